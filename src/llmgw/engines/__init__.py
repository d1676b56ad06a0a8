"""Engine dialects: one module per engine, each exporting ``INFO``."""

from __future__ import annotations

from . import external, generic, llamacpp, sglang, trtllm, vllm
from .base import EngineInfo, MetricSpec

ENGINES: dict[str, EngineInfo] = {
    m.INFO.name: m.INFO for m in (vllm, llamacpp, trtllm, sglang, generic, external)
}
ENGINE_NAMES: tuple[str, ...] = tuple(ENGINES)
SIMULATED_ENGINES: tuple[str, ...] = ("vllm", "llamacpp", "trtllm", "sglang")

__all__ = ["ENGINES", "ENGINE_NAMES", "SIMULATED_ENGINES", "EngineInfo", "MetricSpec", "get"]


def get(name: str) -> EngineInfo:
    """The dialect called ``name``; ``KeyError`` if there is none."""
    return ENGINES[name]
