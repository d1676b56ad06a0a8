"""The scrape poller: one task per replica reading its engine's ``/metrics``.

Each task scrapes at ``scrape.interval`` (with jitter, so hundreds of replicas
don't march in lockstep), with a timeout shorter than the interval, over the
replica's pooled keep-alive connections, sending the replica's key as a bearer
token (llama.cpp guards ``/metrics`` with it). What it reads goes into the
registry; a replica whose last good scrape is older than ``scrape.stale_after``
is stale, and its numbers are never used as if fresh. Each attempt's outcome
goes to the replica too (``Endpoint.scrape_failed`` / ``scrape_answered``), which
decides whether it is *down* (unreachable, or failing past ``stale_after``): then
nothing is routed to it, and a model with every replica down is answered 503 at
once (see :mod:`llmgw._fast.replica_py`). The first answer clears it.

An engine that answers its metrics path 503 says it cannot serve: llama-server
answers every route so while it loads its model (``shared/reference/engines.md``
§2.2), and 503 is "unavailable, retry later" from any engine or a proxy in front
of one (§8.3). Such a replica is held down (``state.down``) until a scrape is
answered otherwise, its ``scrape_problem`` an :class:`~llmgw.fleet.registry.EngineUnavailable`
(``loading`` or ``unavailable``: what the admin API and ``/ready`` say). Other
statuses (404, 501: no metrics page; 401/403; 500) leave it up but blind.

Logging says what is wrong once: when an engine does not serve the metrics its
mapping needs (404, 401, names missing, or served for another model name), one
warning names the replica, the engine, what is missing and how to fix it; it stays
quiet until the reason changes, and logs once when the replica is readable again.
A replica loading its model is logged once at info, and once when it is ready.
Ordinary blips (a restart, a timeout) stay at debug.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from typing import Any

import orjson

from ..config import ScrapeConfig
from ..engines.errors import normalize_error
from ..errors import PromParseError
from ..http.client import should_retry_fresh
from ..http.parser import Response
from ..log import scrape_logger as log
from ..scrape import ACCEPT, label_values, mapping_for, missing_signals, scan_stats
from .registry import Endpoint, EngineUnavailable, Registry

__all__ = ["Poller", "scrape_once"]

_ACCEPT = b"accept: %s\r\n" % ACCEPT.encode()
_MAX_PAGE = 8 * 1024 * 1024
FIRST_SPREAD_S = 0.2
"""The replicas' first scrapes at a start or a reload come within this many seconds (or the interval)."""


class _Page:
    """Collects one scrape response (a ResponseReader sink)."""

    __slots__ = ("body", "done", "lost", "size", "status")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.status = 0  # 0 until the response head
        self.body: list[bytes] = []
        self.size = 0
        self.lost: BaseException | None = None  # why the connection was lost, as the client said
        self.done: asyncio.Future[None] = loop.create_future()

    def on_response_head(self, resp: Response) -> None:
        self.status = resp.status

    def on_response_body(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > _MAX_PAGE:
            if not self.done.done():
                self.done.set_exception(ValueError(f"metrics page larger than {_MAX_PAGE} bytes"))
            return
        self.body.append(data)

    def on_response_end(self) -> None:
        if not self.done.done():
            self.done.set_result(None)

    def on_upstream_lost(self, exc: BaseException | None) -> None:
        if not self.done.done():
            self.lost = exc
            self.done.set_exception(ConnectionError(f"connection lost: {exc}"))


def _expire(page: _Page) -> None:
    if not page.done.done():
        page.done.set_exception(TimeoutError("scrape timed out"))


async def scrape_once(ep: Endpoint, timeout: float) -> tuple[int, bytes]:
    """GET the replica's metrics page; returns (status, body).

    A pooled keep-alive connection that turns out closed before the answer began
    (engines such as llama-server close after streamed answers while advertising
    keep-alive) is retried once on a new connection, by the rule for every exchange
    of the upstream client: :func:`llmgw.http.client.should_retry_fresh`.

    Raises:
        OSError, TimeoutError, ValueError: the scrape failed.
    """
    try:
        return await _scrape_once(ep, timeout, reuse=True)
    except _StaleConnection:
        return await _scrape_once(ep, timeout, reuse=False)


class _StaleConnection(ConnectionError):
    """A reused connection was lost in a way that sends the scrape again on a new one."""


async def _scrape_once(ep: Endpoint, timeout: float, *, reuse: bool) -> tuple[int, bytes]:
    loop = asyncio.get_running_loop()
    page = _Page(loop)
    # PERF: one timer handle for the whole scrape, not wait_for + shield (which
    # make a task, futures and callbacks each time): at 100 ms over hundreds of
    # replicas this is most of the poller's own cost.
    timer = loop.call_later(timeout, _expire, page)
    conn = None
    reused = False
    try:
        conn = ep.pool.take_idle() if reuse else None
        reused = conn is not None
        if conn is None:
            connecting = loop.create_task(ep.pool.connect())
            page.done.add_done_callback(lambda _f: connecting.cancel())
            try:
                conn = await connecting
            except asyncio.CancelledError:
                # Our own timeout cancelled the connect: say so. A cancellation from
                # outside (the poller closing) stays a cancellation.
                if connecting.cancelled() and page.done.done() and not page.done.cancelled():
                    task = asyncio.current_task()
                    if task is None or not getattr(task, "cancelling", lambda: 0)():
                        page.done.result()  # raises the TimeoutError
                raise
        head = b"GET %s HTTP/1.1\r\nhost: %s\r\n%s%s\r\n" % (
            ep.target(ep.metrics_path.encode()),
            ep.host_header,
            _ACCEPT,
            ep.auth_line,
        )
        ep.state.on_scrape_sent()
        conn.send(page, head, b"")
        await page.done
    except ConnectionError as exc:
        if conn is not None:
            conn.abort()
        # (exc wraps what the client reported the connection was lost with: page.lost)
        if should_retry_fresh(reused, page.status != 0, page.lost):
            raise _StaleConnection(str(exc)) from exc
        raise
    except BaseException:
        if conn is not None:
            conn.abort()
        raise
    finally:
        timer.cancel()
    conn.release()
    body = page.body
    return page.status, body[0] if len(body) == 1 else b"".join(body)


class Poller:
    """Keeps one scrape task per scraped replica of the registry."""

    def __init__(
        self,
        registry: Registry,
        cfg: ScrapeConfig,
        *,
        model_rewrites: dict[str, str] | None = None,
        on_update: Callable[[Endpoint], Any] | None = None,
    ) -> None:
        self.registry = registry
        self._on_update = on_update
        self.cfg = cfg
        self._rewrites = model_rewrites or {}
        self._tasks: dict[str, tuple[Endpoint, asyncio.Task[None]]] = {}  # id -> the replica scraped, its task
        self._closed = False
        self._rng = random.Random()
        self._loop = asyncio.get_running_loop()

    def sync(self, *, spread: bool = True) -> None:
        """Start tasks for new replicas and stop those of removed ones.

        ``spread``: the new replicas' first scrapes come within :data:`FIRST_SPREAD_S` and their
        second ones are spread over one interval (a start or a reload adding many); ``False``:
        scraped at once and every interval from then (one replica added at run time: until its first
        scrape no request goes to it, and a deployment's replica should serve as soon as it is ready).
        """
        current = {eid: ep for eid, ep in self.registry.endpoints.items() if ep.engine.scraped}
        replaced = set()
        for eid, (scraped, task) in list(self._tasks.items()):
            # (a replica replaced under its id, a reload that changed it, is a new one: its task scraped
            # the old object, whose pool is closed, and the new one was never scraped)
            if current.get(eid) is not scraped:
                del self._tasks[eid]
                task.cancel()
                replaced.add(eid)
        for eid, ep in current.items():
            if eid not in self._tasks:
                # (a replaced one is scraped at once: until then it is stale, and it served a moment ago)
                task = self._loop.create_task(self._run(ep, spread and eid not in replaced), name=f"llmgw-scrape-{eid}")
                self._tasks[eid] = (ep, task)

    @property
    def task_count(self) -> int:
        return len(self._tasks)

    async def close(self) -> None:
        """Stop every scrape task (bounded: a task that does not stop is left behind, logged)."""
        self._closed = True
        tasks = [t for _, t in self._tasks.values()]
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=2.0)
            if pending:
                log.warning("%d scrape task(s) did not stop within 2s", len(pending))

    async def _run(self, ep: Endpoint, spread: bool = True) -> None:
        interval = self.cfg.interval
        mapping = mapping_for(ep.cfg.engine, dict(ep.cfg.metric_names) or None)
        model = None
        if len(ep.models) == 1:
            model = self._rewrites.get(ep.models[0], ep.models[0])
        # The first scrape comes at once (within FIRST_SPREAD_S, so that a start with many replicas does not
        # open every connection in the same instant): until it lands the replica is stale, which admission
        # reads as full, and a request for its model would wait for it, up to a whole interval with a long
        # one. The later scrapes are spread over the interval (``spread``: the second comes at a random point
        # of it), so that replicas started together are not scraped together for good.
        if spread:
            await asyncio.sleep(self._rng.random() * min(interval, FIRST_SPREAD_S))
        phase = spread
        while not self._closed:
            started = time.monotonic()
            await self._scrape(ep, mapping, model)
            elapsed = time.monotonic() - started
            if phase:
                phase = False
                await asyncio.sleep(max(0.0, self._rng.random() * interval - elapsed))
                continue
            jitter = (self._rng.random() - 0.5) * 0.2 * interval
            await asyncio.sleep(max(0.0, interval - elapsed + jitter))

    async def _scrape(self, ep: Endpoint, mapping: Any, model: str | None) -> None:
        t0 = time.monotonic()
        try:
            status, body = await scrape_once(ep, self.cfg.timeout)
        except asyncio.CancelledError:
            raise
        except (OSError, asyncio.TimeoutError, ValueError) as exc:
            timed_out = isinstance(exc, asyncio.TimeoutError)
            was_down = ep.down
            # Refused or reset: nothing listens there (down now). A timeout or an
            # answer that is not HTTP: down once the scrapes stay failing past
            # stale_after (an engine busy for a moment is not an outage).
            ep.scrape_failed(time.monotonic(), isinstance(exc, OSError) and not timed_out)
            if isinstance(ep.scrape_problem, EngineUnavailable):
                if ep.unreachable:
                    # (gone while it could not serve: an outage like any other, logged as one)
                    ep.scrape_problem = None
                    was_down = False
                else:
                    # (its last answer said it cannot serve; a scrape that failed since says nothing better)
                    ep.state.down = True
            reason = "timed out" if timed_out else str(exc) or type(exc).__name__
            if ep.down and not was_down:
                # (info, once per outage: a restart is an ordinary blip, not a warning)
                log.info(
                    "replica %s (%s at %s) is down (%s: %s); no requests go to it until a scrape reaches it",
                    ep.id, ep.engine.title, ep.cfg.url, "unreachable" if ep.unreachable else "stale", reason,
                )
            else:
                log.debug("scrape of %s failed: %s", ep.id, reason)
            if self._on_update is not None:
                # (requests queued for its models may have to be answered now)
                self._on_update(ep)
            return
        finally:
            ep.scrape_seconds += time.monotonic() - t0
        held = ep.scrape_problem if isinstance(ep.scrape_problem, EngineUnavailable) else None
        if ep.down and held is None:
            log.info("replica %s (%s): reachable again", ep.id, ep.engine.title)
        ep.scrape_answered()
        if status == 503:
            self._unavailable(ep, body)
            return
        if held is not None:
            ep.scrape_problem = None
            log.info(
                "replica %s (%s): ready (it was %s; %s answered HTTP %d); requests go to it again",
                ep.id, ep.engine.title, held.state, ep.metrics_path, status,
            )
        if status != 200:
            ep.scrape_failures += 1
            wanted = ", ".join(sorted(names[0] for names in mapping.names if names))
            if status in (404, 501):
                # 404: no such route; 501: llama-server without --metrics.
                hint = ep.engine.notes[0] if ep.engine.notes else "is its metrics endpoint enabled?"
                why = f"{ep.metrics_path} answered HTTP {status}: no metrics served ({hint}); missing {wanted}"
            elif status in (401, 403):
                why = (
                    f"{ep.metrics_path} answered HTTP {status}: set the replica's api_key (or api_key_env) "
                    f"so llmgw can read {wanted}"
                )
            else:
                why = f"{ep.metrics_path} answered HTTP {status}; cannot read {wanted}"
            self._problem(ep, why)
            # The engine is up but tells nothing: fresh and blind (routed on this
            # router's own counts), not stale, which would count it as full.
            ep.state.on_scrape(time.monotonic(), None, None, None)
            if self._on_update is not None:
                self._on_update(ep)
            return
        try:
            stats, result = scan_stats(body, mapping, model)
        except PromParseError as exc:
            ep.scrape_failures += 1
            self._problem(ep, f"unreadable metrics page ({exc})")
            return
        ep.state.on_scrape(time.monotonic(), stats.waiting, stats.running, stats.kv_cache_usage)
        ep.scrape_ok += 1
        if self._on_update is not None:
            self._on_update(ep)
        if result.bad_lines and ep.scrape_ok % 100 == 1:
            # Rate-limited: a page with a few odd lines is still read.
            log.debug("replica %s: %d malformed metrics line(s) skipped, first: %s", ep.id, result.bad_lines, result.error)
        missing = missing_signals(mapping, result)
        if missing:
            self._problem(ep, _missing_reason(ep, mapping, body, model, missing))
        elif ep.scrape_problem is not None:
            log.info("replica %s (%s): metrics readable again", ep.id, ep.engine.title)
            ep.scrape_problem = None

    def _unavailable(self, ep: Endpoint, body: bytes) -> None:
        """The engine answered its metrics path 503: out of routing (``state.down``) until a scrape
        is answered otherwise; logged once (info while it loads, a warning otherwise)."""
        ep.scrape_failures += 1
        try:
            message = str(orjson.loads(normalize_error(503, body, ep.engine))["error"]["message"])
        except (orjson.JSONDecodeError, KeyError, TypeError):  # (normalize_error always answers its shape)
            message = "no reason given"
        message = _without_key(ep, message[:200])
        state = "loading" if "loading" in message.lower() else "unavailable"
        reason = f"{ep.metrics_path} answered HTTP 503 ({message}): {state}"
        if ep.scrape_problem != reason:
            ep.scrape_problem = EngineUnavailable(reason, state)
            log.log(
                logging.INFO if state == "loading" else logging.WARNING,
                "replica %s (%s at %s) is %s: %s answered HTTP 503 (%s); no requests go to it until a "
                "scrape is answered otherwise",
                ep.id, ep.engine.title, ep.cfg.url, state, ep.metrics_path, message,
            )
        ep.state.down = True
        if self._on_update is not None:
            # (requests queued for its models may have to be answered now)
            self._on_update(ep)

    def _problem(self, ep: Endpoint, reason: str) -> None:
        if ep.scrape_problem == reason:
            return
        ep.scrape_problem = reason
        log.warning(
            "replica %s (%s at %s): %s; routing to it is uninformed until its metrics can be read",
            ep.id,
            ep.engine.title,
            ep.cfg.url,
            reason,
        )


def _missing_reason(
    ep: Endpoint, mapping: Any, page: bytes, model: str | None, missing: dict[str, tuple[str, ...]]
) -> str:
    """Why the page gave no value for the ``missing`` signals, and what to do about it.

    vLLM and SGLang label every sample with the model they serve (``--served-model-name``):
    a page whose gauges are there for another model name is not a page without them, and the
    fix is the name, not the engine's flags.
    """
    names = ", ".join(sorted(g[0] for g in missing.values()))
    label = mapping.model_label
    if model is not None and label is not None:
        # (cold: only for a replica whose page lacks something; the compiled scan, once more, unfiltered)
        _, unfiltered = scan_stats(page, mapping)
        found = {
            name for signal, name in zip(mapping.signals, unfiltered.found, strict=True)
            if signal in missing and name is not None
        }
        if found:
            served = [_without_key(ep, v) for v in label_values(page, found, label)]
            shown = ", ".join(repr(v) for v in served[:5]) + (", ..." if len(served) > 5 else "")
            served_as = repr(served[0]) if served else "the engine's name"
            llmgw_model = ep.models[0]
            return (
                f"its metrics page has {', '.join(sorted(found))} but for {label} {shown}, not {model!r}: "
                f"the engine serves this model under another name; set models.{llmgw_model}.upstream_name "
                f"to {served_as} (or this endpoint's model to it), or start the engine with "
                f"--served-model-name {model}"
            )
    why = f"its metrics page lacks {names}"
    hint = ep.engine.missing_metrics_hint
    return f"{why} ({hint})" if hint else why


def _without_key(ep: Endpoint, text: str) -> str:
    """``text`` from the engine's answer (a label value, an error) with the key llmgw sends it redacted.

    SECURITY: an engine may echo the Authorization it got; what llmgw says of its scrapes is logged and
    shown by the admin API. (Cold: problems only.)
    """
    key = ep.api_key
    if not key:
        return text
    from ..gateway.proxy import redact

    return redact(text.encode("utf-8", "surrogateescape"), (key,)).decode("utf-8", "replace")
