"""``llmgw ctl nodes|gpus|cordon|uncordon`` against a running control plane (real gRPC registrations)."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from click.testing import CliRunner, Result
from cp_helpers import TOKEN, control_runtime, free_port, wait_for
from scenario import discovery_of, h100s

from llmgw._proto.agent.v1 import agent_pb2_grpc
from llmgw.agent.wire import PROTOCOL, discovery_to_proto, pb
from llmgw.cli.ctl import ctl

pytestmark = pytest.mark.timeout(60)


async def invoke(*args: str) -> Result:
    return await asyncio.to_thread(CliRunner().invoke, ctl, list(args), catch_exceptions=False)


async def _register(port: int, name: str, spec: dict[str, object]) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = agent_pb2_grpc.AgentServiceStub(ch)
        req = pb.RegisterRequest(node_name=name, agent_version="test", protocol=pb.ProtocolVersion(major=PROTOCOL[0], minor=PROTOCOL[1]),
                                 discovery=discovery_to_proto(discovery_of(spec)))
        await stub.Register(req, metadata=[("authorization", f"Bearer {TOKEN}")], timeout=5)


async def test_nodes_gpus_cordon_tables_and_json() -> None:
    port = free_port()
    # a long grace: the nodes registered once stay up for the test
    async with control_runtime(port, heartbeat_interval="10s", heartbeat_grace="60s") as rt:
        assert rt.admin_addr is not None
        url = f"http://127.0.0.1:{rt.admin_addr[1]}"
        await _register(port, "node-a", {"hostname": "host-a", "source": "nvml",
                                         "facts": {"driver_version": "550.90.07"}, "gpus": h100s(2)})
        await _register(port, "node-m", {"hostname": "host-m", "gpus": [
            {"uuid": "GPU-mig", "index": 0, "name": "NVIDIA A100", "mig_mode": True, "memory_total_bytes": 2**30}]})
        res = await invoke("--admin", url, "nodes")
        assert res.exit_code == 0, res.output
        assert "node-a" in res.output and "host-a" in res.output and "550.90.07" in res.output and "up" in res.output
        line_m = next(line for line in res.output.splitlines() if line.startswith("node-m"))
        assert "–" in line_m  # no driver version reported: an en dash, not 0 or empty
        res = await invoke("--admin", url, "gpus")
        assert res.exit_code == 0, res.output
        mig = next(line for line in res.output.splitlines() if "GPU-mig" in line)
        assert "–" in mig and "0%" not in mig
        assert "NVIDIA H100 80GB HBM3" in res.output
        res = await invoke("--admin", url, "gpus", "--json")
        rows = json.loads(res.stdout)["gpus"]
        assert {r["uuid"] for r in rows} >= {"GPU-mig"} and len(rows) == 3
        assert next(r for r in rows if r["uuid"] == "GPU-mig")["utilization_gpu_ratio"] is None
        res = await invoke("--admin", url, "cordon", "node-a")
        assert res.exit_code == 0 and "node-a: cordoned" in res.output
        res = await invoke("--admin", url, "nodes")
        assert "cordoned" in next(line for line in res.output.splitlines() if line.startswith("node-a"))
        res = await invoke("--admin", url, "uncordon", "node-a", "--json")
        assert json.loads(res.stdout)["cordoned"] is False
        res = await invoke("--admin", url, "cordon", "nope")
        assert res.exit_code == 1 and "no node 'nope'" in res.output
        res = await invoke("--admin", url, "nodes", "--json")
        assert {n["name"] for n in json.loads(res.stdout)["nodes"]} == {"node-a", "node-m"}


async def test_gpus_of_a_node_past_its_grace_show_no_current_readings() -> None:
    port = free_port()
    async with control_runtime(port, heartbeat_interval="0.1s", heartbeat_grace="0.2s") as rt:
        assert rt.admin_addr is not None
        url = f"http://127.0.0.1:{rt.admin_addr[1]}"
        await _register(port, "node-a", {"hostname": "host-a", "gpus": h100s(1), "errors": ["nvidia-smi: timed out"],
                                         "facts": {"memory_available_bytes": 64 << 30}})

        async def unhealthy() -> bool:
            res = await invoke("--admin", url, "nodes")
            return "unhealthy" in res.output

        await wait_for(unhealthy, what="node-a unhealthy")
        res = await invoke("--admin", url, "gpus")
        row = next(line for line in res.output.splitlines() if line.startswith("node-a"))
        assert "node unhealthy" in row and "°C" not in row and " W" not in row
        # the node's own readings too (QA: ERRORS 0, and the memory available of its last heartbeat)
        res = await invoke("--admin", url, "nodes")
        row = next(line for line in res.output.splitlines() if line.startswith("node-a"))
        assert row.split()[-1] == "–", row
        res = await invoke("--admin", url, "nodes", "--json")
        [node] = json.loads(res.stdout)["nodes"]
        assert node["state"] == "unhealthy" and node["facts"]["memory_available_bytes"] is None, node
        assert node["facts"]["hostname"] == "host-a"  # (what it is stays)


async def test_nodes_without_a_control_plane_says_so() -> None:
    from llmgw.config import load
    from llmgw.runtime import GatewayRuntime

    rt = GatewayRuntime(load({"listen": "127.0.0.1:0", "admin": "127.0.0.1:0"}))
    await rt.start()
    try:
        assert rt.admin_addr is not None
        res = await invoke("--admin", f"http://127.0.0.1:{rt.admin_addr[1]}", "nodes")
        assert res.exit_code == 1 and "no control plane" in res.output
    finally:
        await rt.stop()


async def test_tables_never_cut_a_cell_piped_or_in_a_narrow_terminal() -> None:
    """A long node name and big numbers: piped, every row is one whole line; in a 100-column terminal
    the line runs long (the terminal wraps it) rather than ending a value in an ellipsis."""
    import os
    import sys

    port = free_port()
    long_name = "rack-17.row-b.dc-eu-west-3.gpu-node-with-a-very-long-name-" + "x" * 40
    async with control_runtime(port, heartbeat_interval="10s", heartbeat_grace="60s") as rt:
        assert rt.admin_addr is not None
        url = f"http://127.0.0.1:{rt.admin_addr[1]}"
        gpus = h100s(2)
        gpus[0]["memory_used_bytes"] = 81_604_378_624  # 76.0 GiB
        await _register(port, long_name, {"hostname": "h-" + "y" * 60, "facts": {"driver_version": "550.90.07"},
                                          "gpus": gpus})
        for cmd in ("nodes", "gpus"):
            for env in ({}, {"COLUMNS": "100", "FORCE_COLOR": "0", "TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1"}):
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "llmgw", "ctl", "--admin", url, cmd, stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE, env={**os.environ, **env},
                )
                out, err = await asyncio.wait_for(proc.communicate(), 30)
                text = out.decode()
                assert proc.returncode == 0, err
                assert "…" not in text, text
                rows = [line for line in text.splitlines() if line.startswith(long_name)]
                assert rows, text
                if cmd == "nodes":
                    assert "h-" + "y" * 60 in rows[0] and "550.90.07" in rows[0]
                else:
                    assert len(rows) == 2 and "76.0" in rows[0] and "80.0" in rows[0], text


async def test_ctl_pointed_at_the_grpc_port_says_so_in_one_line() -> None:
    """``--admin`` given the control plane's gRPC address (an easy slip: both are "the control plane"):
    one line naming the mistake, never the HTTP/2 bytes the gRPC server answered."""
    port = free_port()
    async with control_runtime(port):
        res = await invoke("--admin", f"http://127.0.0.1:{port}", "nodes")
        assert res.exit_code == 1
        lines = res.output.strip().splitlines()
        assert len(lines) == 1 and "a gRPC port, such as control.listen, not the admin listener" in lines[0], res.output
        assert "\\x00" not in res.output and "\x00" not in res.output


async def test_ctl_nodes_node_shows_its_errors_labels_and_gpus() -> None:
    port = free_port()
    async with control_runtime(port, heartbeat_interval="10s", heartbeat_grace="60s") as rt:
        assert rt.admin_addr is not None
        url = f"http://127.0.0.1:{rt.admin_addr[1]}"
        gpus = h100s(2)
        gpus[1]["errors"] = ["GPU is lost"]
        await _register(port, "node-e", {"hostname": "host-e", "source": "nvml", "gpus": gpus,
                                         "errors": ["nvidia-smi did not answer within 10 s"]})
        res = await invoke("--admin", url, "nodes")
        assert "llmgw ctl nodes NODE shows a node's errors" in res.output
        res = await invoke("--admin", url, "nodes", "node-e")
        assert res.exit_code == 0, res.output
        out = res.output
        assert "nvidia-smi did not answer within 10 s" in out and "GPU 1 (GPU-a0000001" in out and "GPU is lost" in out
        assert "host-e" in out and "nvml" in out and "NVIDIA H100 80GB HBM3" in out
        assert "80.0" in out  # (the GPUs table: memory total)
        res = await invoke("--admin", url, "nodes", "node-e", "--json")
        assert json.loads(res.stdout)["errors"] == ["nvidia-smi did not answer within 10 s"]
        res = await invoke("--admin", url, "nodes", "nope")
        assert res.exit_code == 1 and "nope" in res.output
