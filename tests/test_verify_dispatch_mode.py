"""The verifier's dispatch modes watch every op, custom ops' kernels included, without importing torch._dynamo (1.5 s
per verification child), and still keep dynamo out of their handlers once something has imported it (a candidate
calling torch.compile)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.repo import REPO

_SCRIPT = """
import json, sys
import torch
from verify.guard import CallGuard
from verify.grads import DtypeEmulation

x = torch.randn(8, 8)
seen = {}
with CallGuard(True, "spec.py", [x], 64) as guard:
    torch.matmul(x, x)
seen["plain"] = guard.violation and guard.violation.verdict.value


@torch.library.custom_op("kbtest::square", mutates_args=())
def square(a: torch.Tensor) -> torch.Tensor:
    return a @ a

with CallGuard(True, "spec.py", [x], 64) as guard:  # the op's kernel is run by the guard, inside the mode
    square(x)
seen["custom_op"] = guard.violation and guard.violation.verdict.value
with DtypeEmulation(torch.bfloat16):
    seen["rounded"] = (x * 1.0).equal(x.to(torch.bfloat16).float())
seen["dynamo_imported"] = "torch._dynamo" in sys.modules

@torch.compile(backend="eager")
def product(a):
    return a @ a

with CallGuard(True, "spec.py", [x], 64) as guard:
    product(x)
seen["compiled"] = guard.violation and guard.violation.verdict.value
print(json.dumps(seen))
"""


def test_modes_watch_ops_without_dynamo_and_under_torch_compile() -> None:
    res = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    seen = json.loads(res.stdout.splitlines()[-1])
    assert seen == {"plain": "forbidden_call", "custom_op": "forbidden_call", "rounded": True, "dynamo_imported": False, "compiled": "forbidden_call"}
