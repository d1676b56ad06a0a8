# cython: annotation_typing=False
"""What the data path reports as it works, and the counters that keep it.

This file is both the pure-Python implementation and, compiled by Cython with the
declarations in ``counters.pxd``, the extension module ``llmgw._fast.counters``.
Import it through :mod:`llmgw.gateway.observe`.

The gateway calls an :class:`Observer`'s hooks on its hot path, so an
implementation must be cheap: increment a counter, nothing that allocates per
call beyond that. :class:`NullObserver` does nothing (metrics off);
:class:`TrafficCounters` counts in plain dicts, and the admin app renders them at
scrape time (``llmgw.admin.metrics.PrometheusObserver`` is one); the gateway
calls it through C.

Upstream error ``kind`` values: ``connect_refused``, ``connect_timeout``,
``reset`` (the replica closed the connection), ``first_byte_timeout``,
``read_timeout``, ``bad_response`` (not valid HTTP), ``status_5xx``.
Admission ``outcome``: ``admitted`` (straight through), ``queued``, ``dequeued``,
``rejected``; ``reason`` for rejections: ``queue_full``, ``queue_timeout``,
``evicted``, ``client_gone`` (the client left while queued), ``model_unavailable``
(every replica down: answered 503 at once, not queued), ``shutting_down``.
"""

from __future__ import annotations

from typing import Any, Protocol

from ..log import admin_logger

__all__ = ["OTHER", "Hist", "NullObserver", "Observer", "RequestSeries", "TrafficCounters"]


class Observer(Protocol):
    """The data path's reporting hooks."""

    def request_done(
        self,
        model: str,
        replica: str | None,
        status: int,
        band: str,
        duration: float | None,
        ttfb: float | None,
        upstream: float | None,
    ) -> None:
        """A client request finished (any outcome). Times in seconds; ``None`` when not reached
        (``duration`` ``None``: an answer that is counted but kept out of the latency histograms,
        as a local answer naming no served model)."""

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
        duration: float | None,
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


# Label value for series past a family's limit.
OTHER = "(other)"


class Hist:
    """One histogram series: per-bucket (not cumulative) counts, the last one +Inf."""

    __slots__ = ("counts", "total")

    def __init__(self, n_bounds: int) -> None:
        self.counts: list[int] = [0] * (n_bounds + 1)
        self.total = 0.0


class RequestSeries:
    """One (model, replica, status, band) combination and the histograms it feeds."""

    __slots__ = ("dur", "mb", "n", "ttfb", "up")

    def __init__(self, mb: tuple[str, str], up: Hist | None) -> None:
        self.n = 0
        self.mb = mb  # (model, band): the key of its duration and TTFB series
        self.dur: Hist | None = None  # (made on the first observation)
        self.ttfb: Hist | None = None
        self.up = up


class TrafficCounters:
    """The data path's observer hooks, counted in plain dicts keyed by label tuples.

    Implements :class:`Observer`. The gateway calls these
    directly from C when its observer is one of these (the admin app's
    ``PrometheusObserver`` is, and renders the dicts at scrape time); for a
    finished request it calls :meth:`record`, not :meth:`request_done`. Not
    thread-safe: hooks and reads happen on the event loop thread.

    Args:
        bounds: histogram upper bounds in seconds, ascending.
        max_series: distinct label sets kept per family before new ones are
            counted under ``(other)``.
    """

    def __init__(self, bounds: list[float], max_series: int) -> None:
        self.bounds = [float(b) for b in bounds]
        self.max_series = max_series
        self._requests: dict[tuple[str, str | None, int, str], RequestSeries] = {}
        self._duration: dict[tuple[str, str], Hist] = {}  # (model, band)
        self._ttfb: dict[tuple[str, str], Hist] = {}  # (model, band)
        self._upstream: dict[tuple[str, str], Hist] = {}  # (model, replica)
        self._tokens: dict[str, list[int]] = {}  # model -> [prompt, completion]
        self._errors: dict[tuple[str, str], int] = {}  # (replica, kind)
        self._retries: dict[str, int] = {}  # model
        self._admission: dict[tuple[str, str, str], int] = {}  # (band, outcome, reason)
        self._admitted: dict[str, int] = {}  # band -> admitted straight away (the common decision)
        self._breaker: dict[tuple[str, str], int] = {}  # (replica, state)
        self._overflowed: set[str] = set()

    def _bucket(self, value: float) -> int:
        """Index of the first bound >= ``value`` (``len(bounds)``: +Inf)."""
        bounds = self.bounds
        n = len(bounds)
        i = 0
        while i < n:
            b = bounds[i]
            if b >= value:
                break
            i += 1
        return i

    # -- the Observer hooks (hot path) --

    def request_done(
        self,
        model: str,
        replica: str | None,
        status: int,
        band: str,
        duration: float | None,
        ttfb: float | None,
        upstream: float | None,
    ) -> None:
        """A client request finished (any outcome). Times in seconds; ``None`` when not reached
        (``duration`` ``None``: counted, kept out of the latency histograms)."""
        self.record(model, replica, status, band, -1.0 if duration is None else duration,
                    -1.0 if ttfb is None else ttfb, -1.0 if upstream is None else upstream)

    def record(
        self, model: str, replica: str | None, status: int, band: str, duration: float, ttfb: float, upstream: float
    ) -> None:
        """:meth:`request_done` with ``-1.0`` for a time not reached (PERF: the gateway's
        call, with no float objects).

        A histogram series is made when its first observation comes, so no series
        stays empty (an answer naming no model has no duration or TTFB series)."""
        s = self._requests.get((model, replica, status, band))
        if s is None:
            s = self._new_requests(model, replica, status, band)
        s.n += 1
        if duration >= 0.0:
            h = s.dur
            if h is None:
                h = s.dur = self._hist(self._duration, s.mb)
            h.counts[self._bucket(duration)] += 1
            h.total += duration
        if ttfb >= 0.0:
            h = s.ttfb
            if h is None:
                h = s.ttfb = self._hist(self._ttfb, s.mb)
            h.counts[self._bucket(ttfb)] += 1
            h.total += ttfb
        if upstream >= 0.0:
            u = s.up
            if u is not None:
                u.counts[self._bucket(upstream)] += 1
                u.total += upstream

    def upstream_error(self, replica: str, kind: str) -> None:
        """An attempt on ``replica`` failed (``kind``: see the module docstring)."""
        key = (replica, kind)
        n = self._errors.get(key)
        if n is None:
            self._first(self._errors, key, "llmgw_upstream_errors_total", (OTHER, kind))
        else:
            self._errors[key] = n + 1

    def retry(self, model: str, replica: str) -> None:
        """A request is retried on another replica (``replica`` failed)."""
        n = self._retries.get(model)
        if n is None:
            self._first(self._retries, model, "llmgw_retries_total", OTHER)
        else:
            self._retries[model] = n + 1

    def tokens(self, model: str, prompt: int, completion: int) -> None:
        """A response reported its token usage."""
        t = self._tokens.get(model)
        if t is None:
            if len(self._tokens) >= self.max_series:
                self._overflow("llmgw_tokens_total")
                model = OTHER
            t = self._tokens.setdefault(model, [0, 0])
        t[0] += prompt
        t[1] += completion

    def admission(self, band: str, outcome: str, reason: str = "") -> None:
        """An admission decision."""
        if outcome == "admitted" and not reason:
            # PERF: one counter per band, no key tuple (see admission_totals)
            m = self._admitted.get(band)
            if m is None:
                self._first(self._admitted, band, "llmgw_admission_total", OTHER)
            else:
                self._admitted[band] = m + 1
            return
        key = (band, outcome, reason)
        n = self._admission.get(key)
        if n is None:
            self._first(self._admission, key, "llmgw_admission_total", (OTHER, outcome, reason))
        else:
            self._admission[key] = n + 1

    def breaker_transition(self, replica: str, state: str) -> None:
        """A replica's circuit breaker moved to ``state`` (closed, open, half_open)."""
        key = (replica, state)
        n = self._breaker.get(key)
        if n is None:
            self._first(self._breaker, key, "llmgw_breaker_transitions_total", (OTHER, state))
        else:
            self._breaker[key] = n + 1

    def admission_totals(self) -> dict[tuple[str, str, str], int]:
        """Admission decisions by (band, outcome, reason)."""
        out = dict(self._admission)
        for band, n in self._admitted.items():
            key = (band, "admitted", "")
            out[key] = out.get(key, 0) + n
        return out

    # -- first sight of a label set (cold path) --

    def _first(self, d: dict[Any, int], key: Any, family: str, other: Any) -> None:
        if len(d) >= self.max_series:
            self._overflow(family)
            key = other
        d[key] = d.get(key, 0) + 1

    def _overflow(self, family: str) -> None:
        if family not in self._overflowed:
            self._overflowed.add(family)
            admin_logger.warning(
                "%s has %d label sets; new ones are counted under %r (a label is probably unbounded)",
                family, self.max_series, OTHER,
            )

    def _hist(self, d: dict[Any, Hist], key: Any) -> Hist:
        h = d.get(key)
        if h is None:
            h = d[key] = Hist(len(self.bounds))
        return h

    def _new_requests(self, model: str, replica: str | None, status: int, band: str) -> RequestSeries:
        if len(self._requests) >= self.max_series:
            self._overflow("llmgw_requests_total")
            model, replica, band = OTHER, OTHER if replica is not None else None, OTHER
            s = self._requests.get((model, replica, status, band))
            if s is not None:
                return s
        mb = (model, band)
        up = None
        if replica is not None:
            up = self._hist(self._upstream, (model, replica))
        s = RequestSeries(mb, up)
        # NOTE: not stored under the original key when overflowing, so the dict stays bounded.
        self._requests[(model, replica, status, band)] = s
        return s


