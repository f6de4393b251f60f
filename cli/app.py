"""The `kb` Typer app that every command registers on, and what the commands share.

Every command reads settings the same way (`kb.settings.load_settings`, with `--home`
overriding KB_HOME). A `KBError` from any command prints one line on stderr and exits 1;
anything else is a bug and keeps its traceback.

Output: results go to stdout through `out`; failures, warnings, progress and spinners go to stderr
through `err`. Text that comes from the KB or the user (names, ids, reasons, paths) is passed through
`esc` before rich renders it as markup, so a kernel named `[/oops]` prints as itself. Error lines and
log records pass through `kb.redact`, so no credential in a URL reaches the terminal. Both are `Console`s whose width is unbounded when their stream is not a terminal (a
pipe, a file, a test runner), so that no table of any command cuts or folds an id or a path there:
a script can paste what it reads into `kb show`.
"""

from __future__ import annotations

import os

# OpenMP threads that spin after the embedding model's forward pass slow the vector query that
# follows (11.5 vs 4.5 ms at 10k kernels on 2 cores); must be set before torch loads libgomp
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import logging
import signal
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console, ConsoleDimensions
from rich.markup import escape
from typer.core import TyperGroup

from kb.errors import KBError
from kb.redact import RedactingFilter, redact_text
from kb.settings import Settings, load_settings

if TYPE_CHECKING:
    from kb.store import KnowledgeBase

__all__ = ["DISTRIBUTION", "CONSOLE_KEY", "app", "err", "esc", "open_kb_of", "out", "settings_of"]

DISTRIBUTION = "kernel-kb"  # the name `kb --version` reads the package metadata of
CONSOLE_KEY = "kb.console"  # click's ctx.meta key of `out`, for commands defined below cli/ (verify.cli)
_UNBOUNDED = 1 << 20  # columns of a stream that is not a terminal: wider than any line kb prints


class _Console(Console):
    """A rich Console as wide as its content when its stream is not a terminal.

    Rich sizes a console by whichever of stdin/stdout/stderr is a terminal (else COLUMNS, else 80), so a
    piped stdout got tables cut to the width of the terminal beside it. The stream itself decides here; FORCE_COLOR
    (which makes rich call a pipe a terminal, for colours) does not make it narrow.
    """

    @property
    def size(self) -> ConsoleDimensions:
        size = super().size
        return size if self._is_tty() else ConsoleDimensions(_UNBOUNDED, size.height)

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        self._width, self._height = new_size

    def _is_tty(self) -> bool:
        isatty = getattr(self.file, "isatty", None)
        try:
            return bool(isatty is not None and isatty())
        except ValueError:  # a closed stream
            return False


out = _Console(highlight=False, soft_wrap=True)
err = _Console(stderr=True, highlight=False, soft_wrap=True)


def esc(value: object) -> str:
    """`value` as text that rich prints literally (its `[` escaped): every KB or user string in markup or a table cell."""
    return escape(str(value))


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
        except KBError as error:
            typer.echo(f"kb: error: {redact_text(str(error))}", err=True)
            ctx.exit(1)
        except KeyboardInterrupt as stop:
            typer.echo(f"kb: interrupted: {redact_text(str(stop))}" if str(stop) else "kb: interrupted", err=True)
            ctx.exit(128 + (caught[0] if caught else signal.SIGINT))
        finally:
            if previous is not None:
                _set_handler(signal.SIGTERM, previous)


def _set_handler(signum: int, handler):
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


def _print_version(value: bool) -> None:
    if not value:
        return
    try:
        meta = metadata.metadata(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        typer.echo(f"kb: error: no package metadata for {DISTRIBUTION} (install it: `pip install .` or "
                   "`pip install -e .` in a checkout)", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"{meta['Name']} {meta['Version']}")
    raise typer.Exit()


@app.callback()
def _root(
    ctx: typer.Context,
    home: Path | None = typer.Option(None, "--home", help="KB directory (overrides KB_HOME)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log progress to stderr."),
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="Print the distribution name and version, and exit."),
) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:  # every record, from any library (httpx logs request URLs)
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
    ctx.obj = load_settings(home=home)
    ctx.meta[CONSOLE_KEY] = out


def settings_of(ctx: typer.Context) -> Settings:
    """The settings the root callback loaded (for commands registered elsewhere)."""
    return ctx.find_root().obj


def open_kb_of(ctx: typer.Context, create: bool = False) -> KnowledgeBase:
    """The knowledge base the root callback's settings name (for a command to use as a context manager)."""
    from kb.store import open_kb

    return open_kb(settings_of(ctx), create=create)
