"""Re-carving a running node: a new GPU split or instance shapes, applied with the least disruption.

schedule.py    pure: old plan + new plan -> ordered steps (start / drain+stop), with the gaps a real node forces
apply.py       the shell: drives the service manager and the proxy's admin API through the steps, rolls back
mode_switch.py restarting engines in place around a switch of the proxy (rolling, or at once under a hold)
The layout file a rebalance leaves (layout.json) is the deployed node's: appliance.node.
"""
