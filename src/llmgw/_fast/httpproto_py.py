"""HTTP/1.1 message handling for llmgw's protocol server and upstream client.

Pure-Python twin of ``httpproto.pyx`` and its specification: both expose the
same names with the same behaviour, and the tests run both.

Framing (request line, headers, Content-Length, chunked bodies, and the
smuggling shapes they allow) is llhttp's job, through httptools, in strict mode.
This module is what llmgw does with each message:

* :class:`RequestReader` is the per-connection, sans-IO request side. Fed raw
  bytes, it enforces the limits (head bytes, header count, body size), sorts each
  header into what llmgw reads (auth, request id, priority, framing) and what it
  forwards upstream untouched, and hands each complete :class:`Request` to the
  connection's ``on_request``.
* :class:`ResponseReader` is the same for a response read from a replica: status,
  framing, content type, and the header lines to pass on to the client.
* :func:`response_head`, :func:`upstream_head`, :func:`chunk_head`,
  :func:`chunk` and :func:`id_line` build the bytes llmgw writes.

Limits raise :mod:`llmgw.errors` HTTP errors (431, 413, 400) that the server turns
into responses in one place. A head llhttp refuses is a 400 wherever the fault
is; the checks on its fields (head size, header count, ``Expect``, a second
``Host``) are made once llhttp has accepted the whole head, in header order.

The compiled twin reads heads (and chunk framing) off the bytes itself and feeds
llhttp exactly one message at a time, so httptools makes no per-header or per-body
callbacks there; what it accepts, refuses and delivers is the same, with two
documented differences: it bounds an unfinished head by the head's own bytes
(this twin by whole reads), and it passes a read's body bytes on once llhttp has
accepted the whole read (this twin as llhttp goes), so when llhttp refuses a read
it has passed on a prefix of what this twin did.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import httptools

# NOTE: sse_cut and usage_counts moved to jsonscan_py (they scan an answer's JSON
# text, not an HTTP message); re-exported here for code that imports them from here.
from llmgw._fast.jsonscan_py import sse_cut, usage_counts
from llmgw.errors import (
    BadRequestError,
    HeadersTooLargeError,
    HTTPError,
    PayloadTooLargeError,
    VersionNotSupportedError,
)

__all__ = [
    "DEFAULT_MAX_BODY",
    "DEFAULT_MAX_HEADERS",
    "DEFAULT_MAX_HEAD_BYTES",
    "STATUS_REASONS",
    "Request",
    "RequestReader",
    "RequestSink",
    "Response",
    "ResponseReader",
    "ResponseSink",
    "chunk_head",
    "id_line",
    "monotonic",
    "response_head",
    "sse_cut",
    "upstream_head",
    "usage_counts",
    "write_now",
]

DEFAULT_MAX_HEAD_BYTES = 16 * 1024
DEFAULT_MAX_HEADERS = 100
DEFAULT_MAX_BODY = 16 * 1024 * 1024

# NOTE: llhttp accepts any Content-Length that fits 64 unsigned bits, but the
# compiled twin stores it in a Py_ssize_t; both twins clamp to this, so a
# 2**64-1 length is "too large" (413 / an endless upstream body) in both rather
# than an OverflowError in one of them.
_MAX_CONTENT_LENGTH = 2**63 - 1

_OWS = (b" ", b"\t")
_BODILESS_INTERIM = (100, 102, 103)  # the 1xx statuses llhttp frames without a body

# Header kinds. A header llmgw reads is classified once, on arrival.
H_OTHER = 0  # forwarded untouched
H_HOP = 1  # hop-by-hop: consumed here, never forwarded (RFC 9110 §7.6.1)
H_CONTENT_LENGTH = 2
H_TRANSFER_ENCODING = 3
H_CONNECTION = 4
H_EXPECT = 5
H_AUTHORIZATION = 6
H_X_API_KEY = 7
H_REQUEST_ID = 8
H_HOST = 9
H_CONTENT_TYPE = 10
H_PRIORITY = 11

_KINDS: dict[bytes, int] = {
    b"content-length": H_CONTENT_LENGTH,
    b"transfer-encoding": H_TRANSFER_ENCODING,
    b"connection": H_CONNECTION,
    b"keep-alive": H_HOP,
    b"proxy-connection": H_HOP,
    b"proxy-authorization": H_HOP,
    b"proxy-authenticate": H_HOP,
    b"te": H_HOP,
    b"trailer": H_HOP,
    b"upgrade": H_HOP,
    # Not hop-by-hop, but never passed on: llmgw reads the replica's body (usage,
    # errors, events), so it asks for it uncoded (upstream_head) whatever the
    # client accepts. A client's "gzip" would come back as bytes llmgw cannot read.
    b"accept-encoding": H_HOP,
    # SECURITY: Azure OpenAI's credential header (its SDK sends the client's key in it): never passed on,
    # as the client's Authorization and x-api-key are not
    b"api-key": H_HOP,
    b"expect": H_EXPECT,
    b"authorization": H_AUTHORIZATION,
    b"x-api-key": H_X_API_KEY,
    b"x-request-id": H_REQUEST_ID,
    b"host": H_HOST,
    b"content-type": H_CONTENT_TYPE,
}


def _plain_connection(value: bytes) -> bool:
    """Whether a Connection value names nothing but ``close`` or ``keep-alive`` (the
    usual case: nothing else to take out of the forwarded headers)."""
    v = value.lower()
    return v == b"keep-alive" or v == b"close"


def _drop_nominated(forward: bytes, connection: list[bytes]) -> bytes:
    """``forward`` without the header lines that the ``Connection`` values name.

    RFC 9110 §7.6.1: a proxy removes every field a Connection header names as a
    connection option before it forwards the message; those fields were meant
    for this hop only. Only the other party's own lines are taken out: the
    headers llmgw writes itself are not in ``forward``.
    """
    names = set()
    for value in connection:
        for token in value.split(b","):
            token = token.strip(b" \t").lower()
            if token and token != b"close" and token != b"keep-alive":
                names.add(token)
    if not names or not forward:
        return forward
    lines = forward.split(b"\r\n")
    return b"".join(ln + b"\r\n" for ln in lines[:-1] if ln.partition(b":")[0].lower() not in names)

# NOTE: every status of the IANA registry (RFC 9110 §15 and the extensions it lists):
# llmgw relays a replica's status as it is, so any of them may go out.
STATUS_REASONS: dict[int, bytes] = {
    100: b"Continue",
    101: b"Switching Protocols",
    102: b"Processing",
    103: b"Early Hints",
    200: b"OK",
    201: b"Created",
    202: b"Accepted",
    203: b"Non-Authoritative Information",
    204: b"No Content",
    205: b"Reset Content",
    206: b"Partial Content",
    207: b"Multi-Status",
    208: b"Already Reported",
    226: b"IM Used",
    300: b"Multiple Choices",
    301: b"Moved Permanently",
    302: b"Found",
    303: b"See Other",
    304: b"Not Modified",
    305: b"Use Proxy",
    307: b"Temporary Redirect",
    308: b"Permanent Redirect",
    400: b"Bad Request",
    401: b"Unauthorized",
    402: b"Payment Required",
    403: b"Forbidden",
    404: b"Not Found",
    405: b"Method Not Allowed",
    406: b"Not Acceptable",
    407: b"Proxy Authentication Required",
    408: b"Request Timeout",
    409: b"Conflict",
    410: b"Gone",
    411: b"Length Required",
    412: b"Precondition Failed",
    413: b"Content Too Large",
    414: b"URI Too Long",
    415: b"Unsupported Media Type",
    416: b"Range Not Satisfiable",
    417: b"Expectation Failed",
    421: b"Misdirected Request",
    422: b"Unprocessable Content",
    423: b"Locked",
    424: b"Failed Dependency",
    425: b"Too Early",
    426: b"Upgrade Required",
    428: b"Precondition Required",
    429: b"Too Many Requests",
    431: b"Request Header Fields Too Large",
    451: b"Unavailable For Legal Reasons",
    500: b"Internal Server Error",
    501: b"Not Implemented",
    502: b"Bad Gateway",
    503: b"Service Unavailable",
    504: b"Gateway Timeout",
    505: b"HTTP Version Not Supported",
    506: b"Variant Also Negotiates",
    507: b"Insufficient Storage",
    508: b"Loop Detected",
    510: b"Not Extended",
    511: b"Network Authentication Required",
}
_STATUS_LINES: dict[int, bytes] = {
    code: b"HTTP/1.1 %d %s\r\n" % (code, reason) for code, reason in STATUS_REASONS.items()
}


def monotonic() -> float:
    """``time.monotonic()``: the clock the data path keeps its deadlines in.

    The compiled twin reads the same clock (``CLOCK_MONOTONIC``) in C, so the data
    path takes the time without a Python call.
    """
    return time.monotonic()


def write_now(fd: int, a: bytes, b: bytes = b"") -> int:
    """Write ``a`` then ``b`` to the stream socket ``fd`` as far as it takes them now.

    For a non-blocking socket whose transport holds no unsent bytes: the data path
    writes there directly, which costs a fraction of a transport's ``write`` (which
    makes the same attempt first and buffers what is left).

    Returns:
        the number of bytes written, from the start of ``a`` (0 when the socket takes
        nothing now), or -1 on an error: the caller hands the data to the transport,
        which meets the same error and reports it as it does.
    """
    while True:
        try:
            return os.writev(fd, (a, b) if b else (a,))
        except InterruptedError:
            continue
        except BlockingIOError:
            return 0
        except OSError:
            return -1


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        if not 100 <= status <= 999:
            raise ValueError(f"invalid HTTP status {status}")
        line = b"HTTP/1.1 %d Status\r\n" % status
    return line


def _check_header_value(value: bytes) -> None:
    if b"\r" in value or b"\n" in value:
        raise ValueError("header value contains CR or LF")


def response_head(
    status: int,
    headers: list[tuple[bytes, bytes]] | tuple[tuple[bytes, bytes], ...] = (),
    content_length: int = -1,
    keep_alive: bool = True,
    raw: bytes = b"",
) -> bytes:
    """The status line and headers of a response, ending with the blank line.

    Args:
        status: HTTP status code.
        headers: extra ``(name, value)`` pairs; values must not contain CR/LF.
        content_length: body length, or -1 for ``Transfer-Encoding: chunked``,
            or -2 for no body framing at all (1xx, 204, 304).
        keep_alive: whether the connection stays open (else ``Connection: close``).
        raw: pre-built header lines (``b"Name: value\\r\\n"`` each) appended as is.

    Returns:
        the head as bytes.
    """
    parts = [_status_line(status)]
    for name, value in headers:
        _check_header_value(value)
        parts.append(b"%s: %s\r\n" % (name, value))
    if raw:
        parts.append(raw)
    if content_length >= 0:
        parts.append(b"content-length: %d\r\n" % content_length)
    elif content_length == -1:
        parts.append(b"transfer-encoding: chunked\r\n")
    if not keep_alive:
        parts.append(b"connection: close\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


def id_line(rid: bytes, n: int = -1) -> bytes:
    """The ``x-request-id`` header line for ``rid``; with ``n >= 0``, for the id
    ``rid`` followed by ``n`` in decimal (a generated id: prefix and counter)."""
    if n >= 0:
        return b"x-request-id: " + rid + str(n).encode() + b"\r\n"
    return b"x-request-id: " + rid + b"\r\n"


def upstream_head(
    method: bytes,
    target: bytes,
    host: bytes,
    forward: bytes,
    content_length: int,
    extra: bytes = b"",
) -> bytes:
    """The request head sent to a replica.

    Args:
        method: request method.
        target: request target (path and query).
        host: value for ``Host``.
        forward: the client's forwardable header lines (:attr:`Request.forward`).
        content_length: body length (the body is always sent de-chunked), or -1
            for a request without a body.
        extra: llmgw's own header lines (the replica's key, the request id).
    """
    parts = [method, b" ", target, b" HTTP/1.1\r\nhost: ", host, b"\r\naccept-encoding: identity\r\n", forward, extra]
    if content_length >= 0:
        parts.append(b"content-length: %d\r\n" % content_length)
    parts.append(b"\r\n")
    return b"".join(parts)


def chunk_head(size: int) -> bytes:
    """The size line that opens one chunk of a chunked body."""
    return b"%x\r\n" % size


def chunk(data: bytes) -> bytes:
    """``data`` framed as one chunk of a chunked body (size line, data, CRLF), one object.

    ``data`` must not be empty: an empty chunk is the last-chunk marker.
    """
    return b"%x\r\n%b\r\n" % (len(data), data)


class Request:
    """One HTTP request as the server read it.

    ``headers`` keeps every header as received (name case kept); the attributes
    below are the ones llmgw reads, decoded once. ``forward`` is the header lines
    a proxy passes on untouched: everything but hop-by-hop headers, framing,
    credentials, ``Host``, ``Expect`` and ``X-Request-Id``, which llmgw writes
    itself.
    """

    __slots__ = (
        "authorization",
        "body",
        "content_length",
        "content_type",
        "expect_continue",
        "forward",
        "headers",
        "host",
        "keep_alive",
        "method",
        "priority",
        "request_id",
        "target",
        "version",
        "x_api_key",
    )

    def __init__(self) -> None:
        self.method: bytes = b""
        self.target: bytes = b""
        self.version: bytes = b"1.1"
        self.headers: list[tuple[bytes, bytes]] = []
        self.forward: bytes = b""
        self.keep_alive: bool = True
        self.content_length: int = -1
        self.expect_continue: bool = False
        self.authorization: bytes | None = None
        self.x_api_key: bytes | None = None
        self.request_id: bytes | None = None
        self.priority: bytes | None = None
        self.host: bytes | None = None
        self.content_type: bytes | None = None
        self.body: bytes = b""

    @property
    def path(self) -> bytes:
        """The target without its query string."""
        q = self.target.find(b"?")
        return self.target if q < 0 else self.target[:q]

    def header(self, name: bytes) -> bytes | None:
        """The first value of header ``name`` (case-insensitive), or ``None``."""
        name = name.lower()
        for n, v in self.headers:
            if n.lower() == name:
                return v
        return None

    def __repr__(self) -> str:
        return f"<Request {self.method.decode('latin-1')} {self.target!r}>"


class RequestSink:
    """What a :class:`RequestReader` hands its requests to (the server's
    protocol is one; compiled, the reader calls it through C)."""

    __slots__ = ()

    def on_request(self, request: Request) -> None:
        """Called with each complete request, in order."""
        raise NotImplementedError

    def on_head(self, request: Request) -> None:
        """Called with a request whose head is complete and whose client waits
        for ``100 Continue`` before sending the body."""


class _CallbackSink(RequestSink):
    """A sink made of two callables (``on_head`` may be ``None``)."""

    __slots__ = ("_on_head", "_on_request")

    def __init__(self, on_request: Callable[[Request], Any], on_head: Callable[[Request], Any] | None) -> None:
        self._on_request = on_request
        self._on_head = on_head

    def on_request(self, request: Request) -> None:
        self._on_request(request)

    def on_head(self, request: Request) -> None:
        if self._on_head is not None:
            self._on_head(request)


# the bytes a Host value may hold (RFC 3986 §3.2.2: reg-name, IP-literal, ":" port)
_HOST_BYTES = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~%!$&'()*+,;=:[]"


def _invalid_host() -> HTTPError:
    """RFC 9112 §3.2: a server MUST answer 400 to a Host with an invalid value."""
    return BadRequestError("the Host header is not a host name or address (with an optional :port)",
                           code="invalid_host", close=True)


def _parse_error(exc: Exception) -> HTTPError:
    """What llhttp's refusal of a request is answered with: 505 for a version it
    does not take ("HTTP/1.2", "HTTP/3.0"), 400 for the rest."""
    if str(exc) == "Invalid HTTP version":
        return VersionNotSupportedError("unsupported HTTP version: llmgw speaks HTTP/1.1 (and 1.0)")
    return BadRequestError(f"malformed HTTP request: {exc}", close=True)


def _unsupported_coding() -> HTTPError:
    return HTTPError(
        "unsupported Transfer-Encoding: llmgw reads chunked request bodies only", status=501,
        type="invalid_request_error", code="unsupported_transfer_coding", close=True, should_retry=False,
    )


def _upgrade_with_chunks() -> HTTPError:
    """A request offering a protocol upgrade is answered on HTTP/1.1 (the offer ignored) with its body read
    off its Content-Length; llhttp does not read the body of such a request, and a chunked one is not
    framed here twice (the compiled twin refuses it alike)."""
    return BadRequestError(
        "a request offering a protocol upgrade (Upgrade:) with a chunked body is not supported: send it "
        "without Upgrade, or with Content-Length", close=True,
    )


def _connect_refused() -> HTTPError:
    """RFC 9110 §9.3.6: CONNECT asks for a tunnel, which this origin server does not
    make; 405 with the methods it takes (§15.5.6). The connection closes: llhttp
    reads what follows a CONNECT head as tunnel bytes, not as HTTP."""
    return HTTPError(
        "CONNECT is not supported: llmgw is an HTTP API gateway, not a forward proxy", status=405,
        type="invalid_request_error", code="method_not_allowed", close=True,
        headers=((b"allow", b"GET, HEAD, POST"),),
    )


def _te_in_http10() -> HTTPError:
    """RFC 9112 §6.1: a server that receives Transfer-Encoding in an HTTP/1.0 message
    MUST treat its framing as faulty (an HTTP/1.0 hop before it may have framed it
    otherwise: a smuggling shape) and close the connection after answering."""
    return BadRequestError(
        "malformed HTTP request: Transfer-Encoding in an HTTP/1.0 request (RFC 9112 §6.1)", close=True,
    )


# Chunked body framing states (the compiled twin's C_* in httpproto.pyx)
_C_SIZE = 0  # in a chunk-size line (digits, then extensions), until LF
_C_DATA = 1  # chunk data (left bytes)
_C_DATA_END = 2  # the CRLF after chunk data, until LF
_C_TRAILER = 3  # at the start of a trailer line (or the final empty line)
_C_TRAILER_LINE = 4  # in a trailer line, until LF
_C_FINAL_LF = 5  # the final empty line's LF

# What _ChunkFraming.frame answers besides the index past the body
F_MORE = -1  # the body goes on past these bytes
F_SIZE = -2  # a chunk size past 2**58
F_BODY = -4  # the chunk sizes pass max_body; stop: past that size line
F_TRAILER_BYTES = -5  # the trailer section passes max_trailer bytes; stop: at the byte that did
F_TRAILER_LINES = -6  # the trailer section passes max_lines lines; stop: at the first byte of the one that did
# (stop is where llhttp is fed to before the answer: its verdict on the bytes before comes first, and a
# trailer limit stops before the message's last byte, so llhttp never completes a refused request)

_MAX_CHUNK_LEFT = 1 << 58  # (a size past this with one more digit is refused, as in the compiled twin)
_HEX_VALUE = {c: int(chr(c), 16) for c in b"0123456789abcdefABCDEF"}


class _ChunkFraming:
    """Where a chunked request body ends, and its limits, read off the bytes as llhttp
    reads them (llhttp validates the framing; this bounds it).

    llhttp takes any chunk size up to 2**64 and waits for that much data, and takes
    any number of trailer lines: a body declared past ``max_body`` would wait for its
    body timeout, a trailer section would grow without limit (it is read, not kept,
    but llhttp keeps each unfinished line). The compiled twin frames chunks itself
    (``_frame_chunks``); this is the same state machine, so both answer alike at the
    same byte.
    """

    __slots__ = ("declared", "in_ext", "left", "lines", "max_body", "max_lines", "max_trailer", "state", "stop",
                 "trailer")

    def __init__(self, max_body: int, max_trailer: int, max_lines: int) -> None:
        self.state = _C_SIZE
        self.left = 0  # the chunk being read: bytes still to come (its size, in its size line)
        self.in_ext = False  # past the size digits of a size line
        self.declared = 0  # the chunk sizes read so far (never past max_body)
        self.trailer = 0  # trailer section bytes so far
        self.lines = 0  # trailer lines so far
        self.stop = 0  # where frame stopped on a limit
        self.max_body = max_body
        self.max_trailer = max_trailer
        self.max_lines = max_lines

    def frame(self, s: bytes, pos: int, n: int) -> int:
        """The index past the body's end in ``s[pos:n]``, or F_MORE (all of it read),
        or a limit (F_SIZE, F_BODY, F_TRAILER_BYTES, F_TRAILER_LINES)."""
        while pos < n:
            state = self.state
            if state == _C_SIZE:
                if self.in_ext:
                    lf = s.find(b"\n", pos, n)  # (extensions: llhttp checks them)
                    if lf < 0:
                        return F_MORE
                    pos = lf
                c = s[pos]
                pos += 1
                if c == 10:
                    if self.left > self.max_body - self.declared:
                        self.stop = pos
                        return F_BODY
                    self.declared += self.left
                    self.state = _C_TRAILER if self.left == 0 else _C_DATA
                    self.in_ext = False
                else:
                    d = _HEX_VALUE.get(c)
                    if d is None:
                        self.in_ext = True  # CR, or extensions: the size is read
                    elif self.left > _MAX_CHUNK_LEFT:
                        return F_SIZE
                    else:
                        self.left = self.left * 16 + d
            elif state == _C_DATA:
                if n - pos >= self.left:
                    pos += self.left
                    self.left = 0
                    self.state = _C_DATA_END
                else:
                    self.left -= n - pos
                    pos = n
            elif state == _C_DATA_END:
                lf = s.find(b"\n", pos, n)
                if lf < 0:
                    return F_MORE
                pos = lf + 1
                self.state = _C_SIZE
            elif state == _C_TRAILER_LINE:
                lf = s.find(b"\n", pos, n)
                end = n if lf < 0 else lf + 1
                if self.trailer + (end - pos) > self.max_trailer:
                    self.stop = pos + self.max_trailer - self.trailer
                    return F_TRAILER_BYTES
                self.trailer += end - pos
                pos = end
                if lf >= 0:
                    self.state = _C_TRAILER
            else:  # _C_TRAILER, _C_FINAL_LF: one byte
                c = s[pos]
                pos += 1
                self.trailer += 1
                if self.trailer > self.max_trailer:
                    self.stop = pos - 1
                    return F_TRAILER_BYTES
                if c == 10:
                    self.state = _C_SIZE
                    return pos
                if state == _C_TRAILER and c == 13:
                    self.state = _C_FINAL_LF
                else:
                    self.lines += 1
                    if self.lines > self.max_lines:
                        self.stop = pos - 1
                        return F_TRAILER_LINES
                    self.state = _C_TRAILER_LINE
        return F_MORE


def _framing_error(f: _ChunkFraming, code: int) -> HTTPError:
    """The answer to a chunked body past a limit (``_ChunkFraming.frame``'s code)."""
    if code == F_SIZE:
        return BadRequestError("malformed HTTP request: chunk size too large", close=True)
    if code == F_BODY:
        return PayloadTooLargeError(
            f"request body is at least {f.declared + f.left} bytes (its chunk sizes); the limit is {f.max_body}",
            close=True,
        )
    if code == F_TRAILER_BYTES:
        return HeadersTooLargeError("request trailer section is too large", close=True)
    return HeadersTooLargeError("too many request trailer fields", close=True)


class RequestReader:
    """Reads pipelined HTTP/1.1 requests from one connection (sans-IO).

    Args:
        on_request: a :class:`RequestSink`, or a callable called with each
            complete :class:`Request`, in order.
        on_head: (with a callable ``on_request``) called with a request whose head
            is complete and whose client waits for ``100 Continue`` before sending
            the body (``None``: ignore). A sink's own ``on_head`` is called instead.
        max_head_bytes: limit on request line plus headers (431 past it).
        max_headers: limit on the number of header lines (431 past it).
        max_body: limit on the body, Content-Length or chunked (413 past it).
        priority_header: lower-case name of the header carrying the priority band.

    ``feed`` raises an :class:`~llmgw.errors.HTTPError` on malformed or over-limit
    input; the reader is then unusable and the connection must answer and close.
    """

    def __init__(
        self,
        on_request: RequestSink | Callable[[Request], Any],
        on_head: Callable[[Request], Any] | None = None,
        max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES,
        max_headers: int = DEFAULT_MAX_HEADERS,
        max_body: int = DEFAULT_MAX_BODY,
        priority_header: bytes = b"x-llmgw-priority",
    ) -> None:
        self._sink = on_request if isinstance(on_request, RequestSink) else _CallbackSink(on_request, on_head)
        self.max_head_bytes = max_head_bytes
        self.max_headers = max_headers
        self.max_body = max_body
        self._priority_header = priority_header.lower()
        self._parser = httptools.HttpRequestParser(self)
        self._req: Request | None = None
        self._in_head = False
        self._head_bytes = 0
        self._head_fed = 0
        self._url_parts: list[bytes] = []
        self._forward: list[bytes] = []
        self._body: list[bytes] = []
        self._body_size = 0
        self._dead = False
        self._ends = 0
        self._error: HTTPError | None = None  # a field error, raised once llhttp accepts the head
        self._te_other = False
        self._te_chunked = False
        self._connection: list[bytes] | None = None  # Connection values naming more than close/keep-alive
        self._chunks: _ChunkFraming | None = None  # the open request's chunked body: its framing and limits
        self._tail = b""  # the last bytes fed inside a head (a blank line split over reads)
        self._upgrade = False  # the open request offers a protocol upgrade (answered on HTTP/1.1 all the same)
        self._upgrade_left = 0  # its body bytes still to come (llhttp ended the message at its head)
        self._drop_rest = False  # past such a request: what follows is no HTTP/1.1 (the connection closes)

    @property
    def in_message(self) -> bool:
        """Whether a request has started but is not complete yet."""
        return self._req is not None

    @property
    def in_head(self) -> bool:
        """Whether a request's head has started but is not complete yet."""
        return self._in_head

    def where(self) -> int:
        """0 between requests, 1 inside a head, 2 past a head (its body is being read)."""
        if self._in_head:
            return 1
        return 0 if self._req is None else 2

    def current(self) -> Request | None:
        """The request whose head was read and accepted by llhttp and whose body is
        being read, or which an error refused after its head was read (its method
        and target known: a refused HEAD is answered without a body); ``None``
        between requests and inside a head."""
        return None if self._in_head else self._req

    def feed(self, data: bytes) -> None:
        """Parse ``data``; complete requests go to ``on_request`` as they finish.

        Raises:
            HTTPError: 400 malformed, 431 head (or trailer section) too large, 413 body too large.
        """
        if self._drop_rest:
            return
        if self._dead:
            raise BadRequestError("connection is closing after a malformed request", close=True)
        if self._upgrade_left:
            self._upgrade_body(data)
            return
        mid_message = self._req is not None
        ends = self._ends
        try:
            self._feed(data)
        except HTTPError:
            self._dead = True  # (a chunked body past a limit)
            raise
        except httptools.HttpParserUpgrade:
            self._dead = True  # (not an offer on_headers_complete took: see _feed)
            raise BadRequestError("protocol upgrade is not supported", close=True) from None
        except httptools.HttpParserError as exc:
            self._dead = True
            cause = exc.__context__
            if isinstance(cause, HTTPError):
                raise cause from None
            raise _parse_error(exc) from exc
        if self._upgrade:
            return  # (past a request offering an upgrade: see _upgraded)
        if self._in_head:
            # httptools accumulates a header that has not ended yet without limit,
            # so an unfinished head is bounded here by the bytes fed into it.
            if self._head_fed >= 0:
                self._head_fed += len(data)
            elif mid_message or self._ends != ends:
                # NOTE: the head began after other requests' bytes in this chunk
                # (pipelining, or a body's tail): counting the whole chunk gave a
                # false 431. Count what is known; an unfinished header can then
                # outgrow the limit by at most this one chunk until the next feed.
                self._head_fed = self._head_bytes
            else:
                self._head_fed = len(data)
            if self._head_fed > self.max_head_bytes:
                self._dead = True
                raise HeadersTooLargeError("request head is too large", close=True)
            self._tail = (self._tail + data[-3:])[-3:]
        else:
            self._tail = b""

    def _feed(self, data: bytes) -> None:
        # llhttp reads the bytes; a chunked body's framing is also read here first, as
        # the compiled twin reads it, for the limits llhttp does not keep (_ChunkFraming).
        # To know where such a body begins, llhttp is fed up to each blank line (where a
        # head may end) at a time: a chunked head that ends there starts the framing just
        # after it. NOTE: (PERF) this costs the twin about 1 us a request (a second
        # feed_data, and a search of the body for blank lines); finding only the heads that
        # name Transfer-Encoding (any case) costs as much.
        n = len(data)
        pos = 0
        feed_data = self._parser.feed_data
        while pos < n:
            f = self._chunks
            if f is not None:
                end = f.frame(data, pos, n)
                if end < F_MORE:
                    if end != F_SIZE and f.stop > pos:
                        feed_data(data[pos : f.stop])  # (llhttp's verdict on the bytes before comes first)
                    raise _framing_error(f, end)
                stop = n if end == F_MORE else end
                feed_data(data if pos == 0 and stop == n else data[pos:stop])
                pos = stop
                if end >= 0 and self._chunks is not None:
                    raise BadRequestError("malformed HTTP request: the message does not end where its framing says",
                                          close=True)
                continue
            stop = -1
            if pos == 0 and self._tail:
                at = (self._tail + data[:3]).find(b"\r\n\r\n")  # (a blank line split over reads)
                if at >= 0:
                    stop = at + 4 - len(self._tail)
            if stop < 0:
                at = data.find(b"\r\n\r\n", pos)
                if at >= 0:
                    stop = at + 4
            blank = stop >= 0
            if not blank:
                stop = n
            try:
                feed_data(data if pos == 0 and stop == n else data[pos:stop])
            except httptools.HttpParserUpgrade as exc:
                if not self._upgrade:
                    raise
                self._upgraded(data, pos + exc.args[0])
                return
            if self._chunks is not None and not blank:
                # (a head that ended elsewhere than at a blank line: its framing is not known here)
                raise BadRequestError("malformed HTTP request: the head does not end where it seems to", close=True)
            pos = stop

    def _upgraded(self, data: bytes, at: int) -> None:
        """llhttp stopped past the head of a request offering a protocol upgrade (``data[at:]`` follows
        it): the request is answered on HTTP/1.1 all the same, then the connection closes (a server may
        ignore Upgrade: RFC 9110 §7.8; h2c from curl --http2 and Java's HttpClient, a WebSocket offer).
        llhttp ended the message at its head, body or not: the body (Content-Length; a chunked one was
        refused) is read here. What follows the request would be the other protocol: never read."""
        if self._upgrade_left:
            self._upgrade_body(data[at:])
        else:
            self._drop_rest = True

    def _upgrade_body(self, data: bytes) -> None:
        take = data[: self._upgrade_left]
        if take:
            self._body.append(take)
            self._body_size += len(take)
            self._upgrade_left -= len(take)
        if not self._upgrade_left:
            self._drop_rest = True
            self._deliver()

    # -- httptools callbacks (called from feed_data) --

    def on_message_begin(self) -> None:
        req = Request()
        self._req = req
        self._in_head = True
        self._head_bytes = 0
        self._head_fed = -1  # the head began during the current feed
        self._te_other = False  # a Transfer-Encoding line says more than "chunked"
        self._te_chunked = False  # the last one ends with chunked
        self._url_parts = []
        self._forward = []
        self._body = []
        self._body_size = 0
        self._error = None
        self._connection = None

    def on_url(self, url: bytes) -> None:
        self._url_parts.append(url)
        self._head_bytes += len(url)
        if self._head_bytes > self.max_head_bytes and self._error is None:
            self._error = HeadersTooLargeError("request line is too long", close=True)

    def on_header(self, name: bytes, value: bytes) -> None:
        req = self._req
        assert req is not None
        if not self._in_head:
            # a chunked body's trailer fields: not part of the head, not read (as
            # in the compiled twin, which never hands them to the request)
            return
        if self._error is not None:
            return
        raw = value
        if value[-1:] in _OWS:
            # llhttp keeps trailing whitespace; it is not part of the value (RFC 9112
            # §5: OWS field-value OWS). Found by the h11 differential test.
            value = value.rstrip(b" \t")
        # NOTE: a field error is raised from on_headers_complete, once llhttp has
        # accepted the whole head: a malformed head is a 400 wherever the bad byte
        # is, and the compiled twin (which reads the fields before llhttp has seen
        # them) gives the same answer.
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > self.max_head_bytes:
            self._error = HeadersTooLargeError("request headers are too large", close=True)
            return
        headers = req.headers
        if len(headers) >= self.max_headers:
            self._error = HeadersTooLargeError("too many request headers", close=True)
            return
        headers.append((name, value))
        lname = name.lower()
        kind = _KINDS.get(lname, H_OTHER)
        if kind == H_OTHER:
            if lname == self._priority_header:
                if req.priority is None:
                    req.priority = value
            else:
                self._forward.append(b"%s: %s\r\n" % (name, value))
        elif kind == H_EXPECT:
            if value.lower() == b"100-continue":
                req.expect_continue = True
            else:
                self._error = HTTPError(
                    "unsupported Expect header", status=417, type="invalid_request_error",
                    code="expectation_failed", close=True,
                )
        elif kind == H_AUTHORIZATION:
            if req.authorization is None:
                req.authorization = value
        elif kind == H_X_API_KEY:
            if req.x_api_key is None:
                req.x_api_key = value
        elif kind == H_REQUEST_ID:
            if req.request_id is None:
                req.request_id = value
        elif kind == H_HOST:
            if req.host is not None:
                self._error = BadRequestError("duplicate Host header", close=True)
            elif value.translate(None, _HOST_BYTES):
                self._error = _invalid_host()
            req.host = value
        elif kind == H_CONTENT_TYPE:
            if req.content_type is None:
                req.content_type = value
                self._forward.append(b"%s: %s\r\n" % (name, value))
        elif kind == H_TRANSFER_ENCODING:
            # (read in on_headers_complete: codings other than chunked)
            self._te_other = self._te_other or value.lower() != b"chunked"
            self._te_chunked = _te_chunked(raw)
        elif kind == H_CONTENT_LENGTH:
            # llhttp has validated the digits and rejected duplicates.
            req.content_length = min(int(value), _MAX_CONTENT_LENGTH)
        elif kind == H_CONNECTION and not _plain_connection(value):
            if self._connection is None:
                self._connection = []
            self._connection.append(value)

    def on_headers_complete(self) -> None:
        req = self._req
        assert req is not None
        self._in_head = False
        parser = self._parser
        # (read first: a head refused below is answered knowing its method, see current())
        req.method = parser.get_method()
        parts = self._url_parts
        req.target = parts[0] if len(parts) == 1 else b"".join(parts)
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        if self._te_other and self._te_chunked:
            # SECURITY: llhttp takes any codings before a final chunked ("gzip,
            # chunked", or two Transfer-Encoding lines); the body would be de-chunked
            # and sent on still coded, with nothing to say so. A coding this server
            # does not decode is 501 (RFC 9112 §6.1); chunked not last stays llhttp's
            # 400 (§6.3). Found by the h11 differential test.
            raise _unsupported_coding()
        version = parser.get_http_version()
        if version != "1.1" and version != "1.0":
            # SECURITY: llhttp lets "HTTP/2.0" and a version-less (0.9) line
            # through; neither is a message this HTTP/1.1 server can frame.
            raise VersionNotSupportedError(f"unsupported HTTP version {version}")
        if parser.should_upgrade():
            # llhttp calls on_message_complete for an upgrade (or CONNECT) before stopping, so the
            # request reaches the app: CONNECT is refused here, before it is delivered; an Upgrade
            # offer (h2c from curl --http2 or Java's HttpClient, a WebSocket) is ignored, as a server
            # may (RFC 9110 §7.8): the request is answered on HTTP/1.1, then the connection closes.
            if req.method == b"CONNECT":
                raise _connect_refused()
            if self._te_chunked:
                raise _upgrade_with_chunks()
            self._upgrade = True
        if self._te_chunked and version == "1.0":
            # SECURITY: llhttp de-chunks it and keeps the connection open (see _te_in_http10)
            raise _te_in_http10()
        req.version = version.encode()
        req.keep_alive = parser.should_keep_alive() and not self._upgrade
        req.forward = b"".join(self._forward)
        if self._connection is not None:
            req.forward = _drop_nominated(req.forward, self._connection)
        if req.content_length > self.max_body:
            raise PayloadTooLargeError(
                f"request body is {req.content_length} bytes; the limit is {self.max_body}", close=True
            )
        if self._te_chunked:
            self._chunks = _ChunkFraming(self.max_body, self.max_head_bytes, self.max_headers)
        if req.expect_continue and req.content_length != 0 and req.version == b"1.1":
            # (an HTTP/1.0 client's expectation is ignored: RFC 9110 §10.1.1)
            self._sink.on_head(req)

    def on_body(self, body: bytes) -> None:
        self._body_size += len(body)
        # (a chunked body is refused on its chunk sizes first, by _ChunkFraming: this
        # is for what llhttp delivers past the limit all the same)
        if self._body_size > self.max_body:
            raise PayloadTooLargeError(f"request body exceeds the limit of {self.max_body} bytes", close=True)
        self._body.append(body)

    def on_message_complete(self) -> None:
        req = self._req
        assert req is not None
        if self._upgrade and req.content_length > 0:
            # (llhttp ends a request offering an upgrade at its head: its body is read by _upgraded)
            self._upgrade_left = req.content_length
            return
        self._deliver()

    def _deliver(self) -> None:
        req = self._req
        assert req is not None
        body = self._body
        if body:
            req.body = body[0] if len(body) == 1 else b"".join(body)
        self._req = None
        self._chunks = None
        self._in_head = False
        self._head_bytes = 0
        self._ends += 1
        self._sink.on_request(req)


class Response:
    """A response head read from a replica.

    ``forward`` holds the header lines to pass to the client: everything but
    hop-by-hop headers and framing (llmgw frames the client's response itself).
    """

    __slots__ = (
        "chunked",
        "content_length",
        "content_type",
        "dated",
        "event_stream",
        "forward",
        "headers",
        "keep_alive",
        "status",
    )

    def __init__(self) -> None:
        self.status: int = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.forward: bytes = b""
        self.content_length: int = -1
        self.chunked: bool = False
        self.content_type: bytes | None = None
        self.event_stream: bool = False
        self.keep_alive: bool = True
        self.dated: bool = False  # the head has a Date field

    def header(self, name: bytes) -> bytes | None:
        """The first value of header ``name`` (case-insensitive), or ``None``."""
        name = name.lower()
        for n, v in self.headers:
            if n.lower() == name:
                return v
        return None


def _te_chunked(value: bytes) -> bool:
    """Whether a Transfer-Encoding value ends with the token ``chunked``, as llhttp
    reads it: the whole value, or after a comma (``gzip chunked`` and ``x-chunked``
    are not chunked: such a response runs until the connection closes). Spaces
    after the token are ignored but not a tab: llhttp does not take ``chunked\t``
    as chunked (a response so framed runs until close; a request is refused)."""
    v = value.rstrip(b" ").lower()
    if not v.endswith(b"chunked"):
        return False
    rest = v[:-7].rstrip(b" \t")
    return not rest or rest.endswith(b",")


class ResponseSink:
    """What a :class:`ResponseReader` reports to (the data path's upstream
    connection is one; compiled, the reader calls it through C). Any other object
    with ``on_response_head``, ``on_response_body`` and ``on_response_end`` will do."""

    __slots__ = ()

    def on_response_head(self, resp: Response) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not implement on_response_head")

    def on_response_body(self, data: bytes) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not implement on_response_body")

    def on_response_end(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not implement on_response_end")

    def on_response_chunk(self, buf: bytes, chunk_start: int, start: int, end: int) -> None:
        """A whole chunk of a chunked body as it came, ``buf[chunk_start:end + 2]``
        (size line, data, CRLF), inside the read ``buf``; its data is
        ``buf[start:end]``. By default the data goes to on_response_body. (The
        pure reader never calls it: it passes body bytes to on_response_body.)"""
        self.on_response_body(buf[start:end])


class ResponseReader:
    """Reads responses from one upstream connection (sans-IO).

    Args:
        sink: receives ``on_response_head(response)``, ``on_response_body(data)``
            and ``on_response_end()`` for each response in turn.
        max_head_bytes / max_headers: limits on the response head.

    ``feed`` raises ``ValueError`` with the reason when the replica's bytes are not
    valid HTTP; the upstream client turns that into a 502.
    """

    def __init__(self, sink: Any, max_head_bytes: int = 65536, max_headers: int = 200) -> None:
        self._sink = sink
        self._on_head = sink.on_response_head
        self._on_body = sink.on_response_body
        self._on_end = sink.on_response_end
        self.max_head_bytes = max_head_bytes
        self.max_headers = max_headers
        self._parser = httptools.HttpResponseParser(self)
        self._resp: Response | None = None
        self._forward: list[bytes] = []
        self._head_bytes = 0
        self._head_fed = 0
        self._in_head = False
        self._interim = False
        self._too_many = False  # more header lines than max_headers (raised once the head is whole)
        self._connection: list[bytes] | None = None  # Connection values naming more than close/keep-alive

    @property
    def in_message(self) -> bool:
        """Whether a response has started but is not complete yet."""
        return self._resp is not None

    def where(self) -> int:
        """0 between responses, 1 inside a head, 2 past a head (its body is being read)."""
        if self._in_head:
            return 1
        return 0 if self._resp is None else 2

    def feed(self, data: bytes) -> None:
        """Parse ``data``; the sink hears about heads, body bytes and ends.

        Raises:
            ValueError: the replica sent malformed HTTP (or over-limit heads).
        """
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # Unreachable while on_headers_complete rejects 101; kept so that
            # httptools' own exception never reaches the client's protocol.
            raise ValueError("malformed upstream response: unexpected protocol switch") from None
        except httptools.HttpParserError as exc:
            cause = exc.__context__
            if cause is not None and not isinstance(cause, ValueError):
                raise cause from None  # the sink's own error
            raise ValueError(f"malformed upstream response: {cause or exc}") from exc
        if self._in_head:
            # NOTE: counts the whole read once a head is open in it (httptools does
            # not say where in the read the head began); the compiled twin, which
            # frames heads itself, counts the head's own bytes.
            self._head_fed += len(data)
            if self._head_fed > self.max_head_bytes:
                raise ValueError("upstream response head is too large")

    def feed_eof(self) -> bool:
        """The replica closed the connection; returns whether that ended a response.

        A response framed by connection close (no Content-Length, not chunked)
        ends here; any other open response was cut short.
        """
        resp = self._resp
        if resp is None:
            return False
        if not resp.chunked and resp.content_length < 0 and not self._in_head:
            self._resp = None
            self._on_end()
            return True
        return False

    # -- httptools callbacks --

    def on_message_begin(self) -> None:
        self._resp = Response()
        self._too_many = False
        self._forward = []
        self._connection = None
        self._head_bytes = 0
        self._head_fed = 0
        self._in_head = True

    def on_header(self, name: bytes, value: bytes) -> None:
        resp = self._resp
        assert resp is not None
        if not self._in_head:
            return  # a chunked body's trailer fields: not part of the head, not passed on
        raw = value
        if value[-1:] in _OWS:
            value = value.rstrip(b" \t")  # (not part of the value: see RequestReader.on_header)
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > self.max_head_bytes:
            raise ValueError("upstream response head is too large")
        if len(resp.headers) >= self.max_headers:
            # NOTE: raised once the head is whole, as the compiled twin (which reads the
            # fields of a whole head) does: an unfinished head is bounded by its bytes
            # alone. Found by bench/fuzz/fuzz_response.py.
            self._too_many = True
            return
        resp.headers.append((name, value))
        lname = name.lower()
        kind = _KINDS.get(lname, H_OTHER)
        if kind == H_OTHER:
            if lname == b"date":
                resp.dated = True
            self._forward.append(b"%s: %s\r\n" % (name, value))
        elif kind == H_CONTENT_TYPE:
            if resp.content_type is None:
                resp.content_type = value
                resp.event_stream = value[:17].lower() == b"text/event-stream"
            self._forward.append(b"%s: %s\r\n" % (name, value))
        elif kind == H_CONTENT_LENGTH:
            resp.content_length = min(int(value), _MAX_CONTENT_LENGTH)
        elif kind == H_TRANSFER_ENCODING and _te_chunked(raw):  # (the raw value: llhttp's rule on a tab)
            resp.chunked = True
        elif kind == H_CONNECTION and not _plain_connection(value):
            if self._connection is None:
                self._connection = []
            self._connection.append(value)

    def on_headers_complete(self) -> None:
        resp = self._resp
        assert resp is not None
        self._in_head = False
        if self._too_many:
            raise ValueError("upstream response head is too large")
        resp.status = self._parser.get_status_code()
        if resp.status < 100:
            # llhttp takes any three digits; 000-099 is no status at all (RFC 9110 §15)
            # (as an interim response its body would reach the sink with no head)
            raise ValueError(f"status code {resp.status} is not a status")
        if resp.status > 599:
            # RFC 9110 §15: a status is 100-599; llhttp takes any three digits, and a client may
            # not read one past 599 (it was relayed as it came)
            raise ValueError(f"status code {resp.status} is outside 100-599")
        if resp.status < 200:
            if resp.status == 101:
                raise ValueError("the replica switched protocols (101), which llmgw never asks for")
            if resp.status not in _BODILESS_INTERIM:
                # llhttp frames only 100, 102 and 103 as bodiless; another 1xx would
                # have a body (to the close, without framing), and this interim
                # response's bytes would reach the sink with no head. Found by
                # bench/fuzz/fuzz_response.py.
                raise ValueError(f"interim status {resp.status}: llmgw reads 100, 102 and 103 only")
            # NOTE: an interim response (100 Continue, 103 Early Hints) precedes
            # the real one on the same exchange (RFC 9110 §15.2); passing it on
            # as the answer would end the exchange early. It is dropped.
            self._interim = True
            return
        resp.keep_alive = self._parser.should_keep_alive()
        resp.forward = b"".join(self._forward)
        if self._connection is not None:
            resp.forward = _drop_nominated(resp.forward, self._connection)
        if resp.chunked:
            resp.content_length = -1
        self._on_head(resp)

    def on_body(self, body: bytes) -> None:
        self._on_body(body)

    def on_message_complete(self) -> None:
        self._resp = None
        self._head_bytes = 0
        if self._interim:
            self._interim = False
            return
        self._on_end()
