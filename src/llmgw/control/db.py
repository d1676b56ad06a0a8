"""The control plane's database: PostgreSQL (asyncpg) or SQLite, versioned migrations, small stores.

``control.database`` names it:

* ``postgresql://user@host:5432/llmgw`` (or ``postgres://``): several ``llmgw serve``
  processes share it and elect a leader (:mod:`llmgw.control.leader`);
* ``sqlite:////var/lib/llmgw/control.db`` (four slashes: an absolute path;
  ``sqlite:///control.db`` is relative to the working directory): one machine,
  nothing else to run.

One SQL text serves both: statements use ``$1, $2, …`` placeholders (SQLite's
``?1, ?2, …`` are put in for it) and three tokens the dialect fills in:
``{now}`` (the database's clock as Unix seconds, a double: the lease is judged by
it, never by a client's clock), ``{for_update}`` / ``{for_share}`` (row locks on
PostgreSQL; SQLite's ``BEGIN IMMEDIATE`` already serialises writers).

**Migrations** (:data:`MIGRATIONS`) are numbered; each runs once, in one transaction
with the version row that records it, and they all run at start under an advisory
lock (``pg_advisory_xact_lock``; SQLite: ``BEGIN IMMEDIATE``), so the first process to
start migrates and the others find nothing left to do. A database whose schema is
newer than this llmgw knows is refused (upgrade llmgw, never run an old one on it).

**Adding a store** (the deployments of the replica issue go this way): append a
:class:`Migration` with the next version creating its tables, write a class that
takes the :class:`Database`, reads with :meth:`Database.transaction` and writes
inside :meth:`llmgw.control.leader.Leadership.transaction` (fenced by the leader's
epoch), like :class:`CordonStore` here. Migrations only add (tables, columns with
defaults): a standby of the previous release may still be reading.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sqlite3
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..log import control_logger as log
from .dburl import MEMORY, parse_database_url, redact

__all__ = [
    "MIGRATIONS",
    "CordonStore",
    "Database",
    "DatabaseError",
    "Migration",
    "NodeStore",
    "Tx",
    "open_database",
    "redact",
]

ADVISORY_MIGRATE = 0x6C6C6D67_00000001
"""``pg_advisory_xact_lock`` key held while migrating ('llmg' + 1)."""


class DatabaseError(Exception):
    """The database could not be reached or refused a statement (its message says which)."""


@dataclass(frozen=True)
class Migration:
    """One schema version: the statements that take the schema from ``version - 1`` to it."""

    version: int
    name: str
    statements: tuple[str, ...]


MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "leader lease", (
        """CREATE TABLE llmgw_lease (
            name TEXT PRIMARY KEY,
            holder TEXT NOT NULL,
            grpc_address TEXT,
            admin_address TEXT,
            epoch BIGINT NOT NULL,
            acquired_at DOUBLE PRECISION,
            renewed_at DOUBLE PRECISION,
            expires_at DOUBLE PRECISION NOT NULL
        )""",
    )),
    Migration(2, "cordons", (
        """CREATE TABLE llmgw_cordons (
            node TEXT PRIMARY KEY,
            cordoned_at DOUBLE PRECISION NOT NULL,
            epoch BIGINT NOT NULL
        )""",
    )),
    Migration(3, "nodes", (
        """CREATE TABLE llmgw_nodes (
            name TEXT PRIMARY KEY,
            node_id TEXT NOT NULL,
            hostname TEXT,
            agent_version TEXT,
            gpus TEXT NOT NULL,
            registered_at DOUBLE PRECISION NOT NULL,
            epoch BIGINT NOT NULL
        )""",
    )),
)

_PLACEHOLDER = re.compile(r"\$(\d+)")


class Tx:
    """One transaction's statements (SQL in the module docstring's form)."""

    async def execute(self, sql: str, *args: Any) -> int:
        """Run a statement; the number of rows it changed."""
        raise NotImplementedError

    async def fetch(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        raise NotImplementedError

    async def fetchrow(self, sql: str, *args: Any) -> tuple[Any, ...] | None:
        rows = await self.fetch(sql, *args)
        return rows[0] if rows else None

    async def fetchval(self, sql: str, *args: Any) -> Any:
        row = await self.fetchrow(sql, *args)
        return row[0] if row else None


class Database:
    """A connection (pool) to the control plane's database; see :func:`open_database`."""

    dialect = ""
    url = ""

    @property
    def shared(self) -> bool:
        """Whether other processes can share it (PostgreSQL): then a leader is elected."""
        return self.dialect == "postgresql"

    async def open(self) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    def transaction(
        self, timeout: float | None = None, *, lease: bool = False
    ) -> contextlib.AbstractAsyncContextManager[Tx]:
        """A transaction: committed when the block ends, rolled back when it raises.

        ``lease``: the election's own (PostgreSQL: a connection of its own, so a burst of
        registrations queued for the others never delays a renew past its deadline).

        Raises:
            DatabaseError: connecting or a statement failed (also ``asyncio.TimeoutError`` past ``timeout``).
        """
        raise NotImplementedError

    def sql(self, text: str) -> str:
        raise NotImplementedError

    async def migrate(self, migrations: Sequence[Migration] = MIGRATIONS) -> list[int]:
        """Apply the migrations this database lacks (module docstring); the versions applied.

        Raises:
            ConfigError: the schema is newer than this llmgw.
            DatabaseError: the database failed.
        """
        known = max((m.version for m in migrations), default=0)
        applied: list[int] = []
        async with self.transaction() as tx:
            if self.dialect == "postgresql":
                await tx.execute("SELECT pg_advisory_xact_lock($1)", ADVISORY_MIGRATE)
            await tx.execute(
                "CREATE TABLE IF NOT EXISTS llmgw_schema (version INTEGER PRIMARY KEY, name TEXT NOT NULL, "
                "applied_at DOUBLE PRECISION NOT NULL)"
            )
            have = int(await tx.fetchval("SELECT COALESCE(MAX(version), 0) FROM llmgw_schema") or 0)
            if have > known:
                raise ConfigError(
                    "control.database",
                    f"{redact(self.url)} has schema version {have}; this llmgw knows up to {known}: "
                    "upgrade llmgw (an older one must not run on a newer schema)",
                )
            for m in sorted(migrations, key=lambda m: m.version):
                if m.version <= have:
                    continue
                for stmt in m.statements:
                    await tx.execute(stmt)
                await tx.execute(
                    self.sql("INSERT INTO llmgw_schema (version, name, applied_at) VALUES ($1, $2, {now})"),
                    m.version, m.name,
                )
                applied.append(m.version)
        if applied:
            log.info("database %s migrated to schema version %d (applied %s)", redact(self.url), applied[-1],
                     ", ".join(map(str, applied)))
        return applied


# -- PostgreSQL --


class _PgTx(Tx):
    def __init__(self, conn: Any, timeout: float | None) -> None:
        self.conn = conn
        self.timeout = timeout

    async def execute(self, sql: str, *args: Any) -> int:
        status: str = await self.conn.execute(sql, *args, timeout=self.timeout)
        # "UPDATE 3", "INSERT 0 1", "DELETE 0", "SELECT 1", "CREATE TABLE"
        tail = status.rsplit(" ", 1)[-1]
        return int(tail) if tail.isdigit() else 0

    async def fetch(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        rows = await self.conn.fetch(sql, *args, timeout=self.timeout)
        return [tuple(r) for r in rows]


async def _no_reset(conn: Any) -> None:
    """PERF: asyncpg resets a connection on each return to the pool (advisory unlock all, CLOSE ALL,
    UNLISTEN *, RESET ALL: a round trip and a transaction each time). llmgw keeps no session state (every
    statement is inside a transaction that ends before the release), so there is nothing to reset."""


class PostgresDatabase(Database):
    """asyncpg pool (a few connections: the lease, agent registrations, the API)."""

    dialect = "postgresql"

    def __init__(self, url: str, *, max_size: int = 4, connect_timeout: float = 5.0) -> None:
        self.url = url
        self.max_size = max_size
        self.connect_timeout = connect_timeout
        self.pool: Any = None
        self.lease_pool: Any = None

    def sql(self, text: str) -> str:
        return text.replace("{now}", "extract(epoch from clock_timestamp())::double precision").replace(
            "{for_update}", "FOR UPDATE").replace("{for_share}", "FOR SHARE")

    async def open(self) -> None:
        import asyncpg

        try:
            # min_size 0: a pool that opens connections as needed, so a database that is down at
            # start does not stop the process (it keeps campaigning) and one back later is used.
            self.pool = await asyncpg.create_pool(
                self.url, min_size=0, max_size=self.max_size, timeout=self.connect_timeout,
                command_timeout=30, max_inactive_connection_lifetime=60, reset=_no_reset,
            )
            self.lease_pool = await asyncpg.create_pool(
                self.url, min_size=0, max_size=1, timeout=self.connect_timeout, command_timeout=30,
                max_inactive_connection_lifetime=0, reset=_no_reset,  # (renewed every lease/3: it stays open)
            )
        except (OSError, asyncpg.PostgresError, asyncio.TimeoutError, ValueError) as exc:
            raise DatabaseError(f"cannot open {redact(self.url)}: {type(exc).__name__}: {exc}") from exc

    async def close(self) -> None:
        for pool in (self.pool, self.lease_pool):
            if pool is not None:
                try:
                    await asyncio.wait_for(pool.close(), 5.0)
                except (asyncio.TimeoutError, OSError):
                    pool.terminate()
        self.pool = self.lease_pool = None

    @contextlib.asynccontextmanager
    async def transaction(self, timeout: float | None = None, *, lease: bool = False) -> AsyncIterator[Tx]:
        import asyncpg

        pool = self.lease_pool if lease else self.pool
        if pool is None:
            raise DatabaseError("the database is not open")
        try:
            async with pool.acquire(timeout=timeout or self.connect_timeout) as conn, conn.transaction():
                yield _PgTx(conn, timeout)
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            raise DatabaseError(f"{redact(self.url)}: {type(exc).__name__}: {exc}") from exc
        except asyncio.TimeoutError as exc:
            raise DatabaseError(f"{redact(self.url)}: no answer within {timeout or self.connect_timeout:g}s") from exc


# -- SQLite --


class _SqliteTx(Tx):
    def __init__(self, db: SqliteDatabase) -> None:
        self.db = db

    async def execute(self, sql: str, *args: Any) -> int:
        return await self.db._call(lambda c: c.execute(_PLACEHOLDER.sub(r"?\1", sql), args).rowcount)

    async def fetch(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        return await self.db._call(lambda c: [tuple(r) for r in c.execute(_PLACEHOLDER.sub(r"?\1", sql), args)])


def _lock_one_process(path: str) -> Any:
    """Hold ``PATH.lock`` exclusively while open: one process per SQLite file (it takes the lease at once).

    Raises:
        OSError: another process holds it (the message says what to do).
    """
    import fcntl

    f = open(path + ".lock", "a+")  # noqa: SIM115 (held open while the database is)
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise OSError(
            f"another llmgw serve uses {path} (an SQLite database serves one process; several control planes "
            "share a postgresql:// database)"
        ) from None
    return f


class SqliteDatabase(Database):
    """One connection, used from one worker thread (sqlite3 calls block); transactions one at a time."""

    dialect = "sqlite"

    def __init__(self, url: str, path: str) -> None:
        self.url = url
        self.path = path
        self._conn: sqlite3.Connection | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._lock = asyncio.Lock()
        self._lock_file: Any = None

    def sql(self, text: str) -> str:
        return text.replace("{now}", "((julianday('now') - 2440587.5) * 86400.0)").replace(
            "{for_update}", "").replace("{for_share}", "")

    async def _call(self, fn: Any) -> Any:
        assert self._pool is not None and self._conn is not None
        conn = self._conn
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, conn)
        except sqlite3.Error as exc:
            raise DatabaseError(f"{self.path}: {exc}") from exc

    async def open(self) -> None:
        memory = self.path == MEMORY
        if not memory:
            d = os.path.dirname(os.path.abspath(self.path))
            try:
                os.makedirs(d, exist_ok=True)
                if not os.path.exists(self.path):  # SECURITY: the replicas' API keys are inside
                    os.close(os.open(self.path, os.O_CREAT | os.O_WRONLY, 0o600))
                self._lock_file = _lock_one_process(self.path)
            except OSError as exc:
                raise DatabaseError(f"cannot open {self.path}: {exc.strerror or exc}") from exc
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="llmgw-sqlite")

        def connect() -> sqlite3.Connection:
            c = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=10.0)
            if not memory:
                c.execute("PRAGMA journal_mode=WAL")
            c.execute("PRAGMA synchronous=NORMAL")
            return c

        try:
            self._conn = await asyncio.get_running_loop().run_in_executor(self._pool, connect)
        except sqlite3.Error as exc:
            self._pool.shutdown(wait=False)
            self._pool = None
            self._unlock()
            raise DatabaseError(f"cannot open {self.path}: {exc}") from exc

    def _unlock(self) -> None:
        f, self._lock_file = self._lock_file, None
        if f is not None:
            f.close()

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        pool, self._pool = self._pool, None
        if pool is not None:
            if conn is not None:
                await asyncio.get_running_loop().run_in_executor(pool, conn.close)
            pool.shutdown(wait=True)
        self._unlock()

    @contextlib.asynccontextmanager
    async def transaction(self, timeout: float | None = None, *, lease: bool = False) -> AsyncIterator[Tx]:
        if self._conn is None:
            raise DatabaseError("the database is not open")
        async with self._lock:
            tx = _SqliteTx(self)
            await tx.execute("BEGIN IMMEDIATE")
            try:
                yield tx
            except BaseException:
                await self._call(lambda c: c.execute("ROLLBACK"))
                raise
            await self._call(lambda c: c.execute("COMMIT"))


def open_database(url: str) -> Database:
    """The :class:`Database` for ``control.database`` (not opened yet; forms in :mod:`.dburl`).

    Raises:
        ConfigError: a URL in none of the forms.
    """
    parsed = parse_database_url(url)
    if parsed.dialect == "postgresql":
        return PostgresDatabase(url)
    assert parsed.path is not None
    return SqliteDatabase(url, parsed.path)


# -- stores --


class CordonStore:
    """Cordoned node names (``llmgw_cordons``): an operator's decision, kept by name."""

    def __init__(self, db: Database) -> None:
        self.db = db

    async def load(self) -> set[str]:
        async with self.db.transaction() as tx:
            return {r[0] for r in await tx.fetch("SELECT node FROM llmgw_cordons")}

    async def set(self, tx: Tx, node: str, cordoned: bool, epoch: int) -> None:
        """Within the caller's (fenced) transaction."""
        if cordoned:
            await tx.execute(self.db.sql(
                "INSERT INTO llmgw_cordons (node, cordoned_at, epoch) VALUES ($1, {now}, $2) "
                "ON CONFLICT (node) DO NOTHING"), node, epoch)
        else:
            await tx.execute("DELETE FROM llmgw_cordons WHERE node = $1", node)


NodeRecord = tuple[str, str | None, str | None, str]
"""What a node row keeps: (node id, hostname, agent version, GPU UUIDs as JSON)."""


class NodeStore:
    """Registered nodes' identity (``llmgw_nodes``): written at registration when it changed, never per heartbeat.

    Readings (memory, utilisation, health) stay in the leader's memory: they change every
    heartbeat and the agents send them again within an interval of a failover.
    """

    def __init__(self, db: Database) -> None:
        self.db = db

    async def load(self) -> dict[str, NodeRecord]:
        async with self.db.transaction() as tx:
            rows = await tx.fetch("SELECT name, node_id, hostname, agent_version, gpus FROM llmgw_nodes")
        return {r[0]: (r[1], r[2], r[3], r[4]) for r in rows}

    async def put(self, tx: Tx, name: str, rec: NodeRecord, epoch: int) -> None:
        await tx.execute(self.db.sql(
            "INSERT INTO llmgw_nodes (name, node_id, hostname, agent_version, gpus, registered_at, epoch) "
            "VALUES ($1, $2, $3, $4, $5, {now}, $6) ON CONFLICT (name) DO UPDATE SET node_id = EXCLUDED.node_id, "
            "hostname = EXCLUDED.hostname, agent_version = EXCLUDED.agent_version, gpus = EXCLUDED.gpus, "
            "registered_at = EXCLUDED.registered_at, epoch = EXCLUDED.epoch"), name, *rec, epoch)

    async def delete(self, tx: Tx, name: str) -> None:
        await tx.execute("DELETE FROM llmgw_nodes WHERE name = $1", name)
