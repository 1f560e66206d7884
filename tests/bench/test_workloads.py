"""Workloads: files and built-in mixes replayed by `pdctl bench`, and the route each request took.

End to end against the real proxy and a simulated engine (tests/bench/conftest.py); the prompts' token ids are
checked where they arrive, at a real aiohttp server (tests/bench/test_client.VllmShapedServer).
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from rich.console import Console

from appliance.bench.analysis import Slo
from appliance.bench.loadgen import RateRun, Target, parse_route, request_count, run_rate, workload_requests
from appliance.bench.mixes import MultiTurn, parse_mix
from appliance.bench.plots import plot_latency
from appliance.bench.report import print_report
from appliance.bench.results import BenchResult, ShapeResult, Workload
from appliance.bench.trace import TRACE_BLOCK_TOKENS, build_prompts, parse_workload
from appliance.errors import PdctlError
from tests.bench import PNG_MAGIC
from tests.bench.test_loadgen import VllmShapedServer
from tests.support.pdctl import pdctl_in

pytestmark = pytest.mark.timeout(240)

GOOD = '{"arrival_s": 0, "input_len": 5, "output_len": 2}'


@pytest.mark.parametrize(
    ("lines", "bad", "says"),
    [
        ([GOOD, "{not json"], 2, "not JSON"),
        ([GOOD, "[1, 2]"], 2, "a JSON object is expected"),
        (['{"input_len": 5, "output_len": 2, "colour": "red"}'], 1, "colour"),
        ([GOOD, "", '{"arrival_s": 1, "input_len": 0, "output_len": 2}'], 3, "input_len"),
        (['{"arrival_s": 1, "timestamp": 1000, "input_len": 5, "output_len": 2}'], 1, "not both"),
        ([GOOD, '{"input_len": 5, "output_len": 2}'], 2, "every line or none"),
        (['{"arrival_s": 2, "input_len": 5, "output_len": 2}', GOOD], 2, "sort the file"),
        (['{"input_len": 5, "output_len": 2, "conversation": "c", "turn": 2}'], 1, "turn 1 comes next"),
        (['{"prompt": "hi", "output_len": 2, "prefix_group": "g"}'], 1, "literal prompt"),
        (['{"input_len": 5, "output_len": 2, "prefix_group": "g", "prefix_len": 6}'], 1, "longer than"),
        (['{"input_len": 5}'], 1, "output_len"),
        (['{"input_length": 5, "output_length": 2, "hash_ids": [0, -1]}'], 1, "non-negative"),
        (['{"arrival_s": NaN, "input_len": 5, "output_len": 2}'], 1, "arrival_s"),
        (['{"input_len": 1048577, "output_len": 2}'], 1, "input_len"),
        (['{"input_length": 5, "output_length": 2, "hash_ids": ' + json.dumps(list(range(2049))) + "}"], 1, "hash_ids"),
        ([json.dumps({"input_len": 600_000, "output_len": 1, "conversation": "c", "turn": t}) for t in (1, 2)], 2,
         "1200001 prompt tokens"),
    ],
)
def test_a_bad_line_is_refused_with_its_number(lines: list[str], bad: int, says: str) -> None:
    with pytest.raises(PdctlError) as err:
        parse_workload(lines, "w.jsonl", 100)
    assert str(err.value).startswith(f"w.jsonl line {bad}: "), str(err.value)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_file_longer_than_max_requests_or_empty_is_refused() -> None:
    with pytest.raises(PdctlError, match="more than 2 requests"):
        parse_workload([GOOD] * 3, "w.jsonl", 2)
    with pytest.raises(PdctlError, match="has no request"):
        parse_workload(["", "  "], "w.jsonl", 2)


def test_mooncake_lines_share_their_hash_blocks() -> None:
    lines = [
        '{"timestamp": 0, "input_length": 1100, "output_length": 3, "hash_ids": [0, 1, 2]}',
        '{"timestamp": 1500, "input_length": 700, "output_length": 4, "hash_ids": [0, 3]}',
        '{"timestamp": 1500, "input_length": 1600, "output_length": 5, "hash_ids": [0, 1, 2]}',
    ]
    trace = parse_workload(lines, "t.jsonl", 10)
    assert trace.timed and [r.arrival_s for r in trace.requests] == [0, 1.5, 1.5]
    assert [r.output_len for r in trace.requests] == [3, 4, 5] and trace.rate == 1.33
    a, b, c = build_prompts(trace.requests, "tokens", (10, 5000), seed=1)
    assert [len(p) for p in (a, b, c)] == [1100, 700, 1600]
    block = TRACE_BLOCK_TOKENS
    assert a[:block] == b[:block] and a[block : 2 * block] != b[block : 2 * block]
    assert a[:1100] == c[:1100]  # the same blocks, cut to each input length
    assert len(set(c[3 * block :]) & set(a)) < 100  # past the blocks: its own tokens


def test_an_untimed_file_sends_each_line_once_per_rate() -> None:
    untimed = parse_workload(['{"input_len": 5, "output_len": 2}'] * 7, "w", 10)
    target = Target("http://x", "m", input_len=40, output_len=8, workload=untimed)
    assert not untimed.timed and request_count(RateRun(3.0, 50, seed=1), target) == 7
    assert request_count(RateRun(3.0, 50, seed=1), Target("http://x", "m", 40, 8)) == 50


def test_prefix_groups_share_exactly_their_prefix() -> None:
    lines = [json.dumps({"input_len": 40, "output_len": 1, "prefix_group": g, "prefix_len": n})
             for g, n in (("a", 30), ("b", 30), ("a", 35), ("a", 10))]
    p = build_prompts(parse_workload(lines, "w", 10).requests, "tokens", (10, 100_000), seed=3)
    assert p[0][:30] == p[2][:30] and p[3][:10] == p[0][:10]
    assert p[0][30:] != p[2][30:] and p[0][:30] != p[1][:30]
    words = build_prompts(parse_workload(lines, "w", 10).requests, "words", (10, 100_000), seed=3)
    assert isinstance(words[0], str) and words[0].split()[:30] == str(words[2]).split()[:30]


def _mix_draw(spec: str, seed: int, count: int = 12) -> tuple[list[Any], list[Any]]:
    rng = random.Random(seed)
    target = Target("http://x", "m", input_len=40, output_len=8, token_range=(10, 5000), workload=parse_mix(spec))
    assert target.workload is not None
    asked = workload_requests(target, target.workload, count, rng)
    return asked, build_prompts(asked, "tokens", target.token_range, seed)


@pytest.mark.parametrize("spec", ["shared-prefix", "multi-turn", "mixed-lengths", "shared-prefix:groups=2,prefix=0.5"])
def test_a_mix_is_the_same_for_a_seed_and_differs_across_seeds(spec: str) -> None:
    assert _mix_draw(spec, 5) == _mix_draw(spec, 5)
    assert _mix_draw(spec, 5)[1] != _mix_draw(spec, 6)[1]


def test_mixes_say_what_they_are() -> None:
    shared, prompts = _mix_draw("shared-prefix:groups=2,prefix=0.5", 1, 30)
    assert {r.prefix_group for r in shared} == {"group-0", "group-1"}
    for r, p in zip(shared, prompts, strict=True):
        same = [q for s, q in zip(shared, prompts, strict=True) if s.prefix_group == r.prefix_group]
        assert all(q[:20] == p[:20] for q in same) and len(p) == 40
    mixed, prompts = _mix_draw("mixed-lengths:long=0.5", 1, 40)
    assert {len(p) for p in prompts} == {4, 40}


def test_multi_turn_prompts_resend_the_conversation_so_far() -> None:
    asked, prompts = _mix_draw("multi-turn:turns=3", 9, 7)  # 3 conversations; the last has one turn only
    assert [(r.conversation, r.turn) for r in asked] == [
        ("conv-0", 1), ("conv-1", 1), ("conv-2", 1), ("conv-0", 2), ("conv-1", 2), ("conv-2", 2), ("conv-0", 3)]
    by_conv: dict[str, list[tuple[int, ...]]] = {}
    for r, p in zip(asked, prompts, strict=True):
        by_conv.setdefault(str(r.conversation), []).append(tuple(p))
    for turns in by_conv.values():
        for earlier, later in zip(turns, turns[1:], strict=False):
            # earlier prompt + its answer (8 stand-in tokens) + 10 new tokens (0.25 x 40)
            assert later[: len(earlier)] == earlier and len(later) == len(earlier) + 8 + 10
    assert by_conv["conv-0"][0][:5] != by_conv["conv-1"][0][:5]


@pytest.mark.parametrize(
    ("spec", "says"),
    [("shared-prefix:groups=0", "groups"), ("multi-turn:turns", "key=value"), ("mixed-lengths:size=3", "size"),
     ("shared-prefix:prefix=2", "prefix")],
)
def test_a_bad_mix_is_refused(spec: str, says: str) -> None:
    with pytest.raises(PdctlError, match=says):
        parse_mix(spec)


@pytest.mark.parametrize(
    ("header", "route", "instances"),
    [
        (None, "unknown", {}),
        ("", "unknown", {}),
        ("colocated", "colocated", {}),
        ("disaggregated; prefill=prefill-0; decode=decode-1", "disaggregated",
         {"prefill": "prefill-0", "decode": "decode-1"}),
        ("decode-only;decode=decode-0", "decode-only", {"decode": "decode-0"}),
        ("<script>", "unknown", {}),
        ("colocated; both", "unknown", {}),
        ("colocated; both=" + "x" * 65, "unknown", {}),
        ("a b", "unknown", {}),
    ],
)
def test_the_route_header_is_read_or_unknown(header: str | None, route: str, instances: dict[str, str]) -> None:
    assert parse_route(header) == (route, instances)


async def _multi_turn_against(server: VllmShapedServer) -> Any:
    target = Target(base_url=server.url, model="m1", input_len=16, output_len=3, token_range=(5, 50),
                    workload=MultiTurn(turns=3))
    async with aiohttp.ClientSession() as session:
        return await run_rate(session, target, RateRun(40.0, 6, seed=2), Slo(ttft_ms=1000, itl_ms=50),
                              asyncio.Event())


def test_multi_turn_token_ids_reach_the_server_sharing_their_prefix_and_routes_are_recorded(tmp_path: Path) -> None:
    routes = ("disaggregated; prefill=prefill-0; decode=decode-0", "decode-only; decode=decode-1")
    with_routes = VllmShapedServer([(0.01, 1)] * 3, continuous_usage=True, routes=routes)

    async def go() -> Any:
        async with with_routes as server:
            return await _multi_turn_against(server)

    rate = asyncio.run(go())
    by_id = {r.request_id: r for r in rate.requests}
    bodies = dict(zip(with_routes.ids, with_routes.bodies, strict=True))
    conv: dict[str, list[list[int]]] = {}
    for rid, body in bodies.items():
        r = by_id[rid]
        assert body["max_tokens"] == 3
        conv.setdefault(str(r.conversation), []).insert(int(r.turn or 0) - 1, body["prompt"])
    assert sorted(conv) == ["conv-0", "conv-1"]
    for prompts in conv.values():
        assert [len(p) for p in prompts] == [16, 16 + 3 + 4, 16 + 2 * (3 + 4)]
        assert prompts[1][:16] == prompts[0] and prompts[2][:23] == prompts[1]
    assert {r.route for r in rate.requests} == {"disaggregated", "decode-only"}
    assert {tuple(sorted(r.route_instances.values())) for r in rate.requests} == {("decode-0", "prefill-0"),
                                                                                  ("decode-1",)}
    result = BenchResult(created="now", command="pdctl bench", engine="unknown",
                         workload=Workload(model="m1", input_len=16, output_len=3, num_requests=6, rates=[40.0],
                                           seed=2, prompt="tokens", workload="multi-turn:turns=3"),
                         slo=Slo(ttft_ms=1000, itl_ms=50), shapes=[ShapeResult(name="target", rates=[rate])])
    console = Console(record=True, width=200)
    print_report(result, console)
    text = console.export_text()
    assert "by route" in text and "decode-only" in text and "disaggregated" in text
    figure = plot_latency(result, tmp_path / "latency.png", 40.0)
    assert figure is not None and figure.read_bytes()[:8] == PNG_MAGIC


def _bench(url: str, tmp_path: Path, *args: str, check: bool = True) -> Any:
    return pdctl_in("bench", "--url", url, "--engine", "sim", "--no-plots", "--warmup", "0", "--out", "out",
                    *args, cwd=tmp_path, check=check)


def test_a_timed_file_is_replayed_in_order_never_early(deployment: str, tmp_path: Path) -> None:
    lines = [
        {"arrival_s": 0.0, "input_len": 40, "output_len": 3, "prefix_group": "sys-a", "prefix_len": 30},
        {"arrival_s": 0.25, "input_len": 60, "output_len": 5, "conversation": "c1", "turn": 1},
        {"arrival_s": 0.5, "input_len": 40, "output_len": 4, "prefix_group": "sys-a", "prefix_len": 30},
        {"arrival_s": 0.5, "prompt": "hello there", "output_len": 2},
        {"arrival_s": 1.0, "input_len": 10, "output_len": 6, "conversation": "c1", "turn": 2},
        {"timestamp": 1400, "input_length": 20, "output_length": 2, "hash_ids": [0]},
    ]
    (tmp_path / "w.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    done = _bench(deployment, tmp_path, "--workload", "w.jsonl")
    data = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert data["workload"]["workload"] == "w.jsonl" and data["workload"]["arrivals"] == "file"
    (rate,) = data["shapes"][0]["rates"]
    reqs = sorted(rate["requests"], key=lambda r: r["index"])
    assert [r["scheduled_s"] for r in reqs] == [0.0, 0.25, 0.5, 0.5, 1.0, 1.4]
    assert all(r["sent_s"] >= r["scheduled_s"] for r in reqs)  # the scheduler's contract: never early
    distinct = [r for r in reqs if r["index"] != 3]  # 2 and 3 share an arrival time: either may go first
    assert [r["index"] for r in sorted(distinct, key=lambda r: r["sent_s"])] == [0, 1, 2, 4, 5]
    assert all(r["success"] for r in reqs), done.stderr
    assert [r["output_tokens"] for r in reqs] == [3, 5, 4, 2, 6, 2]
    assert [r["prompt_tokens"] for r in reqs][:3] == [40, 60, 40] and reqs[4]["prompt_tokens"] == 60 + 5 + 10
    assert [(r["prefix_group"], r["conversation"], r["turn"]) for r in reqs] == [
        ("sys-a", None, None), (None, "c1", 1), ("sys-a", None, None), (None, None, None), (None, "c1", 2),
        (None, None, None)]
    # the proxy's x-pdctl-route header, which the bench asks for, recorded per request (one route: no "by route"
    # table); a proxy without API keys names no instance to its (unauthenticated) clients
    assert {r["route"] for r in reqs} == {"colocated"} and all(r["route_instances"] == {} for r in reqs)
    assert "by route" not in done.stderr and "workload w.jsonl, the file's arrival times" in done.stderr


def test_a_bad_file_fails_in_one_line_with_its_line_number(deployment: str, tmp_path: Path) -> None:
    (tmp_path / "w.jsonl").write_text(GOOD + "\n" + '{"arrival_s": 1, "input_len": -3, "output_len": 2}\n')
    done = _bench(deployment, tmp_path, "--workload", "w.jsonl", check=False)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "w.jsonl line 2: input_len" in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()
    (tmp_path / "t.jsonl").write_text(GOOD + "\n")
    timed = _bench(deployment, tmp_path, "--workload", "t.jsonl", "--rates", "2", check=False)
    assert timed.returncode != 0 and "--rates does not apply" in timed.stderr and "Traceback" not in timed.stderr
    missing = _bench(deployment, tmp_path, "--workload", "nope.jsonl", check=False)
    assert "'nope.jsonl' is neither a file nor a built-in mix" in missing.stderr and "Traceback" not in missing.stderr
    # a model name rich would read as markup is printed as written (the proxy then refuses the name)
    model = _bench(deployment, tmp_path, "--model", "[/m]", "--rates", "1", "-n", "1", "--lifetimes", "0",
                   "--input-len", "4", "--output-len", "2", check=False)
    assert "([/m]'s vocabulary is unknown" in model.stderr and "Traceback" not in model.stderr, model.stderr


def test_a_mix_through_the_proxy_is_deterministic_for_a_seed(deployment: str, tmp_path: Path) -> None:
    def run(out: str) -> list[tuple[Any, ...]]:
        # a label rich would read as markup: the progress bar and the tables print it as written
        done = _bench(deployment, tmp_path, "--workload", "multi-turn:turns=3", "--rates", "8", "--lifetimes", "0",
                      "-n", "9", "--input-len", "20", "--output-len", "4", "--seed", "4", "--out", out,
                      "--label", "[/lab]")
        assert "[/lab]" in done.stderr and "Traceback" not in done.stderr
        (shape,) = json.loads((tmp_path / out / "bench.json").read_text())["shapes"]
        assert shape["name"] == "[/lab]"
        (rate,) = shape["rates"]
        return [(r["conversation"], r["turn"], r["prompt_tokens"], r["scheduled_s"]) for r in rate["requests"]]

    first = run("a")
    assert first == run("b")
    assert [t[2] for t in first] == [20] * 3 + [20 + 4 + 5] * 3 + [20 + 2 * (4 + 5)] * 3
    assert {t[0] for t in first} == {"conv-0", "conv-1", "conv-2"}


def test_a_workload_name_with_brackets_is_printed_as_written() -> None:
    # rich reads [..] as markup: a file named so must neither raise nor be restyled in the method line.
    result = BenchResult(created="now", command="pdctl bench", engine="unknown",
                         workload=Workload(model="m1", input_len=16, output_len=3, num_requests=1, rates=[1.0],
                                           seed=2, prompt="tokens", workload="w[/x][bold].jsonl", arrivals="file"),
                         slo=Slo(ttft_ms=1000, itl_ms=50), shapes=[])
    console = Console(record=True, width=200)
    print_report(result, console)
    assert "workload w[/x][bold].jsonl, the file's arrival times" in console.export_text()


def test_a_node_with_keys_by_name_needs_the_key_to_send(tmp_path: Path) -> None:
    """A node whose API takes the keys of api_keys_file: `pdctl bench` against it must be told which key to send
    (it is one client among them), in one line, before it deploys or writes anything."""
    (tmp_path / "pdctl.toml").write_text(f'state_dir = {json.dumps(str(tmp_path / "state"))}\n[engine]\nkind = "sim"\n'
                                         '[proxy]\napi_keys_file = "/nonexistent/keys.toml"\n')
    done = pdctl_in("bench", "--engine", "sim", "--no-plots", "--out", "out", cwd=tmp_path, check=False)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode != 0 and "--api-key-file" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert len([line for line in lines if "api_keys_file" in line or "keys.toml" in line]) == 1, done.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "state").exists()
