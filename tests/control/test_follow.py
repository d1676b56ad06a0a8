"""Routers that follow a control plane they do not host (``follow:``; docs/follow.md), end to end.

Real processes: ``llmgw serve`` with ``control:`` (a deployment of the stand-in vLLM), ``llmgw agent``
(simulated GPUs, the stand-in engine), and a router (``llmgw serve`` with ``follow:``, in this process so
its registry can be read). The router starts before any control plane is up (not ready, no table); it
gets the table and routes with the replica's key; the control plane killed with SIGKILL, it keeps
routing; the control plane back, it catches up and follows a scale to 2. A wrong router token is
refused and logged without the token.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import grpc
import orjson
import pytest
from cp_helpers import TOKEN, free_port, parse, pick, wait_for

from canary import check_text, secret
from llmgw._proto.router.v1 import router_pb2 as rpb
from llmgw._proto.router.v1 import router_pb2_grpc
from llmgw.config import load
from llmgw.errors import ConfigError
from llmgw.runtime import GatewayRuntime, components_for
from llmgw.testing import standins

pytestmark = pytest.mark.timeout(120)

ROUTER_TOKEN = secret("router-token-9c1e")


async def _http(port: int, method: str, path: str, body: Any = None, timeout: float = 10.0) -> tuple[int, bytes]:
    status, _, payload = await _http3(port, method, path, body, timeout)
    return status, payload


async def _http3(port: int, method: str, path: str, body: Any = None, timeout: float = 10.0
                 ) -> tuple[int, bytes, bytes]:
    data = b"" if body is None else orjson.dumps(body)
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        w.write(f"{method} {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\n"
                f"content-length: {len(data)}\r\n\r\n".encode() + data)
        raw = await asyncio.wait_for(r.read(), timeout)
    finally:
        w.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        out, rest = b"", payload
        while rest:
            size_s, _, rest = rest.partition(b"\r\n")
            size = int(size_s, 16)
            if size == 0:
                break
            out, rest = out + rest[:size], rest[size + 2:]
        payload = out
    return int(head.split(b" ", 2)[1]), head.lower(), payload


async def _chat(rt: GatewayRuntime) -> int:
    assert rt.listen_addr is not None
    status, _ = await _http(rt.listen_addr[1], "POST", "/v1/chat/completions",
                            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    return status


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                out.append(int(d.name))
    return out


class Proc:
    def __init__(self, args: list[str], log: Path, env: dict[str, str]) -> None:
        self.args, self.log, self.env = args, log, env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        with open(self.log, "ab") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "llmgw", *self.args], env={**os.environ, **self.env},
                                         stdout=subprocess.DEVNULL, stderr=err)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    async def term(self, timeout: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        await wait_for(lambda: self.proc.poll() is not None, timeout, f"{self.args[0]} to exit")  # type: ignore[union-attr]

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def _tiny(rt: GatewayRuntime) -> list[Any]:
    assert rt.registry is not None
    return [ep for ep in rt.registry.endpoints.values() if ep.cfg.deployment == "tiny" and not ep.draining]


async def test_router_follows_survives_and_catches_up(tmp_path: Path) -> None:
    cp_grpc, cp_listen, cp_admin = free_port(), free_port(), free_port()
    cp_cfg = tmp_path / "cp.yaml"
    cp_cfg.write_text(
        f"listen: 127.0.0.1:{cp_listen}\nadmin: 127.0.0.1:{cp_admin}\n"
        f"control:\n  listen: 127.0.0.1:{cp_grpc}\n  join_token_env: JOIN\n  router_token_env: ROUTER\n"
        f"  heartbeat_interval: 0.5s\n  heartbeat_grace: 3s\n  database: sqlite:///{tmp_path}/cp.sqlite3\n"
        "deployments:\n  - {name: tiny, model: org/tiny, engine: vllm, gpus: 1, gpu_memory: 1GiB, replicas: 1}\n"
    )
    bin_dir = standins.install(tmp_path / "bin")
    agent_cfg = tmp_path / "agent.yaml"
    ports = free_port()
    ports = range(ports, min(ports + 50, 32768))  # (the replicas listen in the agent's replica_ports only)
    agent_cfg.write_text(
        f"control: 127.0.0.1:{cp_grpc}\ntoken_env: JOIN\nname: node-f\ngpu_source: simulated\nadvertise: 127.0.0.1\n"
        f"state_dir: {tmp_path}/agent-state\nengines:\n  vllm:\n    binary: {bin_dir / 'vllm'}\n"
        f"replica_ports: {ports[0]}-{ports[-1]}\n"
    )
    env = {"JOIN": TOKEN, "ROUTER": ROUTER_TOKEN, "LLMGW_MIRROR": str(tmp_path / "mirror"), "PYTHONUNBUFFERED": "1"}
    cp = Proc(["serve", "-c", str(cp_cfg)], tmp_path / "cp.log", env)
    agent = Proc(["agent", "--config", str(agent_cfg)], tmp_path / "agent.log", env)
    rcfg = load({"listen": "127.0.0.1:0", "admin": "127.0.0.1:0",
                 "follow": {"control": [f"127.0.0.1:{free_port()}", f"127.0.0.1:{cp_grpc}"], "token": ROUTER_TOKEN,
                            "name": "router-1"}})
    rt = GatewayRuntime(rcfg, components=components_for(rcfg))
    await rt.start()
    follower: Any = rt.components[0]
    try:
        assert rt.admin_addr is not None
        admin = rt.admin_addr[1]
        # -- no control plane yet: running, not ready, no table --
        status, body = await _http(admin, "GET", "/ready")
        assert status == 503 and orjson.loads(body)["reason"] == "no_replica_table", body
        # a model it may yet learn of: 503 with Retry-After (SDKs retry it), not 404 (they do not)
        assert rt.listen_addr is not None
        status, body = await _http(rt.listen_addr[1], "POST", "/v1/chat/completions",
                                   {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
        err = orjson.loads(body)["error"]
        assert status == 503 and err["code"] == "model_unavailable" and "no replica table" in err["message"], body

        cp.start()
        agent.start()
        await wait_for(lambda: len(_tiny(rt)) == 1, 60, "the replica in the router's table")
        ep = _tiny(rt)[0]
        assert ep.cfg.api_key and ep.cfg.node == "node-f" and ep.cfg.url.startswith("http://127.0.0.1:")
        await wait_for(lambda: _chat(rt), 20, "a first answer")  # (the stand-in answers 401 without the key)
        assert await _chat(rt) == 200
        status, body = await _http(admin, "GET", "/ready")
        assert status == 200, body
        text = (await _http(admin, "GET", "/metrics"))[1].decode()
        s = parse(text)
        assert pick(s, "llmgw_follow_connected") == [1.0] and pick(s, "llmgw_follow_table_replicas") == [1.0]
        assert "llmgw_node_up" not in text and "llmgw_control_" not in text  # a follower exports no cluster families
        cp_metrics = parse((await _http(cp_admin, "GET", "/metrics"))[1].decode())
        assert pick(cp_metrics, "llmgw_control_followers") == [1.0]

        # -- a wrong router token: UNAUTHENTICATED, logged without the token --
        wrong = secret("wrong-router-token")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cp_grpc}") as ch:
            call = router_pb2_grpc.RouterServiceStub(ch).WatchReplicas(
                rpb.WatchReplicasRequest(router_name="intruder", protocol=rpb.ProtocolVersion(major=1)),
                metadata=[("authorization", f"Bearer {wrong}")], timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await call.read()
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        await wait_for(lambda: "wrong router token" in cp.text(), 5, "the refusal logged")
        assert wrong not in cp.text()

        # -- the control plane killed: the router keeps routing on its last table --
        version = follower.state.version
        cp.kill()
        await wait_for(lambda: not follower.state.connected, 10, "the router to see the control plane gone")
        statuses = [await _chat(rt) for _ in range(20)]
        assert statuses == [200] * 20, statuses
        assert len(_tiny(rt)) == 1 and follower.state.version == version

        # -- back: the router catches up (a new table), and follows a scale to 2 --
        source = follower.state.source
        cp.start()
        await wait_for(lambda: follower.state.connected and follower.state.source != source, 30,
                       "the router following the restarted control plane")
        assert len(_tiny(rt)) == 1, "the restarted control plane's first table keeps the ready replica"
        status, body = await _http(cp_admin, "POST", "/admin/v1/deployments/tiny/scale", {"replicas": 2})
        assert status == 200, body
        await wait_for(lambda: len(_tiny(rt)) == 2, 60, "two replicas in the router")
        assert [await _chat(rt) for _ in range(6)] == [200] * 6
        assert follower.state.connects == 2
        assert all(urlsplit(ep.cfg.url).port in ports for ep in _tiny(rt)), [ep.cfg.url for ep in _tiny(rt)]
        # the join token is not handed down to the engines the agent starts (nor is its variable)
        assert agent.proc is not None
        engines = _children(agent.proc.pid)
        assert len(engines) >= 2
        for pid in engines:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            assert TOKEN.encode() not in environ and b"\0JOIN=" not in b"\0" + environ, pid

        # -- 2 -> 1 with requests in flight through the router: the control plane waits for them --
        assert rt.registry is not None and rt.listen_addr is not None
        done: list[tuple[str, float]] = []

        async def long_request(i: int) -> int:  # (distinct prompts: no prefix affinity puts them on one replica)
            prompt = f"{i} {secrets.token_hex(8)} tell me a long story"
            status, head, _ = await _http3(rt.listen_addr[1], "POST", "/v1/chat/completions",  # type: ignore[index]
                                           {"model": "tiny", "messages": [{"role": "user", "content": prompt}],
                                            "max_tokens": 1200}, timeout=30)  # (~2.5 s at the stand-in's speed)
            replica = head.split(b"x-llmgw-replica: ", 1)[1].split(b"\r\n", 1)[0].decode()
            done.append((replica, time.monotonic()))
            return status

        ids = {ep.id for ep in _tiny(rt)}
        reqs = [asyncio.create_task(long_request(i)) for i in range(4)]
        await wait_for(lambda: all(ep.inflight > 0 for ep in _tiny(rt)), 10, "requests in flight on both")
        status, body = await _http(cp_admin, "POST", "/admin/v1/deployments/tiny/scale", {"replicas": 1})
        assert status == 200, body
        left = await wait_for(lambda: ids - set(rt.registry.endpoints), 30, "the drained replica out")  # type: ignore[union-attr]
        left_at = time.monotonic()
        assert await asyncio.gather(*reqs) == [200] * 4
        gone = left.pop()
        assert any(r == gone for r, _ in done), done
        assert all(t <= left_at for r, t in done if r == gone), "the replica left before its requests finished"

        # -- scaled to 0: the router's 503 says why, in the leader's words (the reason travels in the table) --
        status, body = await _http(cp_admin, "POST", "/admin/v1/deployments/tiny/scale", {"replicas": 0})
        assert status == 200, body
        await wait_for(lambda: not _tiny(rt), 30, "the last replica out of the router")
        msg = ""

        async def said() -> bool:
            nonlocal msg
            status, body = await _http(rt.listen_addr[1], "POST", "/v1/chat/completions",  # type: ignore[index]
                                       {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
            msg = orjson.loads(body)["error"]["message"] if status == 503 else ""
            return "scaled to 0" in msg

        await wait_for(said, 10, "the leader's reason on the router")
        assert "its deployment is scaled to 0" in msg, msg
    finally:
        await rt.stop()
        await agent.term()
        cp.kill()
        for p in (cp, agent):
            check_text(f"{p.args[0]}'s log", p.text())
        assert ROUTER_TOKEN not in cp.text()


def test_follow_config_refusals() -> None:
    with pytest.raises(ConfigError, match="not a loopback address and follow has no TLS"):
        load({"follow": {"control": "cp.example:7070", "token": "t"}})
    assert load({"follow": {"control": "cp.example:7070", "token": "t", "allow_plaintext": True}}).follow
    assert load({"follow": {"control": "cp.example:7070", "token": "t", "tls": True}}).follow.tls  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match="cannot be used together with control"):
        load({"control": {"listen": "127.0.0.1:1", "join_token": "j"},
              "follow": {"control": "127.0.0.1:2", "token": "t"}})
    with pytest.raises(ConfigError, match="needs the router token"):
        load({"follow": {"control": "127.0.0.1:2"}})


def _ep(rid: str) -> Any:
    from llmgw.config import EndpointConfig

    return EndpointConfig(id=rid, url="http://127.0.0.1:9", models=("m",), api_key=secret("replica-key"),
                          host="127.0.0.1", port=9, deployment="d", node="n1", pool="n1")


def test_hub_table_and_drain_reports() -> None:
    from llmgw.control.follow import REPORT_VALID_S, FollowHub
    from llmgw.fleet.follow import endpoint_from_proto

    now = [100.0]
    hub = FollowHub(None, clock=lambda: now[0])
    sent: list[Any] = []
    hub.publish = sent.append
    hub.start()
    hub.add(_ep("r1"))
    hub.add(_ep("r2"))
    hub.hold(frozenset({"m", "z"}), frozenset({"m"}))  # (z: scaled to 0)
    assert [m.table.version for m in sent] == [1, 2, 3, 4]  # (no loop here: each change published at once)
    t = sent[-1].table
    assert [r.id for r in t.replicas] == ["r1", "r2"] and list(t.held_models) == ["m", "z"]
    assert list(t.wanted_models) == ["m"] and dict(t.held_reasons) == {}
    # a held model's reason, and a change of reason alone, reach the routers
    from llmgw.fleet.held import HeldModels

    hub.hold(HeldModels({"m", "z"}, reasons={"z": "its deployment is scaled to 0"}), frozenset({"m"}))
    assert len(sent) == 5 and dict(sent[-1].table.held_reasons) == {"z": "its deployment is scaled to 0"}
    hub.hold(HeldModels({"m", "z"}, reasons={"z": "its deployment's replicas are starting"}), frozenset({"m"}))
    assert len(sent) == 6 and dict(sent[-1].table.held_reasons) == {"z": "its deployment's replicas are starting"}
    back = endpoint_from_proto(t.replicas[0])
    assert back == _ep("r1")  # what the router adds is what the control plane's router got
    hub.set_draining("r2", True)
    assert [r.draining for r in sent[-1].table.replicas] == [False, True]
    # a router's in-flight requests to a draining replica hold the drain; stale reports do not
    hub.report("router-a", {"r2": 3, "r1": 5})  # (r1 is not draining: ignored)
    hub.report("router-b", {"r2": 1})
    assert hub.inflight("r2") == 4 and hub.inflight("r1") == 0 and hub.inflight("nope") is None
    hub.report("router-b", {})
    assert hub.inflight("r2") == 3
    now[0] += REPORT_VALID_S + 0.1
    assert hub.inflight("r2") == 0
    hub.report("router-a", {"r2": 2})
    hub.forget("router-a")  # its stream ended
    assert hub.inflight("r2") == 0
    hub.remove("r2")
    assert [r.id for r in sent[-1].table.replicas] == ["r1"]
    with pytest.raises(KeyError):
        hub.remove("r2")
    with pytest.raises(ValueError):
        hub.add(_ep("r1"))
    with pytest.raises(ValueError, match="URL"):
        endpoint_from_proto(rpb.Replica(id="x", served_name="m", engine="vllm", url="ftp://h:1", metrics_path="/m"))


async def test_a_standby_sends_the_router_to_the_leader(tmp_path: Path) -> None:
    """A standby's UNAVAILABLE with ``llmgw-leader`` (as i21-ha's standbys answer agents) is followed at once."""
    from cp_helpers import control_runtime

    p_standby, p_leader = free_port(), free_port()
    db = {"router_token": ROUTER_TOKEN}
    async with control_runtime(p_standby, database=f"sqlite:///{tmp_path}/a.sqlite3", **db) as standby, \
            control_runtime(p_leader, database=f"sqlite:///{tmp_path}/b.sqlite3", **db) as leader:
        standby.components[0].router_service.standby = lambda: f"127.0.0.1:{p_leader}"
        lead: Any = leader.components[0]
        lead.follow_hub.add(_ep("r1"))  # (as its deployments would: the router's table has it)
        rcfg = load({"listen": "127.0.0.1:0", "admin": "127.0.0.1:0",
                     "follow": {"control": f"127.0.0.1:{p_standby}", "token": ROUTER_TOKEN}})
        rt = GatewayRuntime(rcfg, components=components_for(rcfg))
        await rt.start()
        try:
            follower: Any = rt.components[0]
            await wait_for(lambda: follower.state.connected, 10, "the router following the leader")
            assert follower.state.target == f"127.0.0.1:{p_leader}" and follower.state.source == lead.follow_hub.source
            await wait_for(lambda: rt.registry is not None and "r1" in rt.registry.endpoints, 5, "the leader's table")
            assert standby.components[0].follow_hub.stats.refused.get("standby", 0) >= 1
            # a reload applies a new token (presented on the next call); new addresses need a restart
            same = {"listen": "127.0.0.1:0", "admin": "127.0.0.1:0"}
            got = rt.reload(load({**same, "follow": {"control": f"127.0.0.1:{p_standby}", "token": "rotated"}}))
            assert got["restart_needed_for"] == [] and follower._metadata()[0][1] == "Bearer rotated"
            moved = load({**same, "follow": {"control": f"127.0.0.1:{p_leader}", "token": "rotated-again"}})
            for _ in range(2):  # (and again: the process still follows the old addresses)
                got = rt.reload(moved)
                assert got["restart_needed_for"] == ["follow"]
            assert rt.config.follow is not None and rt.config.follow.control == (("127.0.0.1", p_standby),)
            assert follower._metadata()[0][1] == "Bearer rotated-again"  # (the token applied all the same)
        finally:
            await rt.stop()


@pytest.mark.needs_tool("openssl", install="apt-get install openssl: it makes the certificates")
async def test_router_follows_over_mutual_tls(tmp_path: Path) -> None:
    from cp_helpers import control_runtime
    from test_security import _make_pki

    pki = _make_pki(tmp_path)
    port = free_port()
    async with control_runtime(port, router_token=ROUTER_TOKEN, tls_cert=str(pki["server.pem"]),
                               tls_key=str(pki["server.key"]), tls_client_ca=str(pki["ca.pem"])) as cp_rt:
        cp_rt.components[0].follow_hub.add(_ep("r1"))
        rcfg = load({"listen": "127.0.0.1:0", "admin": "127.0.0.1:0",
                     "follow": {"control": f"localhost:{port}", "token": ROUTER_TOKEN, "tls_ca": str(pki["ca.pem"]),
                                "tls_cert": str(pki["client.pem"]), "tls_key": str(pki["client.key"])}})
        rt = GatewayRuntime(rcfg, components=components_for(rcfg))
        await rt.start()
        try:
            await wait_for(lambda: rt.registry is not None and "r1" in rt.registry.endpoints, 10, "the table over mTLS")
        finally:
            await rt.stop()
        # plaintext to the TLS listener gets nothing
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            call = router_pb2_grpc.RouterServiceStub(ch).WatchReplicas(
                rpb.WatchReplicasRequest(router_name="plain", protocol=rpb.ProtocolVersion(major=1)),
                metadata=[("authorization", f"Bearer {ROUTER_TOKEN}")], timeout=3)
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await call.read()
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_an_operators_drain_reaches_the_routers_that_follow() -> None:
    """ctl drain ID on the control plane's process drains a deployment's replica in its own router
    and in the table its followers route on (it drained only the former)."""
    from cp_helpers import control_plane, control_runtime

    async with control_runtime(free_port()) as rt:
        hub = control_plane(rt).follow_hub
        hub.add(_ep("r9"))  # (as the deployments add a ready replica)
        assert [r.draining for r in hub.table().table.replicas] == [False]
        rt.set_draining("r9", True)  # what POST /admin/v1/endpoints/r9/drain does
        assert rt.registry is not None and rt.registry.endpoints["r9"].draining
        assert [r.draining for r in hub.table().table.replicas] == [True]
        rt.set_draining("r9", False)
        assert [r.draining for r in hub.table().table.replicas] == [False]
