"""Plan -> systemd units: pd.target, one group unit per role, one unit per engine instance, pd-proxy.

Readiness: each engine unit is Type=exec with an ExecStartPost that waits for the engine's /health
(`pdctl wait-healthy`), so `systemctl start/restart` returns, and pd-proxy (After=) starts, only once the
engine answers. The group unit of a role (pd-decode.service) Wants= and is After= its instances, which are
PartOf= it: `systemctl restart pd-decode` restarts every decode instance and returns when all are healthy.
"""

from __future__ import annotations

import re

from appliance.errors import PdctlError
from appliance.plan import Instance, Plan
from appliance.render.names import PROXY_UNIT, instance_unit, role_of_service, services
from appliance.render.templates import (
    RenderedFile,
    RenderOptions,
    check_env_name,
    proxy_argv,
    ready_argv,
    secret_env,
    template,
)
from appliance.statedir import StateDir

_PLAIN = re.compile(r"[A-Za-z0-9_@%+=:,./-]+")
_C_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\t": "\\t", "\r": "\\r"}


class Rendered:
    """The units (for the unit directory) and the private files (relative to the state dir, mode 0600)."""

    def __init__(self, units: list[RenderedFile], private: list[RenderedFile]) -> None:
        self.units = units
        self.private = private


def specifiers(text: str) -> str:
    """Protect text from systemd's specifier expansion (%n, %i, ...): every % becomes %%."""
    return text.replace("%", "%%")


def _c_quote(text: str) -> str:
    out = []
    for ch in text:
        if ch in _C_ESCAPES:
            out.append(_C_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def exec_word(arg: str) -> str:
    """One Exec*= argument as systemd reads it back verbatim: quoted, C-escaped, % as %%, $ as $$."""
    if arg == ";":
        return "\\;"  # a lone ; would separate commands
    escaped = specifiers(arg).replace("$", "$$")
    if escaped and _PLAIN.fullmatch(escaped):
        return escaped
    return _c_quote(escaped)


def exec_line(argv: list[str]) -> str:
    """A whole command line for ExecStart=; the program must be an absolute path."""
    if not argv or not argv[0].startswith("/"):
        raise PdctlError(
            f"the engine command must start with an absolute path, got {argv[:1]}",
            fix="set engine.python to the absolute path of the Python that has vLLM",
        )
    return " ".join(exec_word(a) for a in argv)


def environment_line(name: str, value: str) -> str:
    """One Environment= assignment: quoted and C-escaped; % as %% ($ has no meaning there)."""
    check_env_name(name)
    return "Environment=" + _c_quote(specifiers(f"{name}={value}"))


def env_file_text(env: dict[str, str]) -> str:
    """An EnvironmentFile= body: single quotes keep a value literal; double quotes when it has one."""
    lines = ["# Secrets for one pdctl unit (mode 0600). Rendered by pdctl; do not edit."]
    for name, value in sorted(env.items()):
        check_env_name(name)
        if "'" not in value:
            lines.append(f"{name}='{value}'")
        else:
            escaped = "".join("\\" + c if c in '\\"$`' else c for c in value)
            lines.append(f'{name}="{escaped}"')
    return "\n".join(lines) + "\n"


def _path_value(path: str, what: str) -> str:
    if "\n" in path or not path.startswith("/"):
        raise PdctlError(f"{what} must be an absolute path on one line, got {path!r}")
    return specifiers(path)


def _notify_argv(plan: Plan, inst: Instance, opts: RenderOptions, event: str) -> list[str]:
    """`pdctl proxy-notify` for the unit's stop and start hooks (it never fails the unit)."""
    argv = [opts.python, "-m", "appliance", "proxy-notify", event, inst.name, "--admin", plan.proxy.admin_url]
    if plan.proxy.admin.token_file:
        argv += ["--token-file", plan.proxy.admin.token_file]
    if event in ("stopping", "stopped"):
        # the planned stop lapses by itself once the instance had the time to drain and start again
        expires = opts.restart_drain_s + opts.health_timeout_s + 60
        argv += ["--drain-timeout", f"{opts.restart_drain_s:g}", "--hold", f"{opts.restart_hold_s:g}",
                 "--expires", f"{expires:g}"]
    return argv


def _engine_unit(plan: Plan, inst: Instance, opts: RenderOptions) -> tuple[RenderedFile, RenderedFile | None]:
    unit = instance_unit(inst)
    plain, secret = secret_env(inst.env)
    state = StateDir.at(plan.state_dir)
    env_file = str(state.env_file(unit))
    environment = "".join(environment_line(k, v) + "\n" for k, v in sorted(plain.items()))
    gpus = ",".join(map(str, inst.gpus)) or "cpu"
    text = template("pd-engine.service.in").substitute(
        name=inst.name,
        role=inst.role,
        gpus=gpus,
        port=inst.http_port,
        service=inst.service,
        unit=unit,
        environment=environment,
        env_file=_path_value(env_file, "the environment file"),
        workdir=_path_value(plan.state_dir, "state_dir"),
        exec_start=exec_line(inst.argv),
        exec_ready=exec_line(ready_argv(opts, inst.url + "/health", opts.health_timeout_s)),
        exec_started=exec_line(_notify_argv(plan, inst, opts, "started")),
        exec_stopping=exec_line(_notify_argv(plan, inst, opts, "stopping")),
        exec_stopped=exec_line(_notify_argv(plan, inst, opts, "stopped")),
        # ExecStartPost counts against TimeoutStartSec: leave the health wait room to report first.
        start_timeout=f"{int(opts.health_timeout_s) + 60}s",
        # ExecStop (the drain) and then the engine's own graceful exit each get this long
        stop_timeout=f"{int(opts.restart_drain_s) + 60}s",
    )
    private = RenderedFile(str(state.env_file(unit).relative_to(state.root)), env_file_text(secret), 0o600) if secret else None
    return RenderedFile(f"{unit}.service", text), private


def render_systemd(plan: Plan, opts: RenderOptions | None = None) -> Rendered:
    """Every unit of the plan, plus 0600 environment files for instances whose env holds secrets."""
    opts = opts or RenderOptions()
    units: list[RenderedFile] = []
    private: list[RenderedFile] = []
    groups = services(plan)
    for service in groups:
        members = role_of_service(plan, service)
        names = " ".join(f"{instance_unit(i)}.service" for i in members)
        text = template("pd-role.service.in").substitute(
            role=members[0].role,
            service=service,
            instances=", ".join(i.name for i in members),
            units=names,
        )
        units.append(RenderedFile(f"{service}.service", text))
        for inst in members:
            unit_file, secret_file = _engine_unit(plan, inst, opts)
            units.append(unit_file)
            if secret_file:
                private.append(secret_file)
    engines = " ".join(f"{s}.service" for s in groups)
    admin = f"{plan.proxy.admin_url}/admin/state"
    units.append(
        RenderedFile(
            f"{PROXY_UNIT}.service",
            template("pd-proxy.service.in").substitute(
                address=specifiers(plan.proxy.url),
                connector=plan.connector,
                mode=plan.mode,
                engines=engines,
                env_file=_path_value(str(StateDir.at(plan.state_dir).env_file(PROXY_UNIT)), "env file"),
                workdir=_path_value(plan.state_dir, "state_dir"),
                exec_start=exec_line(proxy_argv(plan, opts)),
                # The admin API answers as soon as the proxy listens, whatever the engines' health.
                exec_ready=exec_line(ready_argv(opts, admin, opts.proxy_ready_timeout_s, any_answer=True)),
                # the keeper's listening sockets, one API socket a worker and the admin's, and its state file
                fdstore=plan.proxy.workers + 2,
            ),
        )
    )
    units.append(
        RenderedFile(
            "pd.target",
            template("pd.target.in").substitute(
                layout=plan.layout,
                connector=plan.connector,
                mode=plan.mode,
                wants=" ".join([*(f"{s}.service" for s in groups), f"{PROXY_UNIT}.service"]),
            ),
        )
    )
    return Rendered(units, private)
