"""The floor of llmgw's architecture: a pure-Python byte relay on raw uvloop protocols.

Each client connection gets its own upstream connection (round robin over the
upstreams) and bytes are copied both ways unparsed: no HTTP, no routing, no
rechunking. Whatever llmgw spends above this is HTTP handling and routing.

    python relay.py --listen 127.0.0.1:28082 --upstream 127.0.0.1:28001 --upstream 127.0.0.1:28002
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal

import uvloop


class Upstream(asyncio.Protocol):
    __slots__ = ("client", "transport")

    def __init__(self, client: Client) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport):  # type: ignore[no-untyped-def]
        self.transport = transport
        self.client.upstream_ready(self)

    def data_received(self, data: bytes) -> None:
        t = self.client.transport
        if t is not None:
            t.write(data)

    def connection_lost(self, exc):  # type: ignore[no-untyped-def]
        self.transport = None
        t = self.client.transport
        if t is not None:
            t.close()

    def pause_writing(self) -> None:
        if self.client.transport is not None:
            self.client.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.client.transport is not None:
            self.client.transport.resume_reading()


class Client(asyncio.Protocol):
    __slots__ = ("pending", "transport", "up")

    targets: itertools.cycle  # type: ignore[type-arg]

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.up: Upstream | None = None
        self.pending: list[bytes] = []

    def connection_made(self, transport):  # type: ignore[no-untyped-def]
        self.transport = transport
        host, port = next(Client.targets)
        loop = asyncio.get_running_loop()
        fut = loop.create_task(loop.create_connection(lambda: Upstream(self), host, port))
        fut.add_done_callback(self._connected)

    def _connected(self, fut: asyncio.Future) -> None:  # type: ignore[type-arg]
        if (fut.cancelled() or fut.exception() is not None) and self.transport is not None:
            self.transport.close()

    def upstream_ready(self, up: Upstream) -> None:
        self.up = up
        if self.pending:
            assert up.transport is not None
            up.transport.writelines(self.pending)
            self.pending = []

    def data_received(self, data: bytes) -> None:
        up = self.up
        if up is None or up.transport is None:
            self.pending.append(data)
        else:
            up.transport.write(data)

    def connection_lost(self, exc):  # type: ignore[no-untyped-def]
        self.transport = None
        if self.up is not None and self.up.transport is not None:
            self.up.transport.close()

    def pause_writing(self) -> None:
        if self.up is not None and self.up.transport is not None:
            self.up.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.up is not None and self.up.transport is not None:
            self.up.transport.resume_reading()


def _addr(s: str) -> tuple[str, int]:
    host, _, port = s.rpartition(":")
    return host, int(port)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--listen", required=True)
    ap.add_argument("--upstream", action="append", required=True)
    args = ap.parse_args()
    Client.targets = itertools.cycle([_addr(u) for u in args.upstream])
    loop = asyncio.get_running_loop()
    host, port = _addr(args.listen)
    server = await loop.create_server(Client, host, port, backlog=4096, reuse_address=True)
    stop = loop.create_future()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: stop.done() or stop.set_result(None))
    await stop
    server.close()


if __name__ == "__main__":
    uvloop.run(main())
