"""What both renderers build from: their options, the unit templates, the command lines of the proxy
and of the health wait, and the secret/plain environment split."""

from __future__ import annotations

import re
import string
import sys
from dataclasses import dataclass, field
from importlib import resources

from appliance.errors import PdctlError
from appliance.plan import Plan
from appliance.statedir import StateDir

# Variables whose names look like credentials never go into a unit file or the command line: a credential
# word ending the name or one of its _-separated parts (HF_TOKEN, AWS_SECRET_ACCESS_KEY, OPENAI_API_KEY,
# MYTOKEN), not a word that merely starts another (TOKENIZERS_PARALLELISM, which pdctl sets itself).
_SECRET = re.compile(r"(KEYS?|TOKENS?|SECRETS?|PASSWORDS?|PASSWD|CREDENTIALS?)(_|$)", re.IGNORECASE)


@dataclass(frozen=True)
class RenderedFile:
    """One file a renderer produced: its name relative to the target directory, its text and file mode."""

    name: str
    text: str
    mode: int = 0o644


@dataclass(frozen=True)
class RenderOptions:
    """What a renderer needs beyond the plan: where pdctl's Python is and how long engines may load."""

    python: str = field(default_factory=lambda: sys.executable)
    health_timeout_s: float = 1800.0
    proxy_ready_timeout_s: float = 60.0
    minfds: int = 65536
    restart_drain_s: float = 30.0  # planned stops (the engine units' ExecStop hook): drain, then hold
    restart_hold_s: float = 120.0


def proxy_argv(plan: Plan, opts: RenderOptions) -> list[str]:
    """The proxy's command line: pdctl's Python running the proxy's keeper (which holds the listening sockets
    and runs appliance.proxy on them: SIGHUP hands them to a new proxy) on the state directory's proxy.json."""
    return [opts.python, "-m", "appliance.proxy.keeper", "--config", str(StateDir.at(plan.state_dir).proxy_config)]


def ready_argv(opts: RenderOptions, url: str, timeout_s: float, any_answer: bool = False) -> list[str]:
    """`pdctl wait-healthy`'s command line: wait until `url` answers 200 (or anything, with any_answer)."""
    argv = [opts.python, "-m", "appliance", "wait-healthy", url, "--timeout", f"{timeout_s:g}"]
    return argv + (["--any-answer"] if any_answer else [])


def secret_env(env: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """Split an environment into (plain, secret): secrets go to a 0600 file, never into the unit text."""
    plain = {k: v for k, v in env.items() if not _SECRET.search(k)}
    secret = {k: v for k, v in env.items() if _SECRET.search(k)}
    return plain, secret


def check_env_name(name: str) -> None:
    """Environment names must be portable identifiers; anything else is a settings mistake."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise PdctlError(f"environment variable name {name!r} is not valid", fix="use letters, digits and _")


def template(name: str) -> string.Template:
    """One unit template ($name placeholders), shipped inside the package in appliance/data/units/."""
    path = resources.files("appliance") / "data" / "units" / name
    try:
        return string.Template(path.read_text())
    except FileNotFoundError:
        raise PdctlError(f"the unit template {name} is missing from the installed pdctl ({path})",
                         fix="reinstall pdctl (pip install, or install.sh)") from None
