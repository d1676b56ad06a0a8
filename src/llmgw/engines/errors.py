"""An engine's error answer in OpenAI's shape, read with what llmgw knows of that engine.

Clients of llmgw speak OpenAI's API, whose error body is
``{"error": {"message", "type", "param", "code"}}`` with ``code`` a string or null
(``shared/reference/engines.md`` §8.3 [A3][A4]). Engines differ:

* vLLM, llama.cpp, TensorRT-LLM and SGLang put the HTTP status, an integer, in
  ``code`` (§1.4 [V15], §2.5 [C8], §3.4 [T2]; SGLang's ``ErrorResponse.code: int``);
* llama.cpp names a too-long prompt by its own ``type``,
  ``exceed_context_size_error``, and adds ``n_prompt_tokens`` and ``n_ctx`` (§2.5 [C8]);
  vLLM names it only in its message ("This model's maximum context length is ...");
* their ``type`` is their own: vLLM, SGLang and TensorRT-LLM name exception classes
  (``BadRequestError``, ``NotFoundError``, ...), llama.cpp its own words
  (``not_found_error``, ``unavailable_error``, ...), where OpenAI's clients expect
  OpenAI's (§8.3): an engine's type is kept only if it is one of OpenAI's
  (:data:`OPENAI_TYPES`), else it is OpenAI's for the status (:data:`TYPE_BY_STATUS`);
* vLLM before v0.10.1, TensorRT-LLM and SGLang answer flat
  (``{"object": "error", "message", ...}``), vLLM since v0.10.1 nested [V15];
  vLLM and SGLang refuse a key with ``{"error": "Unauthorized"}`` [V9][S6];
  FastAPI-based engines answer ``{"detail": ...}``; and some answers are plain text.

What differs per engine is read from its :class:`~llmgw.engines.base.EngineInfo`
(``integer_error_code``, ``error_type_codes``, ``error_message_codes``,
``error_extra_fields``). The body
*shapes* are recognised whatever the engine says it is: one engine's versions
differ (vLLM's envelope changed in v0.10.1), and a shape says by itself what it is.

This is the cold path (error answers only): plain Python, ``orjson`` for the bytes.
"""

from __future__ import annotations

from typing import Any

import orjson

from . import ENGINES
from .base import EngineInfo

__all__ = ["CODE_BY_STATUS", "OPENAI_TYPES", "TYPE_BY_STATUS", "normalize_error"]

# OpenAI's string code for an HTTP status, where the body names none (§8.3 [A3]).
CODE_BY_STATUS: dict[int, str] = {
    400: "invalid_request",
    401: "invalid_api_key",
    403: "permission_denied",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    409: "conflict",
    413: "request_too_large",
    422: "invalid_request",
    429: "rate_limit_exceeded",
    500: "internal_error",
    501: "not_implemented",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "gateway_timeout",
}
# OpenAI's ``type`` for a status where it is not the 4xx/5xx default (§8.3):
# ``invalid_request_error`` below 500 (400, 404, 422, ...), ``server_error`` from 500.
TYPE_BY_STATUS: dict[int, str] = {
    401: "invalid_request_error",
    403: "permission_error",
    429: "rate_limit_exceeded",
    503: "service_unavailable_error",
}
# The ``type``s an engine's answer keeps as they are: OpenAI's (§8.3 [A3][A4]; ``tokens``,
# ``requests`` and ``insufficient_quota`` are the types of OpenAI's own 429s), which are
# also those llmgw answers with. Any other (``BadRequestError``, llama.cpp's
# ``not_found_error``) is the engine's own and becomes OpenAI's for the status.
OPENAI_TYPES: frozenset[str] = frozenset({
    "invalid_request_error",
    "permission_error",
    "rate_limit_exceeded",
    "insufficient_quota",
    "tokens",
    "requests",
    "server_error",
    "service_unavailable_error",
})

# NOTE: what llmgw knows of *some* engine serves an answer whose engine is not
# given: every engine's type codes and extra fields, and an integer ``code`` taken
# for the HTTP status (what every engine known to llmgw does with it).
_ANY_TYPE_CODES: dict[str, str] = {t: c for info in ENGINES.values() for t, c in info.error_type_codes}
_ANY_EXTRA_FIELDS: tuple[str, ...] = tuple(
    dict.fromkeys(k for info in ENGINES.values() for k in info.error_extra_fields)
)
_ANY_MESSAGE_CODES: tuple[tuple[str, str], ...] = tuple(
    dict.fromkeys(p for info in ENGINES.values() for p in info.error_message_codes)
)


def normalize_error(status: int, body: bytes, engine: EngineInfo | None = None) -> bytes:
    """An engine's error body in OpenAI's shape, with a string ``code``.

    Args:
        status: the HTTP status the engine answered.
        body: its body, as it came (JSON in any of the shapes in the module
            docstring, plain text, or empty).
        engine: the engine that answered; ``None``: not known, read with what llmgw
            knows of any engine.

    Returns:
        ``{"error": {"message", "type", "param", "code"}}`` as JSON bytes, plus the
        engine's ``error_extra_fields`` where its body had them. The status is the
        engine's (the caller's to answer). The engine's message and string ``code``
        are kept, and its ``type`` if it is one of OpenAI's (:data:`OPENAI_TYPES`);
        any other type, or none, is OpenAI's for the status. A missing ``code`` is,
        in order: the code of the engine's ``type`` (``error_type_codes``), of a 400's
        message (``error_message_codes``), the engine's own integer code as a string
        when it is not the HTTP status (an engine without ``integer_error_code``),
        else OpenAI's for the status (``http_<status>`` for a status without one).
    """
    if engine is None:
        type_codes = _ANY_TYPE_CODES
        message_codes = _ANY_MESSAGE_CODES
        extra_fields = _ANY_EXTRA_FIELDS
        int_is_status = True
    else:
        type_codes = dict(engine.error_type_codes)
        message_codes = engine.error_message_codes
        extra_fields = engine.error_extra_fields
        int_is_status = engine.integer_error_code
    message: str | None = None
    etype: Any = None
    param: Any = None
    code: Any = None
    extra: dict[str, Any] = {}
    try:
        data = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        data = None
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict):
            src = err
        elif isinstance(err, str):
            src = {"message": err}
        elif data.get("object") == "error" or "message" in data or "detail" in data:
            src = data
        else:
            src = {}
        msg = src.get("message", src.get("detail"))
        message = msg if isinstance(msg, str) else (orjson.dumps(msg).decode() if msg is not None else None)
        etype = src.get("type")
        param = src.get("param")
        code = src.get("code")
        for k in extra_fields:
            if k in src:
                extra[k] = src[k]
    elif body:
        message = body[:500].decode("utf-8", "replace").strip() or None
    own_type = etype if isinstance(etype, str) and etype else None
    if own_type is None or own_type not in OPENAI_TYPES:
        etype = TYPE_BY_STATUS.get(status, "invalid_request_error" if status < 500 else "server_error")
    if not isinstance(code, str) or not code:
        own = (
            code
            if isinstance(code, int) and not isinstance(code, bool) and not int_is_status and code != status
            else None
        )
        said = (
            next((c for text, c in message_codes if text in message), None)
            if status == 400 and message_codes and isinstance(message, str)
            else None
        )
        if own_type is not None and own_type in type_codes:
            code = type_codes[own_type]
        elif said is not None:
            code = said
        elif own is not None:
            code = str(own)  # the provider's own code, kept (as a string: OpenAI's codes are)
        else:
            code = CODE_BY_STATUS.get(status, f"http_{status}")
    if not isinstance(param, str):
        param = None
    if not message:
        message = f"the engine answered HTTP {status}"
    out: dict[str, Any] = {"message": message, "type": etype, "param": param, "code": code}
    out.update(extra)
    return orjson.dumps({"error": out})
