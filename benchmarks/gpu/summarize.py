"""Summarise `benchmarks/gpu/run_step.sh` tarballs: each workload's attainment re-judged under several SLOs
(TTFT target x ITL target x judgement), and the KV hand-off figures each engine reported in its own
/metrics (vLLM's vllm:nixl_* histograms, differences between the snapshots taken around each workload).

    .venv/bin/python benchmarks/gpu/summarize.py OUT.json STEP.tar.gz [STEP.tar.gz ...]
    .venv/bin/python benchmarks/gpu/summarize.py --joins BENCH.json [BENCH.json ...]

Prints tables and writes every figure to OUT.json (small: no per-request data). `--joins` prints, per rate,
what a request joining the engine costs the streams already running there: the p99 of the gaps during
which another request joined (its first token came out, or was about to: the KV hand-off and the joining
step land there) against the p99 of every other gap, from the per-request token timings alone.
"""

from __future__ import annotations

import bisect
import json
import sys
import tarfile
from pathlib import Path
from typing import Any

from appliance.bench.analysis import JUDGEMENTS, Slo, attainment, goodput, percentile, token_gaps
from appliance.bench.results import BenchResult
from appliance.connector.nixl.stats import figures, totals

TTFT_MS = (1000.0, 2000.0, 3000.0)
ITL_MS = (30.0, 50.0)


def _members(path: Path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]


def _rates(result: BenchResult) -> list[dict[str, Any]]:
    """Per rate: the measured requests' latencies and attainment under every SLO."""
    out = []
    for shape in result.shapes:
        for rate in shape.rates:
            judged = [r for r in rate.requests if r.status != "interrupted" and r.measured]
            ok = [r for r in judged if r.success and r.chunk_times_s]
            ttft = [r.chunk_times_s[0] * 1e3 for r in ok]
            req_p99 = [percentile(token_gaps(r.chunk_times_s, r.chunk_tokens), 99) * 1e3 for r in ok if len(r.chunk_times_s) > 1]
            att = {
                f"ttft{t:g}/itl{i:g}/{j}": attainment(judged, Slo(ttft_ms=t, itl_ms=i), j)
                for t in TTFT_MS for i in ITL_MS for j in JUDGEMENTS
            }
            out.append({
                "rate": rate.rate, "partial": rate.partial, "measured": len(judged), "failed": len(judged) - len(ok),
                "ttft_ms_p50": round(percentile(ttft, 50), 1) if ttft else None,
                "ttft_ms_p90": round(percentile(ttft, 90), 1) if ttft else None,
                "request_itl_p99_ms_p50": round(percentile(req_p99, 50), 1) if req_p99 else None,
                "request_itl_p99_ms_p90": round(percentile(req_p99, 90), 1) if req_p99 else None,
                "attainment": {k: (None if v != v else round(v, 3)) for k, v in att.items()},
            })
    return out


def summarize(path: Path) -> dict[str, Any]:
    """One step's tarball: shape, per workload the rates and the KV figures per instance."""
    files = _members(path)
    shape = path.name.removesuffix(".tar.gz")
    snaps = {name.rsplit("metrics-", 1)[1][:-5]: json.loads(data)
             for name, data in files.items() if "/metrics-" in name}
    workloads = {}
    for name in sorted(files):
        if not name.endswith("/bench.json"):
            continue
        tag = name.split("/")[-2]
        result = BenchResult.model_validate_json(files[name])
        workloads[tag] = {"input_len": result.workload.input_len, "output_len": result.workload.output_len,
                          "rates": _rates(result), "kv_transfers": {}}
    # the snapshots are cumulative: each workload's figures are the difference to the one before it
    order = sorted(workloads, key=lambda t: snaps.get(t, {}).get("t", 0))
    previous = {inst: totals(text) for inst, text in snaps.get("up", {"instances": {}})["instances"].items()}
    for tag in order:
        kv = {}
        for inst, text in snaps.get(tag, {"instances": {}})["instances"].items():
            now = totals(text)
            if now is not None and now.get("xfer_s_count", 0) > (previous.get(inst) or {}).get("xfer_s_count", 0):
                kv[inst] = figures(now, previous.get(inst))
            previous[inst] = now
        workloads[tag]["kv_transfers"] = kv
    return {"shape": shape, "workloads": workloads}


def goodputs(step: dict[str, Any], tag: str) -> dict[str, float | None]:
    """Goodput (highest rate with every lower rate at >= 90 %) per SLO key; interrupted rates left out."""
    rates = [r for r in step["workloads"].get(tag, {}).get("rates", []) if not r["partial"]]
    keys = rates[0]["attainment"].keys() if rates else []
    return {k: goodput([(r["rate"], r["attainment"][k] if r["attainment"][k] is not None else float("nan"))
                        for r in rates], 0.9) for k in keys}


JOIN_WINDOW_S = 0.06  # a join's hand-off (post, pull, first step) lands within ~3 decode steps before its first token


def join_stalls(result: BenchResult) -> list[dict[str, Any]]:
    """Per rate: the p50/p99/max of gaps with a join inside against gaps without (ms), and their counts.

    Every request of the rate counts as a joiner (warm-up and drain arrivals join the same engine); only
    measured requests' gaps are judged. One engine per role is assumed (1P+1D, or colocated x1): with
    several decode instances a join elsewhere is counted too, which only makes "with" look better.
    """
    out = []
    for shape in result.shapes:
        for rate in shape.rates:
            done = [r for r in rate.requests if r.success and r.chunk_times_s]
            firsts = sorted(r.sent_s + r.chunk_times_s[0] for r in done)
            with_join: list[float] = []
            without: list[float] = []
            for r in done:
                if not r.measured or len(r.chunk_times_s) < 2:
                    continue
                mine = r.sent_s + r.chunk_times_s[0]
                times = [r.sent_s + t for t in r.chunk_times_s]
                for i in range(1, len(times)):
                    lo, hi = times[i - 1], times[i]
                    k = max(1, r.chunk_tokens[i])
                    # another request's first token in (lo, hi + window]: its hand-off and join fell in this gap
                    j = bisect.bisect_right(firsts, lo)
                    joined = any(f != mine for f in firsts[j:bisect.bisect_right(firsts, hi + JOIN_WINDOW_S)])
                    (with_join if joined else without).extend([(hi - lo) / k * 1e3] * k)

            def stats(gaps: list[float]) -> dict[str, float | int | None]:
                return {"n": len(gaps), "p50": round(percentile(gaps, 50), 1) if gaps else None,
                        "p99": round(percentile(gaps, 99), 1) if gaps else None,
                        "max": round(max(gaps), 1) if gaps else None}

            out.append({"shape": shape.name, "rate": rate.rate, "with_join": stats(with_join),
                        "without_join": stats(without), "all": stats(with_join + without)})
    return out


def print_joins(paths: list[Path]) -> None:
    """`--joins`: the join-stall table of each bench.json."""
    for path in paths:
        result = BenchResult.model_validate_json(path.read_text())
        w = result.workload
        for row in join_stalls(result):
            a, b, c = row["with_join"], row["without_join"], row["all"]
            ratio = f"{c['p99'] / b['p99']:.2f}" if c["p99"] and b["p99"] else "-"
            print(f"{path.name} {row['shape']} {w.input_len}/{w.output_len} @{row['rate']:g}: gaps with a join "
                  f"n={a['n']} p50/p99/max {a['p50']}/{a['p99']}/{a['max']} ms; without n={b['n']} p50/p99/max "
                  f"{b['p50']}/{b['p99']}/{b['max']} ms; all p99 {c['p99']} ms = {ratio}x the p99 without joins")


def main(argv: list[str]) -> None:
    """Summarise the tarballs named on the command line into argv[0] (JSON) and print the tables."""
    if argv and argv[0] == "--joins":
        print_joins([Path(p) for p in argv[1:]])
        return
    out, paths = Path(argv[0]), [Path(p) for p in argv[1:]]
    steps = [summarize(p) for p in paths]
    for step in steps:
        for tag, w in step["workloads"].items():
            print(f"\n{step['shape']} {w['input_len']}/{w['output_len']}")
            for r in w["rates"]:
                a = r["attainment"]
                print(f"  {r['rate']:>4}{'*' if r['partial'] else ' '} n={r['measured']:>3} TTFT p50/p90 "
                      f"{r['ttft_ms_p50']}/{r['ttft_ms_p90']} ms, request ITL p99 p50/p90 {r['request_itl_p99_ms_p50']}/"
                      f"{r['request_itl_p99_ms_p90']} ms; attainment p99 (TTFT 1s/2s/3s, ITL 50): "
                      f"{a['ttft1000/itl50/p99']} {a['ttft2000/itl50/p99']} {a['ttft3000/itl50/p99']}; ITL 30: "
                      f"{a['ttft1000/itl30/p99']} {a['ttft2000/itl30/p99']} {a['ttft3000/itl30/p99']}")
            for inst, kv in w["kv_transfers"].items():
                print(f"  KV {inst}: {kv}")
            step["workloads"][tag]["goodput"] = goodputs(step, tag)
    out.write_text(json.dumps(steps, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
