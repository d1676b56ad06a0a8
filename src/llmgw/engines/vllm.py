"""vLLM (V1 engine, OpenAI server).

``/metrics`` is open even with ``--api-key`` (vLLM checks only ``/v1*``); every
sample carries ``model_name`` (= ``--served-model-name``) and, from v0.10, an
``engine`` label per data-parallel engine core, summed here. The KV gauge was
renamed in v0.9.2 (``gpu_cache_usage_perc`` -> ``kv_cache_usage_perc``); both are
accepted. Values are fractions 0..1 despite "perc".
"""

from __future__ import annotations

from .base import EngineInfo, MetricSpec

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
KV_CACHE_USAGE_OLD = "vllm:gpu_cache_usage_perc"
REQUEST_SUCCESS = "vllm:request_success"  # counter, label finished_reason
PROMPT_TOKENS = "vllm:prompt_tokens"  # counter
GENERATION_TOKENS = "vllm:generation_tokens"  # counter
NUM_PREEMPTIONS = "vllm:num_preemptions"  # counter
TTFT = "vllm:time_to_first_token_seconds"  # histogram
ITL = "vllm:inter_token_latency_seconds"  # histogram
E2E = "vllm:e2e_request_latency_seconds"  # histogram
QUEUE_TIME = "vllm:request_queue_time_seconds"  # histogram
PROMPT_TOKENS_HIST = "vllm:request_prompt_tokens"  # histogram
GENERATION_TOKENS_HIST = "vllm:request_generation_tokens"  # histogram
CACHE_CONFIG_INFO = "vllm:cache_config_info"  # gauge = 1
MODEL_LABEL = "model_name"
ENGINE_LABEL = "engine"

INFO = EngineInfo(
    name="vllm",
    title="vLLM",
    metrics_path="/metrics",
    metrics_need_key=False,
    waiting=MetricSpec((WAITING,), "sum"),
    running=MetricSpec((RUNNING,), "sum"),
    kv_cache_usage=MetricSpec((KV_CACHE_USAGE, KV_CACHE_USAGE_OLD), "max"),
    model_label=MODEL_LABEL,
    owned_by="vllm",
    default_port=8000,
    # {"error": {..., "code": 400}} since v0.10.1, flat {"object": "error", ..., "code": 400}
    # before: the HTTP status either way (engines.md §1.4 [V15]).
    integer_error_code=True,
    # uvicorn's timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE, default 5 s
    # (vllm-project/vllm: vllm/entrypoints/openai/api_server.py, vllm/envs.py;
    # before the variable, TIMEOUT_KEEP_ALIVE = 5 in api_server.py).
    keep_alive=5.0,
    # A too-long request is a 400 named only in its words, which every version so far opens
    # the same way: "This model's maximum context length is N tokens. However, you requested
    # ..." / "... your request has N input tokens ..." (OpenAI's code for it: §8.3 [A3]).
    error_message_codes=(("maximum context length is", "context_length_exceeded"),),
    # --disable-log-stats leaves the stat loggers unset, so the vllm: gauges are not reported (§1.1 [V12]).
    missing_metrics_hint="is vLLM started with --disable-log-stats? it leaves these gauges unset",
)
