# cython: annotation_typing=False
"""Replicas and model pools: what the data path routes to.

This file is both the pure-Python implementation and, compiled by Cython with the
declarations in ``replica.pxd``, the extension module ``llmgw._fast.replica``.
Import it through :mod:`llmgw.fleet.registry`, which makes them.

An :class:`Endpoint` is one replica: its identity and the header lines made for
it ahead (from config), its upstream connection pool, and its
``score.EndpointState`` (what routing reads: the engine's scraped numbers, NaN
when absent, never 0; this router's own requests; the breaker). A
:class:`ModelPool` is one model's replicas, their states as one list for the
picker, the picker and the admission queue.

Down, not full. The poller reports each scrape attempt (:meth:`Endpoint.scrape_failed`,
:meth:`Endpoint.scrape_answered`) and the replica keeps the verdict in
``state.down``, which takes it out of routing (``EndpointState.usable``): it is
*down* when its last scrape could not reach the engine (connection refused or
reset: ``unreachable``), or when its scrapes have kept failing (timeouts,
unreadable answers) until its last good scrape, or the first failure if it never
had one, is older than ``scrape.stale_after`` (``stale``). Any answer from the
engine clears it. A replica whose first scrape has not happened yet is not down: it
is stale (saturation 1.0), so requests wait for that scrape as before. A pool none
of whose replicas can take a request for a reason that waiting will not fix soon
(down, breaker open, draining) is :meth:`ModelPool.unavailable`: the gateway answers
503 at once instead of queueing, which is for a saturated pool, not a dead one.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .._accel import select

try:
    import cython
except ImportError:  # a pure install: no Cython
    from . import _cy as cython

if TYPE_CHECKING:
    from ..config import Config, EndpointConfig
    from . import admit_py as _admit
    from . import httpproto_py as _hp
    from . import jsonscan_py as _js
    from . import score_py as _score
    from . import upstream_py as _up
else:
    _hp = select("httpproto")
    _js = select("jsonscan")
    _score = select("score")
    _admit = select("admit")
    _up = select("upstream")
_BREAKER_OPEN = _score.BREAKER_OPEN
AdmissionQueue = _admit.AdmissionQueue
if not cython.compiled:
    # (the compiled build takes these from replica.pxd: C types and C calls)
    Breaker = _score.Breaker
    EndpointState = _score.EndpointState
    Picker = _score.Picker
    pool_saturation = _score.pool_saturation
    monotonic = _hp.monotonic
    key_hash = _js.key_hash
    Needle = _js.Needle
    UpstreamPool = _up.UpstreamPool

__all__ = ["UNUSABLE_REASONS", "Endpoint", "ModelPool"]

# Why a replica takes no new request (Endpoint.unusable_reason); the same words
# in the admin API, /ready and the 503's message.
UNUSABLE_REASONS = ("draining", "unreachable", "stale", "loading", "unavailable", "auth_failed", "breaker_open",
                    "breaker_probing")


# The byte of a routing key (jsonscan.json_route: native 64-bit words) that holds bit 63 of its
# second word, the later-turn bit.
_LATER_BYTE = 15 if sys.byteorder == "little" else 8


def _opt(x: float) -> float | None:
    return None if math.isnan(x) else x


class Endpoint:
    """One replica's identity and live state.

    Args:
        cfg: the replica's config entry.
        config: the whole config (upstream, breaker and scrape settings).
        engine: what llmgw knows about its engine (``llmgw.engines.EngineInfo``;
            the registry looks it up: this module knows no engine).
    """

    __slots__ = (
        "_auth_cooldown",
        "api_key",
        "auth_failed",
        "auth_line",
        "base_path",
        "breaker",
        "cfg",
        "completed",
        "engine",
        "failing_since",
        "failures",
        "half_opened_seen",
        "host_header",
        "id",
        "key_needle",
        "metrics_path",
        "models",
        "pool",
        "replica_line",
        "scrape_failing",
        "scrape_failures",
        "scrape_interval",
        "scrape_ok",
        "scrape_problem",
        "scrape_seconds",
        "stale_after",
        "state",
        "unreachable",
    )

    def __init__(self, cfg: EndpointConfig, config: Config, engine: Any) -> None:
        upstream = config.upstream
        self.cfg = cfg
        self.id = cfg.id
        self.models = cfg.models
        self.engine = engine
        self.host_header = cfg.address.encode()
        self.base_path = cfg.base_path.encode() if cfg.base_path else b""
        # SECURITY: the replica's own key goes upstream; the client's never does.
        self.auth_line = b"authorization: Bearer %s\r\n" % cfg.api_key.encode() if cfg.api_key else b""
        self.replica_line = b"x-llmgw-replica: %s\r\n" % cfg.id.encode()
        self.pool = UpstreamPool(
            cfg.host,
            cfg.port,
            connect_timeout=upstream.connect_timeout,
            max_idle=upstream.max_idle_connections,
            # (explicit upstream.idle_timeout wins; else below the engine's own keep-alive)
            idle_timeout=upstream.idle_timeout if upstream.idle_timeout is not None else engine.idle_timeout(),
        )
        b = config.breaker
        self.breaker = Breaker(b.failures, b.cooldown, b.max_cooldown)
        self.state = EndpointState(0, self.breaker)
        self.api_key = cfg.api_key.encode() if cfg.api_key else None
        # (what the data path looks for in what the engine sends: an engine echoing its key)
        self.key_needle = Needle(self.api_key) if self.api_key else None
        self.auth_failed = False
        self._auth_cooldown = b.cooldown
        self.state.draining = cfg.draining
        if cfg.slots:
            self.state.slots = float(cfg.slots)
        if not self.engine.scraped:
            # Never scraped: always "fresh" but blind (no gauges); routing knows.
            self.state.scraped_at = math.inf
        self.stale_after = config.scrape.stale_after
        self.scrape_interval = config.scrape.interval
        self.metrics_path = cfg.metrics_path
        self.completed = 0
        self.failures = 0
        self.scrape_ok = 0
        self.scrape_failures = 0
        self.scrape_seconds = 0.0
        self.scrape_problem: str | None = None
        self.scrape_failing = 0  # scrape attempts failed in a row (0: the last one was answered)
        self.failing_since = math.nan  # when the first of them failed (monotonic); NaN: none failing
        self.unreachable = False  # the last attempt could not reach the engine
        self.half_opened_seen = 0

    # -- views for the admin API and metrics (absent is None, never 0) --

    @property
    def inflight(self) -> int:
        return int(self.state.inflight)

    @property
    def draining(self) -> bool:
        return bool(self.state.draining)

    @draining.setter
    def draining(self, value: bool) -> None:
        self.state.draining = value

    @property
    def waiting(self) -> float | None:
        return _opt(self.state.waiting)

    @property
    def running(self) -> float | None:
        return _opt(self.state.running)

    @property
    def kv_cache_usage(self) -> float | None:
        return _opt(self.state.kv_cache_usage)

    @property
    def drain_rate(self) -> float | None:
        """Requests per second this replica finished for this router, now (decaying while none finish)."""
        return _opt(self.state.rate_at(monotonic()))

    @property
    def latency(self) -> float | None:
        return _opt(self.state.latency)

    @property
    def last_scrape(self) -> float | None:
        at = self.state.scraped_at
        return None if math.isnan(at) or math.isinf(at) else at

    @property
    def breaker_state(self) -> str:
        """``closed``; ``open`` while it cools down (no requests); ``half_open`` once the cooldown
        has passed (the next request is its probe) and while the probe is out.

        (The breaker itself turns half-open only when a request takes the probe; a replica sent
        nothing after its cooldown would otherwise show open for as long, while it is usable.)
        """
        b = self.breaker
        state = str(b.state)
        if state == "open" and monotonic() >= b.open_until:
            return "half_open"
        return state

    @property
    def breaker_open(self) -> bool:
        return self.breaker_state == "open"

    @property
    def consecutive_failures(self) -> int:
        return int(self.breaker.consecutive_failures)

    @property
    def stale(self) -> bool:
        """Whether the engine numbers are missing or too old to use as fresh."""
        return bool(self.state.stale(monotonic(), self.stale_after))

    def fresh(self) -> tuple[float | None, float | None, float | None]:
        """(waiting, running, kv_cache_usage) if fresh, else all ``None`` (absent)."""
        if self.stale:
            return None, None, None
        return self.waiting, self.running, self.kv_cache_usage

    @property
    def usable(self) -> bool:
        """Whether new requests may go here (not draining, not down, breaker not open, key not
        refused but for its probe)."""
        return bool(self.state.usable(monotonic()))

    @property
    def down(self) -> bool:
        """The poller's verdict: unreachable, or scrapes failing past ``stale_after``."""
        return bool(self.state.down)

    # -- the poller's reports (it owns ``state.down``) --

    def scrape_answered(self) -> None:
        """A scrape got an HTTP answer (whatever it said): the engine is there."""
        self.scrape_failing = 0
        self.failing_since = math.nan
        self.unreachable = False
        self.state.down = False

    def scrape_failed(self, now: float, unreachable: bool) -> None:
        """A scrape attempt failed; ``unreachable``: no connection could carry it (refused,
        reset), else it timed out or the answer was not HTTP. Decides ``state.down``."""
        self.scrape_failures += 1
        if self.scrape_failing == 0:
            self.failing_since = now
        self.scrape_failing += 1
        self.unreachable = unreachable
        # Stale from the last good scrape or, with none ever, from the first failure
        # (the start of the process is no evidence that the replica is down).
        at = self.state.scraped_at
        if at != at:
            at = self.failing_since
        self.state.down = unreachable or now - at > self.stale_after

    # -- why it takes nothing --

    def unusable_reason(self, now: float) -> str | None:
        """Why no new request may go here now (one of ``UNUSABLE_REASONS``), or ``None``: usable."""
        st = self.state
        if st.draining:
            return "draining"
        if st.down:
            if self.unreachable:
                return "unreachable"
            # (held down by the poller while the engine answers its scrape 503: the poller's scrape
            # problem says which, llmgw.fleet.registry.EngineUnavailable)
            held = getattr(self.scrape_problem, "state", None)
            return held if held == "loading" or held == "unavailable" else "stale"
        breaker = st.breaker
        if not breaker.available(now):
            if self.auth_failed:  # (the gate a refused key holds it with, in the breaker's place)
                return "auth_failed"
            return "breaker_open" if breaker.state_code == _BREAKER_OPEN else "breaker_probing"
        return None

    def usable_in(self, now: float) -> float:
        """Seconds until this replica may take requests again, at the earliest: its
        breaker's next probe, the poller's next scrape (whichever is later); 0.0 if it
        is usable, ``inf`` when draining (only an operator ends that)."""
        st = self.state
        if st.draining:
            return math.inf
        wait = 0.0
        if st.down:
            wait = self.scrape_interval
        breaker = st.breaker
        if breaker.state_code == _BREAKER_OPEN:
            left = breaker.open_until - now
            if left > wait:
                wait = left
        return wait

    def target(self, path: bytes) -> bytes:
        """The request target on this replica for a client path."""
        base = self.base_path
        return base + path if base else path

    # -- the key llmgw sends it, refused (401/403): llmgw's problem, not the engine's --

    def hold_auth(self, now: float) -> bool:
        """The replica refused its key: take it out of routing, as an open breaker is,
        without counting a failure on its breaker (the engine is not failing).

        Routing reads ``state.breaker``; while held that is a *gate*, a breaker that
        one failure opens for a fixed ``breaker.cooldown``, so the half-open machinery
        lets one request through each cooldown: the key's probe. The replica's own
        breaker waits, untouched, in :attr:`breaker`.

        Returns:
            ``True`` when this newly took it out (the caller warns once); ``False`` when
            it was held already (a refused probe: the gate reopens for another cooldown;
            an answer to a request sent before the hold changes nothing).
        """
        if self.auth_failed:
            self.state.breaker.record_failure(now)  # (half-open: reopen; open: nothing)
            return False
        gate = Breaker(1, self._auth_cooldown, self._auth_cooldown)
        gate.record_failure(now)
        self.auth_failed = True
        self.state.breaker = gate
        return True

    def clear_auth(self) -> bool:
        """A probe was answered other than 401/403: the key is accepted; back into
        routing under its own breaker. Returns whether it was held."""
        if not self.auth_failed:
            return False
        self.auth_failed = False
        self.state.breaker = self.breaker
        # (its own probe, if one was out when the key was refused, never reports)
        self.breaker.release()
        return True

    def adopt_auth(self, old: Endpoint) -> None:
        """Carry ``old``'s hold over to this replica, which replaces it in a reload that
        left its key as it was (a reload that changes the key starts unheld: the next
        request probes the new key at once)."""
        if old.auth_failed and not self.auth_failed:
            self.auth_failed = True
            self.state.breaker = old.state.breaker

    def close(self) -> None:
        self.pool.close()

    def __repr__(self) -> str:
        return f"<Endpoint {self.id} {self.cfg.url} inflight={self.inflight}>"


class ModelPool:
    """One model's replicas, their states as one list, its picker and admission queue."""

    __slots__ = ("endpoints", "keyed", "name", "outbox", "picker", "queue", "states")

    def __init__(self, name: str, strategy: str, bands: int, queue_size: int) -> None:
        self.name = name
        self.endpoints: list[Endpoint] = []
        self.states: list[Any] = []
        self.picker = Picker(strategy)
        self.keyed = strategy == "prefix"  # the gateway hands pick_keyed the request's key
        self.queue = AdmissionQueue(bands, queue_size)
        self.outbox: list[tuple[bytes, int, int]] | None = None
        """While routes are shared (``llmgw.fleet.share``): ``(chain, session, replica tag)`` of each
        keyed pick of a conversation (a session, or a later turn), taken by the share's flush."""

    def add(self, ep: Endpoint) -> None:
        # (the prefix strategy knows a replica by a hash of its id: the same in every router)
        ep.state.tag = key_hash(ep.id.encode())
        self.endpoints.append(ep)
        self.states = [e.state for e in self.endpoints]

    def remove(self, ep: Endpoint) -> None:
        if ep in self.endpoints:
            self.endpoints.remove(ep)
        self.states = [e.state for e in self.endpoints]

    def pick(self, now: float, stale_after: float, exclude: Iterable[Endpoint] = ()) -> Endpoint | None:
        """The replica for the next request (taking a half-open breaker's probe), or ``None``."""
        excluded = tuple(exclude)
        if not excluded:
            i = self.picker.pick(self.states, now, stale_after)
            return self.endpoints[i] if i >= 0 else None
        # A retry: the same choice among the replicas not tried yet.
        eps = [e for e in self.endpoints if e not in excluded]
        i = self.picker.pick([e.state for e in eps], now, stale_after)
        return eps[i] if i >= 0 else None

    def pick_keyed(
        self, now: float, stale_after: float, exclude: Iterable[Endpoint], chain: bytes, session: int
    ) -> Endpoint | None:
        """:meth:`pick` with the request's routing key (``Picker.pick_prefix``)."""
        excluded = tuple(exclude)
        if not excluded:
            i = self.picker.pick_prefix(self.states, now, stale_after, chain, session)
            ep = self.endpoints[i] if i >= 0 else None
        else:
            eps = [e for e in self.endpoints if e not in excluded]
            i = self.picker.pick_prefix([e.state for e in eps], now, stale_after, chain, session)
            ep = eps[i] if i >= 0 else None
        outbox = self.outbox
        # a conversation's turn (a session, or the later-turn bit of the key's second word)
        if outbox is not None and ep is not None and (session or (len(chain) >= 24 and chain[_LATER_BYTE] & 0x80)):
            outbox.append((chain, session, ep.state.tag))
        return ep

    def saturation(self, now: float, stale_after: float, max_waiting: float, max_kv: float) -> float:
        return pool_saturation(self.states, now, stale_after, max_waiting, max_kv)

    def unavailable(self, now: float) -> tuple[dict[str, int], float] | None:
        """``None`` while some replica can take a request now, or may soon (a
        half-open breaker's probe is out: its answer decides); else the pool is
        down: ``({reason: replicas}, seconds until one may be usable again)``.

        PERF: a cold path (the gateway asks only when it would queue or found no
        replica), and it stops at the first usable replica.
        """
        reasons: dict[str, int] = {}
        wait = math.inf
        for ep in self.endpoints:
            why = ep.unusable_reason(now)
            if why is None or why == "breaker_probing":
                return None
            reasons[why] = reasons.get(why, 0) + 1
            w = ep.usable_in(now)
            if w < wait:
                wait = w
        if not reasons:
            return None  # (no replicas: the gateway answers 404 before asking)
        return reasons, wait



