"""Join tokens made through the management API (``llmgw ctl tokens create|list|revoke``).

Beside the tokens of the config file (``control.join_token_env`` / ``join_token``, which keep
working as before), an operator makes tokens at run time: each has an id (shown, not secret),
an optional name and expiry, and a secret shown once, in the answer that created it. The
secret reads ``llmgw-join-<id>-<43 random characters>`` (256 random bits; the prefix makes a
leaked one recognisable to secret scanners). Only its SHA-256 is kept, in the database
(:class:`~.db.ApiTokenStore`) and in memory (:class:`JoinTokens`, what the gRPC handlers check).

**How a node is authenticated after it joined.** The agent sends its join token on every call:
Register, and every heartbeat (each message of its heartbeat stream is checked again). There is
no separate node identity issued at join to fall back on (the mirror credential a registration
hands out opens only the blob mirror). So a revoked (or expired) token is refused at the agent's
next heartbeat, with UNAUTHENTICATED and a message naming the token's id and why; the agent's
run ends there (a refusal retrying cannot fix), and the mirror credentials of the nodes that
registered with that token are revoked at once. Running replicas are not stopped by it: the
node's replicas are the leader's decision, not the token's.

**Every control plane at once.** The leader writes (fenced by its epoch); every control plane
loads the rows at start and on election (before it acts), and a standby reads them again every
third of the lease, so whichever process an agent reaches honours a revocation. A read is
merged one way (:meth:`JoinTokens.merge`): it never clears a revocation, and one that began
before a change made here (:attr:`JoinTokens.version`) drops no token.

Expiry is judged on this process's wall clock against the creating leader's (``created_at``,
``expires_at``): honoured to within the skew between the control planes' clocks.

``last_used_at`` is kept in memory per check and written by the leader at most once per
flush period (never a write per heartbeat).

SECURITY: a secret is never logged, put in an error, a metric or a list answer; the list shows
neither it nor its digest. Lookups are by digest, then one constant-time comparison, hit or miss.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

__all__ = ["TOKEN_PREFIX", "JoinToken", "JoinTokens", "new_token", "parse_expiry"]

TOKEN_PREFIX = "llmgw-join-"
MAX_NAME = 100
MAX_EXPIRY_S = 10 * 365 * 86400.0
_ID = re.compile(r"^[0-9a-f]{8}$")
_DUMMY = hashlib.sha256(b"llmgw: no such join token").digest()


@dataclass(frozen=True, slots=True)
class JoinToken:
    """One API-made join token as every control plane knows it (no secret in it)."""

    id: str
    name: str | None
    digest: bytes
    created_at: float
    expires_at: float | None = None
    revoked_at: float | None = None
    last_used_at: float | None = None

    def __repr__(self) -> str:  # (the digest is not shown either)
        return f"JoinToken({self.id!r}, name={self.name!r})"

    def state(self, now: float) -> str:
        """``active``, ``expired`` or ``revoked``."""
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at is not None and now >= self.expires_at:
            return "expired"
        return "active"

    def view(self, now: float, last_used: float | None = None) -> dict[str, Any]:
        """What the API lists (times as Unix seconds; ``None``: never, absent is not zero)."""
        used = max((t for t in (self.last_used_at, last_used) if t is not None), default=None)
        return {
            "id": self.id, "name": self.name, "state": self.state(now), "created_at": self.created_at,
            "expires_at": self.expires_at, "revoked_at": self.revoked_at, "last_used_at": used,
        }

    @classmethod
    def from_row(cls, row: tuple[Any, ...]) -> JoinToken:
        tid, name, sha, created, expires, revoked, used = row
        return cls(str(tid), name, bytes.fromhex(sha), float(created), _opt(expires), _opt(revoked), _opt(used))


def _opt(v: Any) -> float | None:
    return None if v is None else float(v)


def new_token() -> tuple[str, str]:
    """``(id, secret)`` of a new token (the secret is the only copy: hand it over once, never log it)."""
    tid = secrets.token_hex(4)
    return tid, f"{TOKEN_PREFIX}{tid}-{secrets.token_urlsafe(32)}"


def valid_id(token_id: str) -> bool:
    return bool(_ID.fullmatch(token_id))


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}


def parse_expiry(value: Any) -> float | None:
    """Seconds from ``"90s"``, ``"30m"``, ``"12h"``, ``"7d"``, ``"2w"`` or a positive number; ``None``: never.

    Raises:
        ValueError: anything else (the message says what is accepted).
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError("expires: a duration like 30m, 12h or 7d")
    if isinstance(value, int | float):
        secs = float(value)
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", value)
        if m is None:
            raise ValueError(f"expires: {value[:40]!r} is not a duration like 30m, 12h or 7d")
        secs = float(m.group(1)) * _UNITS[m.group(2) or "s"]
    else:
        raise ValueError("expires: a duration like 30m, 12h or 7d")
    if not 0 < secs <= MAX_EXPIRY_S:
        raise ValueError("expires: more than 0 and at most 10 years")
    return secs


class JoinTokens:
    """The API-made tokens by digest (thread-safe: checked on the control thread, changed on the main loop)."""

    __slots__ = ("_by_digest", "_by_id", "_flushed", "_lock", "_nodes", "_used", "_version")

    def __init__(self) -> None:
        self._by_digest: dict[bytes, JoinToken] = {}
        self._by_id: dict[str, JoinToken] = {}
        self._used: dict[str, float] = {}
        """Token id -> when this process last accepted it (wall clock)."""
        self._flushed: dict[str, float] = {}
        """What of that is in the database."""
        self._nodes: dict[str, str] = {}
        """Registered node name -> the id of the API token it registered with (:meth:`joined`, :meth:`forget`)."""
        self._version = 0
        """Counts this process's own changes (:meth:`put`, :meth:`revoked`): a read older than one is stale."""
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"JoinTokens({len(self._by_id)} token(s))"

    def __len__(self) -> int:
        return len(self._by_id)

    def replace(self, tokens: Iterable[JoinToken]) -> None:
        """Make the set ``tokens`` (only where nothing else can have changed it: a test, a fresh set)."""
        by_id = {t.id: t for t in tokens}
        with self._lock:
            self._by_id = by_id
            self._by_digest = {t.digest: t for t in by_id.values()}
            self._version += 1

    @property
    def version(self) -> int:
        """Take it before reading the rows, pass it to :meth:`merge`."""
        return self._version

    def merge(self, tokens: Iterable[JoinToken], since: int) -> None:
        """Take in the rows read from the database (a read begun at :attr:`version` ``since``), one way only.

        A revocation known here is never undone by a read (one that began before the revoke committed
        answers without it), and a token this process added since the read began is kept; a token the
        rows lack is dropped only when nothing changed here since the read began.
        """
        loaded = list(tokens)
        with self._lock:
            stale = self._version != since
            by_id: dict[str, JoinToken] = {}
            for t in loaded:
                old = self._by_id.get(t.id)
                if old is not None and old.revoked_at is not None and (
                        t.revoked_at is None or old.revoked_at < t.revoked_at):
                    t = replace(t, revoked_at=old.revoked_at)
                by_id[t.id] = t
            if stale:
                for i, old in self._by_id.items():
                    by_id.setdefault(i, old)
            self._by_id = by_id
            self._by_digest = {t.digest: t for t in by_id.values()}

    def put(self, t: JoinToken) -> None:
        with self._lock:
            old = self._by_id.get(t.id)
            if old is not None:
                self._by_digest.pop(old.digest, None)
            self._by_id[t.id] = t
            self._by_digest[t.digest] = t
            self._version += 1

    def get(self, token_id: str) -> JoinToken | None:
        return self._by_id.get(token_id)

    def all(self) -> list[JoinToken]:
        with self._lock:
            return sorted(self._by_id.values(), key=lambda t: (t.created_at, t.id))

    def revoked(self, token_id: str, at: float) -> list[str]:
        """Mark ``token_id`` revoked here; the nodes that registered with it (their mirror access goes)."""
        with self._lock:
            t = self._by_id.get(token_id)
            if t is not None and t.revoked_at is None:
                t = replace(t, revoked_at=at)
                self._by_id[token_id] = t
                self._by_digest[t.digest] = t
                self._version += 1
            return [n for n, i in self._nodes.items() if i == token_id]

    def joined(self, node: str, given: str) -> None:
        """``node`` registered (validated, recorded) presenting ``given``: remembered when an API token."""
        if not given.startswith(TOKEN_PREFIX):
            return
        digest = hashlib.sha256(given.encode("utf-8", "surrogateescape")).digest()
        with self._lock:
            t = self._by_digest.get(digest)
            if t is not None:
                self._nodes[node] = t.id
            else:
                self._nodes.pop(node, None)

    def forget(self, node: str) -> None:
        """``node`` left the cluster (deregistered or removed)."""
        with self._lock:
            self._nodes.pop(node, None)

    def dead_nodes(self, now: float) -> list[str]:
        """The registered nodes whose token is revoked or expired by ``now`` (their mirror access goes)."""
        with self._lock:
            return [n for n, i in self._nodes.items()
                    if (t := self._by_id.get(i)) is not None and t.state(now) != "active"]

    def check(self, given: str, now: float | None = None) -> tuple[str, JoinToken | None]:
        """``("ok" | "revoked" | "expired" | "unknown", the token or None)`` for a presented secret.

        SECURITY: looked up by digest, then one constant-time comparison whether or not it was found.
        """
        if not given.startswith(TOKEN_PREFIX):
            return "unknown", None
        digest = hashlib.sha256(given.encode("utf-8", "surrogateescape")).digest()
        with self._lock:
            t = self._by_digest.get(digest)
        ok = hmac.compare_digest(digest, t.digest if t is not None else _DUMMY)
        if not ok or t is None:
            return "unknown", None
        at = time.time() if now is None else now
        state = t.state(at)
        if state != "active":
            return state, t
        with self._lock:
            self._used[t.id] = at
        return "ok", t

    def last_used(self, token_id: str) -> float | None:
        return self._used.get(token_id)

    def unflushed(self) -> dict[str, float]:
        """Ids whose last use is newer than what the database has (for :meth:`flushed`)."""
        with self._lock:
            return {i: at for i, at in self._used.items() if self._flushed.get(i) != at}

    def flushed(self, used: Mapping[str, float]) -> None:
        with self._lock:
            self._flushed.update(used)
