"""``SocketWriter``: writes that go straight to the socket, and what falls back.

Both twins, over a real socket pair with small buffers. The transport is a
recorder with the few methods the writer uses, so each case can say exactly
what the transport holds; the server tests drive the writer end to end.
"""

from __future__ import annotations

import socket
from types import ModuleType
from typing import Any

import pytest


class Recorder:
    """The transport side: keeps what it was given; says how much it still holds."""

    def __init__(self, sock: socket.socket, ssl: bool = False) -> None:
        self.sock = sock
        self.ssl = ssl
        self.closing = False
        self.held = 0  # what get_write_buffer_size() answers
        self.given: list[bytes] = []

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "socket":
            return self.sock
        if name == "sslcontext":
            return object() if self.ssl else None
        return default

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return self.held

    def write(self, data: Any) -> None:
        self.given.append(bytes(data))
        self.held += len(data)

    def writelines(self, parts: Any) -> None:
        for p in parts:
            self.write(p)


@pytest.fixture
def pair() -> Any:
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    yield a, b
    a.close()
    b.close()


def drain(b: socket.socket) -> bytes:
    got = bytearray()
    for _ in range(100000):  # bounded
        try:
            piece = b.recv(1 << 16)
        except BlockingIOError:
            break
        if not piece:
            break
        got += piece
    return bytes(got)


def pattern(n: int, salt: int) -> bytes:
    return bytes((i * 7 + salt) % 251 for i in range(n))


def test_small_writes_go_to_the_socket(server: ModuleType, pair: Any) -> None:
    a, b = pair
    t = Recorder(a)
    w = server.SocketWriter(t)
    w.write(b"HTTP/1.1 200 OK\r\n\r\n", b"body")
    w.write(b"more")
    assert t.given == [] and not w.queued
    assert drain(b) == b"HTTP/1.1 200 OK\r\n\r\nbodymore"


@pytest.mark.parametrize(("head_n", "body_n"), [(200_000, 10), (200_000, 300_000), (10, 300_000), (10, 1000)])
def test_what_the_socket_refuses_goes_to_the_transport_in_order(
    server: ModuleType, pair: Any, head_n: int, body_n: int
) -> None:
    a, b = pair
    t = Recorder(a)
    w = server.SocketWriter(t)
    fill = pattern(1 << 16, 1)
    sent = b""
    if body_n == 1000:  # first fill the socket, so a small write is refused entirely
        while not w.queued:
            w.write(fill)
            sent += fill
    head, body = pattern(head_n, 2), pattern(body_n, 3)
    w.write(head, body)
    assert w.queued
    # Nothing more goes to the socket while the transport holds bytes.
    w.write(b"tail")
    assert t.given[-1] == b"tail"
    assert drain(b) + b"".join(t.given) == sent + head + body + b"tail"


def test_back_to_the_socket_once_the_transport_is_empty(server: ModuleType, pair: Any) -> None:
    a, b = pair
    t = Recorder(a)
    w = server.SocketWriter(t)
    w.write(pattern(300_000, 4))
    assert w.queued and t.given
    first = drain(b) + b"".join(t.given)
    t.given.clear()
    t.held = 0  # the transport has sent everything
    w.write(b"direct")
    assert not w.queued and t.given == []
    assert first + drain(b) == pattern(300_000, 4) + b"direct"


def test_closing_transport_gets_every_write(server: ModuleType, pair: Any) -> None:
    a, b = pair
    t = Recorder(a)
    w = server.SocketWriter(t)
    t.closing = True  # its descriptor may be closed and reused: never written directly
    w.write(b"late", b"!")
    assert t.given == [b"late!"]
    assert drain(b) == b""


def test_tls_transport_gets_every_write(server: ModuleType, pair: Any) -> None:
    a, b = pair
    t = Recorder(a, ssl=True)
    w = server.SocketWriter(t)
    w.write(b"secret")
    assert t.given == [b"secret"]
    assert drain(b) == b""


def test_socket_error_is_left_to_the_transport(server: ModuleType, pair: Any) -> None:
    a, b = pair
    t = Recorder(a)
    w = server.SocketWriter(t)
    b.close()
    w.write(b"to nobody", b"!")  # no exception, no SIGPIPE: the transport reports it
    assert t.given == [b"to nobody!"]
