"""AMD MORI-IO (vLLM's MoRIIOConnector): RDMA or XGMI KV transfer in READ (pull) or WRITE (push) mode."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from appliance.connector.base import (
    LOGPROBS_DROP_COUNT,
    Alone,
    Connector,
    FindInstance,
    Handoff,
    HandoffError,
    HandoffFacts,
    InstanceContext,
    Library,
    ListenerSettings,
    LlmdPod,
    OwnSettings,
    Pairing,
    Peer,
    Platform,
    ProxyListener,
    ProxySide,
    RayServeBackend,
    RdmaNeed,
    SimOptions,
    in_release,
    one_token,
    skipping_lookups,
    without_prompt_logprobs,
)
from appliance.connector.extras import ExtraConfigTable
from appliance.connector.moriio.address import router_request_id, zmq_address
from appliance.connector.moriio.settings import MoriioSettings
from appliance.roles import Mode

# kv_connector_extra_config keys that address pdctl's own proxy or a loopback host; cluster deployments
# discover peers otherwise.
# a client's X-Request-Id that may follow the router id: no "_", "," or ":", so no address can be read out of it
_PLAIN_ID = re.compile(r"[A-Za-z0-9.-]{1,200}")
NODE_LOCAL_KEYS = frozenset({"proxy_ip", "proxy_ping_port", "host_ip", "http_port"})


def strip_node_keys(kv: dict[str, Any]) -> dict[str, Any]:
    """A MoRIIO kv-transfer-config without pdctl's proxy registration and loopback addresses."""
    extra = {k: v for k, v in (kv.get("kv_connector_extra_config") or {}).items() if k not in NODE_LOCAL_KEYS}
    # vLLM's MoRIIO config parser reads these keys unconditionally; an empty proxy_ip disables the
    # registration ping, which is what a cluster (Ray's orchestrator, llm-d's sidecar) wants.
    extra["proxy_ip"] = ""
    extra["proxy_ping_port"] = "0"
    return {**kv, "kv_connector_extra_config": extra}


# The hand-off, from vLLM's MoRIIO connector (moriio_engine.py, moriio_layout.py) and public figures; nothing
# here is measured by pdctl (no MI300X was lent). What the code fixes:
# - per layer one batched RDMA (or XGMI) call: a request's blocks are cut into one segment per run of
#   contiguous blocks on both sides (compute_block_transfer_offsets merges them), K and V apart; a fresh
#   request's blocks are mostly one run, so about 2 descriptors per layer whatever the block size;
# - WRITE: the decode sends its block ids first; the prefill schedules one write per layer as soon as that
#   layer's CUDA event fires, on a background thread, and sends "write_done" after the forward, so only the
#   last layer's share and the notice follow the prefill; READ: the decode pulls every layer after it;
# - each TP rank moves its own KV heads over its own path: RDMA through its NIC (the MI300X platform's one
#   400 Gb/s NIC per GPU: 50 GB/s), or XGMI (one of its 7 links to the peer GPU, 64 GB/s each way).
# Costs per descriptor and per hand-off (RDMA work-request posts, ZMQ notices) are sub-millisecond guesses;
# at 2 descriptors per layer they cannot matter. Achieved share of a link: 0.8 (assumed).
MORIIO_LINK_GBPS = {"rdma": 50.0 * 0.8, "xgmi": 64.0 * 0.8}
MORIIO_POST_MS = 0.5
MORIIO_US_PER_DESCRIPTOR = 2.0


# ---- kv_connector_extra_config: the keys each vLLM release's MoRIIO connector reads --------------------------
# vllm/distributed/kv_transfer/kv_connector/v1/moriio/ of 0.24.0 and 0.32.0: moriio_common.py (MoRIIOConfig.
# from_vllm_config, get_moriio_mode, resolve_host_ip) and moriio_connector.py (_set_port_defaults, the
# handshake and defer timeouts); 0.32.0 adds recv_abort_timeout.
_BOTH = frozenset({"0.24.0", "0.32.0"})
EXTRA_CONFIG = ExtraConfigTable("MoRIIOConnector", {
    **dict.fromkeys(("backend", "defer_timeout", "handshake_port", "host_ip", "http_port", "notify_port",
                     "num_workers", "post_batch_size", "proxy_ip", "proxy_ping_port", "qp_per_transfer",
                     "read_mode", "transfer_timeout"), _BOTH),
    "recv_abort_timeout": frozenset({"0.32.0"}),
})


def _zmq(peer: Peer) -> str:
    address = peer.kv.get("zmq_address")
    if not address:
        raise HandoffError(503, f"instance {peer.name} has no MORI-IO zmq_address (not registered yet?)")
    return str(address)


def rank_offset(dp_rank: int, tp_rank: int) -> int:
    """How far past its instance's base ports vLLM's MoRIIOConnector binds one rank's handshake and notify port.

    Every release that has the connector, 0.14.0 (its first) to 0.33.0 (read in 0.14.0, 0.15.0, 0.18.0, 0.24.0,
    0.32.0 and 0.33.0), binds base + get_port_offset(dp_rank, tp_rank), whose tp_size defaults to 1: so
    dp_rank + tp_rank for both ports, and two ranks of a DP > 1 x TP > 1 instance share a port. Releases after
    0.33.0 are taken to do the same until one is read and found otherwise.
    """
    return dp_rank + tp_rank


class MoriioConnector(Connector):
    """MoRIIOConnector: instances register with the proxy over ZMQ; the mode is fixed at engine start."""

    name = "moriio"
    vllm_class = "MoRIIOConnector"
    modes = frozenset({"read", "write"})
    platforms = frozenset({"rocm"})
    registers_with_proxy = True
    sim_flow = "appliance.connector.moriio.sim:MoriioSim"
    library = Library("mori", "mori.io:IOEngine", "amd-mori (needs ROCm)")
    extra_config_keys = EXTRA_CONFIG
    settings_model = MoriioSettings
    moved_settings = {"moriio_backend": "backend"}

    def handoff_facts(self, platform: Platform, cross_layer: bool, settings: OwnSettings) -> HandoffFacts:
        moriio_backend = self._backend(settings)
        return HandoffFacts(post_ms=MORIIO_POST_MS, post_us_per_descriptor=MORIIO_US_PER_DESCRIPTOR,
                            transfer_us_per_descriptor=MORIIO_US_PER_DESCRIPTOR,
                            link_gbps=MORIIO_LINK_GBPS.get(moriio_backend, MORIIO_LINK_GBPS["rdma"]),
                            descriptors="layer", write_overlaps_prefill=True,
                            source=f"MORI-IO {moriio_backend.upper()}: vLLM's MoRIIO code and public link figures "
                                   "(not measured)")

    @staticmethod
    def _backend(settings: OwnSettings) -> str:
        assert isinstance(settings, MoriioSettings)
        return settings.backend

    def rdma(self, settings: OwnSettings) -> RdmaNeed:
        if self._backend(settings) == "rdma":
            return RdmaNeed(required=True,
                            fix='use backend = "xgmi" in [connector.moriio] on one node, or load the RDMA driver')
        return RdmaNeed(required=False, fix="its xgmi backend moves the KV over XGMI")

    def port_ranges(self, ctx: InstanceContext) -> dict[str, range]:
        # Each rank binds base + rank_offset() (at most DP + TP - 2); a block of DP x TP ports from each base
        # covers that and a rule that offsets by dp_rank * tp_size + tp_rank, should a release adopt one.
        return {
            "handshake": range(ctx.handshake_port, ctx.handshake_port + ctx.ranks),
            "notify": range(ctx.notify_port, ctx.notify_port + ctx.ranks),
        }

    def rank_port_conflict(self, ctx: InstanceContext, vllm_version: str) -> str | None:
        seen: dict[int, tuple[int, int]] = {}
        for dp_rank in range(ctx.dp):
            for tp_rank in range(ctx.tp):
                offset = rank_offset(dp_rank, tp_rank)
                if offset in seen:
                    first = seen[offset]
                    which = (f"vLLM {vllm_version}" if vllm_version else
                             "vLLM (version unknown; every release with MoRIIO, 0.14.0 to 0.33.0, does this)")
                    return (f"{which} binds each rank's MoRIIO handshake and notify ports at base + dp_rank + tp_rank, "
                            f"so with DP {ctx.dp} x TP {ctx.tp} the ranks (dp {first[0]}, tp {first[1]}) and "
                            f"(dp {dp_rank}, tp {tp_rank}) both bind handshake port {ctx.handshake_port + offset}")
                seen[offset] = (dp_rank, tp_rank)
        return None

    def kv_transfer_config(self, ctx: InstanceContext) -> dict[str, Any]:
        extra: dict[str, Any] = {
            "proxy_ip": ctx.proxy_host,
            "proxy_ping_port": str(ctx.proxy_ping_port),
            "http_port": str(ctx.http_port),
            "handshake_port": str(ctx.handshake_port),
            "notify_port": str(ctx.notify_port),
            "read_mode": ctx.mode == "read",
            "backend": self._backend(ctx.settings),
            "host_ip": ctx.host,
        }
        extra = EXTRA_CONFIG.kept(extra, ctx.vllm_version)
        extra.update(ctx.extra_config)
        return {"kv_connector": self.vllm_class, "kv_role": ctx.kv_role, "kv_connector_extra_config": extra}

    def env(self, ctx: InstanceContext) -> dict[str, str]:
        return {
            "VLLM_ROCM_USE_AITER": "1",
            # pdctl chooses the backend explicitly; don't let MORI switch to XGMI behind our back.
            "MORI_DISABLE_AUTO_XGMI": "1",
            "MORI_IO_ENABLE_NOTIFICATION": "0",
        }

    def proxy_kv(self, ctx: InstanceContext) -> dict[str, str | int]:
        # the proxy holds a planned instance to this address and mode whatever a registration says
        return {**super().proxy_kv(ctx), "zmq_address": zmq_address(ctx.host, ctx.handshake_port, ctx.notify_port)}

    def ray_serve(self, kv: dict[str, Any], ports: Mapping[str, list[int]], mode: Mode,
                  block_size: int | None) -> RayServeBackend:
        kv = strip_node_keys(kv)
        extra = kv["kv_connector_extra_config"]
        # Ray's MoRIIO backend derives each replica's ports from these bases (plus a replica offset) and
        # overwrites the per-engine keys, so the node's bases move to where it reads them.
        experimental = {
            "MORI_HANDSHAKE_PORT_BASE": int(extra.pop("handshake_port", ports["handshake"][0])),
            "MORI_NOTIFY_PORT_BASE": int(extra.pop("notify_port", ports["notify"][0])),
        }
        return RayServeBackend(kv, experimental)

    def llm_d(self, kv: dict[str, Any], ports: Mapping[str, list[int]], mode: Mode, vllm_port: int,
              tp: int, dp: int) -> LlmdPod:
        kv = strip_node_keys(kv)
        # Keep the node's handshake/notify bases (a pod has its own ports); the sidecar, not pdctl's proxy,
        # tells each side its peer. vLLM's MoRIIO advertises get_ip(), which honours VLLM_HOST_IP.
        kv["kv_connector_extra_config"]["http_port"] = str(vllm_port)
        # The MoRI-IO flags of llm-d's AMD P/D guide: the sidecar shapes MoRIIO's kv_transfer_params.
        sidecar = [f"--moriio-tp-size={tp}", "--moriio-local-pod-ip=$(POD_IP)"]
        if dp > 1:
            sidecar.append(f"--moriio-dp-size={dp}")
        if mode == "write":
            sidecar += ["--moriio-write-mode", "--moriio-parallel-dispatch"]
        return LlmdPod(
            kv, pod_ip_env=("VLLM_HOST_IP",), port_names={"handshake": "mori-hs", "notify": "mori-nt"},
            sidecar_args=tuple(sidecar),
            # RDMA registers (pins) the KV cache memory.
            ipc_lock=True,
            notes=("MoRIIO needs a vLLM ROCm image with MoRI-IO and a routing sidecar build with the --moriio-* "
                   "flags, and RDMA NICs in the pods (see llm-d's AMD P/D guide)",),
        )

    def sim_args(self, ctx: InstanceContext) -> list[str]:
        return ["--proxy-ping", f"{ctx.proxy_host}:{ctx.proxy_ping_port}",
                "--handshake-port", str(ctx.handshake_port), "--notify-port", str(ctx.notify_port)]

    def check_sim(self, options: SimOptions) -> None:
        if options.handshake_port is None or options.notify_port is None:
            raise ValueError("connector 'moriio' needs --handshake-port and --notify-port")

    def registration_listener(self, settings: ListenerSettings, find: FindInstance, current_mode: Callable[[], str],
                              on_result: Callable[[str], None]) -> ProxyListener:
        # imported here: only the proxy runs it, and every pdctl command that reads the settings would pay for zmq
        from appliance.connector.moriio.registration import RegistrationListener

        return RegistrationListener(settings, find, current_mode, on_result)

    def proxy_side(self, mode: Mode) -> ProxySide:
        return MoriioWrite(mode) if mode == "write" else MoriioRead(mode)


# vLLM 0.32 answers a prefill leg with the first engine request's kv_transfer_params only, whatever the connector
# (entrypoints/openai/completion/serving.py: final_res_batch[0]): a batch's other prompts, or n samples, handed
# over would read the first one's blocks (NIXL showed it on real engines). The mode is MoRIIO's read_mode, in the
# engines' flags. No release: a prefill whose decode never comes is freed by vLLM's own timeout.
MORIIO_READ = Handoff(serial=True, one_request=True, lengths=False, releases=False, fixed_mode=True)
MORIIO_WRITE = Handoff(serial=False, one_request=True, lengths=False, releases=False, fixed_mode=True)

# What a MoRIIO decode does with a request sent alone differs between vLLM releases (each read, and run as vLLM's
# real MoRIIOConnectorScheduler class by tests/connector/test_moriio_vllm.py):
# - a WRITE decode asks for no external token without do_remote_prefill in 0.32.0 only; 0.24.0 and 0.31.0 ask
#   for every uncomputed prompt token, asynchronously, whatever the params (moriio_connector.py,
#   get_num_new_matched_tokens: `if self.mode == MoRIIOMode.WRITE: return ..., True`): the decode would wait for
#   a push that never comes;
# - prompt logprobs make the scheduler drop a connector's count from 0.31.0 only (base.LOGPROBS_DROP_COUNT), so on
#   0.24.0 alone_body serves nothing either.
WRITE_SERVES_ALONE = {"0.24.0": False, "0.31.0": False, "0.32.0": True}


class MoriioWrite(ProxySide):
    """WRITE: both legs start together; the decode sends the prefill its blocks and the prefill writes them."""

    def alone(self) -> Alone:
        # WRITE_SERVES_ALONE above, base.LOGPROBS_DROP_COUNT (tests/connector/test_moriio_vllm.py)
        release = f"vLLM {self.vllm_version}" if self.vllm_version else "vLLM"
        if in_release(WRITE_SERVES_ALONE, self.vllm_version):
            return Alone(True, f"{release}'s MoRIIO decode in WRITE mode loads nothing without do_remote_prefill: "
                               "it computes the prompt itself")
        return Alone(False, f"{release}'s MoRIIO decode in WRITE mode waits for every prompt token to be pushed "
                            "by a prefill, with or without a hand-off", forced=self._drops_count())

    def _drops_count(self) -> bool:
        """Whether the engines' scheduler drops the connector's count for a request with prompt logprobs, so
        that alone_body serves what must go alone."""
        return in_release(LOGPROBS_DROP_COUNT, self.vllm_version)

    def alone_body(self, body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        return (body, False) if self.alone().served else skipping_lookups(body)

    def alone_answer(self, body: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
        return without_prompt_logprobs(answer)

    def handoff(self) -> Handoff:
        return MORIIO_WRITE

    def length_possible(self, prompt_tokens: int, block_size: int) -> bool:
        # Every length hands over in vLLM 0.32 (read, not run on AMD hardware here). moriio_connector.py
        # get_num_new_matched_tokens: READ asks for max(prompt_tokens - num_computed_tokens - 1, 0) (the
        # decode recomputes the last token), WRITE for prompt_tokens - num_computed_tokens, which the
        # scheduler's block-aligned local hit (at most prompt_tokens - 1) keeps at 1 or more. READ pairs the
        # decode's uncached blocks with the prefill's matching suffix (_align_read_blocks) and, with nothing
        # to pull (1 token, or a full local hit), keeps empty block lists so the worker still tells the
        # prefill to free; WRITE notifies the prefill of the decode's blocks for the same prompt, and of none
        # when no token is external. An empty prompt never reaches an engine (vLLM's input processor: 400).
        return True

    def release(self, decode_body: dict[str, Any], path: str) -> tuple[str, dict[str, Any]] | None:
        return None

    def request_id(self, prefill: Peer, decode: Peer, client_id: str | None = None) -> str:
        rid = router_request_id(_zmq(prefill), _zmq(decode))
        # vLLM reads both peers' addresses out of this id (moriio_common.py, _DECODE_ZMQ_RE ends
        # "_<32 hex>(?:-.*)?$"): the client's id may follow it only where it cannot be read as an address
        return f"{rid}-{client_id}" if client_id and _PLAIN_ID.fullmatch(client_id) else rid

    def prefill_body(self, body: dict[str, Any], pairing: Pairing) -> dict[str, Any]:
        leg = one_token(body)
        leg["kv_transfer_params"] = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            # one id ties the two legs (and MORI-IO's notifications) of one request together
            "transfer_id": pairing.transfer_id,
            "remote_dp_size": pairing.decode.dp_size,
            "remote_tp_size": pairing.decode.tp_size,
        }
        return leg

    def decode_body(self, body: dict[str, Any], pairing: Pairing, prefill_rank: int | None,
                    prefill_kv: dict[str, Any] | None) -> dict[str, Any]:
        prefill = pairing.prefill
        params: dict[str, Any] = {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "transfer_id": pairing.transfer_id,
        }
        if prefill_kv is not None:
            # READ: copy what the prefill returned (remote_engine_id, remote_block_ids, transfer_id, ...)
            if not prefill_kv.get("remote_block_ids") and "remote_engine_id" not in prefill_kv:
                raise HandoffError(502, f"prefill instance {prefill.name} returned unusable kv_transfer_params")
            params.update(prefill_kv)
            params["do_remote_decode"] = False
            params["do_remote_prefill"] = True
        params["remote_dp_size"] = prefill.dp_size
        params["remote_tp_size"] = prefill.tp_size
        if prefill_rank is not None:
            params["remote_dp_rank"] = prefill_rank
        return {**body, "kv_transfer_params": params}


class MoriioRead(MoriioWrite):
    """READ: the decode pulls what the prefill's answer names, after it."""

    def alone(self) -> Alone:
        # vLLM 0.32 moriio_connector.py, MoRIIOConnectorScheduler.get_num_new_matched_tokens: READ asks for
        # max(prompt - computed - 1, 0) whatever the params, and update_state_after_alloc returns early without
        # params: nothing is read, and the decode attends over positions never written (a 100-token prompt: 99
        # external tokens, no receive; tests/connector/test_moriio_vllm.py). A request with prompt logprobs
        # skips the connector's count (alone_body): correct, at the cost of the prompt's logprobs and of its
        # prefix cache hits, so only for what cannot be handed over.
        return Alone(False, "vLLM's MoRIIO decode in READ mode counts every prompt token but the last as "
                            "pulled from a prefill, with or without a hand-off, and pulls nothing without one",
                     forced=self._drops_count())

    def handoff(self) -> Handoff:
        return MORIIO_READ

    def decode_body(self, body: dict[str, Any], pairing: Pairing, prefill_rank: int | None,
                    prefill_kv: dict[str, Any] | None) -> dict[str, Any]:
        if prefill_kv is None:
            raise HandoffError(502, f"prefill instance {pairing.prefill.name} returned no kv_transfer_params")
        return super().decode_body(body, pairing, prefill_rank, prefill_kv)
