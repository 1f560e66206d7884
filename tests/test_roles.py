"""The transfer mode has one definition (appliance.roles.Mode): every command line offers exactly its choices and
every reader of a mode goes through parse_mode."""

from __future__ import annotations

import re
from typing import Any

import click
import pytest

from appliance.cli.mode import mode
from appliance.cli.plan import plan
from appliance.engine.sim.cli import sim_engine
from appliance.roles import MODES, parse_mode


@pytest.mark.parametrize("text, expected", [("read", "read"), ("write", "write"), ("READ", "read"),
                                            ("Write", "write")])
def test_parse_mode_reads_any_case_into_the_users_words(text: str, expected: str) -> None:
    assert parse_mode(text) == expected


@pytest.mark.parametrize("value", ["pull", "", " read", None, 1, ["read"]])
def test_parse_mode_refuses_anything_else_naming_the_choices(value: Any) -> None:
    with pytest.raises(ValueError, match=re.escape(f"must be read or write, got {value!r}")):
        parse_mode(value)


@pytest.mark.parametrize("command, param", [(plan, "mode"), (mode, "new_mode"), (sim_engine, "mode")])
def test_every_mode_choice_is_the_one_definition(command: click.Command, param: str) -> None:
    found = {p.name: p for p in command.params}[param]
    assert isinstance(found.type, click.Choice)
    assert tuple(found.type.choices) == MODES
