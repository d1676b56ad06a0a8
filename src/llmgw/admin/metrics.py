"""The admin ``/metrics``: the data path's counters and the fleet's live state.

Two kinds of numbers are exported, and neither costs the request path more than
a few dictionary operations:

* :class:`PrometheusObserver` implements the data path's
  :class:`~llmgw.gateway.observe.Observer` hooks with plain ints and floats kept
  in dicts keyed by label tuples, and renders them as Prometheus families when
  scraped. PERF: a prometheus-client child costs a lock and a method call per
  ``inc``/``observe``; one request's hooks here cost well under a microsecond
  (``bench/bench_observer.py``).
* :class:`FleetCollector` and :class:`RuntimeCollector` read the registry, the
  admission queues and the process at scrape time: nothing is kept in sync per
  request. A signal that is absent for a replica (never scraped, not reported by
  its engine, stale) is omitted for it, never exported as 0.

Everything here runs on the event loop thread (hooks and scrapes alike), so no
locks are taken. ``docs/metrics.md`` lists every family.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from .. import __version__
from ..gateway.observe import Hist, TrafficCounters
from ..log import admin_logger as log
from ..routing import REASONS

if TYPE_CHECKING:
    from ..fleet.registry import Endpoint, Registry
    from ..gateway.observe import Observer
    from .ports import Listeners

__all__ = [
    "LATENCY_BUCKETS",
    "LOOP_LAG_BUCKETS",
    "Carried",
    "FleetCollector",
    "Known",
    "LoopLagMonitor",
    "PrometheusObserver",
    "RuntimeCollector",
    "admission_source",
    "breaker_state",
    "pool_saturations",
    "read_mapping",
    "status_class",
]

# Seconds. LLM requests run from a few ms (a cached embedding) to minutes (a long
# generation): 17 buckets cover 5 ms .. 10 min at roughly 2-2.5x steps.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)
LOOP_LAG_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

# Per family. Labels come from config (replicas, models, bands) and the data path
# passes the resolved model name, so this is a guard against a bug, not a limit
# an operator should meet. Series past it are counted under "(other)".
MAX_SERIES = 10_000
FORGET_REPLICA_S = 3600.0
"""A replica's traffic series stay on the page this long after it left the registry (long past any ``rate()``
window over its last requests), then go."""
OTHER = "(other)"  # (the same label value as the counters use)

_CLASSES = {c: f"{c}xx" for c in range(1, 6)}


def status_class(status: int) -> str:
    """``2xx``..``5xx``; ``none`` when no response was sent (the client went away first)."""
    return _CLASSES.get(status // 100, "none")


def _buckets(bounds: tuple[str, ...], h: Any) -> list[tuple[str, float]]:
    out: list[tuple[str, float]] = []
    acc = 0
    for le, c in zip(bounds, h.counts, strict=True):
        acc += c
        out.append((le, acc))
    return out


class PrometheusObserver(TrafficCounters, Collector):
    """The data path's hooks (:class:`~llmgw.gateway.proxy.TrafficCounters`: plain
    dicts, compiled with the data path) rendered as Prometheus families at scrape time.

    Implements :class:`llmgw.gateway.observe.Observer`; register it on a
    ``CollectorRegistry`` (the admin app does) to export it. Not thread-safe: the
    hooks and :meth:`collect` are called on the event loop thread.

    Args:
        buckets: histogram upper bounds in seconds (default :data:`LATENCY_BUCKETS`).
        max_series: distinct label sets kept per family before new ones are
            counted under ``(other)``.
    """

    def __init__(self, buckets: Iterable[float] = LATENCY_BUCKETS, max_series: int = MAX_SERIES,
                 forget_s: float = FORGET_REPLICA_S, clock: Callable[[], float] = time.monotonic) -> None:
        TrafficCounters.__init__(self, sorted(float(b) for b in buckets), max_series)
        self._le = (*(_fmt(b) for b in self.bounds), "+Inf")
        self._known: Callable[[], Known] | None = None
        self.forget_s = forget_s
        self._clock = clock
        self._gone: dict[str, float] = {}  # replicas counted here that left the registry, since when

    def know(self, known: Callable[[], Known]) -> None:
        """What llmgw knows exists, read at each scrape: its counters are exported at 0
        before their first event, so ``rate()`` panels and alerts read 0, not "No data".

        (Zero is right for *counts* of events known to be none so far; a measurement
        nobody made stays absent.)
        """
        self._known = known

    def _forget_gone(self, known: Known) -> None:
        """The series of replicas gone from the registry for :attr:`forget_s` leave the page (a deployment's
        rolling update makes new replica ids each time: their series would pile up until the process restarts).
        Kept until then, so ``rate()`` windows over a replica's last requests still read them."""
        live = set(known.replicas)
        counted = ({k[1] for k in self._requests if k[1]} | {k[1] for k in self._upstream}
                   | {k[0] for k in self._errors} | {k[0] for k in self._breaker})
        counted.discard(OTHER)
        now = self._clock()
        gone = self._gone
        for r in counted - live:
            gone.setdefault(r, now)
        for r in [r for r, since in gone.items() if r in live or r not in counted or now - since >= self.forget_s]:
            since = gone.pop(r)
            if r in live or r not in counted:
                continue  # (back, or nothing of it is left)
            tables: tuple[tuple[dict[Any, Any], int], ...] = (
                (self._requests, 1), (self._upstream, 1), (self._errors, 0), (self._breaker, 0))
            for table, at in tables:
                for k in [k for k in table if k[at] == r]:
                    del table[k]
            log.info("replica %s left %.0fs ago: its traffic series leave /metrics", r, now - since)

    # -- reading --

    def requests_by_band(self) -> dict[str, int]:
        """Requests finished per band (for the queues view)."""
        out: dict[str, int] = {}
        for (_, _, _, band), s in self._requests.items():
            out[band] = out.get(band, 0) + s.n
        return out

    def admission_counts(self) -> dict[str, dict[str, int]]:
        """``{band: {outcome: count}}`` (for the queues view)."""
        out: dict[str, dict[str, int]] = {}
        for (band, outcome, _), n in self.admission_totals().items():
            per = out.setdefault(band, {})
            per[outcome] = per.get(outcome, 0) + n
        return out

    def collect(self) -> Iterator[Metric]:
        """Render every family (called by the registry at scrape time)."""
        req = CounterMetricFamily(
            "llmgw_requests_total",
            "Client requests finished, by model, replica that answered (empty: none), status class and band.",
            labels=["model", "replica", "status_class", "band"],
        )
        known = self._known() if self._known is not None else Known()
        if self._known is not None:
            self._forget_gone(known)
        agg: dict[tuple[str, str, str, str], int] = {}
        for model, replica in (*((m, "") for m in known.models), *known.serving):
            for band in known.bands:
                for cls in ("2xx", "4xx", "5xx"):
                    agg[(model, replica, cls, band)] = 0
                if not replica:  # (no answer, no replica: the client went away first)
                    agg[(model, "", "none", band)] = 0
        for (model, answered_by, status, band), s in list(self._requests.items()):
            k = (model, answered_by or "", status_class(status), band)
            agg[k] = agg.get(k, 0) + s.n
        for k, n in agg.items():
            req.add_metric(list(k), n)
        yield req
        yield self._histograms(
            "llmgw_request_duration_seconds",
            "Client request duration, from the complete request to the last byte answered.",
            ["model", "band"],
            self._duration,
        )
        yield self._histograms(
            "llmgw_time_to_first_byte_seconds",
            "From the complete client request to the replica's response head (streams: the first event follows).",
            ["model", "band"],
            self._ttfb,
        )
        yield self._histograms(
            "llmgw_upstream_duration_seconds",
            "From sending the request to the replica to the end of its answer (the last attempt).",
            ["model", "replica"],
            self._upstream,
        )
        tok = CounterMetricFamily(
            "llmgw_tokens_total", "Tokens reported in responses' usage, by model and kind (prompt, completion).",
            labels=["model", "kind"],
        )
        # (each served model's from 0: the first answer's tokens show in rate(), as its requests do)
        for model, (p, c) in {**dict.fromkeys(known.models, (0, 0)), **self._tokens}.items():
            tok.add_metric([model, "prompt"], p)
            tok.add_metric([model, "completion"], c)
        yield tok
        yield _counter(
            "llmgw_upstream_errors_total", "Failed attempts on a replica, by kind.", ["replica", "kind"],
            _zeros(self._errors, ((r, k) for r in known.replicas for k in UPSTREAM_ERROR_KINDS)),
        )
        yield _counter(
            "llmgw_retries_total",
            "Requests sent to another replica after one could not be reached or answered 502/503 (with "
            "retries.after_send, also after a failure past the send), by model.",
            ["model"], _zeros({(m,): n for m, n in self._retries.items()}, ((m,) for m in known.models)),
        )
        yield _counter(
            "llmgw_admission_total",
            "Admission decisions by priority band, outcome (admitted, queued, dequeued, rejected) and reason.",
            ["band", "outcome", "reason"],
            _zeros(self.admission_totals(), (
                (b, o, r) for b in known.bands for o, r in ADMISSION_OUTCOMES
            )),
        )
        yield _counter(
            "llmgw_breaker_transitions_total",
            "Circuit-breaker state changes per replica, by the state entered (open, half_open, closed).",
            ["replica", "state"],
            _zeros(self._breaker, ((r, st) for r in known.replicas for st in BREAKER_STATES)),
        )

    def _histograms(self, name: str, doc: str, labels: list[str], series: dict[tuple[str, str], Any]) -> Metric:
        fam = HistogramMetricFamily(name, doc, labels=labels)
        le = self._le
        for key, h in list(series.items()):
            fam.add_metric(list(key), _buckets(le, h), h.total)
        return fam


def _fmt(b: float) -> str:
    return repr(float(b))


class Known(NamedTuple):
    """What the counters' zero series are made for (see :meth:`PrometheusObserver.know`)."""

    models: tuple[str, ...] = ()
    replicas: tuple[str, ...] = ()
    bands: tuple[str, ...] = ()
    serving: tuple[tuple[str, str], ...] = ()
    """(model, replica) pairs: a replica's answers start at 0 too, so the first of them
    shows in ``rate()`` (a series that appears at 4 has no increase to Prometheus)."""


# Label values known ahead (the data path's, see llmgw.gateway.observe).
UPSTREAM_ERROR_KINDS = (
    "connect_refused", "connect_timeout", "reset", "first_byte_timeout", "read_timeout", "bad_response", "status_5xx",
    "auth_failed",
)
ADMISSION_OUTCOMES = (
    ("admitted", ""), ("queued", ""), ("dequeued", ""),
    ("rejected", "queue_full"), ("rejected", "queue_timeout"), ("rejected", "evicted"), ("rejected", "client_gone"),
    ("rejected", "model_unavailable"), ("rejected", "shutting_down"),
)
BREAKER_STATES = ("closed", "open", "half_open")


def _zeros(values: Mapping[Any, int], keys: Iterable[Any]) -> dict[Any, int]:
    out = dict.fromkeys(keys, 0)
    out.update(values)
    return out


def _counter(name: str, doc: str, labels: list[str], values: Mapping[Any, int]) -> Metric:
    fam = CounterMetricFamily(name, doc, labels=labels)
    for key, n in list(values.items()):
        fam.add_metric(list(key), n)
    return fam


# -- reading the routing layer defensively --


def admission_source(registry: Registry, admission: object | None) -> object:
    """What reports admission state: ``admission`` (another admission controller) if given, else the registry.

    The registry answers ``queue_depths()`` (band -> requests queued, over all
    models) and ``pool_saturation(model)``; another controller is read
    defensively (:func:`read_mapping`): ``queue_depths`` and ``pool_saturation``
    as mappings or methods without arguments.
    """
    return registry if admission is None else admission


_warned: set[str] = set()


def _broken(obj: Any, name: str) -> None:
    # The routing layer owns these numbers; a bug there must not take /metrics
    # down, so it is logged once and the signal is treated as absent.
    if name not in _warned:
        _warned.add(name)
        log.exception("reading %s.%s for the admin API failed; treating it as absent", type(obj).__name__, name)


def _finite(v: Any) -> float | None:
    if v is None or isinstance(v, bool):
        return None
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def read_mapping(obj: Any, name: str) -> dict[str, float] | None:
    """``obj.<name>`` (called if callable) as ``{str: number}``; ``None`` if absent or broken.

    Entries that are ``None`` or NaN (absent) are left out.
    """
    if obj is None:
        return None
    attr = getattr(obj, name, None)
    if attr is None:
        return None
    try:
        value = attr() if callable(attr) else attr
        if value is None:
            return None
        out = {}
        for k, v in value.items():
            x = _finite(v)
            if x is not None:
                out[str(k)] = x
        return out
    except Exception:
        _broken(obj, name)
        return None


def pool_saturations(registry: Registry, admission: object | None = None) -> dict[str, float]:
    """Model -> pool saturation now, for the models that have an estimate.

    Reads ``registry.pool_saturation(model)`` for each of ``registry.models()``,
    or a ``pool_saturation`` mapping on ``admission`` when one is given.
    """
    if admission is not None:
        return read_mapping(admission, "pool_saturation") or {}
    reg = registry
    out: dict[str, float] = {}
    try:
        for model in reg.models():
            v = reg.pool_saturation(model)
            # +Inf is a real state (no usable replica); only None and NaN are absent.
            if v is not None and v == v:
                out[model] = float(v)
    except Exception:
        _broken(reg, "pool_saturation")
    return out


def breaker_state(ep: Endpoint) -> str:
    """``closed``, ``open`` or ``half_open``: the replica's circuit breaker.

    NOTE: read as typed attributes of the real :class:`~llmgw.fleet.registry.Endpoint`,
    never probed with ``getattr(..., None)``: a renamed field fails loudly (mypy, the
    tests) instead of quietly dropping a signal from /metrics and the admin API.
    """
    return ep.breaker_state


class Carried:
    """Counters that live on objects a reload or the admin API replaces, kept monotonic per series.

    A replica's scrape counts live on its :class:`~llmgw.fleet.registry.Endpoint`, and a
    reload that changes the replica (any key), or its removal and re-adding, makes a new
    one that counts from 0; the ``prefix`` strategy's decisions live on its picker, which
    a reload of the strategy or its knobs replaces. Exported as they are, those counters
    went backwards on the page (``llmgw_scrapes_total`` 173 -> 2 after a SIGHUP that
    changed the replica's ``slots``): a counter reset to Prometheus, and a series a
    dashboard reads as a restart of the process.

    :meth:`read` is given the object that holds a series' counts now; when another object
    held them before (at the last scrape, or before the series left the page), the old
    object's final counts are added to the series' base and the old object is let go. The
    same object back (a pool emptied and filled again keeps its picker) carries on from its
    own counts, never added twice. A series gone for ``forget_s`` (an hour: long past any
    ``rate()`` window over its last samples) is forgotten, so replicas that come and go
    (deployments' rolling updates) hold no memory for ever. Run on the event loop at
    scrape time only (like every collector here).
    """

    def __init__(self, max_series: int = MAX_SERIES, forget_s: float = 3600.0) -> None:
        self._held: dict[tuple[str, ...], tuple[object, Callable[[Any], tuple[float, ...]]]] = {}
        self._base: dict[tuple[str, ...], tuple[float, ...]] = {}
        self._seen: set[tuple[str, ...]] = set()
        self._gone: dict[tuple[str, ...], float] = {}  # series not on the page since (monotonic), oldest first
        self.max_series = max_series
        self.forget_s = forget_s

    def _fold(self, key: tuple[str, ...], obj: object, values: Callable[[Any], tuple[float, ...]]) -> None:
        final = values(obj)
        base = self._base.get(key)
        if base is None:
            if len(self._base) >= self.max_series:
                return  # (a guard against a bug, as MAX_SERIES: never met from a config)
            self._base[key] = final
        else:
            self._base[key] = tuple(a + b for a, b in zip(base, final, strict=True))

    def read(self, key: tuple[str, ...], obj: object, values: Callable[[Any], tuple[float, ...]]) -> tuple[float, ...]:
        """The series ``key``'s counts: ``values(obj)`` plus what objects before ``obj`` counted."""
        held = self._held.get(key)
        if held is not None and held[0] is not obj:
            self._fold(key, *held)
        if self._gone:
            self._gone.pop(key, None)
        self._held[key] = (obj, values)
        self._seen.add(key)
        now = values(obj)
        base = self._base.get(key)
        return now if base is None else tuple(a + b for a, b in zip(base, now, strict=True))

    def done(self) -> None:
        """End of a scrape: the series not read at it keep their counts for when they come back."""
        now = time.monotonic()
        gone = self._gone
        for key in self._held:
            if key not in self._seen and key not in gone:
                gone[key] = now  # (insertion order is time order: a series back is popped by read())
        self._seen.clear()
        while gone:
            key, since = next(iter(gone.items()))
            if now - since < self.forget_s:
                break
            del gone[key]
            self._held.pop(key, None)
            self._base.pop(key, None)


def _scrape_counts(ep: Endpoint) -> tuple[float, ...]:
    return (ep.scrape_ok, ep.scrape_failures, ep.scrape_seconds)


def _decisions(picker: Any) -> tuple[float, ...]:
    return tuple(picker.decisions())


class FleetCollector(Collector):
    """Live state read from the registry and the admission queues at scrape time.

    A signal that is absent for a replica (never scraped, not reported by its
    engine, stale, no drain-rate estimate) is omitted for that
    replica, never exported as 0.

    Args:
        registry: the replicas (read at scrape time, so changes show).
        admission: another admission controller to read queue depths and
            saturation from instead of the registry (:func:`admission_source`).
    """

    def __init__(self, registry: Registry, admission: object | None = None) -> None:
        self.registry = registry
        self.admission = admission
        self.carried = Carried()
        """The counters a reload's new replica or picker would restart (:class:`Carried`)."""

    def collect(self) -> Iterator[Metric]:
        labels = ["replica", "pool"]

        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=labels)

        info = GaugeMetricFamily(
            "llmgw_endpoint_info", "1 per replica and model it serves; join on replica to get model and engine.",
            labels=["replica", "pool", "model", "engine"],
        )
        inflight = gauge("llmgw_endpoint_inflight", "Requests this gateway has in flight to the replica.")
        waiting = gauge("llmgw_endpoint_waiting", "Requests waiting in the replica's own queue, as last scraped.")
        running = gauge("llmgw_endpoint_running", "Requests the replica is running, as last scraped.")
        kv = gauge("llmgw_endpoint_kv_cache_usage", "KV-cache usage of the replica (0..1), as last scraped.")
        drain = gauge("llmgw_endpoint_drain_rate", "Requests per second the replica finishes for this gateway.")
        latency = gauge(
            "llmgw_endpoint_latency_seconds", "Mean time a request spends on the replica (routing's speed estimate)."
        )
        draining = gauge("llmgw_endpoint_draining", "1 while the replica takes no new requests (drained).")
        stale = gauge(
            "llmgw_endpoint_metrics_stale",
            "1 when the replica's engine metrics are missing or older than scrape.stale_after.",
        )
        breaker = gauge(
            "llmgw_endpoint_breaker_open",
            "1 while the replica's circuit breaker is open (no requests), else 0 (closed, or half-open: probing).",
        )
        breaker_state_ = GaugeMetricFamily(
            "llmgw_endpoint_breaker_state",
            "1 on the replica's current circuit-breaker state (closed, open, half_open), 0 on the others.",
            labels=[*labels, "state"],
        )
        failures = gauge("llmgw_endpoint_consecutive_failures", "Failed attempts on the replica since its last success.")
        auth_failed = gauge(
            "llmgw_endpoint_auth_failed",
            "1 while the replica refuses the API key the gateway sends it (401/403: fix the config); "
            "it takes no requests but a probe each breaker cooldown. Else 0.",
        )
        scrapes = CounterMetricFamily(
            "llmgw_scrapes_total", "Scrapes of the replica's metrics page, by result (ok, failed).",
            labels=[*labels, "result"],
        )
        scrape_time = SummaryMetricFamily(
            "llmgw_scrape_duration_seconds", "Time spent scraping the replica's metrics page (all attempts).",
            labels=labels,
        )
        for ep in list(self.registry.endpoints.values()):
            pool = ep.cfg.pool or ""
            lv = [ep.id, pool]
            for m in ep.models:
                info.add_metric([ep.id, pool, m, ep.cfg.engine], 1.0)
            inflight.add_metric(lv, ep.inflight)
            draining.add_metric(lv, 1.0 if ep.draining else 0.0)
            failures.add_metric(lv, ep.consecutive_failures)
            auth_failed.add_metric(lv, 1.0 if ep.auth_failed else 0.0)
            state = ep.breaker_state
            breaker.add_metric(lv, 1.0 if state == "open" else 0.0)
            for st in BREAKER_STATES:
                breaker_state_.add_metric([*lv, st], 1.0 if st == state else 0.0)
            rate = _finite(ep.drain_rate)  # (None, NaN: never measured; left out)
            if rate is not None:
                drain.add_metric(lv, rate)
            lat = _finite(ep.latency)
            if lat is not None:
                latency.add_metric(lv, lat)
            if not ep.engine.scraped:
                continue
            stale.add_metric(lv, 1.0 if ep.stale else 0.0)
            ok, failed, seconds = self.carried.read(("scrapes", ep.id, pool), ep, _scrape_counts)
            scrapes.add_metric([*lv, "ok"], ok)
            scrapes.add_metric([*lv, "failed"], failed)
            scrape_time.add_metric(lv, int(ok + failed), seconds)
            w, r, k = ep.fresh()
            if w is not None:
                waiting.add_metric(lv, w)
            if r is not None:
                running.add_metric(lv, r)
            if k is not None:
                kv.add_metric(lv, k)
        yield from (
            info, inflight, waiting, running, kv, drain, latency, draining, stale, breaker, breaker_state_, failures,
            auth_failed, scrapes, scrape_time,
        )

        adm = admission_source(self.registry, self.admission)
        depth = GaugeMetricFamily(
            "llmgw_admission_queue_depth", "Requests waiting for admission, by priority band.", labels=["band"]
        )
        for band, n in (read_mapping(adm, "queue_depths") or {}).items():
            depth.add_metric([band], n)
        yield depth
        sat = GaugeMetricFamily(
            "llmgw_pool_saturation",
            "How full a model's replicas are: at 1 or more new requests queue; +Inf: no usable replica.",
            labels=["model"],
        )
        for model, x in pool_saturations(self.registry, self.admission).items():
            sat.add_metric([model], x)
        yield sat
        yield from routing_families(self.registry, self.carried)
        self.carried.done()


def routing_families(registry: Registry, carried: Carried | None = None) -> Iterator[Metric]:
    """The prefix strategy's decisions and index sizes, per model that uses it (read at
    scrape time from the pickers' C counters: the data path counts nothing else).

    ``carried``: keeps ``llmgw_routing_decisions_total`` monotonic when a reload replaces
    a model's picker (:class:`Carried`; without it the new picker's counts are exported).
    """
    decisions = CounterMetricFamily(
        "llmgw_routing_decisions",
        "Picks of the prefix strategy by reason: prefix_hit (the replica with the longest cached prefix), "
        "session (the conversation's replica), load_fallback (the cached replica was too loaded: spilled elsewhere), "
        "blind (nothing known: consistent hashing, or score without a key).",
        labels=["model", "reason"],
    )
    entries = GaugeMetricFamily(
        "llmgw_routing_index_entries",
        "Live entries of the prefix strategy's tables (prefix: block chain -> replica; session), per model.",
        labels=["model", "table"],
    )
    slots = GaugeMetricFamily(
        "llmgw_routing_index_slots", "Slots allocated for those tables (24 bytes each), per model.",
        labels=["model", "table"],
    )
    reuse = GaugeMetricFamily(
        "llmgw_routing_reuse_ratio",
        "Share of the prefix strategy's keyed requests (a moving average over about 64) that continued something "
        "this router knew: a session, a later turn, a known prompt start. Under 0.05 a first turn nothing is known "
        "of goes where score sends it, not where its hash does. No sample before the first keyed request.",
        labels=["model"],
    )
    now = time.monotonic()
    for model, pool in list(registry.pools.items()):
        if not pool.keyed or not pool.endpoints:
            continue
        picker = pool.picker
        counts = _decisions(picker) if carried is None else carried.read(("decisions", model), picker, _decisions)
        for reason, n in zip(REASONS, counts, strict=True):
            decisions.add_metric([model, reason], n)
        live = picker.index_size(now)
        cap = picker.index_capacity()
        for k, table in enumerate(("prefix", "session")):
            entries.add_metric([model, table], live[k])
            slots.add_metric([model, table], cap[k])
        r = picker.reuse
        if r == r:  # (absent until measured; a share, shown to 6 places: an average decayed
            reuse.add_metric([model], round(r, 6))  # towards 0 read 1.6e-322)
    yield from (decisions, entries, slots, reuse)


class LoopLagMonitor:
    """Measures how late the event loop runs a timer: the loop's own latency.

    A callback is scheduled every ``interval`` seconds; how much later than asked
    it runs is observed into a histogram. A blocked loop (a slow callback, a
    large synchronous scrape) shows up here before it shows up as request latency.
    """

    def __init__(self, interval: float = 0.5, stopped: Callable[[], bool] = lambda: False) -> None:
        self.interval = interval
        self.bounds = list(LOOP_LAG_BUCKETS)
        self._le = (*(_fmt(b) for b in self.bounds), "+Inf")
        self.hist = Hist(len(self.bounds))
        self._stopped = stopped
        self._handle: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._due = 0.0

    def start(self) -> None:
        """Start measuring (needs a running loop)."""
        self._loop = asyncio.get_running_loop()
        self._schedule()

    def _schedule(self) -> None:
        assert self._loop is not None
        self._due = self._loop.time() + self.interval
        self._handle = self._loop.call_at(self._due, self._tick)

    def _tick(self) -> None:
        assert self._loop is not None
        lag = max(0.0, self._loop.time() - self._due)
        h = self.hist
        h.counts[bisect_left(self.bounds, lag)] += 1
        h.total += lag
        if self._stopped():
            self._handle = None
            return
        self._schedule()

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def family(self) -> Metric:
        fam = HistogramMetricFamily(
            "llmgw_event_loop_lag_seconds", "How late the event loop ran a timer scheduled every 0.5 s.", labels=[]
        )
        fam.add_metric([], _buckets(self._le, self.hist), self.hist.total)
        return fam


def _extensions() -> str:
    from .._accel import NO_EXTENSIONS

    if NO_EXTENSIONS:
        return "pure"
    mod = sys.modules.get("llmgw._fast.httpproto")
    return "compiled" if mod is not None else "pure"


class RuntimeCollector(Collector):
    """The gateway process itself: build, listeners, asyncio tasks, loop lag, reloads.

    Args:
        listeners: the client and admin listeners (read at scrape time).
        lag: the event loop's lag (``None``: not measured).
        reloads: returns the reloads so far by result (``ok``, ``failed``); called at scrape time.
    """

    def __init__(
        self, listeners: Listeners, lag: LoopLagMonitor | None, reloads: Callable[[], Mapping[str, int]]
    ) -> None:
        self.listeners = listeners
        self.lag = lag
        self.reloads = reloads

    def collect(self) -> Iterator[Metric]:
        build = GaugeMetricFamily(
            "llmgw_build_info", "Always 1; labels say which llmgw and Python run.",
            labels=["version", "python", "extensions"],
        )
        build.add_metric([__version__, sys.version.split()[0], _extensions()], 1.0)
        yield build
        conns = GaugeMetricFamily(
            "llmgw_connections",
            "Open connections, by listener (gateway: the client port; admin: the admin port, scrapes included).",
            labels=["listener"],
        )
        rejected = CounterMetricFamily(
            "llmgw_connections_rejected_total", "Connections refused at the connection limit or during shutdown.",
            labels=["listener"],
        )
        for listener, srv in self.listeners.items():
            conns.add_metric([listener], len(srv.connections))
            rejected.add_metric([listener], srv.rejected)
        yield conns
        yield rejected
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        tasks = GaugeMetricFamily("llmgw_asyncio_tasks", "Asyncio tasks alive on the event loop.")
        if loop is not None:
            tasks.add_metric([], len(asyncio.all_tasks(loop)))
        yield tasks
        if self.lag is not None:
            yield self.lag.family()
        rl = CounterMetricFamily(
            "llmgw_config_reloads_total", "Configuration reloads (admin API or SIGHUP), by result (ok, failed).",
            labels=["result"],
        )
        counts = self.reloads()
        for result in ("ok", "failed"):
            rl.add_metric([result], counts.get(result, 0))
        yield rl


if TYPE_CHECKING:
    _check: Observer = PrometheusObserver()
