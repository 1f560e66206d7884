"""Plan -> supervisord.conf: one [program:] per instance (named like the systemd units) plus pd-proxy,
all in [group:pd], controlled over the unix socket in <state_dir>/supervisor/, and the pd-reaper event
listener (appliance.manager.supervisor_reaper) that ends what a program left behind when it ended by itself.

What supervisor cannot express is left to pdctl: it starts supervisord with RLIMIT_MEMLOCK raised (the
programs inherit it) and gates `pdctl up`/`restart` on each engine's /health.
"""

from __future__ import annotations

import hashlib
import shlex
import tempfile
from pathlib import PurePosixPath

from appliance.errors import PdctlError
from appliance.plan import Plan
from appliance.render.names import PROXY_UNIT, instance_unit, services
from appliance.render.templates import RenderedFile, RenderOptions, check_env_name, proxy_argv, template
from appliance.statedir import StateDir

CONF_NAME = "supervisord.conf"
_ROLE_RANK = {"prefill": 0, "both": 0, "decode": 1}
SOCKET_NAME = "supervisor.sock"
REAPER = "pd-reaper"


def socket_path(plan_state_dir: str) -> PurePosixPath:
    """supervisord's unix socket: in the state dir, unless that path is too long for AF_UNIX (108 bytes)."""
    path = StateDir.at(plan_state_dir).supervisor / SOCKET_NAME
    if len(str(path).encode()) <= 100:
        return path
    digest = hashlib.sha256(plan_state_dir.encode()).hexdigest()[:16]
    return PurePosixPath(tempfile.gettempdir()) / f"pdctl-{digest}" / SOCKET_NAME


def _value(text: str, what: str) -> str:
    """A config value: one line, % doubled (supervisor expands %(name)s in values)."""
    if "\n" in text or "\r" in text:
        raise PdctlError(f"{what} cannot span lines in supervisord.conf: {text!r}")
    return text.replace("%", "%%")


def command_value(argv: list[str]) -> str:
    """A command= value: supervisor splits it like a POSIX shell, after %-expansion."""
    return _value(shlex.join(argv), "a command argument")


def environment_value(env: dict[str, str]) -> str:
    """An environment= value: KEY="v",KEY2='v' (supervisor's lexer keeps quotes and strips them after)."""
    # the errors name the variable, never its value: it may be a secret (HF_TOKEN), and they reach terminals and logs
    pairs = []
    for name, value in sorted(env.items()):
        check_env_name(name)
        if value[:1] in "'\"" and value or value[-1:] in ("'", '"'):
            raise PdctlError(f"{name}: supervisor cannot carry a value that starts or ends with a quote")
        if "\n" in value or "\r" in value:
            raise PdctlError(f"{name}: an environment value cannot span lines in supervisord.conf")
        if '"' not in value:
            quoted = f'"{value}"'
        elif "'" not in value:
            quoted = f"'{value}'"
        else:
            raise PdctlError(f"{name}: supervisor cannot carry a value holding both quote kinds")
        pairs.append(f"{name}={quoted}")
    return _value(",".join(pairs), "an environment value")


def _program(name: str, argv: list[str], env: dict[str, str], workdir: str, logdir: PurePosixPath,
             priority: int, stopwaitsecs: int, stopsignal: str = "TERM") -> str:
    environment = f"environment={environment_value(env)}\n" if env else ""
    return template("supervisor-program.conf.in").substitute(
        name=name,
        command=command_value(argv),
        environment=environment,
        workdir=_value(workdir, "state_dir"),
        priority=priority,
        stopwaitsecs=stopwaitsecs,
        stopsignal=stopsignal,
        logfile=_log_value(logdir, name),
    )


def _log_value(logdir: PurePosixPath, name: str) -> str:
    """A log file value: supervisor %-expands log file names twice (the section value, then with process_num)."""
    return _value(_value(str(logdir / f"{name}.log"), "log file"), "log file")


def _reaper_argv(plan: Plan, opts: RenderOptions) -> list[str]:
    """pd-reaper's command: it reports an engine that ended by itself to the proxy, as a systemd engine unit's
    ExecStop hook does (a hold bounded as a planned stop's: drain + start timeout)."""
    argv = [opts.python, "-m", "appliance.manager.supervisor_reaper", "--admin", plan.proxy.admin_url,
            "--hold", f"{opts.restart_hold_s:g}", "--expires", f"{opts.restart_drain_s + opts.health_timeout_s + 60:g}"]
    if plan.proxy.admin.token_file:
        argv += ["--token-file", plan.proxy.admin.token_file]
    return argv


def render_supervisor(plan: Plan, opts: RenderOptions | None = None) -> list[RenderedFile]:
    """supervisord.conf for the plan (mode 0600: environments may hold secrets)."""
    opts = opts or RenderOptions()
    state = StateDir.at(plan.state_dir)
    sdir = state.supervisor
    logdir = state.supervisor_logs
    programs: list[str] = []
    names: list[str] = []
    for service in services(plan):
        for inst in (i for i in plan.instances if i.service == service):
            name = instance_unit(inst)
            names.append(name)
            # By role, not by position: a plan without a role (mid-rebalance) must not change the others' config.
            priority = 100 + _ROLE_RANK[inst.role]
            programs.append(_program(name, inst.argv, inst.env, plan.state_dir, logdir, priority, 60))
    names.append(PROXY_UNIT)
    # supervisord stops the keeper with SIGINT: a SIGTERM from anyone else is an end it restarts the keeper after,
    # through which the proxy serves on (appliance.proxy.keeper)
    keeper = [*proxy_argv(plan, opts), "--stop-signal", "INT"]
    programs.append(_program(PROXY_UNIT, keeper, {}, plan.state_dir, logdir, 900, 30, stopsignal="INT"))
    text = template("supervisord.conf.in").substitute(
        layout=plan.layout,
        connector=plan.connector,
        mode=plan.mode,
        socket=_value(str(socket_path(plan.state_dir)), "socket path"),
        dir=_value(str(sdir), "state_dir"),
        minfds=opts.minfds,
        programs="".join(programs),
        program_names=",".join(names),
        reaper=REAPER,
        reaper_command=command_value(_reaper_argv(plan, opts)),
        reaper_log=_log_value(logdir, REAPER),
        workdir=_value(plan.state_dir, "state_dir"),
    )
    return [RenderedFile(CONF_NAME, text, 0o600)]
