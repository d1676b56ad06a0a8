"""``llmgw._fast.admit``: bounded per-band admission queues, fair across tenants.

Behaviour tests run against both twins through the ``admit`` fixture; the
differential test drives both twins with the same random operation sequences and
requires the same return values and the same queue contents.
"""

from __future__ import annotations

import gc
import importlib
import math
import weakref
from types import ModuleType
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw._fast import admit_py

admit_c: ModuleType | None
try:
    admit_c = importlib.import_module("llmgw._fast.admit")
except ImportError:  # pragma: no cover - pure build
    admit_c = None


class Waiter:
    """Stands in for the proxy's waiter (opaque to the queue, unhashable on purpose)."""

    __hash__ = None  # type: ignore[assignment]

    def __init__(self, name: str) -> None:
        self.name = name

    def __eq__(self, other: object) -> bool:  # equal names, distinct objects
        return isinstance(other, Waiter) and other.name == self.name

    def __repr__(self) -> str:
        return self.name


def names(items: list[Any]) -> list[str]:
    return [w.name for w in items]


def test_arguments(admit: ModuleType) -> None:
    with pytest.raises(ValueError):
        admit.AdmissionQueue(0, 10)
    with pytest.raises(ValueError):
        admit.AdmissionQueue(3, -1)
    q = admit.AdmissionQueue(3, 10)
    assert (q.bands, q.queue_size, len(q)) == (3, 10, 0)
    with pytest.raises(ValueError):
        q.push(3, "a", Waiter("x"))
    with pytest.raises(ValueError):
        q.push(-1, "a", Waiter("x"))
    with pytest.raises(ValueError):
        q.depth(5)
    with pytest.raises(TypeError):
        q.push(1.0, "a", Waiter("x"))


def test_fifo_per_tenant(admit: ModuleType) -> None:
    q = admit.AdmissionQueue(1, 10)
    ws = [Waiter(f"w{i}") for i in range(5)]
    for w in ws:
        assert q.push(0, "a", w) is None
    assert len(q) == 5
    assert names([q.pop() for _ in range(5)]) == ["w0", "w1", "w2", "w3", "w4"]
    assert q.pop() is None
    assert len(q) == 0


def test_bands_are_served_strictly_in_order(admit: ModuleType) -> None:
    q = admit.AdmissionQueue(3, 10)
    q.push(2, "a", Waiter("batch"))
    q.push(1, "a", Waiter("standard"))
    q.push(0, "a", Waiter("critical"))
    q.push(2, "a", Waiter("batch2"))
    assert [q.depth(b) for b in range(3)] == [1, 1, 2]
    assert names(q.clear()) == ["critical", "standard", "batch", "batch2"]


def test_round_robin_across_tenants(admit: ModuleType) -> None:
    q = admit.AdmissionQueue(1, 100)
    for i in range(6):
        q.push(0, "noisy", Waiter(f"n{i}"))
    q.push(0, "quiet", Waiter("q0"))
    q.push(0, "other", Waiter("o0"))
    q.push(0, "quiet", Waiter("q1"))
    assert q.tenants(0) == 3
    # one per tenant per round, in order of first arrival; a tenant that had its
    # turn goes to the back
    assert names(q.clear()) == ["n0", "q0", "o0", "n1", "q1", "n2", "n3", "n4", "n5"]


def test_a_new_tenant_joins_at_the_back(admit: ModuleType) -> None:
    q = admit.AdmissionQueue(1, 100)
    for i in range(3):
        q.push(0, "a", Waiter(f"a{i}"))
        q.push(0, "b", Waiter(f"b{i}"))
    assert q.pop().name == "a0"
    q.push(0, "c", Waiter("c0"))
    assert names(q.clear()) == ["b0", "a1", "c0", "b1", "a2", "b2"]


def test_remove(admit: ModuleType) -> None:
    q = admit.AdmissionQueue(2, 10)
    a0, a1, b0 = Waiter("a0"), Waiter("a1"), Waiter("b0")
    q.push(1, "a", a0)
    q.push(1, "a", a1)
    q.push(1, "b", b0)
    assert a1 in q
    assert q.remove(a1)
    assert a1 not in q
    assert not q.remove(a1)
    assert not q.remove(Waiter("a1"))  # identity, not equality
    assert len(q) == 2 and q.depth(1) == 2
    assert q.remove(b0)
    assert q.tenants(1) == 1  # b had nothing left: dropped at once
    assert names(q.clear()) == ["a0"]
    assert q.tenants(1) == 0


def test_duplicate_push_is_an_error(admit: ModuleType) -> None:
    q = admit.AdmissionQueue(2, 10)
    w = Waiter("w")
    q.push(0, "a", w)
    with pytest.raises(ValueError, match="already"):
        q.push(1, "b", w)
    assert len(q) == 1


def test_full_band_evicts_the_newest_of_the_lowest_band(admit: ModuleType) -> None:
    q = admit.AdmissionQueue(3, 2)
    s0, s1 = Waiter("s0"), Waiter("s1")
    b0, b1 = Waiter("b0"), Waiter("b1")
    q.push(1, "a", s0)
    q.push(1, "a", s1)
    q.push(2, "a", b0)
    q.push(2, "b", b1)
    # standard is full: the newest batch item makes room
    s2 = Waiter("s2")
    assert q.push(1, "a", s2) is b1
    assert [q.depth(b) for b in range(3)] == [0, 3, 1]
    # critical has room: no eviction
    assert q.push(0, "a", Waiter("c0")) is None
    assert q.push(0, "a", Waiter("c1")) is None
    # critical full: batch is the lowest with items
    assert q.push(0, "a", Waiter("c2")) is b0
    # critical full again: batch is empty, standard gives up its newest
    assert q.push(0, "a", Waiter("c3")) is s2
    # batch is under its size but the whole queue is full: nothing below batch
    assert len(q) == 6
    assert q.push(2, "a", Waiter("b2")) is False
    # standard is at its size and only standard and critical hold items
    assert q.push(1, "a", Waiter("s3")) is False
    assert len(q) == 6
    assert names(q.clear()) == ["c0", "c1", "c2", "c3", "s0", "s1"]


def test_a_full_band_makes_room_for_a_tenant_with_fewer_waiting(admit: ModuleType) -> None:
    """With nothing lower to evict, a full band takes a newcomer whose tenant holds at least two
    fewer than the band's biggest tenant: that tenant's newest makes room (a tenant with many
    clients kept the band full, and the others were refused at the door)."""
    q = admit.AdmissionQueue(1, 4)
    big = [Waiter(f"a{i}") for i in range(4)]
    for w in big:
        assert q.push(0, "a", w) is None
    b0 = Waiter("b0")
    assert q.push(0, "b", b0) is big[3]  # (a: 4, b: 0 -> a gives up its newest)
    assert q.push(0, "b", Waiter("b1")) is big[2]  # (a: 3, b: 1)
    assert q.push(0, "b", Waiter("b2")) is False  # (a: 2, b: 2: even, b waits its turn elsewhere)
    assert q.push(0, "c", Waiter("c0")) is big[1]  # (a: 2, c: 0: the first of the biggest in turn)
    assert [q.pop().name for _ in range(4)] == ["a0", "b0", "c0", "b1"]


def test_the_whole_queue_never_exceeds_bands_times_size(admit: ModuleType) -> None:
    q = admit.AdmissionQueue(3, 4)
    pushed = 0
    for i in range(100):
        r = q.push(i % 3 if i < 50 else 0, f"t{i % 5}", Waiter(f"w{i}"))
        pushed += r is None
        assert len(q) <= 12
    assert len(q) == 12
    assert q.depth(0) == 12  # critical displaced everything else


def test_zero_size_refuses_everything(admit: ModuleType) -> None:
    q = admit.AdmissionQueue(2, 0)
    assert q.push(0, "a", Waiter("x")) is False
    assert q.push(1, "a", Waiter("y")) is False
    assert len(q) == 0


def test_oldest_age(admit: ModuleType) -> None:
    q = admit.AdmissionQueue(2, 10)
    assert q.oldest_age(5.0) == 0.0
    a, b = Waiter("a"), Waiter("b")
    q.push(1, "t", a, 1.0)
    q.push(0, "t", b, 2.0)
    assert q.oldest_age(5.0) == 4.0
    q.remove(a)
    assert q.oldest_age(5.0) == 3.0
    q.push(1, "t", Waiter("c"))  # no time given
    assert math.isnan(q.oldest_age(5.0))


def test_items_are_released(admit: ModuleType) -> None:
    """Popped, removed and evicted items are not kept alive by the queue."""
    q = admit.AdmissionQueue(2, 1)
    a, b, c = Waiter("a"), Waiter("b"), Waiter("c")
    refs = [weakref.ref(w) for w in (a, b, c)]
    q.push(1, "t", a)
    q.push(0, "t", b)
    assert q.push(0, "t", c) is a  # evicted
    q.remove(b)
    q.pop()
    del a, b, c
    gc.collect()
    assert all(r() is None for r in refs)


def test_no_tenant_slots_leak_under_churn(admit: ModuleType) -> None:
    q = admit.AdmissionQueue(3, 50)
    live: list[Waiter] = []
    for i in range(3000):
        w = Waiter(f"w{i}")
        r = q.push(i % 3, f"tenant{i % 37}", w)
        if r is None or r is not False:
            live.append(w)
        if r is not None and r is not False:
            live.remove(r)
        if i % 3 == 0 and live:
            assert q.remove(live.pop(len(live) // 2))
        if i % 5 == 0:
            x = q.pop()
            if x is not None:
                live.remove(x)
    assert len(q) == len(live)
    q.clear()
    assert len(q) == 0
    assert [q.tenants(b) for b in range(3)] == [0, 0, 0]
    assert [q.depth(b) for b in range(3)] == [0, 0, 0]


def test_repr(admit: ModuleType) -> None:
    q = admit.AdmissionQueue(2, 5)
    q.push(1, "a", Waiter("x"))
    assert repr(q) == "<AdmissionQueue [0, 1] of 5>"


# -- both twins ----------------------------------------------------------------------

# Differential tests need the compiled twin: deselected in pure runs (LLMGW_NO_EXTENSIONS=1),
# and an error where the extensions were expected but are missing.
needs_c = pytest.mark.c_extension
DIFF = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.integers(0, 3), st.integers(0, 4)),
        st.tuples(st.just("push"), st.integers(0, 3), st.integers(0, 4)),
        st.tuples(st.just("pop")),
        st.tuples(st.just("remove"), st.integers(0, 1000)),
        st.tuples(st.just("remove_gone"), st.integers(0, 1000)),
    ),
    max_size=120,
)


def run_ops(mod: ModuleType, bands: int, size: int, ops: list[tuple[Any, ...]]) -> list[Any]:
    q = mod.AdmissionQueue(bands, size)
    made: list[Waiter] = []
    trace: list[Any] = []
    for k, op in enumerate(ops):
        if op[0] == "push":
            w = Waiter(f"w{k}")
            made.append(w)
            try:
                r = q.push(op[1], f"t{op[2]}", w, float(k))
            except ValueError as exc:
                trace.append(("error", str(exc)))
                continue
            trace.append(("push", r if r is None or r is False else r.name))
        elif op[0] == "pop":
            r = q.pop()
            trace.append(("pop", None if r is None else r.name))
        elif made:
            w = made[op[1] % len(made)]
            trace.append(("remove", q.remove(w)))
        trace.append((len(q), [q.depth(b) for b in range(bands)], [q.tenants(b) for b in range(bands)]))
        trace.append(q.oldest_age(1000.0))
    trace.append(names(q.clear()))
    return trace


@pytest.mark.c_extension
@needs_c
def test_same_public_names() -> None:
    assert admit_c is not None
    for name in admit_py.__all__:
        assert hasattr(admit_c, name), name
    members = {n for n in dir(admit_py.AdmissionQueue) if not n.startswith("_")}
    assert {n for n in dir(admit_c.AdmissionQueue) if not n.startswith("_")} == members


@pytest.mark.c_extension
@needs_c
@DIFF
@given(st.integers(1, 4), st.integers(0, 6), OPS)
def test_differential_operation_sequences(bands: int, size: int, ops: list[tuple[Any, ...]]) -> None:
    assert admit_c is not None
    assert run_ops(admit_c, bands, size, ops) == run_ops(admit_py, bands, size, ops)


@DIFF
@given(st.integers(1, 4), st.integers(0, 6), OPS)
def test_model_invariants(bands: int, size: int, ops: list[tuple[Any, ...]]) -> None:
    """Against a plain model: bounds hold, pops follow band order and per-tenant FIFO."""
    q = admit_py.AdmissionQueue(bands, size)
    model: dict[int, Waiter] = {}  # id -> waiter queued
    info: dict[int, tuple[int, str, int]] = {}  # id -> (band, tenant, seq)
    made: list[Waiter] = []
    for k, op in enumerate(ops):
        if op[0] == "push" and op[1] < bands:
            w = Waiter(f"w{k}")
            made.append(w)
            before = {b: q.depth(b) for b in range(bands)}
            r = q.push(op[1], f"t{op[2]}", w)
            def held(band: int, tenant: str) -> int:
                return sum(1 for i in model if info[i][0] == band and info[i][1] == tenant)

            if r is False:
                assert before[op[1]] >= size or len(model) >= bands * size
                assert all(before[b] == 0 for b in range(op[1] + 1, bands))
                # nothing lower, and no tenant of the band holds two more than the newcomer's
                mine = held(op[1], f"t{op[2]}")
                assert all(held(op[1], info[i][1]) < mine + 2 for i in model if info[i][0] == op[1])
                continue
            if r is not None:
                rb, rt = info[id(r)][0], info[id(r)][1]
                assert rb >= op[1]
                assert all(before[b] == 0 for b in range(rb + 1, bands))
                if rb == op[1]:  # (the band's fair share: its biggest tenant gave up its newest)
                    assert held(rb, rt) >= held(rb, f"t{op[2]}") + 2
                    assert held(rb, rt) == max(held(rb, info[i][1]) for i in model if info[i][0] == rb)
                    newest = max(s for i, (b, t, s) in info.items() if b == rb and t == rt and i in model)
                else:
                    newest = max(s for i, (b, _, s) in info.items() if b == rb and i in model)
                assert info[id(r)][2] == newest
                del model[id(r)]
            model[id(w)] = w
            info[id(w)] = (op[1], f"t{op[2]}", k)
        elif op[0] == "pop":
            r = q.pop()
            if not model:
                assert r is None
                continue
            top = min(info[i][0] for i in model)
            b, tenant, seq = info[id(r)]
            assert b == top
            assert seq == min(s for i, (bb, t, s) in info.items() if i in model and bb == b and t == tenant)
            del model[id(r)]
        elif made:
            w = made[op[1] % len(made)]
            assert q.remove(w) == (id(w) in model)
            model.pop(id(w), None)
        assert len(q) == len(model) <= bands * size
        for b in range(bands):
            assert q.tenants(b) == len({info[i][1] for i in model if info[i][0] == b})
