"""``/debug/pprof/*``: CPU profiles, task and thread dumps, heap snapshots of the running process."""

from __future__ import annotations

import asyncio
import pstats
import time
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from admin_helpers import Engine, admin_port, http, running


def burn_cpu_in_the_loop(ms: float) -> int:
    """Pure-Python work on the loop thread, so profiles have something to find."""
    end = time.perf_counter() + ms / 1000
    n = 0
    while time.perf_counter() < end:
        n += sum(i * i for i in range(200))
    return n


async def busy_task(stop: asyncio.Event) -> None:
    while not stop.is_set():
        burn_cpu_in_the_loop(5)
        await asyncio.sleep(0.001)


@pytest.fixture
async def rt() -> AsyncIterator[Any]:
    async with running([Engine("a")]) as runtime:
        yield runtime


async def get(rt: Any, path: str) -> tuple[int, dict[str, str], bytes]:
    return await http(admin_port(rt), "GET", path, timeout=20)


async def test_cpu_profile_speedscope(rt: Any) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(busy_task(stop), name="burner")
    try:
        prof_req = asyncio.create_task(get(rt, "/debug/pprof/profile?seconds=0.6&hz=250"))
        await asyncio.sleep(0.15)
        # one profile at a time
        status, _, body = await get(rt, "/debug/pprof/profile?seconds=0.1")
        assert status == 409 and orjson.loads(body)["error"]["code"] == "profile_in_progress"
        status, hdrs, body = await prof_req
    finally:
        stop.set()
        await task
    assert status == 200
    assert hdrs["content-type"] == "application/json"
    assert "speedscope.json" in hdrs["content-disposition"]
    doc = orjson.loads(body)
    assert doc["$schema"] == "https://www.speedscope.app/file-format-schema.json"
    frames = doc["shared"]["frames"]
    (profile,) = doc["profiles"]
    assert profile["type"] == "sampled" and profile["unit"] == "seconds"
    assert len(profile["samples"]) == len(profile["weights"]) >= 20
    assert all(0 <= i < len(frames) for s in profile["samples"] for i in s)
    assert 0.3 < profile["endValue"] < 5
    names = {f["name"] for f in frames}
    assert "burn_cpu_in_the_loop" in names
    burning = sum(
        1 for s in profile["samples"] if any(frames[i]["name"] == "burn_cpu_in_the_loop" for i in s)
    )
    assert burning >= len(profile["samples"]) // 4
    assert any(f["file"].endswith("test_admin_profiling.py") for f in frames)


async def test_cpu_profile_collapsed_and_limits(rt: Any) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(busy_task(stop))
    try:
        status, hdrs, body = await get(rt, "/debug/pprof/profile?seconds=0.3&format=collapsed")
    finally:
        stop.set()
        await task
    assert status == 200 and hdrs["content-type"].startswith("text/plain")
    lines = body.decode().splitlines()
    assert lines and all(line.rsplit(" ", 1)[1].isdigit() for line in lines)
    assert any("burn_cpu_in_the_loop (" in line for line in lines)
    for bad in ("seconds=61", "seconds=0", "seconds=abc", "hz=5000", "format=svg"):
        status, _, body = await get(rt, f"/debug/pprof/profile?{bad}")
        assert status == 400, bad
        assert orjson.loads(body)["error"]["param"] in ("seconds", "hz", "format")


async def test_cpu_profile_pstats(rt: Any, tmp_path: Path) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(busy_task(stop))
    try:
        status, hdrs, body = await get(rt, "/debug/pprof/profile?seconds=0.3&format=pstats")
    finally:
        stop.set()
        await task
    assert status == 200 and hdrs["content-type"] == "application/octet-stream"
    out = tmp_path / "llmgw.pstats"
    out.write_bytes(body)
    st = pstats.Stats(str(out))
    funcs = {name for (_, _, name) in st.stats}  # type: ignore[attr-defined]
    assert "burn_cpu_in_the_loop" in funcs


async def parked_outer(ready: asyncio.Event, release: asyncio.Event) -> None:
    await parked_inner(ready, release)


async def parked_inner(ready: asyncio.Event, release: asyncio.Event) -> None:
    ready.set()
    await release.wait()


async def test_task_and_thread_dumps(rt: Any) -> None:
    # A task parked at a known point: where the poller's task is at the moment of a
    # dump depends on timing (asleep, or somewhere inside a scrape under load), so
    # the deepest frame is checked on this one.
    ready, release = asyncio.Event(), asyncio.Event()
    parked = asyncio.create_task(parked_outer(ready, release), name="parked")
    await ready.wait()
    try:
        status, hdrs, body = await get(rt, "/debug/pprof/tasks")
        assert status == 200 and hdrs["content-type"].startswith("text/plain")
        text = body.decode()
        assert "Task 'llmgw-scrape-a' (pending) Poller._run" in text
        assert "poller.py" in text and "awaiting <Future" in text
        assert "Task 'parked' (pending) parked_outer" in text
        status, _, body = await get(rt, "/debug/pprof/tasks?format=json")
    finally:
        release.set()
        await parked
    tasks = {t["name"]: t for t in orjson.loads(body)["tasks"]}
    scrape = tasks["llmgw-scrape-a"]
    assert scrape["state"] == "pending"
    assert scrape["stack"][0]["function"] == "Poller._run"  # outermost first, whatever it awaits now
    # the whole await chain, outermost first, down to the leaf coroutine
    fns = [f["function"] for f in tasks["parked"]["stack"]]
    assert fns == ["parked_outer", "parked_inner", "Event.wait"], fns
    status, _, body = await get(rt, "/debug/pprof/threads")
    assert status == 200 and b"MainThread" in body
    status, _, body = await get(rt, "/debug/pprof/")
    assert status == 200 and b"/debug/pprof/profile" in body


async def test_heap_snapshot(rt: Any) -> None:
    assert not tracemalloc.is_tracing()
    try:
        status, _, body = await get(rt, "/debug/pprof/heap?format=json")
        assert status == 200 and orjson.loads(body)["started"] is True
        hoard = [bytearray(1024) for _ in range(2000)]  # ~2 MiB from one line of this file
        status, _, body = await get(rt, "/debug/pprof/heap?top=5&format=json")
        report = orjson.loads(body)
        assert report["tracing"] is True and report["traced_bytes"] > 2_000_000
        assert len(report["top"]) == 5
        top = report["top"][0]
        assert top["file"].endswith("test_admin_profiling.py") and top["size_bytes"] > 2_000_000
        status, _, body = await get(rt, "/debug/pprof/heap?top=3")
        assert status == 200 and b"test_admin_profiling.py" in body and b"KiB" in body
        hoard.extend(bytearray(1024) for _ in range(1000))
        status, _, body = await get(rt, "/debug/pprof/heap?top=3&diff=1&format=json")
        grown = orjson.loads(body)["top"][0]
        assert grown["size_diff_bytes"] > 900_000
        del hoard
    finally:
        status, _, body = await get(rt, "/debug/pprof/heap?stop=1&format=json")
    assert status == 200 and orjson.loads(body)["tracing"] is False
    assert not tracemalloc.is_tracing()


def test_task_text_takes_a_frame_without_a_line_number() -> None:
    """A coroutine between instructions (not started, say) has no line number: the text says so, never raises."""
    from llmgw.admin.profiling import format_tasks

    text = format_tasks([{"name": "t", "state": "pending", "coro": "c()", "awaiting": [],
                          "stack": [{"file": __file__, "line": None, "function": "c"}]}])
    assert 'line None, in c' in text


async def test_loop_holds_tell_the_loops_cpu_from_waiting_for_a_core(rt: Any) -> None:
    status, _, body = await get(rt, "/debug/pprof/loop?seconds=0.3")
    assert status == 200
    quiet = orjson.loads(body)
    assert quiet["ticks"] > 20 and quiet["cpu"]["max_ms"] < 25, quiet

    async def burn_once() -> None:
        await asyncio.sleep(0.1)
        end = time.thread_time() + 0.04  # one callback holding the loop for 40 ms of its CPU
        while time.thread_time() < end:
            sum(i * i for i in range(200))

    burner = asyncio.create_task(burn_once())
    status, _, body = await get(rt, "/debug/pprof/loop?seconds=0.4")
    await burner
    held = orjson.loads(body)
    assert status == 200 and held["cpu"]["max_ms"] >= 35 and held["cpu"]["over_ms"]["20"] >= 1, held
    assert held["wall"]["max_ms"] >= 35  # the wall time saw it too
    status, _, body = await get(rt, "/debug/pprof/loop?seconds=-1")
    assert status == 400 and orjson.loads(body)["error"]["param"] == "seconds"
