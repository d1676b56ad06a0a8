"""Deployments on a running gateway with its control plane: the admin API, ``llmgw ctl``, placement
on real registrations, and the router following replica reports (a simulated engine is the replica;
the agent's side is driven by calling ``report()`` in-process as the agent service would)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from pathlib import Path
from typing import Any

import grpc
import orjson
import pytest
from click.testing import CliRunner, Result
from cp_helpers import (
    TOKEN,
    api,
    control_config,
    control_plane,
    control_runtime,
    free_port,
    metrics,
    pick,
    wait_for,
)
from scenario import discovery_of, h100s

from llmgw._proto.agent.v1 import agent_pb2_grpc
from llmgw.agent.wire import PROTOCOL, discovery_to_proto, pb
from llmgw.cli.ctl import ctl
from llmgw.config import load
from llmgw.control.deployments import DeploymentController
from llmgw.engines.sim import SimConfig, SimEngine
from llmgw.launch.spec import ReplicaSpec, ReplicaStatus
from llmgw.runtime import GatewayRuntime, components_for

pytestmark = pytest.mark.timeout(90)

GIB = 1024**3


async def invoke(*args: str) -> Result:
    return await asyncio.to_thread(CliRunner().invoke, ctl, list(args), catch_exceptions=False)


async def register(port: int, name: str, spec: dict[str, Any]) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = agent_pb2_grpc.AgentServiceStub(ch)
        req = pb.RegisterRequest(node_name=name, agent_version="test", protocol=pb.ProtocolVersion(major=PROTOCOL[0], minor=PROTOCOL[1]),
                                 discovery=discovery_to_proto(discovery_of(spec)))
        await stub.Register(req, metadata=[("authorization", f"Bearer {TOKEN}")], timeout=5)


async def admin(rt: GatewayRuntime, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    assert rt.admin_addr is not None
    data = b"" if body is None else orjson.dumps(body)
    r, w = await asyncio.open_connection("127.0.0.1", rt.admin_addr[1])
    try:
        w.write(f"{method} {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: {len(data)}\r\n"
                "content-type: application/json\r\n\r\n".encode() + data)
        raw = await asyncio.wait_for(r.read(), 10)
    finally:
        w.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), orjson.loads(payload)


async def chat(rt: GatewayRuntime, model: str, max_tokens: int = 2) -> tuple[int, Any]:
    assert rt.listen_addr is not None
    data = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens})
    r, w = await asyncio.open_connection("127.0.0.1", rt.listen_addr[1])
    try:
        w.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json"
                b"\r\ncontent-length: %d\r\n\r\n%s" % (len(data), data))
        raw = await asyncio.wait_for(r.read(), 30)
    finally:
        w.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), orjson.loads(payload)


async def client_get(rt: GatewayRuntime, path: str) -> tuple[int, Any]:
    assert rt.listen_addr is not None
    r, w = await asyncio.open_connection("127.0.0.1", rt.listen_addr[1])
    try:
        w.write(f"GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode())
        raw = await asyncio.wait_for(r.read(), 10)
    finally:
        w.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), orjson.loads(payload)


async def listed(rt: GatewayRuntime) -> list[str]:
    """The ids GET /v1/models lists, each also found by GET /v1/models/{id}."""
    status, doc = await client_get(rt, "/v1/models")
    assert status == 200, doc
    ids = [card["id"] for card in doc["data"]]
    for m in ids:
        status, card = await client_get(rt, f"/v1/models/{m}")
        assert status == 200 and card["id"] == m, card
    return ids


def controller(rt: GatewayRuntime) -> DeploymentController:
    ctl_ = control_plane(rt).deployments
    assert ctl_ is not None
    return ctl_


class Replicas:
    """Simulated engines standing in for the replicas a node was asked to run, reported as an agent would."""

    def __init__(self, ctl_: DeploymentController, node: str, tokens_per_second: float = 1e6) -> None:
        self.ctl, self.node, self.tps = ctl_, node, tokens_per_second
        self.engines: dict[str, SimEngine] = {}

    async def follow(self, state: str = "ready") -> tuple[ReplicaSpec, ...]:
        """Run exactly the node's desired set (start what is new, stop what left) and report it."""
        _, specs = self.ctl.desired(self.node)
        want = {s.id: s for s in specs}
        for rid in [r for r in self.engines if r not in want]:
            await self.engines.pop(rid).stop()
        for s in specs:
            if s.id not in self.engines:
                eng = SimEngine(SimConfig(model=s.served_name, engine=s.engine, api_key=s.api_key, ttft_ms=0,
                                          tokens_per_second=self.tps))
                await eng.start("127.0.0.1", 0)
                self.engines[s.id] = eng
        self.report(state)
        return specs

    def report(self, state: str = "ready", **override: str) -> None:
        statuses = [ReplicaStatus(rid, override.get(rid, state), port=e.address[1] if e.address else None, pid=1)
                    for rid, e in self.engines.items()]
        self.ctl.report(self.node, "127.0.0.1", statuses)

    async def close(self) -> None:
        for e in self.engines.values():
            await e.stop()


async def test_the_router_follows_ready_replicas_scale_down_drains_and_zero_answers_503(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    port = free_port()
    async with control_runtime(port, heartbeat_interval="10s", heartbeat_grace="60s",
                               database=f"sqlite:///{tmp_path}/cp.sqlite3") as rt:
        await register(port, "node-1", {"hostname": "h1", "gpus": h100s(2)})
        ctl_ = controller(rt)
        ctl_.drain_grace = 20.0
        changed: list[str] = []
        ctl_.subscribe(changed.append)
        gen0, none = ctl_.desired("node-1")
        assert none == ()
        status, d = await admin(rt, "POST", "/admin/v1/deployments",
                                {"name": "chat", "model": "sim-weights", "gpu_memory": "10GiB", "slots": 4})
        assert status == 201, d
        assert (d["desired"], d["placed"], d["ready"], d["nodes"], d["message"]) == (1, 1, 0, ["node-1"], None)
        gen1, specs = ctl_.desired("node-1")
        assert gen1 > gen0 and changed == ["node-1"] and len(specs) == 1
        s = specs[0]
        assert (s.deployment, s.engine, s.model, s.served_name, s.slots) == ("chat", "vllm", "sim-weights", "chat", 4)
        assert len(s.gpus) == 1 and s.gpus[0].startswith("GPU-") and len(s.api_key) >= 40
        assert ctl_.desired("node-1") == (gen1, specs)  # asked again: the same set, the same generation
        # not ready yet: the model answers 503 model_unavailable (it is deployed), not 404
        status, body = await chat(rt, "chat")
        assert status == 503 and body["error"]["code"] == "model_unavailable", body
        # ... and is listed, as a model that exists (a client lists models before it asks)
        assert "chat" in await listed(rt)
        status, ready = await admin(rt, "GET", "/ready")  # ... and the router is not ready without it
        assert status == 503 and "chat" in ready["models_unavailable"], ready
        # (with the control plane's reason, as the 503 says it)
        assert ready["deployments"] == {"chat": "its deployment's replicas are starting"}, ready
        assert ready["deployments"]["chat"] in body["error"]["message"], body
        reps = Replicas(ctl_, "node-1", tokens_per_second=20.0)
        try:
            await reps.follow("starting")
            assert rt.registry is not None and s.id not in rt.registry.endpoints
            reps.report("ready")
            assert s.id in rt.registry.endpoints
            status, body = await chat(rt, "chat")
            assert status == 200, body
            assert "chat" not in (await admin(rt, "GET", "/ready"))[1]["models_unavailable"]
            status, eps = await admin(rt, "GET", "/admin/v1/endpoints")
            ep = next(e for e in eps["endpoints"] if e["id"] == s.id)
            assert (ep["deployment"], ep["node"], ep["pool"], ep["models"]) == ("chat", "node-1", "node-1", ["chat"])
            assert s.api_key not in json.dumps(eps)
            res = await invoke("--admin", f"http://127.0.0.1:{rt.admin_addr[1]}", "endpoints")  # type: ignore[index]
            assert res.exit_code == 0 and "DEPLOYMENT" in res.output.splitlines()[0]
            assert "chat" in next(line for line in res.output.splitlines() if line.startswith(s.id))
            # the claim shows on /metrics
            samples = await metrics(rt)
            assert pick(samples, "llmgw_gpu_memory_allocated_bytes", node="node-1", gpu_uuid=s.gpus[0]) == [10 * GIB]
            assert sorted(pick(samples, "llmgw_gpu_memory_allocated_bytes", node="node-1")) == [0.0, 10 * GIB]
            assert pick(samples, "llmgw_deployment_replicas_ready", deployment="chat") == [1.0]

            # 1 -> 2: the second replica takes the other GPU (one replica per GPU)
            status, d = await admin(rt, "POST", "/admin/v1/deployments/chat/scale", {"replicas": 2})
            assert status == 200 and d["placed"] == 2, d
            specs2 = await reps.follow("ready")
            assert len(specs2) == 2 and {x.gpus for x in specs2} == {(g["uuid"],) for g in h100s(2)}
            assert all(x.id in rt.registry.endpoints for x in specs2)
            newest = next(x for x in specs2 if x.id != s.id)

            # 2 -> 1 with requests in flight on both: the newest drains first, finishing its requests
            eps_ = rt.registry.endpoints
            await wait_for(lambda: all(eps_[x.id].scrape_ok > 0 for x in specs2), what="both scraped")
            slow = [asyncio.ensure_future(chat(rt, "chat", max_tokens=30)) for _ in range(6)]
            await wait_for(lambda: rt.registry.endpoints[newest.id].inflight > 0  # type: ignore[union-attr]
                           and rt.registry.endpoints[s.id].inflight > 0, what="requests on both")  # type: ignore[union-attr]
            status, d = await admin(rt, "POST", "/admin/v1/deployments/chat/scale", {"replicas": 1})
            assert status == 200
            assert rt.registry.endpoints[newest.id].draining
            assert len(ctl_.desired("node-1")[1]) == 2  # still running: its requests are not done
            assert [r["state"] for r in d["replicas"] if r["id"] == newest.id] == ["draining"]
            assert all(st == 200 for st, _ in await asyncio.gather(*slow))
            await wait_for(lambda: len(ctl_.desired("node-1")[1]) == 1, what="drained replica leaves the set")
            assert newest.id not in rt.registry.endpoints
            await reps.follow("ready")
            assert list(reps.engines) == [s.id]

            # a replica the node stops reporting leaves the router; reported ready again, it is back
            ctl_.report("node-1", "127.0.0.1", [])
            assert s.id not in rt.registry.endpoints
            reps.report("ready")
            assert s.id in rt.registry.endpoints

            # failed: out of the router and of the set, the deployment says why
            ctl_.report("node-1", "127.0.0.1", [ReplicaStatus(s.id, "failed", exit_code=1,
                                                              message="llama-server: error: unknown argument")])
            assert s.id not in rt.registry.endpoints and ctl_.desired("node-1")[1] == ()
            _, d = await admin(rt, "GET", "/admin/v1/deployments/chat")
            assert "failed on node-1 (exit 1): llama-server: error: unknown argument" in d["message"]
            assert d["placed"] == 0  # (placed again after a backoff)
            ctl_.deployments["chat"].retry_at = 0.0
            ctl_.sync(10.0)
            assert ctl_.desired("node-1")[1] == ()  # placed; its node is told once its row is committed
            await ctl_.committed()
            await reps.follow("ready")
            assert len(reps.engines) == 1 and (await chat(rt, "chat"))[0] == 200

            # to 0: drained and gone; requests get 503 model_unavailable
            status, d = await admin(rt, "POST", "/admin/v1/deployments/chat/scale", {"replicas": 0})
            assert status == 200
            await wait_for(lambda: ctl_.desired("node-1")[1] == (), what="scaled to 0")
            assert not [e for e in rt.registry.endpoints if e.startswith("chat-")]
            status, body = await chat(rt, "chat")
            assert status == 503 and body["error"]["code"] == "model_unavailable", body
            # (wanted by nobody now: not what /ready waits for)
            assert "chat" not in (await admin(rt, "GET", "/ready"))[1]["models_unavailable"]
            assert "chat" in await listed(rt)  # (scaled to 0: still deployed)
            # undeployed: the model is gone (404)
            assert (await admin(rt, "DELETE", "/admin/v1/deployments/chat"))[0] == 200
            status, body = await chat(rt, "chat")
            assert status == 404, body
            assert "chat" not in await listed(rt)
            keys = {x.api_key for x in specs2}
        finally:
            await reps.close()
    text = caplog.text
    assert not any(k in text for k in keys), "a replica's API key reached the log"


async def test_unplaceable_deployments_explain_and_ctl_commands(tmp_path: Path) -> None:
    port = free_port()
    async with control_runtime(port, heartbeat_interval="10s", heartbeat_grace="60s",
                               database=f"sqlite:///{tmp_path}/cp.sqlite3") as rt:
        url = f"http://127.0.0.1:{rt.admin_addr[1]}"  # type: ignore[index]
        await register(port, "gpu-node-3", {"hostname": "h3", "gpus": h100s(2, "c")})
        res = await invoke("--admin", url, "deployments")
        assert res.exit_code == 0 and "no deployments" in res.output
        res = await invoke("--admin", url, "deploy", "big", "--model", "llama-70b", "--gpus", "4", "--gpu-memory",
                           "40GiB", "--env", "HF_TOKEN=hf-secret-xyz")
        assert res.exit_code == 0, res.output
        assert "big: deployed: 0 of 1 replica(s) placed" in res.output
        assert "needs 4 GPUs with 40.0 GiB free each; the largest free set is 2 on gpu-node-3" in res.output
        # a client is told the kind of reason (the nodes and GPUs are the operator's, in ctl deployments)
        status, body = await chat(rt, "big")
        assert status == 503 and body["error"]["code"] == "model_unavailable", body
        assert "no replica of its deployment can be placed now" in body["error"]["message"], body
        assert "gpu-node-3" not in body["error"]["message"]
        res = await invoke("--admin", url, "deploy", "cpu", "--model", "/models/tiny.gguf", "--engine", "llamacpp",
                           "--replicas", "2", "--label", "pool=cpu")
        assert res.exit_code == 0, res.output
        assert "needs a node; no node is eligible; gpu-node-3 lacks label pool=cpu" in res.output
        st = control_plane(rt).nodes.get("gpu-node-3")
        st.labels["pool"] = "cpu"  # (as the agent's labels: would say at registration)
        controller(rt).sync(10.0)
        assert [r.deployment for r in controller(rt).replicas.values()] == ["cpu", "cpu"]  # one CPU node: both there
        st.labels.clear()
        res = await invoke("--admin", url, "deploy", "big", "--model", "x")
        assert res.exit_code == 1 and "deployment 'big' exists" in res.output
        res = await invoke("--admin", url, "deploy", "bad", "--model", "x", "--engine", "nope")
        assert res.exit_code == 1 and "engine: unknown engine 'nope'" in res.output
        res = await invoke("--admin", url, "deployments")
        assert res.exit_code == 0, res.output
        lines = res.output.splitlines()
        assert lines[0].split()[:5] == ["DEPLOYMENT", "MODEL", "ENGINE", "READY", "DESIRED"]
        big = next(line for line in lines if line.startswith("big "))
        assert big.split()[1:7] == ["llama-70b", "vllm", "0", "1", "api", "–"], big
        assert "the largest free set is 2 on gpu-node-3" in res.output
        res = await invoke("--admin", url, "deployments", "--json")
        data = {d["name"]: d for d in json.loads(res.stdout)["deployments"]}
        assert data["cpu"]["spec"]["gpus"] == 0 and data["cpu"]["desired"] == 2  # llama.cpp: CPU by default
        assert data["big"]["spec"]["env"] == ["HF_TOKEN"] and "hf-secret-xyz" not in res.stdout
        # the same placed: 2 GPUs of 40 GiB; secrets only when asked
        res = await invoke("--admin", url, "deploy", "fits", "--model", "llama-8b", "--gpus", "2",
                           "--gpu-memory", "40GiB", "--gpu-model", "H100")
        assert "fits: deployed: 1 of 1 replica(s) placed on gpu-node-3" in res.output, res.output
        res = await invoke("--admin", url, "deployments")
        assert "API KEY" not in res.output
        row = next(line for line in res.output.splitlines() if line.startswith("fits-"))
        assert row.split()[1:5] == ["fits", "gpu-node-3", "pending", "–"], row  # no port reported yet: –
        key = next(x for x in controller(rt).desired("gpu-node-3")[1] if x.deployment == "fits").api_key
        assert key not in res.output
        res = await invoke("--admin", url, "deployments", "--show-secrets")
        assert "API KEY" in res.output and key in res.output
        res = await invoke("--admin", url, "scale", "big", "0")
        assert res.exit_code == 0 and "big: scaled to 0: 0 of 0 replica(s) placed" in res.output
        status, body = await chat(rt, "big")
        assert status == 503 and "its deployment is scaled to 0" in body["error"]["message"], body
        res = await invoke("--admin", url, "scale", "nope", "1")
        assert res.exit_code == 1 and "no deployment 'nope'" in res.output
        res = await invoke("--admin", url, "undeploy", "fits")
        assert res.exit_code == 0 and "fits: undeployed; 1 replica(s) draining" in res.output
        # (never reported ready: nothing to drain, it leaves the node's set at once)
        assert [x.deployment for x in controller(rt).desired("gpu-node-3")[1]] == ["cpu", "cpu"]
        status, body = await admin(rt, "POST", "/admin/v1/deployments/big/scale", {"replicas": -1})
        assert status == 400 and body["error"]["code"] == "invalid_replicas"
        status, body = await admin(rt, "POST", "/admin/v1/deployments", {"name": "x", "model": "m", "gpu": 1})
        assert status == 400 and body["error"]["param"] == "gpu" and "did you mean 'gpus'" in body["error"]["message"]
        status, body = await admin(rt, "PATCH", "/admin/v1/deployments/big")
        assert status == 405 and "GET, PUT or DELETE" in body["error"]["message"]


async def test_a_deployment_made_with_ctl_deploy_is_updated_in_place(tmp_path: Path) -> None:
    """``ctl deploy --update`` (PUT): a new form is a rolling update (the old replicas marked outdated, new
    ones placed beside them), a new count alone scales; an unknown name is 404, a config entry 409, a body
    naming another deployment 400."""
    port = free_port()
    cfg = load({"listen": "127.0.0.1:0", "admin": "127.0.0.1:0",
                "control": {"listen": f"127.0.0.1:{port}", "join_token": TOKEN, "heartbeat_interval": "10s",
                            "heartbeat_grace": "60s", "database": f"sqlite:///{tmp_path}/cp.sqlite3"},
                "deployments": [{"name": "filed", "model": "/models/f.gguf", "engine": "llamacpp"}]})
    rt = GatewayRuntime(cfg, components=components_for(cfg))
    await rt.start()
    try:
        url = f"http://127.0.0.1:{rt.admin_addr[1]}"  # type: ignore[index]
        await register(port, "gpu-node-1", {"hostname": "h1", "gpus": h100s(4, "a")})
        res = await invoke("--admin", url, "deploy", "chat", "--model", "llama-8b", "--gpu-memory", "20GiB")
        assert res.exit_code == 0, res.output
        ctl_ = controller(rt)
        first = {r.id for r in ctl_.replicas.values() if r.deployment == "chat"}
        assert len(first) == 1
        await ctl_.committed()
        ctl_.report("gpu-node-1", "127.0.0.1", [ReplicaStatus(rid, "ready", port=free_port(), pid=1) for rid in first])
        ctl_.sync(10.0)
        assert ctl_.view("chat")["ready"] == 1
        # a ready timeout alone: the same replica, its node told the new timeout (no rolling update)
        gen, specs = ctl_.desired("gpu-node-1")
        assert [x.ready_timeout for x in specs if x.deployment == "chat"] == [None]
        res = await invoke("--admin", url, "deploy", "chat", "--model", "llama-8b", "--gpu-memory", "20GiB",
                           "--ready-timeout", "2h", "--update")
        assert res.exit_code == 0, res.output
        d = ctl_.view("chat")
        assert d["outdated"] == 0 and d["ready"] == 1 and {r["id"] for r in d["replicas"]} == first, d
        gen2, specs = ctl_.desired("gpu-node-1")
        assert gen2 > gen
        assert [(x.id, x.ready_timeout) for x in specs if x.deployment == "chat"] == [(next(iter(first)), 7200.0)]
        # kept in the replica's row: a control plane that loads it hands the node the same spec
        await ctl_.committed()
        await ctl_.store.load()  # type: ignore[attr-defined]
        [row] = [r for r in ctl_.store.replicas() if r.deployment == "chat"]
        assert row.spec["form"]["ready_timeout_seconds"] == 7200.0, row.spec
        res = await invoke("--admin", url, "deploy", "chat", "--model", "llama-8b", "--ready-timeout", "0s",
                           "--update")
        assert res.exit_code == 1 and "ready_timeout" in res.output and "at least" in res.output, res.output
        res = await invoke("--admin", url, "deploy", "chat", "--model", "llama-8b", "--gpu-memory", "20GiB",
                           "--arg=--enforce-eager", "--update")
        assert res.exit_code == 0 and "chat: updated: 1 of 1 replica(s) placed" in res.output, res.output
        d = ctl_.view("chat")
        assert d["outdated"] == 1 and d["spec"]["args"] == ["--enforce-eager"], d
        assert {r["id"] for r in d["replicas"] if r["outdated"]} == first  # the old one serves on meanwhile
        # a count alone: the same form, scaled
        status, body = await admin(rt, "PUT", "/admin/v1/deployments/chat",
                                   {"model": "llama-8b", "gpu_memory": "20GiB", "args": ["--enforce-eager"],
                                    "replicas": 2})
        assert status == 200 and body["desired"] == 2 and body["outdated"] == 1, body
        status, body = await admin(rt, "PUT", "/admin/v1/deployments/nope", {"model": "m"})
        assert status == 404, body
        status, body = await admin(rt, "PUT", "/admin/v1/deployments/filed", {"model": "/models/g.gguf",
                                                                             "engine": "llamacpp"})
        assert status == 409 and body["error"]["code"] == "deployment_in_config", body
        status, body = await admin(rt, "PUT", "/admin/v1/deployments/chat", {"name": "other", "model": "m"})
        assert status == 400 and body["error"]["code"] == "name_mismatch", body
        res = await invoke("--admin", url, "deploy", "nope", "--model", "m", "--update")
        assert res.exit_code == 1 and "no deployment 'nope'" in res.output, res.output
    finally:
        await rt.stop()


async def test_a_control_plane_starting_answers_models_503_not_404(monkeypatch: pytest.MonkeyPatch) -> None:
    """The client listener is bound before the control plane has loaded its deployments: a model asked
    for meanwhile may be one of them (a restart: clients are mid-conversation), so it is 503 and
    retried, not 404 (which SDKs do not retry); once loaded, a model nobody serves is 404 again."""
    from llmgw.control.service import ControlPlane

    started = ControlPlane.start
    gate = asyncio.Event()

    async def slow_start(self: Any) -> None:
        await gate.wait()
        await started(self)

    monkeypatch.setattr(ControlPlane, "start", slow_start)
    port = free_port()
    cfg = control_config(port)
    rt = GatewayRuntime(cfg, components=components_for(cfg))
    starting = asyncio.ensure_future(rt.start())
    try:
        await wait_for(lambda: rt.listen_addr is not None, what="the client listener")
        status, body = await chat(rt, "chat")
        assert status == 503 and body["error"]["code"] == "model_unavailable", body
        assert "starting" in body["error"]["message"]
        gate.set()
        await starting
        status, body = await chat(rt, "nope")
        assert status == 404 and body["error"]["code"] == "model_not_found", body
    finally:
        gate.set()
        with contextlib.suppress(Exception):
            await starting
        await rt.stop()


async def test_the_log_of_a_replica_on_a_silent_node_says_where_it_is(tmp_path: Path) -> None:
    """ctl logs of a replica placed on a node past its grace: its node named, and why it cannot be
    asked (it said "no node reports a replica", while ctl deployments listed it there)."""
    port = free_port()
    async with control_runtime(port, heartbeat_interval="0.2s", heartbeat_grace="0.6s",
                               database=f"sqlite:///{tmp_path}/cp.sqlite3") as rt:
        await register(port, "node-1", {"hostname": "h1", "gpus": h100s(1)})
        status, d = await admin(rt, "POST", "/admin/v1/deployments", {"name": "chat", "model": "w", "gpu_memory": "1GiB"})
        assert status == 201, d
        (spec,) = controller(rt).desired("node-1")[1]

        async def silent() -> bool:
            status, body = await api(rt, "GET", "/admin/v1/nodes")
            return status == 200 and body["nodes"][0]["state"] == "unhealthy"

        await wait_for(silent, what="node-1 past its grace")
        status, body = await api(rt, "GET", f"/admin/v1/replicas/{spec.id}/logs")
        err = body["error"]
        assert status == 502 and err["code"] == "node_unavailable", body
        assert "placed on node node-1, which has been silent for" in err["message"]
        status, body = await api(rt, "GET", "/admin/v1/replicas/nope/logs")
        assert status == 404 and body["error"]["code"] == "replica_not_found"


async def test_two_deployments_of_one_served_name_are_warned_of(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    async with control_runtime(port, database=f"sqlite:///{tmp_path}/cp.sqlite3") as rt:
        for name in ("chat", "chat-llama"):
            status, d = await admin(rt, "POST", "/admin/v1/deployments",
                                    {"name": name, "model": "w", "gpu_memory": "1GiB", "served_name": "chat"})
            assert status == 201, d
        await wait_for(lambda: any("deployments chat, chat-llama all serve model 'chat'" in r.getMessage()
                                   for r in caplog.records), what="the warning")


async def test_no_control_plane_no_deployments() -> None:
    rt = GatewayRuntime(load({"listen": "127.0.0.1:0", "admin": "127.0.0.1:0"}))
    await rt.start()
    try:
        status, body = await admin(rt, "GET", "/admin/v1/deployments")
        assert status == 404 and body["error"]["code"] == "no_control_plane"
    finally:
        await rt.stop()


async def test_a_llamacpp_model_that_is_neither_in_the_mirror_nor_a_path_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """llama-server is given a file: a mistyped mirror reference would crash-loop every replica."""
    monkeypatch.setenv("LLMGW_MIRROR", str(tmp_path / "empty-mirror"))  # (never the user's own)
    port = free_port()
    async with control_runtime(port, database=f"sqlite:///{tmp_path}/cp.sqlite3") as rt:
        url = f"http://127.0.0.1:{rt.admin_addr[1]}"  # type: ignore[index]
        res = await invoke("--admin", url, "deploy", "ghost", "--model", "nosuch:1b", "--engine", "llamacpp")
        assert res.exit_code == 1, res.output
        assert "model 'nosuch:1b' is not in the control plane's mirror" in res.output
        assert "ghost" not in controller(rt).deployments
        res = await invoke("--admin", url, "deploy", "file", "--model", "/models/tiny.gguf", "--engine", "llamacpp")
        assert res.exit_code == 0, res.output  # a path on the nodes: theirs to have
        res = await invoke("--admin", url, "deploy", "hf", "--model", "meta-llama/Llama-3.1-8B")
        assert res.exit_code == 0, res.output  # vLLM downloads what it is named


async def test_reload_says_which_deployments_changed(tmp_path: Path) -> None:
    """``ctl reload`` of a file whose deployments changed says so (it said "no endpoint changes")."""
    import yaml

    from llmgw.config import load_file
    from llmgw.runtime import components_for

    port = free_port()
    conf = tmp_path / "llmgw.yaml"

    def write(deployments: list[dict[str, Any]]) -> None:
        conf.write_text(yaml.safe_dump({
            "listen": "127.0.0.1:0", "admin": "127.0.0.1:0",
            "control": {"listen": f"127.0.0.1:{port}", "join_token": TOKEN, "heartbeat_interval": "10s",
                        "heartbeat_grace": "60s", "database": f"sqlite:///{tmp_path}/cp.sqlite3"},
            "deployments": deployments,
        }))

    chat = {"name": "chat", "model": "sim-weights", "gpu_memory": "10GiB", "replicas": 2}
    write([chat, {"name": "old", "model": "sim-weights", "gpu_memory": "10GiB", "replicas": 0}])
    cfg = load_file(conf, serve=True)
    rt = GatewayRuntime(cfg, components=components_for(cfg))
    await rt.start()
    try:
        url = f"http://127.0.0.1:{rt.admin_addr[1]}"  # type: ignore[index]
        await register(port, "node-1", {"hostname": "h1", "gpus": h100s(2)})
        ctl_ = controller(rt)
        ctl_.sync(10.0)
        await wait_for(lambda: ctl_.view("chat")["placed"] == 2, what="both placed")
        write([{**chat, "replicas": 1}, {"name": "new", "model": "sim-weights", "gpu_memory": "10GiB", "replicas": 0}])
        res = await invoke("--admin", url, "reload")
        assert res.exit_code == 0, res.output
        assert res.output == ("configuration reloaded: added deployment new; removed deployment old; "
                              "changed deployment chat (replicas 2 → 1)\n")
        res = await invoke("--admin", url, "reload", "--json")
        assert json.loads(res.stdout)["deployments"] == {"added": [], "removed": [], "changed": [], "replicas": {}}
        res = await invoke("--admin", url, "reload")
        assert res.output == "configuration reloaded: nothing changed\n"
        await wait_for(lambda: ctl_.view("chat")["placed"] == 1 and "old" not in ctl_.deployments,
                       what="the reload applied")
    finally:
        await rt.stop()


async def test_a_deployment_not_ready_keeps_the_control_plane_ready_as_one(tmp_path: Path) -> None:
    """/ready asks every model a deployment wants of the data path (503 while none is ready);
    /ready?role=control asks only whether this process is the control plane to talk to (the
    Kubernetes Service of the management API probes that), so a deployment still loading, or
    broken, does not take the management API away."""
    port = free_port()
    async with control_runtime(port, database=f"sqlite:///{tmp_path}/cp.sqlite3") as rt:
        status, d = await admin(rt, "POST", "/admin/v1/deployments", {"name": "waits", "model": "m", "replicas": 1})
        assert status == 201, d
        status, body = await api(rt, "GET", "/ready")
        assert status == 503 and "waits" in body["models_unavailable"], body
        status, body = await api(rt, "GET", "/ready?role=control")
        assert (status, body) == (200, {"ready": True, "role": "leader"})
        # a probe's typo is an error, not plain /ready's answer taken for the control plane's
        status, body = await api(rt, "GET", "/ready?role=contrl")
        assert status == 400 and body["error"]["param"] == "role" and "contrl" in body["error"]["message"], body


def test_a_ready_timeout_alone_in_the_file_does_not_end_a_scale() -> None:
    """A config deployment scaled with ``ctl scale`` keeps its scale until its entry changes in the file; a new
    ready timeout changes nothing its replicas run (review: it ended the scale, draining replicas)."""
    import dataclasses

    from llmgw.control.deployments import _entry_key

    cfg = load({"control": {"listen": "127.0.0.1:7070", "join_token": TOKEN},
                "deployments": [{"name": "d", "model": "/m/x.gguf", "engine": "llamacpp"}]}).deployments[0]
    assert _entry_key(dataclasses.replace(cfg, ready_timeout=7200.0)) == _entry_key(cfg)
    assert _entry_key(dataclasses.replace(cfg, replicas=3)) != _entry_key(cfg)
    assert _entry_key(dataclasses.replace(cfg, args=("--x",))) != _entry_key(cfg)
