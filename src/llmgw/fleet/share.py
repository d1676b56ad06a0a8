"""Conversation routes shared between routers (the ``prefix`` strategy; docs/routing.md "Several routers").

Several routers in front of one pool each know only the requests they sent: a conversation
whose next turn reaches another router than the last would lose its replica's cache. While
a router shares routes, every keyed pick of a conversation's turn (a request with a session,
or a later turn: ``ModelPool.outbox``) is put in its pool's outbox; :class:`RouteShare`
takes the outboxes every :data:`FLUSH_S` and hands them to ``send`` (the wire: the
``ShareRoutes`` stream of ``proto/llmgw/router/v1/router.proto``, through the control plane
the router follows or hosts), and :meth:`RouteShare.learn` records the routes the other
routers sent in the pools' pickers (``Picker.learn``), as if this router had made the pick.

First turns and single requests are not shared: where they go, every router's consistent
hashing agrees on already, and sharing the picks of prompts that many requests share (a
system prompt) would send every router's requests for it to the same replica at once.

Everything here runs on the main loop. Best effort throughout: a flush takes at most
:data:`MAX_ROUTES` routes (the rest are dropped and counted), and nothing waits for the wire.
While no stream is open (:meth:`RouteShare.set_live`), no outbox exists and the data path does
nothing for sharing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from .._proto.router.v1 import router_pb2 as rpb
from ..log import server_logger as log

if TYPE_CHECKING:
    from .registry import Registry

__all__ = ["FLUSH_S", "MAX_ROUTES", "RouteShare", "ShareCollector", "ShareStats"]

FLUSH_S = 0.1
"""How often the outboxes go out (a conversation's next turn comes seconds later)."""
MAX_ROUTES = 1024
"""Routes per flush at most, over all models (10,000 conversation turns a second; a flush's message is
built on the main loop: about 2 ms at this bound); more are dropped."""
MAX_CHAIN_BYTES = 66 * 8
"""A received route's key longer than this (anchor, blocks word and 64 links) is cut to it."""
MAX_LEARN = MAX_ROUTES
"""Routes learnt from one received message at most (a router's flush holds no more), an entry (a model)
counting as one route at least (the rest ignored, counted): the main loop's bound per message, about 1 ms
for 66-word keys compiled (25 ms in the pure twin)."""
MAX_PENDING = 4
"""Received messages handed to the main loop and not learnt yet, at most: more are ignored (counted), so a
busy main loop is never behind by more than this."""
WANT_EVERY_S = 1.0
"""How often the main loop notes whether any pool routes by prefix (:attr:`RouteShare.wanted`)."""


@dataclass
class ShareStats:
    """Counts of routes (``/metrics``): one writer, the main loop."""

    sent: int = 0
    received: int = 0
    dropped: int = 0
    """Not sent: over :data:`MAX_ROUTES` in a flush, or refused by the stream's queue."""
    ignored: int = 0
    """Received for a model this router has no ``prefix`` pool for, or with no replica, or over a bound."""
    busy: int = 0
    """Received while :data:`MAX_PENDING` messages waited for the main loop (written by the wire's thread)."""
    live: bool = False


class RouteShare:
    """The outboxes of a registry's keyed pools, flushed to ``send``; received routes learnt.

    Args:
        registry: the router's pools.
        send: takes a flush's ``list[rpb.ModelRoutes]`` (called on the main loop; it must not block).
        clock: monotonic seconds (the pickers' clock).
    """

    def __init__(self, registry: Registry, send: Callable[[list[rpb.ModelRoutes]], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = registry
        self.send = send
        self.clock = clock
        self.stats = ShareStats()
        self._timer: asyncio.TimerHandle | None = None
        self._want_timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.wanted = False
        """Whether some pool routes by prefix (kept by :meth:`watch` on the main loop; read by the wire's thread:
        a router with none opens no route stream)."""
        self._handed = 0  # messages handed to the main loop (the wire's thread writes it)
        self._learnt = 0  # ... and learnt there (the main loop writes it)

    # -- on and off --

    def set_live(self, live: bool) -> None:
        """Share while a stream is open (``True``), not otherwise: pools' outboxes and pickers follow."""
        if live == self.stats.live:
            return
        self.stats.live = live
        self._sync()
        if live:
            self._loop = asyncio.get_running_loop()
            self._schedule()
            log.info("sharing conversation routes with the other routers")
        else:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            log.info("not sharing conversation routes (no route stream open)")

    def close(self) -> None:
        self.set_live(False)
        if self._want_timer is not None:
            self._want_timer.cancel()
            self._want_timer = None

    def watch(self) -> None:
        """Keep :attr:`wanted` up to date, every :data:`WANT_EVERY_S` (main loop) until :meth:`close`."""
        self._want_timer = None
        self.wanted = any(p.keyed for p in self.registry.pools.values())
        self._want_timer = asyncio.get_running_loop().call_later(WANT_EVERY_S, self.watch)

    def _sync(self) -> None:
        """Outboxes on the keyed pools while live, none otherwise (pools come and go, pickers are
        replaced on reload: checked on every flush)."""
        live = self.stats.live
        for pool in self.registry.pools.values():
            on = live and pool.keyed
            if on and pool.outbox is None:
                pool.outbox = []
            elif not on and pool.outbox is not None:
                pool.outbox = None
            pool.picker.shared = on

    def _schedule(self) -> None:
        if self._loop is not None and self.stats.live:
            self._timer = self._loop.call_later(FLUSH_S, self._tick)

    def _tick(self) -> None:
        self._timer = None
        try:
            self._sync()
            routes = self.take()
            if routes:
                self.send(routes)
        except Exception:  # (a broken flush must not end sharing for good)
            log.exception("flushing shared routes failed")
        self._schedule()

    # -- out --

    def take(self) -> list[rpb.ModelRoutes]:
        """The outboxes' routes as messages (at most :data:`MAX_ROUTES`), the outboxes emptied."""
        out: list[rpb.ModelRoutes] = []
        room = MAX_ROUTES
        st = self.stats
        for name, pool in self.registry.pools.items():
            box = pool.outbox
            if not box:
                continue
            pool.outbox = []
            if room <= 0:
                st.dropped += len(box)
                continue
            if len(box) > room:
                st.dropped += len(box) - room
                box = box[:room]
            room -= len(box)
            cut = MAX_CHAIN_BYTES
            out.append(rpb.ModelRoutes(model=name, routes=[
                rpb.Route(replica=tag, chain=chain[:cut], session=session) for chain, session, tag in box
            ]))
            st.sent += len(box)
        return out

    def refused(self, routes: Iterable[rpb.ModelRoutes]) -> None:
        """The wire could not take these (no stream, or its queue full): dropped, not sent."""
        n = routes_count(routes)
        self.stats.sent -= n
        self.stats.dropped += n

    def offer(self, routes: list[rpb.ModelRoutes], to_main: Callable[..., Any]) -> None:
        """Received routes, on the wire's thread: learnt on the main loop (``to_main(fn, *args)`` runs
        ``fn(*args)`` there), unless :data:`MAX_PENDING` messages already wait for it (then ignored, counted)."""
        if self._handed - self._learnt >= MAX_PENDING:
            self.stats.busy += routes_count(routes)
            return
        self._handed += 1
        to_main(self._learn_handed, routes)

    def _learn_handed(self, routes: list[rpb.ModelRoutes]) -> None:
        try:
            self.learn(routes)
        finally:
            self._learnt += 1

    # -- in --

    def learn(self, routes: Iterable[rpb.ModelRoutes]) -> None:
        """Record the other routers' routes in this router's pickers (routes for models or
        replicas this router does not have are ignored: counted)."""
        st = self.stats
        now = self.clock()
        pools = self.registry.pools
        room = MAX_LEARN
        tags_of: dict[str, set[int]] = {}
        for m in routes:
            n = len(m.routes)
            st.received += n
            pool = pools.get(m.model)
            if pool is None or not pool.keyed or room <= 0:
                st.ignored += n
                room -= 1  # (an entry costs its lookup, routes or none)
                continue
            picker = pool.picker
            tags = tags_of.get(m.model)
            if tags is None:
                tags = tags_of[m.model] = {e.state.tag for e in pool.endpoints}
            for k, r in enumerate(m.routes):
                if k >= room:
                    st.ignored += n - k
                    break
                if r.replica not in tags:
                    st.ignored += 1
                    continue
                chain = r.chain
                if len(chain) > MAX_CHAIN_BYTES:
                    chain = chain[:MAX_CHAIN_BYTES]
                picker.learn(chain, r.session, r.replica, now)
            room -= max(1, n)


class ShareCollector:
    """The router's shared-route counters on ``/metrics``."""

    def __init__(self, stats: ShareStats) -> None:
        self.stats = stats

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        g = GaugeMetricFamily("llmgw_routing_route_sharing", "1 while this router shares conversation routes "
                              "with the other routers (a ShareRoutes stream is open).")
        g.add_metric([], 1.0 if s.live else 0.0)
        yield g
        c = CounterMetricFamily("llmgw_routing_shared_routes", "Conversation routes shared with the other "
                                "routers, by direction: sent, received (from the others), dropped (not sent: "
                                "over a flush's limit or the stream's queue), ignored (received for a model or "
                                "replica this router does not route to, over a bound, or while the main loop was "
                                "behind).", labels=["direction"])
        c.add_metric(["sent"], float(s.sent))
        c.add_metric(["received"], float(s.received))
        c.add_metric(["dropped"], float(s.dropped))
        c.add_metric(["ignored"], float(s.ignored + s.busy))
        yield c


def routes_count(routes: Iterable[Any]) -> int:
    """Routes in a list of ``ModelRoutes``."""
    return sum(len(m.routes) for m in routes)
