"""ExampleConnector's simulated flow: KV saved to and loaded from shared storage, keyed by the prompt."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from array import array
from typing import Any

from appliance.connector.sim import (
    ConnectorSim,
    KVTransferError,
    SimSequence,
)

log = logging.getLogger("appliance.engine.sim")

_KV_FILE = "sim_kv.json"  # one file per prompt, where vLLM writes one per layer


def _align_to_block_size(num_tokens: int, block_size: int) -> int:
    # ExampleConnector's helper, including its quirk of rounding a full last block down.
    if num_tokens <= 0:
        return 0
    return (num_tokens - 1) // block_size * block_size


class ExampleSim(ConnectorSim):
    """ExampleConnector: the producer saves KV files under a folder named by a hash of the prompt
    tokens; a consumer that finds the folder loads them (serial flow, no kv_transfer_params)."""

    def _folder(self, tokens: list[int]) -> str:
        digest = hashlib.md5(array("q", tokens).tobytes(), usedforsecurity=False).hexdigest()
        assert self.cfg.shared_storage is not None
        return os.path.join(self.cfg.shared_storage, digest)

    async def start(self) -> None:
        assert self.cfg.shared_storage is not None
        os.makedirs(self.cfg.shared_storage, exist_ok=True)

    def info(self) -> dict[str, Any]:
        return {"connector": self.name, "shared_storage": self.cfg.shared_storage}

    def prepare(self, seq: SimSequence) -> None:
        if (
            self.cfg.role in ("decode", "both")
            and _align_to_block_size(len(seq.prompt) - 1, self.cfg.block_size) > 0
        ):
            seq.kv_source = self._load

    async def _load(self, seq: SimSequence) -> int:
        n = _align_to_block_size(len(seq.prompt) - 1, self.cfg.block_size)
        folder = self._folder(seq.prompt[:n])
        if not os.path.isdir(folder):
            self.stats["kv_misses"] += 1
            return 0
        await self._transfer_delay(n)
        # vLLM decides the hit on the folder alone and reads its files afterwards: one gone by then kills the
        # real engine core (FileNotFoundError); the simulated engine fails the request
        try:
            with open(os.path.join(folder, _KV_FILE)) as fh:
                json.load(fh)
        except FileNotFoundError:
            raise KVTransferError(f"KV folder {folder} lost its files after the hit") from None
        self.stats["kv_pulls"] += 1
        return n

    def on_finish(self, seq: SimSequence) -> bool:
        if self.cfg.role not in ("prefill", "both") or seq.cached_tokens:
            return False
        n = _align_to_block_size(len(seq.prompt), self.cfg.block_size)
        lookup = _align_to_block_size(len(seq.prompt) - 1, self.cfg.block_size)
        # vLLM stores a prompt only when its lookup finds nothing: a stored prompt's files are never rewritten
        if n <= 0 or os.path.isdir(self._folder(seq.prompt[:lookup])):
            return False
        folder = self._folder(seq.prompt[:n])
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, _KV_FILE), "w") as fh:
            json.dump({"num_tokens": n, "block_size": self.cfg.block_size, "model": self.cfg.model}, fh)
        self.stats["kv_saves"] += 1
        return False
