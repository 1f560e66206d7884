"""The output of `pdctl plan --suggest`: ranked splits with the reasoning behind them."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import click
from rich.table import Table

from appliance.cli.common import console as cli_console
from appliance.cli.common import obtain
from appliance.cli.lifecycle import installed_plan
from appliance.heads import Heads, read_heads
from appliance.settings import EMBEDDED_MODEL
from appliance.suggest import Profile, _eff, bench_profile, sim_profile, suggest


def _profile(settings, explicit: str | None) -> Profile:  # type: ignore[no-untyped-def]
    fallback = sim_profile(settings)
    path = Path(explicit) if explicit else Path(settings.state_dir) / "bench" / "bench.json"
    if not path.is_file():
        return fallback
    deployed = installed_plan(settings.state_dir)
    tp = {r: (deployed.role_instances(r)[0].tp if deployed and deployed.role_instances(r) else 1)  # type: ignore[arg-type]
          for r in ("prefill", "decode")}
    return bench_profile(path, tp["prefill"], tp["decode"], fallback)


def print_suggestions(ctx: click.Context, input_len: int, output_len: int, rate: float, ttft_ms: float | None,
                      itl_ms: float | None, profile_path: str | None, as_json: bool) -> None:
    """Rank the splits for the workload and say why."""
    overrides = {"slo": {k: v for k, v in (("ttft_ms", ttft_ms), ("itl_ms", itl_ms)) if v is not None}}
    settings, inventory = obtain(ctx, overrides)
    prof = _profile(settings, profile_path)
    heads: Heads | None = None if settings.model.path == EMBEDDED_MODEL else read_heads(settings.model.path)
    ranked = suggest(settings, inventory, prof, input_len, output_len, rate, heads)
    if as_json:
        click.echo(json.dumps({"profile": asdict(prof), "workload": {"input_len": input_len, "output_len": output_len,
                               "rate": rate, "ttft_ms": settings.slo.ttft_ms, "itl_ms": settings.slo.itl_ms},
                               "suggestions": [{**asdict(p), "prefill": str(p.prefill), "decode": str(p.decode),
                                                "prefill_gpus": p.prefill.gpus, "decode_gpus": p.decode.gpus}
                                               for p in ranked]}, indent=2))
        return
    console = cli_console()
    console.print(f"workload: {input_len} prompt + {output_len} output tokens at {rate:g} req/s; SLO TTFT "
                  f"{settings.slo.ttft_ms:g} ms, ITL {settings.slo.itl_ms:g} ms; {len(inventory.gpus)} GPUs "
                  f"({inventory.source})")
    console.print(f"profile: {prof.source}")
    console.print(f"  prefill per GPU: {1e6 / prof.prefill_us_per_token:,.0f} prompt tokens/s "
                  f"({prof.prefill_us_per_token:g} us/token); demand {rate * input_len:,.0f} tokens/s")
    batch = 64
    step = prof.decode_step_ms + prof.decode_step_ms_per_seq * batch
    console.print(f"  decode per GPU: step {prof.decode_step_ms:g} ms + {prof.decode_step_ms_per_seq:g} ms/seq "
                  f"(batch {batch}: {batch * 1000 / step:,.0f} tokens/s); demand {rate * output_len:,.0f} tokens/s")
    if heads is not None:
        console.print(f"  model: {heads.attention} attention heads: TP {', '.join(map(str, heads.fitting(len(inventory.gpus))))} "
                      "can start (others are left out)")
    console.print(f"  TP t speeds an instance up by t x 0.9^log2(t) (TP2 {_eff(2):.2f}x, TP4 {_eff(4):.2f}x)")
    table = Table(show_header=True, header_style="bold")
    for col in ("rank", "prefill", "decode", "P:D GPUs", "goodput req/s", f"TTFT ms @{rate:g}",
                f"ITL ms @{rate:g}", "SLO", "limited by"):
        table.add_column(col)
    for n, p in enumerate(ranked[:12], 1):
        table.add_row(str(n), str(p.prefill), str(p.decode), f"{p.prefill.gpus}:{p.decode.gpus}",
                      f"{p.goodput_rps:.2f}", f"{p.ttft_ms:.0f}" if p.ttft_ms is not None else "saturated",
                      f"{p.itl_ms:.1f}" if p.itl_ms is not None else "saturated",
                      "[green]met[/green]" if p.meets_slo else "[red]missed[/red]", p.bottleneck)
    console.print(table)
    best = ranked[0]
    console.print(f"best: prefill {best.prefill}, decode {best.decode}: predicted goodput {best.goodput_rps:.2f} req/s"
                  f"{'' if best.meets_slo else ' (no split meets the SLOs at this rate)'}")
    console.print(f"apply: pdctl rebalance --prefill {best.prefill} --decode {best.decode}")
