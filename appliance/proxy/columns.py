"""Legs in flight per instance (and per DP rank of it) across several proxy worker processes
(docs/proxy-workers.md): each worker writes its own counts in a file of its own, mapped in memory, which the other
workers of its generation map and read; one writer per cell, no lock. A pick adds the other workers' counts to its
own (BackendState.load, pick_rank). Conditional
routing's decode windows and backlogs are one shared file that every worker changes under its lock (Queues)."""

from __future__ import annotations

import fcntl
import hashlib
import logging
import math
import mmap
import os
import struct
from pathlib import Path

log = logging.getLogger("appliance.proxy.columns")

SLOTS = 1024  # instances one column holds (a node has tens; a removed instance keeps its slot)
MAX_RANKS = 64  # DP ranks a cell counts the legs of (a rank past it: each worker counts its own alone)
_CELL = struct.Struct("=Qq")  # the instance name's hash (0: a free slot), legs in flight; then a count per rank
_COUNT = struct.Struct("=q")
_CELL_SIZE = _CELL.size + _COUNT.size * MAX_RANKS
_SIZE = SLOTS * _CELL_SIZE
_RANKS = [struct.Struct(f"={n}q") for n in range(MAX_RANKS + 1)]  # the first n ranks' counts of a cell


def name_key(name: str) -> int:
    """A nonzero 64-bit key for an instance name (the same in every worker)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") or 1


def _mapped(path: Path, create: bool) -> mmap.mmap | None:
    """The file at `path` mapped shared (created zeroed with `create`); None while another worker has not
    created its own yet."""
    try:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
    except FileNotFoundError:
        return None
    try:
        if os.fstat(fd).st_size < _SIZE:
            if not create:
                return None  # its worker is still sizing it
            os.ftruncate(fd, _SIZE)
        return mmap.mmap(fd, _SIZE)
    finally:
        os.close(fd)


class Column:
    """One instance's cells: its count in this worker's column, and its place in every other worker's."""

    __slots__ = ("columns", "key", "own", "places")

    def __init__(self, columns: Columns, key: int, own: int) -> None:
        self.columns = columns
        self.key = key
        self.own = own  # byte offset of this worker's cell
        self.places: list[int] = [-1] * len(columns.paths)  # byte offset in each other column; -1: not found yet

    def add(self, delta: int, rank: int | None = None) -> None:
        """Change this worker's count of legs by `delta`, and its count on DP rank `rank` (None: no rank)."""
        mine = self.columns.mine
        offset = self.own + 8
        (value,) = _COUNT.unpack_from(mine, offset)
        _COUNT.pack_into(mine, offset, value + delta)
        if rank is not None and rank < MAX_RANKS:
            offset = self.own + _CELL.size + 8 * rank
            (value,) = _COUNT.unpack_from(mine, offset)
            _COUNT.pack_into(mine, offset, value + delta)

    def _cells(self) -> list[tuple[mmap.mmap, int]]:
        """The instance's cell in each other column that has one (its column, its byte offset)."""
        cells = []
        maps, places, key = self.columns.others, self.places, self.key
        for k, other in enumerate(maps):
            if other is None:
                other = self.columns.open(k)
                if other is None:
                    continue
            place = places[k]
            if place < 0 or _CELL.unpack_from(other, place)[0] != key:  # a replaced worker starts from zero
                place = places[k] = _find(other, key)
                if place < 0:
                    continue
            cells.append((other, place))
        return cells

    def others(self) -> int:
        """The legs the other workers of this generation run on the instance now (every pick reads it: _cells'
        walk, inlined)."""
        total = 0
        maps, places, key = self.columns.others, self.places, self.key
        for k, other in enumerate(maps):
            if other is None:
                other = self.columns.open(k)
                if other is None:
                    continue
            place = places[k]
            if place < 0 or _CELL.unpack_from(other, place)[0] != key:  # a replaced worker starts from zero
                place = places[k] = _find(other, key)
                if place < 0:
                    continue
            total += _CELL.unpack_from(other, place)[1]
        return total

    def others_by_rank(self, size: int) -> list[int]:
        """The legs the other workers run on each of the instance's first `size` DP ranks (at most MAX_RANKS)."""
        ranks = _RANKS[min(size, MAX_RANKS)]
        totals = [0] * (ranks.size // 8)
        for other, place in self._cells():
            totals = [a + b for a, b in zip(totals, ranks.unpack_from(other, place + _CELL.size), strict=True)]
        return totals


def _find(table: mmap.mmap, key: int) -> int:
    """The byte offset of `key`'s cell in a column; -1 when it has none."""
    start = key % SLOTS
    for k in range(SLOTS):
        offset = (start + k) % SLOTS * _CELL_SIZE
        found = _CELL.unpack_from(table, offset)[0]
        if found == key:
            return offset
        if found == 0:
            return -1
    return -1


class Columns:
    """This worker's column (zeroed when it starts: a replaced worker's legs ended with it) and the others'."""

    def __init__(self, peers: Path, generation: int, index: int, workers: int) -> None:
        self.paths = [peers / f"g{generation}-w{k}.loads" for k in range(workers) if k != index]
        mine = _mapped(peers / f"g{generation}-w{index}.loads", create=True)
        assert mine is not None
        mine[:] = bytes(_SIZE)
        self.mine = mine
        self.others: list[mmap.mmap | None] = [None] * len(self.paths)

    def open(self, k: int) -> mmap.mmap | None:
        """The k-th other column, mapped once its worker has created it."""
        self.others[k] = _mapped(self.paths[k], create=False)
        return self.others[k]

    def column(self, name: str) -> Column | None:
        """The cells of instance `name`, its own slot claimed in this worker's column; None when it is full."""
        key = name_key(name)
        start = key % SLOTS
        for k in range(SLOTS):
            offset = (start + k) % SLOTS * _CELL_SIZE
            found = _CELL.unpack_from(self.mine, offset)[0]
            if found == key:
                return Column(self, key, offset)
            if found == 0:
                _CELL.pack_into(self.mine, offset, key, 0)
                return Column(self, key, offset)
        log.warning("instance %s: no slot left in the shared loads (%d): the other workers do not see its legs",
                    name, SLOTS)
        return None


RING = 32  # prompts a decode's shared window holds; past it, the oldest still in the window is added to the newest
_HEAD = struct.Struct("=Qddq")  # the decode's name key (0: a free cell), backlog level, when it was read, ring head
_RING = struct.Struct(f"={RING}d{RING}q")  # when each prompt was sent, and its tokens
_QUEUE = _HEAD.size + _RING.size
QUEUE_SLOTS = 256  # decodes the shared queues hold (a node has a few)


class Queues:
    """Conditional routing's decode windows and backlogs (policies/conditional.py's PrefillWindow and PrefillBacklog),
    shared by the workers of a generation: one mapped file, a cell per decode, that any worker reads and changes
    while it holds the file's lock (`with queues.locked: ...`), so that the backlog a decode is sent is decided as
    one process would (a worker reads, decides and counts a prompt before the next one reads)."""

    def __init__(self, peers: Path, generation: int) -> None:
        path = peers / f"g{generation}.queues"
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)  # a replaced worker keeps what the others counted
        if os.fstat(self._fd).st_size < QUEUE_SLOTS * _QUEUE:
            os.ftruncate(self._fd, QUEUE_SLOTS * _QUEUE)  # zeroed, and the same size whoever sizes it
        self.table = mmap.mmap(self._fd, QUEUE_SLOTS * _QUEUE)
        self.locked = _Locked(self._fd)

    def cell(self, name: str) -> int:
        """The byte offset of decode `name`'s cell, claimed if new (call under the lock); -1 when the file is full."""
        key = name_key(name)
        start = key % QUEUE_SLOTS
        for k in range(QUEUE_SLOTS):
            offset = (start + k) % QUEUE_SLOTS * _QUEUE
            found = _HEAD.unpack_from(self.table, offset)[0]
            if found == key:
                return offset
            if found == 0:
                _HEAD.pack_into(self.table, offset, key, 0.0, 0.0, 0)
                return offset
        log.warning("decode %s: no cell left in the shared queues (%d): each worker counts its own prompts there",
                    name, QUEUE_SLOTS)
        return -1


class _Locked:
    """The shared queues' lock (flock: the kernel lets go of it when its holder dies)."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __enter__(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)


class SharedWindow:
    """A decode's PrefillWindow in the shared queues: the same reads and counts, under Queues.locked."""

    __slots__ = ("table", "offset", "window_s")

    def __init__(self, queues: Queues, offset: int, window_s: float) -> None:
        self.table, self.offset, self.window_s = queues.table, offset, window_s

    def recent(self, now: float, window_s: float) -> int:
        """Tokens sent within `window_s` before `now`, by every worker."""
        ring = _RING.unpack_from(self.table, self.offset + _HEAD.size)
        since = now - window_s
        return sum(ring[RING + k] for k in range(RING) if ring[k] > since)

    def add(self, now: float, tokens: int) -> None:
        """Count a prompt of `tokens` uncached tokens sent to the decode at `now`."""
        if tokens <= 0:
            return
        table, offset = self.table, self.offset
        key, level, at, head = _HEAD.unpack_from(table, offset)
        when_at, tokens_at = offset + _HEAD.size + head * 8, offset + _HEAD.size + (RING + head) * 8
        (oldest,), (old,) = struct.unpack_from("=d", table, when_at), struct.unpack_from("=q", table, tokens_at)
        if oldest > now - self.window_s:
            tokens += old  # the ring is full of prompts that still count: they count a little longer
        struct.pack_into("=d", table, when_at, now)
        struct.pack_into("=q", table, tokens_at, tokens)
        _HEAD.pack_into(table, offset, key, level, at, (head + 1) % RING)


class SharedBacklog:
    """A decode's PrefillBacklog in the shared queues: the same reads and counts, under Queues.locked."""

    __slots__ = ("table", "offset")

    def __init__(self, queues: Queues, offset: int) -> None:
        self.table, self.offset = queues.table, offset

    def level(self, now: float, drained_per_s: float) -> int:
        """The backlog at `now`, every worker's prompts in it, the decode computing `drained_per_s` tokens a second."""
        key, level, at, head = _HEAD.unpack_from(self.table, self.offset)
        left: float = max(0.0, level - max(0.0, drained_per_s) * max(0.0, now - at))
        _HEAD.pack_into(self.table, self.offset, key, left, max(at, now), head)
        return math.ceil(round(left, 6))

    def add(self, now: float, tokens: int, drained_per_s: float) -> None:
        """Count a prompt of `tokens` uncached tokens sent to the decode at `now`."""
        self.level(now, drained_per_s)
        key, level, at, head = _HEAD.unpack_from(self.table, self.offset)
        _HEAD.pack_into(self.table, self.offset, key, level + max(0, tokens), at, head)
