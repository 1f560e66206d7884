"""`python -m appliance` is `pdctl`."""

import sys

from appliance.cli.main import main

sys.exit(main())
