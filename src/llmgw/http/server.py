"""llmgw's HTTP/1.1 server: one protocol object per connection on uvloop.

The same core serves the gateway's client port, the admin port and the
simulated engines. An *app* is an :class:`App` or any object with
``handle(request, writer)``; it may answer at once (returning ``None``) or return
an awaitable, which runs as a task. The server owns everything else: limits and
timeouts, pipelining (answered in order), ``100 Continue``, keep-alive, flow
control in both directions, the connection limit, OpenAI-shaped error answers,
and a graceful shutdown.

The implementation is :mod:`llmgw._fast.server` (compiled) or its pure twin
:mod:`llmgw._fast.server_py`; importing this loads neither the upstream client
nor the proxy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._accel import select

if TYPE_CHECKING:
    from .._fast.server_py import (
        App,
        HTTPProtocol,
        HTTPServer,
        ResponseWriter,
        ServerLimits,
        SocketWriter,
        error_body,
    )
else:
    _impl = select("server")
    App = _impl.App
    HTTPProtocol = _impl.HTTPProtocol
    HTTPServer = _impl.HTTPServer
    ResponseWriter = _impl.ResponseWriter
    ServerLimits = _impl.ServerLimits
    SocketWriter = _impl.SocketWriter
    error_body = _impl.error_body

__all__ = ["App", "HTTPProtocol", "HTTPServer", "ResponseWriter", "ServerLimits", "SocketWriter", "error_body"]
