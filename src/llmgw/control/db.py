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
import json
import os
import re
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from ..errors import ConfigError
from ..log import control_logger as log
from .dburl import MEMORY, parse_database_url, redact

__all__ = [
    "MIGRATIONS",
    "ApiTokenStore",
    "CordonStore",
    "Database",
    "DatabaseError",
    "DesiredStore",
    "Fence",
    "JoinTokenStore",
    "Migration",
    "NodeStore",
    "StoredDeployment",
    "StoredReplica",
    "Tx",
    "open_database",
    "redact",
    "token_digests",
    "tokens_differ",
    "unfenced",
    "unreachable",
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
    then: Callable[[Database, Tx], Awaitable[None]] | None = None
    """Run after the statements, in the same transaction (an upgrade copying older data in)."""


async def _from_sqlite_store(db: Database, tx: Tx) -> None:
    """The upgrade from llmgw's earlier deployments store: the same file (the default path is the same)
    held ``deployments`` and ``replicas`` tables; their rows come over once, with epoch 0."""
    if db.dialect != "sqlite":
        return
    have = {r[0] for r in await tx.fetch("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if not {"deployments", "replicas"} <= have:
        return
    n = await tx.execute(
        "INSERT INTO llmgw_deployments (name, source, spec, replicas_override, override_of, updated_at, epoch) "
        "SELECT name, source, spec, replicas_override, override_of, updated_at, 0 FROM deployments")
    m = await tx.execute(
        "INSERT INTO llmgw_replicas (id, deployment, node, spec, created_at, epoch) "
        "SELECT id, deployment, node, spec, created_at, 0 FROM replicas")
    log.info("imported %d deployment(s) and %d replica(s) from the earlier deployments store in %s", n, m,
             redact(db.url))


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
    Migration(4, "deployments and their replicas", (
        """CREATE TABLE llmgw_deployments (
            name TEXT PRIMARY KEY,
            source TEXT NOT NULL,
            spec TEXT NOT NULL,
            replicas_override INTEGER,
            override_of TEXT,
            updated_at DOUBLE PRECISION NOT NULL,
            epoch BIGINT NOT NULL
        )""",
        """CREATE TABLE llmgw_replicas (
            id TEXT PRIMARY KEY,
            deployment TEXT NOT NULL,
            node TEXT NOT NULL,
            spec TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            epoch BIGINT NOT NULL
        )""",
        "CREATE INDEX llmgw_replicas_deployment ON llmgw_replicas (deployment)",
    ), then=_from_sqlite_store),
    Migration(5, "join-token digests", (
        """CREATE TABLE llmgw_join_tokens (
            sha256 TEXT PRIMARY KEY,
            added_at DOUBLE PRECISION NOT NULL,
            epoch BIGINT NOT NULL
        )""",
    )),
    Migration(6, "join tokens made through the API", (
        """CREATE TABLE llmgw_api_join_tokens (
            id TEXT PRIMARY KEY,
            name TEXT,
            sha256 TEXT NOT NULL UNIQUE,
            created_at DOUBLE PRECISION NOT NULL,
            expires_at DOUBLE PRECISION,
            revoked_at DOUBLE PRECISION,
            last_used_at DOUBLE PRECISION,
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

    async def executemany(self, sql: str, rows: Sequence[tuple[Any, ...]]) -> None:
        """Run one statement for each of ``rows`` (PostgreSQL: pipelined, one round trip for all)."""
        for args in rows:
            await self.execute(sql, *args)

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
                if m.then is not None:
                    await m.then(self, tx)
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

    async def executemany(self, sql: str, rows: Sequence[tuple[Any, ...]]) -> None:
        await self.conn.executemany(sql, rows, timeout=self.timeout)

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
            raise DatabaseError(f"cannot open {redact(self.url)}: {_said(exc, self.url)}{_fix(exc)}") from exc

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
        except ConfigError:
            raise  # (the body's own: a ValueError, but no driver's)
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, ValueError) as exc:
            # (ValueError: asyncpg's own parse of a URL the config check let through)
            raise DatabaseError(f"{redact(self.url)}: {_said(exc, self.url)}{_fix(exc)}") from exc
        except asyncio.TimeoutError as exc:
            raise DatabaseError(f"{redact(self.url)}: no answer within {timeout or self.connect_timeout:g}s") from exc


def _said(exc: BaseException, url: str) -> str:
    """``exc`` as one line, without the URL's password (a driver's parse error may quote it)."""
    text = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
    password = _password(url)
    if password:
        text = text.replace(password, "***")
        for part in password.split("@"):  # (an unencoded "@" splits it where a parser cut it)
            if len(part) >= 4:
                text = text.replace(part, "***")
    return text


def _password(url: str) -> str:
    try:
        return unquote(urlsplit(url).password or "")
    except ValueError:
        return ""


# PostgreSQL's refusals at start, by the driver's class name: what to do about each
_FIXES = {
    "InvalidPasswordError": "check the user and password in the URL",
    "InvalidAuthorizationSpecificationError": "check the user in the URL (and pg_hba.conf for this host)",
    "InvalidCatalogNameError": "create the database (createdb NAME) or name one that exists",
    "InsufficientPrivilegeError": "let the user create tables there (GRANT CREATE ON SCHEMA public TO USER)",
    "DuplicateTableError": "the database holds tables llmgw did not make: give llmgw a database of its own",
    "UndefinedColumnError": "the database holds tables llmgw did not make: give llmgw a database of its own",
    "UndefinedTableError": "the database holds tables llmgw did not make: give llmgw a database of its own",
    "ConnectionRefusedError": "is PostgreSQL running and listening at that host and port?",
    "ClientConfigurationError": "check the URL's query parameters (sslmode=disable|prefer|require|verify-full, ...)",
    "ValueError": "check the URL: a password with special characters must be percent-encoded (%40 for '@')",
    "TimeoutError": "is the host reachable, and PostgreSQL listening there?",
}


# SQLSTATEs that say "not now" rather than "no": the server is starting, shutting down or full
# (class 08 is every connection exception)
_NOT_NOW_STATES = frozenset({"57P01", "57P02", "57P03", "53300", "53400"})


def unreachable(exc: DatabaseError) -> bool:
    """Whether ``exc`` says the database cannot be reached *yet* (refused, timed out, starting up, full),
    which waiting may cure, rather than that it refuses (a password, a database that does not exist,
    a privilege, a URL, a schema), which it never will."""
    cause = exc.__cause__
    if cause is None:
        return "no answer within" in str(exc)
    if isinstance(cause, (asyncio.TimeoutError, TimeoutError)):
        return True
    state = getattr(cause, "sqlstate", None)
    if isinstance(state, str):
        return state.startswith("08") or state in _NOT_NOW_STATES
    names = {cls.__name__ for cls in type(cause).__mro__}
    if names & {"ConnectionDoesNotExistError", "InterfaceError"}:
        return "closed" in str(cause) or "does not exist" in str(cause)
    return isinstance(cause, OSError) and not isinstance(cause, PermissionError)


def _fix(exc: BaseException) -> str:
    for cls in type(exc).__mro__:
        fix = _FIXES.get(cls.__name__)
        if fix is not None:
            return f" ({fix})"
    return ""


# -- SQLite --


class _SqliteTx(Tx):
    def __init__(self, db: SqliteDatabase) -> None:
        self.db = db

    async def execute(self, sql: str, *args: Any) -> int:
        return await self.db._call(lambda c: c.execute(_PLACEHOLDER.sub(r"?\1", sql), args).rowcount)

    async def executemany(self, sql: str, rows: Sequence[tuple[Any, ...]]) -> None:
        await self.db._call(lambda c: c.executemany(_PLACEHOLDER.sub(r"?\1", sql), rows))

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
                # SECURITY: the replicas' API keys are inside: 0600 (an older file made wider is narrowed)
                if not os.path.exists(self.path):
                    os.close(os.open(self.path, os.O_CREAT | os.O_WRONLY, 0o600))
                elif os.stat(self.path).st_mode & 0o077:
                    os.chmod(self.path, 0o600)
                    log.warning("%s was readable by others: made 0600 (it holds the replicas' API keys)", self.path)
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
            try:
                await tx.execute("BEGIN IMMEDIATE")
            except asyncio.CancelledError:
                # the BEGIN runs on in the connection's one thread: undo it there, right after it (the
                # lock is still held: nothing else is queued between), or the next BEGIN would fail
                conn, pool = self._conn, self._pool
                if conn is not None and pool is not None:
                    pool.submit(_rollback_quietly, conn)
                raise
            try:
                yield tx
            except BaseException:
                await self._call(lambda c: c.execute("ROLLBACK"))
                raise
            await self._call(lambda c: c.execute("COMMIT"))


def _rollback_quietly(conn: sqlite3.Connection) -> None:
    with contextlib.suppress(sqlite3.Error):  # (no transaction: the BEGIN failed)
        conn.execute("ROLLBACK")


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


class JoinTokenStore:
    """The join tokens' SHA-256 digests the leader accepts (``llmgw_join_tokens``; never a token itself).

    Written by a leader when its configured tokens differ from the rows (at election), read by every
    control plane at start: one whose tokens differ is told so before it ever leads, as an agent
    joined with a token only the others accept would be refused after a takeover.
    """

    def __init__(self, db: Database) -> None:
        self.db = db

    async def load(self) -> set[str]:
        async with self.db.transaction() as tx:
            return {r[0] for r in await tx.fetch("SELECT sha256 FROM llmgw_join_tokens")}

    async def replace(self, tx: Tx, digests: set[str], have: set[str], epoch: int) -> None:
        """Make the rows ``digests`` (``have``: what they are now), within the caller's fenced transaction."""
        for d in sorted(have - digests):
            await tx.execute("DELETE FROM llmgw_join_tokens WHERE sha256 = $1", d)
        for d in sorted(digests - have):
            await tx.execute(self.db.sql(
                "INSERT INTO llmgw_join_tokens (sha256, added_at, epoch) VALUES ($1, {now}, $2) "
                "ON CONFLICT (sha256) DO NOTHING"), d, epoch)


class ApiTokenStore:
    """Join tokens made with ``llmgw ctl tokens create`` (``llmgw_api_join_tokens``): a digest each, never
    the token; revoked ones stay (with ``revoked_at``) so an agent presenting one is told so.

    Written by the leader, fenced (create, revoke, and ``last_used_at`` at most once a flush period);
    read by every control plane (at start, on election, and by standbys every third of the lease).
    """

    COLUMNS = "id, name, sha256, created_at, expires_at, revoked_at, last_used_at"

    def __init__(self, db: Database) -> None:
        self.db = db

    async def load(self) -> list[tuple[Any, ...]]:
        """Every row: ``(id, name, sha256 hex, created_at, expires_at, revoked_at, last_used_at)``."""
        async with self.db.transaction() as tx:
            return await tx.fetch(f"SELECT {self.COLUMNS} FROM llmgw_api_join_tokens ORDER BY created_at, id")

    async def insert(self, tx: Tx, row: tuple[Any, ...], epoch: int) -> None:
        """``row``: ``(id, name, sha256 hex, created_at, expires_at)``."""
        await tx.execute(
            "INSERT INTO llmgw_api_join_tokens (id, name, sha256, created_at, expires_at, epoch) "
            "VALUES ($1, $2, $3, $4, $5, $6)", *row, epoch)

    async def revoke(self, tx: Tx, token_id: str, at: float, epoch: int) -> int:
        """Mark it revoked (once: a second revoke changes nothing); the rows changed."""
        return await tx.execute(
            "UPDATE llmgw_api_join_tokens SET revoked_at = $2, epoch = $3 WHERE id = $1 AND revoked_at IS NULL",
            token_id, at, epoch)

    async def touch(self, tx: Tx, used: Mapping[str, float]) -> None:
        """``last_used_at`` of each id moved forward (never back)."""
        for token_id, at in sorted(used.items()):
            await tx.execute(
                "UPDATE llmgw_api_join_tokens SET last_used_at = $2 WHERE id = $1 "
                "AND (last_used_at IS NULL OR last_used_at < $2)", token_id, at)


def token_digests(tokens: Sequence[str]) -> set[str]:
    """SHA-256 hex digests of join tokens (what the database keeps)."""
    import hashlib

    return {hashlib.sha256(t.encode()).hexdigest() for t in tokens}


def tokens_differ(stored: set[str], mine: set[str]) -> str | None:
    """Why ``mine`` (this process's) differs from ``stored`` (the leader's), for a log line; ``None``: the same."""
    if not stored or stored == mine:
        return None
    return (f"this control plane's join tokens differ from those the leader accepts ({len(mine)} configured, "
            f"{len(stored)} in the database, {len(mine & stored)} in common): after a takeover, agents that "
            "joined with a token only the other control planes have are refused; give every control plane the "
            "same control.join_token_env")


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
    """Its GPUs, claims and API key (JSON)."""
    created_at: float = 0.0


MAX_TX_ROWS = 256
"""Desired-state writes committed in one transaction at most (the rest in the next ones)."""
_DELETE_REPLICAS_OF = "DELETE FROM llmgw_replicas WHERE deployment = $1"


def _runs(ops: Sequence[tuple[str, tuple[Any, ...], Any, bool]], epoch: int) -> list[tuple[str, list[tuple[Any, ...]]]]:
    """Consecutive writes of one statement grouped (order kept): ``(sql, [arguments, ...])``."""
    out: list[tuple[str, list[tuple[Any, ...]]]] = []
    for sql, args, _, fenced in ops:
        row = (*args, epoch) if fenced else args
        if out and out[-1][0] == sql:
            out[-1][1].append(row)
        else:
            out.append((sql, [row]))
    return out


Fence = Callable[[], contextlib.AbstractAsyncContextManager[tuple[Tx, int]]]
"""A leader's fenced transaction (:meth:`llmgw.control.leader.Leadership.transaction`): ``(tx, epoch)``."""


def unfenced(db: Database) -> Fence:
    """A fence for a database no election guards (a test, a tool): epoch 0."""

    @contextlib.asynccontextmanager
    async def fence() -> AsyncIterator[tuple[Tx, int]]:
        async with db.transaction() as tx:
            yield tx, 0

    return fence


class DesiredStore:
    """Deployments and their placed replicas (``llmgw_deployments``, ``llmgw_replicas``), written behind.

    The controller (:class:`~.deployments.DeploymentController`) is synchronous: it decides
    on the event loop between two awaits. So its writes are queued here in order
    (:meth:`put_deployment` …) and committed by one task, all that is queued in one
    transaction, fenced by the leader's epoch (:data:`Fence`): a leader deposed meanwhile
    writes nothing. What must not happen before its write is durable waits for it:

    * a placed replica is told to its node only once its row is committed (``then``
      of :meth:`put_replica`): a leader killed just after placing it never had an agent
      launch it, and the next leader, loading the rows, hands every node the same set;
    * the management API answers a change after :meth:`flushed` (a deployment whose
      creation was answered exists after the leader's kill).

    A write that fails (the database away, the lease lost) calls ``on_failed``: the control
    plane then stops leading, and whoever leads next starts from what the database holds,
    so memory never runs ahead of it for long. Reads (:meth:`load`) happen on election.
    """

    def __init__(self, db: Database, fence: Fence, on_failed: Callable[[BaseException], None] | None = None) -> None:
        self.db = db
        self.fence = fence
        self.on_failed = on_failed
        self._deployments: list[StoredDeployment] = []
        self._replicas: list[StoredReplica] = []
        self._pending: list[tuple[str, tuple[Any, ...], Callable[[], None] | None, bool]] = []
        """(SQL, its arguments, what runs once it is committed, whether the epoch is its last argument)."""
        self._queued = 0
        """Writes queued since the start (the committed ones included)."""
        self._committed = 0
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._task: asyncio.Task[None] | None = None
        self._failed: BaseException | None = None
        self.writes = 0
        """Statements committed (figures: the database's load)."""
        self.transactions = 0

    @property
    def path(self) -> str:
        return redact(self.db.url)

    async def load(self) -> None:
        """Read what the database holds (on election, before the controller is made from it)."""
        async with self.db.transaction() as tx:
            deps = await tx.fetch(
                "SELECT name, source, spec, replicas_override, override_of FROM llmgw_deployments ORDER BY name")
            reps = await tx.fetch(
                "SELECT id, deployment, node, spec, created_at FROM llmgw_replicas ORDER BY created_at, id")
        self._deployments = [StoredDeployment(n, s, json.loads(spec), None if o is None else int(o), of)
                             for n, s, spec, o, of in deps]
        self._replicas = [StoredReplica(i, d, n, json.loads(s), float(c)) for i, d, n, s, c in reps]

    @staticmethod
    async def served_models(db: Database) -> frozenset[str]:
        """The model names the deployments in ``db`` serve (a standby's data path answers them 503)."""
        async with db.transaction() as tx:
            rows = await tx.fetch("SELECT name, spec FROM llmgw_deployments")
        out: set[str] = set()
        for name, spec in rows:
            try:
                served = json.loads(spec).get("served_name")
            except (ValueError, AttributeError):
                served = None
            out.add(served if isinstance(served, str) and served else name)
        return frozenset(out)

    # -- what the controller calls (synchronous) --

    def deployments(self) -> list[StoredDeployment]:
        return list(self._deployments)

    def replicas(self) -> list[StoredReplica]:
        return list(self._replicas)

    def put_deployment(self, d: StoredDeployment) -> None:
        self._queue(self.db.sql(
            "INSERT INTO llmgw_deployments (name, source, spec, replicas_override, override_of, updated_at, epoch) "
            "VALUES ($1, $2, $3, $4, $5, {now}, $6) ON CONFLICT (name) DO UPDATE SET source = EXCLUDED.source, "
            "spec = EXCLUDED.spec, replicas_override = EXCLUDED.replicas_override, "
            "override_of = EXCLUDED.override_of, updated_at = EXCLUDED.updated_at, epoch = EXCLUDED.epoch"),
            (d.name, d.source, json.dumps(d.spec, sort_keys=True), d.replicas_override, d.override_of))

    def delete_deployment(self, name: str) -> None:
        """The deployment and its replicas."""
        self._queue(_DELETE_REPLICAS_OF, (name,), epoch=False)
        self._queue("DELETE FROM llmgw_deployments WHERE name = $1", (name,), epoch=False)

    def put_replica(self, r: StoredReplica, then: Callable[[], None] | None = None) -> None:
        """Queue the replica's row; ``then`` runs once it is committed (the node may be told then)."""
        self._queue(
            "INSERT INTO llmgw_replicas (id, deployment, node, spec, created_at, epoch) VALUES ($1, $2, $3, $4, $5, $6) "
            "ON CONFLICT (id) DO UPDATE SET deployment = EXCLUDED.deployment, node = EXCLUDED.node, "
            "spec = EXCLUDED.spec, created_at = EXCLUDED.created_at, epoch = EXCLUDED.epoch",
            (r.id, r.deployment, r.node, json.dumps(r.spec, sort_keys=True), r.created_at or time.time()), then)

    def delete_replica(self, replica_id: str) -> None:
        self._queue("DELETE FROM llmgw_replicas WHERE id = $1", (replica_id,), epoch=False)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """(Writes queued in one callback are committed together anyway.)"""
        yield

    def close(self) -> None:
        """Nothing to close (the control plane owns the database); queued writes still go."""

    # -- the writer --

    def _queue(self, sql: str, args: tuple[Any, ...], then: Callable[[], None] | None = None, *,
               epoch: bool = True) -> None:
        self._pending.append((sql, args, then, epoch))
        self._queued += 1
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._write(), name="llmgw desired-state writes")

    @property
    def pending(self) -> int:
        return self._queued - self._committed

    async def flushed(self) -> None:
        """Wait until every write queued so far is committed.

        Raises:
            NotLeader, DatabaseError: they could not be (this process stops leading).
        """
        if self._failed is not None:
            raise self._failed
        target = self._queued
        if self._committed >= target:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((target, fut))
        await fut

    async def _write(self) -> None:
        await asyncio.sleep(0)  # (the rest of this callback's writes join the transaction)
        while self._pending:
            # PERF: at most MAX_TX_ROWS writes a transaction, runs of one statement sent as one
            # executemany: a fenced transaction holds the lease row FOR SHARE, which the leader's own
            # renew (an UPDATE of that row) waits for; a ctl scale of 1,000 replicas written as 1,000
            # round trips in one transaction held it past the renew deadline (bench/bulk_placement.py).
            cut = min(MAX_TX_ROWS, len(self._pending))
            while cut < len(self._pending) and self._pending[cut - 1][0] == _DELETE_REPLICAS_OF:
                cut += 1  # (a deployment's delete: its replicas' and its own row in one transaction)
            ops, self._pending = self._pending[:cut], self._pending[cut:]
            try:
                async with self.fence() as (tx, epoch):
                    for sql, rows in _runs(ops, epoch):
                        if len(rows) == 1:
                            await tx.execute(sql, *rows[0])
                        else:
                            await tx.executemany(sql, rows)
            except Exception as exc:
                self._fail(exc, len(ops))
                return
            self._committed += len(ops)
            self.writes += len(ops)
            self.transactions += 1
            for _, _, then, _ in ops:
                if then is not None:
                    try:
                        then()
                    except Exception:
                        log.exception("after a desired-state write")
            done = [w for w in self._waiters if w[0] <= self._committed]
            self._waiters = [w for w in self._waiters if w[0] > self._committed]
            for _, fut in done:
                if not fut.done():
                    fut.set_result(None)
            if self._pending:
                await asyncio.sleep(0)  # (the loop, renewals included, runs between two transactions)
        self._task = None

    def _fail(self, exc: BaseException, lost: int) -> None:
        # the queued writes are dropped with this term: the next leader starts from the database
        self._failed = exc
        self._committed += lost + len(self._pending)
        self._pending = []
        waiters, self._waiters = self._waiters, []
        for _, fut in waiters:
            if not fut.done():
                fut.set_exception(exc)
        self._task = None
        log.error("a desired-state write failed (%s: %s); this control plane stops leading", type(exc).__name__, exc)
        if self.on_failed is not None:
            self.on_failed(exc)
