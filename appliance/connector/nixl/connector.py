"""NVIDIA NIXL (vLLM's NixlConnector / NixlPushConnector): READ (decode pulls) or WRITE (prefill pushes)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from appliance.connector.base import (
    LOGPROBS_DROP_COUNT,
    Alone,
    Connector,
    Handoff,
    HandoffError,
    HandoffFacts,
    InstanceContext,
    Library,
    LlmdPod,
    OwnSettings,
    Pairing,
    Platform,
    ProxySide,
    RayServeBackend,
    RdmaNeed,
    SimOptions,
    asks_prompt_logprobs,
    in_release,
    one_token,
)
from appliance.connector.extras import ExtraConfigTable
from appliance.connector.nixl.settings import NixlSettings
from appliance.errors import ExportError
from appliance.roles import Mode

# Hand-off settings measured on 2 x H200 (NV18 NVLink), Qwen3-32B (results/gpu-h200x2, explained in
# appliance/data/pdctl.toml): vLLM's default 16-token blocks post 16,000 descriptors per request (55 ms post,
# which stalls the decode step); 128-token blocks post 2,048. Cross-layer blocks put every layer of a block in
# one contiguous region, so a request is about one descriptor per block (12.6 for 2000 tokens) instead of
# blocks x layers x K/V. They are NVIDIA's defaults only: that is where they were measured.
GPU_BLOCK_SIZE = 128
# the model a release of abandoned prefill KV names: served by no engine, so vLLM refuses the request (404)
RELEASE_MODEL = "pdctl-release-prefill-kv"
GPU_EXTRA_CONFIG: dict[str, Any] = {"enable_cross_layers_blocks": True}
# vLLM 0.24 allocates the cross-layer KV tensor only in its V1 model runner; Model Runner V2, its default for
# Qwen3, Llama, Mistral, DeepSeek-V2 and more, keeps per-layer blocks and ignores the setting.
CROSS_LAYER_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "0"}


# The hand-off's costs, from the engines' vllm:nixl_* histograms on 2 x H200 (results/gpu-h200x2/README.md):
# post 0.25 ms per request (cross-layer, 13 descriptors of a 2000-token prompt) + 4.1 us per descriptor
# (per-layer, 8,064 descriptors of an 8000-token prompt: 33.3 ms); transfer: bytes at 99 GB/s (cross-layer,
# 1.77 GB in 17.8 ms, NVLink cuda_ipc; a lower bound, vLLM reads it once per step) + 4.3 us per descriptor
# (per-layer 8000: 52.6 ms). The push (WRITE) starts when the prefill is done: nothing overlaps it.
H200_HANDOFF = HandoffFacts(post_ms=0.25, post_us_per_descriptor=4.1, transfer_us_per_descriptor=4.3,
                            link_gbps=99.0, descriptors="block", write_overlaps_prefill=False,
                            source="NIXL on 2 x H200 (NVLink), vllm:nixl_* histograms (results/gpu-h200x2)")


# ---- kv_connector_extra_config: the keys each vLLM release's NIXL connector reads ---------------------------
# Every get_from_extra_config of vllm/distributed/kv_transfer/kv_connector/v1/nixl/ in 0.24.0 and 0.32.0:
# base_scheduler.py (bidirectional_kv_xfer, decoder_kv_blocks_ttl, kv_lease_duration, kv_recompute_threshold),
# base_worker.py (backends, enforce_handshake_compat, engine_ttl, kv_lease_duration, num_threads),
# push_scheduler.py (push_registration_timeout); 0.24.0's connector.py also enable_cross_layers_blocks
# (prefer_cross_layer_blocks). 0.32.0's nixl/ never reads it: only mooncake/store/worker.py does.
_BOTH = frozenset({"0.24.0", "0.32.0"})
EXTRA_CONFIG = ExtraConfigTable("NixlConnector", {
    **dict.fromkeys(("backends", "bidirectional_kv_xfer", "decoder_kv_blocks_ttl", "enforce_handshake_compat",
                     "engine_ttl", "kv_lease_duration", "kv_recompute_threshold", "num_threads",
                     "push_registration_timeout"), _BOTH),
    "enable_cross_layers_blocks": frozenset({"0.24.0"}),
}, instead={"enable_cross_layers_blocks": "MooncakeStoreConnector"})


def _cross_layer_blocks(extra_config: Mapping[str, Any]) -> bool:
    """Whether a kv_connector_extra_config asks for cross-layer blocks, read the way vLLM reads it."""
    return str(extra_config.get("enable_cross_layers_blocks", "False")).lower() == "true"


def _push_release(decode_body: dict[str, Any]) -> dict[str, Any]:
    """The decode leg of a NIXL push, cut to one token: the one request that frees the prefill's blocks."""
    # WRITE: the same refused request frees nothing (push_scheduler.py request_finished parks an empty receive
    # on the decode, and push_worker.start_load_kv only files it: no notification leaves). The prefill frees
    # its blocks when its push completes (push_worker.get_transfer_results, finished_sending), which needs the
    # decode to register blocks for the prompt under the prefill's request id (_pop_matching_finished_blocks:
    # the same path and X-Request-Id). So the release is the decode leg itself, one token long, without what
    # would skip the load (prompt logprobs, echo: skip_reading_prefix_cache) and under a salt of its own, so
    # that no prefix the decode caches leaves no token to register (update_state_after_alloc returns early).
    leg = {k: v for k, v in one_token(decode_body).items()
           if k not in ("prompt_logprobs", "echo", "logprobs", "top_logprobs", "n", "best_of")}
    leg["cache_salt"] = f"pdctl-release-{uuid.uuid4().hex}"
    return leg


class NixlConnector(Connector):
    """NixlConnector (READ: decode pulls) or NixlPushConnector (WRITE: decode registers, prefill writes)."""

    name = "nixl"
    vllm_class = "NixlConnector"
    modes = frozenset({"read", "write"})
    sim_flow = "appliance.connector.nixl.sim:NixlSim"
    library = Library("nixl", "nixl._api:nixl_agent", "nixl")
    extra_config_keys = EXTRA_CONFIG
    settings_model = NixlSettings
    moved_settings = {"kv_buffer_device": "kv_buffer_device"}
    # the side channel env() pins to this node; a cluster's NIXL backend or pod sets its own
    node_local_env = frozenset({"VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT"})


    def transfer_figures(self, url: str) -> dict[str, Any] | None:
        # vLLM's NIXL stats: the puller's transfers in READ, the pusher's in WRITE
        from appliance.connector.nixl.stats import engine_figures

        return engine_figures(url)

    def transfer_warning(self, figures: Mapping[str, Any], kv_transfer_config: Mapping[str, Any] | None,
                         block_size: int | None, tp: int, kv_bytes_per_token: int | None,
                         layers: int | None) -> str | None:
        from appliance.connector.nixl.stats import asks_cross_layer_blocks, per_layer_warning

        if not asks_cross_layer_blocks(kv_transfer_config):
            return None
        return per_layer_warning(figures, block_size, tp, kv_bytes_per_token, layers)

    def rdma(self, settings: OwnSettings) -> RdmaNeed:
        return RdmaNeed(required=False, fix="NIXL falls back to NVLink/TCP within one node")

    def port_ranges(self, ctx: InstanceContext) -> dict[str, range]:
        # The side channel sits at VLLM_NIXL_SIDE_CHANNEL_PORT + dp_rank * tp_size (+ tp_rank in older
        # versions, + dp_index in newer ones): DP x TP ports from the base cover all of them.
        return {"side_channel": range(ctx.handshake_port, ctx.handshake_port + ctx.ranks)}

    def default_block_size(self, platform: Platform) -> int | None:
        return GPU_BLOCK_SIZE if platform == "cuda" else None

    def handoff_facts(self, platform: Platform, cross_layer: bool, settings: OwnSettings) -> HandoffFacts:
        # measured on NVLink only: elsewhere (UCX over RDMA or TCP) the same figures are a guess
        return replace(H200_HANDOFF, descriptors="block" if cross_layer else "layer-block")

    @staticmethod
    def _buffer_device(ctx: InstanceContext) -> str | None:
        """Where the engine stages the KV it hands off (None: vLLM's default, the GPU)."""
        assert isinstance(ctx.settings, NixlSettings)
        return ctx.settings.kv_buffer_device or ("cpu" if ctx.platform == "cpu" else None)

    def _extra_config(self, ctx: InstanceContext) -> dict[str, Any]:
        """kv_connector_extra_config: NVIDIA's measured defaults with GPU buffers (those the engine's vLLM reads),
        then the user's extra_config."""
        on_gpu = ctx.platform == "cuda" and self._buffer_device(ctx) in (None, "cuda")
        extra = EXTRA_CONFIG.kept(GPU_EXTRA_CONFIG, ctx.vllm_version) if on_gpu else {}
        extra.update(ctx.extra_config)
        return extra

    def kv_transfer_config(self, ctx: InstanceContext) -> dict[str, Any]:
        cls = "NixlPushConnector" if ctx.mode == "write" else self.vllm_class
        config: dict[str, Any] = {"kv_connector": cls, "kv_role": ctx.kv_role}
        device = self._buffer_device(ctx)
        if device:
            config["kv_buffer_device"] = device
        extra = self._extra_config(ctx)
        if extra:
            config["kv_connector_extra_config"] = extra
        return config

    def env(self, ctx: InstanceContext) -> dict[str, str]:
        env = {
            "VLLM_NIXL_SIDE_CHANNEL_HOST": ctx.host,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(ctx.handshake_port),
        }
        # NVIDIA only, where it was measured; elsewhere whoever asks for cross-layer blocks picks the runner.
        # a release that ignores the setting keeps its own runner
        if (ctx.platform == "cuda" and _cross_layer_blocks(self._extra_config(ctx))
                and EXTRA_CONFIG.read_by("enable_cross_layers_blocks", ctx.vllm_version) is not False):
            env.update(CROSS_LAYER_ENV)
        return env

    def ray_serve(self, kv: dict[str, Any], ports: Mapping[str, list[int]], mode: Mode,
                  block_size: int | None) -> RayServeBackend:
        if mode == "write":
            raise ExportError("Ray Serve LLM's P/D router drives NIXL in READ (pull) mode only",
                              fix="export the plan with --mode read")
        # Ray's NIXL backend sets VLLM_NIXL_SIDE_CHANNEL_PORT = base + replica offset, and the host to the node IP.
        return RayServeBackend(kv, {"NIXL_SIDE_CHANNEL_PORT_BASE": ports["side_channel"][0]})

    def llm_d(self, kv: dict[str, Any], ports: Mapping[str, list[int]], mode: Mode, vllm_port: int,
              tp: int, dp: int) -> LlmdPod:
        if mode == "write":
            # the sidecar's nixlv2 protocol hands the decode the prefill's block ids: a pull
            raise ExportError("llm-d's routing sidecar drives NIXL in READ (pull) mode only",
                              fix="export the plan with --mode read")
        return LlmdPod(kv, env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(ports["side_channel"][0])},
                       pod_ip_env=("VLLM_NIXL_SIDE_CHANNEL_HOST",), port_names={"side_channel": "nixl"})

    def sim_args(self, ctx: InstanceContext) -> list[str]:
        return ["--side-channel-port", str(ctx.handshake_port)]

    def check_sim(self, options: SimOptions) -> None:
        # READ: the decode pulls from the prefill's side channel. WRITE: the prefill also reaches the decode's
        # (the reverse handshake and the "written" notification), so both need one.
        needs = ("prefill", "both") if options.mode == "read" else ("prefill", "decode", "both")
        if options.role in needs and options.side_channel_port is None:
            raise ValueError(f"connector 'nixl' ({options.mode}) on a {options.role} engine needs --side-channel-port")

    def proxy_side(self, mode: Mode) -> ProxySide:
        return NixlPush(mode) if mode == "write" else NixlPull(mode)


# vLLM 0.32 answers a prefill leg with one kv_transfer_params, the first engine request's
# (entrypoints/openai/completion/serving.py: final_res_batch[0].kv_transfer_params), and the decode applies it to
# every engine request of its leg: the other prompts of a batch were decoded on the first one's KV (a real CPU
# run: [A, B] answered B differently from B alone) and their own prefills held until the lease; n samples all
# read one set of blocks that the prefill frees after the first read. So one engine request per hand-off.
# WRITE too is serial: the decode names the prefill's engine id, which only the prefill's answer carries.
# vLLM 0.24+ ships the push flow as its own class: the mode is in the engines' flags.
NIXL_HANDOFF = Handoff(serial=True, one_request=True, lengths=False, releases=True, fixed_mode=True)


class NixlPull(ProxySide):
    """READ (NixlConnector): the decode pulls the blocks the prefill's answer names."""

    def alone(self) -> Alone:
        # vLLM 0.32 nixl/pull_scheduler.py and push_scheduler.py, get_num_new_matched_tokens: (0, False) unless
        # the request carries do_remote_prefill (real CPU engines: tests/engine/test_vllm_nixl_release.py)
        return Alone(True, f"vLLM's NIXL decode ({self.mode}) loads nothing without do_remote_prefill: it "
                           "computes the prompt itself")

    def handoff(self) -> Handoff:
        return NIXL_HANDOFF

    def body_possible(self, body: Mapping[str, Any]) -> bool:
        # Prompt logprobs: from vLLM 0.31.0 the scheduler zeroes the decode's count for such a request
        # (base.LOGPROBS_DROP_COUNT): the decode computes the whole prompt itself, returns every prompt logprob,
        # and its word still frees the prefill. vLLM 0.24.0 drops only the local prefix cache for it: the decode
        # loads the prefill's KV and answers prompt logprobs for the one token it computed ([None] for a
        # 1,086-token prompt on a real H100: results/gpu-1x/h34), so there it goes to the decode alone.
        return not asks_prompt_logprobs(body) or in_release(LOGPROBS_DROP_COUNT, self.vllm_version)

    def length_possible(self, prompt_tokens: int, block_size: int) -> bool:
        # Every length hands over in vLLM 0.32, READ and WRITE alike. The decode asks for prompt_tokens -
        # num_computed_tokens (nixl/pull_scheduler.py and push_scheduler.py, get_num_new_matched_tokens), and
        # the scheduler offers it a block-aligned local hit of at most prompt_tokens - 1 (v1/core/sched/
        # scheduler.py, block_aligned_local), so the count is at least 1 for 1 token, under one block, k*B and
        # k*B+1, with or without a prefix hit (a prompt the decode holds whole included); a load that covers
        # the whole prompt recomputes its last token (_update_waiting_for_remote_kv). The worker moves only the
        # decode's uncached blocks, end-trimming the prefill's list to them (nixl/base_worker.py
        # _apply_prefix_caching, which asserts decode <= prefill: the prefill holds every block of the same
        # prompt). An empty prompt never reaches an engine: vLLM's input processor refuses it (400).
        return True

    def release(self, decode_body: dict[str, Any], path: str) -> tuple[str, dict[str, Any]] | None:
        # A prefill that answered keeps its blocks until the decode reads them (READ) or they are written to it
        # (WRITE), or until its lease ends: kv_lease_duration, 30 s in vLLM 0.32 (nixl/base_scheduler.py,
        # _reqs_need_send; freed by base_worker._reap_expired_send_leases, counted as
        # vllm:nixl_num_kv_expired_reqs).
        params = decode_body.get("kv_transfer_params")
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return None
        # READ: the decode's word frees them. A request that carries do_remote_prefill and is refused by the
        # decode's OpenAI layer is submitted as an aborted request (entrypoints/generate/base/serving.py
        # _with_kv_transfer_rejection_cleanup -> AsyncLLM.notify_kv_transfer_request_rejected), whose
        # request_finished has the worker send the prefill a notification without a transfer
        # (pull_scheduler.py, do_remote_prefill still set). A model no instance serves is refused before
        # anything else is done (_check_model).
        return "/v1/completions", {"model": RELEASE_MODEL, "prompt": [0], "max_tokens": 1, "kv_transfer_params": params}

    def prefill_body(self, body: dict[str, Any], pairing: Pairing) -> dict[str, Any]:
        leg = one_token(body)
        leg["kv_transfer_params"] = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        }
        return leg

    def decode_body(self, body: dict[str, Any], pairing: Pairing, prefill_rank: int | None,
                    prefill_kv: dict[str, Any] | None) -> dict[str, Any]:
        if not prefill_kv:
            raise HandoffError(502, f"prefill instance {pairing.prefill.name} returned no kv_transfer_params")
        return {**body, "kv_transfer_params": prefill_kv}


class NixlPush(NixlPull):
    """WRITE (NixlPushConnector): the decode registers its blocks with the prefill, which writes into them."""

    def body_possible(self, body: Mapping[str, Any]) -> bool:
        # A push decode that loads nothing registers no blocks (push_scheduler.py update_state_after_alloc
        # returns early at num_external_tokens 0; request_finished then parks an empty receive that
        # push_worker.start_load_kv only files: nothing reaches the prefill), so the prefill holds its KV for its
        # 30 s lease. Prompt logprobs (echo with logprobs, in completions) make vLLM's scheduler zero every
        # decode's count from 0.31.0 (skip_reading_prefix_cache), and on 0.24.0 the decode that loads the pushed
        # KV answers prompt logprobs for its computed token only (NixlPull.body_possible): in every release such
        # a request goes to the decode alone, which computes its prompt itself and returns the same logprobs
        # (real engines: tests/engine/test_vllm_nixl_release.py, CPU 0.32.0 and H100 0.24.0).
        return not asks_prompt_logprobs(body)

    def release(self, decode_body: dict[str, Any], path: str) -> tuple[str, dict[str, Any]] | None:
        # the refused request READ sends frees nothing here (body_possible above): the release is the decode leg
        # itself, one token long (_push_release)
        params = decode_body.get("kv_transfer_params")
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return None
        return path, _push_release(decode_body)

    def decode_body(self, body: dict[str, Any], pairing: Pairing, prefill_rank: int | None,
                    prefill_kv: dict[str, Any] | None) -> dict[str, Any]:
        prefill = pairing.prefill
        if not prefill_kv:
            raise HandoffError(502, f"prefill instance {prefill.name} returned no kv_transfer_params")
        missing = [k for k in ("remote_engine_id", "remote_host", "remote_port") if prefill_kv.get(k) is None]
        if missing:
            raise HandoffError(502, f"prefill instance {prefill.name} returned no {', '.join(missing)} for a NIXL push")
        # vLLM's NixlPushConnector: no remote_block_ids; the decode allocates its own blocks, registers them
        # with this prefill engine over NIXL (both legs share the X-Request-Id it matches them by) and waits
        # for the prefill to write the KV into them.
        return {**body, "kv_transfer_params": {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": prefill_kv["remote_engine_id"],
            "remote_request_id": prefill_kv.get("remote_request_id"),
            "remote_host": prefill_kv["remote_host"],
            "remote_port": prefill_kv["remote_port"],
            "tp_size": prefill_kv.get("tp_size", prefill.tp_size),
        }}
