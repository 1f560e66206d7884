"""The KV store's bound (appliance/proxy/kvstore.py): the proxy evicts the least recently used prompts' KV beyond
max_mib and max_age_s, never KV used within min_idle_s, and the requests keep succeeding."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from pathlib import Path

import aiohttp

from appliance.proxy.kvstore import Entry, evict, prompt_folders, scan, to_evict
from appliance.proxy.warmup import PROMPT
from tests.proxy.cluster import MODEL, cluster, get_json, proxy_config, run, sim_state, static_backends, words
from tests.support.httpclient import post
from tests.support.waiting import eventually

MIB = 1024 * 1024


def _entries(*ages: float, size: int = 10, files: int = 4) -> list[Entry]:
    return [Entry(f"/kv/{i}", size, 1000.0 - age, files) for i, age in enumerate(ages)]


def test_least_recently_used_go_first_until_the_rest_fit() -> None:
    entries = _entries(5, 50, 30, 20, size=10)
    chosen = to_evict(entries, 1000.0, max_bytes=25, max_age_s=3600, min_idle_s=0)
    assert [e.path for e in chosen] == ["/kv/1", "/kv/2"]


def test_old_ones_go_even_under_the_size_bound() -> None:
    chosen = to_evict(_entries(5, 50, 300, 20), 1000.0, max_bytes=MIB, max_age_s=40, min_idle_s=0)
    assert [e.path for e in chosen] == ["/kv/2", "/kv/1"]


def test_recently_used_ones_stay_even_over_the_bound() -> None:
    # an engine may be between its check that the folder exists and its read of the files
    chosen = to_evict(_entries(5, 50, 30, 20), 1000.0, max_bytes=0, max_age_s=10, min_idle_s=25)
    assert [e.path for e in chosen] == ["/kv/1", "/kv/2"]
    assert to_evict(_entries(5, 50), 1000.0, max_bytes=MIB, max_age_s=3600, min_idle_s=0) == []


def test_a_folder_its_writer_left_incomplete_goes_once_idle_whatever_the_bounds() -> None:
    # an engine killed (or out of disk) while saving a prompt's layers: every engine that finds it dies reading it
    entries = [*_entries(5, 50), *_entries(40, 3, files=2)]
    entries = [Entry(f"/kv/{i}", e.size, e.last_used, e.files) for i, e in enumerate(entries)]
    chosen = to_evict(entries, 1000.0, max_bytes=MIB, max_age_s=3600, min_idle_s=25)
    assert [e.path for e in chosen] == ["/kv/2"]  # /kv/3 may still be being written


def _prompt_folder(root: Path, name: str, payload: bytes = b"kv") -> Path:
    folder = root / name
    folder.mkdir()
    (folder / "layer.0.safetensors").write_bytes(payload)
    return folder


def test_a_read_counts_as_use_and_only_prompt_folders_are_touched(tmp_path: Path) -> None:
    old = time.time() - 1000
    read = _prompt_folder(tmp_path, "a" * 32, b"x" * 100)
    unread = _prompt_folder(tmp_path, "b" * 64)
    for folder in (read, unread):
        for path in (*folder.iterdir(), folder):
            os.utime(path, (old, old))
    (tmp_path / "notes").mkdir()  # not a prompt's folder: never the store's to evict
    scan(str(tmp_path))  # arms the files: their next read moves their atime even under relatime
    (read / "layer.0.safetensors").read_bytes()
    entries = {Path(e.path).name: e for e in scan(str(tmp_path))}
    assert set(entries) == {"a" * 32, "b" * 64}
    assert entries["a" * 32].size == 100
    assert entries["a" * 32].last_used > time.time() - 60
    assert entries["b" * 64].last_used < time.time() - 900
    assert evict(entries["b" * 64]) and not unread.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["a" * 32, "notes"])


def test_a_half_removed_folder_is_removed_by_the_next_sweep(tmp_path: Path) -> None:
    _prompt_folder(tmp_path, ".evicting-" + "c" * 32)
    assert scan(str(tmp_path)) == []
    assert list(tmp_path.iterdir()) == []


async def _store_bytes(proxy_url: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(proxy_url + "/metrics") as r:
        text = await r.text()
    for line in text.splitlines():
        if line.startswith("pdctl_proxy_kv_store_bytes "):
            return float(line.split()[1])
    return -1.0


def _on_disk(storage: Path) -> tuple[int, set[str]]:
    """(bytes, names) of the prompt folders in the store; one the proxy evicts meanwhile is not counted."""
    size, names = 0, set()
    for folder in storage.iterdir():
        if folder.name.startswith("."):
            continue
        try:
            size += sum(f.stat().st_size for f in folder.iterdir())
        except FileNotFoundError:
            continue
        names.add(folder.name)
    return size, names


def test_many_distinct_prompts_stay_within_the_bound_and_keep_succeeding(tmp_path: Path) -> None:
    """A client sends hundreds of distinct prompts (each leaves its KV in the store) while another reuses one
    prompt: the store settles under its bound, the reused prompt's KV (the oldest written) stays, every
    request succeeds and the decode keeps loading the KV the prefill wrote."""
    storage = tmp_path / "kv"
    min_idle_s = 2.0
    with cluster() as c:
        p = c.sim("prefill-0", "prefill", "example", "--shared-storage", str(storage))
        d = c.sim("decode-0", "decode", "example", "--shared-storage", str(storage))
        c.ready()
        c.start_proxy(proxy_config(
            "example", backends=static_backends(("prefill-0", "prefill", p), ("decode-0", "decode", d)),
            kv_store={"folders": [str(storage)], "max_mib": 0.004, "max_age_s": 3600, "min_idle_s": min_idle_s,
                      "sweep_interval_s": 0.1}))
        c.ready()
        assert c.proxy is not None
        proxy_url = c.proxy.url

        async def ask(prompt: str) -> int:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
            status, raw, _ = await post(proxy_url, "/v1/completions", body)
            assert status == 200, raw
            return int(json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"])

        async def scenario() -> None:
            await eventually(lambda: _ready(proxy_url), what="proxy ready")
            hot = words(40)
            await ask(hot)
            _, (hot_folder,) = _on_disk(storage)
            sent, started = 0, time.monotonic()
            # rounds of distinct prompts with the hot one among them, for longer than min_idle_s thrice: the
            # hot prompt's folder is the oldest written, and only its reads keep it
            while sent < 300 or time.monotonic() - started < 3 * min_idle_s:
                cached = await asyncio.gather(*(ask(f"client{sent + i} " + words(40)) for i in range(20)), ask(hot))
                assert cached[-1] > 0  # the hot prompt's KV came from the store
                sent += 20
            bound = 0.004 * MIB
            await eventually(lambda: _under(proxy_url, bound), timeout=30, what="the store under its bound")
            size, names = _on_disk(storage)
            assert size <= bound, size
            assert hot_folder in names
            assert len(names) < sent / 2, len(names)
            stats = (await sim_state(d))["stats"]
            assert stats["kv_pulls"] >= sent, stats

        run(scenario())


def test_a_prompt_whose_kv_a_dead_writer_left_incomplete_is_served_again_once_the_proxy_evicts_it(
        tmp_path: Path) -> None:
    """A prefill killed while it saved a prompt's layers leaves a folder with some of them: an engine that finds
    it dies reading the rest (the simulated one fails the request), the restarted prefill too. The proxy evicts
    it once idle, though the store is far under its bounds, and the prompt is served again."""
    storage = tmp_path / "kv"
    with cluster() as c:
        p = c.sim("prefill-0", "prefill", "example", "--shared-storage", str(storage))
        d = c.sim("decode-0", "decode", "example", "--shared-storage", str(storage))
        c.ready()
        c.start_proxy(proxy_config(
            "example", backends=static_backends(("prefill-0", "prefill", p), ("decode-0", "decode", d)),
            kv_store={"folders": [str(storage)], "max_mib": 1024, "max_age_s": 3600, "min_idle_s": 3.0,
                      "sweep_interval_s": 0.1}))
        c.ready()
        assert c.proxy is not None
        proxy_url = c.proxy.url

        async def ask(prompt: str) -> tuple[int, bytes]:
            status, raw, _ = await post(proxy_url, "/v1/completions", {"model": MODEL, "prompt": prompt,
                                                                        "max_tokens": 2})
            return status, raw

        async def scenario() -> None:
            await eventually(lambda: _ready(proxy_url), what="proxy ready")
            assert (await ask("other " + words(40)))[0] == 200
            _, before = _on_disk(storage)
            assert (await ask(words(40)))[0] == 200
            _, after = _on_disk(storage)
            (folder,) = after - before
            for layer in (storage / folder).iterdir():
                layer.unlink()  # the writer died before its first layer's file
            status, raw = await ask(words(40))
            assert status != 200, raw  # what a real engine dies of
            await eventually(lambda: not (storage / folder).exists(), timeout=30, what="the incomplete KV evicted")
            status, raw = await ask(words(40))
            assert status == 200, raw
            assert json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            assert (storage / folder).is_dir() and any((storage / folder).iterdir())  # stored again, whole

        run(scenario())


async def _ready(url: str) -> bool:
    status, _ = await get_json(url + "/health")
    return status == 200


async def _under(url: str, bound: float) -> bool:
    size = await _store_bytes(url)
    return 0 <= size <= bound


def test_the_warm_ups_store_key_is_the_one_vllm_saves_it_under() -> None:
    """Issue 34 defect 7: the warm-up's two token ids are under any block, so vLLM's ExampleConnector saves them
    under the key of no tokens (md5 of no bytes: the folder a real CPU engine left,
    tests/engine/test_vllm_issue34.py); with a block of 1 the key is that of the first id as int64."""
    empty = "d41d8cd98f00b204e9800998ecf8427e"
    assert empty in prompt_folders(PROMPT, 128) and empty in prompt_folders(PROMPT, None)
    assert empty not in prompt_folders(PROMPT, 1)
    assert hashlib.md5((72).to_bytes(8, "little")).hexdigest() in prompt_folders(PROMPT, 1)
