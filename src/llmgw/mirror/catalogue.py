"""The mirror's catalogue: an SQLite database of models, their files and blobs.

One row per model (``name``, ``tag``, where it came from, what Ollama said about
it), one per file (role, blob digest and size, the GGUF header summary) and one per
blob. A model and its files are written in one transaction, and only once every
blob is in place, so a reader never sees a model whose files are missing.

The database runs in WAL mode with ``synchronous=FULL`` (a committed import
survives a power cut) and a busy timeout, so concurrent imports queue rather than
fail.

A mirror this user cannot write (``chmod -R a-w``, a root directory without ``w``, a
read-only mount) is opened read-only, so ``ls``, ``show``, ``verify`` and ``gc --dry-run``
still work: with ``mode=ro``, or, when SQLite cannot create the ``-shm`` file WAL mode
reads through (a read-only directory), with ``immutable=1``, which is only right when no
``-wal`` file holds changes (then the catalogue refuses with what to do). Every SQLite
error becomes one of the mirror's errors: :class:`CatalogueAccessError` (cannot write;
fix the permissions or run as the owner), :class:`NoSpaceError` (disk full),
:class:`MirrorBusyError` or :class:`CatalogueError`.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .errors import (
    CatalogueAccessError,
    CatalogueError,
    MirrorBusyError,
    MirrorError,
    ModelExistsError,
    ModelNotFoundError,
    NoSpaceError,
)
from .names import format_ref

__all__ = ["SCHEMA_VERSION", "Catalogue", "FileEntry", "ModelRecord", "StoredFile", "utc_now"]

SCHEMA_VERSION = 1
_BUSY_TIMEOUT_S = 120.0

_SCHEMA = """
CREATE TABLE blobs (
    digest      TEXT PRIMARY KEY,           -- 'sha256:<64 lowercase hex>'
    size        INTEGER NOT NULL,
    added_at    TEXT NOT NULL,
    verified_at TEXT
);
CREATE TABLE models (
    id          INTEGER PRIMARY KEY,
    name        TEXT NOT NULL COLLATE NOCASE,
    tag         TEXT NOT NULL COLLATE NOCASE,
    source_kind TEXT NOT NULL,              -- 'file' | 'ollama'
    source      TEXT NOT NULL,
    created_at  TEXT NOT NULL,
    info        TEXT NOT NULL,              -- JSON: what the source knew (Ollama template, params, license)
    UNIQUE (name, tag)
);
CREATE TABLE files (
    model_id        INTEGER NOT NULL REFERENCES models(id) ON DELETE CASCADE,
    role            TEXT NOT NULL,          -- 'model' | 'projector' | 'adapter'
    position        INTEGER NOT NULL,
    digest          TEXT NOT NULL REFERENCES blobs(digest),
    size            INTEGER NOT NULL,
    filename        TEXT,
    source          TEXT NOT NULL,
    imported_at     TEXT NOT NULL,
    architecture    TEXT,
    gguf_name       TEXT,
    context_length  INTEGER,
    file_type       INTEGER,
    quantization    TEXT,
    parameter_count INTEGER,
    gguf            TEXT,                   -- JSON: the header summary, NULL for raw files
    PRIMARY KEY (model_id, role, position)
);
CREATE INDEX files_digest ON files(digest);
"""


# SQLite's primary result codes (the low byte of an extended code) that mean "this
# process may not write (or open) the file": the read-only fallback, and the message
# that names permissions rather than corruption.
_CANNOT_WRITE = frozenset({sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_PERM})


def _code(exc: sqlite3.Error) -> int:
    return getattr(exc, "sqlite_errorcode", 0) & 0xFF


def _owner(path: Path) -> str | None:
    try:
        import pwd

        return pwd.getpwuid(os.stat(path).st_uid).pw_name
    except (ImportError, KeyError, OSError):
        return None


def utc_now() -> str:
    """Return the current time as ISO 8601 UTC with a ``Z``, to the second."""
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


@dataclass(frozen=True, slots=True)
class FileEntry:
    """A file to record with a model (its blob already in the store).

    Attributes:
        role: ``model``, ``projector`` or ``adapter``.
        digest: ``sha256:<hex>`` of its bytes.
        size: bytes.
        filename: the source file's name, for people.
        source: where it was copied from.
        gguf: the GGUF header summary, or ``None`` for a raw file.
    """

    role: str
    digest: str
    size: int
    filename: str | None
    source: str
    gguf: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class StoredFile:
    """A model's file as the catalogue records it, with its blob's path."""

    role: str
    position: int
    digest: str
    size: int
    filename: str | None
    source: str
    imported_at: str
    gguf: dict[str, Any] | None
    path: Path

    def to_json(self) -> dict[str, Any]:
        """Return a JSON-friendly dict."""
        return {
            "role": self.role,
            "position": self.position,
            "digest": self.digest,
            "size": self.size,
            "filename": self.filename,
            "source": self.source,
            "imported_at": self.imported_at,
            "path": str(self.path),
            "gguf": self.gguf,
        }


@dataclass(frozen=True, slots=True)
class ModelRecord:
    """A model in the mirror."""

    name: str
    tag: str
    source_kind: str
    source: str
    created_at: str
    files: tuple[StoredFile, ...]
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def ref(self) -> str:
        """``name:tag``."""
        return format_ref(self.name, self.tag)

    @property
    def main(self) -> StoredFile | None:
        """The ``model`` file, if any."""
        return next((f for f in self.files if f.role == "model"), None)

    @property
    def size(self) -> int:
        """Bytes of all its files."""
        return sum(f.size for f in self.files)

    def header(self, key: str) -> Any:
        """Return ``key`` from the main file's GGUF summary, or ``None``."""
        main = self.main
        return main.gguf.get(key) if main is not None and main.gguf else None

    def to_json(self) -> dict[str, Any]:
        """Return a JSON-friendly dict."""
        return {
            "name": self.name,
            "tag": self.tag,
            "ref": self.ref,
            "source_kind": self.source_kind,
            "source": self.source,
            "created_at": self.created_at,
            "size": self.size,
            "architecture": self.header("architecture"),
            "parameter_count": self.header("parameter_count"),
            "quantization": self.header("quantization"),
            "context_length": self.header("context_length"),
            "files": [f.to_json() for f in self.files],
            "info": self.info,
        }


class Catalogue:
    """The SQLite catalogue at ``path``.

    Args:
        path: the database file.
        blob_path: maps a digest to its blob's path (for :class:`StoredFile`).
        create: create the database if it does not exist.

    Raises:
        CatalogueError: the file is not a catalogue, or one from a newer llmgw.
    """

    def __init__(self, path: Path, blob_path: Any, *, create: bool = True) -> None:
        self.path = path
        self._blob_path = blob_path
        # Opened read-only (the file or its directory is not writable here): reads work, writes
        # raise CatalogueAccessError.
        self.read_only = False
        if not create and not path.exists():
            raise CatalogueError(f"no catalogue at {path}; import a model first (llmgw mirror import FILE)")
        try:
            self._db = sqlite3.connect(path, timeout=_BUSY_TIMEOUT_S, isolation_level=None)
        except sqlite3.Error as exc:
            raise self._error(exc, "nothing was read or changed") from exc
        try:
            self._setup()
        except sqlite3.Error as exc:
            self._db.close()
            if _code(exc) not in _CANNOT_WRITE or not path.is_file():
                raise self._error(exc, "nothing was read or changed") from exc
            self._open_read_only()
        except BaseException:
            self._db.close()
            raise

    def _open_read_only(self) -> None:
        """Open the catalogue for reading only (see the module docstring); ``self._db`` is then that."""
        uri = self.path.absolute().as_uri()
        last: sqlite3.Error | None = None
        for options in ("mode=ro", "immutable=1"):
            if options == "immutable=1":
                # immutable: SQLite reads the main file only, without locks or the -shm it
                # cannot create here. Changes still in the -wal file would be unseen (whole
                # models missing), so then refuse; an empty or absent -wal holds nothing.
                try:
                    wal = os.stat(f"{self.path}-wal").st_size
                except FileNotFoundError:
                    wal = 0
                except OSError:
                    wal = 1
                if wal:
                    raise CatalogueAccessError(
                        f"cannot read the catalogue {self.path}: its last changes are in {self.path}-wal,"
                        f" which SQLite reads only with a {self.path}-shm file that this user cannot create"
                        f" ({self._not_writable()[0]}); nothing was read. Run llmgw mirror ls once as"
                        f" {self._owner_words()} (that folds them into the catalogue), or make"
                        f" {self.path.parent} writable"
                    )
            try:
                db = sqlite3.connect(
                    f"{uri}?{options}", uri=True, timeout=_BUSY_TIMEOUT_S, isolation_level=None
                )
            except sqlite3.Error as exc:
                last = exc
                continue
            try:
                version = db.execute("PRAGMA user_version").fetchone()[0]
                if version > SCHEMA_VERSION:
                    raise CatalogueError(
                        f"the catalogue {self.path} was written by a newer llmgw (schema {version}); upgrade llmgw"
                    )
                if version < SCHEMA_VERSION:
                    raise CatalogueAccessError(
                        f"the catalogue {self.path} is not set up yet and cannot be written here"
                        f" ({self._not_writable()[0]}); nothing was read. Import a model as"
                        f" {self._owner_words()}, or fix the permissions of {self.path.parent}"
                    )
                db.execute("PRAGMA foreign_keys=ON")
                db.execute("SELECT count(*) FROM models").fetchone()  # (reads through the WAL, if any)
            except sqlite3.Error as exc:
                db.close()
                if _code(exc) in _CANNOT_WRITE:
                    last = exc
                    continue
                raise self._error(exc, "nothing was read") from exc
            except BaseException:
                db.close()
                raise
            self._db = db
            self.read_only = True
            return
        assert last is not None
        raise self._error(last, "nothing was read") from last

    # -- errors ---------------------------------------------------------------

    def _not_writable(self) -> tuple[str, str]:
        """Why this process cannot write the catalogue, and the fix, in words (best effort)."""
        parent = self.path.parent
        try:
            if os.statvfs(parent).f_flag & os.ST_RDONLY:
                return (
                    f"the file system holding {parent} is mounted read-only",
                    "Mount it read-write, or use another mirror root (--root)",
                )
        except OSError:
            pass
        paths = [p for p in (self.path, Path(f"{self.path}-wal"), Path(f"{self.path}-shm")) if p.exists()]
        denied = [p for p in paths if not os.access(p, os.W_OK)]
        if not os.access(parent, os.W_OK | os.X_OK):
            denied.insert(0, parent)
        if not denied:
            return (
                "it is read-only for this user",
                f"Check its permissions, or run this as {self._owner_words()}",
            )
        names = ", ".join(("its directory " + str(p)) if p == parent else str(p) for p in denied)
        return (
            f"this user may not write {names}",
            f"Make {'them' if len(denied) > 1 else 'it'} writable (chmod u+w {' '.join(map(str, denied))}),"
            f" or run this as {self._owner_words()}",
        )

    def _owner_words(self) -> str:
        owner = _owner(self.path if self.path.exists() else self.path.parent)
        return f"{owner}, who owns it" if owner else "the user who owns it"

    def _access_error(self, exc: sqlite3.Error | None, consequence: str | None) -> CatalogueAccessError:
        detail = f" ({exc})" if exc is not None else ""
        then = f"; {consequence}" if consequence else ""
        if self.path.exists() and not os.access(self.path, os.R_OK):
            return CatalogueAccessError(
                f"cannot read the catalogue {self.path}: this user may not{detail}{then}. Fix its permissions"
                f" (chmod u+r {self.path}), or run this as {self._owner_words()}"
            )
        why, fix = self._not_writable()
        return CatalogueAccessError(f"cannot write to the catalogue {self.path}: {why}{detail}{then}. {fix}")

    def _error(self, exc: sqlite3.Error, consequence: str | None) -> MirrorError:
        """The mirror's error for a failed SQLite call; ``consequence`` says what did not happen."""
        code = _code(exc)
        then = f"; {consequence}" if consequence else ""
        where = f"the catalogue {self.path}"
        if code == sqlite3.SQLITE_FULL:
            return NoSpaceError(
                f"the disk holding {where} is full ({exc}){then}. Free some space (llmgw mirror gc removes"
                " unused blobs) and run it again"
            )
        if code in _CANNOT_WRITE or (self.read_only and code == sqlite3.SQLITE_READONLY):
            return self._access_error(exc, consequence)
        if code in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
            return MirrorBusyError(
                f"{where} stayed locked by another llmgw process for {_BUSY_TIMEOUT_S:.0f} s ({exc}){then}."
                " Run it again when the other command has finished"
            )
        if code == sqlite3.SQLITE_IOERR:
            return CatalogueError(
                f"reading or writing {where} failed with an I/O error ({exc}){then}. Check the disk (dmesg)"
                " before trying again"
            )
        # CORRUPT, NOTADB, or a database without our tables: not (or no longer) an llmgw catalogue.
        return CatalogueError(
            f"{where} is damaged or not an llmgw catalogue ({exc}){then}. Move it aside and import the models"
            " again"
        )

    @contextmanager
    def _errors(self, consequence: str | None = None) -> Iterator[None]:
        """Turn SQLite's errors in the block into the mirror's (see :meth:`_error`)."""
        try:
            yield
        except sqlite3.Error as exc:
            raise self._error(exc, consequence) from exc

    def check_writable(self, consequence: str) -> None:
        """Raise now if this process cannot write the catalogue, before work that would then be lost.

        It writes a header field in a transaction that it rolls back: SQLite says
        ``SQLITE_READONLY`` for a file, a directory or a mount this process may not write.

        Raises:
            CatalogueAccessError: the catalogue is read-only here.
            MirrorBusyError: another process held its write lock past the busy timeout.
        """
        if self.read_only:
            raise self._access_error(None, consequence)
        db = self._db
        with self._errors(consequence):
            db.execute("BEGIN IMMEDIATE")
            try:
                version = int(db.execute("PRAGMA user_version").fetchone()[0])
                db.execute(f"PRAGMA user_version={version}")
            finally:
                if db.in_transaction:
                    db.execute("ROLLBACK")

    def _setup(self) -> None:
        # SQLite answers "database is locked" at once, without waiting in its busy
        # handler, in a few cases where another process is setting the same file
        # up (switching a new file to WAL, a WAL recovery): concurrent first
        # imports into a new mirror meet them. Those are retried here, within the
        # same bound as a busy wait.
        deadline = time.monotonic() + _BUSY_TIMEOUT_S
        delay = 0.01
        for _ in range(100_000):  # (bounded by the deadline long before this)
            try:
                self._setup_once()
                return
            except sqlite3.OperationalError as exc:
                text = str(exc)
                if ("locked" not in text and "busy" not in text) or time.monotonic() >= deadline:
                    raise
            time.sleep(delay)
            delay = min(delay * 2, 0.25)

    def _setup_once(self) -> None:
        db = self._db
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.execute("PRAGMA foreign_keys=ON")
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version == SCHEMA_VERSION:
            return
        if version > SCHEMA_VERSION:
            raise CatalogueError(
                f"the catalogue {self.path} was written by a newer llmgw (schema {version}); upgrade llmgw"
            )
        with self.transaction():
            # Re-read inside the lock: another process may have just created it.
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version == 0:
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        db.execute(statement)
                db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def close(self) -> None:
        """Close the database."""
        self._db.close()

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """Run the block in one write transaction (``BEGIN IMMEDIATE``), committed on success."""
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
            db.execute("COMMIT")
        except BaseException:
            # (SQLite rolls some failures back itself: a full disk, an I/O error. A ROLLBACK
            # that fails too would only hide the error that says what went wrong.)
            if db.in_transaction:
                try:
                    db.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
            raise

    # -- models ---------------------------------------------------------------

    def _files(self, model_id: int) -> tuple[StoredFile, ...]:
        rows = self._db.execute(
            "SELECT role, position, digest, size, filename, source, imported_at, gguf FROM files"
            " WHERE model_id = ? ORDER BY CASE role WHEN 'model' THEN 0 WHEN 'projector' THEN 1 ELSE 2 END,"
            " role, position",
            (model_id,),
        ).fetchall()
        return tuple(
            StoredFile(
                role=r[0],
                position=r[1],
                digest=r[2],
                size=r[3],
                filename=r[4],
                source=r[5],
                imported_at=r[6],
                gguf=json.loads(r[7]) if r[7] else None,
                path=self._blob_path(r[2]),
            )
            for r in rows
        )

    def _record(self, row: Sequence[Any]) -> ModelRecord:
        return ModelRecord(
            name=row[1],
            tag=row[2],
            source_kind=row[3],
            source=row[4],
            created_at=row[5],
            info=json.loads(row[6]),
            files=self._files(row[0]),
        )

    _MODEL_COLS = "id, name, tag, source_kind, source, created_at, info"

    def get(self, name: str, tag: str) -> ModelRecord | None:
        """Return the model ``name:tag`` (case-insensitive) or ``None``."""
        with self._errors():
            row = self._db.execute(
                f"SELECT {self._MODEL_COLS} FROM models WHERE name = ? AND tag = ?", (name, tag)
            ).fetchone()
            return self._record(row) if row else None

    def models(self) -> list[ModelRecord]:
        """Return every model, sorted by name and tag."""
        with self._errors():
            rows = self._db.execute(f"SELECT {self._MODEL_COLS} FROM models ORDER BY name, tag").fetchall()
            return [self._record(r) for r in rows]

    def add(
        self,
        name: str,
        tag: str,
        files: Sequence[FileEntry],
        *,
        source_kind: str,
        source: str,
        info: dict[str, Any],
        replace: bool = False,
    ) -> tuple[ModelRecord, bool]:
        """Record a model and its files in one transaction.

        The caller has put every blob in place first. If ``name:tag`` exists with
        the same files (roles and digests), nothing changes.

        Args:
            replace: a ``name:tag`` recorded with different files is replaced (its blobs
                stay until ``gc``) instead of refused.

        Returns:
            The record and whether it was created (``False``: it was already there).

        Raises:
            ModelExistsError: ``name:tag`` exists with different files (and not ``replace``).
            CatalogueAccessError, NoSpaceError, MirrorBusyError, CatalogueError: it could not be written.
        """
        now = utc_now()
        wanted = [(f.role, f.digest) for f in files]
        with self._errors(f"{format_ref(name, tag)} was not recorded"), self.transaction() as db:
            row = db.execute(
                f"SELECT {self._MODEL_COLS} FROM models WHERE name = ? AND tag = ?", (name, tag)
            ).fetchone()
            if row is not None:
                existing = self._record(row)
                if [(f.role, f.digest) for f in existing.files] == wanted:
                    return existing, False
                if replace:
                    db.execute("DELETE FROM models WHERE id = ?", (row[0],))
                    row = None
            if row is not None:
                raise ModelExistsError(
                    f"{existing.ref} is already in the mirror with different files; nothing was changed."
                    f" Pick another name with --name, or remove it first (llmgw mirror rm {existing.ref})"
                )
            for f in files:
                db.execute(
                    "INSERT OR IGNORE INTO blobs (digest, size, added_at, verified_at) VALUES (?, ?, ?, ?)",
                    (f.digest, f.size, now, now),
                )
            cur = db.execute(
                "INSERT INTO models (name, tag, source_kind, source, created_at, info) VALUES (?, ?, ?, ?, ?, ?)",
                (name, tag, source_kind, source, now, json.dumps(info, sort_keys=True)),
            )
            model_id = cur.lastrowid
            positions: dict[str, int] = {}
            for f in files:
                pos = positions.get(f.role, 0)
                positions[f.role] = pos + 1
                g = f.gguf or {}
                db.execute(
                    "INSERT INTO files (model_id, role, position, digest, size, filename, source, imported_at,"
                    " architecture, gguf_name, context_length, file_type, quantization, parameter_count, gguf)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        model_id,
                        f.role,
                        pos,
                        f.digest,
                        f.size,
                        f.filename,
                        f.source,
                        now,
                        g.get("architecture"),
                        g.get("name"),
                        g.get("context_length"),
                        g.get("file_type"),
                        g.get("quantization"),
                        g.get("parameter_count"),
                        json.dumps(f.gguf, sort_keys=True) if f.gguf is not None else None,
                    ),
                )
            record = self._record(
                db.execute(f"SELECT {self._MODEL_COLS} FROM models WHERE id = ?", (model_id,)).fetchone()
            )
        return record, True

    def remove(self, name: str, tag: str) -> ModelRecord:
        """Remove the model ``name:tag`` (its blobs stay until ``gc``).

        Raises:
            ModelNotFoundError: there is no such model.
            CatalogueAccessError, NoSpaceError, MirrorBusyError, CatalogueError: it could not be written.
        """
        with self._errors(f"{format_ref(name, tag)} was not removed"), self.transaction() as db:
            row = db.execute(
                f"SELECT {self._MODEL_COLS} FROM models WHERE name = ? AND tag = ?", (name, tag)
            ).fetchone()
            if row is None:
                raise ModelNotFoundError(
                    f"no model {format_ref(name, tag)} in the mirror; see the names with llmgw mirror ls"
                )
            record = self._record(row)
            db.execute("DELETE FROM models WHERE id = ?", (row[0],))
        return record

    # -- blobs ----------------------------------------------------------------

    def referenced_digests(self) -> set[str]:
        """Return the digests some model's file uses."""
        with self._errors():
            return {r[0] for r in self._db.execute("SELECT DISTINCT digest FROM files")}

    def blob_users(self) -> dict[str, list[str]]:
        """Return, per digest, the ``name:tag`` of each model that uses it."""
        users: dict[str, list[str]] = {}
        with self._errors():
            for digest, name, tag in self._db.execute(
                "SELECT f.digest, m.name, m.tag FROM files f JOIN models m ON m.id = f.model_id"
                " ORDER BY m.name, m.tag"
            ):
                users.setdefault(digest, []).append(format_ref(name, tag))
        return users

    def blob_sizes(self) -> dict[str, int]:
        """Return the recorded size of every blob a model uses."""
        with self._errors():
            return {r[0]: r[1] for r in self._db.execute("SELECT DISTINCT digest, size FROM files")}

    def mark_verified(self, digests: Sequence[str]) -> None:
        """Record that ``digests`` were re-hashed and found intact just now.

        Raises:
            CatalogueAccessError, NoSpaceError, MirrorBusyError, CatalogueError: it could not be written.
        """
        now = utc_now()
        with self._errors("the results were not recorded"), self.transaction() as db:
            db.executemany("UPDATE blobs SET verified_at = ? WHERE digest = ?", [(now, d) for d in digests])

    def forget_unused_blobs(self) -> None:
        """Delete the rows of blobs no model uses any more (after ``gc`` removed their files).

        Raises:
            CatalogueAccessError, NoSpaceError, MirrorBusyError, CatalogueError: it could not be written
                (the rows stay; nothing reads them for a blob no model uses, and the next ``gc`` forgets them).
        """
        with self._errors("the removed blobs' rows stay in it until the next gc"), self.transaction() as db:
            db.execute(
                "DELETE FROM blobs WHERE NOT EXISTS (SELECT 1 FROM files WHERE files.digest = blobs.digest)"
            )
