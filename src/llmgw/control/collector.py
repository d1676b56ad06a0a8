"""The cluster on the admin ``/metrics``: families computed at scrape time from the node map.

No ticker and no copy: each scrape walks the node map (reference fleet.md §1.5).
Values are as of each node's last heartbeat (every HELP says so). A reading the
agent did not report has no sample. A node past its grace keeps ``llmgw_node_up 0``,
its info and its last-heartbeat timestamp; its GPU and node readings stop being
exported. Removed nodes and GPUs vanish (families are built per scrape).

Every GPU series is labelled ``node``, ``gpu_uuid``, ``gpu_index`` (``""`` when the
index was not reported); the hardware model is only on ``llmgw_gpu_info`` as
``gpu_model`` (``model`` means the LLM on this page).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from .nodes import NodeMap
    from .service import ControlStats

__all__ = ["GPU_HEALTH_STATES", "ClusterCollector"]

_AS_OF = " (as of the node's last heartbeat)"
_GPU = ["node", "gpu_uuid", "gpu_index"]

# model health -> exported state (fleet.md §1.5 names)
GPU_HEALTH_STATES = {"ok": "healthy", "degraded": "degraded", "error": "unhealthy"}
FABRIC_STATES = ("not_supported", "not_started", "in_progress", "completed")

# (GPU attribute, family, HELP, scale, type)
_GPU_GAUGES: tuple[tuple[str, str, str, float], ...] = (
    ("memory_total_bytes", "llmgw_gpu_memory_total_bytes", "GPU memory, bytes", 1.0),
    ("memory_used_bytes", "llmgw_gpu_memory_used_bytes", "GPU memory in use, bytes", 1.0),
    ("memory_free_bytes", "llmgw_gpu_memory_free_bytes", "GPU memory free, bytes", 1.0),
    ("utilization_gpu_ratio", "llmgw_gpu_utilization_ratio",
     "GPU utilisation 0-1: the fraction of time a kernel ran (absent on MIG-enabled GPUs)", 1.0),
    ("utilization_memory_ratio", "llmgw_gpu_memory_bandwidth_utilization_ratio",
     "GPU memory-bandwidth utilisation 0-1 (time memory was read or written, not memory used)", 1.0),
    ("temperature_celsius", "llmgw_gpu_temperature_celsius", "GPU temperature, degrees Celsius", 1.0),
    ("power_watts", "llmgw_gpu_power_watts", "GPU power draw, watts", 1.0),
    ("power_limit_watts", "llmgw_gpu_power_limit_watts", "GPU power limit, watts", 1.0),
    ("sm_clock_mhz", "llmgw_gpu_sm_clock_hertz", "GPU SM clock, hertz", 1e6),
    ("nvlink_links_active", "llmgw_gpu_nvlink_active_links", "NVLink links active", 1.0),
)


class ClusterCollector(Collector):
    """The cluster families (module docstring) and the control plane's own counters."""

    def __init__(self, nodes: NodeMap, stats: ControlStats) -> None:
        self.nodes = nodes
        self.stats = stats

    def describe(self) -> list[Metric]:
        return []  # the registry is auto_describe=False; names are known only at scrape time

    def collect(self) -> Iterator[Metric]:
        t0 = time.perf_counter()
        families = self._cluster()
        families.extend(self._self())
        yield from families
        g = GaugeMetricFamily(
            "llmgw_cluster_collect_duration_seconds", "How long computing the cluster families took on this scrape"
        )
        g.add_metric([], time.perf_counter() - t0)
        yield g

    def _cluster(self) -> list[Metric]:
        nodes = self.nodes
        now = nodes.monotonic()
        info = GaugeMetricFamily(
            "llmgw_node_info", "A registered node (1); labels describe it" + _AS_OF,
            labels=["node", "hostname", "agent_version", "driver_version", "cuda_driver_version", "gpu_source"],
        )
        up = GaugeMetricFamily("llmgw_node_up", "1 if the node's last heartbeat is within the grace, else 0", labels=["node"])
        cordoned = GaugeMetricFamily("llmgw_node_cordoned", "1 if an operator cordoned the node", labels=["node"])
        last = GaugeMetricFamily(
            "llmgw_node_last_heartbeat_timestamp_seconds",
            "When the node's last heartbeat arrived, Unix seconds on the control plane's clock", labels=["node"],
        )
        age = GaugeMetricFamily(
            "llmgw_node_heartbeat_age_seconds", "Seconds since the node's last heartbeat, at this scrape", labels=["node"]
        )
        cores = GaugeMetricFamily("llmgw_node_cpu_cores", "Logical CPU cores" + _AS_OF, labels=["node"])
        mem_total = GaugeMetricFamily("llmgw_node_memory_total_bytes", "Node memory, bytes" + _AS_OF, labels=["node"])
        mem_avail = GaugeMetricFamily(
            "llmgw_node_memory_available_bytes", "Node memory available, bytes" + _AS_OF, labels=["node"]
        )
        node_errors = GaugeMetricFamily(
            "llmgw_node_discovery_errors", "Node-level discovery failures in the last reading" + _AS_OF, labels=["node"]
        )
        ib_rx = CounterMetricFamily(
            "llmgw_node_ib_port_receive_bytes", "InfiniBand/RoCE bytes received" + _AS_OF,
            labels=["node", "device", "port"],
        )
        ib_tx = CounterMetricFamily(
            "llmgw_node_ib_port_transmit_bytes", "InfiniBand/RoCE bytes sent" + _AS_OF, labels=["node", "device", "port"]
        )
        gpu_info = GaugeMetricFamily(
            "llmgw_gpu_info", "A GPU or MIG device (1); labels describe it" + _AS_OF,
            labels=[*_GPU, "gpu_model", "pci_bus_id", "parent_gpu_uuid"],
        )
        gauges = [(attr, GaugeMetricFamily(name, help_ + _AS_OF, labels=_GPU), scale)
                  for attr, name, help_, scale in _GPU_GAUGES]
        energy = CounterMetricFamily(
            "llmgw_gpu_energy_joules", "GPU energy since the driver loaded, joules" + _AS_OF, labels=_GPU
        )
        ecc = CounterMetricFamily(
            "llmgw_gpu_ecc_errors", "ECC errors since the driver loaded (volatile)" + _AS_OF,
            labels=[*_GPU, "error_type"],
        )
        xid = CounterMetricFamily(
            "llmgw_gpu_xid_errors", "XID events the agent saw since it started" + _AS_OF, labels=[*_GPU, "xid"]
        )
        remapped = GaugeMetricFamily(
            "llmgw_gpu_remapped_rows", "Rows remapped, by the kind of error" + _AS_OF, labels=[*_GPU, "kind"]
        )
        remap_pending = GaugeMetricFamily(
            "llmgw_gpu_row_remap_pending", "1 if a row remap is pending (needs a GPU reset)" + _AS_OF, labels=_GPU
        )
        remap_failure = GaugeMetricFamily("llmgw_gpu_row_remap_failure", "1 if a row remap failed" + _AS_OF, labels=_GPU)
        mig = GaugeMetricFamily("llmgw_gpu_mig_mode", "1 if MIG mode is on" + _AS_OF, labels=_GPU)
        health = GaugeMetricFamily(
            "llmgw_gpu_health_state", "1 on the GPU's current health state (healthy, degraded, unhealthy)" + _AS_OF,
            labels=[*_GPU, "state"],
        )
        fabric = GaugeMetricFamily(
            "llmgw_gpu_fabric_state", "1 on the GPU's NVSwitch fabric state" + _AS_OF, labels=[*_GPU, "state"]
        )
        for st in nodes:
            d = st.discovery
            f = d.facts
            n = st.name
            is_up = nodes.is_up(st, now)
            info.add_metric(
                [n, f.hostname, st.agent_version or f.agent_version or "", f.driver_version or "",
                 f.cuda_driver_version or "", d.source], 1.0,
            )
            up.add_metric([n], 1.0 if is_up else 0.0)
            cordoned.add_metric([n], 1.0 if st.cordoned else 0.0)
            last.add_metric([n], st.last_heartbeat)
            age.add_metric([n], st.age(now))
            if not is_up:
                continue  # push expiry: readings of a node past its grace are not current
            for fam, v in ((cores, f.cpu_cores), (mem_total, f.memory_total_bytes), (mem_avail, f.memory_available_bytes)):
                if v is not None:
                    fam.add_metric([n], float(v))
            node_errors.add_metric([n], float(len(d.errors)))
            for p in f.infiniband:
                if p.rcv_bytes is not None:
                    ib_rx.add_metric([n, p.device, str(p.port)], float(p.rcv_bytes))
                if p.xmit_bytes is not None:
                    ib_tx.add_metric([n, p.device, str(p.port)], float(p.xmit_bytes))
            for g in d.gpus:
                lab = [n, g.uuid, "" if g.index is None else str(g.index)]
                gpu_info.add_metric([*lab, g.name or "", g.pci_bus_id or "", g.parent_uuid or ""], 1.0)
                for attr, fam, scale in gauges:
                    v = getattr(g, attr)
                    if v is not None:
                        fam.add_metric(lab, float(v) * scale)
                if g.energy_joules is not None:
                    energy.add_metric(lab, float(g.energy_joules))
                if g.ecc_corrected_volatile is not None:
                    ecc.add_metric([*lab, "corrected"], float(g.ecc_corrected_volatile))
                if g.ecc_uncorrected_volatile is not None:
                    ecc.add_metric([*lab, "uncorrected"], float(g.ecc_uncorrected_volatile))
                for code, count in g.xid_errors:
                    xid.add_metric([*lab, str(code)], float(count))
                if g.remapped_rows_correctable is not None:
                    remapped.add_metric([*lab, "correctable"], float(g.remapped_rows_correctable))
                if g.remapped_rows_uncorrectable is not None:
                    remapped.add_metric([*lab, "uncorrectable"], float(g.remapped_rows_uncorrectable))
                for fam, b in ((remap_pending, g.remapped_rows_pending), (remap_failure, g.remapped_rows_failure),
                               (mig, g.mig_mode)):
                    if b is not None:
                        fam.add_metric(lab, 1.0 if b else 0.0)
                state = GPU_HEALTH_STATES.get(g.health, g.health)
                for s in dict.fromkeys([*GPU_HEALTH_STATES.values(), state]):
                    health.add_metric([*lab, s], 1.0 if s == state else 0.0)
                if g.fabric_state is not None:
                    for s in dict.fromkeys([*FABRIC_STATES, g.fabric_state]):
                        fabric.add_metric([*lab, s], 1.0 if s == g.fabric_state else 0.0)
        return [
            info, up, cordoned, last, age, cores, mem_total, mem_avail, node_errors, ib_rx, ib_tx, gpu_info,
            *(fam for _, fam, _ in gauges), energy, ecc, xid, remapped, remap_pending, remap_failure, mig, health,
            fabric,
        ]

    def _self(self) -> list[Metric]:
        s = self.stats
        nodes = GaugeMetricFamily("llmgw_control_nodes", "Registered nodes by state", labels=["state"])
        counts = {"up": 0, "unhealthy": 0}
        now = self.nodes.monotonic()
        for st in self.nodes:
            counts[self.nodes.state(st, now)] += 1
        for k, v in counts.items():
            nodes.add_metric([k], float(v))
        reg = CounterMetricFamily(
            "llmgw_control_registrations", "Registrations accepted (first ones and re-registrations)", labels=["kind"]
        )
        reg.add_metric(["new"], float(s.registrations - s.reregistrations))
        reg.add_metric(["re"], float(s.reregistrations))
        dereg = CounterMetricFamily("llmgw_control_deregistrations", "Nodes that deregistered (their agent stopped)")
        dereg.add_metric([], float(s.deregistrations))
        refused = CounterMetricFamily("llmgw_control_joins_refused", "Calls from agents refused, by reason", labels=["reason"])
        for reason in dict.fromkeys(["invalid_token", "missing_token", "incompatible_version", "invalid_request",
                                     *s.refused]):
            refused.add_metric([reason], float(s.refused.get(reason, 0)))
        beats = CounterMetricFamily("llmgw_control_heartbeats", "Heartbeats received")
        beats.add_metric([], float(s.heartbeats))
        errors = CounterMetricFamily(
            "llmgw_control_rpc_errors", "Agent calls answered with an error, by method and gRPC status",
            labels=["method", "code"],
        )
        for (method, code), v in sorted(s.rpc_errors.items()):
            errors.add_metric([method, code], float(v))
        return [nodes, reg, dereg, refused, beats, errors]
