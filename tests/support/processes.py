"""Real processes for the tests: one started child with its output in a log file, waited for by the line it
prints when ready or by its HTTP answer, and stopped with SIGTERM (SIGKILL when it does not go)."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# a slow, loaded 2-core box: process start-up (imports) can take several seconds
START_TIMEOUT_S = 60.0


def http_status(url: str, timeout: float = 2.0) -> int:
    """GET url; the status, or 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0


class Proc:
    """A child process. With `ready_line` its stdout is kept for the line that says it is ready and only its
    stderr goes to the log; otherwise both go to the log file `<log_dir>/<name>.log`."""

    def __init__(self, name: str, argv: list[str], log_dir: Path, *, ready_line: bool = False,
                 env: dict[str, str] | None = None, cwd: Path = ROOT, session: bool = False) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = self.log_path.open("wb")
        self.popen = subprocess.Popen(
            argv, cwd=cwd, stdout=subprocess.PIPE if ready_line else self._log,
            stderr=self._log if ready_line else subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, start_new_session=session,
        )
        self.session = session
        self.ready_line = ""

    def read_line(self, pattern: re.Pattern[str] | None = None, timeout: float = START_TIMEOUT_S) -> str:
        """The first stdout line (matching `pattern`, when given); fails when the process exits or is silent."""
        assert self.popen.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise AssertionError(f"{self.name} printed no ready line in {timeout:g}s: {self.log_tail()}")
            readable, _, _ = select.select([self.popen.stdout], [], [], left)
            if not readable:
                continue
            line = self.popen.stdout.readline().decode()
            if not line:
                self.popen.wait(timeout=10)
                raise AssertionError(f"{self.name} exited with {self.popen.returncode}: {self.log_tail()}")
            if pattern is None or pattern.search(line):
                return line.strip()

    def wait_ready(self) -> None:
        """Block until the process printed its ready line (it starts while others do)."""
        if not self.ready_line:
            self.ready_line = self.read_line()
            self._on_ready()

    def _on_ready(self) -> None:
        pass

    def wait_http(self, url: str, timeout: float = 90.0, any_answer: bool = False) -> None:
        """Wait until `url` answers 200 (or, with any_answer, answers at all); fail when the process exits."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive:
                raise AssertionError(f"{self.name} exited: {self.log_tail(2000)}")
            status = http_status(url)
            if status == 200 or (status and any_answer):
                return
            time.sleep(0.1)
        raise AssertionError(f"{self.name} not ready at {url}: {self.log_tail(2000)}")

    def output(self) -> str:
        """Everything the process logged so far."""
        self._log.flush()
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, n: int = 3000) -> str:
        """The end of the process's log."""
        return self.output()[-n:]

    @property
    def alive(self) -> bool:
        """True while the process runs."""
        return self.popen.poll() is None

    def _signal(self, sig: int) -> None:
        if self.session:
            os.killpg(self.popen.pid, sig)  # the whole session: a launcher's children go too
        else:
            self.popen.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL: the process dies the way a crashed engine does."""
        if self.alive:
            self._signal(signal.SIGKILL)
        self.popen.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it does not exit."""
        if self.alive:
            self._signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.popen.wait(timeout=15)
        if self.popen.stdout is not None:
            self.popen.stdout.close()
        self._log.close()
