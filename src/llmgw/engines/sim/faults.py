"""Fault switches of the simulated engine.

Each fault fires for the next ``*_next`` inference requests, then for each later one
with probability ``*_rate``; it is off while both are 0. Only inference requests
(chat, completions, embeddings) draw faults; health, models, metrics and the
control endpoint never fail. Faults are drawn in this order, at most one each:
drop, error, hang, cut.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, fields
from typing import Any

from ...errors import ConfigError

__all__ = ["FAULT_KEYS", "SimFaults"]


@dataclass(slots=True)
class SimFaults:
    """The fault switches in force; mutable at run time.

    Attributes:
        drop_rate / drop_next: close the connection as soon as the request has arrived,
            without an answer (an engine that crashed or restarted after reading it).
        drop_how: ``reset`` (a TCP reset: SO_LINGER 0, then close) or ``eof`` (an
            orderly close: the client reads an end of stream).
        error_rate / error_next: answer ``error_status`` at once, in the engine's error shape.
        error_status: the 5xx status of injected errors (500..599).
        cut_rate / cut_next: cut the connection (TCP abort) after ``cut_after_chunks`` SSE
            events of a stream (0: right after the response head); a non-streamed request
            is cut when its answer would have been sent.
        cut_after_chunks: see above.
        hang_rate / hang_next: take a slot and never answer; with ``hang_after_chunks`` set,
            a stream stops after that many SSE events instead. The request keeps its slot
            until the client goes away or the engine stops.
        hang_after_chunks: see above (``None``: hang before the response head).
        extra_latency_ms: added to every request's time to first token.
    """

    drop_rate: float = 0.0
    drop_next: int = 0
    drop_how: str = "reset"
    error_rate: float = 0.0
    error_next: int = 0
    error_status: int = 500
    cut_rate: float = 0.0
    cut_next: int = 0
    cut_after_chunks: int = 0
    hang_rate: float = 0.0
    hang_next: int = 0
    hang_after_chunks: int | None = None
    extra_latency_ms: float = 0.0

    def update(self, changes: dict[str, Any], *, source: str | None = None) -> None:
        """Apply ``changes`` (keys as the attributes), all or nothing.

        Setting ``cut_after_chunks`` (or ``hang_after_chunks``) without a rate or a
        count for that fault in the same call turns it on for every request
        (``*_rate = 1``). ``{"reset": true}`` first restores every default.

        Raises:
            ConfigError: an unknown key or a value out of range (nothing is changed).
        """
        new = SimFaults() if changes.get("reset") else SimFaults(**asdict(self))
        for key, value in changes.items():
            if key == "reset":
                if not isinstance(value, bool):
                    raise ConfigError("reset", "must be true or false", source=source)
                continue
            if key not in FAULT_KEYS:
                raise ConfigError(key, f"unknown fault; known: {', '.join(FAULT_KEYS)}", source=source)
            setattr(new, key, _check(key, value, source))
        for kind in ("cut", "hang"):
            if (
                f"{kind}_after_chunks" in changes
                and changes[f"{kind}_after_chunks"] is not None
                and f"{kind}_rate" not in changes
                and f"{kind}_next" not in changes
            ):
                setattr(new, f"{kind}_rate", 1.0)
        for f in FAULT_KEYS:
            setattr(self, f, getattr(new, f))

    def as_dict(self) -> dict[str, Any]:
        """The switches as plain JSON values."""
        return asdict(self)

    # -- draws (one per inference request, in this order) --

    def draw_drop(self, rng: random.Random) -> bool:
        if self.drop_next > 0:
            self.drop_next -= 1
            return True
        return self.drop_rate > 0 and rng.random() < self.drop_rate

    def draw_error(self, rng: random.Random) -> int:
        """The status to answer with, or 0 for no injected error."""
        if self.error_next > 0:
            self.error_next -= 1
            return self.error_status
        if self.error_rate > 0 and rng.random() < self.error_rate:
            return self.error_status
        return 0

    def draw_hang(self, rng: random.Random) -> bool:
        if self.hang_next > 0:
            self.hang_next -= 1
            return True
        return self.hang_rate > 0 and rng.random() < self.hang_rate

    def draw_cut(self, rng: random.Random) -> bool:
        if self.cut_next > 0:
            self.cut_next -= 1
            return True
        return self.cut_rate > 0 and rng.random() < self.cut_rate


FAULT_KEYS: tuple[str, ...] = tuple(f.name for f in fields(SimFaults))
DROP_HOW: tuple[str, ...] = ("reset", "eof")


def _check(key: str, value: Any, source: str | None) -> Any:
    def bad(what: str) -> ConfigError:
        return ConfigError(key, f"must be {what}, not {value!r}", source=source)

    if key.endswith("_rate"):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise bad("a probability between 0 and 1")
        return float(value)
    if key == "error_status":
        if isinstance(value, bool) or not isinstance(value, int) or not 500 <= value <= 599:
            raise bad("a 5xx status code")
        return value
    if key == "extra_latency_ms":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 3_600_000:
            raise bad("a number of milliseconds between 0 and 3600000")
        return float(value)
    if key == "drop_how":
        if value not in DROP_HOW:
            raise bad(" or ".join(DROP_HOW))
        return value
    if key == "hang_after_chunks" and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise bad("a non-negative integer")
    return value
