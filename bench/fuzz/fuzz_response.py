"""Fuzz target: the response reader (``_fast.httpproto.ResponseReader``, what
``_fast.upstream`` reads a replica's answer with), compiled vs pure twin.

Each input is cut into reads (``_common.cut``), fed to both twins (then, when the
second byte is odd, end of file); the heads (status, framing, content type, event
stream, forwarded lines, keep-alive), the body bytes, the ends and whether an error
was raised must be the same. One difference is by design (the twin's docstring):
the compiled twin passes a read's body bytes on once llhttp has accepted the
whole read, the pure one as llhttp goes, so when both refuse a read the compiled
twin's body bytes are a prefix of the pure one's.
"""

from __future__ import annotations

from typing import Any

from _common import cut, same, twins
from _harness import Disagreement, main

NAME = "response"
INSTRUMENT = ["llmgw._fast.httpproto_py"]

LIMITS = [{"max_head_bytes": 4096, "max_headers": 5}, {"max_head_bytes": 65536, "max_headers": 200}]

_c: Any = None
_py: Any = None


def setup() -> None:
    global _c, _py
    _c, _py = twins("httpproto")


class Sink:
    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def on_response_head(self, r: Any) -> None:
        self.events.append(("head", r.status, r.content_length, r.chunked, r.content_type, r.event_stream,
                            r.forward, r.keep_alive, r.headers))

    def on_response_body(self, data: bytes) -> None:
        if self.events and self.events[-1][0] == "body":
            self.events[-1] = ("body", self.events[-1][1] + data)
        else:
            self.events.append(("body", data))

    def on_response_end(self) -> None:
        self.events.append(("end",))


def read(mod: Any, chunks: list[bytes], eof: bool, limits: dict[str, int]) -> list[tuple[Any, ...]]:
    sink = Sink()
    r = mod.ResponseReader(sink, **limits)
    try:
        for c in chunks:
            r.feed(c)
        if eof:
            sink.events.append(("eof", r.feed_eof()))
        sink.events.append(("state", r.where(), r.in_message))
    except ValueError:
        sink.events.append(("error",))
    return sink.events


def _no_body(events: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    return [e for e in events if e[0] != "body"]


def _body(events: list[tuple[Any, ...]]) -> bytes:
    return b"".join(e[1] for e in events if e[0] == "body")


def one_input(data: bytes) -> None:
    chunks = cut(data)
    eof = len(data) > 1 and data[1] & 1 == 1
    limits = LIMITS[(data[0] >> 3) & 1] if data else LIMITS[0]
    c, py = read(_c, chunks, eof, limits), read(_py, chunks, eof, limits)
    if c == py:
        return
    if c[-1] == ("error",) and py[-1] == ("error",):
        # by design: the compiled twin's body bytes are a prefix of the pure one's
        same("response (without body bytes)", _no_body(c), _no_body(py), data, "events")
        if not _body(py).startswith(_body(c)):
            raise Disagreement(f"body: compiled {_body(c)!r} is not a prefix of pure {_body(py)!r}", "body prefix")
        return
    tag = "error" if (c[-1] == ("error",)) != (py[-1] == ("error",)) else "events"
    same("response", c, py, data, tag)


if __name__ == "__main__":
    import sys

    main(sys.modules[__name__])
