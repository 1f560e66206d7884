"""Choosing where a request goes, in one pass and this order (as llm-d's disaggregated profile handler does):
keep the routable instances of each role; pick the decode (the routing policy, appliance.proxy.policies);
gather the facts (the prompt's length, counted beforehand by route.length where the body does not settle it;
its cached prefix on that decode; the loads); decide disaggregated or decode-only (policies/conditional.py,
pure, with a reason, never decode-only where the connector's decode cannot serve a prompt alone); pick a
prefill only for a disaggregated request; record the prompt on the instances that compute it; book them,
each on a DP rank it picks. Nothing downstream re-decides."""

from __future__ import annotations

import time
import weakref
from collections.abc import Awaitable, Callable, Collection, Iterable
from dataclasses import dataclass
from typing import NamedTuple, cast

from appliance.connector import Connector, ProxySide
from appliance.connector.base import Alone, Handoff
from appliance.proxy.columns import Queues, SharedBacklog, SharedWindow
from appliance.proxy.instances import BackendState, Booking, InstanceRegistry
from appliance.proxy.policies import Policy, RequestFacts
from appliance.proxy.policies.conditional import (
    PrefillBacklog,
    PrefillWindow,
    RouteFacts,
    RouteName,
    Rules,
    decide,
    drained_per_s,
    served_alone,
    window_tokens,
)
from appliance.proxy.prompts import engine_requests, known_length, most_tokens, shortest_length
from appliance.roles import Mode


class Sided(NamedTuple):
    """The connector's proxy side in one mode, with its hand-off and the block size its length rule reads."""

    side: ProxySide
    handoff: Handoff | None
    block_size: int | None  # the engines' KV block size where the hand-off depends on the prompt's length
    alone: Alone  # whether its decode serves a request sent alone


@dataclass(frozen=True, slots=True)
class Counted:
    """The prompt's length as a decode instance counted it (route.length); None: it could not tell."""

    tokens: int | None


class Unroutable(Exception):
    """No routable instance of the roles named (none: a colocated engine): the request cannot be served now.
    Its text names what is missing in the client's words ("prefill and decode", "engine")."""

    def __init__(self, roles: tuple[str, ...]) -> None:
        super().__init__(" and ".join(roles) or "engine")
        self.roles = roles


class Refused(Exception):
    """No route serves the request correctly: its connector must serve it on a decode alone (`reason`: a batch,
    a prompt it cannot hand over) and cannot in this mode (ProxySide.alone); the text says why."""

    def __init__(self, reason: str, why: str) -> None:
        super().__init__(f"this node cannot serve the request: it must go to a decode instance alone ({reason}), "
                         f"and {why}")
        self.reason = reason


@dataclass(slots=True)
class Route:
    """The instances (and DP ranks) one request runs on, booked on them from the moment it was routed until the
    end of its with block: `with router.route(facts) as route: ...`. Without a prefill instance the request is one
    leg on `decode` (a colocated instance, or a decode instance that prefills the prompt itself); `name` and
    `reason` say which route and why (policies/conditional.py); `side`, the connector's proxy side in the mode it
    was decided in, serves it (legs.py)."""

    decode: BackendState
    decode_rank: int | None
    prefill: BackendState | None
    prefill_rank: int | None
    bookings: tuple[Booking, ...]
    name: RouteName
    reason: str
    side: ProxySide

    def header(self) -> str:
        """The x-pdctl-route header's value (docs/bench.md, "Routes")."""
        if self.prefill is not None:
            return f"{self.name}; prefill={self.prefill.name}; decode={self.decode.name}"
        role = "both" if self.name == "colocated" else "decode"
        return f"{self.name}; {role}={self.decode.name}"

    def __enter__(self) -> Route:
        return self

    def __exit__(self, *exc: object) -> None:
        for booking in self.bookings:
            booking.end()


class Router:
    """Routes requests over the routable instances of each role with the policy the `routing` setting names."""

    def __init__(self, registry: InstanceRegistry, policy: Policy, mode: Callable[[], str], connector: Connector,
                 rules: Rules, block_size: int | None = None, vllm_version: str = "",
                 stand_in: Callable[[Iterable[BackendState]], BackendState | None] = lambda instances: None,
                 on_stand_in: Callable[[BackendState], None] = lambda inst: None) -> None:
        self.registry = registry
        # of a role's in-service instances, none in rotation: the one its requests go to (health.HealthChecker's)
        self._stand_in = stand_in
        self.on_stand_in = on_stand_in  # a request routed to an instance out of rotation, each time
        self.policy = policy
        # the policy keeps an estimate fed by where prompts are computed (a call per instance saved otherwise)
        self._records = type(policy).record is not Policy.record
        self.mode = mode
        self.connector = connector
        self.checks_mode = connector.mode_fixed_at_start  # the connector's engines fix their transfer mode at start
        self.disaggregated = connector.disaggregated  # a prefill and a decode instance per request, else colocated
        self.rules = rules
        # the engines' KV block size, for a connector whose hand-off depends on the prompt's length (in any mode;
        # each pass reads its mode's Handoff.lengths)
        self._block_size = block_size
        self.vllm_version = vllm_version  # the engines' release ("": unknown), which some connectors' answers read
        # per transfer mode, the connector's proxy side and what the pass reads of it
        self._sides: dict[str, Sided] = {}
        # per decode instance, the prompts it was sent to prefill itself lately (the decode-busy rule)
        self._windows: weakref.WeakKeyDictionary[BackendState, PrefillWindow | SharedWindow] = \
            weakref.WeakKeyDictionary()
        # per decode instance whose chunked-prefill budget is known, what it was sent to prefill and has not yet
        self._backlogs: weakref.WeakKeyDictionary[BackendState, PrefillBacklog | SharedBacklog] = \
            weakref.WeakKeyDictionary()
        # the windows and backlogs every worker process of a generation shares (columns.py); None: this one's own
        self.queues: Queues | None = None

    def _window(self, decode: BackendState) -> PrefillWindow | SharedWindow | None:
        """The prompts `decode` was sent to prefill itself lately; None while conditional routing is off (no rule
        reads it)."""
        if not self.rules.decode_only_below:
            return None
        window = self._windows.get(decode)
        if window is None:
            offset = self.queues.cell(decode.name) if self.queues is not None else -1
            window = self._windows[decode] = PrefillWindow() if offset < 0 else \
                SharedWindow(cast(Queues, self.queues), offset, self.rules.window_s)
        return window

    def _backlog(self, decode: BackendState) -> PrefillBacklog | SharedBacklog | None:
        """What `decode` was sent to prefill itself and has not computed yet; None while conditional routing is
        off or the decode's chunked-prefill budget is not known (no rule reads it)."""
        if not self.rules.decode_only_below or not self.rules.decode_budget:
            return None
        backlog = self._backlogs.get(decode)
        if backlog is None:
            offset = self.queues.cell(decode.name) if self.queues is not None else -1
            backlog = self._backlogs[decode] = PrefillBacklog() if offset < 0 else \
                SharedBacklog(cast(Queues, self.queues), offset)
        return backlog

    def _count_prefill(self, decode: BackendState, now: float, tokens: int) -> None:
        """Count a prompt of `tokens` uncached tokens that `decode` was sent to prefill itself at `now`."""
        window, backlog = self._window(decode), self._backlog(decode)
        if window is not None:
            window.add(now, tokens)
        if backlog is not None:
            backlog.add(now, tokens, drained_per_s(self.rules, decode.load()))

    def routable(self, inst: BackendState) -> bool:
        """Healthy, not draining or in a planned stop, and running the proxy's transfer mode (where known)."""
        return inst.healthy and self.in_service(inst)

    def in_service(self, inst: BackendState) -> bool:
        """Not draining or in a planned stop, and running the proxy's transfer mode (where known): whatever its
        health says."""
        if inst.draining or inst.stopping:
            return False
        return not (self.checks_mode and inst.transfer_mode is not None and inst.transfer_mode != self.mode())

    def stand_in(self, role: str, avoid: Collection[BackendState] = ()) -> BackendState | None:
        """The instance of `role` (not one of `avoid`) that takes its requests while none is routable
        (health.stand_in), or None."""
        return self._stand_in(i for i in self.registry.by_role[role] if self.in_service(i) and i not in avoid)

    def candidates(self, role: str, mode: str | None = None) -> list[BackendState]:
        """The routable instances of `role`, in the plan's order (`mode`: the proxy's, read once per pass)."""
        # routable()'s rule, inlined: it runs for every instance of every request
        if self.checks_mode:
            mode = mode or self.mode()
            return [i for i in self.registry.by_role[role] if i.healthy and not (i.draining or i.stopping)
                    and (i.transfer_mode is None or i.transfer_mode == mode)]
        return [i for i in self.registry.by_role[role] if i.healthy and not (i.draining or i.stopping)]

    def pick(self, role: str, request: RequestFacts, mode: str | None = None,
             avoid: Collection[BackendState] = ()) -> BackendState | None:
        """The policy's instance of `role` for `request` (not one of `avoid`); its stand-in when none is routable;
        or None."""
        candidates = self.candidates(role, mode)
        if avoid:
            candidates = [i for i in candidates if i not in avoid]
        if not candidates:
            return self.stand_in(role, avoid)
        return self.policy.pick(role, candidates, request)

    def side(self, mode: str | None = None) -> Sided:
        """The connector's proxy side in `mode` (the proxy's mode now), with what the pass reads of it."""
        mode = mode or self.mode()
        sided = self._sides.get(mode)
        if sided is None:
            side = self.connector.side(cast(Mode, mode), self.vllm_version)
            handoff = side.handoff()
            block = self._block_size if handoff is not None and handoff.lengths else None
            sided = self._sides[mode] = Sided(side, handoff, block, side.alone())
        return sided

    def needs_count(self, request: RequestFacts) -> bool:
        """Whether the hand-off depends on the prompt's exact length and neither the body nor its bound settles it:
        route.length then counts it on a decode instance before the pass (Router.routed)."""
        side, _, block, _ = self.side()
        if block is None or known_length(request.path, request.body) is not None:
            return False
        bound = most_tokens(request.path, request.body)
        return bound is None or any(side.length_possible(n, block) for n in range(bound + 1))

    def facts(self, sided: Sided, request: RequestFacts, prefill_legs: int, decode: BackendState,
              recent_tokens: int, backlog_tokens: int = 0, counted: Counted | None = None) -> RouteFacts:
        """What the conditional decision reads of `request` on `decode`: the prompt's length where the body settles
        it (token ids), `counted` says it (route.length; its tokens None: the engine could not tell) or the body
        bounds it (a text prompt); whether the connector's side (`sided`) can hand it over (what the body asks for; its
        length, an unknown count: no, serving without a hand-off works for every length); `prefill_legs`: the least loaded routable prefill's legs;
        `recent_tokens`: what the decode was sent to prefill itself over the last window; `backlog_tokens`: what
        it has not computed yet."""
        path, body = request.path, request.body
        side, handoff, block, _ = sided
        tokens = bound = None
        if self.rules.decode_only_below or block is not None:  # else no rule reads the length
            tokens = known_length(path, body) if counted is None else counted.tokens
            bound = most_tokens(path, body) if tokens is None and counted is None else tokens
        possible = side.body_possible(body)
        if block is not None and possible:
            if tokens is not None:
                possible = side.length_possible(tokens, block)
            elif counted is not None:
                possible = False
            elif bound is not None:
                possible = any(side.length_possible(n, block) for n in range(bound + 1))
        requests = engine_requests(path, body)
        return RouteFacts(
            prompt_tokens=bound,
            cached_tokens=self.policy.expected_cached_tokens(decode, request) if bound is not None else 0,
            batch=handoff is not None and handoff.one_request and requests > 1,
            handoff_possible=possible,
            prefill_legs=prefill_legs,
            decode_legs=decode.load(),
            recent_tokens=recent_tokens,
            engine_requests=requests,
            backlog_tokens=backlog_tokens,
        )

    async def routed(self, request: RequestFacts, count: Callable[[BackendState], Awaitable[int | None]],
                     avoid: Collection[BackendState] = ()) -> Route:
        """Router.route (off `avoid`), the prompt counted first by `count` on a decode instance where the hand-off
        depends on a length the body does not settle (needs_count)."""
        counted = None
        if self.needs_count(request):
            # the least loaded decode counts (any serves the model's tokenizer); not the policy's pick, which
            # would take the request's turn (round robin) before the pass
            decodes = self.candidates("decode")
            counter = min(decodes, key=lambda inst: inst.load()) if decodes else self.stand_in("decode")
            counted = Counted(await count(counter) if counter is not None else None)
        return self.route(request, counted, avoid)

    def route(self, request: RequestFacts, counted: Counted | None = None,
              avoid: Collection[BackendState] = ()) -> Route:
        """The route for `request` (`counted`: its prompt's length, route.length's count), decided in one pass and
        booked on its instances at once (no await in between: a drain that starts afterwards waits for it);
        raises Unroutable when a role it needs has no routable instance and no stand-in, Refused when no route
        serves it correctly. `avoid`: instances it must not go to (a continuation's, legs.Avoided)."""
        if not self.disaggregated:
            inst = self.pick("both", request, avoid=avoid)
            if inst is None:
                raise Unroutable(())
            self._count_stand_ins(inst)
            if self._records:
                self.policy.record("both", inst, request)
            return Route(inst, inst.pick_rank(), None, None, (inst.book(),), "colocated", "colocated",
                         self.side().side)
        mode = self.mode()
        prefills = self.candidates("prefill", mode)
        if avoid:
            prefills = [i for i in prefills if i not in avoid]
        stand_in = None if prefills else self.stand_in("prefill", avoid)
        decode = self.pick("decode", request, mode, avoid)
        if decode is None or not (prefills or stand_in):
            missing = (("prefill", bool(prefills or stand_in)), ("decode", decode is not None))
            raise Unroutable(tuple(role for role, found in missing if not found))
        if len(prefills) == 1:
            prefill_legs = prefills[0].load()
        else:
            prefill_legs = min(i.load() for i in prefills) if prefills else cast(BackendState, stand_in).load()
        sided = self.side(mode)
        queues = self.queues
        if queues is None or not self.rules.decode_only_below:
            name, reason = self._decide(sided, request, prefill_legs, decode, counted)
        else:
            with queues.locked:  # read, decided and counted before another worker reads the decode's queue
                name, reason = self._decide(sided, request, prefill_legs, decode, counted)
        side = sided.side
        if name == "decode-only":
            self._count_stand_ins(decode)
            if self._records:
                self.policy.record("decode", decode, request)
            return Route(decode, decode.pick_rank(), None, None, (decode.book(),), name, reason, side)
        prefill = self.policy.pick("prefill", prefills, request) if prefills else cast(BackendState, stand_in)
        if self._records:
            # the decode keeps the KV it is handed as its own prefix cache
            self.policy.record_route((("prefill", prefill), ("decode", decode)), request)
        # Both instances count the request until it ends: the decode leg starts only after the prefill leg in
        # READ mode, and a drain of the decode instance in between must wait for it rather than let it be
        # stopped under the request (a 502 "cannot connect").
        bookings = (prefill.book(), decode.book())
        if not (prefill.healthy and decode.healthy):
            self._count_stand_ins(prefill, decode)
        return Route(decode, decode.pick_rank(), prefill, prefill.pick_rank(), bookings, name, reason, side)

    def _decide(self, sided: Sided, request: RequestFacts, prefill_legs: int, decode: BackendState,
                counted: Counted | None) -> tuple[RouteName, str]:
        """Disaggregated or decode-only, and why (conditional.decide, then served_alone), on `decode`'s window and
        backlog; a prompt it sends to the decode alone is counted in them. Raises Refused."""
        recent = queued = 0
        now = 0.0
        if self.rules.decode_only_below:  # else no rule reads the decode's window or backlog
            window, backlog, now = self._window(decode), self._backlog(decode), time.monotonic()
            recent = window.recent(now, self.rules.window_s) if window else 0
            queued = backlog.level(now, drained_per_s(self.rules, decode.load())) if backlog else 0
        facts = self.facts(sided, request, prefill_legs, decode, recent, queued, counted)
        name, reason = decide(facts, self.rules)
        if name == "decode-only":
            alone = sided.alone
            if not (alone.served and alone.forced):
                name, reason = served_alone(reason, alone.served, alone.forced)
                if name == "refused":
                    raise Refused(reason, alone.why)
            if name == "decode-only" and sided.block_size is not None:
                tokens = counted.tokens if counted is not None and counted.tokens is not None else \
                    shortest_length(request.path, request.body)
                why = sided.side.alone_length_refused(tokens, sided.block_size)
                if why is not None:
                    raise Refused(reason, why)
        if name == "decode-only" and self.rules.decode_only_below:
            # every prompt the decode prefills counts, whatever the rule that sent it there
            self._count_prefill(decode, now, window_tokens(facts, self.rules))
        return name, reason

    def _count_stand_ins(self, *chosen: BackendState) -> None:
        for inst in chosen:
            if not inst.healthy:
                self.on_stand_in(inst)
