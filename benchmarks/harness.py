"""What the benchmarks share: a proxy process in front of engines they started, the figures of a /metrics page,
the vLLM CPU build and its tiny model, and the nearest-rank percentile of their tables.

A benchmark puts the repository on sys.path and imports `benchmarks.harness`; the vLLM processes themselves come
from tests/engine/vllm_helpers.py, which the end-to-end tests use too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tests.engine.vllm_helpers import write_tiny_model_with

REPO = Path(__file__).resolve().parents[1]
PROXY_READY_S = 60.0


def pct(values: list[float], q: float) -> float:
    """The nearest-rank q-quantile of `values` (NaN when there are none)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def start_proxy(name: str, config: dict[str, Any], work: Path,
                entry: tuple[str, ...] = ("-m", "appliance.proxy")) -> tuple[subprocess.Popen[bytes], str]:
    """`python -m appliance.proxy` (or python ENTRY...) with `config` (a ProxyConfig as data, its port set), its
    config and log in `work` as NAME.json and NAME.log; returns it and its URL once /health answers 200."""
    path = work / f"{name}.json"
    path.write_text(json.dumps(config))
    log = open(work / f"{name}.log", "wb")  # noqa: SIM115 - the process writes it until it stops
    proc = subprocess.Popen([sys.executable, *entry, "--config", str(path)], cwd=REPO,
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{config['port']}"
    deadline = time.monotonic() + PROXY_READY_S
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.5)
    proc.terminate()
    raise SystemExit(f"the proxy {name} did not become ready in {PROXY_READY_S:g} s; see {work}/{name}.log")


def stop_all(procs: Iterable[subprocess.Popen[bytes]]) -> None:
    """Terminate every process, then wait for each (they stop together, not one after another)."""
    procs = list(procs)
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.wait(timeout=30)


def metric_samples(url: str) -> list[Sample]:
    """Every sample of URL/metrics (prometheus_client's own parser)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def totals(found: list[Sample]) -> dict[str, float]:
    """The samples summed over their labels, by sample name."""
    out: dict[str, float] = {}
    for sample in found:
        out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def by_label(found: list[Sample], name: str, label: str) -> dict[str, float]:
    """The samples named `name` summed by the value of one of their labels."""
    out: dict[str, float] = {}
    for sample in found:
        if sample.name == name:
            out[sample.labels[label]] = out.get(sample.labels[label], 0.0) + sample.value
    return out


def vllm_python() -> str:
    """The python of the vLLM CPU build (PDCTL_TEST_VLLM_PYTHON), or a one-line exit saying to set it."""
    python = os.environ.get("PDCTL_TEST_VLLM_PYTHON")
    if not python:
        raise SystemExit("set PDCTL_TEST_VLLM_PYTHON to the python of a vLLM CPU environment")
    return python


def tiny_model(python: str, work: Path) -> tuple[Path, int]:
    """The tiny embedded model written under `work`, and the number of token ids its tokenizer knows (fewer than
    its config's vocab_size: prompts are drawn from those)."""
    model = write_tiny_model_with(python, work / "model")
    return model, len(json.loads((model / "tokenizer.json").read_text())["model"]["vocab"])
