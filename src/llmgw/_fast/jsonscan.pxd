# The contract of jsonscan.pyx; the spec is its pure twin, jsonscan_py.py.
# The data path calls these from C (dataplane.pxd cimports them).

from libc.stdint cimport uint64_t

# The request side: the body's top-level "model".
cpdef tuple json_model(bytes body)
cpdef tuple model_span(bytes body)
# ... and for the prefix strategy, in the same pass: (is_object, model, chain, session):
# the chain hashes of the prompt's leading blocks (8 bytes each, native order) and the
# body's session key hash (0: none); key_hash() hashes a session header's value alike.
cpdef tuple json_route(bytes body, Py_ssize_t block, Py_ssize_t max_blocks)
cpdef uint64_t key_hash(bytes data) except? 0
# ... and of a header's value, found in the request's forwarded header lines (0: none).
cpdef uint64_t header_hash(bytes lines, bytes name) except? 0

# The answer side, scanned without being parsed: where the last whole SSE event in
# an upstream read ends (0: none yet), and the (prompt_tokens, completion_tokens)
# of the last "usage" object in an answer or its last events (None: none, or not
# integers). Moved here from httpproto, which still declares them by cimport.
cpdef Py_ssize_t sse_cut(bytes data) except -1
# ... and whether a replica's key is in what it sends (redaction; a shift table made once per key)
cdef class Needle:
    cdef readonly bytes needle
    cdef Py_ssize_t _m
    cdef Py_ssize_t _shift[256]
    cpdef bint within(self, bytes data, Py_ssize_t start, Py_ssize_t end) except -1
cpdef usage_counts(bytes data)
