"""Issue 18 end to end: ``llmgw ctl deploy`` of a mirror model -> a real ``llmgw agent`` fetches it from the
control plane's mirror and launches the real ``llama-server`` -> the router serves it to the OpenAI client.

One gateway + control plane in this process, one agent process (its own state dir and mirror store):

* deploy ``tiny:1b`` (a mirror reference the node lacks): fetched, launched, first answer;
* scaled 1 -> 2 -> 1 while a client sends requests without pause: none fails;
* scaled to 0: 503 ``model_unavailable``; back to 1;
* the engine killed with SIGKILL: the agent restarts it and the router takes it back;
* the agent killed with SIGKILL: the engine serves on; the agent started again adopts it (same pid);
* a deployment that cannot be placed says why in ``llmgw ctl deployments``;
* SIGTERM to the agent: it deregisters and its engines stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from click.testing import CliRunner, Result

from canary import check_text, secret
from launch.helpers import gone, wait_gone
from llmgw.cli.ctl import ctl
from llmgw.config import load
from llmgw.mirror import MirrorStore, import_file
from llmgw.runtime import GatewayRuntime, components_for
from ports import free_port as _free

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(180)]

TOKEN = secret("join-e2e")
NAME = "tiny"


async def until(cond: Callable[[], Any], timeout: float, what: str, every: float = 0.05) -> Any:
    """Poll ``cond`` (sync or async) until truthy; bounded."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if asyncio.iscoroutine(v):
            v = await v
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(every)


class Agent:
    """``llmgw agent --config FILE`` as a process."""

    def __init__(self, cfg: Path, log: Path) -> None:
        self.cfg, self.log = cfg, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Agent:
        with open(self.log, "ab") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "llmgw", "agent", "--config", str(self.cfg)],
                                         env={**os.environ, "JOIN": TOKEN}, stdout=subprocess.DEVNULL, stderr=err)
        return self

    async def exited(self, timeout: float) -> int:
        assert self.proc is not None
        await until(lambda: self.proc.poll() is not None, timeout, "the agent to exit")  # type: ignore[union-attr]
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


async def ctl_(admin: str, *args: str) -> Result:
    # (in a thread: the command blocks, and the admin API answers on this loop)
    return await asyncio.to_thread(CliRunner().invoke, ctl, ["--admin", admin, *args], catch_exceptions=False)


def ready_endpoints(rt: GatewayRuntime) -> list[Any]:
    reg = rt.registry
    return [ep for ep in reg.endpoints.values() if ep.cfg.deployment == NAME and not ep.draining]


def replica_pids(state: Path) -> dict[str, int]:
    import json

    out = {}
    for rec in (state / "replicas").glob("*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            out[rec.stem] = int(json.loads(rec.read_text())["pid"])
    return out


async def answered(client: openai.AsyncOpenAI) -> bool:
    try:
        r = await client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=2)
    except openai.APIStatusError as exc:
        if exc.status_code == 503:
            return False
        raise
    return bool(r.choices)


async def test_deploy_scale_fail_adopt_and_explain(llama_server_bin: Path, tiny_model: Path, tmp_path: Path) -> None:
    with MirrorStore(tmp_path / "cp-mirror") as store:
        import_file(store, tiny_model, name="tiny:1b")
    cp_port = _free()
    cfg = load({
        "listen": "127.0.0.1:0", "admin": "127.0.0.1:0", "mirror": {"root": str(tmp_path / "cp-mirror")},
        "control": {"listen": f"127.0.0.1:{cp_port}", "join_token": TOKEN, "heartbeat_interval": "2s",
                    "heartbeat_grace": "10s", "database": f"sqlite:///{tmp_path}/cp.sqlite3"},
    })
    state = tmp_path / "agent-state"
    agent_cfg = tmp_path / "agent.yaml"
    agent_cfg.write_text(
        f"control: 127.0.0.1:{cp_port}\ntoken_env: JOIN\nname: node-e2e\ngpu_source: none\nadvertise: 127.0.0.1\n"
        f"state_dir: {state}\nlabels: {{zone: test}}\nengines:\n  llamacpp:\n    binary: {llama_server_bin}\n"
    )
    log = tmp_path / "agent.log"
    rt = GatewayRuntime(cfg, components=components_for(cfg))
    await rt.start()
    agent = Agent(agent_cfg, log).start()
    assert rt.admin_addr is not None and rt.listen_addr is not None
    admin = f"http://127.0.0.1:{rt.admin_addr[1]}"
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{rt.listen_addr[1]}/v1", api_key="unused",
                                max_retries=0, timeout=30.0)
    try:
        cp = rt.components[0]
        await until(lambda: cp.nodes.get("node-e2e") is not None and cp.nodes.get("node-e2e").heartbeats > 0, 20,
                    "the agent registered")

        # -- deploy: fetched from the mirror, launched, served --
        t0 = time.monotonic()
        res = await ctl_(admin, "deploy", NAME, "--model", "tiny:1b", "--engine", "llamacpp", "--replicas", "1",
                         "--slots", "2", "--context", "1024", "--arg=-t", "--arg=1")
        assert res.exit_code == 0, res.output
        await until(lambda: answered(client), 60, "the first answer")
        first = time.monotonic() - t0
        print(f"\nctl deploy -> first answer: {first:.2f}s")
        assert (state / "mirror").is_dir() and any((state / "mirror").rglob("*")), "fetched into the node's store"

        # -- 1 -> 2 -> 1 under traffic: no request fails --
        failures: list[str] = []
        sent = [0]
        stop = asyncio.Event()

        async def traffic() -> None:
            while not stop.is_set():
                try:
                    r = await client.chat.completions.create(
                        model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
                    assert r.choices
                except Exception as exc:  # every failure counts
                    failures.append(f"{type(exc).__name__}: {exc}")
                sent[0] += 1

        workers = [asyncio.create_task(traffic()) for _ in range(2)]
        try:
            res = await ctl_(admin, "scale", NAME, "2")
            assert res.exit_code == 0, res.output
            await until(lambda: len(ready_endpoints(rt)) == 2, 60, "two replicas in the router")
            before = sent[0]
            await until(lambda: sent[0] >= before + 10, 30, "traffic on two replicas")
            res = await ctl_(admin, "scale", NAME, "1")
            assert res.exit_code == 0, res.output
            await until(lambda: len(rt.registry.endpoints) == 1 and len(replica_pids(state)) == 1, 60,
                        "one replica left (drained, stopped)")
            before = sent[0]
            await until(lambda: sent[0] >= before + 10, 30, "traffic after the scale-down")
        finally:
            stop.set()
            await asyncio.gather(*workers)
        assert failures == [], failures[:5]
        assert sent[0] >= 20

        # -- 0: 503 model_unavailable; then 1 again --
        res = await ctl_(admin, "scale", NAME, "0")
        assert res.exit_code == 0, res.output
        await until(lambda: not rt.registry.endpoints and not replica_pids(state), 60, "no replica")
        with pytest.raises(openai.APIStatusError) as exc:
            await client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=2)
        assert exc.value.status_code == 503 and exc.value.code == "model_unavailable"
        res = await ctl_(admin, "scale", NAME, "1")
        assert res.exit_code == 0, res.output
        await until(lambda: answered(client), 60, "an answer after scaling up from 0")

        # -- the engine killed: restarted by the agent, back in the router --
        (rid, pid), = replica_pids(state).items()
        os.kill(pid, signal.SIGKILL)
        await until(lambda: (p := replica_pids(state).get(rid)) is not None and p != pid and ready_endpoints(rt), 60,
                    "the engine restarted and back in the router")
        assert await answered(client)
        res = await ctl_(admin, "logs", rid, "-n", "20")
        assert res.exit_code == 0 and res.output.strip(), res.output

        # -- the agent killed with SIGKILL: the engine serves on, the next agent adopts it --
        pid = replica_pids(state)[rid]
        assert agent.proc is not None
        agent.proc.send_signal(signal.SIGKILL)
        await agent.exited(10)
        assert not gone(pid) and await answered(client)
        agent.start()
        node = cp.nodes.get("node-e2e")
        regs = node.registrations if node is not None else 0
        await until(lambda: (n := cp.nodes.get("node-e2e")) is not None and n.registrations > regs
                    and any(s.state == "ready" and s.pid == pid for s in n.replicas), 30, "the engine adopted")
        assert replica_pids(state) == {rid: pid}, "adopted, not started twice"
        assert await answered(client)

        # -- a deployment that cannot be placed says why --
        res = await ctl_(admin, "deploy", "big", "--model", "tiny:1b", "--engine", "llamacpp", "--gpus", "2")
        assert res.exit_code == 0, res.output
        res = await ctl_(admin, "deployments")
        assert res.exit_code == 0 and "needs 2 GPUs" in res.output, res.output
        res = await ctl_(admin, "undeploy", "big")
        assert res.exit_code == 0, res.output

        # -- SIGTERM: deregistered, engines stopped --
        agent.proc.send_signal(signal.SIGTERM)
        assert await agent.exited(30) == 0
        await wait_gone(pid, 15)
        assert cp.nodes.get("node-e2e") is None
    finally:
        agent.kill()
        for p in replica_pids(state).values():
            if not gone(p):
                os.kill(p, signal.SIGKILL)
        await client.close()
        await rt.stop()
        check_text("the agent's log", log.read_text(errors="replace"))  # no key, no token, no credential
