"""The console's only way out: an async HTTP client for the admin API.

Plain asyncio streams (one short connection per call, bounded by a timeout), so a
slow or vanished gateway never blocks the UI: every call either answers, or raises
:class:`Unreachable` within ``timeout`` seconds. Errors carry the words the
console shows; the token is sent, never shown.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
from typing import Any
from urllib.parse import quote

import orjson

from ..cli._common import admin_url, grpc_port, tls_mismatch
from ..errors import unsendable_secret

__all__ = ["APIError", "AdminClient", "AuthError", "ClientError", "NotAdminAPI", "Unreachable", "quote_id"]

_BIG = 512 * 1024
MAX_BODY = 256 * 1024 * 1024  # 8,000 GPUs are ~10 MB of JSON; this only stops a runaway answer


class ClientError(Exception):
    """Any failed call; ``str()`` is what to show."""


class Unreachable(ClientError):
    """The admin API did not answer (refused, timed out, reset, not HTTP)."""


class AuthError(ClientError):
    """401: no token, or the wrong one."""


class APIError(ClientError):
    """The API answered an error (its OpenAI-shaped message)."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class NotAdminAPI(APIError):
    """What answered is an llmgw, but not its admin API (the client port): the header says so."""


def quote_id(s: str) -> str:
    """A path segment (ids may hold ``/`` or spaces)."""
    return quote(s, safe="")


class AdminClient:
    """Calls to one admin API.

    Args:
        admin: its URL (``http://host:port``; a bare ``host:port`` means http).
        token: the admin token (``Authorization: Bearer``), or ``None``.
        timeout: seconds one call may take, connection included.

    Raises:
        ValueError: ``admin`` is not a usable URL, or ``token`` cannot be sent (a line break, a control
            character, whitespace at either end; the message names where it came from, never the token).
    """

    def __init__(self, admin: str, token: str | None = None, timeout: float = 5.0) -> None:
        parts = self._parts = admin_url(admin)  # (ValueError: one line naming --admin and the fix, as llmgw ctl's)
        self.https = parts.https
        self.host = parts.host
        self.port = parts.port
        self.base = parts.base
        self.url = parts.url
        self.timeout = timeout
        if token:
            why = unsendable_secret(token)
            if why is not None:
                # SECURITY: refused at start, never quoted: sent, its line break would split the request
                # (the API then answers "malformed HTTP request" to every call). Where it came from:
                # LLMGW_ADMIN_TOKEN when that holds it (llmgw console's --token falls back to it), else --token.
                where = "LLMGW_ADMIN_TOKEN" if os.environ.get("LLMGW_ADMIN_TOKEN") == token else "--token"
                raise ValueError(f"{where} {why}")
        self._token = token or None
        self._ssl: ssl.SSLContext | None = ssl.create_default_context() if self.https else None
        self._host_header = parts.netloc

    @property
    def has_token(self) -> bool:
        return self._token is not None

    async def get(self, path: str) -> Any:
        return await self.call("GET", path)

    async def post(self, path: str, body: Any = None) -> Any:
        return await self.call("POST", path, body)

    async def call(self, method: str, path: str, body: Any = None) -> Any:
        """One call; the decoded JSON answer.

        Raises:
            Unreachable, AuthError, APIError.
        """
        try:
            async with asyncio.timeout(self.timeout):
                status, raw = await self._exchange(method, path, body)
        except TimeoutError:
            raise Unreachable(f"no answer within {self.timeout:g}s") from None
        except ConnectionRefusedError:
            raise Unreachable("connection refused") from None
        except socket.gaierror:
            raise Unreachable(f"unknown host {self.host}") from None
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            raise Unreachable(tls_mismatch(exc, self._parts) or str(exc) or type(exc).__name__) from None
        try:
            if len(raw) > _BIG:
                # PERF: 8,000 GPUs are megabytes of JSON: decoded in a thread, the UI keeps its turns
                payload = await asyncio.to_thread(orjson.loads, raw)
            else:
                payload = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            payload = None
        if status >= 400:
            err = payload.get("error") if isinstance(payload, dict) else None
            message = err.get("message") if isinstance(err, dict) else None
            code = err.get("code") if isinstance(err, dict) else None
            if status == 401:
                if self._token is None:
                    raise AuthError("the admin API needs a token: pass --token or set LLMGW_ADMIN_TOKEN")
                raise AuthError("the admin API refused the token: check --token or LLMGW_ADMIN_TOKEN")
            if status == 404 and message and "OpenAI API" in message:
                raise NotAdminAPI(status, f"{self.url} is the client port, not the admin port; pass the admin "
                                  "address with --admin URL", code if isinstance(code, str) else None)
            raise APIError(status, message or f"the admin API answered HTTP {status}", code if isinstance(code, str)
                           else None)
        if payload is None:
            raise Unreachable(f"{self.url} did not answer JSON; is it llmgw's admin address?")
        return payload

    async def _exchange(self, method: str, path: str, body: Any) -> tuple[int, bytes]:
        reader, writer = await asyncio.open_connection(
            self.host, self.port, ssl=self._ssl, server_hostname=self.host if self._ssl else None
        )
        try:
            data = orjson.dumps(body) if body is not None else b""
            head = [f"{method} {self.base}{path} HTTP/1.1", f"host: {self._host_header}", "connection: close",
                    "accept: application/json", f"content-length: {len(data)}"]
            if body is not None:
                head.append("content-type: application/json")
            auth = b""
            if self._token:
                # (UTF-8, the bytes the gateway compares admin_token by; latin-1 would fail on a non-latin-1 one)
                auth = f"authorization: Bearer {self._token}\r\n".encode()
            writer.write(("\r\n".join(head) + "\r\n").encode("latin-1") + auth + b"\r\n" + data)
            status_line = await reader.readline()
            bits = status_line.split(b" ", 2)
            if len(bits) < 2 or not bits[0].startswith(b"HTTP/1."):
                if status_line.startswith(b"\x00"):  # (an HTTP/2 frame header, a length's high byte: gRPC)
                    raise NotAdminAPI(0, grpc_port(self.url), "grpc_port")
                raise ValueError("the answer is not HTTP")
            status = int(bits[1])
            length: int | None = None
            chunked = False
            while True:
                line = await reader.readline()
                if line in (b"\r\n", b"\n", b""):
                    break
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    length = int(value.strip())
                elif name == b"transfer-encoding" and b"chunked" in value.lower():
                    chunked = True
            if method == "HEAD":
                return status, b""
            if chunked:
                parts: list[bytes] = []
                total = 0
                while True:
                    size = int((await reader.readline()).split(b";", 1)[0].strip() or b"0", 16)
                    if size == 0:
                        break
                    total += size
                    if total > MAX_BODY:
                        raise ValueError("the answer is too large")
                    parts.append(await reader.readexactly(size))
                    await reader.readline()
                return status, b"".join(parts)
            if length is not None:
                if length > MAX_BODY:
                    raise ValueError("the answer is too large")
                return status, await reader.readexactly(length)
            return status, await reader.read(MAX_BODY)
        finally:
            writer.close()
