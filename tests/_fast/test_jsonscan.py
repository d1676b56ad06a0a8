"""``_fast.jsonscan``: reading the top-level ``model`` of a request body, both twins.

The rules are orjson's (the gateway used to parse bodies with it): every body is
checked against ``orjson.loads`` as the reference, by example and by hypothesis.
"""

from __future__ import annotations

import importlib
import json
from types import ModuleType

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


def reference(body: bytes) -> tuple[bool, str | None] | None:
    """What orjson makes of ``body``: ``None`` if it refuses it."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(data, dict):
        return (False, None)
    model = data.get("model")
    return (True, model if isinstance(model, str) else None)


def scan(mod: ModuleType, body: bytes) -> tuple[bool, str | None] | None:
    try:
        return mod.json_model(body)  # type: ignore[no-any-return]
    except mod.JSONScanError as exc:
        assert isinstance(exc, ValueError)
        assert exc.pos >= 0
        return None


VALID = [
    b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}',
    b'  {"model":"llama-3.1-8b"}  \n',
    b'{"model":"a","model":"b"}',  # the last one wins
    b'{"model":"a","model":[1]}',
    b'{"m\\u006fdel":"escaped key"}',
    b'{"model":"caf\xc3\xa9 \\n \\u00e9 \\ud83d\\ude00"}',
    b'{"x":{"model":"inner"},"model" : "outer" }',
    b'{"model":{"a":[1,{}]},"b":2}',
    b'{"model":123}',
    b'{"model":null}',
    b'{"model":""}',
    b'{}',
    b'[{"model":"x"}]',
    b'"model"',
    b'-0.5e+10',
    b'{"a":123456789012345678901234567890}',
    b'{"a":"\x7f\xf4\x8f\xbf\xbf"}',
    b'{"a":[true,false,null,1E+2,-0,0.0]}',
    b"[" * 1024 + b"]" * 1024,
]

INVALID = [
    b"",
    b"   ",
    b"\xef\xbb\xbf{}",  # BOM
    b'{"a":"\\ud800"}',  # lone high surrogate
    b'{"a":"\\udc00"}',  # lone low surrogate
    b'{"a":"\\ud800\\u0041"}',
    b'{"a":1e400}',  # overflows a double
    b'{"a":"\xed\xa0\x80"}',  # an encoded surrogate
    b'{"a":"\xc0\xaf"}',  # overlong
    b'{"a":"\xf4\x90\x80\x80"}',  # past U+10FFFF
    b'{"a":"\xe2\x82"}',  # truncated sequence
    b'{"a":"\x80"}',
    b"[" * 1025 + b"]" * 1025,
    b'{"a":"x\ty"}',  # raw control character
    b"{}\x00",
    b"{} {}",
    b'{"a":1.}',
    b'{"a":01}',
    b'{"a":.5}',
    b'{"a":+1}',
    b'{"a":-}',
    b'{"a":1e}',
    b'{"a":tru}',
    b'{"a":nul}',
    b'{"a":NaN}',
    b'{"a":Infinity}',
    b'{"a":1,}',
    b'[1,]',
    b"{,}",
    b'{"a" 1}',
    b'{"a":}',
    b"{'a':1}",
    b'{"a":"\\x"}',
    b'{"a":"\\u12"}',
    b'{"a":"unterminated',
    b'{"a":[1,2}',
    b'{"a":{"b":1]}',
    b'{"model":"m"',
    b"{1:2}",
]


@pytest.mark.parametrize("body", VALID + INVALID)
def test_matches_orjson(jsonscan: ModuleType, body: bytes) -> None:
    assert scan(jsonscan, body) == reference(body)


@pytest.mark.parametrize("body", INVALID)
def test_invalid_bodies_raise(jsonscan: ModuleType, body: bytes) -> None:
    with pytest.raises(jsonscan.JSONScanError) as info:
        jsonscan.json_model(body)
    assert "at byte" in str(info.value)


def test_reads_the_model(jsonscan: ModuleType) -> None:
    assert jsonscan.json_model(b'{"stream":true,"model":"qwen"}') == (True, "qwen")
    assert jsonscan.json_model(b'{"messages":[]}') == (True, None)
    assert jsonscan.json_model(b"[]") == (False, None)


@pytest.mark.parametrize(
    "body, value",
    [
        (b'{"model":"m","x":1}', b'"m"'),
        (b'{"x":{"model":"no"}, "model" :  "yes" }', b'"yes"'),
        (b'{"model":"a","model":"b"}', b'"b"'),
        (b'{"model":[1,{"a":2}],"y":3}', b'[1,{"a":2}]'),
        (b'{"model":12.5e3}', b"12.5e3"),
        (b'{"model":"\\u006d"}', b'"\\u006d"'),
    ],
)
def test_model_span(jsonscan: ModuleType, body: bytes, value: bytes) -> None:
    start, end = jsonscan.model_span(body)
    assert body[start:end] == value


def test_model_span_absent(jsonscan: ModuleType) -> None:
    assert jsonscan.model_span(b'{"a":{"model":"inner"}}') == (-1, -1)
    assert jsonscan.model_span(b'["model"]') == (-1, -1)
    with pytest.raises(jsonscan.JSONScanError):
        jsonscan.model_span(b'{"model":')


# -- hypothesis: arbitrary JSON documents, and byte-level damage to them --

_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.sampled_from(["model", "a", "b", "modèl"]) | st.text(max_size=6), inner, max_size=5),
    max_leaves=25,
)


def _encode(doc: object, pretty: bool) -> bytes:
    text = json.dumps(doc, ensure_ascii=False, indent=1 if pretty else None)
    return text.encode("utf-8", "surrogatepass")


_SETTINGS = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]


@settings(max_examples=400, deadline=None, suppress_health_check=_SETTINGS)
@given(doc=_json, pretty=st.booleans(), ascii_=st.booleans())
def test_documents_agree_with_orjson(jsonscan: ModuleType, doc: object, pretty: bool, ascii_: bool) -> None:
    body = json.dumps(doc, ensure_ascii=ascii_, indent=1 if pretty else None).encode("utf-8", "surrogatepass")
    want = reference(body)
    assert scan(jsonscan, body) == want, body
    if want is not None and want[0]:
        start, end = jsonscan.model_span(body)
        if isinstance(doc, dict) and "model" in doc:
            assert orjson.loads(body[start:end]) == orjson.loads(body)["model"]
        else:
            assert (start, end) == (-1, -1)


@settings(max_examples=600, deadline=None, suppress_health_check=_SETTINGS)
@given(doc=_json, data=st.data())
def test_damaged_documents_agree_with_orjson(jsonscan: ModuleType, doc: object, data: st.DataObject) -> None:
    body = bytearray(_encode({"model": "m", "x": doc}, pretty=False))
    for _ in range(data.draw(st.integers(1, 3))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        at = data.draw(st.integers(0, max(0, len(body) - 1)))
        if op == "flip" and body:
            body[at] = data.draw(st.integers(0, 255))
        elif op == "cut":
            del body[at:]
        else:
            body[at:at] = data.draw(st.sampled_from([b"\\", b'"', b",", b"]", b"}", b"\\u", b"\xff", b"\xc3", b" ", b"e", b"-"]))
    raw = bytes(body)
    assert scan(jsonscan, raw) == reference(raw), raw


@pytest.mark.parametrize("length", [0, 1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 40])
def test_every_special_byte_at_every_position(jsonscan: ModuleType, length: int) -> None:
    # The compiled scan reads strings 16 and 8 bytes at a time: a byte that ends a
    # plain run must be seen wherever it falls.
    for pos in range(length):
        for ch in (b'"', b"\\", b"\x1f", b"\x00", b"\x7f", b"\xc3", b"\x80", b"\xff"):
            text = bytearray(b"a" * length)
            text[pos : pos + 1] = ch
            body = b'{"model":"' + bytes(text) + b'","k":1}'
            assert scan(jsonscan, body) == reference(body), body


@pytest.mark.parametrize("body", [None, bytearray(b'{"model":"m"}'), '{"model":"m"}'])
def test_body_must_be_bytes(jsonscan: ModuleType, body: object) -> None:
    with pytest.raises(TypeError):
        jsonscan.json_model(body)
    with pytest.raises(TypeError):
        jsonscan.model_span(body)


# -- the answer side: SSE events and token usage (moved here from httpproto) ------


USAGE_CASES = [
    (b'{"x":1,"usage":{"prompt_tokens":10,"total_tokens":30,"completion_tokens":20}}', (10, 20)),
    (b'{"usage": {"prompt_tokens" : 7, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 2}}}', (7, 3)),
    (b'{"usage":{"prompt_tokens_details":{"cached_tokens":0},"prompt_tokens":5,"completion_tokens":6}}', (5, 6)),
    (b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":64}}\n\n', (1, 64)),
    (b'{"usage":{"prompt_tokens":1,"completion_tokens":2}} {"usage":{"prompt_tokens":3,"completion_tokens":4}}', (3, 4)),
    (b'{"usage":null}', None),
    (b'{"usage":{"prompt_tokens":5}}', None),
    (b'{"usage":{"prompt_tokens":"5","completion_tokens":1}}', None),
    (b'{"usage":{"prompt_tokens":5,' + b" " * 2000 + b'"completion_tokens":1}}', None),
    (b"", None),
    (b'"usage"', None),
    # /v1/responses: input/output tokens (the stream's usage in response.completed's response)
    (b'{"object":"response","usage":{"input_tokens":36,"input_tokens_details":{"cached_tokens":0},'
     b'"output_tokens":87,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":123}}', (36, 87)),
    (b'event: response.created\ndata: {"response":{"usage":null}}\n\nevent: response.completed\n'
     b'data: {"type":"response.completed","response":{"usage":{"input_tokens":5,"output_tokens":7}}}\n\n', (5, 7)),
    # /v1/embeddings: no completion (total - prompt)
    (b'{"object":"list","data":[],"usage":{"prompt_tokens":8,"total_tokens":8}}', (8, 0)),
    (b'{"usage":{"prompt_tokens":8,"total_tokens":5}}', None),
    (b'{"usage":{"total_tokens":8}}', None),  # (rerank, score: no prompt count)
]


@pytest.mark.parametrize(("data", "expected"), USAGE_CASES)
def test_usage_counts(jsonscan: ModuleType, data: bytes, expected: object) -> None:
    assert jsonscan.usage_counts(data) == expected


@pytest.mark.c_extension
@given(st.binary(max_size=300))
def test_usage_counts_twins_agree(data: bytes) -> None:
    from llmgw._fast import jsonscan as compiled
    from llmgw._fast import jsonscan_py

    blob = b'{"usage":{"prompt_tokens":' + data + b'"completion_tokens":2}}'
    for x in (data, blob, data + blob, blob + data):
        assert compiled.usage_counts(x) == jsonscan_py.usage_counts(x)


@pytest.mark.c_extension
@given(st.binary(max_size=100), st.sampled_from([b'"input_tokens":3,', b'"prompt_tokens":3,', b""]),
       st.sampled_from([b'"output_tokens":', b'"total_tokens":', b'"completion_tokens":']))
def test_usage_counts_twins_agree_on_every_shape(data: bytes, prompt: bytes, completion: bytes) -> None:
    from llmgw._fast import jsonscan as compiled
    from llmgw._fast import jsonscan_py

    blob = b'{"usage":{' + prompt + data + completion + data[:3] + b'}}'
    for x in (blob, data + blob, b'{"usage":{' + prompt + completion + b"2" + data + b"}}"):
        assert compiled.usage_counts(x) == jsonscan_py.usage_counts(x)


@pytest.mark.parametrize(
    "events, rest",
    [
        (b"", b""),
        (b"", b"data: x"),
        (b"", b"data: x\n"),
        (b"data: x\n\n", b""),
        (b"data: x\n\n", b"data: y"),
        (b"data: x\n\ndata: y\n\n", b""),
        (b"data: x\r\n\r\n", b""),
        (b"data: x\r\n\r\n", b"data: y\r\n"),
        (b": comment\n\ndata: y\n\n", b"data: z\n"),
        (b"\n\n", b""),
        (b"\n\r\n", b""),
        (b"", b"x\r\r"),
    ],
)
def test_sse_cut_after_the_last_whole_event(jsonscan: ModuleType, events: bytes, rest: bytes) -> None:
    assert jsonscan.sse_cut(events + rest) == len(events)


def test_usage_counts_takes_the_last_usage(jsonscan: ModuleType) -> None:
    events = (
        b'data: {"usage":{"prompt_tokens":5,"completion_tokens":1}}\n\n'
        b'data: {"usage": {"prompt_tokens": 5, "completion_tokens": 2}}\n\n'
    )
    assert jsonscan.usage_counts(events) == (5, 2)
    assert jsonscan.usage_counts(b'data: {"usage":null}\n\n') is None
    assert jsonscan.usage_counts(b"x" * 5000) is None


@pytest.mark.c_extension
@given(st.lists(st.sampled_from([b"\n", b"\r", b"\r\n", b"\n\n", b"data: x", b":", b" "]), max_size=20))
def test_sse_cut_twins_agree(parts: list[bytes]) -> None:
    from llmgw._fast import jsonscan as compiled
    from llmgw._fast import jsonscan_py

    data = b"".join(parts)
    assert compiled.sse_cut(data) == jsonscan_py.sse_cut(data)


def test_answer_scans_refuse_str(jsonscan: ModuleType) -> None:
    with pytest.raises(TypeError):
        jsonscan.sse_cut("data: x\n\n")
    with pytest.raises(TypeError):
        jsonscan.usage_counts('{"usage":{"prompt_tokens":1,"completion_tokens":2}}')


def test_old_homes_still_export_the_answer_scans() -> None:
    # sse_cut and usage_counts lived in httpproto; their old import paths stay valid
    import llmgw.gateway.jsonscan as facade
    import llmgw.http.parser as parser
    from llmgw._fast import httpproto_py, jsonscan_py

    assert httpproto_py.sse_cut is jsonscan_py.sse_cut
    assert httpproto_py.usage_counts is jsonscan_py.usage_counts
    assert parser.sse_cut is facade.sse_cut
    assert parser.usage_counts is facade.usage_counts
    assert {"sse_cut", "usage_counts"} <= set(facade.__all__) & set(parser.__all__)


@pytest.mark.c_extension
def test_compiled_httpproto_still_exports_the_answer_scans() -> None:
    from llmgw._fast import httpproto, jsonscan

    assert httpproto.sse_cut is jsonscan.sse_cut
    assert httpproto.usage_counts is jsonscan.usage_counts


def test_a_needle_is_found_where_it_stands(jsonscan: ModuleType) -> None:
    key = b"replica-key-0123456789abcdef"
    n = jsonscan.Needle(key)
    text = b'data: {"error":{"message":"bad auth Bearer ' + key + b'"}}\n\n'
    assert n.needle == key and n.within(text, 0, len(text))
    at = text.index(key)
    assert n.within(text, at, at + len(key)) and not n.within(text, at + 1, len(text))
    assert not n.within(text, 0, at + len(key) - 1)
    assert n.within(text, -5, 10 ** 9)  # (bounds clamped)
    assert not n.within(b"", 0, 0) and not n.within(key[:-1], 0, 100)
    assert jsonscan.Needle(b"x").within(b"abcx", 0, 4) and not jsonscan.Needle(b"x").within(b"abc", 0, 3)
    with pytest.raises(ValueError):
        jsonscan.Needle(b"")
    # bounds no caller gives: never a read outside the text
    assert not n.within(text, 2**63 - 1, 10) and not n.within(text, 5, -(2**63))
    with pytest.raises((TypeError, AttributeError)):
        n.within(None, 0, 10)


@pytest.mark.c_extension
@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=1, max_size=12), st.binary(max_size=200), st.integers(-5, 220), st.integers(-5, 220))
def test_needle_twins_agree(needle: bytes, data: bytes, start: int, end: int) -> None:
    from llmgw._fast import jsonscan as compiled
    from llmgw._fast import jsonscan_py

    hay = data[: len(data) // 2] + needle + data[len(data) // 2 :] if start % 2 else data
    assert compiled.Needle(needle).within(hay, start, end) == jsonscan_py.Needle(needle).within(hay, start, end)


@pytest.mark.parametrize("name", [
    "llmgw._fast.proxy_py", pytest.param("llmgw._fast.proxy", marks=pytest.mark.c_extension)])
def test_an_event_end_split_between_reads_is_found(name: str) -> None:
    """The data path scans each read once; the blank line ending an event may straddle two reads
    (the pending bytes, in one piece or several, and the new read)."""
    straddle = importlib.import_module(name)._straddle
    assert straddle(b"data: x\n", None, b"\nnext") == 1
    assert straddle(b"data: x", [b"\n"], b"\n") == 1
    assert straddle(b"data: x", [b"y", b"\n"], b"\n") == 1
    assert straddle(b"data: x\n", None, b"\r\ndata") == 2
    assert straddle(b"data: x\n\r", None, b"\n") == 1
    assert straddle(b"data: x", [b"\n", b"\r"], b"\n") == 1
    assert straddle(b"data: x\n", None, b"data") == 0
    assert straddle(b"data: x", None, b"y") == 0
