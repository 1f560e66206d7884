"""Round robin: each role's routable instances in turn, whatever their load."""

from __future__ import annotations

from collections.abc import Sequence

from appliance.proxy.instances import BackendState
from appliance.proxy.policies.base import Policy, RequestFacts


class RoundRobin(Policy):
    """The next routable instance of the role, in the plan's order."""

    name = "round_robin"

    def __init__(self) -> None:
        self._turn: dict[str, int] = {}

    def pick(self, role: str, candidates: Sequence[BackendState], request: RequestFacts) -> BackendState:
        """The instance whose turn it is among `candidates`."""
        turn = self._turn.get(role, 0)
        self._turn[role] = turn + 1
        return candidates[turn % len(candidates)]
