"""A GPU source that fails keeps the node's GPUs listed: a GPU node never reads as a CPU node.

A real agent (:class:`AgentClient`) on the real :class:`SmiSource` running the stand-in
``nvidia-smi`` (``tests/agent/bin``), against a real control plane over gRPC on 127.0.0.1. When
``nvidia-smi`` hangs past its timeout, fails or loses a GPU, the node's GPUs stay in
``/admin/v1/nodes`` and ``/admin/v1/gpus`` (what ``llmgw ctl nodes``/``gpus`` show) by what does
not change, every reading absent (docs/agent.md, "Absent is not zero").
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from cp_helpers import TOKEN, api, control_runtime, free_port, running, wait_for
from scenario import discovery_of, h100s

from llmgw.agent.client import AgentClient
from llmgw.agent.discovery import SmiSource
from llmgw.agent.model import Discovery

pytestmark = pytest.mark.timeout(60)

AGENT_TESTS = Path(__file__).resolve().parent.parent / "agent"
FAKE_SMI = AGENT_TESTS / "bin" / "nvidia-smi"
H100X8 = json.loads((AGENT_TESTS / "scenarios" / "smi_h100x8.json").read_text())
READINGS = ("memory_used_bytes", "memory_free_bytes", "utilization_gpu_ratio", "temperature_celsius", "power_watts")


async def _node(rt, name: str) -> tuple[dict, list[dict]]:  # type: ignore[no-untyped-def]
    """The node's row in ``/admin/v1/nodes`` (ctl nodes; ``{}`` before it registers) and its rows in
    ``/admin/v1/gpus`` (ctl gpus)."""
    status, body = await api(rt, "GET", "/admin/v1/nodes")
    assert status == 200, body
    row = next((n for n in body["nodes"] if n["name"] == name), {})
    status, body = await api(rt, "GET", "/admin/v1/gpus")
    assert status == 200, body
    return row, [g for g in body["gpus"] if g["node"] == name]


async def test_nvidia_smi_hanging_failing_or_losing_a_gpu_keeps_the_gpus(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    scenario = tmp_path / "smi.json"

    def answer(**changes: object) -> None:  # (the stand-in reads its scenario on every run)
        scenario.write_text(json.dumps({**H100X8, **changes}))

    answer()
    monkeypatch.setenv("LLMGW_FAKE_SMI_SCENARIO", str(scenario))
    port = free_port()
    async with control_runtime(port) as rt:
        a = AgentClient(f"127.0.0.1:{port}", "node-smi", TOKEN, SmiSource(str(FAKE_SMI), timeout=0.5))
        async with running(a):
            async def fresh() -> bool:
                row, gpus = await _node(rt, "node-smi")
                return row.get("gpu_count") == 8 and row["errors"] == [] and all(g["health"] != "unknown" for g in gpus)

            await wait_for(fresh, 10, "eight GPUs read")
            row, seen = await _node(rt, "node-smi")
            assert row["facts"]["driver_version"] == "550.54.15"

            answer(sleep=3)  # hung past its 0.5 s timeout
            async def kept() -> bool:
                row, gpus = await _node(rt, "node-smi")
                return any("did not answer within 0.5 s" in e for e in row.get("errors", ())) and \
                    len(gpus) == 8 and all(g["health"] == "unknown" for g in gpus)

            await wait_for(kept, 15, "the GPUs kept, health unknown")
            row, gpus = await _node(rt, "node-smi")
            assert row["gpu_count"] == 8 and row["facts"]["driver_version"] == "550.54.15"  # not 0 GPUs, driver "–"
            assert [g["uuid"] for g in gpus] == [g["uuid"] for g in seen]
            for g, s in zip(gpus, seen, strict=True):
                assert (g["index"], g["name"], g["memory_total_bytes"]) == (s["index"], s["name"], s["memory_total_bytes"])
                assert all(g.get(k) is None for k in READINGS), g  # absent, not the last numbers nor 0

            answer()  # answering again
            await wait_for(fresh, 15, "the readings back")

            line = ("Unable to determine the device handle for GPU0000:5D:00.0: GPU is lost.  "
                    "Reboot the system to recover this GPU")
            answer(gpus=[g for g in H100X8["gpus"] if g["index"] != 3], extra_lines=[line], exit=15)

            async def lost() -> bool:
                _, gpus = await _node(rt, "node-smi")
                return len(gpus) == 8 and gpus[3]["health"] == "error"

            await wait_for(lost, 10, "the lost GPU listed with health error")
            row, gpus = await _node(rt, "node-smi")
            assert row["gpu_count"] == 8 and gpus[3]["uuid"] == seen[3]["uuid"]  # 8, not 7
            assert all(gpus[3].get(k) is None for k in READINGS), gpus[3]
            status, node = await api(rt, "GET", "/admin/v1/nodes/node-smi")
            assert status == 200 and node["gpus"][3]["errors"] == [line], node["gpus"][3]


class RaisingSource:
    """Answers, then raises (a source breaking its contract): the GPUs read stay listed."""

    name = "nvml"

    def __init__(self) -> None:
        self.d = discovery_of({"hostname": "odd-host", "gpus": h100s(2, "r"), "source": "nvml"})
        self.raising = False

    def read(self) -> Discovery:
        if self.raising:
            raise RuntimeError("driver said no")
        return self.d

    def close(self) -> None:
        pass


async def test_a_source_that_raises_keeps_the_gpus_last_read() -> None:
    port = free_port()
    source = RaisingSource()
    async with control_runtime(port) as rt:
        a = AgentClient(f"127.0.0.1:{port}", "node-raise", TOKEN, source)
        async with running(a):
            await wait_for(lambda: a.heartbeats >= 2, what="two beats")
            source.raising = True

            async def said() -> bool:
                status, body = await api(rt, "GET", "/admin/v1/nodes/node-raise")
                return status == 200 and any("RuntimeError: driver said no" in e for e in body["errors"])

            await wait_for(said, 10, "the exception reported")
            status, node = await api(rt, "GET", "/admin/v1/nodes/node-raise")
            assert status == 200, node
            assert [g["uuid"] for g in node["gpus"]] == [g.uuid for g in source.d.gpus]
            assert all(g["health"] == "unknown" and g.get("utilization_gpu_ratio") is None for g in node["gpus"])
