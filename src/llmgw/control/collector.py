"""The cluster on the admin ``/metrics``: families computed at scrape time from the node map.

No ticker and no copy: each scrape walks the node map (reference fleet.md §1.5).
Values are as of each node's last heartbeat (every HELP says so). A reading the
agent did not report has no sample. A node past its grace keeps ``llmgw_node_up 0``,
its info and its last-heartbeat timestamp; its GPU and node readings stop being
exported. Removed nodes and GPUs vanish (families are built per scrape).

Every GPU series is labelled ``node``, ``gpu_uuid``, ``gpu_index`` (``""`` when the
index was not reported); the hardware model is only on ``llmgw_gpu_info`` as
``gpu_model`` (``model`` means the LLM on this page).

Two renderings of the same samples (:func:`node_samples` makes them, once):

* :meth:`ClusterCollector.collect`: prometheus_client families (OpenMetrics, and
  anything reading the registry);
* :meth:`ClusterCollector.render_text`: llmgw's own Prometheus text (format 0.0.4)
  for the admin ``/metrics``: each node's sample lines are cached and rebuilt only
  when a heartbeat, a cordon or the grace changed them, and the walk yields to the
  event loop every few milliseconds, so a scrape of a large cluster never holds
  the data path up.
"""

from __future__ import annotations

import asyncio
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as om_generate_latest
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from .._accel import select as _select_impl

if TYPE_CHECKING:
    from .._fast import nodetext_py as _nodetext
    from .deployments import DeploymentController
    from .nodes import NodeMap, NodeState
    from .service import ControlStats
else:
    _nodetext = _select_impl("nodetext")

__all__ = ["FAMILIES", "GPU_HEALTH_STATES", "ClusterCollector", "node_samples", "node_text"]

_AS_OF = " (as of the node's last heartbeat)"
_N = ("node",)
_GPU = ("node", "gpu_uuid", "gpu_index")

# model health -> exported state (fleet.md §1.5 names), and the fabric states (one definition: nodetext's)
GPU_HEALTH_STATES = _nodetext.HEALTH_STATES
FABRIC_STATES = _nodetext.FABRIC_STATES


@dataclass(frozen=True)
class Family:
    name: str
    type: str  # "gauge" or "counter" (name without _total; samples get it)
    help: str
    labels: tuple[str, ...]


FAMILIES: tuple[Family, ...] = (
    Family("llmgw_node_info", "gauge", "A registered node (1); labels describe it" + _AS_OF,
           ("node", "hostname", "agent_version", "driver_version", "cuda_driver_version", "gpu_source")),
    Family("llmgw_node_up", "gauge", "1 if the node's last heartbeat is within the grace, else 0", _N),
    Family("llmgw_node_cordoned", "gauge", "1 if an operator cordoned the node", _N),
    Family("llmgw_node_leaving", "gauge", "1 while the node's agent is stopping and its replicas drain off it", _N),
    Family("llmgw_node_last_heartbeat_timestamp_seconds", "gauge",
           "When the node's last heartbeat arrived, Unix seconds on the control plane's clock", _N),
    Family("llmgw_node_heartbeat_age_seconds", "gauge", "Seconds since the node's last heartbeat, at this scrape", _N),
    Family("llmgw_node_cpu_cores", "gauge", "Logical CPU cores" + _AS_OF, _N),
    Family("llmgw_node_memory_total_bytes", "gauge", "Node memory, bytes" + _AS_OF, _N),
    Family("llmgw_node_memory_available_bytes", "gauge", "Node memory available, bytes" + _AS_OF, _N),
    Family("llmgw_node_discovery_errors", "gauge", "Node-level discovery failures in the last reading" + _AS_OF, _N),
    Family("llmgw_node_ib_port_receive_bytes", "counter", "InfiniBand/RoCE bytes received" + _AS_OF,
           ("node", "device", "port")),
    Family("llmgw_node_ib_port_transmit_bytes", "counter", "InfiniBand/RoCE bytes sent" + _AS_OF,
           ("node", "device", "port")),
    Family("llmgw_gpu_info", "gauge", "A GPU or MIG device (1); labels describe it" + _AS_OF,
           (*_GPU, "gpu_model", "pci_bus_id", "parent_gpu_uuid")),
    Family("llmgw_gpu_memory_total_bytes", "gauge", "GPU memory, bytes" + _AS_OF, _GPU),
    Family("llmgw_gpu_memory_used_bytes", "gauge", "GPU memory in use, bytes" + _AS_OF, _GPU),
    Family("llmgw_gpu_memory_free_bytes", "gauge", "GPU memory free, bytes" + _AS_OF, _GPU),
    Family("llmgw_gpu_utilization_ratio", "gauge",
           "GPU utilisation 0-1: the fraction of time a kernel ran (absent on MIG-enabled GPUs)" + _AS_OF, _GPU),
    Family("llmgw_gpu_memory_bandwidth_utilization_ratio", "gauge",
           "GPU memory-bandwidth utilisation 0-1 (time memory was read or written, not memory used)" + _AS_OF, _GPU),
    Family("llmgw_gpu_temperature_celsius", "gauge", "GPU temperature, degrees Celsius" + _AS_OF, _GPU),
    Family("llmgw_gpu_power_watts", "gauge", "GPU power draw, watts" + _AS_OF, _GPU),
    Family("llmgw_gpu_power_limit_watts", "gauge", "GPU power limit, watts" + _AS_OF, _GPU),
    Family("llmgw_gpu_sm_clock_hertz", "gauge", "GPU SM clock, hertz" + _AS_OF, _GPU),
    Family("llmgw_gpu_nvlink_active_links", "gauge", "NVLink links active" + _AS_OF, _GPU),
    Family("llmgw_gpu_energy_joules", "counter", "GPU energy since the driver loaded, joules" + _AS_OF, _GPU),
    Family("llmgw_gpu_ecc_errors", "counter", "ECC errors since the driver loaded (volatile)" + _AS_OF,
           (*_GPU, "error_type")),
    Family("llmgw_gpu_xid_errors", "counter", "XID events the agent saw since it started" + _AS_OF, (*_GPU, "xid")),
    Family("llmgw_gpu_remapped_rows", "gauge", "Rows remapped, by the kind of error" + _AS_OF, (*_GPU, "kind")),
    Family("llmgw_gpu_row_remap_pending", "gauge", "1 if a row remap is pending (needs a GPU reset)" + _AS_OF, _GPU),
    Family("llmgw_gpu_row_remap_failure", "gauge", "1 if a row remap failed" + _AS_OF, _GPU),
    Family("llmgw_gpu_mig_mode", "gauge", "1 if MIG mode is on" + _AS_OF, _GPU),
    Family("llmgw_gpu_health_state", "gauge",
           "1 on the GPU's current health state (healthy, degraded, unhealthy)" + _AS_OF, (*_GPU, "state")),
    Family("llmgw_gpu_fabric_state", "gauge", "1 on the GPU's NVSwitch fabric state" + _AS_OF, (*_GPU, "state")),
)
_IDX = {f.name: i for i, f in enumerate(FAMILIES)}
AGE = _IDX["llmgw_node_heartbeat_age_seconds"]

# (GPU attribute, family, scale)
_GPU_GAUGES = tuple((attr, _IDX[name], scale) for attr, name, scale in (
    ("memory_total_bytes", "llmgw_gpu_memory_total_bytes", 1.0),
    ("memory_used_bytes", "llmgw_gpu_memory_used_bytes", 1.0),
    ("memory_free_bytes", "llmgw_gpu_memory_free_bytes", 1.0),
    ("utilization_gpu_ratio", "llmgw_gpu_utilization_ratio", 1.0),
    ("utilization_memory_ratio", "llmgw_gpu_memory_bandwidth_utilization_ratio", 1.0),
    ("temperature_celsius", "llmgw_gpu_temperature_celsius", 1.0),
    ("power_watts", "llmgw_gpu_power_watts", 1.0),
    ("power_limit_watts", "llmgw_gpu_power_limit_watts", 1.0),
    ("sm_clock_mhz", "llmgw_gpu_sm_clock_hertz", 1e6),
    ("nvlink_links_active", "llmgw_gpu_nvlink_active_links", 1.0),
))
_I = _IDX  # short alias below

Sample = tuple[int, tuple[str, ...], float]


def node_samples(st: NodeState, is_up: bool) -> list[Sample]:
    """Every sample of one node but its heartbeat age: ``(family index, label values, value)``."""
    d = st.discovery
    f = d.facts
    n = st.name
    out: list[Sample] = [
        (_I["llmgw_node_info"], (n, f.hostname, st.agent_version or f.agent_version or "", f.driver_version or "",
                                 f.cuda_driver_version or "", d.source), 1.0),
        (_I["llmgw_node_up"], (n,), 1.0 if is_up else 0.0),
        (_I["llmgw_node_cordoned"], (n,), 1.0 if st.cordoned else 0.0),
        (_I["llmgw_node_leaving"], (n,), 1.0 if st.leaving else 0.0),
    ]
    if st.heard:  # (a node known from the database only: never heard from, no time to give)
        out.append((_I["llmgw_node_last_heartbeat_timestamp_seconds"], (n,), st.last_heartbeat))
    if not is_up:
        return out  # push expiry: the readings of a node past its grace are not current
    add = out.append
    for idx, v in ((_I["llmgw_node_cpu_cores"], f.cpu_cores), (_I["llmgw_node_memory_total_bytes"], f.memory_total_bytes),
                   (_I["llmgw_node_memory_available_bytes"], f.memory_available_bytes)):
        if v is not None:
            add((idx, (n,), float(v)))
    add((_I["llmgw_node_discovery_errors"], (n,), float(len(d.errors))))
    for p in f.infiniband:
        if p.rcv_bytes is not None:
            add((_I["llmgw_node_ib_port_receive_bytes"], (n, p.device, str(p.port)), float(p.rcv_bytes)))
        if p.xmit_bytes is not None:
            add((_I["llmgw_node_ib_port_transmit_bytes"], (n, p.device, str(p.port)), float(p.xmit_bytes)))
    for g in d.gpus:
        lab = (n, g.uuid, "" if g.index is None else str(g.index))
        add((_I["llmgw_gpu_info"], (*lab, g.name or "", g.pci_bus_id or "", g.parent_uuid or ""), 1.0))
        for attr, idx, scale in _GPU_GAUGES:
            v = getattr(g, attr)
            if v is not None:
                add((idx, lab, float(v) * scale))
        if g.energy_joules is not None:
            add((_I["llmgw_gpu_energy_joules"], lab, float(g.energy_joules)))
        if g.ecc_corrected_volatile is not None:
            add((_I["llmgw_gpu_ecc_errors"], (*lab, "corrected"), float(g.ecc_corrected_volatile)))
        if g.ecc_uncorrected_volatile is not None:
            add((_I["llmgw_gpu_ecc_errors"], (*lab, "uncorrected"), float(g.ecc_uncorrected_volatile)))
        for code, count in g.xid_errors:
            add((_I["llmgw_gpu_xid_errors"], (*lab, str(code)), float(count)))
        if g.remapped_rows_correctable is not None:
            add((_I["llmgw_gpu_remapped_rows"], (*lab, "correctable"), float(g.remapped_rows_correctable)))
        if g.remapped_rows_uncorrectable is not None:
            add((_I["llmgw_gpu_remapped_rows"], (*lab, "uncorrectable"), float(g.remapped_rows_uncorrectable)))
        for idx, b in ((_I["llmgw_gpu_row_remap_pending"], g.remapped_rows_pending),
                       (_I["llmgw_gpu_row_remap_failure"], g.remapped_rows_failure), (_I["llmgw_gpu_mig_mode"], g.mig_mode)):
            if b is not None:
                add((idx, lab, 1.0 if b else 0.0))
        state = GPU_HEALTH_STATES.get(g.health, g.health)
        for s in dict.fromkeys([*GPU_HEALTH_STATES.values(), state]):
            add((_I["llmgw_gpu_health_state"], (*lab, s), 1.0 if s == state else 0.0))
        if g.fabric_state is not None:
            for s in dict.fromkeys([*FABRIC_STATES, g.fabric_state]):
                add((_I["llmgw_gpu_fabric_state"], (*lab, s), 1.0 if s == g.fabric_state else 0.0))
    return out


def _escape(v: str) -> str:
    if "\\" in v or '"' in v or "\n" in v:
        return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
    return v


def _num(v: float) -> str:
    """A sample value as Prometheus text (``repr`` is exact and parses; non-finite spelled out)."""
    if v == v and v not in (_INF, -_INF):
        return repr(v)
    return floatToGoString(v)


_INF = float("inf")
_SAMPLE_NAMES = [f.name + "_total" if f.type == "counter" else f.name for f in FAMILIES]
_HEADERS = [f"# HELP {n} {f.help}\n# TYPE {n} {f.type}\n".encode() for n, f in zip(_SAMPLE_NAMES, FAMILIES, strict=True)]
# OpenMetrics 1.0 names a counter family without ``_total`` (its samples keep it)
_OM_HEADERS = [f"# HELP {f.name} {f.help}\n# TYPE {f.name} {f.type}\n".encode() for f in FAMILIES]
# per family: 'name{k1="%s",k2="%s"} %s\n'
_TEMPLATES = [n + "{" + ",".join(f'{k}="%s"' for k in f.labels) + "} %s\n" for n, f in zip(_SAMPLE_NAMES, FAMILIES, strict=True)]
_OPEN = [n + "{" for n in _SAMPLE_NAMES]  # 'name{'

# The deployments' claims, a sample per GPU of every node that is up: rendered like the node
# families (PERF: through prometheus_client, 8,000 samples held the loop ~40-80 ms per scrape).
_ALLOC = "llmgw_gpu_memory_allocated_bytes"
_ALLOC_HELP = "GPU memory the replicas placed on the GPU hold (their claims), bytes"
_ALLOC_HEADER = f"# HELP {_ALLOC} {_ALLOC_HELP}\n# TYPE {_ALLOC} gauge\n"
_ALLOC_LINE = _ALLOC + '{node="%s",gpu_uuid="%s",gpu_index="%s"} %s\n'


# The node's readings: rendered by nodetext straight from the heartbeat's serialized message (compiled: no
# Python object per field), into the families below by slot. Only the fields the agent set are read, so an
# absent reading has no sample by construction.
_SLOT_FAMILY = tuple(_IDX[name] for name in _nodetext.SLOTS)
_SLOT_OPENS = tuple(f"{_SAMPLE_NAMES[i]}{{".encode() for i in _SLOT_FAMILY)


def node_text(st: NodeState, is_up: bool) -> dict[int, bytes]:
    """The same samples as :func:`node_samples` as Prometheus text lines, by family.

    PERF: the scrape of a large cluster is this function (bench/cluster_render.py: every node's text
    is rebuilt when heartbeats come faster than scrapes). The readings are rendered from the reading's
    protobuf message (:attr:`NodeState.wire`, the form a heartbeat arrives in) by ``llmgw._fast.nodetext``
    (compiled: the message serialized again, ~2 us for 8 GPUs, and its bytes read in C; the pure twin
    walks ``ListFields``): integers as integers, floats with ``repr`` (non-finite ones spelled as
    Prometheus does).
    """
    d = st.wire
    f = d.facts
    n = _escape(st.name)
    nl = f'node="{n}"}} '
    op = _OPEN
    out: dict[int, bytes] = {
        _NODE_INFO: (_TEMPLATES[_NODE_INFO] % (
            n, _escape(f.hostname), _escape(st.agent_version or f.agent_version), _escape(f.driver_version),
            _escape(f.cuda_driver_version), _escape(d.source), "1.0")).encode(),
        _NODE_UP: f"{op[_NODE_UP]}{nl}{'1.0' if is_up else '0.0'}\n".encode(),
        _NODE_CORDONED: f"{op[_NODE_CORDONED]}{nl}{'1.0' if st.cordoned else '0.0'}\n".encode(),
        _NODE_LEAVING: f"{op[_NODE_LEAVING]}{nl}{'1.0' if st.leaving else '0.0'}\n".encode(),
    }
    if st.heard:
        out[_NODE_HEARTBEAT] = f"{op[_NODE_HEARTBEAT]}{nl}{_num(st.last_heartbeat)}\n".encode()
    if is_up:
        for i, text in zip(_SLOT_FAMILY, _nodetext.render_message(d, st.name, _SLOT_OPENS), strict=True):
            if text:
                out[i] = text
    return out


_NODE_INFO, _NODE_UP = _I["llmgw_node_info"], _I["llmgw_node_up"]
_PART = 224 * 1024  # render_parts' pieces: below the admin writer's 256 KiB slice (a piece no larger is not copied)
_NODE_CORDONED, _NODE_HEARTBEAT = _I["llmgw_node_cordoned"], _I["llmgw_node_last_heartbeat_timestamp_seconds"]
_NODE_LEAVING = _I["llmgw_node_leaving"]


class _Families:
    """A ``collect()`` over a fixed list (for prometheus_client's renderer)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


class ClusterCollector(Collector):
    """The cluster families (module docstring) and the control plane's own counters.

    Args:
        nodes: the node map, read at every scrape.
        stats: the control plane's counters.
        slice_s: :meth:`render_text` yields to the event loop after this long.
        deployments: the deployments: their replica counts and the GPU memory their
            replicas hold (``llmgw_gpu_memory_allocated_bytes``: every GPU of every node
            that is up, 0 where nothing is placed; a claim on a GPU its node no longer
            reports is exported too, with ``gpu_index=""``).
        leading: whether this process leads (several control planes on one database): a
            standby's node map is not the cluster's, so it exports no node counts (absent,
            not 0: an alert on ``llmgw_control_nodes{state="up"}`` fired on every standby).
    """

    def __init__(
        self, nodes: NodeMap, stats: ControlStats, slice_s: float = 0.002,
        deployments: DeploymentController | None = None, leading: Callable[[], bool] = lambda: True,
    ) -> None:
        self.nodes = nodes
        self.stats = stats
        self.leading = leading
        self.deployments = deployments
        self.slice_s = slice_s
        self._cache: dict[str, tuple[tuple[int, bool, str], dict[int, bytes]]] = {}
        self.rebuilt = 0
        """Node texts rebuilt so far (the rest came from the cache)."""

    def describe(self) -> list[Metric]:
        return []  # the registry is auto_describe=False; names are known only at scrape time

    # -- prometheus_client --

    def collect(self) -> Iterator[Metric]:
        t0 = time.perf_counter()
        fams: list[Metric] = [
            (CounterMetricFamily if f.type == "counter" else GaugeMetricFamily)(f.name, f.help, labels=list(f.labels))
            for f in FAMILIES
        ]
        nodes = self.nodes
        now = nodes.monotonic()
        for st in nodes:
            for idx, labels, v in node_samples(st, nodes.is_up(st, now)):
                fams[idx].add_metric(list(labels), v)  # type: ignore[attr-defined]
            if st.heard:
                fams[AGE].add_metric([st.name], st.age(now))  # type: ignore[attr-defined]
        yield from fams
        yield from self._self()
        yield self._duration(time.perf_counter() - t0)

    # -- llmgw's own text --

    async def render_text(self) -> bytes:
        """The same families as :meth:`collect` as Prometheus text 0.0.4, node texts cached."""
        return b"".join(await self.render_parts())

    async def render_parts(self, openmetrics: bool = False) -> list[bytes]:
        """:meth:`render_text` in pieces (of about 256 KiB, in order), to be written one after another.

        ``openmetrics``: the same families as OpenMetrics 1.0 (what a real Prometheus asks for); the
        sample lines are the same in both formats, only the family headers differ. No ``# EOF``: the
        page it is part of ends with one.
        """
        t0 = slice0 = time.perf_counter()
        nodes = self.nodes
        now = nodes.monotonic()
        per_family: list[list[bytes]] = [[] for _ in FAMILIES]
        ages: list[str] = []
        seen: set[str] = set()
        cache = self._cache
        for st in nodes:
            key = (st.generation, nodes.is_up(st, now), st.node_id)
            hit = cache.get(st.name)
            if hit is None or hit[0] != key:
                chunks = node_text(st, key[1])
                cache[st.name] = (key, chunks)
                self.rebuilt += 1
            else:
                chunks = hit[1]
            for idx, text in chunks.items():
                per_family[idx].append(text)
            if st.heard:
                ages.append(_TEMPLATES[AGE] % (_escape(st.name), _num(st.age(now))))
            seen.add(st.name)
            if time.perf_counter() - slice0 > self.slice_s:
                await asyncio.sleep(0)  # let the data path run; the node map may change meanwhile (fine)
                slice0 = time.perf_counter()
        for name in [n for n in cache if n not in seen]:
            del cache[name]
        per_family[AGE] = ["".join(ages).encode()]
        # PERF: the page in pieces of about _PART bytes, whatever the families' sizes: the writer sends
        # each as it is (a larger one it would slice: a copy of every slice), and a piece that size is
        # allocated from memory the last scrape freed, where a family of megabytes was fresh pages to
        # fault in (~5 ms per 3 MB family here). The cuts are found in C (accumulate, bisect).
        page: list[bytes] = []
        for idx, header in enumerate(_OM_HEADERS if openmetrics else _HEADERS):
            page.append(header)
            page.extend(per_family[idx])
        ends = list(accumulate(map(len, page)))
        out: list[bytes] = []
        start, n = 0, len(page)
        while start < n:
            cut = min(n, bisect_left(ends, ends[start] - len(page[start]) + _PART, start) + 1)
            out.append(b"".join(page[start:cut]))
            start = cut
            if time.perf_counter() - slice0 > self.slice_s:
                await asyncio.sleep(0)
                slice0 = time.perf_counter()
        if self.deployments is not None:
            out.append(await self._allocated_text())
        own = _Families([*self._self(allocated=False), self._duration(time.perf_counter() - t0)])
        out.append(om_generate_latest(own).removesuffix(b"# EOF\n") if openmetrics else generate_latest(own))
        return out

    # -- the control plane's own --

    @staticmethod
    def _duration(seconds: float) -> Metric:
        g = GaugeMetricFamily(
            "llmgw_cluster_collect_duration_seconds", "How long computing the cluster families took on this scrape"
        )
        g.add_metric([], seconds)
        return g

    async def _allocated_text(self) -> bytes:
        """``llmgw_gpu_memory_allocated_bytes`` as text (the same in both formats), yielding every slice."""
        ctl = self.deployments
        assert ctl is not None
        lines = [_ALLOC_HEADER]
        held = ctl.allocated()
        nodes = self.nodes
        now = nodes.monotonic()
        slice0 = time.perf_counter()
        for st in nodes:
            if not nodes.is_up(st, now):
                continue
            name = _escape(st.name)
            for g in st.wire.gpus:
                lines.append(_ALLOC_LINE % (name, _escape(g.uuid), g.index if g.HasField("index") else "",
                                            _num(float(held.pop((st.name, g.uuid), 0)))))
            if time.perf_counter() - slice0 > self.slice_s:
                await asyncio.sleep(0)
                slice0 = time.perf_counter()
                now = nodes.monotonic()
        for (node, uuid), v in sorted(held.items()):
            owner = nodes.get(node)
            if owner is None or nodes.is_up(owner, now):
                lines.append(_ALLOC_LINE % (_escape(node), _escape(uuid), "", _num(float(v))))
        return "".join(lines).encode()

    def _self(self, allocated: bool = True) -> list[Metric]:
        s = self.stats
        nodes = GaugeMetricFamily("llmgw_control_nodes", "Registered nodes by state", labels=["state"])
        if self.leading():
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
        # (every reason listed from the start, at 0: a rate() needs the series before the first refusal)
        for reason in dict.fromkeys(["invalid_token", "missing_token", "revoked_token", "expired_token",
                                     "incompatible_version", "invalid_request", "oversized_discovery",
                                     *s.refused]):
            refused.add_metric([reason], float(s.refused.get(reason, 0)))
        beats = CounterMetricFamily("llmgw_control_heartbeats", "Heartbeats received")
        beats.add_metric([], float(s.heartbeats))
        streams = GaugeMetricFamily(
            "llmgw_control_heartbeat_streams", "Heartbeat streams open (agents on protocol 1.1 or later)"
        )
        streams.add_metric([], float(s.streams_open))
        errors = CounterMetricFamily(
            "llmgw_control_rpc_errors", "Agent calls answered with an error, by method and gRPC status",
            labels=["method", "code"],
        )
        for (method, code), v in sorted(s.rpc_errors.items()):
            errors.add_metric([method, code], float(v))
        out: list[Metric] = [nodes, reg, dereg, refused, beats, streams, errors]
        if self.deployments is not None:
            out.extend(self._deployment_families(self.deployments, allocated))
        return out

    def _deployment_families(self, ctl: DeploymentController, allocated: bool = True) -> list[Metric]:
        """The deployments' families; ``allocated``: with the claims per GPU (:meth:`collect`; the fast
        renderer writes those itself, :meth:`_allocated_text`)."""
        alloc = GaugeMetricFamily(_ALLOC, _ALLOC_HELP, labels=list(_GPU))
        if allocated:
            held = ctl.allocated()
            now = self.nodes.monotonic()
            for st in self.nodes:
                if not self.nodes.is_up(st, now):
                    continue
                # PERF: the reading as it arrived (``st.wire``), not ``st.discovery``: turning every node's
                # message into the model held the loop ~0.3 ms a node per scrape (~100 ms for 300 nodes)
                for g in st.wire.gpus:
                    key = (st.name, g.uuid)
                    alloc.add_metric([st.name, g.uuid, str(g.index) if g.HasField("index") else ""],
                                     float(held.pop(key, 0)))
            for (node, uuid), v in sorted(held.items()):
                owner = self.nodes.get(node)
                if owner is None or self.nodes.is_up(owner, now):
                    alloc.add_metric([node, uuid, ""], float(v))
        desired = GaugeMetricFamily("llmgw_deployment_replicas_desired", "Replicas a deployment asks for",
                                    labels=["deployment"])
        ready = GaugeMetricFamily("llmgw_deployment_replicas_ready", "Replicas of a deployment reported ready",
                                  labels=["deployment"])
        n_ready: dict[str, int] = {}
        unknown: set[str] = set()
        for r in ctl.replicas.values():
            if not r.reported:
                unknown.add(r.deployment)  # (loaded at a start, its node not heard since: no figure yet)
            elif ctl.ready_now(r):
                n_ready[r.deployment] = n_ready.get(r.deployment, 0) + 1
        for name, dep in sorted(ctl.deployments.items()):
            desired.add_metric([name], float(dep.desired))
            if name not in unknown:  # (absent, not 0: a scrape just after a restart read an outage)
                ready.add_metric([name], float(n_ready.get(name, 0)))
        return [alloc, desired, ready] if allocated else [desired, ready]
