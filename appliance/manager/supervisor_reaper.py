"""pd-reaper: supervisord's event listener that ends what a program left behind when it ended.

supervisord ends a program's whole process group only when it stops the program itself and the main process
outlives the stop signal (stopasgroup/killasgroup). When the main process ends by itself (vLLM's API server
killed -9, OOM-killed, exiting 0 or 1), its children (vLLM's EngineCore, its workers) keep running beside the
restarted program: on a GPU node they keep the memory the new engine needs to load. supervisord starts each
program in its own process group (setpgrp: pgid == pid), so on the program's EXITED or STOPPED event this
listener SIGKILLs the group of the pid that ended. The restarted process leads a group of its own pid.

Run by supervisord (`[eventlistener:pd-reaper]` in supervisord.conf): `python -m appliance.manager.supervisor_reaper`.
"""

from __future__ import annotations

import os
import signal
import sys

from supervisor import childutils

# Events whose payload names the pid that ended (a BACKOFF's payload does not).
ENDED_EVENTS = ("PROCESS_STATE_EXITED", "PROCESS_STATE_STOPPED")


def group_left_behind(event: str, payload: str) -> tuple[str, int] | None:
    """(program, process group) to end for one supervisord event: the group of the pid that ended, or None."""
    if event not in ENDED_EVENTS:
        return None
    fields = childutils.get_headers(payload.strip())
    pid = fields.get("pid", "")
    if not pid.isdigit() or int(pid) <= 1:
        return None
    return f"{fields.get('groupname', '')}:{fields.get('processname', '')}", int(pid)


def end_group(pgid: int) -> str:
    """SIGKILL every process of group `pgid`; what was done, in words. Never the reaper's or supervisord's own
    group, nor one whose id names a live process: a group's id is not reused while the group has members, so a
    live process of that pid is a new one, leading a group of its own."""
    if pgid in (os.getpgrp(), os.getpgid(os.getppid())):
        return f"left process group {pgid} alone: it is supervisord's or the reaper's"
    try:
        os.kill(pgid, 0)
    except ProcessLookupError:
        pass
    except PermissionError:
        return f"left process group {pgid} alone: pid {pgid} was reused by another user's process"
    else:
        return f"left process group {pgid} alone: pid {pgid} was reused by a new process"
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return f"nothing left in process group {pgid}"
    return f"SIGKILL sent to what was left in process group {pgid}"


def main() -> None:
    """Answer supervisord's events forever; never fail one (a failed event is sent again, and again)."""
    while True:
        headers, payload = childutils.listener.wait(sys.stdin, sys.stdout)
        try:
            ended = group_left_behind(headers.get("eventname", ""), payload)
            if ended is not None:
                program, pgid = ended
                print(f"{program} (pid {pgid}) ended: {end_group(pgid)}", file=sys.stderr, flush=True)
        except Exception as exc:  # whatever went wrong, supervisord's event flow goes on
            print(f"could not handle {headers!r} {payload!r}: {exc!r}", file=sys.stderr, flush=True)
        childutils.listener.ok(sys.stdout)


if __name__ == "__main__":
    main()
