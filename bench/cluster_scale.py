#!/usr/bin/env python3
"""Cluster scale: N simulated agents with G GPUs each heartbeating against one ``llmgw serve``.

Measures, for the issue's scale goal (1,000 agents x 8 GPUs every 5 s):

* control-plane CPU: the serve process's utime+stime (``/proc/<pid>/stat``) over
  ``--window`` seconds of heartbeats without scrapes, as a % of one core (goal < 10%);
* CPU per scrape: the serve process's main thread (the data path's loop) and the whole
  process over ``--alone-scrapes`` scrapes an interval apart without other load, less the
  heartbeats' share of the same time (the rates measured just before);
* ``/metrics`` scrape time: wall time of a full ``GET /metrics`` (Prometheus text),
  over ``--scrapes`` scrapes, and its sample count (goal < 250 ms at ~100,000 samples);
* event-loop holds: ``GET /health`` every 2 ms on a kept-alive connection during the
  scrapes; the worst answer time minus the median bounds how long the loop was held
  (goal < 10 ms);
* proxied requests during scrapes: one keep-alive client sends a chat completion every
  5 ms through the gateway to a ``llmgw sim-engine`` replica, for ``--scrapes`` scrapes and
  for as long again without; p50/p99 of each (goal: p99 within +10 ms of no scrapes).

Scrapes ask what a real Prometheus asks (OpenMetrics first; ``--plain`` for text 0.0.4).

``--fleet-only HOST:PORT`` just runs the agents against a control plane someone else
started (``bench/dataplane/run.py --cluster N`` does), until SIGTERM.

The agents are the real :class:`llmgw.agent.client.AgentClient`, all in this
process (one gRPC channel each), on a source whose readings change on every read
(the worst case for the per-node text cache). ``serve`` runs pinned to core 0 with
``--pin`` (the agents on the others).

    .venv/bin/python bench/cluster_scale.py                       # 1000 x 8, window 20 s
    .venv/bin/python bench/cluster_scale.py --agents 200 --window 10 --json /tmp/cs.json

Every process it starts is stopped on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from llmgw.agent.client import AgentClient
from llmgw.agent.model import GPU, Discovery, NodeFacts

TOKEN = "bench-join-token"
GIB = 1024**3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """utime+stime of process ``pid`` (all its threads), or of its thread ``tid`` alone."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def control_tid(pid: int) -> int | None:
    """The ``llmgw-control`` thread of process ``pid``, if it has one."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            if task.joinpath("comm").read_text().strip() == "llmgw-control":
                return int(task.name)
        except OSError:
            continue
    return None


class ChangingSource:
    """G GPUs whose utilisation and memory change on every read."""

    def __init__(self, node: int, gpus: int) -> None:
        self.node, self.gpus, self.rng = node, gpus, random.Random(node)

    def read(self) -> Discovery:
        r = self.rng.random
        return Discovery(
            facts=NodeFacts(hostname=f"bench-{self.node}", cpu_cores=128, memory_total_bytes=2048 * GIB,
                            memory_available_bytes=int(1024 * GIB * (1 + r())), driver_version="550.90.07",
                            cuda_driver_version="12.4", agent_version="bench"),
            gpus=tuple(GPU(
                uuid=f"GPU-{self.node:08x}-0000-4000-8000-{i:012x}", index=i, name="NVIDIA H100 80GB HBM3",
                pci_bus_id=f"00000000:{0x18 + i:02X}:00.0", memory_total_bytes=80 * GIB,
                memory_used_bytes=int(80 * GIB * r()), memory_free_bytes=int(10 * GIB * r()),
                utilization_gpu_ratio=round(r(), 2), utilization_memory_ratio=round(r(), 2),
                temperature_celsius=float(40 + int(40 * r())), power_watts=round(100 + 600 * r(), 1),
                power_limit_watts=700.0, energy_joules=1e6 + 1e4 * r(), sm_clock_mhz=1980.0,
                ecc_corrected_volatile=0, ecc_uncorrected_volatile=0, mig_mode=False, nvlink_links_active=18,
            ) for i in range(self.gpus)),
            source="simulated",
        )

    def close(self) -> None:
        pass


async def get(port: int, path: str) -> tuple[float, bytes]:
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode())
    body = await reader.read()
    writer.close()
    return time.perf_counter() - t0, body


PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


async def scrape(port: int, plain: bool, gzipped: bool = False) -> tuple[float, bytes]:
    """The answer to one ``GET /metrics`` (head and body; a gzipped body is returned inflated, its
    inflating not timed). ``gzipped``: ``accept-encoding: gzip``, as Prometheus sends it."""
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    accept = "text/plain" if plain else PROMETHEUS_ACCEPT
    encoding = "accept-encoding: gzip\r\n" if gzipped else ""
    writer.write(f"GET /metrics HTTP/1.1\r\nhost: x\r\naccept: {accept}\r\n{encoding}connection: close\r\n\r\n"
                 .encode())
    answer = await reader.read()
    writer.close()
    dt = time.perf_counter() - t0
    head, _, body = answer.partition(b"\r\n\r\n")
    if b"\r\ncontent-encoding: gzip" in head.lower():
        answer = head + b"\r\n\r\n" + gzip.decompress(body)
    return dt, answer


def proxied_pinger(port: int, stop: threading.Event, out: list[float]) -> None:
    """A chat completion every 5 ms on one kept-alive connection (in a thread of its own)."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    f = sock.makefile("rb")
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":1}'
    req = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
           b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    while not stop.is_set():
        t0 = time.perf_counter()
        sock.sendall(req)
        length = 0
        status = f.readline()
        while True:
            line = f.readline()
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
            if line in (b"\r\n", b""):
                break
        f.read(length)
        if b" 200 " not in status:
            raise SystemExit(f"bench: a proxied request failed: {status!r}")
        out.append(time.perf_counter() - t0)
        time.sleep(0.005)
    sock.close()


def _ping_main(kind: str, port: int, stop: Any, out: Any) -> None:
    samples: list[float] = []
    (health_pinger if kind == "health" else proxied_pinger)(port, stop, samples)
    out.put(samples)


class Pinger:
    """A pinger in a process of its own: in a thread of this one, its timings would include the
    waits for this process's GIL (the agents' loop, a 19 MB page read), not the gateway's."""

    def __init__(self, kind: str, port: int) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.stop_ev = ctx.Event()
        self.out = ctx.Queue()
        self.proc = ctx.Process(target=_ping_main, args=(kind, port, self.stop_ev, self.out), daemon=True)
        self.proc.start()

    def stop(self) -> list[float]:
        self.stop_ev.set()
        got: list[float] = self.out.get(timeout=30)
        self.proc.join(10)
        return got


def pct(xs: list[float], q: float) -> float:
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(q * len(ys)))]


class Fleet:
    """``--agents`` agents against ``target``, started in waves (as a fleet starts), until :meth:`stop`."""

    def __init__(self, target: str, a: argparse.Namespace) -> None:
        self.clients = [AgentClient(target, f"node-{i:04d}", TOKEN, ChangingSource(i, a.gpus)) for i in range(a.agents)]
        self.tasks: list[asyncio.Task[None]] = []
        self._stop = asyncio.Event()

    async def start(self) -> Fleet:
        for i, c in enumerate(self.clients):
            self.tasks.append(asyncio.create_task(c.run(self._stop)))
            if i % 50 == 49:
                await asyncio.sleep(0.05)
        return self

    async def stop(self) -> None:
        """Every agent deregisters (bounded), as on SIGTERM."""
        self._stop.set()
        await asyncio.wait(self.tasks, timeout=30)


def health_pinger(port: int, stop: threading.Event, out: list[float]) -> None:
    """GET /health every 2 ms on one kept-alive connection, in a thread of its own (not this
    process's event loop, which is busy with the agents and the scraped page)."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    f = sock.makefile("rb")
    req = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
    while not stop.is_set():
        t0 = time.perf_counter()
        sock.sendall(req)
        length = 0
        while True:
            line = f.readline()
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
            if line in (b"\r\n", b""):
                break
        f.read(length)
        out.append(time.perf_counter() - t0)
        time.sleep(0.002)
    sock.close()


async def main_async(a: argparse.Namespace) -> dict[str, Any]:
    cport, aport, lport, eport = free_port(), free_port(), free_port(), free_port()
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-cluster-bench-"))
    cfg = tmp / "llmgw.yaml"
    cfg.write_text(
        f"listen: 127.0.0.1:{lport}\nadmin: 127.0.0.1:{aport}\n"
        f"endpoints:\n  - {{id: e0, url: 'http://127.0.0.1:{eport}', model: m, engine: vllm}}\n"
        f"control:\n  listen: 127.0.0.1:{cport}\n  join_token_env: BENCH_JOIN\n  heartbeat_interval: {a.interval}s\n"
        f"  grpc_server: {a.grpc_server}\n"
    )
    ecmd = [sys.executable, "-m", "llmgw", "--log-level", "warning", "sim-engine", "--listen", f"127.0.0.1:{eport}",
            "--model", "m", "--ttft-ms", "0", "--tokens-per-second", "100000", "--slots", "64"]
    if a.pin:  # the engine with the agents, off the gateway's core
        ecmd = ["taskset", "-c", ",".join(str(c) for c in range(1, os.cpu_count() or 2)) or "0", *ecmd]
    engine = subprocess.Popen(ecmd, stdout=subprocess.DEVNULL)
    cmd = [sys.executable, "-m", "llmgw", "--log-level", "warning", "serve", "-c", str(cfg)]
    if a.pin:
        cmd = ["taskset", "-c", "0", *cmd]
    serve = subprocess.Popen(cmd, env={**os.environ, "BENCH_JOIN": TOKEN}, stdout=subprocess.DEVNULL)
    try:
        if a.pin:
            os.sched_setaffinity(0, set(range(1, os.cpu_count() or 2)) or {0})
        for _ in range(200):
            try:
                await get(aport, "/health")
                break
            except OSError:
                await asyncio.sleep(0.05)
        for _ in range(200):
            try:
                with socket.create_connection(("127.0.0.1", eport), timeout=1):
                    break
            except OSError:
                await asyncio.sleep(0.05)
        fleet = await Fleet(f"127.0.0.1:{cport}", a).start()
        clients = fleet.clients
        t_reg = time.monotonic()
        while sum(c.registrations > 0 for c in clients) < a.agents:
            if time.monotonic() - t_reg > 120:
                raise SystemExit("bench: agents did not all register within 120 s")
            await asyncio.sleep(0.2)
        reg_s = time.monotonic() - t_reg
        await asyncio.sleep(a.interval * 1.5)  # steady heartbeats
        # the main thread runs the data path's loop (and the node map the heartbeats update);
        # gRPC and its handlers run on the control thread and grpc's own threads
        ctl = control_tid(serve.pid)
        c0, m0, w0 = cpu_seconds(serve.pid), cpu_seconds(serve.pid, serve.pid), time.monotonic()
        t0 = cpu_seconds(serve.pid, ctl) if ctl else 0.0
        await asyncio.sleep(a.window)
        wall = time.monotonic() - w0
        ctl_pct = 100 * (cpu_seconds(serve.pid, ctl) - t0) / wall if ctl else None
        cpu_pct = 100 * (cpu_seconds(serve.pid) - c0) / wall
        main_pct = 100 * (cpu_seconds(serve.pid, serve.pid) - m0) / wall
        beats = sum(c.heartbeats for c in clients)
        # main-thread (and whole-process) CPU per scrape: scrapes alone, an interval apart (every node's
        # reading changed since the last one, as with Prometheus' 15 s), less what the heartbeats cost
        # over the same wall time (the rates just measured)
        m1, c1, w1 = cpu_seconds(serve.pid, serve.pid), cpu_seconds(serve.pid), time.monotonic()
        for _ in range(a.alone_scrapes):
            await scrape(aport, a.plain, a.gzip)
            await asyncio.sleep(a.interval)
        alone_s = time.monotonic() - w1
        main_per_scrape = (cpu_seconds(serve.pid, serve.pid) - m1 - main_pct / 100 * alone_s) / a.alone_scrapes
        proc_per_scrape = (cpu_seconds(serve.pid) - c1 - cpu_pct / 100 * alone_s) / a.alone_scrapes
        # scrapes, with /health pinged every 2 ms meanwhile
        base_p = Pinger("health", aport)
        await asyncio.sleep(1.0)
        baseline = base_p.stop()
        health = Pinger("health", aport)
        proxied = Pinger("proxied", lport)
        await asyncio.sleep(0.5)  # (the child processes start)
        times, samples = [], 0
        t_scrapes = time.monotonic()
        # the gateway's own watch of its loop meanwhile: the loop thread's CPU between 1 ms ticks is
        # how long it was held; the wall time adds its waits for a core (admin /debug/pprof/loop)
        watch = asyncio.create_task(get(aport, f"/debug/pprof/loop?seconds={a.scrapes * 0.7:g}"))
        for _ in range(a.scrapes):
            dt, body = await scrape(aport, a.plain, a.gzip)
            times.append(dt)
            text = body.partition(b"\r\n\r\n")[2]
            samples = text.count(b"\n") - text.count(b"#")  # every # is a HELP, TYPE or EOF line here
            await asyncio.sleep(0.5)
        span_s = time.monotonic() - t_scrapes
        watched = json.loads((await watch)[1].partition(b"\r\n\r\n")[2])
        busy = proxied.stop()
        pings = health.stop()
        # as long again, the same proxied load without scrapes
        quiet_p = Pinger("proxied", lport)
        await asyncio.sleep(span_s + 0.5)
        quiet = quiet_p.stop()
        await fleet.stop()
        med = statistics.median(baseline) if baseline else 0.0
        return {
            "agents": a.agents, "gpus_per_agent": a.gpus, "interval_s": a.interval, "register_all_s": round(reg_s, 2),
            "control_plane_cpu_pct_of_a_core": round(cpu_pct, 2), "heartbeats_total": beats,
            "main_thread_cpu_pct_of_a_core": round(main_pct, 2),
            "control_thread_cpu_pct_of_a_core": None if ctl_pct is None else round(ctl_pct, 2),
            "main_thread_cpu_ms_per_scrape": round(1000 * main_per_scrape, 1),
            "process_cpu_ms_per_scrape": round(1000 * proc_per_scrape, 1),
            "scrape_samples": samples,
            "scrape_ms": {"median": round(1000 * statistics.median(times), 1), "max": round(1000 * max(times), 1),
                          "min": round(1000 * min(times), 1)},
            "health_ms_during_scrapes": {"median": round(1000 * statistics.median(pings), 2),
                                         "max": round(1000 * max(pings), 2), "baseline_median": round(1000 * med, 2)},
            "max_loop_hold_ms_estimate": round(1000 * (max(pings) - med), 2),
            "loop_hold_during_scrapes": {"cpu_max_ms": watched["cpu"]["max_ms"], "cpu_over_10ms":
                                         watched["cpu"]["over_ms"]["10"], "wall_max_ms": watched["wall"]["max_ms"],
                                         "ticks": watched["ticks"]},
            "proxied_ms_during_scrapes": {"n": len(busy), "p50": round(1000 * pct(busy, 0.5), 2),
                                          "p99": round(1000 * pct(busy, 0.99), 2), "max": round(1000 * max(busy), 2)},
            "proxied_ms_without_scrapes": {"n": len(quiet), "p50": round(1000 * pct(quiet, 0.5), 2),
                                           "p99": round(1000 * pct(quiet, 0.99), 2), "max": round(1000 * max(quiet), 2)},
            "proxied_p99_added_by_scrapes_ms": round(1000 * (pct(busy, 0.99) - pct(quiet, 0.99)), 2),
        }
    finally:
        for proc in (serve, engine):
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()


async def fleet_only(a: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    fleet = await Fleet(a.fleet_only, a).start()
    print(f"fleet: {len(fleet.clients)} agents x {a.gpus} GPUs against {a.fleet_only}", flush=True)
    while not stop.is_set():  # and a Prometheus's scrapes, when asked
        try:
            await asyncio.wait_for(stop.wait(), a.scrape_every if a.admin else None)
        except asyncio.TimeoutError:
            try:
                await scrape(a.admin, a.plain, a.gzip)
            except OSError as exc:
                print(f"fleet: scrape failed: {exc}", flush=True)
    await fleet.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=1000)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--interval", type=float, default=5.0)
    ap.add_argument("--window", type=float, default=20.0, help="seconds of CPU measurement")
    ap.add_argument("--scrapes", type=int, default=10)
    ap.add_argument("--alone-scrapes", type=int, default=4, help="scrapes, an interval apart, for the CPU per scrape")
    ap.add_argument("--pin", action="store_true", help="serve on core 0, the agents on the rest")
    ap.add_argument("--grpc-server", choices=("llmgw", "grpcio"), default="llmgw",
                    help="control.grpc_server: llmgw's own gRPC server or grpc.aio's")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plain", action="store_true", help="scrape as text 0.0.4 (default: as Prometheus asks)")
    ap.add_argument("--gzip", action="store_true",
                    help="ask for the page gzipped, as Prometheus does (default: not, the most the loop writes)")
    ap.add_argument("--fleet-only", metavar="HOST:PORT", help="only run the agents against this control plane")
    ap.add_argument("--admin", type=int, help="--fleet-only: scrape this admin port's /metrics every --scrape-every s")
    ap.add_argument("--scrape-every", type=float, default=15.0)
    a = ap.parse_args()
    import uvloop

    if a.fleet_only:
        uvloop.run(fleet_only(a))
        return
    res = uvloop.run(main_async(a))
    print(json.dumps(res, indent=2))
    if a.json:
        a.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
