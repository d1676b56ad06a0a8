"""``llmgw ctl`` against a real control plane (nodes registered over gRPC on 127.0.0.1), showing what the
agents reported: text that looks like rich markup is shown as written (it made ``ctl gpus``, ``ctl nodes``
and ``ctl nodes NODE`` print a traceback), control characters are escaped (never sent raw to the terminal),
ERRORS counts a node's GPUs' errors too, and a node past its grace has no current readings in the JSON."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
from click.testing import CliRunner, Result

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "control"))
from cp_helpers import TOKEN, control_runtime, free_port, wait_for
from scenario import discovery_of, h100s

from llmgw._proto.agent.v1 import agent_pb2_grpc
from llmgw.agent.wire import PROTOCOL, discovery_to_proto, pb
from llmgw.cli.ctl import ctl

pytestmark = pytest.mark.timeout(60)

UUID = "GPU-11111111-2222-4333-8444-555555555555"


async def invoke(*args: str) -> Result:
    # (catch_exceptions=False: a traceback fails the test)
    return await asyncio.to_thread(CliRunner().invoke, ctl, list(args), catch_exceptions=False)


async def register(port: int, name: str, spec: dict[str, Any]) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = agent_pb2_grpc.AgentServiceStub(ch)
        req = pb.RegisterRequest(node_name=name, agent_version="test",
                                 protocol=pb.ProtocolVersion(major=PROTOCOL[0], minor=PROTOCOL[1]),
                                 discovery=discovery_to_proto(discovery_of(spec)))
        await stub.Register(req, metadata=[("authorization", f"Bearer {TOKEN}")], timeout=5)


def gpu(**more: Any) -> dict[str, Any]:
    return {"uuid": UUID, "index": 0, "name": "NVIDIA H100", "pci_bus_id": "00000000:01:00.0",
            "memory_total_bytes": 85899345920, "memory_used_bytes": 2**30, "utilization_gpu_ratio": 0.05,
            "temperature_celsius": 40.0, "power_watts": 120.0, **more}


def row_of(output: str, first: str) -> list[str]:
    return next(line for line in output.splitlines() if line.startswith(first)).split()


async def test_markup_from_an_agent_is_shown_as_written() -> None:
    port = free_port()
    async with control_runtime(port, heartbeat_interval="10s", heartbeat_grace="60s") as rt:
        assert rt.admin_addr is not None
        url = f"http://127.0.0.1:{rt.admin_addr[1]}"
        await register(port, "markup-node", {
            "hostname": "host[/b]", "facts": {"driver_version": "550.54[/]", "cuda_driver_version": "[red]12.4"},
            "gpus": [gpu(name="NVIDIA H100 [/link]", errors=["lost [bold]it"])], "errors": ["smi said [/i]"]})
        res = await invoke("--admin", url, "gpus")
        assert res.exit_code == 0, res.output
        assert "NVIDIA H100 [/link]" in res.output
        res = await invoke("--admin", url, "nodes")
        assert res.exit_code == 0, res.output
        assert row_of(res.output, "markup-node")[2:3] == ["host[/b]"]
        assert "550.54[/]" in res.output and "[red]12.4" in res.output
        res = await invoke("--admin", url, "nodes", "markup-node")
        assert res.exit_code == 0, res.output
        for shown in ("host[/b]", "550.54[/] (CUDA [red]12.4)", "smi said [/i]", f"GPU 0 ({UUID}): lost [bold]it",
                      "NVIDIA H100 [/link]"):
            assert shown in res.output, (shown, res.output)


async def test_control_characters_from_an_agent_are_escaped() -> None:
    port = free_port()
    async with control_runtime(port, heartbeat_interval="10s", heartbeat_grace="60s") as rt:
        assert rt.admin_addr is not None
        url = f"http://127.0.0.1:{rt.admin_addr[1]}"
        await register(port, "esc-node", {
            "hostname": "host\x1b[2J", "facts": {"driver_version": "550\x07"},
            "gpus": [gpu(name="H100\x1b[31m", errors=["xid \x1b]0;T\x07"])],
            "errors": ["oops \x1b]0;PWNED TITLE\x07 \x1b[2J cleared\r", "c1 \x9b2J bidi \u202e"]})
        for args in (("nodes", "esc-node"), ("nodes",), ("gpus",)):
            res = await invoke("--admin", url, *args)
            assert res.exit_code == 0, res.output
            assert not any(c in res.output for c in "\x1b\x07\r\x9b\u202e"), (args, res.output)
        res = await invoke("--admin", url, "nodes", "esc-node")
        assert "    oops \\x1b]0;PWNED TITLE\\x07 \\x1b[2J cleared\\r" in res.output.splitlines()
        assert "host\\x1b[2J" in res.output and "550\\x07" in res.output and "xid \\x1b]0;T\\x07" in res.output
        assert "    c1 \\x9b2J bidi \\u202e" in res.output.splitlines()
        # --json: the same JSON, every character that would act on a terminal \u-escaped (C0 by json itself)
        res = await invoke("--admin", url, "nodes", "esc-node", "--json")
        assert not any(c in res.output for c in "\x1b\x07\r\x9b\u202e"), res.output
        assert json.loads(res.output)["errors"] == ["oops \x1b]0;PWNED TITLE\x07 \x1b[2J cleared\r",
                                                    "c1 \x9b2J bidi \u202e"]


async def test_nodes_errors_count_the_gpus_errors_too() -> None:
    port = free_port()
    async with control_runtime(port, heartbeat_interval="10s", heartbeat_grace="60s") as rt:
        assert rt.admin_addr is not None
        url = f"http://127.0.0.1:{rt.admin_addr[1]}"
        await register(port, "gpu-lost", {"hostname": "h1", "gpus": [
            gpu(), gpu(uuid="GPU-2", index=1, health="error", errors=["GPU is lost"])]})
        await register(port, "both", {"hostname": "h2", "errors": ["NVML: Unknown Error"],
                                      "gpus": [gpu(uuid="GPU-3", errors=["a", "b"])]})
        await register(port, "fine", {"hostname": "h3", "gpus": [gpu(uuid="GPU-4")]})
        res = await invoke("--admin", url, "nodes")
        assert res.exit_code == 0, res.output
        # (as the console's Nodes view counts them: the node's own and its GPUs')
        assert row_of(res.output, "gpu-lost")[-1] == "1"
        assert row_of(res.output, "both")[-1] == "3"
        assert row_of(res.output, "fine")[-1] == "0"
        assert "(llmgw ctl nodes NODE shows a node's errors)" in res.output


async def test_the_json_of_a_node_past_its_grace_has_no_current_readings() -> None:
    port = free_port()
    async with control_runtime(port, heartbeat_interval="0.1s", heartbeat_grace="0.3s") as rt:
        assert rt.admin_addr is not None
        url = f"http://127.0.0.1:{rt.admin_addr[1]}"
        await register(port, "node-a", {"hostname": "host-a", "gpus": h100s(1)})
        res = await invoke("--admin", url, "gpus", "--json")
        (g,) = json.loads(res.stdout)["gpus"]
        assert g["node_state"] == "up" and g["health"] == "ok" and g["temperature_celsius"] is not None

        async def unhealthy() -> bool:
            res = await invoke("--admin", url, "gpus", "--json")
            return json.loads(res.stdout)["gpus"][0]["node_state"] == "unhealthy"

        await wait_for(unhealthy, what="node-a past its grace")
        res = await invoke("--admin", url, "gpus", "--json")
        (g,) = json.loads(res.stdout)["gpus"]
        res = await invoke("--admin", url, "nodes", "node-a", "--json")
        (g1,) = json.loads(res.stdout)["gpus"]
        for row in (g, g1):
            # what the GPU is stays; no reading is current, nor its health (as /metrics stops exporting them)
            assert row["uuid"] == h100s(1)[0]["uuid"] and row["name"] == "NVIDIA H100 80GB HBM3"
            assert row["memory_total_bytes"] == 85899345920 and row["index"] == 0
            for k in ("utilization_gpu_ratio", "temperature_celsius", "power_watts", "memory_used_bytes",
                      "memory_free_bytes", "ecc_uncorrected_volatile", "xid_errors"):
                assert row[k] is None, (k, row[k])
            assert row["health"] == "unknown"
        res = await invoke("--admin", url, "gpus")
        assert " ".join(row_of(res.output, "node-a")).endswith("– – – node unhealthy")


def test_a_deploy_placed_in_part_with_nothing_in_the_way_says_the_rest_follow(capsys: pytest.CaptureFixture[str]) -> None:
    """QA: ``ctl deploy --replicas 1024`` said "110 of 1024 replica(s) placed" and nothing of the other 914 (the
    control plane places many in passes: nothing stood in their way)."""
    from llmgw.cli.ctl import _say_deployment

    _say_deployment({"name": "big", "placed": 110, "desired": 1024, "nodes": ["n1"], "message": None}, "deployed")
    out = capsys.readouterr()
    assert out.out.splitlines() == ["big: deployed: 110 of 1024 replica(s) placed on n1",
                                    "big: the rest are being placed (llmgw ctl deployments shows them)"]
    # a reason, when there is one, is what is said instead
    _say_deployment({"name": "big", "placed": 1, "desired": 2, "nodes": ["n1"],
                     "message": "needs 1 GPU; no node has a GPU"}, "deployed")
    out = capsys.readouterr()
    assert out.out.splitlines() == ["big: deployed: 1 of 2 replica(s) placed on n1"]
    assert "no node has a GPU" in out.err
    _say_deployment({"name": "big", "placed": 2, "desired": 2, "nodes": ["n1"], "message": None}, "deployed")
    assert capsys.readouterr().out.splitlines() == ["big: deployed: 2 of 2 replica(s) placed on n1"]
