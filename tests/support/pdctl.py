"""Running the real `pdctl` in tests: a node's settings file (every port free, state in a tmp folder) and
`pdctl --config` against it, or `pdctl` in a working folder whose own settings file keeps the host's out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

from appliance.ports import free_ports
from tests.support.processes import ROOT


def write_config(directory: Path, state_dir: Path, manager: str = "supervisor", extra: str = "") -> Path:
    """A pdctl.toml for the simulated engine on this CPU node, every port free, state in `state_dir`."""
    prefill, decode, colocated = free_ports(3, width=2)  # room for a second instance of each role
    proxy, admin, ping = free_ports(3)
    # the connectors' own ports too (NIXL side channel, MORI-IO handshake and notify): two deployments on
    # their defaults, another test's among them, fail at the engines' bind
    hs_p, nt_p, hs_d, nt_d, hs_c, nt_c = free_ports(6, width=32)  # DP x TP ranks of up to 8 GPUs a role
    ev_p, ev_d, ev_c = free_ports(3, width=16)  # KV events (prefix_affinity on vLLM): DP ranks of 2 instances
    path = directory / "pdctl.toml"
    path.write_text(
        f"""state_dir = {json.dumps(str(state_dir))}
manager = "{manager}"
unit_dir = {json.dumps(str(directory / "units"))}
[engine]
kind = "sim"
health_timeout_s = 60
[prefill]
http_port = {prefill}
handshake_port = {hs_p}
notify_port = {nt_p}
kv_events_port = {ev_p}
[decode]
http_port = {decode}
handshake_port = {hs_d}
notify_port = {nt_d}
kv_events_port = {ev_d}
[colocated]
http_port = {colocated}
handshake_port = {hs_c}
notify_port = {nt_c}
kv_events_port = {ev_c}
[proxy]
port = {proxy}
admin_port = {admin}
ping_port = {ping}
{extra}"""
    )
    return path


def pdctl(config: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 180,
          check: bool = False, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """Run the real `pdctl` (python -m appliance) with --config and the CPU inventory (after `prefix`, e.g. an
    nsenter into a mount namespace)."""
    full_env = dict(os.environ, PDCTL_INVENTORY="sim:cpu", **(env or {}))
    full_env.pop("PDCTL_CONFIG", None)
    # stdin is never a terminal here, as in a script: a command that would ask must be told --yes
    done = subprocess.run([*prefix, sys.executable, "-m", "appliance", "--config", str(config), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env=full_env, stdin=subprocess.DEVNULL)
    if check and done.returncode != 0:
        raise AssertionError(f"pdctl {' '.join(args)} -> {done.returncode}\n{done.stdout}\n{done.stderr}")
    return done


def env_in(cwd: Path) -> dict[str, str]:
    """The environment of a pdctl run in `cwd`: its pdctl.toml (unless the test wrote one: state and units under
    `cwd`), so the host's /etc/pdctl and /var/lib/pdctl never leak in."""
    settings = cwd / "pdctl.toml"
    if not settings.exists():
        settings.write_text(f"state_dir = {json.dumps(str(cwd / 'state'))}\nunit_dir = {json.dumps(str(cwd / 'units'))}\n")
    return {**os.environ, "PDCTL_CONFIG": str(settings)}


def pdctl_in(*args: str, cwd: Path, check: bool = True, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Run `pdctl` (python -m appliance) in `cwd`, whose pdctl.toml (env_in) is the settings unless --config says."""
    done = subprocess.run([sys.executable, "-m", "appliance", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env_in(cwd))
    if check:
        assert done.returncode == 0, done.stdout + done.stderr
    return done


def status(config: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """`pdctl status --json` as data."""
    done = pdctl(config, "status", "--json", env=env)
    assert done.stdout, done.stderr
    doc: dict[str, Any] = json.loads(done.stdout)
    doc["_rc"] = done.returncode
    return doc


def complete(proxy_url: str, model: str = "tiny-qwen3", timeout: float = 30) -> dict[str, Any]:
    """One non-streamed completion through the proxy."""
    body = json.dumps({"model": model, "prompt": "hello there", "max_tokens": 4}).encode()
    request = urllib.request.Request(proxy_url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        result: dict[str, Any] = json.loads(response.read())
    return result


def try_complete(proxy_url: str) -> dict[str, Any] | None:
    """A completion, or None while the proxy cannot serve one yet."""
    try:
        return complete(proxy_url)
    except OSError:
        return None


def set_fault(engine_url: str, **faults: Any) -> dict[str, Any]:
    """Set faults of a simulated engine (its POST /sim/fault); the engine's faults as they now are."""
    body = json.dumps(faults).encode()
    request = urllib.request.Request(engine_url + "/sim/fault", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200
        now: dict[str, Any] = json.loads(response.read())
    return now


def crash_on_next_token(engine_url: str) -> None:
    """Make a simulated engine exit with status 1 at its next generated token."""
    set_fault(engine_url, crash_after_tokens=1)
