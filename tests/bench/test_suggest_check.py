"""benchmarks/gpu/suggest_check.py: `plan --suggest`'s h200 profile against every goodput recorded on H200 (the
dense shape on 2 x H200, results/gpu-h200x2; the MoE shape on 1 x H200, results/gpu-h200x1), and the ranking it
gives each measured workload.

The measured intervals are re-derived from the recorded files; the model must land within 25 % of each, and a
row it misses must be one the script explains (a new miss, or a note left on a row that now passes, fails here).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from appliance.inventory import load_inventory
from appliance.model_config import model_shape
from appliance.settings import Settings
from appliance.suggest import _touched, gpu_profile, suggest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_suggest_check", ROOT / "benchmarks" / "gpu" / "suggest_check.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def rows(check: ModuleType) -> list[dict]:
    return check.check()


def _row(rows: list[dict], deployment: str, workload: str, slo: str) -> dict:
    ttft, itl, judgement = slo.split("/")
    found = [r for r in rows if r["deployment"] == deployment and f"{r['input_len']}/{r['output_len']}" == workload
             and (r["ttft_ms"], r["itl_ms"], r["judgement"]) == (float(ttft), float(itl), judgement)
             and r["steady"]]
    assert len(found) == 1, (deployment, workload, slo)
    return found[0]


def _recorded_and_within(rows: list[dict], expected: dict[tuple[str, str, str], str]) -> None:
    for key, measured in expected.items():
        row = _row(rows, *key)
        assert row["measured"] == measured, key
        assert row["within"], (key, row["predicted"])


def test_measured_intervals_are_the_recorded_ones(rows: list[dict]) -> None:
    expected = {  # issue 14's sessions, as the results README states them
        ("colocated 2xTP1 mbt256", "2000/1000", "1000/50/p99"): "[4, 5.5)",
        ("colocated 2xTP1 mbt256", "2000/1000", "1000/30/p99"): "< 3",
        ("colocated 1xTP2 mbt256", "2000/1000", "1000/50/p99"): ">= 2",
        ("colocated 1xTP2 mbt256", "2000/1000", "1000/30/p99"): ">= 2",
        ("disagg READ 1P+1D, cross-layer (V1 runner)", "2000/1000", "1000/30/p99"): "< 2",
        ("disagg WRITE 1P+1D, cross-layer (V1 runner)", "2000/1000", "1000/50/p99"): ">= 2",
        ("disagg READ 1P+1D, per-layer (V2 runner)", "2000/1000", "1000/50/p99"): "[1.5, 3)",
        ("colocated 1xTP2 mbt256", "8000/200", "2000/30/p99"): "[0.7, 1)",
        ("disagg READ 1P+1D, cross-layer (V1 runner)", "8000/200", "2000/30/p99"): "[0.7, 1)",
        ("disagg WRITE 1P+1D, cross-layer (V1 runner)", "8000/200", "2000/30/p99"): "[0.7, 1)",
        ("colocated 2xTP1 mbt256", "8000/200", "2000/30/p99"): "< 0.4",
        ("colocated 1xTP2 mbt256", "8000/200", "1000/30/p99"): "[0.4, 0.7)",
        ("disagg READ 1P+1D, cross-layer (V1 runner)", "8000/200", "1000/50/p99"): "< 0.4",
    }
    _recorded_and_within(rows, expected)  # every one of these, the workloads the issue names, within 25 %


def test_every_miss_is_explained_and_every_note_is_a_miss(check: ModuleType, rows: list[dict]) -> None:
    misses = {(r["deployment"], f"{r['input_len']}/{r['output_len']}",
               f"{r['ttft_ms']:g}/{r['itl_ms']:g}/{r['judgement']}") for r in rows if not r["within"]}
    assert misses == set(check.MISS_NOTES)
    assert all(r["note"] for r in rows if not r["within"])
    steady = [r for r in rows if r["steady"]]
    # the dense 2 x H200 rows, the MoE rows, the 8B held-out rows and session 4's --compare rows
    assert len(steady) == 216 + 144 + 4 + 6 and sum(r["within"] for r in steady) >= 0.9 * len(steady)
    moe = [r for r in steady if r["deployment"].startswith("MoE")]
    assert len(moe) == 144 and sum(r["within"] for r in moe) >= 0.85 * len(moe)


def test_moe_intervals_are_the_recorded_ones(rows: list[dict]) -> None:
    expected = {  # results/gpu-h200x1/README.md
        ("MoE colocated 1xTP1 mbt512", "2000/1000", "1000/50/p99"): "[4, 5.5)",
        ("MoE colocated 1xTP1 mbt256", "2000/1000", "1000/50/p99"): "[2, 3.5)",
        ("MoE colocated 1xTP1 mbt2048", "2000/1000", "1000/50/p99"): "< 3",
        ("MoE colocated 1xTP1 (vLLM default budget)", "2000/1000", "1000/50/p99"): "< 3",
        ("MoE colocated 1xTP1 mbt512", "8000/200", "2000/50/p99"): "[1.5, 2.5)",
        ("MoE colocated 1xTP1 mbt256", "8000/200", "2000/30/p99"): "[0.7, 1.2)",
        ("MoE colocated 1xTP1 (vLLM default budget)", "8000/200", "2000/30/p99"): "[0.6, 1)",
        ("MoE colocated 1xTP1 mbt2048", "8000/200", "2000/50/p99"): "< 1",
    }
    _recorded_and_within(rows, expected)


@pytest.mark.parametrize(("workload", "ttft_ms", "itl_ms", "rate"), [
    ((2000, 1000), 1000, 50, 4.0),  # measured: mbt512 [4, 5.5); mbt256 [2, 3.5); 2048 and the default < 3
    ((8000, 200), 2000, 50, 1.5),  # measured: mbt512 [1.5, 2.5); mbt256 [0.7, 1.2); default [0.6, 1); 2048 < 1
])
def test_suggest_ranks_the_measured_moe_winner_first(check: ModuleType, workload: tuple[int, int], ttft_ms: float,
                                                     itl_ms: float, rate: float) -> None:
    settings = Settings.model_validate({"engine": {"kind": "vllm"}, "model": {"path": "qwen3-30b-a3b"},
                                        "slo": {"ttft_ms": ttft_ms, "itl_ms": itl_ms}})
    inventory = load_inventory("sim:h200-1")
    shape = model_shape(check.QWEN3_30B_A3B)
    assert shape is not None
    ranked = suggest(settings, inventory, gpu_profile(settings, inventory, shape, 128), *workload, rate)
    assert str(ranked[0].candidate) == "colocated 1xTP1 mbt512"


def test_an_moe_step_reads_the_experts_its_tokens_visit(check: ModuleType) -> None:
    moe, dense = model_shape(check.QWEN3_30B_A3B), model_shape(check.QWEN3_32B)
    assert moe is not None and dense is not None
    assert (moe.experts, moe.experts_per_token) == (128, 8)
    assert moe.expert_params == 48 * 128 * 3 * 2048 * 768
    assert moe.experts_touched(1) == pytest.approx(8 / 128)
    assert 0.79 < moe.experts_touched(25) < 0.81 and moe.experts_touched(512) > 0.999
    assert dense.experts_touched(1) == 1.0 and dense.expert_params == 0
    settings = Settings.model_validate({"engine": {"kind": "vllm"}, "model": {"path": "qwen3-30b-a3b"}})
    prof = gpu_profile(settings, load_inventory("sim:h200-1"), moe, 128)
    # the decode step the runs measured: 4.7 ms with one sequence (the calibration), ~19 and ~32 ms at 25 and 200
    kv_ms = 2500 * moe.kv_bytes_per_token / (prof.kv_read_tbps * 1e12) * 1e3  # type: ignore[operator]
    step = [prof.decode_step_ms + prof.expert_step_ms * _touched(prof, n) + n * kv_ms for n in (1, 25, 200)]
    assert 2.5 < step[0] < 5.0 and 16.0 < step[1] < 21.0 and 29.0 < step[2] < 35.0


def test_within_is_the_25_percent_band(check: ModuleType) -> None:
    assert check.within(3.0, 4.0, 5.5) and not check.within(2.99, 4.0, 5.5)
    assert check.within(6.87, 4.0, 5.5) and not check.within(6.875, 4.0, 5.5)
    assert check.within(0.0, None, 0.4) and not check.within(0.5, None, 0.4)
    assert check.within(1.5, 2.0, None) and not check.within(1.49, 2.0, None)
    assert check.interval([(0.4, 1.0), (0.7, 0.95), (1.0, 0.6)]) == (0.7, 1.0)
    assert check.interval([(3.0, 0.0), (1.5, 1.0)]) == (1.5, 3.0)  # rates merged across sessions, in order


def test_main_writes_the_table_and_the_json(check: ModuleType, rows: list[dict], tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # the rows the other tests check, not computed a second time (~20 s)
    monkeypatch.setattr(check, "check", lambda: rows)
    assert check.main(["--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "suggest-check.json").read_text())
    assert data["count"]["rows"] == len(data["rows"]) and data["count"]["within"] <= data["count"]["rows"]
    text = (tmp_path / "suggest-check.md").read_text()
    assert f"**Within 25 %: {data['count']['within']} of {data['count']['rows']} rows" in text
    assert text.count("\n| ") == len(data["rows"]) + 1  # the header and one line per row


@pytest.mark.parametrize(("workload", "ttft_ms", "itl_ms", "rate", "best"), [
    ((2000, 1000), 1000, 30, 2.0, "colocated 1xTP2 mbt256"),  # measured >= 2; disagg < 2, colocated 2x1 < 3
    ((8000, 200), 2000, 30, 0.7, "colocated 1xTP2 mbt256"),  # measured [0.7, 1), tied with READ and WRITE
    ((8000, 200), 1000, 30, 0.4, "colocated 1xTP2 mbt256"),  # measured [0.4, 0.7); every other < 0.4
])
def test_suggest_ranks_the_measured_winner_first(check: ModuleType, workload: tuple[int, int], ttft_ms: float,
                                                 itl_ms: float, rate: float, best: str) -> None:
    ranked = suggest(*_h200(check, ttft_ms, itl_ms), *workload, rate)
    assert str(ranked[0].candidate) == best


def test_suggest_orders_the_measured_shapes_at_2000_1000_itl_50(check: ModuleType) -> None:
    # Measured: colocated 2x1 mbt256 [4, 5.5), colocated TP2 mbt256 >= 2 (nothing above measured), 1P+1D [2, 3).
    ranked = [str(p.candidate) for p in suggest(*_h200(check, 1000, 50), 2000, 1000, 4.0)]
    measured = [s for s in ranked if s in ("colocated 2xTP1 mbt256", "colocated 1xTP2 mbt256", "1xTP1 : 1xTP1")]
    assert measured == ["colocated 2xTP1 mbt256", "colocated 1xTP2 mbt256", "1xTP1 : 1xTP1"]


def _h200(check: ModuleType, ttft_ms: float, itl_ms: float) -> tuple:
    settings = Settings.model_validate({"engine": {"kind": "vllm"}, "model": {"path": "qwen3-32b"},
                                        "connector": {"name": "nixl"}, "slo": {"ttft_ms": ttft_ms, "itl_ms": itl_ms}})
    inventory = load_inventory("sim:h200-2")
    shape = model_shape(check.QWEN3_32B)
    assert shape is not None
    return settings, inventory, gpu_profile(settings, inventory, shape, 128)


def test_the_held_out_one_gpu_rows_are_within_and_compare_picks_the_first_ranked(check: ModuleType,
                                                                                  rows: list[dict]) -> None:
    # Issue 24's held-out check (Qwen3-8B, 1 x H200, 3000/300, TTFT 1 s, ITL 50 ms p99), every row, and session
    # 4's `pdctl bench --compare` of the same workload: budget 2048 was predicted 80 % too low (its slowest step
    # taken as a whole 2,048-token chunk at the prompt's full context), now within.
    held = [r for r in rows if r["source"].startswith("issue 24")]
    assert [(r["deployment"], r["measured"]) for r in held] == [
        ("8B colocated 1xTP1 mbt256", "[6.5, 8.5)"), ("8B colocated 1xTP1 mbt512", "[7, 9)"),
        ("8B colocated 1xTP1 mbt2048", "[3, 4.5)"), ("8B colocated 1xTP1 (vLLM default budget)", "[1.1, 2)")]
    assert all(r["within"] for r in held), [(r["deployment"], r["predicted"]) for r in held]
    compared = {r["deployment"]: r for r in rows if "bench --compare" in r["source"] and r["judgement"] == "p99"}
    assert compared["8B colocated 1xTP1 mbt512"]["measured"] == ">= 7"
    assert compared["8B colocated 1xTP1 mbt2048"]["measured"] == "< 3"
    assert all(r["within"] for r in compared.values())
    # suggest ranks first the budget `pdctl bench --compare` picked on the GPU
    settings = Settings.model_validate({"engine": {"kind": "vllm"}})
    inventory = load_inventory("sim:h200-1")
    shape = model_shape(check.QWEN3_8B)
    assert shape is not None
    ranked = suggest(settings, inventory, gpu_profile(settings, inventory, shape, 128), 3000, 300, 4)
    assert ranked[0].candidate.budget == 512


def test_every_recorded_run_falls_inside_the_band_its_profile_printed(rows: list[dict]) -> None:
    # issue 39: the band printed beside each prediction (MODEL_BAND x the profile's transfer band) holds on every
    # goodput interval recorded so far, the rows the model misses by more than 25 % included
    assert len(rows) > 400
    missed = [(r["deployment"], r["input_len"], r["output_len"], r["itl_ms"], r["judgement"], r["measured"], r["band"])
              for r in rows if not r["in_band"]]
    assert not missed, missed
    # and it is no blanket: a colocated p99 band is at most 2.3x wide, and the rows hug its ends
    colocated = [r for r in rows if "colocated" in r["deployment"] and r["judgement"] == "p99" and r["predicted"] > 0]
    assert all(r["band"][1] / r["band"][0] < 2.3 for r in colocated)
