"""Routers that follow this control plane: the ready-replica table, served over gRPC (docs/follow.md).

``RouterService`` (``proto/llmgw/router/v1/router.proto``) runs beside the agent
service on the control plane's gRPC listener, on its thread (:mod:`.thread`).

* :class:`FollowHub` stands between the deployments and the process's own router
  (:class:`~.deployments.Router`): every replica that joins, drains or leaves it, and
  every held model, also changes the hub's table, on the main loop. A burst of changes
  (a pass of the reconcile loop) makes one new table version, built once and handed
  to the control thread.
* :class:`RouterService` writes the latest table to every open ``WatchReplicas``
  stream: the whole table first, then each new one. A router that reads slowly
  skips versions (only the newest is kept per stream), never a queue that grows. A
  stream silent for :data:`KEEPALIVE_S` is written a message without a table (routers
  of protocol 1.2), so a router can tell a paused control plane from one with nothing new.
* A scale-down waits for the routers too: each reports (``ReportDraining``) what it
  still has in flight to the draining replicas, and :meth:`FollowHub.inflight` adds
  the fresh reports to the process's own count.

HA (docs/ha.md): a standby refuses routers as it refuses agents (the control plane sets
:attr:`RouterService.standby` to the agent service's standby check), and calls
:meth:`RouterService.end_streams` on the control loop when it stops leading; each term's
controller sets :attr:`FollowHub.settled` anew (no table until its loaded replicas are reported).

SECURITY: the table carries every replica's API key. Routers present a router token
(``control.router_token``: SHA-256 digests, compared in constant time, as the join
tokens are); a refusal is logged with the router's name and address, never the token.
The listener's TLS and its "plaintext off loopback" rule are the agent service's.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from .._proto.router.v1 import router_pb2 as rpb
from .._proto.router.v1 import router_pb2_grpc
from ..agent.wire import TOKEN_METADATA
from ..fleet.share import routes_count
from ..log import control_logger as log

if TYPE_CHECKING:
    from ..config import EndpointConfig
    from .deployments import Router
    from .thread import ControlThread

__all__ = [
    "FOLLOW_PROTOCOL", "KEEPALIVE_METADATA", "KEEPALIVE_S", "LEADER_METADATA", "REPORT_VALID_S", "FollowCollector",
    "FollowHub", "FollowStats", "RouterService", "endpoint_to_proto",
]

FOLLOW_PROTOCOL: tuple[int, int] = (1, 2)
"""llmgw.router.v1's protocol: another major is refused (FAILED_PRECONDITION). 1.1 added ShareRoutes; 1.2
keepalives on WatchReplicas (:data:`KEEPALIVE_S`)."""
KEEPALIVE_S = 3.0
"""A router of protocol 1.2 or later is written a ``WatchReplicasResponse`` without a table when its stream
has been silent this long (the interval announced in :data:`KEEPALIVE_METADATA`), so that it can tell a
live control plane with nothing new from one that is paused or cut off without a reset: those keep their
TCP connection and end no stream (routers stayed on a frozen leader's table until it resumed). An older
router is written none: it would take the empty message for an empty table."""
KEEPALIVE_METADATA = "llmgw-follow-keepalive-ms"
SHARE_QUEUE = 32
"""Route messages a ShareRoutes stream may hold unwritten (about 3 s of flushes); more are dropped."""
MAX_MODELS = 256
"""Models' entries relayed from one message at most (a flush holds one per model that had routes)."""
FIRST_READ_S = 10.0
"""A ShareRoutes stream whose first message (the router's name) does not come within this is ended."""
LEADER_METADATA = "llmgw-leader"
"""A standby's refusal names the leader's gRPC address in this trailing metadata (as for agents)."""
REPORT_VALID_S = 3.0
"""A router's draining report holds a drain this long (it reports about twice a second while it matters)."""
REPORT_WINDOW_S = 1.5
"""While routers follow, a replica that just began draining counts as busy this long: time for the routers
to see it drain and report what they have in flight to it (they report at once)."""
MAX_NAME = 253
SETTLE_POLL_S = 0.1


def endpoint_to_proto(ep: EndpointConfig, draining: bool) -> rpb.Replica:
    """A replica the deployments put in the router, as the table sends it."""
    m = rpb.Replica(
        id=ep.id, deployment=ep.deployment or "", served_name=ep.model, engine=ep.engine, url=ep.url,
        api_key=ep.api_key or "", node=ep.node or "", pool=ep.pool or "", metrics_path=ep.metrics_path,
        draining=draining,
    )
    if ep.slots is not None:
        m.slots = ep.slots
    return m


@dataclass
class FollowStats:
    """The router service's counters: followers and tables sent are written on the control thread, the
    table's version on the main loop; the scrape only reads them."""

    followers: int = 0
    """WatchReplicas streams open now."""
    tables_sent: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    """Refused router calls by reason: ``invalid_token``, ``missing_token``, ``incompatible_version``, ``standby``."""
    version: int = 0
    replicas: int = 0
    sharers: int = 0
    """ShareRoutes streams open now."""
    routes_relayed: int = 0
    """Routes written to a router (or the control plane's own) that did not send them."""
    routes_dropped: int = 0
    """Routes a router's stream could not take (its queue full)."""

    def refuse(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1


class FollowCollector:
    """The router service's families on the control plane's ``/metrics``."""

    def __init__(self, stats: FollowStats, leading: Callable[[], bool] = lambda: True) -> None:
        self.stats = stats
        self.leading = leading  # (a standby sends no table: its version is absent, not 0)

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        g = GaugeMetricFamily("llmgw_control_followers", "Routers following this control plane now (WatchReplicas "
                              "streams open).")
        g.add_metric([], s.followers)
        yield g
        c = CounterMetricFamily("llmgw_control_follow_tables_sent", "Replica tables written to following routers.")
        c.add_metric([], s.tables_sent)
        yield c
        r = CounterMetricFamily("llmgw_control_follow_refused", "Router calls refused, by reason.", labels=["reason"])
        for reason in ("invalid_token", "missing_token", "incompatible_version", "standby"):
            r.add_metric([reason], s.refused.get(reason, 0))
        yield r
        v = GaugeMetricFamily("llmgw_control_replica_table_version", "The version of the replica table routers "
                              "are sent (rises on every change).")
        if self.leading():
            v.add_metric([], s.version)
        yield v
        sh = GaugeMetricFamily("llmgw_control_route_sharers", "Routers sharing conversation routes through this "
                               "control plane now (ShareRoutes streams open).")
        sh.add_metric([], s.sharers)
        yield sh
        rr = CounterMetricFamily("llmgw_control_shared_routes", "Conversation routes passed between routers, by "
                                 "outcome: relayed (written to a router that did not send them), dropped (its "
                                 "stream's queue was full).", labels=["outcome"])
        rr.add_metric(["relayed"], s.routes_relayed)
        rr.add_metric(["dropped"], s.routes_dropped)
        yield rr


class FollowHub:
    """The table routers follow, kept beside the process's own router (a :class:`~.deployments.Router` itself).

    On the main loop. ``publish`` is called (on the main loop, once per burst of changes)
    with the new response message; :class:`ControlPlane` hands it to the control thread.

    Args:
        inner: the process's own router (``None``: a control plane without a gateway).
        clock: the monotonic clock (reports' freshness).
    """

    def __init__(self, inner: Router | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.inner = inner
        self.clock = clock
        self.source = secrets.token_hex(8)
        """This run's name for its versions (a router compares versions of one source only)."""
        self.version = 0
        self.stats = FollowStats()
        self.publish: Callable[[rpb.WatchReplicasResponse], None] | None = None
        self.settled: Callable[[], bool] | None = None
        """Whether the table is worth sending (``None``: always). A control plane that just started knows its
        replicas but not yet which are ready (their nodes report within an interval): an empty table sent
        then would take every replica out of the routers. Until it is, routers keep the table they had."""
        self._settle_timer: asyncio.TimerHandle | None = None
        self._table: dict[str, EndpointConfig] = {}
        self._draining: dict[str, float] = {}
        """Draining replica id -> since when (monotonic)."""
        self._held: frozenset[str] = frozenset()
        self._reasons: dict[str, str] = {}
        self._wanted: frozenset[str] = frozenset()
        self._due = False
        self._reports: dict[str, tuple[float, dict[str, int]]] = {}
        """Router name -> (when it reported, draining replica id -> its requests in flight)."""

    # -- Router (the deployments call these) --

    def add(self, ep: EndpointConfig) -> None:
        if self.inner is not None:
            self.inner.add(ep)
        elif ep.id in self._table:
            raise ValueError(f"an endpoint {ep.id!r} exists")
        self._table[ep.id] = ep
        self._draining.pop(ep.id, None)
        self._changed()

    def remove(self, endpoint_id: str) -> None:
        known = self._table.pop(endpoint_id, None)
        self._draining.pop(endpoint_id, None)
        if known is not None:
            self._changed()
        if self.inner is not None:
            self.inner.remove(endpoint_id)
        elif known is None:
            raise KeyError(endpoint_id)

    def set_draining(self, endpoint_id: str, draining: bool) -> None:
        if self.inner is not None:
            self.inner.set_draining(endpoint_id, draining)
        elif endpoint_id not in self._table:
            raise KeyError(endpoint_id)
        self.operator_drain(endpoint_id, draining)

    def operator_drain(self, endpoint_id: str, draining: bool) -> None:
        """An operator drained (or undrained) one of the process's endpoints (``ctl drain``, on the
        process's own router already): a replica of the table is drained in the routers that follow
        too. Others (the process's file's endpoints) are not in the table: nothing to tell."""
        if endpoint_id in self._table and (endpoint_id in self._draining) != draining:
            if draining:
                self._draining[endpoint_id] = self.clock()
            else:
                del self._draining[endpoint_id]
            self._changed()

    def inflight(self, endpoint_id: str) -> int | None:
        """The process's own requests in flight to it plus what the routers reported (fresh reports only)."""
        own = self.inner.inflight(endpoint_id) if self.inner is not None else (0 if endpoint_id in self._table
                                                                              else None)
        if own is None:
            return None
        now = self.clock()
        since = self._draining.get(endpoint_id)
        if since is not None and self.stats.followers > 0 and now - since < REPORT_WINDOW_S:
            own = max(own, 1)  # (the routers have not had time to report yet)
        for name, (at, counts) in list(self._reports.items()):
            if now - at > REPORT_VALID_S:
                del self._reports[name]
                continue
            own += counts.get(endpoint_id, 0)
        return own

    def hold(self, models: frozenset[str], wanted: frozenset[str]) -> None:
        if self.inner is not None:
            self.inner.hold(models, wanted)
        reasons = dict(getattr(models, "reasons", None) or {})  # (a HeldModels says why, per model)
        if (models, wanted, reasons) != (self._held, self._wanted, self._reasons):
            self._held, self._wanted, self._reasons = models, wanted, reasons
            self._changed()

    # -- routers --

    def report(self, router: str, inflight: dict[str, int]) -> None:
        """A router's requests in flight to draining replicas (on the main loop)."""
        counts = {k: v for k, v in inflight.items() if v > 0 and k in self._draining}
        if counts:
            self._reports[router] = (self.clock(), counts)
        else:
            self._reports.pop(router, None)

    def forget(self, router: str) -> None:
        """A router's stream ended: its reports no longer hold a drain (it may come back and report again)."""
        self._reports.pop(router, None)

    def table(self) -> rpb.WatchReplicasResponse:
        """The table as it is now."""
        t = rpb.ReplicaTable(version=self.version, source=self.source, built_at_unix_seconds=time.time())
        t.replicas.extend(endpoint_to_proto(self._table[i], i in self._draining) for i in sorted(self._table))
        t.held_models.extend(sorted(self._held))
        t.wanted_models.extend(sorted(self._wanted))
        t.held_reasons.update(self._reasons)
        return rpb.WatchReplicasResponse(table=t)

    def start(self) -> None:
        """Publish the first table (at once, even if empty: a router learns there is nothing to route)."""
        self._changed()

    def _changed(self) -> None:
        self.version += 1
        if self._due or self._settle_timer is not None:  # (a publish is due already)
            return
        self._due = True
        try:
            asyncio.get_running_loop().call_soon(self._publish)
        except RuntimeError:  # no loop (a bare test): at once
            self._publish()

    def close(self) -> None:
        if self._settle_timer is not None:
            self._settle_timer.cancel()
            self._settle_timer = None
        self.publish = None

    def _publish(self) -> None:
        self._due = False
        self._settle_timer = None
        if self.settled is not None:
            if not self.settled():
                self._settle_timer = asyncio.get_running_loop().call_later(SETTLE_POLL_S, self._publish)
                return
            self.settled = None
            log.info("replica table %d ready for routers (%d replicas)", self.version, len(self._table))
        self.stats.version = self.version
        self.stats.replicas = len(self._table)
        if self.publish is not None:
            self.publish(self.table())


class _Watch:
    """One router's stream (control loop): woken when a newer table is there."""

    __slots__ = ("name", "peer", "wake")

    def __init__(self, name: str, peer: str) -> None:
        self.name = name
        self.peer = peer
        self.wake = asyncio.Event()


class _Sharer:
    """One router's ShareRoutes stream (control loop): the routes to write to it."""

    __slots__ = ("name", "queue")

    def __init__(self, name: str) -> None:
        self.name = name
        self.queue: asyncio.Queue[list[rpb.ModelRoutes] | None] = asyncio.Queue(SHARE_QUEUE)


class RouterService(router_pb2_grpc.RouterServiceServicer):
    """WatchReplicas, ReportDraining and ShareRoutes over a :class:`FollowHub` (module docstring).

    The handlers run on the control loop. ``check`` tells whether a token is a router
    token (constant time); ``standby`` (set by an HA control plane) returns the leader's
    address while this process is a standby (``""``: unknown), ``None`` while it leads.
    ``to_main`` runs a function on the main loop (``None``: one loop, as in a bare test).
    ``check`` returns ``None`` when no router token is configured at all. ``local`` (the control plane's
    own router's :class:`~llmgw.fleet.share.RouteShare`, main loop) takes part in ShareRoutes like a
    following router: it shares while some router does.
    """

    def __init__(
        self, hub: FollowHub, check: Callable[[str], bool | None], to_main: Callable[..., None] | None = None,
    ) -> None:
        self.hub = hub
        self.stats = hub.stats
        self.check = check
        self.to_main = to_main
        self.standby: Callable[[], str | None] | None = None
        self.latest: rpb.WatchReplicasResponse | None = None
        self._watches: set[_Watch] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.local: Any = None
        self._sharers: set[_Sharer] = set()

    def offer(self, msg: rpb.WatchReplicasResponse) -> None:
        """A new table (on the control loop): every stream writes it next."""
        self.latest = msg
        for w in self._watches:
            w.wake.set()

    def share_local(self, routes: list[rpb.ModelRoutes]) -> None:
        """The control plane's own router's routes (on the control loop): to every sharing router."""
        self._relay(routes, None)

    def _relay(self, routes: list[rpb.ModelRoutes], source: _Sharer | None) -> None:
        routes = [m for m in routes if m.routes][:MAX_MODELS]  # (a message of empty entries costs nothing)
        n = routes_count(routes)
        if not n:
            return
        st = self.stats
        for sh in self._sharers:
            if sh is source:
                continue
            try:
                sh.queue.put_nowait(routes)
                st.routes_relayed += n
            except asyncio.QueueFull:
                st.routes_dropped += n
        if source is not None and self.local is not None:
            st.routes_relayed += n
            self.local.offer(routes, self._main)

    def _sharing(self) -> None:
        if self.local is not None:
            self._main(self.local.set_live, bool(self._sharers))

    def end_streams(self) -> None:
        """End every stream (on the control loop; a control plane that stops leading): routers go elsewhere."""
        for t in list(self._tasks):
            t.cancel()

    def _main(self, fn: Callable[..., Any], *args: Any) -> None:
        if self.to_main is None:
            fn(*args)
        else:
            self.to_main(fn, *args)

    async def _refuse(self, context: Any, code: grpc.StatusCode, message: str) -> None:
        await context.abort(code, message)

    async def _authenticate(self, context: Any, method: str, name: str) -> str:
        given = ""
        for key, value in context.invocation_metadata() or ():
            if key == TOKEN_METADATA and isinstance(value, str):
                given = value[7:].strip() if value[:7].lower() == "bearer " else value.strip()
        if not given:
            self.stats.refuse("missing_token")
            log.warning("refused %s from router %r at %s: no router token", method, name, context.peer())
            await self._refuse(context, grpc.StatusCode.UNAUTHENTICATED,
                               "no router token: follow.token_env must name control.router_token")
        # SECURITY: never log or echo the token.
        await self._recheck(context, method, name, given)
        return given

    async def _recheck(self, context: Any, method: str, name: str, given: str) -> None:
        ok = self.check(given)
        if ok is None:
            self.stats.refuse("invalid_token")
            log.warning("refused %s from router %r at %s: no control.router_token is set", method, name, context.peer())
            await self._refuse(context, grpc.StatusCode.UNAUTHENTICATED,
                               "this control plane takes no routers: it needs control.router_token_env (or "
                               "router_token) set to the token routers present")
        if not ok:
            self.stats.refuse("invalid_token")
            log.warning("refused %s from router %r at %s: wrong router token", method, name, context.peer())
            await self._refuse(context, grpc.StatusCode.UNAUTHENTICATED,
                               "wrong router token: check follow.token_env against control.router_token")

    async def _leader_only(self, context: Any) -> None:
        standby = self.standby
        leader = standby() if standby is not None else None
        if leader is None:
            return
        self.stats.refuse("standby")
        if leader:
            context.set_trailing_metadata(((LEADER_METADATA, leader),))
        await self._refuse(
            context, grpc.StatusCode.UNAVAILABLE,
            f"this control plane is a standby; the leader is at {leader}" if leader
            else "this control plane is a standby and does not know the leader yet: try another control plane",
        )

    async def WatchReplicas(self, request: rpb.WatchReplicasRequest, context: Any) -> None:  # type: ignore[override]
        """The table, then each new one (module docstring).

        (grpc.aio takes a coroutine that writes through ``context``; the generated stub only
        knows the generator form, hence the override ignore.)
        """
        name = request.router_name[:MAX_NAME] or "?"
        given = await self._authenticate(context, "WatchReplicas", name)
        major = request.protocol.major
        if major != FOLLOW_PROTOCOL[0]:
            self.stats.refuse("incompatible_version")
            await self._refuse(
                context, grpc.StatusCode.FAILED_PRECONDITION,
                f"incompatible wire protocol: router {name!r} speaks llmgw.router protocol {major}.x, this control "
                f"plane {FOLLOW_PROTOCOL[0]}.{FOLLOW_PROTOCOL[1]}; run router and control plane of the same major "
                "version",
            )
        await self._leader_only(context)
        task = asyncio.current_task()
        assert task is not None
        watch = _Watch(name, context.peer())
        self._watches.add(watch)
        self._tasks.add(task)
        self.stats.followers += 1
        log.info("router %s at %s follows (llmgw %s)", name, watch.peer, request.router_version or "?")
        keepalive = (major, request.protocol.minor) >= (1, 2)
        try:
            if keepalive:
                await context.send_initial_metadata(((KEEPALIVE_METADATA, str(int(KEEPALIVE_S * 1000))),))
            sent = -1
            while True:
                msg = self.latest
                if msg is not None and msg.table.version != sent:
                    await self._recheck(context, "WatchReplicas", name, given)  # a reload may have removed it
                    await context.write(msg)
                    sent = msg.table.version
                    self.stats.tables_sent += 1
                    continue
                watch.wake.clear()
                if self.latest is not msg:
                    continue
                if not keepalive:
                    await watch.wake.wait()
                    continue
                try:
                    await asyncio.wait_for(watch.wake.wait(), KEEPALIVE_S)
                except asyncio.TimeoutError:
                    await context.write(rpb.WatchReplicasResponse())  # (no table: "still here")
        finally:
            self._watches.discard(watch)
            self._tasks.discard(task)
            self.stats.followers -= 1
            self._main(self.hub.forget, name)
            log.info("router %s at %s stopped following", name, watch.peer)

    async def ShareRoutes(self, request_iterator: Any, context: Any) -> None:  # type: ignore[override]
        """Relay each router's conversation routes to the others (and to this process's router).

        (A stream-stream handler written through ``context.read``/``context.write``, as WatchReplicas.)
        """
        given = await self._authenticate(context, "ShareRoutes", "?")  # (before anything is read)
        try:
            first = await asyncio.wait_for(context.read(), FIRST_READ_S)
        except asyncio.TimeoutError:
            return
        if first is grpc.aio.EOF:
            return
        name = first.router_name[:MAX_NAME] or "?"
        if first.protocol.major != FOLLOW_PROTOCOL[0]:
            self.stats.refuse("incompatible_version")
            await self._refuse(context, grpc.StatusCode.FAILED_PRECONDITION,
                               f"incompatible wire protocol: router {name!r} speaks llmgw.router protocol "
                               f"{first.protocol.major}.x, this control plane {FOLLOW_PROTOCOL[0]}.{FOLLOW_PROTOCOL[1]}")
        await self._leader_only(context)
        task = asyncio.current_task()
        assert task is not None
        sharer = _Sharer(name)
        self._sharers.add(sharer)
        self._tasks.add(task)
        self.stats.sharers += 1
        self._sharing()
        log.info("router %s at %s shares conversation routes", name, context.peer())
        await context.write(rpb.ShareRoutesResponse())  # (an empty first answer: the stream is taken)

        async def read() -> None:
            try:
                msg = first
                while msg is not grpc.aio.EOF:
                    routes = list(msg.routes)
                    if routes:
                        self._relay(routes, sharer)
                    msg = await context.read()
            finally:
                with contextlib.suppress(asyncio.QueueFull):
                    sharer.queue.put_nowait(None)  # (the writer ends; a full queue ends it on the next get)

        reader = asyncio.get_running_loop().create_task(read())
        try:
            checked = time.monotonic()
            while True:
                routes = await sharer.queue.get()
                if routes is None or reader.done():
                    break
                if time.monotonic() - checked > 5.0:  # (a reload may have removed its token)
                    await self._recheck(context, "ShareRoutes", name, given)
                    checked = time.monotonic()
                await context.write(rpb.ShareRoutesResponse(routes=routes))
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
            self._sharers.discard(sharer)
            self._tasks.discard(task)
            self.stats.sharers -= 1
            self._sharing()
            log.info("router %s stopped sharing conversation routes", name)

    async def ReportDraining(self, request: rpb.ReportDrainingRequest, context: Any) -> rpb.ReportDrainingResponse:
        name = request.router_name[:MAX_NAME] or "?"
        await self._authenticate(context, "ReportDraining", name)
        await self._leader_only(context)
        self._main(self.hub.report, name, dict(request.inflight))
        return rpb.ReportDrainingResponse(valid_seconds=REPORT_VALID_S)


def attach(thread: ControlThread | None, hub: FollowHub, service: RouterService) -> None:
    """Tables the hub publishes (main loop) reach the service's streams (control loop)."""
    if thread is None:
        hub.publish = service.offer
    else:
        hub.publish = lambda msg: thread.call(service.offer, msg)
