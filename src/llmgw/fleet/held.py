"""Models the data path answers 503 ``model_unavailable`` rather than 404 while no replica serves them.

The gateway reads ``held_models`` only on its cold path (a model with no pool, or one without
replicas) and says ``reason`` when the container has one. Who holds what: a control plane's
deployments (their served names), a control plane still loading them and a router before its first
replica table (every name: any model may be one of theirs), a standby (the deployments' names).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = ["HeldModels"]


class HeldModels(frozenset[str]):
    """Names held, and why (``reason``, said in the 503; ``reasons``: a name's own, over it; neither: the
    data path's own words for a deployed model with no replica); ``every``: every name is held."""

    reason: str
    reasons: Mapping[str, str]
    every: bool

    def __new__(cls, names: Iterable[str] = (), *, reason: str = "", every: bool = False,
                reasons: Mapping[str, str] | None = None) -> HeldModels:
        held = super().__new__(cls, names)
        held.reason = reason
        held.reasons = reasons or {}
        held.every = every
        return held

    def __contains__(self, item: object) -> bool:
        return self.every or frozenset.__contains__(self, item)
