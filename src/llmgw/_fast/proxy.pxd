# Declarations that compile proxy_py.py into the extension llmgw._fast.proxy
# (Cython "augmenting .pxd"): the client port's app and the proxied call.
#
# Call order, per request: the server calls Gateway.handle -> _proxy -> _prepare
# (the body's model, the band) -> Call.admit -> dispatch (or queued: the
# gateway's admit_next dispatches later; shed answers 429) -> _send on a pooled
# connection, or _connect first -> the connection calls on_response_head,
# on_response_body / on_response_chunk + on_read_end, on_response_end (or
# on_upstream_lost) -> _completed or _attempt_failed (retry: dispatch again) ->
# _finish -> _done (counted, logged, the next queued call admitted). The
# gateway's sweep calls expired() when a call's deadline passes; the writer calls
# client_gone() if the client leaves first. A pool that is down (ModelPool.unavailable)
# is answered by _refuse (admit) or _refuse_queued (_admit), never queued. Shutdown:
# Gateway.shutdown() answers the queue (_refuse_queued); at the deadline the server
# calls Gateway.cut(writer) -> Call.stop_now() for each answer still running.

cimport cython

from llmgw._fast.debug cimport LLMGW_DEBUG

from llmgw._fast.counters cimport TrafficCounters
from llmgw._fast.httpproto cimport Request, Response, id_line, monotonic, upstream_head
from libc.stdint cimport uint64_t
from llmgw._fast.jsonscan cimport Needle, header_hash, json_model, json_route, model_span, sse_cut, usage_counts
from llmgw._fast.replica cimport Endpoint, ModelPool
from llmgw._fast.score cimport EndpointState
from llmgw._fast.server cimport App, ResponseWriter
from llmgw._fast.upstream cimport Exchange, UpstreamConnection, should_retry_fresh

# What a call's deadline is for (checked by the gateway's sweep).
cdef enum Deadline:
    D_NONE = 0
    D_QUEUE = 1                       # waiting in the admission queue
    D_FIRST_BYTE = 2                  # sent; no answer head yet
    D_READ = 3                        # answering; the replica must keep sending

# Where a call is.
cdef enum Phase:
    P_NEW = 0
    P_QUEUED = 1
    P_CONNECTING = 2                  # a new upstream connection is being opened
    P_SENT = 3                        # the request went upstream
    P_DONE = 4

cdef class Gateway


# (not final: Cython refuses a final class that overrides its base in a .py)
cdef class Call(Exchange):
    # the request
    cdef readonly Gateway gw
    cdef readonly Request req
    cdef readonly ResponseWriter w
    cdef readonly ModelPool pool
    cdef readonly object model        # the served model's name (the pool's)
    cdef readonly object client_model # the name the client sent (maybe an alias)
    cdef bytes body                   # what goes upstream (model rewritten if needed)
    cdef readonly bytes rid_line      # b"x-request-id: <id>\r\n"
    cdef readonly double started      # monotonic
    cdef public int band              # index into the gateway's bands
    cdef public object band_name
    cdef public object tenant         # the client key's digest (fair share in the queue), or None
    # progress
    cdef readonly int phase           # Phase
    cdef bint closed                  # _done ran
    cdef list tried                   # replicas that failed this request, or None
    cdef readonly Endpoint ep         # the replica of the current (or last) attempt
    cdef UpstreamConnection conn      # the connection carrying the attempt
    cdef object connect_task          # the task opening a connection, or None
    cdef readonly int tries
    cdef bytes chain                  # the prefix strategy's key: the prompt's block hashes, or None
    cdef uint64_t session             # ... and its session hash (0: none)
    cdef bint probe                   # this attempt is a half-open breaker's probe
    cdef bint retrying                # counted in the retry budget
    cdef bint reused                  # the attempt runs on a connection taken from the pool
    cdef double deadline              # monotonic; when dkind expires
    cdef int dkind                    # Deadline
    cdef bint progress                # answer bytes arrived since the sweep last looked
    cdef object error                 # the last attempt's HTTPError, or None
    cdef bytes head_tail              # the attempt's head (resent on a new connection only if none was written)
    # the answer
    cdef Response resp
    cdef readonly bint streaming
    cdef readonly bint relaying       # a non-streamed answer above max_buffered, relayed as it comes
    cdef list _buf                    # a non-streamed answer's body so far
    cdef bytes _pending               # a stream's bytes short of a whole SSE event
    cdef list _more                   # ... more pieces of it, not joined yet (None: none)
    cdef Py_ssize_t _held             # ... their length in all
    cdef readonly Py_ssize_t sent_bytes
    cdef readonly double ttfb         # monotonic time the answer's head arrived; -1.0 before
    cdef readonly double sent_at      # monotonic time the request went upstream; -1.0 before
    cdef readonly object usage        # (prompt, completion) tokens, or None
    cdef bytes _tail                  # a stream's last write, and the one before it
    cdef bytes _tail_prev
    cdef bytes _run                   # the read holding whole chunks to relay as they came ...
    cdef Py_ssize_t _run_start        # ... from here
    cdef Py_ssize_t _run_end          # ... to here (see on_response_chunk)

    cdef _init(self, Gateway gw, Request req, ResponseWriter w, ModelPool pool, model, bytes body, bytes rid_line,
               double started)
    @cython.locals(now=double, victim=Call)
    cdef admit(self)
    cdef shed(self, reason, message)
    cdef _refuse(self, reason, error)
    @cython.locals(now=double, ep=Endpoint, state=EndpointState)
    cdef dispatch(self)
    @cython.locals(now=double)
    cdef _send(self, UpstreamConnection conn, bytes head, bint reused, bint resend=*)
    cdef _deadline(self, int kind, double at)
    @cython.locals(now=double)
    cdef _attempt_failed(self, error, kind, bint counts=*, bint sent=*)
    cdef bint _fresh_retry(self, exc, bint written) except -1
    cpdef on_response_head(self, Response resp)
    @cython.locals(needle=Needle)
    cdef bytes _forward(self, Response resp)
    @cython.locals(needle=Needle, cut=Py_ssize_t)
    cpdef on_response_body(self, data)
    cpdef on_response_chunk(self, bytes buf, Py_ssize_t chunk_start, Py_ssize_t start, Py_ssize_t end)
    @cython.locals(needle=Needle)
    cpdef on_response_end(self)
    @cython.locals(conn=UpstreamConnection, written=bint)
    cpdef on_upstream_lost(self, exc)
    cpdef on_read_end(self)
    cdef flush_chunks(self)
    cdef _hold(self, bytes data)
    cdef _cut_stream(self, why, code)
    cdef expired(self)
    cdef stop_now(self)
    cpdef client_gone(self)
    @cython.locals(now=double, ep=Endpoint, state=EndpointState)
    cdef _completed(self, bint success, bint counts=*)
    @cython.locals(ep=Endpoint)
    cdef _answered_5xx(self, int status)
    cdef _finish(self, error)
    @cython.locals(ttfb=double, upstream=double, now=double)
    cdef _done(self, error)


# (not final: Cython refuses a final class that overrides its base in a .py)
cdef class Gateway(App):
    cdef readonly object loop
    cdef readonly object registry
    cdef readonly dict pools          # the registry's own dict: model -> ModelPool
    cdef bytes _rid_prefix            # random per process: b"<12 hex>-"
    cdef bytes _date_line             # b"date: <IMF-fixdate>\r\n", remade each second (date_line)
    cdef double _date_until           # monotonic time _date_line is good until
    cdef Py_ssize_t _rid_n
    cdef readonly object created      # unix time, for /v1/models
    cdef readonly object observer
    cdef TrafficCounters counters     # the observer when it is one (called through C), else None
    cdef readonly bint count_tokens   # read usage off answers (an observer wants it)
    cdef readonly Py_ssize_t active_calls
    cdef readonly bint closing        # shutdown() began: nothing is queued any more
    cdef bint _admitting              # admit_next is running (no re-entry)
    cdef set _watched                 # calls with a deadline
    cdef object _sweep_handle
    # from the config (reconfigure)
    cdef readonly object config
    cdef double first_byte_timeout
    cdef double read_timeout
    cdef readonly Py_ssize_t max_buffered  # upstream.max_buffered_body
    cdef tuple _secrets               # the config's plain secrets, as bytes (redact)
    cdef int retry_attempts
    cdef bint retry_after_send        # retries.after_send: resend requests whose bytes were written
    cdef object budget                # RetryBudget
    cdef double stale_after
    cdef double max_waiting
    cdef double max_kv
    cdef readonly object bands        # band names, highest priority first
    cdef dict band_index              # lower-case name (bytes) -> index
    cdef int default_band
    cdef double queue_timeout
    cdef dict aliases                 # alias -> model
    cdef dict rewrites                # client's model name -> name sent upstream
    cdef dict keys                    # sha256 digest -> ClientKey
    cdef dict key_bands               # sha256 digest -> band index
    cdef dict key_tops                # sha256 digest -> the highest band index its requests may ask for
    cdef bint auth
    cdef bint access_log
    cdef bint expose_replica          # x-llmgw-replica on answers (server.expose_replica)
    cdef bint routed                  # some model routes by prefix: bodies are scanned with json_route
    cdef Py_ssize_t route_block       # routing.prefix: block bytes, blocks hashed
    cdef Py_ssize_t route_blocks
    cdef bytes session_header         # routing.prefix.session_header, lower-case
    cdef object _normalize_error      # (status, body, engine) -> bytes: llmgw.engines.errors
    cdef public object held_models    # models answering 503 (not 404) without a replica (deployments)

    cdef watch(self, Call call)
    cdef unwatch(self, Call call)
    @cython.locals(now=double, read_timeout=double, c=Call, keep=set, expired=list)
    cpdef _sweep(self)
    cdef admit_next(self, ModelPool pool)
    @cython.locals(now=double, sat=double, call=Call)
    cdef _admit(self, ModelPool pool)
    @cython.locals(call=Call)
    cdef _refuse_queued(self, ModelPool pool, reason, error)
    cpdef shutdown(self)
    @cython.locals(call=Call)
    cpdef bint cut(self, ResponseWriter w) except -1
    cdef breaker_outcome(self, Endpoint ep, bint success, double now)
    @cython.locals(state=EndpointState, other=EndpointState, since=double, mine=double)
    cdef bint answered_5xx_counts(self, ModelPool pool, Endpoint ep, int status, double now) except -1
    cdef _ensure_sweep(self)
    cpdef on_scrape(self, ep)
    @cython.locals(path=bytes, c=Py_ssize_t)
    cpdef handle(self, Request req, ResponseWriter w)
    cpdef answer_error(self, ResponseWriter w, exc)
    @cython.locals(path=bytes)
    cpdef precheck(self, Request req)
    cdef _answer_local(self, Request req, ResponseWriter w, int status, bytes body)
    @cython.locals(duration=double)
    cdef _local_done(self, Request req, ResponseWriter w, bytes rid, model, double started, Py_ssize_t nbytes=*)
    cdef half_opened(self, Endpoint ep)
    cdef bytes replica_line(self, Endpoint ep)
    cdef bytes date_line(self, double now)
    cdef str replica_name(self, Endpoint ep)
    cdef _served_model(self, bytes body)
    cdef bytes _authenticate(self, Request req)
    cdef bytes _request_id(self, Request req)
    @cython.locals(call=Call, started=double)
    cdef _proxy(self, Request req, ResponseWriter w, key)
    @cython.locals(pool=ModelPool, call=Call, session=uint64_t, sid=uint64_t)
    cdef Call _prepare(self, Request req, ResponseWriter w, bytes rid_line, key, double started)
    cdef log_access(self, Call call, double now)
