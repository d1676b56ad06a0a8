# The contract of httpproto.pyx; the pure twin is httpproto_py.py.
#
# Call order, request side (per connection): RequestReader.feed(data) frames each
# head and reads its fields (_read_head), then feeds httptools the message's bytes,
# which calls on_headers_complete (-> on_head(req) when the client expects
# 100-continue) and on_message_complete; the body is read off the bytes llhttp has
# accepted, and the request goes to on_request(req) once its framing ends. The pure
# twin takes httptools' on_message_begin, on_url, on_header and on_body callbacks.

cdef struct ChunkFraming:
    int state                         # C_* (httpproto.pyx)
    Py_ssize_t left                   # size of the chunk being read
    bint in_ext                       # past the size digits of a size line
    bint record                       # note where chunk data lies:
    Py_ssize_t spans[16]              # ... (start, end) pairs
    int nspans                        # ... how many
    Py_ssize_t stop                   # ... where a pass stopped with spans full
    bint boundary                     # at the start of a chunk-size line
    Py_ssize_t declared               # the chunk sizes read so far (never past max_body)
    Py_ssize_t trailer                # trailer section bytes so far
    Py_ssize_t lines                  # trailer lines so far
    Py_ssize_t max_body               # limits: a request's max_body (PY_SSIZE_T_MAX for a response)
    Py_ssize_t max_trailer            # ... its max_head_bytes
    Py_ssize_t max_lines              # ... its max_headers


cdef class Request:
    cdef public bytes method
    cdef public bytes target          # path + query, as received
    cdef public bytes version         # b"1.1" / b"1.0"
    cdef list _headers                # headers: [(name, value)] as received, read lazily
    cdef bytes _raw                   # ... off these bytes
    cdef Py_ssize_t _raw_start        # ... from the first header line
    cdef Py_ssize_t _raw_end          # ... to the end of the head
    cdef public bytes forward         # header lines a proxy passes on untouched
    cdef public bint keep_alive
    cdef public Py_ssize_t content_length   # -1: none / chunked
    cdef public bint expect_continue
    cdef public object authorization  # bytes | None
    cdef public object x_api_key      # bytes | None
    cdef public object request_id     # bytes | None
    cdef public object priority       # bytes | None
    cdef public object host           # bytes | None
    cdef public object content_type   # bytes | None
    cdef public bytes body


cdef class RequestSink:
    # What a RequestReader hands requests to (the server's protocol subclasses it).
    cpdef on_request(self, Request request)   # each complete request, in order
    cpdef on_head(self, Request request)      # a head whose client waits for 100 Continue


cdef class RequestReader:
    cdef RequestSink _sink            # (a _CallbackSink around callables)
    cdef public Py_ssize_t max_head_bytes
    cdef public Py_ssize_t max_headers
    cdef public Py_ssize_t max_body
    cdef bytes _priority_header       # lower-case
    cdef object _parser               # httptools.HttpRequestParser(self)
    cdef object _feed_data            # its bound feed_data
    cdef Request _req                 # the open request (after its head)
    cdef Request _next                # the head read, until httptools validates it
    cdef bytes _acc                   # head bytes so far (a head split over reads)
    cdef bint _want_head              # the next bytes begin a request head
    cdef int _body                    # B_*: how the open request's body ends
    cdef Py_ssize_t _body_left        # B_LENGTH: body bytes still to come
    cdef ChunkFraming _chunks         # B_CHUNKED: where the body ends
    cdef bint _complete               # httptools reported the message complete
    cdef object _error                # a field error, raised once llhttp accepts the head
    cdef bint _version_known          # the request line said HTTP/1.1 or HTTP/1.0
    cdef bint _te_coded               # codings besides a final chunked: 501 (see the twin)
    cdef bint _check_upgrade          # CONNECT, or an Upgrade header: ask llhttp
    cdef bint _connection             # a Connection header: ask llhttp about keep-alive
    cdef list _parts                  # body bytes so far
    cdef Py_ssize_t _body_size
    cdef bint _dead
    cdef bint _upgrading              # the open request offers an upgrade (answered on HTTP/1.1 all the same)
    cdef bint _drop_rest              # past such a request: the rest is not HTTP/1.1

    cpdef feed(self, data)
    cpdef int where(self)
    cpdef Request current(self)       # the request past its head (or refused after it), or None
    cdef int _feed(self, bytes buf) except -1
    cdef int _llhttp(self, bytes buf, Py_ssize_t start, Py_ssize_t end) except -1
    cdef int _ended(self) except -1
    cdef int _add_body(self, bytes buf, Py_ssize_t start, Py_ssize_t end) except -1
    cdef Request _read_head(self, bytes head, Py_ssize_t end)


cdef class Response:
    cdef public int status
    cdef list _headers                # as Request's
    cdef bytes _raw
    cdef Py_ssize_t _raw_start
    cdef Py_ssize_t _raw_end
    cdef public bytes forward
    cdef public Py_ssize_t content_length   # -1: unknown (chunked or until close)
    cdef public bint chunked
    cdef public object content_type
    cdef public bint event_stream
    cdef public bint keep_alive
    cdef public bint dated            # the head has a Date field


cdef class ResponseSink:
    cpdef on_response_head(self, Response resp)
    cpdef on_response_body(self, data)
    cpdef on_response_end(self)
    cpdef on_response_chunk(self, bytes buf, Py_ssize_t chunk_start, Py_ssize_t start, Py_ssize_t end)


cdef class ResponseReader:
    cdef ResponseSink _sink           # (a _MethodSink around any other sink)
    cdef public Py_ssize_t max_head_bytes
    cdef public Py_ssize_t max_headers
    cdef object _parser
    cdef object _feed_data            # its bound feed_data
    cdef Response _resp               # the open response (after its head)
    cdef Response _next               # the head read, until httptools validates it
    cdef bytes _acc                   # head bytes so far (a head split over reads)
    cdef bint _want_head              # the next bytes begin a response head
    cdef int _body                    # B_*: how the open response's body ends
    cdef Py_ssize_t _body_left        # B_LENGTH: body bytes still to come
    cdef ChunkFraming _chunks         # B_CHUNKED: where the body ends
    cdef bint _interim                # the open response is a 1xx, dropped
    cdef bint _complete               # httptools reported the message complete

    cpdef feed(self, data)
    cpdef int where(self)
    cdef int _llhttp(self, bytes buf, Py_ssize_t start, Py_ssize_t end) except -1
    cdef int _ended(self) except -1
    cdef int _deliver(self, bytes buf, Py_ssize_t start, Py_ssize_t end) except -1
    cdef Response _read_head(self, bytes head, Py_ssize_t end)


# Called from C by the data path (cimported in dataplane.pxd).
cpdef double monotonic() noexcept
cpdef Py_ssize_t write_now(int fd, bytes a, bytes b=*) except -2
cpdef bytes chunk(bytes data)
cpdef bytes id_line(bytes rid, Py_ssize_t n=*)
cpdef bytes upstream_head(bytes method, bytes target, bytes host, bytes forward, Py_ssize_t content_length,
                          bytes extra=*)
cpdef bytes response_head(int status, headers=*, Py_ssize_t content_length=*, bint keep_alive=*, bytes raw=*)

# NOTE: sse_cut and usage_counts are jsonscan's (scans of an answer's JSON text, not
# of HTTP messages); cimported here only so that `from llmgw._fast.httpproto cimport
# sse_cut, usage_counts` keeps working until its users cimport them from jsonscan.
from llmgw._fast.jsonscan cimport sse_cut, usage_counts
