"""llmgw.fleet.share: the outboxes flushed within their bound, received routes learnt within theirs,
sharing on and off with the stream (a real registry; the wire is tests/control/test_share_routes.py)."""

from __future__ import annotations

import asyncio
import struct

from llmgw._proto.router.v1 import router_pb2 as rpb
from llmgw.config import load
from llmgw.fleet import share as sh
from llmgw.fleet.registry import Registry


def _key(*links: int, anchor: int = 77) -> bytes:
    return struct.pack(f"={len(links) + 2}Q", anchor, 1 | (1 << 63), *links)


async def test_outboxes_flush_and_routes_learn_within_bounds() -> None:
    cfg = load({"models": {"s": {"strategy": "score"}}, "routing": {"strategy": "prefix"}, "endpoints": [
        {"id": "a", "url": "http://127.0.0.1:9001", "model": "m", "engine": "vllm"},
        {"id": "b", "url": "http://127.0.0.1:9002", "model": "m", "engine": "vllm"},
        {"id": "c", "url": "http://127.0.0.1:9003", "model": "s", "engine": "vllm"}]})
    reg = Registry(cfg)
    sent: list[list[rpb.ModelRoutes]] = []
    rs = sh.RouteShare(reg, sent.append)
    m, s = reg.pools["m"], reg.pools["s"]
    try:
        rs.set_live(True)
        assert m.outbox == [] and s.outbox is None and m.picker.shared and not s.picker.shared
        tag_a = reg.endpoints["a"].state.tag
        # a flush takes at most MAX_ROUTES; the rest are counted dropped
        m.outbox.extend((_key(k + 1), 0, tag_a) for k in range(sh.MAX_ROUTES + 5))
        out = rs.take()
        assert [len(x.routes) for x in out] == [sh.MAX_ROUTES] and out[0].model == "m"
        assert (rs.stats.sent, rs.stats.dropped) == (sh.MAX_ROUTES, 5) and m.outbox == []
        assert out[0].routes[0].replica == tag_a and out[0].routes[0].chain == _key(1)
        # the timer flushes what the data path put there
        m.outbox.append((_key(9), 5, tag_a))
        for _ in range(40):  # (bounded: 2 s)
            if sent:
                break
            await asyncio.sleep(0.05)
        assert sent and sent[0][0].routes[0].session == 5
        # learnt: known model and replica only, a key cut to its bound
        before = m.picker.index_size(0.0)
        rs.learn([rpb.ModelRoutes(model="m", routes=[rpb.Route(replica=tag_a, chain=_key(1, 2, 3), session=8),
                                                     rpb.Route(replica=12345, chain=_key(4), session=9)]),
                  rpb.ModelRoutes(model="nope", routes=[rpb.Route(replica=tag_a, chain=_key(5))]),
                  rpb.ModelRoutes(model="s", routes=[rpb.Route(replica=tag_a, chain=_key(6))])])
        assert rs.stats.received == 4 and rs.stats.ignored == 3
        now = rs.clock()
        assert m.picker.index_size(now)[0] >= before[0] + 4 and m.picker.index_size(now)[1] == 1
        long = _key(*range(1, 200))
        rs.learn([rpb.ModelRoutes(model="m", routes=[rpb.Route(replica=tag_a, chain=long)])])
        assert m.picker.index_size(rs.clock())[0] <= before[0] + 4 + 1 + sh.MAX_CHAIN_BYTES // 8
        # at most MAX_LEARN from one message
        many = rpb.ModelRoutes(model="m", routes=[rpb.Route(replica=tag_a, chain=_key(k + 1000))
                                                  for k in range(sh.MAX_LEARN + 3)])
        ignored = rs.stats.ignored
        rs.learn([many])
        assert rs.stats.ignored == ignored + 3
        # at most MAX_PENDING messages wait for the main loop; more are ignored (counted)
        waiting: list[tuple[object, tuple[object, ...]]] = []
        one = [rpb.ModelRoutes(model="m", routes=[rpb.Route(replica=tag_a, chain=_key(4242))])]
        for _ in range(sh.MAX_PENDING + 2):
            rs.offer(one, lambda fn, *args: waiting.append((fn, args)))
        assert len(waiting) == sh.MAX_PENDING and rs.stats.busy == 2
        for fn, args in waiting:
            fn(*args)  # type: ignore[operator]
        rs.offer(one, lambda fn, *args: fn(*args))
        assert rs.stats.busy == 2
        # a flush the wire refuses is dropped, not sent
        sent_before, dropped_before = rs.stats.sent, rs.stats.dropped
        rs.refused(one)
        assert (rs.stats.sent, rs.stats.dropped) == (sent_before - 1, dropped_before + 1)
        # a flush cuts each key to its bound
        m.outbox.append((_key(*range(1, 300)), 0, tag_a))
        assert len(rs.take()[0].routes[0].chain) == sh.MAX_CHAIN_BYTES
        # off: no outbox, the pickers not shared
        rs.set_live(False)
        assert m.outbox is None and not m.picker.shared
        col = list(sh.ShareCollector(rs.stats).collect())
        assert col[0].samples[0].value == 0.0
        assert {smp.labels["direction"]: smp.value for smp in col[1].samples}["dropped"] == 6.0
    finally:
        rs.close()
        reg.close()
