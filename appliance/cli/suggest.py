"""The output of `pdctl plan --suggest`: colocated shapes and splits ranked together, with the reasoning;
and `--check bench.json`: the model's predictions next to a measured sweep's figures, shape by shape."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from appliance.cli.conditional import describe_room, describe_spread
from appliance.cli.options import console as rich_console
from appliance.cli.options import obtain
from appliance.connector import disaggregated_name, get_connector, resolve_name
from appliance.connector.base import Alone
from appliance.errors import PdctlError
from appliance.inventory.models import Inventory
from appliance.model_config import Heads, ModelShape, read_heads, read_model_shape, with_engine_quantization
from appliance.node import Node
from appliance.plan import engine_release, platform_of, step_spread
from appliance.proxy.config import DecodeStep
from appliance.roles import Role
from appliance.settings import EMBEDDED_MODEL, Settings
from appliance.suggest import (
    JUDGEMENTS,
    Candidate,
    Prediction,
    Profile,
    Shape,
    bench_profile,
    conditional_threshold,
    decode_step_figures,
    default_profile,
    descriptors,
    goodput_band,
    handoff,
    predict,
    state,
    suggest,
)

WITHIN = 0.25  # issue 14's target: predicted goodput within 25 % of measured


def _profile(settings: Settings, inventory: Inventory, model: ModelShape | None, explicit: str | None) -> Profile:
    fallback = default_profile(settings, inventory, model)
    if not explicit:
        return fallback
    return bench_profile(Path(explicit), _measured(settings), fallback)


def _measured(settings: Settings) -> Candidate:
    """The deployment a calibration bench measured: the installed one, else one colocated engine (TP1, the
    settings' budget), which is what `pdctl bench --url` against a lone vLLM server measures."""
    deployed = Node(settings).installed()
    roles: tuple[Role, ...] = ("prefill", "decode")
    if deployed and all(deployed.role_instances(r) for r in roles):
        pre, dec = (deployed.role_instances(r) for r in roles)
        return Candidate("disaggregated", prefill=Shape(len(pre), pre[0].tp), decode=Shape(len(dec), dec[0].tp))
    colocated = deployed.role_instances("both") if deployed else []
    tp = colocated[0].tp if colocated else 1
    return Candidate("colocated", colocated=Shape(1, tp), budget=settings.colocated.max_num_batched_tokens)


def _model(settings: Settings) -> tuple[Heads | None, ModelShape | None]:
    if settings.model.path == EMBEDDED_MODEL:
        return None, None
    shape = read_model_shape(settings.model.path)
    args = [*settings.decode.extra_args, *settings.colocated.extra_args, *settings.prefill.extra_args]
    return read_heads(settings.model.path), with_engine_quantization(shape, args) if shape else None


CALIBRATION_OUTPUT = 64  # output tokens of a calibration request: 63 gaps, enough for the step's median
CALIBRATION_REQUESTS = 20
CALIBRATION_BUSY = 0.2  # the share of the time a request is in flight: prefill and step each measured alone


def calibration(prof: Profile, input_len: int) -> str | None:
    """How to calibrate an uncalibrated profile on this node: one `pdctl bench` run at a rate low enough that
    requests rarely overlap (by this profile's own TTFT and step), at the workload's prompt length; None when
    calibrated."""
    if prof.calibrated:
        return None
    cand = Candidate("colocated", colocated=Shape(1, 1))
    lone = state(prof, cand, 1e-6, input_len, CALIBRATION_OUTPUT, 1e9)
    life_s = ((lone.ttft_ms or 0.0) + CALIBRATION_OUTPUT * (lone.gap_ms or 0.0)) / 1000
    rate = float(f"{CALIBRATION_BUSY / max(life_s, 1e-3):.1g}")
    minutes = (CALIBRATION_REQUESTS + 1) / rate / 60 + life_s / 60
    return (f"calibrate it on this node: with a deployment up (or `--url` to one vLLM server), `pdctl bench "
            f"--rates {rate:g} -n {CALIBRATION_REQUESTS} --lifetimes 0 --input-len {input_len} --output-len "
            f"{CALIBRATION_OUTPUT} --stop-on none --no-plots --out calibration` (about {minutes:.1f} min: each "
            f"prompt's prefill and the decode step, one request at a time), then `pdctl plan --suggest --profile "
            "calibration/bench.json` (and `pdctl plan --check` on a sweep to see how close it is)")


def _band(prof: Profile, p: Prediction, judgement: str) -> tuple[float, float]:
    """Where the candidate's goodput lies (req/s), by the profile's band for its layout and the judgement."""
    low, high = goodput_band(prof, p.layout, judgement)
    return low * p.goodput_rps, high * p.goodput_rps


def _row(p: Prediction, band: tuple[float, float]) -> dict[str, Any]:
    c = p.candidate
    return {"layout": c.layout, "shape": str(c), "bench_shape": c.bench_name,
            "prefill": str(c.prefill) if c.prefill else None, "decode": str(c.decode) if c.decode else None,
            "colocated": str(c.colocated) if c.colocated else None, "max_num_batched_tokens": c.budget,
            "prefill_gpus": c.prefill.gpus if c.prefill else 0, "decode_gpus": c.decode.gpus if c.decode else 0,
            "goodput_rps": p.goodput_rps, "band_rps": list(band), "goodput": p.goodput, "ttft_ms": p.ttft_ms, "itl_ms": p.itl_ms,
            "running": p.running, "capacity": p.capacity, "meets_slo": p.meets_slo, "bottleneck": p.bottleneck}


def _describe(console: Console, prof: Profile, settings: Settings, inventory: Inventory, model: ModelShape | None,
              heads: Heads | None, input_len: int, output_len: int, rate: float, split_fits: bool) -> None:
    console.print(f"profile: {prof.source}")
    per_token = prof.prefill_us_per_token + input_len / 2 * prof.prefill_us_per_context_token  # with attention
    console.print(f"  prefill per GPU: {1e6 / per_token:,.0f} prompt tokens/s at {input_len} tokens "
                  f"({per_token:.3g} us/token); demand {rate * input_len:,.0f} tokens/s")
    experts = (f" + {prof.expert_step_ms:.3g} ms x the share of the {prof.experts} experts its tokens visit "
               f"({prof.experts_per_token} per token)") if prof.experts else ""
    console.print(f"  decode step per GPU: {prof.decode_step_ms:.3g} ms{experts} + {prof.decode_step_ms_per_seq:g} ms/seq"
                  + (f" + each sequence's KV read at {prof.kv_read_tbps:g} TB/s" if prof.kv_read_tbps else ""))
    console.print(f"  TP t: prefill x{prof.prefill_tp_factor:g}^log2(t), decode x{prof.decode_tp_factor:g}^log2(t) "
                  "per doubling")
    if model is not None:
        weights = f"{model.quantization.upper()} weights" if model.quantization else f"{model.dtype_bytes} B weights"
        console.print(f"  model shape: {model.params_total / 1e9:.1f} B params, {weights} ({model.weight_bytes / 2**30:.1f} GiB), "
                      f"KV {model.kv_bytes_per_token / 1024:g} KiB/token ({model.layers} layers x {model.kv_heads} "
                      f"KV heads x {model.head_dim} x 2 x {model.dtype_bytes} B)")
        tokens = prof.kv_tokens_per_gpu(1)
        if tokens is not None:
            console.print(f"  KV cache per GPU at TP1: {tokens:,.0f} tokens = {tokens / (input_len + output_len / 2):,.0f} "
                          f"running sequences of {input_len} + {output_len}/2 tokens")
    if prof.post_us_per_descriptor and split_fits:
        post, transfer = handoff(prof, input_len)
        layout = {"block": "cross-layer blocks", "layer": "per layer, contiguous blocks merged"}.get(
            prof.descriptors, "per-layer blocks")
        stall = (post if prof.post_on_decode else 0.0) + input_len * prof.join_us_per_prompt_token / 1000
        overlap = (", pushed layer by layer during the prefill" if prof.write_overlaps_prefill
                   and not prof.post_on_decode else "")
        console.print(f"  KV hand-off ({prof.handoff_source}): block size {prof.block_size}, {layout}: "
                      f"{descriptors(prof, input_len):,} descriptors per prompt and rank, posted by the "
                      f"{'decode' if prof.post_on_decode else 'prefill'} in {post:.2f} ms, moved in {transfer:.1f} ms "
                      f"at TP1{overlap}; a joining request stalls the decode's running streams {stall:.1f} ms")
    if heads is not None:
        console.print(f"  model: {heads.attention} attention heads: TP {', '.join(map(str, heads.fitting(len(inventory.gpus))))} "
                      "can start (others are left out)")


def print_suggestions(ctx: click.Context, input_len: int, output_len: int, rate: float, ttft_ms: float | None,
                      itl_ms: float | None, profile_path: str | None, as_json: bool,
                      modelled: dict[str, Any] | None = None, requests: int | None = None) -> None:
    """Rank the colocated shapes and splits for the workload and say why (`modelled`: the plan flags'
    connector, mode and engine overrides; `requests`: a run of that many requests, not the steady state)."""
    overrides = {**(modelled or {}),
                 "slo": {k: v for k, v in (("ttft_ms", ttft_ms), ("itl_ms", itl_ms)) if v is not None}}
    settings, inventory = obtain(ctx, overrides)
    heads, model = _model(settings)
    prof = _profile(settings, inventory, model, profile_path)
    ranked = suggest(settings, inventory, prof, input_len, output_len, rate, heads, requests)
    slo = settings.slo
    split = next((p.candidate.decode for p in ranked if p.candidate.decode is not None), None)
    spread = step_spread(settings)
    threshold, why = conditional_threshold(prof, split.tp if split else 1, slo.itl_ms, spread)
    ms_per_seq, us_per_token = decode_step_figures(prof, split.tp if split else 1, input_len, output_len)
    decode_step = {"ms_per_seq": round(ms_per_seq, 4), "prefill_us_per_token": round(us_per_token, 3)}
    room_text = describe_room(threshold, DecodeStep(ms_per_seq=ms_per_seq, prefill_us_per_token=us_per_token)
                              if us_per_token > 0 else None, slo.itl_ms)
    if as_json:
        profile = {k: v for k, v in asdict(prof).items() if k != "kv_tokens_per_gpu"}
        j = slo.itl_judgement
        click.echo(json.dumps({"profile": profile, "workload": {"input_len": input_len, "output_len": output_len,
                               "rate": rate, "requests": requests, "ttft_ms": slo.ttft_ms, "itl_ms": slo.itl_ms,
                               "itl_judgement": slo.itl_judgement}, "suggestions": [_row(p, _band(prof, p, j)) for p in ranked],
                               "apply": _choice(prof, ranked, j)[0].candidate.bench_name,
                               "decode_only_below": {"tokens": threshold, "why": why, "room": room_text,
                                                     "served_alone": _alone(settings, inventory).served},
                               "decode_step": decode_step, "decode_step_spread": spread}, indent=2))
        return
    console = rich_console()
    run = (f"a run of {requests} requests per rate, every one judged (goodput: the highest rate at which "
           f"{slo.attainment:.0%} of them meet the SLOs)" if requests else "the steady state")
    console.print(f"workload: {input_len} prompt + {output_len} output tokens at {rate:g} req/s; SLO TTFT "
                  f"{slo.ttft_ms:g} ms, ITL {slo.itl_ms:g} ms ({slo.itl_judgement}); {len(inventory.gpus)} GPUs "
                  f"({inventory.source}); modelled: {run}")
    _describe(console, prof, settings, inventory, model, heads, input_len, output_len, rate,
              split_fits=any(p.layout == "disaggregated" for p in ranked))
    table = Table(show_header=True, header_style="bold")
    for col in ("rank", "shape", "goodput req/s", "band", *(f"goodput {j}" for j in JUDGEMENTS), f"TTFT p90 @{rate:g}",
                f"ITL {slo.itl_judgement} @{rate:g}", "running / cap", "SLO", "limited by"):
        table.add_column(col)
    for n, p in enumerate(ranked[:16], 1):
        cap = f"{p.running:.0f} / {p.capacity:.0f}" if p.running is not None and p.capacity is not None else "-"
        low, high = _band(prof, p, slo.itl_judgement)
        table.add_row(str(n), str(p.candidate), _rps(p.goodput_rps), f"{_rps(low)}-{_rps(high)}",
                      *(_rps(p.goodput[j]) for j in JUDGEMENTS),
                      f"{p.ttft_ms:.0f}" if p.ttft_ms is not None else "saturated",
                      f"{p.itl_ms:.1f}" if p.itl_ms is not None else "saturated", cap,
                      "[green]met[/green]" if p.meets_slo else "[red]missed[/red]", p.bottleneck)
    console.print(table)
    best, rival = _choice(prof, ranked, slo.itl_judgement)
    low, high = _band(prof, best, slo.itl_judgement)
    state_of = "uncalibrated here" if not prof.calibrated else "the model's spread"
    console.print(f"best: {best.candidate}: predicted goodput {_rps(best.goodput_rps)} req/s ({slo.itl_judgement}), "
                  f"{_rps(low)}-{_rps(high)} ({state_of}){'' if best.meets_slo else ' (nothing meets the SLOs at this rate)'}")
    for layout in ("colocated", "disaggregated"):
        top = next((p for p in ranked if p.layout == layout), None)
        if top is not None and top is not best:
            console.print(f"best {layout}: {top.candidate}: {_rps(top.goodput_rps)} req/s")
    advice = calibration(prof, input_len)
    if advice:
        console.print(f"the profile is not calibrated on this hardware: {advice}")
    console.print(f"apply: {_apply(best.candidate)}")
    if rival is not None:
        r_low, r_high = _band(prof, rival, slo.itl_judgement)
        console.print(f"  or {rival.candidate} ({_rps(r_low)}-{_rps(r_high)} req/s): its band overlaps; {best.candidate} "
                      f"is named for its better worst case ({_rps(low)} req/s). To tell them apart, measure both: "
                      f"`pdctl bench --compare --shapes {best.candidate.bench_name},{rival.candidate.bench_name}`"
                      f"{'' if not advice else ', or calibrate first'}; then `{_apply(rival.candidate)}` if it wins")
    alone = _alone(settings, inventory)
    if not alone.served:
        console.print(f"conditional routing: not on this node's connector and mode: {alone.why} (docs/routing.md, "
                      "\"Routes per connector\")")
        return
    set_by = "" if settings.proxy.decode_only_below is None else f" (set to {settings.proxy.decode_only_below})"
    console.print(f"conditional routing: decode_only_below = {threshold} prompt tokens{set_by}: {why}; "
                  "\\[proxy] decode_only_below sets it, 0 hands every prompt over (docs/routing.md)")
    console.print(f"  and decode_step = {{ms_per_seq = {decode_step['ms_per_seq']:g}, prefill_us_per_token = "
                  f"{decode_step['prefill_us_per_token']:g}}}: each leg the decode runs takes "
                  f"{ms_per_seq * 1000 / us_per_token:.1f} prompt tokens off that room; {room_text}")
    console.print(f"  from the {describe_spread(settings)}; \\[proxy] decode_step_spread sets it")


def _rps(x: float) -> str:
    """A predicted rate to two significant figures: the model's bands span tens of percent, so 43.16 claims
    more than it knows (43 does not)."""
    if x <= 0 or not math.isfinite(x):
        return f"{x:g}"
    return f"{round(x, 1 - math.floor(math.log10(x))):g}"


def _choice(prof: Profile, ranked: list[Prediction], judgement: str) -> tuple[Prediction, Prediction | None]:
    """What to apply, and the runner-up whose band overlaps it (None: none does). Among the candidates that meet
    the SLOs alike, overlapping bands are not told apart by the point estimate: the one with the better worst
    case (the band's low end) is applied, and the best-placed other one is named beside it."""
    top = ranked[0]
    low, high = _band(prof, top, judgement)
    overlapping = [p for p in ranked if p.meets_slo == top.meets_slo and _band(prof, p, judgement)[1] >= low]
    by_worst = sorted(overlapping, key=lambda p: -_band(prof, p, judgement)[0])
    pick = by_worst[0]
    rival = next((p for p in by_worst if p is not pick), None)
    return pick, rival


def _apply(c: Candidate) -> str:
    """The command that deploys candidate `c`."""
    if c.colocated is not None:
        mbt = f"PDCTL_COLOCATED__MAX_NUM_BATCHED_TOKENS={c.budget} " if c.budget else ""
        return f"{mbt}PDCTL_COLOCATED__INSTANCES={c.colocated.instances} pdctl up --connector none"
    return f"pdctl rebalance --prefill {c.prefill} --decode {c.decode}"


# ---- --check: predictions against a measured sweep ---------------------------------------------------------

def _candidate(name: str, settings: Settings, inventory: Inventory) -> Candidate | None:
    """The candidate a bench shape name stands for on this inventory (disaggregated: the planner's split)."""
    from appliance.bench.families import parse_name
    from appliance.plan import plan

    parsed = parse_name(name)
    if parsed is None:
        return None
    if parsed.family == "colocated":
        gpus = len(inventory.gpus) or parsed.instances or 1
        n = parsed.instances or 1
        return Candidate("colocated", colocated=Shape(n, max(1, gpus // n)), budget=parsed.budget)
    data = settings.model_dump()
    data["connector"]["name"] = disaggregated_name(data["connector"]["name"])
    deployed = plan(Settings.model_validate(data), inventory)
    pre, dec = deployed.role_instances("prefill"), deployed.role_instances("decode")
    return Candidate("disaggregated", prefill=Shape(len(pre), pre[0].tp), decode=Shape(len(dec), dec[0].tp))


def _verdict(predicted: float, measured: float | None, lowest: float, capped: bool, failed: float | None) -> str:
    """Predicted goodput against the measured interval [measured, failed): within 25 % when it lies in
    [0.75 x measured, 1.25 x failed) (the true goodput is anywhere between the rate passed and the one failed)."""
    if measured is None:  # missed even at its lowest rate
        return "consistent (< lowest)" if predicted < lowest * (1 + WITHIN) else "predicts too high"
    if capped or failed is None:  # passed at its highest rate: the measurement is a lower bound
        return "consistent (>= bound)" if predicted >= measured * (1 - WITHIN) else "predicts too low"
    error = predicted / measured - 1 if measured else float("inf")
    ok = measured * (1 - WITHIN) <= predicted < failed * (1 + WITHIN)
    return f"{'within' if ok else 'off'} ({error:+.0%} of the rate passed, next {failed:g} failed)"


def print_check(ctx: click.Context, bench_paths: list[str], profile_path: str | None, as_json: bool,
                modelled: dict[str, Any] | None = None) -> None:
    """Predicted vs measured goodput (every judgement) and per-rate TTFT p90 / mean gap, per measured shape
    (several files: their shapes in order, judged with the first file's workload and SLOs; `modelled`: the
    plan flags' connector, mode and engine overrides)."""
    from appliance.bench.analysis import JUDGEMENTS as BENCH_JUDGEMENTS
    from appliance.bench.families import capped
    from appliance.bench.results import read_result

    result = read_result(Path(bench_paths[0]))
    for extra in bench_paths[1:]:
        more = read_result(Path(extra))
        same = (more.workload.input_len, more.workload.output_len, more.slo) == (
            result.workload.input_len, result.workload.output_len, result.slo)
        if not same:
            raise PdctlError(f"{extra} measured another workload or SLO than {bench_paths[0]}",
                             fix="check runs of one workload together")
        result.shapes.extend(more.shapes)
    bench_path = ", ".join(bench_paths)
    w, slo = result.workload, result.slo
    settings, inventory = obtain(ctx, {**(modelled or {}), "slo": slo.model_dump()})
    heads, model = _model(settings)
    prof = _profile(settings, inventory, model, profile_path)
    rows: list[dict[str, Any]] = []
    rates: list[dict[str, Any]] = []
    for shape in result.shapes:
        measured = [r for r in shape.rates if not r.partial]
        cand = _candidate(shape.name, settings, inventory) if measured else None
        if cand is None:
            continue
        # a WRITE shape's decode does not post the hand-off (the prefill does), whatever the settings say
        shape_prof = replace(prof, post_on_decode=False) if shape.name == "disagg-write" else prof
        # a run that judged every request (no steady window) is modelled as a run of that many requests
        finite = w.num_requests if not w.lifetimes else None
        pred = predict(shape_prof, cand, measured[0].rate, w.input_len, w.output_len, settings, finite)
        lowest = min(r.rate for r in measured)
        for j in BENCH_JUDGEMENTS:
            good = shape.goodput.get(j)
            failed = min((r.rate for r in measured if good is not None and r.rate > good), default=None)
            low, high = (x * pred.goodput[j] for x in goodput_band(shape_prof, cand.layout, j))
            # the measured interval: [good, failed), [0, lowest) when even the lowest rate failed
            bottom, top = (good, failed) if good is not None else (0.0, lowest)
            in_band = bottom <= high and (top is None or top > low)
            rows.append({"shape": shape.name, "candidate": str(cand), "judgement": j, "predicted": pred.goodput[j],
                         "band": [low, high], "in_band": in_band,
                         "measured": good, "bound": ">=" if capped(shape, j) else "<" if good is None else "",
                         "verdict": _verdict(pred.goodput[j], good, lowest, capped(shape, j), failed)})
        for r in measured:
            s = state(shape_prof, cand, r.rate, w.input_len, w.output_len, slo.itl_ms)
            rates.append({"shape": shape.name, "rate": r.rate, "ttft_p90_predicted": s.ttft_ms,
                          "ttft_p90_measured": r.summary.ttft_ms.get("p90"), "gap_predicted": s.gap_ms,
                          "gap_measured": r.summary.tpot_ms.get("mean"), "running_predicted": s.running,
                          "capacity": s.capacity})
    if as_json:
        click.echo(json.dumps({"bench": bench_path, "profile": prof.source, "calibrated": prof.calibrated,
                               "band": prof.band, "calibrate": calibration(prof, w.input_len),
                               "goodput": rows, "rates": rates}, indent=2))
        return
    console = rich_console()
    console.print(f"check: {bench_path} ({result.engine}, {w.input_len} + {w.output_len} tokens, SLO TTFT "
                  f"{slo.ttft_ms:g} ms, ITL {slo.itl_ms:g} ms) against {inventory.source}")
    console.print(f"profile: {prof.source}")
    table = Table("shape", "modelled as", "judgement", "predicted req/s", "band", "measured req/s", "verdict",
                  title=f"goodput: predicted vs measured (target: within {WITHIN:.0%})", title_justify="left")
    for row in rows:
        m = row["measured"]
        shown = f"< {min(r['rate'] for r in rates if r['shape'] == row['shape']):g}" if m is None else f"{row['bound']} {m:g}".strip()
        band = f"{_rps(row['band'][0])}-{_rps(row['band'][1])} ({'holds' if row['in_band'] else 'MISSED'})"
        table.add_row(row["shape"], row["candidate"], row["judgement"], _rps(row['predicted']), band, shown,
                      row["verdict"])
    console.print(table)
    per_rate = Table("shape", "req/s", "TTFT p90 pred", "TTFT p90 meas", "mean gap pred", "mean gap meas (TPOT)",
                     "running pred / cap", title="per rate (ms)", title_justify="left")

    def ms(x: float | None) -> str:
        return "saturated" if x is None else f"{x:.1f}"

    for row in rates:
        run = "-" if row["running_predicted"] is None else f"{row['running_predicted']:.0f} / {row['capacity']:.0f}"
        per_rate.add_row(row["shape"], f"{row['rate']:g}", ms(row["ttft_p90_predicted"]), ms(row["ttft_p90_measured"]),
                         ms(row["gap_predicted"]), ms(row["gap_measured"]), run)
    console.print(per_rate)
    advice = calibration(prof, w.input_len)
    if advice:
        console.print(f"the profile is not calibrated on this hardware (its bands are {prof.band[0]:g}-"
                      f"{prof.band[1]:g}x wider): {advice}")
    if not rows:
        console.print("no shape in the file has a bench shape name (disagg-read, colocated-N[-mbtB]) with a measured rate")


def _alone(settings: Settings, inventory: Inventory) -> Alone:
    """Whether the node's connector, in its mode, serves a prompt on a decode alone (ProxySide.alone): where it
    does not, conditional routing is refused and no decode_only_below is advised."""
    mode = settings.connector.mode
    name = resolve_name(disaggregated_name(settings.connector.name), platform_of(inventory), mode)
    return get_connector(name).side(mode, engine_release(settings)).alone()
