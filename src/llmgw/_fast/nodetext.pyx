# A node's cluster readings as Prometheus text from the heartbeat's wire bytes: the compiled twin of
# nodetext_py.py.
#
# nodetext_py.py is the spec (what is rendered, how the wire is read, what is an error); this module
# matches it byte for byte and error for error. The message is read from its `const unsigned char*`
# without creating a Python object per field: each line is appended to its slot's C buffer, integers
# are written by hand, doubles by PyOS_double_to_string (what repr() calls), strings are checked as
# UTF-8 and escaped on the copy. PERF: the cluster scrape is this function x the nodes
# (bench/cluster_render.py).

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from libc.stdint cimport uint64_t
from libc.math cimport fabs, floor, signbit
from libc.string cimport memcpy

from llmgw._fast.nodetext_py import FABRIC_STATES, HEALTH_STATES, SLOTS

cdef extern from "Python.h":
    char* PyOS_double_to_string(double val, char format_code, int precision, int flags, int* ptype) except NULL
    int Py_DTSF_ADD_DOT_0
    const char* PyUnicode_AsUTF8AndSize(object s, Py_ssize_t* size) except NULL

__all__ = ["FABRIC_STATES", "HEALTH_STATES", "SLOTS", "render", "render_message"]

if len(SLOTS) != N_SLOTS:
    raise ImportError("nodetext: N_SLOTS differs from nodetext_py.SLOTS")

cdef enum:
    S_CPU = 0
    S_MEM_TOTAL
    S_MEM_AVAIL
    S_ERRORS
    S_IB_RCV
    S_IB_XMIT
    S_INFO
    S_GMEM_TOTAL
    S_GMEM_USED
    S_GMEM_FREE
    S_UTIL
    S_MEMBW
    S_TEMP
    S_POWER
    S_POWER_LIMIT
    S_ENERGY
    S_SM_CLOCK
    S_ECC
    S_REMAP
    S_REMAP_PENDING
    S_REMAP_FAILURE
    S_XID
    S_MIG
    S_NVLINK
    S_FABRIC
    S_HEALTH

cdef uint64_t MASK32 = 0xFFFFFFFF
cdef uint64_t ALL64 = 0xFFFFFFFFFFFFFFFF
cdef str _BAD = "not a Discovery message"

# The health states exported for every GPU (HEALTH_STATES' values, in order), and the fabric states.
cdef tuple _HEALTH_WORDS = tuple(HEALTH_STATES)
cdef tuple _HEALTH_NAMES = tuple(HEALTH_STATES.values())
cdef tuple _FABRIC = tuple(FABRIC_STATES)


# -- buffers --

cdef int buf_grow(Buf* b, Py_ssize_t need) except -1:
    cdef Py_ssize_t cap = b.cap * 2 if b.cap else 512
    while cap < b.n + need:
        cap *= 2
    cdef char* p = <char*>PyMem_Realloc(b.p, cap)
    if p == NULL:
        raise MemoryError()
    b.p = p
    b.cap = cap
    return 0


cdef inline int put(Buf* b, const char* s, Py_ssize_t n) except -1:
    if b.n + n > b.cap:
        buf_grow(b, n)
    memcpy(b.p + b.n, s, n)
    b.n += n
    return 0


cdef inline int put_escaped(Buf* b, const unsigned char* s, Py_ssize_t n) except -1:
    """A label value: backslash, double quote and newline escaped (the rest as it is)."""
    cdef Py_ssize_t i
    cdef unsigned char c
    if b.n + 2 * n > b.cap:
        buf_grow(b, 2 * n)
    for i in range(n):
        c = s[i]
        if c == 92 or c == 34:  # \ "
            b.p[b.n] = 92
            b.p[b.n + 1] = c
            b.n += 2
        elif c == 10:
            b.p[b.n] = 92
            b.p[b.n + 1] = 110  # n
            b.n += 2
        else:
            b.p[b.n] = c
            b.n += 1
    return 0


cdef inline int put_uint(Buf* b, uint64_t v) except -1:
    cdef char tmp[24]
    cdef int i = 24
    while True:
        i -= 1
        tmp[i] = <char>(48 + v % 10)
        v //= 10
        if v == 0:
            break
    return put(b, tmp + i, 24 - i)


cdef double[23] _P10 = [1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11, 1e12, 1e13, 1e14, 1e15,
                         1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22]
cdef uint64_t[17] _U10 = [1, 10, 100, 1000, 10000, 100000, 1000000, 10000000, 100000000, 1000000000,
                          10000000000, 100000000000, 1000000000000, 10000000000000, 100000000000000,
                          1000000000000000, 10000000000000000]


cdef int put_fixed(Buf* b, uint64_t m, int k) except -1:
    """``m / 10**k`` written with exactly ``k`` decimals (k >= 1)."""
    cdef char tmp[24]
    cdef int i
    cdef uint64_t frac = m % _U10[k]
    put_uint(b, m // _U10[k])
    put(b, ".", 1)
    for i in range(k - 1, -1, -1):
        tmp[i] = <char>(48 + frac % 10)
        frac //= 10
    return put(b, tmp, k)


cdef int short_decimal(double a, uint64_t* out_m) noexcept nogil:
    """The fewest decimals ``k`` (1..15) such that some ``m / 10**k`` reads back as ``a`` (0 < a < 1e15,
    not an integer), and that ``m``; 0: none found (dtoa decides).

    Why this is repr's answer: ``m`` and ``10**k`` are exact doubles (m < 2**53, k <= 22), so
    ``m / 10**k`` (IEEE division, correctly rounded) is what reading the decimal text gives. The reals
    that round to ``a`` span at most ulp(a) <= a * 2**-52; while the grid 10**-k is coarser than twice
    that, at most one of its points reads back as ``a``: the first ``k`` that has one is the shortest
    text, the one repr writes (fixed notation: 1e-4 <= a < 1e16). ``a * 10**k`` is off by less than
    one from the nearest grid point, so that point is one of m-1, m, m+1.
    """
    cdef int k
    cdef double p10, x
    cdef uint64_t m
    cdef double width = 2.0 * a * 2.220446049250313e-16
    for k in range(1, 16):
        p10 = _P10[k]
        if 1.0 / p10 <= 2.0 * width:
            return 0
        x = a * p10
        if x >= 4503599627370496.0:  # 2**52
            return 0
        m = <uint64_t>(x + 0.5)
        if m > 0 and <double>(m - 1) / p10 == a:
            out_m[0] = m - 1
            return k
        if <double>m / p10 == a:
            out_m[0] = m
            return k
        if <double>(m + 1) / p10 == a:
            out_m[0] = m + 1
            return k
    return 0


cdef int put_double(Buf* b, double v) except -1:
    """``repr(v)`` for a finite double; ``+Inf``, ``-Inf``, ``NaN`` otherwise (the twin's _num)."""
    cdef char* s
    cdef Py_ssize_t n
    cdef double a = fabs(v)
    cdef uint64_t m
    cdef int k
    if v == floor(v) and a < 1e16:
        # PERF: an integral value (a temperature, a power limit, a clock): repr writes it as the
        # integer and ".0" below 1e16 (exponent form from there); no dtoa
        if signbit(v):
            put(b, "-", 1)
        put_uint(b, <uint64_t>a)
        return put(b, ".0", 2)
    if 1e-4 <= a < 1e15:
        # PERF: a value of few decimals (a ratio, watts): found without dtoa (short_decimal says why)
        k = short_decimal(a, &m)
        if k:
            if signbit(v):
                put(b, "-", 1)
            return put_fixed(b, m, k)
    if v - v == 0:
        s = PyOS_double_to_string(v, b'r', 0, Py_DTSF_ADD_DOT_0, NULL)
        n = 0
        while s[n]:
            n += 1
        try:
            put(b, s, n)
        finally:
            PyMem_Free(s)
        return 0
    if v != v:
        return put(b, "NaN", 3)
    return put(b, "+Inf", 4) if v > 0 else put(b, "-Inf", 4)


# -- the wire --

cdef inline int read_varint(const unsigned char* p, Py_ssize_t* i, Py_ssize_t end, uint64_t* out) noexcept nogil:
    """At most 10 bytes, read modulo 2**64; -1: truncated or too long."""
    cdef uint64_t v = 0
    cdef int shift = 0
    cdef unsigned char c
    cdef Py_ssize_t j = i[0]
    while True:
        if j >= end or shift > 63:
            return -1
        c = p[j]
        j += 1
        v |= (<uint64_t>(c & 0x7F)) << shift
        if c < 0x80:
            out[0] = v
            i[0] = j
            return 0
        shift += 7


cdef int skip_group(const unsigned char* p, Py_ssize_t* i, Py_ssize_t end, uint64_t num, int depth) noexcept nogil:
    cdef uint64_t tag, v
    cdef uint64_t n
    cdef int wt
    if depth > MAX_GROUP_DEPTH:
        return -1
    while i[0] < end:
        if read_varint(p, i, end, &tag) < 0:
            return -1
        n = tag >> 3
        wt = <int>(tag & 7)
        if n == 0 or tag > MASK32:
            return -1
        if wt == WT_VARINT:
            if read_varint(p, i, end, &v) < 0:
                return -1
        elif wt == WT_I64:
            i[0] += 8
        elif wt == WT_LEN:
            if read_varint(p, i, end, &v) < 0:
                return -1
            if v > <uint64_t>(end - i[0]):
                return -1
            i[0] += <Py_ssize_t>v
        elif wt == WT_I32:
            i[0] += 4
        elif wt == WT_SGROUP:
            if skip_group(p, i, end, n, depth + 1) < 0:
                return -1
        elif wt == WT_EGROUP:
            return 0 if n == num else -1
        else:
            return -1
        if i[0] > end:
            return -1
    return -1


cdef int next_field(const unsigned char* p, Py_ssize_t* i, Py_ssize_t end, Field* f) noexcept nogil:
    """The next varint, fixed64 or length-delimited field into ``f``: 1; 0 at the end; -1 malformed.
    Fixed32 fields and groups are skipped (no message here has one)."""
    cdef uint64_t tag, n
    f.start = f.end = 0  # (set for every kind: a varint's are copied along, never read)
    while i[0] < end:
        if read_varint(p, i, end, &tag) < 0:
            return -1
        f.num = tag >> 3
        f.wt = <int>(tag & 7)
        if f.num == 0 or tag > MASK32:
            return -1
        if f.wt == WT_VARINT:
            if read_varint(p, i, end, &f.value) < 0:
                return -1
            return 1
        if f.wt == WT_I64:
            if end - i[0] < 8:
                return -1
            memcpy(&f.value, p + i[0], 8)  # little-endian hosts (x86-64, aarch64): the double's bits
            i[0] += 8
            return 1
        if f.wt == WT_LEN:
            if read_varint(p, i, end, &n) < 0:
                return -1
            if n > <uint64_t>(end - i[0]):
                return -1
            f.start = i[0]
            f.end = i[0] + <Py_ssize_t>n
            i[0] = f.end
            return 1
        if f.wt == WT_I32:
            if end - i[0] < 4:
                return -1
            i[0] += 4
        elif f.wt == WT_SGROUP:
            if skip_group(p, i, end, f.num, 1) < 0:
                return -1
        else:
            return -1
    return 0


cdef bint utf8_ok(const unsigned char* s, Py_ssize_t n) noexcept nogil:
    """Strict UTF-8, as Python's decoder reads it (no overlong forms, surrogates or > U+10FFFF)."""
    cdef Py_ssize_t i = 0
    cdef unsigned char c, c1
    while i < n:
        c = s[i]
        if c < 0x80:
            i += 1
            continue
        if c < 0xC2 or c > 0xF4:
            return False
        if c < 0xE0:
            if i + 1 >= n or (s[i + 1] & 0xC0) != 0x80:
                return False
            i += 2
            continue
        if c < 0xF0:
            if i + 2 >= n:
                return False
            c1 = s[i + 1]
            if (c1 & 0xC0) != 0x80 or (s[i + 2] & 0xC0) != 0x80:
                return False
            if (c == 0xE0 and c1 < 0xA0) or (c == 0xED and c1 > 0x9F):
                return False
            i += 3
            continue
        if i + 3 >= n:
            return False
        c1 = s[i + 1]
        if (c1 & 0xC0) != 0x80 or (s[i + 2] & 0xC0) != 0x80 or (s[i + 3] & 0xC0) != 0x80:
            return False
        if (c == 0xF0 and c1 < 0x90) or (c == 0xF4 and c1 > 0x8F):
            return False
        i += 4
    return True


cdef inline int check_text(const unsigned char* p, Field* f) except -1:
    if not utf8_ok(p + f.start, f.end - f.start):
        raise ValueError(_BAD)  # (as the twin: not UnicodeDecodeError, whose text would tell the order read)
    return 0


cdef inline double as_double(uint64_t bits) noexcept nogil:
    cdef double d
    memcpy(&d, &bits, 8)
    return d


# -- rendering --

cdef struct Ctx:
    # per call: the slots' buffers and prefixes, the node's escaped label
    Buf* bufs
    const char** op
    Py_ssize_t* opn
    const unsigned char* node
    Py_ssize_t noden
    Buf gpu             # the current GPU's labels (gpu_prefix)


cdef inline int open_line(Ctx* c, int slot) except -1:
    """``name{node="..."`` into the slot's buffer."""
    cdef Buf* b = &c.bufs[slot]
    put(b, c.op[slot], c.opn[slot])
    put(b, 'node="', 6)
    put(b, <const char*>c.node, c.noden)
    return put(b, '"', 1)


cdef int node_line(Ctx* c, int slot, uint64_t v) except -1:
    open_line(c, slot)
    cdef Buf* b = &c.bufs[slot]
    put(b, "} ", 2)
    put_uint(b, v)
    return put(b, "\n", 1)


cdef int parse_port(const unsigned char* p, Py_ssize_t s, Py_ssize_t e, GpuFields* g) except -1:
    """An InfinibandPort into ``g`` (fields by number, as a GPU's)."""
    cdef Field f
    cdef int r
    g.has = 0
    while True:
        r = next_field(p, &s, e, &f)
        if r == 0:
            return 0
        if r < 0:
            raise ValueError(_BAD)
        if f.num >= 9:
            continue
        if f.num == 1 or f.num == 3:
            if f.wt != WT_LEN:
                continue
            check_text(p, &f)
        elif f.num == 4:
            if f.wt != WT_I64:
                continue
        elif f.wt != WT_VARINT:
            continue
        g.has |= (<uint64_t>1) << f.num
        g.value[f.num] = f.value
        g.start[f.num] = f.start
        g.end[f.num] = f.end


cdef int render_port(Ctx* c, const unsigned char* p, GpuFields* g) except -1:
    port_line(c, p, g, S_IB_RCV, 5)
    return port_line(c, p, g, S_IB_XMIT, 6)


cdef int port_line(Ctx* c, const unsigned char* p, GpuFields* g, int slot, int fnum) except -1:
    cdef Buf* b
    if (g.has >> fnum) & 1:
        open_line(c, slot)
        b = &c.bufs[slot]
        put(b, ',device="', 9)
        if (g.has >> 1) & 1:
            put_escaped(b, p + g.start[1], g.end[1] - g.start[1])
        put(b, '",port="', 8)
        put_uint(b, g.value[2] & MASK32 if (g.has >> 2) & 1 else 0)
        put(b, '"} ', 3)
        put_uint(b, g.value[fnum])
        put(b, "\n", 1)
    return 0


cdef int parse_gpu(const unsigned char* p, Py_ssize_t s, Py_ssize_t e, GpuFields* g) except -1:
    cdef Field f
    cdef int r
    cdef Py_ssize_t xs
    g.has = 0
    while True:
        r = next_field(p, &s, e, &f)
        if r == 0:
            return 0
        if r < 0:
            raise ValueError(_BAD)
        if f.num >= MAX_FIELD:
            continue
        if f.num == 1 or (3 <= f.num <= 5) or f.num == 22 or f.num == 26 or f.num == 28 or f.num == 29:
            if f.wt != WT_LEN:
                continue
            if f.num == 22:  # an XidCount: checked here, rendered later (parse_xid)
                xs = f.start
                parse_xid(p, &xs, f.end, NULL, NULL)
                continue
            check_text(p, &f)
        elif 9 <= f.num <= 15:
            if f.wt != WT_I64:
                continue
        elif f.wt != WT_VARINT:
            continue
        g.has |= (<uint64_t>1) << f.num
        g.value[f.num] = f.value
        g.start[f.num] = f.start
        g.end[f.num] = f.end


cdef int parse_xid(const unsigned char* p, Py_ssize_t* s, Py_ssize_t e, uint64_t* xid, uint64_t* count) except -1:
    cdef Field f
    cdef int r
    cdef uint64_t x = 0, n = 0
    while True:
        r = next_field(p, s, e, &f)
        if r == 0:
            break
        if r < 0:
            raise ValueError(_BAD)
        if f.wt != WT_VARINT:
            continue
        if f.num == 1:
            x = f.value & MASK32
        elif f.num == 2:
            n = f.value
    if xid != NULL:
        xid[0] = x
        count[0] = n
    return 0


cdef int gpu_prefix(Ctx* c, const unsigned char* p, GpuFields* g) except -1:
    """The GPU's labels, ``node="...",gpu_uuid="...",gpu_index="..."``, once per GPU (Ctx.gpu)."""
    cdef Buf* b = &c.gpu
    b.n = 0
    put(b, 'node="', 6)
    put(b, <const char*>c.node, c.noden)
    put(b, '",gpu_uuid="', 12)
    if g.has & 2:
        put_escaped(b, p + g.start[1], g.end[1] - g.start[1])
    put(b, '",gpu_index="', 13)
    if g.has & 4:
        put_uint(b, g.value[2] & MASK32)
    return put(b, '"', 1)


cdef inline int gpu_open(Ctx* c, int slot) except -1:
    """``name{`` and the GPU's labels into the slot's buffer."""
    cdef Buf* b = &c.bufs[slot]
    put(b, c.op[slot], c.opn[slot])
    return put(b, c.gpu.p, c.gpu.n)


cdef int gpu_uint(Ctx* c, GpuFields* g, int fnum, int slot, uint64_t mask) except -1:
    if not (g.has >> fnum) & 1:
        return 0
    gpu_open(c, slot)
    cdef Buf* b = &c.bufs[slot]
    put(b, "} ", 2)
    put_uint(b, g.value[fnum] & mask)
    return put(b, "\n", 1)


cdef int gpu_double(Ctx* c, GpuFields* g, int fnum, int slot, double scale) except -1:
    if not (g.has >> fnum) & 1:
        return 0
    cdef double d = as_double(g.value[fnum])
    if scale != 1.0:
        d = d * scale
    gpu_open(c, slot)
    cdef Buf* b = &c.bufs[slot]
    put(b, "} ", 2)
    put_double(b, d)
    return put(b, "\n", 1)


cdef int gpu_labelled(Ctx* c, GpuFields* g, int fnum, int slot, const char* label, Py_ssize_t labeln) except -1:
    if not (g.has >> fnum) & 1:
        return 0
    gpu_open(c, slot)
    cdef Buf* b = &c.bufs[slot]
    put(b, label, labeln)
    put_uint(b, g.value[fnum])
    return put(b, "\n", 1)


cdef int gpu_flag(Ctx* c, GpuFields* g, int fnum, int slot) except -1:
    if not (g.has >> fnum) & 1:
        return 0
    gpu_open(c, slot)
    if g.value[fnum]:
        return put(&c.bufs[slot], "} 1.0\n", 6)
    return put(&c.bufs[slot], "} 0.0\n", 6)


cdef int state_line(Ctx* c, int slot, const char* label, Py_ssize_t labeln,
                    const unsigned char* state, Py_ssize_t staten, bint on) except -1:
    gpu_open(c, slot)
    cdef Buf* b = &c.bufs[slot]
    put(b, label, labeln)
    put_escaped(b, state, staten)
    if on:
        return put(b, '"} 1.0\n', 7)
    return put(b, '"} 0.0\n', 7)


cdef inline bint same(const unsigned char* a, Py_ssize_t an, bytes b) noexcept:
    cdef Py_ssize_t bn = PyBytes_GET_SIZE(b)
    cdef const char* bp = PyBytes_AS_STRING(b)
    cdef Py_ssize_t i
    if an != bn:
        return False
    for i in range(an):
        if a[i] != <unsigned char>bp[i]:
            return False
    return True


# the state words as UTF-8 (module level, made once)
cdef tuple _HEALTH_WORDS_B = tuple(w.encode() for w in _HEALTH_WORDS)
cdef tuple _HEALTH_NAMES_B = tuple(w.encode() for w in _HEALTH_NAMES)
cdef tuple _FABRIC_B = tuple(w.encode() for w in _FABRIC)
cdef bytes _UNKNOWN = b"unknown"


cdef int render_gpu(Ctx* c, const unsigned char* p, Py_ssize_t s, Py_ssize_t e, GpuFields* g) except -1:
    cdef Buf* b
    cdef int k
    cdef uint64_t xid, count
    cdef Field f
    cdef Py_ssize_t i, xs
    cdef const unsigned char* st
    cdef Py_ssize_t stn
    cdef bytes word
    cdef bint known, on
    parse_gpu(p, s, e, g)
    gpu_prefix(c, p, g)
    # info
    gpu_open(c, S_INFO)
    b = &c.bufs[S_INFO]
    put(b, ',gpu_model="', 12)
    if g.has & (1 << 3):
        put_escaped(b, p + g.start[3], g.end[3] - g.start[3])
    put(b, '",pci_bus_id="', 14)
    if g.has & (1 << 4):
        put_escaped(b, p + g.start[4], g.end[4] - g.start[4])
    put(b, '",parent_gpu_uuid="', 19)
    if g.has & (1 << 5):
        put_escaped(b, p + g.start[5], g.end[5] - g.start[5])
    put(b, '"} 1.0\n', 7)
    gpu_uint(c, g, 6, S_GMEM_TOTAL, ALL64)
    gpu_uint(c, g, 7, S_GMEM_USED, ALL64)
    gpu_uint(c, g, 8, S_GMEM_FREE, ALL64)
    gpu_uint(c, g, 24, S_NVLINK, MASK32)
    gpu_double(c, g, 9, S_UTIL, 1.0)
    gpu_double(c, g, 10, S_MEMBW, 1.0)
    gpu_double(c, g, 11, S_TEMP, 1.0)
    gpu_double(c, g, 12, S_POWER, 1.0)
    gpu_double(c, g, 13, S_POWER_LIMIT, 1.0)
    gpu_double(c, g, 14, S_ENERGY, 1.0)
    gpu_double(c, g, 15, S_SM_CLOCK, 1e6)  # MHz on the wire, hertz on the page
    # labelled integers (in field order within their family)
    gpu_labelled(c, g, 16, S_ECC, ',error_type="corrected"} ', 25)
    gpu_labelled(c, g, 17, S_ECC, ',error_type="uncorrected"} ', 27)
    gpu_labelled(c, g, 18, S_REMAP, ',kind="correctable"} ', 21)
    gpu_labelled(c, g, 19, S_REMAP, ',kind="uncorrectable"} ', 23)
    gpu_flag(c, g, 20, S_REMAP_PENDING)
    gpu_flag(c, g, 21, S_REMAP_FAILURE)
    gpu_flag(c, g, 23, S_MIG)
    # XIDs, in the order they came
    i = s
    while True:
        k = next_field(p, &i, e, &f)
        if k <= 0:
            break
        if f.num != 22 or f.wt != WT_LEN:
            continue
        xs = f.start
        parse_xid(p, &xs, f.end, &xid, &count)
        gpu_open(c, S_XID)
        b = &c.bufs[S_XID]
        put(b, ',xid="', 6)
        put_uint(b, xid)
        put(b, '"} ', 3)
        put_uint(b, count)
        put(b, "\n", 1)
    # fabric state: one sample per known state (and the current one when it is another word)
    if g.has & (1 << 26):
        st = p + g.start[26]
        stn = g.end[26] - g.start[26]
        known = False
        for word in _FABRIC_B:
            on = same(st, stn, word)
            known = known or on
            state_line(c, S_FABRIC, ',state="', 8, <const unsigned char*>PyBytes_AS_STRING(word),
                       PyBytes_GET_SIZE(word), on)
        if not known:
            state_line(c, S_FABRIC, ',state="', 8, st, stn, True)
    # health: the agent's word read as the exported state; one sample per state
    if g.has & (1 << 28) and g.end[28] > g.start[28]:
        st = p + g.start[28]
        stn = g.end[28] - g.start[28]
    else:
        st = <const unsigned char*>PyBytes_AS_STRING(_UNKNOWN)
        stn = PyBytes_GET_SIZE(_UNKNOWN)
    for k in range(len(_HEALTH_WORDS_B)):
        if same(st, stn, <bytes>_HEALTH_WORDS_B[k]):
            word = <bytes>_HEALTH_NAMES_B[k]
            st = <const unsigned char*>PyBytes_AS_STRING(word)
            stn = PyBytes_GET_SIZE(word)
            break
    known = False
    for word in _HEALTH_NAMES_B:
        on = same(st, stn, word)
        known = known or on
        state_line(c, S_HEALTH, ',state="', 8, <const unsigned char*>PyBytes_AS_STRING(word),
                   PyBytes_GET_SIZE(word), on)
    if not known:
        state_line(c, S_HEALTH, ',state="', 8, st, stn, True)
    return 0


cdef int render_all(Ctx* c, const unsigned char* p, Py_ssize_t end) except -1:
    cdef Field f, ff
    cdef int r, r2
    cdef Py_ssize_t i = 0, j
    cdef uint64_t has = 0
    cdef uint64_t fv[8]
    cdef uint64_t n_errors = 0
    cdef GpuFields g
    # 1: the top level and the facts (merged), everything checked but the GPUs
    while True:
        r = next_field(p, &i, end, &f)
        if r == 0:
            break
        if r < 0:
            raise ValueError(_BAD)
        if f.wt != WT_LEN or f.num > 4:
            continue
        if f.num == 3 or f.num == 4:
            check_text(p, &f)
            if f.num == 4:
                n_errors += 1
        elif f.num == 1:
            j = f.start
            while True:
                r2 = next_field(p, &j, f.end, &ff)
                if r2 == 0:
                    break
                if r2 < 0:
                    raise ValueError(_BAD)
                if ff.num > 11:
                    continue
                if 5 <= ff.num <= 7:
                    if ff.wt == WT_VARINT:
                        has |= (<uint64_t>1) << ff.num
                        fv[ff.num] = ff.value
                elif ff.wt == WT_LEN:
                    if ff.num == 11:
                        parse_port(p, ff.start, ff.end, &g)
                    else:
                        check_text(p, &ff)
    if has & (1 << 5):
        node_line(c, S_CPU, fv[5] & MASK32)
    if has & (1 << 6):
        node_line(c, S_MEM_TOTAL, fv[6])
    if has & (1 << 7):
        node_line(c, S_MEM_AVAIL, fv[7])
    node_line(c, S_ERRORS, n_errors)
    # 2: the InfiniBand ports, in the order they came
    i = 0
    while next_field(p, &i, end, &f) > 0:
        if f.num != 1 or f.wt != WT_LEN:
            continue
        j = f.start
        while next_field(p, &j, f.end, &ff) > 0:
            if ff.num == 11 and ff.wt == WT_LEN:
                parse_port(p, ff.start, ff.end, &g)
                render_port(c, p, &g)
    # 3: the GPUs
    i = 0
    while next_field(p, &i, end, &f) > 0:
        if f.num == 2 and f.wt == WT_LEN:
            render_gpu(c, p, f.start, f.end, &g)
    return 0


# PERF: the slots' buffers live on between calls (they grow to a node's size once; a call only resets
# them). render() holds the GIL throughout and calls no Python code that could re-enter it.
# NOT THREAD-SAFE: these module-level buffers are shared by every call, so render() (and
# render_message) are for one thread only, the control plane's main loop where the scrape runs; on
# a free-threaded build, or called from a second thread, two calls would write the same buffers.
cdef Buf _bufs[N_SLOTS]
cdef Buf _node_buf
cdef Buf _gpu_buf
cdef Py_ssize_t _KEEP = 1 << 20  # a buffer grown past this by one huge node is given back after the call


cpdef tuple render(bytes data, str node, tuple opens):
    """The node's reading lines per slot of ``SLOTS`` (see nodetext_py.render)."""
    global _gpu_buf
    cdef Buf* bufs = _bufs
    cdef const char* op[N_SLOTS]
    cdef Py_ssize_t opn[N_SLOTS]
    cdef Ctx c
    cdef Py_ssize_t k, nn
    cdef const char* name
    cdef bytes o
    if len(opens) != N_SLOTS:
        raise ValueError(f"opens: {N_SLOTS} prefixes expected, got {len(opens)}")
    for k in range(N_SLOTS):
        o = <bytes?>opens[k]
        op[k] = PyBytes_AS_STRING(o)
        opn[k] = PyBytes_GET_SIZE(o)
        if not utf8_ok(<const unsigned char*>op[k], opn[k]):
            raise UnicodeDecodeError("utf-8", o, 0, opn[k], "invalid UTF-8")
        bufs[k].n = 0
    name = PyUnicode_AsUTF8AndSize(node, &nn)
    _node_buf.n = 0
    cdef list out
    try:
        put_escaped(&_node_buf, <const unsigned char*>name, nn)
        c.bufs = bufs
        c.op = op
        c.opn = opn
        c.node = <const unsigned char*>_node_buf.p if _node_buf.p != NULL else <const unsigned char*>""
        c.noden = _node_buf.n
        c.gpu = _gpu_buf
        try:
            render_all(&c, <const unsigned char*>PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data))
        finally:
            _gpu_buf = c.gpu  # (it may have grown)
        out = [PyBytes_FromStringAndSize(bufs[k].p, bufs[k].n) if bufs[k].n else b"" for k in range(N_SLOTS)]
    finally:
        for k in range(N_SLOTS):
            if bufs[k].cap > _KEEP:
                PyMem_Free(bufs[k].p)
                bufs[k].p = NULL
                bufs[k].n = bufs[k].cap = 0
    return tuple(out)


def render_message(msg, str node, tuple opens):
    """``render(msg.SerializeToString(), node, opens)`` (see nodetext_py.render_message)."""
    return render(msg.SerializeToString(), node, opens)
