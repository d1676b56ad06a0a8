"""The ``prefix`` strategy end to end: a real gateway in front of simulated engines on
127.0.0.1. A multi-turn conversation stays on one replica (its prefix, then its
session header), and ``/metrics`` shows the decisions and the index (promtool-clean).
"""

from __future__ import annotations

import asyncio
import subprocess
from typing import Any

import orjson
from prometheus_client.parser import text_string_to_metric_families

from llmgw.config import load
from llmgw.engines.sim import SimConfig, SimEngine
from llmgw.gateway.app import GatewayRuntime
from tools import need_tool


async def post(port: int, body: dict[str, Any], headers: bytes = b"") -> tuple[int, bytes]:
    """``(status, the x-llmgw-replica header)``."""
    data = orjson.dumps(body)
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        w.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n%s\r\n%s" % (len(data), headers, data)
        )
        head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 20)
        lines = head.decode().split("\r\n")
        hdrs = {}
        for line in lines[1:]:
            if line:
                k, v = line.split(":", 1)
                hdrs[k.strip().lower()] = v.strip()
        await asyncio.wait_for(r.readexactly(int(hdrs.get("content-length", "0"))), 20)
        return int(lines[0].split()[1]), hdrs.get("x-llmgw-replica", "").encode()
    finally:
        w.close()


async def metrics_page(rt: GatewayRuntime) -> str:
    assert rt.admin_addr is not None
    r, w = await asyncio.open_connection(*rt.admin_addr)
    w.write(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    page = (await asyncio.wait_for(r.read(), 10)).split(b"\r\n\r\n", 1)[1].decode()
    w.close()
    return page


async def test_a_conversation_stays_on_its_replica() -> None:
    engines = [SimEngine(SimConfig(model="m", slots=4, ttft_ms=1, tokens_per_second=2000)) for _ in range(3)]
    for e in engines:
        await e.start("127.0.0.1", 0)
    doc: dict[str, Any] = {
        "listen": "127.0.0.1:0",
        "admin": "127.0.0.1:0",
        "scrape": {"interval": "100ms", "timeout": "80ms", "stale_after": "2s"},
        "routing": {"strategy": "prefix", "prefix": {"block_bytes": 64}},
        "endpoints": [{"id": f"r{i}", "url": e.url, "model": "m", "engine": "vllm"} for i, e in enumerate(engines)],
    }
    rt = GatewayRuntime(load(doc))
    await rt.start()
    try:
        assert rt.registry is not None and rt.listen_addr is not None
        port = rt.listen_addr[1]
        for _ in range(200):  # (bounded: 10 s) every replica scraped once
            if all(ep.scrape_ok > 0 for ep in rt.registry.endpoints.values()):
                break
            await asyncio.sleep(0.05)
        # A conversation that grows turn by turn: every turn on the first turn's replica.
        system = {"role": "system", "content": "You answer in one short sentence. " * 4}
        messages: list[dict[str, str]] = [system]
        where = set()
        for turn in range(6):
            messages.append({"role": "user", "content": f"Question {turn}: what comes after {turn}?"})
            status, replica = await post(port, {"model": "m", "messages": messages, "max_tokens": 4})
            assert status == 200
            where.add(replica)
            messages.append({"role": "assistant", "content": f"{turn + 1} comes after {turn}."})
        assert len(where) == 1, where
        # A session header keeps a conversation together even when its text does not.
        sessions = set()
        for turn in range(4):
            body = {"model": "m", "messages": [{"role": "user", "content": f"unrelated text {turn} " * 8}]}
            status, replica = await post(port, body, b"X-Session-Id: conv-7\r\n")
            assert status == 200
            sessions.add(replica)
        assert len(sessions) == 1, sessions
        page = await metrics_page(rt)
    finally:
        await rt.stop()
        for e in engines:
            await e.stop()
    decisions = {}
    entries = {}
    reuse = []
    for fam in text_string_to_metric_families(page):
        for s in fam.samples:
            if s.name == "llmgw_routing_decisions_total":
                decisions[s.labels["reason"]] = s.value
            elif s.name == "llmgw_routing_index_entries":
                entries[s.labels["table"]] = s.value
            elif s.name == "llmgw_routing_reuse_ratio":
                reuse.append((s.labels, s.value))
    # turn 1 and the session's first request: blind (consistent hashing on the
    # conversation's anchor); turn 2 by its anchor (what it shares with turn 1 ends
    # inside the anchor, which the index keeps as the conversation's last replica);
    # turns 3-6 by their prefix; the session's next three by the session
    assert decisions == {"prefix_hit": 5, "session": 3, "load_fallback": 0, "blind": 2}
    assert entries["prefix"] > 10 and entries["session"] == 1
    # 8 of the 10 continued something (turns 2-6, the session's last three): the hashing stays on
    assert len(reuse) == 1 and reuse[0][0] == {"model": "m"} and 0.95 < reuse[0][1] < 1.0, reuse
    need_tool("promtool", install="apt-get install prometheus")
    res = subprocess.run(["promtool", "check", "metrics"], input=page, capture_output=True, text=True, timeout=30)
    assert res.returncode == 0 and not res.stdout.strip() and not res.stderr.strip(), res.stdout + res.stderr
