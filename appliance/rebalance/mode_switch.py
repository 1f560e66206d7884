"""Restarting a running node's engines in place around one switch of the proxy (`pdctl mode` on a connector
that fixes the transfer mode at engine start, MORI-IO), through a Rebalancer so a failure rolls back.

rolling   every role has two instances or more: all but the last of each role restart first, parked (known to
          the proxy, sent nothing, since their mode is not the proxy's yet); the switch and their admission
          happen under a hold; then the last of each role restarts. Every role keeps a serving instance.
at once   some role has a single instance: the proxy holds new requests and switches, then every changed
          engine restarts (drained first); requests wait in the hold, none fail while the restart takes less.
"""

from __future__ import annotations

from appliance.plan import Instance, Plan
from appliance.rebalance.apply import Rebalancer


def can_roll(plan: Plan) -> bool:
    """True when every role of the plan has two instances or more (one can restart while another serves)."""
    roles = {i.role for i in plan.instances}
    return all(len(plan.role_instances(r)) >= 2 for r in roles)


def _roll(runner: Rebalancer, new_mode: str) -> None:
    old, wanted = runner.old, {i.name: i for i in runner.new.instances}
    roles = sorted({i.role for i in old.instances})
    first = [i for r in roles for i in old.role_instances(r)[:-1]]
    last = [i for r in roles for i in old.role_instances(r)[-1:]]
    for inst in first:
        runner.stop(inst, None)
        runner.start([wanted[inst.name]], parked=True)
    # The switch and the admission are two calls: a request arriving between them waits in the hold.
    runner.hold(True)
    runner.admin.set_mode(new_mode)
    runner.admit([wanted[i.name] for i in first])
    runner.hold(False)
    runner.say(f"proxy switched to {new_mode}")
    for inst in last:
        runner.stop(inst, None)
        runner.start([wanted[inst.name]])


def _at_once(runner: Rebalancer, new_mode: str, changed: list[Instance]) -> None:
    wanted = {i.name: i for i in runner.new.instances}
    runner.hold(True)
    runner.admin.set_mode(new_mode)
    runner.say(f"proxy switched to {new_mode}; holding new requests")
    for inst in changed:
        runner.stop(inst, inst.role)
    runner.start([wanted[i.name] for i in changed])


def switch_mode(runner: Rebalancer, new_mode: str, changed: list[Instance]) -> None:
    """Switch the proxy to `new_mode` and restart `changed` (runner.old's instances) into runner.new's
    definitions: rolling when every role can roll, else at once under a hold. A failure switches the proxy
    back to the old mode and rolls the engines back (RebalanceFailed)."""
    old_mode = runner.old.mode
    if can_roll(runner.old):
        runner.run([], body=lambda: _roll(runner, new_mode), restore=lambda: runner.admin.set_mode(old_mode))
    else:
        runner.run([], body=lambda: _at_once(runner, new_mode, changed),
                   restore=lambda: runner.admin.set_mode(old_mode))
