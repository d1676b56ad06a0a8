"""Canary secrets: every key, token or password a test config holds is made here.

A canary is recognisable by :data:`MARK`; ``tests/conftest.py`` fails any test
during which one reached a log record or the bytes a test client read from a
socket (an asyncio stream: what the gateway answered), the output a test captured
from a process (``Popen.communicate``, ``subprocess.run``, click's ``CliRunner``),
and what the agents it ran logged (:func:`check_text`).
Secrets must never leave the gateway, so a canary in any of them is a leak.
"""

from __future__ import annotations

MARK = "canary-secret"
MARK_BYTES = MARK.encode()


leaks: list[str] = []
"""What leaked during the current test (``tests/conftest.py`` fails the test when it is not empty)."""


def check_text(where: str, text: str) -> None:
    """Note a leak when ``text`` (what a process wrote, say) carries a canary secret."""
    at = text.find(MARK)
    if at >= 0:
        leaks.append(f"{where}: {text[max(0, at - 120) : at + 60]!r}")


def secret(label: str) -> str:
    """A canary secret: ``canary-secret-<label>`` (letters, digits and ``-`` only)."""
    return f"{MARK}-{label}"


def secret_bytes(label: str) -> bytes:
    return secret(label).encode()
