"""CPU one router process spends scraping N simulated replicas every INTERVAL.

Starts N simulated vLLM engines in one helper process (pinned to the last CPU),
then ``llmgw serve`` with N endpoints and ``scrape.interval`` (pinned to CPU 0),
lets it settle, and reads the router's utime+stime from ``/proc/<pid>/stat``
over a measurement window. No client traffic: this is the cost of knowing.

    python bench/scrape_load.py --replicas 200 --interval 100ms --seconds 10 --runs 3

Prints the median CPU share of one core and the scrapes per second the
engines answered (from their own request counters).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CLK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


ENGINES = r"""
import asyncio, json, sys, uvloop
from llmgw.engines.sim import SimConfig, SimEngine

async def main(n):
    engines = []
    for i in range(n):
        e = SimEngine(SimConfig(model="m", engine="vllm", seed=i))
        await e.start("127.0.0.1", 0)
        engines.append(e)
    print(json.dumps([e.url for e in engines]), flush=True)
    await asyncio.Event().wait()

uvloop.run(main(int(sys.argv[1])))
"""


def scrape_counts(admin: str) -> tuple[float, float]:
    """Scrapes that succeeded and failed so far, from the router's own /metrics."""
    import urllib.request

    ok = failed = 0.0
    with urllib.request.urlopen(f"http://{admin}/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("llmgw_scrapes_total{"):
                value = float(line.rsplit(" ", 1)[1])
                if 'result="ok"' in line:
                    ok += value
                else:
                    failed += value
    return ok, failed


def run_once(replicas: int, interval: str, seconds: float, cpus: int) -> dict[str, float]:
    eng = subprocess.Popen(
        ["taskset", "-c", str(cpus - 1), sys.executable, "-c", ENGINES, str(replicas)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert eng.stdout is not None
        addrs = json.loads(eng.stdout.readline())
        with tempfile.TemporaryDirectory() as tmp:
            cfg = Path(tmp) / "llmgw.yaml"
            doc = {
                "listen": f"127.0.0.1:{free_port()}",
                "admin": f"127.0.0.1:{free_port()}",
                "scrape": {"interval": interval},
                "endpoints": [
                    {"id": f"r{i}", "url": a, "model": "m", "engine": "vllm"} for i, a in enumerate(addrs)
                ],
            }
            cfg.write_text(json.dumps(doc))  # JSON is YAML
            gw = subprocess.Popen(
                ["taskset", "-c", "0", sys.executable, "-m", "llmgw", "--log-level", "warning", "serve", "-c", str(cfg)],
                stdout=subprocess.DEVNULL,
            )
            try:
                time.sleep(3.0)  # start-up and the first, jittered round of scrapes
                if gw.poll() is not None:
                    raise SystemExit(f"llmgw serve exited with {gw.returncode}")
                c0, t0 = cpu_seconds(gw.pid), time.monotonic()
                time.sleep(seconds)
                c1, t1 = cpu_seconds(gw.pid), time.monotonic()
                ok, failed = scrape_counts(doc["admin"])
            finally:
                gw.send_signal(signal.SIGTERM)
                gw.wait(timeout=30)
        return {"cpu_share": (c1 - c0) / (t1 - t0), "scrapes_ok": ok, "scrapes_failed": failed}
    finally:
        eng.kill()
        eng.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=200)
    ap.add_argument("--interval", default="100ms")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    cpus = os.cpu_count() or 1
    shares = []
    for i in range(args.runs):
        r = run_once(args.replicas, args.interval, args.seconds, cpus)
        shares.append(r["cpu_share"])
        print(
            f"run {i + 1}: router CPU {r['cpu_share'] * 100:.1f}% of one core; "
            f"scrapes ok {r['scrapes_ok']:.0f}, failed {r['scrapes_failed']:.0f}",
            flush=True,
        )
    print(
        f"{args.replicas} replicas every {args.interval}: median router CPU "
        f"{statistics.median(shares) * 100:.1f}% of one core (runs: {', '.join(f'{s * 100:.1f}%' for s in shares)})"
    )


if __name__ == "__main__":
    asyncio.set_event_loop_policy(None)
    main()
