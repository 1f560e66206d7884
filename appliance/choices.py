"""Click choices read from registries when used, so names registered after import (plug-ins, tests) count."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import click

from appliance.connector import check_name, names


class ConnectorChoice(click.Choice[str]):
    """The registered connector names (plus "auto" where the platform picks one)."""

    def __init__(self, allow_auto: bool = False) -> None:
        self.allow_auto = allow_auto
        super().__init__(())

    @property  # type: ignore[override]
    def choices(self) -> Sequence[str]:
        """Read from the registry every time."""
        return tuple((["auto"] if self.allow_auto else []) + names())

    @choices.setter
    def choices(self, value: Sequence[str]) -> None:
        # click.Choice.__init__ assigns its argument; the registry is the only source, so it is dropped
        pass

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        """A registered name, or "module:Class" for a connector outside pdctl (checked by importing it)."""
        if isinstance(value, str) and ":" in value:
            try:
                return check_name(value)
            except ValueError as exc:
                self.fail(str(exc), param, ctx)
        return super().convert(value, param, ctx)
