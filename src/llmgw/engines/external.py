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
    # OpenAI's own code is a string or null (engines.md §8.3 [A3][A4]): an integer code
    # from a provider is its own, unless it is the HTTP status.
    integer_error_code=False,
    scraped=False,
)
