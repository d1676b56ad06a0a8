# Declarations that compile dataplane_py.py into the extension llmgw._fast.dataplane
# (Cython "augmenting .pxd"): the classes below become extension types with C-level
# attributes, and the methods declared cpdef are called directly from C inside the
# module (and stay callable from Python). Every attribute a class sets must be
# declared here; cpdef methods may not hold closures.

cimport cython

# The compiled data path runs with the compiled HTTP module (one build makes both):
# typed, their attributes are read from the C structs, not looked up by name.
from llmgw._fast.httpproto cimport Request as _Request, Response as _Response
from llmgw._fast.httpproto cimport RequestReader as _RequestReader, ResponseReader as _ResponseReader
from llmgw._fast.httpproto cimport ResponseSink as _ResponseSink
from llmgw._fast.httpproto cimport chunk, id_line, response_head, sse_cut, upstream_head, usage_counts
from llmgw._fast.httpproto cimport monotonic as _monotonic, write_now
from llmgw._fast.jsonscan cimport json_model, model_span
from llmgw._fast.score cimport EndpointState as _EndpointState, Picker as _Picker, pool_saturation

# Module constants read on every request: C ints, not module-dict lookups.
cdef int _D_NONE, _D_QUEUE, _D_FIRST_BYTE, _D_READ
cdef int _P_NEW, _P_QUEUED, _P_CONNECTING, _P_SENT, _P_DONE

cdef class HTTPProtocol
cdef class UpstreamPool
cdef class Gateway
cdef class TrafficCounters
cdef class Call

cdef class SocketWriter:
    cdef public object transport
    cdef object _is_closing
    cdef int _fd
    cdef readonly bint queued

    @cython.locals(n=Py_ssize_t, na=Py_ssize_t)
    cpdef write(self, bytes a, bytes b=*)


cdef class HTTPServer:
    cdef public object app
    cdef public object limits
    cdef public object name
    cdef public object loop
    cdef public set connections
    cdef public bint closing
    cdef public Py_ssize_t rejected
    cdef public object _server
    cdef public object _idle
    cpdef _maybe_closed(self)


cdef class ResponseWriter:
    cdef public Call _call
    cdef public bint _chunked
    cdef public HTTPProtocol _conn
    cdef public bint _head_only
    cdef public list _listeners
    cdef public bint disconnected
    cdef public bint finished
    cdef public bint keep_alive
    cdef public _Request request
    cdef public bint started
    cdef public int status

    cpdef _init(self, HTTPProtocol conn, _Request request)
    cpdef start(self, int status, headers=*, Py_ssize_t content_length=*, raw=*)
    cpdef write(self, data)
    cpdef bint write_chunk(self, bytes chunk)
    cpdef end(self, trailer=*)
    cpdef send(self, int status, body=*, headers=*, raw=*)
    cpdef send_json(self, int status, obj, headers=*)
    cpdef send_error(self, exc, headers=*)
    cpdef abort(self)
    cpdef add_flow_listener(self, listener)
    cpdef on_disconnect(self, callback)
    cpdef _client_gone(self)


cdef class HTTPProtocol:
    cdef public HTTPServer _server
    cdef public object _app
    cdef public object _limits
    cdef public object _loop
    cdef public double _keepalive_timeout
    cdef public double _header_timeout
    cdef public double _body_timeout
    cdef public object transport
    cdef public SocketWriter _out
    cdef public object peer
    cdef public _RequestReader _reader
    cdef public object _pipeline
    cdef public ResponseWriter _current
    cdef public object _task
    cdef public object _timer
    cdef public int _timer_kind
    cdef public double _timer_at
    cdef public double _deadline
    cdef public bint _read_paused
    cdef public bint _write_paused
    cdef public object _drain_waiter
    cdef public object _flow_listener
    cdef public bint _closing
    cdef public bint _rejected
    cdef public bint _lingering
    cdef public bint _lingering_due
    cdef public object _failure
    cdef public bint _continue_due

    cpdef data_received(self, data)
    cpdef _on_head(self, _Request request)
    cpdef _on_request(self, _Request request)
    @cython.locals(gw=Gateway, writer=ResponseWriter)
    cpdef _run(self, _Request request)
    cpdef _internal_error(self, ResponseWriter writer)
    cpdef _response_done(self, ResponseWriter writer)
    cpdef _fail(self, exc)
    cpdef _send_failure(self, exc)
    cpdef _arm(self, int kind, double delay)
    cpdef _cancel_timer(self)
    cpdef _drop_timer(self)
    cpdef _on_timer(self)
    cpdef _transport_write(self, data)
    cpdef _close(self)
    cpdef _linger_close(self)
    cpdef _abort(self)
    cpdef shutdown(self)


cdef class UpstreamConnection(_ResponseSink):
    cdef public UpstreamPool pool
    cdef public object transport
    cdef public object sink
    cdef public _ResponseReader reader
    cdef public bint reusable
    cdef public double idle_since
    cdef public Py_ssize_t requests
    cdef public object _connected
    cdef public bint _read_paused
    cdef public SocketWriter _out

    @cython.locals(call=Call)
    cpdef data_received(self, data)
    @cython.locals(call=Call)
    cpdef on_response_head(self, _Response resp)
    @cython.locals(call=Call)
    cpdef on_response_body(self, data)
    @cython.locals(call=Call)
    cpdef on_response_end(self)
    @cython.locals(call=Call)
    cpdef on_response_chunk(self, bytes buf, Py_ssize_t chunk_start, Py_ssize_t start, Py_ssize_t end)
    cpdef send(self, sink, head, body)
    cpdef pause_reading(self)
    cpdef resume_reading(self)
    cpdef abort(self)
    cpdef release(self)


cdef class UpstreamPool:
    cdef public object host
    cdef public int port
    cdef public double connect_timeout
    cdef public Py_ssize_t max_idle
    cdef public double idle_timeout
    cdef public object _idle
    cdef public set _all
    cdef public object _loop
    cdef public object _sweeper
    cdef public bint closed

    @cython.locals(conn=UpstreamConnection)
    cpdef UpstreamConnection take_idle(self)
    cpdef _put_idle(self, UpstreamConnection conn)
    cpdef _sweep(self)
    cpdef _forget(self, UpstreamConnection conn)
    cpdef close_idle(self)
    cpdef close(self)


cdef class Endpoint:
    cdef public bytes auth_line
    cdef public bytes base_path
    cdef public object cfg
    cdef public Py_ssize_t completed
    cdef public object engine
    cdef public Py_ssize_t failures
    cdef public bytes host_header
    cdef public object id
    cdef public object metrics_path
    cdef public object models
    cdef public UpstreamPool pool
    cdef public bytes replica_line
    cdef public Py_ssize_t scrape_failures
    cdef public Py_ssize_t scrape_ok
    cdef public object scrape_problem
    cdef public double scrape_seconds
    cdef public double stale_after
    cdef public _EndpointState state

    cpdef bytes target(self, bytes path)
    cpdef close(self)


cdef class ModelPool:
    cdef public list endpoints
    cdef public object name
    cdef public _Picker picker
    cdef public object queue
    cdef public list states

    cpdef add(self, Endpoint ep)
    cpdef remove(self, Endpoint ep)
    cpdef Endpoint pick(self, double now, double stale_after, exclude=*)
    cpdef double saturation(self, double now, double stale_after, double max_waiting, double max_kv)


cdef class Hist:
    cdef public list counts
    cdef public double total


cdef class RequestSeries:
    cdef public Py_ssize_t n
    cdef public Hist dur
    cdef public Hist ttfb
    cdef public Hist up


cdef class TrafficCounters:
    cdef public list bounds
    cdef public Py_ssize_t max_series
    cdef public dict _requests
    cdef public dict _duration
    cdef public dict _ttfb
    cdef public dict _upstream
    cdef public dict _tokens
    cdef public dict _errors
    cdef public dict _retries
    cdef public dict _admission
    cdef public dict _admitted
    cdef public dict _breaker
    cdef public set _overflowed

    @cython.locals(i=Py_ssize_t, n=Py_ssize_t, b=double)
    cdef Py_ssize_t _bucket(self, double value)
    cpdef request_done(self, model, replica, int status, band, double duration, ttfb, upstream)
    @cython.locals(s=RequestSeries, h=Hist, u=Hist)
    cpdef record(self, model, replica, int status, band, double duration, double ttfb, double upstream)
    cpdef upstream_error(self, replica, kind)
    cpdef retry(self, model, replica)
    cpdef tokens(self, model, prompt, completion)
    cpdef admission(self, band, outcome, reason=*)
    cpdef breaker_transition(self, replica, state)
    cpdef _first(self, dict d, key, family, other)
    cpdef RequestSeries _new_requests(self, model, replica, int status, band)


cdef class Call:
    cdef public list _buf
    cdef public bytes _pending
    cdef public int band
    cdef public object band_name
    cdef public bytes body
    cdef public object client_model
    cdef public bint closed
    cdef public UpstreamConnection conn
    cdef public object connect_task
    cdef public double deadline
    cdef public int dkind
    cdef public Endpoint ep
    cdef public object error
    cdef public Gateway gw
    cdef public bytes head_tail
    cdef public object model
    cdef public int phase
    cdef public ModelPool pool
    cdef public bint probe
    cdef public _Request req
    cdef public _Response resp
    cdef public bint retrying
    cdef public bytes rid_line
    cdef public double sent_at
    cdef public Py_ssize_t sent_bytes
    cdef public double started
    cdef public bint streaming
    cdef public object tenant
    cdef public list tried
    cdef public int tries
    cdef public double ttfb
    cdef public object usage
    cdef public bint progress
    cdef public bytes _tail
    cdef public bytes _tail_prev
    cdef public bytes _run
    cdef public Py_ssize_t _run_start
    cdef public Py_ssize_t _run_end
    cdef public ResponseWriter w

    cpdef _init(self, Gateway gw, _Request req, ResponseWriter w, ModelPool pool, model, bytes body, bytes rid_line)
    @cython.locals(now=double)
    cpdef admit(self)
    cpdef shed(self, reason, message)
    @cython.locals(now=double, ep=Endpoint, state=_EndpointState)
    cpdef dispatch(self)
    @cython.locals(now=double)
    cpdef _send(self, UpstreamConnection conn, bytes head, bint reused)
    cpdef _deadline(self, int kind, double at)
    cpdef _attempt_failed(self, error, kind, bint counts=*)
    cpdef bint _fresh_retry(self)
    cpdef on_response_head(self, _Response resp)
    cpdef on_response_body(self, data)
    cpdef on_response_chunk(self, bytes buf, Py_ssize_t chunk_start, Py_ssize_t start, Py_ssize_t end)
    cpdef flush_chunks(self)
    cpdef on_response_end(self)
    cpdef on_upstream_lost(self, exc)
    cpdef _cut_stream(self, why, code)
    cpdef expired(self)
    cpdef client_gone(self)
    @cython.locals(now=double, ep=Endpoint, state=_EndpointState)
    cpdef _completed(self, bint success)
    cpdef _finish(self, error)
    @cython.locals(ttfb=double, upstream=double, now=double)
    cpdef _done(self, error)


cdef class Gateway:
    cdef public object loop
    cdef public object registry
    cdef public dict pools
    cdef public bytes _rid_prefix
    cdef public Py_ssize_t _rid_n
    cdef public object created
    cdef public object observer
    cdef public TrafficCounters counters
    cdef public bint count_tokens
    cdef public Py_ssize_t active_calls
    cdef public bint _admitting
    cdef public set _watched
    cdef public object _sweep_handle
    cdef public object config
    cdef public double first_byte_timeout
    cdef public double read_timeout
    cdef public int retry_attempts
    cdef public object budget
    cdef public double stale_after
    cdef public double max_waiting
    cdef public double max_kv
    cdef public object bands
    cdef public dict band_index
    cdef public int default_band
    cdef public double queue_timeout
    cdef public dict aliases
    cdef public dict rewrites
    cdef public dict keys
    cdef public dict key_bands
    cdef public bint auth
    cdef public bint access_log

    cpdef watch(self, Call call)
    cpdef unwatch(self, Call call)
    cpdef admit_next(self, ModelPool pool)
    cpdef breaker_outcome(self, Endpoint ep, bint success, double now)
    cpdef _ensure_sweep(self)
    cpdef on_scrape(self, ep)
    cpdef handle(self, _Request req, ResponseWriter w)
    cpdef bytes _request_id(self, _Request req)
    cpdef _proxy(self, _Request req, ResponseWriter w, key)
    @cython.locals(pool=ModelPool, call=Call)
    cpdef Call _prepare(self, _Request req, ResponseWriter w, bytes rid_line, key)
    cpdef log_access(self, Call call, double now)
