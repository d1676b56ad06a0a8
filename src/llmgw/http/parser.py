"""HTTP message handling: the compiled ``_fast.httpproto`` or its pure twin.

See :mod:`llmgw._fast.httpproto_py` for the specification of every name here but
``sse_cut`` and ``usage_counts``: those are :mod:`llmgw.gateway.jsonscan`'s (specified
in :mod:`llmgw._fast.jsonscan_py`), re-exported here for code that imports them from
this module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._accel import select

if TYPE_CHECKING:
    from .._fast.httpproto_py import (
        DEFAULT_MAX_BODY,
        DEFAULT_MAX_HEAD_BYTES,
        DEFAULT_MAX_HEADERS,
        STATUS_REASONS,
        Request,
        RequestReader,
        RequestSink,
        Response,
        ResponseReader,
        chunk,
        chunk_head,
        id_line,
        monotonic,
        response_head,
        upstream_head,
        write_now,
    )
    from .._fast.jsonscan_py import sse_cut, usage_counts
else:
    _impl = select("httpproto")
    DEFAULT_MAX_BODY = _impl.DEFAULT_MAX_BODY
    DEFAULT_MAX_HEAD_BYTES = _impl.DEFAULT_MAX_HEAD_BYTES
    DEFAULT_MAX_HEADERS = _impl.DEFAULT_MAX_HEADERS
    STATUS_REASONS = _impl.STATUS_REASONS
    Request = _impl.Request
    RequestReader = _impl.RequestReader
    RequestSink = _impl.RequestSink
    Response = _impl.Response
    ResponseReader = _impl.ResponseReader
    chunk = _impl.chunk
    chunk_head = _impl.chunk_head
    id_line = _impl.id_line
    monotonic = _impl.monotonic
    write_now = _impl.write_now
    response_head = _impl.response_head
    upstream_head = _impl.upstream_head
    _jsonscan = select("jsonscan")
    sse_cut = _jsonscan.sse_cut
    usage_counts = _jsonscan.usage_counts

__all__ = [
    "DEFAULT_MAX_BODY",
    "DEFAULT_MAX_HEADERS",
    "DEFAULT_MAX_HEAD_BYTES",
    "STATUS_REASONS",
    "Request",
    "RequestReader",
    "RequestSink",
    "Response",
    "ResponseReader",
    "chunk",
    "chunk_head",
    "id_line",
    "monotonic",
    "response_head",
    "sse_cut",
    "upstream_head",
    "usage_counts",
    "write_now",
]
