"""The fault matrix in CI: every connector flow (MORI-IO READ and WRITE, NIXL, ExampleConnector) deployed by
`pdctl up` on a real supervisord with simulated engines; per flow one round of each fault (client
disconnects; SIGKILL and SIGSTOP of prefill, decode and proxy) with 16 concurrent requests. The long run
with the published figures is scripts/faults.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.reliability.matrix import KINDS, Figures, format_summary, run_flow

FLOWS = ("moriio-read", "moriio-write", "nixl-read", "example-read")
PER_ROUND = 16


def test_fault_matrix(tmp_path: Path) -> None:
    figures: dict[str, Figures] = {flow: Figures() for flow in FLOWS}

    async def scenario() -> None:
        # all flows at once: most of a round is spent waiting for a restart, which overlaps well
        await asyncio.gather(*(
            run_flow(flow, tmp_path / flow, list(KINDS), PER_ROUND, seed=100 + i, figures=figures[flow])
            for i, flow in enumerate(FLOWS)
        ))

    asyncio.run(scenario())
    total = Figures()
    for flow, fig in figures.items():
        for result in fig.rounds:
            total.add(flow, result)
    summary = total.summary()
    print("\n" + format_summary(summary))
    for line in total.problems():
        print("PROBLEM:", line)

    assert total.problems() == []
    assert summary["trials"] == len(FLOWS) * len(KINDS) * PER_ROUND
    assert summary["hung"] == 0 and summary["leaked_blocks"] == 0 and summary["unclean_errors"] == 0
    for flow, fig in figures.items():
        kinds = [r.kind for r in fig.rounds]
        assert kinds == list(KINDS), flow
        kills = [r for r in fig.rounds if r.kind.startswith("kill")]
        # supervisord started a new process for every kill, and the proxy served a request again after it
        assert all(r.restarted is True and r.recovered and r.recovery_s is not None for r in kills), flow
        # the faults did hit requests in flight: some ended in a clean error, some still succeeded
        outcomes = {t.outcome for t in fig.trials}
        assert "success" in outcomes and "clean_error" in outcomes, (flow, outcomes)
