"""The `pdctl` group itself: its help lists every command from the registry without importing any of them."""

from __future__ import annotations

import subprocess
import sys

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
