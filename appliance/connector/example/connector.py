"""vLLM's ExampleConnector: prefill saves KV to shared storage, decode loads it; serial (READ) only."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from appliance.connector.base import (
    LOGPROBS_DROP_COUNT,
    Alone,
    Connector,
    Handoff,
    InstanceContext,
    KvStoreLimits,
    OwnSettings,
    Platform,
    ProxySide,
    RayServeBackend,
    SimOptions,
    in_release,
    skipping_lookups,
    without_prompt_logprobs,
)
from appliance.connector.example.settings import ExampleSettings
from appliance.connector.extras import ExtraConfigTable
from appliance.roles import Mode

# The one kv_connector_extra_config key vLLM's ExampleConnector reads, in 0.24.0 and 0.32.0 alike
# (vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py, its __init__).
EXTRA_CONFIG = ExtraConfigTable("ExampleConnector", {"shared_storage_path": frozenset({"0.24.0", "0.32.0"})})


class ExampleConnector(Connector):
    """Shared-storage KV handoff keyed by the prompt: the CPU default and a test vehicle.

    Its proxy side (ExampleRead): the legs carry no kv_transfer_params (the prompt is the key).
    """

    name = "example"
    vllm_class = "ExampleConnector"
    modes = frozenset({"read"})
    sim_flow = "appliance.connector.example.sim:ExampleSim"
    extra_config_keys = EXTRA_CONFIG
    settings_model = ExampleSettings
    moved_settings = {"shared_storage_path": "shared_storage_path"}

    def default_block_size(self, platform: Platform) -> int:
        # vLLM's own defaults, named so that the proxy knows which prompt lengths hand nothing over
        return 128 if platform == "cpu" else 16

    def proxy_side(self, mode: Mode) -> ProxySide:
        return ExampleRead(mode)

    @staticmethod
    def _storage(ctx: InstanceContext) -> str:
        """The folder prefill saves KV to and decode loads it from."""
        assert isinstance(ctx.settings, ExampleSettings)
        return ctx.settings.shared_storage_path or ctx.kv_store

    def kv_folders(self, kv_transfer_config: Mapping[str, Any]) -> list[str]:
        path = (kv_transfer_config.get("kv_connector_extra_config") or {}).get("shared_storage_path")
        return [str(path)] if path else []

    def kv_store_limits(self, settings: OwnSettings) -> KvStoreLimits | None:
        assert isinstance(settings, ExampleSettings)
        return KvStoreLimits(max_mib=settings.max_store_mib, max_age_s=settings.max_age_s)

    def kv_transfer_config(self, ctx: InstanceContext) -> dict[str, Any]:
        extra = {**EXTRA_CONFIG.kept({"shared_storage_path": self._storage(ctx)}, ctx.vllm_version),
                 **ctx.extra_config}
        return {"kv_connector": self.vllm_class, "kv_role": ctx.kv_role, "kv_connector_extra_config": extra}

    def ray_serve(self, kv: dict[str, Any], ports: Mapping[str, list[int]], mode: Mode,
                  block_size: int | None) -> RayServeBackend:
        path = kv.get("kv_connector_extra_config", {}).get("shared_storage_path")
        # Its producer stores the first (L-1)//B*B prompt tokens, its consumer loads (L-2)//B*B: whole blocks only.
        block = block_size or "the engine's block size (128 on CPU)"
        return RayServeBackend(kv, notes=(
            f"ExampleConnector stores KV under {path}: on more than one node it must be shared storage",
            f"ExampleConnector hands over whole KV blocks only: a prompt of at most {block} + 1 tokens "
            "is recomputed by decode (usage cached_tokens 0)",
        ))

    def sim_args(self, ctx: InstanceContext) -> list[str]:
        return ["--shared-storage", self._storage(ctx)]

    def check_sim(self, options: SimOptions) -> None:
        if not options.shared_storage:
            raise ValueError("connector 'example' needs --shared-storage PATH")


# READ only, serial; one hand-off per prompt (each is keyed by its own tokens, a batch's included); nothing held
# on an engine to release (the store is evicted by the proxy); the mode is the only one it has
EXAMPLE_HANDOFF = Handoff(serial=True, one_request=False, lengths=True, releases=False, fixed_mode=False)


class ExampleRead(ProxySide):
    """The prefill saves the prompt's KV under its tokens, the decode looks it up: no kv_transfer_params."""

    def alone(self) -> Alone:
        return Alone(True, "with prompt logprobs (alone_body) vLLM skips every cache lookup, the "
                           "ExampleConnector's included (scheduler.py: skip_reading_prefix_cache): the decode "
                           "computes the prompt itself")

    def handoff(self) -> Handoff:
        return EXAMPLE_HANDOFF

    def length_possible(self, prompt_tokens: int, block_size: int) -> bool:
        # vLLM 0.32's ExampleConnector stores a prompt of L tokens under its first (L-1)//B*B and looks it up
        # under (L-2)//B*B. Below B+2 tokens nothing is handed over. At L = kB+1 the lookup is one block short
        # of what the engine's own prefix cache may hold, and for L = 1 it is -B: a hit on the key of the
        # empty prompt (stored by any prompt of at most B tokens) reports a negative number of tokens and the
        # engine core dies (IndexError in _prepare_inputs), prefill and decode alike.
        return prompt_tokens >= block_size + 2 and prompt_tokens % block_size != 1

    def alone_length_refused(self, prompt_tokens: int | None, block_size: int) -> str | None:
        # A 1-token prompt looks up the empty prompt's key (length_possible): alone_body's prompt logprobs keep
        # that lookup from loading only where the scheduler drops the connector's count for them
        # (base.LOGPROBS_DROP_COUNT: vLLM 0.31.0 on). On 0.24.0 the decode loads -B tokens whenever the key is
        # in its store (any prompt of at most B tokens it served wrote it) and its engine core dies (run on
        # real 0.24.0 engines: tests/engine/test_vllm_issue34.py).
        # A prompt of a length the proxy does not know (a batch of texts, a prompt /tokenize could not count) may
        # be that 1 token: refused on those releases too, no route being known to serve it correctly.
        if (prompt_tokens is not None and prompt_tokens != 1) or in_release(LOGPROBS_DROP_COUNT, self.vllm_version):
            return None
        if prompt_tokens is None:
            return (f"vLLM {self.vllm_version or 'of this release'}'s ExampleConnector decode would take a 1-token "
                    "prompt for the empty prompt's key and its engine core would die, and this request's prompt "
                    "lengths are not known beforehand (send token ids, or one text prompt at a time)")
        return (f"vLLM {self.vllm_version or 'of this release'}'s ExampleConnector decode looks a 1-token prompt "
                "up under the empty prompt's key whatever the request asks for, and its engine core dies when "
                "the key is in its store (vLLM 0.31.0 on skip that lookup for a request with prompt logprobs)")

    def alone_body(self, body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        # the only per-request way to keep the ExampleConnector's lookup above from running
        return skipping_lookups(body)

    def alone_answer(self, body: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
        return without_prompt_logprobs(answer)

    def release(self, decode_body: dict[str, Any], path: str) -> tuple[str, dict[str, Any]] | None:
        return None  # the prefill holds nothing for the decode: the KV is a file in the store
