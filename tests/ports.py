"""Ports for the tests' servers to listen on.

A port the kernel hands out for ``bind(port 0)`` comes from the ephemeral range, the one it also
takes outgoing connections' source ports from: between the pick and the server's bind, any
connection the machine opens (another test, a benchmark, a scrape) can take it, and the bind fails
(``cannot bind 127.0.0.1:36959``). A port below that range is only ever taken by a listener, and
one that binds now and was not handed out before in this process is as good as it gets without
passing the socket itself.
"""

from __future__ import annotations

import random
import socket

# NOTE: Linux's default ip_local_port_range is 32768-60999; nothing picks from below it unasked.
_SPAN = (20000, 32767)
_given: set[int] = set()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that nothing listens on now, below the ephemeral range where it can be."""
    lo, hi = _SPAN[0], min(_SPAN[1], _ephemeral_low() - 1)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if hi > lo:
        for _ in range(200):
            port = random.randint(lo, hi)
            if port in _given:
                continue
            with socket.socket(family, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
            _given.add(port)
            return port
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
