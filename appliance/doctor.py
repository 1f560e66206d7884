"""`pdctl doctor`: one screen of checks, each failure with the fix."""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import psutil

from appliance.connector import get_connector
from appliance.connector.base import Connector, RdmaNeed
from appliance.engine.command import server_command
from appliance.errors import PdctlError
from appliance.inventory import Inventory
from appliance.model_config import read_heads
from appliance.plan import Plan, all_ports
from appliance.settings import Settings

Status = Literal["ok", "warn", "fail"]
Say = Callable[[str], None]  # where a check says what it is doing while it takes long (a line each)

PROGRESS_EVERY_S = 5.0  # while vLLM imports (about 30 s on a busy 2-core box): a line this often

# Run in the engine's Python: report vLLM's version and whether the connector's library loads.
# Every exception counts: mori raises OSError without ROCm, amdsmi KeyError, a broken wheel anything.
_PROBE = r"""
import importlib, json, sys
out = {}
try:
    import vllm
    out["vllm"] = getattr(vllm, "__version__", "unknown")
except BaseException as exc:
    out["vllm_error"] = f"{type(exc).__name__}: {exc}"
probe = sys.argv[1]
if probe:
    try:
        module, _, attr = probe.partition(":")
        getattr(importlib.import_module(module), attr)
        out["connector"] = "ok"
    except BaseException as exc:
        out["connector_error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
print(json.dumps(out))
"""

@dataclass
class Finding:
    """One check's outcome."""

    check: str
    status: Status
    detail: str
    fix: str = ""


def engine_python(settings: Settings) -> str:
    """The interpreter that runs vLLM."""
    return settings.engine.python or sys.executable


def probe_engine(python: str, connector: str, timeout: float = 180.0, say: Say | None = None) -> dict[str, str]:
    """Import vLLM and the connector library in the engine's Python, saying every PROGRESS_EVERY_S that it still
    does; never raises."""
    library = get_connector(connector).library
    if not (Path(python).exists() or shutil.which(python)):
        return {"vllm_error": f"{python} does not exist"}
    started = time.monotonic()
    with subprocess.Popen([python, "-c", _PROBE, library.probe if library else ""], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                          env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"}) as proc:
        while True:
            try:
                # a retry after TimeoutExpired loses no output (subprocess's documentation)
                out, err = proc.communicate(timeout=min(PROGRESS_EVERY_S, max(started + timeout - time.monotonic(), 0)))
                break
            except subprocess.TimeoutExpired:
                waited = time.monotonic() - started
                if waited >= timeout:
                    proc.kill()
                    proc.communicate()
                    return {"vllm_error": f"importing vLLM took longer than {timeout:.0f} s"}
                if say is not None:
                    say(f"  still importing vLLM ({waited:.0f} s)")
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if not lines:
        return {"vllm_error": (err.strip().splitlines() or ["no output"])[-1][:300]}
    result: dict[str, str] = json.loads(lines[-1])
    return result


def check_ports(settings: Settings, p: Plan) -> Finding:
    """Every planned port is free on the address it binds, or held by its own running unit: the same rule as
    `pdctl up` and `status` (node.port_conflicts: the manager must run the holder; a command line that merely
    looks like vLLM's is nobody's proof)."""
    from appliance.manager import ServiceManager
    from appliance.node import Node, port_conflicts

    try:
        manager: ServiceManager | None = Node(settings).manager(p)
    except PdctlError:  # no manager to ask (e.g. systemd chosen where it is not PID 1)
        manager = None
    busy = port_conflicts(p, manager)
    if busy:
        more = f" (+{len(busy) - 3} more)" if len(busy) > 3 else ""
        return Finding("ports", "fail", "; ".join(busy[:3]) + more,
                       "stop what holds them, or move the base ports in the settings")
    return Finding("ports", "ok", f"{len(all_ports(p.instances, p.proxy))} planned ports free or held by their own units")


def check_model(settings: Settings, p: Plan) -> list[Finding]:
    """The model directory is readable, and disk/memory can hold it."""
    findings: list[Finding] = []
    path = Path(p.model.path)
    if p.model.generate:
        state = Path(p.state_dir)
        parent = state if state.exists() else state.parent
        ok = path.exists() or os.access(parent, os.W_OK)
        findings.append(Finding("model", "ok" if ok else "fail",
                                f"embedded tiny model at {path} ({'present' if path.exists() else 'generated by pdctl up'})",
                                "" if ok else f"make {p.state_dir} writable or set state_dir"))
    elif not path.exists():
        findings.append(Finding("model", "warn" if "/" in p.model.path and not p.model.path.startswith("/") else "fail",
                                f"{p.model.path} is not a local directory",
                                "download the model to a local directory and set model.path (no hub access assumed)"))
        return findings
    elif not (path / "config.json").is_file() or not os.access(path / "config.json", os.R_OK):
        findings.append(Finding("model", "fail", f"{path} has no readable config.json", "point model.path at a model dir"))
        return findings
    else:
        size = sum(f.stat().st_size for f in path.glob("*.safetensors")) + sum(f.stat().st_size for f in path.glob("*.bin"))
        findings.append(Finding("model", "ok", f"{path} ({size / 2**30:.1f} GiB of weights)"))
    disk = shutil.disk_usage(Path(p.state_dir) if Path(p.state_dir).exists() else Path("/"))
    findings.append(Finding("disk", "ok" if disk.free > 2 * 2**30 else "warn", f"{disk.free / 2**30:.0f} GiB free",
                            "" if disk.free > 2 * 2**30 else "free disk space for logs, KV store and the model"))
    if p.platform == "cpu" and settings.engine.kind == "vllm":
        # ~1.4 GiB per CPU engine (API server + engine core) on top of its KV cache.
        need = len(p.instances) * (settings.engine.cpu_kv_cache_mib * 2**20 + int(1.4 * 2**30))
        avail = psutil.virtual_memory().available
        findings.append(Finding("memory", "ok" if avail > need else "fail",
                                f"{avail / 2**30:.1f} GiB available, ~{need / 2**30:.1f} GiB needed by {len(p.instances)} CPU engines",
                                "" if avail > need else "lower engine.cpu_kv_cache_mib or stop other programs"))
    return findings


def check_tp(p: Plan) -> list[Finding]:
    """Every instance's TP divides the model's attention heads (and splits or replicates its KV heads)."""
    heads = None if p.model.generate else read_heads(p.model.path)
    if heads is None:
        return []
    kv = f"{heads.kv} KV heads" if heads.kv is not None else "MLA"
    bad = [(i, why) for i in p.instances if (why := heads.tp_problem(i.tp))]
    if not bad:
        tps = sorted({i.tp for i in p.instances})
        return [Finding("tp", "ok", f"TP {', '.join(map(str, tps))} fits {heads.attention} attention heads, {kv}")]
    # a fix the user can type: the same role's GPUs in instances of a TP the model takes
    findings = []
    for inst, why in bad:
        role_gpus = sum(len(i.gpus) for i in p.role_instances(inst.role))
        shapes = [f"{role_gpus // tp}xTP{tp}" for tp in heads.fitting(role_gpus) if role_gpus % tp == 0]
        findings.append(Finding("tp", "fail", f"{inst.name}: {why}; vLLM refuses to start",
                                f"reshape {inst.role}: --{inst.role} {shapes[-1]}" + (
                                    f" (or {', '.join(shapes[:-1])})" if len(shapes) > 1 else "")))
    return findings


def amd_rows(inventory: Inventory) -> list[Finding]:
    """AMD nodes: the amdsmi release, the compute partition mode and the XGMI matrix, one row each."""
    rows = [
        Finding("amdsmi", "ok", inventory.library)
        if inventory.library
        else Finding("amdsmi", "ok", f"release not recorded (inventory {inventory.source})")
    ]
    modes = sorted({g.compute_partition or "not reported" for g in inventory.gpus})
    groups = inventory.physical_gpus()
    if inventory.partitioned:
        rows.append(Finding("partition", "fail",
                            f"{'/'.join(modes)}: {len(inventory.gpus)} partitions of {len(groups)} physical GPUs",
                            "switch the GPUs to SPX (as root: amd-smi set --compute-partition SPX)"))
    else:
        rows.append(Finding("partition", "ok" if modes == ["SPX"] else "warn", f"{'/'.join(modes)} on {len(groups)} GPUs",
                            "" if modes == ["SPX"] else "amdsmi did not report the compute partition mode"))
    # Partitions share their physical GPU's links: the matrix that matters is the physical GPUs'.
    indices = [group[0] for group in groups]
    pairs = [(a, b) for n, a in enumerate(indices) for b in indices[n + 1:]]
    if not pairs:
        return rows
    what = "physical GPUs" if inventory.partitioned else "GPUs"
    slow = [f"{a}-{b} {kind}" for a, b in pairs if (kind := inventory.link(a, b)) != "XGMI"]
    hops = sorted({link.hops for link in inventory.links if link.type == "XGMI" and link.hops is not None})
    hop_text = f", {'/'.join(map(str, hops))} hop{'s' if hops != [1] else ''}" if hops else ""
    if not slow:
        rows.append(Finding("xgmi", "ok", f"all {len(pairs)} pairs of {len(indices)} {what} on XGMI{hop_text}"))
    else:
        rows.append(Finding("xgmi", "warn", f"{len(pairs) - len(slow)} of {len(pairs)} pairs on XGMI; not: "
                            + ", ".join(slow[:6]) + (f" (+{len(slow) - 6} more)" if len(slow) > 6 else ""),
                            "TP groups over these pairs cross PCIe: see `pdctl inventory` for the matrix"))
    return rows


def _gpus_row(inventory: Inventory) -> Finding:
    bad = [g.index for g in inventory.gpus if not g.healthy]
    return Finding("gpus", "fail" if bad else "ok",
                   f"{len(inventory.gpus)} x {inventory.gpus[0].name} via {inventory.source}"
                   + (f"; unhealthy: {bad}" if bad else ""),
                   "check the driver (amd-smi / nvidia-smi) for the listed GPUs" if bad else "")


def refused_findings(settings: Settings, inventory: Inventory, error: PdctlError,
                     probe_timeout: float = 180.0, say: Say | None = None) -> list[Finding]:
    """When no plan can be made for the node and none is deployed: every check that needs no plan (GPUs,
    vLLM and the settings' connector library, RDMA), and the planner's refusal as the last row."""
    named = settings.connector.name if settings.connector.name != "auto" else None
    return [*node_checks(settings, inventory, named, probe_timeout, say),
            Finding("plan", "fail", error.message, error.fix or "")]


def check_rdma(connector: str, need: RdmaNeed | None, sysfs: Path = Path("/sys/class/infiniband")) -> Finding:
    """RDMA devices and their port states, judged by how the connector depends on them (`need`)."""
    devices = []
    active = 0
    for dev in sorted(sysfs.iterdir()) if sysfs.is_dir() else []:
        states = []
        for state in sorted(dev.glob("ports/*/state")):
            try:
                states.append(state.read_text().split(":")[-1].strip())  # "4: ACTIVE"
            except OSError:
                states.append("unreadable")
        active += states.count("ACTIVE")
        devices.append(f"{dev.name} ({', '.join(states) or 'no ports'})")
    if active:
        return Finding("rdma", "ok", f"{active} active port(s): {', '.join(devices)}")
    where = f"{', '.join(devices)} in {sysfs}, none ACTIVE" if devices else f"no RDMA devices in {sysfs}"
    if need is None:
        return Finding("rdma", "ok", f"{where}; the {connector} connector does not use RDMA")
    if not need.required:
        # nothing the user must change: the connector serves without RDMA on one node
        return Finding("rdma", "ok", f"{where}; the {connector} connector does not need it here: {need.fix}")
    return Finding("rdma", "fail", where, need.fix)


def _limit_text(value: int) -> str:
    return "unlimited" if value == resource.RLIM_INFINITY else f"{value // 1024} KiB"


def engine_memlock(settings: Settings, p: Plan) -> tuple[int | None, str]:
    """The locked-memory limit the engines get (None: unlimited) and where it comes from."""
    from appliance.node import Node
    from appliance.render.names import instance_unit
    from appliance.render.templates import template

    kind = Node(settings).manager_kind()
    if kind == "auto":
        from appliance.manager import systemd_is_pid1

        kind = "systemd" if systemd_is_pid1() else "supervisor"
    if kind == "systemd":
        unit = Path(settings.unit_dir) / f"{instance_unit(p.instances[0])}.service" if p.instances else None
        text, where = (unit.read_text(), str(unit)) if unit and unit.is_file() else (
            template("pd-engine.service.in").template, "the units pdctl up renders")
        match = re.search(r"^LimitMEMLOCK=(\S+)", text, re.MULTILINE)
        if not match:
            soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
            return (None if soft == resource.RLIM_INFINITY else soft), f"systemd's default ({where} sets none)"
        value = match.group(1).split(":")[0]
        return (None if value == "infinity" else _systemd_bytes(value)), f"LimitMEMLOCK={value} in {where}"
    from appliance.manager.supervisor import can_raise_limits

    hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
    if hard == resource.RLIM_INFINITY or can_raise_limits():
        return None, "supervisord, which pdctl starts with memlock raised"
    return hard, "supervisord, capped at this shell's hard limit (pdctl cannot raise it without CAP_SYS_RESOURCE)"


def _systemd_bytes(value: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    try:
        return int(value[:-1]) * units[value[-1].upper()] if value[-1:].upper() in units else int(value)
    except ValueError:
        return 0


CAP_IPC_LOCK = 14  # linux/capability.h: pin memory past RLIMIT_MEMLOCK (mlock, and ib_umem_get for RDMA)


def engines_may_lock(euid: int | None = None, status: Path = Path("/proc/self/status")) -> bool:
    """Whether the engines pdctl starts (as this user: neither renderer sets a User=) hold CAP_IPC_LOCK: root's
    processes get every capability of their bounding set at exec, which they inherit from this one."""
    if (os.geteuid() if euid is None else euid) != 0:
        return False
    try:
        for line in status.read_text().splitlines():
            if line.startswith("CapBnd:"):
                return bool(int(line.split()[1], 16) >> CAP_IPC_LOCK & 1)
    except (OSError, ValueError):
        pass
    return False


def active_rdma_ports(sysfs: Path = Path("/sys/class/infiniband")) -> int:
    """How many RDMA ports are ACTIVE: the only way NIXL (UCX) or MORI-IO pins host memory on one node."""
    count = 0
    for state in sysfs.glob("*/ports/*/state") if sysfs.is_dir() else []:
        with contextlib.suppress(OSError):
            count += state.read_text().split(":")[-1].strip() == "ACTIVE"
    return count


def memlock_fix(manager: str, euid: int) -> str:
    """What raises the engines' memlock limit under `manager`, for a user who may apply it."""
    if manager == "systemd":
        return "set LimitMEMLOCK=infinity in the engine units (pdctl up renders it; remove the override that caps it)"
    if euid == 0:
        # root without CAP_SYS_RESOURCE: a container, whose limit its runtime sets
        return ("raise the limit where this container starts (docker/podman run --ulimit memlock=-1, or "
                "--cap-add SYS_RESOURCE), then pdctl down && pdctl up")
    return ("raise memlock's hard limit (/etc/security/limits.conf: * hard memlock unlimited), log in again, "
            "then pdctl down && pdctl up; or run pdctl as root")


def memlock_finding(detail: str, limited: bool, pins: bool, rdma_ports: int, may_lock: bool, fix: str) -> Finding:
    """The memlock row: a finite limit fails only where the engines would pin memory through an RDMA device
    (UCX over TCP, shared memory or cuda_ipc registers nothing with the kernel) without CAP_IPC_LOCK."""
    if not limited:
        return Finding("memlock", "ok", detail)
    if not pins:
        return Finding("memlock", "ok", f"{detail}; the connector pins no memory")
    if may_lock:
        return Finding("memlock", "ok", f"{detail}; the engines run as root with CAP_IPC_LOCK, which pins memory "
                                        "past the limit")
    if not rdma_ports:
        return Finding("memlock", "ok", f"{detail}; no active RDMA port, so the connector pins no host memory (it "
                                        "would with one: then the limit must be raised)")
    return Finding("memlock", "fail", f"{detail}; {rdma_ports} active RDMA port(s): registering the KV cache "
                                      "with them fails past the limit", fix)


def check_memlock(settings: Settings, p: Plan, pins_memory: bool,
                  sysfs: Path = Path("/sys/class/infiniband")) -> Finding:
    """RLIMIT_MEMLOCK in this shell and for the engines, judged by whether the engines would pin memory."""
    shell = _limit_text(resource.getrlimit(resource.RLIMIT_MEMLOCK)[0])
    limit, source = engine_memlock(settings, p)
    engines = "unlimited" if limit is None else _limit_text(limit)
    detail = f"engines: {engines} ({source}); this shell (ulimit -l): {shell}"
    manager = "systemd" if source.startswith(("LimitMEMLOCK", "systemd")) else "supervisor"
    pins = pins_memory and settings.engine.kind == "vllm"
    return memlock_finding(detail, limit is not None, pins, active_rdma_ports(sysfs) if pins else 0,
                           engines_may_lock(), memlock_fix(manager, os.geteuid()))


def kv_store_room(max_mib: float, free: int, used: int) -> Finding:
    """Whether the file system can hold the KV store up to its bound: what it holds now plus what is free."""
    room = (free + used) / 2**20
    if room >= max_mib:
        return Finding("kv-store", "ok", f"{used / 2**20:.0f} MiB, bounded at {max_mib:g} MiB; {room:.0f} MiB of room")
    return Finding("kv-store", "warn", f"bounded at {max_mib:g} MiB, but only {room:.0f} MiB of room on its file "
                   "system: the engines die when a KV write fails", "lower [connector.example] max_store_mib (or the "
                   "connector's own bound), or free disk space")


def check_kv_store(p: Plan) -> list[Finding]:
    """The KV folders the proxy bounds (plan.proxy.kv_store) each fit their file system."""
    store = p.proxy.kv_store
    if store is None:
        return []
    findings = []
    for folder in store.folders:
        path = Path(folder)
        existing = next(q for q in (path, *path.parents) if q.exists())
        used = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0
        findings.append(kv_store_room(store.max_mib, shutil.disk_usage(existing).free, used))
    return findings


def run_checks(settings: Settings, inventory: Inventory, p: Plan, probe_timeout: float = 180.0,
               say: Say | None = None) -> list[Finding]:
    """All doctor checks for this node and plan (`say`: progress while one takes long)."""
    findings = node_checks(settings, inventory, p.connector, probe_timeout, say)
    need = get_connector(p.connector).rdma(settings.connector.own(p.connector))
    findings.append(check_memlock(settings, p, pins_memory=need is not None))
    findings.append(check_ports(settings, p))
    findings.extend(check_model(settings, p))
    findings.extend(check_kv_store(p))
    findings.extend(check_tp(p))
    return findings


def node_checks(settings: Settings, inventory: Inventory, connector_name: str | None,
                probe_timeout: float = 180.0, say: Say | None = None) -> list[Finding]:
    """The checks that need no plan: GPUs, the engine's vLLM and (where a connector is known) its library and
    RDMA (`say`: progress while vLLM imports)."""
    findings: list[Finding] = []
    connector = get_connector(connector_name) if connector_name else None
    with_connector = f" with the {connector_name} connector" if connector_name else ""
    if inventory.gpus:
        findings.append(_gpus_row(inventory))
    else:
        why = "; ".join(inventory.notes[:2])
        findings.append(Finding("gpus", "ok", f"no GPUs ({why}): CPU layout{with_connector}"))

    if inventory.vendor == "amd":
        findings.extend(amd_rows(inventory))

    if settings.engine.kind == "sim":
        findings.append(Finding("engine", "ok", "simulated engine (no vLLM needed)"))
    else:
        python = engine_python(settings)
        if say is not None:
            say(f"importing vLLM in {python} (about 30 s on a busy 2-core box)")
        result = probe_engine(python, connector_name or "none", probe_timeout, say)
        if "vllm" in result:
            cmd = server_command("python", "MODEL", settings.engine.vllm_package)
            server = f"python -m {cmd[2]}" + (" serve" if cmd[3] == "serve" else "")
            package = settings.engine.vllm_package or "package unknown"
            findings.append(Finding("vllm", "ok", f"vLLM {result['vllm']} ({package}) in {python}; engines start "
                                    f"as `{server}`"))
        else:
            findings.append(Finding("vllm", "fail", f"vLLM is not importable by {python}: {result.get('vllm_error')}",
                                    "run ./install.sh, or set engine.python to the Python that has vLLM"))
        lib = connector.library if connector else None
        if lib is not None:
            if result.get("connector") == "ok":
                findings.append(Finding("connector", "ok", f"{lib.label} loads for the {connector_name} connector"))
            else:
                findings.append(Finding("connector", "fail",
                                        f"{lib.label} does not load: {result.get('connector_error', 'vLLM missing')}",
                                        f"install {lib.install} into the engine's environment"))
        if connector is not None and "vllm" in result:
            findings.extend(check_extra_config(connector, list(settings.connector.extra_config), result["vllm"]))
    if connector is not None and connector_name:
        findings.append(check_rdma(connector_name, connector.rdma(settings.connector.own(connector_name))))
    return findings


def check_extra_config(connector: Connector, keys: list[str], version: str) -> list[Finding]:
    """A warning for each of the settings' connector.extra_config `keys` that the engine's vLLM `version` will
    not read with this connector (its table says which release reads what); no row when there are no keys."""
    table = connector.extra_config_keys
    if table is None or not keys:
        return []
    ignored = table.ignored(keys, version)
    if not ignored:
        unsure = [key for key in keys if table.read_by(key, version) is None]
        read = [key for key in keys if key not in unsure]
        return [Finding("extra_config", "ok", "; ".join(
            ([f"vLLM {version}'s {table.vllm_class} reads {', '.join(read)}"] if read else [])
            + ([f"whether vLLM {version} reads {', '.join(unsure)} is not known"] if unsure else [])))]
    return [Finding("extra_config", "warn", f"{why}: the engines will ignore it",
                    "remove it from connector.extra_config, or run a vLLM release that reads it") for why in ignored]


def summary_exit_code(findings: list[Finding]) -> int:
    """0 when nothing failed, 1 otherwise."""
    return 1 if any(f.status == "fail" for f in findings) else 0


def as_json(findings: list[Finding]) -> str:
    """Findings as a JSON list."""
    return json.dumps([asdict(f) for f in findings], indent=2)


__all__ = ["Finding", "PdctlError", "as_json", "run_checks", "summary_exit_code"]
