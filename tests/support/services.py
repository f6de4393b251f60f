"""Real PostgreSQL and Chroma servers for the tests, started and stopped by the tests themselves.

    with postgres_server() as url:        # postgresql+psycopg2://kb@127.0.0.1:PORT/kernels
        other = create_database(url, "second")
    with chroma_server(path) as chroma:   # chroma.url == http://127.0.0.1:PORT
        chroma.stop(); chroma.restart()   # same path, same port
    with ray_head(num_cpus=2, env=...) as address:   # 127.0.0.1:PORT, for `kb generate --ray --ray-address`

PostgreSQL: a throwaway cluster (`initdb`, `pg_ctl`) in a temp dir on 127.0.0.1 and a free
port, trust authentication for the superuser `kb`; as root the server runs as `postgres`
through `runuser`, since PostgreSQL refuses to run as root. Chroma: `chroma run` from the
venv that runs the tests. Both are always stopped, and PostgreSQL's dir removed, on exit.
Missing PostgreSQL binaries raise `ServiceError` (a test failure, never a skip) with the
reason `tests/install_services.sh` recorded for not installing them. Ray: `ray start --head --block` from the
venv on 127.0.0.1 with its own short temp dir; its workers inherit the environment given. Stopped by signalling the
`ray start` process group (never `ray stop`, which stops every cluster of the machine).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from tests.support.repo import TEST_CACHE

__all__ = ["ServiceError", "INSTALL_LOG", "pg_bindir", "postgres_server", "create_database", "ChromaServer", "chroma_server",
           "ray_head"]

INSTALL_LOG = TEST_CACHE / "install_services.log"  # written by tests/install_services.sh on failure
START_TIMEOUT_S = 60.0


class ServiceError(RuntimeError):
    """A service the tests need could not be started; the message says why."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- PostgreSQL -------------------------------------------------------------------------

def pg_bindir() -> Path:
    """The directory holding `initdb` and `pg_ctl` (newest PostgreSQL first); `ServiceError` if none."""
    candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda d: _major(d.parent.name), reverse=True)
    on_path = shutil.which("initdb")
    for d in [*candidates, *([Path(on_path).resolve().parent] if on_path else [])]:
        if (d / "initdb").exists() and (d / "pg_ctl").exists():
            return d
    why = INSTALL_LOG.read_text().strip() if INSTALL_LOG.is_file() else (
        "tests/install_services.sh has not run (`make test` runs it; or `apt-get install postgresql`)")
    raise ServiceError(f"PostgreSQL's server binaries (initdb, pg_ctl) are missing under /usr/lib/postgresql/*/bin: {why}")


def _major(name: str) -> int:
    return int(name) if name.isdigit() else -1


def _run_as() -> list[str]:
    """`runuser -u postgres --` when root (the data dir must then belong to postgres), else nothing."""
    if os.geteuid() != 0:
        return []
    if shutil.which("runuser") is None:
        raise ServiceError("running as root without `runuser`; PostgreSQL refuses to run as root")
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        raise ServiceError("running as root and there is no 'postgres' user to run the server "
                           "(the Debian postgresql package creates it)") from None
    return ["runuser", "-u", "postgres", "--"]


@contextmanager
def postgres_server(database: str = "kernels") -> Iterator[str]:
    """A fresh PostgreSQL cluster; yields the SQLAlchemy URL of its empty database `database`."""
    bindir, as_user = pg_bindir(), _run_as()
    data = Path(tempfile.mkdtemp(prefix="kb-pg-", dir="/tmp" if as_user else None))  # postgres must reach it
    if as_user:
        shutil.chown(data, "postgres")
    port, started = free_port(), False

    def run(*args: object) -> None:
        proc = subprocess.run([*as_user, *map(str, args)], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            log = (data / "log").read_text()[-2000:] if (data / "log").is_file() else ""
            raise ServiceError(f"{Path(str(args[0])).name} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}\n{log}")

    try:
        run(bindir / "initdb", "-D", data / "db", "-A", "trust", "-U", "kb", "-E", "UTF8")
        run(bindir / "pg_ctl", "-D", data / "db", "-l", data / "log", "-w", "-t", int(START_TIMEOUT_S),
            "-o", f"-p {port} -k {data} -c listen_addresses=127.0.0.1 -c fsync=off", "start")
        started = True
        url = f"postgresql+psycopg2://kb@127.0.0.1:{port}/postgres"
        yield create_database(url, database)
    finally:
        if started:
            run(bindir / "pg_ctl", "-D", data / "db", "-m", "immediate", "stop")
        shutil.rmtree(data, ignore_errors=True)


def create_database(url: str, name: str) -> str:
    """Create the empty database `name` on the server of `url`; returns `url` naming it."""
    engine = create_engine(make_url(url).set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    finally:
        engine.dispose()
    return make_url(url).set(database=name).render_as_string(hide_password=False)


# -- Chroma -----------------------------------------------------------------------------

class ChromaServer:
    """`chroma run` on 127.0.0.1: `url` stays the same across `stop()` and `restart()`."""

    def __init__(self, path: Path, port: int | None = None) -> None:
        self.path = Path(path)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = self.path.parent / f"{self.path.name}.chroma.log"
        self._proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def start(self) -> None:
        exe = Path(sys.executable).parent / "chroma"
        if not exe.exists():
            raise ServiceError(f"no `chroma` executable next to {sys.executable}; `pip install chromadb` in that venv")
        self.path.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as log:
            self._proc = subprocess.Popen(
                [str(exe), "run", "--path", str(self.path), "--host", "127.0.0.1", "--port", str(self.port)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                env={**os.environ, "ANONYMIZED_TELEMETRY": "False"},
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.answers():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise ServiceError(f"chroma run on port {self.port} did not answer its heartbeat:\n{self.log.read_text()[-2000:]}")
            time.sleep(0.1)

    def answers(self) -> bool:
        """True when the server answers its heartbeat."""
        try:
            with urllib.request.urlopen(f"{self.url}/api/v2/heartbeat", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL); a no-op when it is not running. The data stays."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=15)
        wait_port_closed(self.port)

    def restart(self) -> None:
        self.stop()
        self.start()


def wait_port_closed(port: int, timeout_s: float = 15.0) -> None:
    """Wait until nothing accepts connections on 127.0.0.1:`port`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) != 0:
                return
        time.sleep(0.05)
    raise ServiceError(f"port {port} still accepts connections {timeout_s:.0f}s after its server was stopped")


@contextmanager
def chroma_server(path: Path) -> Iterator[ChromaServer]:
    """A Chroma server persisting under `path`; yields it (its `url`, `stop()`, `restart()`), stops it on exit."""
    server = ChromaServer(path)
    try:
        server.start()
        yield server
    finally:
        server.stop()


# -- Ray ---------------------------------------------------------------------------------

@contextmanager
def ray_head(num_cpus: int, env: dict[str, str], num_gpus: int = 0) -> Iterator[str]:
    """A Ray head node on 127.0.0.1 offering `num_cpus` CPUs (so as many task workers at once) and `num_gpus` GPUs
    (logical: Ray schedules by the count it is given, whatever the host has); yields its address."""
    exe = Path(sys.executable).parent / "ray"
    if not exe.exists():
        raise ServiceError(f"no `ray` executable next to {sys.executable}; `pip install ray` in that venv")
    temp = Path(tempfile.mkdtemp(prefix="kbray-", dir="/tmp"))  # Ray's unix sockets need a short path
    port = free_port()
    log = (temp / "head.log").open("wb")
    proc = subprocess.Popen(
        [str(exe), "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(port),
         "--num-cpus", str(num_cpus), "--num-gpus", str(num_gpus), "--include-dashboard=false", "--disable-usage-stats",
         "--temp-dir", str(temp)],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        env={**env, "RAY_USAGE_STATS_ENABLED": "0"})
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while "Ray runtime started" not in (temp / "head.log").read_text(errors="replace"):  # what `ray start` prints
            if proc.poll() is not None or time.monotonic() > deadline:
                raise ServiceError(f"ray start on port {port} did not come up:\n{(temp / 'head.log').read_text()[-2000:]}")
            time.sleep(0.5)
        yield f"127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):  # whatever of the cluster outlived `ray start`
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=15)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)
