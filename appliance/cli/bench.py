"""`pdctl bench`: goodput sweeps against the running deployment, a URL, or every deployment shape (--compare)."""

from __future__ import annotations

import asyncio
import shlex
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

import click

from appliance.cli.options import console as cli_console
from appliance.cli.options import obtain
from appliance.errors import PdctlError
from appliance.hosts import url_host
from appliance.proxy.config import read_secret
from appliance.settings import EngineKind
from appliance.statedir import StateDir

# exit code of a run that measured nothing: every request failed (as `pdctl status` says 1 for a failed node)
EXIT_NOTHING_MEASURED = 1

if TYPE_CHECKING:  # the bench modules load lazily: `pdctl --help` stays fast

    import aiohttp

    from appliance.bench.analysis import Slo
    from appliance.bench.compare import Shape
    from appliance.bench.mixes import Mix
    from appliance.bench.results import BenchResult
    from appliance.bench.sweep import SweepPlan
    from appliance.bench.trace import WorkloadFile
    from appliance.inventory.models import Inventory
    from appliance.model_config import Vocabulary
    from appliance.settings import Settings


@click.command()
@click.option("--url", help="Benchmark this OpenAI-compatible server instead of the deployment's proxy.")
@click.option("--compare", is_flag=True, help="Bring up each deployment shape in turn and sweep it.")
@click.option(
    "--shapes",
    default="disagg-read,disagg-write,colocated",
    show_default=True,
    help="With --compare: which shapes, in order: disagg-read, disagg-write (each also -conditional: conditional "
    "routing on), colocated-N[-mbtB] (N instances, max_num_batched_tokens B), colocated (every N the GPUs allow x "
    "every --budgets value).",
)
@click.option(
    "--budgets",
    default="256,512,2048",
    show_default=True,
    help="With --compare: the chunked-prefill budgets (max_num_batched_tokens) of the colocated shapes; "
    "'default' = vLLM's own.",
)
@click.option(
    "--deploy",
    type=click.Choice(["pdctl", "processes"]),
    default="pdctl",
    show_default=True,
    help="With --compare: `pdctl up/down` with the host's service manager, or with a supervisord pdctl starts.",
)
@click.option(
    "--engine",
    type=click.Choice(get_args(EngineKind)),
    help="Engine kind: with --compare, what to deploy; with --url, how to label the result.",
)
@click.option(
    "--rates",
    default="auto",
    show_default=True,
    help="auto[:START[:MAX]] (x2 up to the ceiling, then bisection) or START:STOP:STEP or a list, in req/s.",
)
@click.option(
    "--stop-on",
    type=click.Choice(["all", "run", "none"]),
    default="all",
    show_default=True,
    help="End a shape's sweep at its first rate under the attainment target under every judgement (all), "
    "the run's judgement (run), or never (none: every listed rate).",
)
@click.option(
    "--resolution",
    type=click.FloatRange(min=0.01),
    default=0.25,
    show_default=True,
    help="With --rates auto: bisect each ceiling until the last passing and first failing rate are this close "
    "(0.25: within 25 %).",
)
@click.option(
    "--num-requests",
    "-n",
    type=click.IntRange(min=1),
    default=50,
    show_default=True,
    help="Requests per rate; with --lifetimes > 0 the fewest measured (the window grows to hold them).",
)
@click.option(
    "--lifetimes",
    type=click.FloatRange(min=0),
    default=3,
    show_default=True,
    help="Steady state: judge only arrivals in a window this many request lifetimes long, after one "
    "lifetime of warm-up and before one of drain (0: every request, no window). See docs/bench.md.",
)
@click.option(
    "--max-requests",
    type=click.IntRange(min=1),
    default=5000,
    show_default=True,
    help="Most requests one rate sends (warm-up and drain included); a capped window is shorter.",
)
@click.option(
    "--input-len", type=click.IntRange(min=1), default=2000, show_default=True, help="Prompt tokens."
)
@click.option(
    "--output-len",
    type=click.IntRange(min=1),
    default=1000,
    show_default=True,
    help="Output tokens (ignore_eos: every request generates exactly this many).",
)
@click.option(
    "--prompt",
    "prompt_kind",
    type=click.Choice(["tokens", "words"]),
    default="tokens",
    show_default=True,
    help="Random token ids (exact lengths) or random words (servers that need text).",
)
@click.option(
    "--token-range",
    metavar="LO:HI",
    help="Token ids are drawn from LO <= id < HI [default: 100:1000, cut to the served model's vocabulary].",
)
@click.option(
    "--workload",
    metavar="FILE|MIX",
    help="Send a workload instead of --input-len random tokens: a JSONL file (its arrival times, or --rates) or a "
    "built-in mix, shared-prefix | multi-turn | mixed-lengths[:key=value,...]. See docs/bench.md.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Run seed; each rate derives its own.")
@click.option("--model", help="Model name to ask for [default: the deployment's, or the server's first].")
@click.option("--api-key-file", type=click.Path(dir_okay=False), help="Send this key as a Bearer token.")
@click.option(
    "--ttft-ms", type=click.FloatRange(min=0, min_open=True), help="TTFT target [settings slo.ttft_ms]."
)
@click.option(
    "--itl-ms", type=click.FloatRange(min=0, min_open=True), help="ITL target [settings slo.itl_ms]."
)
@click.option(
    "--itl-judgement",
    type=click.Choice(["p99", "max", "mean"]),
    help="How a request's ITL is judged: p99 of its gaps, its max gap, or its mean gap (= vLLM TPOT) "
    "[settings slo.itl_judgement, default p99].",
)
@click.option(
    "--attainment",
    type=click.FloatRange(min=0, max=1, min_open=True),
    help="Attainment target for goodput [settings slo.attainment, default 0.9].",
)
@click.option(
    "--request-timeout",
    type=click.FloatRange(min=1),
    default=600,
    show_default=True,
    help="Seconds a request may go without a byte before it counts as failed.",
)
@click.option(
    "--out", "out_dir", type=click.Path(file_okay=False), help="Output folder [default: bench-<time>]."
)
@click.option("--plots/--no-plots", default=True, show_default=True, help="Write the PNG figures.")
@click.option(
    "--plot-rate", type=float, help="Rate of the latency-distribution figure [highest common rate]."
)
@click.option(
    "--inventory", "inventory_source", metavar="SOURCE", help="Inventory for --compare (sim:cpu, ...)."
)
@click.option(
    "--from-json",
    "from_json",
    type=click.Path(dir_okay=False),
    multiple=True,
    help="Measure nothing: print the tables and draw the figures of earlier bench.json files "
    "(repeat it to merge the shapes of several runs into one comparison).",
)
@click.option(
    "--warmup",
    type=click.IntRange(min=0),
    default=1,
    show_default=True,
    help="Unrecorded short requests before each shape's first rate (KV-connector handshakes, compilation).",
)
@click.option(
    "--label",
    default="target",
    show_default=True,
    help="Shape name of a --url sweep in the result (e.g. disagg-read when each shape is swept separately).",
)
@click.pass_context
def bench(ctx: click.Context, /, **opts: Any) -> None:
    """Sweep request rates with Poisson arrivals and report SLO attainment, latencies and goodput."""
    from appliance.bench.workload import parse_token_range

    if opts["from_json"]:
        _replay([Path(p) for p in opts["from_json"]], opts)
        return
    if opts["plots"]:
        from appliance.bench.plots import require_matplotlib

        require_matplotlib()  # no matplotlib: say so before measuring, not after
    if opts["url"] and opts["compare"]:
        raise PdctlError("--url and --compare both given", fix="--compare deploys its own shapes; drop --url")
    if opts["token_range"] is not None:
        parse_token_range(opts["token_range"])  # a malformed range fails before anything is deployed
    workload = _workload(ctx, opts)  # so does a bad workload file, with its line number
    overrides: dict[str, Any] = {"engine": {"kind": opts["engine"]}} if opts["engine"] else {}
    settings, inventory = obtain(ctx, overrides)
    slo = _slo(opts, settings)
    api_key = read_secret(opts["api_key_file"]) or read_secret(settings.proxy.api_key_file if not opts["url"] else None)
    if api_key is None and settings.proxy.api_keys_file and not opts["url"]:
        # the keys file names one key per client: which one the bench sends is the operator's choice
        raise click.UsageError(f"the node's API takes the keys of {settings.proxy.api_keys_file}: pass the one to "
                               "send with --api-key-file")
    stamp = datetime.now(timezone.utc)
    out_dir = Path(opts["out_dir"] or f"bench-{stamp:%Y%m%d-%H%M%S}")
    out_dir.mkdir(parents=True, exist_ok=True)
    sweep = _sweep_plan(opts, slo)
    work = _Workload(sweep, slo, opts["token_range"], api_key, workload)
    result = asyncio.run(_measure(ctx, opts, settings, inventory, work, stamp, out_dir))
    _report(result, opts, out_dir)


@dataclass(frozen=True)
class _Workload:
    """What every shape is measured with: the sweep, the SLO, the prompt tokens' range (as given, or None)
    and the API key."""

    sweep: SweepPlan
    slo: Slo
    token_range: str | None
    api_key: str | None
    requests: WorkloadFile | Mix | None = None


def _slo(opts: dict[str, Any], settings: Settings) -> Slo:
    """The SLO: the command line's targets over the settings'."""
    from appliance.bench.analysis import Slo

    s = settings.slo
    return Slo(
        ttft_ms=opts["ttft_ms"] or s.ttft_ms,
        itl_ms=opts["itl_ms"] or s.itl_ms,
        itl_judgement=opts["itl_judgement"] or s.itl_judgement,
        attainment=opts["attainment"] or s.attainment,
    )


def _empty_result(opts: dict[str, Any], work: _Workload, engine: str, model: str, stamp: datetime,
                  token_range: tuple[int, int]) -> BenchResult:
    """The result document before any shape is measured: the command, the workload and the SLO."""
    from appliance.bench.results import BenchResult, Workload
    from appliance.bench.trace import WorkloadFile

    plan = work.sweep
    return BenchResult(
        created=stamp.isoformat(timespec="seconds"),
        command=shlex.join(["pdctl", *sys.argv[1:]]),
        engine=engine,
        workload=Workload(
            model=model,
            input_len=opts["input_len"],
            output_len=opts["output_len"],
            num_requests=opts["num_requests"],
            rates=list(plan.schedule.rates),
            rate_spec=opts["rates"],
            seed=opts["seed"],
            prompt=opts["prompt_kind"],
            token_range=list(token_range) if opts["prompt_kind"] == "tokens" else None,
            warmup=opts["warmup"],
            lifetimes=plan.lifetimes,
            stop_on=list(plan.schedule.stop_on),
            workload=opts["workload"],
            arrivals="file" if isinstance(work.requests, WorkloadFile) and work.requests.timed else "poisson",
        ),
        slo=work.slo,
        shapes=[],
    )


async def _measure(ctx: click.Context, opts: dict[str, Any], settings: Settings, inventory: Inventory,
                   work: _Workload, stamp: datetime, out_dir: Path) -> BenchResult:
    """Sweep the --url (or the deployment's proxy), or with --compare every shape; what was measured so far
    when interrupted (first Ctrl-C)."""
    from click.core import ParameterSource

    from appliance.bench.compare import PdctlDeployer
    from appliance.bench.loadgen import Target, discover_model, model_root
    from appliance.bench.runner import run_compare, run_url
    from appliance.bench.sweep import Stopper
    from appliance.bench.workload import request_lengths
    from appliance.bench.workload import token_range as resolve_token_range

    if opts["compare"]:
        chosen = _chosen_shapes(settings, inventory, opts)
        base_url, model = "", opts["model"] or settings.model.name
        engine: str = settings.engine.kind
    else:
        base_url = opts["url"] or f"http://{url_host(settings.proxy.host)}:{settings.proxy.port}"
        engine = opts["engine"] or ("unknown" if opts["url"] else settings.engine.kind)
        model = opts["model"]
    console = cli_console(stderr=True)
    stopper = Stopper()
    with stopper.installed():
        import aiohttp

        async with aiohttp.ClientSession() as session:
            if model is None:
                model = await discover_model(session, base_url, work.api_key)
            # a --url server says where it loaded the model from (vLLM's `root`); pdctl's own engines, the settings
            loaded_from = await model_root(session, base_url, model, work.api_key) if opts["url"] else None
            context = await _context(session, settings, engine, base_url if opts["url"] else None, model,
                                     work.api_key)
        vocabulary = _vocabulary(settings, engine, opts["url"], loaded_from)
        token_range = resolve_token_range(work.token_range, vocabulary.size if vocabulary else None, model,
                                          vocabulary.source if vocabulary else "")
        if work.requests is None and context is not None:
            given = any(ctx.get_parameter_source(n) is not ParameterSource.DEFAULT for n in ("input_len", "output_len"))
            lengths = request_lengths(opts["input_len"], opts["output_len"], given, context[0], model, context[1])
            if lengths != (opts["input_len"], opts["output_len"]):
                console.print(f"prompt {lengths[0]} + output {lengths[1]} tokens: the defaults, "
                              f"{opts['input_len']} + {opts['output_len']}, cut to {model}'s context of "
                              f"{context[0]} tokens ({context[1]})", markup=False)
                opts["input_len"], opts["output_len"] = lengths
        if opts["prompt_kind"] == "tokens":
            console.print(f"prompt token ids {token_range[0]}..{token_range[1] - 1} "
                          + (f"({model} has {vocabulary.size}, from {vocabulary.source})" if vocabulary else
                             f"({model}'s vocabulary is unknown here: pass --token-range if it is smaller)"),
                          markup=False)  # the model's name and path are the server's or the user's, as written
        target = Target(
            base_url=base_url,
            model=model,
            input_len=opts["input_len"],
            output_len=opts["output_len"],
            prompt_kind=opts["prompt_kind"],
            token_range=token_range,
            api_key=work.api_key,
            request_timeout_s=opts["request_timeout"],
            workload=work.requests,
        )
        result = _empty_result(opts, work, engine, model, stamp, token_range)
        if opts["compare"]:
            root = ctx.find_root().obj or {}
            deployer = PdctlDeployer(
                opts["inventory_source"] or root.get("inventory_source"),
                Path(StateDir.at(settings.state_dir).bench),
                # processes: a supervisord pdctl starts itself, whatever runs the host
                manager="supervisor" if opts["deploy"] == "processes" else None,
            )
            await run_compare(settings, inventory, chosen, deployer, target, work.sweep, work.slo, result, out_dir,
                              console, stopper)
        else:
            await run_url(target, work.sweep, work.slo, result, out_dir, console, stopper, opts["label"])
        return result


async def _context(session: aiohttp.ClientSession, settings: Settings, engine: str, url: str | None, model: str,
                   api_key: str | None) -> tuple[int, str] | None:
    """The measured model's context length and where it was read: the --url server's model card, else the
    context pdctl's own engines are started with (their --max-model-len); None where neither says."""
    from appliance.bench.loadgen import served_context
    from appliance.engine.command import context_length
    from appliance.plan import model_plan

    if url:
        served = await served_context(session, url, model, api_key)
        return (served, f"max_model_len of {url}/v1/models") if served else None
    if engine == "sim":
        limit = settings.model.max_model_len
    else:
        limit = context_length(settings, model_plan(settings, StateDir.at(settings.state_dir)))
    return (limit, "the engines' --max-model-len") if limit else None


def _vocabulary(settings: Settings, engine: str, url: str | None, root: str | None) -> Vocabulary | None:
    """The token ids the measured model accepts: from the --url server's model directory where it names one on
    this host, else from the settings' model (the simulated engine's own vocabulary for engine sim)."""
    from appliance.engine.sim.tokens import VOCAB_SIZE
    from appliance.model_config import Vocabulary, read_vocabulary
    from appliance.plan import model_plan

    if url:
        return read_vocabulary(root) if root else None
    if engine == "sim":
        return Vocabulary(VOCAB_SIZE, "the simulated engine")
    return read_vocabulary(model_plan(settings, StateDir.at(settings.state_dir)).path)


def _report(result: BenchResult, opts: dict[str, Any], out_dir: Path) -> None:
    """The tables on stderr; bench.json's and the figures' paths on stdout; exit 130 when interrupted, 1 (with
    the reason) when every request failed."""
    from appliance.bench.report import print_report
    from appliance.bench.results import every_request_failed
    from appliance.bench.runner import write_plots

    console = cli_console(stderr=True)
    print_report(result, console)
    written = [out_dir / "bench.json"]
    if opts["plots"] and any(sh.rates for sh in result.shapes):
        written += write_plots(result, out_dir, opts["plot_rate"])
    for path in written:
        click.echo(str(path))
    if result.interrupted:
        console.print("[yellow]interrupted[/]: the files hold every rate measured so far")
        raise SystemExit(130)  # like a shell for SIGINT; `python -m appliance` drops click return codes
    reason = every_request_failed(result)
    if reason:
        click.echo(f"pdctl: error: every request failed, so nothing was measured: {reason}", err=True)
        raise SystemExit(EXIT_NOTHING_MEASURED)


def _workload(ctx: click.Context, opts: dict[str, Any]) -> WorkloadFile | Mix | None:
    """The --workload: a built-in mix by name, else a file. A timed file sets the rate and is judged whole, so it
    takes neither --rates nor --lifetimes (opts gets its rate and lifetimes 0)."""
    from click.core import ParameterSource

    from appliance.bench.mixes import MIXES, parse_mix
    from appliance.bench.trace import read_workload

    spec = opts["workload"]
    if spec is None:
        return None
    if spec.partition(":")[0] in MIXES:
        return parse_mix(spec)
    if not Path(spec).exists():
        raise PdctlError(f"--workload {spec!r} is neither a file nor a built-in mix",
                         fix=f"name a JSONL file or one of {', '.join(MIXES)}")
    workload = read_workload(Path(spec), opts["max_requests"])
    if workload.timed:
        for name in ("rates", "lifetimes"):
            if ctx.get_parameter_source(name) is not ParameterSource.DEFAULT:
                raise PdctlError(f"{spec} times its requests: --{name} does not apply",
                                 fix=f"drop --{name}, or the file's arrival times to send it at --rates")
        opts["rates"], opts["lifetimes"] = f"{workload.rate:g}", 0
    return workload


def _sweep_plan(opts: dict[str, Any], slo: Slo) -> SweepPlan:
    """The sweep's rates (schedule), request counts and steady window, from the options."""
    from appliance.bench.analysis import JUDGEMENTS
    from appliance.bench.rate_schedule import parse_schedule
    from appliance.bench.sweep import SweepPlan

    # The run's judgement first: its ceiling is refined first when the rate budget runs out.
    every = (slo.itl_judgement, *(j for j in JUDGEMENTS if j != slo.itl_judgement))
    stop_on = {"all": every, "run": (slo.itl_judgement,), "none": ()}[opts["stop_on"]]
    schedule = parse_schedule(opts["rates"], slo.attainment, stop_on, opts["resolution"])
    if not schedule.rates and not stop_on:
        raise PdctlError("--rates auto searches for the ceiling: it needs --stop-on all or run", fix="list the rates")
    return SweepPlan(
        schedule=schedule,
        num_requests=opts["num_requests"],
        seed=opts["seed"],
        warmup=opts["warmup"],
        lifetimes=opts["lifetimes"],
        max_requests=opts["max_requests"],
    )


def _chosen_shapes(settings: Settings, inventory: Inventory, opts: dict[str, Any]) -> list[Shape]:
    """The --compare shapes: --shapes with `colocated` expanded over --budgets."""
    from appliance.bench.compare import shapes
    from appliance.bench.families import parse_budgets

    wanted = [x.strip() for x in opts["shapes"].split(",") if x.strip()]
    return shapes(settings, inventory, wanted, parse_budgets(opts["budgets"]))


def _replay(paths: list[Path], opts: dict[str, Any]) -> None:
    """Tables and figures of saved results, their shapes merged in order (figures go next to the first
    unless --out says elsewhere; with several files the merged result is written there as bench.json)."""
    from appliance.bench.families import best_record
    from appliance.bench.report import print_report
    from appliance.bench.results import read_result
    from appliance.bench.runner import write_plots

    result = read_result(paths[0])
    for extra in paths[1:]:
        result.shapes.extend(read_result(extra).shapes)
    result.best = best_record(result)
    path = paths[0]
    if len(paths) > 1 and opts["out_dir"]:
        from appliance.bench.results import write_result

        Path(opts["out_dir"]).mkdir(parents=True, exist_ok=True)
        write_result(result, Path(opts["out_dir"]) / "bench.json")
    console = cli_console(stderr=True)
    print_report(result, console)
    if opts["plots"]:
        out_dir = Path(opts["out_dir"]) if opts["out_dir"] else path.parent
        out_dir.mkdir(parents=True, exist_ok=True)
        for written in write_plots(result, out_dir, opts["plot_rate"]):
            click.echo(str(written))


