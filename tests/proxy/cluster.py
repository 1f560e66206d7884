"""A proxy and its engines as real processes for the end-to-end tests: simulated engines (`python -m
appliance.engine.sim`) and the proxy (`python -m appliance.proxy --config F`), each on free ports, started with
tests.support.processes.Proc, plus small readers of their answers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp

from appliance.settings import deep_merge
from tests.support import proxyconfig
from tests.support.httpclient import sse_events
from tests.support.processes import Proc

MODEL = "sim-e2e"


class Sim(Proc):
    """`python -m appliance.engine.sim` on free ports."""

    def __init__(self, name: str, log_dir: Path, role: str, connector: str, *args: str) -> None:
        argv = [sys.executable, "-m", "appliance.engine.sim", "--port", "0", "--role", role,
                "--connector", connector, "--model", MODEL, "--instance-name", name, "--log-level", "info", *args]
        super().__init__(name, argv, log_dir, ready_line=True)
        self.info: dict[str, Any] = {}
        self.url = ""
        self.port = 0

    def _on_ready(self) -> None:
        self.info = json.loads(self.ready_line)
        self.url = self.info["url"]
        self.port = int(self.url.rsplit(":", 1)[1])


class ProxyProc(Proc):
    """`python -m appliance.proxy --config F` with F written from `config` (a ProxyConfig as data)."""

    def __init__(self, config: dict[str, Any], log_dir: Path, name: str = "proxy") -> None:
        self.config_path = log_dir / f"{name}.json"
        self.config_path.write_text(json.dumps(config))
        argv = [sys.executable, "-m", "appliance.proxy", "--config", str(self.config_path), "--log-level", "INFO"]
        super().__init__(name, argv, log_dir, ready_line=True)
        self.port = self.admin_port = 0
        self.url = self.admin_url = ""

    def _on_ready(self) -> None:
        # "pd-proxy ready on 127.0.0.1:PORT admin 127.0.0.1:PORT"
        words = self.ready_line.split()
        self.port = int(words[3].rsplit(":", 1)[1])
        self.admin_port = int(words[5].rsplit(":", 1)[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin_url = f"http://127.0.0.1:{self.admin_port}"


def proxy_config(connector: str, mode: str = "read", backends: list[dict[str, Any]] | None = None,
                 registration_port: int | None = None, **overrides: Any) -> dict[str, Any]:
    """A ProxyConfig (as data) on free ports, with probes and timeouts that allow for separate processes; no
    warm-up unless `overrides` ask for one (a fault set at an engine's start, a hung prefill or a crash after N
    tokens, is the client's to meet: the warm-up's own tests are tests/proxy/test_warmup.py)."""
    config = proxyconfig.proxy_config(
        connector, MODEL, proxyconfig.SEPARATE_PROCESSES, backends, mode=mode,
        registration={"enabled": registration_port is not None, "port": registration_port or 0},
        timeouts={"connect_s": 5, "prefill_s": 30, "first_token_s": 30, "between_tokens_s": 30},
        health={"warmup_timeout_s": 0},
    )
    return deep_merge(config, overrides)


# every sim: fast decode steps, a short context (a request without max_tokens ends soon)
SIM_TIMING = ("--decode-step-ms", "2", "--decode-step-ms-per-seq", "0", "--max-model-len", "512",
              "--num-blocks", "2048")


class Cluster:
    """A proxy and its engines; stops them all at the end."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[Proc] = []
        self.sims: dict[str, Sim] = {}
        self.proxy: ProxyProc | None = None

    def sim(self, name: str, role: str, connector: str, *args: str) -> Sim:
        """Spawn an engine; call ready() before using its url."""
        sim = Sim(name, self.log_dir, role, connector, *SIM_TIMING, *args)
        self.procs.append(sim)
        self.sims[name] = sim
        return sim

    def start_proxy(self, config: dict[str, Any]) -> ProxyProc:
        """Spawn the proxy; call ready() before using it."""
        self.proxy = ProxyProc(config, self.log_dir)
        self.procs.append(self.proxy)
        return self.proxy

    def ready(self) -> None:
        """Wait for every spawned process's ready line."""
        for proc in self.procs:
            proc.wait_ready()

    def stop(self) -> None:
        for proc in reversed(self.procs):
            with contextlib.suppress(Exception):
                proc.stop()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.log_tail(1500)}" for p in self.procs)


@contextlib.contextmanager
def cluster() -> Iterator[Cluster]:
    """A Cluster whose processes are stopped (and logs removed) on exit."""
    with tempfile.TemporaryDirectory(prefix="pdctl-e2e-") as tmp:
        c = Cluster(Path(tmp))
        try:
            yield c
        finally:
            c.stop()


def static_backends(*sims: tuple[str, str, Sim]) -> list[dict[str, Any]]:
    """Backend entries for (name, role, sim)."""
    out = []
    for name, role, sim in sims:
        entry: dict[str, Any] = {"name": name, "role": role, "url": sim.url}
        if "zmq_address" in sim.info:
            entry["kv"] = {"zmq_address": sim.info["zmq_address"]}
        out.append(entry)
    return out


# ---- client side ---------------------------------------------------------------------------------

def run(coro: Any) -> Any:
    """Run one async scenario (each test owns its loop)."""
    return asyncio.run(coro)


async def get_json(url: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return r.status, await r.json(content_type=None)


async def sim_state(sim: Sim) -> dict[str, Any]:
    """GET /sim/state of one engine."""
    status, body = await get_json(sim.url + "/sim/state")
    assert status == 200
    return dict(body)


async def drained(sim: Sim) -> bool:
    """No KV blocks held (incl. held-for-transfer), nothing running or waiting on the engine."""
    s = await sim_state(sim)
    return (s["kv_blocks_held"] == 0 and s["requests_running"] == 0 and s["requests_waiting"] == 0
            and s["requests_waiting_for_kv"] == 0 and s["pending_transfers"] == 0)


def stream_text(raw: bytes, chat: bool = False) -> tuple[str, list[dict[str, Any]], bool]:
    """(concatenated text, JSON events, saw [DONE]) of a streamed completion."""
    events = sse_events(raw)
    done = bool(events) and events[-1] == "[DONE]"
    parsed = [json.loads(e) for e in events if e != "[DONE]"]
    pieces = []
    for e in parsed:
        for choice in e.get("choices", []):
            text = choice["delta"].get("content") if chat else choice.get("text")
            pieces.append(text or "")
    return "".join(pieces), parsed, done


def words(n: int) -> str:
    """A prompt of exactly n simulated tokens."""
    return "word " * n


async def metric(sim: Sim, name: str) -> float:
    """One unlabelled sample of the engine's /metrics (e.g. sim_requests_total)."""
    async with aiohttp.ClientSession() as s, s.get(sim.url + "/metrics") as r:
        text = await r.text()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in {sim.name}'s /metrics")
