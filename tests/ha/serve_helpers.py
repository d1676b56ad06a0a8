"""Real ``llmgw serve`` processes sharing one control-plane database (tests and bench/failover.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from ports import free_port

TOKEN_ENV = "LLMGW_JOIN_TOKEN"


async def http(port: int, method: str, path: str, timeout: float = 5.0, body: Any = None,
               headers: str = "") -> tuple[int, dict[str, str], bytes]:
    """One request to 127.0.0.1:``port`` (``connection: close``; ``body`` sent as JSON): status, headers, body."""
    data = orjson.dumps(body) if body is not None else b""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout)
    try:
        writer.write(f"{method} {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\n"
                     f"content-length: {len(data)}\r\n{headers}\r\n".encode() + data)
        raw = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status_line = lines[0].split(" ", 2)
    if len(status_line) < 2 or not status_line[1].isdigit():
        # (a process killed with the request in flight closes without a word: for the caller,
        # that is a connection lost, like a refused one)
        raise ConnectionResetError(f"127.0.0.1:{port} closed without an answer ({raw[:80]!r})")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    if headers.get("transfer-encoding") == "chunked":
        out, rest = b"", body
        while rest:
            size_s, _, rest = rest.partition(b"\r\n")
            size = int(size_s, 16)
            if size == 0:
                break
            out, rest = out + rest[:size], rest[size + 2:]
        body = out
    return int(status_line[1]), headers, body


def gauge(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{}"):
            return float(line.rsplit(" ", 1)[1])
    return None


class Serve:
    """One ``llmgw serve`` (control plane only) on free loopback ports, its log in ``log``."""

    def __init__(self, workdir: Path, name: str, dsn: str, token: str, *, lease: float = 2.0,
                 interval: float = 0.2, env: dict[str, str] | None = None, router_token_env: str | None = None) -> None:
        self.name = name
        self.grpc = free_port()
        self.admin = free_port()
        self.gateway = free_port()
        """The gateway's port (the router the deployments' ready replicas join)."""
        self.env = env or {}
        self.log = workdir / f"{name}.log"
        self.token = token
        self.cfg = workdir / f"{name}.yaml"
        self.cfg.write_text(
            f"listen: 127.0.0.1:{self.gateway}\nadmin: 127.0.0.1:{self.admin}\n"
            f"control:\n  listen: 127.0.0.1:{self.grpc}\n  join_token_env: {TOKEN_ENV}\n"
            f"  heartbeat_interval: {interval}s\n  heartbeat_grace: {3 * interval}s\n"
            f"  database: {dsn}\n  lease: {lease}s\n"
            + (f"  router_token_env: {router_token_env}\n" if router_token_env else "")
        )
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc}"

    def start(self) -> Serve:
        env = {**os.environ, **self.env, TOKEN_ENV: self.token}
        with open(self.log, "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "llmgw", "serve", "--config", str(self.cfg)],
                env=env, stdout=subprocess.DEVNULL, stderr=err,
            )
        return self

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # (a stopped process dies of SIGKILL too; CONT for the log)
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGCONT)
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stderr(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    async def metrics(self) -> str | None:
        try:
            status, _, body = await http(self.admin, "GET", "/metrics", timeout=2.0)
        except (OSError, asyncio.TimeoutError):
            return None
        return body.decode() if status == 200 else None

    async def leading(self) -> bool | None:
        """1/0 from ``llmgw_control_leader``; ``None`` when it does not answer."""
        text = await self.metrics()
        if text is None:
            return None
        return gauge(text, "llmgw_control_leader") == 1.0

    async def epoch(self) -> float | None:
        text = await self.metrics()
        return gauge(text, "llmgw_control_leader_epoch") if text is not None else None

    async def api(self, method: str, path: str, body: Any = None, timeout: float = 5.0) -> tuple[int, dict[str, str], Any]:
        status, headers, body = await http(self.admin, method, path, timeout, body)
        return status, headers, orjson.loads(body) if body else None


async def wait_until(cond: Any, timeout: float, what: str, step: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if asyncio.iscoroutine(v):
            v = await v
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(step)


async def the_leader(procs: list[Serve], timeout: float) -> Serve:
    """The one process that leads, once every process alive answers (a standby still starting is not yet one:
    a test asking it right after would find its admin port closed). A process that exits while waited for is a
    failure naming the end of its log."""
    started = [p for p in procs if p.alive()]

    async def one() -> Serve | None:
        for p in started:
            if not p.alive():
                raise AssertionError(f"{p.name} exited ({p.proc.returncode if p.proc else None}) while waited for:"
                                     f"\n{p.stderr()[-3000:]}")
        flags = [(p, await p.leading()) for p in started]
        if any(f is None for _, f in flags):
            return None
        leaders = [p for p, f in flags if f]
        return leaders[0] if len(leaders) == 1 else None

    found: Serve = await wait_until(one, timeout, "exactly one leader")
    return found


ROUTER_TOKEN_ENV = "LLMGW_ROUTER_TOKEN"


class Router:
    """``llmgw serve`` with ``follow:`` (no control plane of its own): routes on the table the leader streams,
    with ``token`` as its router token (``env``: more of its environment)."""

    def __init__(self, tmp: Path, controls: list[str], token: str, env: dict[str, str] | None = None) -> None:
        self.port, self.admin = free_port(), free_port()
        self.log = tmp / "router.log"
        cfg = tmp / "router.yaml"
        cfg.write_text(f"listen: 127.0.0.1:{self.port}\nadmin: 127.0.0.1:{self.admin}\n"
                       f"follow:\n  control: [{', '.join(controls)}]\n  token_env: {ROUTER_TOKEN_ENV}\n")
        with open(self.log, "ab") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "llmgw", "serve", "--config", str(cfg)],
                                         env={**os.environ, **(env or {}), ROUTER_TOKEN_ENV: token},
                                         stdout=subprocess.DEVNULL, stderr=err)

    async def following(self) -> str | None:
        """The control plane whose table it holds now (``None``: not connected, or no answer)."""
        try:
            _, _, body = await http(self.admin, "GET", "/ready", 2.0)
        except (OSError, asyncio.TimeoutError):
            return None
        f = orjson.loads(body).get("follow") or {}
        return f.get("control_plane") if f.get("connected") else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
