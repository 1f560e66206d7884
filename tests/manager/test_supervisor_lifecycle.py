"""A real supervisord, started by `pdctl up`, runs the rendered programs with the simulated engine;
`pdctl up/status/restart/logs/down` drive it exactly as an operator would."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import psutil
import pytest

from appliance.manager.supervisor import can_raise_limits
from tests.support.pdctl import complete, crash_on_next_token, pdctl, status, try_complete, write_config
from tests.support.waiting import wait_until


def _pids(doc: dict) -> dict[str, int]:
    pids = {i["name"]: i["pid"] for i in doc["instances"]}
    pids["proxy"] = doc["proxy"]["pid"]
    return pids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def deployment(tmp_path: Path):
    state = tmp_path / "state with 'quotes' and 100%"
    config = write_config(tmp_path, state)
    yield config, state
    pdctl(config, "down")  # never leave a supervisord behind, whatever the test did


def test_up_status_restart_kill_logs_down(deployment) -> None:
    config, state = deployment
    up = pdctl(config, "up", "--json")
    assert up.returncode == 0, up.stderr
    outcome = json.loads(up.stdout)
    assert outcome["healthy"] is True and outcome["manager"] == "supervisor"
    assert sorted(outcome["started_or_restarted"]) == ["pd-decode-0", "pd-prefill-0", "pd-proxy"]
    assert (state / "supervisor" / "supervisord.conf").stat().st_mode & 0o777 == 0o600
    assert json.loads((state / "plan.json").read_text())["engine"] == "sim"
    assert json.loads((state / "proxy.json").read_text())["backends"][0]["name"] == "prefill-0"

    doc = status(config)
    assert doc["_rc"] == 0 and doc["schema_version"] == 1 and doc["state"] == "healthy"
    assert [(i["name"], i["role"], i["state"], i["health"]) for i in doc["instances"]] == [
        ("prefill-0", "prefill", "running", "healthy"), ("decode-0", "decode", "running", "healthy")]
    assert doc["proxy"]["ready"] and doc["proxy"]["mode"] == "read"
    assert {r["role"] for r in doc["proxy"]["registered"]} == {"prefill", "decode"}
    assert all(i["uptime_s"] is not None and i["restarts"] == 0 for i in doc["instances"])
    before = _pids(doc)
    assert complete(doc["proxy"]["url"])["choices"][0]["text"]
    assert status(config)["proxy"]["requests"]["by_status"].get("200", 0) >= 1

    # Programs inherit the limits pdctl gave supervisord (memlock only where it may be raised).
    limits = Path(f"/proc/{before['decode-0']}/limits").read_text()
    if can_raise_limits():
        assert "Max locked memory         unlimited" in limits

    # A second `pdctl up` with nothing changed is a no-op that reports healthy.
    again = pdctl(config, "up", "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["started_or_restarted"] == []
    assert _pids(status(config)) == before

    # kill -9 of an engine: supervisor restarts it, status counts the restart.
    os.kill(before["decode-0"], signal.SIGKILL)
    doc = wait_until(lambda: (d := status(config))["_rc"] == 0 and _pids(d)["decode-0"] != before["decode-0"] and d,
                     what="decode-0 to come back after kill -9")
    assert doc["instances"][1]["restarts"] == 1 and _pids(doc)["proxy"] == before["proxy"]
    killed = _pids(doc)

    # restart decode: only decode gets a new process; the proxy keeps serving with the same PID.
    done = pdctl(config, "restart", "decode", "--json")
    assert done.returncode == 0, done.stderr
    after = _pids(status(config))
    assert after["decode-0"] != killed["decode-0"]
    assert after["prefill-0"] == before["prefill-0"] and after["proxy"] == before["proxy"]
    assert wait_until(lambda: try_complete(doc["proxy"]["url"]), what="a completion after the restart")

    logs = pdctl(config, "logs", "decode", "-n", "5")
    assert logs.returncode == 0 and 0 < len(logs.stdout.splitlines()) <= 5
    assert "decode-0" in logs.stdout

    down = pdctl(config, "down")
    assert down.returncode == 0, down.stderr
    assert not any(_alive(pid) for pid in after.values())
    gone = status(config)
    assert gone["_rc"] == 3 and gone["state"] == "down"


def test_colocated_layout_comes_up(tmp_path: Path) -> None:
    config = write_config(tmp_path, tmp_path / "state")
    try:
        up = pdctl(config, "up", "--connector", "none", "--json")
        assert up.returncode == 0, up.stderr
        doc = status(config)
        assert doc["layout"] == "colocated" and [i["name"] for i in doc["instances"]] == ["both-0"]
        assert doc["instances"][0]["unit"] == "pd-colocated-0" and doc["instances"][0]["health"] == "healthy"
        assert complete(doc["proxy"]["url"])["usage"]["completion_tokens"] == 4
        restarted = pdctl(config, "restart", "colocated")
        assert restarted.returncode == 0, restarted.stderr
    finally:
        pdctl(config, "down")


def test_failing_engine_shows_its_log_and_exits_nonzero(tmp_path: Path) -> None:
    """An engine that exits at every start (here a bad flag) is never healthy: supervisord starts it again and
    again (startretries), and `pdctl up` says so once it has seen it exit twice, not after its health timeout
    (30 minutes by default on a vLLM node; the 170 s here outlast pdctl()'s 160 s)."""
    extra = '[engine.sim]\nextra_args = ["--no-such-flag"]\n'
    config = write_config(tmp_path, tmp_path / "state", extra=extra)
    try:
        up = pdctl(config, "up", "--timeout", "170", timeout=160)
        assert up.returncode == 1
        assert "pd-prefill-0" in up.stderr and "last log lines" in up.stderr
        assert "keeps exiting as it starts" in up.stderr, up.stderr
        assert "Traceback" not in up.stderr.split("last log lines")[0]
        # The engine's own complaint is what `pdctl logs` shows (on a loaded box it may come after `up` gave up).
        wait_until(lambda: "--no-such-flag" in pdctl(config, "logs", "prefill").stdout,
                   what="the engine's argparse error in its log")
    finally:
        pdctl(config, "down")


def test_a_process_that_stops_by_itself_comes_back_and_status_says_why(deployment) -> None:
    """Whatever way an engine or the proxy ends on its own (exit 0, as vLLM's API server does after its engine
    core died; exit 1; a signal), supervisord starts it again and `pdctl status` says how it ended."""
    config, _ = deployment
    assert pdctl(config, "up").returncode == 0
    doc = status(config)
    urls = {i["name"]: i["url"] for i in doc["instances"]}

    def crash(name: str, pid: int) -> None:
        crash_on_next_token(urls[name])
        try_complete(doc["proxy"]["url"])  # the leg that crashes it fails; the client gets an error

    exits = [("decode-0", lambda n, pid: os.kill(pid, signal.SIGTERM), "exit status 0"),
             ("prefill-0", crash, "exit status 1"),
             ("decode-0", lambda n, pid: os.kill(pid, signal.SIGKILL), "SIGKILL"),
             # supervisord stops the keeper with SIGINT: a SIGTERM from elsewhere leaves its proxy serving, 128 + 15
             ("proxy", lambda n, pid: os.kill(pid, signal.SIGTERM), "exit status 143")]
    for name, stop, why in exits:
        before = _pids(status(config))
        stop(name, before[name])
        doc = wait_until(lambda n=name, old=before[name]: (d := status(config))["_rc"] == 0 and _pids(d)[n] != old and d,
                         what=f"{name} to come back after it ended with {why}")
        unit = doc["proxy"] if name == "proxy" else {i["name"]: i for i in doc["instances"]}[name]
        assert why in (unit["last_exit"] or ""), unit
        assert unit["automatic_restarts"] >= 1, unit
    assert complete(doc["proxy"]["url"])["choices"][0]["text"]

    # Stopping on purpose is for good: nothing comes back after `pdctl down`.
    pids = _pids(doc)
    assert pdctl(config, "down").returncode == 0
    assert not any(_alive(pid) for pid in pids.values())


def _gone(proc: psutil.Process) -> bool:
    """Ended: no such process, or a zombie its new parent (init, in a container maybe never) has not reaped."""
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_an_engine_that_ends_by_itself_leaves_no_child_behind(tmp_path: Path) -> None:
    """vLLM's EngineCore is a child in the API server's process group that outlives it when the API server dies
    (on a GPU node it keeps the memory the restarted engine needs). Whatever way the engine ended, supervisord
    restarts it and nothing of its previous process group is left."""
    config = write_config(tmp_path, tmp_path / "state", extra='[engine.sim]\nextra_args = ["--engine-core-child"]\n')
    try:
        assert pdctl(config, "up").returncode == 0
        doc = status(config)
        urls = {i["name"]: i["url"] for i in doc["instances"]}
        # the reaper itself killed first: supervisord restarts it, and the restarted one does the work below
        supervisord = psutil.Process(_pids(doc)["proxy"]).parent()
        (reaper,) = [p for p in supervisord.children() if "appliance.manager.supervisor_reaper" in p.cmdline()]
        reaper.kill()

        def crash(name: str, pid: int) -> None:
            crash_on_next_token(urls[name])
            try_complete(doc["proxy"]["url"])

        ends = [("decode-0", lambda n, pid: os.kill(pid, signal.SIGKILL), "SIGKILL"),
                ("prefill-0", lambda n, pid: os.kill(pid, signal.SIGTERM), "exit status 0"),
                ("prefill-0", crash, "exit status 1")]
        for name, end, why in ends:
            old = _pids(status(config))[name]
            children = psutil.Process(old).children()
            assert children, f"{name}'s simulated engine core child"
            end(name, old)
            wait_until(lambda c=children: all(_gone(p) for p in c),
                       what=f"{name}'s engine core child to end after the engine ended with {why}")
            again = wait_until(lambda n=name, o=old: (d := status(config))["state"] == "healthy" and _pids(d)[n] != o
                               and d, what=f"{name} healthy again after {why}")
            unit = {i["name"]: i for i in again["instances"]}[name]
            assert why in (unit["last_exit"] or ""), unit
            assert psutil.Process(unit["pid"]).children(), "the new engine has its own engine core"
        assert complete(doc["proxy"]["url"])["choices"][0]["text"]
    finally:
        pdctl(config, "down")


def test_a_redeploy_reports_only_its_own_ends(deployment) -> None:
    """An engine that stopped by itself under the previous deployment is that deployment's story: after a
    redeploy that gives it a new program, `pdctl status` (JSON and text) no longer lists its end or restarts."""
    config, _ = deployment
    assert pdctl(config, "up").returncode == 0
    old = _pids(status(config))["decode-0"]
    os.kill(old, signal.SIGKILL)
    wait_until(lambda: (d := status(config))["_rc"] == 0 and _pids(d)["decode-0"] not in (old, None),
               what="decode-0 back after SIGKILL")
    shown = " ".join(pdctl(config, "status").stdout.split())  # rich wraps at 80 columns on a pipe
    assert "decode-0 last stopped by itself (terminated by SIGKILL)" in shown, shown
    config.write_text(config.read_text() + '[engine.sim]\nextra_args = ["--engine-core-child"]\n')
    up = pdctl(config, "up", "--json")
    assert up.returncode == 0, up.stderr
    assert "pd-decode-0" in json.loads(up.stdout)["started_or_restarted"]
    decode = {i["name"]: i for i in status(config)["instances"]}["decode-0"]
    assert (decode["last_exit"], decode["automatic_restarts"], decode["restarts"]) == (None, 0, 0), decode
    assert "last stopped by itself" not in pdctl(config, "status").stdout
