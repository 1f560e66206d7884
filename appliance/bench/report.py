"""The terminal table: one row per shape and rate, then goodput under each ITL judgement."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from appliance.bench.analysis import JUDGEMENTS
from appliance.bench.results import BenchResult


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def rates_table(result: BenchResult) -> Table:
    """Per-rate figures of every shape."""
    j = result.slo.itl_judgement
    table = Table(
        title="pdctl bench" + (" (SIMULATED ENGINE)" if result.engine == "sim" else ""), title_justify="left"
    )
    for col in (
        "shape",
        "req/s",
        "arrived/s",
        "sent",
        "failed",
        "attainment",
        "TTFT p50",
        "TTFT p99",
        "ITL p50",
        "ITL p99",
        f"req ITL {j} p90",
        "out tok/s",
    ):
        table.add_column(col, justify="left" if col == "shape" else "right")
    for shape in result.shapes:
        if shape.skipped:
            table.add_row(shape.name, "-", "-", "-", "-", f"skipped: {shape.skipped}", *["-"] * 6)
            continue
        for r in shape.rates:
            s = r.summary
            table.add_row(
                shape.name,
                f"{r.rate:g}" + ("*" if r.partial else ""),
                "-" if s.arrival_rate is None else f"{s.arrival_rate:.2g}",
                str(s.sent),
                str(s.failed),
                _pct(s.attainment),
                _ms(s.ttft_ms["p50"]),
                _ms(s.ttft_ms["p99"]),
                _ms(s.itl_ms["p50"]),
                _ms(s.itl_ms["p99"]),
                _ms(s.request_itl_ms["p90"]),
                f"{s.output_throughput:.0f}",
            )
    table.caption = "latencies in ms; arrived/s = the Poisson draw's realized rate; * = interrupted rate (not used for goodput)"
    return table


def goodput_table(result: BenchResult) -> Table:
    """Goodput of each shape under the three ITL judgements, and its ratio to the colocated baseline."""
    table = Table(
        title=f"goodput (req/s at >= {result.slo.attainment:.0%} attainment; TTFT <= {result.slo.ttft_ms:g} ms, "
        f"ITL <= {result.slo.itl_ms:g} ms)",
        title_justify="left",
    )
    table.add_column("shape")
    for j in JUDGEMENTS:
        table.add_column(f"ITL {j}" + (" (run)" if j == result.slo.itl_judgement else ""), justify="right")
    base = next((s for s in result.shapes if s.name == "colocated-2" and s.rates), None)
    top = max((r.rate for s in result.shapes for r in s.rates), default=0.0)
    for shape in result.shapes:
        if shape.skipped or not shape.rates:
            continue
        cells = []
        for j in JUDGEMENTS:
            good = shape.goodput.get(j)
            lowest = min(r.rate for r in shape.rates)
            # At the top of the sweep the goodput is only a lower bound (">="); below the lowest rate, "<".
            bound = ">= " if good is not None and good >= top else ""
            text = f"{bound}{good:g}" if good is not None else f"< {lowest:g}"
            ref = base.goodput.get(j) if base is not None and base is not shape else None
            if good is not None and ref and ref < top:  # a capped baseline gives no meaningful ratio
                text += f" ({bound}{good / ref:.1f}x)"
            cells.append(text)
        table.add_row(shape.name, *cells)
    if base is not None:
        table.caption = "(Nx) = goodput relative to colocated-2"
    return table


def print_report(result: BenchResult, console: Console) -> None:
    """Both tables."""
    console.print(rates_table(result))
    console.print(goodput_table(result))
