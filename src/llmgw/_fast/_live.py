"""Live-object counters of the compiled debug build.

In a build made with ``LLMGW_DEBUG_BUILD=1`` the data path's per-connection and
per-request objects count themselves here when made and when freed, so a test
can assert that a connection, a call or an upstream connection it caused is
gone once it ends (as uvloop's test base does with its handles). In release
builds and the pure twins nothing counts: :data:`enabled` is false.
"""

from __future__ import annotations

__all__ = ["KINDS", "counts", "enabled", "freed", "live", "made"]

KINDS = ("connections", "writers", "calls", "upstream_connections")

counts: dict[str, int] = dict.fromkeys(KINDS, 0)

enabled = False  # set by the compiled server module of a debug build when it loads


def live() -> dict[str, int]:
    """Objects of each kind made and not yet freed."""
    return dict(counts)


def made(kind: str) -> None:
    counts[kind] += 1


def freed(kind: str) -> None:
    try:
        counts[kind] -= 1
    except Exception:  # interpreter shutdown: the module may be half gone
        pass
