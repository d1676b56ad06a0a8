"""What a node agent knows about its node and its GPUs: plain, immutable values.

One :class:`Discovery` per reading: the node's facts, one :class:`GPU` per GPU
(a MIG device is a GPU of its own with ``parent_uuid`` set), which source read
them, and the errors met on the way. GPU discovery (NVML, ``nvidia-smi``, none,
or a stand-in) produces it; the agent puts it on the wire
(``proto/llmgw/agent/v1``); the control plane keeps the last one per node.

**Absent is not zero.** Every measurement is ``None`` when it was not read: not
supported by the GPU or the driver (NVML's NotSupported, FunctionNotFound on an
old driver, a field value whose own return code failed, MIG's utilisation), or
not reported by ``nvidia-smi`` (``[N/A]``, ``[Not Supported]``, a column an old
driver lacks). A reading that failed is never turned into 0: an unreported
utilisation drawn as 0 reads as an idle GPU.

Units are the base units the metric names say: bytes, ratios 0–1 (not percent),
degrees Celsius, watts, joules, megahertz.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["GPU", "GPU_HEALTH", "SOURCES", "Discovery", "InfinibandPort", "NodeFacts"]

# Where a reading came from. "simulated": a stand-in GPU source (the demo), which
# says so everywhere it is shown.
SOURCES = ("nvml", "nvidia-smi", "none", "simulated")

# A GPU's health, as the agent judges it from what it read:
#   ok           every reading it could make succeeded
#   degraded     it answers, but with uncorrected ECC errors, rows pending remap,
#                a remap failure, XID events or a fabric that is not healthy
#   error        it no longer answers (fallen off the bus, GPU_IS_LOST, NVML
#                Unknown Error, left out of nvidia-smi's answer): the last readings
#                are dropped, not zeroed
# and, on a GPU kept listed by its identity (GPU.identity) while the source itself
# does not answer (nvidia-smi timing out, NVML failing to initialise, a read in
# flight for too long): "unknown".
GPU_HEALTH = ("ok", "degraded", "error")


@dataclass(frozen=True, slots=True)
class GPU:
    """One GPU (or MIG device) as read at one moment."""

    uuid: str
    """``GPU-…`` (``MIG-…`` for a MIG device): the key. Never the index, which can change at boot."""
    index: int | None = None
    """NVML/nvidia-smi index (for people; MIG devices: the index within the parent)."""
    name: str | None = None
    """The model, e.g. ``NVIDIA H100 80GB HBM3``."""
    pci_bus_id: str | None = None
    parent_uuid: str | None = None
    """Set on a MIG device: its parent GPU's UUID."""
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    memory_free_bytes: int | None = None
    utilization_gpu_ratio: float | None = None
    """0–1; absent on MIG-enabled GPUs (NVML does not report it there)."""
    utilization_memory_ratio: float | None = None
    """0–1: memory-bandwidth utilisation (absent on MIG, like the above)."""
    temperature_celsius: float | None = None
    power_watts: float | None = None
    power_limit_watts: float | None = None
    energy_joules: float | None = None
    """Energy since the driver loaded (a counter)."""
    sm_clock_mhz: float | None = None
    ecc_corrected_volatile: int | None = None
    ecc_uncorrected_volatile: int | None = None
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failure: bool | None = None
    xid_errors: tuple[tuple[int, int], ...] = ()
    """(XID code, times seen since the agent started), by code."""
    mig_mode: bool | None = None
    """Current MIG mode of a physical GPU (None: not supported / not read)."""
    nvlink_links_active: int | None = None
    nvlink_links_total: int | None = None
    fabric_state: str | None = None
    """NVSwitch systems (Hopper+): ``not_supported``, ``not_started``, ``in_progress``, ``completed``;
    with ``fabric_healthy`` whether the fabric status is success."""
    fabric_healthy: bool | None = None
    health: str = "ok"
    """One of :data:`GPU_HEALTH`."""
    errors: tuple[str, ...] = ()
    """What failed on this GPU (e.g. ``nvmlDeviceGetPowerUsage: NotSupported`` is *not* an error;
    ``GPU is lost`` is)."""

    def identity(self, health: str = "unknown", errors: tuple[str, ...] = ()) -> GPU:
        """This GPU by what does not change (uuid, index, name, PCI bus id, parent, memory total),
        every reading absent: how a GPU is kept listed when it, or the source, stops answering.

        Args:
            health: ``unknown`` (the source did not answer: nothing is known of the GPU now) or
                ``error`` (the source answered, without this GPU).
            errors: what failed, for :attr:`errors`.
        """
        return GPU(uuid=self.uuid, index=self.index, name=self.name, pci_bus_id=self.pci_bus_id,
                   parent_uuid=self.parent_uuid, memory_total_bytes=self.memory_total_bytes,
                   health=health, errors=errors)


@dataclass(frozen=True, slots=True)
class InfinibandPort:
    """One InfiniBand/RoCE port's counters from sysfs (``/sys/class/infiniband``)."""

    device: str
    port: int
    state: str | None = None
    rate_gbps: float | None = None
    rcv_bytes: int | None = None
    xmit_bytes: int | None = None
    """(sysfs port_rcv_data / port_xmit_data count 4-byte words: these are bytes)"""
    link_downed: int | None = None
    symbol_errors: int | None = None


@dataclass(frozen=True, slots=True)
class NodeFacts:
    """The node itself."""

    hostname: str
    os: str | None = None
    kernel: str | None = None
    cpu_model: str | None = None
    cpu_cores: int | None = None
    memory_total_bytes: int | None = None
    memory_available_bytes: int | None = None
    agent_version: str | None = None
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    """e.g. ``12.4`` (NVML's nvmlSystemGetCudaDriverVersion_v2, formatted)."""
    infiniband: tuple[InfinibandPort, ...] = ()


@dataclass(frozen=True, slots=True)
class Discovery:
    """One reading of a node: its facts and GPUs, where they came from, what failed."""

    facts: NodeFacts
    gpus: tuple[GPU, ...] = ()
    source: str = "none"
    """One of :data:`SOURCES`."""
    errors: tuple[str, ...] = field(default=())
    """Node-level failures (e.g. ``Failed to initialize NVML: Unknown Error``): reported, retried,
    never read as "no GPUs"."""
