"""TensorRT-LLM's ``trtllm-serve``.

Prometheus text lives at ``/prometheus/metrics`` and is mounted only with
``return_perf_metrics: true`` (iteration gauges also need
``enable_iter_perf_stats: true``). ``/metrics`` is a destructive JSON queue: never
scrape it. No API-key support. Names gained the ``trtllm_`` prefix in 2026; both
forms are accepted. Labels ``model_name``/``engine_type`` are hard-coded
``"undefined"``, so the model label is not used.
"""

from __future__ import annotations

from .base import EngineInfo, MetricSpec

WAITING = "trtllm_num_requests_waiting"
RUNNING = "trtllm_num_requests_running"
KV_CACHE_USAGE = "trtllm_kv_cache_utilization"
WAITING_OLD = "num_requests_waiting"
RUNNING_OLD = "num_requests_running"
KV_CACHE_USAGE_OLD = "kv_cache_utilization"
REQUEST_SUCCESS = "trtllm_request_success"  # counter, label finished_reason
PROMPT_TOKENS = "trtllm_prompt_tokens"  # counter
GENERATION_TOKENS = "trtllm_generation_tokens"  # counter
TTFT = "trtllm_time_to_first_token_seconds"  # histogram
E2E = "trtllm_e2e_request_latency_seconds"  # histogram
QUEUE_TIME = "trtllm_request_queue_time_seconds"  # histogram
MODEL_LABEL = "model_name"

INFO = EngineInfo(
    name="trtllm",
    title="TensorRT-LLM trtllm-serve",
    metrics_path="/prometheus/metrics",
    metrics_need_key=False,
    waiting=MetricSpec((WAITING, WAITING_OLD), "sum"),
    running=MetricSpec((RUNNING, RUNNING_OLD), "sum"),
    kv_cache_usage=MetricSpec((KV_CACHE_USAGE, KV_CACHE_USAGE_OLD), "max"),
    model_label=None,
    owned_by="tensorrt_llm",
    default_port=8000,
    # ErrorResponse: flat {"object": "error", ..., "code": <HTTP status>} (engines.md §3.4 [T2]).
    integer_error_code=True,
    # uvicorn with timeout_keep_alive=TIMEOUT_KEEP_ALIVE = 5 s (NVIDIA/TensorRT-LLM:
    # tensorrt_llm/serve/openai_server.py).
    keep_alive=5.0,
    notes=("set return_perf_metrics: true and enable_iter_perf_stats: true in trtllm-serve's --config",),
    # return_perf_metrics alone mounts the page with the request histograms only; the queue,
    # running and KV gauges are filled by the iteration-stats loop, and the first builds with
    # Prometheus support (TensorRT-LLM 1.0/1.1, unprefixed names) have none (engines.md §3.2, §3.3).
    missing_metrics_hint=(
        "set enable_iter_perf_stats: true beside return_perf_metrics: true in trtllm-serve's --config; "
        "TensorRT-LLM 1.0/1.1 export no queue, running or KV gauges at all"
    ),
)
