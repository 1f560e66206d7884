"""Run an exported Ray Serve P/D app on a one-head local Ray cluster and send it one request.

Run with the tools Python inside a private network namespace (only loopback exists there, so Ray's
listeners cannot reach beyond this machine):

    unshare --net -- sh -c 'ip link set lo up && exec PYTHON ray_proof.py serve.yaml WORKDIR MODEL KVDIR'

Prints one JSON line: {"ok", "stage", "completion", "usage", "kv_files", "log_tail"}.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

READY_TIMEOUT_S = float(os.environ.get("PDCTL_RAY_PROOF_TIMEOUT_S", "1200"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def post(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _stop(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(config_path: str, workdir: str, model: str, kv_dir: str) -> int:
    signal.signal(signal.SIGTERM, _stop)
    work = Path(workdir)
    bindir = Path(sys.executable).parent
    # Only loopback exists in the namespace: vLLM's get_ip() and gloo's hostname lookup would find no
    # address (vLLM falls back to 0.0.0.0 and its workers never rendezvous), so name loopback explicitly.
    env = {**os.environ, "RAY_TMPDIR": str(work / "ray"), "RAY_USAGE_STATS_ENABLED": "0",
           "VLLM_HOST_IP": "127.0.0.1", "HOST_IP": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"}
    (work / "ray").mkdir(parents=True, exist_ok=True)
    config = yaml.safe_load(Path(config_path).read_text())
    port = config["http_options"]["port"]
    result: dict[str, Any] = {"ok": False, "stage": "ray start", "completion": None, "usage": None, "kv_files": 0}
    log = open(work / "serve-run.log", "w")  # noqa: SIM115 - kept open for the background process
    serve = None
    try:
        subprocess.run(
            [str(bindir / "ray"), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={free_port()}",
             f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
             "--min-worker-port=0", "--max-worker-port=0", "--num-cpus=8", "--include-dashboard=false",
             "--disable-usage-stats", f"--temp-dir={work / 'ray'}"],
            check=True, env=env, capture_output=True, timeout=300,
        )
        result["stage"] = "serve run"
        serve = subprocess.Popen([str(bindir / "serve"), "run", "--address=auto", config_path],
                                 env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + READY_TIMEOUT_S
        base = f"http://127.0.0.1:{port}"
        while True:
            if serve.poll() is not None:
                raise RuntimeError(f"serve run exited with {serve.returncode}")
            try:
                with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as resp:
                    if resp.status == 200 and json.loads(resp.read()).get("data"):
                        break
            except Exception:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the app was not ready after {READY_TIMEOUT_S:.0f}s")
            time.sleep(5)
        result["stage"] = "request"
        prompt = ("A prefill instance computes the key and value cache for the whole prompt in one pass, "
                  "and a decode instance then generates tokens one at a time, reading that cache.")
        out = post(f"{base}/v1/completions", {"model": config["applications"][0]["args"]["decode_config"]
                   ["model_loading_config"]["model_id"], "prompt": prompt, "max_tokens": 8, "temperature": 0},
                   timeout=600)
        result["completion"] = out["choices"][0]["text"]
        result["usage"] = out.get("usage")
        result["kv_files"] = sum(1 for p in Path(kv_dir).rglob("*") if p.is_file())
        cached = ((out.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        result["ok"] = cached > 0 and result["kv_files"] > 0
        result["stage"] = "done"
    except (Exception, KeyboardInterrupt) as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if serve is not None and serve.poll() is None:
            serve.terminate()
            try:
                serve.wait(timeout=60)
            except subprocess.TimeoutExpired:
                serve.kill()
        subprocess.run([str(bindir / "ray"), "stop", "--force"], env=env, capture_output=True, timeout=120)
        log.close()
        result["log_tail"] = (work / "serve-run.log").read_text(errors="replace")[-4000:]
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5]))
