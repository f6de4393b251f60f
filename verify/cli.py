"""`kb verify SPEC CANDIDATE`: register with `app.command("verify")(verify_command)`."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated, Optional

import click
import typer
from rich.console import Console

from kb.errors import KBError
from kb.settings import Settings, load_settings
from verify.options import VerifyOptions
from verify.report import result_table

__all__ = ["verify_command"]


def _settings() -> Settings:
    """The settings `kb`'s root callback loaded (`--home`), or fresh ones when called from Python."""
    ctx = click.get_current_context(silent=True)
    obj = ctx.find_root().obj if ctx is not None else None
    return obj if isinstance(obj, Settings) else load_settings()


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
) -> int:
    """Verify CANDIDATE against SPEC; exit code 0 only on a pass."""
    from verify import verify

    for path, what in ((spec, "spec"), (candidate, "candidate")):
        if not path.is_file():
            raise KBError(f"{what} file {path} does not exist")
    settings = _settings() if timeout is None else replace(_settings(), verify_timeout=timeout)
    try:
        result = verify(spec, candidate, VerifyOptions(torch_baseline=torch_baseline, backward=backward,
                                                       timeout_s=settings.verify_timeout))
    except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM as `kb` maps it: the runner already killed the candidate
        raise KeyboardInterrupt("verification stopped; no candidate process or temp directory left, no report written") from err
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(result.to_json())
    if as_json:
        typer.echo(result.to_json())
    else:
        Console().print(result_table(result))
    return 0 if result.passed else 1
