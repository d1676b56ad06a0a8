"""The kernel driver of ``bench/guard.py``: each compiled kernel, called between markers.

``guard.py`` runs this script under ``valgrind --tool=callgrind --dump-before=getppid``
with the Python of one revision's venv. ``os.getppid()`` is the marker: each call is a
libc ``getppid()``, before which callgrind writes the counts gathered so far to a new
part file and starts counting afresh. For every kernel the script does::

    setup, warm-up | mark | loop(0) | mark | loop(N) | mark | (next kernel's setup)

so part ``2 + 3 i`` holds kernel ``i``'s loop with no call (the marker and loop overhead)
and part ``3 + 3 i`` the same loop with ``N`` calls; ``(part_N - part_0) / N`` is the
instructions per call, the interpreter's own loop included (a ``for`` over ``range`` and
one call through a bound method, the same in both revisions). Nothing else in this
process calls ``getppid``, and the cyclic GC is off while a kernel is measured (what a
collection costs depends on the whole heap, which differs between revisions). Collection is on from the start (part 1 is the interpreter's
start and the imports), and ``PYTHONHASHSEED`` is fixed by the guard, so two runs of the
same build give the same counts to the instruction.

The inputs come from the guard's tree (next to this file), so both revisions read the
same bytes: the real vLLM page ``tests/data/vllm_metrics.txt``, the ~1 KB chat request of
``bench/dataplane/post.lua``, and the stream read and answer of ``bench/bench_jsonscan.py``.

Prints one JSON object on stdout: ``{"kernels": [[name, N, error-or-null], ...]}``.
A kernel the revision lacks (an import or setup error) gets an error and no markers.
"""

from __future__ import annotations

import gc
import importlib
import itertools
import json
import os
import random
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PAGE = (REPO / "tests" / "data" / "vllm_metrics.txt").read_bytes()
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
_POST = re.search(r"^wrk\.body = '(.*)'$", (HERE / "dataplane" / "post.lua").read_text(), re.M)
CHAT_BODY = _POST.group(1).encode() if _POST else b""

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


def _aligned(data: bytes, copies: int = 16) -> Callable[[], bytes]:
    """A source of ``copies`` copies of ``data``, in turn, spread over the heap.

    glibc's vectorised string scans cost a little more or less by the buffer's alignment,
    and where the heap puts one input depends on everything imported before (so on the
    revision); the copies, each after a pad of a different size, land at mixed alignments,
    which averages that out (the figure is over all copies: N is a multiple of ``copies``).
    """
    keep: list[bytes] = []
    out = []
    for k in range(copies):
        keep.append(bytes(600 + 16 * (k % 4)))  # shift the next allocation (malloc, not pymalloc)
        out.append(data[:-1] + data[-1:])  # a fresh object (bytes(data) is data itself)
    _KEEP.append(keep)
    return itertools.cycle(out).__next__


_KEEP: list[list[bytes]] = []


def _compiled(name: str) -> Any:
    mod = importlib.import_module(f"llmgw._fast.{name}")
    if not str(getattr(mod, "__file__", "")).endswith((".so", ".pyd")):
        raise RuntimeError(f"llmgw._fast.{name} is not compiled ({mod.__file__})")
    return mod


def k_promscan() -> Callable[[], Any]:
    from llmgw import scrape

    mod = _compiled("promscan")
    mapping = scrape.mapping_for("vllm", impl=mod)
    scan, page = mod.scan, _aligned(PAGE)
    return lambda: scan(page(), mapping, MODEL)


def _fleet(mod: Any, n: int) -> list[Any]:
    rng = random.Random(1)
    states = []
    for i in range(n):
        s = mod.EndpointState(i)
        s.on_scrape(0.0, rng.choice([0, 0, 0, 1, 3, 7]), rng.randint(4, 32), rng.uniform(0.2, 0.95))
        s.latency = rng.uniform(2.0, 12.0)
        s.drain_rate = rng.uniform(0.5, 4.0)
        for _ in range(rng.randint(0, 3)):
            s.on_dispatch(0.05)
        states.append(s)
    return states


def k_score() -> Callable[[], Any]:
    mod = _compiled("score")
    states = _fleet(mod, 64)
    pick = mod.Picker("score", seed=1).pick
    return lambda: pick(states, 0.1, 3.0)


class _Waiter:
    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n


def k_admit() -> Callable[[], Any]:
    mod = _compiled("admit")
    q = mod.AdmissionQueue(3, 1000)
    for i in range(500):
        q.push(1, f"tenant{i % 50}", _Waiter(i))
    push, pop = q.push, q.pop
    return lambda: push(1, "tenant7", pop())


def k_json_model() -> Callable[[], Any]:
    fn = _compiled("jsonscan").json_model
    assert fn(CHAT_BODY) == (True, "m"), fn(CHAT_BODY)
    data = _aligned(CHAT_BODY)
    return lambda: fn(data())


def k_usage_answer() -> Callable[[], Any]:
    fn = _compiled("jsonscan").usage_counts
    assert fn(ANSWER) == (17, 400)
    data = _aligned(ANSWER)
    return lambda: fn(data())


def k_usage_stream() -> Callable[[], Any]:
    fn = _compiled("jsonscan").usage_counts
    assert fn(STREAM_READ) == (17, 64)
    data = _aligned(STREAM_READ)
    return lambda: fn(data())


def k_sse_cut() -> Callable[[], Any]:
    fn = _compiled("jsonscan").sse_cut
    assert fn(STREAM_READ) == len(STREAM_READ) - len(_TAIL)
    data = _aligned(STREAM_READ)
    return lambda: fn(data())


# figure name -> (setup returning the call, calls per measurement)
KERNELS: dict[str, tuple[Callable[[], Callable[[], Any]], int]] = {
    "promscan.scan vllm page": (k_promscan, 32),
    "score Picker.pick 64": (k_score, 1000),
    "admit push+pop": (k_admit, 2000),
    "jsonscan json_model 1KB": (k_json_model, 2000),
    "jsonscan usage_counts answer": (k_usage_answer, 2000),
    "jsonscan usage_counts stream": (k_usage_stream, 2000),
    "jsonscan sse_cut": (k_sse_cut, 2000),
}


def _loop(fn: Callable[[], Any], n: int) -> None:
    for _ in range(n):
        fn()


def main() -> None:
    mark = os.getppid
    done = []
    for name, (setup, n) in KERNELS.items():
        try:
            fn = setup()
            _loop(fn, 50)  # warm-up: first-use allocations, caches
        except Exception as exc:  # the revision lacks this kernel or its API changed
            done.append([name, n, f"{type(exc).__name__}: {exc}"])
            continue
        gc.collect()
        gc.disable()  # a collection's cost depends on the whole heap, not on the kernel
        mark()
        _loop(fn, 0)
        mark()
        _loop(fn, n)
        mark()
        gc.enable()
        done.append([name, n, None])
    json.dump({"kernels": done}, sys.stdout)


if __name__ == "__main__":
    main()
