"""What conditional routing a plan gives the proxy, in words: `pdctl plan` and `pdctl plan --suggest` print it
(docs/routing.md, "Conditional disaggregation")."""

from __future__ import annotations

from rich.console import Console

from appliance.plan import SIM_HOST_LATENESS_MS, Plan, step_margin, step_spread
from appliance.proxy.config import DecodeStep
from appliance.proxy.policies.conditional import Rules, chunk, legs_without_room, room
from appliance.settings import Settings

ROOM_AT_LEGS = (1, 8, 16, 32)  # running legs at which a decode's room is printed


def describe_room(below: int, step: DecodeStep | None, window_ms: float) -> str:
    """How much a decode may prefill itself per window under conditional routing, by its running legs."""
    rules = Rules(below, 0, window_ms / 1000, step.room_per_leg() if step else 0.0)
    gone = legs_without_room(rules)
    if gone is None:
        return f"room {below} prompt tokens per {window_ms:g} ms whatever the decode's load (no decode_step)"
    at = ", ".join(f"{room(rules, n)} at {n}" for n in ROOM_AT_LEGS if n < gone)
    return (f"room {below} prompt tokens per {window_ms:g} ms less {rules.room_per_leg:.3g} per running leg: "
            f"{at + ' legs; ' if at else ''}none from {gone} legs")


def describe_budget(below: int, step: DecodeStep | None, window_ms: float, budget: int | None,
                    queue_ms: float | None) -> str | None:
    """At which loads a decode whose chunked-prefill budget is known queues short prompts itself (its full chunk
    fits the room: docs/routing.md), or None without a budget."""
    if not budget:
        return None
    rules = Rules(below, 0, window_ms / 1000, step.room_per_leg() if step else 0.0, budget)
    queueing = [n for n in range(budget) if chunk(rules, n)]
    if not queueing:
        return (f"decode budget {budget} (max_num_batched_tokens): a full chunk never fits the room, so the window "
                "rule applies at every load")
    wait = f" (up to {queue_ms:g} ms while the prefill is busy)" if queue_ms else " (one step's chunk)"
    return (f"decode budget {budget} (max_num_batched_tokens): while it runs {queueing[0]}-{queueing[-1]} legs, "
            f"short prompts queue at the decode{wait}; at other loads one room per window")


def describe_spread(settings: Settings) -> str:
    """The decode step spread the planner sizes decode_only_below on, and where it comes from."""
    spread = step_spread(settings)
    if settings.proxy.decode_step_spread is not None:
        source = "[proxy] decode_step_spread"
    elif settings.engine.kind == "sim":
        source = f"simulated engines: the host's {SIM_HOST_LATENESS_MS:g} ms lateness at the ITL target"
    else:
        source = "real engines' step spread, measured on H200"
    return (f"decode step spread {spread:.3g}, {source}: a step carrying a prompt may take "
            f"{step_margin(spread):.0%} of the {settings.slo.itl_ms:g} ms ITL target")


def render_conditional(p: Plan, settings: Settings, console: Console) -> None:
    """The conditional routing the plan gives the proxy (nothing while it is off)."""
    px = p.proxy
    if not px.decode_only_below or p.layout == "colocated":
        return
    origin = "as set" if settings.proxy.decode_only_below is not None else f"from its {describe_spread(settings)}"
    console.print(f"conditional routing: decode_only_below {px.decode_only_below}, {origin}; "
                  f"{describe_room(px.decode_only_below, px.decode_step, px.decode_only_window_ms)}",
                  markup=False, highlight=False)
    budget = describe_budget(px.decode_only_below, px.decode_step, px.decode_only_window_ms, px.decode_budget,
                             px.decode_only_queue_ms)
    if budget:
        console.print(budget, markup=False, highlight=False)
