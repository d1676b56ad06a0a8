"""Routing kernels: the pure-Python twin of ``score.pyx``.

This module is the readable spec; the compiled module matches it name for name and,
given the same seed and the same calls, pick for pick and float for float (both
twins use the same generator and evaluate every formula in the same order).
``docs/routing.md`` explains the model; the short version follows.

Per replica: :class:`EndpointState`
-----------------------------------
What routing reads about one replica. Engine numbers come from scrapes
(``waiting``, ``running``, ``kv_cache_usage``; NaN when the engine does not report
them: absent, never 0). Between scrapes the router corrects them with what it saw
itself: ``dispatched_since_scrape`` and ``completed_since_scrape`` (reset by
:meth:`EndpointState.on_scrape`, or kept from :meth:`EndpointState.on_scrape_sent`
on when the poller says when it sent the scrape). From its own requests the router also measures

* ``drain_rate``: completions per second, an exponentially weighted rate with time
  constant ``DRAIN_TAU`` over the router's own completions (NaN until the first), as of
  the last completion; :meth:`EndpointState.rate_at` is the rate now (it decays while
  nothing completes);
* ``latency``: the mean time the router's requests spend on the replica (Little's
  law over the same window: time-weighted requests in flight divided by
  completions; NaN until the first completion). Unlike the completion rate it does
  not depend on how much traffic the replica is sent, so a replica that is sent
  little is not mistaken for a slow one, and it is the same whichever share of the
  fleet's traffic this router sees. Time spent by requests that have not completed
  yet counts, so a replica that stops completing looks slower and slower.

``capacity()`` is how many requests the replica runs at once: ``slots`` when known
and positive (configured, or read from the engine), else the most ``running`` any
scrape showed (at least 1). That is the capacity once a scrape has shown the
replica with a queue (``seen_full``), and only a lower bound before: routing then
assumes the capacity of the largest replica of the pool, so a new or lightly used
replica is not mistaken for a small one and left idle (if the guess is too high,
its queue shows in the next scrape and settles it).

``load()`` is the corrected number of requests on the replica, ``max(0, W + R + d - c)``
(absent gauges count 0), and ``queued()`` the corrected queue: the router's own
requests since the scrape go to free slots first, then to the queue (see its
docstring).

Choosing a replica: :class:`Picker`
-----------------------------------
A replica is *usable* when it is not draining, not ``down`` (the poller's verdict:
unreachable, or scrapes failing past ``stale_after``) and its breaker is available
(closed, open past its cooldown, or half-open with no probe out). It is *fresh* when its last
scrape is at most ``stale_after`` seconds old and reported ``waiting`` or
``running``. ``pick`` returns an index into the list, or -1.

``score`` (default): among usable fresh replicas, minimise the expected time to
first token, in units of the replica's measured ``latency`` ``t``::

    S     = capacity(), or the pool's largest capacity if the replica has never
            been seen full (see above)
    S_now = running, if the scrape showed a queue (the engine is full at what it
            runs now), else S
    ahead = load() + 1 - S_now            # > 0: no free slot for this request
    wait  = ahead / S_now if ahead > 0 else 0
    cost  = (wait + PREFILL_SHARE * (1 + load() / S)) * kv_factor * t

``t / S_now`` is the time between completions when the replica is full, so
``wait * t`` is how long this request would queue. ``PREFILL_SHARE * t`` stands for
its prefill, which a fuller batch slows down (doubled at a full batch): among
replicas with a free slot the faster and emptier one wins, and a much slower
replica with a free slot wins over a queue. A replica whose latency is unknown
uses the mean of the known ones (none known: all equal). ``kv_factor`` is 1 up to
``KV_KNEE`` KV-cache usage and rises linearly to ``1 + KV_WEIGHT`` at full use: an
engine near its KV limit is about to queue or preempt whatever its queue gauge
says. Every replica within ``NEAR_TIE`` (10 %) of the best cost is a candidate and
one is drawn at random, so routers sharing a fleet don't all pick the same one
between scrapes.

No usable replica fresh (no metrics, or every scrape late): least in-flight among
the usable ones. An unscraped replica is never taken for an idle one.

``least_inflight``: fewest of this router's requests in flight (random tie-break).
``round_robin``: the next usable replica after the last one chosen.

``pick`` calls ``breaker.allow(now)`` on the chosen replica only, so a half-open
breaker gives its single probe to a request that is really sent there.

Saturation and Retry-After
--------------------------
``saturation()`` of one replica: 1.0 when stale; else
``max(queued / max_waiting, kv_cache_usage / max_kv)`` over the parts that are
reported. With neither a queue nor a KV gauge, the only load known is the router's
own: ``max(0, inflight - capacity) / max_waiting``. :func:`pool_saturation` is the
mean over usable replicas (``inf`` if none); 1.0 is the healthy limit.
:func:`retry_after` is ``(queued + 1) / sum(drain_rate)`` over usable replicas,
clamped to ``[RETRY_AFTER_MIN, RETRY_AFTER_MAX]``, ``RETRY_AFTER_DEFAULT`` when no
rate is known.

Breakers and the retry budget
-----------------------------
See :class:`Breaker` and :class:`RetryBudget`.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Sequence

__all__ = [
    "BREAKER_CLOSED",
    "BREAKER_HALF_OPEN",
    "BREAKER_OPEN",
    "DRAIN_TAU",
    "ERR_WEIGHT",
    "KV_KNEE",
    "KV_WEIGHT",
    "NEAR_TIE",
    "PREFILL_SHARE",
    "REASONS",
    "RETRY_AFTER_DEFAULT",
    "RETRY_AFTER_MAX",
    "RETRY_AFTER_MIN",
    "STRATEGIES",
    "Breaker",
    "EndpointState",
    "Picker",
    "RetryBudget",
    "pool_saturation",
    "retry_after",
]

# Seconds: the time constant of the drain-rate and latency averages.
DRAIN_TAU = 10.0
ERR_WEIGHT = 0.125
"""The weight of one answer in ``EndpointState.err_rate`` (an average over about 8)."""
# A rate measured over less than this many seconds is taken over this many (the
# first completion after a start is not a rate of 1/ms).
_MIN_WINDOW = 1.0
# Latency's prior: this many completions at the latency the last completion gave are
# added to the averages, so that time in flight over a completion count decayed to
# nearly nothing (a request aborted after the replica sat idle for minutes) stays an
# estimate (without it: a latency of years, and the replica never picked again), and,
# as the averages age with nothing sent, latency returns to that last settled value.
_LATENCY_PRIOR = 0.5
# With nothing in flight and the completions' average under this (one completion's weight
# falls below it 30 s later, DRAIN_TAU ln 20), latency is unknown again (the pool's mean):
# a replica scored slow by a few long answers, and sent nothing since, is tried again
# rather than kept at that figure for as long as its faster sibling has room.
_LATENCY_FORGET = 0.05
# Score counts no replica as more than this many times slower than the fastest it knows in the pool. A
# replica's latency is its requests' mean time, which says as much about how long the requests it
# happened to serve were as about its speed: one long answer among few made a healthy replica look
# 40 times slower than its sibling, and score queued a burst on the sibling while it idled. Replicas of
# one model differ in speed by a few times at most (a 4x slower one is still told apart).
MAX_SLOWER = 4.0
# The share of a request's time on a replica spent in prefill (before its first
# token), at an empty batch; a full batch doubles it.
PREFILL_SHARE = 0.05
# Replicas within this fraction of the best cost are drawn among at random.
NEAR_TIE = 0.1
# KV-cache usage above which a replica's cost grows, and by how much at 100 %.
KV_KNEE = 0.7
KV_WEIGHT = 3.0
# Retry-After bounds and the value used when no drain rate is known (seconds).
RETRY_AFTER_MIN = 1.0
RETRY_AFTER_MAX = 60.0
RETRY_AFTER_DEFAULT = 5.0

STRATEGIES = ("score", "least_inflight", "round_robin", "prefix")
_S_SCORE = 0
_S_LEAST_INFLIGHT = 1
_S_ROUND_ROBIN = 2
_S_PREFIX = 3

# The prefix strategy's decisions (Picker.decisions(), in this order).
REASONS = ("prefix_hit", "session", "load_fallback", "blind")
_R_PREFIX = 0
_R_SESSION = 1
_R_LOAD = 2
_R_BLIND = 3
# Its defaults (routing.prefix in the config).
INDEX_ENTRIES = 16384
SESSION_ENTRIES = 4096
LOAD_BOUND = 0.25
ENTRY_TTL = 600.0
_WAYS = 4  # a table is buckets of 4 slots; a key lives in bucket (key mod buckets)
_HITS_KEPT = 4  # replicas along a cached prefix tried, deepest first
# A replica whose latency is more than SLOWER x the best's is no home for a prefix or
# a session (its cache saves less than its speed costs).
SLOWER = 3.0
# Where nothing is known, rendezvous hashing keeps to replicas within this share of
# load_bound of the best's utilisation (or with a free slot): an unseen prompt is
# placed nearly as score would, yet consistently across routers.
BLIND_SHARE = 0.2
# While score's pick has a free slot, a cached replica that would queue the request is
# taken only if the wait (queue positions / slots, in latencies, as score counts it) is
# shorter than the prefill its cache saves: PREFILL_WEIGHT latencies for a request of the
# pool's mean chain length (an EWMA over requests, MEAN_BLOCKS_WEIGHT), pro rata.
PREFILL_WEIGHT = 0.2
MEAN_BLOCKS_WEIGHT = 1.0 / 64
# Placing an unseen prompt by its hash pays only when prompts are used again (the hash
# sends a conversation's later turns, or the next request with the same start, where
# every router sends them); where they are not, it only costs (TTFT p50 +4-7 % on a
# workload with no reuse, bench/routing_sim.py). So the blind rule hashes a first turn
# (no session, no later-turn bit) only while at least REUSE_MIN of the pool's keyed
# requests continued something known: a session, a later turn, a chain whose first
# block the index had (an EWMA over requests, REUSE_WEIGHT; it starts at 1).
REUSE_MIN = 0.05
REUSE_WEIGHT = 1.0 / 64
# A first turn whose only match is a shared start (a system prompt) of at most this many
# blocks goes where its anchor hashes, as its later turns will at routers that never saw
# it: recomputing a short system prompt costs less than a conversation that moves.
SHORT_SHARED = 12
# Several routers: when this router's own requests in flight are less than this share of
# the pool's load it sees (scraped, corrected), other routers send to the pool too, and a
# later turn this router did not see the previous turn of (its index's match ends more
# than KNOWN_TURN blocks before the chain's end) goes first to its conversation's home,
# the anchor's rendezvous top, as it does at every router that has not seen it; the
# home's cache counts HOME_SHARE of the chain (it holds the conversation only mostly).
SHARED_FLEET = 0.75
KNOWN_TURN = 4
HOME_SHARE = 0.5
# The anchor is also recorded in the index (salted: never a block's key), as the
# conversation's last replica at this router.
_ANCHOR_SALT = 0x5851F42D4C957F2D

BREAKER_CLOSED = 0
BREAKER_OPEN = 1
BREAKER_HALF_OPEN = 2
_STATE_NAMES = ("closed", "open", "half_open")

_NAN = math.nan
_M64 = (1 << 64) - 1


def _mix(z: int) -> int:
    # SplitMix64's finalizer
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _anchor_key(anchor: int) -> int:
    """The index key of a conversation's anchor: salted, so never a block's key (0 is no key)."""
    return anchor ^ _ANCHOR_SALT or 1


def default_tag(index: int) -> int:
    """The tag of a replica that was given none: a hash of its index (the pool gives each
    replica a hash of its id, the same in every router)."""
    return _mix((index + 1) * 0x9E3779B97F4A7C15 & _M64) or 1


class _Table:
    """A bounded map of 64-bit key -> (replica tag, last used): ``size`` slots (a
    multiple of 4), 4-way set-associative; a put into a full bucket evicts its least
    recently used slot; an entry unused for ``ttl`` seconds is gone."""

    __slots__ = ("keys", "mask", "tags", "ttl", "used")

    def __init__(self, size: int, ttl: float) -> None:
        nb = 1
        while nb * _WAYS < size:
            nb *= 2
        self.mask = nb - 1
        self.keys = [0] * (nb * _WAYS)
        self.tags = [0] * (nb * _WAYS)
        self.used = [0.0] * (nb * _WAYS)
        self.ttl = ttl

    def find(self, key: int, now: float) -> int:
        base = (key & self.mask) * _WAYS
        for s in range(base, base + _WAYS):
            if self.keys[s] == key:
                return s if now - self.used[s] <= self.ttl else -1
        return -1

    def put(self, key: int, tag: int, now: float) -> None:
        base = (key & self.mask) * _WAYS
        keys = self.keys
        used = self.used
        victim = base
        for s in range(base, base + _WAYS):
            if keys[s] == key or keys[s] == 0:
                victim = s
                break
            if used[s] < used[victim]:
                victim = s
        keys[victim] = key
        self.tags[victim] = tag
        used[victim] = now

    def live(self, now: float) -> int:
        ttl = self.ttl
        return sum(1 for k, u in zip(self.keys, self.used, strict=True) if k and now - u <= ttl)


def _nan_if_none(value: float | None) -> float:
    return _NAN if value is None else float(value)


class Breaker:
    """A circuit breaker for one replica.

    Closed: every request may go. ``failures`` consecutive failures open it for
    ``current_cooldown`` seconds (``cooldown`` at first). Once the cooldown has
    passed, the next :meth:`allow` turns it half-open and lets exactly one probe
    through; the probe's success closes it (cooldown back to ``cooldown``), its
    failure opens it again with the cooldown doubled, up to ``max_cooldown``. A probe
    that never reports (its client went away: :meth:`release`) frees the probe
    slot; one that reports nothing for ``max_cooldown`` seconds is given up on and
    another request may probe.

    Only outcomes that say something about the replica count: connect errors,
    resets, timeouts and engine 5xx are failures; 4xx, client disconnects and
    admission rejections are neither failures nor successes. Late reports from
    requests sent before the breaker opened are ignored while it is open.

    ``opened``, ``half_opened``, ``closed`` and ``probes`` count transitions
    (open, open to half-open, back to closed, probes let through) for metrics.

    Args:
        failures: consecutive failures that open the breaker (>= 1).
        cooldown: seconds the breaker stays open the first time (>= 0).
        max_cooldown: the cooldown never grows beyond this (>= cooldown).

    Raises:
        ValueError: an argument is out of range.
    """

    __slots__ = (
        "_probe_expires",
        "_probing",
        "_state",
        "closed",
        "consecutive_failures",
        "cooldown",
        "current_cooldown",
        "failures",
        "half_opened",
        "max_cooldown",
        "open_until",
        "opened",
        "probes",
    )

    def __init__(self, failures: int = 5, cooldown: float = 5.0, max_cooldown: float = 60.0) -> None:
        failures = int(failures)
        cooldown = float(cooldown)
        max_cooldown = float(max_cooldown)
        if failures < 1:
            raise ValueError("failures must be at least 1")
        if not cooldown >= 0.0:
            raise ValueError("cooldown must be >= 0")
        if not max_cooldown >= cooldown:
            raise ValueError("max_cooldown must be >= cooldown")
        self.failures = failures
        self.cooldown = cooldown
        self.max_cooldown = max_cooldown
        self.consecutive_failures = 0
        self.open_until = 0.0
        self.current_cooldown = cooldown
        self.opened = 0
        self.half_opened = 0
        self.closed = 0
        self.probes = 0
        self._state = BREAKER_CLOSED
        self._probing = False
        self._probe_expires = 0.0

    @property
    def state(self) -> str:
        """``"closed"``, ``"open"`` or ``"half_open"``."""
        return _STATE_NAMES[self._state]

    @property
    def state_code(self) -> int:
        """The state as ``BREAKER_CLOSED`` (0), ``BREAKER_OPEN`` (1) or ``BREAKER_HALF_OPEN`` (2)."""
        return self._state

    def available(self, now: float) -> bool:
        """Whether :meth:`allow` would let a request through now (changes nothing)."""
        state = self._state
        if state == BREAKER_CLOSED:
            return True
        if state == BREAKER_OPEN:
            return now >= self.open_until
        return not self._probing or now >= self._probe_expires

    def allow(self, now: float) -> bool:
        """Whether a request may be sent now; in half-open state, takes the one probe."""
        state = self._state
        if state == BREAKER_CLOSED:
            return True
        if state == BREAKER_OPEN:
            if now < self.open_until:
                return False
            self._state = BREAKER_HALF_OPEN
            self.half_opened += 1
        elif self._probing and now < self._probe_expires:
            return False
        self._probing = True
        self._probe_expires = now + self.max_cooldown
        self.probes += 1
        return True

    def record_success(self, now: float) -> None:
        """A request to this replica succeeded (closes a half-open breaker)."""
        state = self._state
        if state == BREAKER_CLOSED:
            self.consecutive_failures = 0
        elif state == BREAKER_HALF_OPEN:
            self._state = BREAKER_CLOSED
            self._probing = False
            self.consecutive_failures = 0
            self.current_cooldown = self.cooldown
            self.closed += 1

    def record_failure(self, now: float) -> None:
        """A request to this replica failed (connect error, reset, timeout, 5xx)."""
        state = self._state
        if state == BREAKER_CLOSED:
            self.consecutive_failures += 1
            if self.consecutive_failures >= self.failures:
                self._state = BREAKER_OPEN
                self.open_until = now + self.current_cooldown
                self.opened += 1
        elif state == BREAKER_HALF_OPEN:
            self.consecutive_failures += 1
            self._state = BREAKER_OPEN
            self._probing = False
            self.current_cooldown = min(self.current_cooldown * 2.0, self.max_cooldown)
            self.open_until = now + self.current_cooldown
            self.opened += 1

    def release(self) -> None:
        """The probe will never report (client gone, request rejected): free the probe slot."""
        self._probing = False

    def __repr__(self) -> str:
        return f"<Breaker {self.state} failures={self.consecutive_failures}/{self.failures}>"


class EndpointState:
    """The numbers routing reads about one replica.

    Fields (all settable): ``index`` (position in its pool, for the caller),
    ``inflight`` (this router's requests in flight), ``waiting``, ``running``,
    ``kv_cache_usage`` (scraped; NaN: absent), ``scraped_at`` (monotonic seconds of the
    last good scrape; NaN: never; ``inf``: an engine that is never scraped and counts
    as always fresh), ``dispatched_since_scrape``, ``completed_since_scrape``,
    ``drain_rate`` (completions/s; NaN: unknown), ``latency`` (mean seconds a request
    spends here; NaN: unknown), ``slots`` (requests the replica runs at once; NaN:
    unknown), ``max_running`` (most ``running`` any scrape showed), ``seen_full`` (some
    scrape showed a queue, so ``max_running`` is the replica's capacity rather than
    a lower bound), ``draining``, ``down`` (the poller found the replica down: it
    cannot be reached, or its scrapes have failed for longer than ``stale_after``;
    set and cleared by the poller), ``breaker``.

    The data path calls :meth:`on_dispatch` when it sends a request here and
    :meth:`on_complete` (response received in full, any status the engine produced)
    or :meth:`on_abort` (no usable outcome: connect error, reset, timeout, engine
    5xx, client gone) when it leaves. The poller calls :meth:`on_scrape_sent` when
    it sends a scrape (optional, but it keeps the correction exact) and
    :meth:`on_scrape` when one lands.

    Args:
        index: the replica's position in its pool.
        breaker: its circuit breaker (default ``Breaker()``).
    """

    __slots__ = (
        "_area",
        "_breaker",
        "_done",
        "_mark_completed",
        "_mark_dispatched",
        "_marked",
        "_settled",
        "_t_last",
        "_window",
        "answered_at",
        "completed_since_scrape",
        "dispatched_since_scrape",
        "down",
        "drain_rate",
        "draining",
        "err_rate",
        "erring_since",
        "index",
        "inflight",
        "kv_cache_usage",
        "latency",
        "max_running",
        "running",
        "scraped_at",
        "seen_full",
        "slots",
        "tag",
        "waiting",
    )

    def __init__(self, index: int = 0, breaker: Breaker | None = None) -> None:
        self.index = int(index)
        self.tag = default_tag(self.index)
        self.inflight = 0
        self.waiting = _NAN
        self.running = _NAN
        self.kv_cache_usage = _NAN
        self.scraped_at = _NAN
        self.dispatched_since_scrape = 0
        self.completed_since_scrape = 0
        self.drain_rate = _NAN
        self.latency = _NAN
        self.slots = _NAN
        self.max_running = 0.0
        self.seen_full = False
        self.draining = False
        self.down = False
        self.answered_at = _NAN  # its last answer (2xx/4xx) to this router (monotonic; NaN: none)
        self.erring_since = _NAN  # its first 5xx answer since then (NaN: none): see Gateway.answered_5xx
        self.err_rate = 0.0  # the share of its answers that were errors (>= 400), over about 8: see answered_error
        self._breaker = Breaker() if breaker is None else breaker
        # Exponentially weighted sums (time constant DRAIN_TAU) of requests in flight
        # over time, of completions, and of observed time; NaN: no event yet.
        self._t_last = _NAN
        self._area = 0.0
        self._done = 0.0
        self._window = 0.0
        self._settled = _NAN  # latency as the last completion left it
        # on_scrape_sent(): the since-scrape counters when the scrape was sent
        self._marked = False
        self._mark_dispatched = 0
        self._mark_completed = 0

    @property
    def breaker(self) -> Breaker:
        """The replica's circuit breaker (never ``None``)."""
        return self._breaker

    @breaker.setter
    def breaker(self, value: Breaker) -> None:
        if not isinstance(value, Breaker):
            raise TypeError("breaker must be a Breaker")
        self._breaker = value

    # -- events ---------------------------------------------------------------

    def on_scrape_sent(self) -> None:
        """A scrape request was sent (optional): the next :meth:`on_scrape` keeps what happens after this.

        Without it, requests dispatched while the scrape was in flight are dropped
        from the correction when it lands, although the page may not count them.
        """
        self._mark_dispatched = self.dispatched_since_scrape
        self._mark_completed = self.completed_since_scrape
        self._marked = True

    def on_scrape(self, now: float, waiting: float | None, running: float | None, kv: float | None) -> None:
        """A scrape landed: store its numbers (``None``: absent) and reset the since-scrape counters.

        After :meth:`on_scrape_sent`, the counters keep what was dispatched and
        completed since the scrape was sent; otherwise they restart at zero.
        """
        self.waiting = _nan_if_none(waiting)
        self.running = _nan_if_none(running)
        self.kv_cache_usage = _nan_if_none(kv)
        self.scraped_at = now
        if self._marked:
            self.dispatched_since_scrape -= self._mark_dispatched
            self.completed_since_scrape -= self._mark_completed
            self._marked = False
        else:
            self.dispatched_since_scrape = 0
            self.completed_since_scrape = 0
        if self.running > self.max_running:
            self.max_running = self.running
        if self.waiting > 0.0:
            self.seen_full = True
        # the averages age between the replica's own events too: a latency nothing has
        # renewed for a while becomes unknown (the pool's mean), so a replica scored slow
        # and sent nothing since is tried again
        self._advance(now)
        self._estimate()

    def _estimate(self) -> None:
        # (after _advance) Little's law over the averages, with the prior; unknown before
        # any completion, and again once the evidence has aged away with nothing in flight
        w0 = self._settled
        if self._done < _LATENCY_FORGET and self.inflight == 0:
            self.latency = _NAN
        elif w0 == w0:
            self.latency = (self._area + _LATENCY_PRIOR * w0) / (self._done + _LATENCY_PRIOR)
        elif self._done > 0.0:
            self.latency = self._area / self._done
        else:
            self.latency = _NAN

    def _advance(self, now: float) -> None:
        last = self._t_last
        if last != last:
            self._t_last = now
        elif now > last:
            x = -(now - last) / DRAIN_TAU
            decay = math.exp(x)
            part = -math.expm1(x)
            self._area = self._area * decay + self.inflight * DRAIN_TAU * part
            self._done = self._done * decay
            self._window = self._window * decay + DRAIN_TAU * part
            self._t_last = now

    def on_dispatch(self, now: float) -> None:
        """The router sent a request to this replica."""
        self._advance(now)
        self.inflight += 1
        self.dispatched_since_scrape += 1
        self._estimate()

    def on_complete(self, now: float) -> None:
        """A request left this replica with a response (counts for drain rate and latency)."""
        self._advance(now)
        if self.inflight > 0:
            self.inflight -= 1
        self.completed_since_scrape += 1
        self.answered_at = now
        self.erring_since = _NAN
        self.err_rate -= self.err_rate * ERR_WEIGHT
        self._done += 1.0
        self.drain_rate = self._done / max(self._window, _MIN_WINDOW)
        self._estimate()
        self._settled = self.latency

    def answered_error(self, completed: bool) -> None:
        """The replica answered with an error (a 4xx but 401/403, or a 5xx): a 1 in ``err_rate`` (an
        average over about ``1 / ERR_WEIGHT`` answers, 0 for the rest). ``completed``: right after
        :meth:`on_complete` for the same answer (a 4xx), whose 0 it turns into the 1."""
        if completed:
            self.err_rate += ERR_WEIGHT
        else:
            self.err_rate += (1.0 - self.err_rate) * ERR_WEIGHT

    def rate_at(self, now: float) -> float:
        """``drain_rate`` as of ``now``: it decays while no request completes (a replica that stopped
        answering does not keep its last rate), as the next completion would find it; NaN: never measured."""
        rate, last, done, window = self.drain_rate, self._t_last, self._done, self._window
        if rate != rate or last != last or not window > 0.0:
            return rate
        if now > last:
            x = -(now - last) / DRAIN_TAU
            decay = math.exp(x)
            done = done * decay
            window = window * decay - DRAIN_TAU * math.expm1(x)
        return done / max(window, _MIN_WINDOW)

    def breaker_settled(self) -> bool:
        """Whether the breaker is closed with no failure counted (a success would change nothing)."""
        b = self._breaker
        return b.state_code == BREAKER_CLOSED and b.consecutive_failures == 0

    def half_open(self) -> bool:
        """Whether the breaker is half-open: a request just picked for this replica is its probe."""
        return self._breaker.state_code == BREAKER_HALF_OPEN

    def on_abort(self, now: float) -> None:
        """A request left this replica without a usable outcome (not a completion)."""
        self._advance(now)
        if self.inflight > 0:
            self.inflight -= 1
        self.completed_since_scrape += 1
        self._estimate()

    # -- reading --------------------------------------------------------------

    def stale(self, now: float, stale_after: float) -> bool:
        """Whether the engine numbers are missing or older than ``stale_after`` seconds."""
        at = self.scraped_at
        return at != at or now - at > stale_after

    def usable(self, now: float) -> bool:
        """Whether new requests may go here: not draining, not down, breaker available."""
        return not self.draining and not self.down and self._breaker.available(now)

    def capacity(self) -> float:
        """Requests the replica runs at once: ``slots``, else the most seen running (at least 1)."""
        slots = self.slots
        if slots > 0.0:
            return slots
        return self.max_running if self.max_running > 1.0 else 1.0

    def load(self) -> float:
        """Corrected requests on the replica: ``max(inflight, W + R + dispatched - completed)``.

        NOTE: never less than this router's own requests in flight there. A scrape
        taken while a burst's requests are still on their way (sent, not yet counted
        by the engine) under-reports them; without the floor the replica then looks
        emptier than it is and takes the rest of the burst (a 13/3 split of 16).
        """
        w = self.waiting
        r = self.running
        n = (w if w == w else 0.0) + (r if r == r else 0.0)
        n = n + (self.dispatched_since_scrape - self.completed_since_scrape)
        own = float(self.inflight)
        return n if n > own else own

    def queued(self) -> float:
        """Corrected queue (NaN if the engine reports no queue gauge).

        The router's own requests since the scrape (dispatched less completed) join
        the queue when the engine had one; otherwise they fill the free slots first
        (``capacity() - running``) and only the rest queue.
        """
        w = self.waiting
        if w != w:
            return _NAN
        net = float(self.dispatched_since_scrape - self.completed_since_scrape)
        r = self.running
        # with a queue (or no running gauge) our requests queue; else they fill free slots first
        q = w + net if w > 0.0 or r != r else r + net - self.capacity()
        return q if q > 0.0 else 0.0

    def saturation(self, now: float, stale_after: float, max_waiting: float, max_kv: float) -> float:
        """How full the replica is against the limits; 1.0 is the healthy limit, stale is 1.0.

        Raises:
            ValueError: ``max_waiting`` or ``max_kv`` is not positive.
        """
        if not (max_waiting > 0.0 and max_kv > 0.0):
            raise ValueError("max_waiting and max_kv must be positive")
        if self.stale(now, stale_after):
            return 1.0
        sat = 0.0
        reported = False
        q = self.queued()
        if q == q:
            sat = q / max_waiting
            reported = True
        kv = self.kv_cache_usage
        if kv == kv:
            kv = kv / max_kv
            if kv > sat:
                sat = kv
            reported = True
        if not reported:
            q = self.inflight - self.capacity()
            sat = q / max_waiting if q > 0.0 else 0.0
        return sat

    def __repr__(self) -> str:
        return (
            f"<EndpointState {self.index} inflight={self.inflight} waiting={self.waiting} "
            f"running={self.running} kv={self.kv_cache_usage}>"
        )


class Picker:
    """Chooses a replica for each request.

    Args:
        strategy: ``"score"``, ``"least_inflight"``, ``"round_robin"`` or ``"prefix"``.
        seed: seeds the tie-break generator (a 64-bit SplitMix); ``None`` draws one
            from the OS. The same seed gives the same picks in both twins.
        index_entries, session_entries, load_bound, entry_ttl: the ``prefix``
            strategy's table sizes, bound and ageing (see :meth:`pick_prefix`); the
            other strategies keep no tables.

    Raises:
        ValueError: unknown strategy, or a setting out of range.
    """

    __slots__ = (
        "_bound", "_counts", "_index", "_mean_blocks", "_reuse", "_reuse_seen", "_rng", "_rr", "_sessions", "_settings", "_strategy", "shared",
    )

    def __init__(
        self,
        strategy: str = "score",
        seed: int | None = None,
        index_entries: int = INDEX_ENTRIES,
        session_entries: int = SESSION_ENTRIES,
        load_bound: float = LOAD_BOUND,
        entry_ttl: float = ENTRY_TTL,
    ) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(
                f"unknown routing strategy {strategy!r}; expected one of {', '.join(STRATEGIES)}"
            )
        index_entries = int(index_entries)
        session_entries = int(session_entries)
        load_bound = float(load_bound)
        entry_ttl = float(entry_ttl)
        if not (4 <= index_entries <= 1 << 24 and 4 <= session_entries <= 1 << 24):
            raise ValueError("index_entries and session_entries must be in 4..16777216")
        if not (load_bound >= 0.0 and entry_ttl > 0.0):
            raise ValueError("load_bound must be >= 0 and entry_ttl > 0")
        self._strategy = STRATEGIES.index(strategy)
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little")
        self._rng = int(seed) & _M64
        self._rr = 0
        self._settings = (index_entries, session_entries, load_bound, entry_ttl)
        self._bound = load_bound
        self._counts = [0, 0, 0, 0]
        self._mean_blocks = 0.0  # prefix: EWMA of the chain's blocks per request
        self._reuse = 1.0  # prefix: EWMA of the keyed requests that continued something known (REUSE_MIN)
        self._reuse_seen = False  # ... and whether a keyed request came yet (until then: presumed, not measured)
        self.shared = False
        """Whether the other routers' conversation routes reach this picker (:meth:`learn`): a
        conversation it knows of is then where it knows, not first at its home (:meth:`pick_prefix`)."""
        if self._strategy == _S_PREFIX:
            self._index: _Table | None = _Table(index_entries, entry_ttl)
            self._sessions: _Table | None = _Table(session_entries, entry_ttl)
        else:
            self._index = self._sessions = None

    @property
    def strategy(self) -> str:
        return STRATEGIES[self._strategy]

    @property
    def settings(self) -> tuple[int, int, float, float]:
        """``(index_entries, session_entries, load_bound, entry_ttl)`` as given."""
        return self._settings

    def decisions(self) -> tuple[int, int, int, int]:
        """How many picks the ``prefix`` strategy made for each of :data:`REASONS`."""
        c = self._counts
        return (c[0], c[1], c[2], c[3])

    def index_size(self, now: float) -> tuple[int, int]:
        """``(prefix entries, session entries)`` live now (0, 0 for other strategies)."""
        if self._index is None or self._sessions is None:
            return (0, 0)
        return (self._index.live(now), self._sessions.live(now))

    @property
    def reuse(self) -> float:
        """``prefix``: the share of keyed requests (an EWMA) that continued something this
        router knew (a session, a later turn, a chain the index had the start of); while it is
        under ``REUSE_MIN`` the blind rule places first turns as ``score`` does. NaN until the
        first keyed request (the gate presumes reuse until then: it is open)."""
        return self._reuse if self._reuse_seen else _NAN

    def index_capacity(self) -> tuple[int, int]:
        """``(prefix slots, session slots)`` allocated (24 bytes each)."""
        if self._index is None or self._sessions is None:
            return (0, 0)
        return (len(self._index.keys), len(self._sessions.keys))

    def _next(self) -> int:
        # SplitMix64 (Steele, Lea, Flood 2014): tiny, fast in C, exact in Python.
        self._rng = z = (self._rng + 0x9E3779B97F4A7C15) & _M64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
        return z ^ (z >> 31)

    def random(self) -> int:
        """The next 64-bit value of the tie-break generator (tests, simulations)."""
        return self._next()

    def pick(self, states: Sequence[EndpointState], now: float, stale_after: float) -> int:
        """The index in ``states`` of the replica to send the next request to, or -1.

        The compiled twin requires ``states`` to be a ``list``. ``prefix`` without a
        key (see :meth:`pick_prefix`) picks as ``score`` and counts ``blind``.
        """
        strategy = self._strategy
        if strategy == _S_SCORE:
            i = self._score(states, now, stale_after)
        elif strategy == _S_LEAST_INFLIGHT:
            i = self._least_inflight(states, now)
        elif strategy == _S_ROUND_ROBIN:
            i = self._round_robin(states, now)
        else:
            i = self._prefix(states, now, stale_after, b"", 0)
        if i >= 0:
            states[i]._breaker.allow(now)
        return i

    def pick_prefix(
        self, states: Sequence[EndpointState], now: float, stale_after: float, chain: bytes, session: int
    ) -> int:
        """:meth:`pick` with the request's routing key: ``chain`` (``jsonscan.json_route``'s
        key: the anchor, its whole blocks and the prompt's block links, as 64-bit words;
        ``b""``: none) and ``session`` (a session hash; 0: none).

        With the ``prefix`` strategy, ``b`` is the replica ``score`` picks and a replica
        is *allowed* when it has a free slot (``load() + 1 <= capacity``) or its
        utilisation ``load() / capacity`` exceeds ``b``'s by at most ``load_bound``. A
        cached replica is *worth it* when it is allowed and, if ``b`` has a free slot,
        it has one too or its queue wait (positions ahead / slots, in latencies, as
        ``score`` counts it) is shorter than the prefill its cache saves:
        ``PREFILL_WEIGHT`` latencies for a request of the pool's mean chain length
        (an EWMA), pro rata to the blocks it has. In this order:

        1. the session's replica, if the session table has one, it is usable and worth
           it (``session``); if not: ``b`` (``load_fallback``), and the session stays on
           ``b`` from now on;
        2. the replica that served the longest prefix of the chain (the first blocks
           found in the index, in order, up to the first miss; among the last 4
           replicas along it, the deepest one worth it: ``prefix_hit``). None worth it:
           rendezvous hashing of the deepest matched block over the replicas allowed
           (with a free slot, while ``b`` has one), so that every router spills a
           prefix to the same few replicas (``load_fallback``). A match no deeper than
           the anchor's whole blocks is no hit for a later turn of a conversation (it
           covers only a system prompt that many conversations share), nor for a first
           turn when it is at most ``SHORT_SHARED`` blocks (such a first turn goes where
           its anchor hashes, as its later turns will at routers that never saw it);
        3. otherwise: rendezvous hashing of the session (else the anchor, else the
           first block) over the allowed replicas' tags, so that routers that share
           nothing agree (``blind``); no key at all, or a first turn with no session
           while under ``REUSE_MIN`` of the keyed requests continue something known
           (:attr:`reuse`): ``b`` (``blind``).

        The chosen replica is then recorded for the session and for every block of
        the chain. Other strategies ignore the key.
        """
        strategy = self._strategy
        if strategy == _S_PREFIX:
            i = self._prefix(states, now, stale_after, chain, session)
        elif strategy == _S_SCORE:
            i = self._score(states, now, stale_after)
        elif strategy == _S_LEAST_INFLIGHT:
            i = self._least_inflight(states, now)
        else:
            i = self._round_robin(states, now)
        if i >= 0:
            states[i]._breaker.allow(now)
        return i

    def learn(self, chain: bytes, session: int, tag: int, now: float) -> None:
        """Record that another router sent a request with this key (``chain``, ``session`` as
        :meth:`pick_prefix` takes them) to the replica whose ``EndpointState.tag`` is ``tag``,
        as this router's own pick would have been recorded. A no-op for other strategies; a
        chain that is no key (under 3 words) records the session only.
        """
        index = self._index
        sessions = self._sessions
        if index is None or sessions is None or not tag:
            return
        tag &= _M64
        if session:
            sessions.put(session & _M64, tag, now)
        words = len(chain) >> 3
        if words < 3:
            return
        key = struct.unpack(f"={words}Q", chain[: words * 8])
        for h in key[2:]:
            if h:  # (0 marks an empty slot: no key from the wire may be it)
                index.put(h, tag, now)
        if key[0]:
            index.put(_anchor_key(key[0]), tag, now)

    def _prefix(
        self, states: Sequence[EndpointState], now: float, stale_after: float, chain: bytes, session: int
    ) -> int:
        b = self._score(states, now, stale_after)
        if b < 0:
            return -1
        index = self._index
        sessions = self._sessions
        assert index is not None and sessions is not None
        # the pool's largest capacity (as score: a replica never seen full may be bigger)
        prior = 1.0
        for st in states:
            c = st.capacity()
            if c > prior:
                prior = c
        limit = _util(states[b], prior) + self._bound
        tb = states[b].latency
        tmax = SLOWER * tb if tb > 0.0 else math.inf  # (slower replicas than this are no home)
        b_free = _has_slot(states[b], prior)
        words = len(chain) >> 3
        key: tuple[int, ...] = struct.unpack(f"={words}Q", chain) if words >= 3 else (0, 0)
        anchor = key[0]
        anchor_blocks = key[1] & ~(1 << 63)
        # a later turn: a match no deeper than its anchor's whole blocks covers only what
        # conversations share (a system prompt); a first turn has nothing more to match
        shallow = anchor_blocks if anchor and key[1] >> 63 else -1
        blocks = key[2:]
        nb = len(blocks)
        if nb:
            mb = self._mean_blocks
            self._mean_blocks = mb + (nb - mb) * MEAN_BLOCKS_WEIGHT if mb > 0.0 else float(nb)
        # the prefill a cache of d blocks saves, in latencies: PREFILL_WEIGHT x d / mean blocks
        per_block = PREFILL_WEIGHT / self._mean_blocks if self._mean_blocks > 0.0 else 0.0
        pick = -1
        reason = _R_BLIND
        new_session = False  # a session no table knows: its hash places it, as in every router
        if session:
            slot = sessions.find(session, now)
            new_session = slot < 0
            if slot >= 0:
                i = _find_tag(states, sessions.tags[slot], now)
                if i >= 0:
                    if _worth(states[i], prior, limit, tmax, b_free, nb * per_block) or i == b:
                        pick = i
                        reason = _R_SESSION
                    else:
                        pick = b
                        reason = _R_LOAD
        matched = 0  # blocks of the chain found in the index, in order
        if pick < 0 and blocks and not new_session:
            hits: list[int] = []  # the last _HITS_KEPT tags met along the cached prefix, deepest last
            depths: list[int] = []  # ... and how deep each was met
            last = 0  # the deepest matched block
            for h in blocks:
                slot = index.find(h, now)
                if slot < 0:
                    break
                matched += 1
                last = h
                t = index.tags[slot]
                if hits and hits[-1] == t:
                    depths[-1] = matched
                else:
                    if len(hits) == _HITS_KEPT:
                        del hits[0]
                        del depths[0]
                    hits.append(t)
                    depths.append(matched)
            if matched <= shallow or (
                shallow < 0 and anchor and matched <= anchor_blocks and matched <= SHORT_SHARED
            ):
                hits = []  # (only a shared start is known: the conversation's anchor decides)
            if (
                shallow >= 0 and (not hits or depths[-1] < nb - KNOWN_TURN) and _shared(states)
                and not (self.shared and index.find(_anchor_key(anchor), now) >= 0)
            ):
                # other routers share the pool and this one did not see the previous turn (nor
                # learn where it went): the conversation's home first, where every router that
                # knows nothing of it sends it
                best_w = -1
                home = -1
                for i, st in enumerate(states):
                    if st.usable(now) and not st.latency > tmax:  # (unknown latency: NaN, allowed)
                        w = _mix(anchor ^ st.tag)
                        if w > best_w:
                            best_w = w
                            home = i
                if home >= 0 and (
                    home == b or _worth(states[home], prior, limit, tmax, b_free, HOME_SHARE * nb * per_block)
                ):
                    pick = home
                    reason = _R_PREFIX
            for k in range(len(hits) - 1, -1, -1):
                if pick >= 0:
                    break
                i = _find_tag(states, hits[k], now)
                if i >= 0 and (i == b or _worth(states[i], prior, limit, tmax, b_free, depths[k] * per_block)):
                    pick = i
                    reason = _R_PREFIX
            if pick < 0 and not hits and shallow >= 0:
                # a later turn matched no deeper than its anchor: where this router last
                # sent the conversation, if it did (the anchor is the conversation's key)
                slot = index.find(_anchor_key(anchor), now)
                if slot >= 0:
                    i = _find_tag(states, index.tags[slot], now)
                    if i >= 0 and (i == b or _worth(states[i], prior, limit, tmax, b_free, nb * per_block)):
                        pick = i
                        reason = _R_PREFIX
            if pick < 0 and hits:
                # none may take it: spill along the deepest matched block's rendezvous
                # order, so that every router spills a prefix to the same few replicas,
                # which then hold it (consistent hashing with bounded loads)
                reason = _R_LOAD
                best_w = -1
                for i, st in enumerate(states):
                    if st.usable(now) and _allowed(st, prior, limit, tmax) and (not b_free or _has_slot(st, prior)):
                        w = _mix(last ^ st.tag)
                        if w > best_w:
                            best_w = w
                            pick = i
                if pick < 0:
                    pick = b
        if nb or session:
            known = matched > 0 or reason != _R_BLIND or shallow >= 0 or (session and not new_session)
            ru = self._reuse
            self._reuse = ru + ((1.0 if known else 0.0) - ru) * REUSE_WEIGHT
            self._reuse_seen = True
        if pick < 0:
            blind_limit = limit - self._bound * (1.0 - BLIND_SHARE)
            h = session or anchor or (blocks[0] if blocks else 0)
            if not (session or shallow >= 0 or self._reuse >= REUSE_MIN):
                h = 0  # (nothing is used again here: a first turn is placed as score places it)
            if h:
                best_w = -1
                for i, st in enumerate(states):
                    if st.usable(now) and _allowed(st, prior, blind_limit, tmax):
                        w = _mix(h ^ st.tag)
                        if w > best_w:
                            best_w = w
                            pick = i
            if pick < 0:
                pick = b
        tag = states[pick].tag
        if session:
            sessions.put(session, tag, now)
        for h in blocks:
            index.put(h, tag, now)
        if anchor:
            index.put(_anchor_key(anchor), tag, now)
        self._counts[reason] += 1
        return pick

    def _least_inflight(self, states: Sequence[EndpointState], now: float) -> int:
        best = -1
        best_load = 0
        ties = 0
        for i, st in enumerate(states):
            if not st.usable(now):
                continue
            load = st.inflight
            if best < 0 or load < best_load:
                best = i
                best_load = load
                ties = 1
            elif load == best_load:
                ties += 1
                if self._next() % ties == 0:
                    best = i
        return best

    def _round_robin(self, states: Sequence[EndpointState], now: float) -> int:
        n = len(states)
        if n == 0:
            return -1
        start = self._rr % n
        for k in range(n):
            i = start + k
            if i >= n:
                i -= n
            if states[i].usable(now):
                self._rr = i + 1
                return i
        return -1

    def _score(self, states: Sequence[EndpointState], now: float, stale_after: float) -> int:
        # pass 1: the usable fresh replicas' numbers, the pool's largest capacity and
        # the mean of the known latencies; pass 2: costs; pass 3: draw among near-ties
        cand: list[tuple[int, float, float, float, float, float]] = []
        fastest = math.inf
        known_sum = 0.0
        known = 0
        gauged = 0
        prior = 1.0
        for i, st in enumerate(states):
            if not st.usable(now) or st.stale(now, stale_after):
                continue
            w = st.waiting
            r = st.running
            # fresh but blind (no queue or running gauge: llama-server without --metrics, a metrics page
            # that fails): a candidate all the same, on this router's own requests there (load()'s floor),
            # never left idle while its siblings queue
            gauged += w == w or r == r
            kv = st.kv_cache_usage
            kvf = 1.0 + KV_WEIGHT * (kv - KV_KNEE) / (1.0 - KV_KNEE) if kv > KV_KNEE else 1.0
            c = st.capacity()
            if c > prior:
                prior = c
            if not (st.slots > 0.0 or st.seen_full):
                c = -c  # a lower bound only: pass 2 uses the pool's largest
            # an engine with a queue is full: what it runs now is its capacity now
            full = r if w > 0.0 and r > 0.0 else 0.0
            t = st.latency
            if t > 0.0:
                known_sum += t
                known += 1
                if t < fastest:
                    fastest = t
            else:
                t = _NAN
            cand.append((i, st.load(), c, full, kvf, t))
        n = len(cand)
        if gauged == 0:
            return self._least_inflight(states, now)  # (a pool none of whose replicas is read)
        fill = known_sum / known if known else 1.0
        top = MAX_SLOWER * fastest
        cost: list[float] = []
        best = math.inf
        for _, load, c, full, kvf, t in cand:
            if c < 0.0:
                c = prior
            slots_now = full if full > 0.0 else c
            ahead = load + 1.0 - slots_now
            wait = ahead / slots_now if ahead > 0.0 else 0.0
            if t != t:
                t = fill
            if t > top:
                t = top
            x = (wait + PREFILL_SHARE * (1.0 + load / c)) * kvf * t
            cost.append(x)
            if x < best:
                best = x
        limit = best * (1.0 + NEAR_TIE)
        m = 0
        for k in range(n):
            if cost[k] <= limit:
                m += 1
        if m == 1:
            for k in range(n):
                if cost[k] <= limit:
                    return cand[k][0]
        r = self._next() % m
        for k in range(n):
            if cost[k] <= limit:
                if r == 0:
                    return cand[k][0]
                r -= 1
        return -1  # unreachable

    def __repr__(self) -> str:
        return f"<Picker {self.strategy}>"


def _util(st: EndpointState, prior: float) -> float:
    c = st.capacity()
    if not (st.slots > 0.0 or st.seen_full) and prior > c:
        c = prior
    return st.load() / c


def _allowed(st: EndpointState, prior: float, limit: float, tmax: float) -> bool:
    """Not much slower than the best (latency at most ``tmax``), and a free slot or
    utilisation within ``limit`` (the best's plus the bound)."""
    if st.latency > tmax:
        return False
    c = st.capacity()
    if not (st.slots > 0.0 or st.seen_full) and prior > c:
        c = prior
    load = st.load()
    return load + 1.0 <= c or load / c <= limit


def _has_slot(st: EndpointState, prior: float) -> bool:
    c = st.capacity()
    if not (st.slots > 0.0 or st.seen_full) and prior > c:
        c = prior
    return st.load() + 1.0 <= c


def _worth(st: EndpointState, prior: float, limit: float, tmax: float, b_free: bool, saved: float) -> bool:
    """Whether a replica with ``saved`` latencies of prefill cached may take the request:
    :func:`_allowed`, and, while score's pick has a free slot, a free slot here too or a
    queue wait (positions ahead / slots, in latencies, as score counts it) below ``saved``."""
    if not _allowed(st, prior, limit, tmax):
        return False
    c = st.capacity()
    if not (st.slots > 0.0 or st.seen_full) and prior > c:
        c = prior
    load = st.load()
    if not b_free or load + 1.0 <= c:
        return True
    w = st.waiting
    r = st.running
    slots_now = r if w > 0.0 and r > 0.0 else c
    return (load + 1.0 - slots_now) / slots_now < saved


def _shared(states: Sequence[EndpointState]) -> bool:
    """Whether other routers send to the pool: this router's requests in flight are less
    than SHARED_FLEET of the pool's load as it sees it (scraped, corrected)."""
    own = 0
    seen = 0.0
    for st in states:
        own += st.inflight
        seen += st.load()
    return own < SHARED_FLEET * seen


def _find_tag(states: Sequence[EndpointState], tag: int, now: float) -> int:
    for i, st in enumerate(states):
        if st.tag == tag:
            return i if st.usable(now) else -1
    return -1


def pool_saturation(
    states: Sequence[EndpointState], now: float, stale_after: float, max_waiting: float, max_kv: float
) -> float:
    """Mean saturation of the usable replicas (stale ones count 1.0); ``inf`` if none is usable.

    Raises:
        ValueError: ``max_waiting`` or ``max_kv`` is not positive.
    """
    if not (max_waiting > 0.0 and max_kv > 0.0):
        raise ValueError("max_waiting and max_kv must be positive")
    total = 0.0
    n = 0
    for st in states:
        if st.usable(now):
            total += st.saturation(now, stale_after, max_waiting, max_kv)
            n += 1
    return total / n if n else math.inf


def retry_after(states: Sequence[EndpointState], queued: int, now: float) -> float:
    """Seconds a rejected client should wait: ``(queued + 1)`` completions at the pool's drain rate.

    Sums the drain rate now (:meth:`EndpointState.rate_at`, at least ``capacity() / latency``,
    what a full replica finishes) over usable replicas whose rate is known; clamped to
    ``[RETRY_AFTER_MIN, RETRY_AFTER_MAX]``; ``RETRY_AFTER_DEFAULT`` when no rate is known.
    """
    rate = 0.0
    for st in states:
        if not st.usable(now):
            continue
        r = st.rate_at(now)
        t = st.latency
        if t > 0.0:
            # a saturated pool (the only one that answers 429) drains what its replicas run at once
            # per latency, whatever this router's recent completions were (a burst after an idle
            # spell read a rate decayed towards 0: Retry-After 60 s for a pool that drains in 10)
            full = st.capacity() / t
            if full > r:
                r = full
        if r > 0.0:
            rate += r
    if not rate > 0.0:
        return RETRY_AFTER_DEFAULT
    t = (queued + 1.0) / rate
    if t < RETRY_AFTER_MIN:
        return RETRY_AFTER_MIN
    if t > RETRY_AFTER_MAX:
        return RETRY_AFTER_MAX
    return t


class RetryBudget:
    """Bounds retries in flight to a fraction of active requests.

    ``can_retry(active)`` is true while retries in flight are fewer than
    ``max(min_inflight, ratio * active)``; the floor lets a lone request retry. Call
    :meth:`record_retry` when a retry is sent and :meth:`done_retry` when it ends.
    ``retries`` and ``refused`` count granted and refused retries.

    Args:
        ratio: retries in flight per active request (0 disables retries beyond the floor).
        min_inflight: retries always allowed in flight, whatever the load.

    Raises:
        ValueError: a negative argument.
    """

    __slots__ = ("min_inflight", "ratio", "refused", "retries", "retrying")

    def __init__(self, ratio: float = 0.2, min_inflight: int = 3) -> None:
        ratio = float(ratio)
        min_inflight = int(min_inflight)
        if not ratio >= 0.0 or min_inflight < 0:
            raise ValueError("ratio and min_inflight must be >= 0")
        self.ratio = ratio
        self.min_inflight = min_inflight
        self.retrying = 0
        self.retries = 0
        self.refused = 0

    def can_retry(self, active: int) -> bool:
        """Whether one more retry may be sent while ``active`` requests are in flight."""
        limit = self.ratio * active
        if limit < self.min_inflight:
            limit = self.min_inflight
        if self.retrying < limit:
            return True
        self.refused += 1
        return False

    def record_retry(self) -> None:
        """A retry was sent."""
        self.retrying += 1
        self.retries += 1

    def done_retry(self) -> None:
        """A retry ended (however)."""
        if self.retrying > 0:
            self.retrying -= 1
