#!/usr/bin/env python3
"""At most once: duplicate arrivals after post-send failures, and idle-gap failures.

Two figures, each against ``llmgw sim-engine`` engines (in this process, on real
sockets on 127.0.0.1, speaking vLLM's protocol) with llmgw in front:

``--failures N`` (default 1000): N requests that the engine fails *after* it has
read them -- a TCP reset, an end of stream, or a hang past
``upstream.first_byte_timeout`` -- half on new upstream connections
(``max_idle_connections: 0``), half on connections taken from the pool (a warm-up
request to each replica first). Each request carries its own ``X-Request-Id``;
the engines count arrivals per id. Reported: requests that arrived more than once
(must be 0), and the statuses llmgw answered. ``--after-send`` runs the same with
``retries.after_send: true`` as a control (duplicates expected).

``--idle-run SECONDS`` (e.g. 600): engines that close idle keep-alive
connections after 5 s (uvicorn's ``timeout_keep_alive``), llmgw's defaults
(``upstream.idle_timeout`` derived from the engine: 4 s), and ``--clients``
independent clients that each wait a random 0-10 s between requests (so pooled
connections are picked at every idle age, including just below and above 5 s).
Reported: requests and failed requests (must be 0). ``--idle-timeout 30s`` shows
what the old default did.

    .venv/bin/python bench/at_most_once.py --failures 1000
    .venv/bin/python bench/at_most_once.py --failures 300 --after-send     # control
    nice -n 19 .venv/bin/python bench/at_most_once.py --idle-run 600 --clients 16
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import sys
import time
from typing import Any

from llmgw.cli._common import run_loop
from llmgw.config import load
from llmgw.engines.sim import SimConfig, SimEngine
from llmgw.gateway.app import GatewayRuntime

BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":4}'


async def post(port: int, rid: str, timeout: float = 30.0) -> int:
    """One request on a new client connection; its status (0: no answer)."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        w.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"x-request-id: %s\r\ncontent-length: %d\r\n\r\n%s" % (rid.encode(), len(BODY), BODY)
        )
        head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), timeout)
        length = 0
        for line in head.split(b"\r\n")[1:]:
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        await asyncio.wait_for(r.readexactly(length), timeout)
        return int(head.split(None, 2)[1])
    except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError):
        return 0
    finally:
        w.close()


async def start(n: int, sim: dict[str, Any], **cfg: Any) -> tuple[GatewayRuntime, list[SimEngine]]:
    engines = [SimEngine(SimConfig(model="m", ttft_ms=1, tokens_per_second=1e5, count_arrivals=True, **sim))
               for _ in range(n)]
    for e in engines:
        await e.start()
    config = load({
        "listen": "127.0.0.1:0", "admin": "127.0.0.1:0", "routing": {"strategy": "round_robin"},
        "endpoints": [{"id": f"e{i}", "url": e.url, "model": "m"} for i, e in enumerate(engines)],
        **cfg,
    })
    rt = GatewayRuntime(config)
    await rt.start()
    return rt, engines


async def stop(rt: GatewayRuntime, engines: list[SimEngine]) -> None:
    await rt.stop()
    for e in engines:
        await e.stop()


async def failures(n: int, after_send: bool) -> dict[str, Any]:
    kinds = ("reset", "eof", "hang")
    out: dict[str, Any] = {"failures": 0, "duplicates": 0, "statuses": {}, "after_send": after_send}
    statuses: collections.Counter[int] = collections.Counter()
    for reuse in (False, True):
        upstream = {"first_byte_timeout": "150ms", "read_timeout": "1s"}
        if not reuse:
            upstream["max_idle_connections"] = 0
        # (breaker.failures at its top: every request here fails, and an open breaker
        # would hold them in the admission queue instead of sending them)
        rt, engines = await start(2, {}, upstream=upstream, retries={"after_send": after_send},
                                  breaker={"failures": 1000})
        assert rt.listen_addr is not None
        port = rt.listen_addr[1]
        reused_seen = 0
        warm_failed: collections.Counter[int] = collections.Counter()
        try:
            for i in range(n // 2):
                if reuse:
                    for j in range(2):  # a pooled connection to each replica
                        for k in range(5):  # (bounded: a loaded machine may miss the 150 ms first-byte timeout)
                            st = await post(port, f"warm-{i}-{j}-{k}")
                            if st == 200:
                                break
                            warm_failed[st] += 1
                        else:
                            raise SystemExit(f"warm-up requests fail: {dict(warm_failed)}")
                    assert rt.registry is not None
                    reused_seen += all(ep.pool.idle_connections for ep in rt.registry.endpoints.values())
                kind = kinds[i % 3]
                for e in engines:
                    if kind == "hang":
                        e.set_faults(hang_next=1)
                    else:
                        e.set_faults(drop_next=1, drop_how=kind)
                statuses[await post(port, f"{'reused' if reuse else 'fresh'}-{i}")] += 1
                for e in engines:
                    e.set_faults(reset=True)
                    e.app.release_hung()
            arrivals: collections.Counter[str] = collections.Counter()
            for e in engines:
                for rid, k in e.arrivals.items():
                    if not rid.startswith(b"warm-"):
                        arrivals[rid.decode()] += k
            out["failures"] += len(arrivals)
            out["duplicates"] += sum(1 for k in arrivals.values() if k > 1)
            out["injected"] = out.get("injected", 0) + sum(e.state.drops + e.state.hangs for e in engines)
            if reuse:
                out["reused_pools_before_failure"] = reused_seen
                out["warmup_failures"] = {str(k): v for k, v in warm_failed.items()}
        finally:
            await stop(rt, engines)
    out["statuses"] = {str(k): v for k, v in sorted(statuses.items())}
    return out


async def idle_run(seconds: float, clients: int, idle_timeout: str | None, keepalive: float) -> dict[str, Any]:
    upstream: dict[str, Any] = {}
    if idle_timeout is not None:
        upstream["idle_timeout"] = idle_timeout
    rt, engines = await start(2, {"keepalive_timeout": keepalive}, upstream=upstream)
    assert rt.listen_addr is not None and rt.registry is not None
    port = rt.listen_addr[1]
    idle = [ep.pool.idle_timeout for ep in rt.registry.endpoints.values()]
    statuses: collections.Counter[int] = collections.Counter()
    end = time.monotonic() + seconds
    rng = random.Random(0)

    async def client(c: int) -> None:
        i = 0
        while time.monotonic() < end:
            await asyncio.sleep(rng.uniform(0.0, 10.0))
            if time.monotonic() >= end:
                return
            statuses[await post(port, f"c{c}-{i}")] += 1
            i += 1

    try:
        await asyncio.gather(*(client(c) for c in range(clients)))
        dup = sum(1 for e in engines for k in e.arrivals.values() if k > 1)
    finally:
        await stop(rt, engines)
    total = sum(statuses.values())
    return {
        "seconds": seconds, "clients": clients, "engine_keepalive_s": keepalive, "llmgw_idle_timeout_s": idle,
        "requests": total, "failed": total - statuses[200], "duplicates": dup,
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--failures", type=int, default=0, help="post-send failures to inject (half fresh, half reused)")
    ap.add_argument("--after-send", action="store_true", help="control: retries.after_send: true")
    ap.add_argument("--idle-run", type=float, default=0.0, metavar="SECONDS", help="run the idle-gap load this long")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--keepalive", type=float, default=5.0, help="the engines' idle keep-alive timeout (s)")
    ap.add_argument("--idle-timeout", default=None, help="upstream.idle_timeout (default: derived from the engine)")
    args = ap.parse_args()
    if not args.failures and not args.idle_run:
        args.failures = 1000

    async def go() -> int:
        bad = False
        if args.failures:
            res = await failures(args.failures, args.after_send)
            print(json.dumps({"at_most_once": res}), flush=True)
            bad |= res["duplicates"] > 0 and not args.after_send
        if args.idle_run:
            res = await idle_run(args.idle_run, args.clients, args.idle_timeout, args.keepalive)
            print(json.dumps({"idle_gaps": res}), flush=True)
            bad |= res["failed"] > 0
        return 1 if bad else 0

    sys.exit(run_loop(go()))


if __name__ == "__main__":
    main()
