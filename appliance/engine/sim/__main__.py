"""`python -m appliance.engine.sim` == `pdctl sim-engine`."""

from appliance.engine.sim.cli import main

if __name__ == "__main__":
    main()
