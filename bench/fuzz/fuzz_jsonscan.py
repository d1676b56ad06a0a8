"""Fuzz target: the JSON scans (``_fast.jsonscan``), compiled vs pure twin (orjson).

``json_model`` and ``model_span`` (the request body's ``model``), ``sse_cut`` and
``usage_counts`` (an engine's answer) run on every input, in both twins: the same
result, or the same error class. The pure twin validates with orjson, so this is
also the compiled scanner against orjson. Not compared: the error's message and
offset. The compiled twin words its own messages and reports the first fault in
the bytes' order; orjson reports a UTF-8 fault anywhere at offset 0 and other
offsets in characters, not bytes (the pure twin passes them on). When the input's first byte
is odd, the rest is wrapped as the value of a member of an object, which reaches
the object and string states more often than raw bytes do.

Also checked: a span ``model_span`` finds holds the model's JSON text.
"""

from __future__ import annotations

from typing import Any

from _common import same, twins
from _harness import Disagreement, main

NAME = "jsonscan"
INSTRUMENT = ["llmgw._fast.jsonscan_py"]

_c: Any = None
_py: Any = None
_orjson: Any = None


def setup() -> None:
    global _c, _py, _orjson
    _c, _py = twins("jsonscan")
    import orjson

    _orjson = orjson


def _call(mod: Any, fn: str, body: bytes) -> Any:
    try:
        return getattr(mod, fn)(body)
    except mod.JSONScanError as exc:
        if not (isinstance(exc, ValueError) and exc.pos >= 0):
            raise AssertionError(f"a JSONScanError that breaks its contract: {exc!r} pos={exc.pos}") from None
        return ("JSONScanError",)


def one_input(data: bytes) -> None:
    body = b'{"model":"m","x":' + data[1:] + b"}" if data and data[0] & 1 else data
    for fn in ("json_model", "model_span", "sse_cut", "usage_counts"):
        c, py = _call(_c, fn, body), _call(_py, fn, body)
        if c != py:
            same(fn, c, py, body, fn)
    span = _call(_c, "model_span", body)
    if isinstance(span, tuple) and len(span) == 2 and isinstance(span[0], int) and span[0] >= 0:
        want = _orjson.loads(body)["model"]
        got = _orjson.loads(body[span[0] : span[1]])
        if got != want:
            raise Disagreement(f"model_span {span} holds {got!r}, the model is {want!r}", "model_span text")


if __name__ == "__main__":
    import sys

    main(sys.modules[__name__])
