"""How long the everyday commands take: `pdctl --help` and `pdctl status` against a running deployment, and
`pdctl up` and `pdctl down` of a simulated node.

    .venv/bin/python benchmarks/cli_latency.py [--runs 20] [--lifecycle-runs 5] [--config FILE] [--against TREE]

Without `--config` it brings up a deployment of simulated engines under supervisord (settings, state and
ports of its own in a tmp folder, never /etc/pdctl), runs each command `--runs` times as an operator's loop
would (a fresh `pdctl` process each time) and prints the median, min and max wall time in seconds, and the
median CPU time (user + system) the command used, which other jobs on a shared machine disturb less; then it
takes the deployment down. With `--config` it measures the node that file deploys and leaves it running.
`--against TREE` also times another source tree of pdctl (e.g. `git archive main | tar -x -C /tmp/base`) on the
same deployment, its runs interleaved with this tree's so that both see the same load on a shared machine.
`pdctl status --json (in process)` is what one status costs once Python and pdctl are loaded: the command run
again in a process that already ran it (its asking of the manager, the engines and the proxy, and the document):
on a loaded machine the fresh processes' wall time is mostly the run queue's, which hides a change there.
Without `--config` it also brings up and takes down a node of its own `--lifecycle-runs` times (each tree's in
turn): an operator waits for both, and most tests of the suite pay both.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.pdctl import write_config  # noqa: E402

COMMANDS: dict[str, list[str]] = {"pdctl --help": ["--help"], "pdctl status": ["status"],
                                  "pdctl status --json": ["status", "--json"]}


def require_pdctl() -> None:
    """Exit with one line where this Python lacks pdctl's dependencies (they are in the project's .venv)."""
    import importlib.metadata as metadata
    import re

    # the unconditional ones (a marker names an extra or another Python's backport)
    names = [re.split(r"[^A-Za-z0-9._-]", r, maxsplit=1)[0] for r in metadata.requires("pdctl") or [] if ";" not in r]
    for name in names:
        try:
            metadata.version(name)
        except metadata.PackageNotFoundError:
            sys.exit(f"cli_latency.py: pdctl's dependency {name} is not installed for {sys.executable}: run it with "
                     "the project's Python, `.venv/bin/python benchmarks/cli_latency.py` (./scripts/test makes it)")


def _pdctl(config: Path, args: list[str], env: dict[str, str], tree: Path = ROOT) -> subprocess.CompletedProcess[str]:
    # `python -m appliance` from `tree`: what the `pdctl` console script runs, for either source tree
    return subprocess.run([sys.executable, "-m", "appliance", "--config", str(config), *args], capture_output=True,
                          text=True, env=dict(env, PYTHONPATH=str(tree)), cwd=tree, timeout=120)


# Runs `pdctl status --json` once (loading everything), then times `runs` more in the same process: wall and CPU.
_IN_PROCESS = """
import contextlib, io, json, sys, time
from appliance.cli.main import main
runs = int(sys.argv.pop(1))
def once():
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            main(sys.argv[1:])
        except SystemExit:
            pass
once()
out = []
for _ in range(runs):
    start, cpu = time.perf_counter(), time.process_time()
    once()
    out.append((time.perf_counter() - start, time.process_time() - cpu))
print(json.dumps(out))
"""


def in_process(config: Path, runs: int, env: dict[str, str], trees: dict[str, Path]) -> dict[str, list[tuple[float, float]]]:
    """(wall, CPU) seconds of `pdctl status --json` run again in a process that has run it, per tree; the trees
    take turns, 5 runs at a time."""
    out: dict[str, list[tuple[float, float]]] = {}
    for _ in range(0, runs, 5):
        for label, tree in trees.items():
            done = subprocess.run([sys.executable, "-c", _IN_PROCESS, "5", "--config", str(config), "status", "--json"],
                                  capture_output=True, text=True, env=dict(env, PYTHONPATH=str(tree)), cwd=tree,
                                  timeout=300)
            if done.returncode != 0:
                raise SystemExit(f"status in process ({tree}) exited {done.returncode}: {done.stderr.strip()}")
            name = "pdctl status --json (in process)"
            out.setdefault(f"{name} [{label}]" if len(trees) > 1 else name, []).extend(
                (wall, cpu) for wall, cpu in json.loads(done.stdout))
    return out


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(config: Path, runs: int, env: dict[str, str],
            trees: dict[str, Path]) -> dict[str, list[tuple[float, float]]]:
    """(wall, CPU) seconds of each command and tree over `runs` fresh processes (one warm-up run each, not
    counted)."""
    out: dict[str, list[tuple[float, float]]] = {}
    for name, args in COMMANDS.items():
        for tree in trees.values():
            _pdctl(config, args, env, tree)  # compiles the bytecode once, as an installed pdctl already has
        for _ in range(runs):
            for label, tree in trees.items():
                start, cpu = time.perf_counter(), _children_cpu()
                done = _pdctl(config, args, env, tree)
                out.setdefault(f"{name} [{label}]" if len(trees) > 1 else name, []).append(
                    (time.perf_counter() - start, _children_cpu() - cpu))
                if done.returncode != 0:
                    raise SystemExit(f"{name} ({tree}) exited {done.returncode}: {done.stderr.strip()}")
    return out


def lifecycle(runs: int, env: dict[str, str], trees: dict[str, Path], tmp: Path) -> dict[str, list[tuple[float, float]]]:
    """(wall, CPU) seconds of `pdctl up` and then `pdctl down` of a fresh simulated node, `runs` times per tree,
    the trees taking turns."""
    out: dict[str, list[tuple[float, float]]] = {}
    steps = {"pdctl up (simulated node)": ["--inventory", "sim:cpu", "up"], "pdctl down (simulated node)": ["down"]}
    for run in range(runs):
        for label, tree in trees.items():
            home = tmp / f"lifecycle-{label}-{run}"
            home.mkdir()
            config = write_config(home, home / "state")
            for name, args in steps.items():
                start, cpu = time.perf_counter(), _children_cpu()
                done = _pdctl(config, args, env, tree)
                out.setdefault(f"{name} [{label}]" if len(trees) > 1 else name, []).append(
                    (time.perf_counter() - start, _children_cpu() - cpu))
                if done.returncode != 0:
                    _pdctl(config, ["down"], env, tree)
                    raise SystemExit(f"{name} ({tree}) exited {done.returncode}: {done.stderr.strip()}")
    return out


def main(argv: list[str] | None = None) -> int:
    """Bring up a simulated node (unless --config), time the commands, print the figures."""
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--lifecycle-runs", type=int, default=5, help="up and down of a node of its own (0: none)")
    parser.add_argument("--config", type=Path, help="measure the node this settings file deploys")
    parser.add_argument("--against", type=Path, help="another pdctl source tree to time on the same deployment")
    args = parser.parse_args(argv)
    require_pdctl()
    # the commands see the host's GPUs as an operator's would (the inventory auto-detected); the simulated
    # deployment is planned for this node's CPU. Bytecode is written (the warm-up run) and used, as pip's
    # install of pdctl compiles it: with PYTHONDONTWRITEBYTECODE every run would compile pdctl's modules again.
    drop = ("PDCTL_CONFIG", "PDCTL_INVENTORY", "PYTHONDONTWRITEBYTECODE")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    with tempfile.TemporaryDirectory(prefix="pdctl-cli-latency-") as tmp:
        config = args.config
        if config is None:
            config = write_config(Path(tmp), Path(tmp) / "state")
            up = _pdctl(config, ["--inventory", "sim:cpu", "up"], env)
            if up.returncode != 0:
                raise SystemExit(f"pdctl up failed: {up.stdout}{up.stderr}")
        try:
            trees = {"this": ROOT, **({"against": args.against.resolve()} if args.against else {})}
            figures = measure(config, args.runs, env, trees) | in_process(config, args.runs, env, trees)
        finally:
            if args.config is None:
                _pdctl(config, ["down"], env)
        if args.config is None:
            figures |= lifecycle(args.lifecycle_runs, env, trees, Path(tmp))
    width = max(len(name) for name in figures)
    print(f"{'command':<{width}} {'median':>7} {'min':>7} {'max':>7} {'CPU':>7}  (seconds, {args.runs} runs, "
          f"up/down {args.lifecycle_runs if args.config is None else 0}, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f})")
    for name, runs in figures.items():
        wall = [w for w, _ in runs]
        cpu = statistics.median(c for _, c in runs)
        print(f"{name:<{width}} {statistics.median(wall):7.3f} {min(wall):7.3f} {max(wall):7.3f} {cpu:7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
