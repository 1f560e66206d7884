"""Pure: the steps that turn the running plan into the new one with the least disruption.

An instance whose definition (GPUs, ports, arguments, environment) is unchanged keeps running. Every other
old instance is stopped (drained first) and every other new one started. A new instance may start only when
no running instance holds one of its GPUs or ports (a real node cannot share them), so the scheduler:
  1. starts every new instance whose GPUs and ports are free (make before break), waits for its health;
  2. else stops the old instance that unblocks the most pending starts, preferring one whose role keeps
     another serving instance; removals that block nothing go last.
When every stop left would leave its role without a serving instance, that stop is a gap: it needs
--allow-downtime, and the proxy holds that role's new requests (bounded) until the replacement is healthy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from appliance.plan import Instance, Plan

Action = Literal["keep", "restart", "start", "stop"]
_ROLE_ORDER = {"prefill": 0, "decode": 1, "both": 2}


@dataclass(frozen=True)
class Step:
    """Start some new instances together, or drain and stop one old instance."""

    kind: Literal["start", "stop"]
    names: tuple[str, ...]
    gap: str | None = None  # the role left without a serving instance by this stop

    def describe(self) -> str:
        """One line for people."""
        what = ", ".join(self.names)
        if self.kind == "start":
            return f"start {what}, wait for health, admit in the proxy"
        text = f"drain {what} in the proxy, stop it"
        return text + (f"  [no {self.gap} instance serves until the next start: requests wait in the proxy]"
                       if self.gap else "")


@dataclass
class Schedule:
    """What happens to each instance and in which order."""

    actions: dict[str, Action]
    steps: list[Step] = field(default_factory=list)

    @property
    def gaps(self) -> list[str]:
        """Roles that some step leaves without a serving instance."""
        return [s.gap for s in self.steps if s.gap]

    @property
    def noop(self) -> bool:
        """True when nothing restarts."""
        return not self.steps


def same(a: Instance, b: Instance) -> bool:
    """Identical definitions: the running process can stay."""
    return a.model_dump() == b.model_dump()


def _resources(inst: Instance) -> set[tuple[str, int]]:
    return {("gpu", g) for g in inst.gpus} | {("port", p) for ports in inst.ports.values() for p in ports}


def order(instances: list[Instance]) -> list[Instance]:
    """Plan order: prefill, decode, both; by index."""
    return sorted(instances, key=lambda i: (_ROLE_ORDER[i.role], i.index))


def actions(old: Plan, new: Plan) -> dict[str, Action]:
    """Per instance name: keep, restart (same name, new definition), start (new) or stop (gone)."""
    before = {i.name: i for i in old.instances}
    after = {i.name: i for i in new.instances}
    out: dict[str, Action] = {}
    for name in [i.name for i in order([*old.instances, *[i for i in new.instances if i.name not in before]])]:
        if name not in after:
            out[name] = "stop"
        elif name not in before:
            out[name] = "start"
        else:
            out[name] = "keep" if same(before[name], after[name]) else "restart"
    return out


def schedule(old: list[Instance], new: list[Instance], unhealthy: frozenset[str] = frozenset()) -> Schedule:
    """Steps from the running instances `old` to `new`; `unhealthy` old ones serve nobody and may stop any time."""
    before = {i.name: i for i in old}
    after = {i.name: i for i in new}
    acts: dict[str, Action] = {}
    for inst in order(old + [i for i in new if i.name not in before]):
        n = inst.name
        acts[n] = ("stop" if n not in after else "start" if n not in before
                   else "keep" if same(before[n], after[n]) else "restart")
    running: dict[str, Instance] = dict(before)
    serving = {n for n in before if n not in unhealthy}
    to_stop = [n for n in before if acts[n] in ("stop", "restart")]
    to_start = [after[n] for n in after if acts[n] in ("start", "restart")]
    steps: list[Step] = []

    def held(inst: Instance, without: str | None = None) -> bool:
        mine = _resources(inst)
        return any(mine & _resources(r) for n, r in running.items() if n != without and n in to_stop_set)

    to_stop_set = set(to_stop)
    # Stop failed instances first: they serve nobody, and their GPUs may be what a start needs.
    for n in [n for n in to_stop if n in unhealthy]:
        steps.append(Step("stop", (n,)))
        running.pop(n)
        to_stop.remove(n)
        to_stop_set.discard(n)
    while to_start or to_stop:
        startable = [i for i in to_start if not held(i)]
        if startable:
            steps.append(Step("start", tuple(i.name for i in order(startable))))
            for inst in startable:
                running[inst.name] = inst
                serving.add(inst.name)
                to_start.remove(inst)
            continue

        def unblocks(n: str) -> int:
            return sum(1 for i in to_start if held(i) and not held(i, without=n))

        def role_kept(n: str) -> bool:
            role = running[n].role
            return any(m != n and m in serving and running[m].role == role for m in running)

        # blocking stops first (most unblocked), then ones that keep their role served, then plan order
        candidates = sorted(to_stop, key=lambda n: (-unblocks(n), not role_kept(n), to_stop.index(n)))
        safe = [n for n in candidates if role_kept(n) and (unblocks(n) or not to_start)]
        pick = safe[0] if safe else candidates[0]
        gap = None if role_kept(pick) or pick not in serving else running[pick].role
        steps.append(Step("stop", (pick,), gap))
        running.pop(pick)
        serving.discard(pick)
        to_stop.remove(pick)
        to_stop_set.discard(pick)
    return Schedule(acts, steps)
