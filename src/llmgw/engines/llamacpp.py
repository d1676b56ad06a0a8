"""llama.cpp's ``llama-server``.

``/metrics`` exists only with ``--metrics`` and is behind ``--api-key`` (Bearer or
``X-Api-Key``); ``/health`` and ``/v1/models`` are public. There is no KV-cache
gauge on current builds (removed in May 2025), so that signal is absent, never 0.
One model per process: samples carry no model label. Names are emitted exactly as
written (counters already end in ``_total``).
"""

from __future__ import annotations

from .base import EngineInfo, MetricSpec

WAITING = "llamacpp:requests_deferred"
RUNNING = "llamacpp:requests_processing"
PROMPT_TOKENS_TOTAL = "llamacpp:prompt_tokens_total"
PROMPT_SECONDS_TOTAL = "llamacpp:prompt_seconds_total"
TOKENS_PREDICTED_TOTAL = "llamacpp:tokens_predicted_total"
TOKENS_PREDICTED_SECONDS_TOTAL = "llamacpp:tokens_predicted_seconds_total"
N_DECODE_TOTAL = "llamacpp:n_decode_total"
N_TOKENS_MAX = "llamacpp:n_tokens_max"
PROMPT_TOKENS_SECONDS = "llamacpp:prompt_tokens_seconds"
PREDICTED_TOKENS_SECONDS = "llamacpp:predicted_tokens_seconds"
N_BUSY_SLOTS_PER_DECODE = "llamacpp:n_busy_slots_per_decode"

INFO = EngineInfo(
    name="llamacpp",
    title="llama.cpp llama-server",
    metrics_path="/metrics",
    metrics_need_key=True,
    waiting=MetricSpec((WAITING,), "sum"),
    running=MetricSpec((RUNNING,), "sum"),
    kv_cache_usage=MetricSpec((), "max"),
    model_label=None,
    owned_by="llamacpp",
    default_port=8080,
    notes=("start llama-server with --metrics, or llmgw routes to it blind",),
)
