"""The client-facing app: OpenAI routes in, replicas out (:class:`Gateway`, one
:class:`Call` per request), the replicas and pools it routes to, and the metrics
counters it reports to.

The implementation, and the description of how a request travels and fails, is
:mod:`llmgw._fast.dataplane_py` (compiled as ``llmgw._fast.dataplane``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._accel import select

if TYPE_CHECKING:
    from .._fast.dataplane_py import (
        Call,
        Endpoint,
        Gateway,
        Hist,
        ModelPool,
        TrafficCounters,
        normalize_error,
    )
else:
    _impl = select("dataplane")
    Call = _impl.Call
    Endpoint = _impl.Endpoint
    ModelPool = _impl.ModelPool
    Gateway = _impl.Gateway
    Hist = _impl.Hist
    TrafficCounters = _impl.TrafficCounters
    normalize_error = _impl.normalize_error

__all__ = ["Call", "Endpoint", "Gateway", "Hist", "ModelPool", "TrafficCounters", "normalize_error"]
