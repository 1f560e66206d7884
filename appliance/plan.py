"""The topology planner: Settings + Inventory -> Plan. Pure: no I/O, no side effects.

The Plan is the single source of truth: units, supervisor config, the proxy's configuration and `pdctl status`
all derive from it. `pdctl plan --json` prints it; its schema (schema_version 2) is stable: fields may be
added, never renamed or removed without bumping schema_version.

Schema 2 (schema 1 until the proxy's own config became `proxy`): `proxy` is the proxy's ProxyConfig, the very
document `proxy.json` holds (listeners in `registration` and `admin`, `timeouts`, the `backends`). A schema-1
plan (a state directory written before) still loads: its flat `proxy` record is read into that shape.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Callable
from statistics import NormalDist
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from appliance.connector import (
    DEFAULT_FOR_PLATFORM,
    PLATFORM_NAMES,
    Connector,
    InstanceContext,
    Platform,
    get_connector,
    names,
    resolve_name,
)
from appliance.connector.base import PLATFORMS, OwnSettings
from appliance.engine.command import context_length, engine_command, whole_prefills
from appliance.engine.version import split_package
from appliance.errors import PlanError
from appliance.hosts import is_loopback, url_host
from appliance.inventory.models import Gpu, Inventory
from appliance.proxy.config import Backend, DecodeStep, KvStoreConfig, ProxyConfig, default_workers
from appliance.roles import MODES, Mode, Role
from appliance.settings import EMBEDDED_MODEL, EngineKind, Settings, deep_merge, proxy_config_data
from appliance.statedir import StateDir

SCHEMA_VERSION: Literal[2] = 2
# A slow step's length varies around the modelled one (chunks of two prompts in one step, contexts, the GPU's
# own variation): in results/gpu-h200x1/s4 (Qwen3-8B, 3000/300, 1 x H200) the chunk steps' gaps had p90 / p50
# of 1.10-1.23 at budget 2048 (3, 4.5 and 7 req/s: lognormal sigma 0.07-0.15, median 43-50 ms where the model
# gives 47.6) and 1.13-1.23 at budget 512 (sigma 0.10-0.16): 0.1. A real engine's conditional room is sized on it.
SLOW_GAP_SPREAD = 0.1
# The share of a running stream's gaps that may be slow: numpy's p99 of a 100-token answer's 99 gaps lets one
# of them pass the target (docs/bench.md), so a decode step carrying a short prompt may be over it this often.
SLOW_STEP_SHARE = 0.01
# A simulated engine's step takes exactly its modelled time; what its clients see later is the host's lateness
# (the engine's, the proxy's and the client's event loops), milliseconds added whatever the step's length. In
# results/conditional's always-disaggregated runs (run2-load6 at 1 x time, run3-x3 and run4-x3 at 3 x: 16 rates)
# the p99 of a gap less its modelled step (18 ms + 0.17 ms per running stream, x 1 or x 3) was 7-20 ms at 11
# rates, median over the 16 rates 15 ms; the other 5 (27-312 ms) were host stalls that no margin covers
# (benchmarks/step_lateness.py prints the figures).
SIM_HOST_LATENESS_MS = 15.0
KV_EVENTS = "kv_events"  # the purpose of an instance's ports the proxy binds for its engine's KV cache events
# the longest path a unix socket's address holds (sun_path's 108 bytes, less the NUL): libzmq refuses a longer one
UNIX_SOCKET_PATH_MAX = 107


class Frozen(BaseModel):
    """Plan records: unknown fields are rejected, so a plan file from elsewhere cannot smuggle keys in, and no
    number is inf or nan (the plan's figures reach generated JSON and YAML)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class Instance(Frozen):
    """One engine process group (one vLLM server, possibly DP x TP ranks) of a role."""

    name: str = Field(description="role-index, e.g. prefill-0")
    role: Role
    index: int
    service: str = Field(description="Service of the role: pd-prefill, pd-decode or pd-colocated")
    gpus: list[int] = Field(description="GPU indices (empty on a CPU-only node)")
    numa_nodes: list[int]
    tp: int
    dp: int
    expert_parallel: bool
    host: str
    http_port: int
    url: str
    ports: dict[str, list[int]] = Field(description="Every port some rank binds, by purpose")
    kv_events_socket: str | None = Field(default=None, description=(
        "The ipc socket file its engine binds for its KV cache events (DP 1; the proxy connects); None: none, or "
        "tcp ports in `ports`"))
    kv_transfer_config: dict[str, Any] | None
    proxy_kv: dict[str, str | int] = Field(description="What the proxy needs for the connector protocol")
    argv: list[str]
    env: dict[str, str]


class ModelPlan(Frozen):
    """The model as the engines will load it."""

    path: str
    served_name: str
    generate: bool = Field(description="True for the embedded tiny model, written by `pdctl up` before start")


class Check(Frozen):
    """One rule the planner checked."""

    name: str
    ok: bool
    detail: str


class Plan(Frozen):
    """The whole node: every instance, the proxy, and the checks that passed."""

    schema_version: Literal[2] = SCHEMA_VERSION
    platform: Platform
    engine: EngineKind
    layout: Literal["disaggregated", "colocated"]
    connector: str
    mode: Mode
    model: ModelPlan
    inventory_source: str
    state_dir: str
    instances: list[Instance]
    proxy: ProxyConfig = Field(description="The proxy's own configuration: proxy.json is its dump")
    checks: list[Check]
    warnings: list[str]

    @model_validator(mode="before")
    @classmethod
    def _from_schema_1(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("schema_version") == 1:
            return _schema_1_to_2(data)
        return data

    def with_instances(self, instances: list[Instance]) -> Plan:
        """This plan running `instances` instead (the proxy's backends follow them)."""
        proxy = self.proxy.model_copy(update={"backends": backends(instances)})
        return self.model_copy(update={"instances": instances, "proxy": proxy})

    def role_instances(self, role: Role) -> list[Instance]:
        """The instances of one role, in index order."""
        return [i for i in self.instances if i.role == role]

    def instance(self, name: str) -> Instance:
        """The instance called `name`, or a PlanError listing the known names."""
        for inst in self.instances:
            if inst.name == name:
                return inst
        known = ", ".join(i.name for i in self.instances)
        raise PlanError(f"no instance '{name}' in the plan", fix=f"use one of {known}")


def platform_of(inventory: Inventory) -> Platform:
    """rocm for AMD GPUs, cuda for NVIDIA, cpu when there are none."""
    return {"amd": "rocm", "nvidia": "cuda", None: "cpu"}[inventory.vendor]  # type: ignore[return-value]


def _usable(gpu: Gpu) -> bool:
    # A GPU reported failed, or whose memory a process outside pdctl holds almost entirely, can't take an engine.
    if not gpu.healthy:
        return False
    return not (gpu.memory_total_mib and gpu.memory_used_mib >= 0.95 * gpu.memory_total_mib and gpu.processes)


def _roles(settings: Settings) -> list[Role]:
    # "auto" always stands for a disaggregating connector
    name = settings.connector.name
    return ["prefill", "decode"] if name == "auto" or get_connector(name).disaggregated else ["both"]


def _sizes(settings: Settings, roles: list[Role], available: int) -> dict[Role, int]:
    """GPUs per role: given by gpus, gpu_count or instances x TP x DP; roles with none share the rest."""
    sizes: dict[Role, int] = {}
    for role in roles:
        rs = settings.role(role)
        if rs.gpus is not None:
            sizes[role] = len(rs.gpus)
        elif rs.gpu_count is not None:
            sizes[role] = rs.gpu_count
        elif rs.tp is not None:
            sizes[role] = rs.instances * rs.dp * rs.tp
    auto = [r for r in roles if r not in sizes]
    free = max(0, available - sum(sizes.values()))
    # Prefill takes the smaller half of an odd split: decode holds the KV of every running stream.
    for n, role in enumerate(auto):
        share = free // len(auto)
        sizes[role] = share if n < len(auto) - 1 else free - share * (len(auto) - 1)
    return sizes


def _shape(settings: Settings, role: Role, size: int, platform: Platform) -> tuple[int, int]:
    """(tp, dp) for the role; raises a PlanError when TP x DP x instances cannot equal its GPU count."""
    rs = settings.role(role)
    key = "colocated" if role == "both" else role
    if platform == "cpu":
        if rs.tp not in (None, 1) or rs.dp != 1:
            raise PlanError(
                f"{role}: TP/DP > 1 needs GPUs, and this node has none",
                fix=f"remove {role}.tp / {role}.dp, or plan for a GPU node with --inventory",
            )
        return 1, 1
    per_instance, rest = divmod(size, rs.instances)
    if size == 0 or rest:
        raise PlanError(
            f"{role}: {size} GPU(s) cannot be split into {rs.instances} equal instance(s)",
            fix=f"give {role} a multiple of {rs.instances} GPUs or change {role}.instances",
        )
    if rs.tp is None:
        tp, remainder = divmod(per_instance, rs.dp)
        if remainder or tp == 0:
            raise PlanError(
                f"{role}: DP {rs.dp} does not divide the {per_instance} GPU(s) of each instance",
                fix=f"set {role}.dp to a divisor of {per_instance}",
            )
        return tp, rs.dp
    if rs.tp * rs.dp != per_instance:
        gpus = settings.origin(f"{key}.gpus" if rs.gpus is not None else f"{key}.gpu_count")
        tp_from = settings.origin(f"{key}.tp")
        raise PlanError(
            f"{role}: TP {rs.tp} (from {tp_from}) x DP {rs.dp} = {rs.tp * rs.dp} GPUs, "
            f"but each instance has {per_instance} (GPUs from {gpus})",
            fix=f"make {role} TP x DP = {per_instance} where TP is set ({tp_from}), "
                f"or give {role} {rs.tp * rs.dp * rs.instances} GPUs",
        )
    return rs.tp, rs.dp


def _pick(free: list[Gpu], want: int) -> list[Gpu]:
    """`want` GPUs from `free`, from one NUMA node if one has enough (best fit), else lowest indices."""
    by_numa: dict[int | None, list[Gpu]] = {}
    for gpu in free:
        by_numa.setdefault(gpu.numa_node, []).append(gpu)
    fitting = [gpus for gpus in by_numa.values() if len(gpus) >= want]
    if fitting:
        best = min(fitting, key=lambda gpus: (len(gpus), gpus[0].index))
        return best[:want]
    return free[:want]


def _allocate(settings: Settings, inventory: Inventory, platform: Platform) -> dict[Role, list[list[int]]]:
    """GPU sets for every instance of every role; checks that they are disjoint and exist."""
    roles = _roles(settings)
    if platform == "cpu":
        for role in roles:
            rs = settings.role(role)
            if rs.gpus or rs.gpu_count:
                raise PlanError(
                    f"{role} asks for GPUs but this node has none (inventory {inventory.source})",
                    fix="drop the GPU settings to run on the CPU, or plan for a GPU node with --inventory",
                )
        return {role: [[] for _ in range(settings.role(role).instances)] for role in roles}

    if inventory.partitioned:
        raise _partitioned(inventory)
    gpus = inventory.by_index()
    usable = [g for g in inventory.gpus if _usable(g)]
    explicit = {role: settings.role(role).gpus for role in roles if settings.role(role).gpus is not None}
    for role, chosen in explicit.items():
        assert chosen is not None
        missing = [g for g in chosen if g not in gpus]
        if missing:
            key = "colocated" if role == "both" else role
            raise PlanError(
                f"{role}.gpus (from {settings.origin(f'{key}.gpus')}) names GPU(s) {missing} but this node has "
                f"{sorted(gpus)}",
                fix=f"pick {role}.gpus from {sorted(gpus)}",
            )
        bad = [g for g in chosen if not _usable(gpus[g])]
        if bad:
            raise PlanError(
                f"{role}.gpus includes GPU(s) {bad}, reported failed or occupied by another process",
                fix="choose other GPUs (see `pdctl inventory`)",
            )
    sizes = _sizes(settings, roles, len(usable))
    if sum(sizes.values()) > len(gpus):
        ask = " + ".join(f"{r} {n}" for r, n in sizes.items())
        raise PlanError(
            f"the plan needs {ask} = {sum(sizes.values())} GPUs but this node has {len(gpus)}",
            fix="lower a role's gpu_count, tp or instances",
        )
    empty = [r for r in roles if sizes[r] == 0]
    if empty and len(roles) > 1:
        raise PlanError(
            f"{' and '.join(empty)} {'gets' if len(empty) == 1 else 'get'} no GPU: a disaggregated deployment needs at least one GPU per role, and "
            f"this node has {len(usable)} usable GPU(s) of {len(gpus)} ({' + '.join(f'{r} {n}' for r, n in sizes.items())})",
            fix="run colocated here (--connector none), or plan for a larger node with --inventory",
        )
    shapes = {r: _shape(settings, r, sizes[r], platform) for r in roles}

    result: dict[Role, list[list[int]]] = {}
    used: set[int] = {g for v in explicit.values() for g in (v or [])}
    for role in roles:
        rs = settings.role(role)
        tp, dp = shapes[role]
        per_instance = tp * dp
        if role in explicit:
            chosen = explicit[role] or []
            result[role] = [chosen[i * per_instance : (i + 1) * per_instance] for i in range(rs.instances)]
            continue
        sets: list[list[int]] = []
        for _ in range(rs.instances):
            free = [g for g in usable if g.index not in used]
            if len(free) < per_instance:
                raise PlanError(
                    f"{role}: not enough usable GPUs left for {rs.instances} instance(s) of {per_instance} GPU(s)",
                    fix="lower the role's size, or free/repair GPUs (see `pdctl inventory`)",
                )
            picked = sorted(g.index for g in _pick(free, per_instance))
            used.update(picked)
            sets.append(picked)
        result[role] = sets
    return result


def _partitioned(inventory: Inventory) -> PlanError:
    """Why pdctl does not plan compute partitions (DPX/QPX/CPX), and how to get whole GPUs back.

    Settings speak of whole GPUs: a TP group over partitions of one GPU shares its memory and fabric, and each
    partition may report the whole GPU's memory (6.3-era amdsmi), so a plan would look right and be wrong."""
    modes = sorted({g.compute_partition for g in inventory.gpus if g.compute_partition} - {"SPX"}) or ["partition"]
    groups = inventory.physical_gpus()
    sizes = sorted({len(group) for group in groups}, reverse=True)
    first = groups[0]
    return PlanError(
        f"the {len(inventory.gpus)} GPUs are {'/'.join(modes)} compute partitions of {len(groups)} physical GPUs "
        f"({' or '.join(map(str, sizes))} each; GPUs {first[0]}-{first[-1]} are all on physical GPU 0), "
        "and pdctl plans whole GPUs",
        fix=f"switch the GPUs to SPX (as root, with no process on them: amd-smi set --compute-partition SPX), "
        f"then plan again for {len(groups)} GPUs",
    )


def _extra_block_size(args: list[str]) -> int | None:
    """A --block-size the user put in a role's extra_args (either spelling), or None."""
    for n, arg in enumerate(args):
        value = arg.split("=", 1)[1] if arg.startswith("--block-size=") else None
        if arg == "--block-size" and n + 1 < len(args):
            value = args[n + 1]
        if value is not None:
            try:
                return int(value)
            except ValueError:
                raise PlanError(f"--block-size {value!r} in extra_args is not a number") from None
    return None


def _block_sizes(settings: Settings, roles: list[Role], default: int | None) -> dict[Role, int | None]:
    """Each role's KV block size; the disaggregated roles must agree, since the hand-off copies whole blocks."""
    sizes: dict[Role, int | None] = {}
    for role in roles:
        sizes[role] = _extra_block_size(settings.role(role).extra_args) or settings.connector.block_size
    named = {size for size in sizes.values() if size is not None}
    if not named:
        return {role: default for role in roles}
    if len(named) == 1:
        # one role names a size: the other gets it too rather than the connector's or vLLM's default
        return {role: next(iter(named)) for role in roles}
    if len(named) > 1:
        said = " and ".join(f"{r} {sizes[r]}" for r in roles)
        raise PlanError(
            f"prefill and decode must use the same KV block size, but they use {said}",
            fix="set connector.block_size (both roles), or the same --block-size in both roles' extra_args",
        )
    return sizes


def _fast_island(inventory: Inventory, gpus: list[int]) -> bool:
    return all(inventory.link(a, b) in ("XGMI", "NVLINK") for a in gpus for b in gpus if a < b)


_PLATFORM_NODES: dict[str, str] = {"rocm": "AMD GPUs", "cuda": "NVIDIA GPUs", "cpu": "a CPU-only node"}


def _check_connector(connector: Connector, mode: Mode, platform: Platform) -> None:
    """The connector has the transfer mode and runs on this platform; otherwise a PlanError naming the way out."""
    try:
        connector.check_mode(mode)
    except ValueError as exc:
        other = next(m for m in MODES if m != mode)
        having = [n for n in names() if (c := get_connector(n)).disaggregated and mode in c.modes]
        raise PlanError(str(exc), fix=f"use --mode {other}, or a connector with a {mode} mode ({', '.join(having)})") from None
    if platform not in connector.platforms:
        needs = " or ".join(_PLATFORM_NODES[p] for p in PLATFORMS if p in connector.platforms)
        ways = [f"'{DEFAULT_FOR_PLATFORM[p]}' on {PLATFORM_NAMES[p]}" for p in PLATFORMS if p not in connector.platforms]
        raise PlanError(
            f"connector '{connector.name}' needs {needs}, and this node is {platform}",
            fix=f"use connector {', '.join(ways)}, or 'auto'",
        )


def model_plan(settings: Settings, state: StateDir) -> ModelPlan:
    """The model as the engines load it: the embedded tiny model lives in the state directory."""
    generate = settings.model.path == EMBEDDED_MODEL
    path = str(state.tiny_model) if generate else settings.model.path
    return ModelPlan(path=path, served_name=settings.model.name, generate=generate)


def _context(settings: Settings, connector: str, role: Role, index: int, gpus: list[int], mode: Mode,
             platform: Platform, kv_store: str, block_size: int | None) -> InstanceContext:
    """What a connector and the engine command line know of one instance: its shape and its base ports,
    each role's bases strided by the instance's DP x TP ranks so no two instances' port blocks overlap."""
    rs = settings.role(role)
    tp, dp = (len(gpus) // rs.dp, rs.dp) if gpus else (1, 1)
    ranks = tp * dp
    return InstanceContext(
        connector=connector,
        role=role,
        index=index,
        tp=tp,
        dp=dp,
        host=rs.host,
        http_port=rs.http_port + index,
        handshake_port=rs.handshake_port + index * ranks,
        notify_port=rs.notify_port + index * ranks,
        mode=mode,
        platform=platform,
        proxy_host=settings.proxy.registration_host,
        proxy_ping_port=settings.proxy.ping_port,
        kv_store=kv_store,
        settings=settings.connector.own(connector),
        extra_config=settings.connector.extra_config,
        block_size=block_size,
        vllm_version=split_package(settings.engine.vllm_package)[1],
    )


def _instance(settings: Settings, inventory: Inventory, connector: Connector, ctx: InstanceContext,
              gpus: list[int], model: ModelPlan, service: str) -> tuple[Instance, list[str]]:
    """One instance: every port its ranks bind, its kv-transfer-config, command line and environment; and the
    warnings its GPUs earn (NUMA nodes spanned, no XGMI/NVLink between them)."""
    rs = settings.role(ctx.role)
    ports: dict[str, list[int]] = {"http": [ctx.http_port]}
    for purpose, span in connector.port_ranges(ctx).items():
        ports[purpose] = list(span)
    if ctx.dp > 1:
        ports["dp_rpc"] = [rs.dp_rpc_port + ctx.index]
    name = f"{ctx.role}-{ctx.index}"
    warnings: list[str] = []
    socket, events = None, None
    if kv_events(settings, ctx.role):
        socket = kv_events_socket(settings, name, ctx.dp)
        if socket is not None:
            events = f"ipc://{socket}"
        else:
            # vLLM's publisher of DP rank r connects to the endpoint's port + r
            ports[KV_EVENTS] = [rs.kv_events_port + ctx.index * ctx.dp + rank for rank in range(ctx.dp)]
            events = f"tcp://127.0.0.1:{ports[KV_EVENTS][0]}"
            if ctx.dp == 1:
                warnings.append(
                    f"{name}: its KV events socket {StateDir.at(settings.state_dir).kv_events_socket(name)} would be "
                    f"longer than a unix socket's {UNIX_SOCKET_PATH_MAX} bytes, so its engine publishes to "
                    f"127.0.0.1:{ports[KV_EVENTS][0]}, which a local process could bind while the proxy restarts "
                    "and read prompts' token ids; set state_dir to a shorter path")
    kv_config = connector.kv_transfer_config(ctx)
    argv, env = engine_command(settings, ctx, model, connector, kv_config, gpus, ports, events)
    gpu_numa = {g.index: g.numa_node for g in inventory.gpus}
    numa = sorted({n for g in gpus if (n := gpu_numa.get(g)) is not None})
    if len(numa) > 1:
        warnings.append(f"{name}: GPUs {gpus} span NUMA nodes {numa}; expect slower host transfers")
    if len(gpus) > 1 and not _fast_island(inventory, gpus):
        warnings.append(f"{name}: GPUs {gpus} are not all linked by XGMI/NVLink; TP traffic crosses PCIe")
    instance = Instance(
        name=name,
        role=ctx.role,
        index=ctx.index,
        service=service,
        gpus=gpus,
        numa_nodes=numa,
        tp=ctx.tp,
        dp=ctx.dp,
        expert_parallel=rs.enable_expert_parallel,
        host=rs.host,
        http_port=ctx.http_port,
        url=f"http://{url_host(rs.host)}:{ctx.http_port}",
        ports=ports,
        kv_events_socket=socket,
        kv_transfer_config=kv_config,
        proxy_kv=connector.proxy_kv(ctx),
        argv=argv,
        env=env,
    )
    return instance, warnings


def kv_events(settings: Settings, role: Role) -> bool:
    """Whether a role's engines publish their KV cache events to the proxy: prefix-affinity routing wants them,
    the setting allows them, the engine is vLLM (a simulated engine has none) and its prefix cache is not off."""
    p = settings.proxy
    return (p.routing == "prefix_affinity" and p.prefix_affinity.kv_events and settings.engine.kind == "vllm"
            and settings.role(role).enable_prefix_caching is not False)


def kv_events_socket(settings: Settings, instance: str, dp: int) -> str | None:
    """The ipc socket file the engine of `instance` binds for its KV cache events, in the state directory's private
    kv-events folder (0700: no other user can connect to it, nor put a socket there first), the proxy connecting to
    it. None where vLLM 0.32 cannot use one: DP > 1 (it offsets only a tcp endpoint per rank, and raises for an
    ipc one) or a path too long for a unix socket; those engines connect to ports the proxy binds on 127.0.0.1."""
    path = str(StateDir.at(settings.state_dir).kv_events_socket(instance))
    return path if dp == 1 and len(path.encode()) <= UNIX_SOCKET_PATH_MAX else None


def _check_rank_ports(connector: Connector, ctx: InstanceContext, settings: Settings) -> None:
    """Refuse a shape whose ranks the engine's vLLM would bind to one port (MoRIIO with DP > 1 x TP > 1)."""
    why = connector.rank_port_conflict(ctx, split_package(settings.engine.vllm_package)[1])
    if why is None:
        return
    key = "colocated" if ctx.role == "both" else ctx.role
    ranks = ctx.tp * ctx.dp
    n = settings.role(ctx.role).instances
    tp_only, dp_only = (f"--{ctx.role} {n}xTP{ranks}; ", f"--{ctx.role} {n}xTP1xDP{ranks}; ") if key != "colocated" \
        else ("", "")
    raise PlanError(f"{ctx.role}-{ctx.index}: {why}",
                    fix=f"use TP only ({tp_only}{key}.tp = {ranks}, {key}.dp = 1) or DP with TP 1 "
                        f"({dp_only}{key}.tp = 1, {key}.dp = {ranks})")


# vLLM flags that cut a prompt's prefill over several steps even with chunked prefill off (the threshold caps
# what one step gives a prompt before the no-chunking rule is applied)
_SPLIT_PREFILL_FLAGS = ("--enable-chunked-prefill", "--long-prefill-token-threshold")


def _check_whole_prefills(settings: Settings, ctx: InstanceContext, model: ModelPlan) -> str | None:
    """Refuse an engine that runs every prefill whole (whole_prefills) with a step too small for the longest
    prompt (vLLM would refuse to start); a warning when the role's extra_args turn chunked prefill back on."""
    if not whole_prefills(ctx.platform):
        return None
    key = "colocated" if ctx.role == "both" else ctx.role
    rs = settings.role(ctx.role)
    budget, context = rs.max_num_batched_tokens, context_length(settings, model)
    if budget is not None and context is not None and budget < context:
        raise PlanError(
            f"{key}.max_num_batched_tokens {budget} is below max_model_len {context}: on a {ctx.platform} node every "
            "prompt is prefilled in one engine step (vLLM's CPU build kills its engine core when a seeded "
            "request's prefill is split), so a step must hold the longest prompt",
            fix=f"set {key}.max_num_batched_tokens to at least {context}, or lower model.max_model_len",
        )
    split = [a.split("=", 1)[0] for a in rs.extra_args if a.split("=", 1)[0] in _SPLIT_PREFILL_FLAGS]
    if split:
        return (f"{key}.extra_args {' '.join(split)} split prefills: on a {ctx.platform} node a seeded request whose "
                "prefill is split kills the engine core (vLLM 0.32)")
    return None


def plan(settings: Settings, inventory: Inventory) -> Plan:
    """Turn settings and an inventory into a full Plan, or raise PlanError saying what to change."""
    platform = platform_of(inventory)
    connector_name = resolve_name(settings.connector.name, platform, settings.connector.mode)
    connector = get_connector(connector_name)
    mode = settings.connector.mode
    _check_connector(connector, mode, platform)
    colocated = not connector.disaggregated
    allocation = _allocate(settings, inventory, platform)
    state = StateDir.at(settings.state_dir)
    model = model_plan(settings, state)
    block_sizes = _block_sizes(settings, list(allocation), connector.default_block_size(platform))

    checks: list[Check] = []
    warnings: list[str] = []
    instances: list[Instance] = []
    for role, sets in allocation.items():
        service = "pd-colocated" if colocated else f"pd-{role}"
        for index, gpus in enumerate(sets):
            ctx = _context(settings, connector_name, role, index, gpus, mode, platform, str(state.kv_store),
                           block_sizes[role])
            if settings.engine.kind == "vllm":
                _check_rank_ports(connector, ctx, settings)
                whole = _check_whole_prefills(settings, ctx, model)
                if whole is not None and whole not in warnings:
                    warnings.append(whole)
            instance, noted = _instance(settings, inventory, connector, ctx, gpus, model, service)
            instances.append(instance)
            warnings.extend(noted)

    used = [g for inst in instances for g in inst.gpus]
    checks.append(Check(name="gpus-disjoint", ok=len(used) == len(set(used)), detail=f"{len(used)} GPU(s) assigned"))
    block = next(iter(block_sizes.values()))
    checks.append(Check(name="block-size", ok=True, detail=f"KV block size {block or 'vLLM default'} on every role"))
    # the hand-off's length rules are vLLM's (ProxySide.length_possible): a simulated engine has none
    proxy = _proxy_config(settings, connector_name, mode, model.served_name,
                          block if settings.engine.kind == "vllm" else None, state)
    if not is_loopback(settings.proxy.host) and not (settings.proxy.api_key_file or settings.proxy.api_keys_file):
        warnings.append(f"proxy.host {settings.proxy.host} serves other hosts and no proxy.api_key_file or "
                        "api_keys_file is set")
    _check_ports(instances, proxy)
    checks.append(
        Check(name="ports-unique", ok=True, detail=f"{sum(len(v) for i in instances for v in i.ports.values())} ports")
    )
    if not colocated and not (any(i.role == "prefill" for i in instances) and any(i.role == "decode" for i in instances)):
        raise PlanError("a disaggregated plan needs at least one prefill and one decode instance")
    # every port is below 65536 now, so each backend's URL is valid
    proxy.backends = backends(instances)
    proxy.kv_store = _kv_store(connector, settings.connector.own(connector_name), instances)
    return Plan(
        platform=platform,
        engine=settings.engine.kind,
        layout="colocated" if colocated else "disaggregated",
        connector=connector_name,
        mode=mode,
        model=model,
        inventory_source=inventory.source,
        state_dir=str(state.root),
        instances=instances,
        proxy=proxy,
        checks=checks,
        warnings=warnings,
    )


def _proxy_config(settings: Settings, connector: str, mode: Mode,
                  served_name: str, block_size: int | None, state: StateDir) -> ProxyConfig:
    """The proxy's configuration from the [proxy] settings (its backends are added once the ports are checked).

    The admin API always has a token: proxy.admin_token_file, else the state directory's, which `pdctl up`
    generates; any local process could otherwise replace the backend set with its own address."""
    p = settings.proxy
    threshold, step = p.decode_only_below, p.decode_step
    if p.conditional_routing and settings.engine.kind == "sim":
        sim = settings.engine.sim
        if threshold is None:
            threshold = decode_only_below(sim.decode_step_ms + sim.decode_step_ms_per_seq, sim.prefill_us_per_token,
                                          settings.slo.itl_ms, step_spread(settings))
        if step is None and sim.prefill_us_per_token > 0:  # free prefill: the load takes nothing off the room
            step = DecodeStep(ms_per_seq=sim.decode_step_ms_per_seq, prefill_us_per_token=sim.prefill_us_per_token)
    if threshold:
        _check_alone(connector, mode, f"decode_only_below = {threshold}" if p.decode_only_below else
                     f"conditional_routing (decode_only_below {threshold})", engine_release(settings))
    queue_ms = p.decode_only_queue_ms
    if queue_ms is None and threshold:
        queue_ms = settings.slo.ttft_ms * DECODE_QUEUE_SHARE
    from_plan = {
        "decode_only_below": threshold, "decode_only_window_ms": settings.slo.itl_ms,
        "decode_step": step.model_dump() if step else None,
        "decode_budget": settings.decode.max_num_batched_tokens, "decode_only_queue_ms": queue_ms,
        "mode": mode, "connector": connector, "model": served_name, "block_size": block_size,
        "vllm_version": engine_release(settings), "max_model_len": settings.model.max_model_len,
        # the proxy runs on the node that plans it (pdctl up): sized for the cores this process may use
        "workers": p.workers or default_workers(len(os.sched_getaffinity(0))),
        "registration": {"enabled": get_connector(connector).registers_with_proxy},
        "admin": {"token_file": p.admin_token_file or str(state.admin_token)},
        **_tenant_files(settings, state),
    }
    try:
        return ProxyConfig.model_validate(deep_merge(proxy_config_data(p.model_dump()), from_plan))
    except ValidationError as exc:
        # The proxy would refuse to start like this; say so before anything is written.
        problem = exc.errors()[0]["msg"].removeprefix("Value error, ")
        fix = "set proxy.admin_token_file (a 0600 file), or keep admin_host on 127.0.0.1" if "admin" in problem else ""
        raise PlanError(f"proxy: {problem}", fix=fix) from None


def engine_release(settings: Settings) -> str:
    """The engines' vLLM release ("": not a vLLM engine, or not known)."""
    return split_package(settings.engine.vllm_package)[1] if settings.engine.kind == "vllm" else ""


def _check_alone(name: str, mode: Mode, setting: str, vllm_version: str = "") -> None:
    """Refuse conditional routing on a connector whose decode cannot serve a prompt alone in `mode`: every
    request it sent there would be answered from KV nobody wrote (ProxySide.alone)."""
    connector = get_connector(name)
    alone = connector.side(mode, vllm_version).alone()
    if not connector.disaggregated or alone.served:
        return
    fix = f"unset [proxy] {setting.split()[0]}"
    served = [m for m in sorted(connector.modes) if connector.side(m, vllm_version).alone().served]
    if served:
        fix += f", or set [connector] mode = \"{served[0]}\""
    raise PlanError(f"[proxy] {setting} sends short prompts to a decode instance "
                    f"alone, which connector '{name}' cannot serve in {mode} mode: {alone.why}", fix=fix)


def _tenant_files(settings: Settings, state: StateDir) -> dict[str, str | None]:
    """While the API has keys: the token /metrics needs (an API key does not do) and the secret the keys' cache
    salts derive from, the state directory's (which `pdctl up` generates) unless the settings name them."""
    p = settings.proxy
    keyed = bool(p.api_key_file or p.api_keys_file)
    metrics = p.metrics_token_file or (str(state.metrics_token) if keyed else None)
    salt = str(state.cache_salt_secret) if keyed and p.tenant_cache_salt else None
    return {"metrics_token_file": metrics, "cache_salt_secret_file": salt}


def _kv_store(connector: Connector, own: OwnSettings, instances: list[Instance]) -> KvStoreConfig | None:
    """What the proxy keeps bounded of the KV the engines keep on disk (every instance's kv_folders), or None."""
    limits = connector.kv_store_limits(own)
    folders = sorted({f for i in instances for f in connector.kv_folders(i.kv_transfer_config or {})})
    if limits is None or not folders:
        return None
    return KvStoreConfig(folders=folders, max_mib=limits.max_mib, max_age_s=limits.max_age_s)


# Of the TTFT target, what a short prompt may wait at most behind the prompts a decode with a known chunked-prefill
# budget has queued (docs/routing.md): the rest is the prompt's own steps and a hand-off-free margin.
DECODE_QUEUE_SHARE = 0.25


def step_spread(settings: Settings) -> float:
    """How much the node's decode steps vary around their modelled length (lognormal sigma), which sizes the
    conditional room: [proxy] decode_step_spread, else a real engine's SLOW_GAP_SPREAD, or on a simulated node
    (whose steps do not vary) the spread that makes the host's lateness the whole margin at the ITL target."""
    if settings.proxy.decode_step_spread is not None:
        return settings.proxy.decode_step_spread
    if settings.engine.kind == "sim":
        return lateness_spread(SIM_HOST_LATENESS_MS, settings.slo.itl_ms)
    return SLOW_GAP_SPREAD


def lateness_spread(late_ms: float, itl_slo_ms: float) -> float:
    """The spread (lognormal sigma) that leaves a margin of `late_ms` at the ITL target: a step of itl - late ms
    stays under the target in all but SLOW_STEP_SHARE of such steps (inf: no step fits)."""
    if late_ms >= itl_slo_ms:
        return math.inf
    return math.log(itl_slo_ms / (itl_slo_ms - late_ms)) / NormalDist().inv_cdf(1 - SLOW_STEP_SHARE)


def step_margin(spread: float) -> float:
    """The share of the ITL target a decode step may take so that, its lengths spread by `spread`, it stays
    under the target in all but SLOW_STEP_SHARE of such steps."""
    return math.exp(-NormalDist().inv_cdf(1 - SLOW_STEP_SHARE) * spread)


def decode_only_below(step_ms: float, prefill_us_per_token: float, itl_slo_ms: float, spread: float) -> int:
    """The prompt length below which a decode instance prefills a prompt itself (conditional disaggregation): the
    longest prompt whose compute, in one decode step of `step_ms`, keeps that step under the ITL target in all
    but SLOW_STEP_SHARE of such steps (their lengths spread by `spread`, step_spread). The proxy sends a decode
    fewer than this many such tokens per ITL target, so no step carries two; then even a stream whose every step
    carried one would see about the 1 % of slow gaps its p99 tolerates, and the request saves the hand-off."""
    longest = itl_slo_ms * step_margin(spread)
    if prefill_us_per_token <= 0:
        return 0 if step_ms > longest else 1_000_000  # free prefill: every prompt, unless no step fits
    return max(0, math.floor((longest - step_ms) * 1000 / prefill_us_per_token))


def backends(instances: list[Instance]) -> list[Backend]:
    """The proxy's static backends: every instance of the plan."""
    return [Backend(name=i.name, role=i.role, url=i.url, dp_size=i.dp, tp_size=i.tp, kv=i.proxy_kv,
                    kv_events_ports=i.ports.get(KV_EVENTS, []), kv_events_socket=i.kv_events_socket)
            for i in instances]


def _schema_1_to_2(data: dict[str, Any]) -> dict[str, Any]:
    """A schema-1 plan (flat proxy record) in the schema-2 shape (the proxy's ProxyConfig)."""
    old = data["proxy"]
    # its keys are the [proxy] settings' (those of its day), plus what the plan decided
    proxy = deep_merge(proxy_config_data(old), {
        "mode": old["mode"], "connector": old["connector"], "model": data["model"]["served_name"],
        "registration": {"enabled": old["registration_enabled"]},
        "backends": [{"name": i["name"], "role": i["role"], "url": i["url"], "dp_size": i["dp"], "tp_size": i["tp"],
                      "kv": i["proxy_kv"]} for i in data["instances"]],
    })
    return {**data, "schema_version": SCHEMA_VERSION, "proxy": proxy}


def all_ports(plan_instances: list[Instance], proxy: ProxyConfig) -> list[tuple[int, str]]:
    """Every (port, owner) the node will bind: each rank's connector ports, HTTP ports, the proxy's."""
    owned: list[tuple[int, str]] = [(proxy.port, "proxy.port"), (proxy.admin.port, "proxy.admin_port")]
    if proxy.registration.enabled:
        owned.append((proxy.registration.port, "proxy.ping_port"))
    for inst in plan_instances:
        owned.extend((port, f"{inst.name} {purpose}") for purpose, ports in inst.ports.items() for port in ports)
    return owned


def _check_ports(instances: list[Instance], proxy: ProxyConfig) -> None:
    owned = all_ports(instances, proxy)
    counts = Counter(port for port, _ in owned)
    clashes = sorted(port for port, n in counts.items() if n > 1)
    if clashes:
        port = clashes[0]
        who = [owner for p, owner in owned if p == port]
        raise PlanError(
            f"port {port} would be bound by {' and '.join(who)}",
            fix="move one role's base port (e.g. decode.notify_port) so the DP x TP port blocks don't overlap",
        )
    high = [(p, o) for p, o in owned if p > 65535]
    if high:
        raise PlanError(f"port {high[0][0]} ({high[0][1]}) is above 65535", fix="lower that role's base port")


class BusyPort(NamedTuple):
    """A port of the plan that something on this host already binds."""

    port: int
    host: str  # the address the plan binds it on
    owner: str  # "proxy.admin_port", "decode-0 notify"
    instance: str | None  # the instance it belongs to; None for the proxy's


def busy_ports(plan_: Plan, is_free: Callable[[str, int], bool]) -> list[BusyPort]:
    """Ports of the plan that something already binds on this host: the proxy's on the addresses it binds
    them on, the engines' on 127.0.0.1 (a wildcard listener clashes there too)."""
    proxy = plan_.proxy
    hosts = {"proxy.port": proxy.host, "proxy.admin_port": proxy.admin.host, "proxy.ping_port": proxy.registration.host}
    problems = []
    for port, owner in all_ports(plan_.instances, proxy):
        host = hosts.get(owner, "127.0.0.1")
        if not is_free(host, port):
            # the proxy binds each instance's KV events ports (the engines connect to it)
            proxys = owner in hosts or owner.endswith(f" {KV_EVENTS}")
            problems.append(BusyPort(port, host, owner, None if proxys else owner.split(" ", 1)[0]))
    return problems
