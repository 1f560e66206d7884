"""`pdctl plan` as a user runs it: a real process, its output and exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.proxy.config import default_workers

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The shipped file's state_dir is the host's /var/lib/pdctl, whose layout.json `pdctl plan` would apply.
    monkeypatch.setenv("PDCTL_STATE_DIR", str(tmp_path / "state"))


def pdctl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("PDCTL_") or k == "PDCTL_STATE_DIR"}
    base["PDCTL_CONFIG"] = str(REPO / "etc" / "pdctl.toml")
    return subprocess.run(
        [sys.executable, "-m", "appliance", *args], capture_output=True, text=True, env={**base, **(env or {})},
        timeout=60,
    )


def test_reference_plan_json() -> None:
    r = pdctl("plan", "--json", env={"PDCTL_INVENTORY": "sim:mi300x-8"})
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    assert p["schema_version"] == 2
    assert [(i["name"], i["gpus"], i["tp"]) for i in p["instances"]] == [
        ("prefill-0", [0, 1, 2, 3], 4),
        ("decode-0", [4, 5, 6, 7], 4),
    ]


def test_two_plus_six_from_flags() -> None:
    r = pdctl("plan", "--json", "--prefill-gpus", "2", "--decode-gpus", "6", env={"PDCTL_INVENTORY": "sim:mi300x-8"})
    assert r.returncode == 0, r.stderr
    assert [len(i["gpus"]) for i in json.loads(r.stdout)["instances"]] == [2, 6]


def test_explicit_sets_and_table() -> None:
    r = pdctl("plan", "--inventory", "sim:h200-8", "--connector", "nixl", "--mode", "read", "--prefill", "0,1",
              "--decode", "2-7")
    assert r.returncode == 0, r.stderr
    assert "prefill-0" in r.stdout and "2,3,4,5,6,7" in r.stdout
    # every instance's command line, pasteable, with its environment; credentials by name only
    lines = {line.split(":", 1)[0]: line for line in r.stdout.splitlines() if line.startswith(("prefill-0:", "decode-0:"))}
    assert set(lines) == {"prefill-0", "decode-0"}
    assert "CUDA_VISIBLE_DEVICES=2,3,4,5,6,7" in lines["decode-0"] and "VLLM_USE_V2_MODEL_RUNNER=0" in lines["decode-0"]
    assert "--block-size 128" in lines["decode-0"] and "NixlConnector" in lines["decode-0"]


def test_table_shows_credentials_by_name_only() -> None:
    r = pdctl("plan", "--inventory", "sim:h200-8", "--connector", "nixl",
              env={"PDCTL_ENGINE__ENV": '{"HF_TOKEN": "hf_s3cret_value"}'})
    assert r.returncode == 0, r.stderr
    assert "HF_TOKEN=<secret>" in r.stdout and "hf_s3cret_value" not in r.stdout


def test_nixl_on_nvidia_shows_the_v1_runner_unless_the_user_chose() -> None:
    # cross-layer KV blocks take effect only on vLLM 0.24's V1 model runner; a role's own env value wins
    r = pdctl("plan", "--json", "--connector", "nixl", "--mode", "read",
              env={"PDCTL_INVENTORY": "sim:h200-8", "PDCTL_DECODE__ENV": '{"VLLM_USE_V2_MODEL_RUNNER": "1"}'})
    assert r.returncode == 0, r.stderr
    runner = {i["name"]: i["env"].get("VLLM_USE_V2_MODEL_RUNNER") for i in json.loads(r.stdout)["instances"]}
    assert runner == {"prefill-0": "0", "decode-0": "1"}


def test_dp2_tp2_ranks_never_share_ports() -> None:
    shape = {"PDCTL_DECODE__DP": "2", "PDCTL_DECODE__TP": "2", "PDCTL_DECODE__GPUS": "[4,5,6,7]"}
    # MORI-IO (the reference) cannot: vLLM binds two of its ranks to one port, so the plan is refused
    r = pdctl("plan", env={"PDCTL_INVENTORY": "sim:mi300x-8", **shape})
    assert r.returncode == 2 and "both bind handshake port" in r.stderr and "--decode 1xTP4" in r.stderr, r.stderr
    r = pdctl("plan", "--json", "--connector", "nixl", "--mode", "read", env={"PDCTL_INVENTORY": "sim:h200-8", **shape})
    assert r.returncode == 0, r.stderr
    ports = [port for i in json.loads(r.stdout)["instances"] for v in i["ports"].values() for port in v]
    assert len(ports) == len(set(ports))


def test_bad_requests_exit_nonzero_with_one_line() -> None:
    cases = [
        ("plan", "--prefill", "0-3", "--decode", "3-6"),
        ("plan", "--prefill-gpus", "6", "--decode-gpus", "6"),
        ("plan", "--prefill", "zero"),
        ("plan", "--inventory", "sim:nope"),
        ("plan", "--connector", "example", "--mode", "write", "--inventory", "sim:cpu"),
    ]
    for args in cases:
        r = pdctl(*args, env={"PDCTL_INVENTORY": "sim:mi300x-8"})
        assert r.returncode != 0, args
        assert "Traceback" not in r.stderr, args
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("pdctl: error:"), (args, r.stderr)


def test_bad_settings_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[connector]\nmode = "sideways"\n')
    r = pdctl("--config", str(bad), "plan", env={"PDCTL_INVENTORY": "sim:mi300x-8"})
    assert r.returncode == 2
    assert r.stderr.strip() == (
        f"pdctl: error: {bad}: connector.mode = 'sideways' is not allowed: Input should be 'read' or 'write'"
    )


def test_shapes_in_the_plan_flags() -> None:
    r = pdctl("plan", "--json", "--prefill", "2xTP2", "--decode", "1xTP4", env={"PDCTL_INVENTORY": "sim:mi300x-8"})
    assert r.returncode == 0, r.stderr
    assert [(i["name"], i["gpus"], i["tp"]) for i in json.loads(r.stdout)["instances"]] == [
        ("prefill-0", [0, 1], 2), ("prefill-1", [2, 3], 2), ("decode-0", [4, 5, 6, 7], 4)]
    # a shape pinned to GPUs, and the same flags through doctor (every command with the plan flags parses them)
    r = pdctl("plan", "--json", "--prefill", "1xTP2@6-7", "--decode", "2xTP2@0-3", env={"PDCTL_INVENTORY": "sim:mi300x-8"})
    assert r.returncode == 0, r.stderr
    assert [(i["name"], i["gpus"]) for i in json.loads(r.stdout)["instances"]] == [
        ("prefill-0", [6, 7]), ("decode-0", [0, 1]), ("decode-1", [2, 3])]
    r = pdctl("doctor", "--json", "--engine", "sim", "--prefill", "2xTP2", "--decode", "1xTP4",
              env={"PDCTL_INVENTORY": "sim:mi300x-8"})
    assert "Traceback" not in r.stderr and json.loads(r.stdout), r.stderr


def test_bad_shape_is_one_line() -> None:
    for value in ("2xTPx", "0xTP2", "3xTP4"):
        r = pdctl("plan", "--prefill", value, env={"PDCTL_INVENTORY": "sim:mi300x-8"})
        assert r.returncode != 0, value
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("pdctl: error:"), (value, r.stderr)
    r = pdctl("plan", "--prefill", "2xTPx", env={"PDCTL_INVENTORY": "sim:mi300x-8"})
    assert "neither a GPU set nor a shape" in r.stderr


def test_errors_name_where_the_value_came_from() -> None:
    env = {"PDCTL_INVENTORY": "sim:h200-8", "PDCTL_CONNECTOR__MODE": "read"}
    # An explicit TP from the environment that the flag's GPU set cannot honour is an error, not a silent TP4.
    r = pdctl("plan", "--connector", "nixl", "--decode", "4-7", env={**env, "PDCTL_DECODE__TP": "3"})
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "TP 3 (from PDCTL_DECODE__TP)" in r.stderr and "GPUs from --decode 4-7" in r.stderr
    # ... and one it can honour is kept: two instances of TP 2 on the flag's four GPUs.
    r = pdctl("plan", "--json", "--connector", "nixl", "--decode", "4-7",
              env={**env, "PDCTL_DECODE__TP": "2", "PDCTL_DECODE__INSTANCES": "2"})
    assert [(i["gpus"], i["tp"]) for i in json.loads(r.stdout)["instances"] if i["role"] == "decode"] == [
        ([4, 5], 2), ([6, 7], 2)], r.stderr
    r = pdctl("plan", env={**env, "PDCTL_CONNECTOR__MODE": "sideways"})
    assert r.stderr.startswith("pdctl: error: PDCTL_CONNECTOR__MODE: connector.mode = 'sideways'"), r.stderr
    r = pdctl("plan", "--connector", "nixl", "--decode", "9-12", env=env)
    assert "decode.gpus (from --decode 9-12)" in r.stderr, r.stderr


def test_usage_errors_are_one_line() -> None:
    for args in (("plan", "--mode", "sideways"), ("plan", "--bogus"), ("nosuch",), ("plan", "--prefill-gpus", "0")):
        r = pdctl(*args, env={"PDCTL_INVENTORY": "sim:mi300x-8"})
        assert r.returncode == 2, args
        assert r.stderr.count("\n") == 1 and r.stderr.startswith("pdctl: error: "), (args, r.stderr)
    r = pdctl("plan", "--mode", "sideways")
    assert "'sideways' is not one of 'read', 'write'" in r.stderr and "pdctl plan --help" in r.stderr


def test_explicit_variables_win_over_the_recorded_layout(tmp_path: Path) -> None:
    """A shape `pdctl rebalance` recorded in layout.json applies over pdctl.toml, never over an explicit PDCTL_*
    variable or flag: those win, and `plan` says in its layout line which record it left out and why."""
    from appliance.inventory import load_inventory
    from appliance.node import Node
    from appliance.plan import plan
    from appliance.settings import load_settings
    from tests.support.pdctl import pdctl as pdctl_at
    from tests.support.pdctl import write_config

    config = write_config(tmp_path, tmp_path / "state")
    settings = load_settings(config)
    Node(settings).record_layout(plan(load_settings(config, {"decode": {"instances": 4, "tp": 1}}),
                                      load_inventory("sim:mi300x-8")))

    def decode(*args: str, env: dict[str, str] | None = None) -> tuple[list[tuple[int, int]], str]:
        shown = pdctl_at(config, "--inventory", "sim:mi300x-8", "plan", *args, env=env)
        assert shown.returncode == 0, shown.stdout + shown.stderr
        as_json = pdctl_at(config, "--inventory", "sim:mi300x-8", "plan", "--json", *args, env=env)
        shapes = [(i["tp"], i["dp"]) for i in json.loads(as_json.stdout)["instances"] if i["role"] == "decode"]
        return shapes, shown.stdout

    recorded, line = decode()
    assert recorded == [(1, 1)] * 4 and "layout.json (pdctl rebalance) applied over the settings" in line, line
    explicit, line = decode(env={"PDCTL_DECODE__DP": "2", "PDCTL_DECODE__TP": "2"})
    assert explicit == [(2, 2)], explicit
    assert "explicit settings win over the decode shape (pdctl rebalance) for PDCTL_DECODE__DP, PDCTL_DECODE__TP" \
        in line, line
    flagged, line = decode("--decode", "2xTP2")
    assert flagged == [(2, 1), (2, 1)] and "for --decode 2xTP2" in line, line


def test_the_plan_says_what_room_conditional_routing_leaves_and_why() -> None:
    # results/conditional's 3 x node (150 ms ITL target; a step of 54 ms + 0.51 ms per sequence, 300 us per
    # prompt token): simulated engines, sized on the host's 15 ms lateness; then on real engines' spread
    sim = {"PDCTL_CONFIG": str(REPO / "results" / "conditional" / "run4-x3" / "sim-scaled.toml"),
           "PDCTL_INVENTORY": "sim:h200-2"}
    on = {**sim, "PDCTL_PROXY__CONDITIONAL_ROUTING": "true"}
    r = pdctl("plan", env=on)
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("conditional routing:"))
    assert line == ("conditional routing: decode_only_below 268, from its decode step spread 0.0453, simulated "
                    "engines: the host's 15 ms lateness at the ITL target: a step carrying a prompt may take 90% of "
                    "the 150 ms ITL target; room 268 prompt tokens per 150 ms less 1.7 per running leg: 266 at 1, "
                    "254 at 8, 240 at 16, 213 at 32 legs; none from 158 legs")
    r = pdctl("plan", env={**on, "PDCTL_PROXY__DECODE_STEP_SPREAD": "0.1"})
    assert "conditional routing: decode_only_below 214, from its decode step spread 0.1, [proxy] " \
           "decode_step_spread: a step carrying a prompt may take 79% of the 150 ms ITL target; room 214 prompt " \
           "tokens per 150 ms less 1.7 per running leg: 212 at 1, 200 at 8, 186 at 16, 159 at 32 legs; none from " \
           "126 legs" in r.stdout
    assert "conditional routing" not in pdctl("plan", env=sim).stdout  # off: nothing to say
    budgeted = pdctl("plan", env={**on, "PDCTL_DECODE__MAX_NUM_BATCHED_TOKENS": "200"}).stdout
    assert ("decode budget 200 (max_num_batched_tokens): while it runs 0-97 legs, short prompts queue at the decode "
            "(up to 750 ms while the prefill is busy); at other loads one room per window") in budgeted, budgeted
    assert "decode budget" not in r.stdout  # none set: vLLM's default, never within the room
    suggested = json.loads(pdctl("plan", "--suggest", "--json", env=sim).stdout)
    assert suggested["decode_only_below"]["tokens"] == 268 and "none from 158 legs" in suggested["decode_only_below"]["room"]
    bad = pdctl("plan", env={**on, "PDCTL_PROXY__DECODE_STEP_SPREAD": "2"})
    assert bad.returncode != 0 and "Traceback" not in bad.stderr and "decode_step_spread" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr


def test_a_budget_below_max_num_seqs_is_refused_in_one_line_as_vllm_would() -> None:
    env = {"PDCTL_CONFIG": str(REPO / "results" / "conditional" / "sim.toml"), "PDCTL_INVENTORY": "sim:h200-2",
           "PDCTL_DECODE__MAX_NUM_BATCHED_TOKENS": "200", "PDCTL_DECODE__MAX_NUM_SEQS": "256"}
    bad = pdctl("plan", env=env)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr, bad.stderr
    assert "max_num_batched_tokens 200 is below max_num_seqs 256" in bad.stderr and "decode" in bad.stderr, bad.stderr
    assert pdctl("plan", env={**env, "PDCTL_DECODE__MAX_NUM_SEQS": "200"}).returncode == 0
    assert pdctl("plan", env={k: v for k, v in env.items() if k != "PDCTL_DECODE__MAX_NUM_SEQS"}).returncode == 0


def test_the_proxy_runs_a_worker_per_four_cores_unless_set() -> None:
    """Unset, the planner sizes the proxy's workers for the cores pdctl may use (one per 4, at most 8: the plan is
    made on the node that runs it); [proxy] workers overrides it; a bad setting is refused in one line."""
    assert [default_workers(cores) for cores in (1, 2, 7, 8, 16, 33, 64, 256)] == [1, 1, 1, 2, 4, 8, 8, 8]
    env = {"PDCTL_INVENTORY": "sim:mi300x-8"}
    planned = json.loads(pdctl("plan", "--json", env=env).stdout)["proxy"]["workers"]
    assert planned == default_workers(len(os.sched_getaffinity(0)))
    one_core = subprocess.run(["taskset", "-c", str(min(os.sched_getaffinity(0))), sys.executable, "-m", "appliance",
                               "plan", "--json"], capture_output=True, text=True, timeout=60,
                              env={**{k: v for k, v in os.environ.items() if not k.startswith("PDCTL_")
                                      or k == "PDCTL_STATE_DIR"},
                                   "PDCTL_CONFIG": str(REPO / "etc" / "pdctl.toml"), **env})
    assert json.loads(one_core.stdout)["proxy"]["workers"] == 1, one_core.stderr
    r = pdctl("plan", env={**env, "PDCTL_PROXY__WORKERS": "3"})
    assert r.returncode == 0, r.stderr
    assert json.loads(pdctl("plan", "--json", env={**env, "PDCTL_PROXY__WORKERS": "3"}).stdout)["proxy"]["workers"] == 3
    assert any(line.startswith("proxy http://") and ", 3 workers" in line for line in r.stdout.splitlines()), r.stdout
    bad = pdctl("plan", env={**env, "PDCTL_PROXY__WORKERS": "0"})
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    assert bad.returncode == 2 and len(lines) == 1 and "PDCTL_PROXY__WORKERS" in lines[0], bad.stderr
