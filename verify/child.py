"""The child process: load, check and run one candidate, then write a JSON result.

Run as `python -m verify.child REQUEST.json RESULT.json PROGRESS.txt` by `verify.runner`.
RESULT holds {"result": VerifyResult} or {"user_error": message}; PROGRESS holds the
call in flight, so a parent that sees the child die (segfault, memory limit) can say where.
The child first starts `verify.reaper` in its process group: when the child dies, however it
dies, the reaper kills whatever else the candidate left running in the group.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from kb.lower.interpreter_fixes import install as install_interpreter_fixes
from verify.load import CandidateImportError, SpecError, check_signatures, load_candidate, load_spec
from verify.options import VerifyOptions
from verify.result import Finding, Verdict, VerifyResult
from verify.session import Session
from verify.shapes import held_summary
from verify.static import scan_candidate

__all__ = ["run_in_process", "main"]

log = logging.getLogger(__name__)


def _device(opts: VerifyOptions) -> str:
    if opts.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return opts.device


def run_in_process(spec_path: Path, cand_path: Path, opts: VerifyOptions, progress: Path | None = None) -> VerifyResult:
    """The whole verification inside this process. Raises SpecError for user mistakes."""
    start = time.monotonic()
    seed = opts.seed if opts.seed is not None else secrets.randbits(31)
    device = _device(opts)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    base = dict(spec=str(spec_path), candidate=str(cand_path), seed=seed, torch_baseline=opts.torch_baseline, device=device)
    spec = load_spec(spec_path)

    def early(finding: Finding) -> VerifyResult:
        return VerifyResult(verdict=finding.verdict, message=finding.message, finding=finding,
                            duration_s=time.monotonic() - start, **base)  # type: ignore[arg-type]

    try:
        static = scan_candidate(cand_path, spec_path, opts.torch_baseline, backward=opts.backward)
    except SyntaxError as err:
        return early(Finding(Verdict.compile_error, f"candidate has a syntax error: {err}", detail=traceback.format_exc(limit=-2)))
    if static:  # decided before importing: importing already runs the candidate's code
        f = static[0]
        return early(Finding(f.verdict, f"static scan: {f.message} (line {f.line})", op=f.op, detail=f"{cand_path}:{f.line}",
                             phase=f.phase))
    sys.path.insert(0, str(cand_path.resolve().parent))  # candidates may import their sibling modules
    if os.environ.get("TRITON_INTERPRET") == "1":  # Triton's interpreter bugs are not the candidate's (bf16 dots)
        install_interpreter_fixes()
    try:
        cand_cls = load_candidate(cand_path)
    except CandidateImportError as err:
        return early(Finding(Verdict.compile_error, str(err), detail=err.detail))
    check_signatures(spec.model_cls, cand_cls)
    session = Session(spec, cand_cls, opts, device, seed, progress)
    finding = session.run()
    verdict = finding.verdict if finding else Verdict.passed
    shapes = f"{len(session.cases_run)} shapes" if session.cases_run else "the spec's own inputs"  # a serving layout
    message = finding.message if finding else f"passed {session.calls} calls over {shapes}"
    if finding is None and session.serving_checked:
        message += f" and its serving-layout variants ({'; '.join(session.serving_checked)})"
    if finding is None and opts.backward:
        message += f", gradients of {', '.join(session.targets.labels)} checked on {session.bwd_calls} backward calls"
    if finding is None and spec.fixed_dims:
        message += f"; {held_summary(spec.fixed_dims)}"
    timing = session.time_it() if finding is None else None
    return session.result(verdict, message, finding, timing, time.monotonic() - start, base)


def _start_reaper() -> subprocess.Popen:
    """`verify.reaper` in this process group, armed to kill the group when this process dies."""
    return subprocess.Popen([sys.executable, "-m", "verify.reaper", str(os.getpid())], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main(argv: list[str]) -> int:
    reaper = _start_reaper()  # noqa: F841 - lives until this process dies, then kills the group
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    request, result_path, progress = json.loads(Path(argv[0]).read_text()), Path(argv[1]), Path(argv[2])
    opts = VerifyOptions.from_dict(request["options"])
    payload: dict[str, Any]
    try:
        res = run_in_process(Path(request["spec"]), Path(request["candidate"]), opts, progress)
        payload = {"result": res.to_dict()}
    except SpecError as err:
        payload = {"user_error": str(err)}
    result_path.write_text(json.dumps(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
