"""The terminal table: one row per shape and rate, then goodput under each ITL judgement."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from appliance.bench.analysis import JUDGEMENTS
from appliance.bench.families import Best, best_of, capped, parse_name
from appliance.bench.results import BenchResult, RequestResult, SteadyWindow, routes, summarize


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
        "window",
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
            table.add_row(escape(shape.name), "-", "-", "-", "-", "-", f"skipped: {escape(shape.skipped)}", *["-"] * 6)
            continue
        for r in shape.rates:
            s = r.summary
            table.add_row(
                escape(shape.name),
                f"{r.rate:g}" + ("*" if r.partial else ""),
                "-" if s.arrival_rate is None else f"{s.arrival_rate:.2g}",
                str(s.sent),
                _window(r.window),
                str(s.failed),
                _pct(s.attainment),
                _ms(s.ttft_ms["p50"]),
                _ms(s.ttft_ms["p99"]),
                _ms(s.itl_ms["p50"]),
                _ms(s.itl_ms["p99"]),
                _ms(s.request_itl_ms["p90"]),
                f"{s.output_throughput:.0f}",
            )
    table.caption = (
        "latencies in ms; arrived/s = the Poisson draw's realized rate; sent = measured requests; window = its "
        "length in request lifetimes, mean in flight first->second half (! = in flight or TTFT grew: not steady); "
        "* = interrupted rate (not used for goodput)"
    )
    return table


def _window(w: SteadyWindow | None) -> str:
    if w is None:
        return "all"
    a, b = w.in_flight
    return f"{w.lifetimes:.1f}x {a:.0f}->{b:.0f}" + ("" if w.steady else "!")


def routes_table(result: BenchResult) -> Table | None:
    """The figures of each rate broken down by the route its requests took; None when one route (or none) was
    seen, as before the proxy reports routes (every request `unknown`)."""
    if len(routes(result)) < 2:
        return None
    table = Table(title="by route (the proxy's x-pdctl-route header)", title_justify="left")
    for col in ("shape", "req/s", "route", "sent", "failed", "attainment", "TTFT p50", "TTFT p99", "ITL p50"):
        table.add_column(col, justify="left" if col in ("shape", "route") else "right")
    for shape in result.shapes:
        for r in shape.rates:
            by_route: dict[str, list[RequestResult]] = {}
            for q in r.requests:
                by_route.setdefault(q.route, []).append(q)
            for route, requests in sorted(by_route.items()):
                s = summarize(requests, result.slo, r.duration_s)
                table.add_row(escape(shape.name), f"{r.rate:g}", route, str(s.sent), str(s.failed), _pct(s.attainment),
                              _ms(s.ttft_ms["p50"]), _ms(s.ttft_ms["p99"]), _ms(s.itl_ms["p50"]))
    return table


def goodput_table(result: BenchResult) -> Table:
    """Goodput of each shape under the three ITL judgements, and its ratio to the best colocated shape."""
    title = (f"goodput, req/s at >= {result.slo.attainment:.0%} attainment of TTFT <= {result.slo.ttft_ms:g} ms "
             f"and ITL <= {result.slo.itl_ms:g} ms")
    # rich wraps a title to the table's width: a table as wide as its title keeps it on one line
    table = Table(title=title, title_justify="left", min_width=len(title))
    table.add_column("shape")
    for j in JUDGEMENTS:
        table.add_column(f"ITL {j}" + (" (run)" if j == result.slo.itl_judgement else ""), justify="right")
    baseline = {j: next((b for b in best_of(result.shapes, j) if b.family == "colocated"), None) for j in JUDGEMENTS}
    for shape in result.shapes:
        if shape.skipped or not any(not r.partial for r in shape.rates):
            continue
        cells = []
        for j in JUDGEMENTS:
            good = shape.goodput.get(j)
            lowest = min(r.rate for r in shape.rates)
            # Passing at its top rate, the goodput is only a lower bound (">="); below the lowest rate, "<".
            bound = ">= " if capped(shape, j) else ""
            text = f"{bound}{good:g}" if good is not None else f"< {lowest:g}"
            ref = baseline[j]
            if good is not None and ref is not None and ref.goodput and not ref.lower_bound and shape.name not in ref.names:
                text += f" ({bound}{good / ref.goodput:.2f}x)"
            cells.append(text)
        table.add_row(escape(shape.name), *cells)
    if any(b is not None for b in baseline.values()):
        table.caption = "(Nx) = goodput relative to the best colocated shape under the same judgement"
    return table


def families_table(result: BenchResult) -> Table | None:
    """Best disaggregated vs best colocated shape under each judgement (which knob won); None without both."""
    rows = {j: {b.family: b for b in best_of(result.shapes, j)} for j in JUDGEMENTS}
    if not any(len(r) == 2 for r in rows.values()):
        return None
    title = "best of each family (the colocated baseline is the best tuned one)"
    table = Table(title=title, title_justify="left", min_width=len(title))
    for col in ("ITL judgement", "best disaggregated", "goodput", "best colocated", "its knobs", "goodput", "disagg / colocated"):
        table.add_column(col, justify="right" if col in ("goodput", "disagg / colocated") else "left")
    for j, fams in rows.items():
        d, c = fams.get("disaggregated"), fams.get("colocated")
        knobs = " = ".join(p.knob for n in c.names if (p := parse_name(n)) is not None) if c else "-"
        table.add_row(
            j + (" (run)" if j == result.slo.itl_judgement else ""),
            escape(" = ".join(d.names)) if d else "-",
            _good(d),
            escape(" = ".join(c.names)) if c else "-",
            knobs,
            _good(c),
            _ratio(d, c),
        )
    table.caption = (
        ">= : passed at its highest measured rate (the ceiling is above); < : missed at its lowest; "
        "capped: the colocated ceiling was not reached, no ratio"
    )
    return table


def _good(best: Best | None) -> str:
    if best is None:
        return "-"
    if best.goodput is None:
        return "< lowest"
    return (">= " if best.lower_bound else "") + f"{best.goodput:g}"


def _ratio(d: Best | None, c: Best | None) -> str:
    if d is None or c is None or d.goodput is None or not c.goodput:
        return "-"
    if c.lower_bound:
        return "capped"
    return (">= " if d.lower_bound else "") + f"{d.goodput / c.goodput:.2f}x"


def method_lines(result: BenchResult) -> list[str]:
    """How the figures were measured (printed under the tables, so a pasted report carries its method)."""
    w = result.workload
    spec = w.rate_spec or ",".join(f"{r:g}" for r in w.rates)
    if w.workload is not None:
        how = "the file's arrival times" if w.arrivals == "file" else f"Poisson arrivals, rates {spec}"
        return [f"method: workload {w.workload}, {how}; every request judged "
                f"(TTFT <= {result.slo.ttft_ms:g} ms, ITL {result.slo.itl_judgement} <= {result.slo.itl_ms:g} ms)."
                if w.lifetimes == 0 else f"method: workload {w.workload}, {how}."]
    lines = [
        f"method: {w.input_len} prompt + {w.output_len} output tokens, Poisson arrivals, rates {spec}; "
        f"stop at the first rate under {result.slo.attainment:.0%} attainment under "
        f"{'/'.join(w.stop_on) if w.stop_on else 'no judgement (every rate)'}.",
    ]
    if w.lifetimes > 0:
        lines.append(
            f"steady state: per rate, arrivals for 1 + {w.lifetimes:g} + 1 request lifetimes (the lifetime: one "
            "request alone, or the median latency at the next lower rate if longer); only arrivals in the middle "
            f"{w.lifetimes:g} lifetimes (and >= {w.num_requests} requests) are judged: warm-up and drain excluded."
        )
        unsteady = [f"{s.name}@{r.rate:g}" for s in result.shapes for r in s.rates if r.window and not r.window.steady]
        if unsteady:
            lines.append(
                "in-flight count or TTFT grew across the window (over capacity: a longer run would miss more): "
                + ", ".join(unsteady)
            )
    else:
        lines.append(f"every one of the {w.num_requests} requests per rate is judged (no steady window).")
    return lines


def print_report(result: BenchResult, console: Console) -> None:
    """The tables and the method."""
    console.print(rates_table(result))
    by_route = routes_table(result)
    if by_route is not None:
        console.print(by_route)
    console.print(goodput_table(result))
    families = families_table(result)
    if families is not None:
        console.print(families)
    for line in method_lines(result):
        console.print(line, highlight=False, markup=False)  # plain text, with file names and labels as written
