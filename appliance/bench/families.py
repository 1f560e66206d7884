"""Shape names of `pdctl bench --compare`, and the best shape of each family (disaggregated, colocated).

A name says what runs, so results from separate runs (`--label`) merge and compare:
- `disagg-read`, `disagg-write`: the disaggregated family, by KV transfer mode; `disagg-read-conditional`,
  `disagg-write-conditional`: the same split with conditional routing on (docs/routing.md); `-mbtB` after
  either: the decode instances' chunked-prefill budget `max_num_batched_tokens = B` (vLLM's default without).
- `colocated-N`: the colocated family, N identical instances over the same GPUs (TP = GPUs / N), vLLM's
  default chunked-prefill budget; `colocated-N-mbtB`: the same with `max_num_batched_tokens = B`.
- `colocated` (in `--shapes` only): every instance count the GPUs allow x every `--budgets` value.

"A comparison against an untuned baseline is not a result": the report names the best shape of each
family under each judgement, so the colocated knob that won is on the page next to the goodput ratio.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from appliance.bench.analysis import JUDGEMENTS, Judgement
from appliance.bench.results import BenchResult, FamilyBest, ShapeResult
from appliance.errors import PdctlError

Family = Literal["disaggregated", "colocated"]
DEFAULT_BUDGETS = "256,512,2048"
_COLOCATED = re.compile(r"colocated-(\d+)(?:-mbt(\d+))?")
_DISAGGREGATED = re.compile(r"disagg-(read|write)(-conditional)?(?:-mbt(\d+))?")


@dataclass(frozen=True)
class ShapeName:
    """What a shape name says."""

    name: str
    family: Family
    mode: str | None = None  # disaggregated: read | write
    instances: int | None = None  # colocated
    budget: int | None = None  # max_num_batched_tokens (colocated; disaggregated: the decode's); None: vLLM's
    conditional: bool = False  # disaggregated: the proxy decides per request whether the prefill hop is taken

    @property
    def knob(self) -> str:
        """The family's tuning knobs in words (what the report says won)."""
        if self.family == "disaggregated":
            budget = f", decode max_num_batched_tokens {self.budget}" if self.budget else ""
            return f"{self.mode.upper() if self.mode else '?'}" + (", conditional" if self.conditional else "") + budget
        budget = f"max_num_batched_tokens {self.budget}" if self.budget else "vLLM's default budget"
        return f"{budget}, {self.instances} inst."


def parse_name(name: str) -> ShapeName | None:
    """The shape a name stands for; None for names outside the two families (e.g. a --url label)."""
    m = _DISAGGREGATED.fullmatch(name)
    if m and (m.group(3) is None or int(m.group(3)) > 0):
        return ShapeName(name, "disaggregated", mode=m.group(1), conditional=m.group(2) is not None,
                         budget=int(m.group(3)) if m.group(3) else None)
    m = _COLOCATED.fullmatch(name)
    if m and int(m.group(1)) > 0 and (m.group(2) is None or int(m.group(2)) > 0):
        return ShapeName(
            name, "colocated", instances=int(m.group(1)), budget=int(m.group(2)) if m.group(2) else None
        )
    return None


def colocated_name(instances: int, budget: int | None) -> str:
    """The name of a colocated shape."""
    return f"colocated-{instances}" + (f"-mbt{budget}" if budget else "")


def parse_budgets(text: str) -> list[int | None]:
    """'256,512,2048' (and 'default' for vLLM's own) -> budgets, in order, without repeats."""
    out: list[int | None] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if part == "default":
            value = None
        elif part.isdigit() and int(part) > 0:
            value = int(part)
        else:
            raise PdctlError(
                f"--budgets: '{part}' is not a token count", fix="e.g. --budgets 256,512,2048,default"
            )
        if value not in out:
            out.append(value)
    if not out:
        raise PdctlError("--budgets names no budget", fix="e.g. --budgets 256,512,2048")
    return out


def expand(wanted: Sequence[str], counts: Sequence[int], budgets: Sequence[int | None]) -> list[str]:
    """Shape names in order, `colocated` replaced by every count x budget; unknown names are an error."""
    out: list[str] = []
    for name in wanted:
        names = [colocated_name(n, b) for n in counts for b in budgets] if name == "colocated" else [name]
        for item in names:
            if parse_name(item) is None:
                raise PdctlError(
                    f"unknown shape '{item}'",
                    fix="use disagg-read, disagg-write (-conditional, -mbtB), colocated, colocated-N or colocated-N-mbtB",
                )
            if item not in out:
                out.append(item)
    return out


@dataclass(frozen=True)
class Best:
    """The best shape(s) of one family under one judgement."""

    family: Family
    names: list[str]  # ties share the top goodput
    goodput: float | None  # None: every shape of the family missed at its lowest rate
    lower_bound: bool  # the goodput is the shape's top measured rate: the ceiling is higher


def capped(shape: ShapeResult, judgement: Judgement) -> bool:
    """True when the shape passed at its highest measured rate (its goodput is only a lower bound)."""
    good = shape.goodput.get(judgement)
    return good is not None and good >= max(r.rate for r in shape.rates if not r.partial)


def best_of(shapes: Iterable[ShapeResult], judgement: Judgement) -> list[Best]:
    """Per family that has measured shapes: its highest goodput under `judgement` and who reached it."""
    out: list[Best] = []
    measured = [s for s in shapes if not s.skipped and any(not r.partial for r in s.rates)]
    for family in ("disaggregated", "colocated"):
        members = [s for s in measured if (p := parse_name(s.name)) is not None and p.family == family]
        if not members:
            continue
        top = max((s.goodput.get(judgement) or 0.0) for s in members)
        winners = [s for s in members if (s.goodput.get(judgement) or 0.0) == top]
        good = winners[0].goodput.get(judgement)
        out.append(Best(family, [s.name for s in winners], good, any(capped(s, judgement) for s in winners)))
    return out


def best_record(result: BenchResult) -> dict[str, dict[str, FamilyBest]]:
    """`best_of` under every judgement, as stored in bench.json (`best`)."""
    return {
        j: {
            b.family: FamilyBest(
                names=b.names,
                knobs=[p.knob for n in b.names if (p := parse_name(n)) is not None],
                goodput=b.goodput,
                lower_bound=b.lower_bound,
            )
            for b in best_of(result.shapes, j)
        }
        for j in JUDGEMENTS
    }
