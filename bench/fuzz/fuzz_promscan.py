"""Fuzz target: the Prometheus scanner (``_fast.promscan``), compiled vs pure twin.

Every input is a page read in every mode (``parse``; ``scan`` lenient and strict,
with and without a model label and a label selection): the same values, flags,
bad-line counts and first error, or the same ``PromParseError`` (line and message:
the twins promise the same words). Values are compared by ``repr``, so NaN equals
NaN and -0.0 differs from 0.0.
"""

from __future__ import annotations

from typing import Any

from _common import same, twins
from _harness import main

NAME = "promscan"
INSTRUMENT = ["llmgw._fast.promscan_py"]
MAX_LEN = 1024  # (pages scale linearly; short ones reach every state)

SIGNALS = {
    "waiting": (("vllm:num_requests_waiting", "w"), "sum"),
    "running": (("m",), "max"),
    "mean": (("m", "x_bucket"), "mean"),
}

_c: Any = None
_py: Any = None
_maps: dict[str, tuple[Any, Any]] = {}
_PromParseError: Any = None


def setup() -> None:
    global _c, _py, _PromParseError
    _c, _py = twins("promscan")
    from llmgw.errors import PromParseError

    _PromParseError = PromParseError
    for mod in (_c, _py):
        _maps[mod.__name__] = (mod.Mapping(SIGNALS), mod.Mapping(SIGNALS, model_label="model_name", select={"le": "1"}))


def _outcome(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
    try:
        got = fn(*args, **kwargs)
    except _PromParseError as exc:
        return ("error", exc.lineno, exc.message)
    if isinstance(got, list):
        return ("ok", repr(got))
    error = None if got.error is None else (got.error.lineno, got.error.message)
    return ("ok", repr(got.values), got.found, got.bad_lines, error, got.eof)


def outcomes(mod: Any, page: bytes) -> list[tuple[Any, ...]]:
    plain, by_model = _maps[mod.__name__]
    return [
        _outcome(mod.parse, page),
        _outcome(mod.scan, page, plain),
        _outcome(mod.scan, page, plain, strict=True),
        _outcome(mod.scan, page, by_model, "llama"),
        _outcome(mod.scan, page, by_model, 'q"\\\n\u00e9', strict=True),
    ]


MODES = ("parse", "scan", "scan strict", "scan by model", "scan by model strict")


def one_input(data: bytes) -> None:
    c, py = outcomes(_c, data), outcomes(_py, data)
    if c != py:
        mode = next(m for m, a, b in zip(MODES, c, py, strict=True) if a != b)
        same("promscan", c, py, data, mode)


if __name__ == "__main__":
    import sys

    main(sys.modules[__name__])
