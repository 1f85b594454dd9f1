"""What the CLI's command modules share (commands.py registers memory.py's command, so memory.py cannot
import commands.py): the user-mistake exception, the status line, the ``--trace`` option."""

from __future__ import annotations

import click

__all__ = ["UserError", "status", "TRACE_OPTION"]


class UserError(click.ClickException):
    """A user mistake: exit code 2, one line ``Error: ...`` on stderr."""

    exit_code = 2


def status(msg: str) -> None:
    click.echo(f"gradscope: {msg}", err=True)


TRACE_OPTION = click.option(
    "--trace/--no-trace",
    "use_trace",
    default=True,
    show_default=True,
    help="Record the forward pass with gradscope.trace() (module names, source lines of cuts) when available.",
)
