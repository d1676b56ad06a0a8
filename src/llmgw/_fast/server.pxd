# Declarations that compile server_py.py into the extension llmgw._fast.server
# (Cython "augmenting .pxd"): the contract of the HTTP server. Every attribute a
# class sets is declared here; cpdef methods hold no closures.
#
# Call order, per connection: connection_made -> data_received* (the reader calls
# on_head / on_request) -> _run (App.handle) -> the app answers through one
# ResponseWriter (send, or start -> write* -> end; abort cuts) -> _response_done
# (the next pipelined request, or the keep-alive timer) ... -> connection_lost
# (the current writer's watcher hears client_gone).

cimport cython

from llmgw._fast.debug cimport LLMGW_DEBUG

from llmgw._fast.httpproto cimport Request, RequestReader, RequestSink
from llmgw._fast.httpproto cimport chunk, monotonic, response_head, write_now

# What a connection's one timer is armed for.
cdef enum TimerKind:
    TIMER_NONE = 0
    TIMER_KEEPALIVE = 1        # idle between requests
    TIMER_HEAD = 2             # a request head begun, not complete
    TIMER_BODY = 3             # a request body begun, not complete
    TIMER_LINGER = 4           # answered and half-closed; dropping input

cdef class HTTPProtocol
cdef class HTTPServer
cdef class ResponseWriter


@cython.final
cdef class SocketWriter:
    cdef readonly object transport
    cdef object _is_closing           # transport.is_closing, bound once
    cdef int _fd                      # -1: every write goes through the transport
    cdef readonly bint queued         # the transport may hold unsent bytes

    @cython.locals(n=Py_ssize_t, na=Py_ssize_t)
    cpdef write(self, bytes a, bytes b=*)


cdef class App:
    # The request handler the server calls (through C when it is a C subclass):
    # handle() per request; answer_error() for every error answer (what handle
    # raised, a 500, a refused request), on a writer not yet started.
    cpdef handle(self, Request request, ResponseWriter writer)
    cpdef answer_error(self, ResponseWriter writer, exc)
    cpdef precheck(self, Request request)


# (not final: Cython refuses a final class that overrides its base in a .py)
cdef class _ObjectApp(App):
    cdef object _app                  # any object with handle(request, writer)

    cpdef handle(self, Request request, ResponseWriter writer)


@cython.final
cdef class ResponseWriter:
    # Made by the protocol with __new__ + _init (one per request).
    cdef HTTPProtocol _conn
    cdef bint _head_only              # a HEAD request: no body bytes go out
    cdef list _listeners              # on_disconnect callbacks, or None
    cdef object _watcher              # watch(): its client_gone() runs if the client goes
    cdef readonly Request request
    cdef public bint keep_alive       # cleared by whoever must close after this answer
    cdef readonly bint started        # the head went out
    cdef readonly bint finished
    cdef readonly bint disconnected   # the client went away first
    cdef readonly bint chunked        # the body goes out in chunked encoding
    cdef readonly int status

    cdef _init(self, HTTPProtocol conn, Request request)
    cpdef start(self, int status, headers=*, Py_ssize_t content_length=*, raw=*)
    cpdef write(self, data)
    cpdef write_raw(self, bytes data)
    cpdef bint write_chunk(self, bytes chunk)
    cpdef end(self, trailer=*)
    cpdef send(self, int status, body=*, headers=*, raw=*)
    cpdef send_json(self, int status, obj, headers=*)
    cpdef Py_ssize_t send_error(self, exc, headers=*) except -1
    cpdef abort(self)
    cpdef add_flow_listener(self, listener)
    cpdef watch(self, watcher)
    cpdef on_disconnect(self, callback)
    cdef _client_gone(self)


# (not final: Cython refuses a final class that overrides its base in a .py)
cdef class HTTPProtocol(RequestSink):
    # config and shared state
    cdef HTTPServer _server
    cdef App _app
    cdef object _limits               # ServerLimits
    cdef object _loop
    cdef double _keepalive_timeout    # seconds (from the limits, as C doubles)
    cdef double _header_timeout
    cdef double _body_timeout
    # connection state
    cdef readonly object transport    # None once closed
    cdef SocketWriter _out            # every write to the client
    cdef readonly object peer
    cdef RequestReader _reader
    cdef object _pipeline             # deque of requests read ahead of the current one
    cdef ResponseWriter _current      # the response being written, or None
    cdef object _task                 # the current app task, if handle() returned an awaitable
    cdef object _timer                # the one TimerHandle, or None (see _arm)
    cdef int _timer_kind              # TimerKind the deadline is for
    cdef double _timer_at             # when the pending handle fires (monotonic)
    cdef double _deadline             # when the armed kind expires (monotonic)
    cdef bint _read_paused
    cdef bint _write_paused
    cdef object _drain_waiter         # a future resume_writing completes
    cdef object _flow_listener        # pause_reading()/resume_reading() follow ours
    cdef bint _closing                # shutdown(): close once the current response ends
    cdef bint _rejected               # answered 503 at connect (limit or shutdown)
    cdef bint _closed                 # closing (close, abort, lingering close); input dropped
    cdef bint _lingering_due          # close by _linger_close: input was left unread
    cdef object _failure              # an HTTPError answered after the requests before it
    cdef bint _continue_due           # a 100 Continue owed once the connection is free
    cdef Request _refused_head        # a head precheck refused, answered by _send_failure

    @cython.locals(cur=ResponseWriter)
    cpdef connection_lost(self, exc)
    @cython.locals(kind=int, where=int, idle=double)
    cpdef data_received(self, data)
    cpdef on_head(self, Request request)
    cpdef on_request(self, Request request)
    @cython.locals(writer=ResponseWriter)
    cdef _run(self, Request request)
    cdef _internal_error(self, ResponseWriter writer)
    @cython.locals(where=int)
    cdef _response_done(self, ResponseWriter writer)
    cdef _fail(self, exc)
    @cython.locals(writer=ResponseWriter)
    cdef _send_failure(self, exc)
    @cython.locals(when=double)
    cdef _arm(self, int kind, double delay)
    cdef _cancel_timer(self)
    cdef _drop_timer(self)
    @cython.locals(now=double, kind=int)
    cpdef _on_timer(self)
    cdef _transport_write(self, bytes data)
    cdef _close(self)
    cdef _linger_close(self)
    cdef _abort(self)
    cpdef shutdown(self)


@cython.final
cdef class HTTPServer:
    cdef readonly object app          # as given
    cdef App _handler                 # the app, or an _ObjectApp around it
    cdef readonly object limits
    cdef readonly object name
    cdef readonly object loop
    cdef readonly set connections     # open HTTPProtocols (not those rejected)
    cdef readonly bint closing        # close() began
    cdef readonly Py_ssize_t rejected # connections answered 503 at once
    cdef set _refusing                # rejected ones not yet closed (close() waits for them)
    cdef object _server               # the asyncio.Server
    cdef object _idle                 # a future close() waits on
    cdef object _hurry                # ... and one hurry() completes (a second Ctrl-C)
    cdef bint _hurried                # hurry() was called: close() waits no longer

    @cython.locals(conn=HTTPProtocol)
    cdef _shutdown_all(self, bint now)
    @cython.locals(conn=HTTPProtocol, w=ResponseWriter, ended=bint)
    cdef bint _cut_all(self, cut) except -1
    cdef _maybe_closed(self)
