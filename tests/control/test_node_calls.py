"""What one agent with a valid join token may say: only for the node it registered, and within bounds."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from cp_helpers import TOKEN, api, control_runtime, free_port

from canary import secret
from llmgw._proto.agent.v1 import agent_pb2_grpc
from llmgw.agent.wire import PROTOCOL, node_id_for, pb

pytestmark = pytest.mark.timeout(60)

OTHER = secret("another-join-token")


def _md(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def _register(name: str, **kw: Any) -> pb.RegisterRequest:
    return pb.RegisterRequest(node_name=name, agent_version=kw.pop("agent_version", "test"),
                              protocol=pb.ProtocolVersion(major=PROTOCOL[0], minor=PROTOCOL[1]),
                              discovery=pb.Discovery(source="none"), **kw)


async def _code(call: Any) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def test_a_node_is_spoken_for_only_with_the_token_it_registered_with() -> None:
    port = free_port()
    async with control_runtime(port, join_token=[TOKEN, OTHER]) as rt, \
            grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = agent_pb2_grpc.AgentServiceStub(ch)
        await stub.Register(_register("victim"), metadata=_md(TOKEN))
        victim = node_id_for("victim")  # (computable by anyone: it is no secret)
        beat = pb.HeartbeatRequest(node_id=victim, node_name="victim", sequence=1, discovery=pb.Discovery(source="x"))
        assert await _code(stub.Heartbeat(beat, metadata=_md(OTHER))) == grpc.StatusCode.PERMISSION_DENIED
        gone = pb.DeregisterRequest(node_id=victim, node_name="victim", reason="taken")
        assert await _code(stub.Deregister(gone, metadata=_md(OTHER))) == grpc.StatusCode.PERMISSION_DENIED
        # registering its name again with the other token, while it is up: refused (retried, not fatal)
        assert await _code(stub.Register(_register("victim"), metadata=_md(OTHER))) == grpc.StatusCode.ALREADY_EXISTS
        stream = stub.StreamHeartbeats(metadata=_md(OTHER))
        await stream.write(pb.StreamHeartbeatsRequest(heartbeat=beat))
        assert await _code(stream.read()) == grpc.StatusCode.PERMISSION_DENIED
        status, body = await api(rt, "GET", "/admin/v1/nodes/victim")
        assert status == 200 and body["state"] == "up" and body["gpu_source"] == "none", body
        # its own token still speaks for it
        assert await _code(stub.Heartbeat(beat, metadata=_md(TOKEN))) == grpc.StatusCode.OK
        assert (await stub.Deregister(gone, metadata=_md(TOKEN))).removed


@pytest.mark.parametrize("field, value", [
    ("agent_version", "V" * 200),
    ("agent_version", "1.0\n2026-01-01 00:00:00 ERROR llmgw.control: FORGED"),
    ("advertise_address", "evil.example:1/\x00"),
    ("advertise_address", "http://x@evil"),
])
async def test_a_registration_with_odd_strings_is_refused(field: str, value: str) -> None:
    port = free_port()
    async with control_runtime(port) as rt, grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = agent_pb2_grpc.AgentServiceStub(ch)
        req = _register("odd", **{field: value})
        assert await _code(stub.Register(req, metadata=_md(TOKEN))) == grpc.StatusCode.INVALID_ARGUMENT
        status, _ = await api(rt, "GET", "/admin/v1/nodes/odd")
        assert status == 404


async def test_a_heartbeats_replica_statuses_are_cut_to_the_limits() -> None:
    from llmgw.control import limits

    port = free_port()
    async with control_runtime(port) as rt, \
            grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                      options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        stub = agent_pb2_grpc.AgentServiceStub(ch)
        await stub.Register(_register("nw"), metadata=_md(TOKEN))
        big = [pb.ReplicaStatus(id="x" * 100_000, state="y" * 100_000, message="z" * 1_000_000)]
        many = [pb.ReplicaStatus(id=f"r{i}", state="ready") for i in range(limits.MAX_REPLICAS + 50)]
        for replicas in (big, many):
            beat = pb.HeartbeatRequest(node_id=node_id_for("nw"), node_name="nw", sequence=1, applied_generation=0,
                                       discovery=pb.Discovery(source="none"), replicas=replicas)
            await stub.Heartbeat(beat, metadata=_md(TOKEN))
            status, body = await api(rt, "GET", "/admin/v1/nodes/nw")
            assert status == 200
            reps = body["replicas"]
            assert len(reps) <= limits.MAX_REPLICAS
            assert all(len(r["id"]) <= limits.MAX_TEXT and len(r.get("message") or "") <= limits.MAX_REPLICA_MESSAGE
                       for r in reps), [len(str(r)) for r in reps][:3]


async def test_node_names_follow_the_agents_rule_on_the_control_plane_too() -> None:
    """A name ``llmgw agent --name`` refuses is refused by Register as well (a hand-made client, an older
    agent): node names end up in metric labels, URLs and deployments' ``nodes:``."""
    port = free_port()
    async with control_runtime(port) as rt, grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = agent_pb2_grpc.AgentServiceStub(ch)
        for bad in ("a b", "node\n", "-x", ".hidden", "ünï", "x/y", "x" * 129, ""):
            try:
                await stub.Register(_register(bad), metadata=_md(TOKEN))
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
                assert "letters, digits, '.', '_' or '-'" in (exc.details() or "")
            else:
                raise AssertionError(f"{bad!r} registered")
        for good in ("n", "gpu-7.rack_2", "x" * 128):
            assert await _code(stub.Register(_register(good), metadata=_md(TOKEN))) == grpc.StatusCode.OK
        status, body = await api(rt, "GET", "/admin/v1/nodes")
        assert status == 200 and sorted(n["name"] for n in body["nodes"]) == sorted(["n", "gpu-7.rack_2", "x" * 128])


async def test_a_call_whose_message_does_not_parse_is_counted() -> None:
    """Bytes that are no Register or Heartbeat message: answered INTERNAL before any handler runs, and
    counted in llmgw_control_rpc_errors_total like every other call answered with an error."""
    from cp_helpers import metrics, pick

    port = free_port()
    async with control_runtime(port) as rt, grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        for method in ("Register", "Heartbeat"):
            call = ch.unary_unary(f"/llmgw.agent.v1.AgentService/{method}",
                                  request_serializer=lambda b: b, response_deserializer=lambda b: b)
            assert await _code(call(b"\xff\xff\xff\xff garbage", metadata=_md(TOKEN))) == grpc.StatusCode.INTERNAL
            assert pick(await metrics(rt), "llmgw_control_rpc_errors_total", method=method, code="INTERNAL") == [1.0]
