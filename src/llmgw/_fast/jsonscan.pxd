# The contract of jsonscan.pyx; the spec is its pure twin, jsonscan_py.py.
# The data path calls these from C (dataplane.pxd cimports them).

# The request side: the body's top-level "model".
cpdef tuple json_model(bytes body)
cpdef tuple model_span(bytes body)

# The answer side, scanned without being parsed: where the last whole SSE event in
# an upstream read ends (0: none yet), and the (prompt_tokens, completion_tokens)
# of the last "usage" object in an answer or its last events (None: none, or not
# integers). Moved here from httpproto, which still declares them by cimport.
cpdef Py_ssize_t sse_cut(bytes data) except -1
cpdef usage_counts(bytes data)
