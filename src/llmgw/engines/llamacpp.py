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

# Error bodies: {"error": {"code": <HTTP status>, "message": ..., "type": ...}}, the
# type by status as below; a prompt longer than the context is a 400 of its own type,
# which also carries the prompt's length and the context's (engines.md §2.5 [C8]).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    500: "server_error",
    501: "not_supported_error",
    503: "unavailable_error",
}
CONTEXT_ERROR_TYPE = "exceed_context_size_error"
CONTEXT_ERROR_FIELDS = ("n_prompt_tokens", "n_ctx")

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
    integer_error_code=True,  # [C8]
    # OpenAI calls a prompt longer than the context "context_length_exceeded".
    error_type_codes=((CONTEXT_ERROR_TYPE, "context_length_exceeded"),),
    error_extra_fields=CONTEXT_ERROR_FIELDS,
    # cpp-httplib's CPPHTTPLIB_KEEPALIVE_TIMEOUT_SECOND, 5 s (yhirose/cpp-httplib:
    # httplib.h; llama-server does not change it): measured on the llama-server
    # built from llama-cpp-python 0.3.36, whose answers say "Keep-Alive: timeout=5,
    # max=100" and which closes an idle connection 5.0 s after an answer.
    keep_alive=5.0,
    # It closes the connection at once after a streamed answer, which says
    # "Keep-Alive: timeout=5, max=100" all the same (measured on the same binary;
    # engines.md §2).
    closes_after_stream=True,
    notes=("start llama-server with --metrics, or llmgw routes to it blind",),
)
