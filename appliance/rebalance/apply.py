"""The shell of a rebalance: carry out a Schedule on the running node through the service manager and the
proxy's admin API, keeping plan.json, the units and the proxy's instance set in agreement after every step.

After each step the node runs a mix of old and new instances; that mix is written as plan.json and
proxy.json, rendered into the units, and sent to the proxy, so a failure at any point leaves a consistent
node. A failed step rolls back to the old plan by the same machinery; if that fails too, the mix stays
(consistent) and `pdctl up` returns the node to the recorded layout.
"""

from __future__ import annotations

import contextlib
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from appliance.errors import PdctlError
from appliance.manager import ACTIVE, ServiceManager
from appliance.node import Node, http_answer
from appliance.plan import Instance, Plan
from appliance.ports import holders, port_free, taken
from appliance.progress import Heartbeat, last_log_line
from appliance.proxy.admin_client import AdminClient
from appliance.rebalance.schedule import Schedule, Step, order, schedule
from appliance.render.names import instance_unit


class StepFailed(PdctlError):
    """A step of the rebalance did not complete (an instance did not become healthy, a call failed)."""

    exit_code = 1


class RebalanceFailed(PdctlError):
    """The rebalance stopped; the message says whether it was rolled back."""

    exit_code = 1


@dataclass
class Options:
    """How patient the rebalance is."""

    drain_timeout_s: float = 60.0
    health_timeout_s: float = 600.0
    hold_s: float = 120.0


def backends(plan: Plan) -> list[dict[str, Any]]:
    """The proxy's static backends for `plan`."""
    return [b.model_dump(mode="json") for b in plan.proxy.backends]


def busy_new_ports(old: Plan, new: Plan, sched: Schedule) -> list[str]:
    """Ports new instances need that neither the node's own instances hold nor are free, one line each naming the
    process that holds it (where pdctl may see it)."""
    ours = {p for i in old.instances for ports in i.ports.values() for p in ports}
    busy = [(port, f"{inst.name} {purpose}") for inst in new.instances
            if sched.actions.get(inst.name) in ("start", "restart")
            for purpose, ports in inst.ports.items() for port in ports
            if port not in ours and not port_free("127.0.0.1", port)]
    found = holders([("127.0.0.1", port) for port, _ in busy]) if busy else {}
    return [taken(port, "127.0.0.1", owner, found[("127.0.0.1", port)]) for port, owner in busy]


def kv_in_use(url: str) -> float | None:
    """The engine's vllm:kv_cache_usage_perc (KV a decode may still read from a prefill), None if unknown."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(url + "/metrics", timeout=3) as response:
            text = response.read().decode()
    except (OSError, ValueError):
        return None
    for family in text_string_to_metric_families(text):
        if family.name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
            return sum(s.value for s in family.samples)
    return None


class Rebalancer:
    """Moves the node from `old` to `new` step by step; `say` reports progress to the user."""

    def __init__(self, node: Node, old: Plan, new: Plan, admin: AdminClient, say: Callable[[str], None],
                 options: Options, manager: str | None = None) -> None:
        self.node = node
        self.old = old
        self.new = new
        self.admin = admin
        self.say = say
        self.options = options
        self.manager_choice = manager
        self.running: dict[str, Instance] = {i.name: i for i in old.instances}
        self.held = False

    # state of the node
    def mix(self) -> Plan:
        """The plan the node runs right now: the new plan's settings with the running instances."""
        return self.new.with_instances(order(list(self.running.values())))

    def _manager(self, plan: Plan) -> ServiceManager:
        return self.node.manager(plan, self.manager_choice)

    def _publish(self, before: Plan) -> ServiceManager:
        """plan.json, proxy.json and the units for the current mix; the proxy's instance set follows."""
        now = self.mix()
        self.node.write(now)
        mgr = self._manager(now)
        mgr.apply(before)
        self.admin.set_instances(backends(now))
        return mgr

    def hold(self, on: bool) -> None:
        """Have the proxy hold requests for a role with no routable instance (bounded), or stop holding."""
        if on == self.held:
            return
        expires = self.options.hold_s + self.options.health_timeout_s + self.options.drain_timeout_s + 60
        self.admin.hold(self.options.hold_s if on else 0.0, expires_in_s=expires)
        self.held = on

    # steps
    def stop(self, inst: Instance, gap: str | None) -> None:
        """Drain `inst` in the proxy (bounded), take it out of the proxy's set, stop it, remove its unit."""
        if gap:
            self.hold(True)
        self.say(f"draining {inst.name} (in-flight requests finish; at most {self.options.drain_timeout_s:g}s)")
        started = time.monotonic()
        try:
            answer = self.admin.drain(inst.name, self.options.drain_timeout_s)
            if not answer.get("drained", True):
                self.say(f"  {inst.name}: {answer.get('in_flight')} request(s) still running after the drain timeout")
        except PdctlError as exc:
            if "answered 404" not in str(exc):  # an instance the proxy never knew has nothing to drain
                raise
        if inst.role == "prefill":
            # A decode may still be reading this prefill's KV after the prefill leg ended.
            deadline = started + self.options.drain_timeout_s
            while (kv_in_use(inst.url) or 0) > 0 and time.monotonic() < deadline:
                time.sleep(0.1)
        before = self.mix()
        self.running.pop(inst.name)
        self.admin.set_instances(backends(self.mix()))
        self._manager(before).stop([instance_unit(inst)])
        self._publish(before)
        self.say(f"stopped {inst.name}")

    def start(self, insts: list[Instance], parked: bool = False) -> None:
        """Render and start `insts`, wait until each is healthy and routable in the proxy.

        `parked`: the proxy knows them but sends them nothing (drained) until `admit`; for engines that run
        a transfer mode the proxy does not run yet, which it cannot tell until their first registration.
        """
        before = self.mix()
        for inst in insts:
            self.running[inst.name] = inst
        mgr = self._publish(before)
        if parked:
            for inst in insts:  # before the engine starts, so no request can reach it first
                self.admin.drain(inst.name, 0)
        units = [instance_unit(i) for i in insts]
        restarts = {u: s.restarts for u, s in mgr.status().items()}
        mgr.start(units)
        self.say(f"starting {', '.join(i.name for i in insts)} "
                 f"({'; '.join(f'{i.name} GPUs {_gpus(i)}' for i in insts)})")
        self._wait_healthy(mgr, insts, restarts, parked)
        self.say(f"{'started (parked)' if parked else 'admitted'} {', '.join(i.name for i in insts)}")

    def admit(self, insts: list[Instance]) -> None:
        """Let parked instances take requests."""
        for inst in insts:
            self.admin.undrain(inst.name)

    def _wait_healthy(self, mgr: ServiceManager, insts: list[Instance], restarts: dict[str, int],
                      parked: bool) -> None:
        started = time.monotonic()
        deadline = started + self.options.health_timeout_s
        pending = {i.name: i for i in insts}
        beat = Heartbeat(self.say)  # on a pipe a mode switch said nothing for 31-74 s (issue 37)
        begun = started
        while pending:
            beat.beat(lambda: self._waiting(mgr, list(pending.values()), time.monotonic() - begun))
            states = mgr.status()
            for inst in list(pending.values()):
                st = states[instance_unit(inst)]
                # failed, exiting again and again at start, or (after a moment to take the start) not running
                stuck = st.state not in ACTIVE and time.monotonic() > started + 5
                if st.state == "failed" or st.restarts - restarts.get(st.name, 0) >= 2 or stuck:
                    tail = mgr.logs([instance_unit(inst)], 8).rstrip() or "(no log lines)"
                    raise StepFailed(f"{inst.name} did not start ({st.detail or st.state}); its last log lines:\n{tail}")
            view = self.admin.state()
            proxy = {i["name"]: i for i in view.get("instances", [])}
            mode = view.get("mode")
            for name, inst in list(pending.items()):
                seen = proxy.get(name, {})
                routable = seen.get("healthy") and (parked or (
                    not seen.get("draining") and seen.get("transfer_mode") in (None, mode)))
                # Started means the manager says so too (supervisord's startsecs): an engine that answers
                # /health at once is still "starting" there, and would be reported so right after the step.
                started = states[instance_unit(inst)].state == "running"
                if routable and started and http_answer(inst.url + "/health") == 200:
                    pending.pop(name)
            if not pending:
                return
            if time.monotonic() > deadline:
                names = ", ".join(pending)
                raise StepFailed(f"{names} not healthy after {self.options.health_timeout_s:g}s")
            time.sleep(0.3)

    @staticmethod
    def _waiting(mgr: ServiceManager, insts: list[Instance], elapsed: float) -> str:
        """What a step still waits for, and what the first of them last logged (rich markup escaped)."""
        from rich.markup import escape

        said = last_log_line(mgr, instance_unit(insts[0]))
        return (f"  still waiting for {', '.join(i.name for i in insts)} to be healthy ({elapsed:.0f}s)"
                + (f"; {insts[0].name} last logged: {escape(said)}" if said else ""))

    def run_steps(self, steps: list[Step], target: Plan) -> None:
        """Carry out `steps` towards `target`."""
        wanted = {i.name: i for i in target.instances}
        gaps_left = sum(1 for s in steps if s.gap)
        for step in steps:
            if step.kind == "stop":
                gaps_left -= bool(step.gap)
                self.stop(self.running[step.names[0]], step.gap)
            else:
                self.start([wanted[n] for n in step.names])
                if self.held and not gaps_left:
                    self.hold(False)

    def run(self, steps: list[Step], body: Callable[[], None] | None = None,
            restore: Callable[[], object] | None = None) -> None:
        """Carry out the schedule (or `body`); on failure `restore`, then roll back to the old plan."""
        try:
            if body is not None:
                body()
            else:
                self.run_steps(steps, self.new)
            self._finish(self.new)
        except (Exception, KeyboardInterrupt) as exc:
            reason = exc.message if isinstance(exc, PdctlError) else (str(exc) or type(exc).__name__)
            self.say(f"[red]step failed:[/red] {reason}")
            self.say("rolling back to the previous plan")
            try:
                if restore is not None:
                    restore()
                self.rollback()
            except (Exception, KeyboardInterrupt) as second:
                why = second.message if isinstance(second, PdctlError) else str(second) or type(second).__name__
                names = ", ".join(self.running)
                raise RebalanceFailed(
                    f"rebalance failed ({reason.splitlines()[0]}) and so did the rollback ({why.splitlines()[0]}); "
                    f"the node runs {names}, and plan.json, the units and the proxy agree on that",
                    fix="run `pdctl up` to return to the previous layout",
                ) from None
            raise RebalanceFailed(f"rebalance failed and was rolled back; the node runs the previous plan. "
                                  f"Cause: {reason}") from None
        finally:
            with contextlib.suppress(PdctlError):
                self.hold(False)

    def rollback(self) -> None:
        """From the current mix back to the old plan (gaps allowed: restoring service comes first)."""
        unhealthy = frozenset(n for n, i in self.running.items() if http_answer(i.url + "/health") != 200)
        back = schedule(list(self.running.values()), self.old.instances, unhealthy)
        self.run_steps(back.steps, self.old)
        self._finish(self.old)

    def _finish(self, target: Plan) -> None:
        before = self.mix()
        self.node.write(target)
        self._manager(target).apply(before)
        self.admin.set_instances(backends(target))
        self.running = {i.name: i for i in target.instances}


def _gpus(inst: Instance) -> str:
    return ",".join(map(str, inst.gpus)) or "cpu"
