"""The client-facing app: OpenAI routes in, replicas out (:class:`Gateway`, one
:class:`Call` per request).

The implementation, and the description of how a request travels and fails, is
:mod:`llmgw._fast.proxy_py` (compiled as ``llmgw._fast.proxy``). The replicas
and pools it routes to are in :mod:`llmgw.fleet.registry`; the counters it
reports to in :mod:`llmgw.gateway.observe`; engine errors are put in OpenAI's
shape by :func:`llmgw.engines.errors.normalize_error`, which the gateway is given.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._accel import select

if TYPE_CHECKING:
    from .._fast.proxy_py import Call, Gateway, config_secrets, redact
else:
    _impl = select("proxy")
    Call = _impl.Call
    Gateway = _impl.Gateway
    config_secrets = _impl.config_secrets
    redact = _impl.redact

__all__ = ["Call", "Gateway", "config_secrets", "redact"]
