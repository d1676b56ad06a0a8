"""Serving the control plane's mirror blobs to node agents, on the admin listener.

==========================================================  ==========================================
route                                                       what
==========================================================  ==========================================
``GET /mirror/v1/blobs/sha256:<64 hex>``                    the blob's bytes (``Range`` honoured: 206)
``HEAD /mirror/v1/blobs/sha256:<64 hex>``                   its headers only (size, digest)
==========================================================  ==========================================

Every request carries a node's mirror credential (``Authorization: Bearer
<credential>``, issued at registration: :mod:`llmgw.control.credentials`), never
the admin token. The answers, in the order they are decided:

* 401 ``missing_node_credential`` / ``invalid_node_credential``: no or an unknown credential;
* 404 ``not_found``: the path is not a blob digest;
* 403 ``blob_not_allowed``: the node has no replica that needs the blob (the
  authorizer the controller provides decides; without one everything is refused).
  It is decided before whether the blob exists, so a node cannot probe the mirror;
* 404 ``blob_not_found``: the mirror has no such blob;
* 416 ``range_not_satisfiable``: a ``Range`` that is not one ``bytes=`` range
  inside the blob (with ``Content-Range: bytes */SIZE``);
* 200 or 206 with ``Content-Length``, ``Content-Range`` (206), ``Accept-Ranges:
  bytes``, a strong ``ETag`` (``"sha256:<hex>"``), ``Repr-Digest`` (RFC 9530) and
  ``x-llmgw-digest``.

PERF: on a plain TCP connection the bytes go with ``sendfile(2)`` from a thread of
the transfer's own (zero-copy: the file's pages go to the socket without passing
through Python, and the event loop does nothing but wait), on duplicates of the
connection's socket and of the blob's file that the thread closes itself, so a
transport that closes meanwhile cannot hand its file descriptor number to another
connection under the thread; the thread waits with ``poll`` while the socket is
full, so it moves at the client's pace and is cut after :data:`STALL_S` without
progress. A thread each, not a pool's: a pool's threads held by the transfers
under way (each as long as its blob takes, or a stalled one for ``STALL_S``) left
the next nodes' answers silent past their read timeout. Otherwise (TLS, or the head
still queued) they are read with ``pread`` in the thread pool, one chunk ahead of
the socket, and written through the writer's flow control (no thread waits on a
socket there). Either way memory stays at a chunk or two per transfer whatever the
blob's size. At most ``max_transfers`` run at once; past it a request is answered
503 ``mirror_busy`` with ``Retry-After`` before anything is sent.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import errno
import os
import re
import select
import stat
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import HTTPError, MethodNotAllowedError, NotFoundError, UnauthorizedError
from ..log import mirror_logger as log
from .store import is_digest

if TYPE_CHECKING:
    from ..control.credentials import NodeCredentials
    from ..http.parser import Request
    from ..http.server import ResponseWriter
    from ..launch.spec import ReplicaController

__all__ = ["BLOB_PREFIX", "CHUNK", "Authorizer", "BlobServer", "RangeNotSatisfiableError", "parse_range", "placed_blobs"]

BLOB_PREFIX = b"/mirror/v1/blobs/"
# PERF: 1 MiB reads: the thread hop and the write cost per chunk vanish next to the
# copy, and one chunk written to the socket holds the loop ~0.1 ms at most.
CHUNK = 1 << 20
# One sendfile call moves at most this much (then the thread checks whether to stop).
SENDFILE_CHUNK = 8 << 20
STALL_S = 120.0
"""Seconds a transfer may make no progress (the agent stopped reading) before it is cut."""
MAX_TRANSFERS = 1024
"""Transfers at once (each holds a socket, a file and, on plain TCP, a thread mostly waiting in ``poll``)."""
_POLL_MS = 500
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
# (the unit is case-insensitive: RFC 9110 section 14.1)
_RANGE = re.compile(rb"bytes[ \t]*=[ \t]*(\d*)[ \t]*-[ \t]*(\d*)[ \t]*", re.IGNORECASE)

Authorizer = Callable[[str, str], bool]
"""``allowed(node, digest)``: whether a replica placed on ``node`` needs the blob ``digest``."""


def _deny(node: str, digest: str) -> bool:
    return False


def placed_blobs(controller: ReplicaController) -> Authorizer:
    """The authorizer the control plane uses: a node may fetch a blob when a replica in its
    desired set (``controller.desired(node)``) lists it in ``blobs``."""

    def allowed(node: str, digest: str) -> bool:
        _, specs = controller.desired(node)
        return any(b.digest == digest for spec in specs for b in spec.blobs)

    return allowed


class RangeNotSatisfiableError(HTTPError):
    """416: the ``Range`` asked for is not one range inside the blob."""

    status = 416
    type = "invalid_request_error"
    code = "range_not_satisfiable"


def parse_range(value: bytes | None, size: int) -> tuple[int, int] | None:
    """The ``[start, end)`` a ``Range`` header asks for in a ``size``-byte blob; ``None`` for none.

    One ``bytes=`` range only (``A-B``, ``A-`` or ``-N``), as RFC 9110 §14.1.2 writes them.

    Raises:
        RangeNotSatisfiableError: anything else (several ranges, another unit, a
            malformed one), or a range that does not overlap the blob.
    """
    if value is None:
        return None
    bad = RangeNotSatisfiableError(
        f"Range {value[:80].decode('latin-1')!r} is not one byte range inside this {size}-byte blob;"
        " ask for bytes=START-[END] with START below the size",
        headers=((b"content-range", b"bytes */%d" % size),),
    )
    m = _RANGE.fullmatch(value.strip())
    if m is None:
        raise bad
    first, last = m.group(1), m.group(2)
    if len(first) > 20 or len(last) > 20:
        raise bad
    if not first:
        if not last:
            raise bad
        n = int(last)  # the last n bytes
        if n == 0 or size == 0:
            raise bad
        return max(0, size - n), size
    start = int(first)
    end = min(int(last) + 1, size) if last else size
    if start >= size or (last and int(last) < start):
        raise bad
    return start, end


class BlobServer:
    """Answers ``/mirror/v1/blobs/...`` on the admin listener (see the module docstring).

    Args:
        root: the mirror root, or a function returning it (called per request: a
            reload may move it).
        credentials: the nodes' credentials (the control plane issues them at registration).
        allowed: ``allowed(node, digest)``; ``None`` refuses every blob (the
            controller sets :attr:`allowed` once it knows the placements).
        chunk: bytes per read.
        threads: the reader threads (``pread`` of the transfers that do not use ``sendfile``, a chunk
            at a time; a ``sendfile`` transfer has a thread of its own).
        max_transfers: transfers at once; past it a request is answered 503 ``mirror_busy``.

    Attributes:
        allowed: the authorizer; replace it at any time.
        served: ``{"requests": n, "bytes": n}`` so far, for tests and metrics.
        use_sendfile: send with ``sendfile(2)`` where the connection allows (``False``: always read and write).
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | Callable[[], str | os.PathLike[str]],
        credentials: NodeCredentials,
        allowed: Authorizer | None = None,
        *,
        chunk: int = CHUNK,
        threads: int = 32,
        max_transfers: int = MAX_TRANSFERS,
    ) -> None:
        self._root = root
        self.credentials = credentials
        self.allowed: Authorizer = allowed if allowed is not None else _deny
        self.chunk = chunk
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self.served = {"requests": 0, "bytes": 0}
        self.use_sendfile = True
        self.max_transfers = max_transfers
        self.active = 0  # transfers under way
        self._stops: set[threading.Event] = set()  # (each sendfile thread's)
        self._closed = False

    def close(self) -> None:
        """Stop the transfers (cut, quietly) and the reader threads."""
        self._closed = True
        for stop in list(self._stops):
            stop.set()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def root(self) -> Path:
        """The mirror root now."""
        r = self._root() if callable(self._root) else self._root
        return Path(r).expanduser().absolute()

    def blob_path(self, digest: str) -> Path:
        """Where blob ``digest`` is in the mirror (the store's layout: ``blobs/sha256/<2 hex>/<64 hex>``)."""
        hexdigest = digest[7:]
        return self.root() / "blobs" / "sha256" / hexdigest[:2] / hexdigest

    # -- requests --

    def _node(self, req: Request) -> str:
        auth = req.authorization
        given = auth[7:].strip() if auth is not None and auth[:7].lower() == b"bearer " else None
        if not given:
            raise UnauthorizedError(
                "mirror blobs need this node's mirror credential (issued when the agent registers): send"
                " Authorization: Bearer <credential>",
                code="missing_node_credential",
            )
        # SECURITY: checked in constant time; never logged or echoed.
        node = self.credentials.node_for(given)
        if node is None:
            raise UnauthorizedError(
                "unknown or revoked node credential: the agent must register again to get a new one",
                code="invalid_node_credential",
            )
        return node

    def handle(self, req: Request, w: ResponseWriter) -> Awaitable[None] | None:
        """Answer one request whose path starts with ``/mirror/v1/``."""
        path = req.path
        if not path.startswith(BLOB_PREFIX):
            raise NotFoundError(
                f"no mirror route {path.decode('latin-1')[:200]}; blobs are at /mirror/v1/blobs/sha256:<hex>"
            )
        if req.method not in (b"GET", b"HEAD"):
            raise MethodNotAllowedError(
                f"{req.method.decode('latin-1')[:20]} is not allowed on {path.decode('latin-1')[:200]}; use GET",
                ("GET", "HEAD"),
            )
        node = self._node(req)
        digest = path[len(BLOB_PREFIX):].decode("latin-1")
        if not is_digest(digest):
            raise NotFoundError(
                f"{digest[:80]!r} is not a blob digest; blobs are named sha256:<64 lowercase hex>",
                code="blob_not_found",
            )
        if not self.allowed(node, digest):
            log.warning("refused blob %s to node %s: no replica placed there needs it", digest, node)
            raise HTTPError(
                f"node {node} may not fetch {digest}: no replica placed on it needs that blob",
                status=403, type="permission_error", code="blob_not_allowed",
            )
        return self._serve(req, w, node, digest)

    async def _serve(self, req: Request, w: ResponseWriter, node: str, digest: str) -> None:
        """The blob's bytes (or head). The cap is checked and the transfer counted in the same step, and
        the file opened only once the transfer is under way: a request dropped before its task ran
        holds neither."""
        if self.active >= self.max_transfers:
            raise HTTPError(
                f"the mirror is sending {self.active} blobs at once, its limit: retry shortly",
                status=503, type="service_unavailable_error", code="mirror_busy", retry_after=5,
            )
        self.active += 1
        try:
            blob = self.blob_path(digest)
            try:
                fd = os.open(blob, os.O_RDONLY | _O_CLOEXEC | _O_NOFOLLOW)
            except (FileNotFoundError, NotADirectoryError):
                raise NotFoundError(
                    f"the mirror has no blob {digest}; import the model again (llmgw mirror import) or check"
                    " llmgw mirror verify", code="blob_not_found",
                ) from None
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise NotFoundError(f"the mirror has no blob {digest}", code="blob_not_found")
                size = st.st_size
                span = parse_range(req.header(b"range"), size)
            except BaseException:
                os.close(fd)
                raise
            start, end = span if span is not None else (0, size)
            raw_digest = bytes.fromhex(digest[7:])
            headers = [
                (b"content-type", b"application/octet-stream"),
                (b"accept-ranges", b"bytes"),
                (b"etag", b'"%s"' % digest.encode()),
                (b"repr-digest", b"sha-256=:%s:" % base64.b64encode(raw_digest)),
                (b"x-llmgw-digest", digest.encode()),
                (b"cache-control", b"private, max-age=31536000, immutable"),
            ]
            status = 200
            if span is not None:
                status = 206
                headers.append((b"content-range", b"bytes %d-%d/%d" % (start, end - 1, size)))
            self.served["requests"] += 1
            if req.method == b"HEAD" or end == start:
                os.close(fd)
                w.start(status, headers, content_length=end - start)
                w.end()
                return
            await self._stream(w, fd, start, end, status, headers, node, digest)
        finally:
            self.active -= 1

    def _sendfile_socket(self, w: ResponseWriter) -> int | None:
        """A duplicate of the connection's socket for ``sendfile``, or ``None`` when it cannot be used."""
        if not (self.use_sendfile and hasattr(os, "sendfile")) or w.disconnected:
            return None
        transport = w.transport
        if transport is None or transport.is_closing() or transport.get_extra_info("sslcontext") is not None:
            return None
        sock = transport.get_extra_info("socket")
        if sock is None or w.queued or transport.get_write_buffer_size():
            return None  # (bytes still queued in the transport would come after ours)
        try:
            return os.dup(sock.fileno())
        except (OSError, ValueError):
            return None

    async def _sendfile(
        self, w: ResponseWriter, loop: asyncio.AbstractEventLoop, sock_fd: int, fd: int, start: int, end: int,
        digest: str,
    ) -> int:
        """Send ``[start, end)`` of ``fd`` with sendfile in a thread of its own; the bytes sent (-1: cut off).
        The thread closes ``sock_fd`` (and a duplicate of ``fd``) when it ends, which may be after this
        returns when it is cancelled (within one sendfile call or poll: the stop flag is set)."""
        try:
            file_fd = os.dup(fd)
        except OSError:
            os.close(sock_fd)
            return 0  # (read and write instead)
        stop = threading.Event()
        w.on_disconnect(stop.set)
        done: asyncio.Future[tuple[int, str] | BaseException] = loop.create_future()

        def run() -> None:
            result: tuple[int, str] | BaseException
            try:
                result = _sendfile_all(sock_fd, file_fd, start, end, stop)
            except BaseException as exc:  # (handed to the loop, raised there)
                result = exc
            finally:
                os.close(sock_fd)
                os.close(file_fd)
            try:
                loop.call_soon_threadsafe(_settle, done, result)
            except RuntimeError:  # the loop is closed: nobody waits
                pass

        self._stops.add(stop)
        try:
            threading.Thread(target=run, name="llmgw-mirror-send", daemon=True).start()
        except BaseException:
            self._stops.discard(stop)
            os.close(sock_fd)
            os.close(file_fd)
            raise
        try:
            got = await done
        finally:
            stop.set()
            self._stops.discard(stop)
        if isinstance(got, BaseException):
            raise got
        sent, why = got
        if self._closed and not w.disconnected:  # (stopped by close(): the transfer is cut, quietly)
            w.abort()
            return -1
        if why and not w.disconnected:
            log.warning("cut the transfer of %s after %d bytes: %s", digest, sent, why)
            w.abort()
            return -1
        return sent

    async def _stream(
        self, w: ResponseWriter, fd: int, start: int, end: int, status: int,
        headers: list[tuple[bytes, bytes]], node: str, digest: str,
    ) -> None:
        """Send ``[start, end)`` of ``fd`` (which it closes: after a read still running in the pool, never
        under it)."""
        loop = asyncio.get_running_loop()
        chunk = self.chunk
        t0 = time.monotonic()
        offset = start
        sent = 0
        reading: concurrent.futures.Future[bytes] | None = None
        try:
            w.start(status, headers, content_length=end - start)
            sock_fd = self._sendfile_socket(w)
            if sock_fd is not None:
                n = await self._sendfile(w, loop, sock_fd, fd, start, end, digest)
                if n < 0:
                    return  # cut off (and logged)
                sent = n
                offset = start + n
            if offset < end and not w.disconnected:  # (no sendfile here: read and write)
                reading = self._read(fd, min(chunk, end - offset), offset)
                if reading is None:
                    w.abort()  # (closed meanwhile: cut, quietly)
                    return
            while reading is not None and offset < end:
                data: bytes = await asyncio.wrap_future(reading, loop=loop)
                reading = None
                if not data:  # the file shrank under us: the client sees a short body and retries
                    log.error("blob %s is shorter than it was when the transfer began; cut the transfer", digest)
                    w.abort()
                    return
                offset += len(data)
                if offset < end:  # read the next chunk while this one goes out
                    reading = self._read(fd, min(chunk, end - offset), offset)
                    if reading is None:
                        w.abort()
                        return
                if w.disconnected:
                    break
                w.write(data)
                sent += len(data)
                if w.write_paused:
                    await w.drain()
                if w.disconnected:
                    break
        finally:
            if reading is not None and not reading.done():
                reading.add_done_callback(lambda _f: os.close(fd))  # (a cancelled wait: the read runs on)
            else:
                os.close(fd)
            self.served["bytes"] += sent
        if w.disconnected:
            log.info("node %s went away after %d of %d bytes of %s", node, sent, end - start, digest)
            return
        w.end()
        took = time.monotonic() - t0
        log.info(
            "sent %s [%d-%d) to node %s: %d bytes in %.2fs (%.0f MiB/s)",
            digest, start, end, node, sent, took, sent / max(took, 1e-6) / (1 << 20),
        )

    def _read(self, fd: int, n: int, offset: int) -> concurrent.futures.Future[bytes] | None:
        """``pread`` in the reader pool (``None``: the server is closed)."""
        if self._closed:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self._threads, thread_name_prefix="llmgw-mirror")
        try:
            return self._pool.submit(os.pread, fd, n, offset)
        except RuntimeError:  # (shut down by close() in between)
            return None


def _settle(fut: asyncio.Future[Any], result: Any) -> None:
    if not fut.done():
        fut.set_result(result)


def _sendfile_all(sock_fd: int, fd: int, offset: int, end: int, stop: threading.Event) -> tuple[int, str]:
    """Send ``[offset, end)`` of ``fd`` to the (non-blocking) socket ``sock_fd``, waiting with poll
    while it is full; ``(bytes sent, why it stopped early or "")``. Runs in a thread."""
    poller = select.poll()
    poller.register(sock_fd, select.POLLOUT)
    sent = 0
    last = time.monotonic()
    while offset < end:
        if stop.is_set():
            return sent, ""  # (the client went away: the caller knows)
        try:
            n = os.sendfile(sock_fd, fd, offset, min(end - offset, SENDFILE_CHUNK))
        except BlockingIOError:
            events = poller.poll(_POLL_MS)
            if events and events[0][1] & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
                return sent, "the connection failed"
            if not events and time.monotonic() - last > STALL_S:
                return sent, f"no progress for {STALL_S:.0f}s (the agent stopped reading)"
            continue
        except OSError as exc:
            if exc.errno in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.EBADF):
                return sent, "the connection failed"
            if exc.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP) and sent == 0:
                return 0, ""  # no sendfile for this pair: the caller falls back to reads
            raise
        if n == 0:
            return sent, "the blob is shorter than it was when the transfer began"
        offset += n
        sent += n
        last = time.monotonic()
    return sent, ""
