"""llmgw's exceptions.

Pure Python, so that the compiled modules and their twins raise the same classes.
Request-path errors carry the HTTP ``status`` and the OpenAI error ``type`` and
``code`` they become, so the server turns any of them into a response in one place
(the HTTP server's ``ResponseWriter.send_error``, whose body is
:func:`llmgw.http.server.error_body`). Messages are public: they never contain a
secret.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BadGatewayError",
    "BadRequestError",
    "ConfigError",
    "ConfigProblem",
    "GatewayTimeoutError",
    "HTTPError",
    "HeadersTooLargeError",
    "InternalError",
    "LlmgwError",
    "MethodNotAllowedError",
    "ModelNotFoundError",
    "ModelUnavailableError",
    "NotFoundError",
    "OverloadedError",
    "PayloadTooLargeError",
    "PromParseError",
    "RateLimitedError",
    "ShuttingDownError",
    "StartupError",
    "UnauthorizedError",
    "UpstreamAuthError",
    "unsendable_secret",
]


class LlmgwError(Exception):
    """Root of every error llmgw raises on purpose."""


class InternalError(LlmgwError, AssertionError):
    """A bug in llmgw itself: an invariant did not hold."""


class StartupError(LlmgwError, RuntimeError):
    """A part of the process could not start (a database it cannot use, an address it cannot
    bind); the message is whole: what failed, why, and what to do. ``llmgw serve`` prints it as is."""


@dataclass(frozen=True, slots=True)
class ConfigProblem:
    """One problem in a configuration: where it is and what is wrong.

    ``source`` is the file (``None`` for a document given as data), ``key`` the
    dotted path of the key (``endpoints[2].url``; empty for the file as a whole),
    ``line`` its 1-based YAML line when known. ``str()`` is the one-line form
    ``llmgw.yaml:14: endpoints[2].url: not a URL (expected http://host:port)``.
    """

    key: str
    message: str
    source: str | None = None
    line: int | None = None

    def __str__(self) -> str:
        where = self.source or ""
        if self.line is not None:
            where = f"{where}:{self.line}" if where else f"line {self.line}"
        return ": ".join([p for p in (where, self.key) if p] + [self.message])

    def as_dict(self) -> dict[str, Any]:
        """The JSON form (``llmgw check-config --json``)."""
        return {"file": self.source, "key": self.key, "line": self.line, "message": self.message}


class ConfigError(LlmgwError, ValueError):
    """The configuration is invalid.

    ``problems`` lists every problem found in one pass (a loader reports them all
    rather than stopping at the first, so one edit fixes a file). ``key``,
    ``message``, ``source`` and ``line`` are those of the first problem, for the
    callers that report one; ``str()`` is every problem, one per line.

    ``ConfigError(key, message, source=...)`` makes an error of one problem;
    ``ConfigError(problems=[...])`` one of several.
    """

    def __init__(
        self,
        key: str = "",
        message: str = "",
        *,
        source: str | None = None,
        line: int | None = None,
        problems: Iterable[ConfigProblem] | None = None,
    ) -> None:
        found = tuple(problems) if problems is not None else ()
        self.problems: tuple[ConfigProblem, ...] = found or (ConfigProblem(key, message, source, line),)
        first = self.problems[0]
        self.key = first.key
        self.message = first.message
        self.source = first.source
        self.line = first.line
        super().__init__("\n".join(str(p) for p in self.problems))


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
        param: the request parameter at fault, if any (a class may set its own default).
        retry_after: seconds for a ``Retry-After`` header, if any.
        close: whether the connection must be closed after the answer.
        headers: more header lines of the answer, ``((name, value), ...)`` as bytes
            (e.g. ``Allow`` on a 405).
        should_retry: ``False``: the answer carries ``x-should-retry: false``, which
            the OpenAI SDKs obey (they retry 408, 409, 429 and 5xx unless told not
            to): set on answers a retry would only repeat. ``None``: no header.
    """

    status = 500
    type = "server_error"
    code: str | None = "internal_error"
    param: str | None = None
    close = False
    headers: tuple[tuple[bytes, bytes], ...] = ()
    should_retry: bool | None = None

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
        headers: tuple[tuple[bytes, bytes], ...] | None = None,
        should_retry: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if param is not None:
            self.param = param
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        if type is not None:
            self.type = type
        if close is not None:
            self.close = close
        if headers is not None:
            self.headers = headers
        if should_retry is not None:
            self.should_retry = should_retry
        self.retry_after = retry_after


class BadRequestError(HTTPError):
    """400: malformed HTTP, bad JSON, a missing or invalid field."""

    status = 400
    type = "invalid_request_error"
    code = "invalid_request"
    should_retry = False  # the same request gets the same answer


class UnauthorizedError(HTTPError):
    """401: no API key or a wrong one. A 401 names the scheme that would work
    (RFC 9110 §11.6.1: it MUST send WWW-Authenticate; RFC 6750 §3 for Bearer)."""

    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"
    headers = ((b"www-authenticate", b"Bearer"),)


class NotFoundError(HTTPError):
    """404: no such route."""

    status = 404
    type = "invalid_request_error"
    code = "not_found"
    should_retry = False  # the same request gets the same answer


class MethodNotAllowedError(HTTPError):
    """405: the route exists, not for this method; ``Allow`` names the methods it takes (RFC 9110 §15.5.6)."""

    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"

    def __init__(self, message: str, allow: tuple[str, ...]) -> None:
        super().__init__(message, headers=((b"allow", ", ".join(allow).encode("ascii")),))
        self.allow = allow


class VersionNotSupportedError(HTTPError):
    """505: a request line in an HTTP version other than 1.0 and 1.1 (RFC 9110 §15.6.6)."""

    status = 505
    type = "invalid_request_error"
    code = "http_version_not_supported"
    close = True
    should_retry = False


class ModelNotFoundError(HTTPError):
    """404: the fleet serves no model by that name (``param`` ``model``, as OpenAI's, whether the
    name came in a request body or in ``GET /v1/models/{model}``)."""

    status = 404
    type = "invalid_request_error"
    code = "model_not_found"
    param = "model"
    should_retry = False  # the same request gets the same answer


class PayloadTooLargeError(HTTPError):
    """413: the request body exceeds the configured limit."""

    status = 413
    type = "invalid_request_error"
    code = "request_too_large"
    close = True
    should_retry = False  # the same request gets the same answer


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


class ModelUnavailableError(HTTPError):
    """503: every replica of the model is down (unreachable, stale, breaker open, draining);
    answered at once, never queued; ``retry_after`` is when one may be back."""

    status = 503
    type = "service_unavailable_error"
    code = "model_unavailable"


class ShuttingDownError(HTTPError):
    """503: the gateway is shutting down (a request it had queued, or one still running
    at ``server.shutdown_timeout``); retry, on another instance if there is one."""

    status = 503
    type = "service_unavailable_error"
    code = "shutting_down"


class BadGatewayError(HTTPError):
    """502: the replica failed before a complete answer."""

    status = 502
    type = "server_error"
    code = "bad_gateway"


class UpstreamAuthError(HTTPError):
    """502: a replica refused the key llmgw sends it (401/403): llmgw's config is wrong, not the client's key.

    Its own class, not a :class:`BadGatewayError` (and not a 401, which would tell
    the client that *its* key is bad), so that what is keyed on error classes
    (retry advice to clients, counting) can tell it apart: retrying does not help
    until the gateway's configuration is fixed.
    """

    status = 502
    type = "server_error"
    code = "upstream_auth_failed"
    should_retry = False  # retrying does not help until the gateway's configuration is fixed


class GatewayTimeoutError(HTTPError):
    """504: the replica did not answer in time."""

    status = 504
    type = "server_error"
    code = "gateway_timeout"


def unsendable_secret(secret: str) -> str | None:
    """Why a secret cannot be sent as it is (in an ``Authorization`` header, a gRPC metadata value): a
    line break or another control character, or whitespace at either end (HTTP strips it from a header
    value); ``None`` when it can. Said of a secret from a file or an environment variable, where a
    trailing newline is common: every client would be refused, or one that sent it would fail with the
    secret in its traceback. The words never quote the secret."""
    if not secret.isprintable():
        return "holds a line break or another control character (a trailing newline from a file?): remove it"
    if secret != secret.strip():
        return "starts or ends with whitespace: remove it"
    return None
