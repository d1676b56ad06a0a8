"""Driving a :class:`ReplicaSupervisor` in tests: waiting on its status changes, small HTTP calls."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmgw.launch.spec import ReplicaStatus
from llmgw.launch.supervisor import ReplicaSupervisor, process_start_time


class Watched:
    """A supervisor whose ``on_change`` wakes :meth:`wait`."""

    def __init__(self, state_dir: Path, **kw: Any) -> None:
        self.changed = asyncio.Event()
        self.changes = 0
        self.on_change_too: Callable[[], None] | None = None
        kw.setdefault("stop_grace", 10.0)
        kw.setdefault("backoff", 0.05)
        self.sup = ReplicaSupervisor(state_dir, on_change=self._on_change, **kw)

    def _on_change(self) -> None:
        self.changes += 1
        self.changed.set()
        if self.on_change_too is not None:
            self.on_change_too()

    def status(self, rid: str) -> ReplicaStatus | None:
        return next((s for s in self.sup.statuses() if s.id == rid), None)

    async def wait(self, rid: str, pred: Callable[[ReplicaStatus], bool], timeout: float = 30.0) -> ReplicaStatus:
        """Wait (on status changes, bounded by ``timeout``) until ``rid``'s status satisfies ``pred``."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.status(rid)
            if st is not None and pred(st):
                return st
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"replica {rid} did not get there within {timeout}s; now: {st}")
            self.changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.changed.wait(), left)

    async def wait_state(self, rid: str, state: str, timeout: float = 30.0) -> ReplicaStatus:
        return await self.wait(rid, lambda s: s.state == state, timeout)


async def http(port: int, method: str, path: str, *, key: str | None = None, body: bytes = b"",
               timeout: float = 20.0) -> tuple[int, bytes]:
    """One request to 127.0.0.1:``port`` (``Connection: close``): ``(status, body)``."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        head = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Connection: close"]
        if key is not None:
            head.append(f"Authorization: Bearer {key}")
        if body or method == "POST":
            head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        raw = await asyncio.wait_for(reader.read(-1), timeout)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    status_line, _, rest = raw.partition(b"\r\n")
    _, _, payload = rest.partition(b"\r\n\r\n")
    return int(status_line.split()[1]), payload


def gone(pid: int) -> bool:
    """Whether ``pid`` no longer runs (exited, or only a zombie)."""
    return process_start_time(pid) is None


async def wait_gone(pid: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not gone(pid):
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} still runs after {timeout}s")
        await asyncio.sleep(0.05)
