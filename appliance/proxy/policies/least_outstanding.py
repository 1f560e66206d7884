"""Least outstanding: the routable instance of a role with the fewest legs running on it."""

from __future__ import annotations

from collections.abc import Sequence

from appliance.proxy.instances import BackendState
from appliance.proxy.policies.base import Policy, RequestFacts


class LeastOutstanding(Policy):
    """The instance with the fewest legs in flight; ties go round: the search starts one instance further each
    time, instead of always favouring the first."""

    name = "least_outstanding"

    def __init__(self) -> None:
        self._turn: dict[str, int] = {}

    def pick(self, role: str, candidates: Sequence[BackendState], request: RequestFacts) -> BackendState:
        """The least loaded of `candidates`, the first from this turn's start on a tie."""
        turn = self._turn.get(role, 0)
        self._turn[role] = turn + 1
        count = len(candidates)
        best = candidates[turn % count]
        least = best.load()
        for k in range(1, count):
            inst = candidates[(turn + k) % count]
            if (load := inst.load()) < least:
                best, least = inst, load
        return best
