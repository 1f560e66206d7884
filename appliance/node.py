"""The deployed node: what is deployed in one state directory, and the service manager that runs it.

`pdctl up` applies a plan here; `status`, `restart`, `logs`, `down`, `rebalance`, `mode` and `bench --compare`
load what was applied from here. The files (appliance.statedir): plan.json is what is deployed; proxy.json
is derived from it; `manager` records which service manager `up` used, so later commands drive the same
one; layout.json records what `pdctl rebalance` (the roles' shapes) and `pdctl mode` (the transfer mode) left
the node in, applied over pdctl.toml; an explicit flag or PDCTL_* variable wins over it (`recorded_overrides`).
"""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from secrets import token_urlsafe
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from appliance.connector import get_connector
from appliance.errors import PdctlError
from appliance.manager import ACTIVE, ServiceManager, choose_manager
from appliance.plan import Plan, busy_ports
from appliance.ports import holders, port_free, taken
from appliance.proxy.tenants import read_keys
from appliance.render.names import PROXY_UNIT, TARGET, instance_unit
from appliance.render.templates import RenderOptions, secret_env
from appliance.roles import ROLES
from appliance.settings import Settings, deep_merge
from appliance.statedir import (
    StateDir,
    Transaction,
    make_private_dir,
    read_state,
    state_error,
    transaction,
    write_atomic,
)

if TYPE_CHECKING:
    from appliance.proxy.admin_client import AdminClient

EXIT_DOWN = 3
# Sections of a layout that a command line naming the same role replaces whole (a shape, not a tweak).
ROLE_SECTIONS = ("prefill", "decode", "colocated")
# The keys of a role section that make its shape: one of them set explicitly replaces a recorded shape whole.
SHAPE_KEYS = ("gpus", "gpu_count", "instances", "tp", "dp")
# Who records what in layout.json: the roles' shapes, the transfer mode (and the connector `auto` ran it on).
REBALANCE = "pdctl rebalance"
MODE = "pdctl mode"


class NotDeployed(PdctlError):
    """No plan was ever applied in this state_dir."""

    exit_code = EXIT_DOWN


def http_answer(url: str, timeout: float = 2.0) -> int | None:
    """The HTTP status `url` answers with, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (OSError, ValueError):
        return None


def admin_url(plan: Plan) -> str:
    """The proxy's admin API base URL."""
    return plan.proxy.admin_url


def admin_client(plan: Plan, timeout: float) -> AdminClient:
    """A client of the proxy's admin API, with the plan's token."""
    from appliance.proxy.admin_client import AdminClient

    return AdminClient(admin_url(plan), token_file=plan.proxy.admin.token_file, timeout=timeout)


def proxy_state(plan: Plan) -> dict[str, Any] | None:
    """The proxy's /admin/state, or None when it does not answer; PortTaken when another service answers there,
    AdminRefused when the proxy answers but refuses pdctl's token."""
    from appliance.proxy.admin_client import AdminRefused, PortTaken, ProxyAdminError

    try:
        return admin_client(plan, timeout=3).state()
    except (PortTaken, AdminRefused):
        raise
    except (ProxyAdminError, OSError):
        return None


PORT_FIX = "stop that process, or move the port in pdctl.toml"


def port_conflicts(plan: Plan, manager: ServiceManager | None, *, proxy_only: bool = False) -> list[str]:
    """The plan's ports (or only the proxy's) that something other than their own running unit holds, one line
    each: the port, the address, what the plan binds there and the process (pid and name where pdctl may see it).

    A busy port of a running unit is its own unless a process the manager does not run holds it; with
    `proxy_only` (a proxy that does not answer) only such processes, or ones pdctl may not name, count. With no
    manager to ask (None), no unit runs: every holder is another process."""
    busy = [b for b in busy_ports(plan, port_free) if not (proxy_only and b.instance is not None)]
    if not busy:
        return []
    import psutil  # only where a port is taken: `pdctl status` on a healthy node does not pay for it

    found = holders([(b.host, b.port) for b in busy])
    if manager is None:
        return [taken(b.port, b.host, b.owner, found[(b.host, b.port)]) for b in busy]
    units = manager.status()
    problems = []
    for b in busy:
        unit = PROXY_UNIT if b.instance is None else instance_unit(plan.instance(b.instance))
        seen = found[(b.host, b.port)]
        # (pid_exists after runs(): a process of ours that exited meanwhile, e.g. a restarting proxy, is no holder)
        others = [h for h in seen if h.pid is not None and not manager.runs(h.pid) and psutil.pid_exists(h.pid)]
        unnamed = [h for h in seen if h.pid is None]
        if not others and (units[unit].state in ACTIVE or (proxy_only and seen and not unnamed)):
            # held by its running unit (or a process pdctl may not name: trusted to be the unit's); for the
            # proxy's wait and status, by a process of the node's own (a proxy still stopping)
            continue
        problems.append(taken(b.port, b.host, b.owner, others or seen))
    return problems


def pinned(plan: Plan) -> dict[str, Any]:
    """The plan's roles as settings that reproduce it exactly (explicit GPUs, instances, TP, DP), its connector
    and mode."""
    out: dict[str, Any] = {"connector": {"name": plan.connector, "mode": plan.mode}}
    for role in ROLES:
        insts = plan.role_instances(role)
        if not insts:
            continue
        key = "colocated" if role == "both" else role
        gpus = [g for i in insts for g in i.gpus]
        out[key] = {"gpus": gpus or None, "gpu_count": None, "instances": len(insts),
                    "tp": insts[0].tp if gpus else None, "dp": insts[0].dp}
    return out


def layered(layout: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Command-line overrides over a layout: a role the command line names replaces the layout's."""
    kept = {k: v for k, v in layout.items() if not (k in ROLE_SECTIONS and k in overrides)}
    return deep_merge(kept, overrides)


@dataclass(frozen=True)
class Recorded:
    """layout.json: the settings overrides it records and, per section, the command that recorded it."""

    overrides: dict[str, Any]
    written_by: dict[str, str]

    def writers(self) -> str:
        """The commands that recorded it, in the order of its sections ("pdctl rebalance, pdctl mode")."""
        return ", ".join(dict.fromkeys(self.written_by.values()))


def recorded_overrides(recorded: Recorded, explicit: dict[str, str], connector_name: str) -> tuple[dict[str, Any], list[str]]:
    """The parts of `recorded` that apply, and one phrase for each part an explicit setting overrides.

    `explicit`: dotted setting -> the flag or PDCTL_* variable that set it; an explicit setting always wins, and a
    role shape is replaced whole by any explicit shape key of that role. `connector_name`: what the settings name
    (the connector `pdctl mode` ran on applies only while they say auto and the recorded mode stands)."""
    kept: dict[str, Any] = {}
    ignored: list[str] = []
    for section, value in recorded.overrides.items():
        by = recorded.written_by.get(section, REBALANCE)
        if section in ROLE_SECTIONS:
            why = [src for key, src in explicit.items()
                   if key == section or (key.startswith(section + ".") and key.split(".")[1] in SHAPE_KEYS)]
            if why:
                ignored.append(f"the {section} shape ({by}) for {', '.join(dict.fromkeys(why))}")
            else:
                kept[section] = value
        elif section == "connector" and isinstance(value, dict):
            connector = dict(value)
            auto_name = connector.pop("auto_name", None)
            if "mode" in connector and "connector.mode" in explicit:
                ignored.append(f"mode {connector.pop('mode')} ({by}) for {explicit['connector.mode']}")
            elif auto_name is not None and connector_name == "auto" and "connector.name" not in explicit:
                connector["name"] = auto_name
            if connector:
                kept[section] = connector
        else:
            kept[section] = value
    return kept, ignored


REDACTED = "<redacted: secrets.json>"


def redacted(plan: Plan) -> tuple[Plan, dict[str, dict[str, str]]]:
    """The plan with every secret environment value (names like *TOKEN*, *KEY*) replaced by a marker, and the
    values it took out, by instance and name: plan.json and `pdctl plan --json` never show a secret."""
    secrets: dict[str, dict[str, str]] = {}
    instances = []
    for inst in plan.instances:
        _, secret = secret_env(inst.env)
        if secret:
            secrets[inst.name] = secret
            inst = inst.model_copy(update={"env": {k: REDACTED if k in secret else v for k, v in inst.env.items()}})
        instances.append(inst)
    return plan.model_copy(update={"instances": instances}), secrets


def _restored(plan: Plan, secrets: dict[str, dict[str, str]]) -> Plan:
    """A plan read from plan.json with the secret values from secrets.json put back."""
    instances = []
    for inst in plan.instances:
        mine = secrets.get(inst.name, {})
        if any(v == REDACTED for v in inst.env.values()):
            inst = inst.model_copy(update={"env": {k: mine.get(k, v) if v == REDACTED else v
                                                   for k, v in inst.env.items()}})
        instances.append(inst)
    return plan.model_copy(update={"instances": instances})


@dataclass(frozen=True)
class Applied:
    """What writing a plan changed: unit definitions, and whether the proxy's configuration did."""

    units: set[str]
    proxy_config: bool

    def to_restart(self) -> set[str]:
        """Units whose running process is out of date (the proxy reads proxy.json only at start)."""
        return self.units | ({PROXY_UNIT} if self.proxy_config else set())



def _generated(target: Path, tx: Transaction) -> bool:
    """A random secret at `target` (0600, pdctl's user): kept when it is there and ours (the units' hooks and
    scripts hold it; the write tightens its mode), else generated; True when it was (re)generated."""
    try:
        info = target.lstat()
        value = target.read_text().strip() if info.st_uid == os.geteuid() and stat.S_ISREG(info.st_mode) else ""
    except (FileNotFoundError, UnicodeDecodeError):
        value = ""
    return tx.write(target, (value or token_urlsafe(32)) + "\n", 0o600) and not value

class Node:
    """The node that `settings.state_dir` describes."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.state = StateDir.at(settings.state_dir)

    # ------------------------------------------------------------------------------------------ reading
    def installed(self) -> Plan | None:
        """The plan `pdctl up` last applied, or None."""
        path = Path(self.state.plan)
        try:
            plan = Plan.model_validate_json(read_state(path))
        except FileNotFoundError:
            return None
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "(top level)"
            raise PdctlError(f"{path} is not a plan pdctl wrote ({where}: {first['msg']})",
                             fix="run `pdctl up` to write it again") from None
        except ValueError as exc:
            raise PdctlError(f"{path} cannot be read ({exc})", fix="run `pdctl up` to write it again") from None
        try:
            secrets = json.loads(read_state(self.state.secrets))
        except FileNotFoundError:
            secrets = {}
        except ValueError as exc:
            raise PdctlError(f"{self.state.secrets} cannot be read ({exc})",
                             fix="run `pdctl up` to write it again") from None
        return _restored(plan, secrets)

    def replaceable(self) -> Plan | None:
        """The installed plan for `pdctl up`, which writes a new one: None also when plan.json cannot be read."""
        try:
            return self.installed()
        except PdctlError:
            return None

    def deployed(self) -> Plan:
        """The installed plan; NotDeployed (one line, exit 3) when nothing was deployed."""
        plan = self.installed()
        if plan is None:
            raise NotDeployed(f"nothing is deployed here ({self.state.plan} is missing)", fix="run `pdctl up`")
        return plan

    def layout(self) -> dict[str, Any]:
        """The overrides layout.json records (roles' shapes, transfer mode), or {} when there are none."""
        return self.recorded().overrides

    def recorded(self) -> Recorded:
        """What layout.json records and which command recorded each part (empty when there is no file)."""
        path = Path(self.state.layout)
        try:
            data = json.loads(read_state(path))
        except FileNotFoundError:
            return Recorded({}, {})
        except ValueError as exc:
            raise PdctlError(f"{path} cannot be read ({exc})",
                             fix="delete it to return to pdctl.toml's layout") from None
        overrides = data.get("overrides", {}) if isinstance(data, dict) else {}
        if not isinstance(overrides, dict):
            overrides = {}
        by = data.get("written_by") if isinstance(data, dict) else None
        # an older file names one writer for all it holds
        written_by = {k: str(by.get(k, REBALANCE)) if isinstance(by, dict) else str(by or REBALANCE)
                      for k in overrides}
        return Recorded(overrides, written_by)

    # -------------------------------------------------------------------------------------- the manager
    def render_options(self) -> RenderOptions:
        """Renderer options from the settings."""
        return RenderOptions(python=sys.executable, health_timeout_s=self.settings.engine.health_timeout_s,
                             restart_drain_s=self.settings.proxy.restart_drain_s,
                             restart_hold_s=self.settings.proxy.restart_hold_s)

    def manager_kind(self, choice: str | None = None, *, recorded: bool = True) -> str:
        """`choice`, else (with `recorded`) the manager `pdctl up` used, else the setting (may be "auto")."""
        path = Path(self.state.manager)
        return choice or (path.read_text().strip() if recorded and path.is_file() else self.settings.manager)

    def manager(self, plan: Plan, choice: str | None = None, *, recorded: bool = True) -> ServiceManager:
        """The manager: `choice`, else (with `recorded`) the one `pdctl up` used, else the setting (auto)."""
        kind = self.manager_kind(choice, recorded=recorded)
        # For driving a systemd that is not this namespace's PID 1 (the tests boot one with unshare).
        prefix = shlex.split(os.environ.get("PDCTL_SYSTEMD_PREFIX", ""))
        return choose_manager(plan, kind, self.settings.unit_dir, self.render_options(), prefix=prefix)

    # ------------------------------------------------------------------------------------------ writing
    def write(self, plan: Plan) -> bool:
        """Write plan.json, secrets.json and proxy.json for `plan`, all or none; True when proxy.json changed."""
        with transaction() as tx:
            return self._stage(plan, tx)

    def _stage(self, plan: Plan, tx: Transaction) -> bool:
        """Stage plan.json (secrets redacted), secrets.json (0600) and proxy.json in the state directory (0700)
        and make the KV store and the KV events sockets' folder (0700); True when proxy.json changed."""
        make_private_dir(self.state.root)
        if plan.proxy.api_keys_file:
            read_keys(plan.proxy.api_keys_file)  # a file the proxy would refuse fails `pdctl up` first, in one line
        connector = get_connector(plan.connector)
        for inst in plan.instances:
            for folder in connector.kv_folders(inst.kv_transfer_config or {}):
                # the KV store holds prompts' KV: private to pdctl's user wherever the settings put it
                make_private_dir(folder)
            if inst.kv_events_socket is not None:
                # its engine binds the socket there: only pdctl's user may connect to it (prompts' token ids) or
                # put a socket there before it
                make_private_dir(Path(inst.kv_events_socket).parent)
        # the token before the proxy's config that names it: a proxy (re)started meanwhile finds it
        new_token = self.ensure_admin_token(plan, tx)
        for path in (plan.proxy.metrics_token_file, plan.proxy.cache_salt_secret_file):
            new_token = self.ensure_generated_secret(path, tx) or new_token
        changed = tx.write(self.state.proxy_config, plan.proxy.model_dump_json(indent=2) + "\n") or new_token
        public, secrets = redacted(plan)
        tx.write(self.state.secrets, json.dumps(secrets, indent=2) + "\n", 0o600)
        tx.write(self.state.plan, public.model_dump_json(indent=2) + "\n", 0o600)
        return changed

    def ensure_admin_token(self, plan: Plan, tx: Transaction) -> bool:
        """Make sure the admin token file the plan names exists: the state directory's is generated (0600,
        owned by the user pdctl runs as) when missing, empty or not ours; True when it was (re)written, so the
        running proxy, which read the old one at start, restarts. A file the settings name must exist."""
        path = plan.proxy.admin.token_file
        if path is None:
            return False
        if path != str(self.state.admin_token):
            if not os.access(path, os.R_OK):
                raise PdctlError(f"proxy.admin_token_file {path} cannot be read",
                                 fix="write a random token into it (mode 0600), or unset it to let pdctl make one")
            return False
        return _generated(Path(path), tx)

    def ensure_generated_secret(self, path: str | None, tx: Transaction) -> bool:
        """The metrics token or cache salt secret at `path`, when it is one the state directory holds: generated
        (0600, pdctl's user) when missing, empty or not ours, as the admin token is; True when (re)written."""
        if path not in (str(self.state.metrics_token), str(self.state.cache_salt_secret)):
            return False
        return _generated(Path(path), tx)

    def apply(self, plan: Plan, manager: ServiceManager, previous: Plan | None) -> Applied:
        """Write the state files for `plan`, record the manager and write its configuration: all of it, or (on
        a failure, one StateWriteError line) none, the previous state whole and in force."""
        with transaction() as tx:
            proxy_changed = self._stage(plan, tx)
            tx.write(self.state.manager, manager.name + "\n")
            # in place before the manager starts anything: a proxy (re)started now reads the new proxy.json
            tx.commit()
            units = manager.apply(previous)
        return Applied(units, proxy_changed)

    def record_layout(self, plan: Plan | None) -> None:
        """Record the roles' shapes `plan` runs (a rebalance's result), or with None drop them (back to pdctl.toml);
        a recorded mode stays."""
        shapes = {} if plan is None else {k: v for k, v in pinned(plan).items() if k in ROLE_SECTIONS}
        self._record(ROLE_SECTIONS, shapes, REBALANCE)

    def record_mode(self, mode: str, auto_connector: str | None) -> None:
        """Record the transfer mode `pdctl mode` switched to and, when the settings leave the connector to `auto`,
        the connector the node runs it on (auto picks by mode on some nodes: a later `up` must not switch)."""
        section: dict[str, Any] = {"mode": mode}
        if auto_connector is not None:
            section["auto_name"] = auto_connector
        self._record(("connector",), {"connector": section}, MODE)

    def _record(self, sections: tuple[str, ...], values: dict[str, Any], by: str) -> None:
        """Replace `sections` of layout.json with `values`, written by `by`; the file goes when nothing is left."""
        before = self.recorded()
        overrides = {k: v for k, v in before.overrides.items() if k not in sections} | values
        written_by = {k: before.written_by[k] for k in overrides if k not in values} | {k: by for k in values}
        path = Path(self.state.layout)
        if not overrides:
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                raise state_error(exc, path, "remove") from None
            return
        doc = {"written_by": written_by, "overrides": overrides}
        write_atomic(path, json.dumps(doc, indent=2) + "\n")

    def ensure_model(self, plan: Plan) -> None:
        """Write the embedded tiny model before vLLM starts (Plan.model.generate); the sim needs none."""
        if not plan.model.generate or plan.engine != "vllm":
            return
        from appliance.engine import tinymodel

        try:
            tinymodel.write_tiny_model(Path(plan.model.path))
            return
        except ImportError:
            pass
        except OSError as exc:
            raise state_error(exc, plan.model.path, "write the tiny model to", directory=True) from None
        # pdctl's own environment lacks the model libraries: the engine's Python has them. The generator is one
        # self-contained file, run isolated (-I) so neither pdctl's packages nor PYTHONPATH shadow the engine's.
        python = self.settings.engine.python or sys.executable
        done = subprocess.run([python, "-I", tinymodel.__file__, plan.model.path], capture_output=True, text=True)
        if done.returncode != 0:
            # the generator's last line says why (an OSError's errno and path, or the missing library)
            why = (done.stderr.strip().splitlines() or ["it exited with no message"])[-1]
            raise PdctlError(f"cannot generate the tiny model in {plan.model.path}: {why}",
                             fix="set engine.python to the Python that has vLLM")

    # ------------------------------------------------------------------------------------------- running
    def up(self, plan: Plan, manager: ServiceManager) -> list[str]:
        """Apply `plan` and start it: changed running units restart, stopped ones start; returns both, in order.

        Refuses (before anything is written) when a port of the plan is held by something else than its unit.
        """
        previous = self.replaceable()
        problems = port_conflicts(plan, manager)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise PdctlError(problems[0] + more, fix=PORT_FIX)
        self.ensure_model(plan)
        changed = self.apply(plan, manager, previous).to_restart()
        now = manager.status()
        restart = [u for u in manager.units() if u in changed and now[u].state in ACTIVE]
        if restart:
            manager.restart(restart)
        started = [u for u in manager.units() if now[u].state not in ACTIVE]
        manager.start([TARGET])
        return restart + started
