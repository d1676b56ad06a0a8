"""A real gateway runtime with its control plane, agents as real processes, and readers of /metrics and the API."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import orjson
from prometheus_client.parser import text_string_to_metric_families

from canary import check_text, secret
from llmgw.config import load
from llmgw.runtime import GatewayRuntime, components_for
from ports import free_port as free_port  # (re-exported: the control tests take it from here)

HERE = Path(__file__).resolve().parent
TOKEN = secret("join-for-tests-7f3a")
INTERVAL = 0.2


def control_config(port: int, **control: Any) -> Any:
    c = {"listen": f"127.0.0.1:{port}", "join_token": TOKEN, "heartbeat_interval": f"{INTERVAL}s",
         "heartbeat_grace": f"{3 * INTERVAL}s", **control}
    return load({"listen": "127.0.0.1:0", "admin": "127.0.0.1:0", "control": c})


@contextlib.asynccontextmanager
async def control_runtime(port: int, **control: Any) -> AsyncIterator[GatewayRuntime]:
    cfg = control_config(port, **control)
    rt = GatewayRuntime(cfg, components=components_for(cfg))
    await rt.start()
    try:
        yield rt
    finally:
        await rt.stop()


def control_plane(rt: GatewayRuntime) -> Any:
    return rt.components[0]


async def http(
    rt: GatewayRuntime, method: str, path: str, timeout: float = 10.0, headers: str = ""
) -> tuple[int, bytes]:
    assert rt.admin_addr is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", rt.admin_addr[1])
    try:
        writer.write(f"{method} {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: 0\r\n{headers}"
                     "\r\n".encode())
        raw = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head.lower():
        out, rest = b"", body
        while rest:
            size_s, _, rest = rest.partition(b"\r\n")
            size = int(size_s, 16)
            if size == 0:
                break
            out, rest = out + rest[:size], rest[size + 2:]
        body = out
    return status, body


async def api(rt: GatewayRuntime, method: str, path: str) -> tuple[int, Any]:
    status, body = await http(rt, method, path)
    return status, orjson.loads(body)


async def metrics_text(rt: GatewayRuntime) -> str:
    status, body = await http(rt, "GET", "/metrics")
    assert status == 200
    return body.decode()


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def pick(samples: Samples, name: str, **labels: str) -> list[float]:
    want = set(labels.items())
    return [v for (n, lab), v in samples.items() if n == name and want <= lab]


async def metrics(rt: GatewayRuntime) -> Samples:
    return parse(await metrics_text(rt))


async def wait_for(cond: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
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
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def running(client: Any) -> AsyncIterator[asyncio.Task[None]]:
    """An in-process agent (:class:`~llmgw.agent.client.AgentClient`) running for the block: stopped
    (deregistering) after it, bounded."""
    stop = asyncio.Event()
    task = asyncio.create_task(client.run(stop))
    try:
        yield task
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 10)


class AgentProc:
    """``agent_proc.py`` as a child process (stderr to ``log``)."""

    def __init__(self, port: int | str, name: str, scenario: Path, log: Path, *extra: str, token: str = TOKEN) -> None:
        """``port``: the control plane's on 127.0.0.1, or the whole ``--control`` value (``A:1,B:2``)."""
        self.port, self.name, self.scenario, self.log, self.extra, self.token = port, name, scenario, log, extra, token
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> AgentProc:
        env = {**os.environ, "LLMGW_JOIN_TOKEN": self.token}
        control = self.port if isinstance(self.port, str) else f"127.0.0.1:{self.port}"
        cmd = [sys.executable, str(HERE / "agent_proc.py"), "--control", control,
               "--name", self.name, "--scenario", str(self.scenario), *self.extra]
        with open(self.log, "ab") as err:
            self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)
        return self

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    async def wait(self, timeout: float = 10.0) -> int:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"agent {self.name} did not exit within {timeout}s")
            await asyncio.sleep(0.05)
        return self.proc.returncode

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(5)
        check_text(f"agent {self.name}'s log", self.stderr())  # (a join token must never be logged)

    def stderr(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


class DemoServe:
    """``llmgw serve`` with no config (the demo: a control plane and its demo node) in a process of its
    own, with ``llama-server`` on PATH being ``script`` (a stand-in), up once the demo node is registered.
    ``env`` is the process's (PATH with the stand-in; give it to ``llmgw ctl`` too), ``ctl`` the command
    line of ``llmgw ctl`` against its admin API."""

    def __init__(self, tmp_path: Path, script: str) -> None:
        port, admin_port = free_port(), free_port()
        tmp, bin_dir = tmp_path / "tmp", tmp_path / "bin"
        tmp.mkdir()
        bin_dir.mkdir()
        (bin_dir / "llama-server").write_text(script)
        (bin_dir / "llama-server").chmod(0o755)
        path = os.pathsep.join([str(bin_dir), os.path.dirname(sys.executable), "/usr/bin", "/bin"])
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp), "PATH": path, "COLUMNS": "400"}
        self.base = f"http://127.0.0.1:{admin_port}"
        self.ctl = [sys.executable, "-m", "llmgw", "ctl", "--admin", self.base]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llmgw", "serve", "--listen", f"127.0.0.1:{port}", "--admin",
             f"127.0.0.1:{admin_port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=self.env,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                if self.get("/admin/v1/nodes")["nodes"]:
                    return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.stop()
        raise AssertionError("the demo node did not register within 60s")

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(f"{self.base}{path}", timeout=5) as r:
            return orjson.loads(r.read())

    def stop(self) -> tuple[int, str]:
        """SIGTERM, then its exit status and its log."""
        self.proc.send_signal(signal.SIGTERM)
        _, err = self.proc.communicate(timeout=30)
        return self.proc.returncode, err
