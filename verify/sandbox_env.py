"""The environment a sandboxed child gets: an allow-list, never the user's secrets.

A variable passes when its name is listed in `ALLOWED` or starts with one of `ALLOWED_PREFIXES`
(what Python, PyTorch, Triton, CUDA and the C compiler Triton calls read), and its name does not look
like a secret (`SECRET_NAME`: keys, tokens, passwords, URLs that may carry them). `KB_*` never passes:
settings such as `KB_LLM_API_KEY` and `KB_DB_URL` (a PostgreSQL password) are the parent's business.
The variables that say where a process writes (HOME, TMPDIR, the compiler caches) are not passed but
set by the sandbox to its own directories.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from kb.errors import KBError

__all__ = ["ALLOWED", "ALLOWED_PREFIXES", "SECRET_NAME", "REPOINTED", "scrub_env"]

ALLOWED = frozenset({
    "PATH", "LANG", "LANGUAGE", "TZ", "USER", "LOGNAME",  # getpass.getuser() and locale
    "VIRTUAL_ENV", "CONDA_PREFIX", "CONDA_DEFAULT_ENV", "LD_LIBRARY_PATH",
    "CC", "CXX",  # the compiler Triton builds its launcher with
    "CUBLAS_WORKSPACE_CONFIG", "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES",
    "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
})
ALLOWED_PREFIXES = ("LC_", "PYTHON", "CUDA_", "TRITON_", "TORCH_", "PYTORCH_", "TORCHINDUCTOR_",
                    "OMP_", "MKL_", "OPENBLAS_", "KMP_", "GOMP_")
SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASS|CREDENTIAL|AUTH|COOKIE|SESSION|URL|URI|DSN|CERT", re.IGNORECASE)
# where a process writes: set by the sandbox to its own directories, never taken from the user
REPOINTED = frozenset({"HOME", "TMPDIR", "TMP", "TEMP", "XDG_CACHE_HOME", "TRITON_HOME", "TRITON_CACHE_DIR",
                       "TRITON_DUMP_DIR", "TRITON_OVERRIDE_DIR", "TORCHINDUCTOR_CACHE_DIR", "CUDA_CACHE_PATH"})


def _passes(name: str) -> bool:
    if name.startswith("KB_") or name in REPOINTED or SECRET_NAME.search(name):
        return False
    return name in ALLOWED or name.startswith(ALLOWED_PREFIXES)


def scrub_env(environ: Mapping[str, str], set_vars: Mapping[str, str], pass_env: Iterable[str] = ()) -> tuple[dict[str, str], tuple[str, ...]]:
    """(the child's environment, the names withheld from it).

    `set_vars` are set as given (the sandbox's directories, TRITON_INTERPRET, PYTHONPATH); `pass_env` names
    extra variables the caller vouches for, which may not be `KB_*` or look like a secret."""
    for name in pass_env:
        if name.startswith("KB_") or SECRET_NAME.search(name):
            raise KBError(f"refusing to pass {name} to sandboxed code: KB_* settings and secret-looking names "
                          f"({SECRET_NAME.pattern}) never reach a candidate")
    extra = set(pass_env)
    env = {k: v for k, v in environ.items() if k in extra or _passes(k)}
    withheld = tuple(sorted(k for k in environ if k not in env and k not in set_vars))
    return env | dict(set_vars), withheld
