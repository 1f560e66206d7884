"""The routing state the proxy's worker processes share (appliance.proxy.columns, docs/proxy-workers.md): each
worker's own columns of legs (DP ranks included) and the decode queues they all change under one lock, here as
two workers' views of one peers folder in one process."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.connector import get_connector
from appliance.proxy.columns import RING, Columns, Queues, SharedBacklog, SharedWindow
from appliance.proxy.instances import BackendState, InstanceRegistry
from appliance.proxy.policies import RequestFacts
from appliance.proxy.policies.conditional import PrefillBacklog, PrefillWindow, Rules
from appliance.proxy.policies.least_outstanding import LeastOutstanding
from appliance.proxy.route import Router


def _instance(name: str, role: str = "decode", dp_size: int = 1) -> BackendState:
    inst = BackendState(name, role, "http://127.0.0.1:9000", connect_timeout=1.0, dp_size=dp_size)
    inst.healthy = True
    return inst


def test_a_dp_rank_pick_counts_the_other_workers_legs_on_each_rank(tmp_path: Path) -> None:
    """Worker 0 runs a leg on rank 0 of a DP-2 decode: worker 1 picks rank 1 (each worker alone counted its own
    legs and picked rank 0, its first turn); once the leg ends, rank 0 is worker 1's turn again."""
    mine, theirs = _instance("decode-0", dp_size=2), _instance("decode-0", dp_size=2)
    mine.share(Columns(tmp_path, 0, 0, 2))
    theirs.share(Columns(tmp_path, 0, 1, 2))
    lease = mine.lease(mine.pick_rank())
    assert lease.rank == 0 and theirs.load() == 1
    assert theirs.pick_rank() == 1
    lease.end()
    theirs.dp_next = 0
    assert theirs.pick_rank() == 0 and theirs.load() == 0


def _router(tmp_path: Path, rules: Rules) -> Router:
    """One worker's router over a prefill and a decode, its decode queues in the peers folder `tmp_path`."""
    registry = InstanceRegistry(1.0)
    for inst in (_instance("prefill-0", "prefill"), _instance("decode-0")):
        registry.instances[inst.name] = inst
        registry.by_role[inst.role].append(inst)
    router = Router(registry, LeastOutstanding(), lambda: "read", get_connector("nixl"), rules)
    router.queues = Queues(tmp_path, 0)
    return router


def _tokens(n: int) -> RequestFacts:
    return RequestFacts("/v1/completions", {"model": "m", "prompt": list(range(1, n + 1))})


def test_a_decodes_window_counts_every_workers_short_prompts(tmp_path: Path) -> None:
    """A room of 16 tokens a minute on the decode: 10 tokens through one worker, then 10 through the other take
    the prefill hop (before: each worker's window held its own 10 alone, and both went to the decode)."""
    rules = Rules(decode_only_below=16, prefill_saturated_at=0, window_s=60.0)
    first, second = _router(tmp_path, rules), _router(tmp_path, rules)
    for router in (first, second):  # a leg on each one's decode (as the shared loads would say)
        router.registry.instances["decode-0"].in_flight = 1
    assert (first.route(_tokens(10)).name, second.route(_tokens(10)).name) == ("decode-only", "disaggregated")


def test_a_decodes_backlog_counts_every_workers_prompts(tmp_path: Path) -> None:
    """A decode of a 16-token chunk a step with a leg running: 10 tokens queued through one worker leave room
    for 5 more through the other, not 10."""
    rules = Rules(decode_only_below=17, prefill_saturated_at=0, window_s=600.0, decode_budget=17)
    first, second = _router(tmp_path, rules), _router(tmp_path, rules)
    for router in (first, second):
        router.registry.instances["decode-0"].in_flight = 1
    assert first.route(_tokens(10)).name == "decode-only"
    assert second.route(_tokens(10)).name == "disaggregated"
    assert second.route(_tokens(5)).name == "decode-only"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 0.2), st.integers(-3, 50), st.floats(0, 2000)), max_size=3 * RING))
def test_the_shared_window_and_backlog_read_as_the_local_ones(sent: list[tuple[float, int, float]]) -> None:
    """One worker's prompts (gaps, tokens, drain rate) read the same from the shared cell as from a
    PrefillWindow and a PrefillBacklog; once RING prompts were in a window at once the shared window counts
    more, never less (its oldest are added to its newest)."""
    with tempfile.TemporaryDirectory() as folder:
        queues = Queues(Path(folder), 0)
        offset = queues.cell("decode-0")
        window_s = 0.5
        shared_window, shared_backlog = SharedWindow(queues, offset, window_s), SharedBacklog(queues, offset)
        window, backlog = PrefillWindow(), PrefillBacklog()
        now, adds, merged = 1000.0, [], False
        for gap, tokens, rate in sent:
            now += gap
            merged = merged or (tokens > 0 and sum(1 for when, n in adds if n > 0 and when > now - window_s) >= RING)
            window.add(now, tokens)
            shared_window.add(now, tokens)
            backlog.add(now, tokens, rate)
            shared_backlog.add(now, tokens, rate)
            adds.append((now, tokens))
            assert shared_backlog.level(now, rate) == backlog.level(now, rate)
            if not merged:
                assert shared_window.recent(now, window_s) == window.recent(now, window_s)
            else:
                assert shared_window.recent(now, window_s) >= window.recent(now, window_s)
