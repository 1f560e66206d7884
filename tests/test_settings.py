"""Settings: file + environment + overrides, and one readable error per bad value."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, get_args

import pytest

from appliance import settings as settings_module
from appliance.errors import ConfigError
from appliance.inventory import load_inventory
from appliance.plan import plan
from appliance.proxy.config import DecodeStep, Limits, PrefixAffinityConfig, ProxyConfig
from appliance.settings import (
    DEFAULT_CONFIG_PATH,
    PROXY_KEYS,
    EngineKind,
    ManagerName,
    ProxySettings,
    Settings,
    config_path,
    env_data,
    load_settings,
    load_settings_despite_errors,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    # PDCTL_CONFIG stays: tests/conftest.py points it at the session's file, never the host's
    for key in list(os.environ):
        if key.startswith("PDCTL_") and key != "PDCTL_CONFIG":
            monkeypatch.delenv(key)


def test_shipped_file_is_the_mi300x_reference() -> None:
    s = load_settings(REPO / "etc" / "pdctl.toml")
    assert s.prefill.gpus == [0, 1, 2, 3] and s.decode.gpus == [4, 5, 6, 7]
    assert (s.prefill.tp, s.decode.tp) == (4, 4)
    assert (s.prefill.http_port, s.prefill.handshake_port, s.prefill.notify_port) == (20005, 6301, 6105)
    assert (s.decode.http_port, s.decode.handshake_port, s.decode.notify_port) == (40005, 7301, 7501)
    assert s.proxy.ping_port == 36367
    assert s.connector.name == "moriio"


def test_defaults_without_a_file_run_the_embedded_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # an installed node's /etc/pdctl/pdctl.toml must not shadow the defaults under test
    monkeypatch.setattr(settings_module, "DEFAULT_CONFIG_PATH", tmp_path / "absent.toml")
    monkeypatch.delenv("PDCTL_CONFIG", raising=False)
    s = load_settings(overrides={})
    assert s.model.path == "embedded:tiny-qwen3"
    assert s.connector.name == "auto"


def test_environment_overrides_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "p.toml"
    f.write_text('[decode]\ntp = 4\nhttp_port = 41000\n[connector]\nmode = "read"\n')
    monkeypatch.setenv("PDCTL_DECODE__TP", "2")
    monkeypatch.setenv("PDCTL_CONNECTOR__MODE", "write")
    s = load_settings(f)
    assert s.decode.tp == 2
    assert s.decode.http_port == 41000  # the file's value survives a partial env override of the table
    assert s.connector.mode == "write"
    # explicit overrides (CLI flags) beat the environment
    assert load_settings(f, {"connector": {"mode": "read"}}).connector.mode == "read"


def test_config_path_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("PDCTL_CONFIG")
    assert config_path() == DEFAULT_CONFIG_PATH
    monkeypatch.setenv("PDCTL_CONFIG", str(tmp_path / "x.toml"))
    assert config_path() == tmp_path / "x.toml"
    assert config_path(tmp_path / "y.toml") == tmp_path / "y.toml"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[prefill]\ntp = "four"\n', "prefill.tp = 'four' is not allowed"),
        ("[prefil]\ntp = 4\n", "unknown setting 'prefil'"),
        ('[connector]\nmode = "fast"\n', "connector.mode = 'fast' is not allowed: Input should be 'read' or 'write'"),
        ("[decode]\nhttp_port = 80\n", "decode.http_port = 80 is not allowed"),
        ("[prefill]\ngpus = [0, 0]\n", "GPU indices repeat"),
        ("[prefill]\ngpus = [0, 1]\n[decode]\ngpus = [1, 2]\n", "share GPUs [1]"),
        ("[prefill\n", "is not valid TOML"),
        ("[slo]\nattainment = 1.5\n", "slo.attainment = 1.5 is not allowed"),
    ],
)
def test_bad_file_names_field_value_and_rule(tmp_path: Path, text: str, expected: str) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_settings(f)
    message = str(info.value)
    assert expected in message
    assert "\n" not in message


def test_missing_explicit_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "nope.toml")


def test_bad_environment_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDCTL_PROXY__PORT", "not-a-port")
    with pytest.raises(ConfigError, match="proxy.port = 'not-a-port'"):
        load_settings(overrides={})


def test_env_data_reads_only_variables_that_name_a_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    # The environment source (and pydantic-settings with it) loads only when a PDCTL_ variable names a setting.
    for key in [k for k in os.environ if k.upper().startswith("PDCTL_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("PDCTL_CONFIG", "/nowhere.toml")
    monkeypatch.setenv("PDCTL_INVENTORY", "sim:cpu")
    monkeypatch.setenv("PDCTL_TEST_VLLM_PYTHON", "/x/python")
    assert env_data() == {}
    monkeypatch.setenv("pdctl_decode__tp", "2")  # as case-insensitive as pydantic-settings is
    monkeypatch.setenv("PDCTL_STATE_DIR", "/s")
    assert env_data() == {"decode": {"tp": "2"}, "state_dir": "/s"}


def test_a_validated_settings_model_does_not_read_the_environment_again(monkeypatch: pytest.MonkeyPatch) -> None:
    # load_settings merges PDCTL_* below the flags once; re-validating a dump (bench --compare's shapes, the
    # suggest candidates) must keep the flags' values, not let the environment override them again
    monkeypatch.setenv("PDCTL_CONNECTOR__NAME", "nixl")
    assert Settings.model_validate({"connector": {"name": "none"}}).connector.name == "none"


def test_a_bad_variable_does_not_hide_what_runs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # status and doctor read the settings "despite errors": a bad PDCTL_* value is their error to report, and
    # the state directory still comes from the file (a pydantic traceback before: validating the locating keys
    # read the bad variable again)
    (tmp_path / "pdctl.toml").write_text(f'state_dir = "{tmp_path / "state"}"\n')
    monkeypatch.setenv("PDCTL_CONNECTOR__MODE", "sideways")
    settings, error = load_settings_despite_errors(tmp_path / "pdctl.toml")
    assert error is not None and str(error).startswith("PDCTL_CONNECTOR__MODE: connector.mode = 'sideways'")
    assert settings.state_dir == str(tmp_path / "state") and settings.connector.mode == "read"
    done = subprocess.run([sys.executable, "-m", "appliance", "--config", str(tmp_path / "pdctl.toml"), "status",
                           "--json"], capture_output=True, text=True, timeout=120)
    doc = json.loads(done.stdout)
    assert done.returncode == 3 and doc["state"] == "down" and "sideways" in doc["config_error"], done.stderr
    assert "Traceback" not in done.stderr


def test_each_connector_reads_its_own_table_and_the_old_flat_keys_still_work(tmp_path: Path) -> None:
    tables = tmp_path / "tables.toml"
    tables.write_text('[connector]\nname = "moriio"\n[connector.moriio]\nbackend = "xgmi"\n'
                      '[connector.example]\nshared_storage_path = "/srv/kv"\n')
    flat = tmp_path / "flat.toml"
    flat.write_text('[connector]\nname = "moriio"\nmoriio_backend = "xgmi"\nshared_storage_path = "/srv/kv"\n')
    for path in (tables, flat):
        connector = load_settings(path).connector
        assert connector.own("moriio").model_dump() == {"backend": "xgmi"}
        assert connector.own("example").model_dump() == {"shared_storage_path": "/srv/kv", "max_store_mib": 1024,
                                                         "max_age_s": 3600}
        assert connector.own("nixl").model_dump() == {"kv_buffer_device": None}


@pytest.mark.parametrize(("text", "said"), [
    ('[connector.moriio]\nbackend = "xgmi"\nbogus = 1\n', "connector.moriio.bogus: Extra inputs are not permitted"),
    ('[connector.moriio]\nbackend = "fast"\n', "connector.moriio.backend: Input should be 'rdma' or 'xgmi'"),
    ('[connector.mooriio]\nbackend = "xgmi"\n', "unknown setting connector.mooriio"),
    ('[connector]\nmoriio_backend = "rdma"\n[connector.moriio]\nbackend = "xgmi"\n',
     "keep connector.moriio.backend"),
    ('[connector]\nname = "no_such_module:Connector"\n', "cannot import no_such_module"),
])
def test_a_bad_connector_table_is_one_line_naming_the_key(tmp_path: Path, text: str, said: str) -> None:
    path = tmp_path / "pdctl.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as refused:
        load_settings(path)
    assert said in str(refused.value) and "\n" not in str(refused.value)


# The proxy's config fields no [proxy] key sets: the plan decides them, or only a hand-written proxy.json does.
NOT_PROXY_KEYS = {"mode", "connector", "model", "block_size", "vllm_version", "max_model_len", "backends",
                  "registration.enabled", "engine_api_key_file", "client_max_size", "max_tokens_limit",
                  "health.probe_interval_s",
                  "health.fail_threshold", "health.probe_timeout_s", "health.listener_check_interval_s",
                  "health.engine_uid", "health.timeout_threshold", "health.panic_max_silence_s", "health.crash_grace_s",
                  "decode_only_window_ms",  # the plan writes slo.itl_ms
                  "cache_salt_secret_file",  # the state directory's, which `pdctl up` generates
                  "decode_budget",  # the plan writes [decode] max_num_batched_tokens
                  "workers",  # the plan writes [proxy] workers, or one per 4 of the node's cores
                  "kv_store"}  # the plan writes the connector's KV folders and its [connector.<name>] bounds


def _field(model: Any, path: str) -> Any:
    *tables, name = path.split(".")
    for table in tables:
        model = model.model_fields[table].annotation
    return model.model_fields[name]


def test_every_proxy_key_is_defined_by_the_proxys_own_config_field() -> None:
    """The proxy's settings are modelled once (proxy/config.py): each [proxy] key has its field's type, default,
    meaning and bounds (ports tightened to unprivileged ones), and every field of the proxy's config is a key or
    decided by the plan."""
    for key, path in PROXY_KEYS.items():
        ours, theirs = ProxySettings.model_fields[key], _field(ProxyConfig, path)
        assert ours.annotation == theirs.annotation, key
        assert ours.get_default(call_default_factory=True) == theirs.get_default(call_default_factory=True), key
        assert ours.description == theirs.description, key
        assert ours.metadata[:len(theirs.metadata)] == theirs.metadata, key
    # pdctl's own: the restart hooks', whether the planner writes the conditional-routing threshold and the
    # step spread it sizes it on
    assert set(ProxySettings.model_fields) - set(PROXY_KEYS) == {"restart_drain_s", "restart_hold_s", "conditional_routing",
                                                                "decode_step_spread", "workers"}
    tables = ("registration", "admin", "timeouts", "health")
    leaves = {f"{name}.{sub}" if name in tables else name
              for name, field in ProxyConfig.model_fields.items()
              for sub in (field.annotation.model_fields if name in tables else [""])}
    assert leaves == set(PROXY_KEYS.values()) | NOT_PROXY_KEYS


def test_each_proxy_key_reaches_the_proxy_config_the_plan_writes() -> None:
    proxy = {"host": "127.0.0.2", "port": 11001, "routing": "round_robin", "api_key_file": "/srv/key",
             "registration_host": "127.0.0.3", "ping_port": 36999, "allowed_hosts": ["127.0.0.1", "10.0.0.5"],
             "peer_hosts": {"10.0.0.5": ["10.0.1.5"]}, "registration_max_per_s": 50.0, "admin_host": "127.0.0.4",
             "admin_port": 11002, "admin_token_file": "/srv/token", "connect_timeout_s": 1.5,
             "prefill_timeout_s": 60.0, "first_token_timeout_s": 70.0, "between_tokens_timeout_s": 8.0,
             "limits": {"max_connections": 99, "max_n": 4}, "decode_only_below": 300, "prefill_saturated_at": 6,
             "prefix_affinity": {"load_bound": 2, "cache_tokens": 4096},
             "decode_step": {"ms_per_seq": 0.5, "prefill_us_per_token": 40.0}, "warmup_timeout_s": 30.0,
             "decode_only_queue_ms": 120.0, "api_keys_file": "/srv/keys.toml", "tenant_cache_salt": False,
             "metrics_token_file": "/srv/metrics-token", "max_continuations": 1}
    assert set(proxy) == set(PROXY_KEYS)
    # WRITE: a MoRIIO decode in READ mode cannot serve the short prompts decode_only_below sends it alone
    planned = plan(Settings.model_validate({"connector": {"name": "moriio", "mode": "write"}, "proxy": proxy}),
                   load_inventory("sim:mi300x-8"))
    for key, path in PROXY_KEYS.items():
        value: Any = planned.proxy
        for part in path.split("."):
            value = getattr(value, part)
        tables = {"limits": Limits, "prefix_affinity": PrefixAffinityConfig, "decode_step": DecodeStep}
        expected = tables[key](**proxy[key]) if key in tables else proxy[key]
        assert value == expected, key
    assert planned.proxy.registration.enabled and planned.proxy.mode == "write"


SIM_STEP = DecodeStep(ms_per_seq=0.05, prefill_us_per_token=20)  # engine.sim's defaults
OWN_STEP = {"ms_per_seq": 0.5, "prefill_us_per_token": 40.0}


@pytest.mark.parametrize(("proxy", "expected", "step"), [
    ({}, None, None),  # conditional routing off (the default): every prompt is handed over
    # the sim's time model: (35 ms - 5.05 ms step) x 1000 / 20 us, 35 ms the longest step the 50 ms ITL target
    # takes in 99 % of cases on a simulated node (whose steps spread only by the host's 15 ms lateness); its
    # per-sequence cost and prefill cost per token, which the proxy takes each running leg's part off that with
    ({"conditional_routing": True}, 1497, SIM_STEP),
    ({"conditional_routing": True, "decode_only_below": 100}, 100, SIM_STEP),  # the user's value wins
    ({"conditional_routing": True, "decode_step": OWN_STEP}, 1497, DecodeStep(**OWN_STEP)),  # so does the step's
    # and the spread's: 0.1 (real engines', the H200 runs'): 39.6 ms, 50 x exp(-2.326 x 0.1); 0: the target
    ({"conditional_routing": True, "decode_step_spread": 0.1}, 1728, SIM_STEP),
    ({"conditional_routing": True, "decode_step_spread": 0}, 2247, SIM_STEP),
    ({"decode_only_below": 0}, 0, None),  # off: every prompt is handed over
])
def test_the_conditional_threshold_comes_from_the_node_unless_set(proxy: dict[str, Any], expected: int,
                                                                  step: DecodeStep | None) -> None:
    settings = Settings.model_validate({"engine": {"kind": "sim"}, "connector": {"name": "nixl"}, "proxy": proxy})
    planned = plan(settings, load_inventory("sim:h200-8")).proxy
    assert planned.decode_only_below == expected
    assert planned.decode_step == step
    # the window over which a decode prefills fewer than that itself: the ITL target
    assert planned.decode_only_window_ms == settings.slo.itl_ms == 50
    # a real-vLLM plan reads no model file: unset stays unset (the proxy hands every prompt over)
    vllm = Settings.model_validate({"connector": {"name": "nixl"}, "proxy": proxy})
    assert plan(vllm, load_inventory("sim:h200-8")).proxy.decode_only_below == proxy.get("decode_only_below")


@pytest.mark.parametrize("key, value, rule", [("ping_port", 1023, "greater than or equal to 1024"),
                                              ("admin_port", 80, "greater than or equal to 1024"),
                                              ("port", 0, "greater than or equal to 1"),
                                              ("port", 65536, "less than or equal to 65535"),
                                              ("connect_timeout_s", 0, "greater than 0"),
                                              ("prefix_affinity.load_bound", -1, "greater than or equal to 0"),
                                              ("prefix_affinity.cache_tokens", 0, "greater than or equal to 1"),
                                              ("routing", "random", "'round_robin', 'least_outstanding' or 'prefix_affinity'")])
def test_a_bad_proxy_key_is_named_as_written(tmp_path: Path, key: str, value: Any, rule: str) -> None:
    config = tmp_path / "pdctl.toml"
    config.write_text(f"[proxy]\n{key} = {json.dumps(value)}\n")
    with pytest.raises(ConfigError, match=f"proxy.{key} = {value!r} is not allowed: .*{rule}"):
        load_settings(config)


@pytest.mark.parametrize("command, param, kind", [
    ("appliance.cli.plan:plan", "engine", EngineKind), ("appliance.cli.bench:bench", "engine", EngineKind),
    ("appliance.cli.lifecycle:up", "manager", ManagerName), ("appliance.cli.restart:restart", "manager", ManagerName),
    ("appliance.cli.mode:mode", "manager", ManagerName)])
def test_command_line_choices_are_the_settings_types(command: str, param: str, kind: Any) -> None:
    """A flag that names a setting's value offers exactly that setting's choices (one definition, in settings)."""
    module, name = command.split(":")
    found = {p.name: p for p in getattr(importlib.import_module(module), name).params}[param]
    assert tuple(found.type.choices) == get_args(kind)


def test_keyed_api_gets_the_state_directorys_metrics_token_and_salt_secret(tmp_path: Path) -> None:
    """While the API has keys the plan names a metrics token and a cache salt secret (the state directory's, which
    `pdctl up` generates), so /metrics is never left to API keys; without keys, neither (one trusted tenant)."""
    state = tmp_path / "state"
    inventory = load_inventory("sim:mi300x-8")
    open_ = plan(Settings.model_validate({"state_dir": str(state)}), inventory).proxy
    assert open_.metrics_token_file is None and open_.cache_salt_secret_file is None
    keyed = plan(Settings.model_validate({"state_dir": str(state), "proxy": {"api_keys_file": "/srv/k"}}),
                 inventory).proxy
    assert keyed.metrics_token_file == str(state / "metrics-token")
    assert keyed.cache_salt_secret_file == str(state / "cache-salt-secret")
    trusted = plan(Settings.model_validate({"state_dir": str(state),
                                            "proxy": {"api_key_file": "/srv/k", "tenant_cache_salt": False}}),
                   inventory).proxy
    assert trusted.metrics_token_file == str(state / "metrics-token") and trusted.cache_salt_secret_file is None
