"""``gradscope diff a.json b.json``: the click command (registered in ``gradscope/cli/commands.py``)."""

from __future__ import annotations

import sys

import click
import networkx as nx

from gradscope.errors import GradscopeError

__all__ = ["diff_cmd"]


@click.command("diff")
@click.argument("before")
@click.argument("after")
@click.option(
    "--by",
    type=click.Choice(["module", "op"]),
    default=None,
    help="Also print both memory tables, grouped by module or op kind.",
)
@click.option(
    "--depth",
    type=click.IntRange(min=1),
    default=None,
    help="Merge submodules into their first N name components (2: blocks.3.attn -> blocks.3).",
)
@click.option("--exit-code", is_flag=True, help="Exit 1 when the reports differ (like git diff --exit-code).")
def diff_cmd(before: str, after: str, by: str | None, depth: int | None, exit_code: bool) -> None:
    """Compare two reports written by `gradscope render ... -o x.json` or `report.render("x.json")`.

    Prints op kinds added or removed, parameters, saved bytes per module before and after, and findings
    that appeared or disappeared. Exits 0 (or 1 with --exit-code when they differ); 2 on a bad file.

    \b
    Examples:
      gradscope render train.py:make_loss -o before.json
      gradscope render train.py:make_loss_ckpt -o after.json
      gradscope diff before.json after.json --depth 2
    """
    from gradscope.compare import diff
    from gradscope.report import load

    a, b = _load(load, before), _load(load, after)
    d = diff(a, b, depth=depth)
    click.echo(str(d))
    if by is not None:
        for label, r in (("before", a), ("after", b)):
            click.echo(f"\n[{label}] " + str(r.memory(by=by, depth=depth if by == "module" else None)))
    if exit_code and d:
        sys.exit(1)


def _load(load, path: str):
    """Load one report; a user mistake ends the command with one line on stderr and exit code 2."""
    try:
        report = load(path)
        report.memory()  # a JSON that is node-link data but not a gradscope report fails here
        return report
    except GradscopeError as exc:
        message = str(exc)
    except IsADirectoryError:
        message = f"{path!r} is a directory; pass a report file written by report.render('x.json')."
    except OSError as exc:
        message = f"cannot read {path!r} ({exc.strerror or exc}); pass a readable report file."
    except (KeyError, TypeError, ValueError, AttributeError, nx.NetworkXError) as exc:
        message = (
            f"{path!r} is not a gradscope report ({type(exc).__name__}: {exc}); pass a file written "
            "by report.render('x.json')."
        )
    click.echo(f"gradscope diff: {message}", err=True)
    sys.exit(2)
