"""An external OpenAI-compatible provider: proxied, never scraped."""

from __future__ import annotations

from .base import EngineInfo, MetricSpec

INFO = EngineInfo(
    name="external",
    title="external provider",
    metrics_path="",
    metrics_need_key=False,
    waiting=MetricSpec(()),
    running=MetricSpec(()),
    kv_cache_usage=MetricSpec(()),
    model_label=None,
    owned_by="external",
    default_port=443,
    scraped=False,
)
