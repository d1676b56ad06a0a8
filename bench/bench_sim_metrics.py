"""µs per ``/metrics`` scrape of the simulated engine, per dialect, over one keep-alive socket.

Each engine first serves some traffic (completions, a stream, an abort) so every series has
values, then is scraped ``--n`` times in a row with the text-format ``Accept`` llmgw's poller
sends. Reports the median of ``--runs`` timings per dialect: wall clock, and CPU time of this
process (engine and client share it), which stays meaningful on a busy machine.
``--churn`` adds one observation to every histogram before each scrape (as under traffic,
so no histogram text can be reused). ``--floor`` answers every scrape with a page rendered
beforehand (same size, no work): the cost of HTTP and of this client alone, to subtract.
``--registry`` renders with ``prometheus_client`` as before the templates (the reference path).

    .venv/bin/python bench/bench_sim_metrics.py --n 500 --runs 5 [--churn]
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


async def bench(engine: str, n: int, runs: int, churn: bool, floor: bool, registry: bool) -> tuple[float, float, int]:
    e = SimEngine(SimConfig(model="m", engine=engine, ttft_ms=0.0, tokens_per_second=1e6))
    host, port = await e.start("127.0.0.1", 0)
    await _traffic(host, port)
    if floor:
        page = e.app.dialect.metrics_page(ACCEPT)
        e.app.dialect.metrics_page = lambda accept: page  # type: ignore[method-assign]
    elif registry and engine != "llamacpp":
        e.app.dialect.metrics_page = e.app.dialect.registry_page  # type: ignore[method-assign]
    path = b"/prometheus/metrics" if engine == "trtllm" else b"/metrics"
    req = b"GET %s HTTP/1.1\r\nhost: x\r\naccept: %s\r\n\r\n" % (path, ACCEPT)
    r, w = await asyncio.open_connection(host, port)
    hists = list(e.app.stats.hist.values()) if churn else []
    times, cpu = [], []
    size = 0
    for _ in range(runs):
        t, c = time.perf_counter(), time.process_time()
        for _ in range(n):
            for h in hists:
                h.observe(h.bounds[0])
            w.write(req)
            size = len(await _read_response(r))
        times.append((time.perf_counter() - t) / n * 1e6)
        cpu.append((time.process_time() - c) / n * 1e6)
    w.close()
    await e.stop()
    return statistics.median(times), statistics.median(cpu), size


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=500, help="scrapes per run")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--engine", action="append", choices=ENGINES, help="default: all")
    ap.add_argument("--churn", action="store_true", help="change every histogram before each scrape")
    ap.add_argument("--floor", action="store_true", help="serve a prepared page: HTTP and client cost only")
    ap.add_argument("--registry", action="store_true", help="render with prometheus_client (the old way)")
    args = ap.parse_args()
    for eng in args.engine or ENGINES:
        us, cpu, size = await bench(eng, args.n, args.runs, args.churn, args.floor, args.registry)
        print(f"{eng:9s} {us:8.1f} us per scrape (wall), {cpu:8.1f} us CPU, {size} bytes")


if __name__ == "__main__":
    uvloop.run(main())
