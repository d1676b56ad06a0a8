"""Scans of JSON text (a request body's ``model``; an answer's SSE events and token
usage): the compiled ``_fast.jsonscan`` or its pure twin.

See :mod:`llmgw._fast.jsonscan_py` for the specification of every name here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._accel import select

if TYPE_CHECKING:
    from .._fast.jsonscan_py import MAX_DEPTH, JSONScanError, json_model, model_span, sse_cut, usage_counts
else:
    _impl = select("jsonscan")
    MAX_DEPTH = _impl.MAX_DEPTH
    JSONScanError = _impl.JSONScanError
    json_model = _impl.json_model
    model_span = _impl.model_span
    sse_cut = _impl.sse_cut
    usage_counts = _impl.usage_counts

__all__ = ["MAX_DEPTH", "JSONScanError", "json_model", "model_span", "sse_cut", "usage_counts"]
