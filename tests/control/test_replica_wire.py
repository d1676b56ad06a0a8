"""The replica wire (protocol 1.2): desired sets pushed to agents, statuses back, labels, log tails.

A real control plane (gRPC on 127.0.0.1) and real :class:`AgentClient`\\ s; the replica controller
and the node's supervisor are small in-test implementations of their Protocols
(:mod:`llmgw.launch.spec`), so what is checked is the transport between them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence

import grpc
import pytest
from click.testing import CliRunner
from cp_helpers import TOKEN, api, control_config, control_plane, control_runtime, free_port, wait_for
from scenario import discovery_of, h100s

from llmgw._proto.agent.v1 import agent_pb2_grpc
from llmgw.agent.client import AgentClient
from llmgw.agent.model import Discovery
from llmgw.agent.wire import pb, spec_from_proto, spec_to_proto, status_from_proto, status_to_proto
from llmgw.cli.ctl import ctl
from llmgw.control.nodes import NodeMap
from llmgw.control.service import AgentService, ControlStats
from llmgw.launch.spec import READY, STARTING, ModelBlob, ReplicaSpec, ReplicaStatus

pytestmark = pytest.mark.timeout(60)

SLOW = {"heartbeat_interval": "20s", "heartbeat_grace": "60s"}
"""Beats far apart: whatever arrives sooner was pushed, not carried by a beat."""


class Source:
    def __init__(self, host: str) -> None:
        self.d = discovery_of({"hostname": host, "gpus": h100s(1, host[-1])})

    def read(self) -> Discovery:
        return self.d

    def close(self) -> None:
        pass


class Controller:
    """A ReplicaController over a dict: ``set(node, specs)`` bumps the node's generation and announces it."""

    def __init__(self) -> None:
        self.sets: dict[str, tuple[int, tuple[ReplicaSpec, ...]]] = {}
        self.reports: list[tuple[str, str, tuple[ReplicaStatus, ...]]] = []
        self.gone: list[str] = []
        self.desired_calls = 0
        self._subs: list[Callable[[str], None]] = []

    def set(self, node: str, specs: Sequence[ReplicaSpec]) -> int:
        gen = self.sets.get(node, (0, ()))[0] + 1
        self.sets[node] = (gen, tuple(specs))
        for cb in self._subs:
            cb(node)
        return gen

    def desired(self, node: str) -> tuple[int, tuple[ReplicaSpec, ...]]:
        self.desired_calls += 1
        return self.sets.get(node, (0, ()))

    def report(self, node: str, address: str, statuses: Sequence[ReplicaStatus]) -> None:
        self.reports.append((node, address, tuple(statuses)))

    def node_gone(self, node: str) -> None:
        self.gone.append(node)

    def wake(self) -> None:
        self.woken = getattr(self, "woken", 0) + 1

    def subscribe(self, changed: Callable[[str], None]) -> None:
        self._subs.append(changed)

    def last(self, node: str) -> tuple[ReplicaStatus, ...] | None:
        for n, _, st in reversed(self.reports):
            if n == node:
                return st
        return None


class Supervisor:
    """A Supervisor that runs nothing: each applied replica is ``starting``, then ``ready`` when told."""

    def __init__(self) -> None:
        self.applied: list[tuple[ReplicaSpec, ...]] = []
        self.applied_at: list[float] = []
        self.states: dict[str, ReplicaStatus] = {}
        self.logs: dict[str, str] = {}
        self.on_change: Callable[[], None] | None = None
        self.adopted = self.closed = False

    async def adopt(self) -> None:
        self.adopted = True

    async def apply(self, desired: Sequence[ReplicaSpec]) -> None:
        self.applied.append(tuple(desired))
        self.applied_at.append(time.monotonic())
        ids = {s.id for s in desired}
        for rid in list(self.states):
            if rid not in ids:
                del self.states[rid]
        for s in desired:
            self.states.setdefault(s.id, ReplicaStatus(id=s.id, state=STARTING, log_path=f"/logs/{s.id}.log"))
        self.changed()

    def ready(self, rid: str, port: int) -> None:
        self.states[rid] = ReplicaStatus(id=rid, state=READY, port=port, pid=4242, log_path=f"/logs/{rid}.log")
        self.changed()

    def changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def statuses(self) -> list[ReplicaStatus]:
        return list(self.states.values())

    def log_tail(self, replica_id: str, lines: int = 100) -> str:
        if replica_id not in self.logs:
            raise KeyError(replica_id)
        return "".join(self.logs[replica_id].splitlines(keepends=True)[-lines:])

    async def close(self, *, stop: bool = True) -> None:
        self.closed = True


def spec(rid: str, **kw: object) -> ReplicaSpec:
    return ReplicaSpec(id=rid, deployment="chat", engine="llamacpp", model="tiny:1b", served_name="chat",
                       api_key="sk-replica-secret", **kw)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def agent(port: int, name: str, sup: Supervisor | None, **kw: object) -> AsyncIterator[AgentClient]:
    # (the Controller here never shrinks a leaving node's set: a stopping agent would wait out its drain)
    kw.setdefault("drain_timeout", 0.0)
    a = AgentClient(f"127.0.0.1:{port}", name, TOKEN, Source(f"host-{name[-1]}"), supervisor=sup, **kw)  # type: ignore[arg-type]
    if sup is not None:
        sup.on_change = a.poke
    stop = asyncio.Event()
    task = asyncio.create_task(a.run(stop))
    try:
        yield a
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 10)


def test_specs_and_statuses_survive_the_wire() -> None:
    s = spec("r1", blobs=(ModelBlob("sha256:" + "ab" * 32, 123, "projector"),), gpus=("GPU-1", "GPU-2"),
             gpu_memory_fraction=0.5, slots=4, context=0, args=("--x", "1"), env={"A": "b"}, ready_timeout=7200.0)
    assert spec_from_proto(spec_to_proto(s)) == s
    bare = spec("r2")
    back = spec_from_proto(spec_to_proto(bare))
    assert back == bare and back.slots is None and back.context is None and back.gpu_memory_fraction is None
    assert back.ready_timeout is None and not spec_to_proto(bare).HasField("ready_timeout_seconds")
    # a ready timeout no deployment could say (a newer or broken sender) is the agent's own instead
    for odd in (0.0, -5.0, 0.5, float("nan"), float("inf"), 8 * 86400.0):
        m = spec_to_proto(bare)
        m.ready_timeout_seconds = odd
        assert spec_from_proto(m).ready_timeout is None, odd
    st = ReplicaStatus(id="r1", state="failed", port=0, pid=7, restarts=3, exit_code=-9, message="boom",
                       log_path="/x.log", fetched=0, fetch_total=10)
    assert status_from_proto(status_to_proto(st)) == st
    unknown = status_from_proto(status_to_proto(ReplicaStatus(id="r", state=STARTING)))
    assert unknown.port is None and unknown.pid is None and unknown.exit_code is None and unknown.fetched is None
    # a value the field cannot hold is left absent, never sent as something else
    assert not status_to_proto(ReplicaStatus(id="r", state=READY, port=-1)).HasField("port")


async def test_a_change_is_pushed_at_once_and_statuses_come_back() -> None:
    port = free_port()
    async with control_runtime(port, **SLOW) as rt:
        cp = control_plane(rt)
        ctl_ = Controller()
        cp.service.attach(ctl_)
        sup = Supervisor()
        async with agent(port, "node-a", sup, labels={"zone": "eu-1"}, advertise="127.0.0.1") as a:
            await wait_for(lambda: a.heartbeats >= 1 and a.streaming, what="the first beat")
            st = cp.nodes.get("node-a")
            assert st is not None and st.labels == {"zone": "eu-1"} and st.address == "127.0.0.1"
            # the controller's generation 0 (nothing ever asked) still goes to an agent that applied nothing:
            # what it may have adopted from before stops
            await wait_for(lambda: sup.applied == [()], timeout=5, what="the empty set of generation 0")
            t0 = time.monotonic()
            gen = ctl_.set("node-a", [spec("r1")])
            await wait_for(lambda: len(sup.applied) == 2, timeout=5, what="the set pushed to the agent")
            assert sup.applied_at[1] - t0 < 1.0, "pushed at once, not at the next beat (20 s away)"
            assert sup.applied[1] == (spec("r1"),)  # the key travelled with it
            # the agent acknowledges at once (an early beat), with the new replica's status
            await wait_for(lambda: a.applied == gen and (ctl_.last("node-a") or ()) != (), timeout=5,
                           what="the early beat with the status")
            assert [s.state for s in ctl_.last("node-a") or ()] == [STARTING]
            assert ctl_.reports[-1][1] == "127.0.0.1"
            t1 = time.monotonic()
            sup.ready("r1", 40001)
            await wait_for(lambda: [s.state for s in ctl_.last("node-a") or ()] == [READY], timeout=5,
                           what="ready reported")
            assert time.monotonic() - t1 < 1.0
            assert ctl_.last("node-a")[0].port == 40001  # type: ignore[index]
            assert cp.nodes.get("node-a").replicas[0].state == READY  # type: ignore[union-attr]
            # beats without a change carry no set again: one apply per generation
            beats = a.heartbeats
            sup.changed()
            sup.changed()
            await wait_for(lambda: a.heartbeats >= beats + 1, timeout=5, what="an early beat")
            assert len(sup.applied) == 2
            # scale to two, then none
            gen2 = ctl_.set("node-a", [spec("r1"), spec("r2")])
            await wait_for(lambda: a.applied == gen2, timeout=5, what="the second set")
            assert [s.id for s in sup.applied[-1]] == ["r1", "r2"]
            gen3 = ctl_.set("node-a", [])
            await wait_for(lambda: a.applied == gen3 and sup.applied[-1] == (), timeout=5, what="the empty set")
            assert len(sup.applied) == 4
        await wait_for(lambda: ctl_.gone == ["node-a"], what="node_gone on deregistration")


async def test_a_restarted_agent_gets_its_set_again() -> None:
    """A new stream (the agent restarted) is sent the set even when its generation was sent before."""
    port = free_port()
    async with control_runtime(port, **SLOW) as rt:
        ctl_ = Controller()
        control_plane(rt).service.attach(ctl_)
        gen = ctl_.set("node-b", [spec("r1")])
        first = Supervisor()
        async with agent(port, "node-b", first) as a:
            await wait_for(lambda: a.applied == gen, timeout=5, what="the set on the first beat")
        second = Supervisor()
        async with agent(port, "node-b", second) as b:
            await wait_for(lambda: b.applied == gen, timeout=5, what="the set after the restart")
        assert first.applied == second.applied == [(spec("r1"),)]


async def test_an_agent_without_replicas_and_an_older_agent_get_no_set() -> None:
    port = free_port()
    async with control_runtime(port) as rt:
        cp = control_plane(rt)
        ctl_ = Controller()
        cp.service.attach(ctl_)
        ctl_.set("node-o", [spec("r1")])
        ctl_.set("node-p", [spec("r2")])
        async with agent(port, "node-o", Supervisor(), protocol=(1, 1)) as old, agent(port, "node-p", None) as plain:
            await wait_for(lambda: old.heartbeats >= 3 and plain.heartbeats >= 3, what="beats")
            assert old.streaming and plain.streaming
            assert old.applied == 0 and plain.applied == 0
            assert ctl_.reports == []  # neither runs replicas: nothing reported for them
            st = cp.nodes.get("node-o")
            assert st is not None and st.protocol == (1, 1) and st.replicas == ()


class _CallsOnly(AgentService):
    """A control plane whose agents use Heartbeat calls (no stream): the set comes in the call's answer."""

    StreamHeartbeats = agent_pb2_grpc.AgentServiceServicer.StreamHeartbeats  # type: ignore[assignment]


async def test_heartbeat_calls_carry_the_set_and_log_requests() -> None:
    port = free_port()
    cfg = control_config(port)
    nodes = NodeMap(lambda: 1.0)
    ctl_ = Controller()
    service = _CallsOnly(nodes, lambda: cfg.control, ControlStats(), controller=ctl_)
    server = grpc.aio.server()
    agent_pb2_grpc.add_AgentServiceServicer_to_server(service, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    try:
        sup = Supervisor()
        sup.logs["r1"] = "one\ntwo\nthree\n"
        gen = ctl_.set("node-c", [spec("r1")])
        async with agent(port, "node-c", sup) as a:
            await wait_for(lambda: a.applied == gen and not a.streaming, timeout=5, what="the set in a call's answer")
            await wait_for(lambda: ctl_.last("node-c"), timeout=5, what="the status")
            assert ctl_.reports[-1][1] == "127.0.0.1"  # no advertise: the peer's address
            assert await service.replica_logs("r1", 2, timeout=5) == "two\nthree\n"
            assert len(sup.applied) == 1
    finally:
        await server.stop(0)


async def test_ctl_logs_asks_the_node() -> None:
    port = free_port()
    async with control_runtime(port, **SLOW) as rt:
        cp = control_plane(rt)
        ctl_ = Controller()
        cp.service.attach(ctl_)
        sup = Supervisor()
        sup.logs["r1"] = "".join(f"line {i}\n" for i in range(500))
        gen = ctl_.set("node-l", [spec("r1"), spec("r2")])
        async with agent(port, "node-l", sup) as a:
            await wait_for(lambda: a.applied == gen and len(cp.nodes.get("node-l").replicas) == 2,  # type: ignore[union-attr]
                           timeout=5, what="the replicas reported")
            t0 = time.monotonic()
            status, body = await api(rt, "GET", "/admin/v1/replicas/r1/logs?lines=3")
            assert status == 200, body
            assert body == {"replica": "r1", "node": "node-l", "lines": 3, "text": "line 497\nline 498\nline 499\n"}
            assert time.monotonic() - t0 < 2.0, "asked on the stream at once, not at the next beat"
            # the replica has no log on the node
            status, body = await api(rt, "GET", "/admin/v1/replicas/r2/logs")
            assert status == 502 and "no replica 'r2' on node node-l" in body["error"]["message"]
            status, body = await api(rt, "GET", "/admin/v1/replicas/nope/logs")
            assert status == 404 and body["error"]["code"] == "replica_not_found"
            status, body = await api(rt, "GET", "/admin/v1/replicas/r1/logs?lines=0")
            assert status == 400 and body["error"]["param"] == "lines"
            status, body = await api(rt, "POST", "/admin/v1/replicas/r1/logs")
            assert status == 405
            # the command (in a thread: it blocks, the control plane answers on this loop)
            admin = f"http://127.0.0.1:{rt.admin_addr[1]}"  # type: ignore[index]
            res = await asyncio.to_thread(CliRunner().invoke, ctl, ["--admin", admin, "logs", "r1", "-n", "2"])
            assert res.exit_code == 0, res.output
            assert res.output == "line 498\nline 499\n"
            res = await asyncio.to_thread(CliRunner().invoke, ctl, ["--admin", admin, "logs", "nope"])
            assert res.exit_code != 0 and "no node reports a replica 'nope'" in res.output


async def test_a_log_request_times_out_when_the_node_does_not_answer() -> None:
    port = free_port()
    async with control_runtime(port, **SLOW) as rt:
        cp = control_plane(rt)
        ctl_ = Controller()
        cp.service.attach(ctl_)
        sup = Supervisor()
        gen = ctl_.set("node-t", [spec("r1")])
        async with agent(port, "node-t", sup) as a:
            await wait_for(lambda: a.applied == gen and cp.nodes.get("node-t").replicas, timeout=5,  # type: ignore[union-attr]
                           what="the replica reported")
            a.supervisor = None  # (this agent no longer answers log requests)
            from llmgw.control.service import ReplicaLogsError

            with pytest.raises(ReplicaLogsError) as exc:
                await cp.service.replica_logs("r1", 5, timeout=0.5)
            assert exc.value.status == 504 and "did not answer" in str(exc.value)
            assert cp.service._waits == {} and cp.service._asks == {}


async def test_register_refuses_bad_labels() -> None:
    port = free_port()
    async with control_runtime(port):
        ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = agent_pb2_grpc.AgentServiceStub(ch)
        md = (("authorization", f"Bearer {TOKEN}"),)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await stub.Register(pb.RegisterRequest(
                    node_name="n", protocol=pb.ProtocolVersion(major=1, minor=2), labels={"": "x"}), metadata=md)
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await stub.Register(pb.RegisterRequest(
                    node_name="n", protocol=pb.ProtocolVersion(major=1, minor=2), advertise_address="a b"), metadata=md)
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            # an answer to a request nobody made is refused quietly
            ok = await stub.Register(pb.RegisterRequest(node_name="n", protocol=pb.ProtocolVersion(major=1, minor=2)),
                                     metadata=md)
            got = await stub.ReplicaLogs(pb.ReplicaLogsRequest(node_id=ok.node_id, node_name="n", request_id=99,
                                                               text="x"), metadata=md)
            assert not got.accepted
            # the mirror: this node's own credential (a new one per registration), never the join token
            assert ok.mirror_url.startswith("http://127.0.0.1:") and ok.mirror_credential.startswith("llmgw-node-")
            again = await stub.Register(
                pb.RegisterRequest(node_name="n", protocol=pb.ProtocolVersion(major=1, minor=2)), metadata=md)
            assert again.mirror_credential != ok.mirror_credential and TOKEN not in again.mirror_credential
            older = await stub.Register(
                pb.RegisterRequest(node_name="o", protocol=pb.ProtocolVersion(major=1, minor=1)), metadata=md)
            assert not older.HasField("mirror_credential") and not older.HasField("mirror_url")
        finally:
            await ch.close()


async def test_engine_check_runs_on_the_node() -> None:
    port = free_port()
    async with control_runtime(port, **SLOW) as rt:
        asked: list[pb.EngineCheckRequest] = []

        async def checker(req: pb.EngineCheckRequest) -> list[dict[str, object]]:
            asked.append(req)
            if req.engine == "vllm":
                raise RuntimeError("no vllm here")
            return [{"check": "binary", "status": "pass", "detail": "llama-server found", "fix": None},
                    {"check": "flags", "status": "fail", "detail": "--metrics missing", "fix": "upgrade it"}]

        async with agent(port, "node-e", Supervisor(), engine_checker=checker) as a, \
                agent(port, "node-old", Supervisor(), protocol=(1, 1)) as old:
            await wait_for(lambda: a.heartbeats >= 1 and old.heartbeats >= 1, what="beats")
            admin = f"http://127.0.0.1:{rt.admin_addr[1]}"  # type: ignore[index]
            t0 = time.monotonic()
            res = await asyncio.to_thread(CliRunner().invoke, ctl, ["--admin", admin, "engine-check", "llamacpp",
                                                                    "--node", "node-e", "--static"])
            assert time.monotonic() - t0 < 5.0, "asked on the stream at once"
            assert res.exit_code == 1, res.output  # a check failed: non-zero, as locally
            assert "on node node-e:" in res.output and "--metrics missing" in res.output and "upgrade it" in res.output
            assert asked[0].engine == "llamacpp" and asked[0].static_only and not asked[0].HasField("model")
            res = await asyncio.to_thread(CliRunner().invoke, ctl, ["--admin", admin, "engine-check", "vllm",
                                                                    "--node", "node-e", "--model", "m", "--json"])
            assert res.exit_code == 1 and "could not run: RuntimeError: no vllm here" in res.output, res.output
            assert asked[1].model == "m"
            res = await asyncio.to_thread(CliRunner().invoke, ctl, ["--admin", admin, "engine-check", "llamacpp",
                                                                    "--node", "node-old"])
            assert res.exit_code == 1 and "protocol 1.1" in res.output, res.output
            res = await asyncio.to_thread(CliRunner().invoke, ctl, ["--admin", admin, "engine-check", "llamacpp",
                                                                    "--node", "nope"])
            assert res.exit_code == 1 and "no node 'nope'" in res.output, res.output
            status, body = await api(rt, "POST", "/admin/v1/nodes/node-e/engine-check")
            assert status == 400 and body["error"]["param"] == "engine"
