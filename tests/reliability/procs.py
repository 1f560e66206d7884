"""Real processes for the bad-input, security and soak checks: simulated engines and a proxy started with
`python -m ...` on free loopback ports, waited for on their sockets, stopped with SIGTERM."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
MODEL = "sim-model"


def http_status(url: str, timeout: float = 2.0) -> int:
    """GET url; the status, or 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0


@dataclass
class Proc:
    """A started process and where its output goes."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(15)


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
        log = self.workdir / f"{name}.log"
        handle = log.open("wb")
        popen = subprocess.Popen(argv, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env=dict(os.environ, **(env or {})))
        handle.close()
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def wait_http(self, proc: Proc, url: str, timeout: float = 90.0, ready: bool = True) -> None:
        """Wait until `url` answers 200 (or, with ready=False, answers at all)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited: {proc.output()[-2000:]}")
            status = http_status(url)
            if status == 200 or (status and not ready):
                return
            time.sleep(0.1)
        raise RuntimeError(f"{proc.name} not ready at {url}: {proc.output()[-2000:]}")

    def engine(self, name: str, role: str, connector: str, *extra: str) -> str:
        port = free_port()
        argv = [sys.executable, "-m", "appliance.engine.sim", "--port", str(port), "--role", role,
                "--connector", connector, "--model", MODEL, "--instance-name", name, "--log-level", "warning",
                *extra]
        proc = self.start(name, argv)
        url = f"http://127.0.0.1:{port}"
        self.wait_http(proc, url + "/health")
        self.engines[name] = url
        return url

    def proxy(self, connector: str, backends: list[dict[str, Any]], launcher: tuple[str, ...] = (),
              **overrides: Any) -> Proc:
        """Start the proxy (its argv after `launcher`, e.g. a prlimit call) with `overrides` on the config."""
        self.proxy_port, self.admin_port, self.registration_port = free_port(), free_port(), free_port()
        config: dict[str, Any] = {
            "port": self.proxy_port, "connector": connector, "model": MODEL,
            "admin": {"port": self.admin_port},
            "registration": {"port": self.registration_port, "enabled": connector == "moriio",
                             "ping_interval_s": 1.0},
            "health": {"probe_interval_s": 0.5},
            "backends": backends,
        }
        for key, value in overrides.items():
            if isinstance(value, dict) and isinstance(config.get(key), dict):
                config[key].update(value)
            else:
                config[key] = value
        self.config = config
        self.registration_port = int(config["registration"]["port"])
        path = self.workdir / "proxy.json"
        path.write_text(json.dumps(config))
        proc = self.start("proxy", [*launcher, sys.executable, "-m", "appliance.proxy", "--config", str(path),
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
        node.proxy("none", [{"name": "both-0", "role": "both", "url": url}], **proxy_overrides)
        yield node
    finally:
        node.stop()


@contextlib.contextmanager
def moriio_node(workdir: Path, *engine_args: str, **proxy_overrides: Any) -> Iterator[Node]:
    """A MORI-IO READ prefill/decode pair that registers with the proxy over ZMQ."""
    node = Node(workdir)
    try:
        reg = free_port()
        overrides = {"registration": {"port": reg, "enabled": True, "ping_interval_s": 1.0}, **proxy_overrides}
        node.proxy("moriio", [], **overrides)
        for role in ("prefill", "decode"):
            node.engine(f"{role}-0", role, "moriio", "--proxy-ping", f"127.0.0.1:{node.registration_port}",
                        "--handshake-port", "0", "--notify-port", "0", "--ping-interval-s", "0.5", *engine_args)
        deadline = time.monotonic() + 60
        while http_status(node.proxy_url + "/health") != 200:
            if time.monotonic() > deadline:
                raise RuntimeError(f"moriio node not ready: {node.procs[0].output()[-2000:]}")
            time.sleep(0.1)
        yield node
    finally:
        node.stop()
