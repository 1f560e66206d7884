"""Errors meant for people: each carries a one-line message and, where known, the fix."""

from __future__ import annotations


class PdctlError(Exception):
    """A user-facing failure: the CLI prints it as one line and exits non-zero, never a traceback."""

    exit_code = 2

    def __init__(self, message: str, fix: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix

    def __str__(self) -> str:
        return f"{self.message} (fix: {self.fix})" if self.fix else self.message


class ConfigError(PdctlError):
    """The settings file or environment holds a value that is not allowed."""


class PlanError(PdctlError):
    """The settings cannot be turned into a plan on this inventory."""


class InventoryError(PdctlError):
    """An inventory source (a JSON file or a simulated name) cannot be read."""
