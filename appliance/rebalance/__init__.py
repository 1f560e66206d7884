"""Re-carving a running node: a new GPU split or instance shapes, applied with the least disruption.

layout.py   the layout file that keeps what the user asked for (shapes are parsed in appliance.shapes)
schedule.py pure: old plan + new plan -> ordered steps (start / drain+stop), with the gaps a real node forces
apply.py    the shell: drives the service manager and the proxy's admin API through the steps, rolls back
"""
