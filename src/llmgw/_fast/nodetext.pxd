# The contract of nodetext.pyx; the spec is its pure twin, nodetext_py.py.
#
# render() reads a serialized llmgw.agent.v1.Discovery from its `const unsigned char*` in
# three passes (the top level with the facts, the InfiniBand ports, then each GPU: read
# whole into a GpuFields, then rendered in field-number order) and appends each sample
# line to the growable C buffer of its slot; one bytes object per slot at the end.
# The slots' buffers are module-level (nodetext.pyx: _bufs, _node_buf, _gpu_buf), kept between
# calls: render() is main-thread only, not thread-safe.

from libc.stdint cimport uint64_t

cdef enum:
    N_SLOTS = 26        # len(nodetext_py.SLOTS); checked at import
    MAX_FIELD = 30      # field numbers the messages use are below this
    MAX_GROUP_DEPTH = 64

cdef enum:
    # wire types
    WT_VARINT = 0
    WT_I64 = 1
    WT_LEN = 2
    WT_SGROUP = 3
    WT_EGROUP = 4
    WT_I32 = 5

cdef struct Buf:
    char* p
    Py_ssize_t n
    Py_ssize_t cap

cdef struct Field:
    # one field as read off the wire (next_field)
    uint64_t num
    int wt
    uint64_t value      # a varint, or a fixed64's bits
    Py_ssize_t start    # a length-delimited field's bytes: [start, end)
    Py_ssize_t end

cdef struct GpuFields:
    # a Gpu message read whole: per field number, whether it was seen (last value wins)
    uint64_t has        # bit n: field n seen on its own wire type
    uint64_t value[MAX_FIELD]
    Py_ssize_t start[MAX_FIELD]
    Py_ssize_t end[MAX_FIELD]

cpdef tuple render(bytes data, str node, tuple opens)
