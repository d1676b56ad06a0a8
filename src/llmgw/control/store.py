"""The control plane's desired state on disk: deployments and the replicas placed for them.

:class:`DesiredStore` is what the controller needs; :class:`SQLiteStore` is the
one implementation (stdlib ``sqlite3``; the HA issue adds PostgreSQL behind the
same methods). ``control.database`` picks the file (``sqlite:///abs/path``, also
written ``sqlite:////abs/path``; ``sqlite:relative/path``; or a bare path; ``sqlite::memory:`` keeps it in memory,
as the demo does); without it the file is ``deployments.sqlite3`` beside
``control.state_file``, else ``$XDG_STATE_HOME/llmgw/control.sqlite3``
(``~/.local/state/llmgw/``).

Writes are a row or two each (a pass that places many replicas makes them one
transaction: :meth:`SQLiteStore.batch`), made on the event loop, and only by
operators' actions and placements (never a request or a heartbeat). WAL with
``synchronous=NORMAL``: a commit does not wait for the disk (an fsync took 10 ms
and more here, on the loop), so a committed change survives llmgw's crash or
restart, and a power cut may lose the last ones (the WAL is synced at each
checkpoint). The file is created ``0600``: it holds the replicas' API keys.

Schema::

    deployments(name PK, source 'config'|'api', spec JSON, replicas_override, override_of, updated_at)
    replicas(id PK, deployment, node, spec JSON (gpus, claims, api key), created_at)

``replicas_override`` is a ``ctl scale`` of a config deployment; ``override_of``
the JSON of the config entry it was made against, so a changed entry ends it.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..errors import ConfigError

__all__ = ["DesiredStore", "SQLiteStore", "StoredDeployment", "StoredReplica", "database_path", "open_store"]

SCHEMA_VERSION = 1
MEMORY = ":memory:"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS deployments (
    name              TEXT PRIMARY KEY,
    source            TEXT NOT NULL,
    spec              TEXT NOT NULL,
    replicas_override INTEGER,
    override_of       TEXT,
    updated_at        REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS replicas (
    id          TEXT PRIMARY KEY,
    deployment  TEXT NOT NULL,
    node        TEXT NOT NULL,
    spec        TEXT NOT NULL,
    created_at  REAL NOT NULL
);
"""


@dataclass(frozen=True, slots=True)
class StoredDeployment:
    name: str
    source: str
    """``config`` (from the file) or ``api`` (``ctl deploy``)."""
    spec: Mapping[str, Any]
    """The deployment as a config ``deployments[]`` entry (JSON)."""
    replicas_override: int | None = None
    override_of: str | None = None


@dataclass(frozen=True, slots=True)
class StoredReplica:
    id: str
    deployment: str
    node: str
    spec: Mapping[str, Any]
    created_at: float = 0.0


class DesiredStore(Protocol):
    """Where desired state is kept (the controller calls these; each is one small transaction)."""

    def deployments(self) -> list[StoredDeployment]: ...

    def put_deployment(self, d: StoredDeployment) -> None: ...

    def delete_deployment(self, name: str) -> None:
        """The deployment and its replicas."""
        ...

    def replicas(self) -> list[StoredReplica]: ...

    def put_replica(self, r: StoredReplica) -> None: ...

    def delete_replica(self, replica_id: str) -> None: ...

    def close(self) -> None: ...

    def batch(self) -> AbstractContextManager[None]:
        """Make the writes inside one transaction (one fsync for a pass that places many replicas)."""
        ...


def _state_home() -> Path:
    base = os.environ.get("XDG_STATE_HOME")
    return Path(base) if base else Path.home() / ".local" / "state"


def database_path(database: str | None, state_file: str | None) -> Path:
    """The SQLite file ``control.database`` names (see the module docstring for the defaults).

    Raises:
        ConfigError: a database URL llmgw cannot open (only ``sqlite:`` so far).
    """
    if database:
        if database in ("sqlite::memory:", ":memory:"):
            return Path(MEMORY)
        if database.startswith("sqlite:"):
            rest = database[len("sqlite:"):]
            if rest.startswith("//"):
                # sqlite:///var/lib/x as a file:// URL writes it, sqlite:////var/lib/x as SQLAlchemy does: both absolute
                rest = rest[2:]
                if not rest.startswith("/"):
                    raise ConfigError(
                        "control.database", f"{database!r}: write sqlite:///ABSOLUTE/PATH or sqlite:RELATIVE/PATH"
                    )
                rest = "/" + rest.lstrip("/")
            if not rest:
                raise ConfigError("control.database", f"{database!r} names no file")
            return Path(rest).expanduser()
        if "://" in database:
            scheme = database.split("://", 1)[0]
            raise ConfigError(
                "control.database",
                f"{scheme}:// databases are not supported yet; use sqlite:///PATH (or a file path)",
            )
        return Path(database).expanduser()
    if state_file:
        return Path(state_file).expanduser().parent / "deployments.sqlite3"
    return _state_home() / "llmgw" / "control.sqlite3"


class SQLiteStore:
    """Desired state in an SQLite file (one connection, used from the event loop's thread).

    Raises:
        ConfigError: the file cannot be opened or is from a newer llmgw.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        memory = str(path) == MEMORY
        try:
            if not memory:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                if not self.path.exists():
                    os.close(os.open(self.path, os.O_CREAT | os.O_WRONLY, 0o600))  # SECURITY: replica keys inside
            self._db = sqlite3.connect(MEMORY if memory else self.path, isolation_level=None,
                                       check_same_thread=False, timeout=5.0)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
            row = self._db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if row is None:
                self._db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            elif int(row[0]) > SCHEMA_VERSION:
                raise ConfigError(
                    "control.database", f"{self.path} has schema version {row[0]}; this llmgw reads {SCHEMA_VERSION}"
                )
        except (sqlite3.Error, OSError) as exc:
            raise ConfigError("control.database", f"cannot open {self.path}: {exc}") from None

    def close(self) -> None:
        self._db.close()

    @contextmanager
    def batch(self) -> Iterator[None]:
        if self._db.in_transaction:  # (nested: the outer one commits)
            yield
            return
        self._db.execute("BEGIN")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def _write(self, sql: str, args: tuple[Any, ...]) -> None:
        # (isolation_level=None: a statement outside batch() is a transaction of its own)
        self._db.execute(sql, args)

    def deployments(self) -> list[StoredDeployment]:
        rows = self._db.execute(
            "SELECT name, source, spec, replicas_override, override_of FROM deployments ORDER BY name"
        ).fetchall()
        return [StoredDeployment(n, s, json.loads(spec), o, of) for n, s, spec, o, of in rows]

    def put_deployment(self, d: StoredDeployment) -> None:
        self._write(
            "INSERT INTO deployments VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(name) DO UPDATE SET source=excluded.source, "
            "spec=excluded.spec, replicas_override=excluded.replicas_override, override_of=excluded.override_of, "
            "updated_at=excluded.updated_at",
            (d.name, d.source, json.dumps(d.spec, sort_keys=True), d.replicas_override, d.override_of, time.time()),
        )

    def delete_deployment(self, name: str) -> None:
        with self.batch():
            self._db.execute("DELETE FROM replicas WHERE deployment=?", (name,))
            self._db.execute("DELETE FROM deployments WHERE name=?", (name,))

    def replicas(self) -> list[StoredReplica]:
        rows = self._db.execute("SELECT id, deployment, node, spec, created_at FROM replicas ORDER BY created_at").fetchall()
        return [StoredReplica(i, d, n, json.loads(s), c) for i, d, n, s, c in rows]

    def put_replica(self, r: StoredReplica) -> None:
        self._write(
            "INSERT OR REPLACE INTO replicas VALUES (?, ?, ?, ?, ?)",
            (r.id, r.deployment, r.node, json.dumps(r.spec, sort_keys=True), r.created_at or time.time()),
        )

    def delete_replica(self, replica_id: str) -> None:
        self._write("DELETE FROM replicas WHERE id=?", (replica_id,))


def open_store(database: str | None, state_file: str | None) -> SQLiteStore:
    """The store ``control.database`` names (:func:`database_path`).

    Raises:
        ConfigError: as :func:`database_path` and :class:`SQLiteStore`.
    """
    return SQLiteStore(database_path(database, state_file))
