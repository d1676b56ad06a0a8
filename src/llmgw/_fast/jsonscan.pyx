# cython: language_level=3
"""Scans of JSON text that build no document (compiled twin of ``jsonscan_py``; see
its docstring for the contract).

The request side: a validating scan that reads only the top-level ``model``, one
pass over the body, no objects built: the grammar of RFC 8259 with the same extra
rules as orjson (UTF-8 only, no BOM, unpaired surrogate escapes refused, nesting at
most 1024 deep, numbers that overflow a double refused). The answer side: where the
last whole SSE event of a read ends, and the token counts of the last ``"usage"``.
"""

cimport cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.stdint cimport uint64_t
from libc.string cimport memchr, memcmp, memcpy

import orjson

MAX_DEPTH = 1024

cdef enum:
    J_OK = 0
    J_EOF = 1
    J_CHAR = 2
    J_CONTROL = 3
    J_ESCAPE = 4
    J_SURROGATE = 5
    J_UTF8 = 6
    J_NUMBER = 7
    J_DEPTH = 8
    J_TRAILING = 9
    J_RANGE = 10
    J_BOM = 11
    J_KEY = 12

# Top-level members json_route reads (W_MODEL..: 1 + their place in _ROUTE_KEYS).
cdef enum:
    W_NONE = 0
    W_MODEL = 1
    W_MESSAGES = 2
    W_PROMPT = 3
    W_SESS0 = 4  # .. W_SESS0 + 2: the session keys, first found wins in this order

cdef tuple _ROUTE_KEYS = ("model", "messages", "prompt", "prompt_cache_key", "safety_identifier", "user")

# The most of the prompt hashed: max_blocks x block bytes.
ROUTE_MAX_BYTES = 65536

cdef tuple _MESSAGES = (
    "",
    "unexpected end of the body",
    "unexpected character",
    "unescaped control character in a string",
    "invalid escape in a string",
    "unpaired surrogate escape in a string",
    "invalid UTF-8",
    "malformed number",
    "nesting deeper than 1024 levels",
    "unexpected content after the JSON value",
    "number out of range",
    "a UTF-8 byte order mark is not allowed",
    "expected a string key",
)


class JSONScanError(ValueError):
    """The body is not valid JSON; ``pos`` is the byte offset of the problem."""

    def __init__(self, message, pos):
        super().__init__(f"{message} at byte {pos}")
        self.pos = pos


# 1 for bytes that may appear unescaped in a string and need no more checks
cdef unsigned char _PLAIN[256]
cdef int _k
for _k in range(256):
    _PLAIN[_k] = 1 if 0x20 <= _k < 0x80 and _k != 0x22 and _k != 0x5C else 0


cdef extern from *:
    """
    /* 16 bytes at a time where the compiler has vector extensions (GCC, Clang:
       SSE2 on x86-64, NEON on arm64): whether none of them is a byte that ends
       a plain run in a string (< 0x20, '"', backslash, >= 0x80). */
    #if defined(__GNUC__) || defined(__clang__)
    #define LLMGW_HAVE_V16 1
    typedef signed char llmgw_v16 __attribute__((vector_size(16)));
    static inline int llmgw_plain16(const unsigned char *p) {
        llmgw_v16 v, hit;
        __builtin_memcpy(&v, p, 16);
        /* signed: bytes >= 0x80 are negative, so v < 0x20 covers both ends */
        hit = (v < (llmgw_v16){32,32,32,32,32,32,32,32,32,32,32,32,32,32,32,32})
            | (v == (llmgw_v16){34,34,34,34,34,34,34,34,34,34,34,34,34,34,34,34})
            | (v == (llmgw_v16){92,92,92,92,92,92,92,92,92,92,92,92,92,92,92,92});
        unsigned long long w[2];
        __builtin_memcpy(w, &hit, 16);
        return (w[0] | w[1]) == 0;
    }
    #else
    #define LLMGW_HAVE_V16 0
    static inline int llmgw_plain16(const unsigned char *p) { (void)p; return 0; }
    #endif

    /* x86-64 (SSE2 is always there): where the first byte that ends a plain run
       is in the 16 at p, or 16 if there is none; one block settles a short
       string without a byte-at-a-time tail. */
    #if defined(__SSE2__) && (defined(__GNUC__) || defined(__clang__))
    #include <emmintrin.h>
    #define LLMGW_HAVE_MASK16 1
    static inline int llmgw_stop16(const unsigned char *p) {
        __m128i v = _mm_loadu_si128((const __m128i *)p);
        __m128i hit = _mm_or_si128(
            _mm_cmplt_epi8(v, _mm_set1_epi8(32)),
            _mm_or_si128(_mm_cmpeq_epi8(v, _mm_set1_epi8(34)), _mm_cmpeq_epi8(v, _mm_set1_epi8(92))));
        int m = _mm_movemask_epi8(hit);
        return m ? __builtin_ctz((unsigned)m) : 16;
    }
    #else
    #define LLMGW_HAVE_MASK16 0
    static inline int llmgw_stop16(const unsigned char *p) { (void)p; return 0; }
    #endif
    """
    bint LLMGW_HAVE_V16
    bint llmgw_plain16(const unsigned char* p) noexcept nogil
    bint LLMGW_HAVE_MASK16
    int llmgw_stop16(const unsigned char* p) noexcept nogil


cdef inline bint _plain8(const unsigned char* p) noexcept nogil:
    """Whether all 8 bytes at ``p`` are plain string bytes (SWAR: no byte < 0x20,
    ``"``, backslash or >= 0x80)."""
    cdef uint64_t x, q, b
    memcpy(&x, p, 8)
    q = x ^ 0x2222222222222222ULL
    b = x ^ 0x5C5C5C5C5C5C5C5CULL
    return (((x - 0x2020202020202020ULL) & ~x)
            | ((q - 0x0101010101010101ULL) & ~q)
            | ((b - 0x0101010101010101ULL) & ~b)
            | x) & 0x8080808080808080ULL == 0


cdef inline bint _ws(unsigned char c) noexcept nogil:
    return c == 0x20 or c == 0x0A or c == 0x0D or c == 0x09


cdef inline int _hexval(unsigned char c) noexcept nogil:
    if 0x30 <= c <= 0x39:
        return c - 0x30
    if 0x61 <= c <= 0x66:
        return c - 0x61 + 10
    if 0x41 <= c <= 0x46:
        return c - 0x41 + 10
    return -1


cdef inline long _hex4(const unsigned char* s, Py_ssize_t i, Py_ssize_t n) noexcept nogil:
    cdef long v = 0
    cdef int d, k
    if i + 4 > n:
        return -1
    for k in range(4):
        d = _hexval(s[i + k])
        if d < 0:
            return -1
        v = v * 16 + d
    return v


cdef inline bint _cont(unsigned char c) noexcept nogil:
    return 0x80 <= c <= 0xBF


@cython.final
cdef class _Scan:
    """State of one scan: the error and the top-level ``model`` value's span."""

    cdef const unsigned char* s
    cdef Py_ssize_t n
    cdef int err
    cdef Py_ssize_t err_pos
    cdef bint escaped             # the last string scanned held an escape
    cdef Py_ssize_t model_start   # -1: no top-level "model" key
    cdef Py_ssize_t model_end
    cdef bint model_escaped
    cdef bint want_model          # the next value is the top-level "model"
    cdef unsigned char top        # first byte of the top-level value
    # (json_route only) the prompt's leading content and the session keys
    cdef bint route               # scan for them at all
    cdef int want                 # W_* of the next top-level value
    cdef int open_kind            # W_* of the top-level value being read (0: none)
    cdef Py_ssize_t open_start
    cdef Py_ssize_t msgs_start    # -1: no top-level "messages" array (the last one counts)
    cdef Py_ssize_t msgs_end
    cdef bint in_msgs             # the top-level "messages" array is open
    cdef bint want_role           # the next value is a message's "role"
    cdef Py_ssize_t role_start    # the current message's role value (-1: none yet)
    cdef Py_ssize_t role_end
    cdef Py_ssize_t anchor        # where the first message not from system/developer ends (-1: none)
    cdef bint later               # ... and more messages follow it (a conversation's later turn)
    cdef Py_ssize_t prompt_start  # -1: no top-level "prompt"
    cdef Py_ssize_t prompt_end
    cdef Py_ssize_t sess_start[3] # prompt_cache_key, safety_identifier, user (-1: none)
    cdef Py_ssize_t sess_end[3]

    cdef Py_ssize_t fail(self, int err, Py_ssize_t pos) noexcept:
        self.err = err
        self.err_pos = pos
        return -1

    cdef Py_ssize_t string(self, Py_ssize_t i) noexcept:
        """``i`` just past the opening quote; returns the index past the closing one."""
        cdef const unsigned char* s = self.s
        cdef Py_ssize_t n = self.n
        cdef unsigned char c, c1
        cdef long cp, lo
        cdef int k = 16
        self.escaped = False
        while True:
            if LLMGW_HAVE_MASK16:
                while i + 16 <= n:
                    k = llmgw_stop16(s + i)
                    i += k
                    if k < 16:
                        break
            elif LLMGW_HAVE_V16:
                while i + 16 <= n and llmgw_plain16(s + i):
                    i += 16
            if k == 16:  # (else s[i] is known to end the run)
                while i + 8 <= n and _plain8(s + i):
                    i += 8
                while i < n and _PLAIN[s[i]]:
                    i += 1
            k = 16
            if i >= n:
                return self.fail(J_EOF, n)
            c = s[i]
            if c == 0x22:
                return i + 1
            if c == 0x5C:
                self.escaped = True
                if i + 1 >= n:
                    return self.fail(J_EOF, n)
                c1 = s[i + 1]
                if c1 == 0x75:  # \uXXXX
                    cp = _hex4(s, i + 2, n)
                    if cp < 0:
                        return self.fail(J_ESCAPE, i)
                    if 0xDC00 <= cp <= 0xDFFF:
                        return self.fail(J_SURROGATE, i)
                    if 0xD800 <= cp <= 0xDBFF:
                        if i + 12 <= n and s[i + 6] == 0x5C and s[i + 7] == 0x75:
                            lo = _hex4(s, i + 8, n)
                            if 0xDC00 <= lo <= 0xDFFF:
                                i += 12
                                continue
                        return self.fail(J_SURROGATE, i)
                    i += 6
                    continue
                if (c1 == 0x22 or c1 == 0x5C or c1 == 0x2F or c1 == 0x62 or c1 == 0x66
                        or c1 == 0x6E or c1 == 0x72 or c1 == 0x74):
                    i += 2
                    continue
                return self.fail(J_ESCAPE, i)
            if c < 0x20:
                return self.fail(J_CONTROL, i)
            # a multi-byte UTF-8 sequence (RFC 3629 table 3-7)
            if 0xC2 <= c <= 0xDF:
                if i + 1 < n and _cont(s[i + 1]):
                    i += 2
                    continue
            elif 0xE0 <= c <= 0xEF:
                if i + 2 < n and _cont(s[i + 2]):
                    c1 = s[i + 1]
                    if ((c == 0xE0 and 0xA0 <= c1 <= 0xBF) or (c == 0xED and 0x80 <= c1 <= 0x9F)
                            or (c != 0xE0 and c != 0xED and _cont(c1))):
                        i += 3
                        continue
            elif 0xF0 <= c <= 0xF4:
                if i + 3 < n and _cont(s[i + 2]) and _cont(s[i + 3]):
                    c1 = s[i + 1]
                    if ((c == 0xF0 and 0x90 <= c1 <= 0xBF) or (c == 0xF4 and 0x80 <= c1 <= 0x8F)
                            or (0xF1 <= c <= 0xF3 and _cont(c1))):
                        i += 4
                        continue
            return self.fail(J_UTF8, i)

    cdef Py_ssize_t number(self, Py_ssize_t i) except? -2:
        cdef const unsigned char* s = self.s
        cdef Py_ssize_t n = self.n
        cdef Py_ssize_t start = i
        cdef bint big = False
        if s[i] == 0x2D:
            i += 1
        if i >= n:
            return self.fail(J_EOF, n)
        if s[i] == 0x30:
            i += 1
        elif 0x31 <= s[i] <= 0x39:
            while i < n and 0x30 <= s[i] <= 0x39:
                i += 1
        else:
            return self.fail(J_NUMBER, i)
        if i - start > 300:
            big = True
        if i < n and s[i] == 0x2E:
            i += 1
            if i >= n or not (0x30 <= s[i] <= 0x39):
                return self.fail(J_NUMBER, i)
            while i < n and 0x30 <= s[i] <= 0x39:
                i += 1
        if i < n and (s[i] == 0x65 or s[i] == 0x45):
            i += 1
            if i < n and (s[i] == 0x2B or s[i] == 0x2D):
                i += 1
            if i >= n or not (0x30 <= s[i] <= 0x39):
                return self.fail(J_NUMBER, i)
            while i < n and 0x30 <= s[i] <= 0x39:
                i += 1
            big = True
        if big:
            # Rare: a number that may not fit a double (as orjson, refuse infinity).
            v = float((<const char*>s)[start:i])
            if v == float("inf") or v == float("-inf"):
                return self.fail(J_RANGE, start)
        return i

    cdef Py_ssize_t literal(self, Py_ssize_t i) noexcept:
        cdef const unsigned char* s = self.s
        cdef Py_ssize_t n = self.n
        cdef unsigned char c = s[i]
        if c == 0x74:  # true
            if i + 4 <= n and s[i + 1] == 0x72 and s[i + 2] == 0x75 and s[i + 3] == 0x65:
                return i + 4
        elif c == 0x66:  # false
            if (i + 5 <= n and s[i + 1] == 0x61 and s[i + 2] == 0x6C and s[i + 3] == 0x73
                    and s[i + 4] == 0x65):
                return i + 5
        elif c == 0x6E:  # null
            if i + 4 <= n and s[i + 1] == 0x75 and s[i + 2] == 0x6C and s[i + 3] == 0x6C:
                return i + 4
        return self.fail(J_CHAR, i)

    cdef bint is_model_key(self, Py_ssize_t start, Py_ssize_t end) except -1:
        """Whether the key string ``s[start:end]`` (quotes included) reads ``model``."""
        cdef const unsigned char* s = self.s
        if not self.escaped:
            return (end - start == 7 and s[start + 1] == 0x6D and s[start + 2] == 0x6F
                    and s[start + 3] == 0x64 and s[start + 4] == 0x65 and s[start + 5] == 0x6C)
        return orjson.loads((<const char*>s)[start:end]) == "model"

    cdef int route_key(self, Py_ssize_t start, Py_ssize_t end) except -1:
        """The W_* kind of the top-level key ``s[start:end]`` (quotes included)."""
        cdef const unsigned char* s = self.s
        cdef Py_ssize_t n = end - start - 2
        cdef const char* k = <const char*>s + start + 1
        if self.escaped:
            name = orjson.loads((<const char*>s)[start:end])
            for j in range(len(_ROUTE_KEYS)):
                if name == _ROUTE_KEYS[j]:
                    return j + 1
            return W_NONE
        if n == 5 and memcmp(k, b"model", 5) == 0:
            return W_MODEL
        if n == 8 and memcmp(k, b"messages", 8) == 0:
            return W_MESSAGES
        if n == 6 and memcmp(k, b"prompt", 6) == 0:
            return W_PROMPT
        if n == 16 and memcmp(k, b"prompt_cache_key", 16) == 0:
            return W_SESS0
        if n == 17 and memcmp(k, b"safety_identifier", 17) == 0:
            return W_SESS0 + 1
        if n == 4 and memcmp(k, b"user", 4) == 0:
            return W_SESS0 + 2
        return W_NONE

    cdef inline void route_value_start(self, Py_ssize_t i) noexcept:
        # (a top-level value begins at i)
        self.open_kind = self.want
        self.want = W_NONE
        self.open_start = i
        if self.open_kind == W_MESSAGES:  # (the last "messages" counts)
            self.in_msgs = self.s[i] == 0x5B
            self.anchor = -1
            self.later = False

    cdef void route_value_end(self, Py_ssize_t i) noexcept:
        # (the top-level value that began at open_start ends at i)
        cdef int kind = self.open_kind
        cdef Py_ssize_t start = self.open_start
        self.open_kind = W_NONE
        if kind == W_MESSAGES:
            self.in_msgs = False
            if self.s[start] == 0x5B:
                self.msgs_start = start
                self.msgs_end = i
            else:
                self.msgs_start = -1
        elif kind == W_PROMPT:
            self.prompt_start = start
            self.prompt_end = i
        elif kind >= W_SESS0:
            if self.s[start] == 0x22:  # a session key: strings only (the last one wins)
                self.sess_start[kind - W_SESS0] = start + 1
                self.sess_end[kind - W_SESS0] = i - 1
            else:
                self.sess_start[kind - W_SESS0] = -1

    cdef bint system_role(self) noexcept:
        """Whether the message that just ended had the role "system" or "developer" (as written)."""
        cdef Py_ssize_t a = self.role_start, n = self.role_end - self.role_start
        if a < 0:
            return False
        return ((n == 8 and memcmp(<const char*>self.s + a, b'"system"', 8) == 0)
                or (n == 11 and memcmp(<const char*>self.s + a, b'"developer"', 11) == 0))

    cdef Py_ssize_t key(self, Py_ssize_t i, Py_ssize_t depth) except -2:
        """A member's key at ``i``: returns the index of its value (past the colon)."""
        cdef const unsigned char* s = self.s
        cdef Py_ssize_t n = self.n
        cdef Py_ssize_t start = i
        if i >= n:
            return self.fail(J_EOF, n)
        if s[i] != 0x22:
            return self.fail(J_KEY, i)
        i = self.string(i + 1)
        if i < 0:
            return -1
        self.want_model = depth == 1 and self.is_model_key(start, i)
        while i < n and _ws(s[i]):
            i += 1
        if i >= n:
            return self.fail(J_EOF, n)
        if s[i] != 0x3A:
            return self.fail(J_CHAR, i)
        i += 1
        while i < n and _ws(s[i]):
            i += 1
        return i

    cdef int run(self) except -1:
        """Scan the whole body; ``err`` says how it ended."""
        cdef const unsigned char* s = self.s
        cdef Py_ssize_t n = self.n
        cdef Py_ssize_t i = 0
        cdef Py_ssize_t depth = 0
        cdef unsigned char c
        cdef bint model_open = False
        cdef unsigned char stack[1024]  # 1: object, 0: array
        if n >= 3 and s[0] == 0xEF and s[1] == 0xBB and s[2] == 0xBF:
            self.fail(J_BOM, 0)
            return 0
        while i < n and _ws(s[i]):
            i += 1
        if i < n:
            self.top = s[i]
        while True:
            # -- a value starts at i --
            if i >= n:
                self.fail(J_EOF, n)
                return 0
            c = s[i]
            if self.want_model:
                # (the last top-level "model" wins, as in any JSON parser)
                self.want_model = False
                model_open = True
                self.model_start = i
                self.model_end = -1
            if c == 0x7B or c == 0x5B:  # { [
                if depth >= 1024:
                    self.fail(J_DEPTH, i)
                    return 0
                stack[depth] = 1 if c == 0x7B else 0
                depth += 1
                i += 1
                while i < n and _ws(s[i]):
                    i += 1
                if i >= n:
                    self.fail(J_EOF, n)
                    return 0
                if c == 0x7B and s[i] == 0x7D or c == 0x5B and s[i] == 0x5D:
                    i += 1
                    depth -= 1
                elif c == 0x7B:
                    i = self.key(i, depth)
                    if i < 0:
                        return 0
                    continue
                else:
                    continue
            elif c == 0x22:
                i = self.string(i + 1)
                if i < 0:
                    return 0
            elif c == 0x2D or 0x30 <= c <= 0x39:
                i = self.number(i)
                if i < 0:
                    return 0
            elif c == 0x74 or c == 0x66 or c == 0x6E:
                i = self.literal(i)
                if i < 0:
                    return 0
            else:
                self.fail(J_CHAR, i)
                return 0
            # -- a value ended at i; close containers as they end --
            while True:
                if model_open and depth == 1:
                    model_open = False
                    self.model_end = i
                    self.model_escaped = self.escaped
                while i < n and _ws(s[i]):
                    i += 1
                if depth == 0:
                    if i < n:
                        self.fail(J_TRAILING, i)
                    return 0
                if i >= n:
                    self.fail(J_EOF, n)
                    return 0
                c = s[i]
                if c == 0x2C:  # ,
                    i += 1
                    while i < n and _ws(s[i]):
                        i += 1
                    if stack[depth - 1]:
                        i = self.key(i, depth)
                        if i < 0:
                            return 0
                    break  # the next value
                if (c == 0x7D and stack[depth - 1]) or (c == 0x5D and not stack[depth - 1]):
                    i += 1
                    depth -= 1
                    continue  # a container ended: a value ended
                self.fail(J_CHAR, i)
                return 0


    cdef Py_ssize_t key_route(self, Py_ssize_t i, Py_ssize_t depth) except -2:
        """A member's key at ``i``: returns the index of its value (past the colon)."""
        cdef const unsigned char* s = self.s
        cdef Py_ssize_t n = self.n
        cdef Py_ssize_t start = i
        if i >= n:
            return self.fail(J_EOF, n)
        if s[i] != 0x22:
            return self.fail(J_KEY, i)
        i = self.string(i + 1)
        if i < 0:
            return -1
        if depth == 1:
            self.want = self.route_key(start, i)
            self.want_model = self.want == W_MODEL
            if self.want == W_MODEL:
                self.want = W_NONE
        else:
            self.want_model = False
            if depth == 3 and self.in_msgs:
                self.want_role = i - start == 6 and memcmp(<const char*>s + start, b'"role"', 6) == 0
        while i < n and _ws(s[i]):
            i += 1
        if i >= n:
            return self.fail(J_EOF, n)
        if s[i] != 0x3A:
            return self.fail(J_CHAR, i)
        i += 1
        while i < n and _ws(s[i]):
            i += 1
        return i

    cdef int run_route(self) except -1:
        """run() that also reads the routing key (json_route): a copy, so that json_model pays nothing."""
        cdef const unsigned char* s = self.s
        cdef Py_ssize_t n = self.n
        cdef Py_ssize_t i = 0
        cdef Py_ssize_t depth = 0
        cdef unsigned char c
        cdef bint model_open = False
        cdef unsigned char stack[1024]  # 1: object, 0: array
        if n >= 3 and s[0] == 0xEF and s[1] == 0xBB and s[2] == 0xBF:
            self.fail(J_BOM, 0)
            return 0
        while i < n and _ws(s[i]):
            i += 1
        if i < n:
            self.top = s[i]
        while True:
            # -- a value starts at i --
            if i >= n:
                self.fail(J_EOF, n)
                return 0
            c = s[i]
            if self.want_model:
                # (the last top-level "model" wins, as in any JSON parser)
                self.want_model = False
                model_open = True
                self.model_start = i
                self.model_end = -1
            if self.want != W_NONE and depth == 1:
                self.route_value_start(i)
            elif self.in_msgs:
                if depth == 2:
                    self.role_start = -1
                elif depth == 3 and self.want_role:
                    self.want_role = False
                    self.role_start = i
                    self.role_end = -1
            if c == 0x7B or c == 0x5B:  # { [
                if depth >= 1024:
                    self.fail(J_DEPTH, i)
                    return 0
                stack[depth] = 1 if c == 0x7B else 0
                depth += 1
                i += 1
                while i < n and _ws(s[i]):
                    i += 1
                if i >= n:
                    self.fail(J_EOF, n)
                    return 0
                if c == 0x7B and s[i] == 0x7D or c == 0x5B and s[i] == 0x5D:
                    i += 1
                    depth -= 1
                elif c == 0x7B:
                    i = self.key_route(i, depth)
                    if i < 0:
                        return 0
                    continue
                else:
                    continue
            elif c == 0x22:
                i = self.string(i + 1)
                if i < 0:
                    return 0
            elif c == 0x2D or 0x30 <= c <= 0x39:
                i = self.number(i)
                if i < 0:
                    return 0
            elif c == 0x74 or c == 0x66 or c == 0x6E:
                i = self.literal(i)
                if i < 0:
                    return 0
            else:
                self.fail(J_CHAR, i)
                return 0
            # -- a value ended at i; close containers as they end --
            while True:
                if model_open and depth == 1:
                    model_open = False
                    self.model_end = i
                    self.model_escaped = self.escaped
                if self.open_kind != W_NONE and depth == 1:
                    self.route_value_end(i)
                elif self.in_msgs:
                    if depth == 3 and self.role_start >= 0 and self.role_end < 0:
                        self.role_end = i
                    elif depth == 2:
                        if self.anchor >= 0:
                            self.later = True
                        elif not self.system_role():
                            self.anchor = i
                while i < n and _ws(s[i]):
                    i += 1
                if depth == 0:
                    if i < n:
                        self.fail(J_TRAILING, i)
                    return 0
                if i >= n:
                    self.fail(J_EOF, n)
                    return 0
                c = s[i]
                if c == 0x2C:  # ,
                    i += 1
                    while i < n and _ws(s[i]):
                        i += 1
                    if stack[depth - 1]:
                        i = self.key_route(i, depth)
                        if i < 0:
                            return 0
                    break  # the next value
                if (c == 0x7D and stack[depth - 1]) or (c == 0x5D and not stack[depth - 1]):
                    i += 1
                    depth -= 1
                    continue  # a container ended: a value ended
                self.fail(J_CHAR, i)
                return 0


cdef _Scan _scan(bytes body, Py_ssize_t route_cap=-1):
    cdef _Scan sc = _Scan.__new__(_Scan)
    sc.s = <const unsigned char*>PyBytes_AS_STRING(body)
    sc.n = PyBytes_GET_SIZE(body)
    sc.err = J_OK
    sc.model_start = -1
    sc.model_end = -1
    sc.want_model = False
    sc.top = 0
    sc.route = route_cap >= 0
    if sc.route:
        sc.want = W_NONE
        sc.open_kind = W_NONE
        sc.msgs_start = -1
        sc.in_msgs = False
        sc.want_role = False
        sc.role_start = -1
        sc.role_end = -1
        sc.anchor = -1
        sc.later = False
        sc.msgs_end = -1
        sc.prompt_start = -1
        sc.prompt_end = -1
        sc.sess_start[0] = sc.sess_start[1] = sc.sess_start[2] = -1
        sc.sess_end[0] = sc.sess_end[1] = sc.sess_end[2] = -1
        sc.run_route()
    else:
        sc.run()
    if sc.err != J_OK:
        raise JSONScanError(_MESSAGES[sc.err], sc.err_pos)
    return sc


cpdef tuple json_model(bytes body):
    """``(is_object, model)`` of a JSON body (see the twin); ``JSONScanError`` if invalid."""
    if body is None:
        raise TypeError("body must be bytes, not NoneType")
    cdef _Scan sc = _scan(body)
    cdef Py_ssize_t start = sc.model_start
    if sc.top != 0x7B:
        return (False, None)
    if start < 0 or sc.s[start] != 0x22:
        return (True, None)
    if not sc.model_escaped:
        return (True, PyUnicode_DecodeUTF8(<const char*>sc.s + start + 1, sc.model_end - start - 2, NULL))
    return (True, orjson.loads(body[start:sc.model_end]))


cpdef tuple model_span(bytes body):
    """``(start, end)`` of the top-level ``model`` value (see the twin); ``(-1, -1)`` if none."""
    if body is None:
        raise TypeError("body must be bytes, not NoneType")
    cdef _Scan sc = _scan(body)
    return (sc.model_start, sc.model_end)


# -- the prompt's blocks and the session key (see the twin) ----------------------

cdef extern from *:
    """
    /* One block of the chain (see jsonscan_py._block): 16 bytes at a time,
       two little-endian words folded by a 64x64->128-bit multiply (wyhash's
       "mum"), the tail zero-padded; then SplitMix64's finalizer. Never 0 (0
       marks an empty slot in the routers' tables). Not collision-resistant
       against an adversary: it only steers where a request goes. */
    #include <string.h>
    #include <stdint.h>
    static inline uint64_t llmgw_le64(const unsigned char *p) {
        uint64_t w;
        memcpy(&w, p, 8);
    #if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        w = __builtin_bswap64(w);
    #endif
        return w;
    }
    static inline uint64_t llmgw_tail64(const unsigned char *p, Py_ssize_t n) {
        uint64_t w = 0;  /* n < 8 bytes, little-endian, zero-padded */
        for (Py_ssize_t k = n - 1; k >= 0; k--)
            w = (w << 8) | p[k];
        return w;
    }
    static inline uint64_t llmgw_mum(uint64_t a, uint64_t b) {
        __uint128_t r = (__uint128_t)a * b;
        return (uint64_t)r ^ (uint64_t)(r >> 64);
    }
    static inline uint64_t llmgw_block_hash(uint64_t h, const unsigned char *p, Py_ssize_t n) {
        uint64_t a, b;
        Py_ssize_t i = 0, m;
        h ^= (uint64_t)n * 0x9E3779B97F4A7C15ULL;
        for (; i + 16 <= n; i += 16)
            h = llmgw_mum(llmgw_le64(p + i) ^ h ^ 0xA0761D6478BD642FULL, llmgw_le64(p + i + 8) ^ 0xE7037ED1A0B428DBULL);
        m = n - i;
        if (m > 0) {
            if (m >= 8) { a = llmgw_le64(p + i); b = llmgw_tail64(p + i + 8, m - 8); }
            else { a = llmgw_tail64(p + i, m); b = 0; }
            h = llmgw_mum(a ^ h ^ 0xA0761D6478BD642FULL, b ^ 0xE7037ED1A0B428DBULL);
        }
        h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9ULL;
        h = (h ^ (h >> 27)) * 0x94D049BB133111EBULL;
        h ^= h >> 31;
        return h ? h : 1;
    }

    /* The value of header `name` (lower-case, n bytes) in `lines` ("Name: value" CRLF
       lines, as the request reader forwards them); start/end of the value, or -1. */
    static Py_ssize_t llmgw_line_value(const char *s, Py_ssize_t len, const char *name, Py_ssize_t n,
                                       Py_ssize_t *end) {
        Py_ssize_t i = 0, j, e;
        while (i < len) {
            const char *nl = memchr(s + i, 10, (size_t)(len - i));
            e = nl ? (Py_ssize_t)(nl - s) : len;  /* the line is s[i:e] */
            if (e - i > n && s[i + n] == ':') {
                for (j = 0; j < n; j++) {
                    char c = s[i + j];
                    if (c >= 'A' && c <= 'Z') c += 32;
                    if (c != name[j]) break;
                }
                if (j == n) {
                    j = i + n + 1;
                    while (j < e && (s[j] == 32 || s[j] == 9)) j++;
                    while (e > j && (s[e - 1] == 13 || s[e - 1] == 32 || s[e - 1] == 9)) e--;
                    *end = e;
                    return j;
                }
            }
            i = e + 1;
        }
        return -1;
    }
    """
    uint64_t _block_hash "llmgw_block_hash" (uint64_t h, const unsigned char* p, Py_ssize_t n) noexcept nogil
    Py_ssize_t _line_value "llmgw_line_value" (const char* s, Py_ssize_t n, const char* name, Py_ssize_t m,
                                               Py_ssize_t* end) noexcept nogil

cdef uint64_t _CHAIN_SEED = 0x243F6A8885A308D3ULL
cdef uint64_t _KEY_SEED = 0x13198A2E03707344ULL


cdef bytes _chain(const unsigned char* p, Py_ssize_t n, Py_ssize_t block, Py_ssize_t anchor, bint later):
    # The routing key (see the twin): [anchor hash (0: none), anchor // block (bit 63: later
    # messages follow it), link 0, link 1, ...].
    cdef Py_ssize_t nb = (n + block - 1) // block
    cdef Py_ssize_t k, m
    cdef uint64_t h = _CHAIN_SEED, a = 0, ab = 0
    cdef bytes out
    cdef unsigned char* o
    if nb == 0:
        return b""
    out = PyBytes_FromStringAndSize(NULL, (nb + 2) * 8)
    o = <unsigned char*>PyBytes_AS_STRING(out)
    for k in range(nb):
        m = n - k * block
        if m > block:
            m = block
        if anchor > k * block and anchor < k * block + block:  # the anchor ends inside this block
            a = _block_hash(h, p + k * block, anchor - k * block)
        h = _block_hash(h, p + k * block, m)
        if anchor == k * block + block:  # ... or with it
            a = h
        memcpy(o + (k + 2) * 8, &h, 8)  # (native order: the pickers read it so)
    if a:
        ab = <uint64_t>(anchor // block)
        if later:
            ab |= 1ULL << 63
    memcpy(o, &a, 8)
    memcpy(o + 8, &ab, 8)
    return out


cpdef tuple json_route(bytes body, Py_ssize_t block, Py_ssize_t max_blocks):
    """``(is_object, model, chain, session)`` of a JSON body (see the twin)."""
    if body is None:
        raise TypeError("body must be bytes, not NoneType")
    if block < 8 or block % 8 or max_blocks < 1 or block * max_blocks > ROUTE_MAX_BYTES:
        raise ValueError("block must be a positive multiple of 8 and block * max_blocks at most 65536")
    cdef Py_ssize_t cap = block * max_blocks
    cdef _Scan sc = _scan(body, cap)
    cdef Py_ssize_t start = sc.model_start
    cdef Py_ssize_t n, k
    cdef object model = None
    cdef bytes chain
    cdef uint64_t sess = 0
    if sc.top != 0x7B:
        return (False, None, b"", 0)
    if start >= 0 and sc.s[start] == 0x22:
        if not sc.model_escaped:
            model = PyUnicode_DecodeUTF8(<const char*>sc.s + start + 1, sc.model_end - start - 2, NULL)
        else:
            model = orjson.loads(body[start:sc.model_end])
    if sc.msgs_start >= 0:
        n = sc.msgs_end - sc.msgs_start
        k = -1  # the anchor's offset in the stream, if within what is hashed
        if sc.anchor >= 0 and sc.anchor - sc.msgs_start <= cap:
            k = sc.anchor - sc.msgs_start
        chain = _chain(sc.s + sc.msgs_start, n if n < cap else cap, block, k, sc.later)
    elif sc.prompt_start >= 0:
        n = sc.prompt_end - sc.prompt_start
        chain = _chain(sc.s + sc.prompt_start, n if n < cap else cap, block, -1, False)
    else:
        chain = b""
    for k in range(3):
        if sc.sess_start[k] >= 0:
            sess = _block_hash(_KEY_SEED, sc.s + sc.sess_start[k], sc.sess_end[k] - sc.sess_start[k])
            break
    return (True, model, chain, sess)


cpdef uint64_t key_hash(bytes data) except? 0:
    """The session hash of ``data`` (a header's value; see the twin); never 0."""
    if data is None:
        raise TypeError("data must be bytes, not NoneType")
    return _block_hash(_KEY_SEED, <const unsigned char*>PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data))


cpdef uint64_t header_hash(bytes lines, bytes name) except? 0:
    """The session hash of header ``name``'s value in ``lines``; 0: absent or empty (see the twin)."""
    cdef Py_ssize_t end = 0, start
    if lines is None or name is None:
        raise TypeError("lines and name must be bytes, not None")
    start = _line_value(PyBytes_AS_STRING(lines), PyBytes_GET_SIZE(lines), PyBytes_AS_STRING(name),
                        PyBytes_GET_SIZE(name), &end)
    if start < 0 or end <= start:
        return 0
    return _block_hash(_KEY_SEED, <const unsigned char*>PyBytes_AS_STRING(lines) + start, end - start)


# -- the answer side: server-sent events and token usage (see the twin) ----------


cpdef Py_ssize_t sse_cut(bytes data) except -1:
    """Where the last complete server-sent event in ``data`` ends; 0: none (see the twin)."""
    cdef const char* s = PyBytes_AS_STRING(data)
    cdef Py_ssize_t i = PyBytes_GET_SIZE(data) - 1
    # from the end: the last LF that closes a blank line (LF LF, or LF CR LF)
    while i >= 1:
        if s[i] == 10:
            if s[i - 1] == 10:
                return i + 1
            if s[i - 1] == 13 and i >= 2 and s[i - 2] == 10:
                return i + 1
        i -= 1
    return 0


@cython.final
cdef class Needle:
    """One fixed byte string (a replica's key) looked for in many texts (see the twin): Horspool's
    shift table is made once, so a look costs a few steps for a short text, not a search's setup."""

    def __cinit__(self, bytes needle not None):
        cdef Py_ssize_t m = PyBytes_GET_SIZE(needle), i
        cdef const unsigned char* p = <const unsigned char*>PyBytes_AS_STRING(needle)
        if m == 0:
            raise ValueError("an empty needle")
        self.needle = needle
        self._m = m
        for i in range(256):
            self._shift[i] = m
        for i in range(m - 1):
            self._shift[p[i]] = m - 1 - i

    cpdef bint within(self, bytes data, Py_ssize_t start, Py_ssize_t end) except -1:
        """Whether the needle is in ``data[start:end]``."""
        if data is None:
            raise TypeError("within() needs bytes, not None")
        cdef Py_ssize_t n = PyBytes_GET_SIZE(data), m = self._m, i
        cdef const unsigned char* h = <const unsigned char*>PyBytes_AS_STRING(data)
        cdef const unsigned char* p = <const unsigned char*>PyBytes_AS_STRING(self.needle)
        cdef unsigned char last = p[m - 1], c
        if end > n:
            end = n
        if start < 0:
            start = 0
        if start > end - m:  # (too short; and start + m could overflow)
            return False
        i = start + m - 1
        while i < end:
            c = h[i]
            if c == last and memcmp(h + i - m + 1, p, m - 1) == 0:
                return True
            i += self._shift[c]
        return False


cdef Py_ssize_t _find(const char* s, Py_ssize_t start, Py_ssize_t end, const char* pat, Py_ssize_t m) noexcept nogil:
    # memchr for the second byte (the first of a JSON key is a quote, and quotes
    # are everywhere), then compare: the keys searched for here are near (a
    # general substring search's set-up costs more than this search); m >= 2
    cdef const char* p
    cdef const char* last = s + end - m + 1
    cdef const char* at = s + start + 1
    while at <= last:
        p = <const char*>memchr(at, pat[1], <size_t>(last - at + 1))
        if p == NULL:
            return -1
        if memcmp(p - 1, pat, m) == 0:
            return p - 1 - s
        at = p + 1
    return -1


cdef extern from *:
    """
    /* The last occurrence of pat (m bytes) in s[0:n], -1: none. Backwards,
       because engines put "usage" at the end of an answer; on x86-64 16 bytes
       at a time (SSE2) for the first byte of pat. */
    #if defined(__SSE2__) && (defined(__GNUC__) || defined(__clang__))
    #include <emmintrin.h>
    #endif
    static Py_ssize_t llmgw_rfind(const char *s, Py_ssize_t n, const char *pat, Py_ssize_t m) {
        Py_ssize_t i = n - m;  /* the last place pat can start */
    #if defined(__SSE2__) && (defined(__GNUC__) || defined(__clang__))
        __m128i first = _mm_set1_epi8(pat[0]);
        while (i >= 15) {
            unsigned mask = (unsigned)_mm_movemask_epi8(
                _mm_cmpeq_epi8(_mm_loadu_si128((const __m128i *)(s + i - 15)), first));
            while (mask) {
                int b = 31 - __builtin_clz(mask);
                if (memcmp(s + i - 15 + b, pat, (size_t)m) == 0)
                    return i - 15 + b;
                mask &= ~(1u << b);
            }
            i -= 16;
        }
    #endif
        for (; i >= 0; i--)
            if (s[i] == pat[0] && memcmp(s + i, pat, (size_t)m) == 0)
                return i;
        return -1;
    }
    """
    Py_ssize_t _rfind "llmgw_rfind" (const char* s, Py_ssize_t n, const char* pat, Py_ssize_t m) noexcept nogil


cdef inline bint _is_ws(char c) noexcept nogil:
    return c == 32 or c == 9 or c == 13 or c == 10


cdef long long _int_value(const char* s, Py_ssize_t start, Py_ssize_t end, const char* key,
                          Py_ssize_t klen) noexcept nogil:
    # -1: absent or not an integer
    cdef Py_ssize_t i = _find(s, start, end, key, klen)
    cdef Py_ssize_t j
    cdef long long v = 0
    if i < 0:
        return -1
    i += klen
    while i < end and _is_ws(s[i]):
        i += 1
    if i >= end or s[i] != 58:
        return -1
    i += 1
    while i < end and _is_ws(s[i]):
        i += 1
    j = i
    while j < end and j - i < 18 and s[j] >= 48 and s[j] <= 57:
        v = v * 10 + (s[j] - 48)
        j += 1
    if j == i:
        return -1
    return v


cpdef usage_counts(bytes data):
    """``(prompt_tokens, completion_tokens)`` of the last ``"usage"`` object (see the twin)."""
    cdef const char* s = PyBytes_AS_STRING(data)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(data)
    cdef Py_ssize_t at, end
    cdef long long prompt, completion, total
    at = _rfind(s, n, b'"usage"', 7)
    if at < 0:
        return None
    end = n if n < at + 1024 else at + 1024
    prompt = _int_value(s, at, end, b'"prompt_tokens"', 15)
    if prompt < 0:
        prompt = _int_value(s, at, end, b'"input_tokens"', 14)  # (/v1/responses)
        if prompt < 0:
            return None
    completion = _int_value(s, at, end, b'"completion_tokens"', 19)
    if completion < 0:
        completion = _int_value(s, at, end, b'"output_tokens"', 15)
        if completion < 0:
            total = _int_value(s, at, end, b'"total_tokens"', 14)  # (embeddings: no completion)
            if total < prompt:
                return None
            completion = total - prompt
    return (prompt, completion)
