"""Deploying a simulated GPU node for rebalance tests, and a steady streaming client load against its proxy."""

from __future__ import annotations

import http.client
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from appliance.ports import free_ports


def write_node_config(directory: Path, state_dir: Path, connector: str = "nixl", engine_extra: str = "") -> Path:
    """pdctl.toml for a simulated 8-GPU node on this CPU box: sim engines, every port free."""
    # each role's bases with room for 8 instances x their ranks above them
    p = dict(zip(("p_http", "p_hs", "p_nt", "d_http", "d_hs", "d_nt"), free_ports(6, width=16), strict=True))
    proxy, admin, ping = free_ports(3)
    path = directory / "pdctl.toml"
    path.write_text(f"""state_dir = {json.dumps(str(state_dir))}
manager = "supervisor"
unit_dir = {json.dumps(str(directory / "units"))}
[engine]
kind = "sim"
health_timeout_s = 60
[engine.sim]
decode_step_ms = 4.0
{engine_extra}
[connector]
name = "{connector}"
[prefill]
http_port = {p['p_http']}
handshake_port = {p['p_hs']}
notify_port = {p['p_nt']}
[decode]
http_port = {p['d_http']}
handshake_port = {p['d_hs']}
notify_port = {p['d_nt']}
[proxy]
port = {proxy}
admin_port = {admin}
ping_port = {ping}
""")
    return path


@dataclass
class Load:
    """Client threads that stream completions through the proxy back to back until stopped."""

    url: str
    threads: int = 3
    max_tokens: int = 24
    timeout_s: float = 120.0  # per request, the proxy's hold included
    model: str | None = None  # the served name, where the engines check it (real vLLM)
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _workers: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> Load:
        for n in range(self.threads):
            t = threading.Thread(target=self._run, args=(n,), daemon=True)
            t.start()
            self._workers.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._workers:
            t.join(timeout=self.timeout_s)

    def _one(self, n: int, k: int) -> str | None:
        """One streamed request; None when it succeeded, else what went wrong."""
        parts = urlsplit(self.url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=self.timeout_s)
        # the usage event counts the tokens: a real engine may send a token that detokenizes to nothing in none
        request = {"prompt": f"client {n} request {k} " * 20, "max_tokens": self.max_tokens, "stream": True,
                   "ignore_eos": True, "stream_options": {"include_usage": True}}
        body = json.dumps(request | ({"model": self.model} if self.model else {}))
        try:
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            text = response.read().decode()
        except (OSError, http.client.HTTPException) as exc:  # a stream cut mid-body is IncompleteRead
            return f"request {n}/{k}: {exc!r}"
        finally:
            conn.close()
        if response.status != 200:
            return f"request {n}/{k}: HTTP {response.status} {text[:200]}"
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]" or any('"error"' in e for e in events):
            return f"request {n}/{k}: broken stream {text[-300:]!r}"
        usage = [u for u in (json.loads(e).get("usage") for e in events[:-1]) if u]
        tokens = usage[-1]["completion_tokens"] if usage else 0
        if tokens < self.max_tokens:
            return f"request {n}/{k}: {tokens} of {self.max_tokens} tokens"
        return None

    def _run(self, n: int) -> None:
        k = 0
        while not self._stop.is_set():
            problem = self._one(n, k)
            with self._lock:
                if problem is None:
                    self.ok += 1
                else:
                    self.failures.append(problem)
            k += 1


def restart_figures(doc: dict, load: Load) -> dict:
    """What a planned restart cost the clients, from the load and the proxy's own counters."""
    requests = doc["proxy"]["requests"]
    return {"sent": load.ok + len(load.failures), "failed": len(load.failures), "held": requests["held"],
            "max_hold_s": requests["max_hold_s"], "streams_cut": requests["by_status"].get("stream_error", 0)}
