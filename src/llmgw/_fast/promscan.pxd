# The contract of promscan.pyx; the spec is its pure twin, promscan_py.py.
#
# Call order: scan() -> Mapping._scan() -> per line _next_line(); for a wanted (or,
# strict, any) sample line _sample() -> _label_set() [-> _exemplar()]; values are
# converted with the GIL by _to_double() only for samples that count. parse() uses
# the same line reader. Every kernel below is `noexcept nogil` over (pointer, length)
# and returns an E_* code, 0 for success.

cdef enum:
    # Limits; promscan_py.py declares the same numbers.
    MAX_PAGE_BYTES = 16777216
    MAX_LINE_BYTES = 65536
    MAX_LABELS = 128
    MAX_NUMBER_BYTES = 64
    MAX_EXEMPLAR_CHARS = 128
    MAX_SIGNALS = 16
    MAX_NAMES = 64
    MAX_SELECT = 8

cdef enum:
    # Error codes: indexes into _MESSAGES (same numbering as the twin's _E_*).
    E_OK = 0
    E_PAGE_TOO_LARGE = 1
    E_LINE_TOO_LONG = 2
    E_AFTER_EOF = 3
    E_UNTERMINATED = 4
    E_NAME = 5
    E_NO_VALUE = 6
    E_LABELS_UNTERMINATED = 7
    E_LABEL_NAME = 8
    E_LABEL_RESERVED = 9
    E_LABEL_DUP = 10
    E_TOO_MANY_LABELS = 11
    E_LABEL_EQ = 12
    E_LABEL_QUOTE = 13
    E_LABEL_VALUE_UNTERMINATED = 14
    E_LABEL_ESCAPE = 15
    E_LABEL_UTF8 = 16
    E_LABEL_SEP = 17
    E_VALUE = 18
    E_TIMESTAMP = 19
    E_TRAILING = 20
    E_EXEMPLAR = 21
    E_EXEMPLAR_TOO_LONG = 22
    E_DESC_NAME = 23
    E_TYPE = 24
    E_UNIT = 25
    E_EOF_LINE = 26

cdef enum:
    # What _next_line() found.
    LINE_NONE = 0       # no line left
    LINE_BLANK = 1
    LINE_COMMENT = 2    # an ordinary comment, or a valid # HELP / # TYPE / # UNIT
    LINE_EOF = 3        # "# EOF"
    LINE_SAMPLE = 4     # a sample line, checked up to its name
    LINE_BAD = 5        # Cursor.err says why

cdef enum:
    # What _float_kind() found.
    F_BAD = 0
    F_DECIMAL = 1       # convert with PyOS_string_to_double
    F_PINF = 2
    F_NINF = 3
    F_NAN = 4

cdef enum:
    AGG_SUM = 0
    AGG_MAX = 1
    AGG_MEAN = 2


cdef struct Cursor:
    const char* p
    Py_ssize_t size         # page length
    Py_ssize_t pos          # where the next line starts
    Py_ssize_t lineno       # 1-based number of the current line
    bint eof                # a "# EOF" line has been read: any further line is an error
    Py_ssize_t start        # current line: first byte after leading blanks
    Py_ssize_t name_end     # LINE_SAMPLE: end of the metric name (p[name_end] is SP, HTAB or "{")
    Py_ssize_t end          # current line end, without its LF and a final CR
    int err                 # LINE_BAD: an E_* code


cdef struct LabelSpan:
    Py_ssize_t name_start
    Py_ssize_t name_end
    Py_ssize_t value_start  # raw value, between the quotes, still escaped
    Py_ssize_t value_end
    bint escaped            # the raw value holds a backslash escape


cdef struct Sample:
    # Filled by _sample(); spans index the page.
    int n_labels
    bint passes             # every label named by a filter has the filter's value
    int value_kind          # F_*
    Py_ssize_t value_start
    Py_ssize_t value_end
    LabelSpan labels[MAX_LABELS]


cdef struct Filter:
    # A label a counted sample must match when it carries it; points into bytes
    # objects that the Mapping (or scan()'s frame, for the model) keeps alive.
    const char* name
    Py_ssize_t name_len
    const char* value       # UTF-8, unescaped
    Py_ssize_t value_len


cdef struct Want:
    # One accepted sample name; points into a bytes object held by Mapping._keep.
    const char* name
    Py_ssize_t len


cdef struct Acc:
    # Running aggregate for one Want over the counted samples.
    double total
    double top
    Py_ssize_t count
    bint has_nan


cdef class Mapping:
    cdef readonly tuple signals       # signal names, in order
    cdef readonly tuple names         # per signal: accepted names, preferred first
    cdef readonly tuple aggregates    # per signal: "sum" | "max" | "mean"
    cdef readonly object model_label  # str | None
    cdef dict _select                 # label -> value (str)
    cdef list _keep                   # bytes objects the C arrays below point into
    cdef bytes _model_label_b
    cdef int _n_signals
    cdef int _n_wants
    cdef int _n_select
    cdef int _agg[MAX_SIGNALS]
    cdef int _first[MAX_SIGNALS + 1]  # wants of signal s are _wants[_first[s]:_first[s+1]]
    cdef Want _wants[MAX_NAMES]
    cdef Filter _filters[MAX_SELECT]

    cdef object _scan(self, bytes page, object model, bint strict)
