"""A stand-in GPU source for the built-in demo: it says it is simulated wherever it is shown.

Its GPUs are named ``Simulated GPU (llmgw demo)``, their UUIDs read
``GPU-simulated-…``, and every :class:`Discovery` has ``source="simulated"``; the
readings drift slowly (a sine over minutes plus a little jitter), so graphs and
tables move without pretending to be a real card.
"""

from __future__ import annotations

import hashlib
import math
import random
import socket
import time
from collections.abc import Callable

from ..model import GPU, Discovery, NodeFacts

__all__ = ["SIMULATED_NAME", "SimulatedSource"]

SIMULATED_NAME = "Simulated GPU (llmgw demo)"
_GIB = 1024**3


class SimulatedSource:
    """One or more plausible GPUs whose readings move a little over time.

    Args:
        gpus: how many (1 to 16).
        facts: called on every read for the node's facts.
        clock: seconds (monotonic); tests pass their own.
        seed: for the jitter (readings are reproducible for a given clock and seed).
        node: the node's name: its GPUs' UUIDs are derived from it, so the simulated GPUs of two
            nodes (several agents on one machine) never share a UUID; default: the host name.
    """

    name = "simulated"

    def __init__(
        self,
        gpus: int = 2,
        *,
        facts: Callable[[], NodeFacts] | None = None,
        clock: Callable[[], float] = time.monotonic,
        seed: int = 17,
        node: str | None = None,
    ) -> None:
        if not 1 <= gpus <= 16:
            raise ValueError(f"gpus={gpus}: 1 to 16 simulated GPUs")
        tag = hashlib.sha256((node if node is not None else socket.gethostname()).encode()).hexdigest()[:12]
        self._uuids = [f"GPU-simulated-{tag}-{i:04d}" for i in range(gpus)]
        self._n = gpus
        self._facts = facts or (lambda: NodeFacts(hostname=""))
        self._clock = clock
        self._start = clock()
        self._random = random.Random(seed)
        self._energy = [0.0] * gpus
        self._last = self._start

    def close(self) -> None:
        """Nothing to release."""

    def read(self) -> Discovery:
        """The simulated GPUs as of now (``source="simulated"``)."""
        now = self._clock()
        dt, self._last = max(0.0, now - self._last), now
        t = now - self._start
        gpus = []
        for i in range(self._n):
            phase = t / 300.0 * 2 * math.pi + i * 1.3  # a five-minute swell, offset per GPU
            util = min(1.0, max(0.0, 0.45 + 0.35 * math.sin(phase) + self._random.uniform(-0.03, 0.03)))
            total = 80 * _GIB
            used = int(total * (0.62 + 0.02 * i))
            power = 90.0 + 560.0 * util
            self._energy[i] += power * dt
            gpus.append(
                GPU(
                    uuid=self._uuids[i],
                    index=i,
                    name=SIMULATED_NAME,
                    memory_total_bytes=total,
                    memory_used_bytes=used,
                    memory_free_bytes=total - used,
                    utilization_gpu_ratio=round(util, 3),
                    utilization_memory_ratio=round(util * 0.55, 3),
                    temperature_celsius=round(34.0 + 36.0 * util, 1),
                    power_watts=round(power, 1),
                    power_limit_watts=700.0,
                    energy_joules=round(self._energy[i], 1),
                    sm_clock_mhz=float(1410 + int(570 * util)),
                    ecc_corrected_volatile=0,
                    ecc_uncorrected_volatile=0,
                    mig_mode=False,
                )
            )
        facts = self._facts()
        return Discovery(facts=facts, gpus=tuple(gpus), source=self.name)
