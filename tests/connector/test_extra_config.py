"""Each connector renders only the kv_connector_extra_config keys the engine's vLLM release reads, from the
table it owns; the tables agree with the vLLM code installed here (the CPU build, 0.32)."""

from __future__ import annotations

import ast
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from appliance.connector import get_connector, names
from appliance.connector.extras import READ_RELEASES
from appliance.inventory import load_inventory
from appliance.plan import plan
from appliance.releases import answer_for
from appliance.settings import Settings

VLLM_PYTHON = os.environ.get("PDCTL_TEST_VLLM_PYTHON")
INVENTORY = {"moriio": "sim:mi300x-8", "nixl": "sim:h200-2", "example": "sim:cpu"}


def _nixl_plan(package: str, extra: dict[str, Any] | None = None) -> list[tuple[dict[str, Any], dict[str, str]]]:
    settings = Settings.model_validate({"connector": {"name": "nixl", "extra_config": extra or {}},
                                        "engine": {"vllm_package": package}})
    p = plan(settings, load_inventory("sim:h200-2"))
    return [((i.kv_transfer_config or {}).get("kv_connector_extra_config", {}), i.env) for i in p.instances]


@pytest.mark.parametrize(("package", "rendered"), [
    ("vllm 0.24.0", True),   # its NIXL connector reads enable_cross_layers_blocks (prefer_cross_layer_blocks)
    ("vllm 0.24.3", True),
    ("vllm 0.32.0", False),  # its NIXL connector never reads it (only the Mooncake store connector does)
    ("vllm 0.33.1", False),  # newer than every release read: as the newest
    ("vllm 0.28.0", True),   # between two releases that disagree: pdctl cannot tell, so it keeps its default
    ("vllm 0.20.0", True),   # older than every release read: as before
    ("", True),              # unknown version: as before
])
def test_nvidia_renders_cross_layer_blocks_only_for_a_vllm_that_reads_them(package: str, rendered: bool) -> None:
    instances = _nixl_plan(package)
    assert instances
    for extra, env in instances:
        assert ("enable_cross_layers_blocks" in extra) is rendered, (package, extra)
        # the V1 runner is forced only where it builds the cross-layer blocks the setting asks for
        assert ("VLLM_USE_V2_MODEL_RUNNER" in env) is rendered, (package, env)


def test_a_users_key_is_rendered_whatever_the_version() -> None:
    # the user's own extra_config goes to the engine as written (`pdctl doctor` says when it is ignored)
    for extra, env in _nixl_plan("vllm 0.32.0", {"enable_cross_layers_blocks": True, "kv_lease_duration": 60}):
        assert extra == {"enable_cross_layers_blocks": True, "kv_lease_duration": 60}
        assert "VLLM_USE_V2_MODEL_RUNNER" not in env  # 0.32 ignores the setting: nothing to force


@pytest.mark.parametrize("name", ["moriio", "nixl", "example"])
@pytest.mark.parametrize("release", READ_RELEASES)
def test_pdctl_renders_no_key_of_its_own_that_the_release_ignores(name: str, release: str) -> None:
    table = get_connector(name).extra_config_keys
    assert table is not None
    settings = Settings.model_validate({"connector": {"name": name}, "engine": {"vllm_package": f"vllm {release}"}})
    p = plan(settings, load_inventory(INVENTORY[name]))
    rendered = {key for i in p.instances for key in (i.kv_transfer_config or {}).get("kv_connector_extra_config", {})}
    assert rendered or (name, release) == ("nixl", "0.32.0"), name  # 0.32's NIXL: nothing of pdctl's
    assert {key for key in rendered if not table.read_by(key, release)} == set(), (name, release)


def test_every_connector_with_a_vllm_class_owns_a_table() -> None:
    for name in names():
        connector = get_connector(name)
        assert (connector.extra_config_keys is None) is (connector.vllm_class is None), name


def test_ignored_names_the_key_the_version_and_what_reads_it_instead() -> None:
    nixl = get_connector("nixl").extra_config_keys
    assert nixl is not None
    assert nixl.ignored(["enable_cross_layers_blocks", "kv_lease_duration"], "0.32.0") == [
        "extra_config key 'enable_cross_layers_blocks' is not read by vLLM 0.32.0's NixlConnector "
        "(vLLM 0.24.0 does; in vLLM 0.32.0 only MooncakeStoreConnector reads it)"]
    assert nixl.ignored(["enable_cross_layers_blocks"], "0.24.0") == []
    assert nixl.ignored(["enable_cross_layers_blocks"], "") == []  # unknown version: no claim
    assert nixl.ignored(["kv_lease_duratoin"], "0.32.0") == [
        "extra_config key 'kv_lease_duratoin' is not read by vLLM 0.32.0's NixlConnector "
        "(no release pdctl read (0.24.0, 0.32.0) reads it)"]


@pytest.mark.parametrize(("version", "expected"), [
    ("0.24.0", "a"), ("0.24.7+cu12", "a"), ("0.32.0+cpu", "b"), ("0.40.0", "b"), ("0.30.0", None),
    ("0.10.0", None), ("", None), ("dev", None),
])
def test_answer_for_a_release_between_after_or_before_those_read(version: str, expected: str | None) -> None:
    assert answer_for(version, {"0.32.0": "b", "0.24.0": "a"}) == expected
    assert answer_for(version, {}) is None


def test_releases_that_agree_answer_for_those_between() -> None:
    assert answer_for("0.28.1", {"0.24.0": True, "0.32.0": True}) is True


# ---- the tables against the vLLM installed here ----------------------------------------------------------------
_FILES = {"nixl": "nixl", "moriio": "moriio", "example": "example_connector.py"}


def _keys_read(path: Path) -> set[str]:
    """The string keys a connector's sources read from the extra config (get_from_extra_config(key), .get(key) or
    [key] on an expression naming extra_config, and `key in extra_config`)."""
    keys: set[str] = set()
    for source in sorted(path.glob("*.py")) if path.is_dir() else [path]:
        for node in ast.walk(ast.parse(source.read_text())):
            key: object = None
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
                on = ast.unparse(node.func.value)
                if node.func.attr == "get_from_extra_config" or (node.func.attr == "get" and "extra_config" in on):
                    key = getattr(node.args[0], "value", None)
            elif isinstance(node, ast.Subscript) and "extra_config" in ast.unparse(node.value):
                key = getattr(node.slice, "value", None)
            elif isinstance(node, ast.Compare) and any("extra_config" in ast.unparse(c) for c in node.comparators):
                key = getattr(node.left, "value", None)
            if isinstance(key, str):
                keys.add(key)
    return keys


@pytest.mark.vllm
@pytest.mark.parametrize("name", ["moriio", "nixl", "example"])
def test_the_table_lists_what_the_installed_vllm_reads(name: str) -> None:
    assert VLLM_PYTHON
    # find_spec locates the package without importing vLLM
    where = subprocess.run([VLLM_PYTHON, "-I", "-c", "import importlib.metadata as m, importlib.util as u; "
                            "n = m.packages_distributions()['vllm'][0]; "
                            "print(m.version(n)); print(u.find_spec('vllm').submodule_search_locations[0])"],
                           capture_output=True, text=True, check=True, timeout=60).stdout.split()
    version, root = where[0], Path(where[1]) / "distributed/kv_transfer/kv_connector/v1"
    table = get_connector(name).extra_config_keys
    assert table is not None
    listed = {key for key in table.reads if table.read_by(key, version)}
    assert listed == _keys_read(root / _FILES[name]), (name, version)
