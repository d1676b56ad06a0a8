"""How fast llmgw reads an engine's metrics page (STYLE.md §11).

The input is ``tests/data/vllm_metrics.txt``: a 58 KB vLLM ``/metrics`` page as
``prometheus_client`` renders it (622 lines, 482 samples, the full histogram ladders).
One call reads the three routing signals (waiting, running, KV-cache usage) of one
model from the whole page, summing across ``engine`` series:

* ``read_stats[c]`` / ``read_stats[py]``: :func:`llmgw.scrape.read_stats` with the
  compiled promscan or its pure twin (the gateway's path; lines are checked up to the
  metric name and unwanted ones skipped);
* ``regex``: one compiled regex that finds only the three gauges, and a sum: the
  cheapest hand-rolled reader, which checks nothing;
* ``prometheus_client``: ``text_string_to_metric_families`` on the decoded page, then
  the same sums: a full parse.

For reference, ``scan_strict[c]`` (every line read in full) and ``parse[c]`` /
``parse[py]`` (every sample returned as objects) show what validation and
materialisation cost. Run::

    .venv/bin/pytest bench/bench_promscan.py --benchmark-enable -p no:cacheprovider

NOTE: STYLE suggests an inner loop of ~100 calls per round; pytest-benchmark's own
calibration (``--benchmark-min-time``) already repeats the fast calls within a round,
and leaving one call per measurement keeps every figure in microseconds per page.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
from prometheus_client.parser import text_string_to_metric_families
from pytest_benchmark.fixture import BenchmarkFixture

from llmgw import scrape
from llmgw._fast import promscan_py

PAGE = (Path(__file__).parent.parent / "tests" / "data" / "vllm_metrics.txt").read_bytes()
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
EXPECTED = scrape.Stats(3.0, 12.0, 0.4213)
NAMES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")


def _compiled() -> ModuleType | None:
    try:
        return importlib.import_module("llmgw._fast.promscan")
    except ImportError:
        return None


TWINS = [
    pytest.param(
        "c", id="c", marks=pytest.mark.skipif(_compiled() is None, reason="promscan is not compiled")
    ),
    pytest.param("py", id="py"),
]


def _twin(which: str) -> ModuleType:
    module = _compiled() if which == "c" else promscan_py
    assert module is not None
    return module


@pytest.fixture(params=TWINS)
def read_stats(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Callable[..., scrape.Stats]:
    """``scrape.read_stats`` running on the twin under test."""
    monkeypatch.setattr(scrape, "promscan", _twin(request.param))
    monkeypatch.setattr(scrape, "_engine_mappings", {})
    return scrape.read_stats


_GAUGES = re.compile(
    rb"^(vllm:num_requests_waiting|vllm:num_requests_running|vllm:kv_cache_usage_perc)"
    rb"(?:\{([^}\n]*)\})?[ \t]+(\S+)",
    re.MULTILINE,
)


def regex_read(page: bytes, model: str) -> scrape.Stats:
    want = b'model_name="' + model.encode() + b'"'
    acc: dict[bytes, float] = {}
    for name, labels, value in _GAUGES.findall(page):
        if want in labels:
            acc[name] = acc.get(name, 0.0) + float(value)
    return scrape.Stats(*(acc.get(n.encode()) for n in NAMES))


def prometheus_client_read(page: bytes, model: str) -> scrape.Stats:
    acc: dict[str, float] = {}
    for family in text_string_to_metric_families(page.decode()):
        for s in family.samples:
            if s.name in NAMES and s.labels.get("model_name") == model:
                acc[s.name] = acc.get(s.name, 0.0) + s.value
    return scrape.Stats(*(acc.get(n) for n in NAMES))


def test_read_stats(benchmark: BenchmarkFixture, read_stats: Callable[..., scrape.Stats]) -> None:
    benchmark.group = "vllm page: read the routing signals"
    assert benchmark(read_stats, PAGE, "vllm", MODEL) == EXPECTED


def test_regex(benchmark: BenchmarkFixture) -> None:
    benchmark.group = "vllm page: read the routing signals"
    assert benchmark(regex_read, PAGE, MODEL) == EXPECTED


def test_prometheus_client(benchmark: BenchmarkFixture) -> None:
    benchmark.group = "vllm page: read the routing signals"
    assert benchmark(prometheus_client_read, PAGE, MODEL) == EXPECTED


@pytest.mark.skipif(_compiled() is None, reason="promscan is not compiled")
def test_scan_strict(benchmark: BenchmarkFixture) -> None:
    benchmark.group = "vllm page: validate every line"
    module = _twin("c")
    mapping = scrape.mapping_for("vllm", impl=module)
    assert benchmark(module.scan, PAGE, mapping, MODEL, strict=True).values == tuple(EXPECTED)


@pytest.mark.parametrize("which", TWINS)
def test_parse(benchmark: BenchmarkFixture, which: str) -> None:
    benchmark.group = "vllm page: every sample as objects"
    assert len(benchmark(_twin(which).parse, PAGE)) == 482
