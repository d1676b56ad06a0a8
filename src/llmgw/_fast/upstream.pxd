# Declarations that compile upstream_py.py into the extension llmgw._fast.upstream
# (Cython "augmenting .pxd"): the contract of the upstream client.
#
# Call order, per exchange: UpstreamPool.take_idle() or await connect() ->
# UpstreamConnection.send(exchange, head, body) -> data_received* (the reader
# calls on_response_* here, passed on to the exchange, then on_read_end) ->
# on_response_end -> the exchange calls release() (back to the pool, or closed)
# or abort() (dropped). connection_lost before the end -> on_upstream_lost.

cimport cython

from llmgw._fast.debug cimport LLMGW_DEBUG

from llmgw._fast.httpproto cimport Response, ResponseReader, ResponseSink, monotonic
from llmgw._fast.server cimport SocketWriter

cdef class UpstreamPool

# When an exchange lost on a pooled keep-alive connection is sent again on a new one
# (scrapes; proxied calls only with retries.after_send).
cpdef bint should_retry_fresh(bint reused, bint got_response_head, exc) except -1


cdef class Exchange:
    # What an upstream connection reports to (the proxy's Call subclasses it).
    cpdef on_response_head(self, Response resp)
    cpdef on_response_body(self, data)
    cpdef on_response_chunk(self, bytes buf, Py_ssize_t chunk_start, Py_ssize_t start, Py_ssize_t end)
    cpdef on_response_end(self)
    cpdef on_upstream_lost(self, exc)
    cpdef on_read_end(self)


# (not final: Cython refuses a final class that overrides its base in a .py)
cdef class _ObjectExchange(Exchange):
    cdef object _x                    # any object with the Exchange methods

    cpdef on_response_head(self, Response resp)
    cpdef on_response_body(self, data)
    cpdef on_response_end(self)
    cpdef on_upstream_lost(self, exc)


# (not final: Cython refuses a final class that overrides its base in a .py)
cdef class UpstreamConnection(ResponseSink):
    cdef readonly UpstreamPool pool
    cdef readonly object transport    # None once closed
    cdef readonly Exchange sink       # the exchange in progress, or None
    cdef ResponseReader reader
    cdef readonly bint reusable       # may go back to the pool when the exchange ends (False once its close arrived)
    cdef readonly bint written        # send() handed the current request to the transport
    cdef readonly double idle_since   # monotonic; when it went back to the pool
    cdef readonly Py_ssize_t requests # exchanges sent on it
    cdef object _connected
    cdef bint _read_paused            # paused for a slow client (flow control)
    cdef SocketWriter _out            # set with the transport, in connection_made

    cpdef data_received(self, data)
    cpdef on_response_head(self, Response resp)
    cpdef on_response_body(self, data)
    cpdef on_response_end(self)
    cpdef on_response_chunk(self, bytes buf, Py_ssize_t chunk_start, Py_ssize_t start, Py_ssize_t end)
    cpdef send(self, sink, bytes head, bytes body)
    cpdef pause_reading(self)
    cpdef resume_reading(self)
    cpdef abort(self)
    cpdef release(self, bint reuse=*)


@cython.final
cdef class UpstreamPool:
    cdef readonly object host
    cdef readonly int port
    cdef readonly double connect_timeout
    cdef readonly Py_ssize_t max_idle
    cdef readonly double idle_timeout
    cdef object _idle                 # deque: most recently used last
    cdef set _all                     # every open connection
    cdef object _loop
    cdef object _sweeper              # TimerHandle closing idle connections, or None
    cdef readonly bint closed

    @cython.locals(conn=UpstreamConnection, cutoff=double)
    cpdef UpstreamConnection take_idle(self)
    cdef _put_idle(self, UpstreamConnection conn)
    @cython.locals(conn=UpstreamConnection, cutoff=double)
    cpdef _sweep(self)
    cdef _forget(self, UpstreamConnection conn)
    cpdef close_idle(self)
    cpdef close(self)
