"""llmgw's exceptions.

Pure Python, so that the compiled modules and their twins raise the same classes.
Request-path errors carry the HTTP ``status`` and the OpenAI error ``type`` and
``code`` they become, so the server turns any of them into a response in one place
(the HTTP server's ``ResponseWriter.send_error``, whose body is
:func:`llmgw.http.server.error_body`). Messages are public: they never contain a
secret.
"""

from __future__ import annotations

__all__ = [
    "BadGatewayError",
    "BadRequestError",
    "ConfigError",
    "GatewayTimeoutError",
    "HTTPError",
    "HeadersTooLargeError",
    "InternalError",
    "LlmgwError",
    "ModelNotFoundError",
    "NotFoundError",
    "OverloadedError",
    "PayloadTooLargeError",
    "PromParseError",
    "RateLimitedError",
    "UnauthorizedError",
]


class LlmgwError(Exception):
    """Root of every error llmgw raises on purpose."""


class InternalError(LlmgwError, AssertionError):
    """A bug in llmgw itself: an invariant did not hold."""


class ConfigError(LlmgwError, ValueError):
    """The configuration is invalid.

    ``key`` is the dotted path of the offending key (``endpoints[2].url``) and the
    message says what is wrong and how to fix it.
    """

    def __init__(self, key: str, message: str, *, source: str | None = None) -> None:
        self.key = key
        self.message = message
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(f"{where}{key}: {message}" if key else f"{where}{message}")


class PromParseError(LlmgwError, ValueError):
    """A Prometheus / OpenMetrics page could not be read; ``lineno`` is 1-based."""

    def __init__(self, lineno: int, message: str) -> None:
        self.lineno = lineno
        self.message = message
        super().__init__(f"line {lineno}: {message}")


class HTTPError(LlmgwError):
    """An error answered to an HTTP client as an OpenAI-shaped JSON body.

    Attributes:
        status: HTTP status code.
        type: OpenAI error ``type``.
        code: OpenAI error ``code`` (always a string or ``None``).
        param: the request parameter at fault, if any.
        retry_after: seconds for a ``Retry-After`` header, if any.
        close: whether the connection must be closed after the answer.
    """

    status = 500
    type = "server_error"
    code: str | None = "internal_error"
    close = False

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
        close: bool | None = None,
        status: int | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        if type is not None:
            self.type = type
        if close is not None:
            self.close = close
        self.retry_after = retry_after


class BadRequestError(HTTPError):
    """400: malformed HTTP, bad JSON, a missing or invalid field."""

    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class UnauthorizedError(HTTPError):
    """401: no API key or a wrong one."""

    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class NotFoundError(HTTPError):
    """404: no such route."""

    status = 404
    type = "invalid_request_error"
    code = "not_found"


class ModelNotFoundError(HTTPError):
    """404: the fleet serves no model by that name."""

    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class PayloadTooLargeError(HTTPError):
    """413: the request body exceeds the configured limit."""

    status = 413
    type = "invalid_request_error"
    code = "request_too_large"
    close = True


class HeadersTooLargeError(HTTPError):
    """431: request line or headers exceed the configured limits."""

    status = 431
    type = "invalid_request_error"
    code = "request_header_fields_too_large"
    close = True


class RateLimitedError(HTTPError):
    """429: admission control shed the request; ``retry_after`` says when to come back."""

    status = 429
    type = "rate_limit_exceeded"
    code = "rate_limit_exceeded"


class OverloadedError(HTTPError):
    """503: no replica can take the request, or the gateway is at its connection limit."""

    status = 503
    type = "service_unavailable_error"
    code = "service_unavailable"


class BadGatewayError(HTTPError):
    """502: the replica failed before a complete answer."""

    status = 502
    type = "server_error"
    code = "bad_gateway"


class GatewayTimeoutError(HTTPError):
    """504: the replica did not answer in time."""

    status = 504
    type = "server_error"
    code = "gateway_timeout"
