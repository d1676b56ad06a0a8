"""Per-node credentials: what a node agent presents to fetch blobs from the control plane's mirror.

The control plane issues one at registration (:meth:`NodeCredentials.issue`;
the RegisterResponse carries it to the agent), and the agent sends it as
``Authorization: Bearer <credential>`` on ``/mirror/v1/blobs/...`` of the admin
listener. It is not the admin token and not the join token: it names one node,
which can fetch only the blobs of replicas placed on it (the mirror's
authorizer), and it dies with the node (:meth:`NodeCredentials.revoke` when the
node deregisters or is removed; a new registration replaces it).

SECURITY: only the SHA-256 of each credential is kept. A credential is 256
random bits, so a fast hash is as good as a slow one here (nothing to brute
force). A presented credential is hashed and looked up by its hash; the stored
hash is then compared with :func:`hmac.compare_digest`, and a miss compares
against a dummy, so the time taken does not depend on how much of a guess was
right. Credentials never appear in logs, errors or reprs.

Kept in memory: a control plane that restarts has forgotten every node anyway
(agents register again, and get a new credential).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading

__all__ = ["CREDENTIAL_PREFIX", "NodeCredentials"]

CREDENTIAL_PREFIX = "llmgw-node-"
"""What every credential starts with (so a leaked one is recognisable, e.g. by secret scanners)."""

_DUMMY = hashlib.sha256(b"llmgw: no such credential").digest()


def _digest(credential: str | bytes) -> bytes:
    raw = credential.encode("utf-8", "surrogateescape") if isinstance(credential, str) else credential
    return hashlib.sha256(raw).digest()


class NodeCredentials:
    """The mirror credentials of the registered nodes, stored hashed.

    Thread-safe: registration may issue on the gRPC service's thread while the
    admin listener checks on the main loop (each call holds a lock for a few
    dictionary operations, never for I/O).
    """

    __slots__ = ("_by_digest", "_by_node", "_lock")

    def __init__(self) -> None:
        self._by_node: dict[str, bytes] = {}
        self._by_digest: dict[bytes, str] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"NodeCredentials({len(self._by_node)} node(s))"

    def __len__(self) -> int:
        return len(self._by_node)

    def __contains__(self, node: object) -> bool:
        return node in self._by_node

    def issue(self, node: str) -> str:
        """Make a new credential for ``node``, replacing (revoking) any it had; return it.

        The returned string is the only copy: hand it to the agent and do not log it.
        """
        if not node:
            raise ValueError("a credential needs a node name")
        with self._lock:
            self._revoke(node)
            for _ in range(8):  # (a collision of 256 random bits does not happen; bounded anyway)
                credential = CREDENTIAL_PREFIX + secrets.token_urlsafe(32)
                digest = _digest(credential)
                if digest not in self._by_digest:
                    break
            else:  # pragma: no cover
                raise RuntimeError("could not make a unique credential")
            self._by_node[node] = digest
            self._by_digest[digest] = node
        return credential

    def revoke(self, node: str) -> bool:
        """Forget ``node``'s credential; whether it had one."""
        with self._lock:
            return self._revoke(node)

    def _revoke(self, node: str) -> bool:
        digest = self._by_node.pop(node, None)
        if digest is None:
            return False
        self._by_digest.pop(digest, None)
        return True

    def node_for(self, credential: str | bytes | None) -> str | None:
        """The node ``credential`` belongs to, or ``None`` (unknown, revoked, empty)."""
        if not credential:
            return None
        digest = _digest(credential)
        with self._lock:
            node = self._by_digest.get(digest)
            stored = self._by_node.get(node) if node is not None else None
        # SECURITY: always one constant-time comparison, hit or miss.
        ok = hmac.compare_digest(digest, stored if stored is not None else _DUMMY)
        return node if ok and stored is not None else None
