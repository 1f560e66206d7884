"""`pdctl bench` end to end on simulated engines: real processes, real proxy, real sockets.

The attainment, goodput and TTFT figures in the JSON are recomputed here from the per-request timings with
numpy, independently of appliance.bench.analysis.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from appliance.ports import free_port
from tests.bench import PNG_MAGIC
from tests.support.pdctl import env_in, pdctl_in
from tests.support.processes import Proc

PY = sys.executable

pytestmark = pytest.mark.timeout(300)
def gaps_of(req: dict[str, Any]) -> np.ndarray:
    """Per-token gaps, recomputed: a chunk of k tokens arriving dt after the last one gives k gaps of dt/k."""
    t = np.asarray(req["chunk_times_s"])
    k = np.asarray(req["chunk_tokens"])
    first = np.zeros(int(k[0]) - 1)
    rest = np.repeat(np.diff(t) / k[1:], k[1:])
    return np.concatenate([first, rest])


def recompute_attainment(requests: list[dict[str, Any]], slo: dict[str, Any], judgement: str) -> float:
    judge = {"p99": lambda g: np.percentile(g, 99), "max": np.max, "mean": np.mean}[judgement]
    good = 0
    for r in requests:
        if not r["success"]:
            continue
        g = gaps_of(r)
        itl_ok = g.size == 0 or judge(g) * 1000 <= slo["itl_ms"]
        good += r["chunk_times_s"][0] * 1000 <= slo["ttft_ms"] and itl_ok
    return good / len(requests)


def test_sweep_writes_json_and_pngs_consistent_with_request_timings(deployment: str, tmp_path: Path) -> None:
    done = pdctl_in(
        "bench",
        "--url",
        deployment,
        "--engine",
        "sim",
        "--rates",
        "2,6,12",
        "--stop-on",
        "none",
        "--lifetimes",
        "0",
        "-n",
        "14",
        "--input-len",
        "300",
        "--output-len",
        "24",
        "--ttft-ms",
        "400",
        "--itl-ms",
        "30",
        "--out",
        "out",
        cwd=tmp_path,
    )
    out = tmp_path / "out"
    for name in ("bench.json", "attainment.png", "latency.png"):
        assert (out / name).is_file(), done.stdout + done.stderr
        assert str(out / name) in done.stdout or name in done.stdout
    for png in ("attainment.png", "latency.png"):
        assert (out / png).read_bytes()[:8] == PNG_MAGIC
    assert "goodput" in done.stderr and "SIMULATED" in done.stderr

    data = json.loads((out / "bench.json").read_text())
    assert data["schema_version"] == 1 and data["engine"] == "sim" and not data["interrupted"]
    slo = data["slo"]
    assert slo == {"ttft_ms": 400.0, "itl_ms": 30.0, "itl_judgement": "p99", "attainment": 0.9}
    (shape,) = data["shapes"]
    assert [r["rate"] for r in shape["rates"]] == [2.0, 6.0, 12.0]
    assert len({r["seed"] for r in shape["rates"]}) == 3
    values = []
    for rate in shape["rates"]:
        reqs = rate["requests"]
        assert len(reqs) == 14 and not rate["partial"]
        ok = [r for r in reqs if r["success"]]
        assert ok, "every request failed"
        for r in ok:
            assert sum(r["chunk_tokens"]) == 24 == r["output_tokens"]  # ignore_eos through the proxy
            assert r["prompt_tokens"] == 300
            assert all(b >= a for a, b in zip(r["chunk_times_s"], r["chunk_times_s"][1:], strict=False))
        summary = rate["summary"]
        for j in ("p99", "max", "mean"):
            assert summary["attainment_by_judgement"][j] == pytest.approx(recompute_attainment(reqs, slo, j))
        assert summary["attainment"] == summary["attainment_by_judgement"]["p99"]
        ttfts = np.array([r["chunk_times_s"][0] for r in ok]) * 1000
        assert summary["ttft_ms"]["p99"] == pytest.approx(np.percentile(ttfts, 99))
        assert summary["ttft_ms"]["p50"] == pytest.approx(np.median(ttfts))
        pooled = np.concatenate([gaps_of(r) for r in ok]) * 1000
        assert summary["itl_ms"]["p99"] == pytest.approx(np.percentile(pooled, 99))
        assert summary["sent"] == 14 and summary["succeeded"] == len(ok)
        values.append(summary["attainment_by_judgement"]["p99"])
    # Goodput under each judgement, recomputed: the last rate before the first one under 90%.
    for j in ("p99", "max", "mean"):
        expected = None
        for rate in shape["rates"]:
            if recompute_attainment(rate["requests"], slo, j) < 0.9:
                break
            expected = rate["rate"]
        assert shape["goodput"][j] == expected
    # The figures are not degenerate: the ITL judgement matters at some rate.
    att = [[r["summary"]["attainment_by_judgement"][j] for j in ("max", "mean")] for r in shape["rates"]]
    assert any(a[0] < a[1] for a in att), att


def test_interrupt_keeps_what_was_measured(deployment: str, tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [
            PY,
            "-m",
            "appliance",
            "bench",
            "--url",
            deployment,
            "--rates",
            "1:20:1",
            "--stop-on",
            "none",
            "--lifetimes",
            "0",
            "-n",
            "8",
            "--input-len",
            "50",
            "--output-len",
            "200",
            "--out",
            "out",
            "--no-plots",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env_in(tmp_path),
    )
    result = tmp_path / "out" / "bench.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        # Interrupt once the first rate is saved, while the second one is in flight.
        if result.is_file() and json.loads(result.read_text())["shapes"][0]["rates"]:
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "interrupted" in stderr and "Traceback" not in stderr
    data = json.loads(result.read_text())
    assert data["interrupted"] is True and data["engine"] == "unknown"
    rates = data["shapes"][0]["rates"]
    assert 1 <= len(rates) < 20
    assert not rates[0]["partial"]
    last = rates[-1]
    statuses = {r["status"] for r in last["requests"]}
    assert last["partial"] == ("interrupted" in statuses or len(last["requests"]) < 8)
    assert last["summary"]["sent"] == sum(1 for r in last["requests"] if r["status"] != "interrupted")


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    for args, words in (
        (["--rates", "5:1:1"], "--rates"),
        (["--url", "http://127.0.0.1:9", "--compare"], "--compare"),
        (["--url", f"http://127.0.0.1:{free_port()}"], "cannot reach"),
        (["--token-range", "9:3"], "--token-range"),
        (["--rates", "auto:0"], "--rates"),
        (["--rates", "auto", "--stop-on", "none"], "--stop-on"),
        (["--compare", "--budgets", "1k"], "--budgets"),
    ):
        done = pdctl_in("bench", *args, "--out", "o", cwd=tmp_path, check=False)
        assert done.returncode == 2, done.stderr
        assert words in done.stderr and "Traceback" not in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr



def test_a_bad_argument_is_answered_without_loading_matplotlib(tmp_path: Path) -> None:
    """Plots are checked for before measuring, but finding matplotlib must not import it (2 s of a busy node's
    CPU, which every mistake in the arguments waited for)."""
    code = ("import sys\nfrom appliance.cli.main import main\n"
            "try:\n    main(['bench', '--rates', '5:1:1', '--out', 'o'])\n"
            "except SystemExit as exc:\n    print('EXIT', exc.code)\nprint('MODULES', *sorted(sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env=env_in(tmp_path))
    assert "EXIT 2" in done.stdout and "--rates" in done.stderr, done.stdout[:200] + done.stderr
    modules = set(done.stdout.partition("MODULES ")[2].split())
    assert sorted(m for m in modules if m.split(".")[0] == "matplotlib") == []

def test_steady_sweep_stops_at_the_ceiling_and_judges_only_the_window(deployment: str, tmp_path: Path) -> None:
    pdctl_in(
        "bench",
        "--url",
        deployment,
        "--engine",
        "sim",
        "--rates",
        "auto:4",
        "--stop-on",
        "run",
        "--itl-judgement",
        "mean",
        "--lifetimes",
        "2",
        "-n",
        "8",
        "--input-len",
        "300",
        "--output-len",
        "24",
        "--ttft-ms",
        "400",
        "--itl-ms",
        "12",
        "--out",
        "out",
        "--no-plots",
        cwd=tmp_path,
    )
    data = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert data["workload"]["lifetimes"] == 2 and data["workload"]["stop_on"] == ["mean"]
    (shape,) = data["shapes"]
    assert shape["lifetime_s"] > 0.024 * 4  # the probe: 24 decode steps of >= 4 ms
    rates = shape["rates"]
    assert [r["rate"] for r in rates] == sorted(r["rate"] for r in rates)
    mean = [recompute_attainment([q for q in r["requests"] if q["measured"]], data["slo"], "mean") for r in rates]
    # The sweep found the ceiling: some rate misses, and the goodput is the rate just below the first miss.
    assert min(mean) < 0.9, mean
    first_miss = next(i for i, a in enumerate(mean) if a < 0.9)
    assert shape["goodput"]["mean"] == (rates[first_miss - 1]["rate"] if first_miss else None)
    # Doubling then bisection: no rate above the first doubling that missed.
    assert max(r["rate"] for r in rates) <= 2 * rates[first_miss]["rate"]
    for rate in rates:
        window, reqs = rate["window"], rate["requests"]
        measured = [q for q in reqs if q["measured"]]
        # Selection by arrival time only: inside [start, end) is measured, everything else is not.
        assert all((window["start_s"] <= q["scheduled_s"] < window["end_s"]) == q["measured"] for q in reqs)
        assert window["start_s"] >= window["lifetime_s"] * 0.99  # one lifetime of warm-up
        assert window["span_s"] >= window["end_s"] + window["lifetime_s"] * 0.99  # and one of drain
        assert len(measured) >= 8 or window["lifetimes"] >= 2
        assert rate["summary"]["sent"] == len(measured) and rate["summary"]["unmeasured"] == len(reqs) - len(measured)
        assert rate["summary"]["attainment_by_judgement"]["mean"] == pytest.approx(mean[rates.index(rate)])
    assert sum(r["summary"]["unmeasured"] for r in rates) > 0  # warm-up arrivals were sent and left out
    unmeasured = [q for r in rates for q in r["requests"] if not q["measured"]]
    assert all(q["chunk_times_s"] == [] and q["latency_s"] > 0 for q in unmeasured if q["success"])


def test_a_run_in_which_every_request_failed_exits_non_zero_and_says_why(deployment: str, tmp_path: Path) -> None:
    # ids past the simulated engine's vocabulary (32000), as 100:1000 was past the embedded model's (695)
    done = pdctl_in("bench", "--url", deployment, "--token-range", "40000:40100", "--rates", "4", "-n", "4",
                    "--stop-on", "none", "--lifetimes", "0", "--input-len", "20", "--output-len", "4", "--out", "out",
                    cwd=tmp_path, check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("pdctl: error: every request failed") and "out of vocabulary" in last, done.stderr
    assert "4 of 4 requests; the first: HTTP 400: Token id 4" in last and '{"error"' not in last
    assert "No artists with labels" not in done.stderr and "Traceback" not in done.stderr
    assert (tmp_path / "out" / "bench.json").is_file()  # what was sent is kept for a look


@pytest.fixture
def small_vocabulary_engine(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A simulated engine serving a model directory whose tokenizer has 300 ids (its config says 1024)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 1024}))
    vocab = {f"t{i}": i for i in range(3, 300)}
    added = [{"id": i, "content": f"<s{i}>"} for i in range(3)]
    (model / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}, "added_tokens": added}))
    engine = Proc("engine", [PY, "-m", "appliance.engine.sim", "--port", "0", "--model", str(model), "--log-level",
                             "warning"], tmp_path, ready_line=True, session=True)
    try:
        yield json.loads(engine.read_line(re.compile(r'"url": "http://')))["url"], model
    finally:
        engine.stop()


def test_the_default_token_range_comes_from_the_served_models_vocabulary(
        small_vocabulary_engine: tuple[str, Path], tmp_path: Path) -> None:
    url, model = small_vocabulary_engine
    common = ["--rates", "4", "-n", "3", "--stop-on", "none", "--lifetimes", "0", "--input-len", "50",
              "--output-len", "2", "--no-plots"]
    done = pdctl_in("bench", "--url", url, *common, "--out", "out", cwd=tmp_path)
    data = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert data["workload"]["token_range"] == [100, 300]
    assert f"{model} has 300, from {model / 'tokenizer.json'}" in " ".join(done.stderr.split())
    # ids the server would refuse are refused before anything is sent, in one line
    done = pdctl_in("bench", "--url", url, *common, "--token-range", "100:1000", "--out", "o2", cwd=tmp_path,
                    check=False)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "draws ids up to 999" in done.stderr and "has 300 token ids" in done.stderr
    assert not (tmp_path / "o2" / "bench.json").exists()


@pytest.fixture
def short_context_engine(tmp_path: Path) -> Iterator[str]:
    """A simulated engine serving a 64-token context, as the embedded model's 2048 is shorter than the defaults."""
    engine = Proc("engine", [PY, "-m", "appliance.engine.sim", "--port", "0", "--model", "short", "--max-model-len",
                             "64", "--log-level", "warning"], tmp_path, ready_line=True, session=True)
    try:
        yield json.loads(engine.read_line(re.compile(r'"url": "http://')))["url"]
    finally:
        engine.stop()


def test_the_default_lengths_come_from_the_served_models_context(short_context_engine: str, tmp_path: Path) -> None:
    url = short_context_engine
    common = ["--rates", "4", "-n", "3", "--stop-on", "none", "--lifetimes", "0", "--no-plots"]
    done = pdctl_in("bench", "--url", url, *common, "--out", "out", cwd=tmp_path)
    data = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert (data["workload"]["input_len"], data["workload"]["output_len"]) == (43, 21)  # 2000:1000 in 64
    requests = [q for r in data["shapes"][0]["rates"] for q in r["requests"]]
    assert requests and all(q["success"] and q["output_tokens"] == 21 for q in requests)
    assert "the defaults, 2000 + 1000, cut to short's context of 64 tokens" in " ".join(done.stderr.split())
    # lengths the user chose that do not fit are refused before anything is sent, in one line
    done = pdctl_in("bench", "--url", url, *common, "--input-len", "50", "--output-len", "20", "--out", "o2",
                    cwd=tmp_path, check=False)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "--input-len 50 + --output-len 20 = 70 tokens, but short's context is 64 tokens" in done.stderr
    assert not (tmp_path / "o2" / "bench.json").exists()


def test_on_a_pipe_progress_lines_come_as_they_happen(deployment: str, tmp_path: Path) -> None:
    """Issue 37: on a pipe `pdctl bench` said nothing for 143 s, then every progress line at once at the end. A
    rate of 12 requests at 0.5 req/s lasts ~24 s: its start, a line at least every HEARTBEAT_S, and its outcome
    arrive while it runs."""
    from appliance.progress import HEARTBEAT_S

    argv = [PY, "-m", "appliance", "bench", "--url", deployment, "--rates", "0.5", "--stop-on", "none",
            "--lifetimes", "0", "-n", "12", "--input-len", "20", "--output-len", "8", "--out", "out", "--no-plots"]
    proc = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env_in(tmp_path))
    arrived: list[tuple[float, str]] = []
    assert proc.stderr is not None  # the progress goes to stderr, the results' path to stdout
    for line in proc.stderr:
        arrived.append((time.monotonic(), line.rstrip("\n")))
    assert proc.wait(timeout=120) == 0, arrived
    rate = [(t, line) for t, line in arrived if " 0.5 req/s: " in line]
    # the deployment's series is not called "target", the SLO lines' word (issue 37)
    assert rate and rate[0][1] == "deployment 0.5 req/s: 0/12 done, 0s", arrived
    assert any("attainment" in line for _, line in rate), arrived
    times = [t for t, _ in rate]
    assert len(rate) >= 3 and max(b - a for a, b in zip(times, times[1:], strict=False)) < HEARTBEAT_S + 5, rate
    assert arrived[-1][0] - times[0] > HEARTBEAT_S, "every line came at the end"
