"""The `kb` Typer app that every command registers on, and what the commands share.

Every command reads settings the same way (`kb.settings.load_settings`, with `--home`
overriding KB_HOME). A `KBError` from any command prints one line on stderr and exits 1;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import os

# OpenMP threads that spin after the embedding model's forward pass slow the vector query that
# follows (11.5 vs 4.5 ms at 10k kernels on 2 cores); must be set before torch loads libgomp
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import logging
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from typer.core import TyperGroup

from kb.errors import KBError
from kb.settings import Settings, load_settings

if TYPE_CHECKING:
    from kb.store import KnowledgeBase

__all__ = ["app", "open_kb_of", "out", "settings_of"]

out = Console(highlight=False, soft_wrap=True)


class _KBGroup(TyperGroup):
    """Turns `KBError` into one line on stderr and exit status 1, and a stop into one line and 128 + signal.

    SIGTERM raises KeyboardInterrupt like Ctrl-C, so both unwind through every `finally` (the
    verify runner kills its candidate there, generate records its run as interrupted). A command
    says what it kept as the KeyboardInterrupt's message: `kb: interrupted: <message>`.
    """

    # the base names typer's private click Context; typer hands every command its public subclass
    def invoke(self, ctx: typer.Context) -> Any:  # type: ignore[override]
        caught: list[int] = []

        def on_sigterm(signum: int, frame: object) -> None:
            caught.append(signum)
            raise KeyboardInterrupt

        previous = _set_handler(signal.SIGTERM, on_sigterm)
        try:
            return super().invoke(ctx)
        except KBError as err:
            typer.echo(f"kb: error: {err}", err=True)
            ctx.exit(1)
        except KeyboardInterrupt as err:
            typer.echo(f"kb: interrupted: {err}" if str(err) else "kb: interrupted", err=True)
            ctx.exit(128 + (caught[0] if caught else signal.SIGINT))
        finally:
            if previous is not None:
                _set_handler(signal.SIGTERM, previous)


def _set_handler(signum: int, handler):  # noqa: ANN001, ANN202
    """signal.signal, or None where it cannot be set (not the main thread)."""
    try:
        return signal.signal(signum, handler)
    except ValueError:
        return None


app = typer.Typer(
    cls=_KBGroup,
    help="kernel-kb: a knowledge base of expert GPU attention kernels.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)


@app.callback()
def _root(
    ctx: typer.Context,
    home: Path | None = typer.Option(None, "--home", help="KB directory (overrides KB_HOME)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log progress to stderr."),
) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    ctx.obj = load_settings(home=home)


def settings_of(ctx: typer.Context) -> Settings:
    """The settings the root callback loaded (for commands registered elsewhere)."""
    return ctx.find_root().obj


def open_kb_of(ctx: typer.Context, create: bool = False) -> KnowledgeBase:
    """The knowledge base the root callback's settings name (for a command to use as a context manager)."""
    from kb.store import open_kb

    return open_kb(settings_of(ctx), create=create)
