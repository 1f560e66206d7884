"""A test node for the bad-input, security and soak checks: simulated engines and a proxy started with
`python -m ...` on free loopback ports (tests.support.processes.Proc), waited for on their sockets."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance.ports import free_port
from appliance.settings import deep_merge
from tests.support.processes import Proc, http_status

MODEL = "sim-model"


@dataclass
class Node:
    """Engines + proxy of one test node."""

    workdir: Path
    procs: list[Proc] = field(default_factory=list)
    proxy_port: int = 0
    admin_port: int = 0
    registration_port: int = 0
    engines: dict[str, str] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        """Start a process of the node, its output in <workdir>/<name>.log."""
        proc = Proc(name, argv, self.workdir, env=env)
        self.procs.append(proc)
        return proc

    def wait_http(self, proc: Proc, url: str, timeout: float = 90.0, ready: bool = True) -> None:
        """Wait until `url` answers 200 (or, with ready=False, answers at all)."""
        proc.wait_http(url, timeout, any_answer=not ready)

    def engine(self, name: str, role: str, connector: str, *extra: str, port: int | None = None) -> str:
        """Start a simulated engine (on `port`, else a free one) and wait until it is healthy; its URL."""
        port = port or free_port()
        argv = [sys.executable, "-m", "appliance.engine.sim", "--port", str(port), "--role", role,
                "--connector", connector, "--model", MODEL, "--instance-name", name, "--log-level", "warning",
                *extra]
        proc = self.start(name, argv)
        url = f"http://127.0.0.1:{port}"
        self.wait_http(proc, url + "/health")
        self.engines[name] = url
        return url

    def proxy(self, connector: str, backends: list[dict[str, Any]], launcher: tuple[str, ...] = (),
              module: str = "appliance.proxy", **overrides: Any) -> Proc:
        """Start the proxy (its argv after `launcher`, e.g. a prlimit call; `module` appliance.proxy.keeper runs
        it under its keeper) with `overrides` on the config."""
        self.proxy_port, self.admin_port, self.registration_port = free_port(), free_port(), free_port()
        config: dict[str, Any] = {
            "port": self.proxy_port, "connector": connector, "model": MODEL,
            "admin": {"port": self.admin_port},
            "registration": {"port": self.registration_port, "enabled": connector == "moriio"},
            "health": {"probe_interval_s": 0.5},
            "backends": backends,
        }
        config = deep_merge(config, overrides)
        self.config = config
        self.registration_port = int(config["registration"]["port"])
        path = self.workdir / "proxy.json"
        path.write_text(json.dumps(config))
        proc = self.start("proxy", [*launcher, sys.executable, "-m", module, "--config", str(path),
                                    "--log-level", "warning"])
        self.wait_http(proc, self.proxy_url + "/health", ready=False)  # ready only once engines are there
        return proc

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


@contextlib.contextmanager
def colocated_node(workdir: Path, *engine_args: str, **proxy_overrides: Any) -> Iterator[Node]:
    """One role=both simulated engine behind a proxy (connector none)."""
    node = Node(workdir)
    try:
        url = node.engine("both-0", "both", "none", *engine_args)
        proc = node.proxy("none", [{"name": "both-0", "role": "both", "url": url}], **proxy_overrides)
        # ready: its engine admitted (probed and warmed up), as `pdctl up` waits for it
        node.wait_http(proc, node.proxy_url + "/health")
        yield node
    finally:
        node.stop()


def moriio_engine(node: Node, name: str, role: str, registration_port: int, mode: str, *engine_args: str) -> dict[str, Any]:
    """Start a MORI-IO engine that pings the proxy at `registration_port`; returns its planned backend (the
    zmq address and mode the proxy holds it to, as the plan writes them)."""
    hs, nt = free_port(), free_port()
    url = node.engine(name, role, "moriio", "--proxy-ping", f"127.0.0.1:{registration_port}", "--handshake-port",
                      str(hs), "--notify-port", str(nt), "--ping-interval-s", "0.5", "--mode", mode, *engine_args)
    return {"name": name, "role": role, "url": url,
            "kv": {"zmq_address": f"host:127.0.0.1,handshake:{hs},notify:{nt}", "transfer_mode": mode}}


@contextlib.contextmanager
def moriio_node(workdir: Path, *engine_args: str, decodes: int = 1, **proxy_overrides: Any) -> Iterator[Node]:
    """A MORI-IO prefill and `decodes` decodes that the plan declares (the proxy's backends, with their zmq
    addresses and mode) and that ping the proxy over ZMQ, as vLLM's MoRIIO does."""
    node = Node(workdir)
    try:
        reg = free_port()
        mode = str(proxy_overrides.get("mode", "read"))
        backends = [moriio_engine(node, "prefill-0", "prefill", reg, mode, *engine_args)]
        backends += [moriio_engine(node, f"decode-{i}", "decode", reg, mode, *engine_args) for i in range(decodes)]
        overrides = deep_merge({"registration": {"port": reg, "enabled": True}}, proxy_overrides)
        node.proxy("moriio", backends, **overrides)
        deadline = time.monotonic() + 60
        while http_status(node.proxy_url + "/health") != 200:
            if time.monotonic() > deadline:
                raise AssertionError(f"moriio node not ready: {node.procs[-1].output()[-2000:]}")
            time.sleep(0.1)
        yield node
    finally:
        node.stop()
