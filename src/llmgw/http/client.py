"""The upstream client: pooled keep-alive HTTP/1.1 connections to one replica.

One raw protocol object per connection, with httptools' response parser
through :class:`~llmgw.http.parser.ResponseReader`; no aiohttp/httpx on the
request path. The same client serves proxying and scraping.

A connection serves one exchange at a time. The exchange is a *sink* object with
``on_response_head(resp)``, ``on_response_body(data)``, ``on_response_end()`` and
``on_upstream_lost(exc)``; bytes are passed to it as they arrive.

The implementation is :mod:`llmgw._fast.dataplane` (compiled) or its pure twin.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._accel import select

if TYPE_CHECKING:
    from .._fast.dataplane_py import UpstreamConnection, UpstreamPool
else:
    _impl = select("dataplane")
    UpstreamConnection = _impl.UpstreamConnection
    UpstreamPool = _impl.UpstreamPool

__all__ = ["UpstreamConnection", "UpstreamPool"]
