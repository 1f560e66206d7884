"""`pdctl bench --compare`: the shapes it plans, and a real run through `pdctl up/down` on simulated engines."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import tomllib

from appliance.bench.compare import shape_plan, shapes, to_toml
from appliance.bench.families import parse_name
from appliance.errors import PdctlError
from appliance.inventory import load_inventory
from appliance.node import Node
from appliance.plan import plan
from appliance.settings import Settings, load_settings
from tests.bench import PNG_MAGIC
from tests.support.pdctl import pdctl, write_config

pytestmark = pytest.mark.timeout(400)


def test_shapes_on_an_amd_node_split_the_same_eight_gpus() -> None:
    settings, inventory = load_settings(overrides={"engine": {"kind": "sim"}}), load_inventory("sim:mi300x-8")
    # The default: both disaggregated modes, and every colocated TP the 8 GPUs allow x three budgets.
    default = [s.name for s in shapes(settings, inventory)]
    assert default[:2] == ["disagg-read", "disagg-write"]
    assert default[2:] == [f"colocated-{n}-mbt{b}" for n in (8, 4, 2, 1) for b in (256, 512, 2048)]
    found = {
        s.name: s
        for s in shapes(settings, inventory, ["disagg-read", "disagg-write", "colocated-2", "colocated-1"])
    }
    assert list(found) == ["disagg-read", "disagg-write", "colocated-2", "colocated-1"]
    assert all(s.skipped is None for s in found.values())
    plans = {name: shape_plan(settings, inventory, s)[1] for name, s in found.items()}
    assert plans["disagg-read"].connector == "moriio" and plans["disagg-read"].mode == "read"
    assert plans["disagg-write"].mode == "write"
    gpus = {name: sorted(g for i in p.instances for g in i.gpus) for name, p in plans.items()}
    assert all(g == list(range(8)) for g in gpus.values()), gpus
    two = plans["colocated-2"]
    assert two.layout == "colocated" and [i.tp for i in two.instances] == [4, 4]
    assert two.proxy.routing == "round_robin"
    assert [i.tp for i in plans["colocated-1"].instances] == [8]
    # A budget reaches every instance's command line (the simulated engine's chunk size = vLLM's knob).
    (tuned,) = shapes(settings, inventory, ["colocated-2-mbt512"], [])
    argvs = [i.argv for i in shape_plan(settings, inventory, tuned)[1].instances]
    assert len(argvs) == 2 and all(a[a.index("--chunk-tokens") + 1] == "512" for a in argvs)
    assert "--chunk-tokens" not in plans["colocated-2"].instances[0].argv
    # A name without a budget means the engine's default, even when the settings file sets one.
    tuned_file = load_settings(overrides={"engine": {"kind": "sim"}, "colocated": {"max_num_batched_tokens": 999}})
    (untuned,) = shapes(tuned_file, inventory, ["colocated-2"])
    assert "--chunk-tokens" not in shape_plan(tuned_file, inventory, untuned)[1].instances[0].argv


def test_a_one_gpu_node_compares_its_colocated_shapes_and_skips_the_split() -> None:
    # One GPU cannot be split into a prefill and a decode: the colocated shapes still run on it, and
    # each disaggregated shape says why it is skipped rather than the whole comparison failing.
    settings, inventory = load_settings(overrides={"engine": {"kind": "sim"}}), load_inventory("sim:h200-1")
    found = {s.name: s for s in shapes(settings, inventory, ["disagg-read", "colocated"], [512, 2048])}
    assert list(found) == ["disagg-read", "colocated-1-mbt512", "colocated-1-mbt2048"]
    assert "prefill gets no GPU" in (found["disagg-read"].skipped or "")
    for name in ("colocated-1-mbt512", "colocated-1-mbt2048"):
        assert found[name].skipped is None
        deployed = shape_plan(settings, inventory, found[name])[1]
        assert [i.gpus for i in deployed.instances] == [[0]]


def test_write_is_skipped_where_the_connector_has_none() -> None:
    settings = load_settings(overrides={"engine": {"kind": "sim"}})
    found = {s.name: s for s in shapes(settings, load_inventory("sim:cpu"))}
    assert found["disagg-write"].skipped == "connector 'example' has no write mode (it supports read)"
    # NIXL pushes on NVIDIA (vLLM's NixlPushConnector): its WRITE shape is swept
    assert {s.name: s for s in shapes(settings, load_inventory("sim:h200-8"))}["disagg-write"].skipped is None
    cpu = {s.name: s for s in shapes(settings, load_inventory("sim:cpu"), ["disagg-read", "colocated"], [None])}
    counts = {
        n: len(shape_plan(settings, load_inventory("sim:cpu"), cpu[n])[1].instances)
        for n in ("disagg-read", "colocated-2", "colocated-1")
    }
    assert counts == {"disagg-read": 2, "colocated-2": 2, "colocated-1": 1}
    for bad in ("colocated-x", "colocated-2-mbt0", "disagg-push", "disagg-read-mbt0", "disagg-read-mbt-conditional"):
        with pytest.raises(PdctlError, match="unknown shape"):
            shapes(settings, load_inventory("sim:cpu"), [bad])


def test_a_conditional_shape_is_the_same_split_with_the_planners_threshold() -> None:
    settings = load_settings(overrides={"engine": {"kind": "sim"}})
    inventory = load_inventory("sim:h200-2")
    found = {s.name: s for s in shapes(settings, inventory, ["disagg-read", "disagg-read-conditional"])}
    plain, conditional = (shape_plan(settings, inventory, found[n])[1] for n in ("disagg-read", "disagg-read-conditional"))
    assert [i.gpus for i in conditional.instances] == [i.gpus for i in plain.instances] == [[0], [1]]
    assert plain.proxy.decode_only_below is None  # every prompt handed over
    assert conditional.proxy.decode_only_below == 1497  # the sim's time model (tests/test_settings.py)
    assert "conditional routing" in found["disagg-read-conditional"].description


def test_a_disaggregated_shape_with_a_budget_sets_the_decodes_and_the_proxy_reads_it() -> None:
    # the settings file's decode budget is not the shape's: without -mbtB, vLLM's default (as colocated)
    settings = load_settings(overrides={"engine": {"kind": "sim"}, "decode": {"max_num_batched_tokens": 4096}})
    inventory = load_inventory("sim:h200-2")
    names = ["disagg-read", "disagg-read-conditional-mbt200", "disagg-write-mbt512"]
    found = {s.name: s for s in shapes(settings, inventory, names)}
    plans = {n: shape_plan(settings, inventory, found[n])[1] for n in names}
    decode = {n: next(i for i in p.instances if i.role == "decode") for n, p in plans.items()}
    assert [found[n].skipped for n in names] == [None, None, None]
    assert "--chunk-tokens" not in decode["disagg-read"].argv and plans["disagg-read"].proxy.decode_budget is None
    argv = decode["disagg-read-conditional-mbt200"].argv
    assert argv[argv.index("--chunk-tokens") + 1] == "200"  # the simulated engine's max_num_batched_tokens
    proxy = plans["disagg-read-conditional-mbt200"].proxy
    assert (proxy.decode_budget, proxy.decode_only_below, proxy.decode_only_queue_ms) == (200, 1497, 250.0)
    assert plans["disagg-write-mbt512"].proxy.decode_budget == 512 and plans["disagg-write-mbt512"].mode == "write"
    assert "decode max_num_batched_tokens 200" in found["disagg-read-conditional-mbt200"].description
    parsed = parse_name("disagg-read-conditional-mbt200")
    assert parsed is not None and (parsed.family, parsed.mode, parsed.conditional, parsed.budget) == (
        "disaggregated", "read", True, 200)
    assert parsed.knob == "READ, conditional, decode max_num_batched_tokens 200"
    # a CPU node prefills every prompt whole: a decode budget below max_model_len is refused, the shape skipped
    cpu = load_settings(overrides={"engine": {"kind": "vllm"}})
    skipped = shapes(cpu, load_inventory("sim:cpu"), ["disagg-read-mbt64"])[0].skipped
    assert skipped is not None and "max_num_batched_tokens 64 is below max_model_len" in skipped


def test_shape_settings_file_reads_back_as_the_same_settings() -> None:
    settings = load_settings(
        overrides={
            "engine": {"kind": "sim", "env": {"A B": "1"}},
            "connector": {"extra_config": {"x": 1}},
            "colocated": {"gpus": [0, 1]},
        }
    )
    text = to_toml(settings)
    # Values only: a settings object also remembers where each value came from (flag, file), which differs.
    assert Settings.model_validate(tomllib.loads(text)).model_dump() == settings.model_dump()


def test_compare_through_pdctl_up_and_down_on_a_rebalanced_node(tmp_path: Path) -> None:
    """Each shape is deployed as the shape says, whatever layout.json holds; the layout stays in force after."""
    config = write_config(tmp_path, tmp_path / "state", extra="[engine.sim]\nprefill_us_per_token = 100\n")
    settings = load_settings(config)
    # A rebalance left this node with two decode instances (Node.record_layout, as `pdctl rebalance` writes it).
    Node(settings).record_layout(plan(load_settings(config, {"decode": {"instances": 2}}), load_inventory("sim:cpu")))
    recorded = (tmp_path / "state" / "layout.json").read_text()
    done = pdctl(config, "bench", "--compare", "--shapes", "colocated-2,disagg-write,disagg-read", "--rates", "3",
                 "--lifetimes", "0", "-n", "6", "--input-len", "200", "--output-len", "16",
                 "--out", str(tmp_path / "out"), timeout=400, check=True)
    data = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert data["engine"] == "sim" and not data["interrupted"]
    by_name = {s["name"]: s for s in data["shapes"]}
    assert list(by_name) == ["colocated-2", "disagg-write", "disagg-read"]
    assert by_name["disagg-write"]["skipped"] and not by_name["disagg-write"]["rates"]
    for name in ("disagg-read", "colocated-2"):
        (rate,) = by_name[name]["rates"]
        assert by_name[name]["url"] == f"http://127.0.0.1:{settings.proxy.port}"
        assert rate["summary"]["sent"] == 6 and rate["summary"]["succeeded"] == 6, (name, done.stderr[-3000:])
    for png in ("attainment.png", "latency.png"):
        assert (tmp_path / "out" / png).read_bytes()[:8] == PNG_MAGIC
    # Each shape ran from its own settings file, as the shape says: the last one (disagg-read) deployed one
    # prefill and one decode, not the recorded layout's two decodes.
    deployed = json.loads((tmp_path / "state" / "plan.json").read_text())
    assert [i["name"] for i in deployed["instances"]] == ["prefill-0", "decode-0"], deployed["instances"]
    shape_file = tomllib.loads((tmp_path / "state" / "bench" / "colocated-2.toml").read_text())
    assert shape_file["colocated"]["instances"] == 2 and shape_file["connector"]["name"] == "none"
    colocated = settings.colocated.http_port
    for port in (settings.proxy.port, colocated, colocated + 1):
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0, f"something still listens on {port}"  # torn down
    # The rebalanced layout is still recorded and in force: `pdctl plan` (and so `pdctl up`) applies it.
    assert (tmp_path / "state" / "layout.json").read_text() == recorded
    after = json.loads(pdctl(config, "plan", "--json", check=True).stdout)
    assert [i["name"] for i in after["instances"]] == ["prefill-0", "decode-0", "decode-1"]
    # What each shape's `pdctl up --ignore-layout` planned, and says so.
    shown = pdctl(config, "plan", "--ignore-layout", check=True).stdout
    assert "decode-0" in shown and "decode-1" not in shown and "layout.json (pdctl rebalance) ignored" in shown


def test_compare_names_the_tuned_colocated_budget_that_won(tmp_path: Path) -> None:
    # A 300-token prefill costs 60 ms: unchunked it stalls every running stream past the 40 ms ITL target;
    # in 64-token chunks (13 ms each) it does not. The tuned colocated shape must win, and be named.
    config = write_config(tmp_path, tmp_path / "state",
                          extra="[engine.sim]\nprefill_us_per_token = 200\ndecode_step_ms = 4\n")
    done = pdctl(config, "bench", "--compare", "--deploy", "processes", "--shapes",
                 "disagg-read,colocated-1,colocated-1-mbt64", "--rates", "4", "--lifetimes", "0", "-n", "10",
                 "--input-len", "300", "--output-len", "24", "--itl-ms", "40", "--no-plots",
                 "--out", str(tmp_path / "out"), timeout=400, check=True)
    data = json.loads((tmp_path / "out" / "bench.json").read_text())
    by_name = {s["name"]: s for s in data["shapes"]}
    assert list(by_name) == ["disagg-read", "colocated-1", "colocated-1-mbt64"]
    assert by_name["colocated-1-mbt64"]["goodput"]["p99"] == 4.0, done.stderr[-4000:]
    assert by_name["colocated-1"]["goodput"]["p99"] is None, done.stderr[-4000:]
    # The result and the report's family table say which colocated knob won under the run's judgement.
    best = data["best"]["p99"]["colocated"]
    assert best["names"] == ["colocated-1-mbt64"] and best["knobs"] == ["max_num_batched_tokens 64, 1 inst."]
    assert best["goodput"] == 4.0 and best["lower_bound"]
    assert data["best"]["p99"]["disaggregated"]["names"] == ["disagg-read"]
    row = next(line for line in done.stderr.splitlines() if line.startswith("│ p99 (run)"))
    assert "colocated-1-mbt64" in row and "max_num_batched_tokens 64" in row, done.stderr[-4000:]
