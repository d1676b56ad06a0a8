"""The client-facing app: OpenAI routes in, replicas out.

``POST /v1/*`` with a JSON body naming a ``model`` is proxied to one of that
model's replicas; ``GET /v1/models`` lists the fleet's models. The body is read
only for ``model`` and forwarded byte for byte unless the model name must be
rewritten (an alias, or ``upstream_name``).

A request travels as one :class:`Call`: admission (straight through below pool
saturation 1.0, else a bounded priority-band queue), a replica chosen by the
model's picker, an attempt on a pooled keep-alive connection, and the answer
relayed back. Everything after parsing is driven by callbacks; a task is made
only to open a new upstream connection.

Failure semantics:

* before any byte reached the client (connect refused or timed out, reset,
  502/503 from the engine, a non-streamed answer cut short) the request is retried
  on another replica (``retries.attempts`` times, within ``retries.budget``), then
  answered with a clear error;
* after the first byte there is never a retry: a stream cut by the engine ends
  with an SSE ``data: {"error": ...}`` event and the connection is closed;
* a client that goes away aborts the upstream request at once; every counter
  returns to where it was.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._accel import select

if TYPE_CHECKING:
    from .._fast.dataplane_py import (
        Call,
        Endpoint,
        Gateway,
        Hist,
        ModelPool,
        TrafficCounters,
        normalize_error,
    )
else:
    _impl = select("dataplane")
    Call = _impl.Call
    Endpoint = _impl.Endpoint
    ModelPool = _impl.ModelPool
    Gateway = _impl.Gateway
    Hist = _impl.Hist
    TrafficCounters = _impl.TrafficCounters
    normalize_error = _impl.normalize_error

__all__ = ["Call", "Endpoint", "Gateway", "Hist", "ModelPool", "TrafficCounters", "normalize_error"]
