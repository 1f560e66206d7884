"""The amdsmi release matrix: each release's real Python package from the package index (pip install --target),
over a stand-in for the native libamd_smi.so compiled with gcc for that release's structure layouts.

Run as a script (scripts/test does) to prepare every release ahead of the tests; the tests call `prepare()`
themselves when a release is missing. Everything lands in a cache directory, rebuilt only when a release or
the stand-in's source changes:

    <cache>/<release>/site/amdsmi/...          the package, unmodified
    <cache>/<release>/rocm/lib/libamd_smi.so   the stand-in (ROCM_PATH=<cache>/<release>/rocm finds it)
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
# One release of each API generation pdctl meets: 6.0 (process handles), 6.1 and 6.2 (IO-link enum only),
# 6.3 and 6.4 (AmdSmiLinkType numbered XGMI=1, PCIE=2 beside the IO-link enum), 7.0 (renumbered, IO-link gone).
RELEASES = ("6.0.2", "6.1.2", "6.2.4", "6.3.3", "6.4.4", "7.0.2")
LATEST = RELEASES[-1]

# The fields the stand-in fills, by the C prefix layout.h gives them: (ctypes structure, field paths).
_STRUCTS = {
    "asic": (
        "amdsmi_asic_info_t",
        [
            "market_name",
            "vendor_id",
            "vendor_name",
            "subvendor_id",
            "device_id",
            "rev_id",
            "asic_serial",
            "oam_id",
            "num_of_compute_units",
            "target_graphics_version",
        ],
    ),
    "engine": ("amdsmi_engine_usage_t", ["gfx_activity", "umc_activity", "mm_activity"]),
    "proc": (
        "amdsmi_proc_info_t",
        [
            "name",
            "pid",
            "mem",
            "engine_usage.gfx",
            "engine_usage.enc",
            "memory_usage.gtt_mem",
            "memory_usage.cpu_mem",
            "memory_usage.vram_mem",
            "cu_occupancy",
        ],
    ),
    "version": ("amdsmi_version_t", ["major", "minor", "release", "build"]),
}

# Run inside the release's package, over the stubs-only library: where its ctypes structures put each field.
_LAYOUT_PROBE = r"""
import json, sys
from amdsmi import amdsmi_interface as i, amdsmi_wrapper as w
structs = json.loads(sys.argv[1])
# 6.0 lists process handles to pass to amdsmi_get_gpu_process_info; later releases list the records.
out = {"handles": hasattr(i, "amdsmi_get_gpu_process_info")}
for prefix, (name, fields) in structs.items():
    struct = getattr(w, name)
    out[f"SIZE_{prefix}"] = __import__("ctypes").sizeof(struct)
    for path in fields:
        kind, offset, size = struct, 0, -1
        for part in path.split("."):
            field = getattr(kind, part, None)
            if field is None:
                offset = -1
                break
            offset += field.offset
            size = field.size
            kind = dict((f[0], f[1]) for f in kind._fields_)[part]
        key = path.replace(".", "_")
        out[f"OFF_{prefix}_{key}"] = offset
        out[f"LEN_{prefix}_{key}"] = size
print(json.dumps(out))
"""


@dataclass(frozen=True)
class Release:
    """One prepared release: the package directory for sys.path and the directory for ROCM_PATH."""

    version: str
    site: Path
    rocm: Path

    @property
    def library(self) -> Path:
        """The stand-in libamd_smi.so built for this release."""
        return self.rocm / "lib" / "libamd_smi.so"


# What the tests' `amdsmi` fixture is: call it as amdsmi(scenario, release=LATEST).
AmdSmi = Callable[..., Release]


def cache_root() -> Path:
    """$PDCTL_TEST_AMDSMI_CACHE, else .cache/amdsmi-releases in the repository (git ignores .cache)."""
    return Path(os.environ.get("PDCTL_TEST_AMDSMI_CACHE") or REPO / ".cache" / "amdsmi-releases")


def _source_stamp(version: str) -> str:
    digest = hashlib.sha256(version.encode())
    for name in ("libamd_smi.c", "amdsmi_matrix.py"):
        digest.update((HERE / name).read_bytes())
    return digest.hexdigest()


def _stubs(wrapper: Path) -> str:
    """A weak stub answering AMDSMI_STATUS_NOT_SUPPORTED for every symbol the package binds at import."""
    names = sorted(set(re.findall(r"_libraries\['libamd_smi\.so'\]\.(\w+)", wrapper.read_text())))
    return "".join(f"__attribute__((weak)) int {n}(void) {{ return 2; }}\n" for n in names)


def _gcc(out: Path, sources: list[Path], include: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    _run(
        [
            "gcc",
            "-shared",
            "-fPIC",
            "-O1",
            "-Wall",
            "-Werror",
            f"-I{include}",
            "-o",
            str(out),
            *map(str, sources),
        ]
    )


def _run(cmd: list[str], **kwargs: Any) -> str:
    """`cmd`'s output; a failure raises with what the command said (pip without the index, gcc errors)."""
    result = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        said = (result.stderr or result.stdout).strip()[-2000:]
        raise RuntimeError(f"{' '.join(cmd[:6])} ... failed: {said}")
    return result.stdout


def prepare(version: str, root: Path | None = None) -> Release:
    """Install release `version` and build its stand-in, unless the cache already holds both."""
    base = (root or cache_root()) / version
    base.mkdir(parents=True, exist_ok=True)
    release = Release(version, base / "site", base / "rocm")
    stamp = base / "stamp"
    want = _source_stamp(version)
    with (base / "lock").open("w") as lock:
        # scripts/test, a pytest run and a second pytest run may prepare the same release at once.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.is_file() and stamp.read_text() == want and release.library.is_file():
            return release
        if not release.site.is_dir():
            partial = base / "site.partial"
            shutil.rmtree(partial, ignore_errors=True)
            _run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                  "--target", str(partial), f"amdsmi=={version}"])  # fmt: skip
            partial.rename(release.site)
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            stubs = work / "stubs.c"
            stubs.write_text(_stubs(release.site / "amdsmi" / "amdsmi_wrapper.py"))
            # Stage 1: stubs only, enough for the package to import and show its structure layouts.
            _gcc(work / "stage1" / "lib" / "libamd_smi.so", [stubs], work)
            env = {**os.environ, "ROCM_PATH": str(work / "stage1"), "PYTHONPATH": str(release.site)}
            probe = _run([sys.executable, "-c", _LAYOUT_PROBE, json.dumps(_STRUCTS)], env=env, cwd=work)
            layout = json.loads(probe.splitlines()[-1])
            lines = [f"#define PROCESS_LIST_HANDLES {int(layout.pop('handles'))}"]
            lines += [f"#define {key} {value}" for key, value in sorted(layout.items())]
            (work / "layout.h").write_text("\n".join(lines) + "\n")
            # Stage 2: the stand-in's calls override the weak stubs. Replaced in one step: a process that
            # has the old library loaded keeps it.
            _gcc(work / "libamd_smi.so", [HERE / "libamd_smi.c", stubs], work)
            release.library.parent.mkdir(parents=True, exist_ok=True)
            os.replace(work / "libamd_smi.so", release.library)
        stamp.write_text(want)
    return release


def amdsmi_env(scenario: str, release: str = LATEST) -> dict[str, str]:
    """Environment that makes a child process's `import amdsmi` load `release` over the stand-in's `scenario`."""
    prepared = prepare(release)
    return {"PYTHONPATH": str(prepared.site), "ROCM_PATH": str(prepared.rocm), "AMDSMI_STAND_IN": scenario}


def main() -> None:
    """Prepare every release of the matrix (side by side: most of the time is the package index); print them."""
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=len(RELEASES)) as pool:
        releases = list(pool.map(prepare, RELEASES))
    print(f"amdsmi releases {', '.join(RELEASES)} ready in {releases[0].site.parents[1]} "
          f"({time.monotonic() - start:.1f} s)")  # fmt: skip


if __name__ == "__main__":
    main()
