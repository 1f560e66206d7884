"""`pdctl plan --suggest`: rank prefill:decode splits for a workload with a small analytic model.

Profile (per GPU): prefill costs prefill_us_per_token microseconds per prompt token on one GPU; a decode
step costs decode_step_ms + decode_step_ms_per_seq x batch. TP t divides both by t x 0.9^log2(t) (TP is
never free). Sources: a `pdctl bench` result measured on this node (--profile FILE: TTFT per prompt token
and ITL at its lowest rate, for the node's shape when it ran), else the simulated engine's time model.
For a split, prefill is an M/M/1-like queue per instance (TTFT = service / (1 - utilisation)) and decode a
batch whose size follows Little's law (batch = rate x output_len x step time / instances); the predicted
goodput is the highest rate at which both the TTFT and the ITL SLO hold.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.errors import PdctlError
from appliance.heads import Heads
from appliance.inventory.models import Inventory
from appliance.plan import _usable, plan
from appliance.settings import Settings

TP_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True)
class Profile:
    """Per-GPU costs the model uses, and where they came from."""

    prefill_us_per_token: float
    decode_step_ms: float
    decode_step_ms_per_seq: float
    max_num_seqs: int
    source: str


@dataclass(frozen=True)
class Shape:
    """Instances x TP of one role."""

    instances: int
    tp: int

    @property
    def gpus(self) -> int:
        return self.instances * self.tp

    def __str__(self) -> str:
        return f"{self.instances}xTP{self.tp}"


@dataclass(frozen=True)
class Prediction:
    """One split's predicted behaviour at the asked rate, and its goodput."""

    prefill: Shape
    decode: Shape
    goodput_rps: float
    ttft_ms: float | None
    itl_ms: float | None
    meets_slo: bool
    bottleneck: str


def _eff(tp: int) -> float:
    return tp * 0.9 ** math.log2(tp)


def sim_profile(settings: Settings) -> Profile:
    """The simulated engine's time model as a profile."""
    sim = settings.engine.sim
    return Profile(sim.prefill_us_per_token, sim.decode_step_ms, sim.decode_step_ms_per_seq,
                   settings.decode.max_num_seqs or 256, "the simulated engine's time model (settings engine.sim)")


def bench_profile(path: Path, prefill_tp: int, decode_tp: int, fallback: Profile) -> Profile:
    """Costs measured by `pdctl bench` (lowest rate of its first shape), per GPU for the TPs it ran with."""
    from appliance.bench.results import read_result

    result = read_result(path)
    rates = [r for s in result.shapes for r in s.rates if r.requests]
    if not rates:
        raise PdctlError(f"{path} holds no measured requests", fix="run `pdctl bench` first, or drop --profile")
    low = min(rates, key=lambda r: r.rate)
    ok = [q for q in low.requests if q.error is None and q.chunk_times_s and q.prompt_tokens]
    if not ok:
        raise PdctlError(f"{path}: no successful request with timings at rate {low.rate}")
    ttft_per_token = statistics.median((q.chunk_times_s[0] - q.sent_s) / q.prompt_tokens for q in ok)  # type: ignore[operator]
    gaps = [b - a for q in ok for a, b in zip(q.chunk_times_s, q.chunk_times_s[1:], strict=False)]
    itl_ms = statistics.median(gaps) * 1000 if gaps else fallback.decode_step_ms
    # At the lowest rate the batch is small: the step is mostly its base cost.
    return Profile(ttft_per_token * 1e6 * _eff(prefill_tp), itl_ms * _eff(decode_tp),
                   fallback.decode_step_ms_per_seq, fallback.max_num_seqs, f"pdctl bench result {path}")


def _predict(p: Profile, pre: Shape, dec: Shape, rate: float, input_len: int, output_len: int,
             ttft_slo_ms: float, itl_slo_ms: float) -> tuple[float | None, float | None]:
    """(TTFT ms, ITL ms) at `rate`, or None where the role is saturated."""
    service_s = input_len * p.prefill_us_per_token / _eff(pre.tp) / 1e6
    util = rate / pre.instances * service_s
    ttft = service_s / (1 - util) * 1000 if util < 1 else None
    base = p.decode_step_ms / _eff(dec.tp)
    per_seq = p.decode_step_ms_per_seq / _eff(dec.tp)
    k = rate * output_len / dec.instances / 1000  # sequences per ms of step time
    itl = base / (1 - per_seq * k) if per_seq * k < 1 else None
    if itl is not None and k * itl > p.max_num_seqs:
        itl = None  # the batch would exceed max_num_seqs: requests queue without bound
    return ttft, itl


def predict(p: Profile, pre: Shape, dec: Shape, rate: float, input_len: int, output_len: int,
            ttft_slo_ms: float, itl_slo_ms: float) -> Prediction:
    """A split's latencies at `rate` and the highest rate that meets both SLOs (bisection)."""
    def ok(r: float) -> bool:
        ttft, itl = _predict(p, pre, dec, r, input_len, output_len, ttft_slo_ms, itl_slo_ms)
        return ttft is not None and itl is not None and ttft <= ttft_slo_ms and itl <= itl_slo_ms

    lo, hi = 0.0, 1.0
    if ok(1e-9):
        while ok(hi) and hi < 1e6:
            lo, hi = hi, hi * 2
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    ttft, itl = _predict(p, pre, dec, rate, input_len, output_len, ttft_slo_ms, itl_slo_ms)
    ttft_bad = ttft is None or ttft > ttft_slo_ms
    itl_bad = itl is None or itl > itl_slo_ms
    bottleneck = "prefill (TTFT)" if ttft_bad and not itl_bad else "decode (ITL)" if itl_bad and not ttft_bad \
        else "both" if ttft_bad else "-"
    return Prediction(pre, dec, lo, ttft, itl, not (ttft_bad or itl_bad), bottleneck)


def _shapes(gpus: int, heads: Heads | None) -> list[Shape]:
    return [Shape(gpus // tp, tp) for tp in TP_SIZES
            if tp <= gpus and gpus % tp == 0 and (heads is None or heads.tp_problem(tp) is None)]


def candidates(settings: Settings, inventory: Inventory, heads: Heads | None = None) -> list[tuple[Shape, Shape]]:
    """Every P:D GPU count and TP shape on the usable GPUs that the planner accepts (and, given the model's
    `heads`, that vLLM can start)."""
    usable = sum(1 for g in inventory.gpus if _usable(g))
    out = []
    for p_gpus in range(1, usable):
        for pre in _shapes(p_gpus, heads):
            for dec in _shapes(usable - p_gpus, heads):
                overrides: dict[str, Any] = {
                    role: {"gpu_count": None, "gpus": None, "instances": s.instances, "tp": s.tp, "dp": 1}
                    for role, s in (("prefill", pre), ("decode", dec))}
                data = settings.model_dump()
                for role, values in overrides.items():
                    data[role].update(values)
                try:
                    plan(Settings.model_validate(data), inventory)
                except (PdctlError, ValueError):
                    continue
                out.append((pre, dec))
    return out


def suggest(settings: Settings, inventory: Inventory, profile: Profile, input_len: int, output_len: int,
            rate: float, heads: Heads | None = None) -> list[Prediction]:
    """Candidate splits ranked: meeting the SLOs at `rate` first, then by predicted goodput, fewer instances.

    `heads`: the model's head counts when known; shapes whose TP the model cannot take are left out."""
    if not inventory.gpus:
        raise PdctlError("this node has no GPUs to split", fix="plan for a GPU node with --inventory sim:mi300x-8")
    slo = settings.slo
    preds = [predict(profile, pre, dec, rate, input_len, output_len, slo.ttft_ms, slo.itl_ms)
             for pre, dec in candidates(settings, inventory, heads)]
    if not preds:
        why = f" for a model with {heads.attention} attention heads" if heads else ""
        raise PdctlError(f"the planner accepts no prefill/decode split on this inventory{why}")
    return sorted(preds, key=lambda x: (not x.meets_slo, -round(x.goodput_rps, 6),
                                        x.prefill.instances + x.decode.instances))
