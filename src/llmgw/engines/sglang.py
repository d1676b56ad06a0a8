"""SGLang (``python -m sglang.launch_server``).

Metrics need ``--enable-metrics``. Names use ``sglang:`` (older builds
``sglang_``); both are accepted. Scheduler gauges carry ``tp_rank``/``pp_rank``
and, with data parallelism, ``dp_rank``: queue and running are summed across
them, ``token_usage`` (KV pool, 0..1) takes the max.
"""

from __future__ import annotations

from .base import EngineInfo, MetricSpec

WAITING = "sglang:num_queue_reqs"
RUNNING = "sglang:num_running_reqs"
KV_CACHE_USAGE = "sglang:token_usage"
WAITING_OLD = "sglang_num_queue_reqs"
RUNNING_OLD = "sglang_num_running_reqs"
KV_CACHE_USAGE_OLD = "sglang_token_usage"
NUM_USED_TOKENS = "sglang:num_used_tokens"
MAX_TOTAL_NUM_TOKENS = "sglang:max_total_num_tokens"
GEN_THROUGHPUT = "sglang:gen_throughput"
CACHE_HIT_RATE = "sglang:cache_hit_rate"
PROMPT_TOKENS = "sglang:prompt_tokens"  # counter
GENERATION_TOKENS = "sglang:generation_tokens"  # counter
NUM_REQUESTS = "sglang:num_requests"  # counter
TTFT = "sglang:time_to_first_token_seconds"  # histogram
E2E = "sglang:e2e_request_latency_seconds"  # histogram
MODEL_LABEL = "model_name"

INFO = EngineInfo(
    name="sglang",
    title="SGLang",
    metrics_path="/metrics",
    metrics_need_key=False,
    waiting=MetricSpec((WAITING, WAITING_OLD), "sum"),
    running=MetricSpec((RUNNING, RUNNING_OLD), "sum"),
    kv_cache_usage=MetricSpec((KV_CACHE_USAGE, KV_CACHE_USAGE_OLD), "max"),
    model_label=MODEL_LABEL,
    owned_by="sglang",
    default_port=30000,
    # ErrorResponse: flat {"object": "error", ..., "code": int}, the HTTP status
    # (sgl-project/sglang python/sglang/srt/entrypoints/openai/protocol.py).
    integer_error_code=True,
    # uvicorn.run(..., timeout_keep_alive=5) (sgl-project/sglang:
    # python/sglang/srt/entrypoints/http_server.py, launch_server).
    keep_alive=5.0,
    notes=("start SGLang with --enable-metrics",),
)
