"""The simulated engine's request handling (the app the HTTP server calls).

``handle`` answers at once whenever it can: a non-streamed request admitted
into a free slot whose whole generation fits inside the loop clock's resolution
(``--ttft-ms 0`` and a huge ``--tokens-per-second``) is answered without a task
or a timer. Everything else runs as a coroutine that sleeps on the event loop's
clock: once until the answer is due for a whole answer; for a stream, once per
batch of tokens that fell due together.
"""

from __future__ import annotations

import asyncio
import collections
import os
import random
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import orjson

from ...errors import ConfigError
from ...log import engine_logger as log
from .dialects import DIALECTS, make_dialect
from .faults import FAULT_KEYS
from .openai import (
    DONE_EVENT,
    ChunkMaker,
    Job,
    RequestError,
    Vocab,
    completion_body,
    embed,
    embedding_item,
    parse_embeddings,
    parse_generation,
)
from .scheduler import QueueFullError, Scheduler, SimRequest, Stats

if TYPE_CHECKING:
    from ...http.parser import Request
    from ...http.server import ResponseWriter
    from .config import SimConfig
    from .faults import SimFaults

__all__ = ["SimApp", "SimState"]

# uvloop's timers have millisecond resolution: a wait shorter than this is not slept.
_MIN_SLEEP = 0.001

Handler = Callable[["Request", "ResponseWriter"], "Awaitable[None] | None"]


@dataclass(frozen=True, slots=True)
class SimState:
    """A snapshot of one simulated engine.

    Attributes:
        ready: not loading (``/health`` answers 200).
        waiting / running: requests queued for a slot / holding one.
        kv_tokens_used: prompt plus generated tokens of the running requests.
        kv_tokens: KV capacity.
        kv_usage: ``kv_tokens_used / kv_tokens`` (what the KV gauge reports).
        finished: requests over, by reason: ``stop``, ``length``, ``abort``.
        completed: ``stop + length``.
        requests: inference requests received (chat, completions; embeddings apart).
        embeddings: embeddings requests answered.
        rejected: answered ``queue_full_status`` because the queue was full.
        errors / cuts / hangs / drops: injected faults.
        prompt_tokens: prompt tokens of admitted requests.
        generation_tokens: output tokens, including those of running requests so far.
        ttft_ms / tokens_per_second: the current speed.
    """

    ready: bool
    waiting: int
    running: int
    kv_tokens_used: int
    kv_tokens: int
    kv_usage: float
    finished: dict[str, int]
    completed: int
    requests: int
    embeddings: int
    rejected: int
    errors: int
    cuts: int
    hangs: int
    drops: int
    prompt_tokens: int
    generation_tokens: int
    ttft_ms: float
    tokens_per_second: float

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class SimApp:
    """Routes and answers requests for one simulated engine.

    Args:
        cfg: the engine's configuration.
        faults: the live fault switches (shared with the engine).
    """

    def __init__(self, cfg: SimConfig, faults: SimFaults) -> None:
        self.cfg = cfg
        self.faults = faults
        self.created = int(time.time())
        self.stats = Stats(DIALECTS[cfg.engine].buckets_for(cfg))
        self.sched = Scheduler(cfg.slots, cfg.max_queue, cfg.kv_tokens, self.stats)
        self.dialect = make_dialect(cfg, self.sched, self.stats, self.created)
        self.vocab = Vocab(cfg.seed)
        self.rng = random.Random(cfg.seed)
        self._salt = struct.pack("<q", cfg.seed)
        self.ttft = cfg.ttft_ms / 1e3
        self.tpi = 1.0 / cfg.tokens_per_second
        self.ready = True
        self.loop: asyncio.AbstractEventLoop | None = None
        self._hung: set[asyncio.Future[None]] = set()
        self._id_prefix = os.urandom(8).hex()
        self._id_seq = 0
        self._ready_timer: asyncio.TimerHandle | None = None
        self._routes = self._build_routes()
        self.arrivals: collections.Counter[bytes] = collections.Counter()  # (with cfg.count_arrivals)

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.sched.bind(loop)

    # -- routing --

    def _build_routes(self) -> dict[bytes, dict[bytes, Handler]]:
        d = self.dialect
        routes: dict[bytes, dict[bytes, Handler]] = {}

        def add(method: bytes, path: bytes, fn: Handler) -> None:
            routes.setdefault(path, {})[method] = fn

        add(b"POST", b"/v1/chat/completions", self._chat)
        add(b"POST", b"/v1/completions", self._completions)
        add(b"POST", b"/v1/embeddings", self._embeddings)
        add(b"GET", b"/v1/models", self._models)
        add(b"GET", b"/health", self._health)
        if self.cfg.metrics:
            add(b"GET", d.metrics_path, self._metrics)
        for (method, path), name in d.routes.items():
            if name == "health":
                add(method, path, self._health)
            elif name == "models":
                add(method, path, self._models)
            else:
                add(method, path, self._dialect_route(getattr(d, f"route_{name}")))
        return routes

    def _dialect_route(self, fn: Callable[..., tuple[int, bytes, list[tuple[bytes, bytes]]]]) -> Handler:
        def handler(request: Request, writer: ResponseWriter) -> None:
            status, body, headers = fn(request, self.sched.now())
            writer.send(status, body, headers)

        return handler

    def handle(self, request: Request, writer: ResponseWriter) -> Awaitable[None] | None:
        """Answer one request (the server's app protocol)."""
        path = request.path
        if path.startswith(b"/sim/"):
            self._control(request, writer, path)
            return None
        d = self.dialect
        method = request.method
        if d.auth_enabled and d.needs_key(method, path) and not d.key_ok(request):
            status, body = d.unauthorized()
            writer.send(status, body)
            return None
        by_method = self._routes.get(path)
        if by_method is None:
            status, body = d.not_found()
            writer.send(status, body)
            return None
        fn = by_method.get(method)
        if fn is None:
            status, body = d.method_not_allowed()
            writer.send(status, body)
            return None
        return fn(request, writer)

    # -- small endpoints --

    def _health(self, request: Request, writer: ResponseWriter) -> None:
        status, body, headers = self.dialect.health(self.ready)
        writer.send(status, body, headers)

    def _models(self, request: Request, writer: ResponseWriter) -> None:
        writer.send(200, orjson.dumps(self.dialect.models()))

    def _metrics(self, request: Request, writer: ResponseWriter) -> None:
        if not self.ready:
            loading = self.dialect.metrics_loading()
            if loading is not None:
                writer.send(*loading)
                return
        body, content_type = self.dialect.metrics_page(request.header(b"accept"))
        writer.send(200, body, [(b"content-type", content_type)])

    # -- errors --

    def _send_error(self, writer: ResponseWriter, exc: RequestError) -> None:
        status, body = self.dialect.request_error(exc)
        writer.send(status, body)

    def _next_id(self, prefix: str) -> str:
        self._id_seq += 1
        return f"{prefix}{self._id_prefix}{self._id_seq:016x}"

    # -- generation --

    def _chat(self, request: Request, writer: ResponseWriter) -> Awaitable[None] | None:
        return self._generate(request, writer, True)

    def _completions(self, request: Request, writer: ResponseWriter) -> Awaitable[None] | None:
        return self._generate(request, writer, False)

    def _generate(self, request: Request, writer: ResponseWriter, chat: bool) -> Awaitable[None] | None:
        d = self.dialect
        if not self.ready:
            status, body = d.loading()
            writer.send(status, body)
            return None
        cfg = self.cfg
        self.stats.requests += 1
        if cfg.count_arrivals:
            self.arrivals[request.request_id or b""] += 1
        faults = self.faults
        if faults.draw_drop(self.rng):
            self.stats.drops += 1
            self._drop(writer, faults.drop_how)
            return None
        try:
            try:
                data = orjson.loads(request.body)
            except orjson.JSONDecodeError as exc:
                raise RequestError(400, f"the request body is not valid JSON: {exc}") from exc
            job = parse_generation(
                data,
                chat=chat,
                vocab=self.vocab,
                default_max_tokens=cfg.chat_max_tokens if chat else cfg.completion_max_tokens,
                max_model_len=cfg.max_model_len,
                clamp_to_context=d.clamp_to_context,
                usage_default_with_options=d.usage_default_with_options,
            )
        except RequestError as exc:
            self._send_error(writer, exc)
            return None
        if d.checks_model and job.model is not None and job.model != cfg.model:
            status, body = d.unknown_model(job.model)
            writer.send(status, body)
            return None
        rng = self.rng
        err = faults.draw_error(rng)
        if err:
            self.stats.errors += 1
            self._send_error(writer, RequestError(err, "simulated engine failure (llmgw sim-engine fault)", "server"))
            return None
        hang = faults.draw_hang(rng)
        cut = not hang and faults.draw_cut(rng)
        limit = -1
        if hang and faults.hang_after_chunks is not None:
            limit = faults.hang_after_chunks
        elif cut:
            limit = faults.cut_after_chunks
        ttft = self.ttft + faults.extra_latency_ms / 1e3
        req = SimRequest(job.total_prompt, job.n_list, job.reasons, job.max_tokens, ttft, self.tpi)
        try:
            admitted = self.sched.submit(req)
        except QueueFullError:
            status = cfg.queue_full_status
            self._send_error(writer, RequestError(
                status, "The server is at capacity: every slot is busy and the waiting queue is full.",
                "rate_limit" if status == 429 else "unavailable",
            ))
            return None
        if job.stream:
            return self._stream(writer, job, req, admitted, hang, cut, limit)
        if admitted and not hang and not cut and req.t_end - req.t_admit < _MIN_SLEEP:
            # PERF: the whole generation is due now; answer without a task.
            self.sched.finish(req)
            writer.send(200, self._whole_body(job, req))
            return None
        return self._whole(writer, job, req, admitted, hang, cut)

    def _whole_body(self, job: Job, req: SimRequest) -> bytes:
        d = self.dialect
        model = job.model if d.echo_model and job.model else self.cfg.model
        return completion_body(
            job, self.vocab, self._next_id("chatcmpl-" if job.chat else "cmpl-"), int(time.time()), model,
            choice_extra=d.choice_extra, message_extra=d.message_extra if job.chat else {},
            top_extra=d.top_extra(job, req), stop_reason_field=d.stop_reason_field,
        )

    async def _whole(
        self, writer: ResponseWriter, job: Job, req: SimRequest, admitted: bool, hang: bool, cut: bool
    ) -> None:
        sched = self.sched
        writer.on_disconnect(lambda: sched.finish(req, "abort"))
        try:
            if not admitted:
                assert req.fut is not None
                await req.fut
            if hang:
                await self._hang(req, writer, 0)
                return
            assert self.loop is not None
            delay = req.t_end - self.loop.time()
            if delay >= _MIN_SLEEP:
                await asyncio.sleep(delay)
            if cut:
                self.stats.cuts += 1
                sched.finish(req, "abort")
                writer.abort()
                return
            sched.finish(req)
            writer.send(200, self._whole_body(job, req))
        finally:
            sched.finish(req, "abort")

    @staticmethod
    def _drop(writer: ResponseWriter, how: str) -> None:
        """Close the connection without an answer: a reset, or an orderly end of stream."""
        t = writer.transport
        if how == "reset" and t is not None:
            sock = t.get_extra_info("socket")
            if sock is not None:
                # (linger on, 0 s: close() sends RST instead of FIN)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.abort()

    async def _hang(self, req: SimRequest, writer: ResponseWriter, steps: int) -> None:
        """Hold the slot, produce nothing more, never answer; cut when the engine stops."""
        assert self.loop is not None
        self.stats.hangs += 1
        req.cap = steps
        fut: asyncio.Future[None] = self.loop.create_future()
        self._hung.add(fut)
        try:
            await fut
        finally:
            self._hung.discard(fut)
        writer.abort()

    async def _stream(
        self, writer: ResponseWriter, job: Job, req: SimRequest, admitted: bool, hang: bool, cut: bool,
        limit: int,
    ) -> None:
        sched, d, loop = self.sched, self.dialect, self.loop
        assert loop is not None
        writer.on_disconnect(lambda: sched.finish(req, "abort"))
        try:
            if hang and limit < 0:
                if not admitted:
                    assert req.fut is not None
                    await req.fut
                await self._hang(req, writer, 0)
                return
            writer.start(200, [(b"content-type", d.sse_content_type)])
            if not admitted:
                assert req.fut is not None
                await req.fut
            model = job.model if d.echo_model and job.model else self.cfg.model
            maker = ChunkMaker(job, self.vocab, self._next_id("chatcmpl-" if job.chat else "cmpl-"),
                               int(time.time()), model)
            delay = req.t_first - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            n_list, reasons = job.n_list, job.reasons
            srf, last_style = d.stop_reason_field, d.finish_on_last_token
            parts: list[bytes] = []
            if job.chat:
                parts.extend(maker.role(j, d.role_content) for j in range(len(n_list)))
            for j, nj in enumerate(n_list):
                if nj == 0:  # stopped before its first token
                    parts.append(maker.finish(j, reasons[j], srf, d.finish_extra(job, req)))
            sent = 0
            i = 0
            n_max = req.n_max
            tail = 2 if job.include_usage else 1
            faulted = False
            while True:
                due = req.steps(loop.time())
                for t in range(i, due):
                    for j, nj in enumerate(n_list):
                        if t >= nj:
                            continue
                        if t == nj - 1:
                            if last_style:
                                parts.append(maker.last_token(j, t, reasons[j], srf))
                            else:
                                parts.append(maker.token(j, t))
                                parts.append(maker.finish(j, reasons[j], srf, d.finish_extra(job, req)))
                        else:
                            parts.append(maker.token(j, t))
                if due > i:
                    i = due
                if i >= n_max:
                    # The tail (usage, [DONE]) must fit under the limit too.
                    faulted = 0 <= limit < sent + len(parts) + tail
                    break
                if limit >= 0 and sent + len(parts) >= limit:
                    faulted = True
                    break
                if parts:
                    writer.write(b"".join(parts))
                    sent += len(parts)
                    parts.clear()
                    if writer.write_paused:
                        await writer.drain()
                # NOTE: at least one clock tick: uvloop's clock moves in whole
                # milliseconds, so shorter sleeps would spin until it does.
                delay = req.t_first + i * req.tpi - loop.time()
                await asyncio.sleep(delay if delay > _MIN_SLEEP else _MIN_SLEEP)
            if faulted:
                keep = limit - sent
                if keep > 0:
                    writer.write(b"".join(parts[:keep]))
                if cut:
                    self.stats.cuts += 1
                    sched.finish(req, "abort")
                    writer.abort()
                    return
                await self._hang(req, writer, i)
                return
            # Generation is over: the slot frees now, whatever the client's pace.
            sched.finish(req)
            if job.include_usage:
                parts.append(maker.usage())
            parts.append(DONE_EVENT)
            writer.write(b"".join(parts))
            writer.end()
        finally:
            sched.finish(req, "abort")

    # -- embeddings --

    def _embeddings(self, request: Request, writer: ResponseWriter) -> None:
        d = self.dialect
        if not self.ready:
            status, body = d.loading()
            writer.send(status, body)
            return
        cfg = self.cfg
        try:
            try:
                data = orjson.loads(request.body)
            except orjson.JSONDecodeError as exc:
                raise RequestError(400, f"the request body is not valid JSON: {exc}") from exc
            items, counts, dims, b64 = parse_embeddings(data, cfg.max_model_len, cfg.embedding_dim)
        except RequestError as exc:
            self._send_error(writer, exc)
            return
        model = data.get("model")
        if d.checks_model and model is not None and model != cfg.model:
            status, body = d.unknown_model(str(model))
            writer.send(status, body)
            return
        err = self.faults.draw_error(self.rng)
        if err:
            self.stats.errors += 1
            self._send_error(writer, RequestError(err, "simulated engine failure (llmgw sim-engine fault)", "server"))
            return
        self.stats.embeddings += 1
        total = sum(counts)
        out = {
            "id": self._next_id("embd-"),
            "object": "list",
            "created": int(time.time()),
            "model": model if d.echo_model and isinstance(model, str) else cfg.model,
            "data": [embedding_item(embed(item, dims, self._salt), i, b64) for i, item in enumerate(items)],
            "usage": {"prompt_tokens": total, "total_tokens": total, "completion_tokens": 0},
        }
        writer.send(200, orjson.dumps(out))

    # -- state and control --

    def state(self) -> SimState:
        sched, st = self.sched, self.stats
        now = sched.now()
        used = sched.kv_used(now)
        return SimState(
            ready=self.ready,
            waiting=sched.n_waiting,
            running=sched.n_running,
            kv_tokens_used=used,
            kv_tokens=sched.kv_tokens,
            kv_usage=used / sched.kv_tokens,
            finished=dict(st.finished),
            completed=st.finished["stop"] + st.finished["length"],
            requests=st.requests,
            embeddings=st.embeddings,
            rejected=st.rejected,
            errors=st.errors,
            cuts=st.cuts,
            hangs=st.hangs,
            drops=st.drops,
            prompt_tokens=st.prompt_tokens,
            generation_tokens=st.generation_tokens + sched.generating(now),
            ttft_ms=self.ttft * 1e3,
            tokens_per_second=1.0 / self.tpi,
        )

    def set_speed(self, ttft_ms: float | None = None, tokens_per_second: float | None = None) -> None:
        """Change the speed of requests admitted from now on.

        Raises:
            ConfigError: a value out of range.
        """
        if ttft_ms is not None and (
            isinstance(ttft_ms, bool) or not isinstance(ttft_ms, (int, float)) or not 0 <= ttft_ms <= 3_600_000
        ):
            raise ConfigError("ttft_ms", f"must be between 0 and 3600000, not {ttft_ms!r}")
        if tokens_per_second is not None and (
            isinstance(tokens_per_second, bool)
            or not isinstance(tokens_per_second, (int, float))
            or not tokens_per_second > 0
        ):
            raise ConfigError("tokens_per_second", f"must be greater than 0, not {tokens_per_second!r}")
        if ttft_ms is not None:
            self.ttft = ttft_ms / 1e3
        if tokens_per_second is not None:
            self.tpi = 1.0 / tokens_per_second

    def release_hung(self) -> None:
        """Wake every hung request (each then cuts its connection)."""
        for fut in list(self._hung):
            if not fut.done():
                fut.set_result(None)

    def control_state(self) -> dict[str, Any]:
        out = self.state().as_dict()
        out["faults"] = self.faults.as_dict()
        out["config"] = self.cfg.summary()
        return out

    def _control(self, request: Request, writer: ResponseWriter, path: bytes) -> None:
        method = request.method
        if path == b"/sim/state" and method == b"GET":
            writer.send(200, orjson.dumps(self.control_state()))
            return
        if path == b"/sim/faults" and method == b"GET":
            writer.send(200, orjson.dumps(self.faults.as_dict()))
            return
        if path == b"/sim/faults" and method == b"POST":
            try:
                changes = orjson.loads(request.body or b"{}")
                if not isinstance(changes, dict):
                    raise ConfigError("", "the body must be a JSON object")
                self.apply_control(changes)
            except (orjson.JSONDecodeError, ConfigError) as exc:
                msg = str(exc) if isinstance(exc, ConfigError) else f"the body is not valid JSON: {exc}"
                writer.send(400, orjson.dumps({"error": {"message": msg, "type": "invalid_request_error"}}))
                return
            writer.send(200, orjson.dumps(self.control_state()))
            return
        writer.send(404, orjson.dumps({"error": {"message": "unknown control endpoint; see GET /sim/state",
                                                 "type": "not_found_error"}}))

    def apply_control(self, changes: dict[str, Any]) -> None:
        """Apply a ``POST /sim/faults`` body: fault keys, ``ttft_ms``, ``tokens_per_second``,
        ``ready``, ``reset``. All or nothing.

        Raises:
            ConfigError: an unknown key or a bad value.
        """
        speed = {k: changes[k] for k in ("ttft_ms", "tokens_per_second") if k in changes}
        ready = changes.get("ready")
        if "ready" in changes and not isinstance(ready, bool):
            raise ConfigError("ready", "must be true or false")
        rest = {k: v for k, v in changes.items() if k not in ("ttft_ms", "tokens_per_second", "ready")}
        unknown = [k for k in rest if k not in FAULT_KEYS and k != "reset"]
        if unknown:
            raise ConfigError(
                unknown[0],
                f"unknown key; known: {', '.join((*FAULT_KEYS, 'ttft_ms', 'tokens_per_second', 'ready', 'reset'))}",
            )
        # Validate both parts before changing either.
        probe = type(self.faults)(**self.faults.as_dict())
        probe.update(rest)
        self.set_speed(**speed)
        self.faults.update(rest)
        if isinstance(ready, bool):
            self.set_ready(ready)
        log.debug("sim-engine %s: control %s", self.cfg.model, changes)

    def set_ready(self, ready: bool) -> None:
        """Be ready (``/health`` 200) or loading (503); cancels a pending simulated startup."""
        if self._ready_timer is not None:
            self._ready_timer.cancel()
            self._ready_timer = None
        self.ready = ready

    def schedule_ready(self, delay: float) -> None:
        """Load for ``delay`` seconds (503s), then be ready."""
        assert self.loop is not None
        self.set_ready(False)
        self._ready_timer = self.loop.call_later(delay, self._became_ready)

    def _became_ready(self) -> None:
        self._ready_timer = None
        self.ready = True
        log.info("sim-engine %s (%s): model loaded", self.cfg.model, self.cfg.engine)
