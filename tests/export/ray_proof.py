"""Run an exported Ray Serve P/D app on a one-head local Ray cluster and send it one request.

Run with the tools Python inside a private network namespace (only loopback exists there, so Ray's
listeners cannot reach beyond this machine):

    unshare --net -- sh -c 'ip link set lo up && exec PYTHON ray_proof.py serve.yaml WORKDIR MODEL KVDIR'

Prints one JSON line: {"ok", "stage", "completion", "usage", "expected_cached", "kv_folders", "seconds", ...}.

vLLM's ExampleConnector hands over whole KV blocks only. The producer stores the first
(L-1)//B*B tokens of an L-token prompt (B = block size) in a folder named by the md5 of their ids; the
consumer looks up (L-2)//B*B tokens and loads those. A prompt of B+1 tokens or fewer therefore hands
over nothing (both sides hash zero tokens: the folder d41d8cd98f00b204e9800998ecf8427e, md5 of b""),
so the proof builds a prompt of about 1.5 blocks and expects exactly (L-2)//B*B cached tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

# The tools Python has no pdctl installed: its ports come from this checkout's appliance/ports.py.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from appliance.ports import free_ports  # noqa: E402

READY_TIMEOUT_S = float(os.environ.get("PDCTL_RAY_PROOF_TIMEOUT_S", "1200"))


# vLLM's CPU platform sets this block size when none is given (vllm/platforms/cpu.py).
CPU_DEFAULT_BLOCK_SIZE = 128
_TEXT = ("A prefill instance computes the key and value cache for the whole prompt in one pass, and a decode "
         "instance then generates tokens one at a time, reading that cache. The proxy sends the prompt to "
         "prefill first, then streams the answer from decode. ")


def block_size(config: dict[str, Any]) -> int:
    """The KV block size both roles run with; ExampleConnector's folder names only agree when they are equal."""
    args = config["applications"][0]["args"]
    sizes = {int(args[r]["engine_kwargs"].get("block_size", CPU_DEFAULT_BLOCK_SIZE))
             for r in ("prefill_config", "decode_config")}
    if len(sizes) != 1:
        raise ValueError(f"prefill and decode block sizes differ: {sorted(sizes)}")
    return sizes.pop()


def handoff_prompt(model: str, block: int) -> tuple[str, list[int]]:
    """A text prompt of about 1.5 blocks (so whole blocks are handed over) and its token ids."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    words = (_TEXT * (4 * block // len(_TEXT.split()) + 2)).split()
    target = block + block // 2
    for n in range(1, len(words) + 1):
        text = " ".join(words[:n])
        ids = tok.encode(text).ids
        # The producer's and the consumer's aligned prefixes agree unless (L-1) is a multiple of the block.
        if len(ids) >= target and (len(ids) - 1) % block:
            return text, ids
    raise ValueError("the handoff text is too short for the block size")


def kv_folder(token_ids: list[int], block: int) -> str:
    """ExampleConnector's folder for a stored prompt: md5 of the int64 ids of its first (L-1)//B*B tokens."""
    import numpy as np

    stored = (len(token_ids) - 1) // block * block
    return hashlib.md5(np.asarray(token_ids[:stored], dtype=np.int64).tobytes()).hexdigest()


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
    # Ray puts AF_UNIX sockets under its temp dir and refuses paths over 107 bytes; pytest's tmp paths are
    # long, so Ray gets a short folder of its own (removed at the end).
    ray_tmp = Path(tempfile.mkdtemp(prefix="pdray-", dir="/tmp"))
    env = {**os.environ, "RAY_TMPDIR": str(ray_tmp), "RAY_USAGE_STATS_ENABLED": "0",
           "VLLM_HOST_IP": "127.0.0.1", "HOST_IP": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"}
    config = yaml.safe_load(Path(config_path).read_text())
    port = config["http_options"]["port"]
    result: dict[str, Any] = {"ok": False, "stage": "ray start", "completion": None, "usage": None, "kv_files": 0}
    begun = time.monotonic()
    log = open(work / "serve-run.log", "w")  # noqa: SIM115 - kept open for the background process
    serve = None
    try:
        block = block_size(config)
        prompt, ids = handoff_prompt(model, block)
        gcs, client, agent = free_ports(3)
        started_head = subprocess.run(
            [str(bindir / "ray"), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs}",
             f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent}",
             "--min-worker-port=0", "--max-worker-port=0", "--num-cpus=8", "--include-dashboard=false",
             "--disable-usage-stats", f"--temp-dir={ray_tmp}"],
            env=env, capture_output=True, text=True, timeout=300,
        )
        if started_head.returncode != 0:
            raise RuntimeError(f"ray start failed: {started_head.stderr[-1500:]}")
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
        # The ingress lists the model before the engine replicas finish starting: a first short request
        # waits for them, so the timed request below measures the P/D path only. Its prompt is under one
        # block, so ExampleConnector stores it under md5 of nothing (the folder d41d8cd9...) and decode loads 0.
        result["stage"] = "warm-up request"
        model_id = config["applications"][0]["args"]["decode_config"]["model_loading_config"]["model_id"]
        warm = post(f"{base}/v1/completions", {"model": model_id, "prompt": "Hello!", "max_tokens": 1},
                    timeout=max(60.0, deadline - time.monotonic()))
        result["warm_up_usage"] = warm.get("usage")
        result["stage"] = "request"
        started = time.monotonic()
        out = post(f"{base}/v1/completions", {"model": model_id, "prompt": prompt, "max_tokens": 8,
                                              "temperature": 0}, timeout=600)
        result["seconds"] = round(time.monotonic() - started, 1)
        result["completion"] = out["choices"][0]["text"]
        usage = out.get("usage") or {}
        result["usage"] = usage
        prompt_tokens = int(usage.get("prompt_tokens") or 0)
        result["block_size"] = block
        result["expected_cached"] = (prompt_tokens - 2) // block * block
        folders = sorted(p.name for p in Path(kv_dir).glob("*") if p.is_dir())
        result["kv_folders"] = folders
        result["kv_folder_expected"] = kv_folder(ids, block)
        result["kv_files"] = sum(1 for p in Path(kv_dir).rglob("*") if p.is_file())
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        # Decode's cached tokens are exactly the whole blocks prefill stored, under the folder of those tokens.
        result["ok"] = (prompt_tokens == len(ids) and cached == result["expected_cached"] > 0
                        and result["kv_folder_expected"] in folders and result["kv_files"] > 0)
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
        shutil.rmtree(ray_tmp, ignore_errors=True)
        result["total_seconds"] = round(time.monotonic() - begun, 1)
        result["log_tail"] = (work / "serve-run.log").read_text(errors="replace")[-4000:]
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5]))
