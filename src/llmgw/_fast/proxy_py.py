# cython: annotation_typing=False
"""The proxy: the client port's app, one call per request, and engine errors.

This file is both the pure-Python implementation and, compiled by Cython with the
declarations in ``proxy.pxd``, the extension module ``llmgw._fast.proxy``. Import
it through :mod:`llmgw.gateway.proxy`.

``POST /v1/*`` with a JSON body naming a ``model`` is proxied to one of that
model's replicas; ``GET /v1/models`` lists the fleet's models. The body is read
only for ``model`` and forwarded byte for byte unless the model name must be
rewritten (an alias, or ``upstream_name``).

A request travels as one :class:`Call`: admission (straight through below pool
saturation 1.0, else a bounded priority-band queue), a replica chosen by the
model's picker, an attempt on a pooled keep-alive connection, and the answer
relayed back. Everything after parsing is driven by callbacks; a task is made
only to open a new upstream connection. The :class:`Gateway` is the server's
:class:`~llmgw._fast.server_py.App` and each call is its upstream connection's
:class:`~llmgw._fast.upstream_py.Exchange`, so both are called through C.

Failure semantics (a request reaches an engine at most once):

* before the request reached a replica (connect refused or timed out) or when
  the replica answered 502/503, the request is retried on another replica
  (``retries.attempts`` times, within ``retries.budget``), then answered with a
  clear error; a connection found closed before any byte was written to it is
  replaced by a new one to the same replica;
* once its bytes were written, a request is never sent again, to the same replica
  or another: a reset, an end of stream or a timeout before the complete answer
  is answered 502 or 504 (the engine that reset may already be generating; as
  nginx never resends a sent POST). ``retries.after_send: true`` restores
  resending such requests while no byte reached the client;
* after the first byte there is never a retry: a stream cut by the engine ends
  with an SSE ``data: {"error": ...}`` event and the connection is closed;
* a client that goes away aborts the upstream request at once; every counter
  returns to where it was;
* a 401/403 from the engine means llmgw's key for it is wrong: the replica is
  held out of routing (``Endpoint.hold_auth``), the request retried elsewhere, and
  only if none takes it answered 502 ``upstream_auth_failed``;
* a non-streamed answer above ``upstream.max_buffered_body`` is relayed as it
  arrives with the engine's framing (a cut then shows as an incomplete body).

Secrets (replica, client and admin keys, join tokens) are redacted from what an
engine's error answer or headers would carry to a client or a log (:func:`redact`).

NOTE (compiled build): classes declared in ``proxy.pxd`` are extension types,
so they cannot grow attributes that are not declared there, and methods declared
``cpdef`` there may not hold closures (lambdas, generator expressions).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import hmac
import math
import os
import re
import time
from collections.abc import Callable, Container, Iterable
from email.utils import formatdate
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote_to_bytes

import orjson

from .._accel import select
from ..errors import (
    BadGatewayError,
    BadRequestError,
    GatewayTimeoutError,
    HTTPError,
    MethodNotAllowedError,
    ModelNotFoundError,
    ModelUnavailableError,
    NotFoundError,
    OverloadedError,
    RateLimitedError,
    ShuttingDownError,
    UnauthorizedError,
    UpstreamAuthError,
)
from ..log import access_logger, server_logger, upstream_logger
from . import _live

try:
    import cython
except ImportError:  # a pure install: no Cython
    from . import _cy as cython

if TYPE_CHECKING:
    from ..config import Config
    from . import counters_py as _counters
    from . import httpproto_py as _hp
    from . import jsonscan_py as _js
    from . import replica_py as _replica
    from . import score_py as _score
    from . import server_py as _srv
    from . import upstream_py as _up
else:
    _hp = select("httpproto")
    _js = select("jsonscan")
    _score = select("score")
    _srv = select("server")
    _up = select("upstream")
    _replica = select("replica")
    _counters = select("counters")
JSONScanError = _js.JSONScanError
RetryBudget = _score.RetryBudget
retry_after = _score.retry_after
_RETRY_AFTER_MIN = _score.RETRY_AFTER_MIN
_RETRY_AFTER_MAX = _score.RETRY_AFTER_MAX
_RETRY_AFTER_DEFAULT = _score.RETRY_AFTER_DEFAULT
NullObserver = _counters.NullObserver
if not cython.compiled:
    # (the compiled build takes these from proxy.pxd: C types, C calls, C enums)
    Request = _hp.Request
    Response = _hp.Response
    id_line = _hp.id_line
    monotonic = _hp.monotonic
    upstream_head = _hp.upstream_head
    json_model = _js.json_model
    json_route = _js.json_route
    header_hash = _js.header_hash
    model_span = _js.model_span
    sse_cut = _js.sse_cut
    usage_counts = _js.usage_counts
    EndpointState = _score.EndpointState
    App = _srv.App
    ResponseWriter = _srv.ResponseWriter
    Exchange = _up.Exchange
    UpstreamConnection = _up.UpstreamConnection
    should_retry_fresh = _up.should_retry_fresh
    Endpoint = _replica.Endpoint
    ModelPool = _replica.ModelPool
    TrafficCounters = _counters.TrafficCounters
    # Deadline kinds of a Call, checked by the gateway's sweep (proxy.pxd: Deadline).
    D_NONE = 0
    D_QUEUE = 1
    D_FIRST_BYTE = 2
    D_READ = 3
    # Call phases (proxy.pxd: Phase).
    P_NEW = 0
    P_QUEUED = 1
    P_CONNECTING = 2
    P_SENT = 3
    P_DONE = 4
    LLMGW_DEBUG = False  # (debug.h: the debug build's switch)

__all__ = ["Call", "Gateway"]


_SSE_SEP = b"\n\n"
_VISIBLE_ASCII = bytes(range(33, 127))
_RETRYABLE_STATUS = (502, 503)
_UNKNOWN = "(unknown)"  # the model label for requests naming no served model (bounded cardinality)
_TICK = 0.05  # seconds between deadline sweeps

_JSON_CT = ((b"content-type", b"application/json"),)
_NO_RETRY_LINE = b"x-should-retry: false\r\n"


def _engine_retry_after(lines: bytes) -> float:
    """Seconds the engine's ``retry-after-ms`` (or else ``retry-after``, in seconds) header line
    in ``lines`` asks a client to wait (at most an hour); -1: none given (or not a number)."""
    if b"retry-after" not in lines.lower():
        return -1.0
    ms = -1.0
    seconds = -1.0
    for line in lines.split(b"\n"):
        name, sep, value = line.partition(b":")
        if not sep:
            continue
        name = name.strip().lower()
        if name != b"retry-after" and name != b"retry-after-ms":
            continue
        try:
            v = float(value.strip())
        except ValueError:
            continue  # (an HTTP date: not followed)
        if not 0.0 <= v < math.inf:
            continue
        if name == b"retry-after-ms":
            ms = v / 1000.0
        else:
            seconds = v
    wait = ms if ms >= 0.0 else seconds
    return min(wait, 3600.0) if wait >= 0.0 else -1.0


def _straddle(pending: bytes, more: list[bytes] | None, data: bytes) -> int:
    """Where in ``data`` an SSE event's end that began in the pending bytes ends (0: none): the
    blank line split between reads. ``pending`` (and ``more``) hold no event end of their own."""
    last = more[len(more) - 1] if more else pending
    tail = last[max(0, len(last) - 2):]
    if len(tail) < 2 and more:
        prev = more[len(more) - 2] if len(more) >= 2 else pending
        tail = prev[max(0, len(prev) - 1):] + tail
    head = data[:2]
    cut = sse_cut(tail + head)
    return cut - len(tail) if cut > len(tail) else 0


def _retry_lines(wait: float) -> bytes:
    """``Retry-After`` (whole seconds, at least 1) and ``retry-after-ms`` header lines for ``wait``
    seconds, as the gateway's own answers carry them; none for a negative ``wait``."""
    if wait < 0.0:
        return b""
    return b"retry-after: %d\r\nretry-after-ms: %d\r\n" % (max(1, int(wait + 0.999)), max(1, int(wait * 1000)))


def _last_events(data: bytes) -> bytes:
    """The end of ``data`` from the start of its last two SSE events (``\\n\\n``-ended;
    chunk framing may lie between them); all of it when it holds fewer, or when its
    events end in CRLF pairs. Usage is read off this: it is in the last events, and
    a write of several chunks (see ``Call.flush_chunks``) is not scanned whole."""
    end = data.rfind(b"\n\n")
    if end > 0:
        end = data.rfind(b"\n\n", 0, end)
        if end > 0:
            end = data.rfind(b"\n\n", 0, end)
            if end >= 0:
                return data[end + 2 :]
    return data


# How the 503 for a model that is down words each reason (replica_py.UNUSABLE_REASONS);
# it counts replicas and never names them (``server.expose_replica``).
_REASON_WORDS = {
    "unreachable": "unreachable",
    "stale": "failing its scrapes",
    "loading": "loading its model",
    "unavailable": "answering its metrics page 503 (unavailable)",
    "breaker_open": "with an open circuit breaker",
    "auth_failed": "refusing the API key the gateway sends it (fix its key in the configuration)",
    "draining": "draining",
}


def _unavailable_error(model: str, why: tuple[dict[str, int], float]) -> HTTPError:
    """The 503 for a model none of whose replicas can take a request (``ModelPool.unavailable``):
    ``Retry-After`` is when one may be back (its breaker's probe, the next scrape)."""
    reasons, wait = why
    if len(reasons) == 1 and "auth_failed" in reasons:
        # every replica refuses the gateway's key: only fixing the config helps, so the answer a
        # client must not retry (x-should-retry: false), not a 503 its SDK would retry
        n = reasons["auth_failed"]
        return UpstreamAuthError(
            f"the model `{model}` is unavailable: its replica{'s' if n != 1 else ''} refuse{'' if n != 1 else 's'} "
            "the API key the gateway sends; the gateway's configuration must be fixed"
        )
    if wait == math.inf:
        wait = _RETRY_AFTER_DEFAULT  # (only draining: an operator decides when)
    if wait < _RETRY_AFTER_MIN:
        wait = _RETRY_AFTER_MIN
    elif wait > _RETRY_AFTER_MAX:
        wait = _RETRY_AFTER_MAX
    parts = []
    for reason in sorted(reasons):
        parts.append(f"{reasons[reason]} {_REASON_WORDS.get(reason, reason)}")
    n = sum(reasons.values())
    return ModelUnavailableError(
        f"the model `{model}` is unavailable: no replica can take requests ({n} replica{'s' if n != 1 else ''}: "
        f"{', '.join(parts)}); retry after {math.ceil(wait)}s",
        retry_after=wait,
    )


def _shutting_down(message: str) -> HTTPError:
    return ShuttingDownError(f"the gateway is shutting down; {message}", retry_after=1.0)


def _sse_error(message: str, code: str) -> bytes:
    return b"data: " + orjson.dumps(
        {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    ) + _SSE_SEP


_REDACTED = b"[redacted]"
# Tokens an error text is cut into, to find a secret that is not there whole: runs
# between JSON and text punctuation, then (for a key in a URL or a header value)
# between URL punctuation too, then (a key shown in part: "sk-ab12...") runs of
# letters, digits, "-", "_" and "+".
_TOKENS = (
    re.compile(rb"[^\s\"'`,;()\[\]{}<>\\]+"),
    re.compile(rb"[^\s\"'`,;:()\[\]{}<>\\/=&?@#]+"),
    re.compile(rb"[A-Za-z0-9_+-]+"),
)
_WHOLE_MIN = 4  # a secret this long or longer is redacted wherever it stands, whole
_FRAGMENT_MIN = 6  # a token this long that begins or ends a key is redacted
_INNER_MIN = 12  # a token this long (or with a digit) from inside a key is redacted
_DIGITS = re.compile(rb"[0-9]")


def redact(
    data: bytes, plain: Iterable[bytes], digests: Container[bytes] = (), pieces_of: Iterable[bytes] | None = None
) -> bytes:
    """``data`` with the secrets in it replaced by ``[redacted]``.

    SECURITY: an engine's error body may echo what it was sent or holds (its key, a
    key a client put in a request body); none of it may reach a client or a log.
    Cold path: error answers only (a success path never scans a body).

    Args:
        data: the text (an engine's error body, a header block).
        plain: the secrets llmgw holds in plain (replica keys, the admin token,
            join tokens): redacted whole wherever they stand (those shorter than
            4 bytes only as a whole token).
        digests: SHA-256 digests of the secrets llmgw holds only so (client keys):
            a token whose digest is one of them is redacted.
        pieces_of: the secrets whose pieces are redacted too (an engine showing part
            of its key, as "sk-ab12...wxyz"): a token of 6 bytes or more that begins or
            ends one, or one from inside it of 12 bytes or more or with a digit. The
            key the answering replica was sent; ``None``: every one of ``plain``.
            (A piece of another replica's key cannot be in this engine's answer, and
            a key made of words must not take those words out of every error text:
            "engine" from a key "enginesecret".)
    """
    secrets = sorted({p for p in plain if p}, key=len, reverse=True)
    for sec in secrets:
        if len(sec) >= _WHOLE_MIN and sec in data:
            data = data.replace(sec, _REDACTED)
    if not secrets and not digests:
        return data
    pieces = secrets if pieces_of is None else [p for p in pieces_of if p]
    for pattern in _TOKENS:
        out: list[bytes] = []
        pos = 0
        for m in pattern.finditer(data):
            tok = m.group()
            if tok == _REDACTED or tok == b"redacted" or not _is_secret(tok, secrets, pieces, digests):
                continue
            out.append(data[pos : m.start()])
            out.append(_REDACTED)
            pos = m.end()
        if out:
            out.append(data[pos:])
            data = b"".join(out)
    return data


def _is_secret(tok: bytes, secrets: list[bytes], pieces: list[bytes], digests: Container[bytes]) -> bool:
    if tok in secrets:
        return True
    if len(tok) >= _FRAGMENT_MIN:
        for sec in pieces:
            if tok in sec and (sec.startswith(tok) or sec.endswith(tok) or len(tok) >= _INNER_MIN
                               or _DIGITS.search(tok) is not None):
                return True
    return bool(digests) and hashlib.sha256(tok).digest() in digests


def config_secrets(config: Config) -> tuple[bytes, ...]:
    """The secrets ``config`` holds in plain: replica keys, the admin token, join and router tokens."""
    out = [ep.api_key for ep in config.endpoints if ep.api_key]
    if config.admin_token:
        out.append(config.admin_token)
    if config.control is not None:
        out.extend(config.control.join_tokens)
        out.extend(config.control.router_tokens)
    if config.follow is not None and config.follow.token:
        out.append(config.follow.token)
    return tuple(s.encode() for s in out if s)


_JSON_TYPES = {int: "an integer", float: "a number", bool: "a boolean", list: "an array", dict: "an object"}
_TYPED_MODEL_MAX = 1 << 20  # bodies up to this size are read again to say what their model is instead


def _no_model(body: bytes) -> BadRequestError:
    """The 400 for a body whose ``model`` is missing, empty or not a string.

    (Off the hot path: only a refused request pays for reading its body again,
    and only a body small enough to read quickly.)
    """
    if len(body) <= _TYPED_MODEL_MAX and b'"model"' in body:
        with contextlib.suppress(orjson.JSONDecodeError):
            given = orjson.loads(body).get("model")
            if given is not None and not isinstance(given, str):
                return BadRequestError(
                    f"Invalid type for 'model': expected a string, but got {_JSON_TYPES.get(type(given), 'null')} "
                    "instead.", param="model", code="invalid_type",
                )
    return BadRequestError("You must provide a model parameter.", param="model", code="missing_model")


# a parameter of a header value: ; name = token or "quoted string" (RFC 9110 §5.6.6, RFC 7578 §4.2)
_PARAM = re.compile(rb';[ \t]*([^\s=;]+)[ \t]*=[ \t]*("(?:[^"\\]|\\.)*"|[^;]*)')


def _params(value: bytes) -> dict[bytes, bytes]:
    """The parameters of a header value (``type; a=1; b="x"``): lower-case names, values unquoted."""
    out: dict[bytes, bytes] = {}
    for m in _PARAM.finditer(value):
        v = m.group(2).strip(b" \t")
        if v[:1] == b'"':
            v = re.sub(rb"\\(.)", rb"\1", v[1 : len(v) - 1])  # (no negative index: wraparound is off, compiled)
        out.setdefault(m.group(1).lower(), v)
    return out


def _bad_multipart(why: str) -> BadRequestError:
    return BadRequestError(f"We could not parse the multipart/form-data body of your request: {why}.",
                           code="invalid_multipart")


def _multipart_model(body: bytes, content_type: bytes | None) -> tuple[str, int, int] | None:
    """The ``model`` field of a ``multipart/form-data`` body (the OpenAI API's audio
    transcriptions and translations take one), and where its value lies in ``body``:
    ``("", 0, 0)`` when it has none; ``None`` when ``content_type`` is not
    multipart/form-data (cold path: only a body that is not JSON gets here).

    Raises:
        BadRequestError: a malformed multipart body, or one with two ``model`` fields
            (the gateway would route by one and the engine might read the other).
    """
    if content_type is None:
        return None
    mime, _, rest = content_type.partition(b";")
    if mime.strip(b" \t").lower() != b"multipart/form-data":
        return None
    boundary = _params(b";" + rest).get(b"boundary")
    if not boundary:
        raise _bad_multipart("its Content-Type names no boundary")
    delim = b"\r\n--" + boundary
    # (the first delimiter opens the body, or ends a preamble)
    if body.startswith(delim[2:]):
        pos = len(delim) - 2
    else:
        pos = body.find(delim)
        if pos < 0:
            raise _bad_multipart("no part begins with the boundary")
        pos += len(delim)
    found: tuple[str, int, int] | None = None
    while body[pos : pos + 2] != b"--":  # (the close delimiter)
        line = body.find(b"\r\n", pos)
        head_end = body.find(b"\r\n\r\n", line) if line >= 0 else -1
        end = body.find(delim, head_end + 4) if head_end >= 0 else -1
        if end < 0:
            raise _bad_multipart("a part does not end with the boundary")
        name = None
        for h in body[line + 2 : head_end].split(b"\r\n"):
            field, _, value = h.partition(b":")
            if field.strip(b" \t").lower() == b"content-disposition":
                name = _params(b";" + value.partition(b";")[2]).get(b"name")
        if name == b"model":
            if found is not None:
                raise _bad_multipart("it has two model fields")
            try:
                found = (body[head_end + 4 : end].decode("utf-8"), head_end + 4, end)
            except UnicodeDecodeError:
                raise _bad_multipart("its model field is not UTF-8") from None
        pos = end + len(delim)
    return found if found is not None else ("", 0, 0)


def _compressed(body: bytes) -> str | None:
    """The content coding ``body`` starts as (its magic bytes), if one: gzip, zstd or deflate (zlib)."""
    if body[:2] == b"\x1f\x8b":
        return "gzip"
    if body[:4] == b"\x28\xb5\x2f\xfd":
        return "zstd"
    if body[:1] == b"\x78" and body[1:2] in (b"\x01", b"\x5e", b"\x9c", b"\xda"):
        return "deflate"  # (RFC 1950's header as zlib writes it: 32 KiB window, each level, no dictionary)
    return None


def _form_model(body: bytes, content_type: bytes | None, exc: JSONScanError) -> str:
    """The model a body that is not JSON names: its ``multipart/form-data`` ``model``
    field (the audio transcriptions and translations send their fields as a form).

    Raises:
        BadRequestError: the body is neither (the JSON 400, saying why), or a malformed form.
    """
    form = _multipart_model(body, content_type)
    if form is None:
        coding = _compressed(body)
        if coding is not None:
            # (the header is not read on the hot path; the bytes say it: RFC 9110 §15.5.16)
            raise HTTPError(
                f"The request body is {coding}-compressed (Content-Encoding: {coding}): llmgw takes request "
                "bodies uncompressed. Send it without compression.",
                status=415, type="invalid_request_error", code="unsupported_content_encoding",
                headers=((b"accept-encoding", b"identity"),), should_retry=False,
            )
        raise BadRequestError(
            f"We could not parse the JSON body of your request ({exc}). Send a JSON object "
            "(or a multipart/form-data body where the API takes one).",
            code="invalid_json",
        ) from None
    return form[0]


def _form_rewrite(body: bytes, content_type: bytes | None, model: str) -> bytes:
    """``body`` (a ``multipart/form-data`` body with a ``model`` field) naming ``model`` instead;
    every other byte as it was."""
    form = _multipart_model(body, content_type)
    assert form is not None and form[2]  # (read by _form_model before)
    return body[: form[1]] + model.encode() + body[form[2] :]


def _bad_path(path: bytes) -> BadRequestError:
    return BadRequestError(
        f"the path {path.decode('latin-1')[:200]} has a '.' or '..' segment (maybe percent-encoded): "
        "llmgw forwards only plain /v1/ paths", code="invalid_path",
    )


def _no_route(path: bytes) -> NotFoundError:
    return NotFoundError(f"no route for {path.decode('latin-1')[:200]}; llmgw serves the OpenAI API under /v1/")


_ENGINE_ADMIN = frozenset({b"load_lora_adapter", b"unload_lora_adapter"})
"""Administration endpoints an inference engine serves under /v1/ (vLLM's runtime LoRA
routes, with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): never forwarded."""


def _engine_admin(path: bytes) -> bool:
    """Whether ``path`` (no query) names one of :data:`_ENGINE_ADMIN`, as an engine (or a
    proxy before it) may route it: percent-decoded, in any case, with empty segments
    (``//``, a trailing ``/``) dropped (cold path: only paths whose first segment after
    ``/v1/`` starts with one of the bytes ``lLuU%/`` get here)."""
    plain = unquote_to_bytes(path) if b"%" in path else path
    segments = [seg for seg in plain.lower().split(b"/") if seg]
    return len(segments) == 2 and segments[0] == b"v1" and segments[1] in _ENGINE_ADMIN


def _admin_refused(path: bytes) -> HTTPError:
    # SECURITY: a replica runs what the gateway sends it with the gateway's own key for it: passed on,
    # any client of the gateway could load or unload adapters on every replica it reaches.
    return HTTPError(
        f"{path.decode('latin-1')[:200]} is an inference engine's administration endpoint; llmgw does not pass "
        "it to replicas (it would run with the gateway's own key for them): call the engine directly",
        status=403, type="invalid_request_error", code="engine_admin_endpoint", should_retry=False,
    )


_POST_ROUTES = frozenset({
    b"/v1/chat/completions", b"/v1/completions", b"/v1/embeddings", b"/v1/responses", b"/v1/moderations",
    b"/v1/audio/transcriptions", b"/v1/audio/translations", b"/v1/audio/speech", b"/v1/images/generations",
    b"/v1/rerank", b"/v1/score", b"/v1/tokenize", b"/v1/detokenize",
})
"""The POST routes of the OpenAI API and of the engines' extensions: another method there is a 405."""


def _origin_form(target: bytes) -> bytes | None:
    """The origin-form (path and query) of an absolute-form ``http(s)://authority/path?query``
    request target; ``None`` for any other target."""
    head = target[:8].lower()
    if head.startswith(b"http://"):
        rest = target[7:]
    elif head == b"https://":
        rest = target[8:]
    else:
        return None
    cut = len(rest)
    for sep in (b"/", b"?"):
        at = rest.find(sep)
        if 0 <= at < cut:
            cut = at
    if cut == 0:
        return None  # (no authority: not an absolute URI)
    origin = rest[cut:]
    return origin if origin[:1] == b"/" else b"/" + origin


def _dot_segments(path: bytes) -> bool:
    """Whether ``path`` (no query) has a ``.`` or ``..`` segment once percent-decoded, with
    ``\\`` taken as ``/`` as some servers take it (cold path: only paths with a ``.``, ``%``
    or ``\\`` get here)."""
    plain = unquote_to_bytes(path).replace(b"\\", b"/")
    return any(seg == b"." or seg == b".." for seg in plain.split(b"/"))


@functools.lru_cache(maxsize=1)
def _date_of(second: int) -> bytes:
    return formatdate(second, usegmt=True).encode("ascii")


def _http_date() -> bytes:
    """``Date`` for an answer llmgw makes itself (RFC 9110 §6.6.1: an origin with a
    clock MUST send one); a replica's answers carry the replica's. Formatted once a second."""
    return _date_of(int(time.time()))


class Call(Exchange):
    """One client request, from admission to the last byte (and its attempts).

    It is the exchange of the upstream connection carrying the current attempt,
    and its response writer's watcher (``client_gone``).
    """

    __slots__ = (
        "_buf",
        "_held",
        "_more",
        "_pending",
        "_run",
        "_run_end",
        "_run_start",
        "_tail",
        "_tail_prev",
        "band",
        "band_name",
        "body",
        "chain",
        "client_model",
        "closed",
        "conn",
        "connect_task",
        "deadline",
        "dkind",
        "ep",
        "error",
        "gw",
        "head_tail",
        "model",
        "phase",
        "pool",
        "probe",
        "progress",
        "relaying",
        "req",
        "resp",
        "retrying",
        "reused",
        "rid_line",
        "sent_at",
        "sent_bytes",
        "session",
        "started",
        "streaming",
        "tenant",
        "tried",
        "tries",
        "ttfb",
        "usage",
        "w",
    )

    def __init__(
        self, gw: Gateway, req: Request, w: ResponseWriter, pool: ModelPool, model: str, body: bytes, rid_line: bytes,
        started: float,
    ) -> None:
        self._init(gw, req, w, pool, model, body, rid_line, started)

    def _init(
        self, gw: Gateway, req: Request, w: ResponseWriter, pool: ModelPool, model: str, body: bytes, rid_line: bytes,
        started: float,
    ) -> None:
        # PERF: the gateway makes calls with Call.__new__ and this (a C call when
        # compiled), not through the type's call with its argument parsing.
        # (read back through the typed attributes: C struct reads when compiled)
        self.gw = gw
        self.req = req
        self.w = w
        self.pool = pool
        self.model = self.pool.name
        self.client_model = model
        self.body = body
        self.rid_line = rid_line  # b"x-request-id: <id>\r\n"
        self.started = started  # (monotonic: the gateway read the clock when the request came)
        self.band = self.gw.default_band
        self.band_name = self.gw.bands[self.band]
        self.tenant: Any = None
        self.phase = P_NEW
        self.closed = False
        self.tried: list[Endpoint] | None = None
        self.ep: Endpoint | None = None
        self.conn: UpstreamConnection | None = None
        self.connect_task: asyncio.Task[None] | None = None
        self.tries = 0
        self.chain: bytes | None = None  # the prefix strategy's key (Gateway._prepare), or None
        self.session = 0
        self.probe = False
        self.retrying = False
        self.reused = False
        self.deadline = 0.0
        self.dkind = D_NONE
        self.resp: Response | None = None
        self.streaming = False
        self.relaying = False  # a non-streamed answer too large to buffer, relayed as it comes
        self._buf: list[bytes] = []
        self._pending = b""
        self._more: list[bytes] | None = None  # more pieces of the pending event, not joined yet
        self._held = 0  # bytes of the pending event (_pending and _more)
        self.sent_bytes = 0
        self.ttfb = -1.0  # when the answer's head arrived (monotonic); -1: not yet
        self.sent_at = -1.0  # when the request went upstream; -1: not yet
        self.error: HTTPError | None = None
        self.head_tail = b""
        self.usage: tuple[int, int] | None = None  # the answer's token usage, reported once at the end
        self._tail = b""  # a stream's last write, and the one before it
        self._tail_prev = b""
        self._run: bytes | None = None  # a read holding whole chunks to relay as they came ...
        self._run_start = 0  # ... from here
        self._run_end = 0  # ... to here (see on_response_chunk)
        self.progress = False  # answer bytes arrived since the sweep last looked
        if LLMGW_DEBUG:
            _live.made("calls")

    def __dealloc__(self) -> None:
        if LLMGW_DEBUG:
            _live.freed("calls")

    @property
    def rid(self) -> bytes:
        """The request id."""
        return self.rid_line[14 : len(self.rid_line) - 2]

    # -- admission --

    def admit(self) -> None:
        """Straight through below saturation 1.0 with nobody waiting; else queue (or shed).

        A pool that is down rather than full (``ModelPool.unavailable``), or a gateway
        that is shutting down, answers 503 at once: waiting would not help.
        """
        gw = self.gw
        pool = self.pool
        now = monotonic()
        if not len(pool.queue) and pool.saturation(now, gw.stale_after, gw.max_waiting, gw.max_kv) < 1.0:
            counters = gw.counters
            if counters is not None:
                counters.admission(self.band_name, "admitted")
            else:
                gw.observer.admission(self.band_name, "admitted")
            self.dispatch()
            return
        # (the cold path: what follows costs nothing while the pool has room)
        if gw.closing:
            self._refuse("shutting_down", _shutting_down("retry"))
            return
        why = pool.unavailable(now)
        if why is not None:
            self._refuse("model_unavailable", _unavailable_error(self.model, why))
            return
        evicted = pool.queue.push(self.band, self.tenant, self, now)
        if evicted is False:
            gw.observer.admission(self.band_name, "rejected", "queue_full")
            self.shed("queue_full", f"the {self.model} pool is saturated and its {self.band_name} queue is full")
            return
        self.phase = P_QUEUED
        self._deadline(D_QUEUE, now + gw.queue_timeout)
        gw.observer.admission(self.band_name, "queued")
        if evicted is not None:
            assert isinstance(evicted, Call)
            victim = evicted  # (typed in proxy.pxd)
            gw.observer.admission(victim.band_name, "rejected", "evicted")
            victim.shed("evicted", f"the {self.model} pool is saturated; a higher-priority request took this slot"
                        if victim.band != self.band else f"the {self.model} pool is saturated and its "
                        f"{self.band_name} queue is full; this key had the most requests waiting there, and "
                        "another key's took this slot")
        # A pool that is saturated only because nothing is known yet still moves.
        gw.admit_next(pool)

    def shed(self, reason: str, message: str) -> None:
        """Answer 429 (with Retry-After from the pool's drain rate) and finish."""
        now = monotonic()
        wait = retry_after(self.pool.states, len(self.pool.queue), now)
        self.phase = P_DONE
        self._finish(RateLimitedError(f"{message}; retry after {math.ceil(wait)}s", retry_after=wait, code=reason))

    def _refuse(self, reason: str, error: HTTPError) -> None:
        """Answer ``error`` to a request sent nowhere yet (new, or taken out of the
        queue), counted as an admission rejection for ``reason``."""
        self.gw.observer.admission(self.band_name, "rejected", reason)
        self.phase = P_DONE
        self._finish(error)

    # -- attempts --

    def dispatch(self) -> None:
        """Choose a replica and send the request (now if a pooled connection is idle)."""
        gw = self.gw
        now = monotonic()
        if self.chain is None:
            ep = self.pool.pick(now, gw.stale_after, self.tried or ())
        else:
            ep = self.pool.pick_keyed(now, gw.stale_after, self.tried or (), self.chain, self.session)
        if ep is None:
            err = self.error
            if err is None:
                why = self.pool.unavailable(now)
                if why is not None:
                    err = _unavailable_error(self.model, why)
                else:
                    err = OverloadedError(
                        f"no replica of model `{self.model}` is available (all draining or failing)", retry_after=1
                    )
            self._finish(err)
            return
        self.ep = ep
        self.tries += 1
        state = ep.state
        self.probe = state.half_open()  # this request is the breaker's probe
        if self.probe:
            gw.half_opened(ep)
        state.on_dispatch(now)
        head = upstream_head(
            self.req.method,
            ep.target(self.req.target),
            ep.host_header,
            self.req.forward,
            len(self.body),
            self.rid_line + ep.auth_line,
        )
        conn = ep.pool.take_idle()
        if conn is not None:
            self._send(conn, head, reused=True)
            return
        self.phase = P_CONNECTING
        self.connect_task = gw.loop.create_task(self._connect(ep, head))

    async def _connect(self, ep: Endpoint, head: bytes, resend: bool = False) -> None:
        try:
            conn = await ep.pool.connect()
        except asyncio.CancelledError:
            return
        except TimeoutError:
            self._attempt_failed(
                GatewayTimeoutError(f"{self.gw.replica_name(ep)} did not accept a connection in time"), "connect_timeout"
            )
            return
        except OSError as exc:
            if isinstance(exc, ConnectionRefusedError) and not ep.state.down:
                # nothing listens there: down at once, as a refused scrape would say, so that the
                # requests after this one go elsewhere (the next scrape that reaches it says up)
                ep.unreachable = True
                ep.state.down = True
                upstream_logger.info("replica %s refused a connection: down until a scrape reaches it", ep.id)
            self._attempt_failed(
                BadGatewayError(f"{self.gw.replica_name(ep)} refused the connection ({exc.strerror or exc})"), "connect_refused"
            )
            return
        finally:
            self.connect_task = None
        if self.phase == P_DONE or self.ep is not ep:
            conn.release()
            return
        self._send(conn, head, False, resend)

    def _send(self, conn: UpstreamConnection, head: bytes, reused: bool, resend: bool = False) -> None:
        self.phase = P_SENT
        self.conn = conn
        self.resp = None
        self.reused = reused
        # (what a new connection to the same replica is sent if this one fails
        # first: once per attempt, not again on that new connection)
        self.head_tail = b"" if resend else head
        now = monotonic()
        self.sent_at = now
        self._deadline(D_FIRST_BYTE, now + self.gw.first_byte_timeout)
        conn.send(self, head, self.body)

    def _deadline(self, kind: int, at: float) -> None:
        """Expire at ``at`` (the monotonic clock) unless moved on first."""
        self.dkind = kind
        self.deadline = at
        self.gw.watch(self)

    def _attempt_failed(self, error: HTTPError, kind: str, counts: bool = True, sent: bool = False) -> None:
        """This attempt failed before any byte reached the client: retry or answer.

        ``sent``: the request's bytes were written to the replica, which may be
        working on it: answered, never sent to another replica (unless
        ``retries.after_send``).
        """
        gw = self.gw
        ep = self.ep
        assert ep is not None
        now = monotonic()
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.abort()
        ep.state.on_abort(now)
        ep.failures += 1
        if counts:
            gw.breaker_outcome(ep, False, now)
        elif self.probe:
            ep.state.breaker.release()
        gw.observer.upstream_error(ep.id, kind)
        self.error = error
        if upstream_logger.isEnabledFor(10):  # DEBUG; the JSON log format shows the request id
            upstream_logger.debug("replica %s failed: %s", ep.id, error.message, extra={"request_id": self.rid})
        if self.retrying:
            gw.budget.done_retry()
            self.retrying = False
        if self.w.disconnected:
            self._finish(None)
            return
        # A refused connection carried nothing, to a replica that is now down: its retry adds no
        # load anywhere the budget guards (it would turn away all but 3 of the requests caught
        # connecting to a replica that just died), and is bounded by retries.attempts all the same.
        free = kind == "connect_refused"
        if (
            self.tries <= gw.retry_attempts
            and (not sent or gw.retry_after_send)
            and (free or gw.budget.can_retry(gw.active_calls))
        ):
            if self.tried is None:
                self.tried = []
            self.tried.append(ep)
            if not free:
                gw.budget.record_retry()
                self.retrying = True
            gw.observer.retry(self.model, ep.id)
            self.dispatch()
            return
        self._finish(error)

    def _fresh_retry(self, exc: BaseException | None, written: bool) -> bool:
        """Send the request again on a new connection to the same replica, once: when
        none of it was written (the connection was found closed), or, with
        ``retries.after_send``, when a reused connection was lost before the answer
        began (the upstream client's rule: ``should_retry_fresh``)."""
        if not self.head_tail:
            return False  # (once per attempt)
        if written and not should_retry_fresh(self.reused, self.resp is not None, exc):
            return False
        head, self.head_tail = self.head_tail, b""
        ep = self.ep
        assert ep is not None
        self.conn = None
        self.phase = P_CONNECTING
        self.connect_task = self.gw.loop.create_task(self._connect(ep, head, True))
        return True

    # -- the ResponseReader sink (via the upstream connection) --

    def on_response_head(self, resp: Response) -> None:
        self.resp = resp
        self.ttfb = monotonic()
        if resp.event_stream and resp.status < 300:
            self.streaming = True
            w = self.w
            w.start(resp.status, (), -1, self._forward(resp) + self.rid_line + self.gw.replica_line(self.ep))  # type: ignore[arg-type]
            conn = self.conn
            if conn is not None:
                w.add_flow_listener(conn)
        elif resp.content_length > self.gw.max_buffered and resp.status < 400:
            self._start_relay()
        self._deadline(D_READ, self.ttfb + self.gw.read_timeout)

    def _forward(self, resp: Response) -> bytes:
        """The engine's header lines for the client.

        SECURITY: the one secret an engine is given is its own key; one that echoes
        it in a header has it redacted. PERF: one search of the header block, for
        replicas that have a key; every other secret is looked for in error answers.
        """
        fwd = resp.forward
        needle = self.ep.key_needle  # type: ignore[union-attr]
        if needle is not None and needle.within(fwd, 0, len(fwd)):
            fwd = self.gw.redact(fwd, self.ep)
        if not resp.dated:
            return fwd + self.gw.date_line(self.ttfb)
        return fwd

    def _start_relay(self) -> None:
        """A non-streamed answer too large to buffer (``upstream.max_buffered_body``):
        relay it as it arrives, framed as the engine framed it. With a Content-Length
        the client gets the same one, so a cut leaves it a body shorter than promised;
        a chunked (or close-delimited) answer goes chunked, and a cut ends it with no
        last chunk. Either way the cut stays visible: never a short 200 that looks whole.
        What was buffered so far goes first."""
        resp = self.resp
        assert resp is not None
        w = self.w
        self.relaying = True
        cl = resp.content_length
        w.start(resp.status, (), cl if cl >= 0 else -1,
                self._forward(resp) + self.rid_line + self.gw.replica_line(self.ep))  # type: ignore[arg-type]
        conn = self.conn
        if conn is not None:
            w.add_flow_listener(conn)  # (a slow client pauses the replica: memory stays bounded)
        buf, self._buf = self._buf, []
        for piece in buf:
            w.write(piece)
        if buf:
            self._tail = buf[len(buf) - 1]  # (no negative index: the module compiles with wraparound off)

    def on_response_body(self, data: bytes) -> None:
        if self.streaming:
            if self._run is not None:
                self.flush_chunks()  # (what came before this goes first)
            # PERF: no clock read per event; the sweep moves the read deadline on.
            self.progress = True
            # Relay whole SSE events only, so a cut never leaves half an event.
            cut = sse_cut(data)  # (the new bytes only: an event arriving in many reads is scanned once)
            pending = self._pending
            if pending:
                if cut == 0:
                    cut = _straddle(pending, self._more, data)
                    if cut == 0:
                        self._hold(data)
                        return
                if self._more is not None:
                    self._more.append(data)
                    data = b"".join([pending, *self._more])
                    self._more = None
                else:
                    data = pending + data
                cut += self._held
                self._held = 0
            elif cut == 0:
                self._pending = data
                self._held = len(data)
                return
            if cut == len(data):
                self._pending = b""
                out = data
            else:
                self._pending = data[cut:]
                self._held = len(data) - cut
                out = data[:cut]
            needle = self.ep.key_needle  # type: ignore[union-attr]
            if needle is not None and needle.within(out, 0, len(out)):  # SECURITY: an error event echoing it
                out = self.gw.redact(out, self.ep)
            self.sent_bytes += len(out)
            self.w.write(out)
            # Usage comes in the last events (with vLLM's continuous usage stats every
            # event carries the running totals, and the last counts, once): keep the
            # last two writes, read at the end instead of searching every event.
            self._tail_prev = self._tail
            self._tail = out
        elif self.relaying:
            self.progress = True
            self.sent_bytes += len(data)
            self._tail_prev = self._tail
            self._tail = data  # (usage is read off the last two reads at the end)
            self.w.write(data)
        else:
            # (read_timeout is the longest silence: a buffered answer's bytes move it on too)
            self.progress = True
            self._buf.append(data)
            self.sent_bytes += len(data)
            if self.sent_bytes > self.gw.max_buffered:
                if self.resp.status < 400:  # type: ignore[union-attr]
                    self._start_relay()
                    return
                # (an error answer is read whole to be normalized; one this large is not an error answer)
                self._attempt_failed(
                    BadGatewayError(f"{self.gw.replica_name(self.ep)} sent an error answer larger than {self.gw.max_buffered} bytes"),  # type: ignore[arg-type]
                    "bad_response", True, True,  # (the engine had the request: not resent, at most once)
                )

    def _hold(self, data: bytes) -> None:
        """``data`` is more of an SSE event not whole yet: kept (one more piece, not copied), unless the
        event outgrows ``upstream.max_buffered_body``: the stream is then cut (memory stays bounded)."""
        if not data:
            return  # (no piece held empty: _straddle reads the last two bytes held)
        held = self._held + len(data)
        gw = self.gw
        if held > gw.max_buffered:
            ep = self.ep
            assert ep is not None
            conn, self.conn = self.conn, None
            if conn is not None:
                conn.abort()
            self._pending = b""
            self._more = None
            self._held = 0
            gw.observer.upstream_error(ep.id, "bad_response")
            self._cut_stream(f"the replica sent an event larger than {gw.max_buffered} bytes "
                             "(upstream.max_buffered_body)", "upstream_bad_response")
            self._completed(False)
            return
        self._held = held
        if self._more is None:
            self._more = [data]
        else:
            self._more.append(data)

    def on_response_chunk(self, buf: bytes, chunk_start: int, start: int, end: int) -> None:
        """A whole chunk as the replica framed it: ``buf[chunk_start:end + 2]`` (size
        line, data, CRLF) in the read ``buf``; its data is ``buf[start:end]``.

        PERF: a stream's chunk that holds whole SSE events, with nothing pending,
        goes to the client as it came: its framing is valid chunked encoding, so
        the data is neither copied out nor framed again. Such chunks that follow
        one another in a read go out together, in one write, when the read has
        been parsed (:meth:`flush_chunks`), or before anything else is written.
        """
        if (
            self.streaming
            and not self._pending
            and end - start >= 2
            and buf[end - 1] == 10
            and (buf[end - 2] == 10 or (buf[end - 2] == 13 and end - start >= 3 and buf[end - 3] == 10))
            and self.w.chunked
            # SECURITY: a chunk with the replica's key in it (an error event echoing it) is redacted below
            and (self.ep.key_needle is None or not self.ep.key_needle.within(buf, start, end))  # type: ignore[union-attr]
        ):
            self.progress = True
            self.sent_bytes += end - start
            if self._run is buf and self._run_end == chunk_start:
                self._run_end = end + 2
                return
            if self._run is not None:
                self.flush_chunks()
            self._run = buf
            self._run_start = chunk_start
            self._run_end = end + 2
            return
        if self._run is not None:
            self.flush_chunks()
        self.on_response_body(buf[start:end])

    def on_read_end(self) -> None:
        """The upstream read is parsed: its whole chunks go out in one write."""
        if self._run is not None:
            self.flush_chunks()

    def flush_chunks(self) -> None:
        """Send the whole chunks noted by :meth:`on_response_chunk` (one write)."""
        buf = self._run
        if buf is None:
            return
        self._run = None
        if self._run_start == 0 and self._run_end == len(buf):
            out = buf
        else:
            out = buf[self._run_start : self._run_end]
        self.w.write_chunk(out)
        self._tail_prev = self._tail
        self._tail = out  # (usage is read off it at the end; the framing does not matter)

    def on_response_end(self) -> None:
        conn, self.conn = self.conn, None
        resp = self.resp
        ep = self.ep
        assert resp is not None and ep is not None
        w = self.w
        if self.streaming:
            if self._run is not None:
                self.flush_chunks()
            if self._pending:
                rest = self._pending if self._more is None else b"".join([self._pending, *self._more])
                needle = ep.key_needle
                if needle is not None and needle.within(rest, 0, len(rest)):
                    rest = self.gw.redact(rest, ep)
                w.write(rest)
                self.sent_bytes += len(rest)
                self._pending = b""
                self._more = None
                self._held = 0
            if conn is not None:
                # (llama-server closes after a stream while it says keep-alive:
                # pooled, the connection would meet the next request with its close)
                conn.release(not ep.engine.closes_after_stream)
            w.end()
            self._completed(True)
            return
        if self.relaying:
            if conn is not None:
                conn.release()
            w.end()
            if self.gw.count_tokens:
                prev = self._tail_prev
                self.usage = usage_counts(prev[max(0, len(prev) - 2048) :] + self._tail)
            self._completed(True)
            return
        buf = self._buf
        body = buf[0] if len(buf) == 1 else b"".join(buf)
        self._buf = []
        if conn is not None:
            conn.release()
        status = resp.status
        if status >= 400:
            if status == 401 or status == 403:
                self._auth_refused(status)
                return
            # (the engine's own error shapes: llmgw.engines.errors, handed in by the runtime;
            # SECURITY: redacted before and after, as normalizing may decode an escaped secret)
            gw = self.gw
            normalized = gw.redact(gw._normalize_error(status, gw.redact(body, ep), ep.engine), ep)
            # the engine's Retry-After (a 429's, a 503's) is the client's to honour, as the engine said it
            wait = _engine_retry_after(resp.forward) if status == 429 or status >= 500 else -1.0
            if status >= 500:
                if status in _RETRYABLE_STATUS:
                    message = orjson.loads(normalized)["error"]["message"]
                    err = HTTPError(
                        f"{gw.replica_name(ep)} answered {status}: {message}",
                        status=status,
                        type="service_unavailable_error" if status == 503 else "server_error",
                        code="service_unavailable" if status == 503 else "bad_gateway",
                        retry_after=wait if wait >= 0.0 else (1 if status == 503 else None),
                    )
                    self._attempt_failed(err, "status_5xx")
                    return
                gw.observer.upstream_error(ep.id, "status_5xx")
                lines = self.rid_line + gw.replica_line(ep) + _retry_lines(wait) + gw.date_line(self.ttfb)
                if status == 501:  # (what the engine does not implement, a retry asks again in vain)
                    lines += _NO_RETRY_LINE
                w.send(status, normalized, _JSON_CT, lines)
                self.sent_bytes = len(normalized)  # (the access log's bytes: what the client got)
                self._answered_5xx(status)
                return
            lines = self.rid_line + gw.replica_line(ep) + _retry_lines(wait) + gw.date_line(self.ttfb)
            if status != 408 and status != 409 and status != 429:
                lines += _NO_RETRY_LINE  # (the same request would be refused again; SDKs retry only those three)
            w.send(status, normalized, _JSON_CT, lines)
            self.sent_bytes = len(normalized)
            self._completed(True)
            ep.state.answered_error(True)  # (an answer, and an error one: see Gateway.answered_5xx_counts)
            return
        needle = ep.key_needle
        if needle is not None and needle.within(body, 0, len(body)):  # SECURITY: an answer echoing the key
            body = self.gw.redact(body, ep)
        w.send(status, body, (), self._forward(resp) + self.rid_line + self.gw.replica_line(ep))
        if self.gw.count_tokens:
            self.usage = usage_counts(body)
        self._completed(True)

    def _auth_refused(self, status: int) -> None:
        """The replica answered 401/403: it refused the key *llmgw* sent it (the
        client's own key, if any, was checked and never goes upstream). That is
        llmgw's misconfiguration, so the client never gets a 401 saying its key is
        bad: the replica is held out of routing (:meth:`Gateway.auth_refused`), not
        counted against its breaker, and the request is retried on another replica.

        NOTE: retried although it was sent: an engine checks the key before it
        does any work, so nothing was generated and sending it elsewhere does
        nothing twice. Only when no other replica takes it (retries.attempts, the
        retry budget) is the answer a 502 ``upstream_auth_failed``.
        """
        ep = self.ep
        assert ep is not None
        self.gw.auth_refused(ep, status)
        self._attempt_failed(
            UpstreamAuthError(
                f"{self.gw.replica_name(ep)} refused the API key the gateway sends it (HTTP {status}); "
                "the gateway's configuration for it must be fixed"
            ),
            "auth_failed",
            counts=False,
        )

    def _cut_relay(self, kind: str) -> None:
        """A relayed large answer lost its replica: close the client's connection
        mid-body (a short Content-Length body, or no last chunk)."""
        ep = self.ep
        assert ep is not None
        self.gw.observer.upstream_error(ep.id, kind)
        if not self.w.finished:
            self.w.abort()
        self._completed(False)

    def on_upstream_lost(self, exc: BaseException | None) -> None:
        conn, self.conn = self.conn, None
        if self._run is not None:
            self.flush_chunks()  # (whole events that arrived before the loss)
        if self.phase != P_SENT:
            return
        kind = "bad_response" if isinstance(exc, ValueError) else "reset"
        if self.relaying:
            self._cut_relay(kind)
            return
        if self.streaming:
            ep = self.ep
            assert ep is not None
            self.gw.observer.upstream_error(ep.id, kind)
            if kind == "bad_response":
                self._cut_stream("the replica sent a malformed answer", "upstream_bad_response")
            else:
                self._cut_stream("the replica closed the connection", "upstream_disconnected")
            self._completed(False)
            return
        # NOTE: at most once. Bytes handed to the transport may have reached the
        # engine, which may be generating: never sent again (unless after_send).
        written = conn is None or conn.written
        if (not written or self.gw.retry_after_send) and self._fresh_retry(exc, written):
            return
        ep = self.ep
        assert ep is not None
        if kind == "bad_response":
            # (not HTTP llmgw can relay: a status outside 100-599, bad framing, a 101, ...; the
            # reason is llmgw's own or llhttp's words, never the replica's bytes)
            why = str(exc).removeprefix("malformed upstream response: ")
            error = BadGatewayError(f"{self.gw.replica_name(ep)} sent a malformed answer ({why})",
                                    code="upstream_bad_response")
        else:
            error = BadGatewayError(f"{self.gw.replica_name(ep)} closed the connection before a complete answer")
        self._attempt_failed(error, kind, True, written)

    def _cut_stream(self, why: str, code: str) -> None:
        w = self.w
        if w.finished:
            return
        if not w.chunked:
            # a body of announced length cut short cannot be completed: only the close tells the client.
            # A chunked stream's framing is completed below, so the connection stays usable (closing it
            # would fail a client that reuses it at once with a request it cannot safely resend).
            w.keep_alive = False
        if not w.disconnected:
            # Never a fabricated [DONE] or finish_reason: the client learns the truth.
            w.write(_sse_error(f"stream interrupted: {why}", code))
        w.end()

    # -- deadlines (from the gateway's sweep) --

    def expired(self) -> None:
        kind = self.dkind
        self.dkind = D_NONE
        gw = self.gw
        if kind == D_QUEUE:
            if self.phase == P_QUEUED and self.pool.queue.remove(self):
                gw.observer.admission(self.band_name, "rejected", "queue_timeout")
                self.shed("queue_timeout", f"the {self.model} pool stayed saturated for {gw.queue_timeout:g}s")
            return
        if self.phase != P_SENT:
            return
        ep = self.ep
        assert ep is not None
        if kind == D_FIRST_BYTE and self.resp is None:
            conn, self.conn = self.conn, None
            if conn is not None:
                conn.abort()
            now = monotonic()
            ep.state.on_abort(now)
            ep.failures += 1
            gw.breaker_outcome(ep, False, now)
            gw.observer.upstream_error(ep.id, "first_byte_timeout")
            # Not retried, here or by the client (x-should-retry: false): the engine
            # may be working on it, and a retry would wait as long again.
            self._finish(GatewayTimeoutError(
                f"{gw.replica_name(ep)} did not answer within {gw.first_byte_timeout:g}s", should_retry=False
            ))
        elif kind == D_READ:
            w = self.w
            if (self.streaming or self.relaying) and w.write_paused and not w.finished:
                # NOTE: the replica was not silent: llmgw stopped reading it because the
                # client took no bytes (flow control pauses the replica while the client's
                # socket is full). A client that took nothing for read_timeout is cut as
                # gone, as nginx's send_timeout does; no verdict on the replica, whose
                # breaker a slow or stalled client must not open.
                server_logger.info(
                    "request %s for %s: the client read nothing of the answer for %gs; its connection is closed "
                    "and the replica's request aborted", self.rid.decode("latin-1"), self.model, gw.read_timeout,
                    extra={"request_id": self.rid},
                )
                w.abort()
                self.client_gone()
                return
            conn, self.conn = self.conn, None
            if conn is not None:
                conn.abort()
            if self.relaying:
                self._cut_relay("read_timeout")
                return
            if self.streaming:
                gw.observer.upstream_error(ep.id, "read_timeout")
                self._cut_stream("the replica stopped sending", "upstream_timeout")
                self._completed(False)
            else:
                self._attempt_failed(
                    BadGatewayError(f"{gw.replica_name(ep)} stopped sending its answer"), "read_timeout", True, True
                )

    def stop_now(self) -> None:
        """The gateway stops and waits no longer (``server.shutdown_timeout`` passed, or
        a second signal): end this request with an answer, never a bare cut. A stream
        ends with an SSE error event and the end of its chunked body (as a read
        timeout's cut); a request with no answer begun gets 503 ``shutting_down``."""
        phase = self.phase
        if phase == P_DONE:
            return
        if phase == P_QUEUED:
            self.pool.queue.remove(self)
            self.dkind = D_NONE
            self._refuse("shutting_down", _shutting_down("retry"))
            return
        task = self.connect_task
        if task is not None:
            task.cancel()
            self.connect_task = None
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.abort()  # (the engine stops generating)
        ep = self.ep
        if ep is not None and phase in (P_CONNECTING, P_SENT):
            # Not the replica's failure: no breaker outcome.
            ep.state.on_abort(monotonic())
            if self.probe:
                ep.state.breaker.release()
        if self.streaming:
            self._cut_stream("the gateway is shutting down", "shutting_down")
            self._finish(None)
        else:
            self._finish(_shutting_down("it could not wait longer for this answer; retry"))

    # -- endings --

    def client_gone(self) -> None:
        """The client disconnected: abort whatever is in progress, release everything."""
        phase = self.phase
        if phase == P_DONE:
            return
        gw = self.gw
        if phase == P_QUEUED:
            self.pool.queue.remove(self)
            gw.observer.admission(self.band_name, "rejected", "client_gone")
        task = self.connect_task
        if task is not None:
            task.cancel()
            self.connect_task = None
        conn, self.conn = self.conn, None
        if conn is not None:
            # NOTE: closing the upstream connection is how an engine learns to stop
            # generating; the slot frees at once.
            conn.abort()
        ep = self.ep
        if ep is not None and phase in (P_CONNECTING, P_SENT):
            ep.state.on_abort(monotonic())
            if self.probe:
                ep.state.breaker.release()
        if self.retrying:  # (a retry in flight holds a slot of the retry budget)
            gw.budget.done_retry()
            self.retrying = False
        self._done(None)

    def _completed(self, success: bool, counts: bool = True) -> None:
        """The replica answered (fully, or a stream that was then cut); ``counts``: a failure is a verdict
        on the replica for its breaker (else a probe it was is given back)."""
        ep = self.ep
        assert ep is not None
        now = monotonic()
        state = ep.state
        gw = self.gw
        if success:
            state.on_complete(now)
            ep.completed += 1
            gw.breaker_outcome(ep, True, now)
        else:
            state.on_abort(now)
            ep.failures += 1
            if counts:
                gw.breaker_outcome(ep, False, now)
            elif self.probe:
                state.breaker.release()  # (no verdict on the replica: another request probes)
        if self.retrying:
            gw.budget.done_retry()
            self.retrying = False
        self._done(None)

    def _answered_5xx(self, status: int) -> None:
        """The replica answered 500 (or another 5xx not retried), whole: it is there, and said the
        request failed. Whether that counts against its breaker: :meth:`Gateway.answered_5xx_counts`."""
        ep = self.ep
        assert ep is not None
        ep.state.answered_error(False)
        self._completed(False, ep.auth_failed or self.gw.answered_5xx_counts(self.pool, ep, status, monotonic()))

    def _finish(self, error: HTTPError | None) -> None:
        """Answer ``error`` (if the client is still there) and finish."""
        w = self.w
        if error is not None and not w.started and not w.disconnected:
            # (nothing went out before: the access log's bytes are the error's body; an answer about a
            # replica's attempt names it, as a relayed one does)
            ep = self.ep
            extra = ((b"x-request-id", self.rid), (b"date", _http_date())) if ep is None or not self.gw.expose_replica \
                else ((b"x-request-id", self.rid), (b"date", _http_date()), (b"x-llmgw-replica", ep.id.encode()))
            self.sent_bytes = w.send_error(error, extra)
        elif not w.finished and w.started:
            w.abort()
        if self.retrying:
            self.gw.budget.done_retry()
            self.retrying = False
        self._done(error)

    def _done(self, error: HTTPError | None) -> None:
        if self.closed:
            return
        self.closed = True
        self.phase = P_DONE
        self.dkind = D_NONE
        gw = self.gw
        gw.unwatch(self)
        gw.active_calls -= 1
        now = monotonic()
        ep = self.ep
        w = self.w
        ttfb = self.ttfb - self.started if self.ttfb >= 0.0 else -1.0
        upstream = now - self.sent_at if self.sent_at >= 0.0 else -1.0
        replica = ep.id if ep is not None else None
        if self.streaming and gw.count_tokens:
            usage = usage_counts(_last_events(self._tail)) if self._tail else None
            if usage is None and self._tail_prev:
                usage = usage_counts(_last_events(self._tail_prev))
            self.usage = usage
        usage = self.usage
        counters = gw.counters
        if counters is not None:  # PERF: C calls, not Python method calls
            counters.record(self.model, replica, w.status, self.band_name, now - self.started, ttfb, upstream)
            if usage is not None:
                counters.tokens(self.model, usage[0], usage[1])
        else:
            observer = gw.observer
            observer.request_done(
                self.model, replica, w.status, self.band_name, now - self.started,
                ttfb if ttfb >= 0.0 else None, upstream if upstream >= 0.0 else None,
            )
            if usage is not None:
                observer.tokens(self.model, usage[0], usage[1])
        if gw.access_log:
            gw.log_access(self, now)
        gw.admit_next(self.pool)


class Gateway(App):
    """The client port's app (see the module docstring).

    Args:
        config: the configuration (re-read on :meth:`reconfigure`).
        registry: the replicas and model pools (``llmgw.fleet.registry.Registry``);
            its ``pools`` dict is read per request and kept up to date by it.
        normalize_error: ``(status, body, engine) -> bytes``, an engine's error
            answer in OpenAI's shape (``llmgw.engines.errors.normalize_error``:
            what llmgw knows of each engine lives there, not here).
    """

    def __init__(self, config: Config, registry: Any, normalize_error: Callable[[int, bytes, Any], bytes]) -> None:
        self._normalize_error = normalize_error
        self.loop = asyncio.get_running_loop()
        self.registry = registry
        self.pools: dict[str, ModelPool] = registry.pools  # (the registry's own dict, kept up to date by it)
        self._rid_prefix = os.urandom(6).hex().encode() + b"-"
        self._rid_n = 0
        self._date_line = b""
        self._date_until = -1.0
        self.created = int(time.time())
        self.observer: _counters.Observer = NullObserver()
        self.counters: TrafficCounters | None = None
        self.count_tokens = False
        self.active_calls = 0
        self.closing = False
        self._admitting = False
        self._watched: set[Call] = set()
        self._sweep_handle: asyncio.TimerHandle | None = None
        self.held_models: Container[str] = frozenset()
        """Models that answer 503 ``model_unavailable`` rather than 404 while they have no replica
        (the control plane's deployments: ``llmgw.control.deployments``)."""
        self.reconfigure(config)

    def reconfigure(self, config: Config) -> None:
        """Adopt a new configuration (a reload): tables are rebuilt, connections kept."""
        self.config = config
        self.first_byte_timeout = config.upstream.first_byte_timeout
        self.read_timeout = config.upstream.read_timeout
        self.max_buffered = config.upstream.max_buffered_body
        self.retry_attempts = config.retries.attempts
        self.retry_after_send = config.retries.after_send
        self.budget = RetryBudget(config.retries.budget)
        self.stale_after = config.scrape.stale_after
        self.max_waiting = float(config.saturation.max_waiting)
        self.max_kv = config.saturation.max_kv_cache_usage
        adm = config.admission
        self.bands = adm.bands
        self.band_index = {b.encode(): i for i, b in enumerate(adm.bands)}
        self.default_band = adm.bands.index(adm.default_band)
        self.queue_timeout = adm.queue_timeout
        self.aliases = config.aliases()
        # model name as the client says it -> name to put in the upstream body
        rewrites: dict[str, str] = {}
        for m in config.models.values():
            if m.upstream_name:
                rewrites[m.name] = m.upstream_name
        for alias, real in self.aliases.items():
            rewrites[alias] = config.models[real].upstream_name or real
        self.rewrites = rewrites
        self.keys = {k.sha256: k for k in config.auth.keys}
        key_bands: dict[bytes, int] = {}
        key_tops: dict[bytes, int] = {}
        for k in config.auth.keys:
            top = adm.bands.index(k.max_band) if k.max_band in adm.bands else None
            if k.band is not None and k.band in adm.bands:
                key_bands[k.sha256] = adm.bands.index(k.band)
            elif top is not None and self.default_band < top:  # (a default above the key's ceiling: its ceiling)
                key_bands[k.sha256] = top
            if top is not None:
                key_tops[k.sha256] = top
        self.key_bands = key_bands
        self.key_tops = key_tops
        self.auth = bool(self.keys)
        self._secrets = config_secrets(config)
        self.access_log = config.access_log.enabled
        self.expose_replica = config.server.expose_replica
        r = config.routing
        self.routed = r.strategy == "prefix" or any(m.strategy == "prefix" for m in config.models.values())
        self.route_block = r.prefix.block
        self.route_blocks = r.prefix.blocks
        self.session_header = r.prefix.session_header.strip().lower().encode("ascii")

    def set_observer(self, observer: _counters.Observer, count_tokens: bool | None = None) -> None:
        """Report the data path's work to ``observer`` (metrics).

        ``count_tokens``: read token usage off the answers for it (default: unless
        it is a :class:`NullObserver`; ``False`` measures the hooks alone).
        """
        self.observer = observer
        self.counters = observer if isinstance(observer, TrafficCounters) else None
        self.count_tokens = not isinstance(observer, NullObserver) if count_tokens is None else count_tokens

    # -- deadlines: one sweep for every call, instead of a timer per call --

    def watch(self, call: Call) -> None:
        self._watched.add(call)
        if self._sweep_handle is None:
            self._sweep_handle = self.loop.call_later(_TICK, self._sweep)

    def unwatch(self, call: Call) -> None:
        self._watched.discard(call)

    def _sweep(self) -> None:
        self._sweep_handle = None
        now = monotonic()  # (deadlines are kept in this clock)
        read_timeout = self.read_timeout
        expired = []
        for c in self._watched:
            if c.progress:  # an answer's bytes came since the last sweep: its read deadline too
                c.progress = False
                if c.dkind == D_READ:
                    c.deadline = now + read_timeout
            if c.dkind != D_NONE and c.deadline <= now:
                expired.append(c)
        for c in expired:
            c.expired()
        keep = set()
        for c in self._watched:
            if c.dkind != D_NONE:
                keep.add(c)
        self._watched = keep
        if self._watched:
            self._sweep_handle = self.loop.call_later(_TICK, self._sweep)
        # Breakers reopen and scrapes move on with time: let queued requests re-check.
        for pool in self.registry.pools.values():
            if len(pool.queue):
                self.admit_next(pool)

    def admit_next(self, pool: ModelPool) -> None:
        """Dispatch queued requests while the pool is below saturation 1.0."""
        queue = pool.queue
        if not len(queue) or self._admitting:
            return
        self._admitting = True
        try:
            self._admit(pool)
        finally:
            self._admitting = False

    def _admit(self, pool: ModelPool) -> None:
        queue = pool.queue
        if self.closing:
            self._refuse_queued(pool, "shutting_down", _shutting_down("retry"))
            return
        for _ in range(len(queue)):
            now = monotonic()
            sat = pool.saturation(now, self.stale_after, self.max_waiting, self.max_kv)
            if sat >= 1.0:
                if sat == math.inf:
                    # No replica usable: if the pool is down (not just waiting on a
                    # breaker's probe), waiting helps nobody: answer them all now.
                    why = pool.unavailable(now)
                    if why is not None:
                        self._refuse_queued(pool, "model_unavailable", _unavailable_error(pool.name, why))
                        return
                # Nothing in flight and still "full": nothing will free capacity but
                # time; the sweep checks again.
                if not any(st.inflight for st in pool.states):
                    self._ensure_sweep()
                return
            popped = queue.pop()
            if popped is None:
                return
            assert isinstance(popped, Call)
            call = popped  # (typed in proxy.pxd)
            call.dkind = D_NONE
            self.observer.admission(call.band_name, "dequeued")
            call.dispatch()

    def _refuse_queued(self, pool: ModelPool, reason: str, error: HTTPError) -> None:
        """Answer ``error`` to every request queued for ``pool``, now."""
        queue = pool.queue
        for _ in range(len(queue)):
            popped = queue.pop()
            if popped is None:
                return
            assert isinstance(popped, Call)
            call = popped  # (typed in proxy.pxd)
            call.dkind = D_NONE
            call._refuse(reason, error)

    def shutdown(self) -> None:
        """Stop queueing (the first step of a graceful shutdown): every request waiting
        for admission gets 503 ``shutting_down`` now, and so does every request that
        would wait from now on; requests already sent go on (see :meth:`cut`)."""
        self.closing = True
        for pool in list(self.pools.values()):
            if len(pool.queue):
                self.admit_next(pool)

    def cut(self, w: ResponseWriter) -> bool:
        """The server waits no longer for ``w`` (shutdown): end its request honestly
        now (:meth:`Call.stop_now`); ``False`` when it is not one of this gateway's calls."""
        watcher = w.watcher
        if not isinstance(watcher, Call):
            return False
        call = watcher  # (typed in proxy.pxd)
        call.stop_now()
        return True

    def answered_5xx_counts(self, pool: ModelPool, ep: Endpoint, status: int, now: float) -> bool:
        """Whether ``ep``'s answer ``status`` (a 5xx it answered, not 502/503) counts against its breaker.
        A 504 and the other 5xx do; a 501 never; a 500 as follows.

        A 500 the engine answers whole is as often a verdict on the request as on the engine (an
        input it cannot take: llama-server answers 500 to an image for a text model, where vLLM
        answers 400), and one client repeating such requests (its SDK retries each 500 twice)
        would open the breakers of healthy replicas and take the model away from everyone. So it
        counts only while another replica of the model answers (2xx/4xx) since ``ep``'s first 5xx
        of the streak *and* errs (answers >= 400) at most half as often (``err_rate``, over about
        8 answers each): a replica failing what its siblings serve is the replica; replicas failing
        alike are failing the requests (one client's among the others' is spread over them all).
        """
        if status != 500:
            return status != 501  # (504 and the rest: the replica's path failed)
        state = ep.state
        since = state.erring_since
        if since != since:
            state.erring_since = since = now
        mine = state.err_rate
        return any(other is not state and other.answered_at > since and other.err_rate * 2.0 <= mine
                   for other in pool.states)

    def breaker_outcome(self, ep: Endpoint, success: bool, now: float) -> None:
        """Tell ``ep``'s breaker how an attempt ended; report a state change."""
        if success and ep.state.breaker_settled():
            return  # PERF: the usual case; record_success would change nothing
        if ep.auth_failed:
            self._auth_outcome(ep, success, now)
            return
        breaker = ep.state.breaker
        before = breaker.state_code
        if success:
            breaker.record_success(now)
        else:
            breaker.record_failure(now)
        if breaker.state_code != before:
            self.observer.breaker_transition(ep.id, breaker.state)

    # -- a replica that refuses its key (cold path) --

    def auth_refused(self, ep: Endpoint, status: int) -> None:
        """``ep`` answered 401/403: hold it out of routing (warned once, naming the
        replica, never the key)."""
        if ep.hold_auth(monotonic()):
            upstream_logger.warning(
                "replica %s refused the API key the gateway sends it (HTTP %d): fix its api_key or api_key_env "
                "and reload; until then it takes no requests but one probe every %gs, and its model's other "
                "replicas serve",
                ep.id, status, self.config.breaker.cooldown,
            )

    def _auth_outcome(self, ep: Endpoint, success: bool, now: float) -> None:
        """An attempt on a replica held for a refused key ended other than 401/403.

        Only the gate's probe (the one request it let through, half-open) says
        anything of the key now; an answer to a request sent before the hold is
        ignored. Answered (any status but 401/403, 5xx aside): the key is accepted.
        No verdict (a 5xx, a reset, a timeout): probe again next cooldown. The
        replica's own breaker counts none of it.
        """
        gate = ep.state.breaker
        if gate.state_code != _score.BREAKER_HALF_OPEN:
            return
        if success:
            ep.clear_auth()
            upstream_logger.info("replica %s accepts the gateway's API key again; it is back in routing", ep.id)
        else:
            gate.record_failure(now)

    def redact(self, data: bytes, ep: Endpoint | None = None) -> bytes:
        """``data`` with every secret the gateway knows replaced (:func:`redact`): the
        replicas' keys (``ep``'s too, if it left the registry), the admin token, join
        tokens, and the client keys (by digest); pieces of ``ep``'s key, the one its
        engine was sent."""
        plain = list(self._secrets)
        for e in self.registry.endpoints.values():
            if e.api_key is not None:
                plain.append(e.api_key)
        mine = ep.api_key if ep is not None else None
        if mine is not None:
            plain.append(mine)
        return redact(data, plain, self.keys, (mine,) if mine is not None else ())

    def _ensure_sweep(self) -> None:
        if self._sweep_handle is None:
            self._sweep_handle = self.loop.call_later(_TICK, self._sweep)

    def on_scrape(self, ep: Endpoint) -> None:
        """A scrape of ``ep`` landed or failed: queued requests of its models may go
        now, or be answered 503 (the pool went down)."""
        pools = self.registry.pools
        for m in ep.models:
            pool = pools.get(m)
            if pool is not None and len(pool.queue):
                self.admit_next(pool)

    # -- routing --

    def handle(self, req: Request, w: ResponseWriter) -> None:
        target = req.target
        # PERF: the common case, a POST to /v1/... without a query string, skips
        # building the path.
        path = target if b"?" not in target else req.path
        method = req.method
        if path[:4] != b"/v1/":
            if path == b"/health":
                # Liveness on the client port, as vLLM, SGLang and llama-server
                # answer it (benchmark clients probe it): no detail, no key needed.
                if method != b"GET" and method != b"HEAD":
                    raise MethodNotAllowedError(f"method {method.decode('latin-1')} is not allowed on /health",
                                                ("GET", "HEAD"))
                self._answer_local(req, w, 200, b"")
                return None
            origin = _origin_form(target)
            if origin is not None:
                # RFC 9112 §3.2.2: a server MUST accept the absolute-form (a client that takes
                # llmgw for a proxy); routed as its path and query, sent on in origin-form
                req.target = origin
                return self.handle(req, w)
            raise _no_route(path)
        # PERF: one-byte tests (memchr, compiled: path is bytes); the exact test only when one hits
        if (b"." in path or b"%" in path or b"\\" in path) and _dot_segments(path):
            # An engine (or a proxy in front of it) that resolves dot segments would serve
            # /v1/../admin as /admin, with the replica's own key: never forwarded.
            raise _bad_path(path)
        if len(path) > 4:
            # PERF: one byte read (a C char, compiled); the exact test only for a path whose first
            # segment starts as an engine's admin endpoint may ("l", "u", either case, "%", "/")
            c = path[4]
            if (c == 108 or c == 117 or c == 37 or c == 47 or c == 76 or c == 85) and _engine_admin(path):
                raise _admin_refused(path)
        key = self._authenticate(req) if self.auth else None
        if method == b"POST":
            self._proxy(req, w, key)
            return None
        models = path == b"/v1/models" or path.startswith(b"/v1/models/")
        if models and (method == b"GET" or method == b"HEAD"):
            if path == b"/v1/models" or path == b"/v1/models/":  # (with a trailing slash: the list, not model "")
                self._answer_local(req, w, 200, orjson.dumps({"object": "list", "data": self._model_cards()}))
                return None
            # the id percent-decoded: SDKs send "org/name" ids as org%2Fname
            name = unquote_to_bytes(path[len(b"/v1/models/") :]).decode("utf-8", "replace")
            for card in self._model_cards():
                if card["id"] == name:
                    self._answer_local(req, w, 200, orjson.dumps(card))
                    return None
            raise ModelNotFoundError(f"The model `{name}` does not exist or you do not have access to it.")
        if not models and path not in _POST_ROUTES:
            # (POSTs to any /v1/ path are passed on: the engine knows its routes; another method on a path
            # that is no known route is OpenAI's 404, not a 405 promising that a POST would do)
            raise NotFoundError(f"Invalid URL ({method.decode('latin-1')} {path.decode('latin-1')[:200]}): llmgw "
                                "serves GET /v1/models and the OpenAI API's POST routes under /v1/")
        raise MethodNotAllowedError(
            f"method {method.decode('latin-1')} is not allowed on {path.decode('latin-1')[:200]}",
            ("GET", "HEAD", "POST") if models else ("POST",),
        )

    def precheck(self, req: Request) -> HTTPError | None:
        """A head asking for ``100 Continue``: what :meth:`handle` would refuse from the head alone
        (no such route, a missing or wrong key) is answered before the client sends its body."""
        target = req.target
        path = target if b"?" not in target else req.path
        if path[:4] != b"/v1/":
            if path == b"/health" or _origin_form(target) is not None:
                return None  # (routed as handle routes them, body and all)
            return _no_route(path)
        if (b"." in path or b"%" in path or b"\\" in path) and _dot_segments(path):
            return _bad_path(path)  # (handle's 400, in handle's order: before the key)
        if _engine_admin(path):
            return _admin_refused(path)  # (handle's 403, in handle's order)
        if self.auth:
            try:
                self._authenticate(req)
            except HTTPError as exc:
                return exc
        return None

    def answer_error(self, w: ResponseWriter, exc: HTTPError) -> None:
        """Every error the server answers for this app (what :meth:`handle` raised, a
        500, a request refused before routing: malformed, too large, too slow):
        with a request id, counted and logged like any answer."""
        req = w.request
        rid_line = self._request_id(req)
        rid = rid_line[14 : len(rid_line) - 2]
        nbytes = w.send_error(exc, ((b"x-request-id", rid), (b"date", _http_date())))
        self._local_done(req, w, rid, None, -1.0, nbytes)

    def _answer_local(self, req: Request, w: ResponseWriter, status: int, body: bytes) -> None:
        """An answer the gateway gives itself (models, health): with a request id, counted, logged."""
        rid_line = self._request_id(req)
        w.send(status, body, _JSON_CT if body else (), rid_line + b"date: " + _http_date() + b"\r\n")
        self._local_done(req, w, rid_line[14 : len(rid_line) - 2], None, -1.0, len(body))

    def _local_done(self, req: Request, w: ResponseWriter, rid: bytes, model: str | None, started: float,
                    nbytes: int = 0) -> None:
        """Count and log an answer no replica gave: under ``model`` with its real
        duration when it named a served one, else under ``(unknown)`` and out of the
        latency histograms."""
        band = self.bands[self.default_band]
        duration = monotonic() - started if model is not None else -1.0
        label = model if model is not None else _UNKNOWN
        self.observer.request_done(label, None, w.status, band, duration if duration >= 0.0 else None, None, None)
        if self.access_log:
            self._access_line(req, rid, label, band, None, 0, w, nbytes, None,
                              round(duration * 1000, 3) if duration >= 0.0 else None)

    def half_opened(self, ep: Endpoint) -> None:
        """``ep``'s breaker may have just moved from open to half-open (in the
        picker, taking its probe): report each such move once."""
        if ep.auth_failed:
            return  # (the probe of a refused key: its gate is not the replica's breaker)
        breaker = ep.state.breaker
        n = breaker.half_opened
        while ep.half_opened_seen < n:
            ep.half_opened_seen += 1
            self.observer.breaker_transition(ep.id, "half_open")

    def replica_line(self, ep: Endpoint) -> bytes:
        """The ``x-llmgw-replica`` header line for answers from ``ep`` (``b""`` with
        ``server.expose_replica: false``: the access log and metrics name it anyway)."""
        return ep.replica_line if self.expose_replica else b""

    def date_line(self, now: float) -> bytes:
        """``date: …`` CRLF for an answer whose replica sent no Date (llama-server sends none; RFC
        9110 §6.6.1: a recipient with a clock that forwards a response without one MUST add it). ``now``
        is the monotonic time the answer came; the line is remade when a new second begins."""
        if now >= self._date_until:
            t = time.time()
            second = int(t)
            self._date_line = b"date: " + _date_of(second) + b"\r\n"
            self._date_until = now + (second + 1 - t)
        return self._date_line

    def replica_name(self, ep: Endpoint) -> str:
        """How an error message to a client names ``ep``: ``replica <id>``, or ``a replica``
        with ``server.expose_replica: false`` (the access log and the server log name it anyway)."""
        return f"replica {ep.id}" if self.expose_replica else "a replica"

    def _authenticate(self, req: Request) -> bytes:
        key: bytes | None = None
        auth = req.authorization
        if auth is not None:
            if auth[:7].lower() == b"bearer ":
                key = auth[7:].strip()
        elif req.x_api_key is not None:
            key = req.x_api_key.strip()
        if not key:
            raise UnauthorizedError(
                "You didn't provide an API key. Send it as Authorization: Bearer <key>.", code="missing_api_key"
            )
        digest = hashlib.sha256(key).digest()
        found = self.keys.get(digest)
        # SECURITY: compare in constant time; never echo the key.
        if found is None or not hmac.compare_digest(found.sha256, digest):
            raise UnauthorizedError("Incorrect API key provided.")
        return digest

    def _model_cards(self) -> list[dict[str, Any]]:
        """The models a client may ask for: those with replicas, their aliases, and those held (a
        deployed model with no replica ready now, one a standby names: asked for, they are 503 and
        retried, so they are listed, not missing from the list while a POST says they exist)."""
        served = self.registry.models()
        cards = [{"id": m, "object": "model", "created": self.created, "owned_by": "llmgw"} for m in served]
        listed = set(served)
        held = self.held_models
        for m in sorted(held) if isinstance(held, frozenset) else ():
            if m not in listed:
                listed.add(m)
                cards.append({"id": m, "object": "model", "created": self.created, "owned_by": "llmgw"})
        for alias, real in self.aliases.items():
            if real in listed:
                cards.append({"id": alias, "object": "model", "created": self.created, "owned_by": "llmgw", "root": real})
        return cards

    def _request_id(self, req: Request) -> bytes:
        """The request's ``x-request-id`` header line."""
        rid = req.request_id
        # Accept the client's id when it is a short token of visible ASCII.
        if rid is not None and 0 < len(rid) <= 128 and not rid.translate(None, _VISIBLE_ASCII):
            return id_line(rid)
        self._rid_n += 1
        return id_line(self._rid_prefix, self._rid_n)

    def _proxy(self, req: Request, w: ResponseWriter, key: bytes | None) -> None:
        started = monotonic()
        rid_line = self._request_id(req)
        try:
            call = self._prepare(req, w, rid_line, key, started)
        except HTTPError as exc:
            rid = rid_line[14 : len(rid_line) - 2]
            nbytes = w.send_error(exc, ((b"x-request-id", rid), (b"date", _http_date())))
            self._local_done(req, w, rid, self._served_model(req.body), started, nbytes)
            return
        self.active_calls += 1
        w.watch(call)  # (PERF: one slot, not an on_disconnect callback)
        call.admit()

    def _served_model(self, body: bytes) -> str | None:
        """The served model a refused body names, if it names one (cold path: the
        answer was an error; the body is scanned again)."""
        try:
            is_object, model = json_model(body)
        except JSONScanError:
            return None
        if not is_object or not model:
            return None
        real = self.aliases.get(model, model)
        pool = self.pools.get(real)
        return real if pool is not None and pool.endpoints else None

    def _prepare(self, req: Request, w: ResponseWriter, rid_line: bytes, key: bytes | None, started: float) -> Call:
        body = req.body
        # PERF: validated in one pass without building the document; only the
        # top-level "model" is read (see llmgw._fast.jsonscan_py).
        chain = None
        session = 0
        try:
            if self.routed:  # some model routes by prefix: its key is read in the same pass
                is_object, model, chain, session = json_route(body, self.route_block, self.route_blocks)
            else:
                is_object, model = json_model(body)
        except JSONScanError as exc:
            # (PERF: no local of its own on the hot path: the form is read again to rewrite its model)
            model = _form_model(body, req.content_type, exc)
            is_object = True
        if not is_object:
            raise BadRequestError("The request body must be a JSON object.", code="invalid_json")
        if not model:
            raise _no_model(body)
        real = self.aliases.get(model, model)
        pool = self.pools.get(real)
        if pool is None or not pool.endpoints:
            held = self.held_models
            if real in held:
                # (the cold path: a deployed model with no replica now, scaled to 0 or still starting;
                # or a follower before its first table, whose container holds every name and says why)
                reasons = getattr(held, "reasons", None)
                why = (reasons.get(real) if reasons else None) or getattr(held, "reason", None)
                raise ModelUnavailableError(
                    f"the model `{model[:200]}` is unavailable: "
                    + (why or "its deployment has no ready replica (scaled to 0, or its replicas are starting)"),
                    param="model", retry_after=_RETRY_AFTER_DEFAULT,
                )
            raise ModelNotFoundError(
                f"The model `{model[:200]}` does not exist or you do not have access to it.", param="model"
            )
        rewrite = self.rewrites.get(model)
        if rewrite is not None and rewrite != model:
            # Only the name changes; every other byte goes upstream as the client sent it.
            try:
                start, end = model_span(body)
            except JSONScanError:
                body = _form_rewrite(body, req.content_type, rewrite)  # (a multipart/form-data body)
            else:
                body = body[:start] + orjson.dumps(rewrite) + body[end:]
        call = Call.__new__(Call)
        call._init(self, req, w, pool, model, body, rid_line, started)
        if chain is not None and pool.keyed:
            # (the header, if the client sent one, names the conversation before the body does)
            sid = header_hash(req.forward, self.session_header) if req.forward else 0
            if sid:
                session = sid
            call.chain = chain
            call.session = session
        band = self.default_band
        if key is not None:
            band = self.key_bands.get(key, band)
            call.tenant = key
        prio = req.priority
        if prio is not None:
            idx = self.band_index.get(prio.strip().lower())
            if idx is None:
                raise BadRequestError(
                    f"unknown priority band {prio.decode('latin-1')[:64]!r}; use one of {', '.join(self.bands)}",
                    code="invalid_priority",
                )
            if key is not None and idx < self.key_tops.get(key, 0):
                raise HTTPError(
                    f"this API key may not ask for priority band {self.bands[idx]!r}: its highest is "
                    f"{self.bands[self.key_tops[key]]!r} (bands, highest first: {', '.join(self.bands)})",
                    status=403, type="invalid_request_error", code="priority_not_allowed", should_retry=False,
                )
            band = idx
        call.band = band
        call.band_name = self.bands[band]
        return call

    def log_access(self, call: Call, now: float) -> None:
        self._access_line(
            call.req,
            call.rid,
            call.model,
            call.band_name,
            call.ep.id if call.ep is not None else None,
            call.tries,
            call.w,
            call.sent_bytes,
            round((call.ttfb - call.started) * 1000, 3) if call.ttfb >= 0.0 else None,
            round((now - call.started) * 1000, 3),
        )

    def _access_line(
        self,
        req: Request,
        rid: bytes,
        model: str,
        band: str,
        replica: str | None,
        attempts: int,
        w: ResponseWriter,
        nbytes: int,
        ttfb_ms: float | None,
        duration_ms: float | None,
    ) -> None:
        access_logger.info(
            orjson.dumps(
                {
                    "ts": time.time(),
                    "id": rid.decode("latin-1"),
                    "method": req.method.decode("latin-1"),
                    "path": req.path.decode("latin-1"),
                    "model": model,
                    "band": band,
                    "replica": replica,
                    "attempts": attempts,
                    "status": w.status,
                    "bytes": nbytes,
                    "ttfb_ms": ttfb_ms,
                    "duration_ms": duration_ms,
                    "client_disconnected": w.disconnected,
                }
            ).decode()
        )

    def close(self) -> None:
        """Stop the deadline sweep."""
        if self._sweep_handle is not None:
            self._sweep_handle.cancel()
            self._sweep_handle = None
