"""promscan: the Prometheus / OpenMetrics reader, both twins (``promscan`` fixture)."""

from __future__ import annotations

import importlib
import math
from pathlib import Path
from types import ModuleType

import pytest

from llmgw.errors import PromParseError

DATA = Path(__file__).parent.parent / "data"

W, R, K = "vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"
K_OLD = "vllm:gpu_cache_usage_perc"
VLLM = {"waiting": ((W,), "sum"), "running": ((R,), "sum"), "kv": ((K, K_OLD), "max")}


def one(promscan: ModuleType, line: bytes) -> tuple[str, dict[str, str], float]:
    samples = promscan.parse(line)
    assert len(samples) == 1
    return samples[0]


def err(promscan: ModuleType, page: bytes) -> PromParseError:
    with pytest.raises(PromParseError) as info:
        promscan.parse(page)
    return info.value


def same(a: float | None, b: float | None) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


# -- the line grammar -------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (b"up 1\n", ("up", {}, 1.0)),
        (b"up{} 1\n", ("up", {}, 1.0)),
        (b'a{b="c"} 2.5\n', ("a", {"b": "c"}, 2.5)),
        (b'a{b="c",} 2.5\n', ("a", {"b": "c"}, 2.5)),  # trailing comma
        (b'a{b="c",d="e"} 0\n', ("a", {"b": "c", "d": "e"}, 0.0)),
        (b'  a { b = "c" , d="e" , }   7  \n', ("a", {"b": "c", "d": "e"}, 7.0)),  # blanks everywhere
        (b'\ta\t{b="c"}\t7\t\n', ("a", {"b": "c"}, 7.0)),
        (b'a{b="c"}7\n', ("a", {"b": "c"}, 7.0)),
        (b"vllm:num_requests_waiting 3\n", ("vllm:num_requests_waiting", {}, 3.0)),
        (b"_:x_9 1\n", ("_:x_9", {}, 1.0)),
        (b'a{_b9="c"} 1\n', ("a", {"_b9": "c"}, 1.0)),
        (b"up 1\r\n", ("up", {}, 1.0)),  # CRLF
        (b"up 1", None),  # no final LF: truncated (checked below)
    ],
)
def test_sample_syntax(promscan: ModuleType, line: bytes, expected: object) -> None:
    if expected is None:
        assert err(promscan, line).lineno == 1
    else:
        assert one(promscan, line) == expected


@pytest.mark.parametrize(
    ("raw", "value"),
    [
        (rb"plain", "plain"),
        (rb"a\\b", "a\\b"),
        (rb"say \"hi\"", 'say "hi"'),
        (rb"two\nlines", "two\nlines"),
        (rb"\\n", "\\n"),  # an escaped backslash, then n
        (rb"\\\"", '\\"'),
        (b"a,b}c=d#e f", "a,b}c=d#e f"),  # separators inside quotes
        ("caf\u00e9 \u65e5\u672c \U0001f680".encode(), "caf\u00e9 \u65e5\u672c \U0001f680"),
        (b"tab\there", "tab\there"),
        (b"", ""),
    ],
)
def test_label_values(promscan: ModuleType, raw: bytes, value: str) -> None:
    assert one(promscan, b'm{l="' + raw + b'"} 1\n') == ("m", {"l": value}, 1.0)


@pytest.mark.parametrize(
    ("token", "value"),
    [
        (b"0", 0.0),
        (b"-0", -0.0),
        (b"42", 42.0),
        (b"+42", 42.0),
        (b"1.", 1.0),
        (b".5", 0.5),
        (b"-1.25", -1.25),
        (b"1e3", 1000.0),
        (b"1.7537953269352946e+09", 1.7537953269352946e09),
        (b"2.5E-3", 0.0025),
        (b"007", 7.0),
        (b"1e999", math.inf),
        (b"0.1", 0.1),
        (b"123456789012345678901234567890", 1.2345678901234568e29),
        (b"NaN", math.nan),
        (b"nan", math.nan),
        (b"+Inf", math.inf),
        (b"-Inf", -math.inf),
        (b"Inf", math.inf),
        (b"inf", math.inf),
        (b"-infinity", -math.inf),
        (b"+INFINITY", math.inf),
    ],
)
def test_values(promscan: ModuleType, token: bytes, value: float) -> None:
    got = one(promscan, b"m " + token + b"\n")[2]
    assert same(got, value)
    assert math.copysign(1.0, got) == math.copysign(1.0, value)


@pytest.mark.parametrize(
    "token",
    [
        b"1_000",
        b"0x10",
        b"+NaN",
        b"-nan",
        b"1e",
        b"1e+",
        b".",
        b"+",
        b"e5",
        b"--1",
        b"1.2.3",
        b"infx",
        b"in",
        b"1,5",
    ],
)
def test_invalid_values(promscan: ModuleType, token: bytes) -> None:
    e = err(promscan, b"ok 1\nm " + token + b"\n")
    assert (e.lineno, e.message) == (2, "invalid sample value")


def test_number_length_limit(promscan: ModuleType) -> None:
    ok = b"0." + b"1" * (promscan.MAX_NUMBER_BYTES - 2)
    assert one(promscan, b"m " + ok + b"\n")[2] == pytest.approx(0.1111111111)
    assert err(promscan, b"m " + ok + b"1\n").message == "invalid sample value"


@pytest.mark.parametrize(
    "line",
    [
        b"m 1 1712345678000\n",  # 0.0.4: int ms
        b"m 1 -5\n",
        b"m 1 1767225600.125\n",  # OpenMetrics: float seconds
        b"m 1\t\t1712345678000  \n",
    ],
)
def test_timestamps(promscan: ModuleType, line: bytes) -> None:
    assert one(promscan, line) == ("m", {}, 1.0)


@pytest.mark.parametrize("ts", [b"NaN", b"+Inf", b"x", b"12a"])
def test_invalid_timestamps(promscan: ModuleType, ts: bytes) -> None:
    assert err(promscan, b"m 1 " + ts + b"\n").message == "invalid timestamp"


def test_comments_and_descriptors(promscan: ModuleType) -> None:
    page = (
        b"# just a comment\n"
        b"#no space: a comment too\n"
        b"#\n"
        b"\n"
        b"   \n"
        b"# HELP m Free text: anything \\goes\\ here, even \xff bytes { and }\n"
        b"# HELP m2\n"
        b"# TYPE m gauge\n"
        b"  # TYPE m3 counter\n"
        b"# UNIT m_seconds seconds\n"
        b"# UNIT m_ratio\n"
        b"# help m lowercase is a comment\n"
        b"m 1\n"
    )
    assert promscan.parse(page) == [("m", {}, 1.0)]


@pytest.mark.parametrize(
    "kind",
    [
        b"counter",
        b"gauge",
        b"histogram",
        b"summary",
        b"untyped",
        b"unknown",
        b"gaugehistogram",
        b"stateset",
        b"info",
    ],
)
def test_types(promscan: ModuleType, kind: bytes) -> None:
    assert promscan.parse(b"# TYPE m " + kind + b"\n") == []


def test_histogram_and_summary(promscan: ModuleType) -> None:
    page = (
        b"# TYPE h histogram\n"
        b'h_bucket{le="0.1"} 1\n'
        b'h_bucket{le="+Inf"} 3\n'
        b"h_sum 0.7\n"
        b"h_count 3\n"
        b"# TYPE s summary\n"
        b's{quantile="0.5"} 0.2\n'
        b"s_sum 1\n"
        b"s_count 4\n"
    )
    assert promscan.parse(page) == [
        ("h_bucket", {"le": "0.1"}, 1.0),
        ("h_bucket", {"le": "+Inf"}, 3.0),
        ("h_sum", {}, 0.7),
        ("h_count", {}, 3.0),
        ("s", {"quantile": "0.5"}, 0.2),
        ("s_sum", {}, 1.0),
        ("s_count", {}, 4.0),
    ]


@pytest.mark.parametrize(
    "line",
    [
        b'c_total 3 # {trace_id="abc"} 1\n',
        b'c_total 3 # {trace_id="abc"} 1 1767225600.5\n',
        b'c_total 3 1767225600 # {trace_id="abc"} 1.0\n',
        b"c_total 3 # {} 1\n",
        b'c_total 3 # {a="1",b="2",} 1\n',
        b'c_total 3 #\t{a="x"}\t1\n',
    ],
)
def test_exemplars(promscan: ModuleType, line: bytes) -> None:
    assert one(promscan, line) == ("c_total", {}, 3.0)


def test_exemplar_length_limit(promscan: ModuleType) -> None:
    limit = promscan.MAX_EXEMPLAR_CHARS
    ok = b'c_total 3 # {t="' + b"x" * (limit - 1) + b'"} 1\n'
    assert one(promscan, ok)[2] == 3.0
    # Characters, not bytes: 127 two-byte characters still fit.
    wide = b'c_total 3 # {t="' + "\u00e9".encode() * (limit - 1) + b'"} 1\n'
    assert one(promscan, wide)[2] == 3.0
    # An escape is one character.
    escaped = b'c_total 3 # {t="' + b"\\n" * (limit - 1) + b'"} 1\n'
    assert one(promscan, escaped)[2] == 3.0
    too_long = b'c_total 3 # {t="' + b"x" * limit + b'"} 1\n'
    assert err(promscan, too_long).message == f"exemplar labels longer than {limit} characters"


def test_eof(promscan: ModuleType) -> None:
    assert promscan.parse(b"m 1\n# EOF\n") == [("m", {}, 1.0)]
    assert promscan.parse(b"m 1\n# EOF") == [("m", {}, 1.0)]  # the final LF is optional
    assert promscan.parse(b"m 1\n#  EOF  \n") == [("m", {}, 1.0)]
    m = promscan.Mapping({"m": (("m",), "sum")})
    assert promscan.scan(b"m 1\n# EOF\n", m).eof
    assert not promscan.scan(b"m 1\n", m).eof
    assert promscan.scan(b"# EOF\n", m).values == (None,)


@pytest.mark.parametrize(
    ("page", "lineno"),
    [
        (b"# EOF\nm 1\n", 2),
        (b"# EOF\n\n", 2),  # not even a blank line
        (b"m 1\n# EOF\n# EOF\n", 3),
        (b"# EOF\n# comment\n", 2),
    ],
)
def test_text_after_eof(promscan: ModuleType, page: bytes, lineno: int) -> None:
    e = err(promscan, page)
    assert (e.lineno, e.message) == (lineno, "text after # EOF")


def test_utf8_label_values(promscan: ModuleType) -> None:
    assert one(promscan, 'm{l="\u00e9"} 1\n'.encode())[1] == {"l": "\u00e9"}
    for bad in (b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf", b"\xe0\x80\xaf"):
        e = err(promscan, b'm{l="' + bad + b'"} 1\n')
        assert e.message == "label value is not valid UTF-8", bad


# -- malformed lines: typed error, right line ---------------------------------------


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (b"1m 1", "invalid metric name"),
        (b"m-x 1", "invalid metric name"),
        (b'{__name__="m"} 1', "invalid metric name"),
        (b"<html>", "invalid metric name"),
        (b"m", "sample has no value"),
        (b"m   ", "sample has no value"),
        (b'm{l="v"}', "sample has no value"),
        (b'm{l="v"', "label set has no closing '}'"),
        (b'm{l="v",', "label set has no closing '}'"),
        (b"m{", "label set has no closing '}'"),
        (b"m{,} 1", "invalid label name"),
        (b'm{9l="v"} 1', "invalid label name"),
        (b'm{l="v",,} 1', "invalid label name"),
        (b'm{"l"="v"} 1', "invalid label name"),
        (b'm{__name__="x"} 1', "label name __name__ is reserved"),
        (b'm{l="a",l="b"} 1', "duplicate label name"),
        (b'm{l:x="v"} 1', "expected '=' after label name"),
        (b"m{l} 1", "expected '=' after label name"),
        (b"m{l=v} 1", "label value must be in double quotes"),
        (b"m{l='v'} 1", "label value must be in double quotes"),
        (b'm{l="v} 1', "label value has no closing quote"),
        (b'm{l="v\\', "label value has no closing quote"),
        (b'm{l="\\t"} 1', "invalid escape in label value"),
        (b'm{l="\\x"} 1', "invalid escape in label value"),
        (b'm{l="a" x="b"} 1', "expected ',' or '}' after label value"),
        (b'm{l="a";x="b"} 1', "expected ',' or '}' after label value"),
        (b"m x", "invalid sample value"),
        (b"m 1 2 3", "unexpected text after sample"),
        (b"m 1 #", "invalid exemplar"),
        (b"m 1 # x", "invalid exemplar"),
        (b'm 1 #{a="b"} 1', "invalid exemplar"),
        (b'm 1 # {a="b"}', "invalid exemplar"),
        (b'm 1 # {a="b"}1', "invalid exemplar"),
        (b'm 1 # {a="b"} x', "invalid exemplar"),
        (b'm 1 # {a="b"} 1 NaN', "invalid exemplar"),
        (b'm 1 # {a="b"} 1 2 3', "unexpected text after sample"),
        (b'm 1 # {a="b" 1', "expected ',' or '}' after label value"),
        (b"# HELP", "# HELP, # TYPE or # UNIT without a valid metric name"),
        (b"# HELP 1m text", "# HELP, # TYPE or # UNIT without a valid metric name"),
        (b"# TYPE m{ gauge", "# HELP, # TYPE or # UNIT without a valid metric name"),
        (b"# UNIT", "# HELP, # TYPE or # UNIT without a valid metric name"),
        (b"# TYPE m", "invalid # TYPE line"),
        (b"# TYPE m Gauge", "invalid # TYPE line"),
        (b"# TYPE m gauge extra", "invalid # TYPE line"),
        (b"# TYPE m histogram_", "invalid # TYPE line"),
        (b"# UNIT m sec-onds", "invalid # UNIT line"),
        (b"# UNIT m seconds extra", "invalid # UNIT line"),
        (b"# EOF now", "text after # EOF on its line"),
    ],
)
def test_malformed_line(promscan: ModuleType, line: bytes, message: str) -> None:
    page = b"# HELP ok fine\nok 1\n\n" + line + b"\nok 2\n"
    e = err(promscan, page)
    assert isinstance(e, ValueError)
    assert (e.lineno, e.message) == (4, message)
    assert str(e) == f"line 4: {message}"
    # strict scan raises the same error; lenient scan counts it and goes on.
    m = promscan.Mapping({"ok": (("ok",), "sum"), "m": (("m",), "sum")})
    with pytest.raises(PromParseError) as info:
        promscan.scan(page, m, strict=True)
    assert (info.value.lineno, info.value.message) == (4, message)
    got = promscan.scan(page, m)
    assert got.values[0] == 3.0
    assert got.bad_lines == 1
    assert got.error is not None
    assert (got.error.lineno, got.error.message) == (4, message)


def test_unterminated_last_line(promscan: ModuleType) -> None:
    e = err(promscan, b"a 1\nb 2")
    assert (e.lineno, e.message) == (2, "last line has no newline (truncated page?)")
    # A truncated value must not be counted, even in the lenient mode.
    m = promscan.Mapping({"b": (("b",), "sum")})
    got = promscan.scan(b"b 1\nb 2", m)
    assert (got.values, got.found, got.bad_lines) == ((1.0,), ("b",), 1)
    assert got.error is not None and (got.error.lineno, got.error.message) == (2, e.message)
    # Comments and blank lines without LF are harmless.
    assert promscan.parse(b"a 1\n# HELP a x") == [("a", {}, 1.0)]
    assert promscan.parse(b"a 1\n   ") == [("a", {}, 1.0)]


# -- limits -------------------------------------------------------------------------


def test_limits_are_the_same_in_both_twins() -> None:
    from llmgw._fast import promscan_py

    assert promscan_py.MAX_PAGE_BYTES == 16 * 1024 * 1024
    assert promscan_py.MAX_LINE_BYTES == 64 * 1024


@pytest.mark.c_extension
def test_compiled_limits_match_twin() -> None:
    from llmgw._fast import promscan_py

    promscan = importlib.import_module("llmgw._fast.promscan")

    for name in promscan_py.__all__:
        if name.startswith("MAX_") or name == "AGGREGATES":
            assert getattr(promscan, name) == getattr(promscan_py, name), name
    assert promscan.__all__ == promscan_py.__all__
    assert promscan.ScanResult is promscan_py.ScanResult


def test_page_size_limit(promscan: ModuleType) -> None:
    limit = promscan.MAX_PAGE_BYTES
    line = b"#" + b"x" * (promscan.MAX_LINE_BYTES - 2) + b"\n"  # a comment, MAX_LINE_BYTES long
    full = line * (limit // len(line))
    assert len(full) == limit
    m = promscan.Mapping({"m": (("m",), "sum")})
    assert promscan.scan(full, m) == promscan.ScanResult((None,), (None,), 0, None, False)
    page = full + b"m 2\n"
    for call in (
        lambda: promscan.parse(page),
        lambda: promscan.scan(page, m),
        lambda: promscan.scan(page, m, strict=True),
    ):
        with pytest.raises(PromParseError) as info:
            call()
        assert info.value.lineno == limit // len(line) + 1
        assert info.value.message == f"page is larger than {limit} bytes"


def test_line_length_limit(promscan: ModuleType) -> None:
    limit = promscan.MAX_LINE_BYTES
    at = b"# HELP m " + b"x" * (limit - 9) + b"\n"
    assert promscan.parse(at + b"m 1\n") == [("m", {}, 1.0)]
    over = b"# HELP m " + b"x" * (limit - 8) + b"\n"
    e = err(promscan, b"m 1\n" + over)
    assert (e.lineno, e.message) == (2, f"line is longer than {limit} bytes")
    m = promscan.Mapping({"m": (("m",), "sum")})
    got = promscan.scan(b"m 1\n" + over + b"m 2\n", m)
    assert (got.values, got.bad_lines) == ((3.0,), 1)


def test_label_count_limit(promscan: ModuleType) -> None:
    limit = promscan.MAX_LABELS
    labels = b",".join(b'l%d="v"' % i for i in range(limit))
    _, got, _ = one(promscan, b"m{" + labels + b"} 1\n")
    assert len(got) == limit
    e = err(promscan, b"m{" + labels + b',x="v"} 1\n')
    assert e.message == f"more than {limit} labels"


def test_many_duplicate_checks_stay_fast(promscan: ModuleType) -> None:
    # Worst case for the duplicate-label check: MAX_LABELS labels on every wanted line.
    labels = b",".join(b'l%03d="v"' % i for i in range(promscan.MAX_LABELS))
    page = (b"m{" + labels + b"} 1\n") * 200
    m = promscan.Mapping({"m": (("m",), "sum")})
    assert promscan.scan(page, m).values == (200.0,)


# -- scan: what a mapping reads -------------------------------------------------------

VLLM_PAGE = (
    b"# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
    b"# TYPE vllm:num_requests_waiting gauge\n"
    b'vllm:num_requests_waiting{engine="0",model_name="llama"} 3.0\n'
    b'vllm:num_requests_waiting{engine="1",model_name="llama"} 4.0\n'
    b'vllm:num_requests_waiting{engine="0",model_name="qwen"} 40.0\n'
    b'vllm:num_requests_running{engine="0",model_name="llama"} 1.0\n'
    b'vllm:num_requests_running{engine="1",model_name="llama"} 2.0\n'
    b'vllm:kv_cache_usage_perc{engine="0",model_name="llama"} 0.25\n'
    b'vllm:kv_cache_usage_perc{engine="1",model_name="llama"} 0.5\n'
    b'vllm:gpu_cache_usage_perc{engine="0",model_name="llama"} 0.9\n'
)


def test_scan_sums_and_maxes(promscan: ModuleType) -> None:
    m = promscan.Mapping(VLLM, model_label="model_name")
    got = promscan.scan(VLLM_PAGE, m)
    assert got == promscan.ScanResult((47.0, 3.0, 0.5), (W, R, K), 0, None, False)
    # The first accepted name present wins: gpu_cache_usage_perc (0.9) is not read.
    assert got.values[2] == 0.5


def test_scan_model_filter(promscan: ModuleType) -> None:
    m = promscan.Mapping(VLLM, model_label="model_name")
    assert promscan.scan(VLLM_PAGE, m, "llama").values == (7.0, 3.0, 0.5)
    assert promscan.scan(VLLM_PAGE, m, "qwen").values == (40.0, None, None)
    assert promscan.scan(VLLM_PAGE, m, "nope") == promscan.ScanResult(
        (None, None, None), (None, None, None), 0, None, False
    )
    # Samples without the model label count for every model.
    page = VLLM_PAGE + W.encode() + b" 100\n"
    assert promscan.scan(page, m, "llama").values[0] == 107.0
    # A mapping without a model label ignores the model.
    plain = promscan.Mapping(VLLM)
    assert promscan.scan(VLLM_PAGE, plain, "llama").values == (47.0, 3.0, 0.5)


def test_scan_model_filter_unescapes(promscan: ModuleType) -> None:
    m = promscan.Mapping({"w": (("w",), "sum")}, model_label="model")
    page = b'w{model="a\\"b\\\\c\\nd"} 1\nw{model="a\\"b"} 10\nw{model="\xc3\xa9"} 100\n'
    assert promscan.scan(page, m, 'a"b\\c\nd').values == (1.0,)
    assert promscan.scan(page, m, 'a"b').values == (10.0,)
    assert promscan.scan(page, m, "\u00e9").values == (100.0,)
    assert promscan.scan(page, m, "a").values == (None,)


def test_old_name_when_new_is_absent(promscan: ModuleType) -> None:
    m = promscan.Mapping(VLLM, model_label="model_name")
    page = b'vllm:gpu_cache_usage_perc{engine="0",model_name="llama"} 0.75\n'
    got = promscan.scan(page, m, "llama")
    assert got.values == (None, None, 0.75)
    assert got.found == (None, None, K_OLD)


def test_preference_is_by_presence_after_filtering(promscan: ModuleType) -> None:
    m = promscan.Mapping(VLLM, model_label="model_name")
    page = b'vllm:kv_cache_usage_perc{model_name="other"} 0.1\nvllm:gpu_cache_usage_perc{model_name="llama"} 0.6\n'
    assert promscan.scan(page, m, "llama").found[2] == K_OLD


@pytest.mark.parametrize(
    ("agg", "expected"),
    [("sum", 6.0), ("max", 3.0), ("mean", 2.0)],
)
def test_aggregates(promscan: ModuleType, agg: str, expected: float) -> None:
    m = promscan.Mapping({"x": (("x",), agg)})
    assert promscan.scan(b'x{r="0"} 1\nx{r="1"} 3\nx{r="2"} 2\n', m).values == (expected,)


@pytest.mark.parametrize("agg", ["sum", "max", "mean"])
def test_nan_propagates(promscan: ModuleType, agg: str) -> None:
    m = promscan.Mapping({"x": (("x",), agg)})
    for page in (b"x 1\nx NaN\nx 3\n", b"x NaN\nx 1\n", b"x NaN\n"):
        assert math.isnan(promscan.scan(page, m).values[0])


def test_infinities(promscan: ModuleType) -> None:
    m = promscan.Mapping({"s": (("x",), "sum"), "m": (("x",), "max")})
    assert promscan.scan(b"x -Inf\nx 1\n", m).values == (-math.inf, 1.0)
    assert math.isnan(promscan.scan(b"x -Inf\nx +Inf\n", m).values[0])


def test_same_name_in_two_signals(promscan: ModuleType) -> None:
    m = promscan.Mapping({"a": (("x", "y"), "sum"), "b": (("y",), "max")})
    assert promscan.scan(b"y 2\ny 5\n", m) == promscan.ScanResult((7.0, 5.0), ("y", "y"), 0, None, False)


def test_signal_without_names_is_absent(promscan: ModuleType) -> None:
    m = promscan.Mapping({"waiting": (("llamacpp:requests_deferred",), "sum"), "kv": ((), "max")})
    got = promscan.scan(b"llamacpp:requests_deferred 2\n", m)
    assert got.values == (2.0, None)
    assert got.found == ("llamacpp:requests_deferred", None)


def test_select(promscan: ModuleType) -> None:
    m = promscan.Mapping({"q": (("q",), "sum")}, model_label="model_name", select={"tp_rank": "0"})
    assert m.select == {"tp_rank": "0"}
    page = (
        b'q{dp_rank="0",tp_rank="0",model_name="a"} 1\n'
        b'q{dp_rank="0",tp_rank="1",model_name="a"} 1\n'
        b'q{dp_rank="1",tp_rank="0",model_name="a"} 2\n'
        b'q{dp_rank="1",tp_rank="0",model_name="b"} 20\n'
        b"q 100\n"
    )
    assert promscan.scan(page, m).values == (123.0,)
    assert promscan.scan(page, m, "a").values == (103.0,)


def test_names_are_matched_exactly(promscan: ModuleType) -> None:
    m = promscan.Mapping({"w": ((W,), "sum")})
    page = (
        (W + "_by_reason").encode() + b' {reason="x"} 5\n' + W.encode() + b"x 7\nvllm:num_requests_waitin 9\n"
    )
    assert promscan.scan(page, m).values == (None,)
    assert promscan.scan(W.encode() + b"\t{} 4\n", m).values == (4.0,)


def test_lenient_skips_unwanted_lines_unread(promscan: ModuleType) -> None:
    m = promscan.Mapping({"w": (("w",), "sum")})
    page = b'junk{a="unterminated 1\nother 1 2 3 4\nw 5\n'
    assert promscan.scan(page, m) == promscan.ScanResult((5.0,), ("w",), 0, None, False)
    with pytest.raises(PromParseError) as info:
        promscan.scan(page, m, strict=True)
    assert info.value.lineno == 1
    # ... but every line's shape up to its name, and every descriptor, is checked.
    got = promscan.scan(b"w 1\n<html>\n# TYPE w gauge x\n{}\nw 2\n", m)
    assert (got.values, got.bad_lines, got.error.lineno if got.error else None) == ((3.0,), 3, 2)


def test_lenient_stops_after_text_after_eof(promscan: ModuleType) -> None:
    m = promscan.Mapping({"w": (("w",), "sum")})
    got = promscan.scan(b"w 1\n# EOF\nw 2\nw 3\n", m)
    assert got.values == (1.0,)
    assert got.bad_lines == 1
    assert got.eof
    assert got.error is not None and (got.error.lineno, got.error.message) == (3, "text after # EOF")


def test_empty_page(promscan: ModuleType) -> None:
    m = promscan.Mapping(VLLM)
    assert promscan.scan(b"", m) == promscan.ScanResult(
        (None, None, None), (None, None, None), 0, None, False
    )
    assert promscan.parse(b"") == []


def test_binary_garbage_never_crashes(promscan: ModuleType) -> None:
    m = promscan.Mapping(VLLM, model_label="model_name")
    for page in (bytes(range(256)) * 4, b"\x00" * 1000, b"{" * 5000 + b"\n", b'm{a="' + b"\\" * 5001 + b"\n"):
        promscan.scan(page, m, "x")
        with pytest.raises(PromParseError):
            promscan.parse(page)


# -- Mapping ----------------------------------------------------------------------------


def test_mapping_attributes(promscan: ModuleType) -> None:
    m = promscan.Mapping(VLLM, model_label="model_name")
    assert m.signals == ("waiting", "running", "kv")
    assert m.names == ((W,), (R,), (K, K_OLD))
    assert m.aggregates == ("sum", "sum", "max")
    assert m.model_label == "model_name"
    assert m.select == {}
    assert "kv_cache_usage_perc" in repr(m)
    m.select["x"] = "y"  # a copy
    assert m.select == {}


@pytest.mark.parametrize(
    ("args", "kwargs", "exc"),
    [
        (({"w": (("bad name",), "sum")},), {}, ValueError),
        (({"w": (("1x",), "sum")},), {}, ValueError),
        (({"w": (("w",), "median")},), {}, ValueError),
        (({"w": ("w", "sum")},), {}, TypeError),  # a bare str is not a list of names
        (({"w": (("w", "w"), "sum")},), {}, ValueError),
        (({"w": (("w",),)},), {}, TypeError),
        (({"w": ((1,), "sum")},), {}, TypeError),
        (([("w", (("w",), "sum"))],), {}, TypeError),
        (({1: (("w",), "sum")},), {}, TypeError),
        (({f"s{i}": ((), "sum") for i in range(17)},), {}, ValueError),
        (({f"s{i}": ((f"n{i}_{j}" for j in range(9)), "sum") for i in range(8)},), {}, TypeError),
        (({f"s{i}": (tuple(f"n{i}_{j}" for j in range(9)), "sum") for i in range(8)},), {}, ValueError),
        (({},), {"model_label": "model-name"}, ValueError),
        (({},), {"model_label": "__x:"}, ValueError),
        (({},), {"select": {"a-b": "x"}}, ValueError),
        (({},), {"select": {"a": 1}}, TypeError),
        (({},), {"select": {f"l{i}": "x" for i in range(9)}}, ValueError),
        (({},), {"model_label": "m", "select": {"m": "x"}}, ValueError),
    ],
)
def test_mapping_rejects(promscan: ModuleType, args: tuple, kwargs: dict, exc: type) -> None:
    with pytest.raises(exc):
        promscan.Mapping(*args, **kwargs)


def test_scan_argument_types(promscan: ModuleType) -> None:
    m = promscan.Mapping(VLLM)
    with pytest.raises(TypeError):
        promscan.scan("text", m)
    with pytest.raises(TypeError):
        promscan.scan(bytearray(b"x 1\n"), m)
    with pytest.raises(TypeError):
        promscan.scan(b"", {"w": ((W,), "sum")})
    with pytest.raises(TypeError):
        promscan.scan(b"", m, model=b"llama")
    with pytest.raises(TypeError):
        promscan.parse("x 1\n")
    assert m.scan(VLLM_PAGE, strict=True).values == promscan.scan(VLLM_PAGE, m).values


@pytest.mark.c_extension
def test_mappings_do_not_cross_twins() -> None:
    from llmgw._fast import promscan_py

    promscan = importlib.import_module("llmgw._fast.promscan")

    with pytest.raises(TypeError):
        promscan.scan(b"", promscan_py.Mapping({}))
    with pytest.raises(TypeError):
        promscan_py.scan(b"", promscan.Mapping({}))


# -- the captured pages ----------------------------------------------------------------


def test_vllm_page(promscan: ModuleType) -> None:
    page = (DATA / "vllm_metrics.txt").read_bytes()
    m = promscan.Mapping(VLLM, model_label="model_name")
    want = promscan.ScanResult((3.0, 12.0, 0.4213), (W, R, K), 0, None, False)
    assert promscan.scan(page, m, "meta-llama/Llama-3.1-8B-Instruct") == want
    assert promscan.scan(page, m, "meta-llama/Llama-3.1-8B-Instruct", strict=True) == want
    assert len(promscan.parse(page)) == 482


def test_openmetrics_pages(promscan: ModuleType) -> None:
    page = (DATA / "vllm_metrics_openmetrics.txt").read_bytes()
    m = promscan.Mapping(VLLM, model_label="model_name")
    got = promscan.scan(page, m, strict=True)
    assert got == promscan.ScanResult((3.0, 12.0, 0.4213), (W, R, K), 0, None, True)
    small = promscan.parse((DATA / "openmetrics.txt").read_bytes())
    assert ("acme_queue_depth", {"shard": "a"}, 3.0) in small
    assert ("acme_build_info", {"version": "1.2.3", "revision": '"quoted" \\ path\nnext'}, 1.0) in small
    assert ("acme_limits", {"kind": "upper"}, math.inf) in small
    assert len(small) == 24
