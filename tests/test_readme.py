"""The README's own examples work on the node its first command sets up: every instance, unit and role a
command line there names exists in the default plan."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.support.pdctl import pdctl, pdctl_in, status, write_config
from tests.support.processes import ROOT

README = (ROOT / "README.md").read_text()
# `pdctl restart decode-0`, `pdctl drain decode-0 / undrain`, `systemctl restart pd-decode`, `pdctl logs decode`
PDCTL_TARGETS = re.compile(r"^pdctl (?:restart|drain|undrain|logs) ([a-z][\w-]*)", re.MULTILINE)
UNITS = re.compile(r"^systemctl (?:restart|stop|start) (pd-[\w-]+)", re.MULTILINE)
WORDS = {"prefill", "decode", "proxy", "all"}  # roles and the proxy, which every plan has


def _default_plan(inventory: str, tmp_path: Path) -> dict[str, object]:
    done = pdctl_in("plan", "--json", "--inventory", inventory, cwd=tmp_path)
    plan: dict[str, object] = json.loads(done.stdout)
    return plan


def test_the_readme_names_targets() -> None:
    # the checks below would pass on a README that names nothing
    assert "decode-0" in PDCTL_TARGETS.findall(README) and "pd-decode" in UNITS.findall(README)


@pytest.mark.parametrize("inventory", ["sim:mi300x-8", "sim:h200-8", "sim:h200-2", "sim:cpu"])
def test_every_instance_the_readme_names_is_in_the_default_plan(inventory: str, tmp_path: Path) -> None:
    plan = _default_plan(inventory, tmp_path)
    names = {str(i["name"]) for i in plan["instances"]}  # type: ignore[attr-defined]
    for word in PDCTL_TARGETS.findall(README):
        assert word in WORDS or word in names, f"README: `pdctl ... {word}`, but the default plan has {sorted(names)}"
    units = {f"pd-{n}" for n in names} | {"pd-prefill", "pd-decode", "pd-proxy"}
    for unit in UNITS.findall(README):
        assert unit.removesuffix(".service") in units, f"README: `systemctl ... {unit}`: no such unit"


def test_the_readme_says_what_replaces_systemctl_under_supervisord() -> None:
    using = README.split("## Using it", 1)[1].split("###", 1)[0]
    assert "systemd only" in using and "System has not been booted with systemd" in using
    assert "under supervisord use `pdctl restart`" in " ".join(using.split())


def test_the_readme_explains_cached_tokens_in_each_mode() -> None:
    # issue 27: in WRITE mode cached_tokens equals the whole prompt even for 11 tokens, which the README did not
    # explain; the behaviour itself is checked on real vLLM (tests/engine/test_pdctl_vllm_e2e.py, write mode)
    said = " ".join(README.split("`usage.prompt_tokens_details.cached_tokens`", 1)[1].split("\n\n", 1)[0].split())
    assert "In READ mode" in said and "whole blocks" in said and "report `cached_tokens` 0" in said
    assert "In WRITE mode" in said and "`cached_tokens` equals `prompt_tokens`" in said
    # issue 37: a 1-token WRITE prompt reported 0, and READ prompts of kB+1 tokens went decode-only
    assert "however short" not in said and "one-token prompt reports 0" in said
    assert "(129, 257, 385, ...:" in said and "(L-2)//128*128" in said


def test_the_readmes_read_mode_rule_is_the_proxys() -> None:
    """The lengths the README says are served by the decode alone are the ones the example connector routes so."""
    from appliance.connector import get_connector

    example = get_connector("example").side("read")
    alone = [n for n in range(1, 520) if not example.length_possible(n, 128)]
    assert alone == [*range(1, 130), 257, 385, 513], alone


MODE_LINES = re.compile(r"^(pdctl (?:mode|up --mode)[^#\n]*?)\s+#", re.MULTILINE)


def _readme_command(prefix: str) -> list[str]:
    """The arguments of the README's one command line that starts `prefix`."""
    lines = [line for line in MODE_LINES.findall(README) if line.startswith(prefix)]
    assert len(lines) == 1, (prefix, MODE_LINES.findall(README))
    return lines[0].split()[1:]


def test_the_readmes_mode_lines_work_as_written_on_the_node_install_makes(tmp_path: Path) -> None:
    """Issue 37: `pdctl mode read|write` was refused on the CPU node (its connector has READ only), and on nixl
    refused twice, first for --allow-downtime, then for --yes. Each README line runs as written, in order, on
    the node `pdctl up` makes on the CPU (simulated engines: the same plan, connector and proxy)."""
    # engines that "load" for 12 s, as vLLM does (for a while): the switch says what it waits for meanwhile
    config = write_config(tmp_path, tmp_path / "state", extra='[engine.sim]\nextra_args = ["--load-s", "12"]\n')
    pdctl(config, "up", check=True)
    try:
        # the CPU node runs the example connector, READ only: a switch is refused naming the README's `up` line
        refused = pdctl(config, "mode", "write", "--allow-downtime", "--yes")
        assert refused.returncode == 2 and "pdctl up --mode write" in refused.stderr, refused.stderr
        pdctl(config, *_readme_command("pdctl up --mode write"), check=True)
        assert status(config)["connector"] == "nixl"
        # without the flags, one refusal names both
        bare = pdctl(config, "mode", "read")
        assert bare.returncode == 2 and "--allow-downtime --yes" in bare.stderr, bare.stderr
        assert len(bare.stderr.strip().splitlines()) <= 2 and "Traceback" not in bare.stderr
        done = pdctl(config, *_readme_command("pdctl mode "), "--hold", "60")
        assert done.returncode == 0 and "mode read" in done.stdout, done.stdout + done.stderr
        # issue 37: on a pipe a mode switch said nothing for 31-74 s between "starting" and "admitted"
        assert "still waiting for " in done.stdout and "loading the model" in done.stdout, done.stdout
        assert status(config)["proxy"]["mode"] == "read"
        # issue 37: after `pdctl up --ignore-layout` (the settings' connector again: example), plan and doctor
        # described the recorded nixl node without saying so, while status showed the running one
        pdctl(config, "up", "--ignore-layout", check=True)
        assert status(config)["connector"] == "example"
        shown = pdctl(config, "plan", check=True).stdout
        assert "not the deployed plan: this one has connector nixl (deployed: example)" in " ".join(shown.split())
        rows = json.loads(pdctl(config, "doctor", "--json").stdout)
        assert rows[1]["check"] == "deployed" and "connector nixl (deployed: example)" in rows[1]["detail"], rows
        assert "not the deployed plan" not in pdctl(config, "plan", "--ignore-layout", check=True).stdout
    finally:
        pdctl(config, "down")
