"""What every KV connector module provides: its engine side (vLLM flags, environment, ports), its simulated
engine (arguments and flow), and its proxy side (ProxySide, one per transfer mode: what a request sent to a decode
alone is, how a request is handed over, how a prefill whose client left is released)."""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar, Literal, Protocol

from pydantic import BaseModel, ConfigDict

from appliance.connector.extras import ExtraConfigTable
from appliance.releases import answer_for, version_tuple
from appliance.roles import Mode, Role

Platform = Literal["rocm", "cuda", "cpu"]

PLATFORMS: tuple[Platform, ...] = ("rocm", "cuda", "cpu")


@dataclass(frozen=True)
class Library:
    """The Python library a connector needs in the engine's environment (checked by `pdctl doctor`)."""

    label: str  # what doctor calls it
    probe: str  # "module:attribute" whose import fails when the library cannot work
    install: str  # what to install when it does not load


@dataclass(frozen=True)
class RdmaNeed:
    """How a connector depends on RDMA devices: without them it fails (required) or only slows (not)."""

    required: bool
    fix: str  # required: what to do without them; not: why the connector serves without them


@dataclass(frozen=True)
class HandoffFacts:
    """What one prompt's KV hand-off costs with this connector, for `pdctl plan --suggest`: who posts the
    transfer, how many descriptors it is cut into, and the per-hand-off, per-descriptor and per-byte costs."""

    post_ms: float  # per hand-off
    post_us_per_descriptor: float
    transfer_us_per_descriptor: float
    link_gbps: float  # per rank pair (each TP rank moves its own share of the KV)
    # "block": one descriptor per block of every layer (cross-layer blocks); "layer-block": one per layer, K/V
    # and block; "layer": one per layer and K/V, a request's contiguous blocks merged into one
    descriptors: Literal["block", "layer-block", "layer"]
    # WRITE: the prefill pushes each layer's KV as soon as that layer is computed, so only the last layer's
    # share and the completion notice remain after the prefill (False: the whole transfer follows it)
    write_overlaps_prefill: bool
    source: str


@dataclass(frozen=True)
class Alone:
    """How a decode instance serves a request sent alone (no hand-off) in one transfer mode, and the vLLM
    behaviour that says so (ProxySide.alone; docs/routing.md, "Routes per connector"). `served`: the client's
    prompt as it is (False: vLLM's scheduler side of the connector would skip prompt tokens nobody wrote, so
    conditional routing never chooses the decode alone); `forced`: a request that cannot be handed over (a
    batch, a length or a body the hand-off cannot carry), through ProxySide.alone_body (False: the proxy
    refuses it)."""

    served: bool
    why: str
    forced: bool = True


# Whether vLLM's scheduler drops a connector's count for a request that asks for prompt logprobs, by release (read,
# and run as the real scheduler by tests/connector/test_moriio_vllm.py): 0.31.0 and 0.32.0 do (v1/core/sched/
# scheduler.py: `if request.skip_reading_prefix_cache: ext_tokens, load_kv_async = 0, False`); 0.24.0 has no such
# line (prompt logprobs skip the local prefix cache only), so there a connector's lookup still loads what it counts.
LOGPROBS_DROP_COUNT = {"0.24.0": False, "0.31.0": True, "0.32.0": True}


def in_release(table: dict[str, bool], vllm_version: str) -> bool:
    """`table`'s answer for vLLM `vllm_version`: unknown (""), the newest read release's (pdctl's tested one);
    a release between read ones that disagree, or older than all, no (the answer that is never wrong)."""
    if not vllm_version:
        return table[max(table, key=version_tuple)]
    return answer_for(vllm_version, table) is True


def asks_prompt_logprobs(body: Mapping[str, Any]) -> bool:
    """Whether `body` asks vLLM for prompt logprobs (completions' echo with logprobs does too), which make it
    skip every cache lookup, its KV connector's included (v1/core/sched/scheduler.py: skip_reading_prefix_cache
    sets the connector's count to 0)."""
    return body.get("prompt_logprobs") is not None or bool(body.get("echo") and body.get("logprobs") is not None)


def skipping_lookups(body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """`body` asking for prompt logprobs (asks_prompt_logprobs), and whether the answer must lose them again
    (without_prompt_logprobs): a body that asks for them already needs neither."""
    if asks_prompt_logprobs(body):
        return body, False
    return {**body, "prompt_logprobs": 0}, True


def without_prompt_logprobs(answer: dict[str, Any]) -> dict[str, Any]:
    """A non-streamed answer to skipping_lookups' body as vLLM's own to the client's body: no prompt logprobs."""
    if "prompt_logprobs" in answer:
        answer = {**answer, "prompt_logprobs": None}
    choices = answer.get("choices")
    if isinstance(choices, list):
        answer = {**answer, "choices": [{**c, "prompt_logprobs": None} if isinstance(c, dict) and
                                        "prompt_logprobs" in c else c for c in choices]}
    return answer


@dataclass(frozen=True)
class KvStoreLimits:
    """How far pdctl lets a connector's KV folders grow: beyond either bound the proxy evicts, oldest first."""

    max_mib: float  # all the folders together
    max_age_s: float  # since a prompt's KV was last written or read


class OwnSettings(BaseModel):
    """A connector's own settings, the table [connector.<name>] of pdctl.toml: each connector that has some
    subclasses this (its settings_model); unknown keys are errors, so a typo never passes silently."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=True, allow_inf_nan=False)


@dataclass(frozen=True)
class InstanceContext:
    """Everything a connector needs to know about one engine instance of the plan."""

    connector: str  # the name pdctl finds the connector by: a registered name, or "module:Class"
    role: Role
    index: int
    tp: int
    dp: int
    host: str
    http_port: int
    handshake_port: int
    notify_port: int
    mode: Mode
    platform: Platform
    proxy_host: str
    proxy_ping_port: int
    kv_store: str  # the state directory's folder for KV kept on disk: a default for connectors that do
    settings: OwnSettings  # the connector's own settings ([connector.<name>]), as its settings_model
    extra_config: dict[str, Any] = field(default_factory=dict)
    block_size: int | None = None
    vllm_version: str = ""  # the engine's vLLM release ("": unknown): what it reads of the connector's config

    @property
    def ranks(self) -> int:
        """Engine ranks of the instance (DP x TP), each of which may bind connector ports."""
        return self.dp * self.tp

    @property
    def kv_role(self) -> str:
        """vLLM's kv_role for this instance."""
        return {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}[self.role]


@dataclass(frozen=True)
class RayServeBackend:
    """What Ray Serve LLM's backend for a connector takes for one role's replicas."""

    kv_transfer_config: dict[str, Any]
    experimental_configs: dict[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class LlmdPod:
    """What one role's llm-d pods need for a connector: peers are addressed by pod IP, not by pdctl's proxy."""

    kv_transfer_config: dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)
    pod_ip_env: tuple[str, ...] = ()  # variables set to the pod's own IP
    port_names: dict[str, str] = field(default_factory=dict)  # port purpose -> container port name prefix
    sidecar_args: tuple[str, ...] = ()  # the routing sidecar's connector flags; $(POD_IP) is the pod's IP
    ipc_lock: bool = False  # the transfer pins (registers) the KV cache memory
    notes: tuple[str, ...] = ()


class Peer(Protocol):
    """An engine instance as the proxy sees it: what a connector may read to address it."""

    @property
    def name(self) -> str: ...

    @property
    def dp_size(self) -> int: ...

    @property
    def tp_size(self) -> int: ...

    @property
    def kv(self) -> Mapping[str, Any]: ...


class SimOptions(Protocol):
    """The simulated engine's settings a connector checks (appliance.engine.sim.config.SimConfig)."""

    @property
    def role(self) -> str: ...

    @property
    def mode(self) -> str: ...

    @property
    def handshake_port(self) -> int | None: ...

    @property
    def notify_port(self) -> int | None: ...

    @property
    def side_channel_port(self) -> int | None: ...

    @property
    def shared_storage(self) -> str | None: ...


class ListenerSettings(Protocol):
    """Where the listener binds and whom it hears (the proxy's RegistrationConfig)."""

    @property
    def host(self) -> str: ...

    @property
    def port(self) -> int: ...

    @property
    def allowed_hosts(self) -> list[str]: ...

    @property
    def peer_hosts(self) -> dict[str, list[str]]: ...

    @property
    def max_per_s(self) -> float: ...


class Registrant(Protocol):
    """A planned instance as a registration refreshes it (appliance.proxy.instances.BackendState)."""

    name: str
    role: str
    dp_size: int
    tp_size: int
    kv: dict[str, Any]
    transfer_mode: str | None
    last_seen: float | None
    last_seen_mono: float | None


# The planned instance served at (canonical host, port), or None.
FindInstance = Callable[[str, int], Registrant | None]


class ProxyListener(Protocol):
    """A socket the proxy runs for a connector (its engines' registrations), bound by start()."""

    port: int

    def start(self) -> None: ...

    async def stop(self) -> None: ...


class HandoffError(Exception):
    """A request's KV handoff cannot go ahead; the client gets `status` (502/503/504) with the message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def one_token(body: dict[str, Any]) -> dict[str, Any]:
    """`body` asking for one token, not streamed (a prefill leg, a release)."""
    leg = dict(body)
    leg["stream"] = False
    leg["max_tokens"] = 1
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    leg.pop("stream_options", None)
    # a 1-token leg cannot honour a minimum length; the decode leg keeps it
    leg.pop("min_tokens", None)
    leg.pop("min_completion_tokens", None)
    return leg


@dataclass(frozen=True, slots=True)
class Handoff:
    """How a connector hands one request's KV over in one transfer mode: what the router and the legs read."""

    # the decode leg needs the prefill's answer, so the legs run one after the other (READ; WRITE where the
    # decode must name what only that answer carries); else both start together and the prefill pushes
    serial: bool
    # the hand-off carries one engine request's KV: a request that is several (n > 1, a prompt list) is served
    # by a decode alone (ProxySide.alone_body)
    one_request: bool
    # some prompt lengths cannot be handed over (ProxySide.length_possible): the proxy counts a prompt's tokens
    lengths: bool
    # release() frees a prefill's KV whose decode leg will not be sent, so the proxy reads a prefill leg whose
    # client left to its end (its answer carries what the release needs) instead of aborting it
    releases: bool
    # the engines run the mode from their start (it is in their flags): the proxy routes an instance no request
    # while it runs another mode, and a switch restarts them
    fixed_mode: bool


@dataclass(frozen=True)
class Pairing:
    """One request's two legs as its connector pairs them: the instances and the X-Request-Id both legs carry
    (ProxySide.request_id)."""

    prefill: Peer
    decode: Peer
    request_id: str

    @cached_property
    def transfer_id(self) -> str:
        """An id of this hand-off apart from the request id, made on first use (MoRIIO's transfer_id)."""
        return f"tx-{uuid.uuid4()}"


class ProxySide(ABC):
    """A connector's proxy side in one transfer mode (Connector.proxy_side), as vLLM splits a connector into its
    scheduler and worker sides: what a request sent to a decode alone is, how one is handed over and how a
    prefill whose client left is released. Its three answers (alone, handoff, release) are abstract: a
    connector whose side leaves one out is refused when it is loaded (appliance.connector.get_connector)."""

    # the engines' vLLM release ("": unknown), set by Connector.side: a side whose answers differ between
    # releases reads it (MoRIIO's)
    vllm_version: str = ""

    def __init__(self, mode: Mode) -> None:
        self.mode = mode

    # ---- what the routing pipeline asks (appliance/proxy/route) ------------------------------------------
    @abstractmethod
    def alone(self) -> Alone:
        """Whether a decode instance in this mode serves a request sent alone (alone_body) correctly, from what
        vLLM's scheduler side of the connector does with a request without a hand-off."""

    @abstractmethod
    def handoff(self) -> Handoff | None:
        """How a request is handed over in this mode; None: no hand-off (colocated engines)."""

    def length_possible(self, prompt_tokens: int, block_size: int) -> bool:
        """Whether a prompt of this many tokens can be handed over (read where handoff().lengths; False: the
        proxy sends it to a decode instance alone)."""
        return True

    def body_possible(self, body: Mapping[str, Any]) -> bool:
        """Whether what `body` asks for leaves the hand-off whole (False: the proxy sends it to a decode alone)."""
        return True

    def alone_length_refused(self, prompt_tokens: int | None, block_size: int) -> str | None:
        """Why a decode instance cannot serve a request whose shortest prompt has this many tokens sent alone
        (alone_body; None: the proxy does not know it), though alone() says it serves one, so that no route
        serves it and the proxy refuses it; None: it can (read where handoff().lengths)."""
        return None

    # ---- a request sent alone ------------------------------------------------------------------------------
    def alone_body(self, body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """The request a decode instance serves without a hand-off, and whether alone_answer must mend its
        non-streamed answer."""
        return body, False

    def alone_answer(self, body: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
        """The client's answer from a decode instance's answer to alone_body(body)."""
        return answer

    # ---- a request handed over -----------------------------------------------------------------------------
    def request_id(self, prefill: Peer, decode: Peer, client_id: str | None = None) -> str:
        """The X-Request-Id both legs of one request carry: unique to the request (connectors pair its legs by
        it), led by the client's own X-Request-Id when it sent one (vLLM answers with the id cmpl-<this>)."""
        unique = uuid.uuid4().hex
        return f"{client_id}-{unique}" if client_id else unique

    def pair(self, prefill: Peer, decode: Peer, client_id: str | None = None) -> Pairing:
        """One request's legs on `prefill` and `decode`, under request_id's id."""
        return Pairing(prefill, decode, self.request_id(prefill, decode, client_id))

    def prefill_body(self, body: dict[str, Any], pairing: Pairing) -> dict[str, Any]:
        """The prefill leg: one token, not streamed."""
        return one_token(body)

    def decode_body(self, body: dict[str, Any], pairing: Pairing, prefill_rank: int | None,
                    prefill_kv: dict[str, Any] | None) -> dict[str, Any]:
        """The decode leg: the client's request plus what the decode needs from the prefill. `prefill_kv` is the
        prefill's returned kv_transfer_params where the legs are serial, None where both start together or the
        prefill returned none. Raises HandoffError where the decode cannot go ahead without what is missing."""
        return body

    # ---- a request whose client left -----------------------------------------------------------------------
    @abstractmethod
    def release(self, decode_body: dict[str, Any], path: str) -> tuple[str, dict[str, Any]] | None:
        """What a decode instance is sent (the path and body of a POST, with the legs' X-Request-Id) so that the
        prefill frees the KV it holds for `decode_body`, a decode leg to `path` that will not be sent (its client
        left); None: nothing to release."""


class Colocated(ProxySide):
    """The proxy side of engines that compute their own prompts: no hand-off, nothing to release."""

    def alone(self) -> Alone:
        return Alone(True, "no connector: every engine computes its prompts itself")

    def handoff(self) -> Handoff | None:
        return None

    def release(self, decode_body: dict[str, Any], path: str) -> tuple[str, dict[str, Any]] | None:
        return None


class Connector(ABC):
    """One KV connector: the single place that knows its vLLM class, flags, ports, simulation and proxy protocol."""

    name: ClassVar[str]
    vllm_class: ClassVar[str | None]
    modes: ClassVar[frozenset[Mode]]
    platforms: ClassVar[frozenset[Platform]] = frozenset(PLATFORMS)
    # True: instances announce themselves to the proxy's registration socket (the proxy listens for them).
    registers_with_proxy: ClassVar[bool] = False
    # Its own settings, the table [connector.<name>] (OwnSettings: none).
    settings_model: ClassVar[type[OwnSettings]] = OwnSettings
    # Keys of its settings that older releases read from [connector] itself: old key -> key in its own table.
    moved_settings: ClassVar[dict[str, str]] = {}
    # The simulated engine's flow for this connector, "module:Class", imported only when a sim engine runs it.
    sim_flow: ClassVar[str]
    # The kv_connector_extra_config keys each vLLM release reads for this connector (None: it renders none).
    extra_config_keys: ClassVar[ExtraConfigTable | None] = None
    # The library vLLM loads for this connector, if any.
    library: ClassVar[Library | None] = None
    # Variables of env() that pin an engine to this node's addresses or ports: a cluster export leaves them out,
    # the cluster engine (Ray's backend, a pod's own IP) sets its own.
    node_local_env: ClassVar[frozenset[str]] = frozenset()

    # ---- the engine side ------------------------------------------------------------------------
    def port_ranges(self, ctx: InstanceContext) -> dict[str, range]:
        """Every port (by purpose) that some rank of the instance binds for this connector."""
        return {}

    def default_block_size(self, platform: Platform) -> int | None:
        """The KV cache block size (tokens) the hand-off is fastest with here; None: vLLM's own default."""
        return None

    def handoff_facts(self, platform: Platform, cross_layer: bool, settings: OwnSettings) -> HandoffFacts | None:
        """What its KV hand-off costs on this platform (None: no model of it; suggest assumes it free)."""
        return None

    def rank_port_conflict(self, ctx: InstanceContext, vllm_version: str) -> str | None:
        """Why two ranks of the instance would bind one port in this vLLM version ("": unknown), or None."""
        return None

    @abstractmethod
    def kv_transfer_config(self, ctx: InstanceContext) -> dict[str, Any] | None:
        """The --kv-transfer-config value (None: no connector)."""

    def env(self, ctx: InstanceContext) -> dict[str, str]:
        """Environment variables the connector needs in the engine's process."""
        return {}

    def proxy_kv(self, ctx: InstanceContext) -> dict[str, str | int]:
        """What the proxy needs to address this instance for the connector's protocol; where the mode is fixed at
        engine start, the mode the engine runs: the proxy routes it no request while it runs another mode."""
        return {"transfer_mode": ctx.mode} if self.mode_fixed_at_start else {}

    def rdma(self, settings: OwnSettings) -> RdmaNeed | None:
        """Whether the transfer uses RDMA devices (None: never), given the connector's own settings."""
        return None

    def transfer_figures(self, url: str) -> dict[str, Any] | None:
        """The KV transfers the engine at `url` posted since it started, from its own metrics (`pdctl status`),
        or None: this connector's engines publish none, or the engine did not answer."""
        return None

    def transfer_warning(self, figures: Mapping[str, Any], kv_transfer_config: Mapping[str, Any] | None,
                         block_size: int | None, tp: int, kv_bytes_per_token: int | None,
                         layers: int | None) -> str | None:
        """What `figures` show the engine ignored of what it was asked (a KV layout, say), with the fix; None
        when nothing."""
        return None

    def kv_folders(self, kv_transfer_config: Mapping[str, Any]) -> list[str]:
        """Folders of this node where an engine with this kv-transfer-config keeps prompts' KV (pdctl makes them
        private to its user)."""
        return []

    def kv_store_limits(self, settings: OwnSettings) -> KvStoreLimits | None:
        """The bounds of this connector's kv_folders under its own settings, or None: pdctl evicts nothing."""
        return None

    def check_mode(self, mode: Mode) -> None:
        """Raise ValueError when the connector has no such transfer mode (the one rule every validator uses)."""
        if mode not in self.modes:
            raise ValueError(f"connector '{self.name}' has no {mode} mode (it supports {', '.join(sorted(self.modes))})")

    # ---- the simulated engine -------------------------------------------------------------------
    def sim_args(self, ctx: InstanceContext) -> list[str]:
        """The simulated engine's connector flags for this instance (same ports as the real engine)."""
        return []

    def check_sim(self, options: SimOptions) -> None:
        """Raise ValueError when a simulated engine lacks a setting this connector's flow needs."""
        return None

    # ---- the cluster exports (appliance/export) ---------------------------------------------------
    def ray_serve(self, kv: dict[str, Any], ports: Mapping[str, list[int]], mode: Mode,
                  block_size: int | None) -> RayServeBackend | None:
        """Ray Serve LLM's backend for one role's node `kv` config and ports; None: Ray has none for it.

        Raises ExportError for a mode Ray's P/D router cannot drive."""
        return None

    def llm_d(self, kv: dict[str, Any], ports: Mapping[str, list[int]], mode: Mode, vllm_port: int,
              tp: int, dp: int) -> LlmdPod | None:
        """What llm-d's pods of one role need for this connector; None: llm-d's routing sidecar does not drive it.

        Raises ExportError for a mode the sidecar cannot drive."""
        return None

    # ---- the proxy side -------------------------------------------------------------------------
    def registration_listener(self, settings: ListenerSettings, find: FindInstance, current_mode: Callable[[], str],
                              on_result: Callable[[str], None]) -> ProxyListener | None:
        """The socket the proxy listens on for this connector's engines to register (registers_with_proxy): it may
        refresh the planned instance `find` returns for an address, never add one; each message's outcome goes
        to on_result. None: its engines do not register."""
        return None

    @abstractmethod
    def proxy_side(self, mode: Mode) -> ProxySide:
        """Its proxy side in `mode`: every connector answers for each of its modes (docs/routing.md, "Routes per
        connector")."""

    def side(self, mode: Mode, vllm_version: str = "") -> ProxySide:
        """proxy_side(mode) for engines of vLLM `vllm_version` ("": unknown), made once per connector object."""
        sides: dict[tuple[str, str], ProxySide] = self.__dict__.setdefault("_sides", {})
        found = sides.get((mode, vllm_version))
        if found is None:
            found = sides[mode, vllm_version] = self.proxy_side(mode)
            found.vllm_version = vllm_version
        return found

    @property
    def disaggregated(self) -> bool:
        """Whether it hands KV over between a prefill and a decode instance (False: colocated engines)."""
        return any(self.side(m).handoff() is not None for m in sorted(self.modes))

    @property
    def mode_fixed_at_start(self) -> bool:
        """Whether its engines fix the transfer mode at start, so a switch restarts them (Handoff.fixed_mode)."""
        return any((h := self.side(m).handoff()) is not None and h.fixed_mode for m in sorted(self.modes))
