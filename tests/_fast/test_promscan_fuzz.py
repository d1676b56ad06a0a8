"""promscan under hypothesis.

* compiled vs pure twin on arbitrary bytes (token soup and raw binary) and on generated
  valid pages: the same result, or the same error (line and message), in every mode;
* parse() vs prometheus_client's text and OpenMetrics parsers on generated valid pages
  and on the captured fixtures: the same samples.
"""

from __future__ import annotations

import importlib
import math
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_families
from prometheus_client.parser import text_string_to_metric_families as text_families

from llmgw._fast import promscan_py
from llmgw.errors import PromParseError

DATA = Path(__file__).parent.parent / "data"
FIXTURE_OK = [HealthCheck.function_scoped_fixture]  # the fixture is a module: no state to reset

SIGNALS = {
    "waiting": (("vllm:num_requests_waiting", "w"), "sum"),
    "running": (("m",), "max"),
    "mean": (("m", "x_bucket"), "mean"),
}

# -- outcomes, compared with repr so that NaN == NaN and -0.0 != 0.0 ---------------------


def _canon_scan(r: Any) -> tuple[Any, ...]:
    error = None if r.error is None else (r.error.lineno, r.error.message)
    return (repr(r.values), r.found, r.bad_lines, error, r.eof)


def outcome(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
    try:
        got = fn(*args, **kwargs)
    except PromParseError as exc:
        return ("error", exc.lineno, exc.message)
    if isinstance(got, list):
        return ("ok", repr(got))
    return ("ok", *_canon_scan(got))


def all_outcomes(mod: ModuleType, page: bytes) -> list[tuple[Any, ...]]:
    plain = mod.Mapping(SIGNALS)
    by_model = mod.Mapping(SIGNALS, model_label="model_name", select={"le": "1"})
    return [
        outcome(mod.parse, page),
        outcome(mod.scan, page, plain),
        outcome(mod.scan, page, plain, strict=True),
        outcome(mod.scan, page, by_model, "llama"),
        outcome(mod.scan, page, by_model, 'q"\\\n\u00e9', strict=True),
    ]


# -- arbitrary bytes ------------------------------------------------------------------

TOKENS = [
    b"m", b"w", b"x_bucket", b"vllm:num_requests_waiting", b"model_name", b"llama", b"le", b"1",
    b"{", b"}", b'"', b"\\", b"\\n", b'\\"', b"=", b",", b" ", b"\t", b"\n", b"\n", b"\r", b"#",
    b"# HELP ", b"# TYPE ", b"# UNIT ", b"# EOF", b"# EOF\n", b"gauge", b"counter", b"seconds",
    b"0", b"-2.5e3", b"1e", b".5", b"NaN", b"+Inf", b"-inf", b"Infinity", b"nan", b"+nan",
    b"1712345678000", b"_", b":", b".", b"e", b"\xc3\xa9", b"\xed\xa0\x80", b"\xff", b"\x00",
    b'l="v"', b'model_name="llama"', b'le="1"', b"__name__", b"# {", b'trace_id="a"',
]  # fmt: skip

soup = st.lists(st.sampled_from(TOKENS) | st.binary(max_size=3), max_size=60).map(b"".join)


@pytest.mark.c_extension
@settings(max_examples=300, deadline=None)
@given(page=soup | st.binary(max_size=200))
def test_twins_agree_on_any_bytes(page: bytes) -> None:
    promscan = importlib.import_module("llmgw._fast.promscan")

    assert all_outcomes(promscan, page) == all_outcomes(promscan_py, page)


# -- valid pages ----------------------------------------------------------------------

_ALNUM = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
metric_names = st.text(_ALNUM + "_:", max_size=10)  # drawn after a "f<i>_" prefix
label_names = st.builds(str.__add__, st.sampled_from("abcxyzABC"), st.text(_ALNUM + "_", max_size=6))
label_values = st.text(st.characters(codec="utf-8"), max_size=10)
simple_values = st.text("abcXYZ09_-. ", max_size=8)


def escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@st.composite
def numbers(draw: st.DrawFn, *, special: bool = True, negative: bool = True) -> str:
    """A number as some exporter prints it."""
    if special and draw(st.integers(0, 9)) == 0:
        return draw(st.sampled_from(["NaN", "+Inf", "-Inf", "Inf", "nan", "inf", "-inf", "+infinity"]))
    if draw(st.booleans()):
        return str(draw(st.integers(-(10**12) if negative else 0, 10**12)))
    x = draw(st.floats(min_value=None if negative else 0.0, allow_nan=False, allow_infinity=False))
    return draw(st.sampled_from([repr(x), f"{x:.6e}", f"{x:.17g}"]))


@st.composite
def label_sets(draw: st.DrawFn, values: st.SearchStrategy[str] = label_values) -> dict[str, str]:
    names = draw(st.lists(label_names, max_size=4, unique=True))
    return {n: draw(values) for n in names}


def render_labels(
    labels: dict[str, str], *, blanks: str = "", trailing_comma: bool = False, empty: str = ""
) -> str:
    if not labels:
        return empty
    body = ("," + blanks).join(f'{k}{blanks}={blanks}"{escape(v)}"' for k, v in labels.items())
    return "{" + blanks + body + ("," if trailing_comma else "") + blanks + "}"


@st.composite
def text_pages(draw: st.DrawFn, *, canonical: bool) -> str:
    """A Prometheus text 0.0.4 page; ``canonical``: as prometheus_client renders it."""
    lines: list[str] = []
    for i in range(draw(st.integers(0, 6))):
        name = f"f{i}_" + draw(metric_names)
        kind = draw(st.sampled_from(["gauge", "untyped", "counter", "histogram", "summary", None]))
        if kind == "counter":
            name += "_total"
        if draw(st.booleans()):
            help_text = draw(st.text(st.characters(codec="utf-8", exclude_characters="\n\r"), max_size=20))
            lines.append(f"# HELP {name} {help_text}")
        if kind is not None:
            lines.append(f"# TYPE {name} {kind}")
        if not canonical and draw(st.booleans()):
            lines.append(draw(st.sampled_from(["", "# a comment", "#", "   "])))
        suffixes = {"histogram": ["_bucket", "_sum", "_count"], "summary": ["", "_sum", "_count"]}.get(
            kind or "", [""]
        )
        for _ in range(draw(st.integers(0, 4))):
            suffix = draw(st.sampled_from(suffixes))
            labels = draw(label_sets())
            if suffix == "_bucket":
                labels["le"] = draw(st.sampled_from(["0.1", "1.0", "+Inf", "1", "10"]))
            blanks = "" if canonical else draw(st.sampled_from(["", " ", "\t "]))
            sep = " " if canonical else draw(st.sampled_from([" ", "\t", "  "]))
            text = (
                name
                + suffix
                + render_labels(labels, blanks=blanks, trailing_comma=not canonical and draw(st.booleans()))
            )
            text += sep + draw(numbers())
            if draw(st.integers(0, 3)) == 0:
                text += sep + str(draw(st.integers(-(10**13), 10**13)))
            lines.append(text)
    return "".join(line + "\n" for line in lines)


@st.composite
def openmetrics_pages(draw: st.DrawFn) -> str:
    """An OpenMetrics 1.0 page that prometheus_client's strict parser accepts."""
    lines: list[str] = []
    for i in range(draw(st.integers(0, 5))):
        kind = draw(st.sampled_from(["gauge", "counter", "unknown", "histogram", "info"]))
        unit = "seconds" if kind in ("gauge", "histogram") and draw(st.booleans()) else ""
        name = f"f{i}_" + draw(st.text("abcxyz019_", max_size=8)) + (f"_{unit}" if unit else "")
        lines.append(f"# TYPE {name} {kind}")
        if unit:
            lines.append(f"# UNIT {name} {unit}")
        if draw(st.booleans()):
            lines.append(f"# HELP {name} " + escape(draw(st.text(st.characters(codec="utf-8"), max_size=15))))
        sets = draw(st.lists(label_sets(), max_size=3, unique_by=lambda d: tuple(sorted(d.items()))))
        for labels in sets:
            labels.pop("le", None)
            labels.pop("quantile", None)
            exemplar = ""
            if draw(st.integers(0, 2)) == 0:
                exemplar = (
                    " # "
                    + render_labels(draw(label_sets(simple_values)), empty="{}")
                    + " "
                    + draw(numbers(special=False))
                )
            if kind == "gauge":
                ts = (
                    f" {draw(st.integers(0, 2**31))}.{draw(st.integers(0, 999))}"
                    if draw(st.booleans())
                    else ""
                )
                lines.append(f"{name}{render_labels(labels)} {draw(numbers())}{ts}")
            elif kind == "unknown":
                lines.append(f"{name}{render_labels(labels)} {draw(numbers())}")
            elif kind == "counter":
                lines.append(
                    f"{name}_total{render_labels(labels)} {draw(numbers(special=False, negative=False))}{exemplar}"
                )
                if draw(st.booleans()):
                    lines.append(f"{name}_created{render_labels(labels)} 1767225600.5")
            elif kind == "info":
                lines.append(f"{name}_info{render_labels(labels)} 1")
            else:
                count = 0
                for le in ("0.5", "1.0", "+Inf"):
                    count += draw(st.integers(0, 5))
                    lines.append(f"{name}_bucket{render_labels({**labels, 'le': le})} {count}{exemplar}")
                lines.append(f"{name}_count{render_labels(labels)} {count}")
                lines.append(
                    f"{name}_sum{render_labels(labels)} {draw(numbers(special=False, negative=False))}"
                )
    lines.append("# EOF")
    return "".join(line + "\n" for line in lines)


def flatten(families: Any, page: str | None = None) -> list[tuple[str, dict[str, Any], Any]]:
    samples = [(s.name, s.labels, float(s.value)) for f in families for s in f.samples]
    if page is not None:
        # prometheus_client's text parser renames the samples of a counter whose TYPE
        # name lacks _total (llama.cpp's n_tokens_max); promscan reports names as written.
        written = {line.split("{")[0].split()[0] for line in page.splitlines() if line and line[0] != "#"}
        samples = [
            (n[:-6] if n not in written and n.endswith("_total") and n[:-6] in written else n, labels, v)
            for n, labels, v in samples
        ]
    return canon(samples)


def canon(samples: list[tuple[str, dict[str, str], float]]) -> list[tuple[str, dict[str, Any], Any]]:
    # NaN as a string so that lists compare; +0.0 for -0.0, which prometheus_client
    # reads through int() and so without its sign.
    return [(n, labels, "nan" if math.isnan(v) else v + 0.0) for n, labels, v in samples]


@pytest.mark.c_extension
@settings(max_examples=100, deadline=None)
@given(page=text_pages(canonical=False) | openmetrics_pages())
def test_twins_agree_on_valid_pages(page: str) -> None:
    promscan = importlib.import_module("llmgw._fast.promscan")

    data = page.encode()
    got = all_outcomes(promscan, data)
    assert got == all_outcomes(promscan_py, data)
    assert got[0][0] == "ok", got[0]


@settings(max_examples=60, deadline=None, suppress_health_check=FIXTURE_OK)
@given(page=text_pages(canonical=True))
def test_parse_matches_prometheus_client_text(promscan: ModuleType, page: str) -> None:
    assert canon(promscan.parse(page.encode())) == flatten(text_families(page))


@settings(max_examples=60, deadline=None, suppress_health_check=FIXTURE_OK)
@given(page=text_pages(canonical=False))
def test_parse_accepts_text_variants(promscan: ModuleType, page: str) -> None:
    # Extra blanks, tabs, trailing commas and comments: prometheus_client reads them too.
    assert canon(promscan.parse(page.encode())) == flatten(text_families(page))


@settings(max_examples=60, deadline=None, suppress_health_check=FIXTURE_OK)
@given(page=openmetrics_pages())
def test_parse_matches_prometheus_client_openmetrics(promscan: ModuleType, page: str) -> None:
    assert canon(promscan.parse(page.encode())) == flatten(om_families(page))
    m = promscan.Mapping({})
    assert promscan.scan(page.encode(), m, strict=True).eof


@settings(max_examples=200, deadline=None, suppress_health_check=FIXTURE_OK)
@given(raw=st.binary(max_size=12).filter(lambda b: not any(c in b for c in b'"\\\n')))
def test_label_utf8_check_matches_python(promscan: ModuleType, raw: bytes) -> None:
    try:
        expected: Any = raw.decode("utf-8")
    except UnicodeDecodeError:
        expected = None
    page = b'm{l="' + raw + b'"} 1\n'
    if expected is None:
        with pytest.raises(PromParseError, match="not valid UTF-8"):
            promscan.parse(page)
    else:
        assert promscan.parse(page) == [("m", {"l": expected}, 1.0)]


@settings(max_examples=200, deadline=None, suppress_health_check=FIXTURE_OK)
@given(x=st.floats() | st.integers(-(10**30), 10**30).map(float))
def test_values_round_trip(promscan: ModuleType, x: float) -> None:
    for text in {repr(x), f"{x:.17g}", f"{x:e}"}:
        got = promscan.parse(f"m {text}\n".encode())[0][2]
        assert repr(got) == repr(float(text)), text


# -- the captured pages against prometheus_client -------------------------------------------


@pytest.mark.parametrize(
    "name",
    ["vllm_metrics.txt", "llamacpp_metrics.txt", "sglang_metrics.txt", "sglang_old_metrics.txt",
     "trtllm_metrics.txt", "trtllm_old_metrics.txt"],
)  # fmt: skip
def test_fixtures_match_prometheus_client_text(promscan: ModuleType, name: str) -> None:
    page = (DATA / name).read_bytes()
    assert canon(promscan.parse(page)) == flatten(text_families(page.decode()), page.decode())


@pytest.mark.parametrize("name", ["vllm_metrics_openmetrics.txt", "openmetrics.txt"])
def test_fixtures_match_prometheus_client_openmetrics(promscan: ModuleType, name: str) -> None:
    page = (DATA / name).read_bytes()
    assert canon(promscan.parse(page)) == flatten(om_families(page.decode()))
