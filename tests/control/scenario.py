"""A scenario-driven GPU source for the tests: readings come from a JSON file, re-read on every read.

The file holds ``{"hostname": ..., "source": ..., "errors": [...], "facts": {...}, "gpus": [{GPU fields}]}``;
a test rewrites it to change what the agent reports next. Only :mod:`llmgw.agent.model` is used:
the real discovery is not needed to drive the real agent client.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmgw.agent.model import GPU, Discovery, NodeFacts


def discovery_of(spec: dict[str, Any]) -> Discovery:
    facts = dict(spec.get("facts", {}))
    facts.setdefault("hostname", spec.get("hostname", "test-host"))
    gpus = []
    for g in spec.get("gpus", []):
        g = dict(g)
        g["xid_errors"] = tuple(tuple(x) for x in g.get("xid_errors", ()))
        g["errors"] = tuple(g.get("errors", ()))
        gpus.append(GPU(**g))
    return Discovery(
        facts=NodeFacts(**facts), gpus=tuple(gpus), source=spec.get("source", "simulated"),
        errors=tuple(spec.get("errors", ())),
    )


class ScenarioSource:
    """``read()`` the scenario file as a :class:`Discovery`; counts reads and closes."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.reads = 0
        self.closed = False

    def read(self) -> Discovery:
        self.reads += 1
        return discovery_of(json.loads(self.path.read_text()))

    def close(self) -> None:
        self.closed = True


def write_scenario(path: Path, spec: dict[str, Any]) -> Path:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(spec))
    tmp.replace(path)
    return path


def h100s(n: int, prefix: str = "a") -> list[dict[str, Any]]:
    """``n`` fully reported H100s."""
    return [
        {
            "uuid": f"GPU-{prefix}{i:07d}-0000-4000-8000-000000000000", "index": i, "name": "NVIDIA H100 80GB HBM3",
            "pci_bus_id": f"00000000:{0x18 + i:02X}:00.0", "memory_total_bytes": 85899345920,
            "memory_used_bytes": 1000 * (i + 1), "memory_free_bytes": 85899345920 - 1000 * (i + 1),
            "utilization_gpu_ratio": 0.0 if i == 0 else 0.5, "temperature_celsius": 40.0 + i,
            "power_watts": 300.0, "power_limit_watts": 700.0, "energy_joules": 1.5e6, "sm_clock_mhz": 1980.0,
            "ecc_corrected_volatile": 0, "ecc_uncorrected_volatile": 0, "xid_errors": [[79, 1]] if i == 1 else [],
            "health": "ok" if i != 1 else "degraded",
        }
        for i in range(n)
    ]
