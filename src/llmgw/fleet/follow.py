"""A router that follows control planes it does not host (``follow:``; docs/follow.md).

:class:`Follower` is a runtime component of ``llmgw serve`` without ``control:``. It
holds a ``WatchReplicas`` stream (``proto/llmgw/router/v1/router.proto``) to one of
the control planes and puts the replicas of each table it receives into the router
the way the in-process control plane does (the same :class:`Router` operations):
replicas join and leave, a draining one takes no new requests, held models answer
503 ``model_unavailable``. A table replaces the one before it, so a router that
reconnects catches up with one message.

* **No control plane answers**: the router keeps routing on the last table it had
  (its replicas keep being scraped, their breakers work as ever); it retries every
  address, at once within a round and then with exponential backoff and full
  jitter (:data:`BACKOFF_MAX_S` at most; a stream that brought a table starts the
  next rounds from the shortest wait, however it ended), and follows a standby's
  ``llmgw-leader`` hint to the leader at once. A control plane that announces
  keepalives (protocol 1.2) and sends nothing for three of them is left as if its
  stream had ended: one paused or cut off without a reset keeps its connection.
* **Readiness**: before its first table a follower without static endpoints is not
  ready (``/ready`` 503, reason ``no_replica_table``): it knows no replica yet.
* **Drains**: while it has requests in flight to replicas the table marks draining,
  it reports them (``ReportDraining``) about twice a second, so the control plane
  stops them only when they are done (or at its drain grace).
* **Shared routes** (``routing.prefix.share``): while the table stream is open, a
  ``ShareRoutes`` stream to the same control plane carries where this router sent
  conversations' turns, and brings the other routers' (:mod:`llmgw.fleet.share`). A
  control plane older than protocol 1.1 does not know it: the router routes without.

The wire runs on a thread of its own (:class:`~llmgw.control.thread.ControlThread`,
``llmgw-follow``), as the control plane's does; the tables are applied on the main
loop, so nothing here shares state between threads (the stats have one writer each).

SECURITY: the table carries the replicas' API keys; TLS off loopback (the config
refuses plaintext there unless ``follow.allow_plaintext``). Keys and the router token
are never logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

import grpc
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from .. import __version__
from .._proto.router.v1 import router_pb2 as rpb
from .._proto.router.v1 import router_pb2_grpc
from ..agent.wire import CLIENT_OPTIONS, TOKEN_METADATA
from ..config import EndpointConfig
from ..control.follow import FOLLOW_PROTOCOL, KEEPALIVE_METADATA, LEADER_METADATA
from ..control.thread import ControlThread
from ..engines import ENGINE_NAMES
from ..log import server_logger as log
from .held import HeldModels
from .share import RouteShare, ShareCollector

if TYPE_CHECKING:
    from ..config import Config, FollowConfig

__all__ = ["BACKOFF_MAX_S", "FollowRouter", "FollowState", "Follower", "endpoint_from_proto"]

BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 5.0
"""The longest wait between rounds of attempts (a control plane back is followed within about this)."""
REPORT_EVERY_S = 0.5
CALL_TIMEOUT_S = 5.0
MAX_TABLE_BYTES = 64 * 1024 * 1024
SHARE_QUEUE = 32
"""Flushes of shared routes the follow thread holds unwritten (about 3 s); more are dropped."""
_REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.FAILED_PRECONDITION,
            grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNIMPLEMENTED)


class FollowRouter(Protocol):
    """What the follower changes in the router (``llmgw.runtime.RouterPort``; as the control plane's deployments)."""

    def add(self, ep: EndpointConfig) -> None: ...

    def remove(self, endpoint_id: str) -> None: ...

    def set_draining(self, endpoint_id: str, draining: bool) -> None: ...

    def inflight(self, endpoint_id: str) -> int | None: ...

    def hold(self, models: frozenset[str], wanted: frozenset[str]) -> None: ...


_NO_TABLE_YET = "this router has no replica table from its control plane yet (it is connecting)"


def endpoint_from_proto(m: rpb.Replica) -> EndpointConfig:
    """A table's replica as the router's endpoint.

    Raises:
        ValueError: a field the router cannot use (the message says which).
    """
    if not m.id or len(m.id) > 253 or not m.id.isprintable():
        raise ValueError(f"replica id {m.id[:60]!r} is not usable")
    if not m.served_name:
        raise ValueError(f"replica {m.id}: no served model name")
    if m.engine not in ENGINE_NAMES:
        raise ValueError(f"replica {m.id}: unknown engine {m.engine!r}")
    parts = urlsplit(m.url)
    try:
        port = parts.port or 80
    except ValueError:
        port = -1
    if parts.scheme != "http" or not parts.hostname or port <= 0 or parts.username or parts.query:
        raise ValueError(f"replica {m.id}: not an http://HOST:PORT URL: {m.url[:100]!r}")
    if not m.metrics_path.startswith("/"):
        raise ValueError(f"replica {m.id}: metrics path {m.metrics_path[:60]!r} does not start with /")
    return EndpointConfig(
        id=m.id, url=m.url.rstrip("/"), models=(m.served_name,), engine=m.engine, pool=m.pool or m.node or None,
        api_key=m.api_key or None, metrics_path=m.metrics_path, slots=m.slots if m.HasField("slots") else None,
        scheme="http", host=parts.hostname, port=port, base_path=parts.path.rstrip("/"),
        deployment=m.deployment or None, node=m.node or None,
    )


@dataclass
class FollowState:
    """What the follower knows of its control planes (``/metrics``, ``/ready``, ``ctl``).

    ``connected``, ``target``, ``connects`` and ``refusals`` are written on the follow thread; the table's
    fields on the main loop; readers take them as they are.
    """

    connected: bool = False
    target: str | None = None
    """The address of the control plane it follows (or tries) now."""
    connects: int = 0
    refusals: int = 0
    last_error: str | None = None
    version: int | None = None
    """The table's version (``None``: no table yet)."""
    source: str | None = None
    received_at: float | None = None
    """When the table arrived (monotonic)."""
    built_at: float | None = None
    """When the control plane built it (Unix time)."""
    tables: int = 0
    replicas: int = 0
    skipped: int = 0
    """Replicas of the table the router could not use (logged)."""


class FollowCollector:
    """The follower's families on the router's ``/metrics`` (a follower exports no cluster families)."""

    def __init__(self, state: FollowState) -> None:
        self.state = state

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        s = self.state
        g = GaugeMetricFamily("llmgw_follow_connected", "1 while a control plane's replica table stream is open.")
        g.add_metric([], 1.0 if s.connected else 0.0)
        yield g
        v = GaugeMetricFamily("llmgw_follow_table_version", "The version of the replica table routed on "
                              "(absent before the first table).")
        a = GaugeMetricFamily("llmgw_follow_table_age_seconds", "Seconds since the replica table routed on "
                              "arrived (absent before the first table).")
        if s.version is not None and s.received_at is not None:
            v.add_metric([], float(s.version))
            a.add_metric([], max(0.0, time.monotonic() - s.received_at))
        yield v
        yield a
        n = GaugeMetricFamily("llmgw_follow_table_replicas", "Replicas in the table routed on (absent before "
                              "the first table).")
        if s.version is not None:
            n.add_metric([], float(s.replicas))
        yield n
        t = CounterMetricFamily("llmgw_follow_tables", "Replica tables received.")
        t.add_metric([], float(s.tables))
        yield t
        c = CounterMetricFamily("llmgw_follow_connects", "Replica table streams opened (the first, then each "
                                "reconnection).")
        c.add_metric([], float(s.connects))
        yield c
        r = CounterMetricFamily("llmgw_follow_refusals", "Control planes' refusals of this router (wrong "
                                "token, incompatible protocol).")
        r.add_metric([], float(s.refusals))
        yield r


def _target(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _credentials(f: FollowConfig) -> grpc.ChannelCredentials | None:
    if not f.tls:
        return None

    def read(path: str | None) -> bytes | None:
        if path is None:
            return None
        with open(path, "rb") as fh:
            return fh.read()

    return grpc.ssl_channel_credentials(
        root_certificates=read(f.tls_ca), private_key=read(f.tls_key), certificate_chain=read(f.tls_cert)
    )


class _Silent(Exception):
    """The control plane announced keepalives and sent nothing for three of them (paused, or cut off)."""


def _silence(md: Any) -> float | None:
    """How long a silence ends the stream: three of the keepalives the control plane announced (``None``: it
    announced none, an older one: wait as long as the stream lasts)."""
    for key, value in md or ():
        if key == KEEPALIVE_METADATA:
            try:
                ms = int(value)
            except (TypeError, ValueError):
                return None
            return 3 * ms / 1000 if ms > 0 else None
    return None


def _leader_hint(exc: grpc.aio.AioRpcError) -> str | None:
    try:
        md = exc.trailing_metadata() or ()
    except Exception:  # (a constructed error may carry none)
        return None
    for key, value in md:
        if key == LEADER_METADATA and isinstance(value, str) and value:
            return value
    return None


class Follower:
    """The ``follow:`` component (module docstring).

    Args:
        config: the running configuration (its ``follow`` section must be set).
        router: the router the table's replicas join.
        admin: the admin app (its ``/metrics`` gets the follower's families); ``None``: none.
        rng: jitter's randomness (tests).
    """

    name = "follower"

    def __init__(self, config: Callable[[], Config], router: FollowRouter, admin: Any = None,
                 rng: random.Random | None = None) -> None:
        f = config().follow
        if f is None:
            raise RuntimeError("the configuration has no follow: section")
        self.config = config
        self.follow = f
        self.router = router
        self.admin = admin
        self.rng = rng or random.Random()
        self.state = FollowState()
        self.targets = [_target(h, p) for h, p in f.control]
        self.router_name = f.name or socket.gethostname()
        self.first_table: asyncio.Event | None = None
        self._creds = _credentials(f)
        self._thread: ControlThread | None = None
        self._task: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._collector: FollowCollector | None = None
        # (main loop only)
        self._eps: dict[str, tuple[EndpointConfig, bool, bytes]] = {}
        """The table's replicas in the router: id -> (endpoint, draining, wire form: :meth:`_parse`)."""
        self._report_timer: asyncio.Handle | None = None
        self._reported: dict[str, int] | None = None
        # (follow thread only)
        self._stop: asyncio.Event | None = None
        self._channel: grpc.aio.Channel | None = None
        self._share_q: asyncio.Queue[list[rpb.ModelRoutes]] | None = None
        self._share_said = False
        # (main loop) routes shared with the other routers, when the router has pools to share
        registry = getattr(router, "registry", None)
        self.routes: RouteShare | None = None
        if registry is not None and config().routing.prefix.share:
            self.routes = RouteShare(registry, self._send_routes)
        self._share_collector: ShareCollector | None = None

    # -- the component --

    async def start(self) -> None:
        """Start following (in the background: the router starts whether or not a control plane answers)."""
        # until the first table, a model this router does not serve itself may well be the table's:
        # 503 with Retry-After (an SDK retries), not 404 model_not_found (it does not)
        self.router.hold(HeldModels(reason=_NO_TABLE_YET, every=True), frozenset())
        self._loop = asyncio.get_running_loop()
        self.first_table = asyncio.Event()
        thread = ControlThread("llmgw-follow")
        thread.start()
        self._thread = thread
        self._task = thread.run(self._run())
        if self.routes is not None:
            self.routes.watch()
        if self.admin is not None:
            self._collector = FollowCollector(self.state)
            self.admin.register_collector(self._collector)
            if self.routes is not None:
                self._share_collector = ShareCollector(self.routes.stats)
                self.admin.register_collector(self._share_collector)
        log.info("following the control plane(s) at %s as router %s (%s)", ", ".join(self.targets),
                 self.router_name, "TLS" if self._creds is not None else "plaintext")

    async def stop(self) -> None:
        if self._report_timer is not None:
            self._report_timer.cancel()
            self._report_timer = None
        if self.admin is not None and self._collector is not None:
            self.admin.unregister_collector(self._collector)
            self._collector = None
        if self.admin is not None and self._share_collector is not None:
            self.admin.unregister_collector(self._share_collector)
            self._share_collector = None
        if self.routes is not None:
            self.routes.close()
        thread, task = self._thread, self._task
        self._thread = self._task = None
        if thread is not None:
            if task is not None:
                thread.call(self._cancel_run)
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await asyncio.wait_for(task, 5.0)
            thread.stop()

    def readiness(self) -> dict[str, Any] | None:
        """``None`` once a table arrived; else why ``/ready`` is 503 (when the router has no static endpoints)."""
        if self.state.version is not None:
            return None
        return {"reason": "no_replica_table", "follow": self.status()}

    def models(self) -> frozenset[str]:
        """The models the table's replicas serve (draining ones left out): ``/ready`` asks for each."""
        return frozenset(ep.model for ep, draining, _ in self._eps.values() if not draining)

    def status(self) -> dict[str, Any]:
        s = self.state
        return {
            "connected": s.connected, "control_plane": s.target, "table_version": s.version,
            "table_age_seconds": None if s.received_at is None else round(time.monotonic() - s.received_at, 3),
            "replicas": s.replicas if s.version is not None else None, "last_error": s.last_error,
        }

    # -- the wire (follow thread) --

    def _cancel_run(self) -> None:
        if self._stop is not None:
            self._stop.set()
        ch = self._channel
        if ch is not None:
            asyncio.get_running_loop().create_task(ch.close())

    async def _sleep(self, seconds: float) -> bool:
        """Sleep, or less when stopped; whether stopped."""
        assert self._stop is not None
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)
        return self._stop.is_set()

    async def _run(self) -> None:
        self._stop = stop = asyncio.Event()
        delay = BACKOFF_MIN_S
        i = 0
        target = self.targets[0]
        tried: set[str] = set()
        said: str | None = None
        while not stop.is_set():
            self.state.target = target
            connects = self.state.connects
            refused = False
            err: str | None = None
            hint: str | None = None
            try:
                await self._watch(target)
                err = "the control plane ended the stream"
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                hint = _leader_hint(exc)
                err = f"{code.name}: {exc.details()}"
                if code in _REFUSED:
                    self.state.refusals += 1
                    err = f"refused ({err}); retrying every {BACKOFF_MAX_S:g}s"
                    delay, refused = BACKOFF_MAX_S, True
            except asyncio.CancelledError:
                raise
            except _Silent as exc:
                err = str(exc)
            except Exception as exc:  # a bad table, a closed channel: logged, and the link made again
                log.exception("following %s failed", target)
                err = f"{type(exc).__name__}: {exc}"
            finally:
                self.state.connected = False
                ch, self._channel = self._channel, None
                if ch is not None:
                    with contextlib.suppress(Exception):
                        await ch.close()
            if stop.is_set():
                break
            if self.state.connects != connects and not refused:
                # it worked for a while (a table came), however the stream ended: a new round, from the
                # first wait. (A leader that dies or steps down ends it with an error, not EOF: judged by
                # a clean end alone, a router kept the longest wait of the rounds before it connected,
                # and followed the next leader seconds late.)
                delay, tried = BACKOFF_MIN_S, set()
            self.state.last_error = err
            if err != said:
                log.warning("control plane at %s: %s; %s", target, err,
                            f"following the leader at {hint}" if hint and hint != target
                            else "routing on the last replica table meanwhile" if self.state.version is not None
                            else "no replica table yet")
                said = err
            tried.add(target)
            untried = [t for t in self.targets[i + 1:] + self.targets[:i + 1] if t not in tried]
            nxt = hint if hint and hint not in tried else (untried[0] if untried else None)
            if nxt is not None:
                target = nxt
                i = self.targets.index(nxt) if nxt in self.targets else i
                continue
            tried = set()
            i = (i + 1) % len(self.targets)
            target = self.targets[i]
            # full jitter: routers that lost a control plane together do not come back in step
            if await self._sleep(self.rng.uniform(0.5, 1.0) * delay):
                break
            delay = min(delay * 2, BACKOFF_MAX_S)

    async def _watch(self, target: str) -> bool:
        """Follow ``target`` until its stream ends; whether a table came (raises the stream's error)."""
        # a table is ~250 bytes a replica: 10,000 replicas pass gRPC's default 4 MiB for a received message
        opts = [*CLIENT_OPTIONS, ("grpc.max_receive_message_length", MAX_TABLE_BYTES)]
        if self._creds is not None:
            self._channel = ch = grpc.aio.secure_channel(target, self._creds, options=opts)
        else:
            self._channel = ch = grpc.aio.insecure_channel(target, options=opts)
        stub = router_pb2_grpc.RouterServiceStub(ch)
        req = rpb.WatchReplicasRequest(
            router_name=self.router_name, router_version=__version__,
            protocol=rpb.ProtocolVersion(major=FOLLOW_PROTOCOL[0], minor=FOLLOW_PROTOCOL[1]),
        )
        call = stub.WatchReplicas(req, metadata=self._metadata())
        got = False
        loop = self._loop
        assert loop is not None
        share: asyncio.Task[None] | None = None
        silence: float | None = None
        heard = False
        try:
            while True:
                if silence is None:
                    msg = await call.read()
                else:
                    try:
                        msg = await asyncio.wait_for(call.read(), silence)
                    except asyncio.TimeoutError:
                        call.cancel()
                        raise _Silent(f"nothing from the control plane for {silence:g}s (paused, or cut off); "
                                      "trying the others") from None
                if msg is grpc.aio.EOF:
                    return got
                if not heard:  # (its headers came with the first message: whether it sends keepalives)
                    heard = True
                    silence = _silence(await call.initial_metadata())
                if not msg.HasField("table"):
                    continue  # a keepalive (protocol 1.2): the control plane is there, nothing changed
                if not got:
                    got = True
                    self.state.connected = True
                    self.state.connects += 1
                    self.state.last_error = None
                    log.info("following the control plane at %s (replica table %d)", target, msg.table.version)
                    if self.routes is not None:
                        share = asyncio.get_running_loop().create_task(self._share_while(stub, target))
                # PERF: parsed here, off the data path's loop (1,000 replicas take ~10 ms); applied there
                loop.call_soon_threadsafe(self._apply, msg.table, *self._parse(msg.table))
        finally:
            if share is not None:
                share.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await share

    # -- shared routes --

    async def _share_while(self, stub: router_pb2_grpc.RouterServiceStub, target: str) -> None:
        """ShareRoutes streams to ``target`` while the table's stream is open (this task is cancelled when it
        ends): one once some pool routes by prefix, again after a failure (backoff with jitter, up to
        :data:`BACKOFF_MAX_S`), none after a refusal that retrying will not change (an older control plane)."""
        routes = self.routes
        assert routes is not None
        delay = BACKOFF_MIN_S
        while True:
            while not routes.wanted:
                await asyncio.sleep(1.0)
            if not await self._share(stub, target):
                return
            await asyncio.sleep(self.rng.uniform(0.5, 1.0) * delay)
            delay = min(delay * 2, BACKOFF_MAX_S)

    async def _share(self, stub: router_pb2_grpc.RouterServiceStub, target: str) -> bool:
        """One ShareRoutes stream (follow thread): this router's flushes out, the other routers' routes in
        (learnt on the main loop). Live once the control plane's first (empty) answer says it took the
        stream. Whether another try may help."""
        loop = self._loop
        routes = self.routes
        assert loop is not None and routes is not None
        q: asyncio.Queue[list[rpb.ModelRoutes]] = asyncio.Queue(SHARE_QUEUE)
        call = stub.ShareRoutes(metadata=self._metadata())
        live = False

        def to_main(fn: Callable[..., Any], *args: Any) -> None:
            loop.call_soon_threadsafe(fn, *args)

        try:
            await call.write(rpb.ShareRoutesRequest(
                router_name=self.router_name,
                protocol=rpb.ProtocolVersion(major=FOLLOW_PROTOCOL[0], minor=FOLLOW_PROTOCOL[1]),
            ))
            msg = await call.read()  # (the control plane's first answer: it took the stream)
            if msg is grpc.aio.EOF:
                return True
            self._share_q = q
            loop.call_soon_threadsafe(routes.set_live, True)
            live = True

            async def write() -> None:
                while True:
                    await call.write(rpb.ShareRoutesRequest(routes=await q.get()))

            writer = asyncio.get_running_loop().create_task(write())
            try:
                while True:
                    if msg.routes:
                        routes.offer(list(msg.routes), to_main)
                    msg = await call.read()
                    if msg is grpc.aio.EOF:
                        break
            finally:
                writer.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await writer
            return True
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code in _REFUSED:
                if not self._share_said:
                    if code == grpc.StatusCode.UNIMPLEMENTED:
                        log.info("the control plane at %s does not relay routes (older than protocol 1.1): "
                                 "conversations' turns are routed on this router's own knowledge", target)
                    else:
                        log.warning("the control plane at %s refused to share routes: %s: %s", target,
                                    code.name, exc.details())
                    self._share_said = True
                return False
            if code != grpc.StatusCode.CANCELLED:
                log.warning("sharing routes through %s: %s: %s", target, code.name, exc.details())
            return True
        finally:
            self._share_q = None
            if live:
                loop.call_soon_threadsafe(routes.set_live, False)
            call.cancel()

    def _send_routes(self, routes: list[rpb.ModelRoutes]) -> None:
        """A flush (main loop): to the follow thread's stream, or dropped when it has no room."""
        thread = self._thread
        if thread is None:
            if self.routes is not None:
                self.routes.refused(routes)
            return
        thread.call(self._queue_routes, routes)

    def _queue_routes(self, routes: list[rpb.ModelRoutes]) -> None:  # (follow thread)
        q = self._share_q
        try:
            if q is None:
                raise asyncio.QueueFull
            q.put_nowait(routes)
        except asyncio.QueueFull:
            loop = self._loop
            if loop is not None and self.routes is not None:
                loop.call_soon_threadsafe(self.routes.refused, routes)

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        f = self.config().follow or self.follow  # (a reload may change the token: the next call presents it)
        return ((TOKEN_METADATA, f"Bearer {f.token or ''}"),)

    async def _report(self, counts: dict[str, int]) -> None:
        ch = self._channel
        if ch is None:
            return
        req = rpb.ReportDrainingRequest(router_name=self.router_name)
        for k, v in counts.items():
            req.inflight[k] = v
        try:
            await router_pb2_grpc.RouterServiceStub(ch).ReportDraining(req, metadata=self._metadata(),
                                                                         timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            log.debug("reporting draining replicas to %s failed: %s", self.state.target, exc.code().name)

    # -- the table (main loop) --

    @staticmethod
    def _parse(table: rpb.ReplicaTable) -> tuple[dict[str, tuple[EndpointConfig, bool, bytes]], int]:
        """The table's replicas as endpoints (id -> (endpoint, draining, its wire form but the draining flag))
        and how many were left out. PERF: a replica is compared by its bytes (1 us) rather than its
        endpoint (10 us): an unchanged table of 1,000 costs the loop 1 ms, not 10."""
        new: dict[str, tuple[EndpointConfig, bool, bytes]] = {}
        skipped = 0
        for m in table.replicas:
            try:
                draining = m.draining
                m.draining = False
                new[m.id] = (endpoint_from_proto(m), draining, m.SerializeToString())
            except ValueError as exc:
                skipped += 1
                log.error("replica table %d: %s; left out", table.version, exc)
        return new, skipped

    def _apply(self, table: rpb.ReplicaTable, new: dict[str, tuple[EndpointConfig, bool, bytes]], skipped: int
               ) -> None:
        """Make the router's followed replicas the table's (replicas join, leave, drain; models held)."""
        s = self.state
        router = self.router
        newly_draining = False
        for rid in [r for r in self._eps if r not in new or new[r][2] != self._eps[r][2]]:
            del self._eps[rid]
            with contextlib.suppress(KeyError):
                router.remove(rid)
        for rid, (ep, draining, wire) in new.items():
            had = self._eps.get(rid)
            if had is None:
                try:
                    router.add(ep)
                except ValueError:
                    log.error("replica %s of the table has the id of an endpoint of this router's file; left out", rid)
                    skipped += 1
                    continue
                if draining:
                    router.set_draining(rid, True)
            elif had[1] != draining:
                router.set_draining(rid, draining)
                newly_draining |= draining
            self._eps[rid] = (ep, draining, wire)
        # (a deployed model's own reason, as the leader's data path says it; an older control plane sends none)
        router.hold(HeldModels(table.held_models, reasons=dict(table.held_reasons)), frozenset(table.wanted_models))
        first = s.version is None
        s.version, s.source, s.built_at = table.version, table.source, table.built_at_unix_seconds
        s.received_at = time.monotonic()
        s.tables += 1
        s.replicas = len(self._eps)
        s.skipped = skipped
        if first:
            log.info("first replica table: version %d, %d replicas", table.version, len(self._eps))
        if self.first_table is not None:
            self.first_table.set()
        if newly_draining:  # report at once: the control plane waits for it before it stops the replica
            if self._report_timer is not None:
                self._report_timer.cancel()
            assert self._loop is not None
            self._report_timer = self._loop.call_soon(self._report_tick)
        else:
            self._schedule_report()

    def _schedule_report(self) -> None:
        if self._report_timer is None and (any(d for _, d, _ in self._eps.values()) or self._reported):
            assert self._loop is not None
            self._report_timer = self._loop.call_later(REPORT_EVERY_S, self._report_tick)

    def _report_tick(self) -> None:
        self._report_timer = None
        counts: dict[str, int] = {}
        for rid, (_, draining, _) in self._eps.items():
            if draining:
                n = self.router.inflight(rid)
                if n:
                    counts[rid] = n
        if counts or self._reported:  # (one report with nothing left ends the wait at once)
            thread = self._thread
            if thread is not None:
                thread.call(self._spawn_report, counts)
        self._reported = counts or None
        if counts or any(d for _, d, _ in self._eps.values()):
            self._schedule_report()

    def _spawn_report(self, counts: dict[str, int]) -> None:
        asyncio.get_running_loop().create_task(self._report(counts))
