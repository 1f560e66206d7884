"""The CPU connector's KV store over time on real vLLM (CPU build, the tiny embedded model): a prefill and a decode
with vLLM's ExampleConnector behind the proxy, distinct prompts (each leaves its KV in the store), first behind a
proxy that bounds nothing (as before pdctl bounded the store), then behind one with a kv_store bound.

    PDCTL_TEST_VLLM_PYTHON=/path/to/vllm/venv/bin/python .venv/bin/python benchmarks/kv_store_cpu.py \\
        [--prompts 200] [--prompt-len 300] [--max-mib 16] [--min-idle 5] [--out results/cpu-kv-store]

Prints, per phase, the store's size and folder count every --every requests (and, bounded, once more after
min_idle_s without requests), the requests that failed, the decode's KV hits (usage cached_tokens > 0), the proxy's
evictions and whether both engines are alive at the end; writes OUT/summary.json.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from appliance.ports import free_ports  # noqa: E402
from benchmarks.harness import metric_samples, start_proxy, stop_all, tiny_model, totals, vllm_python  # noqa: E402
from tests.engine.vllm_helpers import (  # noqa: E402
    example_kv_config,
    post_json,
    start_vllm,
    stop_vllm,
    vllm_argv,
    vllm_env,
    wait_ready,
)

MODEL = "tiny-qwen3"


def store_size(storage: Path) -> tuple[int, int]:
    """(bytes, prompt folders) of the store."""
    size = folders = 0
    for folder in storage.iterdir():
        if folder.name.startswith("."):
            continue
        try:
            size += sum(f.stat().st_size for f in folder.iterdir())
        except FileNotFoundError:
            continue  # the proxy evicted it meanwhile
        folders += 1
    return size, folders


def proxy_config(engines: dict[str, str], kv_store: dict[str, Any] | None) -> dict[str, Any]:
    """The proxy in front of the prefill and the decode, bounding the store with `kv_store` (None: nothing)."""
    port, admin = free_ports(2)
    config: dict[str, Any] = {
        "connector": "example", "model": MODEL, "block_size": 128, "port": port, "admin": {"port": admin},
        "backends": [{"name": f"{role}-0", "role": role, "url": url} for role, url in engines.items()]}
    if kv_store is not None:
        config["kv_store"] = kv_store
    return config


def run_phase(name: str, kv_store: dict[str, Any] | None, engines: dict[str, str], storage: Path,
              rng: random.Random, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One proxy, --prompts distinct prompts through it one after another, the store sampled as they go."""
    proc, url = start_proxy(f"proxy-{name}", proxy_config(engines, kv_store), work)
    samples, failed, hits = [], 0, 0
    started = time.monotonic()
    try:
        for i in range(1, args.prompts + 1):
            prompt = [rng.randrange(args.vocabulary) for _ in range(args.prompt_len)]
            try:
                answer = post_json(url + "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 4})
                hits += (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) > 0
            except (OSError, RuntimeError) as exc:  # unreachable, or an HTTP error with the server's message
                failed += 1
                print(f"{name}: request {i} failed: {exc}", flush=True)
            if i % args.every == 0:
                size, folders = store_size(storage)
                samples.append({"requests": i, "s": round(time.monotonic() - started, 1), "mib": size / 2**20,
                                "folders": folders})
                print(f"{name:<10}{i:>6}{samples[-1]['s']:>8}{size / 2**20:>10.1f}{folders:>9}", flush=True)
        if kv_store is not None:
            # KV used within min_idle_s is never evicted: the bound holds once the newest has aged that long
            time.sleep(kv_store["min_idle_s"] + 2 * kv_store["sweep_interval_s"])
            size, folders = store_size(storage)
            samples.append({"requests": args.prompts, "s": round(time.monotonic() - started, 1),
                            "mib": size / 2**20, "folders": folders, "settled": True})
            print(f"{name:<10}{'idle':>6}{samples[-1]['s']:>8}{size / 2**20:>10.1f}{folders:>9}", flush=True)
        evicted = totals(metric_samples(url)).get("pdctl_proxy_kv_store_evictions_total", 0.0)
    finally:
        stop_all([proc])
    return {"phase": name, "kv_store": kv_store, "requests": args.prompts, "failed": failed, "decode_hits": hits,
            "evicted": evicted, "samples": samples}


def main() -> None:
    """Start the engines, run both phases, print and write the figures."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=200, help="distinct prompts per phase")
    parser.add_argument("--prompt-len", type=int, default=300, help="tokens per prompt")
    parser.add_argument("--every", type=int, default=20, help="sample the store every this many requests")
    parser.add_argument("--max-mib", type=float, default=16.0, help="the bounded phase's max_mib")
    parser.add_argument("--min-idle", type=float, default=5.0, help="the bounded phase's min_idle_s")
    parser.add_argument("--out", type=Path, default=REPO / "results" / "cpu-kv-store")
    args = parser.parse_args()
    python = vllm_python()
    args.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(7)
    with tempfile.TemporaryDirectory(prefix="pdctl-kvstore-") as tmp:
        work = Path(tmp)
        storage = work / "kv-store"
        storage.mkdir()
        model, args.vocabulary = tiny_model(python, work)
        ports = free_ports(2)
        servers = {role: start_vllm(f"{role}-0", vllm_argv(python, model, port, MODEL,
                                                          example_kv_config(kv_role, storage)),
                                    vllm_env(), work, port)
                   for (role, kv_role), port in zip((("prefill", "kv_producer"), ("decode", "kv_consumer")), ports,
                                                    strict=True)}
        try:
            wait_ready(list(servers.values()))
            engines = {role: s.url for role, s in servers.items()}
            print(f"{'phase':<10}{'reqs':>6}{'s':>8}{'MiB':>10}{'folders':>9}", flush=True)
            bound = {"folders": [str(storage)], "max_mib": args.max_mib, "max_age_s": 3600,
                     "min_idle_s": args.min_idle, "sweep_interval_s": 1.0}
            rows = [run_phase("unbounded", None, engines, storage, rng, args, work),
                    run_phase("bounded", bound, engines, storage, rng, args, work)]
            alive = {role: s.proc.poll() is None for role, s in servers.items()}
        finally:
            for server in servers.values():
                stop_vllm(server)
    summary = {"prompt_len": args.prompt_len, "max_tokens": 4, "engines_alive_at_end": alive, "phases": rows}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    for row in rows:
        last = row["samples"][-1] if row["samples"] else {}
        print(f"{row['phase']}: {row['requests']} requests, {row['failed']} failed, {row['decode_hits']} decode KV "
              f"hits, {row['evicted']:.0f} evicted, store at the end {last.get('mib', 0):.1f} MiB in "
              f"{last.get('folders', 0)} folders")
    print(f"engines alive at the end: {alive}")


if __name__ == "__main__":
    main()
