"""Predictions written before a finite-run check on one H200 (results/gpu-h200x1/s5): a colocated MoE engine at
budget 512 and a given max_num_seqs, 2000/1000 tokens, TTFT 1 s / ITL 50 ms, both as the steady state and as a
run of 100 requests every one of which is judged (`pdctl bench --lifetimes 0 -n 100`).

    .venv/bin/python benchmarks/gpu/predict_finite.py MODEL_DIR bf16|fp8 MAX_NUM_SEQS [GRAPH_TOKENS] > predicted.json

GRAPH_TOKENS: the engine's `--compilation-config '{"max_cudagraph_capture_size": N}'` (default: vLLM's own).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from appliance.inventory import load_inventory
from appliance.model_config import read_model_shape, with_engine_quantization
from appliance.settings import Settings
from appliance.suggest import Candidate, Shape, finite_attainment, goodputs, gpu_profile, state

RATES = (1.5, 2, 2.5, 3, 4, 5, 6)


def main(argv: list[str]) -> int:
    """Print the predictions as JSON."""
    model_dir, quant, seqs = argv[0], argv[1], int(argv[2])
    args = ["--quantization", "fp8"] if quant == "fp8" else []
    if len(argv) > 3:
        args += ["--compilation-config", json.dumps({"max_cudagraph_capture_size": int(argv[3])})]
    shape = read_model_shape(model_dir)
    if shape is None:
        raise SystemExit(f"no readable config.json in {model_dir}")
    shape = with_engine_quantization(shape, args)
    settings = Settings.model_validate({"model": {"path": model_dir}, "connector": {"name": "none"},
                                        "colocated": {"max_num_seqs": seqs, "extra_args": args},
                                        "slo": {"ttft_ms": 1000, "itl_ms": 50}})
    prof = gpu_profile(settings, load_inventory("sim:h200-1"), shape, 16, False)
    cand = Candidate("colocated", colocated=Shape(1, 1), budget=512)
    out: dict[str, Any] = {"model": model_dir.rstrip("/").rsplit("/", 1)[-1], "quantization": quant, "max_num_seqs": seqs,
                 "engine_args": args,
                 "budget": 512, "workload": "2000/1000", "slo": "TTFT 1000 ms, ITL 50 ms", "profile": prof.source,
                 "steady_goodput": goodputs(prof, cand, 2000, 1000, 1000, 50, 0.9),
                 "finite_100_goodput": goodputs(prof, cand, 2000, 1000, 1000, 50, 0.9, 100), "per_rate": {}}
    for rate in RATES:
        st = state(prof, cand, rate, 2000, 1000, 50)
        att = finite_attainment(prof, cand, rate, 2000, 1000, 1000, 50, 100)
        out["per_rate"][rate] = {"finite_100_attainment": {k: round(v, 3) for k, v in att.items()},
                                 "steady_running": st.running, "steady_gap_ms": st.gap_ms, "steady_limit": st.limit}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
