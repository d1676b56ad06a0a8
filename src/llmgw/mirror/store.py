"""The mirror's content-addressed blob store and its catalogue.

Layout under the mirror root::

    catalogue.sqlite3                    the catalogue (plus -wal and -shm files)
    blobs/sha256/<2 hex>/<64 hex>        each blob, named by the SHA-256 of its bytes, read-only
    tmp/<pid>-<random>.partial           copies in progress (never visible as blobs)
    tmp/fetch-<64 hex>.partial           a blob being fetched from a control plane's mirror
                                         (llmgw.mirror.fetch: kept across interruptions to resume)
    quarantine/<64 hex>                  a blob ``verify`` found corrupt, moved out of the blobs
                                         (its models can no longer be deployed; never deleted by llmgw)
    lock                                 flock: imports share it, gc takes it alone

How a blob gets in (:meth:`MirrorStore.add_blob`), so that an interruption at any
point (Ctrl-C, ``kill -9``, a full disk, a power cut) leaves no visible partial
blob and no catalogue row:

1. a temporary file is created in ``tmp/`` with ``O_CREAT|O_EXCL|O_NOFOLLOW``
   (never an existing file, never through a link), and space for the whole file
   is reserved, so a full disk fails before the copy rather than near its end;
2. the source is copied and hashed in one pass (the hash runs in a second thread
   on the buffer just read, while the main thread writes it);
3. the source is checked not to have changed during the copy, and the digest
   against the one expected, if any; the file is made read-only and fsync'd;
4. it is hard-linked to its final name (which fails, rather than overwrites, if
   the blob exists: then the existing blob is re-hashed and reused, or replaced
   atomically if it turns out corrupt), and the blob's directory is fsync'd;
5. only then does the caller record the model in the catalogue, in one
   transaction.

Concurrent imports of the same blob each write their own temporary file; the
first link wins and the others verify and reuse it. ``gc`` takes the lock
exclusively, so it never removes a blob an import has placed but not yet recorded.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import re
import secrets
import stat
import sys
import time
from collections.abc import Collection, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .catalogue import Catalogue, FileEntry, ModelRecord
from .errors import (
    DigestMismatchError,
    FileTooLargeError,
    MirrorBusyError,
    MirrorError,
    ModelNotFoundError,
    NoSpaceError,
    SourceChangedError,
    SourceError,
    StoreLayoutError,
)
from .progress import NullProgress, Progress

__all__ = [
    "COPY_CHUNK",
    "BlobCheck",
    "BlobResult",
    "GcReport",
    "MirrorStore",
    "default_root",
    "hash_file",
    "is_digest",
]

log = logging.getLogger("llmgw.mirror")

# PERF: 4 MiB chunks measured best on the benchmark (bench/bench_mirror_import.py):
# large enough that the per-chunk Python overhead and the hand-off to the hash
# thread vanish, small enough to stay in L2/L3 between the read, hash and write.
COPY_CHUNK = 4 << 20
# Below this, a second thread costs more than it saves.
_PIPELINE_MIN = 3 * COPY_CHUNK
# Keep this much free beyond the file itself (the catalogue and the file system need room too).
_SPACE_MARGIN = 16 << 20

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)

_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_TEMP = re.compile(r"\d+-[0-9a-f]{16}\.partial")
_FETCH_TEMP = re.compile(r"fetch-[0-9a-f]{64}\.partial")


def is_digest(value: str) -> bool:
    """Return whether ``value`` is ``sha256:`` and 64 lowercase hex digits."""
    return _DIGEST.fullmatch(value) is not None


def default_root(environ: dict[str, str] | None = None) -> Path:
    """Return the default mirror root.

    ``$LLMGW_MIRROR`` if set, else ``$XDG_DATA_HOME/llmgw/mirror`` (when that is an
    absolute path, as the XDG spec requires), else ``~/.local/share/llmgw/mirror``.

    Args:
        environ: the environment to read (``os.environ`` by default).

    Returns:
        The root, with ``~`` expanded; it may not exist yet.
    """
    env = os.environ if environ is None else environ
    explicit = env.get("LLMGW_MIRROR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = env.get("XDG_DATA_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "llmgw" / "mirror"
    return Path.home() / ".local" / "share" / "llmgw" / "mirror"


@dataclass(frozen=True, slots=True)
class BlobResult:
    """A blob now in the store.

    Attributes:
        digest: ``sha256:<hex>``.
        size: bytes.
        path: its path in the store.
        reused: the store already had it (verified); nothing new was written.
        replaced: the store had a corrupt blob under that name (or a link, ...); the
            verified copy replaced it.
    """

    digest: str
    size: int
    path: Path
    reused: bool
    replaced: bool = False


@dataclass(frozen=True, slots=True)
class BlobCheck:
    """The result of re-hashing one blob (``verify``).

    Attributes:
        digest: the digest the blob is stored under.
        size: its recorded size.
        path: where it should be.
        status: ``ok``, ``corrupt`` (its bytes hash to something else),
            ``wrong-size``, ``not-a-file`` (a directory, a symbolic link, ... at its
            path), ``quarantined`` (missing, and a check found it corrupt before: ``quarantined`` says
            where it went), or ``missing``.
        actual: the digest its bytes have, for a corrupt blob.
        models: the ``name:tag`` of each model that uses it.
        quarantined: where a corrupt blob was moved (``verify(quarantine=True)``, now or before), else ``None``.
    """

    digest: str
    size: int
    path: Path
    status: str
    actual: str | None = None
    models: tuple[str, ...] = ()
    quarantined: Path | None = None

    @property
    def ok(self) -> bool:
        """Whether the blob is intact."""
        return self.status == "ok"

    def to_json(self) -> dict[str, Any]:
        """Return a JSON-friendly dict."""
        return {
            "digest": self.digest,
            "size": self.size,
            "path": str(self.path),
            "status": self.status,
            "actual": self.actual,
            "models": list(self.models),
            "quarantined": str(self.quarantined) if self.quarantined is not None else None,
        }


@dataclass(slots=True)
class GcReport:
    """What ``gc`` removed (or would remove, with ``dry_run``).

    Attributes:
        blobs: ``(digest, size, path)`` of each blob no model uses.
        temp_files: ``(path, size)`` of each temporary file left by an interrupted import.
        dry_run: nothing was removed.
        busy: (``dry_run`` only) an import or a fetch holds the mirror now, so ``gc``
            would refuse to run; the lists leave out its files in progress.
    """

    blobs: list[tuple[str, int, Path]] = field(default_factory=list)
    temp_files: list[tuple[Path, int]] = field(default_factory=list)
    dry_run: bool = False
    busy: bool = False

    @property
    def reclaimed(self) -> int:
        """Bytes freed (or that would be)."""
        return sum(b[1] for b in self.blobs) + sum(t[1] for t in self.temp_files)

    def to_json(self) -> dict[str, Any]:
        """Return a JSON-friendly dict."""
        return {
            "dry_run": self.dry_run,
            "busy": self.busy,
            "reclaimed": self.reclaimed,
            "blobs": [{"digest": d, "size": s, "path": str(p)} for d, s, p in self.blobs],
            "temp_files": [{"path": str(p), "size": s} for p, s in self.temp_files],
        }


def _write_all(fd: int, view: memoryview) -> None:
    """Write all of ``view`` to ``fd`` (``os.write`` may write less than asked)."""
    while view:
        n = os.write(fd, view)
        view = view[n:]


_SYNC_FILE_RANGE_WRITE = 2
# Start writeback every this many bytes copied (see _start_writeback).
_WRITEBACK_EVERY = 32 << 20
_sync_file_range: Any = None


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing ``length`` bytes at ``offset`` to disk, without waiting.

    PERF: with this every ``_WRITEBACK_EVERY`` bytes, the disk writes while we
    copy and hash, and the final fsync has almost nothing left to do: on the
    benchmark the fsync of 1 GiB went from ~0.45 s to ~0.02 s. Linux only
    (``sync_file_range(2)``, not in :mod:`os`); elsewhere a no-op.
    """
    global _sync_file_range
    if _sync_file_range is None:
        _sync_file_range = False
        if sys.platform.startswith("linux"):
            try:
                import ctypes

                fn = ctypes.CDLL(None, use_errno=True).sync_file_range
                fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
                fn.restype = ctypes.c_int
                _sync_file_range = fn
            except (OSError, AttributeError):  # pragma: no cover - not glibc/musl
                pass
    if _sync_file_range:
        _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


def _copy_and_hash(src_fd: int, dst_fd: int | None, size: int, progress: Progress) -> tuple[str, int]:
    """Copy the first ``size`` bytes of ``src_fd`` to ``dst_fd`` (or only read them, when ``None``), hashing them.

    It stops at ``size`` (the size when the copy began) even if the file grows
    meanwhile, or earlier if it shrank: the caller compares the count and the
    file's ``fstat`` afterwards to tell a changed source.

    Returns:
        ``(hex digest, bytes read)``.
    """
    h = hashlib.sha256()
    total = 0
    if size < _PIPELINE_MIN:
        buf = memoryview(bytearray(min(COPY_CHUNK, max(size, 1 << 16))))
        while total < size and (n := os.readv(src_fd, [buf[: min(len(buf), size - total)]])):
            chunk = buf[:n]
            h.update(chunk)
            if dst_fd is not None:
                _write_all(dst_fd, chunk)
            total += n
            progress.advance(n)
        return h.hexdigest(), total
    # PERF: two buffers in turn. The hash thread digests buffer i (hashlib drops
    # the GIL for large inputs) while this thread writes buffer i and reads into
    # buffer i^1; buffer i is reused only after its hash has finished, which the
    # wait on `pending` before each submit guarantees.
    views = (memoryview(bytearray(COPY_CHUNK)), memoryview(bytearray(COPY_CHUNK)))
    flushed = 0
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmgw-hash") as pool:
        pending: Future[None] | None = None
        i = 0
        try:
            while total < size and (n := os.readv(src_fd, [views[i][: min(COPY_CHUNK, size - total)]])):
                chunk = views[i][:n]
                if pending is not None:
                    pending.result()
                pending = pool.submit(h.update, chunk)
                total += n
                if dst_fd is not None:
                    _write_all(dst_fd, chunk)
                    if total - flushed >= _WRITEBACK_EVERY:
                        _start_writeback(dst_fd, flushed, total - flushed)
                        flushed = total
                progress.advance(n)
                i ^= 1
        finally:
            # Never leave the hash thread reading a buffer that is going away.
            if pending is not None:
                pending.result()
    return h.hexdigest(), total


def hash_file(path: str | os.PathLike[str], progress: Progress | None = None) -> tuple[str, int]:
    """Return ``("sha256:<hex>", size)`` of a file, streamed (links are not followed).

    Raises:
        OSError: the file cannot be read (``ELOOP`` for a symbolic link).
    """
    fd = os.open(path, os.O_RDONLY | _O_CLOEXEC | _O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        _advise_sequential(fd)
        hexdigest, n = _copy_and_hash(fd, None, size, progress or NullProgress())
    finally:
        os.close(fd)
    return "sha256:" + hexdigest, n


def _advise_sequential(fd: int) -> None:
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except OSError:  # pragma: no cover - advice only
            pass


def _fsync_dir(path: Path) -> None:
    """fsync a directory so a name just created or removed in it is durable."""
    fd = os.open(path, os.O_RDONLY | _O_CLOEXEC | _O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as exc:  # pragma: no cover - some file systems refuse fsync on directories
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _unlink_quiet(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _human(n: int) -> str:
    """Bytes in decimal units (KB, MB, ...), as the CLI prints every size."""
    size = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")  # pragma: no cover


def _pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (any user's); a reused pid makes a dead one look alive, which only
    makes ``gc --dry-run`` list a leftover less."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)  # (PermissionError: another user's process, alive too)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _file_too_large(root: Path, label: str, size: int) -> str:
    import resource

    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and limit < size:
        why = f"this process may not write files over {_human(limit)} (ulimit -f)"
        fix = "Raise the limit (ulimit -f unlimited) and run it again"
    else:
        why = f"the file system holding {root} does not take files that large"
        fix = "Use a mirror root on another file system (--root)"
    return f"cannot store {label} ({_human(size)}) in {root}: {why}; nothing was recorded. {fix}"



def _locked_elsewhere(fd: int, mode: int) -> bool:
    """Whether another process holds a lock on ``fd``'s file that ``mode`` (``LOCK_SH``/``LOCK_EX``)
    conflicts with; ``fd`` is closed (which releases the lock, if it was taken)."""
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False

class MirrorStore:
    """A mirror root: blobs by SHA-256 and the catalogue of models.

    Args:
        root: the mirror root (see :func:`default_root`).
        create: create the root and its layout if missing; with ``False`` a
            missing catalogue raises :class:`~llmgw.mirror.errors.CatalogueError`.

    Raises:
        CatalogueError: the catalogue is unreadable or from a newer llmgw.
        OSError: the root cannot be created.
    """

    def __init__(self, root: str | os.PathLike[str], *, create: bool = True) -> None:
        self.root = Path(root).expanduser().absolute()
        self.blobs_dir = self.root / "blobs" / "sha256"
        self.tmp_dir = self.root / "tmp"
        self.quarantine_dir = self.root / "quarantine"
        self.lock_path = self.root / "lock"
        self.catalogue_path = self.root / "catalogue.sqlite3"
        if create:
            if not self.root.exists():
                os.makedirs(self.root, 0o755, exist_ok=True)
                _fsync_dir(self.root.parent)
            for d in (self.root, self.root / "blobs", self.blobs_dir, self.tmp_dir):
                self._ensure_dir(d)
        self.catalogue = Catalogue(self.catalogue_path, self.blob_path, create=create)

    @staticmethod
    def exists(root: str | os.PathLike[str]) -> bool:
        """Return whether ``root`` holds a mirror catalogue."""
        return (Path(root).expanduser() / "catalogue.sqlite3").is_file()

    def close(self) -> None:
        """Close the catalogue."""
        self.catalogue.close()

    def __enter__(self) -> MirrorStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- layout ---------------------------------------------------------------

    def blob_path(self, digest: str) -> Path:
        """Return where the blob ``sha256:<hex>`` lives.

        Raises:
            ValueError: ``digest`` is not ``sha256:`` and 64 lowercase hex digits.
        """
        if not is_digest(digest):
            raise ValueError(f"not a sha256 digest: {digest!r}")
        hexdigest = digest[7:]
        return self.blobs_dir / hexdigest[:2] / hexdigest

    def _ensure_dir(self, path: Path) -> None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            try:
                os.mkdir(path, 0o755)
            except FileExistsError:
                pass
            else:
                _fsync_dir(path.parent)
            st = os.lstat(path)
        # The root itself may be a link (to a bigger disk); the layout inside may not:
        # renames must stay on one file system and inside the root.
        if path != self.root and stat.S_ISLNK(st.st_mode):
            raise SourceError(f"{path} is a symbolic link; the mirror's own directories must be real ones")
        if not stat.S_ISDIR(os.stat(path).st_mode):
            raise SourceError(
                f"{path} is not a directory; move it aside or choose another mirror root (--root)"
            )

    # -- locking --------------------------------------------------------------

    def _open_lock(self, *, required: bool = True) -> int | None:
        """Open the lock file; ``None`` when it cannot be opened and not ``required`` (a read-only mirror)."""
        try:
            return os.open(self.lock_path, os.O_RDWR | os.O_CREAT | _O_CLOEXEC | _O_NOFOLLOW, 0o644)
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
            try:
                # flock works as well on a descriptor open for reading (a read-only mirror).
                return os.open(self.lock_path, os.O_RDONLY | _O_CLOEXEC | _O_NOFOLLOW)
            except OSError:
                if required:
                    raise exc from None
                return None

    @contextmanager
    def importing(self) -> Iterator[None]:
        """Hold the mirror for an import: shared with other imports, exclusive of ``gc``.

        When no other process holds the mirror, temporary files left by
        interrupted imports are removed first.
        """
        fd = self._open_lock()
        assert fd is not None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pass
            else:
                self._sweep_temp(dry_run=False)
            fcntl.flock(fd, fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)

    @contextmanager
    def _reading(self) -> Iterator[None]:
        """Keep ``gc`` out while reading blobs (``verify``); on a mirror whose lock file this user can
        neither open nor create, read without it (nobody without write access can ``gc`` it either)."""
        fd = self._open_lock(required=False)
        try:
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_SH)
            yield
        finally:
            if fd is not None:
                os.close(fd)

    def _held_by_another(self) -> bool:
        """Whether an import or a fetch holds the mirror now (so ``gc`` would refuse)."""
        fd = self._open_lock(required=False)
        return fd is not None and _locked_elsewhere(fd, fcntl.LOCK_EX)

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        fd = self._open_lock()
        assert fd is not None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as exc:
                raise MirrorBusyError(
                    f"another llmgw process is importing into {self.root}; run gc again when it has finished"
                ) from exc
            yield
        finally:
            os.close(fd)

    def _sweep_temp(self, *, dry_run: bool, fetches: bool = False) -> list[tuple[Path, int]]:
        """Remove the temporary files of interrupted imports; with ``fetches``, partial fetches too.

        (An import sweeps only its own kind: a partial fetch is kept to be resumed; ``gc`` removes both.)
        A dry run leaves out the files of an import or a fetch still running (a live ``<pid>-`` prefix,
        a partial fetch under its writer's ``flock``): ``gc`` runs only when none is, and would not
        find them.
        """
        found = []
        try:
            names = os.listdir(self.tmp_dir)
        except FileNotFoundError:
            return []
        for name in names:
            if not (_TEMP.fullmatch(name) or (fetches and _FETCH_TEMP.fullmatch(name))):
                continue  # not ours: never delete what we did not create
            path = self.tmp_dir / name
            try:
                size = os.lstat(path).st_size
                if dry_run:
                    if self._in_progress(name, path):
                        continue
                else:
                    os.unlink(path)
            except FileNotFoundError:
                continue
            found.append((path, size))
        if found and not dry_run:
            log.debug("removed %d temporary file(s) left by interrupted imports", len(found))
        return found

    @staticmethod
    def _in_progress(name: str, path: Path) -> bool:
        if _TEMP.fullmatch(name):
            return _pid_alive(int(name.partition("-")[0]))
        try:
            fd = os.open(path, os.O_RDONLY | _O_CLOEXEC | _O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
        except OSError:
            return False
        return _locked_elsewhere(fd, fcntl.LOCK_SH)

    # -- adding blobs ---------------------------------------------------------

    def add_blob(
        self,
        source: str | os.PathLike[str],
        *,
        expected_digest: str | None = None,
        progress: Progress | None = None,
        label: str | None = None,
    ) -> BlobResult:
        """Copy a file into the store (see the module docstring for how).

        Call it inside :meth:`importing`. Symbolic links in ``source`` are followed.

        Args:
            source: the file to copy.
            expected_digest: ``sha256:<hex>`` the bytes must hash to.
            progress: where to report progress.
            label: how progress and messages name the file.

        Returns:
            The stored blob.

        Raises:
            SourceError: ``source`` is not a regular file.
            SourceChangedError: it changed while being copied.
            DigestMismatchError: its bytes do not hash to ``expected_digest``.
            NoSpaceError: the mirror's disk is full.
            OSError: reading or writing failed otherwise.
        """
        fd = os.open(source, os.O_RDONLY | _O_CLOEXEC)
        try:
            return self.add_blob_fd(
                fd, expected_digest=expected_digest, progress=progress, label=label or os.fspath(source)
            )
        finally:
            os.close(fd)

    def add_blob_fd(
        self,
        src_fd: int,
        *,
        expected_digest: str | None = None,
        progress: Progress | None = None,
        label: str = "file",
    ) -> BlobResult:
        """Copy the file open at ``src_fd`` into the store. See :meth:`add_blob`."""
        progress = progress or NullProgress()
        st0 = os.fstat(src_fd)
        if not stat.S_ISREG(st0.st_mode):
            raise SourceError(f"{label} is not a regular file")
        size = st0.st_size
        if expected_digest is not None:
            if not is_digest(expected_digest):
                raise ValueError(f"not a sha256 digest: {expected_digest!r}")
            # Already stored? Re-hashing our copy is cheaper than copying again.
            final = self.blob_path(expected_digest)
            if self._existing_is_good(final, expected_digest, size, progress, label):
                return BlobResult(expected_digest, size, final, reused=True)

        free = _free_bytes(self.tmp_dir)
        if free < size + _SPACE_MARGIN:
            raise NoSpaceError(
                f"not enough space in {self.root} for {label}: it needs {_human(size + _SPACE_MARGIN)}"
                f" ({_human(size)}, and {_human(_SPACE_MARGIN)} kept free) and {_human(free)} is free; free some space (llmgw mirror gc removes unused blobs) or use"
                " another mirror root (--root)",
            )
        tmp_path, dst_fd = self._create_temp()
        try:
            try:
                digest = self._copy_into(src_fd, dst_fd, st0, size, expected_digest, progress, label)
            finally:
                os.close(dst_fd)
            placed = self._place(tmp_path, digest, size, progress, label)
        except OSError as exc:
            if isinstance(exc, (NoSpaceError, FileTooLargeError)):
                raise
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise NoSpaceError(
                    f"the disk holding {self.root} filled up while copying {label}; nothing was recorded."
                    " Free some space (llmgw mirror gc removes unused blobs) and run the import again",
                ) from exc
            if exc.errno == errno.EFBIG:
                raise FileTooLargeError(_file_too_large(self.root, label, size)) from exc
            raise
        finally:
            _unlink_quiet(tmp_path)
        return BlobResult(
            digest, size, self.blob_path(digest), reused=placed == "reused", replaced=placed == "replaced"
        )

    # -- blobs fetched from elsewhere (llmgw.mirror.fetch) ---------------------

    def has_blob(self, digest: str, size: int, progress: Progress | None = None) -> bool:
        """Return whether the store holds blob ``digest`` of ``size`` bytes, intact (it is re-hashed)."""
        return self._existing_is_good(self.blob_path(digest), digest, size, progress or NullProgress(), digest)

    def fetch_partial_path(self, digest: str) -> Path:
        """Where a fetch of blob ``digest`` keeps its bytes until they are verified (one name per
        blob, so an interrupted fetch resumes from what it had)."""
        if not is_digest(digest):
            raise ValueError(f"not a sha256 digest: {digest!r}")
        return self.tmp_dir / f"fetch-{digest[7:]}.partial"

    def open_fetch_partial(self, digest: str) -> tuple[Path, int]:
        """Open (creating it if needed) the partial file of a fetch of ``digest``, for reading and
        appending; the caller holds an ``flock`` on it while writing."""
        path = self.fetch_partial_path(digest)
        # SECURITY: O_NOFOLLOW: never write through a link planted under that name.
        flags = os.O_RDWR | os.O_CREAT | _O_NOFOLLOW | _O_CLOEXEC
        fd = os.open(path, flags, 0o600)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise SourceError(f"{path} is not a regular file; remove it")
        except BaseException:
            os.close(fd)
            raise
        return path, fd

    def place_fetched(self, partial: Path, fd: int, digest: str, size: int) -> Path:
        """Make a fetched file whose bytes were verified to hash to ``digest`` the blob ``digest``.

        It is made read-only and fsync'd, then hard-linked into place as an import's
        copy is (see the module docstring); the partial file is removed.
        Call it inside :meth:`importing`.

        Returns:
            The blob's path.
        """
        os.fchmod(fd, 0o444)
        os.fsync(fd)
        try:
            placed = self._place(partial, digest, size, NullProgress(), digest)
        finally:
            _unlink_quiet(partial)
        if placed == "replaced":
            log.warning("blob %s in %s was corrupt; replaced it with the verified copy fetched", digest, self.root)
        return self.blob_path(digest)

    def _create_temp(self) -> tuple[Path, int]:
        # SECURITY: O_EXCL|O_NOFOLLOW: never open an existing file or follow a link
        # planted under our temporary name.
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC
        for _ in range(100):
            path = self.tmp_dir / f"{os.getpid()}-{secrets.token_hex(8)}.partial"
            try:
                return path, os.open(path, flags, 0o600)
            except FileExistsError:
                # Someone else's file (or a planted link) under that name: leave it, pick another.
                continue
        raise SourceError(
            f"cannot create a temporary file in {self.tmp_dir}; is something filling it with names?"
        )

    def _copy_into(
        self,
        src_fd: int,
        dst_fd: int,
        st0: os.stat_result,
        size: int,
        expected_digest: str | None,
        progress: Progress,
        label: str,
    ) -> str:
        """Copy, hash, check and fsync; return the digest."""
        if size and hasattr(os, "posix_fallocate"):
            try:
                os.posix_fallocate(dst_fd, 0, size)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                    raise
                # EINVAL/EOPNOTSUPP: the file system cannot reserve space; copy anyway.
        _advise_sequential(src_fd)
        progress.start(label, size)
        try:
            hexdigest, copied = _copy_and_hash(src_fd, dst_fd, size, progress)
        finally:
            progress.finish()
        st1 = os.fstat(src_fd)
        if copied != size or st1.st_size != size or st1.st_mtime_ns != st0.st_mtime_ns:
            raise SourceChangedError(
                f"{label} changed while it was copied ({size} bytes before, {copied} read, {st1.st_size} after);"
                " nothing was recorded. Run the import again once nothing is writing to it"
            )
        digest = "sha256:" + hexdigest
        if expected_digest is not None and digest != expected_digest:
            raise DigestMismatchError(
                f"{label} is corrupt: its bytes hash to {digest}, not {expected_digest}; nothing was recorded."
                " Fetch the file again (for Ollama: ollama pull the model) and retry"
            )
        os.fchmod(dst_fd, 0o444)
        os.fsync(dst_fd)
        return digest

    def _place(self, tmp_path: Path, digest: str, size: int, progress: Progress, label: str) -> str:
        """Give the finished temporary file its blob name.

        Returns:
            ``"new"``, ``"reused"`` (an intact blob was there) or ``"replaced"`` (a corrupt one
            was, or something else that is not a directory: a link, a file of another size).

        Raises:
            StoreLayoutError: a directory is at the blob's path (never removed: llmgw did not make it).
        """
        final = self.blob_path(digest)
        self._ensure_dir(final.parent)
        placed = "new"
        try:
            # link, not rename: it fails instead of replacing a blob that exists.
            os.link(tmp_path, final)
        except FileExistsError:
            if self._existing_is_good(final, digest, size, progress, label):
                placed = "reused"
            else:
                self._replace(tmp_path, final)
                # (debug: the caller tells the user, in the words of its own output)
                log.debug("blob %s was corrupt; replaced it with the verified copy of %s", digest, label)
                placed = "replaced"
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.ENOSYS):
                raise
            # A file system without hard links: rename. Whatever it replaces has
            # the same digest, so nothing of value can be lost.
            self._replace(tmp_path, final)
        _fsync_dir(final.parent)
        return placed

    @staticmethod
    def _replace(tmp_path: Path, final: Path) -> None:
        try:
            os.replace(tmp_path, final)
        except IsADirectoryError as exc:  # (rename(2) names neither path in its error: say which one is wrong)
            raise StoreLayoutError(
                f"{final} is a directory where the mirror keeps a blob; llmgw did not make it and does not"
                " remove it. Move it out of the mirror and run the command again"
            ) from exc

    def _existing_is_good(self, final: Path, digest: str, size: int, progress: Progress, label: str) -> bool:
        """Return whether a blob exists at ``final`` with the right size and digest."""
        try:
            st = os.lstat(final)
        except FileNotFoundError:
            return False
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            return False
        progress.start(f"verifying stored copy of {label}", size)
        try:
            actual, _ = hash_file(final, progress)
        finally:
            progress.finish()
        return actual == digest

    # -- models ---------------------------------------------------------------

    def record_model(
        self,
        name: str,
        tag: str,
        files: Sequence[FileEntry],
        *,
        source_kind: str,
        source: str,
        info: dict[str, Any] | None = None,
        replace: bool = False,
    ) -> tuple[ModelRecord, bool]:
        """Record a model whose blobs are all in place, in one transaction.

        Args:
            replace: replace a ``name:tag`` recorded with other files (see :meth:`Catalogue.add`).

        Returns:
            The record and whether it was created (``False``: it was already there, identical).

        Raises:
            ModelExistsError: ``name:tag`` exists with different files (and not ``replace``).
            SourceError: a blob is not in the store (a bug in the caller).
            CatalogueAccessError, NoSpaceError, CatalogueError: the catalogue could not be written.
        """
        for f in files:
            path = self.blob_path(f.digest)
            try:
                st = os.stat(path)
            except FileNotFoundError as exc:
                raise SourceError(f"blob {f.digest} is not in the store; import it first") from exc
            if st.st_size != f.size:
                raise SourceError(f"blob {f.digest} in the store has {st.st_size} bytes, not {f.size}")
        return self.catalogue.add(
            name, tag, files, source_kind=source_kind, source=source, info=info or {}, replace=replace
        )

    def get_model(self, name: str, tag: str) -> ModelRecord:
        """Return the model ``name:tag``.

        Raises:
            ModelNotFoundError: there is none.
        """
        record = self.catalogue.get(name, tag)
        if record is None:
            raise ModelNotFoundError(
                f"no model {name}:{tag} in the mirror; see the names with llmgw mirror ls"
            )
        return record

    def list_models(self) -> list[ModelRecord]:
        """Return every model, sorted by name and tag."""
        return self.catalogue.models()

    def remove_model(self, name: str, tag: str) -> ModelRecord:
        """Remove a model from the catalogue; its blobs stay until :meth:`gc`.

        Raises:
            ModelNotFoundError: there is none.
        """
        return self.catalogue.remove(name, tag)

    def unused_bytes(self) -> int:
        """Return the bytes of blobs on disk that no model uses (what ``gc`` would free)."""
        used = self.catalogue.referenced_digests()
        return sum(size for digest, size, _ in self._blobs_on_disk() if digest not in used)

    # -- verify and gc --------------------------------------------------------

    def verify(
        self,
        models: Sequence[ModelRecord] | None = None,
        progress: Progress | None = None,
        *,
        record: bool = True,
        quarantine: bool = False,
        only: Collection[str] | None = None,
    ) -> list[BlobCheck]:
        """Re-hash the blobs of ``models`` (all models by default).

        Args:
            models: the models whose blobs to check (default: every model's).
            progress: where to report progress.
            record: record the intact ones as verified now (see :meth:`record_verified`);
                ``False`` leaves that to the caller, who can show the results first.
            quarantine: move each corrupt blob to ``quarantine/`` (:meth:`quarantine_path`): a
                blob whose size is right but whose bytes are not is otherwise still served to nodes
                and deployed (a size is all a deployment checks); a missing one is refused, and the
                import that brought it in puts a verified copy back. Best effort: a mirror that
                cannot be written keeps it (its check's ``quarantined`` stays ``None``).
            only: check only these digests (of ``models``' blobs).

        Returns:
            One :class:`BlobCheck` per distinct blob, in digest order.

        Raises:
            CatalogueAccessError: (with ``record``) the catalogue is read-only here.
        """
        progress = progress or NullProgress()
        users = self.catalogue.blob_users()
        if models is None:
            sizes = self.catalogue.blob_sizes()
        else:
            sizes = {f.digest: f.size for m in models for f in m.files}
        if only is not None:
            sizes = {d: n for d, n in sizes.items() if d in only}
        checks: list[BlobCheck] = []
        with self._reading():  # keeps gc out while we read
            for digest in sorted(sizes):
                size = sizes[digest]
                path = self.blob_path(digest)
                who = tuple(users.get(digest, ()))
                try:
                    st = os.lstat(path)
                except FileNotFoundError:
                    # (a check found it corrupt before and set it aside: said, not a mere "missing")
                    aside = self.quarantine_path(digest)
                    checks.append(BlobCheck(digest, size, path, "quarantined" if aside.exists() else "missing",
                                            models=who, quarantined=aside if aside.exists() else None))
                    continue
                if not stat.S_ISREG(st.st_mode):
                    checks.append(BlobCheck(digest, size, path, "not-a-file", models=who))
                    continue
                if st.st_size != size:
                    checks.append(BlobCheck(digest, size, path, "wrong-size", models=who))
                    continue
                progress.start(f"verifying {digest[7:19]}", size)
                try:
                    actual, _ = hash_file(path, progress)
                finally:
                    progress.finish()
                status = "ok" if actual == digest else "corrupt"
                moved = self._quarantine(path, digest, st) if quarantine and status == "corrupt" else None
                checks.append(BlobCheck(digest, size, path, status, None if status == "ok" else actual, who, moved))
        for c in checks:
            if not c.ok:
                # debug, not warning: the caller reports bad blobs to the user itself.
                log.debug("blob %s is %s (used by %s)", c.digest, c.status, ", ".join(c.models) or "no model")
        if record:
            self.record_verified(checks)
        return checks

    def quarantine_path(self, digest: str) -> Path:
        """Where :meth:`verify` moves the blob ``digest`` when it finds it corrupt."""
        self.blob_path(digest)  # (validates it)
        return self.quarantine_dir / digest[7:]

    def _quarantine(self, path: Path, digest: str, hashed: os.stat_result) -> Path | None:
        """Move the corrupt blob at ``path`` to :meth:`quarantine_path` (or beside it, named by the time, when a
        copy set aside before is there: never over it); ``None`` when it stays."""
        dest = self.quarantine_path(digest)
        if dest.exists():
            dest = dest.with_name(f"{dest.name}.{time.time_ns()}")
        try:
            self._ensure_dir(self.quarantine_dir)
            # Aside first, then checked: an import may have put a verified copy in its place since it was
            # hashed; that one goes back (a link: never over a copy placed meanwhile again).
            aside = self.quarantine_dir / f".{digest[7:]}.{os.getpid()}.{secrets.token_hex(4)}"
            os.rename(path, aside)
            moved = os.lstat(aside)
            if (moved.st_dev, moved.st_ino) != (hashed.st_dev, hashed.st_ino):
                with contextlib.suppress(FileExistsError):
                    os.link(aside, path)
                os.unlink(aside)
                return None
            os.replace(aside, dest)
            _fsync_dir(path.parent)
            _fsync_dir(self.quarantine_dir)
        except (OSError, MirrorError) as exc:
            log.warning("blob %s is corrupt but could not be moved to %s: %s", digest, dest, exc)
            return None
        log.warning("blob %s is corrupt: moved to %s", digest, dest)
        return dest

    def record_verified(self, checks: Sequence[BlobCheck]) -> None:
        """Record the intact blobs of ``checks`` as verified now.

        Raises:
            CatalogueAccessError, NoSpaceError, MirrorBusyError, CatalogueError: it could not be written.
        """
        good = [c.digest for c in checks if c.ok]
        if good:
            self.catalogue.mark_verified(good)

    def _blobs_on_disk(self) -> Iterator[tuple[str, int, Path]]:
        try:
            shards = sorted(os.listdir(self.blobs_dir))
        except FileNotFoundError:
            return
        for shard in shards:
            if len(shard) != 2:
                continue
            shard_dir = self.blobs_dir / shard
            try:
                names = sorted(os.listdir(shard_dir))
            except (NotADirectoryError, FileNotFoundError):
                continue
            for name in names:
                if not _HEX64.fullmatch(name) or name[:2] != shard:
                    continue  # not a blob of ours: leave it alone
                path = shard_dir / name
                try:
                    st = os.lstat(path)
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    yield "sha256:" + name, st.st_size, path

    def gc(self, *, dry_run: bool = False) -> GcReport:
        """Remove blobs no model uses and temporary files of interrupted imports.

        Args:
            dry_run: only report what would be removed.

        Returns:
            What was (or would be) removed.

        Raises:
            MirrorBusyError: an import is running (not raised with ``dry_run``: see ``busy``).
            CatalogueAccessError: the catalogue is read-only here (checked before anything is removed).
        """
        report = GcReport(dry_run=dry_run)
        if dry_run:
            report.busy = self._held_by_another()
            used = self.catalogue.referenced_digests()
            report.blobs = [b for b in self._blobs_on_disk() if b[0] not in used]
            report.temp_files = self._sweep_temp(dry_run=True, fetches=True)
            return report
        # Before anything is deleted: a catalogue this user cannot write would fail only after
        # the blobs were gone. (A full disk passes: the files go first, then the rows.)
        self.catalogue.check_writable("nothing was removed")
        with self._exclusive():
            used = self.catalogue.referenced_digests()
            report.blobs = [b for b in self._blobs_on_disk() if b[0] not in used]
            for _, _, path in report.blobs:
                _unlink_quiet(path)
            for parent in {p.parent for _, _, p in report.blobs}:
                _fsync_dir(parent)
                try:
                    os.rmdir(parent)  # only succeeds when empty
                except OSError:
                    pass
            report.temp_files = self._sweep_temp(dry_run=False, fetches=True)
            # Last: the rows of blobs no model uses are bookkeeping only (nothing reads them), so
            # if this fails the next gc forgets them; the blobs removed above are lost to nobody.
            self.catalogue.forget_unused_blobs()
        return report
