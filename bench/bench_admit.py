"""Benchmarks of ``llmgw._fast.admit``: enqueue + dequeue, compiled vs pure.

Run: ``.venv/bin/python -m pytest bench/bench_admit.py --benchmark-enable -p no:cacheprovider``.
Each benchmark runs ``N`` push+pop (or push+remove) pairs per round; the
``ns/call`` column of ``extra_info`` is per pair. The baseline is a bare
``collections.deque`` (one FIFO: no bands, tenants, bounds or removal).
"""

from __future__ import annotations

import importlib
from collections import deque
from types import ModuleType
from typing import Any

import pytest

from llmgw._fast import admit_py

admit_c: ModuleType | None
try:
    admit_c = importlib.import_module("llmgw._fast.admit")
except ImportError:  # pragma: no cover - pure build
    admit_c = None

N = 100
IMPLS = [
    pytest.param(
        admit_c,
        id="c",
        marks=[pytest.mark.c_extension, pytest.mark.skipif(admit_c is None, reason="not built")],
    ),
    pytest.param(admit_py, id="py"),
]


class Waiter:
    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n


def per_pair(benchmark: Any) -> None:
    stats = getattr(benchmark, "stats", None)
    if stats is not None:
        benchmark.extra_info["ns/call"] = round(stats.stats.mean / N * 1e9, 1)


def backlog(mod: ModuleType) -> Any:
    """3 bands of 1000; 500 waiters already queued over 50 tenants in the middle band."""
    q = mod.AdmissionQueue(3, 1000)
    for i in range(500):
        q.push(1, f"tenant{i % 50}", Waiter(i))
    return q


@pytest.mark.parametrize("mod", IMPLS)
def test_push_pop(benchmark: Any, mod: ModuleType) -> None:
    """pop the next waiter, push one back: the steady state of a saturated pool (500 queued)."""
    q = backlog(mod)
    tenants = [f"tenant{i % 50}" for i in range(N)]
    push, pop = q.push, q.pop

    def run() -> None:
        for i in range(N):
            push(1, tenants[i], pop())

    benchmark(run)
    per_pair(benchmark)


@pytest.mark.parametrize("mod", IMPLS)
def test_push_remove(benchmark: Any, mod: ModuleType) -> None:
    """push, then remove the same waiter (a client that disconnects while queued)."""
    q = backlog(mod)
    ws = [Waiter(i) for i in range(N)]
    push, remove = q.push, q.remove

    def run() -> None:
        for i in range(N):
            w = ws[i]
            push(2, "t", w)
            remove(w)

    benchmark(run)
    per_pair(benchmark)


def test_push_pop_baseline_deque(benchmark: Any) -> None:
    """Baseline: ``deque.append`` + ``deque.popleft``."""
    d: deque[Waiter] = deque(Waiter(i) for i in range(500))
    ws = [Waiter(i) for i in range(N)]
    append, popleft = d.append, d.popleft

    def run() -> None:
        for i in range(N):
            append(ws[i])
            popleft()

    benchmark(run)
    per_pair(benchmark)
