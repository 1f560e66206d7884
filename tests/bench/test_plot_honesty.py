"""What bench's figures and tables say is true of the run: the axes fit the data, the banner names the
workload and the token lengths its requests really had, and a table's title stays on one line."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from appliance.bench.analysis import Slo
from appliance.bench.plots import latency_figure, plot_attainment, plot_latency
from appliance.bench.report import goodput_table
from appliance.bench.results import BenchResult, RateResult, RequestResult, ShapeResult, Workload, summarize

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _result(ttft_s: float) -> BenchResult:
    """A multi-turn run whose prompts grew from 64 to 160 tokens, every TTFT near `ttft_s`."""
    slo = Slo(ttft_ms=5000, itl_ms=100)
    requests = [RequestResult(index=i, request_id=f"r{i}", status="ok", success=True, scheduled_s=i / 10,
                              sent_s=i / 10, chunk_times_s=[ttft_s + i / 1000 + k / 50 for k in range(4)],
                              chunk_tokens=[1] * 4, latency_s=ttft_s + 0.1, prompt_tokens=64 + 32 * (i % 4),
                              output_tokens=4, conversation=f"c{i // 4}", turn=i % 4 + 1)
                for i in range(12)]
    rate = RateResult(rate=10.0, seed=1, started_at="now", duration_s=2.0, requests=requests,
                      summary=summarize(requests, slo, 2.0))
    return BenchResult(created="now", command="pdctl bench", engine="sim", slo=slo,
                       workload=Workload(model="m", input_len=64, output_len=4, num_requests=12, rates=[10.0],
                                         seed=1, prompt="tokens", workload="multi-turn:turns=4"),
                       shapes=[ShapeResult(name="deployment", rates=[rate], goodput={"max": 10.0})])


def test_the_ttft_axis_fits_the_data_and_marks_a_far_slo(tmp_path: Path) -> None:
    fig = latency_figure(_result(0.12), 10.0)
    ttft = fig.axes[0]
    assert ttft.get_xlim()[1] < 1000, ttft.get_xlim()  # the points span 120-131 ms, not a sliver of 5,000
    assert "SLO 5000 ms is off the scale" in ttft.get_xlabel(), ttft.get_xlabel()
    near = latency_figure(_result(3.0), 10.0).axes[0]  # an SLO inside the data's range is a line
    assert any(list(line.get_xdata()) == [5000, 5000] for line in near.get_lines())
    assert plot_latency(_result(0.12), tmp_path / "latency.png", 10.0).read_bytes()[:8] == PNG_MAGIC


def test_every_figure_names_the_workload_and_its_real_prompt_lengths(tmp_path: Path) -> None:
    title = latency_figure(_result(0.12), 10.0).texts[0].get_text()  # the suptitle
    assert "workload multi-turn:turns=4" in title and "64-160 in / 4 out" in title, title
    assert "64 in" not in title
    assert plot_attainment(_result(0.12), tmp_path / "attainment.png").read_bytes()[:8] == PNG_MAGIC


def test_the_goodput_tables_title_stays_on_one_line_at_80_columns() -> None:
    console = Console(record=True, width=80)
    console.print(goodput_table(_result(0.12)))
    first = console.export_text().splitlines()[0]
    assert first.strip().startswith("goodput") and first.strip().endswith("ITL <= 100 ms"), first
