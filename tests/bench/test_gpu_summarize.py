"""benchmarks/gpu/summarize.py's join-stall split, over recorded real-GPU bench results (results/gpu-h200x2).

The README quotes these figures: the test pins that the script computes them from the recorded token timings,
and that the split separates the gaps a join landed in from the others.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from appliance.bench.results import BenchResult

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "results" / "gpu-h200x2"


def _summarize() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_summarize", ROOT / "benchmarks" / "gpu" / "summarize.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(name: str) -> dict[float, dict]:
    result = BenchResult.model_validate_json((RESULTS / name).read_text())
    return {row["rate"]: row for row in _summarize().join_stalls(result)}


def test_cross_layer_join_costs_the_running_streams_little_at_2000_tokens() -> None:
    row = _rows("issue14-s2/disagg-read-w2000x1000.json")[2.0]
    with_join, without = row["with_join"], row["without_join"]
    assert with_join["n"] > 1000 and without["n"] > 20000   # every measured gap is in one group or the other
    assert with_join["p99"] - without["p99"] == pytest.approx(0.9, abs=0.05)
    assert row["all"]["p99"] / without["p99"] < 1.1


def test_joins_are_where_the_slow_gaps_are() -> None:
    # 8000-token joins with vLLM's V2 runner (8,064 descriptors): the joined gaps are ~7 ms slower at p99
    row = _rows("issue14/long-disagg-read.json")[0.4]
    assert row["with_join"]["p99"] > row["without_join"]["p99"] + 5
    assert row["with_join"]["p50"] == pytest.approx(row["without_join"]["p50"], abs=1.0)
