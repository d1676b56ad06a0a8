"""``llmgw._fast.score``: replica state, pickers, saturation, breakers, retry budget.

Behaviour tests run against both twins through the ``score`` fixture; the
differential tests drive both twins with the same random operation sequences and
require the same picks (same seed), the same numbers (bit for bit) and the same
breaker states.
"""

from __future__ import annotations

import importlib
import math
from collections import Counter
from types import ModuleType
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw._fast import score_py

score_c: ModuleType | None
try:
    score_c = importlib.import_module("llmgw._fast.score")
except ImportError:  # pragma: no cover - pure build
    score_c = None

STALE = 3.0


def fresh(
    mod: ModuleType, n: int, *, waiting: float = 0, running: float = 0, kv: float | None = None
) -> list[Any]:
    """``n`` replicas scraped at t=0 with the same numbers."""
    states = []
    for i in range(n):
        s = mod.EndpointState(i)
        s.on_scrape(0.0, waiting, running, kv)
        states.append(s)
    return states


def picks(picker: Any, states: list[Any], n: int, now: float = 1.0) -> Counter[int]:
    return Counter(picker.pick(states, now, STALE) for _ in range(n))


def serve(state: Any, t0: float, duration: float, count: int, gap: float) -> float:
    """``count`` requests one after the other, each ``duration`` s, ``gap`` s apart; returns the end."""
    t = t0
    for _ in range(count):
        state.on_dispatch(t)
        t += duration
        state.on_complete(t)
        t += gap
    return t


# -- EndpointState ----------------------------------------------------------------


def test_state_defaults_are_absent(score: ModuleType) -> None:
    s = score.EndpointState(3)
    assert s.index == 3
    assert s.inflight == 0
    for name in ("waiting", "running", "kv_cache_usage", "scraped_at", "drain_rate", "latency", "slots"):
        assert math.isnan(getattr(s, name)), name
    assert s.max_running == 0.0 and not s.seen_full
    assert s.dispatched_since_scrape == s.completed_since_scrape == 0
    assert not s.draining
    assert s.breaker.state == "closed"
    assert s.stale(0.0, STALE)


def test_on_scrape_stores_numbers_none_is_nan_and_resets_counters(score: ModuleType) -> None:
    s = score.EndpointState()
    s.on_dispatch(0.0)
    s.on_dispatch(0.1)
    s.on_complete(0.2)
    assert (s.dispatched_since_scrape, s.completed_since_scrape, s.inflight) == (2, 1, 1)
    s.on_scrape(1.0, 2, 5, None)
    assert (s.waiting, s.running) == (2.0, 5.0)
    assert math.isnan(s.kv_cache_usage)
    assert s.scraped_at == 1.0
    assert (s.dispatched_since_scrape, s.completed_since_scrape, s.inflight) == (0, 0, 1)
    assert s.max_running == 5.0
    s.on_scrape(2.0, None, 3, 0.5)
    assert math.isnan(s.waiting)
    assert s.kv_cache_usage == 0.5
    assert s.max_running == 5.0  # the most ever seen


def test_on_scrape_sent_keeps_what_happens_while_the_scrape_is_in_flight(score: ModuleType) -> None:
    s = score.EndpointState()
    s.on_scrape(0.0, 0, 2, None)
    s.on_dispatch(0.01)
    s.on_dispatch(0.02)  # before the scrape was sent: the page counts them
    s.on_scrape_sent()
    s.on_dispatch(0.03)  # while it is in flight: the page may not
    s.on_complete(0.04)
    s.on_scrape(0.05, 1, 4, None)
    assert (s.dispatched_since_scrape, s.completed_since_scrape) == (1, 1)
    s.on_dispatch(0.06)
    s.on_scrape(0.1, 1, 4, None)  # no scrape sent since: restart at zero
    assert (s.dispatched_since_scrape, s.completed_since_scrape) == (0, 0)


def test_inflight_never_negative(score: ModuleType) -> None:
    s = score.EndpointState()
    s.on_complete(1.0)
    s.on_abort(2.0)
    assert s.inflight == 0


def test_stale(score: ModuleType) -> None:
    s = score.EndpointState()
    assert s.stale(100.0, STALE)  # never scraped
    s.on_scrape(10.0, 0, 0, None)
    assert not s.stale(12.9, STALE)
    assert not s.stale(13.0, STALE)
    assert s.stale(13.01, STALE)
    s.scraped_at = math.inf  # an engine that is never scraped: always fresh
    assert not s.stale(1e9, STALE)


def test_drain_rate_and_latency_follow_own_requests(score: ModuleType) -> None:
    s = score.EndpointState()
    # 2 requests in flight at a time, each 2 s long: rate 1/s, latency 2 s
    t = 0.0
    s.on_dispatch(t)
    s.on_dispatch(t + 1.0)
    t = 1.0
    for _ in range(200):
        t += 1.0
        s.on_complete(t)
        s.on_dispatch(t)
    # read right after a completion, the average holds that completion at full weight
    # (+1/(2 tau) on average): within 6 %
    assert s.drain_rate == pytest.approx(1.0, rel=0.06)
    assert s.latency == pytest.approx(2.0, rel=0.06)


def test_latency_does_not_depend_on_traffic_volume(score: ModuleType) -> None:
    """A replica sent little traffic is not taken for a slow one."""
    busy, idle = score.EndpointState(0), score.EndpointState(1)
    serve(busy, 0.0, 1.0, 100, 0.0)
    serve(idle, 0.0, 1.0, 10, 9.0)
    assert busy.latency == pytest.approx(1.0, rel=0.06)
    assert idle.latency == pytest.approx(1.0, rel=0.06)
    assert busy.drain_rate > 5 * idle.drain_rate


def test_the_drain_rate_decays_while_nothing_completes(score: ModuleType) -> None:
    """A replica that stops answering does not keep its last rate (read on /metrics, ctl endpoints and
    Retry-After): as of a time, it is what the next completion would find, less one."""
    s = score.EndpointState()
    end = serve(s, 0.0, 1.0, 100, 0.0)
    assert s.rate_at(end) == s.drain_rate == pytest.approx(1.0, rel=0.06)
    assert s.rate_at(end - 1.0) == s.drain_rate  # (no going back)
    later = s.rate_at(end + score.DRAIN_TAU)
    assert later == pytest.approx(s.drain_rate / math.e, rel=0.1)
    assert s.rate_at(end + 10 * score.DRAIN_TAU) < 1e-3 * s.drain_rate
    assert s.drain_rate == pytest.approx(1.0, rel=0.06)  # (reading changes nothing)
    # the next completion's rate is the decayed one plus its own
    s.on_complete(end + score.DRAIN_TAU)
    assert s.drain_rate == pytest.approx(later + 1.0 / score.DRAIN_TAU, rel=0.05)
    # never measured: NaN at any time; set by hand with no history: as set
    fresh_ = score.EndpointState()
    assert math.isnan(fresh_.rate_at(100.0))
    fresh_.drain_rate = 2.5
    assert fresh_.rate_at(100.0) == 2.5


def test_retry_after_reads_what_the_pool_drains(score: ModuleType) -> None:
    """Retry-After is what the pool drains: the recent completions' rate now, but never less than
    what its replicas finish when full (capacity / latency): a burst after an idle spell (a rate
    decayed towards 0) is not told to wait a minute for a pool that drains in seconds."""
    s = score.EndpointState()
    s.on_scrape(0.0, 0.0, 1.0, None)
    end = serve(s, 0.0, 0.1, 200, 0.0)  # one at a time, 0.1 s each: ~10 completions a second
    s.on_scrape(end, 0.0, 1.0, None)
    assert score.retry_after([s], 9, end) == pytest.approx(1.0, rel=0.2)
    s.on_scrape(end + 20.0, 0.0, 1.0, None)
    # 20 s (two time constants) without a completion: the recent rate is ~e^2 lower ...
    assert s.rate_at(end + 20.0) == pytest.approx(s.drain_rate / math.e ** 2, rel=0.2)
    # ... but a full replica still finishes one per latency (0.1 s): ten requests, one second
    assert s.latency == pytest.approx(0.1, rel=0.1)
    assert score.retry_after([s], 9, end + 20.0) == pytest.approx(1.0, rel=0.2)


def test_stalled_replica_latency_grows(score: ModuleType) -> None:
    s = score.EndpointState()
    end = serve(s, 0.0, 1.0, 20, 0.0)
    before = s.latency
    s.on_dispatch(end)
    s.on_dispatch(end + 30.0)  # nothing completed for 30 s with one in flight
    assert s.latency > 5 * before


def test_abort_is_not_a_completion(score: ModuleType) -> None:
    s = score.EndpointState()
    s.on_dispatch(0.0)
    s.on_abort(0.001)  # a connect error: fast, but says nothing about speed
    assert math.isnan(s.drain_rate)
    assert math.isnan(s.latency)
    assert s.completed_since_scrape == 1  # it left the replica, so the correction counts it


def test_abort_after_idle_does_not_take_the_replica_out_of_rotation(score: ModuleType) -> None:
    """One failure after minutes idle: the time it was in flight is not divided by a completion
    count decayed to nearly nothing (that read as a latency of years, and the replica was
    never picked again while its sibling queued)."""
    a, b = score.EndpointState(0), score.EndpointState(1)
    end = max(serve(a, 0.0, 0.115, 20, 0.0), serve(b, 0.0, 0.115, 20, 0.0))
    before = a.latency
    t = end + 360.0  # six minutes idle
    a.on_dispatch(t)
    assert a.latency == pytest.approx(before)  # (in flight: the last settled figure)
    a.on_abort(t + 0.2)  # an engine 500 (or a client gone) 0.2 s in
    assert math.isnan(a.latency)  # nothing recent known: unknown (the pool's mean), not years
    # b queues (4 slots, 28 waiting): a, with free slots, takes the requests
    for s_ in (a, b):
        s_.slots = 4.0
    a.on_scrape(t + 0.3, 0, 0, None)
    b.on_scrape(t + 0.3, 28, 4, None)
    picker = score.Picker("score", seed=1)
    assert picks(picker, [a, b], 50, now=t + 0.4)[0] == 50


def test_latency_is_unknown_again_once_nothing_recent_is_known(score: ModuleType) -> None:
    """A latency raised by time in flight (aborts, a stall, a few long answers) and then sent
    nothing: the scrapes age the averages, the raised figure eases back towards what the last
    completion left, and then, with no evidence left, latency is unknown (the pool's mean), so
    the replica is tried again rather than kept at that figure for ever."""
    s = score.EndpointState()
    end = serve(s, 0.0, 0.1, 20, 0.5)
    settled = s.latency
    for k in range(3):  # three streams a client dropped after 2 s each
        s.on_dispatch(end + 3 * k)
        s.on_abort(end + 3 * k + 2.0)
    raised = s.latency
    assert raised > 5 * settled
    t = end + 9.0
    eased = []
    for _ in range(120):  # a scrape a second, two minutes
        t += 1.0
        s.on_scrape(t, 0, 0, None)
        eased.append(s.latency)
    known = [x for x in eased if x == x]
    assert known and known[-1] < raised / 2 and known == sorted(known, reverse=True)
    assert math.isnan(eased[-1])
    # sent again: its new requests are the evidence
    s.on_dispatch(t)
    s.on_complete(t + 0.1)
    assert s.latency == s.latency and s.latency < raised


def test_first_completion_rate_is_bounded(score: ModuleType) -> None:
    s = score.EndpointState()
    s.on_dispatch(0.0)
    s.on_complete(0.001)
    assert s.drain_rate <= 1.0  # not 1000/s from one completion after 1 ms


def test_load_and_queued_corrections(score: ModuleType) -> None:
    s = score.EndpointState()
    s.on_scrape(0.0, 3, 4, None)
    assert s.load() == 7.0
    assert s.queued() == 3.0
    s.on_dispatch(0.1)
    s.on_dispatch(0.1)
    s.on_complete(0.2)
    assert s.load() == 8.0
    assert s.queued() == 4.0  # the engine had a queue: our new request joined it
    # no queue at the scrape: our requests take free slots first
    s.slots = 8.0
    s.on_scrape(1.0, 0, 6, None)
    for _ in range(3):
        s.on_dispatch(1.1)
    assert s.load() == 9.0
    assert s.queued() == 1.0
    # corrections never go below what this router has in flight there (a scrape
    # that has not seen our requests yet does not make the replica look idle)
    s.on_scrape(2.0, 0, 0, None)
    s.on_complete(2.1)
    assert s.inflight == 3
    assert s.load() == 3.0
    assert s.queued() == 0.0
    for _ in range(3):
        s.on_complete(2.2)
    assert s.load() == 0.0  # nor below zero


def test_a_burst_spreads_when_a_scrape_under_reports_it(score: ModuleType) -> None:
    """Eight requests sent to a replica whose next scrape counts none of them yet
    (still on their way): the router's own in-flight count keeps it from looking idle."""
    a, b = score.EndpointState(0), score.EndpointState(1)
    for state in (a, b):
        state.on_scrape(0.0, 0, 0, None)
    picker = score.Picker("score", seed=1)
    picks = []
    for k in range(16):
        if k == 8:  # a's scrape lands mid-burst, seeing nothing of it (b's comes later)
            a.on_scrape_sent()
            a.on_scrape(0.5, 0, 0, None)
        i = picker.pick([a, b], 0.5, 10.0)
        (a, b)[i].on_dispatch(0.5)
        picks.append(i)
    assert picks.count(0) == picks.count(1) == 8, picks


def test_queued_is_absent_without_queue_gauge(score: ModuleType) -> None:
    s = score.EndpointState()
    s.on_scrape(0.0, None, 4, 0.3)
    assert math.isnan(s.queued())
    assert s.load() == 4.0


def test_capacity(score: ModuleType) -> None:
    s = score.EndpointState()
    assert s.capacity() == 1.0
    s.on_scrape(0.0, 0, 6, None)
    assert s.capacity() == 6.0
    s.slots = 16.0
    assert s.capacity() == 16.0
    s.slots = 0.0  # not a usable value: ignored
    assert s.capacity() == 6.0


def test_saturation(score: ModuleType) -> None:
    s = score.EndpointState()
    assert s.saturation(0.0, STALE, 8, 0.9) == 1.0  # never scraped: full
    s.on_scrape(0.0, 4, 8, None)
    assert s.saturation(1.0, STALE, 8, 0.9) == 0.5  # KV absent: queue only
    s.on_scrape(0.0, 4, 8, 0.81)
    assert s.saturation(1.0, STALE, 8, 0.9) == pytest.approx(0.9)  # KV part wins
    s.on_scrape(0.0, 16, 8, 0.45)
    assert s.saturation(1.0, STALE, 8, 0.9) == 2.0  # above the limit is above 1.0
    s.on_scrape(0.0, None, 8, 0.45)
    assert s.saturation(1.0, STALE, 8, 0.9) == pytest.approx(0.5)  # queue absent: KV only
    assert s.saturation(10.0, STALE, 8, 0.9) == 1.0  # stale: full


def test_saturation_counts_own_dispatches_between_scrapes(score: ModuleType) -> None:
    s = score.EndpointState()
    s.on_scrape(0.0, 2, 4, None)
    for _ in range(6):
        s.on_dispatch(0.05)
    assert s.saturation(0.1, STALE, 8, 0.9) == 1.0


def test_saturation_without_gauges_uses_own_inflight(score: ModuleType) -> None:
    s = score.EndpointState()
    s.on_scrape(0.0, None, None, None)  # fresh, but the engine reports nothing
    assert s.saturation(0.1, STALE, 8, 0.9) == 0.0
    s.slots = 2.0
    for _ in range(6):
        s.on_dispatch(0.1)
    assert s.saturation(0.1, STALE, 8, 0.9) == 0.5  # 6 in flight, 2 slots: 4 queued of 8


def test_saturation_rejects_bad_limits(score: ModuleType) -> None:
    s = score.EndpointState()
    with pytest.raises(ValueError):
        s.saturation(0.0, STALE, 0, 0.9)
    with pytest.raises(ValueError):
        score.pool_saturation([s], 0.0, STALE, 8, 0.0)


def test_breaker_field_rejects_non_breakers(score: ModuleType) -> None:
    s = score.EndpointState()
    with pytest.raises(TypeError):
        s.breaker = None
    b = score.Breaker(2, 1.0)
    s.breaker = b
    assert s.breaker is b
    assert score.EndpointState(0, b).breaker is b


# -- Picker: score ------------------------------------------------------------------


def test_unknown_strategy(score: ModuleType) -> None:
    with pytest.raises(ValueError, match="round_robin"):
        score.Picker("random")
    assert score.Picker("least_inflight").strategy == "least_inflight"
    assert score.STRATEGIES == ("score", "least_inflight", "round_robin", "prefix")


def test_empty_and_unusable_pools(score: ModuleType) -> None:
    for strategy in score.STRATEGIES:
        p = score.Picker(strategy, seed=1)
        assert p.pick([], 0.0, STALE) == -1
        states = fresh(score, 3)
        for s in states:
            s.draining = True
        assert p.pick(states, 0.1, STALE) == -1


def test_score_prefers_the_shorter_queue(score: ModuleType) -> None:
    states = fresh(score, 3, waiting=5, running=8)
    states[1].on_scrape(0.0, 0, 2, None)
    assert picks(score.Picker("score", seed=1), states, 50) == {1: 50}


def test_score_corrects_between_scrapes_with_own_dispatches(score: ModuleType) -> None:
    states = fresh(score, 2, waiting=0, running=4)
    for s in states:
        s.slots = 8.0
    p = score.Picker("score", seed=3)
    chosen = []
    for _ in range(8):
        i = p.pick(states, 0.05, STALE)
        states[i].on_dispatch(0.05)
        chosen.append(i)
    # the picker never sees a new scrape, yet it spreads: 4 each
    assert Counter(chosen) == {0: 4, 1: 4}


def test_score_weighs_replica_speed(score: ModuleType) -> None:
    """Shortest expected delay: a 4x slower replica gets work only when the fast one is 4x as loaded."""
    fast, slow = fresh(score, 2)
    serve(fast, 150.0, 1.0, 50, 0.0)  # (both recent at t=200: evidence 150 s old is forgotten)
    serve(slow, 0.0, 4.0, 50, 0.0)
    for w_fast, expect in ((0, 0), (2, 0), (6, 1)):
        fast.on_scrape(200.0, w_fast, 1, None)
        slow.on_scrape(200.0, 0, 1, None)
        assert picks(score.Picker("score", seed=2), [fast, slow], 20, now=200.1) == {expect: 20}


def test_score_assumes_the_pool_capacity_until_a_replica_has_queued(score: ModuleType) -> None:
    """A new replica (never seen running more than 1) is not taken for a 1-slot one."""
    old, new = fresh(score, 2)
    old.on_scrape(0.0, 2, 8, None)  # full at 8
    old.on_scrape(0.1, 0, 6, None)
    new.on_scrape(0.1, 0, 1, None)
    assert old.seen_full and not new.seen_full
    assert new.capacity() == 1.0  # its own lower bound...
    p = score.Picker("score", seed=1)
    chosen = []
    for _ in range(6):
        i = p.pick([old, new], 0.2, STALE)
        [old, new][i].on_dispatch(0.2)
        chosen.append(i)
    assert chosen.count(1) >= 4  # ...but routing fills it like an 8-slot replica
    new.on_scrape(0.3, 3, 2, None)  # it queued at 2: now its capacity is known
    assert new.seen_full and new.capacity() == 2.0
    assert picks(score.Picker("score", seed=1), [old, new], 10, now=0.3) == {0: 10}


def test_score_unknown_latency_takes_the_mean(score: ModuleType) -> None:
    known, unknown = fresh(score, 2, waiting=0, running=0)
    serve(known, 0.0, 1.0, 30, 0.0)
    known.on_scrape(30.0, 0, 3, None)
    unknown.on_scrape(30.0, 0, 2, None)
    known.slots = unknown.slots = 4.0
    # equal latency assumed: the less loaded one wins
    assert picks(score.Picker("score", seed=5), [known, unknown], 20, now=30.1) == {1: 20}


def test_score_kv_pressure_penalty(score: ModuleType) -> None:
    a, b = fresh(score, 2)
    a.slots = b.slots = 8.0
    a.on_scrape(0.0, 0, 2, 0.95)
    b.on_scrape(0.0, 0, 4, 0.3)
    assert picks(score.Picker("score", seed=1), [a, b], 20) == {1: 20}
    a.on_scrape(0.0, 0, 2, 0.6)  # below the knee: no penalty
    assert picks(score.Picker("score", seed=1), [a, b], 20) == {0: 20}


def test_score_near_ties_are_broken_randomly(score: ModuleType) -> None:
    states = fresh(score, 4, waiting=0, running=10)
    for s in states:
        s.slots = 16.0
    states[3].on_scrape(0.0, 0, 10.5, None)  # within 10 %
    states[2].on_scrape(0.0, 0, 14, None)  # not
    got = picks(score.Picker("score", seed=9), states, 400)
    assert set(got) == {0, 1, 3}
    assert all(got[i] > 80 for i in (0, 1, 3))


def test_score_same_seed_same_picks(score: ModuleType) -> None:
    states = fresh(score, 8, waiting=0, running=1)
    a = [score.Picker("score", seed=42).pick(states, 0.5, STALE) for _ in range(1)]
    p1, p2 = score.Picker("score", seed=42), score.Picker("score", seed=42)
    seq1 = [p1.pick(states, 0.5, STALE) for _ in range(50)]
    seq2 = [p2.pick(states, 0.5, STALE) for _ in range(50)]
    assert seq1 == seq2
    assert a[0] == seq1[0]
    assert len(set(seq1)) > 1


def test_score_skips_draining_open_and_stale(score: ModuleType) -> None:
    states = fresh(score, 4, waiting=6, running=8)
    states[0].on_scrape(0.0, 0, 0, None)
    states[0].draining = True
    states[1].on_scrape(0.0, 0, 0, None)
    b = states[1].breaker
    for _ in range(b.failures):
        b.record_failure(0.0)
    states[2].on_scrape(-10.0, 0, 0, None)  # stale: never looks idle
    assert picks(score.Picker("score", seed=1), states, 20) == {3: 20}


def test_score_routes_a_blind_replica_on_its_own_requests(score: ModuleType) -> None:
    """A replica read without gauges (llama-server without --metrics, a failing metrics page) is
    routed on this router's requests in flight there: never taken for an idle one (it fills up like
    any, to the pool's capacity), never left idle while its siblings queue (it took nothing)."""
    states = fresh(score, 2, waiting=3, running=8)
    states[0].on_scrape(0.0, None, None, None)  # fresh, no numbers
    p = score.Picker("score", seed=1)
    order = []
    for _ in range(40):
        i = p.pick(states, 1.0, STALE)
        order.append(i)
        states[i].on_dispatch(1.0)
    got = Counter(order)
    assert order[:8] == [0] * 8, order  # (its free slots first: the other queues)
    assert got[1] >= 10 and got[0] <= 30, got  # (then its own queue counts: never taken for an idle one)
    assert states[0].inflight == got[0]


def test_score_falls_back_to_least_inflight_when_nothing_is_fresh(score: ModuleType) -> None:
    states = [score.EndpointState(i) for i in range(3)]  # never scraped
    states[0].on_dispatch(0.0)
    states[2].on_dispatch(0.0)
    p = score.Picker("score", seed=1)
    assert picks(p, states, 10) == {1: 10}
    for s in states:
        s.on_scrape(0.0, None, None, None)  # engine without gauges
    assert picks(p, states, 10) == {1: 10}


def test_pick_takes_the_half_open_probe_only_for_the_chosen_replica(score: ModuleType) -> None:
    a, b = fresh(score, 2, waiting=0, running=0)
    b.on_scrape(0.0, 5, 8, None)
    for s in (a, b):
        for _ in range(s.breaker.failures):
            s.breaker.record_failure(0.0)
    p = score.Picker("score", seed=1)
    now = a.breaker.open_until + 0.1
    a.scraped_at = b.scraped_at = now
    assert p.pick([a, b], now, STALE) == 0  # a probes
    assert a.breaker.state == "half_open"
    assert b.breaker.state == "open"  # not chosen: its probe is still available
    assert b.breaker.available(now)
    assert p.pick([a, b], now, STALE) == 1  # a's probe is out; b probes
    assert p.pick([a, b], now, STALE) == -1
    a.breaker.record_success(now + 1)
    assert p.pick([a, b], now + 1, STALE) == 0


# -- Picker: least_inflight, round_robin ----------------------------------------------


def test_least_inflight(score: ModuleType) -> None:
    states = [score.EndpointState(i) for i in range(4)]
    for i, n in enumerate((3, 1, 1, 2)):
        for _ in range(n):
            states[i].on_dispatch(0.0)
    got = picks(score.Picker("least_inflight", seed=4), states, 400)
    assert set(got) == {1, 2}  # ties broken at random
    assert min(got.values()) > 120
    states[1].draining = True
    assert picks(score.Picker("least_inflight", seed=4), states, 10) == {2: 10}


def test_round_robin_rotates_over_usable(score: ModuleType) -> None:
    states = [score.EndpointState(i) for i in range(4)]
    p = score.Picker("round_robin", seed=0)
    assert [p.pick(states, 0.0, STALE) for _ in range(6)] == [0, 1, 2, 3, 0, 1]
    states[3].draining = True
    assert [p.pick(states, 0.0, STALE) for _ in range(4)] == [2, 0, 1, 2]
    assert [p.pick(states[:2], 0.0, STALE) for _ in range(3)] == [1, 0, 1]  # a shorter list wraps


def test_random_is_splitmix64(score: ModuleType) -> None:
    # reference values of SplitMix64 seeded with 0
    p = score.Picker("score", seed=0)
    assert [p.random() for _ in range(3)] == [
        0xE220A8397B1DCDAF,
        0x6E789E6AA1B965F4,
        0x06C45D188009454F,
    ]


# -- saturation of a pool, Retry-After ----------------------------------------------


def test_pool_saturation(score: ModuleType) -> None:
    states = fresh(score, 4, waiting=4, running=8)
    assert score.pool_saturation(states, 1.0, STALE, 8, 0.9) == 0.5
    states[0].scraped_at = -10.0  # stale: counts 1.0
    assert score.pool_saturation(states, 1.0, STALE, 8, 0.9) == pytest.approx(0.625)
    states[1].draining = True  # excluded
    b = states[2].breaker
    for _ in range(b.failures):
        b.record_failure(1.0)  # open: excluded
    assert score.pool_saturation(states, 1.0, STALE, 8, 0.9) == pytest.approx(0.75)
    states[0].draining = states[3].draining = True
    assert score.pool_saturation(states, 1.0, STALE, 8, 0.9) == math.inf
    assert score.pool_saturation([], 1.0, STALE, 8, 0.9) == math.inf


def test_retry_after(score: ModuleType) -> None:
    states = [score.EndpointState(i) for i in range(2)]
    assert score.retry_after(states, 10, 0.0) == score.RETRY_AFTER_DEFAULT  # no rate known
    states[0].drain_rate = 2.0
    states[1].drain_rate = 3.0
    assert score.retry_after(states, 49, 0.0) == pytest.approx(10.0)  # 50 completions at 5/s
    assert score.retry_after(states, 0, 0.0) == score.RETRY_AFTER_MIN
    assert score.retry_after(states, 10_000, 0.0) == score.RETRY_AFTER_MAX
    states[1].draining = True
    assert score.retry_after(states, 49, 0.0) == pytest.approx(25.0)


# -- Breaker --------------------------------------------------------------------------


def open_breaker(b: Any, now: float) -> None:
    for _ in range(b.failures):
        b.record_failure(now)


def test_breaker_opens_after_n_consecutive_failures(score: ModuleType) -> None:
    b = score.Breaker(3, 5.0)
    b.record_failure(0.0)
    b.record_failure(0.0)
    b.record_success(0.0)  # not consecutive any more
    b.record_failure(0.0)
    b.record_failure(0.0)
    assert b.state == "closed"
    assert b.allow(0.0)
    b.record_failure(1.0)
    assert b.state == "open"
    assert b.state_code == score.BREAKER_OPEN
    assert b.open_until == 6.0
    assert b.opened == 1
    assert not b.allow(5.9)
    assert not b.available(5.9)


def test_breaker_half_open_lets_exactly_one_probe(score: ModuleType) -> None:
    b = score.Breaker(1, 5.0)
    b.record_failure(0.0)
    assert b.available(5.0)
    assert b.state == "open"  # available() changes nothing
    assert b.allow(5.0)
    assert b.state == "half_open"
    assert b.state_code == score.BREAKER_HALF_OPEN
    assert b.probes == 1
    assert not b.available(5.1)
    assert not b.allow(5.1)
    b.record_success(6.0)
    assert b.state == "closed"
    assert b.closed == 1
    assert b.current_cooldown == 5.0
    assert b.allow(6.0)


def test_breaker_failed_probe_doubles_the_cooldown_up_to_the_max(score: ModuleType) -> None:
    b = score.Breaker(1, 5.0, max_cooldown=12.0)
    b.record_failure(0.0)
    t = 0.0
    for expect in (10.0, 12.0, 12.0):
        t = b.open_until
        assert b.allow(t)
        b.record_failure(t)
        assert b.state == "open"
        assert b.current_cooldown == expect
        assert b.open_until == t + expect
    assert b.opened == 4
    t = b.open_until
    assert b.allow(t)
    b.record_success(t)
    assert b.current_cooldown == 5.0  # reset on close
    b.record_failure(t)
    assert b.open_until == t + 5.0


def test_breaker_ignores_late_reports_while_open(score: ModuleType) -> None:
    b = score.Breaker(2, 5.0)
    open_breaker(b, 0.0)
    b.record_failure(1.0)  # a request sent before it opened
    b.record_success(1.0)
    assert b.state == "open"
    assert b.open_until == 5.0


def test_breaker_lost_probe(score: ModuleType) -> None:
    b = score.Breaker(1, 5.0, max_cooldown=20.0)
    b.record_failure(0.0)
    assert b.allow(5.0)
    assert not b.allow(6.0)
    b.release()  # the probe's client went away
    assert b.allow(6.0)
    assert not b.allow(7.0)
    assert b.allow(26.0)  # no report for max_cooldown seconds: another request may probe
    assert b.probes == 3


def test_breaker_arguments(score: ModuleType) -> None:
    with pytest.raises(ValueError):
        score.Breaker(0, 5.0)
    with pytest.raises(ValueError):
        score.Breaker(5, -1.0)
    with pytest.raises(ValueError):
        score.Breaker(5, 10.0, max_cooldown=5.0)
    b = score.Breaker()
    assert (b.failures, b.cooldown, b.max_cooldown) == (5, 5.0, 60.0)
    assert score.BREAKER_CLOSED == 0 and b.state_code == score.BREAKER_CLOSED


# -- RetryBudget ------------------------------------------------------------------------


def test_retry_budget(score: ModuleType) -> None:
    r = score.RetryBudget(0.2, min_inflight=1)
    assert r.can_retry(1)  # the floor: a lone request may retry
    r.record_retry()
    assert not r.can_retry(1)
    assert r.can_retry(10)  # 0.2 * 10 = 2
    r.record_retry()
    assert not r.can_retry(10)
    assert r.refused == 2
    r.done_retry()
    r.done_retry()
    r.done_retry()  # never below zero
    assert r.retrying == 0
    assert r.retries == 2
    assert score.RetryBudget().min_inflight == 3
    with pytest.raises(ValueError):
        score.RetryBudget(-0.1)


def test_retry_budget_bounds_an_outage(score: ModuleType) -> None:
    r = score.RetryBudget(0.2, min_inflight=3)
    granted = 0
    for _ in range(1000):  # 1000 active requests all failing at once
        if r.can_retry(1000):
            r.record_retry()
            granted += 1
    assert granted == 200


# -- both twins -------------------------------------------------------------------------

# Differential tests need the compiled twin: deselected in pure runs (LLMGW_NO_EXTENSIONS=1),
# and an error where the extensions were expected but are missing.
needs_c = pytest.mark.c_extension
DIFF = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

STATE_FIELDS = (
    "index",
    "inflight",
    "waiting",
    "running",
    "kv_cache_usage",
    "scraped_at",
    "dispatched_since_scrape",
    "completed_since_scrape",
    "drain_rate",
    "latency",
    "slots",
    "max_running",
    "seen_full",
)
BREAKER_FIELDS = (
    "state",
    "failures",
    "cooldown",
    "max_cooldown",
    "consecutive_failures",
    "open_until",
    "current_cooldown",
    "opened",
    "half_opened",
    "closed",
    "probes",
)


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


@pytest.mark.c_extension
@needs_c
def test_same_public_names() -> None:
    assert score_c is not None
    for name in score_py.__all__:
        assert hasattr(score_c, name), name
    for cls in ("EndpointState", "Picker", "Breaker", "RetryBudget"):
        members = {n for n in dir(getattr(score_py, cls)) if not n.startswith("_")}
        assert {n for n in dir(getattr(score_c, cls)) if not n.startswith("_")} == members, cls
    for name in (
        "DRAIN_TAU",
        "NEAR_TIE",
        "PREFILL_SHARE",
        "KV_KNEE",
        "KV_WEIGHT",
        "RETRY_AFTER_MIN",
        "RETRY_AFTER_MAX",
        "RETRY_AFTER_DEFAULT",
        "STRATEGIES",
        "BREAKER_CLOSED",
        "BREAKER_OPEN",
        "BREAKER_HALF_OPEN",
    ):
        assert getattr(score_c, name) == getattr(score_py, name), name


maybe_none = st.one_of(st.none(), st.integers(0, 40).map(float))
kv_value = st.one_of(st.none(), st.floats(0.0, 1.0))

OPS = st.one_of(
    st.tuples(st.just("tick"), st.floats(0.0, 2.0)),
    st.tuples(st.just("scrape"), st.integers(0, 7), maybe_none, maybe_none, kv_value),
    st.tuples(st.just("sent"), st.integers(0, 7)),
    st.tuples(st.just("dispatch"), st.integers(0, 7)),
    st.tuples(st.just("complete"), st.integers(0, 7)),
    st.tuples(st.just("abort"), st.integers(0, 7)),
    st.tuples(st.just("pick")),
    st.tuples(st.just("pick")),
    st.tuples(st.just("drain"), st.integers(0, 7), st.booleans()),
    st.tuples(st.just("slots"), st.integers(0, 7), st.sampled_from([math.nan, 0.0, 2.0, 8.0])),
    st.tuples(st.just("fail"), st.integers(0, 7)),
    st.tuples(st.just("ok"), st.integers(0, 7)),
    st.tuples(st.just("release"), st.integers(0, 7)),
    st.tuples(st.just("allow"), st.integers(0, 7)),
)


def run_ops(mod: ModuleType, strategy: str, seed: int, n: int, ops: list[tuple[Any, ...]]) -> list[Any]:
    states = [mod.EndpointState(i, mod.Breaker(2, 1.0, 4.0)) for i in range(n)]
    picker = mod.Picker(strategy, seed=seed)
    budget = mod.RetryBudget(0.25, 1)
    now = 0.0
    trace: list[Any] = []
    for op in ops:
        kind = op[0]
        s: Any = states[op[1] % n] if len(op) > 1 and kind != "tick" else None
        if kind == "tick":
            now += op[1]
        elif kind == "scrape":
            s.on_scrape(now, op[2], op[3], op[4])
        elif kind == "sent":
            s.on_scrape_sent()
        elif kind == "dispatch":
            s.on_dispatch(now)
        elif kind == "complete":
            s.on_complete(now)
        elif kind == "abort":
            s.on_abort(now)
        elif kind == "pick":
            i = picker.pick(states, now, 1.5)
            trace.append(("pick", i))
            if i >= 0:
                states[i].on_dispatch(now)
        elif kind == "drain":
            s.draining = op[2]
        elif kind == "slots":
            s.slots = op[2]
        elif kind == "fail":
            s.breaker.record_failure(now)
        elif kind == "ok":
            s.breaker.record_success(now)
        elif kind == "release":
            s.breaker.release()
        elif kind == "allow":
            trace.append(("allow", s.breaker.allow(now)))
        trace.append(("pool", mod.pool_saturation(states, now, 1.5, 4, 0.9)))
        trace.append(("retry", mod.retry_after(states, len(trace), now)))
        trace.append(("budget", budget.can_retry(len(trace) % 7)))
    for s in states:
        trace.append(tuple(getattr(s, f) for f in STATE_FIELDS))
        trace.append(tuple(getattr(s.breaker, f) for f in BREAKER_FIELDS))
        trace.append((s.load(), s.queued(), s.capacity(), s.saturation(now, 1.5, 4, 0.9), s.stale(now, 1.5)))
        trace.append((bool(s.draining), s.usable(now), s.breaker.available(now)))
    trace.append(("rng", picker.random()))
    return trace


def assert_same_trace(a: list[Any], b: list[Any]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert len(x) == len(y), (x, y)
        for u, v in zip(x, y, strict=True):
            if isinstance(u, float) or isinstance(v, float):
                assert same(u, v), (x, y)
            else:
                assert u == v, (x, y)


@pytest.mark.c_extension
@needs_c
@DIFF
@given(
    st.sampled_from(score_py.STRATEGIES),
    st.integers(0, 2**64 - 1),
    st.integers(1, 8),
    st.lists(OPS, max_size=80),
)
def test_differential_operation_sequences(
    strategy: str, seed: int, n: int, ops: list[tuple[Any, ...]]
) -> None:
    assert score_c is not None
    assert_same_trace(run_ops(score_c, strategy, seed, n, ops), run_ops(score_py, strategy, seed, n, ops))


@pytest.mark.c_extension
@needs_c
@DIFF
@given(st.integers(0, 2**64 - 1), st.data())
def test_differential_score_on_busy_fleets(seed: int, data: st.DataObject) -> None:
    """Many replicas with realistic numbers: the same pick sequence, near-ties and all."""
    n = data.draw(st.integers(1, 64))
    rows = data.draw(
        st.lists(
            st.tuples(
                st.integers(0, 20), st.integers(0, 16), kv_value, st.floats(0.1, 30.0), st.integers(0, 5)
            ),
            min_size=n,
            max_size=n,
        )
    )

    def run(mod: ModuleType) -> list[int]:
        states = []
        for i, (w, r, kv, lat, d) in enumerate(rows):
            s = mod.EndpointState(i)
            s.on_scrape(0.0, w, r, kv)
            s.latency = lat
            for _ in range(d):
                s.on_dispatch(0.01)
            states.append(s)
        p = mod.Picker("score", seed=seed)
        out = []
        for _ in range(20):
            i = p.pick(states, 0.5, 3.0)
            out.append(i)
            states[i].on_dispatch(0.5)
        return out

    assert score_c is not None
    assert run(score_c) == run(score_py)


def test_seed_none_draws_from_the_os(score: ModuleType) -> None:
    a, b = score.Picker("score"), score.Picker("score")
    assert a.random() != b.random()


def _answered_500s(p_bad: float, sick: int | None, seed: int, n: int = 3000) -> list[int]:
    """Two replicas picked at random; a share ``p_bad`` of the requests fail on whichever gets them (one
    client's bad input), and replica ``sick`` fails everything: the breakers' openings, by the gateway's
    rule for answered 500s (``Gateway.answered_5xx_counts``, the pure twin's)."""
    import random

    from llmgw._fast import proxy_py

    rnd = random.Random(seed)
    states = [score_py.EndpointState(i, score_py.Breaker(5, 5.0, 60.0)) for i in range(2)]

    class Pool:
        pass

    class Ep:
        def __init__(self, st: Any) -> None:
            self.state = st

    pool = Pool()
    pool.states = states  # type: ignore[attr-defined]
    now = 100.0
    for _ in range(n):
        now += 0.05
        up = [i for i in range(2) if states[i].breaker.available(now)]
        if not up:
            continue
        i = rnd.choice(up)
        st = states[i]
        probe = st.breaker.state != "closed"
        st.breaker.allow(now)
        st.on_dispatch(now)
        if rnd.random() < p_bad or i == sick:
            st.on_abort(now)
            st.answered_error(False)
            if proxy_py.Gateway.answered_5xx_counts(None, pool, Ep(st), 500, now):  # type: ignore[arg-type]
                st.breaker.record_failure(now)
            elif probe:
                st.breaker.release()
        else:
            st.on_complete(now)
            st.breaker.record_success(now)
    return [s.breaker.opened for s in states]


@pytest.mark.parametrize("p_bad", [0.5, 0.8, 0.95])
def test_one_clients_500s_among_good_traffic_open_no_breaker(p_bad: float) -> None:
    """Requests every replica fails, mixed with good ones at random, err alike on both replicas: no
    verdict on either (any sibling answer since the streak began opened a healthy replica 8-18 times)."""
    assert _answered_500s(p_bad, None, seed=1) == [0, 0]


@pytest.mark.parametrize("p_bad", [0.0, 0.3])
def test_a_replica_failing_what_its_sibling_serves_opens(p_bad: float) -> None:
    opened = _answered_500s(p_bad, 1, seed=1)
    assert opened[0] == 0 and opened[1] >= 4, opened  # (each reopening doubles the cooldown: out most of the time)


def test_score_takes_an_idle_replica_over_a_queue_after_one_long_answer(score: ModuleType) -> None:
    """QA, on two real llama-server replicas: one long answer among few left a healthy replica with a
    latency 40 times its sibling's (a replica's latency is its requests' mean time: as much how long they
    were as its speed), and score queued a burst on the sibling while it idled. No replica is scored more
    than MAX_SLOWER times slower than the fastest: an idle one wins over a queue."""
    quick, long_one = fresh(score, 2)
    serve(quick, 0.0, 0.02, 6, 0.5)
    serve(long_one, 0.0, 0.02, 3, 0.5)
    serve(long_one, 2.0, 6.3, 1, 0.0)
    for s in (quick, long_one):
        s.slots = 2.0
    assert long_one.latency > 20 * quick.latency  # (the skew the QA run saw)
    quick.on_scrape(8.5, 0, 2, None)  # its two slots busy: one more would queue
    long_one.on_scrape(8.5, 0, 0, None)
    assert picks(score.Picker("score", seed=3), [quick, long_one], 20, now=8.6) == {1: 20}
    # a replica that is slower, measured over many requests, is still told apart (test_score_weighs_replica_speed)
