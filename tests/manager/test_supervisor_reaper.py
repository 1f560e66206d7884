"""The pd-reaper event listener, run as supervisord runs it (a real process speaking supervisor's listener
protocol on its stdin/stdout) against real process groups."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import psutil
import pytest

from appliance.manager.supervisor_reaper import group_left_behind
from tests.support.waiting import wait_until

_SLEEPER = [sys.executable, "-c", "import signal; signal.pause()"]


@pytest.fixture
def reaper() -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen([sys.executable, "-m", "appliance.manager.supervisor_reaper"], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == "READY\n"
    yield proc
    proc.kill()
    proc.wait()


def _event(reaper: subprocess.Popen[str], event: str, payload: str) -> None:
    """Send one event as supervisord does; the reaper must answer OK and be ready for the next."""
    assert reaper.stdin is not None and reaper.stdout is not None
    head = f"ver:3.0 server:supervisor serial:1 pool:pd-reaper poolserial:1 eventname:{event} len:{len(payload)}\n"
    reaper.stdin.write(head + payload)
    reaper.stdin.flush()
    assert reaper.stdout.readline() == "RESULT 2\n"
    assert reaper.stdout.read(2) == "OK"
    assert reaper.stdout.readline() == "READY\n"


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _orphan() -> tuple[int, int]:
    """(the dead leader's pid = its group's id, a child left running in that group)."""
    spawn = f"import subprocess; print(subprocess.Popen({_SLEEPER!r}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)"
    leader = subprocess.run([sys.executable, "-c", spawn], capture_output=True, text=True, start_new_session=True,
                            check=True)
    child = int(leader.stdout)
    return os.getpgid(child), child


def test_it_kills_what_an_ended_program_left_in_its_group_and_nothing_else(reaper) -> None:
    group, child = _orphan()
    bystander = subprocess.Popen(_SLEEPER, start_new_session=True)  # a live leader: a restarted program
    try:
        payload = f"processname:pd-decode-0 groupname:pd from_state:RUNNING expected:0 pid:{bystander.pid}"
        _event(reaper, "PROCESS_STATE_EXITED", payload)
        assert bystander.poll() is None and not _gone(child)
        _event(reaper, "PROCESS_STATE_EXITED", f"processname:pd-decode-0 groupname:pd from_state:RUNNING "
                                               f"expected:0 pid:{group}")
        wait_until(lambda: _gone(child), what="the orphan to be killed")
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
        if not _gone(child):
            psutil.Process(child).kill()


def test_bad_events_are_answered_ok_and_it_keeps_going(reaper) -> None:
    for event, payload in [("PROCESS_STATE_EXITED", "garbage"), ("PROCESS_STATE_EXITED", "pid:1"),
                           ("PROCESS_STATE_STOPPED", "pid:abc"), ("PROCESS_STATE_EXITED", "pid:0 x"),
                           ("PROCESS_STATE_EXITED", "pid:99999999999999999999"), ("TICK_5", "when:1"),
                           ("PROCESS_STATE_EXITED", "\x00\xff:: :")]:
        _event(reaper, event, payload)
    assert reaper.poll() is None


@pytest.mark.parametrize(("event", "payload", "wanted"), [
    ("PROCESS_STATE_EXITED", "processname:a groupname:pd from_state:RUNNING expected:1 pid:42", ("pd:a", 42)),
    ("PROCESS_STATE_STOPPED", "processname:a groupname:pd from_state:STOPPING pid:7", ("pd:a", 7)),
    ("PROCESS_STATE_BACKOFF", "processname:a groupname:pd from_state:STARTING tries:1", None),
    ("PROCESS_STATE_EXITED", "processname:a groupname:pd pid:1", None),
    ("PROCESS_STATE_EXITED", "processname:a groupname:pd pid:0", None),
    ("PROCESS_STATE_RUNNING", "processname:a groupname:pd from_state:STARTING pid:42", None),
])
def test_which_group_an_event_names(event: str, payload: str, wanted: tuple[str, int] | None) -> None:
    assert group_left_behind(event, payload) == wanted
