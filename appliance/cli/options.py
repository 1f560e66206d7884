"""The options commands share: the plan-shaping flags, and the settings, inventory and plan that the global
--config / --inventory options and those flags resolve to."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar, get_args

import click

from appliance.choices import ConnectorChoice
from appliance.errors import PdctlError
from appliance.inventory import Inventory, load_inventory
from appliance.machines import simulated_sources
from appliance.node import Node, layered, recorded_overrides
from appliance.nodelock import Holder, node_lock
from appliance.plan import Plan, plan
from appliance.role_shape import role_overrides
from appliance.roles import MODES
from appliance.settings import EngineKind, Settings, env_data, env_name, leaves, load_settings

if TYPE_CHECKING:
    from rich.console import Console

F = TypeVar("F", bound=Callable[..., Any])


# Wide enough for any table pdctl prints: piped output is read by people in logs and by grep, never cut.
PIPE_WIDTH = 1000


def console(stderr: bool = False) -> Console:
    """A rich console; on a pipe or a log (not a terminal, no $COLUMNS) tables and lines are never cut at 80."""
    from rich.console import Console  # `status --json` and other plain outputs never load rich

    stream = sys.stderr if stderr else sys.stdout
    wide = not stream.isatty() and "COLUMNS" not in os.environ
    return Console(stderr=stderr, width=PIPE_WIDTH if wide else None, emoji=False)


def confirm(question: str) -> None:
    """Ask `question` on the terminal; PdctlError (exit 2, nothing changed) when it is declined or cannot be asked
    (stdin is not a terminal: a script or a pipe must pass --yes)."""
    if not sys.stdin.isatty():
        raise PdctlError(f"cannot ask \"{question}\": stdin is not a terminal; nothing was changed",
                         fix="pass --yes to go ahead without asking")
    if not click.confirm(question, default=False):
        raise PdctlError("not confirmed; nothing was changed")


def plan_options(func: F) -> F:
    """The flags that reshape a plan without editing the settings file."""
    options = [
        click.option("--mode", type=click.Choice(MODES), help="KV transfer mode."),
        click.option("--connector", type=ConnectorChoice(allow_auto=True),
                     help="KV connector (none: colocated)."),
        click.option("--engine", type=click.Choice(get_args(EngineKind)), help="Real vLLM or the simulated engine."),
        click.option("--prefill-gpus", type=click.IntRange(min=1), help="Number of prefill GPUs (one instance)."),
        click.option("--decode-gpus", type=click.IntRange(min=1), help="Number of decode GPUs (one instance)."),
        click.option("--prefill", "prefill_set", metavar="SET|SHAPE",
                     help="Prefill GPUs (0,1 / 0-3) or shape (2xTP2, 2xTP2@0-3)."),
        click.option("--decode", "decode_set", metavar="SET|SHAPE",
                     help="Decode GPUs (4-7) or shape (1xTP4, 2xTP2@4-7)."),
        click.option("--inventory", "inventory_source", metavar="SOURCE",
                     help=f"Plan for another inventory: {simulated_sources()} or a JSON file."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def layout_option(func: F) -> F:
    """--ignore-layout, for the commands that apply what layout.json records (up, plan, doctor, export)."""
    return click.option(
        "--ignore-layout", is_flag=True,
        help="Plan from the settings and flags alone, without what `pdctl rebalance` / `pdctl mode` recorded (layout.json "
             "stays, in force for the next command without this flag). `bench --compare` deploys its shapes so.",
    )(func)


def node_overrides(node: Node, options: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The plan flags' overrides over what layout.json records (unless --ignore-layout), and one line saying what
    of it was applied or ignored (None when there is none). A flag or PDCTL_* variable always wins over a record."""
    overrides = overrides_from(options)
    recorded = node.recorded()
    if not recorded.overrides:
        return overrides, None
    where = f"{node.state.layout} ({recorded.writers()})"
    if options.get("ignore_layout"):
        return overrides, f"{where} ignored (--ignore-layout); in force without it"
    explicit = {key: env_name(key) for key in leaves(env_data())} | flag_origins(options)
    name = options.get("connector") or node.settings.connector.name
    kept, ignored = recorded_overrides(recorded, explicit, name)
    applied = (f"{where} applied over the settings (--ignore-layout leaves it out; `pdctl rebalance --reset` drops "
               "its shapes)") if kept else f"{where} not applied"
    given_up = f"; explicit settings win over {'; '.join(ignored)}" if ignored else ""
    return layered(kept, overrides), applied + given_up


def _shape(p: Plan) -> list[str]:
    return [f"{i.name} GPUs {i.gpus} TP{i.tp} DP{i.dp}" for i in p.instances]


def plan_differences(deployed: Plan, planned: Plan) -> list[str]:
    """What the plan `planned` changes of the `deployed` one, in a few words each (empty: the same node)."""
    words = [f"{what} {getattr(planned, what)} (deployed: {getattr(deployed, what)})"
             for what in ("connector", "mode", "engine") if getattr(planned, what) != getattr(deployed, what)]
    if _shape(planned) != _shape(deployed):
        words.append(f"instances {', '.join(_shape(planned))} (deployed: {', '.join(_shape(deployed))})")
    return words


def deployed_note(node: Node, planned: Plan) -> str | None:
    """One line when `planned` is not what the node runs (e.g. after `pdctl up --ignore-layout`, or with other
    flags or settings), so that a command describing `planned` says plainly that it describes another node."""
    try:
        deployed = node.installed()
    except PdctlError:
        return None
    changes = plan_differences(deployed, planned) if deployed is not None else []
    if not changes:
        return None
    return (f"not the deployed plan: this one has {'; '.join(changes)}. `pdctl status` describes what is deployed; "
            "`pdctl up` (with these flags) would deploy this one")


def overrides_from(options: dict[str, Any]) -> dict[str, Any]:
    """Settings overrides from the plan flags that were given."""
    out: dict[str, Any] = {}

    def put(section: str, key: str, value: Any) -> None:
        out.setdefault(section, {})[key] = value

    if options.get("mode"):
        put("connector", "mode", options["mode"])
    if options.get("connector"):
        put("connector", "name", options["connector"])
    if options.get("engine"):
        put("engine", "kind", options["engine"])
    roles = role_overrides(options)
    env = env_data() if roles else {}
    for role, values in roles.items():
        if values.get("tp") is None:
            # A GPU set or count leaves the shape to the planner, except what PDCTL_<ROLE>__* sets explicitly:
            # that is kept, and the planner refuses it (naming both) when these GPUs cannot honour it.
            for key in ("instances", "tp", "dp"):
                if key in env.get(role, {}):
                    values.pop(key, None)
    out.update(roles)
    return out


# Plan flag -> the setting it overrides, so an error about that setting names the flag.
_FLAG_SETTINGS = {"mode": "connector.mode", "connector": "connector.name", "engine": "engine.kind",
                  "prefill_gpus": "prefill", "decode_gpus": "decode", "prefill_set": "prefill", "decode_set": "decode"}


def flag_origins(options: dict[str, Any]) -> dict[str, str]:
    """Dotted setting -> the flag that set it ("decode" -> "--decode 4-7"), for errors that name their source."""
    out: dict[str, str] = {}
    for param, key in _FLAG_SETTINGS.items():
        if options.get(param):
            flag = "--" + param.removesuffix("_set").replace("_", "-")
            out[key] = f"{flag} {options[param]}"
    return out


def obtain(ctx: click.Context, overrides: dict[str, Any] | None = None) -> tuple[Settings, Inventory]:
    """Settings and inventory from the global --config / --inventory options (a command's --inventory wins)."""
    obj = ctx.find_root().obj or {}
    settings = load_settings(obj.get("config_path"), overrides, flag_origins(ctx.params))
    if settings.engine.kind == "vllm" and not settings.engine.vllm_package:
        # The plan depends on the engine's vLLM (its server command, MoRIIO's port rule): ask its Python.
        from appliance.engine.version import vllm_package

        settings.engine.vllm_package = vllm_package(settings.engine.python or sys.executable) or ""
    inventory = load_inventory(ctx.params.get("inventory_source") or obj.get("inventory_source"))
    return settings, inventory


def obtain_plan(ctx: click.Context, overrides: dict[str, Any] | None = None) -> tuple[Settings, Inventory, Plan]:
    """Settings, inventory and the plan they make."""
    settings, inventory = obtain(ctx, overrides)
    return settings, inventory, plan(settings, inventory)


@contextlib.contextmanager
def locked(settings: Settings, verb: str, *, create: bool = False) -> Iterator[Holder]:
    """Hold the node lock for `pdctl <verb>` (a mutating command); while another command holds it, say which
    (command and pid) on stderr and wait for it. `create` makes a missing state directory (`pdctl up`)."""
    node = Node(settings)

    def waiting(other: Holder | None) -> None:
        who = str(other) if other else "another pdctl command"
        click.echo(f"pdctl: waiting for {who}, which holds the node lock on {node.state.root} (Ctrl-C to give up)",
                   err=True)

    with node_lock(node.state, f"pdctl {verb}", waiting, create=create) as me:
        yield me


def mutating(verb: str) -> Callable[[F], F]:
    """A command (after click.pass_context) that changes the node: it runs holding the node lock (`locked`)."""

    def wrap(func: F) -> F:
        @functools.wraps(func)
        def run(ctx: click.Context, /, *args: Any, **kwargs: Any) -> Any:
            settings = load_settings((ctx.find_root().obj or {}).get("config_path"))
            with locked(settings, verb):
                return func(ctx, *args, **kwargs)

        return run  # type: ignore[return-value]

    return wrap
