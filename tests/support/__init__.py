"""What every test area shares: real processes (processes.py), waiting for a condition (waiting.py), and
running pdctl against a node's settings file (pdctl.py)."""
