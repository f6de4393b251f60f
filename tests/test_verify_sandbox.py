"""Candidate code runs sandboxed: no secrets, no network, no writes outside its directory; honest kernels still pass.

The attacker (tests/support/verify_fixtures/sandbox_attacker.py) runs through `kb verify` with a KB_LLM_API_KEY,
a PostgreSQL password in KB_DB_URL, cloud tokens in the environment and secrets in the user's home and KB home;
a TCP server listens on 127.0.0.1. What the sandbox must stop is checked on its effects (the server's
backlog, the files on disk) and on what the attacker reported. Whether this machine offers a network namespace
and Landlock is asked independently of the code under test (util-linux's `unshare`, the Landlock syscall), so a
sandbox that silently lost a layer fails here instead of passing vacuously.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import shutil
import socket
import subprocess
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import verify.confine as confine
import verify.sandbox as sandbox
from kb.errors import KBError
from tests.support.procs import kb_env
from tests.support.repo import KB_CLI
from verify import Verdict, VerifyOptions, VerifyResult, verify
from verify.sandbox import Sandbox, SandboxPolicy, default_cache_dir
from verify.sandbox_env import scrub_env
from verify.sandbox_fs import FsView

FIX = Path(__file__).parent / "support" / "verify_fixtures"
SPEC = FIX / "attn_spec.py"
FAST = VerifyOptions(distributions=("normal",), max_cases=1, timeout_s=300)
SECRETS = {"KB_LLM_API_KEY": "sk-kb-llm-5ecret", "KB_DB_URL": "postgresql://kb:hunter2-db-pw@127.0.0.1:5432/kb",
           "AWS_SECRET_ACCESS_KEY": "aws-5ecret-key", "AWS_ACCESS_KEY_ID": "AKIA5ECRET", "HF_TOKEN": "hf_5ecret",
           "GITHUB_TOKEN": "ghp_5ecret", "OPENAI_API_KEY": "sk-openai-5ecret", "PGPASSWORD": "pg-5ecret"}
FILE_SECRETS = {"config.toml": "sk-in-config-5ecret", ".aws/credentials": "aws-file-5ecret", ".pgpass": "pgpass-5ecret"}


# ---- independent oracles: what this machine allows

def _netns_possible() -> bool:
    if shutil.which("unshare") is None:
        return False
    for cmd in (["unshare", "--net", "true"], ["unshare", "--user", "--map-current-user", "--net", "true"]):
        if subprocess.run(cmd, capture_output=True).returncode == 0:
            return True
    return False


def _seccomp_possible() -> bool:
    status = Path("/proc/self/status").read_text() if Path("/proc/self/status").exists() else ""
    return "Seccomp:" in status and os.uname().machine in ("x86_64", "aarch64")


def _landlock_abi() -> int:
    syscall = ctypes.CDLL(None, use_errno=True).syscall
    syscall.restype = ctypes.c_long
    return max(0, int(syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))))  # landlock_create_ruleset(VERSION)


# ---- the attack

@pytest.fixture(scope="module")
def attack(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A home and a KB home holding secrets, a listening server, the attacker and its targets; `kb verify` run on it
    once for the three tests that read its outcome."""
    tmp_path = tmp_path_factory.mktemp("attack").resolve()
    home, kb_home = tmp_path / "home", tmp_path / "kb-home"
    (home / ".aws").mkdir(parents=True)
    kb_home.mkdir()
    (kb_home / "config.toml").write_text(f'llm_api_key = "{FILE_SECRETS["config.toml"]}"\n')
    (home / ".aws" / "credentials").write_text(f"aws_secret_access_key = {FILE_SECRETS['.aws/credentials']}\n")
    (home / ".pgpass").write_text(f"127.0.0.1:5432:kb:kb:{FILE_SECRETS['.pgpass']}\n")
    cand_dir = tmp_path / "candidate"
    cand_dir.mkdir()
    candidate = Path(shutil.copy(FIX / "sandbox_attacker.py", cand_dir))
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    (tmp_path / "run").mkdir()
    bus = socket.socket(socket.AF_UNIX)  # a local service reached through its socket file, as the session bus
    bus.bind(str(tmp_path / "run" / "bus"))
    bus.listen(8)
    writes = [str(tmp_path / "outside.txt"), str(home / "planted.txt"), str(kb_home / "planted.txt"),
              str(cand_dir / "sibling_module.py")]
    reads = [str(kb_home / "config.toml"), str(home / ".aws" / "credentials"), str(home / ".pgpass")]
    (cand_dir / "targets.json").write_text(json.dumps({"read": reads, "write": writes, "host": "127.0.0.1",
                                                       "port": server.getsockname()[1], "unix": str(tmp_path / "run" / "bus")}))
    env = kb_env(tmp_path, HOME=str(home), KB_HOME=str(kb_home), **SECRETS)
    try:
        res = subprocess.run([*KB_CLI, "verify", str(SPEC), str(candidate), "--json"], env=env, capture_output=True,
                             text=True, timeout=600)
        connected, unix_connected = _was_connected(server), _was_connected(bus)
    finally:
        server.close()
        bus.close()
    assert res.returncode == 1, res.stderr
    result = VerifyResult.from_json(res.stdout)
    assert result.verdict is Verdict.runtime_error and result.finding is not None, result.message
    report = json.loads(result.finding.detail.rsplit("SANDBOX-REPORT ", 1)[1].strip())
    return dict(result=result, raw=res.stdout + res.stderr, report=report, connected=connected,
                unix_connected=unix_connected, writes=writes, reads=reads, home=home)


def _was_connected(server: socket.socket) -> bool:
    """Whether a connection waits in the listening socket's backlog (one made and closed still waits there)."""
    server.setblocking(False)
    try:
        server.accept()[0].close()
        return True
    except BlockingIOError:
        return False


def test_the_candidate_sees_no_secret(attack: dict) -> None:
    iso, report = attack["result"].isolation, attack["report"]
    assert iso is not None and iso.env == "scrubbed"
    assert not [k for k in report["env"] if k.startswith("KB_") or k in SECRETS]
    assert set(SECRETS) <= set(iso.withheld_env)  # the names are reported, never the values
    assert report["env"]["HOME"] == iso.workdir and report["env"]["TMPDIR"] == iso.workdir
    for value in [*SECRETS.values(), *FILE_SECRETS.values(), "hunter2"]:
        assert value not in attack["raw"], f"{value} leaked into the verify report"
    if _landlock_abi() >= 2:  # the home and KB home are hidden, the parent's environment unreadable
        assert iso.filesystem == "landlock"
        assert all(attack["report"]["read"][p] == "PermissionError" for p in attack["reads"]), attack["report"]["read"]
        assert report["parent_environ"] == "PermissionError"


def test_the_candidate_cannot_reach_the_network(attack: dict) -> None:
    iso, report = attack["result"].isolation, attack["report"]
    if _netns_possible():
        assert iso.network == "namespace", iso.missing
    if iso.network in ("namespace", "tcp-denied"):
        assert not attack["connected"], "the candidate reached a server on 127.0.0.1"
        assert report["connect"] != "connected"
    else:
        assert iso.missing, "an open network must be reported"
    if _seccomp_possible():
        assert iso.unix_sockets == "blocked", iso.missing
        assert report["connect_unix"] == "PermissionError: Operation not permitted" and not attack["unix_connected"]


def test_the_candidate_cannot_write_outside_its_directory(attack: dict) -> None:
    iso, report = attack["result"].isolation, attack["report"]
    scratch = os.path.join(iso.workdir, "scratch.txt")
    assert report["write"][scratch] == "written" and report["child_write"][scratch + ".child"] == "written"
    if _landlock_abi() >= 2:
        assert iso.filesystem == "landlock", iso.missing
        for path in attack["writes"]:
            assert report["write"][path] == "PermissionError" and not Path(path).exists()
            assert report["child_write"][path + ".child"] == "PermissionError" and not Path(path + ".child").exists()
        assert iso.signals_scoped == (iso.landlock_abi >= 6)
        if iso.signals_scoped:
            assert report["signal_parent"] == "PermissionError"
    else:
        assert iso.filesystem == "open" and iso.missing
    assert not Path(iso.workdir).exists(), "the sandbox directory outlived the run"


# ---- honest candidates still pass, and the result says how they ran

def test_an_honest_triton_kernel_passes_in_the_sandbox(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(sandbox, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="verify.sandbox"):
        r = verify(SPEC, FIX / "triton_flash.py", FAST)
    assert r.verdict is Verdict.passed, r.message
    iso = r.isolation
    assert iso is not None and "address space 16384 MiB" in iso.limits and any(x.startswith("CPU time") for x in iso.limits)
    assert r.memory is not None and r.memory.method == "peak RSS (VmHWM reset)"  # /proc/self/clear_refs stays writable
    assert bool(iso.missing) == bool(caplog.records)
    round_trip = VerifyResult.from_json(r.to_json())
    assert round_trip.isolation == iso


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_sandboxed_child_reaches_the_driver_and_compiles() -> None:
    """The GPU path: /dev/nvidia* open, the CUDA driver initialised, Triton's compiler (gcc for its launcher, ptxas)
    writing to the sandbox's cache, with every layer in force."""
    r = verify(SPEC, FIX / "triton_flash.py", replace(FAST, device="cuda"))
    assert r.verdict is Verdict.passed and r.device == "cuda", r.message
    assert r.isolation is not None and not r.isolation.missing, r.isolation
    assert any((default_cache_dir() / "triton").iterdir()), "Triton compiled nothing into the sandbox's cache"


def test_missing_isolation_is_one_warning_and_reported(monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """No namespace and no Landlock (as on a machine that allows neither): the verdict is unchanged, the result and
    one warning per process say what is missing."""
    monkeypatch.setattr(confine, "_new_netns", lambda unshare: "unshare(CLONE_NEWNET): Operation not permitted (test)")
    monkeypatch.setattr(sandbox, "abi_version", lambda: (0, "the kernel has no Landlock (test)"))
    monkeypatch.setattr(sandbox, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="verify.sandbox"):
        first = verify(SPEC, FIX / "torch_reference.py", replace(FAST, torch_baseline=True))
        second = verify(SPEC, FIX / "torch_reference.py", replace(FAST, torch_baseline=True))
    assert first.verdict is Verdict.passed and second.verdict is Verdict.passed, first.message
    iso = first.isolation
    assert iso is not None and iso.network == "open" and iso.filesystem == "open" and iso.env == "scrubbed"
    assert len(iso.missing) == 2 and "Operation not permitted (test)" in iso.missing[0] and "(test)" in iso.missing[1]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no network namespace" in warnings[0] and "no read-only view" in warnings[0]


def test_without_a_namespace_landlock_still_denies_tcp(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    if _landlock_abi() < 4:
        pytest.skip("Landlock ABI < 4 (Linux < 6.7) has no TCP rules")
    monkeypatch.setattr(confine, "_new_netns", lambda unshare: "unshare(CLONE_NEWNET): Operation not permitted (test)")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    (tmp_path / "probe.py").write_text("import socket, sys\ntry:\n    socket.create_connection(('127.0.0.1', int(sys.argv[1])), 5)\n"
                                       "    print('connected')\nexcept OSError as e:\n    print(type(e).__name__)\n")
    with Sandbox(SandboxPolicy(python_path=(tmp_path,))) as box:
        run = box.run("probe", [str(server.getsockname()[1])], timeout_s=120)
    server.close()
    assert run.isolation.network == "tcp-denied" and "TCP denied by Landlock; UDP open" in run.isolation.missing[0]
    assert run.stdout.strip() == "PermissionError", run.stderr


def _refuse_the_direct_unshare(monkeypatch: pytest.MonkeyPatch) -> None:
    """As for a user without CAP_SYS_ADMIN: the first unshare (network + IPC namespace, no user namespace) is refused."""
    if not _netns_possible() or subprocess.run(["unshare", "--user", "true"], capture_output=True).returncode:
        pytest.skip("this machine allows no user namespace")
    real = confine._unshare_fn

    def refusing() -> Callable[[int], int]:
        call, calls = real(), []

        def unshare(flags: int) -> int:
            calls.append(flags)
            return errno.EPERM if len(calls) == 1 else call(flags)

        return unshare

    monkeypatch.setattr(confine, "_unshare_fn", refusing)


def _probe(tmp_path: Path) -> Path:
    (tmp_path / "probe.py").write_text("import os\nopen('made.txt', 'w').write('x')\n"
                                       "print(os.geteuid(), *open('/proc/self/uid_map').read().split())\n")
    return tmp_path


def test_an_unprivileged_user_gets_the_namespace_through_a_user_namespace(monkeypatch: pytest.MonkeyPatch,
                                                                           tmp_path: Path) -> None:
    """The child maps its own ids in a new user namespace, enters a network namespace from there, and still writes."""
    _refuse_the_direct_unshare(monkeypatch)
    with Sandbox(SandboxPolicy(python_path=(_probe(tmp_path),))) as box:
        run = box.run("probe", [], timeout_s=120)
        made = (box.workdir / "made.txt").exists()
    assert run.returncode == 0 and made, run.stderr
    uid = os.geteuid()
    assert run.isolation.network == "namespace"
    assert run.stdout.split() == [str(uid), str(uid), str(uid), "1"]  # its own uid, mapped to itself


def test_a_user_namespace_it_cannot_map_is_left_for_no_namespace(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Id maps refused (a user namespace where files could not even be created): the child starts again without
    one, runs, and the result says why the network is open."""
    _refuse_the_direct_unshare(monkeypatch)
    real_write = confine._write

    def no_maps(path: str, text: str) -> None:
        if path.endswith("uid_map"):
            raise PermissionError(errno.EPERM, "Operation not permitted (test)")
        real_write(path, text)

    monkeypatch.setattr(confine, "_write", no_maps)
    with Sandbox(SandboxPolicy(python_path=(_probe(tmp_path),))) as box:
        run = box.run("probe", [], timeout_s=120)
    assert run.returncode == 0, run.stderr
    assert run.isolation.network in ("tcp-denied", "open")
    assert "user namespace id maps: Operation not permitted (test)" in run.isolation.missing[0]
    assert run.stdout.split()[1:] == ["0", "0", "4294967295"]  # the initial user namespace: no namespace of its own


# ---- the pieces

def test_env_allow_list() -> None:
    environ = {"PATH": "/usr/bin", "LC_ALL": "C", "CUDA_VISIBLE_DEVICES": "0", "TRITON_PTXAS_PATH": "/x/ptxas",
               "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "OMP_NUM_THREADS": "2", **SECRETS,
               "NVIDIA_API_KEY": "nv", "TRITON_REMOTE_CACHE_URL": "redis://:pw@h", "HOME": "/home/u",
               "TRITON_CACHE_DIR": "/home/u/.triton/cache", "SSH_AUTH_SOCK": "/run/agent", "MY_TOOL": "x"}
    env, withheld = scrub_env(environ, {"HOME": "/w", "TRITON_CACHE_DIR": "/c"}, pass_env=("MY_TOOL",))
    assert env == {"PATH": "/usr/bin", "LC_ALL": "C", "CUDA_VISIBLE_DEVICES": "0", "TRITON_PTXAS_PATH": "/x/ptxas",
                   "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "OMP_NUM_THREADS": "2", "MY_TOOL": "x",
                   "HOME": "/w", "TRITON_CACHE_DIR": "/c"}
    assert set(withheld) == set(SECRETS) | {"NVIDIA_API_KEY", "TRITON_REMOTE_CACHE_URL", "SSH_AUTH_SOCK"}
    for name in ("KB_DB_URL", "HF_TOKEN"):
        with pytest.raises(KBError, match="never reach a candidate"):
            scrub_env(environ, {}, pass_env=(name,))


def test_fs_view_hides_trees_and_reopens_what_the_child_needs(tmp_path: Path) -> None:
    tmp_path = tmp_path.resolve()
    home = tmp_path / "home"
    for d in ("venv/lib", ".ssh", "work"):
        (home / d).mkdir(parents=True)
    (tmp_path / "other").mkdir()
    (tmp_path / "file.txt").write_text("x")
    view = FsView(hidden=(home,), readable=(home / "venv", home, tmp_path), writable=(home / "work",))
    rules = dict(view.rules())
    assert home not in rules and home / ".ssh" not in rules and tmp_path not in rules  # tmp_path and home hold hidden trees
    assert rules[home / "venv"] and rules[tmp_path / "other"] and rules[tmp_path / "file.txt"] and rules[home / "work"]
    assert not any(p in home.parents for p in rules)  # no ancestor of the hidden tree (/ included) is readable as a tree


def test_fs_view_of_a_checkout_holding_the_kb_home(tmp_path: Path) -> None:
    """`make demo` keeps its KB home in the checkout: the project's code stays readable, the KB home does not."""
    repo = tmp_path.resolve() / "repo"
    for d in ("verify", ".kb-demo"):
        (repo / d).mkdir(parents=True)
    rules = dict(FsView(hidden=(repo / ".kb-demo",), readable=(repo,), writable=()).rules())
    assert rules[repo / "verify"] and repo not in rules and repo / ".kb-demo" not in rules
