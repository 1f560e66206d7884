"""Every parser of outside input costs time linear in its input (issue 36): hypothesis draws a piece of input, the
test repeats it to n and to 8n bytes and compares the CPU time each costs. Linear work costs ~8 times more at 8n,
quadratic work ~64 times: the bound, 24, tells them apart with room for noise. The time is this thread's CPU
time (not the wall clock: a loaded machine slows both sizes alike, it does not stretch one of them), the least
of a few runs, and anything under a tenth of a millisecond counts as that much."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import Callable
from typing import Any

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from appliance.bench.trace import parse_workload
from appliance.errors import PdctlError
from appliance.proxy import kv_events
from appliance.proxy.body import BodyRules, check_body
from appliance.proxy.guard import STRING, json_too_deep, lone_surrogate
from appliance.proxy.kv_events import BadMessage
from tests.proxy.test_upstream import OK_CHUNKED, scripted, settle

LINEAR = settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
# linear work grows 8x from n to 8n, quadratic 64x
MOST_GROWTH = 24
FLOOR_S = 1e-4
N = 4096  # the smaller size: 4 KiB was already 50 ms for the quadratic scan, 32 KiB 3 s
RULES = BodyRules(model="m", max_tokens_limit=4096, max_json_depth=64, max_json_values=1_000_000, max_n=128,
                  max_model_len=None)

# the bytes that steer a JSON scanner: quotes, escapes, brackets, separators, surrogate escapes
PIECES = [b'"', b"\\", b'\\"', b"[", b"]", b"{", b"}", b",", b":", b"0", b"a", b" ", b"\\u", b"d800", b"\\ud800",
          b"\n", b"\xff", b"1e9", b"-", b"."]
JSONISH = st.lists(st.sampled_from(PIECES), min_size=1, max_size=12).map(b"".join)
PREFIXES = st.sampled_from([b"", b"[" * 65, b'{"prompt": "', b'{"prompt": [', b"{" * 70])


def cpu_cost(parse: Callable[[Any], object], value: Any) -> float:
    """The least CPU time of three runs of `parse(value)`, in seconds (FLOOR_S at least)."""
    best = math.inf
    for _ in range(3):
        start = time.thread_time()
        parse(value)
        best = min(best, time.thread_time() - start)
    return max(best, FLOOR_S)


def assert_linear(parse: Callable[[Any], object], make: Callable[[int], Any]) -> None:
    """`parse` of `make(8n)` costs less than MOST_GROWTH times `parse` of `make(n)`."""
    small, large = cpu_cost(parse, make(N)), cpu_cost(parse, make(8 * N))
    assert large < MOST_GROWTH * small, f"{small * 1e3:.2f} ms at {N} bytes, {large * 1e3:.2f} ms at {8 * N}"


def repeated(prefix: bytes, unit: bytes) -> Callable[[int], bytes]:
    """Input of `prefix` then `unit` again and again, n bytes in all."""
    return lambda n: prefix + (unit * (n // len(unit) + 1))[: max(0, n - len(prefix))]


def test_the_quadratic_body_of_issue_36_is_linear() -> None:
    """The finding itself: 65 brackets, then `\\"` again and again (a string that never ends)."""
    assert_linear(lambda raw: json_too_deep(raw, 64), repeated(b"[" * 65, b'\\"'))
    assert_linear(lambda raw: check_body(raw, False, RULES), repeated(b"[" * 65, b'\\"'))


@LINEAR
@given(PREFIXES, JSONISH)
def test_the_string_scan_is_linear(prefix: bytes, unit: bytes) -> None:
    assert_linear(lambda raw: STRING.sub(b"", raw), repeated(prefix, unit))


@LINEAR
@given(PREFIXES, JSONISH)
def test_the_string_pattern_matches_at_every_quote_it_is_tried_at(prefix: bytes, unit: bytes) -> None:
    """Why the scan is one pass: outside a string, every quote starts a match (to the string's end, or the text's),
    so re.sub never fails at a quote and starts over at the next one."""
    raw = repeated(prefix, unit)(512)
    pos = 0
    while (quote := raw.find(b'"', pos)) >= 0:
        match = STRING.match(raw, quote)
        assert match is not None, (raw, quote)
        pos = match.end()


@LINEAR
@given(PREFIXES, JSONISH)
def test_the_nesting_bound_is_linear(prefix: bytes, unit: bytes) -> None:
    assert_linear(lambda raw: json_too_deep(raw, 64), repeated(prefix, unit))


@LINEAR
@given(PREFIXES, JSONISH)
def test_the_whole_body_check_is_linear(prefix: bytes, unit: bytes) -> None:
    """Counting values, the nesting bound, json, the fields and the surrogate check (what the worker and the
    event loop run for a client's body; the admin API runs the same door on its bodies)."""
    assert_linear(lambda raw: check_body(raw, False, RULES), repeated(prefix, unit))


@LINEAR
@given(st.lists(st.text(max_size=8), min_size=1, max_size=6))
def test_the_surrogate_check_is_linear(words: list[str]) -> None:
    def make(n: int) -> tuple[bytes, Any]:
        value = {"prompt": words * (n // 16 + 1), "k": "\\ud83d\\ude00"}
        return json.dumps(value).encode(), value

    assert_linear(lambda pair: lone_surrogate(*pair), make)


_HASH = st.one_of(st.integers(min_value=0, max_value=2**64 - 1), st.binary(min_size=1, max_size=32))
_EVENT = st.one_of(
    st.builds(lambda hashes, size: {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
                                    "token_ids": [5] * (len(hashes) * size), "block_size": size, "medium": "GPU"},
              st.lists(_HASH, min_size=1, max_size=8), st.integers(min_value=1, max_value=16)),
    st.builds(lambda hashes: {"type": "BlockRemoved", "block_hashes": hashes, "medium": None},
              st.lists(_HASH, min_size=1, max_size=8)),
    st.just({"type": "AllBlocksCleared"}),
    st.dictionaries(st.text(max_size=4), st.integers(-(2**63), 2**63 - 1) | st.text(max_size=4), max_size=3),
)


@LINEAR
@given(st.lists(_EVENT, min_size=1, max_size=6))
def test_kv_event_batches_decode_in_linear_time(events: list[dict[str, Any]]) -> None:
    """A batch repeats the drawn events until it is n bytes long; parse() decodes and checks it."""
    one = len(msgpack.packb(events))

    def make(n: int) -> list[bytes]:
        return [b"", (0).to_bytes(8, "big"), msgpack.packb([0.0, events * (n // one + 1), 0])]

    def parse(frames: list[bytes]) -> None:
        with contextlib.suppress(BadMessage):
            kv_events.parse(frames)

    assert_linear(parse, make)


_LINE = st.one_of(
    st.builds(lambda i, o: f'{{"input_len": {i}, "output_len": {o}}}', st.integers(1, 4096), st.integers(1, 512)),
    st.builds(lambda i, ids: f'{{"input_length": {i}, "output_length": 4, "hash_ids": {ids}}}',
              st.integers(1, 8192), st.lists(st.integers(0, 50), max_size=16)),
    st.builds(lambda t: f'{{"prompt": {t!r}, "output_len": 3}}'.replace("'", '"'), st.text("abc ", min_size=1)),
    st.text(max_size=20),
)


@LINEAR
@given(st.lists(_LINE, min_size=1, max_size=5))
def test_workload_files_parse_in_linear_time(lines: list[str]) -> None:
    size = sum(len(line) + 1 for line in lines)

    def parse(text: list[str]) -> None:
        with contextlib.suppress(PdctlError):
            parse_workload(text, "w.jsonl", 10**9)

    assert_linear(parse, lambda n: lines * (n // size + 1))


def test_an_engines_answer_collected_in_small_reads_costs_linear_time() -> None:
    """One large chunk (a prefill's JSON answer) arriving in 1 KiB reads: the collector copied what it held at every
    read, so its work grew with the square of the chunk."""
    def cost(size: int) -> float:
        async def scenario() -> float:
            async with scripted() as (engine, pool):
                conn = await pool.send("POST", "/v1/completions", (), b"{}", collect=True)
                await (await engine.peer()).request()
                answer = OK_CHUNKED + b"%x\r\n%b\r\n0\r\n\r\n" % (size, b"x" * size)
                start = time.thread_time()
                for k in range(0, len(answer), 1024):
                    conn.data_received(answer[k:k + 1024])
                best = time.thread_time() - start
                assert len(await settle(conn.done_fut)) == size
                return max(best, FLOOR_S)
        return asyncio.run(scenario())

    small = min(cost(64 * 1024) for _ in range(3))
    large = min(cost(8 * 64 * 1024) for _ in range(3))
    assert large < MOST_GROWTH * small, f"{small * 1e3:.2f} ms, then {large * 1e3:.2f} ms at 8 times the size"
