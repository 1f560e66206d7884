"""The pure core: per-token gaps, ITL judgements, SLO checks, goodput, rates and the Poisson schedule."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.bench.analysis import (
    Slo,
    Timing,
    attainment,
    goodput,
    judge_itl,
    meets,
    percentile,
    token_gaps,
)
from appliance.bench.workload import arrivals, parse_rates, parse_token_range, prompt, rate_seed, token_range
from appliance.errors import PdctlError


@given(st.lists(st.floats(min_value=-1e6, max_value=1e6), min_size=1, max_size=60), st.floats(0, 100))
def test_percentile_matches_numpy_linear(values: list[float], q: float) -> None:
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-9, abs=1e-6)


def test_multi_token_chunks_spread_their_gap_and_mean_is_tpot() -> None:
    # chunk 0 carries 2 tokens at 100 ms, chunk 1 one token 40 ms later, chunk 2 three tokens 30 ms later.
    times, tokens = [0.100, 0.140, 0.170], [2, 1, 3]
    gaps = token_gaps(times, tokens)
    assert gaps == pytest.approx([0.0, 0.040, 0.010, 0.010, 0.010])
    assert len(gaps) == sum(tokens) - 1
    tpot = (times[-1] - times[0]) / (sum(tokens) - 1)  # vLLM: (latency - ttft) / (output_len - 1)
    assert judge_itl(gaps, "mean") == pytest.approx(tpot)
    assert judge_itl(gaps, "max") == pytest.approx(0.040)
    assert judge_itl([], "p99") is None


@given(st.lists(st.tuples(st.floats(0.0, 0.5), st.integers(1, 4)), min_size=1, max_size=40))
def test_gaps_sum_to_stream_span(chunks: list[tuple[float, int]]) -> None:
    times = list(np.cumsum([dt for dt, _ in chunks]))
    tokens = [k for _, k in chunks]
    gaps = token_gaps(times, tokens)
    assert len(gaps) == sum(tokens) - 1
    assert sum(gaps) == pytest.approx(times[-1] - times[0], abs=1e-9)


def test_meets_uses_inclusive_limits_and_each_judgement() -> None:
    slo = Slo(ttft_ms=1000, itl_ms=50, itl_judgement="p99")
    # 99 gaps of 10 ms and one of 200 ms: the mean and p99 pass, the max fails.
    times = [1.0]
    for i in range(100):
        times.append(times[-1] + (0.2 if i == 50 else 0.01))
    t = Timing(success=True, chunk_times_s=times, chunk_tokens=[1] * len(times))
    assert meets(t, slo, "mean") and meets(t, slo, "p99") and not meets(t, slo, "max")
    late = Timing(success=True, chunk_times_s=[1.0005, 1.01], chunk_tokens=[1, 1])
    assert not meets(late, slo)
    on_the_line = Timing(success=True, chunk_times_s=[0.5, 0.55], chunk_tokens=[1, 1])
    assert meets(on_the_line, Slo(ttft_ms=500, itl_ms=50.000001))
    assert not meets(Timing(success=False, chunk_times_s=[0.1], chunk_tokens=[1]), slo)
    assert meets(Timing(success=True, chunk_times_s=[0.1], chunk_tokens=[1]), slo)  # one token: no gaps


def test_attainment_counts_failures_as_misses() -> None:
    slo = Slo(ttft_ms=100, itl_ms=50)
    good = Timing(success=True, chunk_times_s=[0.05, 0.06], chunk_tokens=[1, 1])
    bad = Timing(success=False)
    assert attainment([good, good, bad, bad], slo) == 0.5
    assert math.isnan(attainment([], slo))


def test_goodput_is_the_last_rate_before_the_first_miss() -> None:
    points = [(1.0, 1.0), (2.0, 0.95), (3.0, 0.5), (4.0, 0.92)]  # the rebound at 4 does not count
    assert goodput(points, 0.9) == 2.0
    assert goodput(list(reversed(points)), 0.9) == 2.0
    assert goodput([(1.0, 0.89)], 0.9) is None
    assert goodput([(1.0, 0.9), (2.0, 0.9)], 0.9) == 2.0


def test_parse_rates() -> None:
    rates = parse_rates("0.5:10:0.5")
    assert len(rates) == 20 and rates[0] == 0.5 and rates[-1] == 10.0
    assert parse_rates("4, 1,2,2") == [1.0, 2.0, 4.0]
    for bad in ("", "a:b:c", "1:2", "0:5:1", "5:1:1", "1:5:0", "-1,2", "0"):
        with pytest.raises(PdctlError):
            parse_rates(bad)
    assert parse_token_range("10:20") == (10, 20)
    for bad in ("10", "20:10", "x:y", "-1:5"):
        with pytest.raises(PdctlError):
            parse_token_range(bad)


def test_poisson_schedule_is_seeded_and_has_the_asked_rate() -> None:
    a = arrivals(4.0, 4000, random.Random(1))
    assert a == arrivals(4.0, 4000, random.Random(1))
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:], strict=False))
    mean_gap = a[-1] / (len(a) - 1)
    assert mean_gap == pytest.approx(0.25, rel=0.1)
    # Exponential gaps: the coefficient of variation is 1.
    gaps = np.diff(a)
    assert float(np.std(gaps) / np.mean(gaps)) == pytest.approx(1.0, rel=0.1)


def test_each_rate_gets_its_own_prompts() -> None:
    seeds = {rate_seed(0, r) for r in parse_rates("0.5:10:0.5")}
    assert len(seeds) == 20
    assert rate_seed(0, 1.0) == rate_seed(0, 1.0) != rate_seed(1, 1.0)
    p = prompt("tokens", 300, random.Random(rate_seed(0, 1.0)), (100, 1000))
    q = prompt("tokens", 300, random.Random(rate_seed(0, 2.0)), (100, 1000))
    assert isinstance(p, list) and len(p) == 300 and all(100 <= t < 1000 for t in p) and p != q
    words = prompt("words", 50, random.Random(3), (0, 1))
    assert isinstance(words, str) and len(words.split()) == 50


def test_token_range_default_fits_the_vocabulary() -> None:
    assert token_range(None, None, "m", "") == (100, 1000)  # unknown vocabulary: the default as is
    assert token_range(None, 32000, "m", "x") == (100, 1000)
    assert token_range(None, 695, "tiny-qwen3", "x") == (100, 695)  # the embedded model
    assert token_range(None, 150, "m", "x") == (75, 150)
    assert token_range("5:10", 10, "m", "x") == (5, 10)
    with pytest.raises(PdctlError, match=r"draws ids up to 999, but tiny-qwen3 has 695 token ids \(0..694, from f\)"):
        token_range("100:1000", 695, "tiny-qwen3", "f")
    with pytest.raises(PdctlError, match="too few"):
        token_range(None, 1, "m", "x")
