"""Conditional disaggregation: whether one request of a disaggregated node is prefilled on a prefill instance
(`disaggregated`) or by its decode instance itself (`decode-only`), and why. Pure: the router gathers the facts
(appliance.proxy.route) and serves the answer; docs/routing.md says what each rule is for.

The rules, first match wins (the first two are not choices: such a prompt sent down the hand-off would hand
nothing over, hand over another prompt's KV or crash the engine):
- `batch`: several engine requests (n > 1, a prompt list) on a connector that hands over one per request.
- `handoff-impossible`: the connector cannot hand this prompt's KV over (its length, where lengths matter, or
  what the body asks for: ProxySide.length_possible, body_possible).
- `policy`: conditional routing is off (`decode_only_below` 0): every other request takes the prefill hop.
- `short-prompt` / `cached-prefix`: fewer uncached prompt tokens than the threshold (`decode_only_below`):
  prefilling them on the decode costs its running streams less than a step's worth of ITL slack, and the
  request saves the hand-off. `cached-prefix` when the prompt itself is not short and the tokens the routing
  policy expects cached on the decode make the difference. Only while the decode was sent fewer than
  its room (`room`) such tokens in all over the last window (the ITL target, `window_s`), or runs no leg:
  a decode step carries the prompts that came during the step before it, which the target bounds, so no step
  prefills more than one room's worth, however many short prompts arrive (two 200-token prompts in one step
  are a 60 ms gap for every running stream, over a 50 ms target). The room is `decode_only_below` less what
  the decode's running legs add to its step (`room_per_leg` each): a step of 32 running sequences leaves less
  of the target for a prompt than a step of one.
  With the decode's own chunked-prefill budget known (`decode_budget`: its max_num_batched_tokens, as vLLM
  counts it, one token per running sequence included) and a full chunk of it within the room at the decode's
  load (`chunk`), the engine itself bounds what any one step prefills, so short prompts may queue there:
  instead of one room per window, a short prompt goes to the decode while its estimated backlog (what it was
  sent to prefill itself and has not computed yet, `PrefillBacklog`) plus the prompt fits this step's chunk,
  or, while the prefill instance is busy, `queue_steps` chunks (its first token waits that many steps at
  most, against a prefill queue of unknown length).
- `prefill-saturated`: the prefill instance runs `prefill_saturated_at` or more prefill legs (a new one would
  wait behind them past the TTFT target), the decode runs fewer legs than that prefill does, and it has room
  left in its window (runs no leg, or was sent less than its room lately): such a prompt is larger than the
  room (else it was short), so it takes the decode's next step alone, and the window it fills keeps any
  other prompt off that step.
- `decode-idle`: the decode runs no leg at all and the prefill is busy: the prompt starts at once on an
  engine whose compute nobody else is using, and no running stream is slowed by it.
- otherwise the prefill hop: `decode-busy` for a prompt shorter than `decode_only_below` that the room
  (the window, the decode's load) kept off the decode, else `policy`.
- last (`served_alone`), where the connector's decode cannot serve the client's prompt alone in this mode
  (ProxySide.alone: MoRIIO READ), a rule that chose the decode gives way to the prefill hop
  (`alone-unserved`); a forced one (`batch`, `handoff-impossible`) goes alone through the connector's
  alone_body, or, where that cannot serve it either, leaves no correct route: `refused`.

Every prompt a decode is sent to prefill itself counts in its window, whatever the rule (`window_tokens`): the
forced ones (`batch`, `handoff-impossible`) have no other route but still fill the step, and one whose length
the proxy cannot know (a chat request) counts as a whole room.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Literal

RouteName = Literal["disaggregated", "decode-only", "colocated", "refused"]
REASONS = ("policy", "short-prompt", "cached-prefix", "decode-busy", "prefill-saturated", "decode-idle",
           "handoff-impossible", "batch", "colocated", "alone-unserved")
# the rules that leave no other route than the decode alone
FORCED = frozenset({"batch", "handoff-impossible"})


@dataclass(frozen=True, slots=True)
class Rules:
    """The proxy's conditional-routing settings (ProxyConfig's decode_only_below, prefill_saturated_at,
    decode_only_window_ms and decode_step): decode_only_below 0 turns conditional routing off,
    prefill_saturated_at 0 its saturation rule, room_per_leg 0 (no step model) the load's part of the room."""

    decode_only_below: int  # the room of a decode running no other leg (its step: one sequence, the prompt's)
    prefill_saturated_at: int
    window_s: float  # the ITL target: fewer than the room's short-prompt tokens per decode in it
    # prompt tokens of room each leg running on the decode takes: its sequence's part of a step (ms) over the
    # prefill's cost per token, i.e. the step time it adds, spent in prompt tokens
    room_per_leg: float = 0.0
    # the decode's chunked-prefill budget (vLLM max_num_batched_tokens: its running sequences' one token each
    # and the prompt tokens a step computes); 0: not known (the engine's default, far above any room)
    decode_budget: int = 0
    # while the prefill is busy, a short prompt may wait this many of the decode's chunks behind its backlog
    queue_steps: float = 0.0


@dataclass(frozen=True, slots=True)
class RouteFacts:
    """What the decision reads of one request and of the two instances the policy picked for it."""

    prompt_tokens: int | None  # exact (token ids) or an upper bound (a text prompt); None: unknown (chat)
    cached_tokens: int  # of them, what the routing policy expects cached on the decode instance
    batch: bool  # several engine requests on a connector that hands over one per request
    handoff_possible: bool  # False: the connector surely cannot hand this prompt over
    prefill_legs: int  # prefill legs running on the prefill instance
    decode_legs: int  # decode legs running on the decode instance (requests it is decoding or prefilling)
    recent_tokens: int = 0  # uncached prompt tokens the decode was sent to prefill itself within the window
    engine_requests: int = 1  # n x the prompts of a batch: the decode prefills the prompt once for each
    backlog_tokens: int = 0  # uncached prompt tokens sent to the decode that it has not computed yet (estimate)


def uncached(facts: RouteFacts) -> int | None:
    """The prompt tokens the decode would compute if it prefilled this request itself (None: unknown)."""
    tokens = facts.prompt_tokens
    return None if tokens is None else (tokens - min(facts.cached_tokens, tokens)) * facts.engine_requests


def window_tokens(facts: RouteFacts, rules: Rules) -> int:
    """What a request sent to a decode alone counts in that decode's window: the tokens it prefills, or a whole
    room (decode_only_below) when the proxy cannot know them, so that no short prompt joins its step."""
    fresh = uncached(facts)
    return rules.decode_only_below if fresh is None else fresh


def room(rules: Rules, decode_legs: int) -> int:
    """The uncached prompt tokens a decode running `decode_legs` legs may prefill itself per window: what is left
    of the step the 99 % rule allows (decode_only_below's, sized on a step of one sequence) once its running
    sequences' part of the step is paid (below zero: none)."""
    # rounded first: 0.17 ms x 1000 / 100 us is 1.7000000000000002 in floats, and 200 legs' 340 must not be 341
    return rules.decode_only_below - math.ceil(round(rules.room_per_leg * decode_legs, 6))


def chunk(rules: Rules, decode_legs: int) -> int:
    """The prompt tokens one step of a decode running `decode_legs` legs computes at most by its own budget, when
    such a step stays within its room (the engine then bounds every step, however many prompts wait); 0 when the
    budget is not known or a full chunk at this load would take more than the room."""
    if not rules.decode_budget:
        return 0
    per_step = rules.decode_budget - decode_legs
    return per_step if 0 < per_step <= room(rules, decode_legs) else 0


def legs_without_room(rules: Rules) -> int | None:
    """The fewest running legs that leave a decode no room at all (None: its room does not shrink with load)."""
    if rules.room_per_leg <= 0:
        return None
    # room(legs) <= 0 from ceil(per_leg x legs) >= below, i.e. per_leg x legs > below - 1; floats may miss by one
    legs = max(0, math.floor((rules.decode_only_below - 1) / rules.room_per_leg) + 1)
    if legs > 0 and room(rules, legs - 1) <= 0:
        return legs - 1
    return legs if room(rules, legs) <= 0 else legs + 1


def decide(facts: RouteFacts, rules: Rules) -> tuple[RouteName, str]:
    """(route, reason) for one request of a disaggregated node, by the rules in the module's docstring, before
    the connector's answer for the decode alone (served_alone)."""
    if facts.batch:
        return "decode-only", "batch"
    if not facts.handoff_possible:
        return "decode-only", "handoff-impossible"
    if not rules.decode_only_below:
        return "disaggregated", "policy"
    below, fresh = rules.decode_only_below, uncached(facts)
    busy = False
    if fresh is not None and fresh < below:
        step = chunk(rules, facts.decode_legs)
        queued = facts.backlog_tokens + fresh
        if facts.decode_legs == 0:
            fits = True  # no stream to slow, nothing queued
        elif step:  # the engine bounds each step: the backlog, not the window, decides
            fits = queued <= step or (facts.prefill_legs > 0 and queued <= step * rules.queue_steps)
        else:
            fits = facts.recent_tokens + fresh < room(rules, facts.decode_legs)
        if fits:
            short = facts.prompt_tokens is not None and facts.prompt_tokens < below
            return "decode-only", "short-prompt" if short else "cached-prefix"
        busy = True
    saturated = rules.prefill_saturated_at
    if saturated and facts.prefill_legs >= saturated and facts.decode_legs < facts.prefill_legs \
            and (facts.decode_legs == 0 or facts.recent_tokens < room(rules, facts.decode_legs)):
        return "decode-only", "prefill-saturated"
    if facts.decode_legs == 0 and facts.prefill_legs > 0:
        return "decode-only", "decode-idle"
    return "disaggregated", "decode-busy" if busy else "policy"


def served_alone(reason: str, served: bool, forced: bool) -> tuple[RouteName, str]:
    """The route of a request `decide` sent to the decode alone for `reason`, given whether the connector's decode
    serves the client's prompt alone (`served`) and a request that cannot be handed over through its alone_body
    (`forced`; ProxySide.alone): the decode alone where it serves it, else the prefill hop for a choice
    (`alone-unserved`), no route for a forced one (`refused`)."""
    if reason in FORCED:
        return ("decode-only", reason) if forced else ("refused", reason)
    return ("decode-only", reason) if served else ("disaggregated", "alone-unserved")


class PrefillWindow:
    """The uncached prompt tokens one decode instance was sent to prefill itself, over the last window: what
    the `decode-busy` rule sums. The caller passes the time (monotonic seconds); entries older than the window
    are dropped as it is read, so it holds at most a window's worth of decode-only requests."""

    def __init__(self) -> None:
        self._sent: deque[tuple[float, int]] = deque()
        self._total = 0

    def recent(self, now: float, window_s: float) -> int:
        """Tokens sent within `window_s` before `now`."""
        while self._sent and self._sent[0][0] <= now - window_s:
            self._total -= self._sent.popleft()[1]
        return self._total

    def add(self, now: float, tokens: int) -> None:
        """Count a prompt of `tokens` uncached tokens sent to the decode at `now`."""
        if tokens > 0:
            self._sent.append((now, tokens))
            self._total += tokens


class PrefillBacklog:
    """An estimate of the uncached prompt tokens one decode instance was sent to prefill itself and has not
    computed yet: each prompt adds its tokens, and the decode computes them at no less than one chunk of its
    budget per window (a step that carries a chunk stays within the ITL target, the window). The caller passes
    the time (monotonic seconds) and how many tokens a window drains at the decode's load now."""

    def __init__(self) -> None:
        self._level = 0.0
        self._at = 0.0

    def level(self, now: float, drained_per_s: float) -> int:
        """The backlog at `now`, the decode computing `drained_per_s` prompt tokens a second since last read."""
        self._level = max(0.0, self._level - max(0.0, drained_per_s) * max(0.0, now - self._at))
        self._at = max(self._at, now)
        return math.ceil(round(self._level, 6))  # 0.1 s at 1000 a second drains 99.99999999999 in floats

    def add(self, now: float, tokens: int, drained_per_s: float) -> None:
        """Count a prompt of `tokens` uncached tokens sent to the decode at `now`."""
        self.level(now, drained_per_s)
        self._level += max(0, tokens)


def drained_per_s(rules: Rules, decode_legs: int) -> float:
    """The prompt tokens a second a decode running `decode_legs` legs computes at least while it has a backlog:
    a chunk of its budget per window (0: its budget is not known)."""
    if not rules.decode_budget:
        return 0.0
    return max(0, rules.decode_budget - decode_legs) / rules.window_s
