"""Legs in flight per instance across several proxy worker processes (docs/proxy-workers.md): each worker writes
its own counts in a file of its own, mapped in memory, which the other workers of its generation map and read;
one writer per cell, no lock. A pick adds the other workers' counts to its own (BackendState.load)."""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import struct
from pathlib import Path

log = logging.getLogger("appliance.proxy.columns")

SLOTS = 1024  # instances one column holds (a node has tens; a removed instance keeps its slot)
_CELL = struct.Struct("=Qq")  # the instance name's hash (0: a free slot), legs in flight
_SIZE = SLOTS * _CELL.size


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

    def add(self, delta: int) -> None:
        """Change this worker's count by `delta`."""
        mine = self.columns.mine
        offset = self.own + 8
        (value,) = struct.unpack_from("=q", mine, offset)
        struct.pack_into("=q", mine, offset, value + delta)

    def others(self) -> int:
        """The legs the other workers of this generation run on the instance now."""
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


def _find(table: mmap.mmap, key: int) -> int:
    """The byte offset of `key`'s cell in a column; -1 when it has none."""
    start = key % SLOTS
    for k in range(SLOTS):
        offset = (start + k) % SLOTS * _CELL.size
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
            offset = (start + k) % SLOTS * _CELL.size
            found = _CELL.unpack_from(self.mine, offset)[0]
            if found == key:
                return Column(self, key, offset)
            if found == 0:
                _CELL.pack_into(self.mine, offset, key, 0)
                return Column(self, key, offset)
        log.warning("instance %s: no slot left in the shared loads (%d): the other workers do not see its legs",
                    name, SLOTS)
        return None
