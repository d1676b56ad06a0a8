# Read routing signals from a Prometheus page: the compiled twin of promscan_py.py.
#
# promscan_py.py is the spec (grammar, modes, limits); this module matches it result
# for result and error for error. The page is read once, line by line, from its
# `const char*`: memchr finds each line end; a sample line's metric name is checked
# and compared (length, then memcmp) with the few wanted names, and an unwanted line
# is left there without creating any Python object. Only wanted lines have their
# labels and value read.

cimport cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.ref cimport PyObject
from libc.math cimport INFINITY, NAN
from libc.string cimport memchr, memcmp, memcpy, memset

from llmgw.errors import PromParseError
from llmgw._fast.promscan_py import AGGREGATES, ScanResult
from llmgw._fast.promscan_py import Mapping as _SpecMapping


cdef extern from "Python.h":
    # Correctly rounded, locale-independent (unlike strtod); the token is checked first,
    # so it cannot fail, and overflow gives +-inf as float() does.
    double PyOS_string_to_double(const char* s, char** endptr, PyObject* overflow_exception) except? -1.0
    unicode PyUnicode_DecodeUTF8(const char* s, Py_ssize_t size, const char* errors)
    unicode PyUnicode_DecodeASCII(const char* s, Py_ssize_t size, const char* errors)


__all__ = [
    "AGGREGATES",
    "MAX_EXEMPLAR_CHARS",
    "MAX_LABELS",
    "MAX_LINE_BYTES",
    "MAX_NAMES",
    "MAX_NUMBER_BYTES",
    "MAX_PAGE_BYTES",
    "MAX_SELECT",
    "MAX_SIGNALS",
    "Mapping",
    "ScanResult",
    "parse",
    "scan",
]

# The limits as Python ints, under the twin's names.
globals().update(
    MAX_PAGE_BYTES=MAX_PAGE_BYTES,
    MAX_LINE_BYTES=MAX_LINE_BYTES,
    MAX_LABELS=MAX_LABELS,
    MAX_NUMBER_BYTES=MAX_NUMBER_BYTES,
    MAX_EXEMPLAR_CHARS=MAX_EXEMPLAR_CHARS,
    MAX_SIGNALS=MAX_SIGNALS,
    MAX_NAMES=MAX_NAMES,
    MAX_SELECT=MAX_SELECT,
)

# Same texts as the twin's _MESSAGES; the differential tests compare them.
cdef tuple _MESSAGES = (
    "",
    f"page is larger than {MAX_PAGE_BYTES} bytes",
    f"line is longer than {MAX_LINE_BYTES} bytes",
    "text after # EOF",
    "last line has no newline (truncated page?)",
    "invalid metric name",
    "sample has no value",
    "label set has no closing '}'",
    "invalid label name",
    "label name __name__ is reserved",
    "duplicate label name",
    f"more than {MAX_LABELS} labels",
    "expected '=' after label name",
    "label value must be in double quotes",
    "label value has no closing quote",
    "invalid escape in label value",
    "label value is not valid UTF-8",
    "expected ',' or '}' after label value",
    "invalid sample value",
    "invalid timestamp",
    "unexpected text after sample",
    "invalid exemplar",
    f"exemplar labels longer than {MAX_EXEMPLAR_CHARS} characters",
    "# HELP, # TYPE or # UNIT without a valid metric name",
    "invalid # TYPE line",
    "invalid # UNIT line",
    "text after # EOF on its line",
)


# -- character classes ------------------------------------------------------------

cdef enum:
    C_NAME_START = 1    # [a-zA-Z_:]
    C_NAME = 2          # [a-zA-Z0-9_:]  (also the UNIT characters)
    C_LABEL_START = 4   # [a-zA-Z_]
    C_LABEL = 8         # [a-zA-Z0-9_]
    C_DIGIT = 16        # [0-9]

cdef unsigned char _CLS[256]


cdef void _init_classes() noexcept:
    cdef int c
    memset(_CLS, 0, sizeof(_CLS))
    for c in range(256):
        if (c'a' <= c <= c'z') or (c'A' <= c <= c'Z') or c == c'_':
            _CLS[c] = C_NAME_START | C_NAME | C_LABEL_START | C_LABEL
        elif c'0' <= c <= c'9':
            _CLS[c] = C_NAME | C_LABEL | C_DIGIT
        elif c == c':':
            _CLS[c] = C_NAME_START | C_NAME


_init_classes()


cdef inline bint _is_ws(char c) noexcept nogil:
    return c == c' ' or c == c'\t'


cdef inline bint _has(char c, unsigned char cls) noexcept nogil:
    return (_CLS[<unsigned char>c] & cls) != 0


cdef inline Py_ssize_t _name_end(const char* p, Py_ssize_t j, Py_ssize_t end) noexcept nogil:
    """End of the run of metric-name characters starting at p[j]."""
    cdef const unsigned char* u = <const unsigned char*>p
    # PERF: names are most of what the skip path reads. Testing 8 bytes per branch
    # (independent table loads ANDed) made the whole scan of the vLLM page ~1.6x faster
    # than a byte-per-iteration loop.
    while j + 8 <= end and (
        _CLS[u[j]] & _CLS[u[j + 1]] & _CLS[u[j + 2]] & _CLS[u[j + 3]]
        & _CLS[u[j + 4]] & _CLS[u[j + 5]] & _CLS[u[j + 6]] & _CLS[u[j + 7]] & C_NAME
    ):
        j += 8
    while j < end and (_CLS[u[j]] & C_NAME):
        j += 1
    return j


cdef inline Py_ssize_t _skip_ws(const char* p, Py_ssize_t k, Py_ssize_t end) noexcept nogil:
    while k < end and (p[k] == c' ' or p[k] == c'\t'):
        k += 1
    return k


cdef inline Py_ssize_t _token_end(const char* p, Py_ssize_t k, Py_ssize_t end) noexcept nogil:
    while k < end and p[k] != c' ' and p[k] != c'\t':
        k += 1
    return k


cdef inline bint _lower_eq(const char* p, Py_ssize_t n, const char* word, Py_ssize_t wn) noexcept nogil:
    """ASCII case-insensitive comparison with a lower-case word."""
    cdef Py_ssize_t i
    cdef char c
    if n != wn:
        return False
    for i in range(n):
        c = p[i]
        if c'A' <= c <= c'Z':
            c = c + 32
        if c != word[i]:
            return False
    return True


# -- numbers ----------------------------------------------------------------------

cdef int _float_kind(const char* p, Py_ssize_t k, Py_ssize_t j) noexcept nogil:
    """Classify the token p[k:j] (twin: _float_kind / _finite)."""
    cdef Py_ssize_t i = k, digits = 0, exp_start
    cdef bint signed = False
    if k == j or j - k > MAX_NUMBER_BYTES:
        return F_BAD
    if p[i] == c'+' or p[i] == c'-':
        signed = True
        i += 1
    while i < j and _has(p[i], C_DIGIT):
        i += 1
        digits += 1
    if i < j and p[i] == c'.':
        i += 1
        while i < j and _has(p[i], C_DIGIT):
            i += 1
            digits += 1
    if digits:
        if i < j and (p[i] == c'e' or p[i] == c'E'):
            i += 1
            if i < j and (p[i] == c'+' or p[i] == c'-'):
                i += 1
            exp_start = i
            while i < j and _has(p[i], C_DIGIT):
                i += 1
            if i == exp_start:
                return F_BAD
        return F_DECIMAL if i == j else F_BAD
    i = k + signed
    if _lower_eq(p + i, j - i, "inf", 3) or _lower_eq(p + i, j - i, "infinity", 8):
        return F_NINF if p[k] == c'-' else F_PINF
    if not signed and _lower_eq(p + i, j - i, "nan", 3):
        return F_NAN
    return F_BAD


cdef double _to_double(const char* p, Py_ssize_t k, Py_ssize_t j, int kind) except? -1.0:
    """The value of a token _float_kind() accepted as `kind`."""
    cdef char buf[MAX_NUMBER_BYTES + 1]
    if kind == F_PINF:
        return INFINITY
    if kind == F_NINF:
        return -INFINITY
    if kind == F_NAN:
        return NAN
    # NOTE: the token is at most MAX_NUMBER_BYTES long (checked by _float_kind).
    memcpy(buf, p + k, <size_t>(j - k))
    buf[j - k] = 0
    return PyOS_string_to_double(buf, NULL, NULL)


# -- label values -----------------------------------------------------------------

cdef bint _utf8_ok(const unsigned char* s, Py_ssize_t n) noexcept nogil:
    """Well-formed UTF-8 (Unicode table 3-7), exactly what bytes.decode("utf-8") accepts."""
    cdef Py_ssize_t i = 0
    cdef unsigned char c, lo, hi
    cdef int more, k
    while i < n:
        c = s[i]
        if c < 0x80:
            i += 1
            continue
        lo = 0x80
        hi = 0xBF
        if 0xC2 <= c <= 0xDF:
            more = 1
        elif 0xE0 <= c <= 0xEF:
            more = 2
            if c == 0xE0:
                lo = 0xA0
            elif c == 0xED:
                hi = 0x9F  # no surrogates
        elif 0xF0 <= c <= 0xF4:
            more = 3
            if c == 0xF0:
                lo = 0x90
            elif c == 0xF4:
                hi = 0x8F  # nothing above U+10FFFF
        else:
            return False
        if i + more >= n:
            return False
        if not (lo <= s[i + 1] <= hi):
            return False
        for k in range(2, more + 1):
            if not (0x80 <= s[i + k] <= 0xBF):
                return False
        i += more + 1
    return True


cdef Py_ssize_t _chars(const char* p, Py_ssize_t k, Py_ssize_t j) noexcept nogil:
    """Characters in the unescaped, valid UTF-8 value whose raw bytes are p[k:j]."""
    cdef Py_ssize_t n = 0
    while k < j:
        if p[k] == c'\\':
            k += 2
        else:
            if (<unsigned char>p[k] & 0xC0) != 0x80:
                n += 1
            k += 1
            continue
        n += 1
    return n


cdef bint _value_eq(const char* p, Py_ssize_t k, Py_ssize_t j, bint escaped,
                    const char* want, Py_ssize_t wn) noexcept nogil:
    """Whether the raw (escaped) value p[k:j] unescapes to want[:wn]."""
    cdef Py_ssize_t i = 0
    cdef char c
    if not escaped:
        return j - k == wn and memcmp(p + k, want, <size_t>wn) == 0
    while k < j:
        c = p[k]
        if c == c'\\':
            k += 1
            c = p[k]
            if c == c'n':
                c = c'\n'
        if i == wn or want[i] != c:
            return False
        i += 1
        k += 1
    return i == wn


cdef inline unsigned long long _bloom_bit(const char* p, Py_ssize_t k, Py_ssize_t j) noexcept nogil:
    return 1ULL << (<unsigned int>((j - k) * 7 + <unsigned char>p[k] + <unsigned char>p[j - 1] * 3) & 63)


# -- lines ------------------------------------------------------------------------

cdef int _comment(const char* p, Py_ssize_t k, Py_ssize_t end) noexcept nogil:
    """Check a "#" line (p[k] is the "#"): 0 a comment, 1 "# EOF", or -E_* (twin: _comment)."""
    cdef Py_ssize_t j, m
    cdef char keyword
    k += 1
    if k == end or not _is_ws(p[k]):
        return 0
    k = _skip_ws(p, k, end)
    j = _token_end(p, k, end)
    if j - k == 4 and (
        memcmp(p + k, "HELP", 4) == 0 or memcmp(p + k, "TYPE", 4) == 0 or memcmp(p + k, "UNIT", 4) == 0
    ):
        keyword = p[k]
        k = _skip_ws(p, j, end)
        if k == end or not _has(p[k], C_NAME_START):
            return -E_DESC_NAME
        k = _name_end(p, k + 1, end)
        if k < end and not _is_ws(p[k]):
            return -E_DESC_NAME
        if keyword == c'H':
            return 0  # the rest is the docstring, not checked
        k = _skip_ws(p, k, end)
        j = _token_end(p, k, end)
        m = _skip_ws(p, j, end)
        if keyword == c'T':
            if m < end or not _is_type(p + k, j - k):
                return -E_TYPE
        else:
            if m < end:
                return -E_UNIT
            while k < j:
                if not _has(p[k], C_NAME):
                    return -E_UNIT
                k += 1
        return 0
    if j - k == 3 and memcmp(p + k, "EOF", 3) == 0:
        if _skip_ws(p, j, end) < end:
            return -E_EOF_LINE
        return 1
    return 0


cdef bint _is_type(const char* p, Py_ssize_t n) noexcept nogil:
    if n == 5:
        return memcmp(p, "gauge", 5) == 0
    if n == 7:
        return memcmp(p, "counter", 7) == 0 or memcmp(p, "summary", 7) == 0 or memcmp(p, "untyped", 7) == 0 \
            or memcmp(p, "unknown", 7) == 0
    if n == 9:
        return memcmp(p, "histogram", 9) == 0
    if n == 14:
        return memcmp(p, "gaugehistogram", 14) == 0
    if n == 8:
        return memcmp(p, "stateset", 8) == 0
    if n == 4:
        return memcmp(p, "info", 4) == 0
    return False


cdef inline int _bad(Cursor* c, int code) noexcept nogil:
    c.err = code
    return LINE_BAD


cdef inline int _next_line(Cursor* c) noexcept nogil:
    """Advance to the next line and check it up to its metric name (twin: _classify)."""
    cdef const char* p = c.p
    cdef const char* q
    cdef Py_ssize_t pos = c.pos, eol, end, k, j
    cdef bint unterminated
    cdef int r
    cdef char ch
    if pos >= c.size:
        return LINE_NONE
    c.lineno += 1
    q = <const char*>memchr(p + pos, c'\n', <size_t>(c.size - pos))
    if q == NULL:
        eol = c.size
        unterminated = True
        c.pos = eol
    else:
        eol = q - p
        unterminated = False
        c.pos = eol + 1
    if c.eof:
        return _bad(c, E_AFTER_EOF)
    if eol - pos > MAX_LINE_BYTES:
        return _bad(c, E_LINE_TOO_LONG)
    end = eol
    if end > pos and p[end - 1] == c'\r':
        end -= 1
    k = pos
    while k < end and (p[k] == c' ' or p[k] == c'\t'):
        k += 1
    c.start = k
    c.end = end
    if k == end:
        return LINE_BLANK
    if p[k] == c'#':
        r = _comment(p, k, end)
        if r < 0:
            return _bad(c, -r)
        if r:
            c.eof = True
            return LINE_EOF
        return LINE_COMMENT
    if unterminated:
        return _bad(c, E_UNTERMINATED)
    if not _has(p[k], C_NAME_START):
        return _bad(c, E_NAME)
    j = _name_end(p, k + 1, end)
    c.name_end = j
    if j == end:
        return _bad(c, E_NO_VALUE)
    ch = p[j]
    if ch != c' ' and ch != c'\t' and ch != c'{':
        return _bad(c, E_NAME)
    return LINE_SAMPLE


cdef int _label_set(const char* p, Py_ssize_t* pj, Py_ssize_t end, LabelSpan* out, int* count,
                    const Filter* filters, int nf, bint* passes, Py_ssize_t* chars) noexcept nogil:
    """Read "{...}" at p[pj[0]] into out[:count[0]]; pj[0] ends after the "}" (twin: _label_set).

    A label named by one of filters[:nf] with another value clears passes[0]; chars, if
    given, receives the set's length in characters (exemplar limit).
    """
    cdef Py_ssize_t j = pj[0] + 1, ns, ne, vs, ve
    cdef int n = 0, i, f
    cdef bint escaped, high
    cdef unsigned long long bloom = 0, bit
    cdef unsigned char ch
    count[0] = 0
    while True:
        j = _skip_ws(p, j, end)
        if j == end:
            return E_LABELS_UNTERMINATED
        if p[j] == c'}':
            pj[0] = j + 1
            return E_OK
        if not _has(p[j], C_LABEL_START):
            return E_LABEL_NAME
        ns = j
        j += 1
        while j < end and _has(p[j], C_LABEL):
            j += 1
        ne = j
        if ne - ns == 8 and memcmp(p + ns, "__name__", 8) == 0:
            return E_LABEL_RESERVED
        # PERF: a 64-bit hash of (length, first, last) skips the quadratic search for
        # nearly every label; a hostile set of MAX_LABELS labels stays bounded anyway.
        bit = _bloom_bit(p, ns, ne)
        if bloom & bit:
            for i in range(n):
                if out[i].name_end - out[i].name_start == ne - ns and \
                        memcmp(p + out[i].name_start, p + ns, <size_t>(ne - ns)) == 0:
                    return E_LABEL_DUP
        bloom |= bit
        if n == MAX_LABELS:
            return E_TOO_MANY_LABELS
        j = _skip_ws(p, j, end)
        if j == end or p[j] != c'=':
            return E_LABEL_EQ
        j = _skip_ws(p, j + 1, end)
        if j == end or p[j] != c'"':
            return E_LABEL_QUOTE
        j += 1
        vs = j
        escaped = False
        high = False
        while True:
            if j == end:
                return E_LABEL_VALUE_UNTERMINATED
            ch = <unsigned char>p[j]
            if ch == c'"':
                break
            if ch == c'\\':
                if j + 1 == end:
                    return E_LABEL_VALUE_UNTERMINATED
                ch = <unsigned char>p[j + 1]
                if ch != c'\\' and ch != c'"' and ch != c'n':
                    return E_LABEL_ESCAPE
                escaped = True
                j += 2
                continue
            if ch >= 0x80:
                high = True
            j += 1
        ve = j
        j += 1
        if high and not _utf8_ok(<const unsigned char*>p + vs, ve - vs):
            return E_LABEL_UTF8
        out[n].name_start = ns
        out[n].name_end = ne
        out[n].value_start = vs
        out[n].value_end = ve
        out[n].escaped = escaped
        n += 1
        count[0] = n
        for f in range(nf):
            if filters[f].name_len == ne - ns and memcmp(filters[f].name, p + ns, <size_t>(ne - ns)) == 0:
                if not _value_eq(p, vs, ve, escaped, filters[f].value, filters[f].value_len):
                    passes[0] = False
        if chars != NULL:
            chars[0] += (ne - ns) + _chars(p, vs, ve)
        j = _skip_ws(p, j, end)
        if j == end:
            return E_LABELS_UNTERMINATED
        if p[j] == c',':
            j += 1
        elif p[j] == c'}':
            pj[0] = j + 1
            return E_OK
        else:
            return E_LABEL_SEP


cdef int _exemplar(const char* p, Py_ssize_t j, Py_ssize_t end) noexcept nogil:
    """Check an exemplar (p[j] is its "#") (twin: _exemplar)."""
    cdef LabelSpan labels[MAX_LABELS]
    cdef int n = 0, code
    cdef bint passes = True
    cdef Py_ssize_t chars = 0, t
    j += 1
    if j == end or not _is_ws(p[j]):
        return E_EXEMPLAR
    j = _skip_ws(p, j, end)
    if j == end or p[j] != c'{':
        return E_EXEMPLAR
    code = _label_set(p, &j, end, labels, &n, NULL, 0, &passes, &chars)
    if code:
        return code
    if chars > MAX_EXEMPLAR_CHARS:
        return E_EXEMPLAR_TOO_LONG
    if j == end or not _is_ws(p[j]):
        return E_EXEMPLAR
    j = _skip_ws(p, j, end)
    t = _token_end(p, j, end)
    if _float_kind(p, j, t) == F_BAD:
        return E_EXEMPLAR
    j = _skip_ws(p, t, end)
    if j < end:
        t = _token_end(p, j, end)
        if _float_kind(p, j, t) != F_DECIMAL:
            return E_EXEMPLAR
        if _skip_ws(p, t, end) < end:
            return E_TRAILING
    return E_OK


cdef int _sample(const char* p, Py_ssize_t k, Py_ssize_t end, const Filter* filters, int nf,
                 Sample* s) noexcept nogil:
    """Read a sample line after its name (p[k] is SP, HTAB or "{") (twin: _sample)."""
    cdef Py_ssize_t j = _skip_ws(p, k, end), t
    cdef int code
    s.n_labels = 0
    s.passes = True
    if j == end:
        return E_NO_VALUE
    if p[j] == c'{':
        code = _label_set(p, &j, end, s.labels, &s.n_labels, filters, nf, &s.passes, NULL)
        if code:
            return code
        j = _skip_ws(p, j, end)
        if j == end:
            return E_NO_VALUE
    t = _token_end(p, j, end)
    s.value_kind = _float_kind(p, j, t)
    if s.value_kind == F_BAD:
        return E_VALUE
    s.value_start = j
    s.value_end = t
    j = _skip_ws(p, t, end)
    if j < end and p[j] != c'#':
        t = _token_end(p, j, end)
        if _float_kind(p, j, t) != F_DECIMAL:
            return E_TIMESTAMP
        j = _skip_ws(p, t, end)
        if j < end and p[j] != c'#':
            return E_TRAILING
    if j < end:
        return _exemplar(p, j, end)
    return E_OK


cdef Py_ssize_t _count_lf(const char* p, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t count = 0, pos = 0
    cdef const char* q
    while pos < n:
        q = <const char*>memchr(p + pos, c'\n', <size_t>(n - pos))
        if q == NULL:
            break
        count += 1
        pos = (q - p) + 1
    return count


cdef int _start(Cursor* c, bytes page) except -1:
    """Point c at page; refuse a page over MAX_PAGE_BYTES (twin: _split)."""
    c.p = PyBytes_AS_STRING(page)
    c.size = PyBytes_GET_SIZE(page)
    c.pos = 0
    c.lineno = 0
    c.eof = False
    c.err = E_OK
    if c.size > MAX_PAGE_BYTES:
        raise PromParseError(_count_lf(c.p, MAX_PAGE_BYTES) + 1, _MESSAGES[E_PAGE_TOO_LARGE])
    return 0


cdef str _label_value(const char* p, Py_ssize_t k, Py_ssize_t j, bint escaped):
    """The unescaped label value p[k:j] as str (valid UTF-8: checked while reading)."""
    cdef bytearray buf
    cdef char* out
    cdef Py_ssize_t n = 0
    cdef char c
    if not escaped:
        return PyUnicode_DecodeUTF8(p + k, j - k, NULL)
    buf = bytearray(j - k)
    out = buf
    while k < j:
        c = p[k]
        if c == c'\\':
            k += 1
            c = p[k]
            if c == c'n':
                c = c'\n'
        out[n] = c
        n += 1
        k += 1
    return PyUnicode_DecodeUTF8(out, n, NULL)


# -- public API -------------------------------------------------------------------

@cython.final
cdef class Mapping:
    """The samples one reading wants, compiled once and reused for every page.

    See promscan_py.Mapping: same arguments, checks and attributes.
    """

    def __init__(self, signals, model_label=None, select=None):
        cdef int s, w = 0
        cdef bytes b
        # The twin checks and normalises the spec, so both reject the same input alike.
        spec = _SpecMapping(signals, model_label, select)
        self.signals = spec.signals
        self.names = spec.names
        self.aggregates = spec.aggregates
        self.model_label = spec.model_label
        self._select = spec.select
        self._keep = []
        self._n_signals = len(self.signals)
        for s in range(self._n_signals):
            self._agg[s] = AGGREGATES.index(self.aggregates[s])
            self._first[s] = w
            for name in self.names[s]:
                b = name.encode("ascii")
                self._keep.append(b)
                self._wants[w].name = PyBytes_AS_STRING(b)
                self._wants[w].len = PyBytes_GET_SIZE(b)
                w += 1
        self._first[self._n_signals] = w
        self._n_wants = w
        self._n_select = 0
        for label, value in self._select.items():
            b = label.encode("ascii")
            self._keep.append(b)
            self._filters[self._n_select].name = PyBytes_AS_STRING(b)
            self._filters[self._n_select].name_len = PyBytes_GET_SIZE(b)
            b = value.encode("utf-8")
            self._keep.append(b)
            self._filters[self._n_select].value = PyBytes_AS_STRING(b)
            self._filters[self._n_select].value_len = PyBytes_GET_SIZE(b)
            self._n_select += 1
        self._model_label_b = None if self.model_label is None else self.model_label.encode("ascii")

    @property
    def select(self):
        """The ``select`` filters (a copy)."""
        return dict(self._select)

    def __repr__(self):
        parts = ", ".join(f"{s}={n!r}/{a}" for s, n, a in zip(self.signals, self.names, self.aggregates))
        return f"Mapping({parts}, model_label={self.model_label!r}, select={self._select!r})"

    def scan(self, page, model=None, *, bint strict=False):
        """Same as ``scan(page, self, model, strict=strict)``."""
        return _checked_scan(self, page, model, strict)

    cdef object _scan(self, bytes page, object model, bint strict):
        cdef Cursor cur
        cdef Sample smp
        cdef Acc acc[MAX_NAMES]
        cdef Filter filters[MAX_SELECT + 1]
        cdef int hits[MAX_NAMES]
        cdef int nf = self._n_select, kind, code, w, h, nhits, s
        cdef int first_code = E_OK
        cdef Py_ssize_t first_line = 0, bad = 0, nlen
        cdef double v
        cdef bytes model_b
        cdef const char* name
        _start(&cur, page)
        if nf:
            memcpy(filters, self._filters, nf * sizeof(Filter))
        if model is not None and self._model_label_b is not None:
            model_b = (<str>model).encode("utf-8")
            filters[nf].name = PyBytes_AS_STRING(self._model_label_b)
            filters[nf].name_len = PyBytes_GET_SIZE(self._model_label_b)
            filters[nf].value = PyBytes_AS_STRING(model_b)
            filters[nf].value_len = PyBytes_GET_SIZE(model_b)
            nf += 1
        memset(acc, 0, sizeof(acc))
        while True:
            kind = _next_line(&cur)
            if kind == LINE_SAMPLE:
                # PERF: the skip path. Compare the name with the wanted ones (length
                # first); an unwanted line costs no call and no object.
                name = cur.p + cur.start
                nlen = cur.name_end - cur.start
                nhits = 0
                for w in range(self._n_wants):
                    if self._wants[w].len == nlen and memcmp(self._wants[w].name, name, <size_t>nlen) == 0:
                        hits[nhits] = w
                        nhits += 1
                if nhits == 0 and not strict:
                    continue
                code = _sample(cur.p, cur.name_end, cur.end, filters, nf, &smp)
                if code == E_OK:
                    if nhits and smp.passes:
                        v = _to_double(cur.p, smp.value_start, smp.value_end, smp.value_kind)
                        for h in range(nhits):
                            w = hits[h]
                            if acc[w].count == 0 or v > acc[w].top:
                                acc[w].top = v
                            if v != v:
                                acc[w].has_nan = True
                            acc[w].total += v
                            acc[w].count += 1
                    continue
            elif kind == LINE_BAD:
                code = cur.err
            elif kind == LINE_NONE:
                break
            else:
                continue
            if strict:
                raise PromParseError(cur.lineno, _MESSAGES[code])
            bad += 1
            if first_code == E_OK:
                first_code = code
                first_line = cur.lineno
            if code == E_AFTER_EOF:
                break

        values = []
        found = []
        for s in range(self._n_signals):
            for w in range(self._first[s], self._first[s + 1]):
                if acc[w].count:
                    if self._agg[s] == AGG_SUM:
                        values.append(acc[w].total)
                    elif self._agg[s] == AGG_MAX:
                        values.append(NAN if acc[w].has_nan else acc[w].top)
                    else:
                        values.append(acc[w].total / <double>acc[w].count)
                    found.append(self.names[s][w - self._first[s]])
                    break
            else:
                values.append(None)
                found.append(None)
        error = None if first_code == E_OK else PromParseError(first_line, _MESSAGES[first_code])
        return ScanResult(tuple(values), tuple(found), bad, error, cur.eof)


cdef object _checked_scan(Mapping mapping, object page, object model, bint strict):
    if type(page) is not bytes:
        raise TypeError("page must be bytes")
    if model is not None and not isinstance(model, str):
        raise TypeError("model must be str or None")
    return mapping._scan(<bytes>page, model, strict)


def scan(page, mapping, model=None, *, bint strict=False):
    """Read the signals ``mapping`` wants from one Prometheus / OpenMetrics page.

    See promscan_py.scan: same arguments, result and errors.
    """
    if not isinstance(mapping, Mapping):
        raise TypeError("mapping must be a promscan Mapping from the same implementation")
    return _checked_scan(<Mapping>mapping, page, model, strict)


def parse(page):
    """Read every sample of a page, strictly: ``[(name, labels, value), ...]``.

    See promscan_py.parse: same result and errors.
    """
    cdef Cursor cur
    cdef Sample smp
    cdef int kind, code, i
    cdef const char* p
    cdef dict labels
    cdef LabelSpan* lab
    if type(page) is not bytes:
        raise TypeError("page must be bytes")
    _start(&cur, <bytes>page)
    p = cur.p
    out = []
    while True:
        kind = _next_line(&cur)
        if kind == LINE_NONE:
            break
        if kind == LINE_BAD:
            raise PromParseError(cur.lineno, _MESSAGES[cur.err])
        if kind != LINE_SAMPLE:
            continue
        code = _sample(p, cur.name_end, cur.end, NULL, 0, &smp)
        if code:
            raise PromParseError(cur.lineno, _MESSAGES[code])
        labels = {}
        for i in range(smp.n_labels):
            lab = &smp.labels[i]
            labels[PyUnicode_DecodeASCII(p + lab.name_start, lab.name_end - lab.name_start, NULL)] = \
                _label_value(p, lab.value_start, lab.value_end, lab.escaped)
        out.append((
            PyUnicode_DecodeASCII(p + cur.start, cur.name_end - cur.start, NULL),
            labels,
            _to_double(p, smp.value_start, smp.value_end, smp.value_kind),
        ))
    return out
