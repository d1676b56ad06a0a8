# The contract of httpproto.pyx; the pure twin is httpproto_py.py.
#
# Call order, request side (per connection): RequestReader.feed(data) drives
# httptools, which calls on_message_begin, on_url*, on_header*, on_headers_complete
# (-> on_head(req) when the client expects 100-continue), on_body*,
# on_message_complete (-> on_request(req)).

cdef class Request:
    cdef public bytes method
    cdef public bytes target          # path + query, as received
    cdef public bytes version         # b"1.1" / b"1.0"
    cdef public list headers          # [(name, value)] as received
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


cdef class RequestReader:
    cdef object _on_request
    cdef object _on_head
    cdef public Py_ssize_t max_head_bytes
    cdef public Py_ssize_t max_headers
    cdef public Py_ssize_t max_body
    cdef bytes _priority_header       # lower-case
    cdef object _parser               # httptools.HttpRequestParser(self)
    cdef object _feed_data            # its bound feed_data
    cdef Request _req
    cdef bint _in_head
    cdef Py_ssize_t _head_bytes       # exact: request line + header lines seen
    cdef Py_ssize_t _head_fed         # bytes fed while the head is open; -1: it began this feed
    cdef list _url_parts
    cdef list _forward
    cdef list _body
    cdef Py_ssize_t _body_size
    cdef bint _dead
    cdef Py_ssize_t _ends             # requests completed so far (to tell where a head began)
    cdef object _version_hint         # b"1.1"/b"1.0" read off the request line starting this read
    cdef Py_ssize_t _hint_ends        # ... which is request number _ends then

    cpdef feed(self, data)


cdef class Response:
    cdef public int status
    cdef public list headers
    cdef public bytes forward
    cdef public Py_ssize_t content_length   # -1: unknown (chunked or until close)
    cdef public bint chunked
    cdef public object content_type
    cdef public bint event_stream
    cdef public bint keep_alive


cdef class ResponseReader:
    cdef object _sink
    cdef object _on_head
    cdef object _on_body
    cdef object _on_end
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
    cdef int _cstate                  # B_CHUNKED: C_* framing state
    cdef Py_ssize_t _chunk_left       # ... size of the chunk being read
    cdef bint _in_ext                 # ... past the size digits of a size line
    cdef bint _interim                # the open response is a 1xx, dropped
    cdef bint _complete               # httptools reported the message complete

    cpdef feed(self, data)
    cdef int _llhttp(self, bytes buf, Py_ssize_t start, Py_ssize_t end) except -1
    cdef int _ended(self) except -1
    cdef Py_ssize_t _frame_chunks(self, const char* s, Py_ssize_t pos, Py_ssize_t n) except -2
    cdef Response _read_head(self, bytes head, Py_ssize_t end)
