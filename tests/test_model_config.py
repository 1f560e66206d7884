"""Which TP a model can take (vLLM's head-divisibility rules), and the places that act on it: `pdctl doctor`,
`pdctl plan --suggest` and the pure suggestion ranking."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from appliance.inventory import load_inventory
from appliance.model_config import Heads, read_heads
from appliance.settings import Settings
from appliance.suggest import Prediction, sim_profile, suggest

# config.json head counts of real models (from their published configs)
QWEN3_32B = {"architectures": ["Qwen3ForCausalLM"], "num_attention_heads": 64, "num_key_value_heads": 8}
QWEN25_05B = {"architectures": ["Qwen2ForCausalLM"], "num_attention_heads": 14, "num_key_value_heads": 2}


def _model(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_vllm_head_rules() -> None:
    qwen3 = Heads(64, 8)
    assert qwen3.tp_problem(6) == "TP 6 does not divide the model's 64 attention heads"
    assert [tp for tp in range(1, 17) if qwen3.tp_problem(tp) is None] == [1, 2, 4, 8, 16]  # TP16 replicates KV
    assert Heads(24, 6).tp_problem(4) == "TP 4 neither divides the model's 6 KV heads nor is a multiple of them"
    assert Heads(24, 6).tp_problem(3) is None and Heads(24, 6).tp_problem(12) is None
    assert Heads(128, None).fitting(8) == [1, 2, 4, 8]  # MLA: no KV constraint


def test_read_heads(tmp_path: Path) -> None:
    assert read_heads(_model(tmp_path, QWEN3_32B)) == Heads(64, 8)
    (tmp_path / "mm").mkdir()
    (tmp_path / "mm" / "config.json").write_text(json.dumps({"text_config": {"num_attention_heads": 40}}))
    assert read_heads(tmp_path / "mm") == Heads(40, 40)  # no num_key_value_heads: plain multi-head attention
    (tmp_path / "mla").mkdir()
    (tmp_path / "mla" / "config.json").write_text(json.dumps({"num_attention_heads": 128, "kv_lora_rank": 512,
                                                               "num_key_value_heads": 128}))
    assert read_heads(tmp_path / "mla") == Heads(128, None)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("[1, 2")
    assert read_heads(tmp_path / "bad") is None
    assert read_heads(tmp_path / "nothing-here") is None
    assert read_heads("Qwen/Qwen3-32B") is None  # a hub name: not readable, no check


def test_suggest_leaves_out_tps_the_model_cannot_take() -> None:
    settings = Settings.model_validate({"engine": {"kind": "sim"}, "connector": {"name": "moriio"}})
    inv = load_inventory("sim:mi300x-8")
    free = suggest(settings, inv, sim_profile(settings), 1024, 256, 4)
    small = suggest(settings, inv, sim_profile(settings), 1024, 256, 4, Heads(14, 2))
    def tps(ranked: list[Prediction]) -> set[int]:
        c = [p.candidate for p in ranked]
        return {s.tp for x in c for s in (x.prefill, x.decode, x.colocated) if s is not None}

    assert 4 in tps(free)
    assert small and tps(small) == {1, 2}


def _pdctl(tmp_path: Path, model: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cfg = tmp_path / "pdctl.toml"
    cfg.write_text(f'state_dir = "{tmp_path}/state"\n[engine]\nkind = "sim"\n[model]\npath = "{model}"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDCTL_")} | {"COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "appliance", "--config", str(cfg), *args], capture_output=True,
                          text=True, env=env, timeout=120)


def test_doctor_fails_a_tp_that_does_not_divide_the_heads(tmp_path: Path) -> None:
    model = _model(tmp_path, QWEN3_32B)
    r = _pdctl(tmp_path, model, "doctor", "--json", "--inventory", "sim:mi300x-8", "--connector", "moriio",
               "--prefill-gpus", "2", "--decode-gpus", "6")
    assert "Traceback" not in r.stderr, r.stderr
    tp = [f for f in json.loads(r.stdout) if f["check"] == "tp"]
    assert r.returncode == 1
    assert tp == [{"check": "tp", "status": "fail",
                   "detail": "decode-0: TP 6 does not divide the model's 64 attention heads; vLLM refuses to start",
                   "fix": "reshape decode: --decode 3xTP2 (or 6xTP1)"}]
    r = _pdctl(tmp_path, model, "doctor", "--json", "--inventory", "sim:mi300x-8", "--connector", "moriio",
               "--prefill", "2xTP1", "--decode", "3xTP2")
    tp = [f for f in json.loads(r.stdout) if f["check"] == "tp"]
    assert tp == [{"check": "tp", "status": "ok", "detail": "TP 1, 2 fits 64 attention heads, 8 KV heads", "fix": ""}]


def test_plan_suggest_reads_the_model(tmp_path: Path) -> None:
    model = _model(tmp_path, QWEN25_05B)
    r = _pdctl(tmp_path, model, "plan", "--suggest", "--inventory", "sim:mi300x-8", "--connector", "moriio")
    assert r.returncode == 0, r.stderr
    assert "model: 14 attention heads: TP 1, 2 can start" in r.stdout
    r = _pdctl(tmp_path, model, "plan", "--suggest", "--json", "--inventory", "sim:mi300x-8", "--connector", "moriio")
    rows = json.loads(r.stdout)["suggestions"]
    shapes = {(s["prefill"], s["decode"]) for s in rows if s["layout"] == "disaggregated"}
    assert ("4xTP1", "2xTP2") in shapes and not any("TP4" in p + d for p, d in shapes)
    assert {s["colocated"] for s in rows if s["layout"] == "colocated"} == {"8xTP1", "4xTP2"}
