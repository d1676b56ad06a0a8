# cython: language_level=3
"""HTTP/1.1 message handling (compiled twin of ``httpproto_py``; see its docstring)."""

cimport cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.pyport cimport PY_SSIZE_T_MAX
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.string cimport memchr, memcmp, memcpy
from libc.errno cimport EAGAIN, EINTR, errno
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec

cdef extern from *:
    """
    #include <errno.h>
    #include <string.h>
    #include <sys/socket.h>
    #include <sys/uio.h>
    #ifndef MSG_NOSIGNAL
    #define MSG_NOSIGNAL 0
    #endif
    static Py_ssize_t llmgw_sendv(int fd, const char* a, Py_ssize_t na, const char* b, Py_ssize_t nb) {
        struct iovec iov[2];
        struct msghdr msg;
        memset(&msg, 0, sizeof(msg));
        iov[0].iov_base = (void*)a;
        iov[0].iov_len = (size_t)na;
        iov[1].iov_base = (void*)b;
        iov[1].iov_len = (size_t)nb;
        msg.msg_iov = iov;
        msg.msg_iovlen = nb > 0 ? 2 : 1;
        return (Py_ssize_t)sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    }
    """
    int EWOULDBLOCK
    Py_ssize_t llmgw_sendv(int fd, const char* a, Py_ssize_t na, const char* b, Py_ssize_t nb) nogil

import httptools

from llmgw.errors import (
    BadRequestError, HeadersTooLargeError, HTTPError, PayloadTooLargeError, VersionNotSupportedError,
)

# sse_cut and usage_counts moved to jsonscan (they scan an answer's JSON text, not an
# HTTP message); their Python names stay here, as their C names do in httpproto.pxd,
# for code that still imports them from this module.
from llmgw._fast import jsonscan as _jsonscan

sse_cut = _jsonscan.sse_cut
usage_counts = _jsonscan.usage_counts

cdef object HttpParserUpgrade = httptools.HttpParserUpgrade
cdef object HttpParserError = httptools.HttpParserError
cdef object HttpRequestParser = httptools.HttpRequestParser
cdef object HttpResponseParser = httptools.HttpResponseParser

DEFAULT_MAX_HEAD_BYTES = 16 * 1024
DEFAULT_MAX_HEADERS = 100
DEFAULT_MAX_BODY = 16 * 1024 * 1024

# Chunk data spans noted per pass of _frame_chunks (ChunkFraming.spans).
cdef enum:
    _MAX_SPANS = 8

# Heads up to this size are read with a buffer on the C stack.
cdef enum:
    _STACK_HEAD = 4096
cdef bytes _POST = b"POST"
cdef bytes _GET = b"GET"

# Content-Length is clamped to this in both twins (see the twin).
cdef object _MAX_CONTENT_LENGTH = 2**63 - 1

cdef enum HeaderKind:
    H_OTHER = 0
    H_HOP = 1
    H_CONTENT_LENGTH = 2
    H_TRANSFER_ENCODING = 3
    H_CONNECTION = 4
    H_EXPECT = 5
    H_AUTHORIZATION = 6
    H_X_API_KEY = 7
    H_REQUEST_ID = 8
    H_HOST = 9
    H_CONTENT_TYPE = 10

# (every status of the IANA registry: see the twin)
STATUS_REASONS = {
    100: b"Continue", 101: b"Switching Protocols", 102: b"Processing", 103: b"Early Hints",
    200: b"OK", 201: b"Created", 202: b"Accepted", 203: b"Non-Authoritative Information", 204: b"No Content",
    205: b"Reset Content", 206: b"Partial Content", 207: b"Multi-Status", 208: b"Already Reported",
    226: b"IM Used",
    300: b"Multiple Choices", 301: b"Moved Permanently", 302: b"Found", 303: b"See Other", 304: b"Not Modified",
    305: b"Use Proxy", 307: b"Temporary Redirect", 308: b"Permanent Redirect",
    400: b"Bad Request", 401: b"Unauthorized", 402: b"Payment Required", 403: b"Forbidden", 404: b"Not Found",
    405: b"Method Not Allowed", 406: b"Not Acceptable", 407: b"Proxy Authentication Required",
    408: b"Request Timeout", 409: b"Conflict", 410: b"Gone", 411: b"Length Required", 412: b"Precondition Failed",
    413: b"Content Too Large", 414: b"URI Too Long", 415: b"Unsupported Media Type",
    416: b"Range Not Satisfiable", 417: b"Expectation Failed", 421: b"Misdirected Request",
    422: b"Unprocessable Content", 423: b"Locked", 424: b"Failed Dependency", 425: b"Too Early",
    426: b"Upgrade Required", 428: b"Precondition Required", 429: b"Too Many Requests",
    431: b"Request Header Fields Too Large", 451: b"Unavailable For Legal Reasons",
    500: b"Internal Server Error", 501: b"Not Implemented", 502: b"Bad Gateway", 503: b"Service Unavailable",
    504: b"Gateway Timeout", 505: b"HTTP Version Not Supported", 506: b"Variant Also Negotiates",
    507: b"Insufficient Storage", 508: b"Loop Detected", 510: b"Not Extended",
    511: b"Network Authentication Required",
}
cdef dict _STATUS_LINES = {
    code: b"HTTP/1.1 %d %s\r\n" % (code, reason) for code, reason in STATUS_REASONS.items()
}


cdef inline char _lower(char c) noexcept nogil:
    if c >= 65 and c <= 90:
        return c + 32
    return c


cdef inline bint _ieq(const char* s, const char* lit, Py_ssize_t n) noexcept nogil:
    # ``lit`` is lower case; ``s`` any case; both ``n`` bytes long.
    cdef Py_ssize_t i
    for i in range(n):
        if _lower(s[i]) != lit[i]:
            return False
    return True


cdef int _classify(const char* s, Py_ssize_t n) noexcept nogil:
    if n == 14:
        if _ieq(s, b"content-length", 14):
            return H_CONTENT_LENGTH
    elif n == 12:
        if _ieq(s, b"x-request-id", 12):
            return H_REQUEST_ID
        if _ieq(s, b"content-type", 12):
            return H_CONTENT_TYPE
    elif n == 13:
        if _ieq(s, b"authorization", 13):
            return H_AUTHORIZATION
    elif n == 4:
        if _ieq(s, b"host", 4):
            return H_HOST
    elif n == 10:
        if _ieq(s, b"connection", 10):
            return H_CONNECTION
        if _ieq(s, b"keep-alive", 10):
            return H_HOP
    elif n == 17:
        if _ieq(s, b"transfer-encoding", 17):
            return H_TRANSFER_ENCODING
    elif n == 6:
        if _ieq(s, b"expect", 6):
            return H_EXPECT
    elif n == 9:
        if _ieq(s, b"x-api-key", 9):
            return H_X_API_KEY
    elif n == 2:
        if _ieq(s, b"te", 2):
            return H_HOP
    elif n == 7:
        if _ieq(s, b"trailer", 7) or _ieq(s, b"upgrade", 7) or _ieq(s, b"api-key", 7):
            return H_HOP  # (api-key: Azure OpenAI's credential header, see the twin)
    elif n == 16:
        if _ieq(s, b"proxy-connection", 16):
            return H_HOP
    elif n == 19:
        if _ieq(s, b"proxy-authorization", 19):
            return H_HOP
    elif n == 18:
        if _ieq(s, b"proxy-authenticate", 18):
            return H_HOP
    elif n == 15:
        # never passed on (see the twin): upstream_head asks for identity
        if _ieq(s, b"accept-encoding", 15):
            return H_HOP
    return H_OTHER


cdef inline bint _host_ok(const char* s, Py_ssize_t n) noexcept nogil:
    # the bytes a Host value may hold (see the twin's _HOST_BYTES)
    cdef Py_ssize_t i
    cdef unsigned char c
    for i in range(n):
        c = <unsigned char>s[i]
        if (97 <= c <= 122) or (48 <= c <= 58) or (65 <= c <= 93 and c != 92) or c == 45 or c == 46:
            continue  # a-z, 0-9 ":", A-Z "[" "]", "-", "."
        if c == 95 or c == 126 or c == 37 or c == 33 or c == 36 or (38 <= c <= 44) or c == 59 or c == 61:
            continue  # _ ~ % ! $ & ' ( ) * + , ; =
        return False
    return True


cdef inline bint _plain_connection(const char* s, Py_ssize_t nv) noexcept nogil:
    # a Connection value naming nothing but close or keep-alive (the usual case)
    return (nv == 10 and _ieq(s, b"keep-alive", 10)) or (nv == 5 and _ieq(s, b"close", 5))


cdef bytes _drop_nominated(bytes forward, list connection):
    # ``forward`` without the lines the Connection values name (see the twin)
    cdef set names = set()
    for value in connection:
        for token in (<bytes>value).split(b","):
            token = token.strip(b" \t").lower()
            if token and token != b"close" and token != b"keep-alive":
                names.add(token)
    if not names or not forward:
        return forward
    lines = forward.split(b"\r\n")
    return b"".join([ln + b"\r\n" for ln in lines[:len(lines) - 1] if ln.partition(b":")[0].lower() not in names])


cdef bytes _header_line(bytes name, bytes value):
    # b"name: value\r\n" in one allocation.
    cdef Py_ssize_t nn = PyBytes_GET_SIZE(name)
    cdef Py_ssize_t nv = PyBytes_GET_SIZE(value)
    cdef bytes out = PyBytes_FromStringAndSize(NULL, nn + nv + 4)
    cdef char* p = PyBytes_AS_STRING(out)
    memcpy(p, PyBytes_AS_STRING(name), nn)
    p[nn] = 58  # ':'
    p[nn + 1] = 32
    memcpy(p + nn + 2, PyBytes_AS_STRING(value), nv)
    p[nn + 2 + nv] = 13
    p[nn + 3 + nv] = 10
    return out


cdef bytes _status_line(int status):
    line = _STATUS_LINES.get(status)
    if line is None:
        if not 100 <= status <= 999:
            raise ValueError(f"invalid HTTP status {status}")
        line = b"HTTP/1.1 %d Status\r\n" % status
    return <bytes>line


cdef inline void _check_header_value(bytes value) except *:
    cdef const char* p = PyBytes_AS_STRING(value)
    cdef Py_ssize_t i, n = PyBytes_GET_SIZE(value)
    for i in range(n):
        if p[i] == 13 or p[i] == 10:
            raise ValueError("header value contains CR or LF")


cdef inline bytes _slice(bytes buf, Py_ssize_t start, Py_ssize_t end):
    # buf[start:end] (PERF: Cython's slice of bytes goes through a slice object)
    if start == 0 and end == PyBytes_GET_SIZE(buf):
        return buf
    return PyBytes_FromStringAndSize(PyBytes_AS_STRING(buf) + start, end - start)


cdef inline bytes _head_so_far(bytes acc, bytes buf, Py_ssize_t pos):
    # an open head: what earlier reads left of it (acc), then this read from pos
    if PyBytes_GET_SIZE(acc) == 0:
        return _slice(buf, pos, PyBytes_GET_SIZE(buf))
    return acc + _slice(buf, pos, PyBytes_GET_SIZE(buf))


cdef inline char* _put(char* p, bytes b) noexcept:
    cdef Py_ssize_t n = PyBytes_GET_SIZE(b)
    memcpy(p, PyBytes_AS_STRING(b), n)
    return p + n


cdef inline int _digits(char* out, Py_ssize_t n) noexcept nogil:
    # the decimal digits of n >= 0, backwards into out[0:24]; returns how many
    cdef int k = 0
    while True:
        out[k] = 48 + n % 10
        k += 1
        n //= 10
        if n == 0:
            return k


cdef inline char* _put_content_length(char* p, const char* digits, int k) noexcept:
    memcpy(p, b"content-length: ", 16)
    p += 16
    while k > 0:
        k -= 1
        p[0] = digits[k]
        p += 1
    p[0] = 13
    p[1] = 10
    return p + 2


cpdef double monotonic() noexcept:
    """``time.monotonic()``, the clock the data path keeps its deadlines in (see the twin).

    PERF: a C call from the data path, with no Python call and no float object.
    """
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    # (as CPython converts: nanoseconds as a double, over 1e9)
    return <double>(<long long>ts.tv_sec * 1000000000 + ts.tv_nsec) / 1e9


cpdef Py_ssize_t write_now(int fd, bytes a, bytes b=b"") except -2:
    """Write ``a`` then ``b`` to the stream socket ``fd`` as far as it takes them now (see the twin).

    One ``sendmsg`` with both buffers, never blocking and never raising SIGPIPE.
    """
    cdef Py_ssize_t n
    cdef Py_ssize_t nb = PyBytes_GET_SIZE(b) if b is not None else 0
    if a is None:
        raise TypeError("a must be bytes")
    while True:
        n = llmgw_sendv(fd, PyBytes_AS_STRING(a), PyBytes_GET_SIZE(a),
                        PyBytes_AS_STRING(b) if nb else NULL, nb)
        if n >= 0:
            return n
        if errno == EINTR:
            continue
        if errno == EAGAIN or errno == EWOULDBLOCK:
            return 0
        return -1


cpdef bytes response_head(int status, headers=(), Py_ssize_t content_length=-1, bint keep_alive=True,
                  bytes raw=b""):
    """The status line and headers of a response, ending with the blank line."""
    cdef bytes line = _status_line(status)
    cdef bytes name, value, out
    cdef list parts
    cdef char digits[24]
    cdef int k = 0
    cdef Py_ssize_t size
    cdef char* p
    if headers:
        parts = [line]
        for name, value in headers:
            _check_header_value(value)
            parts.append(_header_line(name, value))
        parts.append(raw)
        line = b"".join(parts)
    # PERF: one buffer, written in place (a join takes a buffer view of each part)
    size = PyBytes_GET_SIZE(line) + PyBytes_GET_SIZE(raw if not headers else b"") + 2
    if content_length >= 0:
        k = _digits(digits, content_length)
        size += 18 + k
    elif content_length == -1:
        size += 28
    if not keep_alive:
        size += 19
    out = PyBytes_FromStringAndSize(NULL, size)
    p = _put(PyBytes_AS_STRING(out), line)
    if not headers:
        p = _put(p, raw)
    if content_length >= 0:
        p = _put_content_length(p, digits, k)
    elif content_length == -1:
        memcpy(p, b"transfer-encoding: chunked\r\n", 28)
        p += 28
    if not keep_alive:
        memcpy(p, b"connection: close\r\n", 19)
        p += 19
    p[0] = 13
    p[1] = 10
    return out


cpdef bytes id_line(bytes rid, Py_ssize_t n=-1):
    """The ``x-request-id`` header line (see the twin)."""
    cdef char digits[24]
    cdef int k = _digits(digits, n) if n >= 0 else 0
    cdef bytes out = PyBytes_FromStringAndSize(NULL, 14 + PyBytes_GET_SIZE(rid) + k + 2)
    cdef char* p = PyBytes_AS_STRING(out)
    memcpy(p, b"x-request-id: ", 14)
    p = _put(p + 14, rid)
    while k > 0:
        k -= 1
        p[0] = digits[k]
        p += 1
    p[0] = 13
    p[1] = 10
    return out


# the replica's body is read (usage, errors, events): asked for uncoded
cdef const char* _IDENTITY = b"accept-encoding: identity\r\n"
cdef enum:
    _IDENTITY_LEN = 27


cpdef bytes upstream_head(bytes method, bytes target, bytes host, bytes forward, Py_ssize_t content_length,
                  bytes extra=b""):
    """The request head sent to a replica (see the twin)."""
    cdef char digits[24]
    cdef int k = 0
    cdef Py_ssize_t size = (PyBytes_GET_SIZE(method) + PyBytes_GET_SIZE(target) + PyBytes_GET_SIZE(host)
                            + PyBytes_GET_SIZE(forward) + PyBytes_GET_SIZE(extra) + 1 + 17 + 2 + _IDENTITY_LEN + 2)
    cdef bytes out
    cdef char* p
    if content_length >= 0:
        k = _digits(digits, content_length)
        size += 18 + k
    out = PyBytes_FromStringAndSize(NULL, size)
    p = _put(PyBytes_AS_STRING(out), method)
    p[0] = 32
    p = _put(p + 1, target)
    memcpy(p, b" HTTP/1.1\r\nhost: ", 17)
    p = _put(p + 17, host)
    p[0] = 13
    p[1] = 10
    memcpy(p + 2, _IDENTITY, _IDENTITY_LEN)
    p = _put(p + 2 + _IDENTITY_LEN, forward)
    p = _put(p, extra)
    if content_length >= 0:
        p = _put_content_length(p, digits, k)
    p[0] = 13
    p[1] = 10
    return out


def chunk_head(Py_ssize_t size):
    """The size line that opens one chunk of a chunked body."""
    return b"%x\r\n" % size


cdef const char* _HEX = b"0123456789abcdef"


cpdef bytes chunk(bytes data):
    """``data`` framed as one chunk of a chunked body, one object (see the twin)."""
    cdef Py_ssize_t n = PyBytes_GET_SIZE(data)
    cdef char digits[16]
    cdef int k = 0
    cdef size_t v = <size_t>n
    cdef bytes out
    cdef char* p
    while True:
        digits[k] = _HEX[v & 15]
        k += 1
        v >>= 4
        if v == 0:
            break
    out = PyBytes_FromStringAndSize(NULL, k + 2 + n + 2)
    p = PyBytes_AS_STRING(out)
    while k > 0:
        k -= 1
        p[0] = digits[k]
        p += 1
    p[0] = 13
    p[1] = 10
    memcpy(p + 2, PyBytes_AS_STRING(data), n)
    p[n + 2] = 13
    p[n + 3] = 10
    return out


cdef Py_ssize_t _field(const char* s, Py_ssize_t pos, Py_ssize_t end, Py_ssize_t* start, Py_ssize_t* nn,
                       Py_ssize_t* vs, Py_ssize_t* eol) noexcept nogil:
    # The next header line at or after pos in a head that ends at end (with the
    # blank line), as llhttp's callbacks give it: its name s[start:start+nn], its
    # value s[vs:eol] (eol: past its last byte that is not OWS). Returns where the line after it
    # starts; -1: no more. Lines without a colon are skipped (llhttp refuses a
    # head with one; what is read of it then does not matter).
    cdef Py_ssize_t e, colon, v, ve
    while pos < end - 2:
        e = _eol(s, pos, end) - 1
        if e < pos:
            return -1
        colon = pos
        while colon < e and s[colon] != 58:
            colon += 1
        if colon < e:
            v = colon + 1
            while v < e and _ows(s[v]):
                v += 1
            start[0] = pos
            nn[0] = colon - pos
            vs[0] = v
            # the value ends before trailing OWS (RFC 9112 §5: OWS field-value OWS)
            ve = e
            if _ows(s[ve - 1]):  # (rare: one test per field otherwise)
                while ve > v and _ows(s[ve - 1]):
                    ve -= 1
            eol[0] = ve
            return e + 2
        pos = e + 2
    return -1


cdef long long _length_value(const char* s, Py_ssize_t vs, Py_ssize_t eol) noexcept nogil:
    # a Content-Length value (trailing OWS allowed; clamped); -1: not digits
    cdef long long cl = 0
    cdef Py_ssize_t k
    while eol > vs and _ows(s[eol - 1]):
        eol -= 1
    if eol == vs:
        return -1
    for k in range(vs, eol):
        if not 48 <= s[k] <= 57:
            return -1
        if cl < 100000000000000000LL:
            cl = cl * 10 + (s[k] - 48)
        else:
            cl = 0x7FFFFFFFFFFFFFFF
    return cl


cdef inline Py_ssize_t _put_field(char* fw, Py_ssize_t at, const char* name, Py_ssize_t nn, const char* value,
                                  Py_ssize_t nv) noexcept nogil:
    # "name: value" CRLF written at fw + at; returns the new end
    memcpy(fw + at, name, nn)
    fw[at + nn] = 58
    fw[at + nn + 1] = 32
    memcpy(fw + at + nn + 2, value, nv)
    fw[at + nn + 2 + nv] = 13
    fw[at + nn + 3 + nv] = 10
    return at + nn + nv + 4


cdef list _field_list(bytes raw, Py_ssize_t pos, Py_ssize_t end):
    # the (name, value) pairs of the header lines in raw[pos:end], as llhttp's
    # callbacks give them
    cdef const char* s = PyBytes_AS_STRING(raw)
    cdef Py_ssize_t start, nn, vs, eol
    cdef list out = []
    while True:
        pos = _field(s, pos, end, &start, &nn, &vs, &eol)
        if pos < 0:
            return out
        out.append((PyBytes_FromStringAndSize(s + start, nn), PyBytes_FromStringAndSize(s + vs, eol - vs)))


@cython.final
@cython.freelist(32)
cdef class Request:
    """One HTTP request as the server read it (see the twin)."""

    def __cinit__(self):
        self.method = b""
        self.target = b""
        self.version = b"1.1"
        self._headers = None
        self._raw = None
        self.forward = b""
        self.keep_alive = True
        self.content_length = -1
        self.expect_continue = False
        self.authorization = None
        self.x_api_key = None
        self.request_id = None
        self.priority = None
        self.host = None
        self.content_type = None
        self.body = b""

    @property
    def headers(self):
        """``[(name, value)]`` as received (PERF: read off the head when first asked for)."""
        if self._headers is None:
            self._headers = [] if self._raw is None else _field_list(self._raw, self._raw_start, self._raw_end)
        return self._headers

    @headers.setter
    def headers(self, list value):
        self._headers = value

    @property
    def path(self):
        """The target without its query string."""
        q = self.target.find(b"?")
        return self.target if q < 0 else self.target[:q]

    def header(self, bytes name):
        """The first value of header ``name`` (case-insensitive), or ``None``."""
        name = name.lower()
        for n, v in self.headers:
            if n.lower() == name:
                return v
        return None

    def __repr__(self):
        return f"<Request {self.method.decode('latin-1')} {self.target!r}>"


@cython.final
@cython.freelist(32)
cdef class Response:
    """A response head read from a replica (see the twin)."""

    def __cinit__(self):
        self.status = 0
        self._headers = None
        self._raw = None
        self.forward = b""
        self.content_length = -1
        self.chunked = False
        self.content_type = None
        self.event_stream = False
        self.keep_alive = True
        self.dated = False

    @property
    def headers(self):
        """``[(name, value)]`` as received (PERF: read off the head when first asked for)."""
        if self._headers is None:
            self._headers = [] if self._raw is None else _field_list(self._raw, self._raw_start, self._raw_end)
        return self._headers

    @headers.setter
    def headers(self, list value):
        self._headers = value

    def header(self, bytes name):
        """The first value of header ``name`` (case-insensitive), or ``None``."""
        name = name.lower()
        for n, v in self.headers:
            if n.lower() == name:
                return v
        return None


cdef inline Py_ssize_t _eol(const char* s, Py_ssize_t start, Py_ssize_t n) noexcept nogil:
    # index of the next LF at or after ``start``; -1: none (memchr is vectorised)
    cdef const char* hit = <const char*>memchr(s + start, 10, <size_t>(n - start))
    return -1 if hit == NULL else hit - s


cdef Py_ssize_t _head_end(const char* s, Py_ssize_t start, Py_ssize_t n) noexcept nogil:
    # index just past the first CRLF CRLF at or after ``start``; -1: not yet
    cdef Py_ssize_t i = start
    while i < n:
        i = _eol(s, i, n)
        if i < 0:
            return -1
        # s[i] is LF: a blank line follows it if CR LF comes next (and CR before)
        if i + 2 < n and s[i + 1] == 13 and s[i + 2] == 10:
            if i >= 1 and s[i - 1] == 13:
                return i + 3
            if memchr(s, 10, <size_t>i) == NULL:
                # the first line ended by a bare LF: llhttp takes that for an HTTP/0.9
                # request line (and refuses it), and the blank line after it ends the head
                return i + 3
        i += 1
    return -1


cdef inline int _hex_digit(char c) noexcept nogil:
    if 48 <= c <= 57:
        return c - 48
    if 97 <= c <= 102:
        return c - 87
    if 65 <= c <= 70:
        return c - 55
    return -1


cdef inline bint _ows(char c) noexcept nogil:
    return c == 32 or c == 9


cdef bint _te_chunked(const char* s, Py_ssize_t vs, Py_ssize_t ve) noexcept nogil:
    # whether the Transfer-Encoding value s[vs:ve] ends with the token "chunked"
    # (trailing spaces aside), as llhttp reads it: the whole value, or after a
    # comma. NOTE: llhttp takes spaces after the token but not a tab ("chunked\t"
    # frames a response by close, and is refused in a request): so does this.
    while ve > vs and s[ve - 1] == 32:
        ve -= 1
    if ve - vs < 7 or not _ieq(s + ve - 7, b"chunked", 7):
        return False
    ve -= 7
    while ve > vs and _ows(s[ve - 1]):
        ve -= 1
    return ve == vs or s[ve - 1] == 44


cdef bint _te_only_chunked(const char* s, Py_ssize_t vs, Py_ssize_t ve) noexcept nogil:
    # whether the Transfer-Encoding value s[vs:ve] is "chunked" alone (OWS aside)
    while ve > vs and _ows(s[ve - 1]):
        ve -= 1
    while vs < ve and _ows(s[vs]):
        vs += 1
    return ve - vs == 7 and _ieq(s + vs, b"chunked", 7)


cdef object _unsupported_coding():
    return HTTPError(
        "unsupported Transfer-Encoding: llmgw reads chunked request bodies only", status=501,
        type="invalid_request_error", code="unsupported_transfer_coding", close=True, should_retry=False,
    )


cdef object _upgrade_with_chunks():
    return BadRequestError(
        "a request offering a protocol upgrade (Upgrade:) with a chunked body is not supported: send it "
        "without Upgrade, or with Content-Length", close=True,
    )


cdef object _connect_refused():
    # 405 to CONNECT, and close (see the twin)
    return HTTPError(
        "CONNECT is not supported: llmgw is an HTTP API gateway, not a forward proxy", status=405,
        type="invalid_request_error", code="method_not_allowed", close=True,
        headers=((b"allow", b"GET, HEAD, POST"),),
    )


cdef object _te_in_http10():
    # RFC 9112 §6.1 (see the twin)
    return BadRequestError(
        "malformed HTTP request: Transfer-Encoding in an HTTP/1.0 request (RFC 9112 §6.1)", close=True,
    )


cdef object _framing_error(ChunkFraming* f, Py_ssize_t code):
    # the answer to a chunked request body past a limit (_frame_chunks' code; see the twin)
    if code == -2:
        return BadRequestError("malformed HTTP request: chunk size too large", close=True)
    if code == -4:
        return PayloadTooLargeError(
            f"request body is at least {f.declared + f.left} bytes (its chunk sizes); the limit is {f.max_body}",
            close=True,
        )
    if code == -5:
        return HeadersTooLargeError("request trailer section is too large", close=True)
    return HeadersTooLargeError("too many request trailer fields", close=True)


cdef enum:
    # how the open response's body ends (after the head)
    B_NONE = 0        # no body: the head ends it
    B_LENGTH = 1      # Content-Length bytes
    B_CHUNKED = 2     # the last chunk (framed by _frame_chunks)
    B_CLOSE = 3       # the connection closing

cdef enum:
    # chunk framing states
    C_SIZE = 0        # in a chunk-size line (digits, then extensions), until LF
    C_DATA = 1        # chunk data (_chunk_left bytes)
    C_DATA_END = 2    # the CRLF after chunk data, until LF
    C_TRAILER = 3     # at the start of a trailer line (or the final empty line)
    C_TRAILER_LINE = 4  # in a trailer line, until LF
    C_FINAL_LF = 5    # the final empty line's LF


cdef Py_ssize_t _frame_chunks(ChunkFraming* f, const char* s, Py_ssize_t pos, Py_ssize_t n) noexcept nogil:
    # where the chunked body ends in s[pos:n] (the index past it); -1: not yet
    # (all of it read); -2: a chunk size past 2**58 (llhttp validates the rest of
    # the framing); -3: f.spans is full, read up to f.stop. With f.record the
    # chunk data read is noted in f.spans ((start, end) pairs, f.nspans of them).
    # Limits (the twin's _ChunkFraming.frame, byte for byte), read up to f.stop:
    # -4: the chunk sizes pass f.max_body (stop: past that size line); -5: the
    # trailer section passes f.max_trailer bytes (stop: at the byte that did);
    # -6: it passes f.max_lines lines (stop: at the first byte of the one that did).
    cdef char c
    cdef int d
    while pos < n:
        c = s[pos]
        if f.state == C_SIZE:
            pos += 1
            f.boundary = False
            if c == 10:
                if f.left > f.max_body - f.declared:
                    f.stop = pos
                    return -4
                f.declared += f.left
                f.state = C_TRAILER if f.left == 0 else C_DATA
                f.in_ext = False
            elif not f.in_ext:
                d = _hex_digit(c)
                if d < 0:
                    f.in_ext = True  # CR, or extensions: the size is read
                elif f.left > (<Py_ssize_t>1 << 58):
                    return -2
                else:
                    f.left = f.left * 16 + d
        elif f.state == C_DATA:
            if f.record:
                if f.nspans == _MAX_SPANS:
                    f.stop = pos
                    return -3
                f.spans[2 * f.nspans] = pos
            if n - pos >= f.left:
                pos += f.left
                f.left = 0
                f.state = C_DATA_END
            else:
                f.left -= n - pos
                pos = n
            if f.record:
                f.spans[2 * f.nspans + 1] = pos
                f.nspans += 1
        elif f.state == C_DATA_END:
            pos += 1
            if c == 10:
                f.state = C_SIZE
                f.boundary = True
        else:  # C_TRAILER, C_FINAL_LF, C_TRAILER_LINE: the trailer section, bounded
            pos += 1
            f.trailer += 1
            if f.trailer > f.max_trailer:
                f.stop = pos - 1
                return -5
            if f.state == C_TRAILER_LINE:
                if c == 10:
                    f.state = C_TRAILER
            elif c == 10:
                f.state = C_SIZE
                return pos
            elif f.state == C_TRAILER and c == 13:
                f.state = C_FINAL_LF
            else:
                f.lines += 1
                if f.lines > f.max_lines:
                    f.stop = pos - 1
                    return -6
                f.state = C_TRAILER_LINE
    return -1


cdef inline void _chunks_reset(ChunkFraming* f) noexcept nogil:
    # (the limits are the reader's, set apart)
    f.state = C_SIZE
    f.left = 0
    f.in_ext = False
    f.nspans = 0
    f.boundary = True
    f.declared = 0
    f.trailer = 0
    f.lines = 0


cdef inline void _chunks_unbounded(ChunkFraming* f) noexcept nogil:
    # a response's body: llmgw does not bound what a replica sends this way
    f.max_body = PY_SSIZE_T_MAX
    f.max_trailer = PY_SSIZE_T_MAX
    f.max_lines = PY_SSIZE_T_MAX


cdef Py_ssize_t _plain_chunks(ChunkFraming* f, const char* s, Py_ssize_t pos, Py_ssize_t n) noexcept nogil:
    # From a chunk boundary: the end of the run of whole plain chunks in s[pos:n]
    # (size line of hex digits and CRLF, size > 0, data, CRLF), their data noted
    # in f.spans; it stops before anything else (extensions, the last chunk, a
    # chunk not all here) and when f.spans is full. llhttp accepts such chunks
    # whatever they hold and is back where it was after each one, so they need
    # not go through it: the usual SSE event is one plain chunk per read.
    cdef Py_ssize_t i, size, end
    cdef int d, k
    while f.nspans < _MAX_SPANS:
        i = pos
        size = 0
        k = 0
        while i < n and k < 15:
            d = _hex_digit(s[i])
            if d < 0:
                break
            size = size * 16 + d
            i += 1
            k += 1
        if k == 0 or size == 0 or i + 2 > n or s[i] != 13 or s[i + 1] != 10:
            return pos
        end = i + 2 + size
        if end + 2 > n or s[end] != 13 or s[end + 1] != 10:
            return pos
        f.spans[2 * f.nspans] = i + 2
        f.spans[2 * f.nspans + 1] = end
        f.nspans += 1
        pos = end + 2
    return pos


cdef class ResponseSink:
    """What a :class:`ResponseReader` reports to, through C (abstract: the data
    path's upstream connection is a subclass). Any other object with
    ``on_response_head``, ``on_response_body`` and ``on_response_end`` will do:
    the reader wraps it in a :class:`_MethodSink`."""

    cpdef on_response_head(self, Response resp):
        raise NotImplementedError(f"{type(self).__name__} does not implement on_response_head")

    cpdef on_response_body(self, data):
        raise NotImplementedError(f"{type(self).__name__} does not implement on_response_body")

    cpdef on_response_end(self):
        raise NotImplementedError(f"{type(self).__name__} does not implement on_response_end")

    cpdef on_response_chunk(self, bytes buf, Py_ssize_t chunk_start, Py_ssize_t start, Py_ssize_t end):
        """A whole chunk of a chunked body as it came, ``buf[chunk_start:end + 2]``
        (size line, data, CRLF), inside the read ``buf``; its data is
        ``buf[start:end]``. By default the data goes to on_response_body."""
        self.on_response_body(buf[start:end])


@cython.final
cdef class _MethodSink(ResponseSink):
    """A sink that is not a :class:`ResponseSink`, through its bound methods."""

    cdef object _head, _body, _end

    def __init__(self, sink):
        self._head = sink.on_response_head
        self._body = sink.on_response_body
        self._end = sink.on_response_end

    cpdef on_response_head(self, Response resp):
        self._head(resp)

    cpdef on_response_body(self, data):
        self._body(data)

    cpdef on_response_end(self):
        self._end()


@cython.final
cdef class ResponseReader:
    """Reads responses from one upstream connection (see the twin).

    PERF: unlike the twin, this one takes no per-header callbacks from httptools
    (each costs two bytes objects and a Python call). It frames each head itself
    (up to the blank line), reads the header lines from those bytes, then feeds
    httptools exactly the bytes of one message, which validate them (llhttp,
    strict) and frame the body. Where its framing and httptools' disagree the
    response is malformed.
    """

    def __init__(self, sink, Py_ssize_t max_head_bytes=65536, Py_ssize_t max_headers=200):
        self._sink = sink if isinstance(sink, ResponseSink) else _MethodSink(sink)  # PERF: called through C
        self.max_head_bytes = max_head_bytes
        self.max_headers = max_headers
        self._parser = HttpResponseParser(self)
        self._feed_data = self._parser.feed_data
        self._resp = None
        self._next = None
        self._acc = b""
        self._want_head = True
        self._body = B_NONE
        self._body_left = 0
        _chunks_reset(&self._chunks)
        _chunks_unbounded(&self._chunks)
        self._chunks.record = True  # (the body goes to the sink from these spans)
        self._interim = False
        self._complete = False

    @property
    def in_message(self):
        """Whether a response has started but is not complete yet."""
        return self.where() != 0

    cpdef int where(self):
        """0 between responses, 1 inside a head, 2 past a head (its body is being read)."""
        if PyBytes_GET_SIZE(self._acc) > 0:
            return 1
        return 2 if self._resp is not None else 0

    cpdef feed(self, data):
        """Parse ``data``; the sink hears about heads, body bytes and ends.

        PERF: body bytes go to the sink from this reader's own framing once
        httptools has accepted the bytes that hold them (no on_body callback
        through httptools); if it refuses a read, none of that read's body bytes
        are passed on.
        """
        cdef bytes buf = data if type(data) is bytes else bytes(data)
        cdef Py_ssize_t n = PyBytes_GET_SIZE(buf)
        cdef const char* s = PyBytes_AS_STRING(buf)
        cdef Py_ssize_t pos = 0
        cdef Py_ssize_t base, e, take, stop, start
        cdef bytes head
        cdef ChunkFraming* f = &self._chunks
        while pos < n:
            if self._want_head:
                if PyBytes_GET_SIZE(self._acc) == 0 and (s[pos] == 13 or s[pos] == 10):
                    # empty lines before a status line are skipped, as llhttp (and so
                    # the twin) skips them: a replica's stray CRLF after a body
                    start = pos
                    while pos < n and (s[pos] == 13 or s[pos] == 10):
                        pos += 1
                    self._llhttp(buf, start, pos)
                    if pos == n:
                        return
                base = PyBytes_GET_SIZE(self._acc)
                head = _head_so_far(self._acc, buf, pos)
                e = _head_end(PyBytes_AS_STRING(head), base - 3 if base > 3 else 0, PyBytes_GET_SIZE(head))
                if e < 0:
                    if PyBytes_GET_SIZE(head) > self.max_head_bytes:
                        raise ValueError("upstream response head is too large")
                    self._acc = head
                    self._llhttp(buf, pos, n)  # (it refuses garbage before the head ends)
                    return
                self._acc = b""
                take = e - base  # this feed's share of the head
                self._next = self._read_head(head, e)
                self._want_head = False
                self._complete = False
                if self._body == B_NONE:
                    self._llhttp(buf, pos, pos + take)
                    pos += take
                    self._ended()
                    continue
                if self._body == B_LENGTH and self._body_left <= n - pos - take:
                    # PERF: the usual case, head and body in one read: one feed
                    stop = pos + take + self._body_left
                    self._body_left = 0
                    self._llhttp(buf, pos, stop)
                    self._deliver(buf, pos + take, stop)
                    pos = stop
                    self._ended()
                    continue
                self._llhttp(buf, pos, pos + take)
                pos += take
                continue
            # body bytes of the open response
            if self._body == B_CLOSE:
                self._llhttp(buf, pos, n)
                self._deliver(buf, pos, n)
                return
            if self._body == B_LENGTH:
                take = self._body_left if self._body_left < n - pos else n - pos
                self._body_left -= take
                self._llhttp(buf, pos, pos + take)
                self._deliver(buf, pos, pos + take)
                pos += take
                if self._body_left == 0:
                    self._ended()
                continue
            f.nspans = 0
            if f.boundary and f.state == C_SIZE:
                # PERF: whole plain chunks go straight to the sink (see _plain_chunks)
                stop = _plain_chunks(f, PyBytes_AS_STRING(buf), pos, n)
                if stop > pos:
                    for e in range(f.nspans):
                        # the chunk as it came (a valid chunk for the client too),
                        # told by where it lies in the read: no copy
                        base = pos if e == 0 else f.spans[2 * e - 1] + 2
                        self._sink.on_response_chunk(buf, base, f.spans[2 * e], f.spans[2 * e + 1])
                    pos = stop
                    f.nspans = 0
                    continue
            take = _frame_chunks(f, PyBytes_AS_STRING(buf), pos, n)
            if take == -2 or take == -4:  # (-4: sizes past PY_SSIZE_T_MAX in all)
                raise ValueError("malformed upstream response: chunk size too large")
            stop = take if take >= 0 else (n if take == -1 else f.stop)
            self._llhttp(buf, pos, stop)
            pos = stop
            for e in range(f.nspans):
                self._deliver(buf, f.spans[2 * e], f.spans[2 * e + 1])
            f.nspans = 0
            if take >= 0:
                self._ended()
            elif take == -1:
                return

    cdef int _deliver(self, bytes buf, Py_ssize_t start, Py_ssize_t end) except -1:
        if end > start:
            self._sink.on_response_body(_slice(buf, start, end))
        return 0

    cdef int _llhttp(self, bytes buf, Py_ssize_t start, Py_ssize_t end) except -1:
        if end <= start:
            return 0
        try:
            self._feed_data(_slice(buf, start, end))
        except HttpParserUpgrade:
            raise ValueError("malformed upstream response: unexpected protocol switch") from None
        except HttpParserError as exc:
            cause = exc.__context__
            if cause is not None and not isinstance(cause, ValueError):
                raise cause from None
            raise ValueError(f"malformed upstream response: {cause or exc}") from exc
        return 0

    cdef int _ended(self) except -1:
        # our framing says the message ended: httptools must agree
        if not self._complete:
            raise ValueError("malformed upstream response: the message does not end where its framing says")
        self._want_head = True
        if self._interim:
            self._interim = False
            return 0
        self._resp = None
        self._sink.on_response_end()
        return 0

    cdef Response _read_head(self, bytes head, Py_ssize_t end):
        """The response head ``head[:end]`` (ending with the blank line), read as
        the twin's header callbacks would; sets how its body is framed."""
        cdef const char* s = PyBytes_AS_STRING(head)
        cdef Py_ssize_t pos, eol, fs, vs, nn, nv, k
        cdef Py_ssize_t header_bytes = 0
        cdef Py_ssize_t fwlen = 0
        cdef char* fw
        cdef int kind, status = 0
        cdef long long cl
        cdef bint chunked = False, has_te = False
        cdef Response resp = Response.__new__(Response)
        cdef bytes value
        cdef list connection = None
        cdef Py_ssize_t count = 0
        cdef char stack[_STACK_HEAD]
        # status line: HTTP/x.y SP 3DIGIT ... (CRLF line ends: httptools checks)
        eol = _eol(s, 0, end) - 1
        if eol >= 12 and s[8] == 32:
            for k in range(9, 12):
                if 48 <= s[k] <= 57:
                    status = status * 10 + (s[k] - 48)
                else:
                    status = 0
                    break
        resp.status = status
        resp._raw = head
        resp._raw_start = eol + 2
        resp._raw_end = end
        fw = &stack[0] if end <= _STACK_HEAD else <char*>PyMem_Malloc(end)
        if fw == NULL:
            raise MemoryError()
        try:
            pos = eol + 2
            while True:
                pos = _field(s, pos, end, &fs, &nn, &vs, &eol)
                if pos < 0:
                    break
                nv = eol - vs
                header_bytes += nn + nv + 4
                if header_bytes > self.max_head_bytes or count >= self.max_headers:
                    raise ValueError("upstream response head is too large")
                count += 1
                kind = _classify(s + fs, nn)
                if kind == H_OTHER or kind == H_CONTENT_TYPE:
                    if nn == 4 and kind == H_OTHER and _ieq(s + fs, b"date", 4):
                        resp.dated = True
                    elif kind == H_CONTENT_TYPE and resp.content_type is None:
                        value = PyBytes_FromStringAndSize(s + vs, nv)
                        resp.content_type = value
                        resp.event_stream = nv >= 17 and _ieq(s + vs, b"text/event-stream", 17)
                    fwlen = _put_field(fw, fwlen, s + fs, nn, s + vs, nv)
                elif kind == H_CONTENT_LENGTH:
                    cl = _length_value(s, vs, eol)
                    if cl >= 0:
                        resp.content_length = cl
                elif kind == H_TRANSFER_ENCODING:
                    has_te = True
                    chunked = _te_chunked(s, vs, pos - 2)  # (the raw value: llhttp's rule on a tab)
                elif kind == H_CONNECTION and not _plain_connection(s + vs, nv):
                    if connection is None:
                        connection = []
                    connection.append(PyBytes_FromStringAndSize(s + vs, nv))
            resp.forward = PyBytes_FromStringAndSize(fw, fwlen)
        finally:
            if fw != &stack[0]:
                PyMem_Free(fw)
        if connection is not None:
            resp.forward = _drop_nominated(resp.forward, connection)
        resp.chunked = chunked
        # how the body ends (RFC 9112 section 6.3), as llhttp frames it
        if status < 200 or status == 204 or status == 304:
            self._body = B_NONE
        elif chunked:
            self._body = B_CHUNKED
            _chunks_reset(&self._chunks)
        elif has_te:
            self._body = B_CLOSE
        elif resp.content_length >= 0:
            self._body = B_LENGTH if resp.content_length > 0 else B_NONE
            self._body_left = resp.content_length
        else:
            self._body = B_CLOSE
        return resp

    def feed_eof(self):
        """The replica closed the connection; returns whether that ended a response."""
        cdef Response resp = self._resp
        if resp is None:
            return False
        if not resp.chunked and resp.content_length < 0:
            self._resp = None
            self._sink.on_response_end()
            return True
        return False

    def on_headers_complete(self):
        # httptools has validated the head read by _read_head
        cdef Response resp = self._next
        self._next = None
        if resp is None:
            raise ValueError("a response head that was not framed")
        if resp.status < 100:
            # llhttp takes any three digits; 000-099 is no status at all (RFC 9110 §15)
            raise ValueError(f"status code {self._parser.get_status_code()} is not a status")
        if resp.status > 599:  # (RFC 9110 §15: see the twin)
            raise ValueError(f"status code {resp.status} is outside 100-599")
        if resp.status < 200:
            if resp.status == 101:
                raise ValueError("the replica switched protocols (101), which llmgw never asks for")
            if resp.status != 100 and resp.status != 102 and resp.status != 103:
                # (see the twin: llhttp would read a body for it)
                raise ValueError(f"interim status {resp.status}: llmgw reads 100, 102 and 103 only")
            self._interim = True  # 1xx: dropped (see the twin)
            return
        self._resp = resp
        resp.keep_alive = self._parser.should_keep_alive()
        if resp.chunked:
            resp.content_length = -1
        self._sink.on_response_head(resp)

    def on_message_complete(self):
        self._complete = True  # (the end goes to the sink from _ended, after the body)


cdef class RequestSink:
    """What a :class:`RequestReader` hands its requests to (see the twin)."""

    cpdef on_request(self, Request request):
        raise NotImplementedError

    cpdef on_head(self, Request request):
        pass


@cython.final
cdef class _CallbackSink(RequestSink):
    """A sink made of two callables (``on_head`` may be ``None``)."""

    cdef object _on_request
    cdef object _on_head

    def __init__(self, on_request, on_head):
        self._on_request = on_request
        self._on_head = on_head

    cpdef on_request(self, Request request):
        self._on_request(request)

    cpdef on_head(self, Request request):
        if self._on_head is not None:
            self._on_head(request)


@cython.final
cdef class RequestReader:
    """Reads pipelined HTTP/1.1 requests from one connection (see the twin).

    PERF: like :class:`ResponseReader`, it takes no per-header callbacks from
    httptools (each cost two bytes objects and a Python call). It frames each head
    itself (up to the blank line), reads the request line and header fields from
    those bytes, then feeds httptools exactly the bytes of one message, which
    validate them (llhttp, strict) and deliver the body. What llhttp refuses is
    refused before any field check, as in the twin; where its framing and this
    one's disagree the request is malformed.
    """

    def __init__(self, on_request, on_head=None, Py_ssize_t max_head_bytes=DEFAULT_MAX_HEAD_BYTES,
                 Py_ssize_t max_headers=DEFAULT_MAX_HEADERS, Py_ssize_t max_body=DEFAULT_MAX_BODY,
                 bytes priority_header=b"x-llmgw-priority"):
        # PERF: a RequestSink (the server's protocol) is called through C
        self._sink = on_request if isinstance(on_request, RequestSink) else _CallbackSink(on_request, on_head)
        self.max_head_bytes = max_head_bytes
        self.max_headers = max_headers
        self.max_body = max_body
        self._priority_header = priority_header.lower()
        self._parser = HttpRequestParser(self)
        self._feed_data = self._parser.feed_data
        self._req = None
        self._next = None
        self._acc = b""
        self._want_head = True
        self._body = B_NONE
        self._body_left = 0
        _chunks_reset(&self._chunks)
        self._chunks.record = True  # (the body is read off these spans; the limits are set per body)
        self._complete = False
        self._error = None
        self._version_known = False
        self._check_upgrade = False
        self._connection = False
        self._parts = []
        self._body_size = 0
        self._dead = False
        self._upgrading = False
        self._drop_rest = False

    @property
    def in_message(self):
        """Whether a request has started but is not complete yet."""
        return self.where() != 0

    @property
    def in_head(self):
        """Whether a request's head has started but is not complete yet."""
        return self.where() == 1

    cpdef int where(self):
        """0 between requests, 1 inside a head, 2 past a head (its body is being read)."""
        if PyBytes_GET_SIZE(self._acc) > 0:
            return 1
        return 0 if self._want_head else 2

    cpdef Request current(self):
        """The request past its (accepted) head, or that an error refused after it (see the twin)."""
        return self._req

    cpdef feed(self, data):
        """Parse ``data``; complete requests go to ``on_request`` as they finish."""
        if self._drop_rest:
            return None
        if self._dead:
            raise BadRequestError("connection is closing after a malformed request", close=True)
        try:
            self._feed(data if type(data) is bytes else bytes(data))
        except BaseException:
            self._dead = True
            raise

    cdef int _feed(self, bytes buf) except -1:
        cdef Py_ssize_t n = PyBytes_GET_SIZE(buf)
        cdef const char* s = PyBytes_AS_STRING(buf)
        cdef Py_ssize_t pos = 0
        cdef Py_ssize_t base, e, take, start, stop, size
        cdef bytes head
        cdef ChunkFraming* f = &self._chunks
        while pos < n:
            if self._drop_rest:
                return 0  # (past a request offering an upgrade: see the twin)
            if self._want_head:
                if PyBytes_GET_SIZE(self._acc) == 0:
                    # empty lines before a request line are skipped (llhttp does too)
                    start = pos
                    while pos < n and (s[pos] == 13 or s[pos] == 10):
                        pos += 1
                    if pos > start:
                        self._llhttp(buf, start, pos)
                        if pos == n:
                            return 0
                base = PyBytes_GET_SIZE(self._acc)
                head = _head_so_far(self._acc, buf, pos)
                e = _head_end(PyBytes_AS_STRING(head), base - 3 if base > 3 else 0, PyBytes_GET_SIZE(head))
                if e < 0:
                    self._acc = head
                    self._llhttp(buf, pos, n)  # (it refuses garbage before the head ends)
                    if PyBytes_GET_SIZE(head) > self.max_head_bytes:
                        if _eol(PyBytes_AS_STRING(head), 0, PyBytes_GET_SIZE(head)) < 0:
                            raise HeadersTooLargeError("request line is too long", close=True)
                        raise HeadersTooLargeError("request head is too large", close=True)
                    return 0
                self._acc = b""
                take = e - base  # this feed's share of the head
                self._next = self._read_head(head, e)
                self._want_head = False
                self._complete = False
                if self._body == B_NONE:
                    self._llhttp(buf, pos, pos + take)
                    pos += take
                    self._ended()
                    continue
                if self._body == B_LENGTH and self._body_left <= n - pos - take:
                    # PERF: the usual case, head and body in one read: one feed
                    stop = pos + take + self._body_left
                    self._body_left = 0
                    self._llhttp(buf, pos, stop)
                    self._add_body(buf, pos + take, stop)
                    pos = stop
                    self._ended()
                    continue
                self._llhttp(buf, pos, pos + take)
                pos += take
                if self._next is not None:
                    raise BadRequestError("malformed HTTP request: the head does not end where it seems to", close=True)
                continue
            # body bytes of the open request
            if self._body == B_LENGTH:
                take = self._body_left if self._body_left < n - pos else n - pos
                self._body_left -= take
                self._llhttp(buf, pos, pos + take)
                self._add_body(buf, pos, pos + take)
                pos += take
                if self._body_left == 0:
                    self._ended()
                continue
            f.nspans = 0
            take = _frame_chunks(f, s, pos, n)
            if take == -2:
                raise _framing_error(f, take)
            if take <= -4:
                # (llhttp's verdict on the bytes before comes first, as in the twin)
                self._llhttp(buf, pos, f.stop)
                raise _framing_error(f, take)
            # NOTE: the data cannot pass max_body: the chunk sizes it came in did not (-4)
            stop = take if take >= 0 else (n if take == -1 else f.stop)
            self._llhttp(buf, pos, stop)
            for e in range(f.nspans):
                self._add_body(buf, f.spans[2 * e], f.spans[2 * e + 1])
            f.nspans = 0
            pos = stop
            if take >= 0:
                self._ended()
            elif take == -1:
                return 0
        return 0

    cdef int _add_body(self, bytes buf, Py_ssize_t start, Py_ssize_t end) except -1:
        if end > start:
            self._parts.append(_slice(buf, start, end))
            self._body_size += end - start
        return 0

    cdef int _llhttp(self, bytes buf, Py_ssize_t start, Py_ssize_t end) except -1:
        if end <= start:
            return 0
        if self._upgrading:
            return 0  # (llhttp ended the message at its head: this framing reads the body, see the twin)
        try:
            self._feed_data(_slice(buf, start, end))
        except HttpParserUpgrade:
            # llhttp stops past the head of a request offering an upgrade, having ended the message
            # there, body or not: answered on HTTP/1.1 all the same (see the twin's _upgraded)
            if not self._upgrading:
                raise BadRequestError("protocol upgrade is not supported", close=True) from None
            if self._body != B_NONE:
                self._want_head = False  # (its body is read off its Content-Length, as any)
        except HttpParserError as exc:
            cause = exc.__context__
            if isinstance(cause, HTTPError):
                raise cause from None
            if str(exc) == "Invalid HTTP version":  # (see the twin's _parse_error)
                raise VersionNotSupportedError("unsupported HTTP version: llmgw speaks HTTP/1.1 (and 1.0)") from exc
            raise BadRequestError(f"malformed HTTP request: {exc}", close=True) from exc
        return 0

    cdef int _ended(self) except -1:
        # our framing says the request ended: httptools must agree
        cdef Request req = self._req
        cdef list parts = self._parts
        if not self._complete or req is None:
            raise BadRequestError("malformed HTTP request: the message does not end where its framing says",
                                  close=True)
        if parts:
            req.body = parts[0] if len(parts) == 1 else b"".join(parts)
            self._parts = []
        self._req = None
        if self._upgrading:
            self._drop_rest = True  # (what follows would be the other protocol: never read)
            self._want_head = True  # (between requests, as llhttp's end of the message said early)
        self._sink.on_request(req)
        return 0

    cdef Request _read_head(self, bytes head, Py_ssize_t end):
        """The request head ``head[:end]`` (ending with the blank line), read as
        the twin's callbacks would; sets how its body is framed. A field error is
        kept for on_headers_complete, after llhttp has validated the whole head."""
        cdef const char* s = PyBytes_AS_STRING(head)
        cdef Py_ssize_t pos, eol, fs, vs, nn, nv, k, t, te
        cdef Py_ssize_t head_bytes
        cdef Py_ssize_t fwlen = 0
        cdef char* fw
        cdef int kind
        cdef long long cl
        cdef bint chunked = False, has_te = False, te_other = False
        cdef Request req = Request.__new__(Request)
        cdef Py_ssize_t count = 0
        cdef char stack[_STACK_HEAD]
        cdef Py_ssize_t max_headers = self.max_headers
        cdef Py_ssize_t max_head = self.max_head_bytes
        cdef bytes prio = self._priority_header
        cdef Py_ssize_t np = PyBytes_GET_SIZE(prio)
        cdef list connection = None
        error = None
        self._version_known = False
        self._check_upgrade = False
        self._connection = False
        # request line: method SP+ target SP+ version (llhttp checks the grammar)
        eol = _eol(s, 0, end) - 1
        if eol < 0:
            eol = 0
        k = 0
        while k < eol and s[k] != 32:
            k += 1
        if k == 4 and memcmp(s, b"POST", 4) == 0:
            req.method = _POST  # PERF: no new object for the usual methods
        elif k == 3 and memcmp(s, b"GET", 3) == 0:
            req.method = _GET
        else:
            req.method = PyBytes_FromStringAndSize(s, k)
            if k == 7 and memcmp(s, b"CONNECT", 7) == 0:
                self._check_upgrade = True
        t = k
        while t < eol and s[t] == 32:
            t += 1
        te = t
        while te < eol and s[te] != 32:
            te += 1
        req.target = PyBytes_FromStringAndSize(s + t, te - t)
        k = te
        while k < eol and s[k] == 32:
            k += 1
        if eol - k == 8 and memcmp(s + k, b"HTTP/1.", 7) == 0 and (s[k + 7] == 49 or s[k + 7] == 48):
            req.version = b"1.1" if s[k + 7] == 49 else b"1.0"
            self._version_known = True
        elif k >= eol and s[eol] != 13:
            # no version and a bare LF (llhttp takes that for an HTTP/0.9 line, and
            # on_headers_complete refuses it): the target runs to the LF
            te = eol + 1
        head_bytes = te - t
        if head_bytes > max_head:
            error = HeadersTooLargeError("request line is too long", close=True)
        req._raw = head
        req._raw_start = eol + 2
        req._raw_end = end
        fw = &stack[0] if end <= _STACK_HEAD else <char*>PyMem_Malloc(end)
        if fw == NULL:
            raise MemoryError()
        try:
            pos = eol + 2
            while True:
                pos = _field(s, pos, end, &fs, &nn, &vs, &eol)
                if pos < 0:
                    break
                nv = eol - vs
                # framing is read whatever the fields say
                kind = _classify(s + fs, nn)
                if kind == H_TRANSFER_ENCODING:
                    has_te = True
                    chunked = _te_chunked(s, vs, pos - 2)  # (the raw value: llhttp's rule on a tab)
                    if not _te_only_chunked(s, vs, eol):
                        te_other = True
                elif kind == H_CONTENT_LENGTH:
                    cl = _length_value(s, vs, eol)
                    if cl >= 0:
                        req.content_length = cl
                elif kind == H_CONNECTION or (kind == H_HOP and nn == 16):
                    self._connection = True  # (llhttp reads Proxy-Connection as Connection)
                    if kind == H_CONNECTION and not _plain_connection(s + vs, nv):
                        if connection is None:
                            connection = []
                        connection.append(PyBytes_FromStringAndSize(s + vs, nv))
                elif kind == H_HOP and nn == 7 and _ieq(s + fs, b"upgrade", 7):
                    self._check_upgrade = True
                if error is not None:
                    continue
                # the twin's on_header, in the same order
                head_bytes += nn + nv + 4
                if head_bytes > max_head:
                    error = HeadersTooLargeError("request headers are too large", close=True)
                    continue
                if count >= max_headers:
                    error = HeadersTooLargeError("too many request headers", close=True)
                    continue
                count += 1
                if kind == H_OTHER:
                    if nn == np and _ieq(s + fs, PyBytes_AS_STRING(prio), nn):
                        if req.priority is None:
                            req.priority = PyBytes_FromStringAndSize(s + vs, nv)
                        continue
                elif kind == H_CONTENT_TYPE:
                    if req.content_type is not None:
                        continue
                    req.content_type = PyBytes_FromStringAndSize(s + vs, nv)
                else:
                    if kind == H_EXPECT:
                        if nv == 12 and _ieq(s + vs, b"100-continue", 12):
                            req.expect_continue = True
                        else:
                            error = HTTPError(
                                "unsupported Expect header", status=417, type="invalid_request_error",
                                code="expectation_failed", close=True,
                            )
                    elif kind == H_AUTHORIZATION:
                        if req.authorization is None:
                            req.authorization = PyBytes_FromStringAndSize(s + vs, nv)
                    elif kind == H_X_API_KEY:
                        if req.x_api_key is None:
                            req.x_api_key = PyBytes_FromStringAndSize(s + vs, nv)
                    elif kind == H_REQUEST_ID:
                        if req.request_id is None:
                            req.request_id = PyBytes_FromStringAndSize(s + vs, nv)
                    elif kind == H_HOST:
                        if req.host is not None:
                            error = BadRequestError("duplicate Host header", close=True)
                        elif not _host_ok(s + vs, nv):
                            error = BadRequestError(
                                "the Host header is not a host name or address (with an optional :port)",
                                code="invalid_host", close=True,
                            )
                        req.host = PyBytes_FromStringAndSize(s + vs, nv)
                    continue
                # a line passed on: "name: value" CRLF
                fwlen = _put_field(fw, fwlen, s + fs, nn, s + vs, nv)
            req.forward = PyBytes_FromStringAndSize(fw, fwlen)
        finally:
            if fw != &stack[0]:
                PyMem_Free(fw)
        if connection is not None:
            req.forward = _drop_nominated(req.forward, connection)
        self._error = error
        self._te_coded = chunked and te_other  # (refused in on_headers_complete, see the twin)
        # how the body ends (RFC 9112 section 6.3; llhttp refuses the rest)
        if has_te:
            self._body = B_CHUNKED if chunked else B_NONE
            req.content_length = -1
            _chunks_reset(&self._chunks)
            self._chunks.max_body = self.max_body
            self._chunks.max_trailer = max_head  # (the trailer section is bounded as a head is)
            self._chunks.max_lines = max_headers
        elif req.content_length > 0:
            self._body = B_LENGTH
            self._body_left = req.content_length
        else:
            self._body = B_NONE
        return req

    def on_headers_complete(self):
        # llhttp has validated the head read by _read_head
        cdef Request req = self._next
        self._next = None
        if req is None:
            # llhttp ended a head this framing did not see end: a version-less
            # (HTTP/0.9) request line ended by a bare LF; the twin says so
            version = self._parser.get_http_version()
            if version != "1.1" and version != "1.0":
                raise VersionNotSupportedError(f"unsupported HTTP version {version}")
            raise BadRequestError("malformed HTTP request: a head that was not framed", close=True)
        self._req = req
        self._body_size = 0
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        if self._te_coded:
            raise _unsupported_coding()
        parser = self._parser
        if not self._version_known:
            version = parser.get_http_version()
            if version != "1.1" and version != "1.0":
                raise VersionNotSupportedError(f"unsupported HTTP version {version}")
            req.version = version.encode()
        if self._check_upgrade and parser.should_upgrade():
            if req.method == b"CONNECT":
                raise _connect_refused()
            if self._body == B_CHUNKED:
                raise _upgrade_with_chunks()
            self._upgrading = True  # (answered on HTTP/1.1, then the connection closes: see the twin)
        if self._body == B_CHUNKED and req.version == b"1.0":
            raise _te_in_http10()  # SECURITY: see the twin
        if self._upgrading:
            req.keep_alive = False
        elif self._connection:
            req.keep_alive = parser.should_keep_alive()
        else:
            req.keep_alive = req.version == b"1.1"
        if req.content_length > self.max_body:
            raise PayloadTooLargeError(
                f"request body is {req.content_length} bytes; the limit is {self.max_body}", close=True
            )
        if req.expect_continue and req.content_length != 0 and req.version == b"1.1":
            # (an HTTP/1.0 client's expectation is ignored: RFC 9110 §10.1.1)
            self._sink.on_head(req)

    def on_message_complete(self):
        # (the request goes to on_request from _ended, with the body read off the bytes)
        self._complete = True
        self._want_head = True
