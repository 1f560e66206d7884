"""benchmarks/crash_bench.py's quick mode, one cell (kill -KILL of the keeper, a pooled client, real supervisord and
simulated engines): its table is well formed and its figures add up; the keeper's crash fails and cuts nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support.processes import ROOT

BENCH = ROOT / "benchmarks" / "crash_bench.py"


def _table(stdout: str) -> list[dict[str, str]]:
    """The Markdown table the benchmark prints last, as one dict a row."""
    lines = [line for line in stdout.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert set(lines[1].strip("|").split("|")) == {"---"}, lines[1]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert all(len(row) == len(header) for row in rows), rows
    return [dict(zip(header, row, strict=True)) for row in rows]


def test_the_quick_mode_of_one_case_prints_a_consistent_table(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, str(BENCH), "--quick", "--managers", "supervisor", "--faults", "KILL-keeper",
                           "--clients", "pooled", "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "load average at the start:" in done.stdout and "load average at the end:" in done.stdout
    (row,) = _table(done.stdout)
    assert list(row) == ["manager", "fault", "client", "sent", "ok", "failed", "cut", "held", "continued",
                         "recovery_s"]
    assert (row["manager"], row["fault"], row["client"]) == ("supervisor", "KILL-keeper", "pooled")
    sent, ok, failed, cut = (int(row[k]) for k in ("sent", "ok", "failed", "cut"))
    assert sent == ok + failed + cut
    assert ok >= 6  # the quick mode's 3 before the fault and 3 after the keeper was back
    assert (failed, cut) == (0, 0), done.stdout  # the guarantee: the proxy serves on while its keeper is restarted
    assert row["held"].isdigit() and (row["continued"] == "n/a" or row["continued"].isdigit())
    assert float(row["recovery_s"]) > 0
    (saved,) = json.loads(out.read_text())
    assert {k: str(v) if v is not None else "n/a" for k, v in saved.items() if k in row} == row
