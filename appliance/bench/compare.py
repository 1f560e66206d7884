"""`pdctl bench --compare`: the same sweep against every deployment shape on the same GPUs.

Shapes (settings overrides on top of the user's settings; the planner checks each one; names in families.py):
- disagg-read:  the configured connector in READ mode (decode pulls the KV).
- disagg-write: the same connector in WRITE mode (prefill pushes); skipped where the connector has no write.
- disagg-read-conditional, disagg-write-conditional: the same with `[proxy] conditional_routing = true` (the
                planner's decode_only_below unless the settings set one): short prompts prefilled by the decode.
- disagg-...-mbtB: any of those with the decode instances' chunked-prefill budget max_num_batched_tokens = B
                (without: vLLM's default, whatever the settings say).
- colocated-N[-mbtB]: connector "none", the disaggregated plan's GPUs split into N identical instances
                behind the proxy's round-robin (colocated-2 on 8 GPUs: the reference's 2 x TP4), with
                chunked-prefill budget max_num_batched_tokens = B (default: vLLM's).
- colocated:    every N the GPUs allow x every --budgets value: the tuned baseline.
On a node without GPUs (the CPU and the simulated engine) the shapes are instance counts: 1 prefill +
1 decode, 2 or 1 colocated.

Each shape is brought up, measured and torn down before the next by `pdctl up` / `pdctl down`, so the
service manager runs it as in production: the manager `pdctl up` would pick, or (`--deploy processes`) a
supervisord that pdctl starts itself, for machines whose service manager pdctl may not use. Each shape is
deployed exactly as it says: its `pdctl up` has --ignore-layout, so the layout a rebalance recorded
(layout.json) neither reshapes it nor is lost; the node's next plain `pdctl up` applies it again.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import tomli_w

from appliance.bench.families import DEFAULT_BUDGETS, ShapeName, expand, parse_budgets, parse_name
from appliance.connector import Connector, disaggregated_name, get_connector, resolve_name
from appliance.errors import PdctlError, PlanError
from appliance.inventory.models import Inventory
from appliance.model_config import Heads, read_heads
from appliance.plan import Plan, _usable, plan, platform_of
from appliance.roles import Mode, parse_mode
from appliance.settings import EMBEDDED_MODEL, Settings, deep_merge

DEFAULT_SHAPES = "disagg-read,disagg-write,colocated"


@dataclass(frozen=True)
class Shape:
    """One deployment shape: a name, what it is, and the settings overrides that make it."""

    name: str
    description: str
    overrides: dict[str, Any] = field(default_factory=dict)
    skipped: str | None = None


def colocated_counts(gpus: list[int], heads: Heads | None) -> list[int]:
    """Colocated instance counts over these GPUs, most instances first: each a power-of-two TP that
    divides them and the model can take (`heads`); without GPUs, instance counts 2 and 1."""
    if not gpus:
        return [2, 1]
    n = len(gpus)
    return [n // tp for tp in (1, 2, 4, 8) if tp <= n and n % tp == 0 and (heads is None or heads.tp_problem(tp) is None)]


def shapes(
    settings: Settings,
    inventory: Inventory,
    wanted: list[str] | None = None,
    budgets: list[int | None] | None = None,
) -> list[Shape]:
    """The comparison's shapes for these settings on this inventory (skipped ones carry the reason).

    `wanted`: shape names (families.py), `colocated` standing for every instance count x `budgets`."""
    platform = platform_of(inventory)
    connector = resolve_name(disaggregated_name(settings.connector.name), platform)
    disagg = {"connector": {"name": connector, "mode": "read"}}
    try:
        base = plan(_with(settings, disagg), inventory)
        gpus = sorted(g for inst in base.instances for g in inst.gpus)
        unsplittable = None
    except PlanError as exc:
        # A node the planner cannot split (one GPU) still compares its colocated shapes, on every usable GPU.
        gpus, unsplittable = [g.index for g in inventory.gpus if _usable(g)], f"the planner refuses it: {exc}"
    where = f"GPUs {gpus[0]}-{gpus[-1]}" if gpus else "no GPUs: instance counts"
    heads = None if settings.model.path == EMBEDDED_MODEL else read_heads(settings.model.path)
    names = expand(
        (wanted or DEFAULT_SHAPES.split(",")),
        colocated_counts(gpus, heads),
        budgets if budgets is not None else parse_budgets(DEFAULT_BUDGETS),
    )
    kv_connector = get_connector(connector)
    out = []
    for shape_name in names:
        parsed = parse_name(shape_name)
        assert parsed is not None  # expand() let only known names through
        if parsed.family == "disaggregated":
            mode = parse_mode(parsed.mode or "read")
            # No budget in the name: the decode engine's own default, whatever the settings file says (as colocated).
            overrides: dict[str, Any] = {"connector": {"name": connector, "mode": mode},
                                         "decode": {"max_num_batched_tokens": parsed.budget}}
            conditional = ""
            if parsed.conditional:
                overrides["proxy"] = {"conditional_routing": True}
                conditional = ", conditional routing"
            if parsed.budget:
                conditional += f", decode max_num_batched_tokens {parsed.budget}"
            shape = Shape(shape_name, f"disaggregated, {connector} {mode.upper()}{conditional} ({where})", overrides,
                          unsplittable or _missing_mode(kv_connector, mode))
            if shape.skipped is None and parsed.budget:  # a budget the planner may refuse (a CPU node's whole prefills)
                try:
                    shape_plan(settings, inventory, shape)
                except (PdctlError, ValueError) as exc:
                    shape = Shape(shape.name, shape.description, overrides, f"the planner refuses it: {exc}")
            out.append(shape)
        else:
            out.append(_colocated_shape(settings, inventory, parsed, gpus, where))
    return out


def _missing_mode(connector: Connector, mode: Mode) -> str | None:
    """Why `connector` cannot run this transfer mode (the connector's own check), or None when it can."""
    try:
        connector.check_mode(mode)
    except ValueError as exc:
        return str(exc)
    return None


def _colocated_shape(
    settings: Settings, inventory: Inventory, parsed: ShapeName, gpus: list[int], where: str
) -> Shape:
    """A colocated shape over the disaggregated plan's GPUs; skipped when the planner refuses it."""
    n = parsed.instances or 1
    # No budget in the name: the engine's own default, whatever the settings file says (None = unset).
    colocated: dict[str, Any] = {
        "gpus": gpus or None,
        "gpu_count": None,
        "tp": None,
        "instances": n,
        "max_num_batched_tokens": parsed.budget,
    }
    # round_robin: the reference's colocated baseline is identical instances behind a round-robin.
    overrides = {
        "connector": {"name": "none", "mode": "read"},
        "proxy": {"routing": "round_robin"},
        "colocated": colocated,
    }
    tp = f", TP{len(gpus) // n}" if gpus and len(gpus) % n == 0 else ""
    budget = f"max_num_batched_tokens {parsed.budget}" if parsed.budget else "vLLM's default batch budget"
    shape = Shape(parsed.name, f"colocated, {n} instance(s){tp} round-robin, {budget} ({where})", overrides)
    try:
        shape_plan(settings, inventory, shape)
    except (PdctlError, ValueError) as exc:
        return Shape(shape.name, shape.description, overrides, f"the planner refuses it: {exc}")
    return shape


def _with(settings: Settings, overrides: dict[str, Any]) -> Settings:
    return Settings.model_validate(deep_merge(settings.model_dump(), overrides))


def shape_plan(settings: Settings, inventory: Inventory, shape: Shape) -> tuple[Settings, Plan]:
    """The settings and plan of one shape."""
    shaped = _with(settings, shape.overrides)
    return shaped, plan(shaped, inventory)


def _drop_none(data: dict[str, Any]) -> dict[str, Any]:
    """TOML has no null: a None override means "back to the default", i.e. the key is left out."""
    return {k: _drop_none(v) if isinstance(v, dict) else v for k, v in data.items() if v is not None}


def to_toml(settings: Settings) -> str:
    """The settings as a settings file that reads back as the same settings."""
    return tomli_w.dumps(_drop_none(settings.model_dump(mode="json")))


async def wait_ready(url: str, model: str, timeout_s: float) -> None:
    """Poll `url`/v1/models until it lists `model` and a one-token completion answers; PdctlError on timeout."""
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(url + "/v1/models") as resp:
                    if resp.status == 200 and model in json.dumps(await resp.json()):
                        body = {"model": model, "prompt": "ready", "max_tokens": 1}
                        async with session.post(url + "/v1/completions", json=body) as probe:
                            if probe.status == 200:
                                return
                            last = f"completion probe answered HTTP {probe.status}"
                    else:
                        last = f"/v1/models answered HTTP {resp.status}"
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                last = str(exc) or type(exc).__name__
            await asyncio.sleep(0.5)
    raise PdctlError(
        f"{url} was not ready after {timeout_s:.0f} s ({last})", fix="check `pdctl status` / logs"
    )


class PdctlDeployer:
    """Brings one shape up with `pdctl up` and takes it down with `pdctl down`, as subprocesses.

    The shape's effective settings go to a settings file in `work_dir`, passed with --config; `manager`
    (None: what `pdctl up` would pick) is passed as --manager.
    """

    def __init__(self, inventory_source: str | None, work_dir: Path, manager: str | None = None) -> None:
        self.inventory_source = inventory_source
        self.work_dir = work_dir
        self.manager = manager
        self._config: Path | None = None

    @staticmethod
    def _pdctl() -> list[str]:
        # The console script, not `python -m appliance`: `up` reports an unhealthy start by exit code only.
        script = Path(sys.executable).with_name("pdctl")
        if script.exists():
            return [str(script)]
        found = shutil.which("pdctl")
        if found is None:
            raise PdctlError(
                "the pdctl command is not on PATH", fix="install pdctl (its console script)"
            )
        return [found]

    def _run(self, verb: str, config: Path) -> None:
        argv = [*self._pdctl(), "--config", str(config)]
        if self.inventory_source:
            argv += ["--inventory", self.inventory_source]
        argv.append(verb)
        if verb == "up":
            # the shape as planned here, not reshaped by a rebalance's layout.json (which stays for the node)
            argv.append("--ignore-layout")
            if self.manager:
                argv += ["--manager", self.manager]
        done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        # `down` exits 3 when nothing was running (a failed `up` already stopped it): not a second failure
        # that would hide the first one.
        if done.returncode != 0 and not (verb == "down" and done.returncode == 3):
            tail = " | ".join(done.stdout.strip().splitlines()[-3:])
            raise PdctlError(f"`pdctl {verb}` failed (exit {done.returncode}): {tail}")

    async def up(self, settings: Settings, plan_: Plan, shape: Shape) -> str:
        """Start the shape; return the proxy's base URL once it serves."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self._config = self.work_dir / f"{shape.name}.toml"
        # The shape's whole effective settings (file, environment, flags, shape), so `up` plans what we planned.
        self._config.write_text(to_toml(settings))
        await asyncio.to_thread(self._run, "up", self._config)
        await wait_ready(plan_.proxy.url, plan_.model.served_name, settings.engine.health_timeout_s)
        return plan_.proxy.url

    async def down(self) -> None:
        """Stop whatever up() started (safe to call twice)."""
        if self._config is not None:
            config, self._config = self._config, None
            await asyncio.to_thread(self._run, "down", config)
