"""The KV store's bound: vLLM's ExampleConnector writes each new prompt's KV to a folder of the store, named by
a hash of the prompt's tokens, and never deletes one; the proxy evicts the least recently used beyond the
bounds of its kv_store config, so that no client (many distinct prompts) and no length of service fills the disk.

How an engine uses a folder (vLLM 0.32, kv_connector/v1/example_connector.py): the scheduler checks that the
folder exists (a hit), and the worker then reads one safetensors file per layer in the same step; a file gone by
then raises in the engine core, which dies. So a folder is evicted whole and at once (renamed out of the store,
then removed: a check sees all of it or nothing), and only once nothing has written or read it for
min_idle_s. A folder with fewer files than the others is one whose writer died mid-prompt (an engine killed
or out of disk while it saved its layers): any engine that finds it dies reading it, the restarted one as well,
so it goes as soon as it is idle, whatever the bounds. Reads show in a file's atime: after each read seen, the sweep re-arms the file (sets its own atime
again, which moves its ctime) so that the next read updates the atime under relatime as well.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from appliance.proxy.config import KvStoreConfig

log = logging.getLogger("appliance.proxy")

# the folder names vLLM gives prompts' KV: the hex digest (md5, or sha256 in FIPS mode) of their token ids;
# anything else in the folder is not the engines' and is left alone
_PROMPT_FOLDER = re.compile(r"[0-9a-f]{32}|[0-9a-f]{64}")
_EVICTING = ".evicting-"  # a folder renamed out of the store, being removed


@dataclass(frozen=True)
class Entry:
    """One prompt's KV folder: its size (bytes of its files), how many files (one per layer) and when it was
    last written or read."""

    path: str
    size: int
    last_used: float
    files: int


def to_evict(entries: Iterable[Entry], now: float, max_bytes: float, max_age_s: float,
             min_idle_s: float) -> list[Entry]:
    """The folders to evict: the incomplete ones (fewer files than the fullest: their writer died), then the least
    recently used first, those older than max_age_s and more until the rest fit in max_bytes; never one used
    within min_idle_s (an engine may be between its check and its read, or still writing it)."""
    ordered = sorted(entries, key=lambda e: e.last_used)
    layers = max((e.files for e in ordered), default=0)
    out = [e for e in ordered if e.files < layers and now - e.last_used >= min_idle_s]
    whole = [e for e in ordered if e.files == layers]
    total = sum(e.size for e in ordered) - sum(e.size for e in out)
    for entry in whole:
        idle = now - entry.last_used
        if idle < min_idle_s or (total <= max_bytes and idle <= max_age_s):
            break  # every later one was used more recently still
        out.append(entry)
        total -= entry.size
    return out


def _entry(path: str) -> Entry | None:
    """The folder's size and last use (re-arming the atime of files read since the last sweep), or None when
    it went away meanwhile."""
    try:
        st = os.stat(path, follow_symlinks=False)
        size, last, count = 0, st.st_mtime, 0
        with os.scandir(path) as files:
            for f in files:
                fs = f.stat(follow_symlinks=False)
                size += fs.st_size
                count += 1
                last = max(last, fs.st_mtime, fs.st_atime)
                if fs.st_atime_ns > fs.st_ctime_ns:
                    # relatime updates the atime of a read only when it is not after the mtime or ctime
                    os.utime(f.path, ns=(fs.st_atime_ns, fs.st_mtime_ns), follow_symlinks=False)
    except FileNotFoundError:
        return None
    return Entry(path, size, last, count)


def scan(folder: str) -> list[Entry]:
    """Every prompt's KV folder in the store, and the removal of what a previous sweep left half-removed."""
    entries: list[Entry] = []
    try:
        listing = list(os.scandir(folder))
    except FileNotFoundError:
        return entries  # the engines make it when they start
    for item in listing:
        if item.name.startswith(_EVICTING):
            shutil.rmtree(item.path, ignore_errors=True)
        elif _PROMPT_FOLDER.fullmatch(item.name) and item.is_dir(follow_symlinks=False):
            entry = _entry(item.path)
            if entry is not None:
                entries.append(entry)
    return entries


def prompt_folders(token_ids: list[int], block_size: int | None) -> set[str]:
    """The folder names (md5, and sha256 in FIPS mode) an ExampleConnector engine saves a prompt of these token
    ids under: the hash of its first (L-1)//B*B ids as int64 (vLLM 0.32 example_connector.py, make_meta and
    _generate_foldername_debug); block_size None: a prompt under any block (its key is that of no tokens)."""
    kept = (len(token_ids) - 1) // block_size * block_size if block_size else 0
    data = b"".join(t.to_bytes(8, "little", signed=True) for t in token_ids[:kept])
    return {hashlib.md5(data, usedforsecurity=False).hexdigest(), hashlib.sha256(data).hexdigest()}


def forget(folders: Iterable[str], names: Iterable[str]) -> int:
    """Remove the prompt folders `names` from each of `folders` (as evict does); how many there were."""
    return sum(evict(Entry(os.path.join(folder, name), 0, 0.0, 0)) for folder in folders for name in names)


def evict(entry: Entry) -> bool:
    """Remove one prompt's KV folder: renamed out of the store first, so that no engine sees part of it."""
    parent, name = os.path.split(entry.path)
    hidden = os.path.join(parent, _EVICTING + name)
    try:
        os.rename(entry.path, hidden)
    except FileNotFoundError:
        return False
    shutil.rmtree(hidden, ignore_errors=True)
    return True


@dataclass
class SweepResult:
    """What one sweep found and did."""

    bytes_before: int
    bytes_after: int
    evicted: int


def sweep(config: KvStoreConfig, now: float) -> SweepResult:
    """Evict what is beyond the bounds from every folder of the store (blocking: run it in a thread)."""
    entries = [e for folder in config.folders for e in scan(folder)]
    before = sum(e.size for e in entries)
    chosen = to_evict(entries, now, config.max_mib * 1024 * 1024, config.max_age_s, config.min_idle_s)
    gone = [e for e in chosen if evict(e)]
    return SweepResult(before, before - sum(e.size for e in gone), len(gone))


class KvStoreSweeper:
    """Sweeps the store every sweep_interval_s while the proxy runs; reports each sweep to `on_sweep`."""

    def __init__(self, config: KvStoreConfig, on_sweep: Callable[[SweepResult], None]) -> None:
        self.config = config
        self.on_sweep = on_sweep
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start sweeping in the background."""
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Stop sweeping (a sweep under way finishes in its thread)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        over, failure = False, ""
        while True:
            try:
                result = await asyncio.to_thread(sweep, self.config, time.time())
            except OSError as exc:
                # a store the proxy cannot read or write (its owner or mode changed): say so once, keep serving
                if str(exc) != failure:
                    log.warning("KV store sweep failed: %s", exc)
                failure = str(exc)
            else:
                failure = ""
                self.on_sweep(result)
                if result.evicted:
                    log.info("KV store: evicted %d prompts' KV, %.1f -> %.1f MiB", result.evicted,
                             result.bytes_before / 2**20, result.bytes_after / 2**20)
                now_over = result.bytes_after > self.config.max_mib * 2**20
                if now_over and not over:
                    log.warning("KV store: %.1f MiB, over its %g MiB bound, all of it used within the last %g s",
                                result.bytes_after / 2**20, self.config.max_mib, self.config.min_idle_s)
                over = now_over
            await asyncio.sleep(self.config.sweep_interval_s)
