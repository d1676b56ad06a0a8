"""Regressions found by fuzzing (``bench/fuzz/``) and the h11 differential test.

Each case is the (minimised) input that showed the fault, run against both twins.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest

from llmgw.errors import HTTPError


def read_requests(mod: ModuleType, data: bytes, **kw: Any) -> tuple[list[Any], HTTPError | None]:
    got: list[Any] = []
    reader = mod.RequestReader(got.append, **kw)
    try:
        reader.feed(data)
    except HTTPError as exc:
        return got, exc
    return got, None


class Sink:
    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def on_response_head(self, r: Any) -> None:
        self.events.append(("head", r.status, r.headers))

    def on_response_body(self, data: bytes) -> None:
        self.events.append(("body", data))

    def on_response_end(self) -> None:
        self.events.append(("end",))


def read_response(mod: ModuleType, data: bytes) -> tuple[list[tuple[Any, ...]], Any]:
    sink = Sink()
    reader = mod.ResponseReader(sink)
    try:
        reader.feed(data)
    except ValueError as exc:
        return sink.events, exc
    return sink.events, reader.where()


def test_trailer_fields_are_not_request_headers(httpproto: ModuleType) -> None:
    # fuzz_request: the pure twin added a chunked body's trailer fields to the
    # request's headers, the compiled one did not
    data = b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\nX-T: 1\r\nHost: a\r\n\r\n"
    (req,), error = read_requests(httpproto, data)
    assert error is None
    assert req.headers == [(b"Transfer-Encoding", b"chunked")]
    assert req.host is None
    assert req.body == b"hello"


@pytest.mark.parametrize(
    "data",
    [
        b"GET /v1\n\r\n/v1>\r\n",  # a version-less line ended by a bare LF, then a blank line
        b"GET /\n\r\nPOST /x HTTP/1.1\r\nExpect: 050-continue\r\n\r\n",  # not the next head's fields
        b"GET /d\r\nHost: a\r\n\r\n",  # ended by CRLF: fields follow
    ],
)
def test_http09_request_line_is_refused_as_such(httpproto: ModuleType, data: bytes) -> None:
    # fuzz_request: the compiled twin framed the head past the LF that ends an
    # HTTP/0.9 line for llhttp, and answered 417 or "a head that was not framed"
    got, error = read_requests(httpproto, data)
    assert got == []
    assert error is not None and error.status == 505
    assert error.message == "unsupported HTTP version 0.9"


def test_http09_line_fields_still_checked_first(httpproto: ModuleType) -> None:
    # ...while fields after a CRLF-ended version-less line are checked, in order, as the twin does
    _, error = read_requests(httpproto, b"GET /d\r\nExpect: other\r\n\r\n")
    assert error is not None and error.status == 417


@pytest.mark.parametrize("gap", [b"\r\n", b"\n", b"\r\n\r\n", b"\n\r\n"])
def test_empty_lines_between_responses_are_skipped(httpproto: ModuleType, gap: bytes) -> None:
    # fuzz_response: llhttp (and so the pure twin) skips them; the compiled twin
    # took them for the start of a head (a 502, or a connection left "in a head")
    data = b"HTTP/1.1 204 No Content\r\n\r\n" + gap + b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok" + gap
    events, where = read_response(httpproto, data)
    assert where == 0
    assert events == [("head", 204, []), ("end",), ("head", 200, [(b"content-length", b"2")]), ("body", b"ok"),
                      ("end",)]


@pytest.mark.parametrize("status", [b"000", b"099", b"042"])
def test_status_below_100_is_malformed(httpproto: ModuleType, status: bytes) -> None:
    # fuzz_response: llhttp takes any three digits; the pure twin took 000 for an
    # interim response and passed its body to the sink with no head
    events, error = read_response(httpproto, b"HTTP/1.1 " + status + b" OK\r\nConnection: close\r\n\r\noverloaded")
    assert isinstance(error, ValueError)
    assert events == []


@pytest.mark.parametrize(
    ("te", "status"),
    [(b"gzip, chunked", 501), (b"deflate,chunked", 501), (b"chued\r\nTransfer-Encoding: chunked", 501),
     (b"chunked\r\nTransfer-Encoding: chunked", 400), (b"gzip", 400), (b"chunked, gzip", 400),
     (b" Chunked ", None)],
)
def test_request_transfer_codings_other_than_chunked_are_501(httpproto: ModuleType, te: bytes, status: int | None) -> None:
    # h11 differential: llhttp takes any codings before a final chunked; llmgw read
    # the body, de-chunked it and would have sent it on still gzip-coded
    data = b"POST / HTTP/1.1\r\nTransfer-Encoding: " + te + b"\r\n\r\n1\r\nx\r\n0\r\n\r\n"
    got, error = read_requests(httpproto, data)
    if status is None:
        assert error is None and got[0].body == b"x"
    else:
        assert error is not None and error.status == status and got == []
        assert error.close


def test_trailing_whitespace_is_not_part_of_a_value(httpproto: ModuleType) -> None:
    # h11 differential: llhttp keeps it; RFC 9112 §5 (OWS field-value OWS) does not
    data = b"GET / HTTP/1.1\r\nAuthorization: Bearer sk-1 \t\r\nX-Request-Id: r1 \r\nX-Other: a b  \r\n\r\n"
    (req,), error = read_requests(httpproto, data)
    assert error is None
    assert req.authorization == b"Bearer sk-1"
    assert req.request_id == b"r1"
    assert req.headers[2] == (b"X-Other", b"a b")
    assert req.forward == b"X-Other: a b\r\n"
    events, _ = read_response(httpproto, b"HTTP/1.1 200 OK\r\nX-A: v \r\ncontent-length: 0\r\n\r\n")
    assert events[0] == ("head", 200, [(b"X-A", b"v"), (b"content-length", b"0")])


@pytest.mark.parametrize("framing", [b"", b"Content-Length: 3\r\n", b"Transfer-Encoding: gzip\r\n",
                                     b"Transfer-Encoding: chunked\r\n"])
@pytest.mark.parametrize("status", [b"104", b"106", b"199"])
def test_interim_statuses_llhttp_gives_a_body_are_malformed(httpproto: ModuleType, status: bytes, framing: bytes) -> None:
    # fuzz_response: llhttp frames only 100, 102 and 103 without a body; the pure twin
    # passed another 1xx's "body" (and its end) to the sink with no head
    events, error = read_response(httpproto, b"HTTP/1.1 " + status + b" X\r\n" + framing + b"\r\nabc")
    assert isinstance(error, ValueError)
    assert events == []


@pytest.mark.parametrize("status", [b"100", b"102", b"103"])
def test_interim_statuses_are_dropped(httpproto: ModuleType, status: bytes) -> None:
    events, where = read_response(httpproto, b"HTTP/1.1 " + status + b" X\r\nLink: </a>\r\n\r\n"
                                  b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
    assert where == 0
    assert events == [("head", 200, [(b"content-length", b"2")]), ("body", b"ok"), ("end",)]


def test_response_header_count_is_checked_once_the_head_is_whole(httpproto: ModuleType) -> None:
    # fuzz_response: the pure twin refused an unfinished head at its max_headers+1st
    # line; the compiled one (which reads the fields of a whole head) waited. Both now
    # bound an unfinished head by its bytes and count its lines once it is whole.
    sink = Sink()
    reader = httpproto.ResponseReader(sink, max_head_bytes=4096, max_headers=2)
    reader.feed(b"HTTP/1.1 200 OK\r\nA: 1\r\nB: 2\r\nC: 3\r\nD: 4\r\n")
    assert reader.where() == 1 and sink.events == []
    with pytest.raises(ValueError, match="too large"):
        reader.feed(b"\r\n")
    assert sink.events == []
