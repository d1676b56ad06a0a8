"""What the data path reports as it works, for metrics and logs.

:class:`Observer` is the set of hooks the gateway calls on its hot path;
:class:`NullObserver` does nothing (metrics off); :class:`TrafficCounters`
counts in plain dicts (``llmgw.admin.metrics.PrometheusObserver`` renders them
at scrape time). The implementation, with the meaning of each hook's arguments,
is :mod:`llmgw._fast.counters_py` (compiled as ``llmgw._fast.counters``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._accel import select

if TYPE_CHECKING:
    from .._fast.counters_py import OTHER, Hist, NullObserver, Observer, RequestSeries, TrafficCounters
else:
    _impl = select("counters")
    OTHER = _impl.OTHER
    Hist = _impl.Hist
    NullObserver = _impl.NullObserver
    Observer = _impl.Observer
    RequestSeries = _impl.RequestSeries
    TrafficCounters = _impl.TrafficCounters

__all__ = ["OTHER", "Hist", "NullObserver", "Observer", "RequestSeries", "TrafficCounters"]
