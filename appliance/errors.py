"""Errors meant for people: each carries a one-line message and, where known, the fix; `run_command` shows
them (and click's usage errors) as one `pdctl: error:` line at a command line's edge."""

from __future__ import annotations

import sys

import click


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


class ExportError(PdctlError):
    """The plan cannot be expressed for the chosen target (an unsupported connector, layout or option)."""


class InventoryError(PdctlError):
    """An inventory source (a JSON file or a simulated name) cannot be read."""


def run_command(command: click.Command, argv: list[str] | None, prog_name: str) -> int:
    """Run a click command as a program: a mistake is one `pdctl: error:` line on stderr and its exit code."""
    try:
        result = command.main(args=argv, prog_name=prog_name, standalone_mode=False)
        # Without standalone mode click returns ctx.exit()'s code instead of exiting.
        return result if isinstance(result, int) else 0
    except PdctlError as exc:
        click.echo(f"pdctl: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("pdctl: aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        # Usage mistakes (a bad flag value, an unknown option) read like every other error: one line.
        where = exc.ctx.command_path if isinstance(exc, click.UsageError) and exc.ctx else "pdctl"
        hint = f" (see `{where} --help`)" if isinstance(exc, click.UsageError) else ""
        message = exc.format_message().rstrip(".")
        click.echo(f"pdctl: error: {message[:1].lower()}{message[1:]}{hint}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        click.echo("pdctl: interrupted", err=True)
        sys.exit(130)
