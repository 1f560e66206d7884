"""Conditional disaggregation: whether one request of a disaggregated node is prefilled on a prefill instance
(`disaggregated`) or by its decode instance itself (`decode-only`), and why. Pure: the router gathers the facts
(appliance.proxy.routing) and serves the answer; docs/routing.md says what each rule is for.

The rules, first match wins (the first two are not choices: such a prompt sent down the hand-off would hand
nothing over, hand over another prompt's KV or crash the engine):
- `batch`: several engine requests (n > 1, a prompt list) on a connector that hands over one per request.
- `handoff-impossible`: the connector cannot hand this prompt's KV over (its length, where lengths matter).
- `policy`: conditional routing is off (`decode_only_below` 0): every other request takes the prefill hop.
- `short-prompt` / `cached-prefix`: fewer uncached prompt tokens than the threshold (`decode_only_below`):
  prefilling them on the decode costs its running streams less than a step's worth of ITL slack, and the
  request saves the hand-off. `cached-prefix` when the prompt itself is not short and the tokens the routing
  policy expects cached on the decode make the difference.
- `prefill-saturated`: the prefill instance runs `prefill_saturated_at` or more prefill legs (a new one would
  wait behind them past the TTFT target) and the decode runs fewer legs than that prefill does.
- `decode-idle`: the decode runs no leg at all and the prefill is busy: the prompt starts at once on an
  engine whose compute nobody else is using, and no running stream is slowed by it.
- otherwise `policy`: the prefill hop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

RouteName = Literal["disaggregated", "decode-only", "colocated"]
REASONS = ("policy", "short-prompt", "cached-prefix", "prefill-saturated", "decode-idle", "handoff-impossible",
           "batch", "colocated")


@dataclass(frozen=True, slots=True)
class Rules:
    """The proxy's conditional-routing settings (ProxyConfig's decode_only_below and prefill_saturated_at):
    decode_only_below 0 turns conditional routing off, prefill_saturated_at 0 its saturation rule."""

    decode_only_below: int
    prefill_saturated_at: int


@dataclass(frozen=True, slots=True)
class RouteFacts:
    """What the decision reads of one request and of the two instances the policy picked for it."""

    prompt_tokens: int | None  # exact (token ids) or an upper bound (a text prompt); None: unknown (chat)
    cached_tokens: int  # of them, what the routing policy expects cached on the decode instance
    batch: bool  # several engine requests on a connector that hands over one per request
    handoff_possible: bool  # False: the connector surely cannot hand this prompt over
    prefill_legs: int  # prefill legs running on the prefill instance
    decode_legs: int  # decode legs running on the decode instance (requests it is decoding or prefilling)


def decide(facts: RouteFacts, rules: Rules) -> tuple[RouteName, str]:
    """(route, reason) for one request of a disaggregated node, by the rules in the module's docstring."""
    if facts.batch:
        return "decode-only", "batch"
    if not facts.handoff_possible:
        return "decode-only", "handoff-impossible"
    if not rules.decode_only_below:
        return "disaggregated", "policy"
    tokens = facts.prompt_tokens
    if tokens is not None:
        if tokens < rules.decode_only_below:
            return "decode-only", "short-prompt"
        if tokens - min(facts.cached_tokens, tokens) < rules.decode_only_below:
            return "decode-only", "cached-prefix"
    saturated = rules.prefill_saturated_at
    if saturated and facts.prefill_legs >= saturated and facts.decode_legs < facts.prefill_legs:
        return "decode-only", "prefill-saturated"
    if facts.decode_legs == 0 and facts.prefill_legs > 0:
        return "decode-only", "decode-idle"
    return "disaggregated", "policy"
