"""ProxyConfig: everything the proxy runs from (written by `pdctl` as JSON, read by `python -m appliance.proxy`)."""

from __future__ import annotations

import json
import logging
import stat
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from appliance.connector import check_name, get_connector
from appliance.errors import ConfigError
from appliance.hosts import is_loopback, url_host
from appliance.roles import Mode, Role

log = logging.getLogger("appliance.proxy")

Routing = Literal["round_robin", "least_outstanding", "prefix_affinity"]
MAX_WORKERS = 64
# RegistrationConfig keys of the dynamic registration pdctl no longer has (its expiry and its instance cap)
_DYNAMIC_KEYS = frozenset({"ping_interval_s", "expire_after_missed", "max_instances"})


class _Model(BaseModel):
    # a JSON config may spell Infinity and NaN: no timeout or limit of the proxy may be either
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class RegistrationConfig(_Model):
    """The MORI-IO registration listener (a ZMQ ROUTER the engines ping from a DEALER). Only the backends
    may register, each as exactly what the plan says it is; any other registration is refused and counted."""

    host: str = "127.0.0.1"
    port: int = Field(default=36367, ge=0, le=65535, description="MORI-IO registration (ZMQ ROUTER)")
    enabled: bool = False
    allowed_hosts: list[str] = Field(default_factory=lambda: ["127.0.0.1"])
    # A registration may only claim its sender's own address; a sender that registers engines at other
    # addresses (a NAT, a multi-homed host) is listed here: {"sender IP": ["claimed IP", ...]}.
    peer_hosts: dict[str, list[str]] = Field(default_factory=dict)
    # Registrations handled per second (engines ping every few seconds); a flood waits in ZMQ's bounded
    # queues, fair-queued per sender, so it costs bounded CPU and cannot crowd out the engines' pings.
    max_per_s: float = Field(default=1000.0, gt=0, description=(
        "Registrations the proxy handles per second; a flood waits in bounded queues instead of costing CPU"))

    @model_validator(mode="before")
    @classmethod
    def _drop_dynamic_keys(cls, data: Any) -> Any:
        # plans and proxy.json files written while unplanned engines could register carry these; nothing
        # registers on its own any more, so they mean nothing and must not stop an installed node from loading
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if k not in _DYNAMIC_KEYS}
        return data


class AdminConfig(_Model):
    """The live-control API (HTTP on loopback by default; token-protected when token_file is set)."""

    host: str = "127.0.0.1"
    port: int = Field(default=10002, ge=0, le=65535)
    token_file: str | None = Field(default=None, description="Admin calls must send this token")


class Timeouts(_Model):
    """Per-leg limits; every wait in the proxy is bounded by one of these."""

    connect_s: float = Field(default=5.0, gt=0)
    prefill_s: float = Field(default=600.0, gt=0)
    first_token_s: float = Field(default=600.0, gt=0)
    between_tokens_s: float = Field(default=120.0, gt=0)


class HealthConfig(_Model):
    """Active /health probes and passive failure counting."""

    probe_interval_s: float = Field(default=2.0, gt=0)
    fail_threshold: int = Field(default=3, ge=1)
    probe_timeout_s: float = Field(default=2.0, gt=0)
    # Probes in a row with no answer within probe_timeout_s and nothing from the instance meanwhile that take it
    # out of rotation: one is a load spike on a starved host as often as a hung engine (health.py)
    timeout_threshold: int = Field(default=2, ge=1)
    # When no instance of a role is in rotation, one out for silence alone still takes the role's requests while
    # it sent a byte within this long (a starved engine's pause); beyond it is taken as hung (health.stand_in)
    panic_max_silence_s: float = Field(default=30.0, ge=0)
    # Who must own an instance's listening socket (appliance.proxy.listeners): checked before an instance is
    # (re)admitted and again on the first probe after this interval while it stays healthy
    listener_check_interval_s: float = Field(default=10.0, gt=0)
    engine_uid: int | None = Field(default=None, ge=0)  # the engines' user; None: the proxy's own
    # An engine that stopped listening (a crash) is reported by its service manager a moment later (supervisord:
    # within its 1 s tick; systemd: the unit's ExecStopPost hook), and its role is then held while it comes back:
    # until then, for at most this long after it was first seen gone (a refused connect, or an answer cut by the
    # engine closing its connection), its role's new requests wait for that report instead of failing
    crash_grace_s: float = Field(default=3.0, ge=0)
    # Before an instance is (re)admitted the proxy sends it a tiny request of its own, so that vLLM's one-time
    # work on a first request (compiling its logprob ranking: seconds) is not a client's (appliance.proxy.warmup)
    warmup_timeout_s: float = Field(default=120.0, ge=0, description=(
        "How long the warm-up of an instance about to be (re)admitted may take; then it is admitted anyway (0: no "
        "warm-up)"))


class Limits(_Model):
    """What one client connection may cost the proxy (docs/threat-model.md); the defaults serve a busy node."""

    # Open client connections. One more is answered 503 and closed at once, so a flood of sockets cannot take
    # the descriptors the engine legs need; the proxy lowers this to fit its RLIMIT_NOFILE (and says so).
    max_connections: int = Field(default=4096, ge=1)
    # aiohttp closes a connection that has not sent a complete request head within this time, on a new
    # connection and between keep-alive requests: it bounds slow headers and idle sockets alike.
    idle_timeout_s: float = Field(default=15.0, gt=0)
    body_timeout_s: float = Field(default=30.0, gt=0)  # reading a request body; then 408
    # JSON nesting checked on the raw bytes before parsing; deeper bodies get 400 (an engine's parser
    # may fail on them, and the engine must not look broken because a client sent one)
    max_json_depth: int = Field(default=64, ge=2, le=10_000)
    # JSON values (prompt token ids, messages, list items) one body may hold, counted on the raw bytes before
    # parsing; more is 413. Default: 4 prompts of the served model's whole context (plus 4096), or 262,144
    # when the plan does not know the context (vLLM reads it from the model).
    max_json_values: int | None = Field(default=None, ge=1024)
    max_n: int = Field(default=128, ge=1)  # completions per request (OpenAI's own limit)
    # Bodies over 64 KiB are read and parsed (in worker processes) this many at a time; more wait for a turn,
    # up to body_timeout_s, then get 503: the memory large bodies take is bounded.
    large_bodies: int = Field(default=4, ge=1, le=1024)
    # Prefill legs read to their end after their client left, so that their KV can be released (legs.py):
    # each costs the prefill a prompt's compute that nobody reads, so a client that sends and cuts requests
    # in a loop makes the prefill work for at most this many at once; beyond it a leg is aborted, as before.
    max_kept_prefills: int = Field(default=64, ge=0, le=65536)
    # a stopping proxy (SIGTERM: a restart, a handover to a new proxy) finishes its requests for up to this
    # long, then cuts what is left; below the units' stop timeout (30 s) so the manager never kills it first
    stop_drain_s: float = Field(default=25.0, ge=0, le=3600)


class PrefixAffinityConfig(_Model):
    """The prefix-affinity routing policy (routing = "prefix_affinity"; docs/routing.md)."""

    # A continuous-batching engine serves its running requests together, so a few more on the instance that holds
    # a prompt's prefix cost each of them a little decode time, while a miss costs a whole prefill of the prefix
    # elsewhere; a hot prefix still cannot pile more than this many legs onto one instance beyond the least loaded.
    load_bound: int = Field(default=4, ge=0, description=(
        "A prefix match wins only while its instance has at most this many more legs in flight than the least "
        "loaded instance of the role; 0: always the least loaded"))
    # 2**20 tokens: about the KV cache of one H200 serving an 8B model (~110 GB at 0.9 memory utilization over
    # 128 KiB per token); an estimate larger than the cache only costs hits that are not there, which the load
    # bound still caps. Its memory: about 150 bytes per block remembered (65,536 blocks of 16 tokens: ~10 MB).
    cache_tokens: int = Field(default=1_048_576, ge=1, le=1 << 30, description=(
        "Prompt tokens the policy remembers per instance (an estimate of its KV cache's size in tokens)"))
    # vLLM's KV cache events say exactly which blocks an engine holds; the planner turns them on for vLLM engines
    # (a simulated engine publishes none), and the proxy falls back to the estimate per instance without them.
    kv_events: bool = Field(default=True, description=(
        "vLLM engines publish their KV cache events to the proxy (exact prefix matches for token-id prompts); "
        "false: the estimate only"))


class KvStoreConfig(_Model):
    """The KV folders of a connector that keeps prompts' KV on disk (vLLM's ExampleConnector), which the proxy
    keeps bounded: it evicts the least recently used prompts' KV beyond max_mib or max_age_s (kvstore.py)."""

    folders: list[str] = Field(min_length=1)
    max_mib: float = Field(gt=0, description="All the folders together")
    max_age_s: float = Field(gt=0, description="KV not written or read for this long is evicted")
    # an engine checks that a prompt's folder exists, then reads its files within the same step (vLLM dies when
    # one is gone by then): KV written or read this recently is never evicted, even beyond max_mib
    min_idle_s: float = Field(default=60.0, ge=0)
    sweep_interval_s: float = Field(default=10.0, gt=0)


class DecodeStep(_Model):
    """A decode instance's step time model, the parts the conditional room reads (docs/routing.md): what each
    running sequence adds to a step, and what each prompt token the decode prefills itself costs."""

    ms_per_seq: float = Field(ge=0, description="A decode step's cost per running sequence (ms)")
    prefill_us_per_token: float = Field(gt=0, description="Prefill compute per prompt token (us)")

    def room_per_leg(self) -> float:
        """Prompt tokens of a decode's room each leg running on it takes (the step time its sequence adds)."""
        return self.ms_per_seq * 1000 / self.prefill_us_per_token


class Backend(_Model):
    """One engine instance from the plan."""

    name: str = Field(min_length=1)
    role: Role
    url: str
    dp_size: int = Field(default=1, ge=1)
    tp_size: int = Field(default=1, ge=1)
    kv: dict[str, str | int] = Field(default_factory=dict)
    # where the instance's engine publishes its KV cache events (docs/routing.md): the ipc socket file its engine
    # binds (DP 1: the proxy connects), else each DP rank's port, where the proxy binds a SUB socket on 127.0.0.1;
    # neither: none, the prefix estimate serves it
    kv_events_ports: list[Annotated[int, Field(ge=1, le=65535)]] = Field(default_factory=list)
    kv_events_socket: str | None = Field(default=None, min_length=1)

    @property
    def kv_events_endpoints(self) -> list[str]:
        """One ZMQ endpoint per DP rank where the proxy reads the engine's KV cache events (kv_events.py)."""
        if self.kv_events_socket is not None:
            return [f"ipc://{self.kv_events_socket}"]
        return [f"tcp://127.0.0.1:{port}" for port in self.kv_events_ports]

    @model_validator(mode="after")
    def _one_events_path(self) -> Backend:
        if self.kv_events_socket is not None and self.kv_events_ports:
            raise ValueError("a backend's KV events come from kv_events_socket or kv_events_ports, not both")
        return self

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme != "http" or not parts.hostname or parts.port is None:
            raise ValueError(f"backend url must look like http://HOST:PORT, got {value!r}")
        return value.rstrip("/")


class ProxyConfig(_Model):
    """The whole proxy configuration. Its field names are proxy.json's keys and the plan's `proxy` record, which
    deployed nodes have on disk and a new proxy must still load: rename none (add, with a default, instead)."""

    host: str = Field(default="127.0.0.1", description="Client API address; 0.0.0.0 to serve other hosts")
    port: int = Field(default=10001, ge=0, le=65535)
    # several processes serve the API behind the keeper (appliance.proxy.keeper, docs/proxy-workers.md); the planner
    # writes [proxy] workers, or default_workers() of the node's cores
    workers: int = Field(default=1, ge=1, le=MAX_WORKERS, description=(
        "Proxy worker processes, each with its own event loop and API socket (SO_REUSEPORT); worker 0 also "
        "serves the admin API, the probes and the registrations"))
    mode: Mode = "read"
    connector: str
    routing: Routing = "least_outstanding"
    model: str = Field(min_length=1)
    api_key_file: str | None = Field(default=None, description="Clients must send this key (file mode 0600)")
    # several clients, each with a key of its own: TOML `name = "key"` lines (tenants.py); with api_key_file, its
    # key is the tenant "default"
    api_keys_file: str | None = Field(default=None, description=(
        "Clients must send one of these keys: a TOML file (mode 0600) of name = \"key\" lines, one per client"))
    tenant_cache_salt: bool = Field(default=True, description=(
        "Each API key's requests carry a vLLM cache_salt of its own, so no two keys share prefix-cache entries "
        "(docs/threat-model.md); false: one trusted tenant, whose keys share the cache"))
    cache_salt_secret_file: str | None = Field(default=None, description=(
        "The node secret the keys' cache salts derive from (mode 0600; pdctl up writes one); unset: a random one "
        "per proxy start"))
    metrics_token_file: str | None = Field(default=None, description=(
        "GET /metrics must send this token (Authorization: Bearer); an API key does not do; unset: /metrics is "
        "open only while the API has no key"))
    # sent to the engines as their Bearer key (vLLM --api-key); the client's own key is never forwarded
    engine_api_key_file: str | None = None
    # the engines' KV block size (tokens), for connectors whose hand-off depends on the prompt's length
    block_size: int | None = Field(default=None, ge=1)
    vllm_version: str = Field(default="", max_length=64, description=(
        "The engines' vLLM release (e.g. 0.32.0; empty: unknown, taken as the newest pdctl read): what a "
        "connector's decode does with a request sent alone differs between releases (docs/routing.md)"))
    prefix_affinity: PrefixAffinityConfig = Field(default_factory=PrefixAffinityConfig)
    registration: RegistrationConfig = Field(default_factory=RegistrationConfig)
    admin: AdminConfig = Field(default_factory=AdminConfig)
    timeouts: Timeouts = Field(default_factory=Timeouts)
    health: HealthConfig = Field(default_factory=HealthConfig)
    limits: Limits = Field(default_factory=Limits, description="What one client connection may cost the proxy")
    backends: list[Backend] = Field(default_factory=list)
    kv_store: KvStoreConfig | None = None  # None: the connector keeps no KV on disk, or pdctl bounds none
    client_max_size: int = Field(default=8 * 1024 * 1024, ge=1024)
    max_tokens_limit: int = Field(default=1_000_000, ge=1)
    max_continuations: int = Field(default=2, ge=0, le=16, description=(
        "Times one stream may be continued on another engine leg after its own died mid-stream, and a prefill "
        "that died before its hand-off run again (0: never; docs/operations.md)"))
    # the served model's context (vLLM --max-model-len) when the plan sets it: bounds token-id prompts
    max_model_len: int | None = Field(default=None, ge=1)
    # conditional disaggregation (docs/routing.md); None in the settings: the planner's figure for the node
    decode_only_below: int | None = Field(default=None, ge=0, description=(
        "Prompts with fewer uncached tokens are prefilled by the decode instance itself; 0 (or unset in "
        "proxy.json): every prompt the connector can hand over goes through a prefill instance"))
    prefill_saturated_at: int = Field(default=0, ge=0, description=(
        "Prefill legs running on a prefill instance from which a prompt goes to a less busy decode instance "
        "instead (0: never)"))
    decode_only_window_ms: float = Field(default=50.0, gt=0, description=(
        "A decode instance prefills fewer than decode_only_below prompt tokens itself in any window this long "
        "(the planner writes slo.itl_ms): a decode step carries what arrived during the step before it, so no "
        "step carries more; a short prompt over it takes the prefill hop (reason decode-busy)"))
    # None in the settings: the planner's, from the node's time model (engine.sim), when it writes
    # decode_only_below; None here: the room does not depend on the decode's load
    decode_step: DecodeStep | None = Field(default=None, description=(
        "The decode's step time model: each leg running on a decode takes ms_per_seq x 1000 / "
        "prefill_us_per_token prompt tokens off the room decode_only_below gives an idle one"))
    # the planner's, from [decode] max_num_batched_tokens; None: the engine's default (vLLM's, far above any room)
    decode_budget: int | None = Field(default=None, ge=1, description=(
        "The decode instances' chunked-prefill budget (vLLM max_num_batched_tokens): while a full chunk of it fits "
        "the room at a decode's load, short prompts queue at the decode, which bounds each step itself"))
    # None in the settings: the planner's; None here: 0
    decode_only_queue_ms: float | None = Field(default=None, ge=0, description=(
        "With decode_budget: while the prefill instance is busy, a short prompt may wait this long at most behind "
        "the prompts its decode has queued (in chunks of the budget, one per decode_only_window_ms); 0: only what "
        "the decode's next step computes (the planner writes a quarter of slo.ttft_ms)"))

    @field_validator("connector")
    @classmethod
    def _registered(cls, value: str) -> str:
        return check_name(value)

    @model_validator(mode="after")
    def _connector_has_mode(self) -> ProxyConfig:
        # the one check of the transfer mode against the connector; the request flows trust it
        get_connector(self.connector).check_mode(self.mode)
        return self

    @model_validator(mode="after")
    def _admin_exposed_needs_token(self) -> ProxyConfig:
        # the admin API can switch modes and replace every backend: off loopback it must be authenticated
        if not is_loopback(self.admin.host) and self.admin.token_file is None:
            raise ValueError(f"admin host {self.admin.host!r} exposes the admin API without a token (admin.token_file)")
        return self

    @property
    def max_json_values(self) -> int:
        """The JSON values one request body may hold (limits.max_json_values, or derived from the context)."""
        if self.limits.max_json_values is not None:
            return self.limits.max_json_values
        return 262_144 if self.max_model_len is None else 4 * self.max_model_len + 4096

    @property
    def url(self) -> str:
        """Where clients on this machine reach the API."""
        return f"http://{url_host(self.host)}:{self.port}"

    @property
    def admin_url(self) -> str:
        """Where pdctl on this machine reaches the admin API."""
        return f"http://{url_host(self.admin.host)}:{self.admin.port}"


def default_workers(cores: int) -> int:
    """The proxy's worker processes to set (`[proxy] workers`) on a node of `cores` CPU cores: one per 4 cores, at
    most 8, leaving the rest to the engines' API servers and the kernel's loopback work; 1 below 8 cores. What the
    planner writes where [proxy] workers is unset."""
    return max(1, min(8, cores // 4))


def load_config(path: str | Path) -> ProxyConfig:
    """Read and validate a ProxyConfig JSON file; a bad file raises ConfigError with the reason."""
    p = Path(path)
    try:
        raw = json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"proxy config {p} does not exist", fix="run `pdctl plan` / `pdctl up` to write it") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"proxy config {p} cannot be read: {exc}") from None
    try:
        return ProxyConfig.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "(top level)"
        raise ConfigError(f"proxy config {p}: {where}: {first['msg']}") from None


def read_secret(path: str | None) -> str | None:
    """Return the stripped contents of a key/token file, or None when no file is configured."""
    if path is None:
        return None
    try:
        mode = Path(path).stat().st_mode
        secret = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read secret file {path}: {exc}") from None
    if not secret:
        raise ConfigError(f"secret file {path} is empty", fix="write the key into it or remove the setting")
    if stat.S_IMODE(mode) & 0o077:
        log.warning("secret file %s has mode %o: other users can read or change it (chmod 600 %s)",
                    path, stat.S_IMODE(mode), path)
    return secret
