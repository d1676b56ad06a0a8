"""A stand-in GPU source built from :mod:`llmgw.agent.model` alone: the demo's, and the
fallback of ``llmgw agent --gpu-source simulated|none`` where GPU discovery
(``llmgw.agent.discovery``) is not installed.

It says what it is everywhere: ``source="simulated"`` and GPU names starting with
``Simulated``. Its readings move slowly over time (utilisation, memory, power) so a
dashboard shows something alive; nothing about them is measured.
"""

from __future__ import annotations

import math
import os
import platform
import socket
import time

from .. import __version__
from .model import GPU, Discovery, NodeFacts

__all__ = ["NoGPUSource", "SimulatedSource", "node_facts"]

_GIB = 1024**3


def node_facts() -> NodeFacts:
    """What the standard library can tell about this node (no GPU facts)."""
    mem_total = mem_avail = None
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[1:2]}
        mem_total, mem_avail = info.get("MemTotal"), info.get("MemAvailable")
    except (OSError, ValueError, IndexError):
        pass
    return NodeFacts(
        hostname=socket.gethostname(),
        os=platform.platform(terse=True) or None,
        kernel=platform.release() or None,
        cpu_model=platform.processor() or None,
        cpu_cores=os.cpu_count(),
        memory_total_bytes=mem_total,
        memory_available_bytes=mem_avail,
        agent_version=__version__,
    )


class NoGPUSource:
    """A node without GPUs: facts only (``source="none"``)."""

    def read(self) -> Discovery:
        return Discovery(facts=node_facts(), source="none")

    def close(self) -> None:
        pass


class SimulatedSource:
    """``gpus`` simulated 80 GiB GPUs whose readings drift with time (``source="simulated"``)."""

    def __init__(self, gpus: int = 2, *, seed: int = 0) -> None:
        self.gpus = gpus
        self.seed = seed
        self._t0 = time.monotonic()

    def read(self) -> Discovery:
        t = time.monotonic() - self._t0
        facts = node_facts()
        gpus = []
        for i in range(self.gpus):
            phase = t / 30.0 + i + self.seed
            util = 0.5 + 0.45 * math.sin(phase)
            used = int((20 + 50 * (0.5 + 0.5 * math.sin(phase / 3))) * _GIB)
            gpus.append(GPU(
                uuid=f"GPU-5151{self.seed:04x}-0000-4000-8000-{i:012x}",
                index=i,
                name="Simulated GPU 80GB (llmgw demo)",
                pci_bus_id=f"00000000:{0x18 + i:02X}:00.0",
                memory_total_bytes=80 * _GIB,
                memory_used_bytes=used,
                memory_free_bytes=80 * _GIB - used,
                utilization_gpu_ratio=round(util, 3),
                utilization_memory_ratio=round(util * 0.6, 3),
                temperature_celsius=round(40 + 30 * util, 1),
                power_watts=round(90 + 500 * util, 1),
                power_limit_watts=700.0,
                sm_clock_mhz=1980.0,
                ecc_corrected_volatile=0,
                ecc_uncorrected_volatile=0,
                mig_mode=False,
            ))
        return Discovery(
            facts=NodeFacts(
                hostname=facts.hostname, os=facts.os, kernel=facts.kernel, cpu_model=facts.cpu_model,
                cpu_cores=facts.cpu_cores, memory_total_bytes=facts.memory_total_bytes,
                memory_available_bytes=facts.memory_available_bytes, agent_version=__version__,
                driver_version="simulated", cuda_driver_version="simulated",
            ),
            gpus=tuple(gpus),
            source="simulated",
        )

    def close(self) -> None:
        pass
