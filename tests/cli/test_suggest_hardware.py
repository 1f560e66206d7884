"""`pdctl plan --suggest` on hardware pdctl was not calibrated on (issue 39): a profile per accelerator from its
public peaks, the H200's measured shares carried only within its family, the nearest profile for a card with
none, a band on every figure, a calibration command sized by the profile, and overlapping bands said so."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.inventory import load_inventory
from appliance.inventory.models import Gpu, Inventory
from appliance.model_config import model_shape
from appliance.settings import Settings
from appliance.suggest import (
    ACCELERATORS,
    H200,
    MODEL_BAND,
    Candidate,
    Shape,
    accelerator_of,
    bench_profile,
    goodput_band,
    gpu_profile,
    state,
)
from tests.support.processes import Proc

# The published Qwen3-8B shape (the lent GPU's runs served it with dummy weights).
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
SHAPE = model_shape(QWEN3_8B)
SETTINGS = Settings.model_validate({"engine": {"kind": "vllm"}, "model": {"path": "qwen3-8b"}})
ONE = Candidate("colocated", colocated=Shape(1, 1))


def _profile(source: str | Inventory):
    inventory = load_inventory(source) if isinstance(source, str) else source
    assert SHAPE is not None
    return gpu_profile(SETTINGS, inventory, SHAPE, 16)


# what NVML / amdsmi report for each card (nvidia-smi's and amd-smi's product names)
REPORTED = {"NVIDIA H100 80GB HBM3": "H100 SXM", "NVIDIA H100 PCIe": "H100 PCIe", "NVIDIA H200": "H200",
            "NVIDIA H200 NVL": "H200", "NVIDIA B200": "B200", "AMD Instinct MI300X": "MI300X",
            "AMD Instinct MI300X VF": "MI300X", "AMD Instinct MI325X": "MI325X", "AMD Instinct MI355X": "MI355X"}


@pytest.mark.parametrize("reported", REPORTED)
def test_every_listed_card_has_its_own_profile(reported: str) -> None:
    acc = accelerator_of(reported)
    assert acc is not None and acc.name == REPORTED[reported]
    # the peaks a profile states are that card's: no share above 1, no rate above its peak
    assert all(0 < share <= 1 for share in (acc.weight_share, acc.kv_share, acc.gemm_share, acc.fp8_gemm_share))
    assert acc.fp8_tflops == pytest.approx(2 * acc.bf16_tflops, rel=0.01) and acc.link


def test_an_h100_reads_its_kv_under_its_own_bandwidth() -> None:
    # the defect issue 39 reports: an H100 got the H200's absolute rates (KV read at 3.9 TB/s > its 3.35 peak)
    h100 = _profile("sim:h100-1")
    assert h100.kv_read_tbps is not None and h100.kv_read_tbps < 3.35
    assert "H100 SXM profile" in h100.source and "H200's measured shares" in h100.source
    assert not h100.calibrated


def test_shares_carry_by_physics_within_a_family() -> None:
    h200, h100 = _profile("sim:h200-1"), _profile("sim:h100-1")
    # the memory-bound decode step scales with the bandwidth, the prefill GEMM with the tensor peak (equal)
    assert h100.decode_step_ms / h200.decode_step_ms == pytest.approx(4.8 / 3.35)
    assert h100.kv_read_tbps / h200.kv_read_tbps == pytest.approx(3.35 / 4.8)  # type: ignore[operator]
    assert h100.prefill_us_per_token == pytest.approx(h200.prefill_us_per_token)
    pcie = _profile(Inventory(source="test", gpus=[Gpu(index=0, vendor="nvidia", name="NVIDIA H100 PCIe",
                                                       memory_total_mib=81_559)]))
    assert pcie.prefill_us_per_token / h200.prefill_us_per_token == pytest.approx(989 / 756)
    assert pcie.decode_step_ms / h200.decode_step_ms == pytest.approx(4.8 / 2.0)


def test_a_card_without_a_profile_gets_the_nearest_and_a_wider_band() -> None:
    h100_nvl = Inventory(source="test", gpus=[Gpu(index=0, vendor="nvidia", name="NVIDIA H100 NVL",
                                                  memory_total_mib=95_830)])
    prof = _profile(h100_nvl)
    assert "H100 SXM profile on NVIDIA H100 NVL (no profile for it: the nearest by memory)" in prof.source
    assert not prof.calibrated and prof.band[0] < 0.85 and prof.band[1] > 1.15
    amd = Inventory(source="test", gpus=[Gpu(index=0, vendor="amd", name="AMD Instinct MI308X",
                                             memory_total_mib=196_592)])
    assert _profile(amd).source.startswith("MI300X profile on AMD Instinct MI308X")


def test_the_band_widens_from_calibrated_to_carried_to_assumed() -> None:
    widths = {}
    for source in ("sim:h200-1", "sim:h100-1", "sim:b200-8", "sim:mi355x-8"):
        low, high = goodput_band(_profile(source), "colocated", "p99")
        widths[source] = high / low
    assert widths["sim:h200-1"] < widths["sim:h100-1"] < widths["sim:b200-8"] == widths["sim:mi355x-8"]
    assert goodput_band(_profile("sim:h200-1"), "colocated", "p99") == MODEL_BAND[("colocated", "p99")]


def test_every_accelerator_names_a_family_and_only_the_h200_is_calibrated() -> None:
    assert [a.name for a in ACCELERATORS if a.calibrated] == ["H200"]
    for acc in ACCELERATORS:
        assert acc.family and acc.band[0] < 1 < acc.band[1] or acc is H200
        assert acc.carried_from in ("", "H200") and (acc.carried_from == "H200") == (acc.family == "hopper"
                                                                                      and acc is not H200)


def _cli(tmp_path: Path, *args: str) -> str:
    model = tmp_path / "qwen3-8b"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(QWEN3_8B))
    (tmp_path / "pdctl.toml").write_text(f'state_dir = "{tmp_path / "state"}"\n[engine]\nkind = "vllm"\n'
                                         f'[model]\npath = "{model}"\n')
    done = subprocess.run([sys.executable, "-m", "appliance", "plan", *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120,
                          env=dict(os.environ, PDCTL_CONFIG=str(tmp_path / "pdctl.toml"), COLUMNS="400"))
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_calibration_command_fits_the_profile(tmp_path: Path) -> None:
    out = _cli(tmp_path, "--suggest", "--inventory", "sim:h100-1", "--input-len", "3000", "--output-len", "300")
    line = next(li for li in out.splitlines() if "calibrate it on this node" in li)
    command = line.split("`")[3]
    words = command.split()
    rate, prompt, output = (float(words[words.index(flag) + 1]) for flag in ("--rates", "--input-len", "--output-len"))
    assert prompt == 3000 and "--lifetimes 0" in command and "-n 20" in command
    # one request at a time: the rate times a lone request's life (this profile's TTFT + its steps) is ~0.2
    lone = state(_profile("sim:h100-1"), ONE, 1e-6, 3000, int(output), 1e9)
    assert lone.ttft_ms is not None and lone.gap_ms is not None
    life_s = (lone.ttft_ms + output * lone.gap_ms) / 1000
    assert 0.1 < rate * life_s < 0.3
    minutes = float(line.split("(about ")[1].split(" min")[0])
    assert minutes < 3  # a short run


def test_overlapping_bands_are_named_together(tmp_path: Path) -> None:
    out = _cli(tmp_path, "--suggest", "--inventory", "sim:h100-1", "--input-len", "3000", "--output-len", "300")
    lines = out.splitlines()
    apply = next(i for i, li in enumerate(lines) if li.startswith("apply:"))
    assert "MAX_NUM_BATCHED_TOKENS=512" in lines[apply]
    # budget 256's band overlaps 512's: the advice names it, and how to tell the two apart
    assert "or colocated 1xTP1 mbt256" in lines[apply + 1] and "its band overlaps" in lines[apply + 1]
    assert "pdctl bench --compare --shapes colocated-1-mbt512,colocated-1-mbt256" in lines[apply + 1]
    data = json.loads(_cli(tmp_path, "--suggest", "--json", "--inventory", "sim:h100-1", "--input-len", "3000",
                           "--output-len", "300"))
    for row in data["suggestions"]:
        low, high = row["band_rps"]
        assert low < row["goodput_rps"] < high
    assert data["apply"] == "colocated-1-mbt512"


def test_calibration_fits_the_profile_to_the_engine_it_measured(tmp_path: Path) -> None:
    # a real engine process slower than the H100 profile says (the simulated engine, its time model set):
    # prefill 30 us a token against the profile's ~22, a decode step of 9 ms against ~6.5
    engine = Proc("engine", [sys.executable, "-m", "appliance.engine.sim", "--port", "0", "--model", "sim-model",
                             "--prefill-us-per-token", "30", "--decode-step-ms", "9", "--decode-step-ms-per-seq", "0",
                             "--log-level", "warning"], tmp_path, ready_line=True, session=True)
    try:
        url = json.loads(engine.read_line(re.compile(r'"url": "http://')))["url"]
        out = _cli(tmp_path, "--suggest", "--inventory", "sim:h100-1", "--input-len", "1000", "--output-len", "300")
        command = next(li for li in out.splitlines() if "calibrate it on this node" in li).split("`")[3].split()
        assert command[:2] == ["pdctl", "bench"]
        # the printed run, as a user runs it, against that engine (fewer requests: a test's time)
        args = [*command[1:], "--url", url]
        args[args.index("-n") + 1] = "5"
        args[args.index("--out") + 1] = str(tmp_path / "calibration")
        done = subprocess.run([sys.executable, "-m", "appliance", *args], cwd=tmp_path, capture_output=True,
                              text=True, timeout=180, env=dict(os.environ, PDCTL_CONFIG=str(tmp_path / "pdctl.toml")))
        assert done.returncode == 0, done.stderr
        fitted = json.loads(_cli(tmp_path, "--suggest", "--json", "--inventory", "sim:h100-1", "--profile",
                                 str(tmp_path / "calibration" / "bench.json"), "--input-len", "1000",
                                 "--output-len", "300"))["profile"]
    finally:
        engine.kill()
    assert fitted["calibrated"] and fitted["band"] == [1.0, 1.0]
    assert "prefill x" in fitted["source"] and "decode step x" in fitted["source"]
    # the fitted profile reproduces what the run measured: a lone prompt's TTFT and the decode step
    bench = tmp_path / "calibration" / "bench.json"
    requests = [q for shape in json.loads(bench.read_text())["shapes"] for r in shape["rates"]
                for q in r["requests"]]
    ttft_ms = statistics.median(q["chunk_times_s"][0] for q in requests) * 1000
    raw = _profile("sim:h100-1")
    prof = bench_profile(bench, ONE, raw)
    lone = state(prof, ONE, 1e-6, 1000, 64, 1e9)
    assert lone.ttft_ms == pytest.approx(ttft_ms, rel=0.1)
    assert prof.decode_step_ms == pytest.approx(9.0, rel=0.15) and raw.decode_step_ms < 7.5
    assert fitted["decode_step_ms"] == pytest.approx(prof.decode_step_ms)
