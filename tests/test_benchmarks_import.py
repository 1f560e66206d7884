"""Every benchmark and script in the repository still imports: a helper they use that moved or was removed (a
merge that dropped `tests.engine.vllm_helpers.example_kv_config` while benchmarks/kv_store_cpu.py used it) shows
here, not the next time someone runs the benchmark."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "benchmarks" / "harness.py"
MODULES = sorted([*ROOT.glob("benchmarks/*.py"), *ROOT.glob("benchmarks/gpu/*.py"), *ROOT.glob("scripts/*.py")])


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(ROOT)) for p in MODULES])
def test_it_imports(path: Path) -> None:
    name = f"_bench_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)  # defines; `main()` runs only as __main__
    finally:
        sys.modules.pop(name, None)
    # benchmarks/harness.py holds what the benchmarks share: it is imported, not run
    assert callable(getattr(module, "main", None)) or path.parent.name == "scripts" or path == HARNESS, \
        f"{path} has no main()"


def _usage_lines(path: Path) -> list[str]:
    doc = (path.read_text().split('"""', 2)[1:2] or [""])[0]
    return [line.strip() for line in doc.splitlines() if re.match(r"\s+(\S+=\S+ )*\S*python3? (benchmarks|scripts)/", line)]


# what runs pdctl's own code (a GPU machine's vLLM Python runs the other gpu/ probes, which import none of it)
PDCTL_USERS = [p for p in MODULES if re.search(r"^(from|import) (appliance|tests|benchmarks)", p.read_text(), re.M)]


@pytest.mark.parametrize("path", PDCTL_USERS, ids=[str(p.relative_to(ROOT)) for p in PDCTL_USERS])
def test_its_usage_line_names_the_projects_python(path: Path) -> None:
    """Issue 37: `python benchmarks/cli_latency.py`, as its docstring said, ran the system's Python, which has
    none of pdctl's dependencies (a traceback)."""
    assert all(" .venv/bin/python " in f" {line} " for line in _usage_lines(path)), _usage_lines(path)


def test_cli_latency_says_in_one_line_what_python_to_use(tmp_path: Path) -> None:
    """Run as a user might, with a Python that lacks pdctl's dependencies; and its --help ends a sentence."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True)
    script = ROOT / "benchmarks" / "cli_latency.py"
    done = subprocess.run([str(tmp_path / "bare" / "bin" / "python"), str(script), "--runs", "1",
                           "--lifecycle-runs", "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and ".venv/bin/python benchmarks/cli_latency.py" in done.stderr
    shown = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, check=True)
    description = " ".join(shown.stdout.split("\n\n")[1].split())
    assert description.endswith("of a simulated node."), description
