"""Helpers for the bench tests: start real processes, run pdctl as a subprocess, pick free ports."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

PY = sys.executable
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def start(argv: list[str], ready: re.Pattern[str], log: Path) -> tuple[subprocess.Popen[str], re.Match[str]]:
    """Start a process and wait (generously) for the line that says where it listens."""
    with open(log, "w") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
    deadline = time.monotonic() + 60
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if m := ready.search(line):
            return proc, m
    proc.kill()
    raise AssertionError(f"{argv[:4]} did not start: {log.read_text()[-2000:]}")


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def env_for(cwd: Path) -> dict[str, str]:
    """The environment of a pdctl run: an empty settings file, so the host's /etc/pdctl never leaks in."""
    (cwd / "pdctl.toml").touch()
    return {**os.environ, "PDCTL_CONFIG": str(cwd / "pdctl.toml")}


def pdctl(*args: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [PY, "-m", "appliance", *args], cwd=cwd, capture_output=True, text=True, timeout=240, env=env_for(cwd)
    )
    if check:
        assert done.returncode == 0, done.stdout + done.stderr
    return done
