#!/usr/bin/env python3
"""The long fault matrix: deploy each connector flow with `pdctl up` (supervisord, simulated engines, the
proxy), then run rounds of concurrent streaming requests while killing (SIGKILL) or hanging (SIGSTOP) the
prefill, the decode or the proxy at random points, or disconnecting clients at random points.

Prints: trials run, hung requests, leaked KV blocks, unclean errors, recovery time p50/p99.
Exit status 0 only when nothing hung, nothing leaked, no error was unclean and every fault recovered.

    .venv/bin/python scripts/faults.py --trials 10000            # the README figures
    .venv/bin/python scripts/faults.py --trials 300 --flows nixl-read --per-round 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.reliability.matrix import FLOWS, KINDS, Figures, RoundResult, format_summary, run_flow  # noqa: E402


def _kinds_for(rounds: int, offset: int) -> list[str]:
    """Every fault kind in turn, starting at `offset` so flows do not all start with the same fault."""
    return [KINDS[(offset + i) % len(KINDS)] for i in range(rounds)]


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run the flows (a few at a time) and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=1000, help="total client requests (trials) to run")
    parser.add_argument("--flows", default="moriio-read,moriio-write,nixl-read,example-read",
                        help=f"comma-separated, from {', '.join(FLOWS)}")
    parser.add_argument("--per-round", type=int, default=32, help="concurrent requests per round (one fault each)")
    parser.add_argument("--parallel", type=int, default=2, help="flows deployed at the same time")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--slack-s", type=float, default=3.0,
                        help="added to the configured timeouts before a request counts as hung")
    parser.add_argument("--max-minutes", type=float, default=60.0,
                        help="stop starting new rounds after this long (the figures say how many ran)")
    parser.add_argument("--json", dest="json_path", help="also write the figures as JSON here")
    parser.add_argument("--quiet", action="store_true", help="no line per round")
    args = parser.parse_args(argv)
    flows = [f.strip() for f in args.flows.split(",") if f.strip()]
    unknown = [f for f in flows if f not in FLOWS]
    if unknown or not flows:
        parser.error(f"unknown flow(s) {unknown}; choose from {', '.join(FLOWS)}")
    if args.trials < 1 or args.per_round < 1 or args.parallel < 1:
        parser.error("--trials, --per-round and --parallel must be at least 1")

    rounds_total = -(-args.trials // args.per_round)
    per_flow = [rounds_total // len(flows) + (1 if i < rounds_total % len(flows) else 0) for i in range(len(flows))]
    figures = Figures()
    started = time.monotonic()
    problems: list[str] = []
    harness_errors: list[str] = []

    def log(flow: str, result: RoundResult) -> None:
        bad = [t for t in result.trials if t.outcome in ("hung", "unclean")]
        if not args.quiet:
            rec = f"{result.recovery_s:.2f}s" if result.recovery_s is not None else "-"
            outcomes = {o: sum(1 for t in result.trials if t.outcome == o)
                        for o in sorted({t.outcome for t in result.trials})}
            print(f"[{time.monotonic() - started:7.1f}s] {flow:13s} {result.kind:13s} {json.dumps(outcomes)} "
                  f"recovery {rec} leaked {result.leaked_blocks} bad {len(bad)} "
                  f"({len(figures.trials)} trials)", flush=True)
        for t in bad:
            line = f"{flow} {result.kind}: {t.outcome}: status {t.status} {t.tokens} tokens: {t.detail}"
            problems.append(line)
            print("  BAD:", line, flush=True)

    async def run_all() -> None:
        queue = list(enumerate(flows))
        sem = asyncio.Semaphore(args.parallel)

        async def one(index: int, flow: str) -> None:
            async with sem:
                deadline = started + args.max_minutes * 60
                with tempfile.TemporaryDirectory(prefix=f"pdctl-faults-{flow}-") as tmp:
                    # rounds in chunks so one flow's deployment is fresh every 40 rounds (and a crash
                    # of the harness loses little)
                    todo = _kinds_for(per_flow[index], index)
                    for chunk_start in range(0, len(todo), 40):
                        if time.monotonic() > deadline:
                            print(f"{flow}: --max-minutes reached, no more rounds", flush=True)
                            break
                        await run_flow(flow, Path(tmp) / f"d{chunk_start}", todo[chunk_start:chunk_start + 40],
                                       args.per_round, args.seed * 1000 + index * 100 + chunk_start, figures,
                                       args.slack_s, log, deadline)

        # one flow's harness failure must not cancel the others (their deployments are torn down either way)
        outcomes = await asyncio.gather(*(one(i, f) for i, f in queue), return_exceptions=True)
        for (_, flow), outcome in zip(queue, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                harness_errors.append(f"{flow}: {type(outcome).__name__}: {outcome}")

    asyncio.run(run_all())
    summary = figures.summary()
    summary["wall_s"] = round(time.monotonic() - started, 1)
    summary["command"] = "scripts/faults.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print()
    print(format_summary(summary))
    print(f"wall time:         {summary['wall_s']} s ({summary['trials'] / max(summary['wall_s'], 1e-9):.1f} trials/s)")
    for line in figures.problems()[:50]:
        print("PROBLEM:", line)
    for line in harness_errors:
        print("HARNESS ERROR:", line)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(summary, indent=2) + "\n")
    ok = not figures.problems() and not harness_errors and summary["trials"] >= 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
