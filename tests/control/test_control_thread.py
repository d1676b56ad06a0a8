"""The control plane's own thread (llmgw.control.thread): gRPC off the data path's loop, state on it."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

import pytest
from cp_helpers import TOKEN, control_plane, control_runtime, free_port, running, wait_for
from scenario import discovery_of, h100s

from llmgw.agent.client import AgentClient
from llmgw.agent.model import Discovery
from llmgw.control import thread as ct

pytestmark = pytest.mark.timeout(60)


class Source:
    def __init__(self, host: str) -> None:
        self.d = discovery_of({"hostname": host, "gpus": h100s(1, host[-1])})

    def read(self) -> Discovery:
        return self.d

    def close(self) -> None:
        pass


async def test_hand_overs_run_on_the_main_loop_in_order_and_batched(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ct, "HOP_BATCH", 4)
    main = asyncio.get_running_loop()
    control = ct.ControlThread("test-control")
    control.start()
    try:
        hop = ct.MainHop(main, control.loop)
        seen: list[tuple[int, bool]] = []
        drains: list[int] = []
        real_drain = hop._drain

        def counting_drain() -> None:
            drains.append(len(hop._items))
            real_drain()

        hop._drain = counting_drain  # type: ignore[method-assign]

        async def on_control() -> int:
            for i in range(10):  # no answer wanted: taken over together, after HOP_DELAY
                hop.submit(lambda i=i: seen.append((i, threading.current_thread() is threading.main_thread())))
            return await hop.run(lambda: len(seen))  # an answer: the main loop is woken at once

        n = await control.run(on_control())
        # the call came after the ten in the queue, so they ran first, on the main thread, in order
        assert n == 10 and seen == [(i, True) for i in range(10)]
        # 11 items, at most 4 per callback: 3 callbacks, one wake-up from the control thread
        assert drains == [11, 7, 3]

        async def failing() -> None:
            await hop.run(lambda: 1 / 0)

        with pytest.raises(ZeroDivisionError):
            await control.run(failing())
    finally:
        control.stop()
    assert control._thread is None


async def test_grpc_runs_on_the_control_thread_and_heartbeats_keep_their_arrival_time() -> None:
    port = free_port()
    async with control_runtime(port) as rt:
        cp = control_plane(rt)
        assert cp.thread is not None and cp.thread.loop is not asyncio.get_running_loop()
        handler_threads: list[str] = []
        real = cp.service._stream_beats

        async def spy(*args: object) -> None:
            handler_threads.append(threading.current_thread().name)
            await real(*args)  # type: ignore[arg-type]

        cp.service._stream_beats = spy  # type: ignore[method-assign]
        a = AgentClient(f"127.0.0.1:{port}", "node-x", TOKEN, Source("host-x"), rng=None)
        async with running(a):
            await wait_for(lambda: (n := cp.nodes.get("node-x")) is not None and n.heartbeats >= 2,
                           what="two beats recorded")
            st = cp.nodes.get("node-x")
            assert st is not None
            # stamped when the control thread read it, not when the main loop recorded it
            assert st.last_seen <= cp.nodes.monotonic()
        assert handler_threads == ["llmgw-control"]
    assert cp.thread is None


def test_a_busy_control_loop_takes_what_came_during_its_nap_in_one_turn() -> None:
    """ControlThread.pace: while busy, what is handed to the control loop meanwhile (a socket's data,
    a call from another thread) waits for the end of the nap and is run in one turn with the rest;
    not busy, it is run at once."""
    control = ct.ControlThread("test-pace")
    control.start()
    busy = threading.Event()
    try:
        control.pace(busy.is_set, nap=0.3)
        ran: list[tuple[int, float]] = []
        done = threading.Event()

        def record(i: int) -> None:
            ran.append((i, time.monotonic()))
            if i == 19:
                done.set()

        # not busy: each call runs as it comes (within a few ms)
        for _ in range(3):
            sent = time.monotonic()
            ev = threading.Event()
            control.call(lambda ev=ev: ev.set())
            assert ev.wait(1.0) and time.monotonic() - sent < 0.25  # (a turn of the paced loop: 0.3 s)
        busy.set()
        time.sleep(1.2)  # (the idle loop looks again within PACE_CHECK_S)
        start = time.monotonic()
        for i in range(20):  # over ~1.2 s
            control.call(record, i)
            time.sleep(0.06)
        assert done.wait(2.0)
        assert [i for i, _ in ran] == list(range(20))  # (in order)
        # grouped into turns: the calls of one nap ran together, ~0.3 s apart from the next turn's (not
        # paced, the 20 would have run one by one, 0.06 s apart)
        turns = 1 + sum(1 for (_, a), (_, b) in itertools.pairwise(ran) if b - a > 0.15)
        assert 2 <= turns <= 10, (turns, [round(t - start, 3) for _, t in ran])
        together = 1 + sum(1 for (_, a), (_, b) in itertools.pairwise(ran) if b - a > 0.01)
        assert together <= 10, together  # (each turn's calls one after the other, not 20 wakes)
        busy.clear()
        time.sleep(1.2)
        sent = time.monotonic()
        ev = threading.Event()
        control.call(lambda: ev.set())
        assert ev.wait(1.0) and time.monotonic() - sent < 0.25  # (quick again)
    finally:
        busy.clear()
        control.stop()
