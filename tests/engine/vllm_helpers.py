"""Start, wait for and stop real CPU vLLM processes without pdctl (benchmarks/prefix_affinity_cpu.py), and post
to an engine (the end-to-end tests' hand-done legs).

The argv and environment here are the ones notes/vllm-cpu.md documents; pdctl's own vLLM command builder
produces the same flags, and tests/engine/test_pdctl_vllm_example.py runs the two-leg flow on the engines it starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance import ports

REPO = Path(__file__).resolve().parents[2]

# Seconds; generous because three engines import torch and vLLM at once on two loaded cores.
READY_TIMEOUT_S = 420.0
REQUEST_TIMEOUT_S = 120.0
# Where the engines run: "cpu" (vLLM's CPU build, here and in CI) or "cuda" (vLLM's CUDA build on a lent GPU, where
# the kit of shared/gpu stages it: the NIXL matrix of vLLM 0.24.0, whose worker cannot register the CPU backend's KV)
DEVICE = os.environ.get("PDCTL_TEST_VLLM_DEVICE", "cpu")


def example_kv_config(role: str, storage: Path) -> dict[str, Any]:
    """vLLM's --kv-transfer-config for ExampleConnector; role is kv_producer (prefill) or kv_consumer (decode)
    (benchmarks/kv_store_cpu.py starts its engines by hand with it)."""
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }


def vllm_argv(
    python: str,
    model_dir: Path,
    port: int,
    served_name: str,
    kv_transfer_config: dict[str, Any] | None = None,
    kv_cache_bytes: str = "256M",
) -> list[str]:
    """The command line of one vLLM instance (OpenAI server on 127.0.0.1:port): on the CPU, or with DEVICE "cuda"
    on a GPU that every instance of a test shares (bfloat16: the GPU attention backends take no float32)."""
    argv = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),
        "--served-model-name", served_name,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", "bfloat16" if DEVICE == "cuda" else "float32",
        "--enforce-eager",
        "--distributed-executor-backend", "uni",
        "--kv-cache-memory-bytes", kv_cache_bytes,
        "--max-model-len", "2048",
        "--enable-prompt-tokens-details",
        "--disable-uvicorn-access-log",
        "--no-enable-chunked-prefill",
    ]  # fmt: skip
    if DEVICE == "cuda":
        argv += ["--gpu-memory-utilization", "0.15"]  # vLLM's start check: three engines share the one GPU
    if kv_transfer_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config, separators=(",", ":"))]
    return argv


def vllm_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a CPU vLLM instance: one in-process worker, one OpenMP thread, no pinning, loopback only."""
    env = dict(os.environ if base is None else base)
    env.update(
        {
            # The worker runs inside the engine-core process (with --distributed-executor-backend uni):
            # one process fewer to import torch and vLLM, about 30 s and 0.6 GB saved per instance.
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            # "auto" pins every instance to the same core; let the kernel spread them instead.
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": "1",
            "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


@dataclass
class VllmProcess:
    """One running vLLM server and where its log goes."""

    name: str
    port: int
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes]
    started_at: float = field(default_factory=time.monotonic)
    ready_after_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the server's log, for failure messages."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "<no log>"


def start_vllm(name: str, argv: list[str], env: dict[str, str], log_dir: Path, port: int) -> VllmProcess:
    """Start one server in its own session (so stop_vllm can end its whole process group)."""
    log_path = log_dir / f"{name}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            cwd=log_dir, start_new_session=True,
        )  # fmt: skip
    return VllmProcess(name=name, port=port, argv=argv, log_path=log_path, proc=proc)


def wait_ready(servers: list[VllmProcess], timeout_s: float = READY_TIMEOUT_S) -> None:
    """Poll GET /health on every server until all answer 200; fail early with the log if one exits."""
    deadline = time.monotonic() + timeout_s
    pending = list(servers)
    while pending:
        for server in list(pending):
            if server.proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM {server.name} exited with {server.proc.returncode} before it was ready:\n"
                    + server.log_tail()
                )
            try:
                with urllib.request.urlopen(server.url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        server.ready_after_s = time.monotonic() - server.started_at
                        pending.remove(server)
            except (urllib.error.URLError, OSError):
                pass
        if pending and time.monotonic() > deadline:
            names = ", ".join(s.name for s in pending)
            raise TimeoutError(
                f"vLLM {names} not ready after {timeout_s:.0f}s:\n" + pending[0].log_tail()
            )
        if pending:
            time.sleep(1.0)


def stop_vllm(server: VllmProcess, grace_s: float = 30.0) -> None:
    """SIGTERM the server's process group, then SIGKILL what is left after grace_s."""
    if server.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.proc.wait(timeout=grace_s)
    # The engine core may outlive the API server; the group holds both.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait(timeout=10)


def post_json(url: str, body: dict[str, Any], timeout_s: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
    """POST a JSON body and return the JSON answer; an HTTP error raises with the server's message."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read())  # type: ignore[no-any-return]
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"POST {url} -> {exc.code}: {exc.read().decode(errors='replace')}") from exc


def write_tiny_model_with(python: str, model_dir: Path) -> Path:
    """Run ``python -m appliance.engine.tinymodel`` with the engine's python (it has tokenizers/safetensors)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    subprocess.run(
        [python, "-m", "appliance.engine.tinymodel", str(model_dir)], env=env, check=True, timeout=120,
        capture_output=True,
    )  # fmt: skip
    return model_dir


def free_port() -> int:
    """A loopback port for an engine to bind, below the kernel's ephemeral range and claimed for this run
    (appliance.ports.free_port): a port bind(0) handed out could be any outgoing connection's local end before
    the engine binds it, seconds later."""
    return ports.free_port()


def start_pair(home: Path, model_dir: Path, served_name: str, kv_transfer_config: dict[str, Any],
               env: dict[str, dict[str, str]] | None = None,
               extra_argv: dict[str, list[str]] | None = None, python: str | None = None) -> list[VllmProcess]:
    """A prefill (kv_producer) and a decode (kv_consumer) engine with this connector config, on free ports, ready;
    `env` and `extra_argv` add to one role's environment and command line; `python`: the vLLM Python to run
    (the test environment's, PDCTL_TEST_VLLM_PYTHON, unless given)."""
    python = python or os.environ["PDCTL_TEST_VLLM_PYTHON"]
    servers = []
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        port = free_port()
        argv = vllm_argv(python, model_dir, port, served_name, {**kv_transfer_config, "kv_role": kv_role})
        servers.append(start_vllm(role, argv + (extra_argv or {}).get(role, []),
                                  {**vllm_env(), **(env or {}).get(role, {})}, home, port))
    try:
        wait_ready(servers)
    except BaseException:
        for server in servers:
            stop_vllm(server)
        raise
    return servers
