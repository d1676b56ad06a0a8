"""The client-facing app: OpenAI routes in, replicas out.

``POST /v1/*`` with a JSON body naming a ``model`` is proxied to one of that
model's replicas; ``GET /v1/models`` lists the fleet's models. The body is read
only for ``model`` and ``stream`` and forwarded byte for byte unless the model
name must be rewritten (an alias, or ``upstream_name``).

Failure semantics:

* before any byte reached the client (connect refused or timed out, reset,
  502/503 from the engine, a non-streamed answer cut short) the request is retried
  on another replica of the model (``retries.attempts`` times), then answered with
  a clear error;
* after the first byte there is never a retry: a stream cut by the engine ends
  with an SSE ``data: {"error": ...}`` event and the connection is closed;
* a client that goes away aborts the upstream request at once.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import os
import time
from collections.abc import Awaitable
from typing import Any

import orjson

from ..config import Config
from ..errors import (
    BadGatewayError,
    BadRequestError,
    GatewayTimeoutError,
    HTTPError,
    ModelNotFoundError,
    NotFoundError,
    OverloadedError,
    UnauthorizedError,
)
from ..fleet.registry import Endpoint, Registry
from ..http.client import UpstreamConnection
from ..http.parser import Request, Response, upstream_head
from ..http.server import ResponseWriter
from ..log import access_logger, upstream_logger
from .observe import NullObserver, Observer

__all__ = ["Gateway", "normalize_error"]

_SSE_SEP = b"\n\n"
_MAX_BUFFERED = 64 * 1024 * 1024
_RETRYABLE_STATUS = (502, 503)

_CODE_BY_STATUS = {
    400: "invalid_request",
    401: "invalid_api_key",
    403: "permission_denied",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    409: "conflict",
    413: "request_too_large",
    422: "invalid_request",
    429: "rate_limit_exceeded",
    500: "internal_error",
    501: "not_implemented",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "gateway_timeout",
}
_TYPE_BY_STATUS = {401: "invalid_request_error", 429: "rate_limit_exceeded", 503: "service_unavailable_error"}
_CODE_BY_TYPE = {"exceed_context_size_error": "context_length_exceeded"}


def normalize_error(status: int, body: bytes) -> bytes:
    """An engine's error body in OpenAI's shape, with a string ``code``.

    Engines put the HTTP status (an integer) in ``code`` (vLLM, llama.cpp,
    TensorRT-LLM), answer ``{"error": "Unauthorized"}`` (vLLM, SGLang), use the flat
    pre-0.10.1 vLLM shape, or send plain text; all become
    ``{"error": {"message", "type", "param", "code"}}``.
    """
    message: str | None = None
    etype: Any = None
    param: Any = None
    code: Any = None
    extra: dict[str, Any] = {}
    try:
        data = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        data = None
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict):
            src = err
        elif isinstance(err, str):
            src = {"message": err}
        elif data.get("object") == "error" or "message" in data or "detail" in data:
            src = data
        else:
            src = {}
        msg = src.get("message", src.get("detail"))
        message = msg if isinstance(msg, str) else (orjson.dumps(msg).decode() if msg is not None else None)
        etype = src.get("type")
        param = src.get("param")
        code = src.get("code")
        for k in ("n_prompt_tokens", "n_ctx"):
            if k in src:
                extra[k] = src[k]
    elif body:
        message = body[:500].decode("utf-8", "replace").strip() or None
    if not isinstance(etype, str) or not etype:
        etype = _TYPE_BY_STATUS.get(status, "invalid_request_error" if status < 500 else "server_error")
    if not isinstance(code, str) or not code:
        code = _CODE_BY_TYPE.get(etype) or _CODE_BY_STATUS.get(status, f"http_{status}")
    if not isinstance(param, str):
        param = None
    if not message:
        message = f"the engine answered HTTP {status}"
    out: dict[str, Any] = {"message": message, "type": etype, "param": param, "code": code}
    out.update(extra)
    return orjson.dumps({"error": out})


def _sse_error(message: str, code: str) -> bytes:
    return b"data: " + orjson.dumps(
        {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    ) + _SSE_SEP


class _Retry:
    """An attempt failed before anything reached the client."""

    __slots__ = ("error", "fresh")

    def __init__(self, error: HTTPError, fresh: bool = False) -> None:
        self.error = error
        self.fresh = fresh  # a reused keep-alive connection died: retry the same replica


_DONE = object()
_UNKNOWN = "(unknown)"  # the model label for requests naming no served model (bounded cardinality)
_BAND = "standard"


class Exchange:
    """One attempt: a client request relayed to one replica and its answer back."""

    __slots__ = (
        "_buf",
        "_conn",
        "_done",
        "_loop",
        "_pending",
        "_sent_bytes",
        "_streaming",
        "_timer",
        "ep",
        "gw",
        "model",
        "resp",
        "rid_line",
        "sent_at",
        "ttfb",
        "writer",
    )

    def __init__(self, gw: Gateway, writer: ResponseWriter, ep: Endpoint, rid_line: bytes, model: str) -> None:
        self.gw = gw
        self.model = model
        self.writer = writer
        self.ep = ep
        self.rid_line = rid_line
        self._loop = gw.loop
        self._conn: UpstreamConnection | None = None
        self._done: asyncio.Future[Any] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._streaming = False
        self._buf: list[bytes] = []
        self._pending = b""
        self._sent_bytes = 0
        self.resp: Response | None = None
        self.ttfb: float | None = None
        self.sent_at: float | None = None

    async def run(self, head: bytes, body: bytes) -> Any:
        ep = self.ep
        conn = ep.pool.take_idle()
        reused = conn is not None
        if conn is None:
            try:
                conn = await ep.pool.connect()
            except TimeoutError:
                self.gw.observer.upstream_error(ep.id, "connect_timeout")
                return _Retry(GatewayTimeoutError(f"replica {ep.id} did not accept a connection in time"))
            except OSError as exc:
                self.gw.observer.upstream_error(ep.id, "connect_refused")
                return _Retry(BadGatewayError(f"replica {ep.id} refused the connection ({exc.strerror or exc})"))
        writer = self.writer
        if writer.disconnected:
            conn.release()
            return _DONE
        self._conn = conn
        self._done = self._loop.create_future()
        writer.on_disconnect(self._client_gone)
        self._arm(self.gw.first_byte_timeout)
        self.sent_at = time.monotonic()
        conn.send(self, head, body)
        try:
            outcome = await self._done
        except asyncio.CancelledError:
            self._abandon()
            raise
        if isinstance(outcome, _Retry) and reused and self.resp is None and isinstance(outcome.error, BadGatewayError):
            outcome.fresh = True
        return outcome

    # -- timers and endings --

    def _arm(self, delay: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_later(delay, self._timed_out)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _finish(self, outcome: Any) -> None:
        self._disarm()
        done = self._done
        if done is not None and not done.done():
            done.set_result(outcome)

    def _abandon(self) -> None:
        self._disarm()
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.abort()

    def _client_gone(self) -> None:
        # PERF/NOTE: closing the upstream connection is how an engine learns to stop
        # generating; the slot frees at once.
        self._abandon()
        self._finish(_DONE)

    def _timed_out(self) -> None:
        self._timer = None
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.abort()
        self.gw.observer.upstream_error(self.ep.id, "first_byte_timeout" if self.resp is None else "read_timeout")
        if self._streaming:
            self._cut_stream("the replica stopped sending", "upstream_timeout")
            self._finish(_DONE)
        elif self.resp is None:
            self._finish(
                GatewayTimeoutError(f"replica {self.ep.id} did not answer within {self.gw.first_byte_timeout:g}s")
            )
        else:
            self._finish(_Retry(BadGatewayError(f"replica {self.ep.id} stopped sending its answer")))

    def _cut_stream(self, why: str, code: str) -> None:
        w = self.writer
        if w.finished:
            return
        w.keep_alive = False
        if not w.disconnected:
            # Never a fabricated [DONE] or finish_reason: the client learns the truth.
            w.write(_sse_error(f"stream interrupted: {why}", code))
        w.end()

    # -- ResponseReader sink --

    def on_response_head(self, resp: Response) -> None:
        self.resp = resp
        self.ttfb = time.monotonic()
        w = self.writer
        if resp.event_stream and resp.status < 300:
            self._streaming = True
            self._arm(self.gw.read_timeout)
            w.start(resp.status, (), -1, resp.forward + self.rid_line + self.ep_line())
            conn = self._conn
            if conn is not None:
                w.add_flow_listener(conn)
        else:
            self._arm(self.gw.read_timeout)

    def ep_line(self) -> bytes:
        return self.gw.replica_lines[self.ep.id]

    def on_response_body(self, data: bytes) -> None:
        if self._streaming:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = self._loop.call_later(self.gw.read_timeout, self._timed_out)
            # Relay whole SSE events only, so a cut never leaves half an event.
            if self._pending:
                data = self._pending + data
            cut = data.rfind(_SSE_SEP)
            if cut < 0:
                self._pending = data
                return
            cut += 2
            if cut == len(data):
                self._pending = b""
                out = data
            else:
                self._pending = data[cut:]
                out = data[:cut]
            self._sent_bytes += len(out)
            self.writer.write(out)
            if self.gw.count_tokens and (b'"usage":{' in out or b'"usage": {' in out):
                self._usage(out)
        else:
            self._buf.append(data)
            self._sent_bytes += len(data)
            if self._sent_bytes > _MAX_BUFFERED:
                conn, self._conn = self._conn, None
                if conn is not None:
                    conn.abort()
                self._finish(BadGatewayError(f"replica {self.ep.id} sent an answer larger than {_MAX_BUFFERED} bytes"))

    def on_response_end(self) -> None:
        self._disarm()
        conn, self._conn = self._conn, None
        resp = self.resp
        assert resp is not None
        w = self.writer
        if self._streaming:
            if self._pending:
                w.write(self._pending)
                self._sent_bytes += len(self._pending)
                self._pending = b""
            if conn is not None:
                conn.release()
            w.end()
            self._finish(_DONE)
            return
        body = b"".join(self._buf) if len(self._buf) != 1 else self._buf[0]
        self._buf = []
        if conn is not None:
            conn.release()
        status = resp.status
        if status >= 400:
            normalized = normalize_error(status, body)
            if status >= 500:
                self.gw.observer.upstream_error(self.ep.id, "status_5xx")
            if status in _RETRYABLE_STATUS:
                message = orjson.loads(normalized)["error"]["message"]
                err = HTTPError(
                    f"replica {self.ep.id} answered {status}: {message}",
                    status=status,
                    type="service_unavailable_error" if status == 503 else "server_error",
                    code=_CODE_BY_STATUS[status],
                    retry_after=1 if status == 503 else None,
                )
                self._finish(_Retry(err))
                return
            body = normalized
            raw = self.rid_line + self.ep_line()
            w.send(status, body, ((b"content-type", b"application/json"),), raw)
        else:
            w.send(status, body, (), resp.forward + self.rid_line + self.ep_line())
            if self.gw.count_tokens:
                self._usage(body)
        self._finish(_DONE)

    def _usage(self, data: bytes) -> None:
        """Report token usage when the answer (or an SSE event in it) carries it."""
        at = data.find(b'"usage"')
        if at < 0:
            return
        if self._streaming:
            start = data.rfind(b"data:", 0, at)
            end = data.find(_SSE_SEP, at)
            if start < 0:
                return
            data = data[start + 5 : end if end >= 0 else len(data)]
        try:
            usage = orjson.loads(data).get("usage")
            prompt = usage.get("prompt_tokens") or 0
            completion = usage.get("completion_tokens") or 0
        except (orjson.JSONDecodeError, AttributeError):
            return
        if isinstance(prompt, int) and isinstance(completion, int):
            self.gw.observer.tokens(self.model, prompt, completion)

    def on_upstream_lost(self, exc: BaseException | None) -> None:
        self._conn = None
        if self._done is None or self._done.done():
            return
        self.gw.observer.upstream_error(self.ep.id, "bad_response" if isinstance(exc, ValueError) else "reset")
        if self._streaming:
            self._cut_stream("the replica closed the connection", "upstream_disconnected")
            self._finish(_DONE)
        else:
            self._finish(
                _Retry(BadGatewayError(f"replica {self.ep.id} closed the connection before a complete answer"))
            )


class Gateway:
    """The client port's app (see the module docstring)."""

    def __init__(self, config: Config, registry: Registry) -> None:
        self.loop = asyncio.get_running_loop()
        self.registry = registry
        self._rid_prefix = os.urandom(6).hex()
        self._rid_counter = itertools.count(1)
        self.created = int(time.time())
        self.observer: Observer = NullObserver()
        self.count_tokens = False
        self.reconfigure(config)

    def reconfigure(self, config: Config) -> None:
        """Adopt a new configuration (a reload): tables are rebuilt, connections kept."""
        self.config = config
        self.first_byte_timeout = config.upstream.first_byte_timeout
        self.read_timeout = config.upstream.read_timeout
        self.retry_attempts = config.retries.attempts
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
        self.auth = bool(self.keys)
        self.access_log = config.access_log.enabled
        self.refresh()

    def set_observer(self, observer: Observer) -> None:
        """Report the data path's work to ``observer`` (metrics)."""
        self.observer = observer
        self.count_tokens = not isinstance(observer, NullObserver)

    def refresh(self) -> None:
        """Recompute what depends on the endpoint list (after add/remove)."""
        self.replica_lines = {
            ep.id: b"x-llmgw-replica: %s\r\n" % ep.id.encode() for ep in self.registry.endpoints.values()
        }

    # -- routing --

    def handle(self, req: Request, w: ResponseWriter) -> Awaitable[None] | None:
        path = req.path
        if not path.startswith(b"/v1/"):
            raise NotFoundError(f"no route for {path.decode('latin-1')[:200]}; llmgw serves the OpenAI API under /v1/")
        if self.auth:
            self._authenticate(req)
        method = req.method
        if method == b"POST":
            return self._proxy(req, w)
        if method == b"GET" or method == b"HEAD":
            if path == b"/v1/models":
                w.send_json(200, {"object": "list", "data": self._model_cards()})
                return None
            if path.startswith(b"/v1/models/"):
                name = path[len(b"/v1/models/"):].decode("utf-8", "replace")
                for card in self._model_cards():
                    if card["id"] == name:
                        w.send_json(200, card)
                        return None
                raise ModelNotFoundError(f"The model `{name}` does not exist or you do not have access to it.")
        raise HTTPError(
            f"method {method.decode('latin-1')} is not allowed on {path.decode('latin-1')[:200]}",
            status=405,
            type="invalid_request_error",
            code="method_not_allowed",
        )

    def _authenticate(self, req: Request) -> None:
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

    def _model_cards(self) -> list[dict[str, Any]]:
        cards = [
            {"id": m, "object": "model", "created": self.created, "owned_by": "llmgw"} for m in self.registry.models()
        ]
        for alias, real in self.aliases.items():
            if real in self.registry.by_model:
                cards.append({"id": alias, "object": "model", "created": self.created, "owned_by": "llmgw", "root": real})
        return cards

    def _request_id(self, req: Request) -> bytes:
        rid = req.request_id
        # Accept the client's id when it is a short token of visible ASCII.
        if rid is not None and 0 < len(rid) <= 128 and all(33 <= c < 127 for c in rid):
            return rid
        return b"%s-%d" % (self._rid_prefix.encode(), next(self._rid_counter))

    async def _proxy(self, req: Request, w: ResponseWriter) -> None:
        started = time.monotonic()
        rid = self._request_id(req)
        model = _UNKNOWN
        ep: Endpoint | None = None
        ex: Exchange | None = None
        try:
            model, ep, ex = await self._forward(req, w, rid)
        except HTTPError as exc:
            if not w.started:
                w.send_error(exc, ((b"x-request-id", rid),))
            elif not w.finished:
                w.abort()
        finally:
            now = time.monotonic()
            ttfb = ex.ttfb - started if ex is not None and ex.ttfb is not None else None
            upstream = now - ex.sent_at if ex is not None and ex.sent_at is not None else None
            self.observer.request_done(
                model, ep.id if ep is not None else None, w.status, _BAND, now - started, ttfb, upstream
            )
            if self.access_log:
                self._log(req, w, model, ep, ex, started, rid)

    async def _forward(
        self, req: Request, w: ResponseWriter, rid: bytes
    ) -> tuple[str, Endpoint | None, Exchange | None]:
        """Send the request to a replica (retrying before the first byte); returns what served it."""
        body = req.body
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise BadRequestError(
                f"We could not parse the JSON body of your request ({exc}). Send a JSON object.",
                code="invalid_json",
            ) from None
        if not isinstance(data, dict):
            raise BadRequestError("The request body must be a JSON object.", code="invalid_json")
        model = data.get("model")
        if not isinstance(model, str) or not model:
            raise BadRequestError("You must provide a model parameter.", param="model", code="missing_model")
        real = self.aliases.get(model, model)
        if real not in self.registry.by_model:
            raise ModelNotFoundError(
                f"The model `{model[:200]}` does not exist or you do not have access to it.", param="model"
            )
        rewrite = self.rewrites.get(model)
        if rewrite is not None and rewrite != model:
            data["model"] = rewrite
            body = orjson.dumps(data)
        rid_line = b"x-request-id: %s\r\n" % rid
        registry = self.registry
        tried: list[Endpoint] = []
        error: HTTPError | None = None
        attempts = 1 + self.retry_attempts
        ex: Exchange | None = None
        ep: Endpoint | None = None
        while attempts > 0:
            nxt = registry.pick(real, tried)
            if nxt is None:
                break
            if ep is not None:
                self.observer.retry(real, ep.id)
            ep = nxt
            attempts -= 1
            tried.append(ep)
            head = upstream_head(
                req.method, ep.target(req.target), ep.host_header, req.forward, len(body), rid_line + ep.auth_line
            )
            for _fresh_try in range(2):
                ex = Exchange(self, w, ep, rid_line, real)
                ep.inflight += 1
                try:
                    outcome = await ex.run(head, body)
                finally:
                    ep.inflight -= 1
                if not (isinstance(outcome, _Retry) and outcome.fresh):
                    break
            if outcome is _DONE:
                ep.completed += 1
                ep.consecutive_failures = 0
                return real, ep, ex
            ep.failures += 1
            ep.consecutive_failures += 1
            if isinstance(outcome, _Retry):
                error = outcome.error
                upstream_logger.debug("replica %s failed: %s", ep.id, error.message)
                continue
            error = outcome  # final (a first-byte timeout): never retried
            break
        if error is None:
            error = OverloadedError(f"no replica of model `{real}` is available", retry_after=1)
        w.send_error(error, ((b"x-request-id", rid),))
        return real, ep, ex

    def _log(
        self,
        req: Request,
        w: ResponseWriter,
        model: str,
        ep: Endpoint | None,
        ex: Exchange | None,
        started: float,
        rid: bytes,
    ) -> None:
        if not self.access_log:
            return
        now = time.monotonic()
        ttfb = ex.ttfb if ex is not None else None
        access_logger.info(
            orjson.dumps(
                {
                    "ts": time.time(),
                    "id": rid.decode("latin-1"),
                    "method": req.method.decode("latin-1"),
                    "path": req.path.decode("latin-1"),
                    "model": model,
                    "replica": ep.id if ep is not None else None,
                    "status": w.status,
                    "bytes": ex._sent_bytes if ex is not None else 0,
                    "ttfb_ms": round((ttfb - started) * 1000, 3) if ttfb is not None else None,
                    "duration_ms": round((now - started) * 1000, 3),
                    "client_disconnected": w.disconnected,
                }
            ).decode()
        )
