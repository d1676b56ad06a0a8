"""A real, throw-away PostgreSQL server for tests and benchmarks.

    with PostgresServer() as pg:
        dsn = pg.dsn          # postgresql://postgres@127.0.0.1:PORT/postgres

:class:`PostgresServer` finds ``initdb``/``pg_ctl``/``postgres`` on PATH or under
``/usr/lib/postgresql/*/bin`` (where Debian's ``postgresql`` package puts them),
runs ``initdb`` in a temporary directory, starts the server on a free loopback
port with its unix socket in that directory, and on :meth:`stop` stops it
(``pg_ctl stop -m fast``) and removes the directory: no process or file is left.

PostgreSQL refuses to run as root. Run as root (containers, CI), the server runs
as an unprivileged system user (:data:`PG_USER`, created with ``useradd`` when it
does not exist) that owns the temporary directory; otherwise as the current user.

The server is tuned for tests, not durability (``fsync=off``): a crash of the
*machine* loses it, which a test does not care about; a crash of a *client* (the
kill -9 the HA tests make) is exactly what it still survives.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

__all__ = ["PG_USER", "PostgresNotFound", "PostgresServer", "find_binaries"]

PG_USER = "llmgw-pg"
"""The system user the server runs as when the caller is root."""

BINARIES = ("initdb", "pg_ctl", "postgres")


class PostgresNotFound(RuntimeError):
    """PostgreSQL's server binaries are not installed (``apt-get install postgresql``)."""


def find_binaries() -> Path:
    """The directory holding ``initdb``, ``pg_ctl`` and ``postgres``.

    Raises:
        PostgresNotFound: none has all three.
    """
    candidates: list[Path] = []
    found = shutil.which("initdb")
    if found:
        candidates.append(Path(found).resolve().parent)
    # Debian/Ubuntu: /usr/lib/postgresql/<major>/bin, not on PATH; the newest first
    debian = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: _major(p), reverse=True)
    candidates += [Path(p) for p in debian]
    for d in candidates:
        if all((d / b).is_file() and os.access(d / b, os.X_OK) for b in BINARIES):
            return d
    raise PostgresNotFound(
        "PostgreSQL's server binaries (initdb, pg_ctl, postgres) are neither on PATH nor under "
        "/usr/lib/postgresql/*/bin: apt-get install postgresql"
    )


def _major(path: str) -> int:
    try:
        return int(Path(path).parent.name.split(".")[0])
    except ValueError:
        return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _unprivileged_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(PG_USER)
    except KeyError:
        pass
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "--home-dir", "/nonexistent", "--shell", "/usr/sbin/nologin",
         "--user-group", PG_USER],
        check=False, capture_output=True,
    )
    try:
        return pwd.getpwnam(PG_USER)
    except KeyError:
        raise RuntimeError(
            f"running as root, PostgreSQL needs an unprivileged user and {PG_USER!r} could not be created "
            "(useradd failed)"
        ) from None


class PostgresServer:
    """One PostgreSQL server in a temporary directory (the module docstring).

    Args:
        settings: extra ``postgres -c`` settings (name -> value).
        preload: ``shared_preload_libraries`` (e.g. ``pg_stat_statements`` for a benchmark).
        start_timeout: seconds to wait for it to accept connections.
    """

    def __init__(
        self, settings: dict[str, str] | None = None, *, preload: str = "", start_timeout: float = 60.0
    ) -> None:
        self.settings = dict(settings or {})
        self.preload = preload
        self.start_timeout = start_timeout
        self.bindir: Path | None = None
        self.dir: Path | None = None
        self.port: int | None = None
        self._user: pwd.struct_passwd | None = None

    # -- the process --

    def _run(self, cmd: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        kw: dict[str, object] = {}
        if self._user is not None:
            kw = {"user": self._user.pw_uid, "group": self._user.pw_gid, "extra_groups": []}
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env["LC_ALL"] = "C"
        return subprocess.run(
            cmd, env=env, cwd=str(self.dir), capture_output=True, text=True, timeout=timeout, check=False,
            **kw,  # type: ignore[call-overload]
        )

    @property
    def data(self) -> Path:
        assert self.dir is not None
        return self.dir / "data"

    @property
    def socket_dir(self) -> Path:
        assert self.dir is not None
        return self.dir / "sock"

    @property
    def dsn(self) -> str:
        """``postgresql://postgres@127.0.0.1:PORT/postgres`` (trust authentication on loopback)."""
        assert self.port is not None, "not started"
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> PostgresServer:
        """initdb and start (a port taken meanwhile: another port, three tries).

        Raises:
            PostgresNotFound: not installed.
            RuntimeError: initdb or the start failed (its output in the message).
        """
        self.bindir = find_binaries()
        self._user = _unprivileged_user() if os.geteuid() == 0 else None
        self.dir = Path(tempfile.mkdtemp(prefix="llmgw-pg-"))
        try:
            self.socket_dir.mkdir()
            if self._user is not None:
                for p in (self.dir, self.socket_dir):
                    os.chown(p, self._user.pw_uid, self._user.pw_gid)
            r = self._run([str(self.bindir / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust",
                           "-E", "UTF8", "--no-sync", "--no-instructions"], timeout=120)
            if r.returncode != 0:
                raise RuntimeError(f"initdb failed ({r.returncode}): {r.stderr.strip() or r.stdout.strip()}")
            last = ""
            for _ in range(3):
                self.port = _free_port()
                opts = {
                    "listen_addresses": "127.0.0.1", "port": str(self.port),
                    "unix_socket_directories": str(self.socket_dir), "fsync": "off",
                    "synchronous_commit": "off", "full_page_writes": "off", "max_connections": "200",
                    **({"shared_preload_libraries": self.preload} if self.preload else {}),
                    **self.settings,
                }
                o = " ".join(f"-c {k}={v}" for k, v in opts.items())
                r = self._run([str(self.bindir / "pg_ctl"), "start", "-w", "-t", str(int(self.start_timeout)),
                               "-D", str(self.data), "-l", str(self.dir / "server.log"), "-o", o],
                              timeout=self.start_timeout + 10)
                if r.returncode == 0:
                    return self
                last = self.log_tail() or r.stderr or r.stdout
                self._pg_ctl_stop()
            raise RuntimeError(f"PostgreSQL did not start: {last.strip()[-2000:]}")
        except BaseException:
            self.stop()
            raise

    def log_tail(self, n: int = 4000) -> str:
        """The end of the server's log."""
        try:
            return (self.dir / "server.log").read_text(errors="replace")[-n:] if self.dir else ""
        except OSError:
            return ""

    def _pg_ctl_stop(self) -> None:
        if self.bindir is None or self.dir is None or not (self.data / "postmaster.pid").exists():
            return
        r = self._run([str(self.bindir / "pg_ctl"), "stop", "-w", "-m", "fast", "-t", "30", "-D", str(self.data)],
                      timeout=40)
        if r.returncode != 0 and (self.data / "postmaster.pid").exists():
            self._run([str(self.bindir / "pg_ctl"), "stop", "-w", "-m", "immediate", "-D", str(self.data)],
                      timeout=20)

    def stop(self) -> None:
        """Stop the server and remove its directory (idempotent)."""
        try:
            self._pg_ctl_stop()
        finally:
            if self.dir is not None:
                shutil.rmtree(self.dir, ignore_errors=True)
                self.dir = None

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def wait_port_closed(port: int, timeout: float = 10.0) -> bool:
    """Whether nothing listens on 127.0.0.1:``port`` within ``timeout`` (tests: the server is gone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) != 0:
                return True
        time.sleep(0.05)
    return False
