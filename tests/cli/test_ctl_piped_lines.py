"""``llmgw ctl``'s tables, piped: no line ends in spaces.

rich pads every cell to its column's width, the last column too, so a piped ``ctl gpus`` ended each
row in the spaces that made ``ok`` as wide as ``HEALTH``, and ``ctl deployments`` a row with no reason
in a reason's width of them (a hundred and more), carried by ``cut``, ``awk '$NF'`` and diffs.
A real control plane on 127.0.0.1, a node registered over gRPC.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import grpc
import pytest
from click.testing import CliRunner, Result

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "control"))
from cp_helpers import TOKEN, control_runtime, free_port
from scenario import discovery_of, h100s

from llmgw._proto.agent.v1 import agent_pb2_grpc
from llmgw.agent.wire import PROTOCOL, discovery_to_proto, pb
from llmgw.cli.ctl import ctl

pytestmark = pytest.mark.timeout(60)


async def invoke(*args: str) -> Result:
    return await asyncio.to_thread(CliRunner().invoke, ctl, list(args), catch_exceptions=False)


async def register(port: int, name: str) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = agent_pb2_grpc.AgentServiceStub(ch)
        req = pb.RegisterRequest(node_name=name, agent_version="test",
                                 protocol=pb.ProtocolVersion(major=PROTOCOL[0], minor=PROTOCOL[1]),
                                 discovery=discovery_to_proto(discovery_of({"gpus": h100s(2)})))
        await stub.Register(req, metadata=[("authorization", f"Bearer {TOKEN}")], timeout=5)


async def test_piped_tables_have_no_trailing_spaces() -> None:
    port = free_port()
    async with control_runtime(port, heartbeat_interval="10s", heartbeat_grace="60s") as rt:
        assert rt.admin_addr is not None
        url = f"http://127.0.0.1:{rt.admin_addr[1]}"
        await register(port, "node-with-a-rather-long-name")
        for args in (["gpus"], ["nodes"], ["nodes", "node-with-a-rather-long-name"], ["endpoints"], ["queues"],
                     ["deployments"], ["tokens", "list"]):
            res = await invoke("--admin", url, *args)
            assert res.exit_code == 0, res.output
            lines = res.output.splitlines()
            padded = [line for line in lines if line != line.rstrip()]
            assert not padded, f"ctl {' '.join(args)}: lines ending in spaces: {padded!r}"
        gpus = (await invoke("--admin", url, "gpus")).output.splitlines()
        assert gpus[0].endswith("HEALTH") and all(line.split()[-1] in ("ok", "degraded") for line in gpus[1:]), gpus
