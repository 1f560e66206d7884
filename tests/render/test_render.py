"""The renderers: unit/program names and contents for 1P1D, xPyD and colocated plans; secrets kept out
of unit text; systemd-analyze verify with an empty stderr; supervisor's own parser reads back every
argument and environment value; the model-runner choice NIXL's cross-layer KV blocks need, per platform."""

from __future__ import annotations

import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from supervisor.options import ServerOptions

from appliance.errors import PdctlError
from appliance.inventory import load_inventory
from appliance.plan import Plan, plan
from appliance.proxy.keeper import slot_names
from appliance.render import RenderOptions, render_supervisor, render_systemd
from appliance.render.names import PROXY_UNIT, instance_unit, unit_instance
from appliance.render.supervisor import REAPER, environment_value, socket_path
from appliance.render.systemd import exec_word
from appliance.settings import load_settings

AWKWARD_MODEL = "/models/my \"odd\" 100% $HOME model's \\ dir"
OPTS = RenderOptions(python=sys.executable, health_timeout_s=900)


def make(overrides: dict[str, Any], inventory: str = "sim:mi300x-8") -> Plan:
    settings = load_settings(None, {"state_dir": "/var/lib/pdctl", **overrides})
    return plan(settings, load_inventory(inventory))


def units_of(p: Plan) -> dict[str, str]:
    return {f.name: f.text for f in render_systemd(p, OPTS).units}


def lines(text: str, key: str) -> list[str]:
    return [line.split("=", 1)[1] for line in text.splitlines() if line.startswith(key + "=")]


def test_unit_names_for_1p1d_xpyd_and_colocated() -> None:
    assert sorted(units_of(make({}))) == sorted([
        "pd.target", "pd-prefill.service", "pd-prefill-0.service", "pd-decode.service", "pd-decode-0.service",
        "pd-proxy.service"])
    xpyd = units_of(make({"prefill": {"instances": 2, "tp": 2}, "decode": {"instances": 2, "tp": 2}}))
    assert lines(xpyd["pd-decode.service"], "Wants") == ["pd-decode-0.service pd-decode-1.service"]
    assert lines(xpyd["pd-decode.service"], "After") == ["pd-decode-0.service pd-decode-1.service"]
    assert lines(xpyd["pd-decode-1.service"], "PartOf") == ["pd-decode.service"]
    colocated = units_of(make({"connector": {"name": "none"}, "engine": {"kind": "sim"}}, "sim:cpu"))
    assert "pd-colocated-0.service" in colocated
    assert lines(colocated["pd.target"], "Wants") == ["pd-colocated.service pd-proxy.service"]


def test_engine_unit_pins_gpus_limits_restart_and_readiness() -> None:
    unit = units_of(make({}))["pd-decode-0.service"]
    assert 'Environment="CUDA_VISIBLE_DEVICES=4,5,6,7"' in unit and 'Environment="HIP_VISIBLE_DEVICES=4,5,6,7"' in unit
    for setting in ("LimitMEMLOCK=infinity", "LimitNOFILE=1048576", "Restart=always", "StartLimitIntervalSec=0", "KillMode=control-group",
                    "TimeoutStartSec=960s", "Type=exec"):
        assert setting in unit.splitlines()
    ready, started = lines(unit, "ExecStartPost")
    assert shlex.split(ready)[3:] == ["wait-healthy", "http://127.0.0.1:40005/health", "--timeout", "900"]
    # then, and before every stop, the proxy hears of it (a failing hook, "-", never fails the unit)
    # with the admin token pdctl up writes: the proxy refuses admin calls without it
    assert shlex.split(started.removeprefix("-"))[3:] == ["proxy-notify", "started", "decode-0", "--admin",
                                                          "http://127.0.0.1:10002", "--token-file",
                                                          "/var/lib/pdctl/admin-token"]
    (stopping,) = lines(unit, "ExecStop")
    assert shlex.split(stopping.removeprefix("-"))[3:] == [
        "proxy-notify", "stopping", "decode-0", "--admin", "http://127.0.0.1:10002",
        "--token-file", "/var/lib/pdctl/admin-token", "--drain-timeout", "30",
        "--hold", "120", "--expires", "990"]
    # systemd skips ExecStop after a signal or a failed exit: ExecStopPost reports that crash
    (stopped,) = lines(unit, "ExecStopPost")
    assert shlex.split(stopped.removeprefix("-"))[3:] == [
        "proxy-notify", "stopped", "decode-0", "--admin", "http://127.0.0.1:10002",
        "--token-file", "/var/lib/pdctl/admin-token", "--drain-timeout", "30",
        "--hold", "120", "--expires", "990"]
    assert "TimeoutStopSec=90s" in unit.splitlines()  # the drain, then the engine's own graceful exit


@pytest.mark.parametrize("workers", [1, 3])
def test_proxy_unit_stores_every_listening_socket_of_the_keeper(workers: int) -> None:
    """One API socket per proxy worker, the admin socket and the control state's file fit the unit's file
    descriptor store (issue 38: it held 2 whatever the workers)."""
    unit = units_of(make({"proxy": {"workers": workers}}))["pd-proxy.service"]
    assert lines(unit, "FileDescriptorStoreMax") == [str(len([n for s in slot_names(workers) for n in s]) + 1)]
    assert lines(unit, "NotifyAccess") == ["main"]


def test_proxy_unit_never_requires_or_binds_the_engines() -> None:
    unit = units_of(make({}))["pd-proxy.service"]
    for key in ("Requires", "BindsTo", "Requisite"):
        assert not lines(unit, key)
    assert "pd-decode.service" in lines(unit, "Wants")[0] and "pd-decode.service" in lines(unit, "After")[0]
    assert "PartOf=pd.target" in unit


def test_secrets_go_to_a_0600_environment_file_never_the_unit() -> None:
    p = make({"engine": {"env": {"HF_TOKEN": "hf_s3cret", "VLLM_LOGGING_LEVEL": "INFO"}}})
    rendered = render_systemd(p, OPTS)
    assert all("hf_s3cret" not in f.text for f in rendered.units)
    env_files = {f.name: f for f in rendered.private}
    assert set(env_files) == {"env/pd-prefill-0.env", "env/pd-decode-0.env"}
    assert all(f.mode == 0o600 and "HF_TOKEN='hf_s3cret'" in f.text for f in env_files.values())
    unit = {f.name: f.text for f in rendered.units}["pd-prefill-0.service"]
    assert "EnvironmentFile=-/var/lib/pdctl/env/pd-prefill-0.env" in unit
    assert 'Environment="VLLM_LOGGING_LEVEL=INFO"' in unit


@pytest.mark.parametrize(("arg", "word"), [
    ("plain", "plain"), ("100%", "100%%"), ("$HOME", '"$$HOME"'), ("a b", '"a b"'), ('q"x', '"q\\"x"'),
    ("back\\slash", '"back\\\\slash"'), (";", "\\;"), ("", '""'), ("it's", '"it\'s"'),
])
def test_exec_words(arg: str, word: str) -> None:
    assert exec_word(arg) == word


def test_relative_engine_python_is_a_clear_error() -> None:
    with pytest.raises(PdctlError, match="absolute path"):
        render_systemd(make({"engine": {"python": "python3"}}), OPTS)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
@pytest.mark.parametrize("overrides", [
    {},
    {"model": {"path": AWKWARD_MODEL, "served_name": "odd"}, "state_dir": "/var/lib/pd ctl %$ 'q'",
     "engine": {"env": {"WEIRD": 'a "b" %c $d', "API_KEY": "k"}}},
    {"prefill": {"instances": 2, "tp": 2}, "decode": {"instances": 2, "tp": 2}},
    {"connector": {"name": "none"}},
], ids=["1p1d", "awkward-paths", "xpyd", "colocated"])
def test_systemd_analyze_verify_has_empty_stderr(tmp_path: Path, overrides: dict[str, Any]) -> None:
    inventory = "sim:mi300x-8" if overrides.get("connector", {}).get("name") != "none" else "sim:cpu"
    if inventory == "sim:cpu":
        overrides = {**overrides, "engine": {"kind": "sim"}}
    for f in render_systemd(make(overrides, inventory), OPTS).units:
        (tmp_path / f.name).write_text(f.text)
    done = subprocess.run(["systemd-analyze", "verify", *sorted(str(p) for p in tmp_path.iterdir())],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr


def test_supervisord_reads_back_every_argument_and_variable(tmp_path: Path) -> None:
    state = str(tmp_path / "state 100% 'q'")
    p = make({"model": {"path": AWKWARD_MODEL}, "state_dir": state,
              "engine": {"env": {"WEIRD": 'a "b" %c $d,e', "API_KEY": "k'ey"}}})
    (conf,) = render_supervisor(p, OPTS)
    assert conf.mode == 0o600
    (Path(state) / "supervisor" / "logs").mkdir(parents=True)  # supervisord checks that log dirs exist
    group = read_back(conf.text, tmp_path)
    assert group.name == "pd"
    programs = {c.name: c for c in group.process_configs}
    assert list(programs) == ["pd-prefill-0", "pd-decode-0", "pd-proxy"]
    for inst in p.instances:
        cfg = programs[f"pd-{inst.name}"]
        assert shlex.split(cfg.command) == inst.argv
        assert cfg.environment == inst.env
        assert cfg.stopasgroup and cfg.killasgroup
        assert cfg.stdout_logfile == f"{state}/supervisor/logs/pd-{inst.name}.log"
    assert shlex.split(programs["pd-proxy"].command)[-3:] == [f"{state}/proxy.json", "--stop-signal", "INT"]
    # supervisord stops the keeper with the signal it is told is the stop (a SIGTERM from elsewhere hands over)
    assert programs["pd-proxy"].stopsignal == signal.SIGINT
    assert str(socket_path(state)) in conf.text
    # the reaper ends what a program left behind: on every end that names a pid, restarted if it dies
    pool = read_back(conf.text, tmp_path, REAPER)
    reaper = pool.process_configs[0]
    # and reports an engine that ended by itself to the proxy, as the systemd units' ExecStop hook does
    expires = OPTS.restart_drain_s + OPTS.health_timeout_s + 60
    assert shlex.split(reaper.command) == [OPTS.python, "-m", "appliance.manager.supervisor_reaper",
                                           "--admin", p.proxy.admin_url, "--hold", f"{OPTS.restart_hold_s:g}",
                                           "--expires", f"{expires:g}"] + (
        ["--token-file", p.proxy.admin.token_file] if p.proxy.admin.token_file else [])
    assert {e.__name__ for e in pool.pool_events} == {"ProcessStateExitedEvent", "ProcessStateStoppedEvent"}
    assert reaper.autorestart and reaper.priority < min(c.priority for c in programs.values())
    assert reaper.stderr_logfile == f"{state}/supervisor/logs/{REAPER}.log" and not reaper.redirect_stderr


def test_supervisor_rejects_values_it_cannot_carry() -> None:
    """...naming the variable and never its value, which may be a secret (issue 36, finding 5's class)."""
    for value, problem in (("a'b\"c-hf_s3cret", "both quote kinds"), ("'quoted-hf_s3cret'", "starts or ends with a quote"),
                           ("hf_s3cret\n[program:x]", "cannot span lines")):
        with pytest.raises(PdctlError, match=problem) as info:
            environment_value({"HF_TOKEN": value})
        assert "HF_TOKEN" in str(info.value) and "s3cret" not in str(info.value), info.value


def read_back(text: str, tmp_path: Path, name: str = "pd") -> Any:
    """The process group `name` as supervisord itself parses it from a rendered conf."""
    path = tmp_path / "supervisord.conf"
    path.write_text(text)
    options = ServerOptions()
    options.configfile = str(path)
    options.process_config(do_usage=False)
    (group,) = [g for g in options.process_group_configs if g.name == name]
    return group


def supervisor_env(p: Plan, tmp_path: Path) -> dict[str, dict[str, str]]:
    """Each engine program's environment as supervisord itself parses the rendered conf."""
    (conf,) = render_supervisor(p, OPTS)
    group = read_back(conf.text, tmp_path)
    return {c.name: c.environment or {} for c in group.process_configs if c.name != "pd-proxy"}


RUNNER = "VLLM_USE_V2_MODEL_RUNNER"
NIXL = {"connector": {"name": "nixl", "mode": "read"}}


@pytest.mark.parametrize(("overrides", "inventory", "cross_layer", "expected"), [
    # NVIDIA: cross-layer blocks (the default) need vLLM 0.24's V1 model runner, in both roles, READ and WRITE
    (NIXL, "sim:h200-2", True, {"prefill-0": "0", "decode-0": "0"}),
    ({"connector": {"name": "nixl", "mode": "write"}}, "sim:h200-2", True, {"prefill-0": "0", "decode-0": "0"}),
    # cross-layer blocks off: vLLM's own runner choice
    ({"connector": {"name": "nixl", "extra_config": {"enable_cross_layers_blocks": False}}}, "sim:h200-2", False,
     {"prefill-0": None, "decode-0": None}),
    # the user's value wins over pdctl's, for every role (engine.env) or one role
    ({**NIXL, "engine": {"env": {RUNNER: "1"}}}, "sim:h200-2", True, {"prefill-0": "1", "decode-0": "1"}),
    ({**NIXL, "decode": {"env": {RUNNER: "1"}}}, "sim:h200-2", True, {"prefill-0": "0", "decode-0": "1"}),
    # CPU (NIXL's host-buffer push) and AMD: neither cross-layer blocks nor the runner switch
    ({"connector": {"name": "nixl", "mode": "write"}}, "sim:cpu", False, {"prefill-0": None, "decode-0": None}),
    (NIXL, "sim:mi300x-8", False, {"prefill-0": None, "decode-0": None}),
    # colocated: no hand-off
    ({"connector": {"name": "none"}}, "sim:h200-2", False, {"colocated-0": None}),
], ids=["nvidia-read", "nvidia-write", "cross-layer-off", "engine-env-wins", "role-env-wins", "cpu", "amd",
        "colocated"])
def test_nixl_cross_layer_runner_in_units_and_programs(tmp_path: Path, overrides: dict[str, Any], inventory: str,
                                                       cross_layer: bool, expected: dict[str, str | None]) -> None:
    p = make({**overrides, "state_dir": str(tmp_path)}, inventory)
    extra = [(i.kv_transfer_config or {}).get("kv_connector_extra_config", {}) for i in p.instances]
    assert [e.get("enable_cross_layers_blocks") is True for e in extra] == [cross_layer] * len(expected)
    units = units_of(p)
    (tmp_path / "supervisor" / "logs").mkdir(parents=True)
    programs = supervisor_env(p, tmp_path)
    assert sorted(programs) == sorted(f"pd-{name}" for name in expected)
    for name, value in expected.items():
        unit = units[f"pd-{name}.service"]
        if value is None:
            assert RUNNER not in unit and RUNNER not in programs[f"pd-{name}"]
        else:
            assert lines(unit, "Environment").count(f'"{RUNNER}={value}"') == 1, unit
            assert programs[f"pd-{name}"][RUNNER] == value


@pytest.mark.parametrize("overrides", [{}, {"connector": {"name": "none"}, "colocated": {"instances": 2}}])
def test_an_engine_unit_names_its_instance_and_no_other_name_does(overrides: dict[str, Any]) -> None:
    """pd-reaper reports an engine that ended by itself under its instance's name, read from its program's."""
    instances = make(overrides).instances
    assert {unit_instance(instance_unit(i)) for i in instances} == {i.name for i in instances}
    assert [unit_instance(n) for n in (PROXY_UNIT, REAPER, "pd-decode", "pd-decode-x", "other-0")] == [None] * 5
