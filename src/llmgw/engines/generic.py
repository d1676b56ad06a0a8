"""Any other OpenAI-compatible engine that serves Prometheus metrics.

It has no built-in metric names: give them per endpoint under ``metric_names``
(``waiting``, ``running``, ``kv_cache_usage``). A signal with no names is absent.
"""

from __future__ import annotations

from .base import EngineInfo, MetricSpec

INFO = EngineInfo(
    name="generic",
    title="generic engine",
    metrics_path="/metrics",
    metrics_need_key=False,
    waiting=MetricSpec((), "sum"),
    running=MetricSpec((), "sum"),
    kv_cache_usage=MetricSpec((), "max"),
    model_label=None,
    owned_by="generic",
    default_port=8000,
    # Not known; taken to do what every engine above does with an integer code.
    integer_error_code=True,
    notes=("set metric_names for this endpoint so llmgw knows what to read",),
)
