"""The advice on a card it was not calibrated on, held to what a lent H100 measured (issue 39, results/gpu-1x/h39).

The runs were not used to derive the band or the profile: the predictions were committed before any of them. Every
measured shape must stay inside the band `pdctl plan --check` prints for it, uncalibrated and calibrated on the run's
own calibration bench, and the verdict must stay within 25 % (or consistent with an open-ended measurement). A change
to the H100 profile or to the model that moves a prediction out of what the card did fails here.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from appliance.cli.main import cli

RUN = Path(__file__).resolve().parents[2] / "results" / "gpu-1x" / "h39" / "run"

# The Qwen3-8B shape the H100 served with dummy weights: the published config.json's sizes (what .gpu/bin/make_model.py
# writes); plan reads only these.
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 128, "hidden_size": 4096,
    "intermediate_size": 12288, "max_position_embeddings": 40960, "num_attention_heads": 32, "num_hidden_layers": 36,
    "num_key_value_heads": 8, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 151936,
}

# sweep folder -> the highest rate it passed under ITL p99 (results/gpu-1x/h39/README.md)
SWEEPS = {
    "s1-mbt512": 7.0,  # 3000/300, ITL 50 ms, budget 512: the calibration's workload family; 8 failed
    "s1-default": 0.5,  # the same at vLLM's default budget; 1 failed
    "held-out-mbt512": 14.0,  # 1500/150, ITL 30 ms: held out, seed 12; 16 failed
    "held-out-fine2-s21": 18.0,  # held out, seed 21; 20 failed
}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Settings like the device's (results/gpu-1x/h39/device/pdctl.toml) with the model's config.json, the sweeps
    unpacked."""
    home = tmp_path_factory.mktemp("h39")
    model = home / "qwen3-8b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3_8B))
    settings = home / "pdctl.toml"
    settings.write_text(f'state_dir = "{home / "state"}"\nunit_dir = "{home / "units"}"\n[engine]\nkind = "vllm"\n'
                        f'[model]\npath = "{model}"\n[colocated]\nmax_num_batched_tokens = 512\n')
    files = {"settings": settings}
    for name in [*SWEEPS, "calibration"]:
        out = home / f"{name}.json"
        out.write_bytes(gzip.decompress((RUN / name / "bench.json.gz").read_bytes()) if name != "calibration"
                        else (RUN / name / "bench.json").read_bytes())
        files[name] = out
    return files


def _check(node: dict[str, Path], sweep: str, calibrated: bool) -> list[dict]:
    profile = ["--profile", str(node["calibration"])] if calibrated else []
    result = CliRunner().invoke(cli, ["--config", str(node["settings"]), "--inventory", "sim:h100-1", "plan",
                                      "--check", str(node[sweep]), "--json", *profile])
    assert result.exit_code == 0, result.output
    return [row for row in json.loads(result.output)["goodput"] if row["judgement"] == "p99"]


@pytest.mark.parametrize("calibrated", [False, True], ids=["uncalibrated", "calibrated"])
@pytest.mark.parametrize("sweep", list(SWEEPS))
def test_every_shape_the_h100_measured_lies_in_its_band_and_within_25_percent(
        node: dict[str, Path], sweep: str, calibrated: bool) -> None:
    rows = _check(node, sweep, calibrated)
    assert len(rows) == 1, rows  # one shape per sweep
    row = rows[0]
    low, high = row["band"]
    assert row["in_band"] and low <= row["predicted"] <= high, row
    assert row["measured"] == SWEEPS[sweep], row  # the recorded run, read as recorded
    assert row["verdict"].startswith("within"), row


def test_calibration_moves_the_advice_towards_the_card() -> None:
    """The calibrated band is narrower than the uncalibrated one: calibration is worth the user's minutes."""
    # read from the predictions written on the device before the held-out sweep (run/predicted-calibrated-*.json)
    committed = json.loads((RUN.parent / "predicted-uncalibrated-h100-1-w1500x150-itl30.json").read_text())
    on_device = json.loads((RUN / "predicted-calibrated-w1500x150-itl30.json").read_text())

    def width(doc: dict) -> float:
        row = next(r for r in doc["suggestions"] if r["shape"] == "colocated 1xTP1 mbt512")
        low, high = row["band_rps"]
        return float(high) / float(low)

    assert width(on_device) < width(committed)
