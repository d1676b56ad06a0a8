# Declarations that compile replica_py.py into the extension llmgw._fast.replica
# (Cython "augmenting .pxd"): the contract of replicas and model pools.
#
# Written by: the registry (made from config; the picker swapped on reload), the
# poller (scrape_* and, through state, the engine's numbers), the proxy (state's
# router-side numbers, completed, failures). Read per request by the proxy: the
# header lines, pool, state, target().

cimport cython

from llmgw._fast.httpproto cimport monotonic
from llmgw._fast.jsonscan cimport Needle, key_hash
from libc.stdint cimport uint64_t
from llmgw._fast.score cimport Breaker, EndpointState, Picker, pool_saturation
from llmgw._fast.upstream cimport UpstreamPool


@cython.final
cdef class Endpoint:
    cdef readonly object cfg              # its EndpointConfig
    cdef readonly object id               # str
    cdef readonly object models           # tuple of the models it serves
    cdef readonly object engine           # EngineInfo (llmgw.engines)
    cdef readonly bytes host_header       # b"host:port", the Host value sent upstream
    cdef readonly bytes base_path         # prefix of every upstream target (b"": none)
    cdef readonly bytes auth_line         # b"authorization: Bearer <its key>\r\n" or b""
    cdef readonly bytes replica_line      # b"x-llmgw-replica: <id>\r\n", sent to clients
    cdef readonly UpstreamPool pool
    cdef readonly EndpointState state
    cdef readonly double stale_after      # seconds a scrape stays fresh
    cdef readonly double scrape_interval  # seconds between scrapes (the next look at a down replica)
    cdef readonly object metrics_path
    cdef public Py_ssize_t completed      # answered requests (the proxy counts)
    cdef public Py_ssize_t failures       # failed attempts (the proxy counts)
    cdef public Py_ssize_t scrape_ok      # the poller counts these four
    cdef public Py_ssize_t scrape_failures
    cdef public object scrape_problem     # why its metrics can't be read, or None
    cdef public double scrape_seconds
    cdef public Py_ssize_t scrape_failing # scrape attempts failed in a row (scrape_failed / scrape_answered)
    cdef public double failing_since      # monotonic time the first of them failed; NaN: none
    cdef public bint unreachable          # the last attempt could not reach the engine
    cdef public long long half_opened_seen  # breaker.half_opened already reported (the proxy)
    # The replica refused llmgw's key for it (401/403): out of routing until a probe
    # is answered otherwise. Meanwhile state.breaker is a gate (a breaker of one
    # failure and a fixed cooldown: its half-open probe is the key's probe) and
    # `breaker` keeps the replica's own, untouched. hold_auth() -> clear_auth().
    cdef readonly bint auth_failed
    cdef readonly Breaker breaker         # the replica's own circuit breaker (views read this one)
    cdef readonly bytes api_key           # its key (redaction; None: none), never shown
    cdef readonly Needle key_needle       # ... looked for in what it sends (None: no key)
    cdef double _auth_cooldown            # seconds between the gate's probes (breaker.cooldown)

    cpdef bytes target(self, bytes path)
    cpdef bint hold_auth(self, double now)
    cpdef bint clear_auth(self)
    cpdef adopt_auth(self, Endpoint old)
    cpdef close(self)
    cpdef scrape_answered(self)
    @cython.locals(at=double)
    cpdef scrape_failed(self, double now, bint unreachable)
    cpdef unusable_reason(self, double now)
    @cython.locals(wait=double, left=double)
    cpdef double usable_in(self, double now)


@cython.final
cdef class ModelPool:
    cdef readonly list endpoints
    cdef readonly object name
    cdef public Picker picker             # swapped by the registry when the strategy changes
    cdef public bint keyed                # the picker is `prefix`: the gateway calls pick_keyed
    cdef readonly object queue            # its AdmissionQueue
    cdef readonly list states             # [ep.state for ep in endpoints], for the picker
    cdef public list outbox               # shared routes' (chain, session, tag) (None: not shared)

    cpdef add(self, Endpoint ep)
    cpdef remove(self, Endpoint ep)
    cpdef Endpoint pick(self, double now, double stale_after, exclude=*)
    @cython.locals(ep=Endpoint, i=Py_ssize_t, outbox=list)
    cpdef Endpoint pick_keyed(self, double now, double stale_after, exclude, bytes chain, uint64_t session)
    cpdef double saturation(self, double now, double stale_after, double max_waiting, double max_kv)
    @cython.locals(ep=Endpoint, wait=double, w=double)
    cpdef unavailable(self, double now)
