"""`pdctl plan --suggest`'s model on the mission's node against the reference deployment's published results.

    .venv/bin/python benchmarks/mission_check.py

The reference (vLLM blog "Next-Level Inference: Why Your Single-Node vLLM Setup Needs Prefill-Decode
Disaggregation", AMD and Embedded LLM, 2026-04-07): 8 x MI300X, Qwen3-235B-A22B-FP8, 2000/1000 tokens, random
prompts, 100 requests per rate from 0.5 to 10 req/s, TTFT < 1 s and ITL < 50 ms; MORI-IO 1P TP4 + 1D TP4 with
--max-num-batched-tokens 4096 --max-num-seqs 64, expert parallel; standard serving 2 x TP4 (round robin) and
1 x TP8 at --max-num-batched-tokens 8192, vLLM's default max_num_seqs. Its Figure 4 / Table 3 figures are
transcribed below (approximate where the text says "about"). The model runs on the MI300X profile (public peaks,
uncalibrated) and the model's config.json (tests/data/qwen3-235b-a22b-fp8), as a run of 100 requests per rate,
every one judged, and in the steady state.
"""

from __future__ import annotations

from pathlib import Path

from appliance.inventory import load_inventory
from appliance.model_config import read_heads, read_model_shape
from appliance.settings import Settings
from appliance.suggest import Candidate, Shape, default_profile, finite_attainment, goodputs

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "tests" / "data" / "qwen3-235b-a22b-fp8"
RATES = (0.5, 1, 2, 3, 4, 5, 5.5, 6, 8, 10)
SPLIT = Candidate("disaggregated", prefill=Shape(1, 4), decode=Shape(1, 4))
STANDARD_2X4 = Candidate("colocated", colocated=Shape(2, 4), budget=8192)
STANDARD_1X8 = Candidate("colocated", colocated=Shape(1, 8), budget=8192)
# (shape, mode) -> {rate: attainment %} as the reference states it; goodput: (passed, failed) at 100 %.
# (shape, mode): ({rate: reference attainment %}, what the reference said)
REFERENCE: dict[tuple[str, str | None], tuple[dict[float, int], str]] = {
    ("1P TP4 + 1D TP4", "write"): ({8: 73}, "100 % up to about 5.5, about 46 % at 10"),
    ("1P TP4 + 1D TP4", "read"): ({8: 70}, "100 % up to about 5, about 44 % at 10"),
    ("standard 2 x TP4", None): ({0.5: 100, 1: 60, 2: 25, 8: 30}, "100 % at 0.5, ~60 % at 1, ~25 % from 2 on"),
    ("standard 1 x TP8", None): ({8: 26}, "ITL violations from low rates on"),
}


def profile(mode: str):  # type: ignore[no-untyped-def]
    """The MI300X profile for the reference's settings in `mode`."""
    settings = Settings.model_validate({
        "engine": {"kind": "vllm"}, "model": {"path": str(MODEL)}, "connector": {"name": "moriio", "mode": mode},
        "prefill": {"max_num_seqs": 64, "max_num_batched_tokens": 4096},
        "decode": {"max_num_seqs": 64, "max_num_batched_tokens": 4096},
        "slo": {"ttft_ms": 1000, "itl_ms": 50}})
    inventory = load_inventory("sim:mi300x-8")
    assert read_heads(MODEL) is not None
    return default_profile(settings, inventory, read_model_shape(MODEL))


def main() -> int:
    """Print each reference shape's attainment per rate (model, 100 requests), and its goodput."""
    for (name, mode), (points, said) in REFERENCE.items():
        cand = SPLIT if mode else STANDARD_2X4 if "2 x TP4" in name else STANDARD_1X8
        prof = profile(mode or "write")
        curve = {r: finite_attainment(prof, cand, r, 2000, 1000, 1000, 50, 100)["p99"] for r in RATES}
        finite = goodputs(prof, cand, 2000, 1000, 1000, 50, 0.9, 100)["p99"]
        full = goodputs(prof, cand, 2000, 1000, 1000, 50, 0.999, 100)["p99"]
        steady = goodputs(prof, cand, 2000, 1000, 1000, 50, 0.9)["p99"]
        print(f"{name}{f' ({mode.upper()})' if mode else ''}: reference: {said}")
        print("  model, attainment (ITL p99) per rate, 100 requests: "
              + "  ".join(f"{r:g}: {100 * a:.0f} %" + (f" (ref {points[r]} %)" if r in points else "")
                          for r, a in curve.items()))
        print(f"  model goodput: {finite:.2f} req/s at >= 90 %, {full:.2f} at 100 % (100 requests); steady state {steady:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
