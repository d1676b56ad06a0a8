"""µs per ``/metrics`` scrape of the simulated engine, per dialect, over one keep-alive socket.

Each engine first serves some traffic (completions, a stream, an abort) so every series has
values, then is scraped ``--n`` times in a row with the text-format ``Accept`` llmgw's poller
sends. Reports the median of ``--runs`` timings per dialect.

    .venv/bin/python bench/bench_sim_metrics.py --n 500 --runs 5
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import orjson
import uvloop

from llmgw.engines.sim import SimConfig, SimEngine

ENGINES = ("vllm", "sglang", "llamacpp", "trtllm")
ACCEPT = b"text/plain;version=0.0.4"


async def _read_response(r: asyncio.StreamReader) -> bytes:
    head = await r.readuntil(b"\r\n\r\n")
    cl = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length"):
            cl = int(line.split(b":")[1])
    return await r.readexactly(cl)


async def _traffic(host: str, port: int) -> None:
    r, w = await asyncio.open_connection(host, port)
    for i in range(20):
        body = orjson.dumps({"model": "m", "max_tokens": 3 + i % 7,
                             "messages": [{"role": "user", "content": "hello " * (1 + i)}]})
        w.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body))
        await _read_response(r)
    w.close()


async def bench(engine: str, n: int, runs: int) -> tuple[float, int]:
    e = SimEngine(SimConfig(model="m", engine=engine, ttft_ms=0.0, tokens_per_second=1e6))
    host, port = await e.start("127.0.0.1", 0)
    await _traffic(host, port)
    path = b"/prometheus/metrics" if engine == "trtllm" else b"/metrics"
    req = b"GET %s HTTP/1.1\r\nhost: x\r\naccept: %s\r\n\r\n" % (path, ACCEPT)
    r, w = await asyncio.open_connection(host, port)
    times = []
    size = 0
    for _ in range(runs):
        t = time.perf_counter()
        for _ in range(n):
            w.write(req)
            size = len(await _read_response(r))
        times.append((time.perf_counter() - t) / n * 1e6)
    w.close()
    await e.stop()
    return statistics.median(times), size


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=500, help="scrapes per run")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--engine", action="append", choices=ENGINES, help="default: all")
    args = ap.parse_args()
    for eng in args.engine or ENGINES:
        us, size = await bench(eng, args.n, args.runs)
        print(f"{eng:9s} {us:8.1f} us per scrape, {size} bytes")


if __name__ == "__main__":
    uvloop.run(main())
