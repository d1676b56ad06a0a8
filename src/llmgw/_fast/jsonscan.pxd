# The contract of jsonscan.pyx; the spec is its pure twin, jsonscan_py.py.
# The data path calls these from C (dataplane.pxd cimports them).

cpdef tuple json_model(bytes body)
cpdef tuple model_span(bytes body)
