"""Benchmarks of ``llmgw._fast.score``: one routing decision, compiled vs pure.

Run: ``.venv/bin/python -m pytest bench/bench_score.py --benchmark-enable -p no:cacheprovider``.
Each benchmark runs an inner loop of ``N`` calls; divide the reported time by ``N``
(the ``ns/call`` column of ``extra_info`` does it). The issue's bar: one ``score``
decision over 64 replicas well under 5 µs compiled.
"""

from __future__ import annotations

import importlib
import random
from types import ModuleType
from typing import Any

import pytest

from llmgw._fast import score_py

score_c: ModuleType | None
try:
    score_c = importlib.import_module("llmgw._fast.score")
except ImportError:  # pragma: no cover - pure build
    score_c = None

N = 100
IMPLS = [
    pytest.param(
        score_c,
        id="c",
        marks=[pytest.mark.c_extension, pytest.mark.skipif(score_c is None, reason="not built")],
    ),
    pytest.param(score_py, id="py"),
]


def fleet(mod: ModuleType, n: int, seed: int = 1) -> list[Any]:
    """``n`` fresh replicas with vLLM-like numbers: queues, KV use, measured latency."""
    rng = random.Random(seed)
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


def per_call(benchmark: Any) -> None:
    stats = getattr(benchmark, "stats", None)
    if stats is not None:
        benchmark.extra_info["ns/call"] = round(stats.stats.mean / N * 1e9, 1)


@pytest.mark.parametrize("mod", IMPLS)
@pytest.mark.parametrize("strategy", ["score", "least_inflight", "round_robin"])
def test_pick_64(benchmark: Any, mod: ModuleType, strategy: str) -> None:
    """``Picker.pick`` over 64 usable, fresh replicas; one decision per call."""
    states = fleet(mod, 64)
    pick = mod.Picker(strategy, seed=1).pick

    def run() -> None:
        for _ in range(N):
            pick(states, 0.1, 3.0)

    benchmark(run)
    per_call(benchmark)


def test_pick_64_baseline_min(benchmark: Any) -> None:
    """Baseline: builtin ``min`` over 64 precomputed floats (no model at all)."""
    costs = [random.Random(i).random() for i in range(64)]
    idx = range(64)
    key = costs.__getitem__

    def run() -> None:
        for _ in range(N):
            min(idx, key=key)

    benchmark(run)
    per_call(benchmark)


@pytest.mark.parametrize("mod", IMPLS)
def test_pool_saturation_64(benchmark: Any, mod: ModuleType) -> None:
    """``pool_saturation`` over 64 replicas (admission reads it per request)."""
    states = fleet(mod, 64)
    f = mod.pool_saturation

    def run() -> None:
        for _ in range(N):
            f(states, 0.1, 3.0, 8.0, 0.9)

    benchmark(run)
    per_call(benchmark)


@pytest.mark.parametrize("mod", IMPLS)
def test_dispatch_complete(benchmark: Any, mod: ModuleType) -> None:
    """``on_dispatch`` + ``on_complete`` on one replica (the data path's per-request bookkeeping)."""
    s = mod.EndpointState(0)
    clock = [0.0]

    def run() -> None:
        t = clock[0]
        for _ in range(N):
            t += 0.01
            s.on_dispatch(t)
            s.on_complete(t)
        clock[0] = t

    benchmark(run)
    per_call(benchmark)
