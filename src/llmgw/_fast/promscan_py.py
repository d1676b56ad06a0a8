"""Read routing signals from a Prometheus page: the pure-Python twin of ``promscan.pyx``.

This module is the readable spec; the compiled module matches it name for name,
limit for limit, result for result and error for error (line number and message).

What is read
------------
One grammar covers the Prometheus text format 0.0.4 and OpenMetrics 1.0 at the line
level, so a page in either dialect reads the same (``shared/reference/engines.md`` §7)::

    page      = *line                  ; lines end with LF; a CR before the LF is dropped
    line      = ws* ( sample | comment ) ws* | ws*      ; blank lines are skipped
    ws        = SP | HTAB
    sample    = name ws* [ labels ws* ] value [ ws+ timestamp ] [ ws+ exemplar ]
    name      = [a-zA-Z_:] *[a-zA-Z0-9_:]       ; followed by ws or "{"
    labels    = "{" ws* [ label *( ws* "," ws* label ) [ ws* "," ] ws* ] "}"
    label     = lname ws* "=" ws* DQUOTE *( char | "\\\\" | "\\\"" | "\\n" ) DQUOTE
    lname     = [a-zA-Z_] *[a-zA-Z0-9_]        ; not "__name__", unique in its set
    value     = float                          ; ParseFloat syntax, see below
    timestamp = float, finite                  ; int ms (0.0.4) or seconds (OpenMetrics)
    exemplar  = "#" ws+ labels ws+ float [ ws+ timestamp ]
    comment   = "#" ws+ ( "HELP" ws+ name [ ws text ]
                        | "TYPE" ws+ name ws+ type
                        | "UNIT" ws+ name [ ws+ unit ]
                        | "EOF" )
              | "#" anything-else              ; an ordinary comment, ignored

``float`` is ``[+-]? ( digits [ "." digits* ] | "." digits ) [ [eE] [+-]? digits ]``
or, in any letter case, ``[+-]? ( "inf" | "infinity" )`` or ``"nan"`` (no sign): what
Go's ``ParseFloat`` and Python's ``float`` both accept, less hex and ``_``. Label values
must be valid UTF-8 (the only escapes are ``\\\\``, ``\\"`` and ``\\n``); exemplar label
sets hold at most 128 characters (OpenMetrics). ``type`` is one of the 0.0.4 and
OpenMetrics types. After ``# EOF`` nothing may follow (one final LF aside), and every
sample line must end with LF: an unterminated last line is a truncated page.

Not checked: family-level rules (one TYPE per family, TYPE before samples, grouping,
bucket order, ``le``/``quantile`` being numbers) and HELP text. They cannot change a
routing signal and checking them would cost state per family.

Two modes
---------
``scan(page, mapping)`` reads only what a :class:`Mapping` wants. Every line's shape up
to its metric name is checked, as are comments; a sample whose name is not wanted is
then skipped without reading its labels or value (and, in the compiled twin, without
creating any object). A wanted sample is read in full.

* ``strict=False`` (the default, what the poller uses): a bad line is skipped and
  counted; the result carries the count and the first error. Checklist item 5 of the
  reference: one odd line must not blind the router to a whole replica.
* ``strict=True``: every line is read in full, and the first bad one raises
  :class:`~llmgw.errors.PromParseError`.

``parse(page)`` reads every sample (strictly) and returns ``(name, labels, value)``
triples; tests compare it with ``prometheus_client``'s parsers.

Limits (a hostile page cannot make either twin allocate or loop without bound): a page
over ``MAX_PAGE_BYTES`` raises whatever the mode, naming the line that crosses the limit;
a line over ``MAX_LINE_BYTES``, a label set over ``MAX_LABELS`` labels, or a number over
``MAX_NUMBER_BYTES`` characters is a bad line.
"""

from __future__ import annotations

import re
from collections.abc import Mapping as _Mapping
from collections.abc import Sequence
from typing import NamedTuple

from llmgw.errors import PromParseError

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

MAX_PAGE_BYTES = 16 * 1024 * 1024
MAX_LINE_BYTES = 64 * 1024
MAX_LABELS = 128
MAX_NUMBER_BYTES = 64
MAX_EXEMPLAR_CHARS = 128
MAX_SIGNALS = 16
MAX_NAMES = 64
MAX_SELECT = 8

AGGREGATES = ("sum", "max", "mean")

# Error codes: indexes into _MESSAGES. promscan.pxd declares the same numbers.
_E_PAGE_TOO_LARGE = 1
_E_LINE_TOO_LONG = 2
_E_AFTER_EOF = 3
_E_UNTERMINATED = 4
_E_NAME = 5
_E_NO_VALUE = 6
_E_LABELS_UNTERMINATED = 7
_E_LABEL_NAME = 8
_E_LABEL_RESERVED = 9
_E_LABEL_DUP = 10
_E_TOO_MANY_LABELS = 11
_E_LABEL_EQ = 12
_E_LABEL_QUOTE = 13
_E_LABEL_VALUE_UNTERMINATED = 14
_E_LABEL_ESCAPE = 15
_E_LABEL_UTF8 = 16
_E_LABEL_SEP = 17
_E_VALUE = 18
_E_TIMESTAMP = 19
_E_TRAILING = 20
_E_EXEMPLAR = 21
_E_EXEMPLAR_TOO_LONG = 22
_E_DESC_NAME = 23
_E_TYPE = 24
_E_UNIT = 25
_E_EOF_LINE = 26

_MESSAGES = (
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

_AGG_SUM, _AGG_MAX, _AGG_MEAN = 0, 1, 2

_TYPES = frozenset((b"counter", b"gauge", b"histogram", b"summary", b"untyped"))
_TYPES |= {b"unknown", b"gaugehistogram", b"stateset", b"info"}  # OpenMetrics

_NAME = re.compile(rb"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(rb"[a-zA-Z_][a-zA-Z0-9_]*")
_UNIT = re.compile(rb"[a-zA-Z0-9_:]+")
_WS = re.compile(rb"[ \t]*")
_TOKEN = re.compile(rb"[^ \t]*")
_PLAIN = re.compile(rb'[^"\\]*')
_DECIMAL = re.compile(rb"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_ESCAPE = re.compile(rb'\\[\\"n]')
_UNESCAPED = {b"\\\\": b"\\", b'\\"': b'"', b"\\n": b"\n"}
_SPECIAL = {
    b"inf": float("inf"),
    b"+inf": float("inf"),
    b"-inf": float("-inf"),
    b"infinity": float("inf"),
    b"+infinity": float("inf"),
    b"-infinity": float("-inf"),
    b"nan": float("nan"),
}
_VALID_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_VALID_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")

_SP, _TAB, _CR, _HASH, _EQ, _DQUOTE, _COMMA, _LBRACE, _RBRACE, _BSLASH = b' \t\r#=",{}\\'


def _skip_ws(line: bytes, k: int, end: int) -> int:
    """Index of the first byte at or after ``k`` that is not a space or tab."""
    return _WS.match(line, k, end).end()  # type: ignore[union-attr]  # [ \t]* always matches


def _token_end(line: bytes, k: int, end: int) -> int:
    """Index of the first space or tab at or after ``k`` (or ``end``)."""
    return _TOKEN.match(line, k, end).end()  # type: ignore[union-attr]  # [^ \t]* always matches


class ScanResult(NamedTuple):
    """What :func:`scan` read from one page.

    Attributes:
        values: per signal of the mapping, in its order: the aggregated value, or
            ``None`` when no accepted name had a (counted) sample: absent, never 0.
            A NaN sample makes the value NaN.
        found: per signal, the accepted name that supplied the value, or ``None``.
        bad_lines: lines skipped as malformed (always 0 under ``strict=True``).
        error: the first of them, as the error ``strict=True`` would have raised.
        eof: whether the page ended with ``# EOF`` (an OpenMetrics page that is not
            cut short).
    """

    values: tuple[float | None, ...]
    found: tuple[str | None, ...]
    bad_lines: int
    error: PromParseError | None
    eof: bool


class _Bad(Exception):
    """A malformed line; ``code`` indexes ``_MESSAGES``. Never leaves this module."""

    def __init__(self, code: int) -> None:
        self.code = code


class Mapping:
    """The samples one reading wants, compiled once and reused for every page.

    Args:
        signals: signal name -> (accepted sample names, most preferred first;
            aggregate). The first accepted name with a sample on the page supplies the
            signal (old and new names are never added up). Samples of that name that
            differ in other labels (vLLM's ``engine``, SGLang's ``dp_rank``) combine by
            the aggregate: ``"sum"``, ``"max"`` or ``"mean"``. No names: the signal is
            always absent.
        model_label: the label that names the served model (vLLM's ``model_name``).
            When :func:`scan` is given a model, samples whose label has another value
            do not count; samples without the label still do.
        select: label -> value that a sample must have to count, when it has that
            label (e.g. ``{"tp_rank": "0"}``); samples without the label count.

    Raises:
        TypeError, ValueError: a malformed spec (names must be valid metric names).
    """

    __slots__ = (
        "_aggs",
        "_filters",
        "_model_label_b",
        "_names_flat",
        "_ranges",
        "_select",
        "_wants",
        "aggregates",
        "model_label",
        "names",
        "signals",
    )

    def __init__(
        self,
        signals: _Mapping[str, tuple[Sequence[str], str]],
        model_label: str | None = None,
        select: _Mapping[str, str] | None = None,
    ) -> None:
        if not isinstance(signals, _Mapping):
            raise TypeError("signals must be a mapping of signal name to (names, aggregate)")
        if len(signals) > MAX_SIGNALS:
            raise ValueError(f"at most {MAX_SIGNALS} signals")
        sig_names: list[str] = []
        all_names: list[tuple[str, ...]] = []
        aggs: list[str] = []
        for signal, spec in signals.items():
            if not isinstance(signal, str):
                raise TypeError("signal names must be str")
            try:
                names, agg = spec
            except (TypeError, ValueError):
                raise TypeError(f"signal {signal!r}: expected (names, aggregate)") from None
            if isinstance(names, (str, bytes)) or not isinstance(names, Sequence):
                raise TypeError(f"signal {signal!r}: names must be a sequence of str")
            names = tuple(names)
            for name in names:
                if not isinstance(name, str):
                    raise TypeError(f"signal {signal!r}: names must be a sequence of str")
                if not _VALID_NAME.fullmatch(name):
                    raise ValueError(f"signal {signal!r}: {name!r} is not a valid metric name")
            if len(set(names)) != len(names):
                raise ValueError(f"signal {signal!r}: a name is listed twice")
            if agg not in AGGREGATES:
                raise ValueError(f"signal {signal!r}: aggregate must be one of {', '.join(AGGREGATES)}")
            sig_names.append(signal)
            all_names.append(names)
            aggs.append(agg)
        if sum(len(n) for n in all_names) > MAX_NAMES:
            raise ValueError(f"at most {MAX_NAMES} names in all")
        if model_label is not None and (
            not isinstance(model_label, str) or not _VALID_LABEL.fullmatch(model_label)
        ):
            raise ValueError(f"model_label {model_label!r} is not a valid label name")
        sel: dict[str, str] = {}
        if select is not None:
            if not isinstance(select, _Mapping):
                raise TypeError("select must be a mapping of label name to value")
            if len(select) > MAX_SELECT:
                raise ValueError(f"at most {MAX_SELECT} select labels")
            for label, value in select.items():
                if not isinstance(label, str) or not _VALID_LABEL.fullmatch(label):
                    raise ValueError(f"select: {label!r} is not a valid label name")
                if not isinstance(value, str):
                    raise TypeError(f"select: the value for {label!r} must be str")
                if label == model_label:
                    raise ValueError(f"select: {label!r} is the model label; pass the model to scan()")
                sel[label] = value

        self.signals: tuple[str, ...] = tuple(sig_names)
        self.names: tuple[tuple[str, ...], ...] = tuple(all_names)
        self.aggregates: tuple[str, ...] = tuple(aggs)
        self.model_label: str | None = model_label
        self._select = sel
        self._aggs = tuple(AGGREGATES.index(a) for a in aggs)
        # Wants are numbered signal by signal, in preference order.
        flat: list[str] = []
        ranges: list[tuple[int, int]] = []
        wants: dict[bytes, tuple[int, ...]] = {}
        for names in all_names:
            first = len(flat)
            for name in names:
                wants[name.encode("ascii")] = (*wants.get(name.encode("ascii"), ()), len(flat))
                flat.append(name)
            ranges.append((first, len(flat)))
        self._names_flat = tuple(flat)
        self._ranges = tuple(ranges)
        self._wants = wants
        self._filters = {k.encode("ascii"): v.encode("utf-8") for k, v in sel.items()}
        self._model_label_b = model_label.encode("ascii") if model_label is not None else None

    @property
    def select(self) -> dict[str, str]:
        """The ``select`` filters (a copy)."""
        return dict(self._select)

    def __repr__(self) -> str:
        parts = ", ".join(
            f"{s}={n!r}/{a}" for s, n, a in zip(self.signals, self.names, self.aggregates, strict=True)
        )
        return f"Mapping({parts}, model_label={self.model_label!r}, select={self._select!r})"

    def scan(self, page: bytes, model: str | None = None, *, strict: bool = False) -> ScanResult:
        """Same as ``scan(page, self, model, strict=strict)``."""
        if type(page) is not bytes:
            raise TypeError("page must be bytes")
        filters = self._filters
        if model is not None:
            if not isinstance(model, str):
                raise TypeError("model must be str or None")
            if self._model_label_b is not None:
                filters = {**filters, self._model_label_b: model.encode("utf-8")}
        return _scan(page, self, filters or None, strict)


def scan(page: bytes, mapping: Mapping, model: str | None = None, *, strict: bool = False) -> ScanResult:
    """Read the signals ``mapping`` wants from one Prometheus / OpenMetrics page.

    Args:
        page: the whole response body.
        mapping: what to read, see :class:`Mapping`.
        model: count only samples for this model (by ``mapping.model_label``); samples
            that carry no model label count too. Ignored if the mapping has no model label.
        strict: raise on the first malformed line instead of skipping it.

    Returns:
        a :class:`ScanResult`.

    Raises:
        PromParseError: the page is over ``MAX_PAGE_BYTES``, or (``strict``) a line is malformed.
        TypeError: ``page`` is not bytes or ``mapping`` is not this module's Mapping.
    """
    if not isinstance(mapping, Mapping):
        raise TypeError("mapping must be a promscan Mapping from the same implementation")
    return mapping.scan(page, model, strict=strict)


def parse(page: bytes) -> list[tuple[str, dict[str, str], float]]:
    """Read every sample of a page, strictly.

    Returns:
        ``(name, labels, value)`` per sample line, in page order. Timestamps and
        exemplars are checked and dropped.

    Raises:
        PromParseError: the first malformed line, or a page over ``MAX_PAGE_BYTES``.
        TypeError: ``page`` is not bytes.
    """
    if type(page) is not bytes:
        raise TypeError("page must be bytes")
    out: list[tuple[str, dict[str, str], float]] = []
    lines, open_last = _split(page)
    eof = False
    for index, line in enumerate(lines):
        try:
            kind, start, name_end, end = _classify(line, eof, open_last and index == len(lines) - 1)
            if kind == _SAMPLE:
                labels: dict[str, str] = {}
                value, _ = _sample(line, name_end, end, None, labels)
                out.append((line[start:name_end].decode("ascii"), labels, value))
            elif kind == _EOF:
                eof = True
        except _Bad as exc:
            raise PromParseError(index + 1, _MESSAGES[exc.code]) from None
    return out


# -- the line reader -------------------------------------------------------------

_BLANK, _COMMENT, _EOF, _SAMPLE = range(4)


def _split(page: bytes) -> tuple[list[bytes], bool]:
    """Split a page into lines; also whether the last one lacks its LF."""
    if len(page) > MAX_PAGE_BYTES:
        raise PromParseError(page.count(b"\n", 0, MAX_PAGE_BYTES) + 1, _MESSAGES[_E_PAGE_TOO_LARGE])
    lines = page.split(b"\n")
    if lines[-1]:
        return lines, True
    lines.pop()
    return lines, False


def _classify(line: bytes, after_eof: bool, unterminated: bool) -> tuple[int, int, int, int]:
    """Check a line up to its metric name.

    Returns:
        (kind, start, name_end, end): ``end`` excludes a final CR; for a sample,
        ``line[start:name_end]`` is its name and ``line[name_end]`` a space, tab or "{".
    """
    if after_eof:
        raise _Bad(_E_AFTER_EOF)
    end = len(line)
    if end > MAX_LINE_BYTES:
        raise _Bad(_E_LINE_TOO_LONG)
    if end and line[end - 1] == _CR:
        end -= 1
    start = _skip_ws(line, 0, end)
    if start == end:
        return _BLANK, start, start, end
    if line[start] == _HASH:
        return (_EOF if _comment(line, start, end) else _COMMENT), start, start, end
    if unterminated:
        raise _Bad(_E_UNTERMINATED)
    m = _NAME.match(line, start, end)
    if m is None:
        raise _Bad(_E_NAME)
    name_end = m.end()
    if name_end == end:
        raise _Bad(_E_NO_VALUE)
    c = line[name_end]
    if c != _SP and c != _TAB and c != _LBRACE:
        raise _Bad(_E_NAME)
    return _SAMPLE, start, name_end, end


def _comment(line: bytes, k: int, end: int) -> bool:
    """Check a ``#`` line (``line[k]`` is the ``#``); true if it is ``# EOF``."""
    k += 1
    if k == end or (line[k] != _SP and line[k] != _TAB):
        return False
    k = _skip_ws(line, k, end)
    j = _token_end(line, k, end)
    keyword = line[k:j]
    if keyword == b"HELP" or keyword == b"TYPE" or keyword == b"UNIT":
        k = _skip_ws(line, j, end)
        m = _NAME.match(line, k, end)
        if m is None:
            raise _Bad(_E_DESC_NAME)
        k = m.end()
        if k < end and line[k] != _SP and line[k] != _TAB:
            raise _Bad(_E_DESC_NAME)
        if keyword == b"HELP":
            return False  # the rest is the docstring, not checked
        k = _skip_ws(line, k, end)
        j = _token_end(line, k, end)
        token = line[k:j]
        k = _skip_ws(line, j, end)
        if keyword == b"TYPE":
            if token not in _TYPES or k < end:
                raise _Bad(_E_TYPE)
        elif (token and _UNIT.fullmatch(token) is None) or k < end:
            raise _Bad(_E_UNIT)
        return False
    if keyword == b"EOF":
        if _skip_ws(line, j, end) < end:
            raise _Bad(_E_EOF_LINE)
        return True
    return False


def _float_kind(line: bytes, k: int, j: int) -> float | None:
    """``line[k:j]`` as a float if it is a valid one, else ``None``."""
    if k == j or j - k > MAX_NUMBER_BYTES:
        return None
    if _DECIMAL.fullmatch(line, k, j):
        return float(line[k:j])
    return _SPECIAL.get(line[k:j].lower())


def _finite(line: bytes, k: int, j: int) -> bool:
    """Whether ``line[k:j]`` is a valid timestamp: a number spelled without inf or nan."""
    return k < j and j - k <= MAX_NUMBER_BYTES and _DECIMAL.fullmatch(line, k, j) is not None


def _sample(
    line: bytes,
    k: int,
    end: int,
    filters: dict[bytes, bytes] | None,
    labels: dict[str, str] | None,
) -> tuple[float, bool]:
    """Read a sample line after its name (``line[k]``, a space, tab or "{", ends it).

    Args:
        filters: label -> wanted value (UTF-8), or None.
        labels: filled with the sample's labels, if given.

    Returns:
        (value, whether the sample passes ``filters``).
    """
    j = _skip_ws(line, k, end)
    if j == end:
        raise _Bad(_E_NO_VALUE)
    passes = True
    if line[j] == _LBRACE:
        j, passes, _ = _label_set(line, j, end, filters, labels)
        j = _skip_ws(line, j, end)
        if j == end:
            raise _Bad(_E_NO_VALUE)
    t = _token_end(line, j, end)
    value = _float_kind(line, j, t)
    if value is None:
        raise _Bad(_E_VALUE)
    j = _skip_ws(line, t, end)
    if j < end and line[j] != _HASH:
        t = _token_end(line, j, end)
        if not _finite(line, j, t):
            raise _Bad(_E_TIMESTAMP)
        j = _skip_ws(line, t, end)
        if j < end and line[j] != _HASH:
            raise _Bad(_E_TRAILING)
    if j < end:
        _exemplar(line, j, end)
    return value, passes


def _exemplar(line: bytes, j: int, end: int) -> None:
    """Check an exemplar (``line[j]`` is its ``#``)."""
    j += 1
    if j == end or (line[j] != _SP and line[j] != _TAB):
        raise _Bad(_E_EXEMPLAR)
    j = _skip_ws(line, j, end)
    if j == end or line[j] != _LBRACE:
        raise _Bad(_E_EXEMPLAR)
    j, _, chars = _label_set(line, j, end, None, None)
    if chars > MAX_EXEMPLAR_CHARS:
        raise _Bad(_E_EXEMPLAR_TOO_LONG)
    if j == end or (line[j] != _SP and line[j] != _TAB):
        raise _Bad(_E_EXEMPLAR)
    j = _skip_ws(line, j, end)
    t = _token_end(line, j, end)
    if _float_kind(line, j, t) is None:
        raise _Bad(_E_EXEMPLAR)
    j = _skip_ws(line, t, end)
    if j < end:
        t = _token_end(line, j, end)
        if not _finite(line, j, t):
            raise _Bad(_E_EXEMPLAR)
        if _skip_ws(line, t, end) < end:
            raise _Bad(_E_TRAILING)


def _label_set(
    line: bytes,
    j: int,
    end: int,
    filters: dict[bytes, bytes] | None,
    labels: dict[str, str] | None,
) -> tuple[int, bool, int]:
    """Read ``{...}`` (``line[j]`` is the ``{``).

    Returns:
        (index after the ``}``, whether it passes ``filters``, its length in characters
        (label names plus unescaped values, for the exemplar limit)).
    """
    j += 1
    seen: list[bytes] = []
    passes = True
    chars = 0
    while True:
        j = _skip_ws(line, j, end)
        if j == end:
            raise _Bad(_E_LABELS_UNTERMINATED)
        if line[j] == _RBRACE:
            return j + 1, passes, chars
        m = _LABEL_NAME.match(line, j, end)
        if m is None:
            raise _Bad(_E_LABEL_NAME)
        name = m.group()
        if name == b"__name__":
            raise _Bad(_E_LABEL_RESERVED)
        if name in seen:
            raise _Bad(_E_LABEL_DUP)
        if len(seen) == MAX_LABELS:
            raise _Bad(_E_TOO_MANY_LABELS)
        seen.append(name)
        j = _skip_ws(line, m.end(), end)
        if j == end or line[j] != _EQ:
            raise _Bad(_E_LABEL_EQ)
        j = _skip_ws(line, j + 1, end)
        if j == end or line[j] != _DQUOTE:
            raise _Bad(_E_LABEL_QUOTE)
        j += 1
        start = j
        escaped = False
        while True:
            j = _PLAIN.match(line, j, end).end()  # type: ignore[union-attr]
            if j == end:
                raise _Bad(_E_LABEL_VALUE_UNTERMINATED)
            if line[j] == _DQUOTE:
                break
            if j + 1 == end:  # a backslash with nothing after it
                raise _Bad(_E_LABEL_VALUE_UNTERMINATED)
            if line[j + 1] not in b'\\"n':
                raise _Bad(_E_LABEL_ESCAPE)
            escaped = True
            j += 2
        raw = line[start:j]
        j += 1
        if not raw.isascii():
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                raise _Bad(_E_LABEL_UTF8) from None
        value = _ESCAPE.sub(lambda m: _UNESCAPED[m.group()], raw) if escaped else raw
        if filters is not None:
            wanted = filters.get(name)
            if wanted is not None and wanted != value:
                passes = False
        if labels is not None:
            labels[name.decode("ascii")] = value.decode("utf-8")
        chars += len(name) + (len(value) if value.isascii() else len(value.decode("utf-8")))
        j = _skip_ws(line, j, end)
        if j == end:
            raise _Bad(_E_LABELS_UNTERMINATED)
        c = line[j]
        if c == _COMMA:
            j += 1
        elif c == _RBRACE:
            return j + 1, passes, chars
        else:
            raise _Bad(_E_LABEL_SEP)


def _scan(page: bytes, mapping: Mapping, filters: dict[bytes, bytes] | None, strict: bool) -> ScanResult:
    lines, open_last = _split(page)
    last = len(lines) - 1
    wants = mapping._wants
    nwants = len(mapping._names_flat)
    count = [0] * nwants
    total = [0.0] * nwants
    top = [0.0] * nwants
    has_nan = [False] * nwants
    bad = 0
    first: PromParseError | None = None
    eof = False
    for index, line in enumerate(lines):
        try:
            kind, start, name_end, end = _classify(line, eof, open_last and index == last)
            if kind != _SAMPLE:
                if kind == _EOF:
                    eof = True
                continue
            hits = wants.get(line[start:name_end])
            if hits is None:
                if strict:
                    _sample(line, name_end, end, None, None)
                continue
            value, passes = _sample(line, name_end, end, filters, None)
        except _Bad as exc:
            error = PromParseError(index + 1, _MESSAGES[exc.code])
            if strict:
                raise error from None
            bad += 1
            if first is None:
                first = error
            if exc.code == _E_AFTER_EOF:
                break
            continue
        if passes:
            for w in hits:
                if count[w] == 0 or value > top[w]:
                    top[w] = value
                if value != value:
                    has_nan[w] = True
                total[w] += value
                count[w] += 1
    values: list[float | None] = []
    found: list[str | None] = []
    for (lo, hi), agg in zip(mapping._ranges, mapping._aggs, strict=True):
        for w in range(lo, hi):
            if count[w]:
                if agg == _AGG_SUM:
                    values.append(total[w])
                elif agg == _AGG_MAX:
                    values.append(float("nan") if has_nan[w] else top[w])
                else:
                    values.append(total[w] / count[w])
                found.append(mapping._names_flat[w])
                break
        else:
            values.append(None)
            found.append(None)
    return ScanResult(tuple(values), tuple(found), bad, first, eof)
