"""`python -m appliance` is `pdctl`."""

from appliance.cli.main import main

main()
