"""A real ``llmgw agent`` process runs the real ``llama-server`` the control plane asks for.

The control plane is the real one (gRPC on 127.0.0.1); its replica controller here is a small
in-test one (a dict of desired sets), so this checks the wire and the agent with real processes:
the set pushed at once, the engine launched and reported ready, ``ctl logs`` through the admin
API, the engine killed -> restarted, the agent killed with SIGKILL -> the engine adopted by the
next agent (no orphan, no second engine), SIGTERM -> deregistered and the engine stopped.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from canary import check_text, secret
from launch.helpers import gone, http, wait_gone
from llmgw.launch.spec import READY, ReplicaSpec, ReplicaStatus

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(120)]

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "control"))
from cp_helpers import TOKEN, api, control_plane, control_runtime, free_port  # noqa: E402

KEY = secret("replica-key")
CHAT = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'


class Controller:
    """A ReplicaController over a dict, recording what the agent reports; ``wait`` wakes on each report."""

    def __init__(self) -> None:
        self.sets: dict[str, tuple[int, tuple[ReplicaSpec, ...]]] = {}
        self.latest: dict[str, tuple[str, tuple[ReplicaStatus, ...]]] = {}
        self.gone: list[str] = []
        self.event = asyncio.Event()
        self._subs: list[Callable[[str], None]] = []

    def set(self, node: str, specs: Sequence[ReplicaSpec]) -> None:
        self.sets[node] = (self.sets.get(node, (0, ()))[0] + 1, tuple(specs))
        for cb in self._subs:
            cb(node)

    def desired(self, node: str) -> tuple[int, tuple[ReplicaSpec, ...]]:
        return self.sets.get(node, (0, ()))

    def report(self, node: str, address: str, statuses: Sequence[ReplicaStatus]) -> None:
        self.latest[node] = (address, tuple(statuses))
        self.event.set()

    def node_gone(self, node: str) -> None:
        self.gone.append(node)
        self.event.set()

    def wake(self) -> None:
        self.woken = getattr(self, "woken", 0) + 1

    def subscribe(self, changed: Callable[[str], None]) -> None:
        self._subs.append(changed)

    def status(self, node: str, rid: str) -> ReplicaStatus | None:
        return next((s for s in self.latest.get(node, ("", ()))[1] if s.id == rid), None)

    async def wait(self, pred: Callable[[], object], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}; reports: {self.latest}")
            self.event.clear()
            try:
                await asyncio.wait_for(self.event.wait(), left)
            except asyncio.TimeoutError:
                pass


async def exited(p: subprocess.Popen[bytes], timeout: float) -> int:
    """Wait for ``p`` to exit without blocking the loop (the control plane answers its Deregister on it)."""
    deadline = time.monotonic() + timeout
    while p.poll() is None:
        if time.monotonic() > deadline:
            raise AssertionError(f"the agent did not exit within {timeout}s")
        await asyncio.sleep(0.05)
    return p.returncode


def start_agent(port: int, cfg: Path, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as err:
        return subprocess.Popen([sys.executable, "-m", "llmgw", "agent", "--config", str(cfg)],
                                env={**os.environ, "JOIN": TOKEN}, stdout=subprocess.DEVNULL, stderr=err)


async def test_agent_runs_adopts_and_stops_the_real_engine(
    llama_server_bin: Path, tiny_model: Path, tmp_path: Path
) -> None:
    port = free_port()
    cfg = tmp_path / "agent.yaml"
    # (drain_timeout 0: this Controller never drains a leaving node, so SIGTERM stops the engine at once)
    cfg.write_text(
        f"control: 127.0.0.1:{port}\ntoken_env: JOIN\nname: node-r\ngpu_source: none\nadvertise: 127.0.0.1\n"
        f"state_dir: {tmp_path / 'state'}\ndrain_timeout: 0s\nengines:\n  llamacpp:\n    binary: {llama_server_bin}\n"
    )
    log = tmp_path / "agent.log"
    spec = ReplicaSpec(id="chat-r1", deployment="chat", engine="llamacpp", model=str(tiny_model), served_name="tiny",
                       slots=1, context=512, args=("-t", "1"), api_key=KEY)
    async with control_runtime(port, heartbeat_interval="5s", heartbeat_grace="15s") as rt:
        ctl = Controller()
        cp = control_plane(rt)
        cp.service.attach(ctl)
        agent = start_agent(port, cfg, log)
        pid = None
        try:
            await ctl.wait(lambda: "node-r" in ctl.latest, 20, "the agent's first beat")
            t0 = time.monotonic()
            ctl.set("node-r", [spec])
            await ctl.wait(lambda: (s := ctl.status("node-r", "chat-r1")) is not None and s.state == READY, 60,
                           "the engine ready")
            took = time.monotonic() - t0
            st = ctl.status("node-r", "chat-r1")
            assert st is not None and st.port and st.pid
            pid = st.pid
            assert ctl.latest["node-r"][0] == "127.0.0.1"
            assert took < 5.0 * 0.9, f"ready reported in {took:.2f}s: by an early beat, not the next interval"
            status, body = await http(st.port, "POST", "/v1/chat/completions", key=KEY, body=CHAT)
            assert status == 200, body
            # ctl logs: the engine's own output, from its log file on the node
            status, ans = await api(rt, "GET", "/admin/v1/replicas/chat-r1/logs?lines=50")
            assert status == 200 and ans["node"] == "node-r" and "llama" in ans["text"].lower(), ans
            assert KEY not in ans["text"]
            # ctl engine-check --node: the agent checks the engine its config names
            from click.testing import CliRunner

            from llmgw.cli.ctl import ctl as ctl_cmd

            admin = f"http://127.0.0.1:{rt.admin_addr[1]}"  # type: ignore[index]
            res = await asyncio.to_thread(CliRunner().invoke, ctl_cmd, ["--admin", admin, "engine-check", "llamacpp",
                                                                        "--node", "node-r", "--static"])
            assert res.exit_code == 0, res.output
            assert "on node node-r:" in res.output and "all checks passed" in res.output

            # the engine killed: restarted by the agent, reported ready again on another pid
            os.kill(pid, signal.SIGKILL)
            await ctl.wait(lambda: (s := ctl.status("node-r", "chat-r1")) is not None and s.state == READY
                           and s.pid != pid and s.restarts >= 1, 60, "the engine restarted")
            st = ctl.status("node-r", "chat-r1")
            assert st is not None and st.pid is not None
            pid = st.pid

            # the agent killed with SIGKILL: the engine runs on; the next agent adopts it (same pid)
            agent.send_signal(signal.SIGKILL)
            await exited(agent, 10)
            assert not gone(pid)
            ctl.latest.clear()
            agent = start_agent(port, cfg, log)
            await ctl.wait(lambda: (s := ctl.status("node-r", "chat-r1")) is not None and s.state == READY, 30,
                           "the engine adopted")
            st = ctl.status("node-r", "chat-r1")
            assert st is not None and st.pid == pid, "adopted, not started again"
            status, _ = await http(st.port or 0, "POST", "/v1/chat/completions", key=KEY, body=CHAT)
            assert status == 200

            # SIGTERM: deregistered, the engine stopped
            agent.send_signal(signal.SIGTERM)
            assert await exited(agent, 30) == 0
            await ctl.wait(lambda: ctl.gone == ["node-r"], 10, "node_gone")
            await wait_gone(pid, 15)
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.wait(10)
            if pid is not None and not gone(pid):
                os.kill(pid, signal.SIGKILL)
            check_text("the agent's log", log.read_text(errors="replace"))  # (no key, no join token in it)
