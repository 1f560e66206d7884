"""PNG figures of a bench result (matplotlib, headless): attainment vs rate, latency distributions at one rate."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from appliance.bench.analysis import token_gaps
from appliance.bench.results import BenchResult, RateResult, routes
from appliance.errors import PdctlError


def require_matplotlib() -> None:
    """A PdctlError with the fix when matplotlib is not installed; found without importing it (seconds on a busy
    node), so `pdctl bench` can say so before it measures without making every other mistake wait for it."""
    if importlib.util.find_spec("matplotlib") is None:
        raise PdctlError("plots need matplotlib", fix="pip install 'pdctl[bench]' or pass --no-plots")


def pyplot() -> Any:
    """matplotlib.pyplot on the headless Agg backend; a PdctlError with the fix when matplotlib is missing."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt

    return plt


def _span(values: list[int], asked: int) -> str:
    """The lengths the requests really had ("64-160"), or the asked length where none was reported."""
    if not values:
        return str(asked)
    return f"{min(values)}" if min(values) == max(values) else f"{min(values)}-{max(values)}"


def _banner(result: BenchResult) -> str:
    """The workload the figure shows: its name, the token lengths its requests had, and how many."""
    w = result.workload
    sim = "SIMULATED ENGINE (time model, not hardware) - " if result.engine == "sim" else ""
    per_rate = (
        f">= {w.num_requests} measured per rate over >= {w.lifetimes:g} request lifetimes"
        if w.lifetimes > 0
        else f"{w.num_requests} requests per rate"
    )
    ok = [r for s in result.shapes for rate in s.rates for r in rate.requests if r.success]
    ins = _span([r.prompt_tokens for r in ok if r.prompt_tokens is not None], w.input_len)
    outs = _span([r.output_tokens for r in ok if r.output_tokens], w.output_len)
    arrivals = "timed from the file" if w.arrivals == "file" else "Poisson"
    return (f"{sim}workload {w.workload or 'random'}: {ins} in / {outs} out tokens, {per_rate}, "
            f"{arrivals}")


def plot_attainment(result: BenchResult, path: Path) -> Path:
    """SLO attainment (%) against request rate, one line per shape, with the target and each goodput."""
    plt = pyplot()
    slo = result.slo
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=110)
    top = max((r.rate for s in result.shapes for r in s.rates), default=0.0)
    for n, shape in enumerate(result.shapes):
        rates = [r for r in shape.rates if r.summary.attainment is not None]
        if not rates:
            continue
        xs = [r.rate for r in rates]
        ys = [100 * (r.summary.attainment or 0.0) for r in rates]
        good = shape.goodput.get(slo.itl_judgement)
        if good is None:
            label = f"{shape.name} (goodput < {xs[0]:g})"
        else:
            # At the top of the sweep the goodput is only a lower bound.
            label = f"{shape.name} (goodput {'>= ' if good >= top else ''}{good:g} req/s)"
        # Distinct markers and dashes: shapes with identical attainment would otherwise hide each other.
        style = ("-", "--", "-.", ":")[n % 4]
        (line,) = ax.plot(xs, ys, marker="osD^v"[n % 5], markersize=5, linestyle=style, label=label)
        partial = [(r.rate, 100 * (r.summary.attainment or 0.0)) for r in rates if r.partial]
        if partial:
            ax.scatter(*zip(*partial, strict=True), facecolors="none", edgecolors=line.get_color(), s=60)
    ax.axhline(100 * slo.attainment, color="grey", linestyle="--", linewidth=1)
    ax.text(
        ax.get_xlim()[0], 100 * slo.attainment + 1, f" target {slo.attainment:.0%}", color="grey", fontsize=8
    )
    ax.set_ylim(-3, 103)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_title(
        f"SLO attainment: TTFT <= {slo.ttft_ms:g} ms and ITL ({slo.itl_judgement}) <= {slo.itl_ms:g} ms",
        fontsize=10,
    )
    fig.suptitle(_banner(result), fontsize=8, y=0.995, wrap=True)
    ax.grid(True, alpha=0.3)
    _legend(ax, "lower left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _slo_line(ax: Any, limit_ms: float) -> None:
    """The SLO as a dashed line where it is at most twice the data's range (the axis stretched to show it);
    further out, the axis keeps the data's scale (a far SLO would squeeze every point to the left) and an arrow
    at the right edge says where the SLO is."""
    ax.set_xlim(left=0)
    right = ax.get_xlim()[1]
    if limit_ms <= 2 * right:
        ax.set_xlim(right=max(right, 1.05 * limit_ms))
        ax.axvline(limit_ms, color="grey", linestyle="--", linewidth=1)
        return
    ax.set_xlabel(f"{ax.get_xlabel()}; SLO {limit_ms:g} ms is off the scale \u2192")


def _legend(ax: Any, loc: str) -> None:
    # no line to name (every request failed): matplotlib would warn "No artists with labels found"
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc=loc)


def pick_rate(result: BenchResult) -> float | None:
    """The rate for the distribution plot: the best goodput of any shape (where the shapes differ most
    usefully: one still meets the SLO), else the highest rate every measured shape completed."""
    goods = [g for s in result.shapes if (g := s.goodput.get(result.slo.itl_judgement)) is not None]
    if goods:
        return max(goods)
    sets = [{r.rate for r in s.rates if not r.partial} for s in result.shapes if s.rates]
    if not sets:
        return None
    common = set.intersection(*sets)
    return max(common) if common else max(set.union(*sets))


def _at(rates: list[RateResult], rate: float) -> RateResult | None:
    return next((r for r in rates if r.rate == rate), None)


def plot_latency(result: BenchResult, path: Path, rate: float | None = None) -> Path | None:
    """CDFs of TTFT and of per-token gaps at one rate, one line per shape, with the SLO targets marked."""
    rate = rate if rate is not None else pick_rate(result)
    if rate is None:
        return None
    fig = latency_figure(result, rate)
    fig.savefig(path)
    pyplot().close(fig)
    return path


def latency_figure(result: BenchResult, rate: float) -> Any:
    """The figure plot_latency saves (a matplotlib Figure)."""
    plt = pyplot()
    fig, (ax_t, ax_i) = plt.subplots(1, 2, figsize=(10, 4.2), dpi=110)
    split = len(routes(result)) > 1  # one line per shape and route once the proxy reports several routes
    for shape in result.shapes:
        at = _at(shape.rates, rate)
        if at is None:
            continue
        for route in routes(result) if split else [None]:
            ok = [r for r in at.requests if r.success and r.measured and route in (None, r.route)]
            ttfts = sorted(1000 * r.chunk_times_s[0] for r in ok)
            gaps = sorted(1000 * g for r in ok for g in token_gaps(r.chunk_times_s, r.chunk_tokens))
            for ax, values in ((ax_t, ttfts), (ax_i, gaps)):
                if values:
                    ys = [(i + 1) / len(values) for i in range(len(values))]
                    ax.step(values, ys, where="post", label=f"{shape.name} ({route})" if split else shape.name)
    ax_t.set_xlabel("TTFT (ms)")
    _slo_line(ax_t, result.slo.ttft_ms)
    ax_i.axvline(result.slo.itl_ms, color="grey", linestyle="--", linewidth=1)
    ax_i.set_xlabel("inter-token gap (ms)")
    ax_i.set_xscale("symlog", linthresh=10)
    ax_i.set_xlim(left=0)
    top = ax_i.get_xlim()[1]
    ax_i.set_xticks([t for t in (0, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000) if t <= top])
    ax_i.set_xticklabels([f"{t:g}" for t in ax_i.get_xticks()])
    for ax in (ax_t, ax_i):
        ax.set_ylabel("share of requests" if ax is ax_t else "share of gaps")
        ax.grid(True, alpha=0.3)
        _legend(ax, "lower right")
        ax.set_ylim(0, 1.02)
    fig.suptitle(f"Latency distributions at {rate:g} req/s\n{_banner(result)}", fontsize=9, wrap=True)
    fig.tight_layout()
    return fig
