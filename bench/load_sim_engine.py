"""Throughput of ``llmgw sim-engine`` alone: non-streamed chat completions per second.

What is measured: one ``llmgw sim-engine`` process (started here, as a
subprocess) answering ``POST /v1/chat/completions`` (16 output tokens, not
streamed) with ``--ttft-ms 0 --tokens-per-second 1e9 --slots 256``, so the
figure is the cost of the HTTP core plus the simulation per request, with no
simulated waiting. The load comes from another process: ``wrk`` with
``bench/sim_engine_chat.lua`` when it is installed, else a small keep-alive
load generator on raw asyncio sockets. The result is the median of ``--runs``
runs of ``--duration`` seconds each; any non-2xx answer fails the run.

Usage::

    .venv/bin/python bench/load_sim_engine.py [--connections 32] [--duration 5] [--runs 3]
        [--engine vllm] [--max-tokens 16] [--stream] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
LUA = HERE / "sim_engine_chat.lua"


def start_engine(engine: str, slots: int) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmgw", "--log-level", "warning", "sim-engine", "--listen", "127.0.0.1:0",
         "--model", "bench", "--engine", engine, "--slots", str(slots), "--max-queue", "100000",
         "--ttft-ms", "0", "--tokens-per-second", "1e9"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    m = re.search(r"http://127\.0\.0\.1:(\d+)", line)
    if not m:
        proc.kill()
        raise SystemExit(f"sim-engine did not start: {line!r}")
    return proc, int(m.group(1))


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` (Linux), else None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_wrk(port: int, body: str, connections: int, duration: float, threads: int) -> float:
    env = {**os.environ, "SIM_BENCH_BODY": body}
    out = subprocess.run(
        ["wrk", f"-t{threads}", f"-c{connections}", f"-d{duration:g}s", "-s", str(LUA),
         f"http://127.0.0.1:{port}/v1/chat/completions"],
        capture_output=True, text=True, env=env, check=True,
    ).stdout
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if bad:
        raise SystemExit(f"wrk saw {bad.group(1)} non-2xx answers:\n{out}")
    if "Socket errors" in out:
        raise SystemExit(f"wrk saw socket errors:\n{out}")
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    assert m, out
    return float(m.group(1))


# -- the fallback load generator (runs in its own process) --


async def _conn_loop(port: int, payload: bytes, stop_at: float, counts: list[int]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.monotonic() < stop_at:
            writer.write(payload)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            if status != 200:
                raise RuntimeError(f"status {status}")
            low = head.lower()
            if b"transfer-encoding: chunked" in low:
                while True:
                    size = int((await reader.readline()).split(b";")[0], 16)
                    await reader.readexactly(size + 2)
                    if size == 0:
                        break
            else:
                i = low.index(b"content-length:")
                n = int(low[i + 15 : low.index(b"\r\n", i)])
                await reader.readexactly(n)
            counts[0] += 1
    finally:
        writer.close()


def _generator(port: int, body: bytes, connections: int, duration: float, q: multiprocessing.Queue) -> None:
    payload = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )

    async def main() -> float:
        counts = [0]
        t0 = time.monotonic()
        stop_at = t0 + duration
        await asyncio.gather(*(_conn_loop(port, payload, stop_at, counts) for _ in range(connections)))
        return counts[0] / (time.monotonic() - t0)

    try:
        import uvloop

        q.put(uvloop.run(main()))
    except ImportError:
        q.put(asyncio.run(main()))


def run_python(port: int, body: str, connections: int, duration: float) -> float:
    q: multiprocessing.Queue = multiprocessing.Queue()
    p = multiprocessing.Process(target=_generator, args=(port, body.encode(), connections, duration, q))
    p.start()
    rate = q.get(timeout=duration + 60)
    p.join()
    return float(rate)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="wrk threads (keep cores free for the engine)")
    ap.add_argument("--engine", default="vllm", choices=["vllm", "llamacpp", "trtllm", "sglang"])
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--stream", action="store_true", help="streamed answers instead")
    ap.add_argument("--python-client", action="store_true", help="use the Python load generator even if wrk exists")
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    args = ap.parse_args()

    body = json.dumps({
        "model": "bench", "messages": [{"role": "user", "content": "Hello, how are you today?"}],
        "max_tokens": args.max_tokens, "stream": args.stream,
    }, separators=(",", ":"))
    use_wrk = shutil.which("wrk") is not None and not args.python_client
    proc, port = start_engine(args.engine, args.slots)
    rates: list[float] = []
    per_cpu: list[float] = []
    cpu_share: list[float] = []
    try:
        # warm up (imports, first connections)
        if use_wrk:
            run_wrk(port, body, args.connections, 1.0, args.threads)
        else:
            run_python(port, body, args.connections, 1.0)
        for _ in range(args.runs):
            cpu0, t0 = cpu_seconds(proc.pid), time.monotonic()
            if use_wrk:
                rate = run_wrk(port, body, args.connections, args.duration, args.threads)
            else:
                rate = run_python(port, body, args.connections, args.duration)
            cpu1, t1 = cpu_seconds(proc.pid), time.monotonic()
            rates.append(rate)
            if cpu0 is not None and cpu1 is not None and cpu1 > cpu0:
                # PERF: requests per CPU-second of the engine process: steadier than
                # requests/s on a machine shared with other work.
                per_cpu.append(rate * args.duration / (cpu1 - cpu0))
                cpu_share.append((cpu1 - cpu0) / (t1 - t0))
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=15)
    med = statistics.median(rates)
    result = {
        "client": "wrk" if use_wrk else "python", "engine": args.engine, "connections": args.connections,
        "duration_s": args.duration, "runs": [round(r, 1) for r in rates], "median_rps": round(med, 1),
        "stream": args.stream, "max_tokens": args.max_tokens, "cpus": os.cpu_count(), "engine_exit": rc,
        "requests_per_engine_cpu_s": round(statistics.median(per_cpu), 1) if per_cpu else None,
        "engine_cpu_share": [round(c, 2) for c in cpu_share],
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"sim-engine ({args.engine}, {'streamed' if args.stream else 'whole'} answers, "
              f"{args.max_tokens} tokens) via {result['client']}, {args.connections} connections: "
              f"median {med:,.0f} requests/s over {args.runs} x {args.duration:g}s runs {result['runs']}")
        if per_cpu:
            print(f"  engine process: median {statistics.median(per_cpu):,.0f} requests per CPU-second "
                  f"(it got {', '.join(f'{c:.0%}' for c in cpu_share)} of a core)")
    if rc != 0:
        raise SystemExit(f"sim-engine exited {rc} on SIGTERM")


if __name__ == "__main__":
    main()
