"""SIGTERM to an agent that runs replicas drains its node first (protocol 1.3).

One gateway + control plane in this process, two real ``llmgw agent`` processes
(stand-in GPUs, the vLLM stand-in engine generating 8 tokens a second), one
deployment of one replica. A client streams a 60-token answer from it (7.5 s); the agent
of the replica's node gets SIGTERM a moment into the stream:

* the stream ends as the engine ends it (every token, ``finish_reason``, ``[DONE]``):
  the node's replica is drained (no new request), not cut;
* meanwhile the node is ``leaving`` (``/admin/v1/nodes``), no replica is placed
  there, and the replica is placed again on the other node, which serves;
* once drained the agent stops the engine, deregisters and exits 0, well within
  its ``drain_timeout``.

And a second SIGTERM while draining (the other agent, at the end) stops the engine at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from cp_helpers import TOKEN, control_plane, free_port, wait_for

from llmgw.config import load
from llmgw.runtime import GatewayRuntime, components_for
from llmgw.testing import standins

pytestmark = pytest.mark.timeout(120)

TOKENS = 60
TPS = 8.0  # (60 tokens: 7.5 s, longer than the stand-in engine's own 5 s grace when it is stopped)


class Agent:
    def __init__(self, tmp: Path, name: str, port: int, env: dict[str, str], *extra: str) -> None:
        self.name, self.log = name, tmp / f"{name}.log"
        with open(self.log, "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "llmgw", "agent", "--control", f"127.0.0.1:{port}", "--token-env", "JOIN",
                 "--name", name, "--gpu-source", "simulated", "--state-dir", str(tmp / name), *extra],
                env={**os.environ, **env, "JOIN": TOKEN}, stdout=subprocess.DEVNULL, stderr=err,
            )

    async def exited(self, timeout: float) -> int:
        await wait_for(lambda: self.proc.poll() is not None, timeout, f"agent {self.name} to exit")
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def text(self) -> str:
        return self.log.read_text(errors="replace")


async def request(port: int, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = b"" if body is None else orjson.dumps(body)
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        w.write(f"{method} {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\n"
                f"content-length: {len(data)}\r\n\r\n".encode() + data)
        raw = await asyncio.wait_for(r.read(), 15)
    finally:
        w.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), payload


def _cluster(tmp_path: Path, tps: float) -> tuple[dict[str, str], int, Any]:
    """The agents' environment (the stand-in engines first, generating ``tps`` tokens a second), the
    control port, and a gateway + control plane config on an SQLite database."""
    bin_dir = standins.install(tmp_path / "bin")
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join(p for p in (str(standins.PYTHONPATH), os.environ.get("PYTHONPATH", "")) if p),
           "LLMGW_STANDIN_TOKENS_PER_SECOND": str(tps)}
    cp_port = free_port()
    cfg = load({
        "listen": "127.0.0.1:0", "admin": "127.0.0.1:0",
        "control": {"listen": f"127.0.0.1:{cp_port}", "join_token": TOKEN, "heartbeat_interval": "0.5s",
                    "heartbeat_grace": "3s", "database": f"sqlite:///{tmp_path}/cp.sqlite3"},
    })
    return env, cp_port, cfg


def chat(max_tokens: int, stream: bool) -> bytes:
    return orjson.dumps({"model": "chat", "messages": [{"role": "user", "content": "hi"}],
                         "max_tokens": max_tokens, "stream": stream})


async def test_sigterm_drains_the_node_before_the_agent_stops(tmp_path: Path) -> None:
    env, cp_port, cfg = _cluster(tmp_path, TPS)
    rt = GatewayRuntime(cfg, components=components_for(cfg))
    await rt.start()
    assert rt.admin_addr is not None and rt.listen_addr is not None
    admin, gw = rt.admin_addr[1], rt.listen_addr[1]
    agents = {n: Agent(tmp_path, n, cp_port, env) for n in ("node-a", "node-b")}
    try:
        cp = control_plane(rt)
        await wait_for(lambda: all(cp.nodes.get(n) is not None and cp.nodes.get(n).heartbeats > 0 for n in agents), 30,
                    "both agents registered")
        status, body = await request(admin, "POST", "/admin/v1/deployments",
                                     {"name": "chat", "replicas": 1, "model": "stand-in/chat", "engine": "vllm",
                                      "gpu_memory": "1GiB"})
        assert status in (200, 201), body

        async def served() -> bool:
            return (await request(gw, "POST", "/v1/chat/completions", orjson.loads(chat(2, False))))[0] == 200

        await wait_for(served, 60, "the replica's first answer")
        status, body = await request(admin, "GET", "/admin/v1/deployments/chat")
        first = orjson.loads(body)
        nodes = {r["node"] for r in first["replicas"]}
        assert len(nodes) == 1, first
        home = nodes.pop()
        other = "node-b" if home == "node-a" else "node-a"

        # a stream of TOKENS tokens at TPS a second, read as it comes
        r, w = await asyncio.open_connection("127.0.0.1", gw)
        body_ = chat(TOKENS, True)
        w.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
                b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body_), body_))
        head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 15)
        assert head.startswith(b"HTTP/1.1 200"), head
        got = await asyncio.wait_for(r.read(1), 15)
        t_term = time.monotonic()
        agents[home].proc.send_signal(signal.SIGTERM)

        async def leaving() -> bool:
            status, raw = await request(admin, "GET", f"/admin/v1/nodes/{home}")
            return status == 200 and orjson.loads(raw).get("leaving") is True

        await wait_for(leaving, 5, f"{home} leaving")
        rest = await asyncio.wait_for(r.read(), 30)
        w.close()
        text = (got + rest).decode()
        assert '"error"' not in text, text[-500:]
        assert text.count('"content":') >= TOKENS and '"finish_reason":"length"' in text.replace(" ", ""), text[-500:]
        assert "data: [DONE]" in text, text[-300:]

        # placed again elsewhere, and served from there
        async def moved() -> bool:
            status, raw = await request(admin, "GET", "/admin/v1/deployments/chat")
            reps = orjson.loads(raw)["replicas"] if status == 200 else []
            return any(x["node"] == other and x.get("state") == "ready" for x in reps) and await served()

        await wait_for(moved, 60, f"the replica placed again on {other} and serving")

        assert await agents[home].exited(30) == 0
        took = time.monotonic() - t_term
        assert took < 25, f"the drain took {took:.1f}s"
        log = agents[home].text()
        assert "draining 1 replica(s) off this node first" in log and "drained: no replica runs" in log, log[-2000:]
        assert "deregistered" in log, log[-2000:]
        await wait_for(lambda: cp.nodes.get(home) is None, 10, f"{home} deregistered")

        # the other node: a second SIGTERM while draining stops the engine at once (its stream is cut)
        r, w = await asyncio.open_connection("127.0.0.1", gw)
        w.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
                b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body_), body_))
        head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 15)
        assert head.startswith(b"HTTP/1.1 200"), head
        await asyncio.wait_for(r.read(1), 15)
        agents[other].proc.send_signal(signal.SIGTERM)
        await wait_for(lambda: "draining 1 replica(s)" in agents[other].text(), 10, f"{other} draining")
        t_again = time.monotonic()
        agents[other].proc.send_signal(signal.SIGTERM)
        assert await agents[other].exited(20) == 0
        assert time.monotonic() - t_again < 10
        assert "stopped again while draining" in agents[other].text(), agents[other].text()[-2000:]
        cut = (await asyncio.wait_for(r.read(), 30)).decode()
        w.close()
        assert cut.count('"content":') < TOKENS, "the stream was cut, not drained"
    finally:
        for a in agents.values():
            a.kill()
        for rec in tmp_path.glob("node-*/replicas/*.json"):  # (a failed run's engines: not left behind)
            with contextlib.suppress(OSError, ValueError, KeyError):
                os.kill(int(orjson.loads(rec.read_bytes())["pid"]), signal.SIGKILL)
        await rt.stop()


async def test_a_drain_goes_on_across_a_control_plane_restart(tmp_path: Path) -> None:
    """SIGTERM while the control plane is away (stopped, or handing over): the agent does not give the
    drain up at the first refused beat; it calls again until the control plane is back (within its
    drain_timeout), which then drains the node: the replica is placed on the other node, and the agent
    exits 0 once its engine is stopped, saying it drained."""
    env, cp_port, cfg = _cluster(tmp_path, 500.0)
    rt = GatewayRuntime(cfg, components=components_for(cfg))
    await rt.start()
    agents = {n: Agent(tmp_path, n, cp_port, env) for n in ("node-a", "node-b")}
    try:
        cp = control_plane(rt)
        await wait_for(lambda: all(cp.nodes.get(n) is not None and cp.nodes.get(n).heartbeats > 0 for n in agents), 30,
                    "both agents registered")
        assert rt.admin_addr is not None
        status, body = await request(rt.admin_addr[1], "POST", "/admin/v1/deployments",
                                     {"name": "chat", "replicas": 1, "model": "stand-in/chat", "engine": "vllm",
                                      "gpu_memory": "1GiB"})
        assert status in (200, 201), body
        ctl_ = cp.deployments
        await wait_for(lambda: ctl_.view("chat")["ready"] == 1, 60, "the replica ready")
        (home,) = ctl_.view("chat")["nodes"]
        other = "node-b" if home == "node-a" else "node-a"
        await rt.stop()  # the control plane away...
        agents[home].proc.send_signal(signal.SIGTERM)  # ...when its agent is stopped
        await wait_for(lambda: "draining 1 replica(s)" in agents[home].text(), 10, f"{home} draining")
        await asyncio.sleep(1.0)
        assert agents[home].proc.poll() is None, agents[home].text()[-2000:]  # (not given up)
        rt = GatewayRuntime(cfg, components=components_for(cfg))  # ...and back
        await rt.start()
        cp = control_plane(rt)
        ctl_ = cp.deployments
        assert await agents[home].exited(30) == 0
        log = agents[home].text()
        assert "drained: no replica runs" in log and "deregistered" in log, log[-2000:]
        await wait_for(lambda: ctl_.view("chat")["ready"] == 1 and ctl_.view("chat")["nodes"] == [other], 60,
                    f"the replica placed again on {other} and ready")
    finally:
        for a in agents.values():
            a.kill()
        for rec in tmp_path.glob("node-*/replicas/*.json"):
            with contextlib.suppress(OSError, ValueError, KeyError):
                os.kill(int(orjson.loads(rec.read_bytes())["pid"]), signal.SIGKILL)
        await rt.stop()
