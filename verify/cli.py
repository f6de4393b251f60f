"""`kb verify SPEC CANDIDATE`: register with `app.command("verify")(verify_command)`."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from kb.errors import KBError
from kb.settings import Settings, load_settings
from verify import verify
from verify.options import VerifyOptions
from verify.report import result_table
from verify.sandbox import SandboxPolicy

__all__ = ["verify_command"]


def _settings(ctx: typer.Context | None) -> Settings:
    """The settings `kb`'s root callback loaded (`--home`), or fresh ones when called from Python."""
    obj = ctx.find_root().obj if ctx is not None else None
    return obj if isinstance(obj, Settings) else load_settings()


def _console(ctx: typer.Context | None) -> Console:
    """The console `kb` prints results through (cli.app puts it in ctx.meta under "kb.console": unbounded width
    when stdout is not a terminal), or a plain one when called from Python."""
    found = ctx.meta.get("kb.console") if ctx is not None else None
    return found if isinstance(found, Console) else Console()


def verify_command(
    spec: Annotated[Path, typer.Argument(help="spec file: Model, get_inputs, get_init_inputs")],
    candidate: Annotated[Path, typer.Argument(help="candidate file: ModelNew")],
    json_out: Annotated[Optional[Path], typer.Option("--json-out", help="where to write the JSON report")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the JSON report instead of a table")] = False,
    torch_baseline: Annotated[bool, typer.Option("--torch-baseline", help="allow torch compute ops (plain torch re-implementations)")] = False,
    backward: Annotated[bool, typer.Option("--backward", help="also check gradients (q, k, v, Model's learnable parameters) "
                                                               "against the fp32 reference, anti-cheat rules inside backward")] = False,
    timeout: Annotated[Optional[float], typer.Option("--timeout", metavar="SECONDS",
                                                     help="limit on the candidate process [default: KB_VERIFY_TIMEOUT, 600]")] = None,
    ctx: typer.Context = None,  # type: ignore[assignment]  # typer passes its context (typer.Context is no Optional); None from Python
) -> int:
    """Verify CANDIDATE against SPEC; exit code 0 only on a pass."""
    for path, what in ((spec, "spec"), (candidate, "candidate")):
        if not path.is_file():
            raise KBError(f"{what} file {path} does not exist")
    settings = _settings(ctx) if timeout is None else replace(_settings(ctx), verify_timeout=timeout)
    try:
        result = verify(spec, candidate, VerifyOptions(torch_baseline=torch_baseline, backward=backward,
                                                       timeout_s=settings.verify_timeout),
                        SandboxPolicy(hidden=(settings.home,)))  # --home may name a KB home outside KB_HOME
    except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM as `kb` maps it: the runner already killed the candidate
        raise KeyboardInterrupt("verification stopped; no candidate process or temp directory left, no report written") from err
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(result.to_json())
    if as_json:
        typer.echo(result.to_json())
    else:
        _console(ctx).print(result_table(result))
    return 0 if result.passed else 1
