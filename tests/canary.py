"""Canary secrets: every key, token or password a test config holds is made here.

A canary is recognisable by :data:`MARK`; ``tests/conftest.py`` fails any test
during which one reached a log record or the bytes a test client read from a
socket (an asyncio stream: what the gateway answered). Secrets must never leave
the gateway, so a canary in either is a leak.
"""

from __future__ import annotations

MARK = "canary-secret"
MARK_BYTES = MARK.encode()


def secret(label: str) -> str:
    """A canary secret: ``canary-secret-<label>`` (letters, digits and ``-`` only)."""
    return f"{MARK}-{label}"


def secret_bytes(label: str) -> bytes:
    return secret(label).encode()
