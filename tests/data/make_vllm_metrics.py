"""Write ``vllm_metrics.txt`` and ``vllm_metrics_openmetrics.txt``: a vLLM ``/metrics`` page.

The page is rendered by ``prometheus_client`` itself (the library vLLM uses), from a
registry holding the families a 2026 vLLM OpenAI server exposes: the ``vllm:`` V1
engine metrics with ``model_name`` and ``engine`` labels (``shared/reference/engines.md``
§1.2, bucket ladders as vLLM registers them), the HTTP metrics of its FastAPI
instrumentator, and the ``python_*`` / ``process_*`` runtime families. Values come
from a seeded generator and ``_created`` stamps from a fixed clock, so the output is
the same on every run::

    .venv/bin/python tests/data/make_vllm_metrics.py            # rewrite both files
    .venv/bin/python tests/data/make_vllm_metrics.py --check    # exit 1 if they differ

The OpenMetrics rendering also carries exemplars (trace ids) on a few buckets.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from unittest import mock

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.openmetrics.exposition import ALLOWUTF8
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.registry import Collector

HERE = Path(__file__).parent
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
MAX_MODEL_LEN = 131072
CLOCK = 1767225600.0  # 2026-01-01T00:00:00Z: every _created sample
# What the routing signals read on the generated page (engine "0").
WAITING = 3
RUNNING = 12
KV_CACHE_USAGE = 0.4213

LABELS = ["model_name", "engine"]
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0]  # fmt: skip
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip
ITERATION_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
HIGHR_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5, 5, 7.5,
                 10, 30, 60]  # fmt: skip
HANDLERS = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/tokenize",
    "/ping",
    "/health",
    "/metrics",
]


def buckets_1_2_5(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's token-count ladder)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return out
            out.append(m * scale)
        scale *= 10


class RuntimeCollector(Collector):
    """The python_gc_*, python_info and process_* families, with fixed values."""

    def collect(self) -> Iterator[Metric]:
        gc_families = [
            ("python_gc_objects_collected", "Objects collected during gc", (51234, 9876, 1432)),
            ("python_gc_objects_uncollectable", "Uncollectable objects found during GC", (0, 0, 0)),
            ("python_gc_collections", "Number of times this generation was collected", (1893, 171, 12)),
        ]
        for name, doc, values in gc_families:
            c = CounterMetricFamily(name, doc, labels=["generation"])
            for gen, v in enumerate(values):
                c.add_metric([str(gen)], v)
            yield c
        info = GaugeMetricFamily(
            "python_info",
            "Python platform information",
            labels=["implementation", "major", "minor", "patchlevel", "version"],
        )
        info.add_metric(["CPython", "3", "12", "11", "3.12.11"], 1)
        yield info
        yield GaugeMetricFamily(
            "process_virtual_memory_bytes", "Virtual memory size in bytes.", 42_371_518_464
        )
        yield GaugeMetricFamily(
            "process_resident_memory_bytes", "Resident memory size in bytes.", 3_287_912_448
        )
        yield GaugeMetricFamily(
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds.",
            CLOCK - 3600.25,
        )
        yield CounterMetricFamily(
            "process_cpu_seconds_total", "Total user and system CPU time spent in seconds.", 1312.47
        )
        yield GaugeMetricFamily("process_open_fds", "Number of open file descriptors.", 97)
        yield GaugeMetricFamily("process_max_fds", "Maximum number of open file descriptors.", 1048576)


def build_registry(seed: int = 2026) -> CollectorRegistry:
    rnd = random.Random(seed)
    reg = CollectorRegistry(auto_describe=True)
    reg.register(RuntimeCollector())
    engine = "0"
    lv = (MODEL, engine)

    def gauge(name: str, doc: str, value: float) -> None:
        Gauge(name, doc, LABELS, registry=reg).labels(*lv).set(value)

    def counter(name: str, doc: str, value: float) -> None:
        Counter(name, doc, LABELS, registry=reg).labels(*lv).inc(value)

    def histogram(name: str, doc: str, buckets: Sequence[float], draw: object, n: int = 400) -> Histogram:
        h = Histogram(name, doc, LABELS, buckets=buckets, registry=reg)
        child = h.labels(*lv)
        for _ in range(n):
            child.observe(draw())  # type: ignore[operator]
        return h

    # -- scheduler state (the routing gauges) --
    gauge("vllm:num_requests_running", "Number of requests in model execution batches.", RUNNING)
    gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", WAITING)
    by_reason = Gauge(
        "vllm:num_requests_waiting_by_reason",
        "Number of requests waiting to be processed, by reason.",
        [*LABELS, "reason"],
        registry=reg,
    )
    by_reason.labels(*lv, "capacity").set(WAITING - 1)
    by_reason.labels(*lv, "deferred").set(1)
    gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", KV_CACHE_USAGE)
    sleep = Gauge("vllm:engine_sleep_state", "Engine sleep state.", [*LABELS, "sleep_state"], registry=reg)
    for state, v in (("awake", 1), ("weights_offloaded", 0), ("discard_all", 0)):
        sleep.labels(*lv, state).set(v)

    # -- counters --
    queries = rnd.randint(4_000_000, 6_000_000)
    counter(
        "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", queries
    )
    counter(
        "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", queries * 0.37
    )
    counter(
        "vllm:external_prefix_cache_queries",
        "External prefix cache queries from KV connector cross-instance cache sharing, "
        "in terms of number of queried tokens.",
        0,
    )
    counter(
        "vllm:external_prefix_cache_hits",
        "External prefix cache hits from KV connector cross-instance cache sharing, "
        "in terms of number of cached tokens.",
        0,
    )
    counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", 17)
    counter("vllm:prompt_tokens", "Number of prefill tokens processed.", queries)
    counter(
        "vllm:generation_tokens", "Number of generation tokens processed.", rnd.randint(900_000, 1_100_000)
    )
    success = Counter(
        "vllm:request_success",
        "Count of successfully processed requests.",
        [*LABELS, "finished_reason"],
        registry=reg,
    )
    for reason, v in (("stop", 3912), ("length", 402), ("abort", 23), ("error", 1)):
        success.labels(*lv, reason).inc(v)

    # -- histograms of counts --
    tokens = buckets_1_2_5(MAX_MODEL_LEN)
    histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens,
              lambda: int(rnd.lognormvariate(6.5, 1.2)))  # fmt: skip
    histogram("vllm:request_generation_tokens", "Number of generation tokens processed.", tokens,
              lambda: int(rnd.lognormvariate(5.2, 1.0)))  # fmt: skip
    histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", ITERATION_BUCKETS,
              lambda: int(rnd.lognormvariate(5.0, 1.5)) + 1)  # fmt: skip
    histogram("vllm:request_max_num_generation_tokens",
              "Histogram of maximum number of requested generation tokens.", tokens,
              lambda: rnd.choice([256, 512, 1024, 2048, 4096]))  # fmt: skip
    histogram("vllm:request_params_n", "Histogram of the n request parameter.", [1, 2, 5, 10, 20],
              lambda: rnd.choice([1, 1, 1, 1, 2]))  # fmt: skip
    histogram("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", tokens,
              lambda: rnd.choice([256, 512, 1024, 2048, 4096]))  # fmt: skip

    # -- histograms of times --
    ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                     TTFT_BUCKETS, lambda: rnd.lognormvariate(-2.0, 1.0))  # fmt: skip
    histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS,
              lambda: rnd.lognormvariate(-3.8, 0.4))  # fmt: skip
    histogram("vllm:request_time_per_output_token_seconds",
              "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS,
              lambda: rnd.lognormvariate(-3.7, 0.3))  # fmt: skip
    for name, phase, mu in (
        ("vllm:e2e_request_latency_seconds", None, 1.5),
        ("vllm:request_queue_time_seconds", "WAITING", -1.5),
        ("vllm:request_inference_time_seconds", "RUNNING", 1.4),
        ("vllm:request_prefill_time_seconds", "PREFILL", -2.0),
        ("vllm:request_decode_time_seconds", "DECODE", 1.3),
    ):
        doc = (
            "Histogram of e2e request latency in seconds."
            if phase is None
            else f"Histogram of time spent in {phase} phase for request."
        )
        histogram(name, doc, LATENCY_BUCKETS, lambda mu=mu: rnd.lognormvariate(mu, 0.8))

    # -- info gauges --
    cache_info = {
        "block_size": "16",
        "cache_dtype": "auto",
        "calculate_kv_scales": "False",
        "cpu_offload_gb": "0",
        "enable_prefix_caching": "True",
        "engine": engine,
        "gpu_memory_utilization": "0.9",
        "is_attention_free": "False",
        "kv_sharing_fast_prefill": "False",
        "mamba_page_size_padded": "None",
        "num_cpu_blocks": "None",
        "num_gpu_blocks": "27689",
        "num_gpu_blocks_override": "None",
        "prefix_caching_hash_algo": "sha256",
        "sliding_window": "None",
        "swap_space": "4",
        "swap_space_bytes": "4294967296",
    }
    Gauge(
        "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", list(cache_info), registry=reg
    ).labels(**cache_info).set(1)

    # -- the HTTP server (prometheus-fastapi-instrumentator) --
    requests = Counter(
        "http_requests_total",
        "Total number of requests by method, status and handler.",
        ["handler", "method", "status"],
        registry=reg,
    )
    for handler, method, status, v in (
        ("/v1/chat/completions", "POST", "2xx", 4310),
        ("/v1/chat/completions", "POST", "4xx", 12),
        ("/v1/completions", "POST", "2xx", 28),
        ("/v1/models", "GET", "2xx", 311),
        ("/tokenize", "POST", "2xx", 96),
        ("/ping", "GET", "2xx", 1440),
        ("/health", "GET", "2xx", 7201),
        ("/metrics", "GET", "2xx", 36004),
    ):
        requests.labels(handler, method, status).inc(v)
    req_size = Summary(
        "http_request_size_bytes",
        "Content length of incoming requests by handler. Only value of header is respected. "
        "Otherwise ignored. No percentile calculated. ",
        ["handler"],
        registry=reg,
    )
    resp_size = Summary(
        "http_response_size_bytes",
        "Content length of outgoing responses by handler. Only value of header is respected. "
        "Otherwise ignored. No percentile calculated. ",
        ["handler"],
        registry=reg,
    )
    highr = Histogram(
        "http_request_duration_highr_seconds",
        "Latency with many buckets but no API specific labels. Made for more accurate percentile calculations. ",
        buckets=HIGHR_BUCKETS,
        registry=reg,
    )
    duration = Histogram(
        "http_request_duration_seconds",
        "Latency with only few buckets by handler. Made to be only used if aggregation by handler is important. ",
        ["handler", "method"],
        buckets=[0.1, 0.5, 1],
        registry=reg,
    )
    for handler in HANDLERS:
        method = "POST" if handler.endswith(("completions", "tokenize")) else "GET"
        for _ in range(50):
            t = rnd.lognormvariate(-4.0 if method == "GET" else 1.0, 1.0)
            req_size.labels(handler).observe(rnd.randint(200, 9000) if method == "POST" else 0)
            resp_size.labels(handler).observe(rnd.randint(300, 60000))
            highr.observe(t)
            duration.labels(handler, method).observe(t)

    # Exemplars appear only in the OpenMetrics rendering.
    ttft.labels(*lv).observe(0.042, exemplar={"trace_id": "4bf92f3577b34da6a3ce929d0e0e4736"})
    success.labels(*lv, "stop").inc(1, exemplar={"trace_id": "00f067aa0ba902b7"})
    return reg


def render() -> tuple[bytes, bytes]:
    with mock.patch("time.time", return_value=CLOCK):
        reg = build_registry()
    # ALLOWUTF8 keeps the "vllm:" colons in sample names, as vLLM's own client renders them.
    return generate_latest(reg), generate_openmetrics(reg, escaping=ALLOWUTF8)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare with the files instead of writing them")
    args = ap.parse_args()
    text, om = render()
    targets = {HERE / "vllm_metrics.txt": text, HERE / "vllm_metrics_openmetrics.txt": om}
    if args.check:
        stale = [p.name for p, data in targets.items() if not p.exists() or p.read_bytes() != data]
        if stale:
            print("out of date:", ", ".join(stale), file=sys.stderr)
            return 1
        return 0
    for path, data in targets.items():
        path.write_bytes(data)
        lines = data.count(b"\n")
        samples = sum(1 for line in data.splitlines() if line and not line.startswith(b"#"))
        print(f"{path.name}: {len(data)} bytes, {lines} lines, {samples} samples")
    return 0


if __name__ == "__main__":
    sys.exit(main())
