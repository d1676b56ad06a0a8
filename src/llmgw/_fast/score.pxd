# The contract of score.pyx; the spec is its pure twin, score_py.py.
#
# Call order. Poller, per scrape: EndpointState.on_scrape_sent() (optional) when the
# request goes out, on_scrape() when the page has been read. Data path, per request:
# Picker.pick() (which calls Breaker.allow() on the chosen replica only), then
# EndpointState.on_dispatch(); when the request ends on_complete() or on_abort(), and
# Breaker.record_success()/record_failure() for outcomes that count. Admission reads
# pool_saturation() and retry_after(). Nothing here takes the clock itself: every
# method gets `now` (monotonic seconds) from the caller.

from libc.stdint cimport uint64_t

cdef enum:
    # Breaker states; the same numbers as BREAKER_* (score.pyx, score_py.py).
    BS_CLOSED = 0
    BS_OPEN = 1
    BS_HALF_OPEN = 2

cdef enum:
    # Strategies: indexes into STRATEGIES.
    S_SCORE = 0
    S_LEAST_INFLIGHT = 1
    S_ROUND_ROBIN = 2
    S_PREFIX = 3

cdef enum:
    # The prefix strategy's decisions: indexes into REASONS and Picker._counts.
    R_PREFIX = 0
    R_SESSION = 1
    R_LOAD = 2
    R_BLIND = 3

# The prefix strategy's tables: chain hash (or session hash) -> the replica's tag and
# when it was last used there; 4-way set-associative, LRU within a bucket, aged out
# after ttl seconds. 24 bytes a slot.
cdef struct Slot:
    uint64_t key                          # 0: empty
    uint64_t tag                          # EndpointState.tag of the replica
    double used                           # monotonic s

cdef struct Table:
    Slot* slots
    Py_ssize_t n                          # slots (buckets x 4)
    uint64_t mask                         # buckets - 1
    double ttl


cdef class Breaker:
    cdef public int failures              # consecutive failures that open it
    cdef public double cooldown           # first cooldown (s)
    cdef public double max_cooldown       # cap on the doubled cooldown (s)
    cdef public int consecutive_failures
    cdef public double open_until         # monotonic s; 0.0 before the first opening
    cdef public double current_cooldown   # cooldown of the current/next opening
    cdef public long long opened          # transitions to open (metrics)
    cdef public long long half_opened     # transitions open -> half-open (metrics; in allow())
    cdef public long long closed          # transitions half-open -> closed (metrics)
    cdef public long long probes          # probes let through (metrics)
    cdef int _state                       # BS_*
    cdef bint _probing                    # half-open: the probe is out
    cdef double _probe_expires            # ... and is given up on at this time

    cdef bint _available(self, double now) noexcept
    cdef bint _allow(self, double now) noexcept


cdef class EndpointState:
    cdef public Py_ssize_t index
    cdef public Py_ssize_t inflight       # this router's requests in flight
    cdef public double waiting            # scraped; NaN: absent
    cdef public double running            # scraped; NaN: absent
    cdef public double kv_cache_usage     # scraped, 0..1; NaN: absent
    cdef public double scraped_at         # NaN: never; inf: never scraped, always fresh
    cdef public Py_ssize_t dispatched_since_scrape
    cdef public Py_ssize_t completed_since_scrape
    cdef public double drain_rate         # own completions/s (EWMA); NaN: unknown
    cdef public double latency            # mean s on the replica (Little's law); NaN: unknown
    cdef public double slots              # requests run at once; NaN: unknown
    cdef public double max_running        # most `running` a scrape showed
    cdef public bint seen_full            # a scrape showed a queue: max_running is the capacity
    cdef public bint draining
    cdef public uint64_t tag              # the replica's identity for the prefix strategy (a hash
                                          #   of its id, the same in every router; never 0)
    cdef public bint down                 # the poller found it down (unreachable, or scrapes failing
                                          #   past stale_after): not usable until a scrape reaches it
    cdef public double answered_at        # its last answer (2xx/4xx) to this router (monotonic; NaN: none)
    cdef public double erring_since       # its first 5xx answer since then (NaN: none)
    cdef public double err_rate           # share of its answers that were errors (>= 400), over ~8
    cdef Breaker _breaker                 # never None (the property setter checks)
    cdef double _t_last                   # last event (NaN: none yet)
    cdef double _area                     # EWMA sums, time constant DRAIN_TAU:
    cdef double _done                     #   in-flight x time, completions,
    cdef double _window                   #   observed time
    cdef double _settled                  # latency as the last completion left it (NaN: none yet)
    cdef bint _marked                     # on_scrape_sent() was called since the last scrape
    cdef Py_ssize_t _mark_dispatched      # ... and the since-scrape counters then
    cdef Py_ssize_t _mark_completed

    cdef void _advance(self, double now) noexcept
    cdef void _estimate(self) noexcept
    cdef bint _usable(self, double now) noexcept
    cdef bint _stale(self, double now, double stale_after) noexcept
    cdef double _capacity(self) noexcept
    cdef double _load(self) noexcept
    cdef double _queued(self) noexcept
    cdef double _saturation(self, double now, double stale_after, double max_waiting, double max_kv) noexcept

    # (called from C by the data path)
    cpdef on_dispatch(self, double now)
    cpdef on_complete(self, double now)
    cpdef on_abort(self, double now)
    cpdef bint half_open(self)
    cpdef bint breaker_settled(self)
    cpdef double rate_at(self, double now)
    cpdef answered_error(self, bint completed)


cdef class Picker:
    cdef int _strategy                    # S_*
    cdef uint64_t _rng                    # SplitMix64 state
    cdef Py_ssize_t _rr                   # round robin: next index to try
    cdef Py_ssize_t _size                 # candidates the scratch arrays below hold
    cdef Py_ssize_t* _idx                 # score: candidate indexes
    cdef double* _buf                     # score: 5 x _size doubles: load (then cost),
                                          #   capacity (< 0: lower bound), running when
                                          #   full (0: not full), KV factor, latency
    cdef object _settings                 # (index_entries, session_entries, load_bound, entry_ttl)
    cdef double _bound                    # prefix: load_bound
    cdef Table _index                     # prefix: chain hash -> replica (slots NULL otherwise)
    cdef Table _sessions                  # prefix: session hash -> replica
    cdef long long _counts[4]             # prefix: picks per R_* (metrics, read at scrape time)
    cdef double _mean_blocks              # prefix: EWMA of the chain's blocks per request (0: none yet)
    cdef double _reuse                    # prefix: EWMA of keyed requests continuing something known
    cdef bint _reuse_seen                 # prefix: a keyed request came (reuse measured, not presumed)
    cdef public bint shared               # prefix: other routers' routes reach learn() (see the twin)

    cdef uint64_t _next(self) noexcept
    cdef int _reserve(self, Py_ssize_t n) except -1
    cdef Py_ssize_t _least_inflight(self, list states, double now) except -2
    cdef Py_ssize_t _round_robin(self, list states, double now) except -2
    cdef Py_ssize_t _score(self, list states, double now, double stale_after) except -2

    cdef Py_ssize_t _prefix(self, list states, double now, double stale_after, const unsigned char* chain,
                            Py_ssize_t nblocks, uint64_t session) except -2

    cpdef learn(self, bytes chain, uint64_t session, uint64_t tag, double now)
    cpdef Py_ssize_t pick(self, list states, double now, double stale_after) except -2
    cpdef Py_ssize_t pick_prefix(self, list states, double now, double stale_after, bytes chain,
                                 uint64_t session) except -2


cdef class RetryBudget:
    cdef public double ratio              # retries in flight per active request
    cdef public Py_ssize_t min_inflight   # retries always allowed in flight
    cdef public Py_ssize_t retrying       # retries in flight now
    cdef public long long retries         # granted (metrics)
    cdef public long long refused         # refused (metrics)


cpdef double pool_saturation(list states, double now, double stale_after, double max_waiting,
                             double max_kv) except? -1.0
