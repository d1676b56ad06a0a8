"""The upstream client: pooled keep-alive HTTP/1.1 connections to one replica.

One raw protocol object per connection, with the compiled response reader
(:class:`~llmgw.http.parser.ResponseReader`); no aiohttp/httpx on the request
path. The same client serves proxying and scraping.

A connection serves one exchange at a time: an :class:`Exchange` (or any object
with its methods) passed to ``UpstreamConnection.send`` hears about the answer
as it arrives: ``on_response_head(resp)``, ``on_response_body(data)``,
``on_response_end()``, or ``on_upstream_lost(exc)``. :func:`should_retry_fresh`
is the one rule for sending a request lost on a stale pooled connection again.

The implementation is :mod:`llmgw._fast.upstream` (compiled) or its pure twin
:mod:`llmgw._fast.upstream_py`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._accel import select

if TYPE_CHECKING:
    from .._fast.upstream_py import Exchange, UpstreamConnection, UpstreamPool, should_retry_fresh
else:
    _impl = select("upstream")
    Exchange = _impl.Exchange
    UpstreamConnection = _impl.UpstreamConnection
    UpstreamPool = _impl.UpstreamPool
    should_retry_fresh = _impl.should_retry_fresh

__all__ = ["Exchange", "UpstreamConnection", "UpstreamPool", "should_retry_fresh"]
