"""What the data path reports as it works, for metrics and logs.

The gateway calls these hooks on its hot path, so an implementation must be
cheap: increment a counter, observe a histogram, nothing that allocates per call
beyond that. :class:`NullObserver` does nothing (metrics off);
``llmgw.admin.metrics.PrometheusObserver`` feeds the admin ``/metrics``.

Upstream error ``kind`` values: ``connect_refused``, ``connect_timeout``,
``reset`` (the replica closed the connection), ``first_byte_timeout``,
``read_timeout``, ``bad_response`` (not valid HTTP), ``status_5xx``.
Admission ``outcome``: ``admitted`` (straight through), ``queued``, ``dequeued``,
``rejected``; ``reason`` for rejections: ``queue_full``, ``queue_timeout``,
``evicted``, ``client_gone`` (the client left while queued).
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["NullObserver", "Observer"]


class Observer(Protocol):
    """The data path's reporting hooks."""

    def request_done(
        self,
        model: str,
        replica: str | None,
        status: int,
        band: str,
        duration: float,
        ttfb: float | None,
        upstream: float | None,
    ) -> None:
        """A client request finished (any outcome). Times in seconds; ``None`` when not reached."""

    def upstream_error(self, replica: str, kind: str) -> None:
        """An attempt on ``replica`` failed (see the module docstring for ``kind``)."""

    def retry(self, model: str, replica: str) -> None:
        """A request is retried on another replica (``replica`` failed)."""

    def tokens(self, model: str, prompt: int, completion: int) -> None:
        """A response reported its token usage."""

    def admission(self, band: str, outcome: str, reason: str = "") -> None:
        """An admission decision."""

    def breaker_transition(self, replica: str, state: str) -> None:
        """A replica's circuit breaker moved to ``state`` (closed, open, half_open)."""


class NullObserver:
    """Reports nothing."""

    def request_done(
        self,
        model: str,
        replica: str | None,
        status: int,
        band: str,
        duration: float,
        ttfb: float | None,
        upstream: float | None,
    ) -> None:
        pass

    def upstream_error(self, replica: str, kind: str) -> None:
        pass

    def retry(self, model: str, replica: str) -> None:
        pass

    def tokens(self, model: str, prompt: int, completion: int) -> None:
        pass

    def admission(self, band: str, outcome: str, reason: str = "") -> None:
        pass

    def breaker_transition(self, replica: str, state: str) -> None:
        pass
