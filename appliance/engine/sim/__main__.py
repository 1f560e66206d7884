"""`python -m appliance.engine.sim` == `pdctl sim-engine`."""

from appliance.cli.sim import main

if __name__ == "__main__":
    main()
