"""Counters on the admin ``/metrics`` never go backwards across a reload.

A reload (SIGHUP, ``llmgw ctl reload``, the admin API) that changes a replica, or removes
it and adds it back, makes a new replica object; one that changes the ``prefix``
strategy's knobs makes a new picker. The counters those objects hold
(``llmgw_scrapes_total``, ``llmgw_scrape_duration_seconds``,
``llmgw_routing_decisions_total``) must carry on from where they were: a counter that
drops is a reset to Prometheus. Real gateway, real engines on loopback sockets, the page
scraped over HTTP as a scraper does, and a real Prometheus reading ``resets()``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from admin_helpers import Engine, admin_port, chat, client_port, config_for, families, http, running, sample
from prom_helpers import prometheus, query, scrapes, until

from llmgw.config import load


async def _page(rt: Any) -> dict[str, Any]:
    status, _, body = await http(admin_port(rt), "GET", "/metrics")
    assert status == 200
    return families(body.decode())


def _counts(fams: dict[str, Any], replica: str) -> tuple[float | None, float | None, float | None]:
    return (
        sample(fams, "llmgw_scrapes_total", replica=replica, result="ok"),
        sample(fams, "llmgw_scrape_duration_seconds_count", replica=replica),
        sample(fams, "llmgw_scrape_duration_seconds_sum", replica=replica),
    )


async def _until_scraped(rt: Any, replica: str, at_least: float, timeout: float = 15.0) -> tuple[Any, ...]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        got = _counts(await _page(rt), replica)
        if got[0] is not None and got[0] >= at_least:
            return got
        if loop.time() > deadline:
            raise AssertionError(f"{replica} not scraped {at_least} times in time: {got}")
        await asyncio.sleep(0.1)


def _monotonic(before: tuple[Any, ...], after: tuple[Any, ...]) -> None:
    assert None not in before and None not in after, (before, after)
    assert all(a >= b for a, b in zip(after, before, strict=True)), f"went backwards: {before} -> {after}"


def _cfg(engines: list[Engine], slots: int | None = None, keep_b: bool = True, **extra: Any) -> Any:
    raw = config_for(engines, **extra)
    raw["endpoints"] = [e for e in raw["endpoints"] if keep_b or e["id"] != "b"]
    for e in raw["endpoints"]:
        if e["id"] == "b" and slots is not None:
            e["slots"] = slots
    return load(raw)


async def test_scrape_counters_carry_on_across_a_reload_that_changes_or_readds_a_replica() -> None:
    a, b = Engine("a"), Engine("b")
    async with running([a, b]) as rt:
        first = await _until_scraped(rt, "b", 3)
        # a reload that changes the replica (any key): a new replica object
        rt.reload(_cfg([a, b], slots=4))
        changed = _counts(await _page(rt), "b")
        _monotonic(first, changed)
        later = await _until_scraped(rt, "b", (changed[0] or 0) + 2)  # (and it goes on counting)
        _monotonic(changed, later)
        # removed (its series go), then added back: it carries on from where it was
        rt.reload(_cfg([a, b], slots=4, keep_b=False))
        fams = await _page(rt)
        assert _counts(fams, "b") == (None, None, None)
        rt.reload(_cfg([a, b], slots=4))
        back = _counts(await _page(rt), "b")
        _monotonic(later, back)
        # a replica untouched by the reloads was never restarted either
        assert (_counts(await _page(rt), "a")[0] or 0) >= first[0]


async def test_routing_decisions_carry_on_across_a_reload_that_replaces_the_picker() -> None:
    a = Engine("a")
    routing = {"strategy": "prefix", "prefix": {"load_bound": 0.25}}
    async with running([a], routing=routing) as rt:
        for _ in range(3):
            assert await chat(client_port(rt)) == 200
        before = sample(await _page(rt), "llmgw_routing_decisions_total", model="m")
        assert before == 3
        # new prefix knobs: a new picker (its index forgotten, as routing.md says), the count kept
        rt.reload(_cfg([a], routing={"strategy": "prefix", "prefix": {"load_bound": 0.5}}))
        assert sample(await _page(rt), "llmgw_routing_decisions_total", model="m") == 3
        assert await chat(client_port(rt)) == 200
        assert sample(await _page(rt), "llmgw_routing_decisions_total", model="m") == 4
        # off the prefix strategy and back: no sample meanwhile, then on from 4
        rt.reload(_cfg([a], routing={"strategy": "score"}))
        assert sample(await _page(rt), "llmgw_routing_decisions_total", model="m") is None
        rt.reload(_cfg([a], routing={"strategy": "prefix"}))
        assert sample(await _page(rt), "llmgw_routing_decisions_total", model="m") == 4


@pytest.mark.needs_tool("prometheus", install="apt-get install prometheus")
async def test_prometheus_sees_no_counter_reset_across_a_reload(tmp_path: Path) -> None:
    a, b = Engine("a"), Engine("b")
    async with running([a, b]) as rt, prometheus(tmp_path, admin_port(rt)) as port:
        await until(lambda: scrapes(port) >= 2, 60)
        await _until_scraped(rt, "b", 3)
        rt.reload(_cfg([a, b], slots=4))  # b is a new replica object from here
        seen = scrapes(port)
        await until(lambda: scrapes(port) >= seen + 2, 30)
        for name in ("llmgw_scrapes_total", "llmgw_scrape_duration_seconds_count"):
            res = query(port, f'resets({name}{{replica="b"}}[5m])')
            assert res["status"] == "success", res
            assert [float(r["value"][1]) for r in res["data"]["result"]] == [0.0] * len(res["data"]["result"])
            assert res["data"]["result"], name


class _Counts:
    def __init__(self, n: int) -> None:
        self.n = n


def _n(c: _Counts) -> tuple[float, ...]:
    return (c.n,)


def test_carried_counts_are_forgotten_an_hour_after_their_series_went() -> None:
    from llmgw.admin.metrics import Carried

    carried = Carried(forget_s=3600.0)
    old, new = _Counts(5), _Counts(1)
    assert carried.read(("k",), old, _n) == (5,)
    carried.done()
    carried.done()  # gone at this scrape: its 5 kept for when it comes back
    assert carried.read(("k",), new, _n) == (6,)
    carried.done()
    carried.done()  # gone again
    carried.forget_s = 0.0
    carried.done()  # ...for longer than forget_s: forgotten (no memory held for replicas gone for good)
    assert carried.read(("k",), _Counts(2), _n) == (2,)


def test_the_same_object_back_on_the_page_is_not_counted_twice() -> None:
    # A pool emptied and filled again keeps its picker: its counts carry on from its own,
    # never its earlier counts added once more (the page would jump by what it had counted).
    from llmgw.admin.metrics import Carried

    carried = Carried()
    picker = _Counts(5)
    assert carried.read(("k",), picker, _n) == (5,)
    carried.done()
    carried.done()  # not on the page at this scrape
    picker.n = 7
    assert carried.read(("k",), picker, _n) == (7,)
    carried.done()
    assert carried.read(("k",), _Counts(1), _n) == (8,)  # then a reload's new picker: 7 carried + its 1
