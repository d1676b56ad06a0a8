"""Benchmarks of ``llmgw._fast.jsonscan``'s answer side: ``sse_cut`` and ``usage_counts``.

Run: ``.venv/bin/python -m pytest bench/bench_jsonscan.py --benchmark-enable -p no:cacheprovider``.
Each round makes ``N`` calls on one input; ``extra_info["ns/call"]`` is per call.
The inputs are what the data path hands these kernels: one upstream read of a
stream (eight content events, the usage event, ``[DONE]`` and the start of the
next event) and a non-streamed chat answer of about 2 KB. The baselines do the
same with ``bytes.rfind`` (events) and ``orjson.loads`` (usage: what reading it
by parsing the answer would cost).

These kernels moved from ``httpproto`` to ``jsonscan`` with their C code
unchanged; their instruction counts are best compared under callgrind (wall
clock on a shared VM moves by 10-15%).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import orjson
import pytest

from llmgw._fast import jsonscan_py

jsonscan_c: ModuleType | None
try:
    jsonscan_c = importlib.import_module("llmgw._fast.jsonscan")
except ImportError:  # pragma: no cover - pure build
    jsonscan_c = None

N = 100
IMPLS = [
    pytest.param(
        jsonscan_c,
        id="c",
        marks=[pytest.mark.c_extension, pytest.mark.skipif(jsonscan_c is None, reason="not built")],
    ),
    pytest.param(jsonscan_py, id="py"),
]

_EVENT = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1760000000,"model":"m",'
    b'"choices":[{"index":0,"delta":{"content":"hello"},"finish_reason":null}]}\n\n'
)
_TAIL = b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"con'
STREAM_READ = (
    _EVENT * 8
    + b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[],'
    b'"usage":{"prompt_tokens":17,"completion_tokens":64,"total_tokens":81}}\n\n'
    + b"data: [DONE]\n\n"
    + _TAIL
)
ANSWER = (
    b'{"id":"chatcmpl-1","object":"chat.completion","created":1760000000,"model":"m","choices":[{"index":0,'
    b'"message":{"role":"assistant","content":"' + b"word " * 400 + b'"},"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":17,"completion_tokens":400,"total_tokens":417,'
    b'"prompt_tokens_details":{"cached_tokens":0}}}'
)


def per_call(benchmark: Any) -> None:
    stats = getattr(benchmark, "stats", None)
    if stats is not None:
        benchmark.extra_info["ns/call"] = round(stats.stats.mean / N * 1e9, 1)


def _loop(fn: Any, data: bytes) -> Any:
    out = None
    for _ in range(N):
        out = fn(data)
    return out


@pytest.mark.parametrize("mod", IMPLS)
def test_sse_cut(benchmark: Any, mod: ModuleType) -> None:
    """Where the whole events of one stream read end (the relay's cut before each write)."""
    assert benchmark(_loop, mod.sse_cut, STREAM_READ) == len(STREAM_READ) - len(_TAIL)
    per_call(benchmark)


def test_sse_cut_baseline_rfind(benchmark: Any) -> None:
    """The same cut with two ``bytes.rfind`` calls (LF LF and LF CR LF)."""

    def cut(data: bytes) -> int:
        lf = data.rfind(b"\n\n")
        crlf = data.rfind(b"\n\r\n")
        return max(lf + 2 if lf >= 0 else 0, crlf + 3 if crlf >= 0 else 0)

    assert benchmark(_loop, cut, STREAM_READ) == len(STREAM_READ) - len(_TAIL)
    per_call(benchmark)


@pytest.mark.parametrize("mod", IMPLS)
@pytest.mark.parametrize("kind", ["answer", "stream"])
def test_usage_counts(benchmark: Any, mod: ModuleType, kind: str) -> None:
    """The token counts of a non-streamed answer, or of a stream's last events."""
    data, want = (ANSWER, (17, 400)) if kind == "answer" else (STREAM_READ, (17, 64))
    assert benchmark(_loop, mod.usage_counts, data) == want
    per_call(benchmark)


def test_usage_counts_baseline_orjson(benchmark: Any) -> None:
    """The answer's counts read by parsing it with orjson."""

    def counts(data: bytes) -> tuple[int, int]:
        usage = orjson.loads(data)["usage"]
        return (usage["prompt_tokens"], usage["completion_tokens"])

    assert benchmark(_loop, counts, ANSWER) == (17, 400)
    per_call(benchmark)
