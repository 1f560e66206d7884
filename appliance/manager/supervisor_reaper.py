"""pd-reaper: supervisord's event listener that ends what a program left behind when it ended.

supervisord ends a program's whole process group only when it stops the program itself and the main process
outlives the stop signal (stopasgroup/killasgroup). When the main process ends by itself (vLLM's API server
killed -9, OOM-killed, exiting 0 or 1), its children (vLLM's EngineCore, its workers) keep running beside the
restarted program: on a GPU node they keep the memory the new engine needs to load. supervisord starts each
program in its own process group (setpgrp: pgid == pid), so on the program's EXITED or STOPPED event this
listener SIGKILLs the group of the pid that ended. The restarted process leads a group of its own pid.

An engine that ended by itself (EXITED: a crash, a kill, an exit; supervisord restarts it) is also reported to
the proxy as a stop (`--admin`), as the systemd units' ExecStopPost hook does after a crash: the proxy sends it no
new request, and while its role has no other instance new requests wait (at most `--hold` s) until it answers
/health again, instead of failing.

Run by supervisord (`[eventlistener:pd-reaper]` in supervisord.conf):
`python -m appliance.manager.supervisor_reaper [--admin URL --token-file FILE --hold S --expires S]`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from supervisor import childutils

from appliance.errors import PdctlError
from appliance.proxy.admin_client import AdminClient
from appliance.render.names import unit_instance

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


def crashed_instance(event: str, payload: str) -> str | None:
    """The engine instance whose process ended by itself (EXITED; supervisord restarts it), or None."""
    if event != "PROCESS_STATE_EXITED":
        return None
    return unit_instance(childutils.get_headers(payload.strip()).get("processname", ""))


def tell_proxy(admin: AdminClient, instance: str, hold_s: float, expires_s: float) -> str:
    """Report a crashed instance to the proxy as a stop with no drain (its requests ended with it); in words."""
    try:
        answer = admin.stopping(instance, hold_s, 0, expires_s, crashed=True)
    except (PdctlError, OSError) as exc:
        return f"the proxy was not told ({exc})"
    held = "its role's new requests wait for it" if answer.get("holding") else "its role has another instance"
    return f"the proxy was told: {held}"


def _args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m appliance.manager.supervisor_reaper")
    parser.add_argument("--admin", help="the proxy's admin API base URL: report engines that ended by themselves")
    parser.add_argument("--token-file", help="the proxy's admin token file")
    parser.add_argument("--hold", type=float, default=120.0, help="seconds a held request may wait")
    parser.add_argument("--expires", type=float, default=1890.0, help="seconds after which the stop lapses")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Answer supervisord's events forever; never fail one (a failed event is sent again, and again)."""
    args = _args(argv)
    admin = AdminClient(args.admin, token_file=args.token_file, timeout=5) if args.admin else None
    while True:
        headers, payload = childutils.listener.wait(sys.stdin, sys.stdout)
        try:
            event = headers.get("eventname", "")
            crashed = crashed_instance(event, payload) if admin is not None else None
            if admin is not None and crashed is not None:
                # first: requests arriving while it is away wait rather than fail
                said = tell_proxy(admin, crashed, args.hold, args.expires)
                print(f"{crashed} ended by itself: {said}", file=sys.stderr, flush=True)
            ended = group_left_behind(event, payload)
            if ended is not None:
                program, pgid = ended
                print(f"{program} (pid {pgid}) ended: {end_group(pgid)}", file=sys.stderr, flush=True)
        except Exception as exc:  # whatever went wrong, supervisord's event flow goes on
            print(f"could not handle {headers!r} {payload!r}: {exc!r}", file=sys.stderr, flush=True)
        childutils.listener.ok(sys.stdout)


if __name__ == "__main__":
    main()
