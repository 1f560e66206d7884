"""Every benchmark and script in the repository still imports: a helper they use that moved or was removed (a
merge that dropped `tests.engine.vllm_helpers.example_kv_config` while benchmarks/kv_store_cpu.py used it) shows
here, not the next time someone runs the benchmark."""

from __future__ import annotations

import importlib.util
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
