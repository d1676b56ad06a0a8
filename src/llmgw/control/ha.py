"""The control plane's own HA families on the admin ``/metrics``.

* ``llmgw_control_leader`` 1 while this process acts as the control plane, 0 on a
  standby (always 1 without a database: there is no election).
* ``llmgw_control_leader_epoch``: the lease's epoch as this process knows it (its own
  term on the leader, the holder's as last read on a standby); absent without a
  database or before the lease was first read: an epoch nobody measured is no 0.
* ``llmgw_control_leader_terms_total`` / ``llmgw_control_leader_step_downs_total``:
  terms won and lost by this process.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

if TYPE_CHECKING:
    from .service import ControlPlane

__all__ = ["LeaderCollector"]


class LeaderCollector:
    """Reads the control plane's election state at scrape time."""

    def __init__(self, cp: ControlPlane) -> None:
        self.cp = cp

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        cp = self.cp
        g = GaugeMetricFamily("llmgw_control_leader",
                              "1 while this process acts as the control plane (the leader), 0 on a standby.")
        g.add_metric([], 1.0 if cp.leading() else 0.0)
        yield g
        lead = cp.leadership
        if lead is None:
            return
        epoch = lead.last_epoch
        if epoch is not None:
            e = GaugeMetricFamily("llmgw_control_leader_epoch",
                                  "The control-plane lease's epoch as this process knows it (bumped on every takeover).")
            e.add_metric([], float(epoch))
            yield e
        t = CounterMetricFamily("llmgw_control_leader_terms", "Terms this process has won as control-plane leader.")
        t.add_metric([], float(lead.terms))
        yield t
        s = CounterMetricFamily("llmgw_control_leader_step_downs",
                                "Times this process stopped leading (deadline passed or lease taken over).")
        s.add_metric([], float(lead.stepped_down))
        yield s
