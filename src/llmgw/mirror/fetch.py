"""The node agent's mirror client: brings a replica's model blobs from the control plane's mirror.

:class:`MirrorFetcher` implements :class:`llmgw.launch.spec.ModelFetcher`. For each
blob a replica needs (``ReplicaSpec.blobs``):

1. if the node's own mirror store has it, intact (re-hashed once per process and
   then remembered by inode, size and mtime), it is used as it is;
2. otherwise it is fetched over HTTP from ``GET {base_url}/mirror/v1/blobs/<digest>``
   with the node's credential, into ``tmp/fetch-<hex>.partial`` of the node's store
   (:meth:`MirrorStore.open_fetch_partial`). The SHA-256 is computed while the bytes
   are written (a second thread hashes the buffer just received while the next one
   is read). After an interruption the next attempt asks for
   ``Range: bytes=<what the partial file holds>-`` and hashes the part it already
   had first;
3. only when the digest matches is the file made a blob of the store
   (:meth:`MirrorStore.place_fetched`: read-only, fsync'd, hard-linked into place);
   a corrupt transfer is refused and its partial file removed, and the fetch is
   tried again with exponential backoff, a bounded number of times, then fails
   with a :class:`~llmgw.mirror.errors.FetchError` that says why. A blob the
   disk cannot hold is refused before its first byte is written
   (:class:`NoSpaceError`); a write that fails (the disk full, an I/O error) is
   not retried, and its partial file is removed;
4. the model is recorded in the node's catalogue (so ``llmgw mirror ls`` shows it
   and ``llmgw mirror gc`` keeps its blobs).

Concurrent :meth:`MirrorFetcher.ensure` calls for the same blob share one download;
each caller hears the progress of all its blobs. A 401, 403 or 404 is not retried
(the credential, the placement or the mirror is wrong: a retry cannot help).

The transfers run in threads (blocking sockets, ``readinto`` a ring of page-aligned
buffers kept from one transfer to the next, ``pwrite``): the event loop only hears
progress, a few times a second.

PERF: a blob of at least ``direct_min`` bytes (64 MiB by default) is written with
``O_DIRECT`` where the file system takes it (Linux): from the transfer buffer straight to
the disk, not copied into the page cache, so the client's CPU per GiB is the socket's
copy and the hash, no longer the page cache's allocation and copy and its writeback
(measured in docs/mirror.md). The piece before the first 4 KiB boundary (a resumed
transfer) and the blob's last partial block are written through the page cache; a file
system that refuses ``O_DIRECT`` (``EINVAL``) gets the rest through the page cache too.
``direct_io=False`` or ``LLMGW_FETCH_DIRECT_IO=0`` turns it off. The cost: the engine
that loads the blob next reads it from the disk instead of from memory.
SECURITY: the credential goes in the ``Authorization`` header only, never in a
message or a log line.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import hashlib
import http.client
import mmap
import os
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from .. import __version__
from ..log import mirror_logger as log
from .errors import CORRUPT_TRANSFER, FetchError, MirrorError, ModelExistsError, NoSpaceError
from .store import COPY_CHUNK, MirrorStore, _human, _start_writeback, is_digest

if TYPE_CHECKING:
    from ..launch.spec import LocalModel, ModelBlob, ReplicaSpec

__all__ = ["MirrorFetcher"]

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")
# Progress goes to the loop at most this often (and at the end of each blob).
_PROGRESS_EVERY_S = 0.2
# PERF: buffers in flight between the socket reader and the hash (and O_DIRECT write)
# thread: one being hashed, one being written, one being filled, one spare so none waits
# on another's jitter. With O_DIRECT, 4 gave a higher rate than 3 in each of four pairs of
# runs (1182-1344 against 1033-1243 MiB/s on a quiet machine; docs/mirror.md); 6 no more.
_BUFFERS = 4
_WRITEBACK_EVERY = 32 << 20
# PERF: a ring of buffers is kept for the next transfer (at most this many rings):
# allocating 3 x 4 MiB costs 8-20 ms on the benchmark VM (every page faulted in and
# zeroed), 2-6% of a 384 MiB transfer, paid again by every blob.
_KEEP_RINGS = 1
_rings: list[list[memoryview]] = []
_rings_lock = threading.Lock()
# Keep this much free beyond the blob (the catalogue and the file system need room too).
_SPACE_MARGIN = 16 << 20
_O_DIRECT = getattr(os, "O_DIRECT", 0)
# O_DIRECT writes start at a multiple of this and are a multiple of it long (the largest
# logical block size of common disks; buffers are page-aligned, from mmap).
_DIRECT_ALIGN = 4096
# PERF: blobs at least this big are written with O_DIRECT (see the module docstring): a
# smaller one (a projector, a tiny model) saves little CPU and is better left in the page
# cache for the engine that reads it next.
DIRECT_MIN = 64 << 20
_FALSE = ("0", "false", "no", "off")


def direct_io_default() -> bool:
    """Whether fetches write big blobs with ``O_DIRECT``: where the platform has it, unless
    ``LLMGW_FETCH_DIRECT_IO`` is ``0`` (or ``false``, ``no``, ``off``)."""
    return bool(_O_DIRECT) and os.environ.get("LLMGW_FETCH_DIRECT_IO", "1").strip().lower() not in _FALSE


class _Fatal(Exception):
    """A refusal a retry cannot change (401, 403, 404, a malformed answer)."""


class _Retry(Exception):
    """A failure the next attempt may not meet (a cut connection, a 5xx, a corrupt transfer)."""


class _Busy(Exception):
    """The mirror is sending as many blobs as it may (503 ``mirror_busy``): no attempt failed; ask again
    after ``after`` seconds."""

    def __init__(self, message: str, after: float) -> None:
        super().__init__(message)
        self.after = after


BUSY_WAIT_S = 3600.0
"""How long a fetch waits, in all, for a mirror that answers it is busy (its transfers under way take
as long as their blobs do) before it fails."""


@dataclass(eq=False)
class _Job:
    """One blob being fetched, shared by every ensure() that needs it."""

    blob: ModelBlob
    done: int = 0  # (the transfer thread's count)
    told: int = 0  # (the last count delivered to the listeners, on the event loop)
    listeners: list[Callable[[int], None]] = field(default_factory=list)
    task: asyncio.Task[Path] | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    conn: Any = None  # the HTTP connection in use (closed by MirrorFetcher.close to unblock a read)

    def notify(self, done: int) -> None:
        """Deliver a count the transfer thread had at the time it sent it: listeners hear the counts
        in the order they were true (the first chunk, then nothing kept after a discard), never a
        later value read in place of one they missed."""
        self.told = done
        for listener in list(self.listeners):
            listener(done)


class MirrorFetcher:
    """Fetches replicas' blobs from the control plane's mirror into this node's store.

    Args:
        base_url: the control plane's admin listener, ``http://host:port`` (or
            ``https://``); the path ``/mirror/v1/blobs/...`` is added to it.
        credential: this node's mirror credential (from the RegisterResponse);
            :meth:`set_access` when a new registration brings a new one.
        store_root: the node's own mirror root (created if missing).
        attempts: tries per blob before giving up (each after a corrupt or cut transfer).
        backoff: seconds before the second try; doubled each time, up to ``max_backoff``.
        timeout: seconds a connection may stay silent.
        chunk: bytes per socket read.
        ssl_context: for ``https://`` (default: the system's trust store, verified).
        direct_io: write blobs of at least ``direct_min`` bytes with ``O_DIRECT`` where the
            file system takes it (default: :func:`direct_io_default`, on where the platform
            has it unless ``LLMGW_FETCH_DIRECT_IO=0``).
        direct_min: the smallest blob written with ``O_DIRECT``.
    """

    def __init__(
        self,
        base_url: str,
        credential: str,
        store_root: str | os.PathLike[str],
        *,
        attempts: int = 5,
        backoff: float = 0.5,
        max_backoff: float = 15.0,
        timeout: float = 30.0,
        chunk: int = COPY_CHUNK,
        ssl_context: ssl.SSLContext | None = None,
        direct_io: bool | None = None,
        direct_min: int = DIRECT_MIN,
    ) -> None:
        if attempts < 1:
            raise ValueError("attempts must be at least 1")
        self.direct_io = direct_io_default() if direct_io is None else bool(direct_io and _O_DIRECT)
        self.direct_min = direct_min
        self.set_access(base_url, credential)
        self.store = MirrorStore(store_root)
        self.attempts = attempts
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.timeout = timeout
        self.chunk = chunk
        self._ssl = ssl_context
        self._jobs: dict[str, _Job] = {}
        """Digest -> the job new ensure() calls join."""
        self._running: set[_Job] = set()
        """Every job whose task has not finished (abandoned ones included)."""
        self._verified: dict[str, tuple[int, int, int, int]] = {}
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="llmgw-fetch")
        self._closed = False
        self.downloads = 0
        """Transfers started (a resumed one counts again): for tests and logs."""
        self.direct_bytes = 0
        """Bytes written with ``O_DIRECT`` (the rest went through the page cache): for tests and logs."""

    def set_access(self, base_url: str, credential: str) -> None:
        """Use ``base_url`` and ``credential`` from now on (a new registration brings new ones);
        transfers under way finish with the old ones.

        Raises:
            ValueError: ``base_url`` is not ``http(s)://HOST[:PORT][/PATH]``.
        """
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"the mirror URL must be http://HOST:PORT or https://HOST:PORT, got {base_url[:200]!r}")
        self.base_url = base_url.rstrip("/")
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._https else 80)
        self._prefix = parts.path.rstrip("/")
        self.credential = credential

    def __repr__(self) -> str:
        return f"MirrorFetcher({self.base_url!r}, store={str(self.store.root)!r})"

    def _abandon(self, job: _Job) -> None:
        """Stop ``job``'s transfer; a new ensure() of the blob starts a new job."""
        if self._jobs.get(job.blob.digest) is job:
            del self._jobs[job.blob.digest]
        job.cancelled.set()
        conn = job.conn
        sock = conn.sock if conn is not None else None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # unblocks a read in the transfer thread
            except OSError:
                pass
        if job.task is not None:
            job.task.cancel()  # (a wait between attempts ends now; a transfer thread sees the flag)

    async def close(self) -> None:
        """Stop every transfer (their ensure() calls fail) and release the store."""
        self._closed = True
        jobs = list(self._running)
        for job in jobs:
            self._abandon(job)
        tasks = [j.task for j in jobs if j.task is not None and not j.task.done()]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        # (off the loop: a transfer thread may take up to a read's timeout to see its flag)
        await asyncio.get_running_loop().run_in_executor(None, self._pool.shutdown, True)
        self.store.close()

    # -- ModelFetcher --

    async def ensure(self, spec: ReplicaSpec, progress: Callable[[int, int], None]) -> LocalModel:
        """Return the local files of ``spec.blobs``, fetching what the node lacks.

        ``progress(done, total)`` is called on the event loop as bytes arrive (and
        once at the start with what the node already had).

        Raises:
            FetchError: a blob cannot be fetched or keeps failing its digest (the message says why).
            MirrorError: the spec names no model blob.
        """
        from ..launch.spec import LocalModel

        if self._closed:
            raise FetchError("the mirror fetcher is closed")
        blobs = _unique(spec.blobs)
        main = next((b for b in blobs if b.role == "model"), None)
        if main is None:
            raise MirrorError(
                f"replica {spec.id}: model {spec.model!r} lists no blob with the role 'model' to fetch"
            )
        for b in blobs:
            if not is_digest(b.digest):
                raise MirrorError(f"replica {spec.id}: {b.digest[:80]!r} is not a sha256 digest")
        total = sum(b.size for b in blobs)
        done = dict.fromkeys((b.digest for b in blobs), 0)
        last = [-1]

        def report() -> None:
            now = sum(done.values())
            if now == last[0]:
                return
            last[0] = now
            try:
                progress(now, total)
            except Exception:  # a caller's bug must not stop the fetch
                log.exception("progress callback failed")

        def listener(digest: str) -> Callable[[int], None]:
            def heard(n: int) -> None:
                done[digest] = n
                report()

            return heard

        jobs: list[tuple[_Job, Callable[[int], None]]] = []
        tasks: list[asyncio.Task[Path]] = []
        for b in blobs:
            job = self._job(b)
            heard = listener(b.digest)
            job.listeners.append(heard)
            heard(job.told)
            jobs.append((job, heard))
            assert job.task is not None
            tasks.append(job.task)
        paths: dict[str, Path] = {}
        try:
            # shield: one caller giving up must not stop a download others wait for
            results = await asyncio.gather(*(asyncio.shield(t) for t in tasks))
            for (job, heard), path in zip(jobs, results, strict=True):
                heard(job.blob.size)
                paths[job.blob.digest] = path
        finally:
            for job, heard in jobs:
                if heard in job.listeners:
                    job.listeners.remove(heard)
                if not job.listeners and job.task is not None and not job.task.done():
                    # nobody waits for it any more (the replica was stopped): stop the transfer;
                    # its partial file stays, and a later ensure() resumes from it
                    self._abandon(job)
        await self._record(spec, blobs)
        projector = next((b for b in blobs if b.role == "projector"), None)
        return LocalModel(
            path=str(paths[main.digest]),
            projector=str(paths[projector.digest]) if projector is not None else None,
        )

    # -- one blob --

    def _job(self, blob: ModelBlob) -> _Job:
        job = self._jobs.get(blob.digest)
        if job is not None:
            return job
        job = _Job(blob)
        self._jobs[blob.digest] = job
        self._running.add(job)
        job.task = asyncio.get_running_loop().create_task(self._fetch(job), name=f"llmgw-fetch-{blob.digest[7:19]}")

        def forget(task: asyncio.Task[Path]) -> None:
            if self._jobs.get(blob.digest) is job:
                del self._jobs[blob.digest]
            self._running.discard(job)
            if not task.cancelled():
                task.exception()  # (retrieved here: every waiter may have given up)

        job.task.add_done_callback(forget)
        return job

    def _known_good(self, digest: str, size: int) -> bool:
        """Whether the blob is where it was when this process last verified it."""
        key = self._verified.get(digest)
        if key is None:
            return False
        try:
            st = os.stat(self.store.blob_path(digest))
        except OSError:
            return False
        return key == (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) and st.st_size == size

    def _remember(self, digest: str) -> None:
        try:
            st = os.stat(self.store.blob_path(digest))
        except OSError:
            return
        self._verified[digest] = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    async def _fetch(self, job: _Job) -> Path:
        blob = job.blob
        loop = asyncio.get_running_loop()
        path = self.store.blob_path(blob.digest)
        if self._known_good(blob.digest, blob.size) or await loop.run_in_executor(
            self._pool, self.store.has_blob, blob.digest, blob.size
        ):
            self._remember(blob.digest)
            job.done = blob.size
            return path
        last: Exception | None = None
        attempt = 0
        busy_until = time.monotonic() + BUSY_WAIT_S
        busy: _Busy | None = None
        while attempt < self.attempts:
            if busy is not None:  # (not an attempt: the mirror asked to be asked again later)
                if time.monotonic() + busy.after > busy_until:
                    raise FetchError(
                        f"cannot fetch {blob.digest} from {self.base_url}: the mirror stayed busy for"
                        f" {BUSY_WAIT_S:.0f}s ({busy})"
                    )
                log.info("fetching %s: %s; asking again in %.0fs", blob.digest, busy, busy.after)
                await asyncio.sleep(busy.after)
                busy = None
            elif attempt:
                delay = min(self.backoff * 2 ** (attempt - 1), self.max_backoff)
                log.warning(
                    "fetching %s: %s; trying again in %.1fs (attempt %d of %d)",
                    blob.digest, last, delay, attempt + 1, self.attempts,
                )
                await asyncio.sleep(delay)
            if job.cancelled.is_set():
                raise FetchError(f"fetching {blob.digest} was stopped (the agent is shutting down)")
            try:
                await loop.run_in_executor(self._pool, self._transfer, job, loop)
            except _Fatal as exc:
                raise FetchError(f"cannot fetch {blob.digest} from {self.base_url}: {exc}") from None
            except _Busy as exc:
                busy = exc
                continue
            except _Retry as exc:
                last = exc
                attempt += 1
                continue
            except NoSpaceError:
                raise
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise NoSpaceError(
                        f"the disk holding {self.store.root} filled up while fetching {blob.digest}"
                        f" ({blob.size} bytes); free some space (llmgw mirror gc removes unused blobs)"
                    ) from exc
                raise FetchError(
                    f"cannot write {blob.digest} ({blob.size} bytes) into the node's mirror at"
                    f" {self.store.root}: {exc.strerror or exc}"
                ) from exc
            self._remember(blob.digest)
            job.done = blob.size
            return path
        raise FetchError(
            f"could not fetch {blob.digest} ({blob.size} bytes) from {self.base_url} in {self.attempts}"
            f" attempts; the last failure: {last}"
        )

    # -- the transfer (in a thread) --

    def _transfer(self, job: _Job, loop: asyncio.AbstractEventLoop) -> None:
        """One attempt: resume or start the partial file, fetch the rest, verify, place."""
        blob = job.blob
        store = self.store
        with store.importing():  # gc stays out while the partial file and the new blob are ours
            partial, fd = store.open_fetch_partial(blob.digest)
            try:
                # Another process fetching the same blob into this store: wait for it, then see.
                fcntl.flock(fd, fcntl.LOCK_EX)
                if store.has_blob(blob.digest, blob.size):
                    return
                have = os.fstat(fd).st_size
                if have > blob.size:
                    os.ftruncate(fd, 0)
                    have = 0
                h = hashlib.sha256()
                if have:
                    have = _hash_prefix(fd, have, h)
                job.done = have
                loop.call_soon_threadsafe(job.notify, job.done)
                if have < blob.size:
                    try:
                        h = self._get(job, fd, have, h, loop)
                    except NoSpaceError:
                        raise  # (refused before a byte was written: what the partial file holds stays good)
                    except OSError:
                        # A local failure (the disk is full, the file may not grow, an I/O error):
                        # what was written is not worth resuming from, and it holds space.
                        _discard(fd, partial)
                        job.done = 0
                        loop.call_soon_threadsafe(job.notify, job.done)
                        raise
                size = os.fstat(fd).st_size
                actual = "sha256:" + h.hexdigest()
                if size != blob.size or actual != blob.digest:
                    # SECURITY: never keep bytes that are not the blob asked for.
                    _discard(fd, partial)
                    job.done = 0
                    loop.call_soon_threadsafe(job.notify, job.done)
                    raise _Retry(
                        f"the bytes received hash to {actual} ({size} bytes), not {blob.digest} ({blob.size}"
                        f" bytes): {CORRUPT_TRANSFER} and was discarded (again and again: the control"
                        " plane's own copy may be corrupt; llmgw mirror verify there names it)"
                    )
                store.place_fetched(partial, fd, blob.digest, blob.size)
            finally:
                os.close(fd)

    def _connect(self) -> http.client.HTTPConnection:
        if self._https:
            ctx = self._ssl or ssl.create_default_context()
            return http.client.HTTPSConnection(self._host, self._port, timeout=self.timeout, context=ctx)
        return http.client.HTTPConnection(self._host, self._port, timeout=self.timeout)

    def _get(
        self, job: _Job, fd: int, have: int, h: Any, loop: asyncio.AbstractEventLoop
    ) -> Any:
        """GET the blob from ``have`` on, appending to ``fd`` and hashing; return the hash (a new one
        when the server sent the whole blob instead of the range)."""
        blob = job.blob
        headers = {
            "Authorization": f"Bearer {self.credential}",
            "User-Agent": f"llmgw-agent/{__version__}",
            "Accept-Encoding": "identity",
        }
        if have:
            headers["Range"] = f"bytes={have}-"
        conn = self._connect()
        job.conn = conn
        self.downloads += 1
        t0 = time.monotonic()
        got = 0
        direct0 = self.direct_bytes
        try:
            try:
                conn.request("GET", f"{self._prefix}/mirror/v1/blobs/{blob.digest}", headers=headers)
                resp = conn.getresponse()
            except (OSError, http.client.HTTPException) as exc:
                raise _Retry(f"cannot reach the mirror at {self.base_url} ({_why(exc)})") from None
            status = resp.status
            if status in (401, 403, 404):
                raise _Fatal(f"{status} {_error_message(resp)}")
            if status == 416:
                os.ftruncate(fd, 0)  # what we hold does not fit the blob: start again from 0
                raise _Retry(f"the mirror refused the range bytes={have}- ({_error_message(resp)})")
            if status == 200:
                if have:
                    os.ftruncate(fd, 0)
                    have = 0
                    h = hashlib.sha256()
                    job.done = 0
            elif status == 206:
                m = _CONTENT_RANGE.fullmatch(resp.getheader("content-range") or "")
                if m is None or int(m.group(1)) != have or int(m.group(3)) != blob.size:
                    raise _Retry(
                        f"the mirror answered bytes={have}- with Content-Range"
                        f" {(resp.getheader('content-range') or '')[:80]!r}"
                    )
            elif status == 503:
                message, code = _error_of(resp)
                if code != "mirror_busy":
                    raise _Retry(f"the mirror answered 503 ({message})")
                wait = (resp.getheader("retry-after") or "").strip()
                raise _Busy(f"the mirror answered 503 ({message})",
                            float(min(60, max(1, int(wait)))) if wait.isdigit() else 5.0)
            else:
                raise _Retry(f"the mirror answered {status} ({_error_message(resp)})")
            length = resp.length
            if length is None or have + length != blob.size:
                raise _Retry(
                    f"the mirror sent {length} bytes from offset {have} for a blob of {blob.size} bytes"
                )
            self._check_space(blob, fd, have, length)
            got = self._pump(job, resp, fd, length, h, have, loop)
        finally:
            job.conn = None
            conn.close()
            if got:
                took = time.monotonic() - t0
                direct = self.direct_bytes - direct0
                log.info(
                    "received %d bytes of %s from %s%s in %.2fs (%.0f MiB/s%s); its digest is checked next",
                    got, blob.digest, self.base_url, f" (resumed at {have})" if have else "",
                    took, got / max(took, 1e-6) / (1 << 20), f", {direct} bytes with O_DIRECT" if direct else "",
                )
        return h

    def _check_space(self, blob: ModelBlob, fd: int, have: int, length: int) -> None:
        """Refuse at once, before any byte comes, a blob the disk cannot hold."""
        st = os.fstatvfs(fd)
        available = st.f_bavail * st.f_frsize
        needed = length
        if available < needed + _SPACE_MARGIN:
            raise NoSpaceError(
                f"not enough space in {self.store.root} for {blob.digest} ({_human(blob.size)}"
                f"{f', resuming at {_human(have)}' if have else ''}): it needs {_human(needed + _SPACE_MARGIN)} more"
                f" ({_human(needed)}, and {_human(_SPACE_MARGIN)} kept free) and"
                f" {_human(available)} is free; free some space (llmgw mirror gc removes unused blobs)"
            )

    def _pump(
        self, job: _Job, resp: http.client.HTTPResponse, fd: int, length: int, h: Any, offset: int,
        loop: asyncio.AbstractEventLoop,
    ) -> int:
        """Copy ``length`` body bytes to ``fd`` from ``offset`` on while a second thread hashes them;
        the bytes copied.

        PERF: ``readinto`` a ring of reusable buffers (no allocation per chunk); the
        hash thread digests buffer i (hashlib drops the GIL) while this thread writes
        it and reads into the next. A buffer is refilled only after its hash has run
        and its write has returned. With ``O_DIRECT`` (:class:`_Writer`) each buffer is
        filled whole, so every write but the first of a resumed transfer and the last
        starts and ends on a block boundary, and the writes run on a third thread: an
        O_DIRECT write returns only when the disk has the bytes, and the socket is read
        meanwhile (a page-cache write is a copy, done here).
        """
        chunk = self.chunk
        views = _take_ring(chunk, length)
        hashing: list[Future[None] | None] = [None] * len(views)
        writing: list[Future[None] | None] = [None] * len(views)
        writer = _Writer(fd, self.direct_io and job.blob.size >= self.direct_min and chunk % _DIRECT_ALIGN == 0)
        threaded = writer.direct
        got = 0
        flushed = 0
        told = 0.0  # (the first chunk is reported at once)
        i = 0
        try:
            with contextlib.ExitStack() as threads:
                hasher = threads.enter_context(ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmgw-fetch-hash"))
                writes = threads.enter_context(
                    ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmgw-fetch-write")) if threaded else None
                try:
                    while got < length:
                        if job.cancelled.is_set():
                            raise _Fatal("stopped (the agent is shutting down)")
                        pending = hashing[i]
                        if pending is not None:
                            pending.result()
                        pending = writing[i]
                        if pending is not None:
                            pending.result()  # (raises what the write met: the disk full, an I/O error)
                        pos = offset + got
                        want = min(chunk, length - got)
                        if writer.direct and pos % _DIRECT_ALIGN:
                            want = min(want, _DIRECT_ALIGN - pos % _DIRECT_ALIGN)  # (up to the boundary)
                        view = views[i][:want]
                        n = _fill(resp, view, writer.direct, pos)
                        data = view[:n]
                        hashing[i] = hasher.submit(h.update, data)
                        if writes is not None:
                            writing[i] = writes.submit(writer.write, data, pos)
                        else:
                            writer.write(data, pos)
                        got += n
                        # (O_DIRECT may go off mid-transfer, EINVAL: the page cache's writes are then
                        # started as they pile up, whichever thread wrote them)
                        if not writer.direct and got - flushed >= _WRITEBACK_EVERY:
                            _start_writeback(fd, offset + flushed, got - flushed)
                            flushed = got
                        job.done = offset + got
                        now = time.monotonic()
                        if now - told >= _PROGRESS_EVERY_S:
                            told = now
                            loop.call_soon_threadsafe(job.notify, job.done)
                        i = (i + 1) % len(views)
                    for pending in writing:
                        if pending is not None:
                            pending.result()  # (the last writes' failures)
                finally:
                    # Never leave the hash or write thread reading a buffer that is going away (or
                    # that the next transfer fills).
                    futures.wait([f for f in hashing + writing if f is not None])
                    self.direct_bytes += writer.direct_bytes
                    writer.close()
                    # A write that failed leaves a hole (zeros past it) in the partial file: its error,
                    # not a read's _Retry met meanwhile, goes up, so the file is discarded rather than
                    # resumed from (a resume would hash the hole and fail the whole blob's digest).
                    failed = _write_error(writing)
                    if failed is not None:
                        raise failed
        finally:
            _give_ring(views, chunk)  # (the hash thread has ended: no buffer of the ring is in use)
        loop.call_soon_threadsafe(job.notify, job.done)
        return got

    # -- the node's catalogue --

    async def _record(self, spec: ReplicaSpec, blobs: Sequence[ModelBlob]) -> None:
        """Record the model in the node's catalogue (so ``llmgw mirror gc`` keeps its blobs); best effort."""
        try:
            await asyncio.get_running_loop().run_in_executor(self._pool, self._record_sync, spec, blobs)
        except (MirrorError, OSError, ValueError) as exc:
            log.warning("fetched %s but could not record it in %s: %s", spec.model, self.store.root, exc)

    def _record_sync(self, spec: ReplicaSpec, blobs: Sequence[ModelBlob]) -> None:
        from .catalogue import FileEntry
        from .gguf import read_gguf
        from .names import parse_ref

        name, tag = parse_ref(spec.model)
        files = []
        for b in blobs:
            path = self.store.blob_path(b.digest)
            try:
                summary: dict[str, Any] | None = read_gguf(path).summary()
            except (MirrorError, OSError):
                summary = None
            files.append(FileEntry(b.role, b.digest, b.size, None, self.base_url, summary))
        # (a connection of this thread: SQLite connections stay in the thread that opened them)
        with MirrorStore(self.store.root) as store:
            # The control plane is authoritative for what it placed here: a record an earlier
            # fetch made (source_kind mirror) of a model it has since imported again under the
            # same name is replaced, or `llmgw mirror gc` on the node would delete the blobs
            # the replica now runs on. A model imported on the node itself is never overwritten.
            existing = store.catalogue.get(name, tag)
            replace = existing is not None and existing.source_kind == "mirror"
            try:
                _, created = store.record_model(
                    name, tag, files, source_kind="mirror", source=self.base_url, replace=replace
                )
            except ModelExistsError:
                assert existing is not None
                log.warning(
                    "the node's mirror at %s has its own %s:%s (%s %s), with other files than the control"
                    " plane's; the fetched one is not recorded, so llmgw mirror gc on this node would remove"
                    " its blobs: remove the node's own (llmgw mirror rm %s:%s --root %s)",
                    store.root, name, tag, existing.source_kind, existing.source, name, tag, store.root,
                )
                return
            if replace and created:
                log.info(
                    "%s:%s in the node's mirror at %s now has the control plane's files (it was imported"
                    " there again); the old ones stay until llmgw mirror gc", name, tag, store.root,
                )


def _unique(blobs: Sequence[ModelBlob]) -> list[ModelBlob]:
    seen: dict[str, ModelBlob] = {}
    for b in blobs:
        seen.setdefault(b.digest, b)
    return list(seen.values())


def _hash_prefix(fd: int, have: int, h: Any) -> int:
    """Hash the first ``have`` bytes of ``fd`` into ``h``; the bytes hashed (less if the file is shorter)."""
    buf = memoryview(bytearray(min(COPY_CHUNK, have)))
    done = 0
    while done < have:
        n = os.preadv(fd, [buf[: min(len(buf), have - done)]], done)
        if not n:
            break
        h.update(buf[:n])
        done += n
    if done < have:
        os.ftruncate(fd, done)
    return done


def _take_ring(chunk: int, length: int) -> list[memoryview]:
    """Buffers for a transfer of ``length`` bytes in reads of ``chunk``: a kept ring of the size,
    else new ones (a blob smaller than the ring gets only what it needs). Each starts on a page
    (anonymous ``mmap``), as ``O_DIRECT`` needs."""
    with _rings_lock:
        for ring in _rings:
            if len(ring[0]) == chunk:
                _rings.remove(ring)
                return ring
    size = min(chunk, max(length, 1))
    return [memoryview(mmap.mmap(-1, size)) for _ in range(_BUFFERS if length > size else 1)]


def _fill(resp: http.client.HTTPResponse, view: memoryview, whole: bool, pos: int) -> int:
    """Read body bytes into ``view`` (all of it when ``whole``, else what one ``readinto``
    gives); the bytes read. ``pos``: the blob offset of ``view[0]``, for the messages."""
    n = 0
    while n < len(view):
        try:
            k = resp.readinto(view[n:])
        except (OSError, http.client.HTTPException) as exc:
            if n:
                return n  # (what came is written, so a retry resumes after it; the next read fails)
            raise _Retry(f"the transfer broke off after {pos} bytes ({_why(exc)})") from None
        if not k:
            if n:
                return n
            raise _Retry(f"the mirror closed the connection after {pos} bytes")
        n += k
        if not whole:
            break
    return n


class _Writer:
    """Writes a transfer's buffers at their offsets: with ``O_DIRECT`` when ``direct`` and the piece
    is block-aligned, else through the page cache. ``direct`` goes off for good when the file
    system refuses ``O_DIRECT`` (``EINVAL``)."""

    def __init__(self, fd: int, direct: bool) -> None:
        self.fd = fd
        self.direct = direct
        self.direct_bytes = 0
        self._flags = fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT
        self._on = False  # whether the fd has O_DIRECT set now

    def _set(self, on: bool) -> None:
        if on != self._on:
            fcntl.fcntl(self.fd, fcntl.F_SETFL, self._flags | _O_DIRECT if on else self._flags)
            self._on = on

    def write(self, view: memoryview, pos: int) -> None:
        if self.direct and pos % _DIRECT_ALIGN == 0:
            body = len(view) - len(view) % _DIRECT_ALIGN
            if body:
                try:
                    self._set(True)
                    _pwrite_all(self.fd, view[:body], pos)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    # The file system takes no O_DIRECT (or not these blocks): the page cache,
                    # from here on. (Writing all of `view` again from `pos` is harmless where a
                    # short write took part of it: the same bytes at the same offsets.)
                    self.direct = False
                    self._set(False)
                    _pwrite_all(self.fd, view, pos)
                    return
                self.direct_bytes += body
                view, pos = view[body:], pos + body
        if view:
            self._set(False)
            _pwrite_all(self.fd, view, pos)

    def close(self) -> None:
        """Leave the fd as it was (best effort: a failure is being reported already)."""
        try:
            self._set(False)
        except OSError:
            pass


def _write_error(writing: Sequence[Future[None] | None]) -> BaseException | None:
    """The first error of the finished write futures, ``None`` when none failed."""
    for f in writing:
        if f is not None and f.done() and not f.cancelled():
            exc = f.exception()
            if exc is not None:
                return exc
    return None


def _pwrite_all(fd: int, view: memoryview, pos: int) -> None:
    """Write all of ``view`` at ``pos`` (``pwrite`` may write less than asked; nothing written: an error,
    never a loop without end)."""
    while view:
        n = os.pwrite(fd, view, pos)
        if n <= 0:
            raise OSError(errno.EIO, f"pwrite wrote nothing at offset {pos} ({len(view)} bytes left)")
        view, pos = view[n:], pos + n


def _give_ring(ring: list[memoryview], chunk: int) -> None:
    """Keep a full-sized ring for the next transfer (up to :data:`_KEEP_RINGS`); others are freed."""
    if len(ring) != _BUFFERS or len(ring[0]) != chunk:
        return
    with _rings_lock:
        if len(_rings) < _KEEP_RINGS:
            _rings.append(ring)


def _discard(fd: int, partial: Path) -> None:
    """Empty and remove a partial file (best effort: the caller is reporting a failure already)."""
    try:
        os.ftruncate(fd, 0)
    except OSError:
        pass
    try:
        os.unlink(partial)
    except FileNotFoundError:
        pass


def _why(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text[:200]


def _error_message(resp: http.client.HTTPResponse) -> str:
    """The ``error.message`` of an OpenAI-style error body (bounded), else the reason phrase."""
    return _error_of(resp)[0]


def _error_of(resp: http.client.HTTPResponse) -> tuple[str, str | None]:
    """The ``error.message`` (bounded; else the reason phrase) and ``error.code`` of an OpenAI-style error body."""
    import orjson

    try:
        body = resp.read(64 * 1024)
        err = orjson.loads(body)["error"]
        msg, code = err.get("message"), err.get("code")
        return (msg[:500] if isinstance(msg, str) else resp.reason or "no reason given",
                code if isinstance(code, str) else None)
    except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError, AttributeError):
        return resp.reason or "no reason given", None
