"""The `pdctl` group itself: its help lists every command from the registry without importing any of them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import click
import pytest

from appliance.cli.main import COMMANDS, cli
from appliance.machines import MACHINES

# What `pdctl --help` must not load: each costs tens to hundreds of milliseconds on a busy 2-core node, and an
# operator runs the command in a loop (benchmarks/cli_latency.py measures it).
HEAVY = ("pydantic", "pydantic_settings", "rich", "aiohttp", "psutil", "appliance.plan", "appliance.settings",
         "appliance.inventory", "appliance.node", "appliance.proxy", "appliance.cli.options")


def _help_and_modules() -> tuple[str, set[str]]:
    code = ("import sys\nfrom appliance.cli.main import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('MODULES', *sorted(sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    text, _, modules = done.stdout.partition("MODULES ")
    return text, set(modules.split())


def test_help_imports_no_command_and_no_heavy_library() -> None:
    text, modules = _help_and_modules()
    assert "Commands:" in text and "status" in text
    loaded = sorted(m for m in modules if m.split(".")[0] in HEAVY or any(m.startswith(h + ".") or m == h for h in HEAVY))
    assert loaded == [], loaded
    assert not [m for m in modules if m.startswith("appliance.cli.") and m != "appliance.cli.main"]


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_summary_is_its_commands_own_first_sentence(name: str) -> None:
    command = cli.get_command(click.Context(cli), name)
    assert command is not None
    assert COMMANDS[name].summary == command.get_short_help_str(limit=10**6)
    assert COMMANDS[name].hidden == command.hidden


def test_help_shows_every_visible_command_and_no_hidden_one() -> None:
    text, _ = _help_and_modules()
    listed = {line.split()[0] for line in text.split("Commands:")[1].splitlines() if line.strip()}
    assert listed == {name for name, verb in COMMANDS.items() if not verb.hidden}


def test_inventory_help_names_every_simulated_machine() -> None:
    text = " ".join(_help_and_modules()[0].split())
    for name in MACHINES:
        assert f"sim:{name}," in text
    plan_help = subprocess.run([sys.executable, "-m", "appliance", "plan", "--help"], capture_output=True,
                               text=True, check=True, timeout=60).stdout
    for name in MACHINES:
        assert f"sim:{name}" in " ".join(plan_help.split())


def test_status_loads_none_of_what_it_does_not_use(tmp_path: Path) -> None:
    # `pdctl status` in an operator's loop: no asyncio/aiohttp stack, no pydantic-settings (no PDCTL_ setting
    # set), no Prometheus parser, no supervisord internals, and for --json no rich (psutil stays: the GPU detection reads sysfs with it)
    (tmp_path / "pdctl.toml").write_text(f'state_dir = "{tmp_path / "state"}"\n')
    code = ("import sys\nfrom appliance.cli.main import main\n"
            f"try:\n    main(['--config', {str(tmp_path / 'pdctl.toml')!r}, 'status', '--json'])\n"
            "except SystemExit:\n    pass\nprint('MODULES', *sorted(sys.modules))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDCTL_")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60,
                          env=env)
    assert '"state": "down"' in done.stdout  # it ran: nothing is deployed there
    modules = set(done.stdout.partition("MODULES ")[2].split())
    unwanted = ("asyncio", "aiohttp", "pydantic_settings", "prometheus_client", "supervisor", "rich")
    assert sorted(m for m in modules if m.split(".")[0] in unwanted or m in unwanted) == []
