# cython: language_level=3
"""Routing kernels (compiled twin of ``score_py``; see its docstring and docs/routing.md).

NOTE: every formula is written in the same order as in the twin, so the two give
bit-identical floats (no FMA contraction happens on the default x86-64/arm64
targets for these separate statements; the differential tests check it).
"""

cimport cython
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.ref cimport PyObject
from libc.math cimport INFINITY, NAN, exp, expm1, isnan
from libc.stdint cimport uint64_t
from libc.string cimport memcpy
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE

import os

DRAIN_TAU = 10.0
ERR_WEIGHT = 0.125
NEAR_TIE = 0.1
PREFILL_SHARE = 0.05
KV_KNEE = 0.7
KV_WEIGHT = 3.0
RETRY_AFTER_MIN = 1.0
RETRY_AFTER_MAX = 60.0
RETRY_AFTER_DEFAULT = 5.0
STRATEGIES = ("score", "least_inflight", "round_robin", "prefix")
REASONS = ("prefix_hit", "session", "load_fallback", "blind")
INDEX_ENTRIES = 16384
SESSION_ENTRIES = 4096
LOAD_BOUND = 0.25
SLOWER = 3.0
BLIND_SHARE = 0.2
PREFILL_WEIGHT = 0.2
MEAN_BLOCKS_WEIGHT = 1.0 / 64
REUSE_MIN = 0.05
REUSE_WEIGHT = 1.0 / 64
SHORT_SHARED = 12
SHARED_FLEET = 0.75
KNOWN_TURN = 4
HOME_SHARE = 0.5
ENTRY_TTL = 600.0
BREAKER_CLOSED = BS_CLOSED
BREAKER_OPEN = BS_OPEN
BREAKER_HALF_OPEN = BS_HALF_OPEN

# The same numbers as C constants (the Python names above are the public ones).
cdef double C_DRAIN_TAU = 10.0
cdef double C_MIN_WINDOW = 1.0
cdef double C_ERR_WEIGHT = 0.125
# (score_py: _LATENCY_PRIOR) completions at the last settled latency added to the averages
cdef double C_LATENCY_PRIOR = 0.5
# (score_py: _LATENCY_FORGET) nothing in flight and less evidence than this: latency unknown again
cdef double C_LATENCY_FORGET = 0.05
# (score_py: MAX_SLOWER) no replica is scored more than this many times slower than the pool's fastest
cdef double C_MAX_SLOWER = 4.0
cdef double C_NEAR_TIE = 0.1
cdef double C_PREFILL_SHARE = 0.05
cdef double C_KV_KNEE = 0.7
cdef double C_KV_WEIGHT = 3.0
cdef double C_RETRY_AFTER_MIN = 1.0
cdef double C_RETRY_AFTER_MAX = 60.0
cdef double C_RETRY_AFTER_DEFAULT = 5.0
cdef double C_SLOWER = 3.0
cdef double C_BLIND_SHARE = 0.2
cdef double C_PREFILL_WEIGHT = 0.2
cdef double C_MEAN_BLOCKS_WEIGHT = 1.0 / 64
cdef double C_REUSE_MIN = 0.05
cdef double C_REUSE_WEIGHT = 1.0 / 64
cdef long long C_SHORT_SHARED = 12
cdef double C_SHARED_FLEET = 0.75
cdef long long C_KNOWN_TURN = 4
cdef double C_HOME_SHARE = 0.5
cdef uint64_t C_ANCHOR_SALT = 0x5851F42D4C957F2DULL

cdef tuple _STATE_NAMES = ("closed", "open", "half_open")
cdef object os_urandom = os.urandom
cdef object _M64 = (1 << 64) - 1

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
    "default_tag",
    "pool_saturation",
    "retry_after",
]


cdef inline uint64_t _mix(uint64_t z) noexcept:
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL
    return z ^ (z >> 31)


cdef inline uint64_t _anchor_key(uint64_t anchor) noexcept:
    # the index key of a conversation's anchor: salted, so never a block's key (0 is no key)
    cdef uint64_t k = anchor ^ C_ANCHOR_SALT
    return k if k != 0 else 1


cdef inline uint64_t _default_tag(uint64_t index) noexcept:
    cdef uint64_t t = _mix((index + 1) * 0x9E3779B97F4A7C15ULL)
    return t if t else 1


def default_tag(index):
    """The tag of a replica that was given none (see the twin)."""
    return _default_tag(<uint64_t>int(index))


cdef inline double _nan_if_none(object value) except? -1.0:
    if value is None:
        return NAN
    return float(value)


@cython.final
cdef class Breaker:
    """A circuit breaker for one replica (see score_py.Breaker)."""

    def __init__(self, failures=5, cooldown=5.0, max_cooldown=60.0):
        cdef int f = int(failures)
        cdef double c = float(cooldown)
        cdef double m = float(max_cooldown)
        if f < 1:
            raise ValueError("failures must be at least 1")
        if not c >= 0.0:
            raise ValueError("cooldown must be >= 0")
        if not m >= c:
            raise ValueError("max_cooldown must be >= cooldown")
        self.failures = f
        self.cooldown = c
        self.max_cooldown = m
        self.consecutive_failures = 0
        self.open_until = 0.0
        self.current_cooldown = c
        self.opened = 0
        self.half_opened = 0
        self.closed = 0
        self.probes = 0
        self._state = BS_CLOSED
        self._probing = False
        self._probe_expires = 0.0

    @property
    def state(self):
        """``"closed"``, ``"open"`` or ``"half_open"``."""
        return _STATE_NAMES[self._state]

    @property
    def state_code(self):
        """The state as ``BREAKER_CLOSED`` (0), ``BREAKER_OPEN`` (1) or ``BREAKER_HALF_OPEN`` (2)."""
        return self._state

    cdef inline bint _available(self, double now) noexcept:
        if self._state == BS_CLOSED:
            return True
        if self._state == BS_OPEN:
            return now >= self.open_until
        return not self._probing or now >= self._probe_expires

    cdef bint _allow(self, double now) noexcept:
        if self._state == BS_CLOSED:
            return True
        if self._state == BS_OPEN:
            if now < self.open_until:
                return False
            self._state = BS_HALF_OPEN
            self.half_opened += 1
        elif self._probing and now < self._probe_expires:
            return False
        self._probing = True
        self._probe_expires = now + self.max_cooldown
        self.probes += 1
        return True

    def available(self, double now):
        """Whether :meth:`allow` would let a request through now (changes nothing)."""
        return self._available(now)

    def allow(self, double now):
        """Whether a request may be sent now; in half-open state, takes the one probe."""
        return self._allow(now)

    def record_success(self, double now):
        """A request to this replica succeeded (closes a half-open breaker)."""
        if self._state == BS_CLOSED:
            self.consecutive_failures = 0
        elif self._state == BS_HALF_OPEN:
            self._state = BS_CLOSED
            self._probing = False
            self.consecutive_failures = 0
            self.current_cooldown = self.cooldown
            self.closed += 1

    def record_failure(self, double now):
        """A request to this replica failed (connect error, reset, timeout, 5xx)."""
        if self._state == BS_CLOSED:
            self.consecutive_failures += 1
            if self.consecutive_failures >= self.failures:
                self._state = BS_OPEN
                self.open_until = now + self.current_cooldown
                self.opened += 1
        elif self._state == BS_HALF_OPEN:
            self.consecutive_failures += 1
            self._state = BS_OPEN
            self._probing = False
            self.current_cooldown = min(self.current_cooldown * 2.0, self.max_cooldown)
            self.open_until = now + self.current_cooldown
            self.opened += 1

    def release(self):
        """The probe will never report (client gone, request rejected): free the probe slot."""
        self._probing = False

    def __repr__(self):
        return f"<Breaker {self.state} failures={self.consecutive_failures}/{self.failures}>"


@cython.final
cdef class EndpointState:
    """The numbers routing reads about one replica (see score_py.EndpointState)."""

    def __init__(self, index=0, breaker=None):
        self.index = int(index)
        self.tag = _default_tag(<uint64_t>self.index)
        self.inflight = 0
        self.waiting = NAN
        self.running = NAN
        self.kv_cache_usage = NAN
        self.scraped_at = NAN
        self.dispatched_since_scrape = 0
        self.completed_since_scrape = 0
        self.drain_rate = NAN
        self.latency = NAN
        self.slots = NAN
        self.max_running = 0.0
        self.seen_full = False
        self.draining = False
        self.down = False
        self.answered_at = NAN
        self.erring_since = NAN
        self.err_rate = 0.0
        if breaker is None:
            self._breaker = Breaker()
        else:
            self.breaker = breaker
        self._t_last = NAN
        self._area = 0.0
        self._done = 0.0
        self._window = 0.0
        self._settled = NAN  # latency as the last completion left it
        self._marked = False
        self._mark_dispatched = 0
        self._mark_completed = 0

    @property
    def breaker(self):
        """The replica's circuit breaker (never ``None``)."""
        return self._breaker

    @breaker.setter
    def breaker(self, value):
        if not isinstance(value, Breaker):
            raise TypeError("breaker must be a Breaker")
        self._breaker = <Breaker>value

    # -- events ---------------------------------------------------------------

    def on_scrape_sent(self):
        """A scrape request was sent (optional): the next :meth:`on_scrape` keeps what happens after this."""
        self._mark_dispatched = self.dispatched_since_scrape
        self._mark_completed = self.completed_since_scrape
        self._marked = True

    def on_scrape(self, double now, waiting, running, kv):
        """A scrape landed: store its numbers (``None``: absent) and reset the since-scrape counters."""
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
        self._advance(now)  # (the averages age between the replica's own events too)
        self._estimate()

    cdef void _estimate(self) noexcept:
        cdef double w0 = self._settled
        if self._done < C_LATENCY_FORGET and self.inflight == 0:
            self.latency = NAN
        elif not isnan(w0):
            self.latency = (self._area + C_LATENCY_PRIOR * w0) / (self._done + C_LATENCY_PRIOR)
        elif self._done > 0.0:
            self.latency = self._area / self._done
        else:
            self.latency = NAN

    cdef void _advance(self, double now) noexcept:
        cdef double last = self._t_last
        cdef double x, decay, part
        if isnan(last):
            self._t_last = now
        elif now > last:
            x = -(now - last) / C_DRAIN_TAU
            decay = exp(x)
            part = -expm1(x)
            self._area = self._area * decay + <double>self.inflight * C_DRAIN_TAU * part
            self._done = self._done * decay
            self._window = self._window * decay + C_DRAIN_TAU * part
            self._t_last = now

    cpdef on_dispatch(self, double now):
        """The router sent a request to this replica."""
        self._advance(now)
        self.inflight += 1
        self.dispatched_since_scrape += 1
        self._estimate()

    cpdef on_complete(self, double now):
        """A request left this replica with a response (counts for drain rate and latency)."""
        self._advance(now)
        if self.inflight > 0:
            self.inflight -= 1
        self.completed_since_scrape += 1
        self.answered_at = now
        self.erring_since = NAN
        self.err_rate -= self.err_rate * C_ERR_WEIGHT
        self._done += 1.0
        self.drain_rate = self._done / (self._window if self._window > C_MIN_WINDOW else C_MIN_WINDOW)
        self._estimate()
        self._settled = self.latency

    cpdef answered_error(self, bint completed):
        """The replica answered with an error: a 1 in ``err_rate`` (see the twin)."""
        if completed:
            self.err_rate += C_ERR_WEIGHT
        else:
            self.err_rate += (1.0 - self.err_rate) * C_ERR_WEIGHT

    cpdef double rate_at(self, double now):
        """``drain_rate`` as of ``now`` (see score_py.EndpointState.rate_at)."""
        cdef double rate = self.drain_rate, last = self._t_last, done = self._done, window = self._window
        cdef double x, decay
        if isnan(rate) or isnan(last) or not window > 0.0:
            return rate
        if now > last:
            x = -(now - last) / C_DRAIN_TAU
            decay = exp(x)
            done = done * decay
            window = window * decay - C_DRAIN_TAU * expm1(x)
        return done / (window if window > C_MIN_WINDOW else C_MIN_WINDOW)

    cpdef bint breaker_settled(self):
        """Whether the breaker is closed with no failure counted (a success would change nothing)."""
        return self._breaker._state == BS_CLOSED and self._breaker.consecutive_failures == 0

    cpdef bint half_open(self):
        """Whether the breaker is half-open: a request just picked for this replica is its probe."""
        return self._breaker._state == BS_HALF_OPEN

    cpdef on_abort(self, double now):
        """A request left this replica without a usable outcome (not a completion)."""
        self._advance(now)
        if self.inflight > 0:
            self.inflight -= 1
        self.completed_since_scrape += 1
        self._estimate()

    # -- reading --------------------------------------------------------------

    cdef inline bint _stale(self, double now, double stale_after) noexcept:
        return isnan(self.scraped_at) or now - self.scraped_at > stale_after

    cdef inline bint _usable(self, double now) noexcept:
        return not self.draining and not self.down and self._breaker._available(now)

    cdef inline double _capacity(self) noexcept:
        if self.slots > 0.0:
            return self.slots
        return self.max_running if self.max_running > 1.0 else 1.0

    cdef inline double _load(self) noexcept:
        cdef double n = (0.0 if isnan(self.waiting) else self.waiting) + (0.0 if isnan(self.running) else self.running)
        n = n + <double>(self.dispatched_since_scrape - self.completed_since_scrape)
        # never less than our own requests in flight there (see score_py.EndpointState.load)
        cdef double own = <double>self.inflight
        return n if n > own else own

    cdef double _queued(self) noexcept:
        cdef double w = self.waiting
        cdef double r = self.running
        cdef double net, q
        if isnan(w):
            return NAN
        net = <double>(self.dispatched_since_scrape - self.completed_since_scrape)
        if w > 0.0 or isnan(r):
            q = w + net
        else:
            q = r + net - self._capacity()
        return q if q > 0.0 else 0.0

    cdef double _saturation(self, double now, double stale_after, double max_waiting, double max_kv) noexcept:
        cdef double sat = 0.0, q, kv
        cdef bint reported = False
        if self._stale(now, stale_after):
            return 1.0
        q = self._queued()
        if not isnan(q):
            sat = q / max_waiting
            reported = True
        kv = self.kv_cache_usage
        if not isnan(kv):
            kv = kv / max_kv
            if kv > sat:
                sat = kv
            reported = True
        if not reported:
            q = <double>self.inflight - self._capacity()
            sat = q / max_waiting if q > 0.0 else 0.0
        return sat

    def stale(self, double now, double stale_after):
        """Whether the engine numbers are missing or older than ``stale_after`` seconds."""
        return self._stale(now, stale_after)

    def usable(self, double now):
        """Whether new requests may go here: not draining, not down, breaker available."""
        return self._usable(now)

    def capacity(self):
        """Requests the replica runs at once: ``slots``, else the most seen running (at least 1)."""
        return self._capacity()

    def load(self):
        """Corrected requests on the replica: ``max(0, W + R + dispatched - completed)``."""
        return self._load()

    def queued(self):
        """Corrected queue (NaN if the engine reports no queue gauge)."""
        return self._queued()

    def saturation(self, double now, double stale_after, double max_waiting, double max_kv):
        """How full the replica is against the limits; 1.0 is the healthy limit, stale is 1.0."""
        if not (max_waiting > 0.0 and max_kv > 0.0):
            raise ValueError("max_waiting and max_kv must be positive")
        return self._saturation(now, stale_after, max_waiting, max_kv)

    def __repr__(self):
        return (
            f"<EndpointState {self.index} inflight={self.inflight} waiting={self.waiting} "
            f"running={self.running} kv={self.kv_cache_usage}>"
        )


cdef inline EndpointState _state_at(list states, Py_ssize_t i):
    # Checked cast: a wrong element type raises TypeError instead of crashing.
    return <EndpointState?>PyList_GET_ITEM(states, i)


@cython.final
cdef class Picker:
    """Chooses a replica for each request (see score_py.Picker)."""

    def __cinit__(self):
        self._size = 0
        self._idx = NULL
        self._buf = NULL
        self._index.slots = NULL
        self._sessions.slots = NULL

    def __init__(self, strategy="score", seed=None, index_entries=INDEX_ENTRIES,
                 session_entries=SESSION_ENTRIES, load_bound=LOAD_BOUND, entry_ttl=ENTRY_TTL):
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown routing strategy {strategy!r}; expected one of {', '.join(STRATEGIES)}")
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
            seed = int.from_bytes(os_urandom(8), "little")
        self._rng = <uint64_t>(int(seed) & _M64)
        self._rr = 0
        self._settings = (index_entries, session_entries, load_bound, entry_ttl)
        self._bound = load_bound
        self._counts[0] = self._counts[1] = self._counts[2] = self._counts[3] = 0
        self._mean_blocks = 0.0
        self._reuse = 1.0
        self._reuse_seen = False
        self.shared = False
        _table_free(&self._index)
        _table_free(&self._sessions)
        if self._strategy == S_PREFIX:
            _table_init(&self._index, index_entries, entry_ttl)
            _table_init(&self._sessions, session_entries, entry_ttl)

    def __dealloc__(self):
        PyMem_Free(self._idx)
        PyMem_Free(self._buf)
        _table_free(&self._index)
        _table_free(&self._sessions)

    @property
    def strategy(self):
        return STRATEGIES[self._strategy]

    @property
    def settings(self):
        """``(index_entries, session_entries, load_bound, entry_ttl)`` as given."""
        return self._settings

    def decisions(self):
        """How many picks the ``prefix`` strategy made for each of REASONS."""
        return (self._counts[0], self._counts[1], self._counts[2], self._counts[3])

    def index_size(self, double now):
        """``(prefix entries, session entries)`` live now (0, 0 for other strategies)."""
        return (_table_live(&self._index, now), _table_live(&self._sessions, now))

    @property
    def reuse(self):
        """``prefix``: the share of keyed requests (an EWMA) that continued something this router
        knew; under ``REUSE_MIN`` the blind rule places first turns as ``score`` does (see the twin).
        NaN until the first keyed request."""
        return self._reuse if self._reuse_seen else NAN

    def index_capacity(self):
        """``(prefix slots, session slots)`` allocated (24 bytes each)."""
        return (self._index.n, self._sessions.n)

    cdef inline uint64_t _next(self) noexcept:
        # SplitMix64, as in the twin.
        cdef uint64_t z
        self._rng += 0x9E3779B97F4A7C15ULL
        z = self._rng
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL
        return z ^ (z >> 31)

    def random(self):
        """The next 64-bit value of the tie-break generator (tests, simulations)."""
        return self._next()

    cdef int _reserve(self, Py_ssize_t n) except -1:
        cdef Py_ssize_t cap
        if n <= self._size:
            return 0
        cap = n if n > 64 else 64
        PyMem_Free(self._idx)
        PyMem_Free(self._buf)
        self._size = 0
        self._idx = <Py_ssize_t*>PyMem_Malloc(cap * sizeof(Py_ssize_t))
        self._buf = <double*>PyMem_Malloc(5 * cap * sizeof(double))
        if self._idx == NULL or self._buf == NULL:
            raise MemoryError()
        self._size = cap
        return 0

    cpdef Py_ssize_t pick(self, list states, double now, double stale_after) except -2:
        """The index in ``states`` of the replica to send the next request to, or -1."""
        cdef Py_ssize_t i
        if states is None:
            raise TypeError("states must be a list, not None")
        if self._strategy == S_SCORE:
            i = self._score(states, now, stale_after)
        elif self._strategy == S_LEAST_INFLIGHT:
            i = self._least_inflight(states, now)
        elif self._strategy == S_ROUND_ROBIN:
            i = self._round_robin(states, now)
        else:
            i = self._prefix(states, now, stale_after, NULL, 0, 0)
        if i >= 0:
            (<EndpointState>PyList_GET_ITEM(states, i))._breaker._allow(now)
        return i

    cpdef Py_ssize_t pick_prefix(self, list states, double now, double stale_after, bytes chain,
                                 uint64_t session) except -2:
        """pick() with the request's routing key (see the twin)."""
        cdef Py_ssize_t i
        if states is None or chain is None:
            raise TypeError("states must be a list and chain bytes, not None")
        if self._strategy == S_PREFIX:
            i = self._prefix(states, now, stale_after, <const unsigned char*>PyBytes_AS_STRING(chain),
                             PyBytes_GET_SIZE(chain) >> 3, session)  # (words: anchor, its blocks, links)
        elif self._strategy == S_SCORE:
            i = self._score(states, now, stale_after)
        elif self._strategy == S_LEAST_INFLIGHT:
            i = self._least_inflight(states, now)
        else:
            i = self._round_robin(states, now)
        if i >= 0:
            (<EndpointState>PyList_GET_ITEM(states, i))._breaker._allow(now)
        return i

    cpdef learn(self, bytes chain, uint64_t session, uint64_t tag, double now):
        """Record another router's pick for this key (see the twin)."""
        cdef Py_ssize_t k, words
        cdef uint64_t h, anchor
        cdef const unsigned char* p
        if chain is None:
            raise TypeError("chain must be bytes, not None")
        if self._strategy != S_PREFIX or not tag:
            return
        if session:
            _table_put(&self._sessions, session, tag, now)
        words = PyBytes_GET_SIZE(chain) >> 3
        if words < 3:
            return
        p = <const unsigned char*>PyBytes_AS_STRING(chain)
        for k in range(2, words):
            memcpy(&h, p + 8 * k, 8)
            if h:  # (0 marks an empty slot: no key from the wire may be it)
                _table_put(&self._index, h, tag, now)
        memcpy(&anchor, p, 8)
        if anchor:
            _table_put(&self._index, _anchor_key(anchor), tag, now)

    cdef Py_ssize_t _prefix(self, list states, double now, double stale_after, const unsigned char* chain,
                            Py_ssize_t nblocks, uint64_t session) except -2:
        cdef Py_ssize_t b, i, k, n = PyList_GET_SIZE(states), pick = -1, slot, nhits = 0, matched = 0
        cdef double prior = 1.0, c, limit, blind_limit, tb, tmax, mb, per_block
        cdef int reason = R_BLIND
        cdef uint64_t h, t, key, w, best_w, tag, anchor = 0, last = 0
        cdef Py_ssize_t home
        cdef long long shallow = -1, anchor_blocks = 0
        cdef bint new_session = False, b_free, known
        cdef uint64_t hits[4]
        cdef Py_ssize_t depths[4]
        cdef EndpointState st
        # (nblocks counts words: the anchor and its whole blocks, then the links)
        if nblocks >= 3:
            memcpy(&anchor, chain, 8)
            memcpy(&h, chain + 8, 8)
            anchor_blocks = <long long>(h & ~(1ULL << 63))
            if anchor and h >> 63:  # a later turn (see the twin)
                shallow = anchor_blocks
            chain += 16
            nblocks -= 2
        else:
            nblocks = 0
        b = self._score(states, now, stale_after)
        if b < 0:
            return -1
        for i in range(n):
            c = _state_at(states, i)._capacity()
            if c > prior:
                prior = c
        limit = _util(_state_at(states, b), prior) + self._bound
        tb = _state_at(states, b).latency
        tmax = C_SLOWER * tb if tb > 0.0 else INFINITY
        b_free = _has_slot(_state_at(states, b), prior)
        if nblocks:
            mb = self._mean_blocks
            self._mean_blocks = mb + (nblocks - mb) * C_MEAN_BLOCKS_WEIGHT if mb > 0.0 else <double>nblocks
        per_block = C_PREFILL_WEIGHT / self._mean_blocks if self._mean_blocks > 0.0 else 0.0
        if session:
            slot = _table_find(&self._sessions, session, now)
            new_session = slot < 0  # (its hash places it, as in every router)
            if slot >= 0:
                i = _find_tag(states, self._sessions.slots[slot].tag, now)
                if i >= 0:
                    if i == b or _worth(_state_at(states, i), prior, limit, tmax, b_free, nblocks * per_block):
                        pick = i
                        reason = R_SESSION
                    else:
                        pick = b
                        reason = R_LOAD
        if pick < 0 and nblocks and not new_session:
            for k in range(nblocks):
                memcpy(&h, chain + 8 * k, 8)
                slot = _table_find(&self._index, h, now)
                if slot < 0:
                    break
                matched += 1
                last = h
                t = self._index.slots[slot].tag
                if nhits and hits[nhits - 1] == t:
                    depths[nhits - 1] = matched
                else:
                    if nhits == 4:
                        hits[0] = hits[1]
                        hits[1] = hits[2]
                        hits[2] = hits[3]
                        depths[0] = depths[1]
                        depths[1] = depths[2]
                        depths[2] = depths[3]
                        nhits = 3
                    hits[nhits] = t
                    depths[nhits] = matched
                    nhits += 1
            if matched <= shallow or (
                shallow < 0 and anchor and matched <= anchor_blocks and matched <= C_SHORT_SHARED
            ):
                nhits = 0  # (only a shared start is known: the conversation's anchor decides)
            if shallow >= 0 and (nhits == 0 or depths[nhits - 1] < nblocks - C_KNOWN_TURN) and _shared(states) and not (
                self.shared and _table_find(&self._index, _anchor_key(anchor), now) >= 0
            ):
                # other routers share the pool, this one did not see the previous turn (nor
                # learn where it went): the conversation's home first (see the twin)
                home = -1
                best_w = 0
                for i in range(n):
                    st = _state_at(states, i)
                    if st._usable(now) and not st.latency > tmax:
                        w = _mix(anchor ^ st.tag)
                        if home < 0 or w > best_w:
                            best_w = w
                            home = i
                if home >= 0 and (home == b or _worth(_state_at(states, home), prior, limit, tmax, b_free,
                                                      C_HOME_SHARE * nblocks * per_block)):
                    pick = home
                    reason = R_PREFIX
            if pick < 0:
                for k in range(nhits - 1, -1, -1):
                    i = _find_tag(states, hits[k], now)
                    if i >= 0 and (i == b or _worth(_state_at(states, i), prior, limit, tmax, b_free,
                                                    depths[k] * per_block)):
                        pick = i
                        reason = R_PREFIX
                        break
            if pick < 0 and nhits == 0 and shallow >= 0:
                # where this router last sent the conversation (see the twin)
                slot = _table_find(&self._index, _anchor_key(anchor), now)
                if slot >= 0:
                    i = _find_tag(states, self._index.slots[slot].tag, now)
                    if i >= 0 and (i == b or _worth(_state_at(states, i), prior, limit, tmax, b_free,
                                                    nblocks * per_block)):
                        pick = i
                        reason = R_PREFIX
            if pick < 0 and nhits:
                # spill along the deepest matched block's rendezvous order (see the twin)
                reason = R_LOAD
                best_w = 0
                for i in range(n):
                    st = _state_at(states, i)
                    if st._usable(now) and _allowed(st, prior, limit, tmax) and (
                        not b_free or _has_slot(st, prior)
                    ):
                        w = _mix(last ^ st.tag)
                        if pick < 0 or w > best_w:
                            best_w = w
                            pick = i
                if pick < 0:
                    pick = b
        if nblocks or session:  # (the reuse gate: see the twin)
            known = matched > 0 or reason != R_BLIND or shallow >= 0 or (session and not new_session)
            self._reuse += ((1.0 if known else 0.0) - self._reuse) * C_REUSE_WEIGHT
            self._reuse_seen = True
        if pick < 0:
            blind_limit = limit - self._bound * (1.0 - C_BLIND_SHARE)
            key = session
            if not key:
                key = anchor
            if not key and nblocks:
                memcpy(&key, chain, 8)
            if not (session or shallow >= 0 or self._reuse >= C_REUSE_MIN):
                key = 0  # (nothing is used again here: a first turn is placed as score places it)
            if key:
                best_w = 0
                for i in range(n):
                    st = _state_at(states, i)
                    if st._usable(now) and _allowed(st, prior, blind_limit, tmax):
                        w = _mix(key ^ st.tag)
                        if pick < 0 or w > best_w:
                            best_w = w
                            pick = i
            if pick < 0:
                pick = b
        tag = _state_at(states, pick).tag
        if session:
            _table_put(&self._sessions, session, tag, now)
        for k in range(nblocks):
            memcpy(&h, chain + 8 * k, 8)
            _table_put(&self._index, h, tag, now)
        if anchor:
            _table_put(&self._index, _anchor_key(anchor), tag, now)
        self._counts[reason] += 1
        return pick

    cdef Py_ssize_t _least_inflight(self, list states, double now) except -2:
        cdef Py_ssize_t i, n = PyList_GET_SIZE(states)
        cdef Py_ssize_t best = -1, best_load = 0, ties = 0, load
        cdef EndpointState st
        for i in range(n):
            st = _state_at(states, i)
            if not st._usable(now):
                continue
            load = st.inflight
            if best < 0 or load < best_load:
                best = i
                best_load = load
                ties = 1
            elif load == best_load:
                ties += 1
                if self._next() % <uint64_t>ties == 0:
                    best = i
        return best

    cdef Py_ssize_t _round_robin(self, list states, double now) except -2:
        cdef Py_ssize_t n = PyList_GET_SIZE(states)
        cdef Py_ssize_t start, k, i
        if n == 0:
            return -1
        start = self._rr % n
        for k in range(n):
            i = start + k
            if i >= n:
                i -= n
            if _state_at(states, i)._usable(now):
                self._rr = i + 1
                return i
        return -1

    cdef Py_ssize_t _score(self, list states, double now, double stale_after) except -2:
        # pass 1: the usable fresh replicas' numbers, the pool's largest capacity and
        # the mean of the known latencies; pass 2: costs; pass 3: draw among near-ties
        cdef Py_ssize_t i, k, m, n = PyList_GET_SIZE(states)
        cdef Py_ssize_t cnt = 0, known = 0, gauged = 0
        cdef double known_sum = 0.0, prior = 1.0, fastest = INFINITY, top
        cdef double fill, w, r, kv, kvf, t, c, full, slots_now, ahead, wait, x, best, limit
        cdef double *load
        cdef double *capa
        cdef double *fulls
        cdef double *kvfs
        cdef double *lat
        cdef uint64_t pick
        cdef EndpointState st
        self._reserve(n)
        load = self._buf
        capa = load + self._size
        fulls = capa + self._size
        kvfs = fulls + self._size
        lat = kvfs + self._size
        for i in range(n):
            st = _state_at(states, i)
            if not st._usable(now) or st._stale(now, stale_after):
                continue
            w = st.waiting
            r = st.running
            if not (isnan(w) and isnan(r)):  # (blind: a candidate on its own requests, see the twin)
                gauged += 1
            kv = st.kv_cache_usage
            kvf = 1.0 + C_KV_WEIGHT * (kv - C_KV_KNEE) / (1.0 - C_KV_KNEE) if kv > C_KV_KNEE else 1.0
            c = st._capacity()
            if c > prior:
                prior = c
            if not (st.slots > 0.0 or st.seen_full):
                c = -c  # a lower bound only: pass 2 uses the pool's largest
            full = r if w > 0.0 and r > 0.0 else 0.0
            t = st.latency
            if t > 0.0:
                known_sum += t
                known += 1
                if t < fastest:
                    fastest = t
            else:
                t = NAN
            self._idx[cnt] = i
            load[cnt] = st._load()
            capa[cnt] = c
            fulls[cnt] = full
            kvfs[cnt] = kvf
            lat[cnt] = t
            cnt += 1
        if gauged == 0:
            return self._least_inflight(states, now)
        fill = known_sum / <double>known if known else 1.0
        top = C_MAX_SLOWER * fastest
        best = INFINITY
        for k in range(cnt):
            c = capa[k]
            if c < 0.0:
                c = prior
            full = fulls[k]
            slots_now = full if full > 0.0 else c
            ahead = load[k] + 1.0 - slots_now
            wait = ahead / slots_now if ahead > 0.0 else 0.0
            t = lat[k]
            if isnan(t):
                t = fill
            if t > top:
                t = top
            x = (wait + C_PREFILL_SHARE * (1.0 + load[k] / c)) * kvfs[k] * t
            load[k] = x  # the cost, from here on
            if x < best:
                best = x
        limit = best * (1.0 + C_NEAR_TIE)
        m = 0
        for k in range(cnt):
            if load[k] <= limit:
                m += 1
        if m == 1:
            for k in range(cnt):
                if load[k] <= limit:
                    return self._idx[k]
        pick = self._next() % <uint64_t>m
        for k in range(cnt):
            if load[k] <= limit:
                if pick == 0:
                    return self._idx[k]
                pick -= 1
        return -1  # unreachable

    def __repr__(self):
        return f"<Picker {self.strategy}>"


cdef inline double _util(EndpointState st, double prior) noexcept:
    cdef double c = st._capacity()
    if not (st.slots > 0.0 or st.seen_full) and prior > c:
        c = prior
    return st._load() / c


cdef inline bint _allowed(EndpointState st, double prior, double limit, double tmax) noexcept:
    cdef double c = st._capacity()
    cdef double load
    if st.latency > tmax:
        return False
    if not (st.slots > 0.0 or st.seen_full) and prior > c:
        c = prior
    load = st._load()
    return load + 1.0 <= c or load / c <= limit


cdef inline bint _has_slot(EndpointState st, double prior) noexcept:
    cdef double c = st._capacity()
    if not (st.slots > 0.0 or st.seen_full) and prior > c:
        c = prior
    return st._load() + 1.0 <= c


cdef bint _worth(EndpointState st, double prior, double limit, double tmax, bint b_free, double saved) noexcept:
    # (see the twin)
    cdef double c, load, w, r, slots_now
    if not _allowed(st, prior, limit, tmax):
        return False
    c = st._capacity()
    if not (st.slots > 0.0 or st.seen_full) and prior > c:
        c = prior
    load = st._load()
    if not b_free or load + 1.0 <= c:
        return True
    w = st.waiting
    r = st.running
    slots_now = r if w > 0.0 and r > 0.0 else c
    return (load + 1.0 - slots_now) / slots_now < saved


cdef bint _shared(list states) noexcept:
    # other routers send to the pool: this router's requests in flight are less than
    # SHARED_FLEET of the pool's load as it sees it (see the twin)
    cdef Py_ssize_t i, own = 0
    cdef double seen = 0.0
    cdef EndpointState st
    for i in range(PyList_GET_SIZE(states)):
        st = _state_at(states, i)
        own += st.inflight
        seen += st._load()
    return own < C_SHARED_FLEET * seen


cdef Py_ssize_t _find_tag(list states, uint64_t tag, double now) noexcept:
    cdef Py_ssize_t i, n = PyList_GET_SIZE(states)
    cdef EndpointState st
    for i in range(n):
        st = <EndpointState>PyList_GET_ITEM(states, i)
        if st.tag == tag:
            return i if st._usable(now) else -1
    return -1


# -- the prefix strategy's tables (see score_py._Table) ----------------------------

cdef int _table_init(Table* t, Py_ssize_t size, double ttl) except -1:
    cdef Py_ssize_t nb = 1, i
    while nb * 4 < size:
        nb *= 2
    t.slots = <Slot*>PyMem_Malloc(nb * 4 * sizeof(Slot))
    if t.slots == NULL:
        raise MemoryError()
    t.n = nb * 4
    t.mask = <uint64_t>(nb - 1)
    t.ttl = ttl
    for i in range(t.n):
        t.slots[i].key = 0
        t.slots[i].tag = 0
        t.slots[i].used = 0.0
    return 0


cdef void _table_free(Table* t) noexcept:
    PyMem_Free(t.slots)
    t.slots = NULL
    t.n = 0


cdef inline Py_ssize_t _table_find(Table* t, uint64_t key, double now) noexcept:
    cdef Py_ssize_t base = <Py_ssize_t>(key & t.mask) * 4, s
    for s in range(base, base + 4):
        if t.slots[s].key == key:
            return s if now - t.slots[s].used <= t.ttl else -1
    return -1


cdef inline void _table_put(Table* t, uint64_t key, uint64_t tag, double now) noexcept:
    cdef Py_ssize_t base = <Py_ssize_t>(key & t.mask) * 4, s, victim = base
    for s in range(base, base + 4):
        if t.slots[s].key == key or t.slots[s].key == 0:
            victim = s
            break
        if t.slots[s].used < t.slots[victim].used:
            victim = s
    t.slots[victim].key = key
    t.slots[victim].tag = tag
    t.slots[victim].used = now


cdef Py_ssize_t _table_live(Table* t, double now) noexcept:
    cdef Py_ssize_t i, live = 0
    for i in range(t.n):
        if t.slots[i].key and now - t.slots[i].used <= t.ttl:
            live += 1
    return live


cpdef double pool_saturation(list states, double now, double stale_after, double max_waiting,
                             double max_kv) except? -1.0:
    """Mean saturation of the usable replicas (stale ones count 1.0); ``inf`` if none is usable."""
    cdef Py_ssize_t i, n = 0
    cdef double total = 0.0
    cdef EndpointState st
    if states is None:
        raise TypeError("states must be a list, not None")
    if not (max_waiting > 0.0 and max_kv > 0.0):
        raise ValueError("max_waiting and max_kv must be positive")
    for i in range(PyList_GET_SIZE(states)):
        st = _state_at(states, i)
        if st._usable(now):
            total += st._saturation(now, stale_after, max_waiting, max_kv)
            n += 1
    return total / <double>n if n else INFINITY


def retry_after(list states not None, queued, double now):
    """Seconds a rejected client should wait: ``(queued + 1)`` completions at the pool's drain rate."""
    cdef Py_ssize_t i
    cdef double rate = 0.0, r, t, full
    cdef EndpointState st
    for i in range(PyList_GET_SIZE(states)):
        st = _state_at(states, i)
        if not st._usable(now):
            continue
        r = st.rate_at(now)
        if st.latency > 0.0:  # (what a full replica finishes: see the twin)
            full = st._capacity() / st.latency
            if full > r:
                r = full
        if r > 0.0:
            rate += r
    if not rate > 0.0:
        return C_RETRY_AFTER_DEFAULT
    t = (<double>queued + 1.0) / rate
    if t < C_RETRY_AFTER_MIN:
        return C_RETRY_AFTER_MIN
    if t > C_RETRY_AFTER_MAX:
        return C_RETRY_AFTER_MAX
    return t


@cython.final
cdef class RetryBudget:
    """Bounds retries in flight to a fraction of active requests (see score_py.RetryBudget)."""

    def __init__(self, ratio=0.2, min_inflight=3):
        cdef double r = float(ratio)
        cdef Py_ssize_t m = int(min_inflight)
        if not r >= 0.0 or m < 0:
            raise ValueError("ratio and min_inflight must be >= 0")
        self.ratio = r
        self.min_inflight = m
        self.retrying = 0
        self.retries = 0
        self.refused = 0

    def can_retry(self, Py_ssize_t active):
        """Whether one more retry may be sent while ``active`` requests are in flight."""
        cdef double limit = self.ratio * <double>active
        if limit < <double>self.min_inflight:
            limit = <double>self.min_inflight
        if <double>self.retrying < limit:
            return True
        self.refused += 1
        return False

    def record_retry(self):
        """A retry was sent."""
        self.retrying += 1
        self.retries += 1

    def done_retry(self):
        """A retry ended (however)."""
        if self.retrying > 0:
            self.retrying -= 1
