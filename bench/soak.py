#!/usr/bin/env python3
"""Soak: a steady mix of traffic and trouble against one ``llmgw serve`` for ``--duration`` seconds.

What runs at once (all real processes on 127.0.0.1):

* traffic at ``--rate`` requests/s on kept-alive connections: non-streamed and streamed chat
  completions to model ``steady`` (two ``llmgw sim-engine`` replicas nobody faults), streams
  the client abandons after two events, and requests to model ``chaos`` (one replica);
* trouble on ``chaos``: its engine's faults switched every 15 s (errors, cut streams, hung
  requests that the gateway's timeouts must end), and the engine killed (SIGKILL) and
  restarted every 60 s;
* a Prometheus's scrape of ``/metrics`` every second, admin queries (``/admin/v1/endpoints``,
  ``/ready``) every 2 s, and a config reload (``POST /admin/v1/reload``, the file changed)
  every 30 s.

It reports, for the gateway process: RSS after the warm-up (``--warmup``) and at the end
(goal: growth < 16 MiB), open descriptors idle before and after (goal: back to the
baseline once idle upstream connections expired), every in-flight and queue gauge after
the traffic stopped (goal: 0), and answers by kind. **Errors the traffic did not ask
for** (goal 0): any answer to ``steady`` that is not a complete 200 (a whole JSON body, or a
stream ending in ``[DONE]``), and any answer to ``chaos`` that is neither a complete 200 nor
an honest failure (an OpenAI-shaped JSON error with a 4xx/5xx status, or a stream that
ends with an SSE ``error`` event).

    .venv/bin/python bench/soak.py                        # 10 minutes, 40 requests/s
    .venv/bin/python bench/soak.py --duration 120 --json /tmp/soak.json

Every process it starts is stopped on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

LLMGW = [sys.executable, "-m", "llmgw"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def fd_kinds(pid: int) -> dict[str, int]:
    """Open descriptors by kind (socket, pipe, anon_inode:[eventpoll], a file, ...)."""
    out: Counter[str] = Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        out[target.split(":")[0] if ":" in target else "file"] += 1
    return dict(out)


# ---------------------------------------------------------------- a small HTTP/1.1 client


class Answer:
    def __init__(self, status: int, headers: dict[str, str], body: bytes, complete: bool) -> None:
        self.status, self.headers, self.body, self.complete = status, headers, body, complete


class Conn:
    """One kept-alive connection (HTTP/1.1, Content-Length or chunked answers)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.r: asyncio.StreamReader | None = None
        self.w: asyncio.StreamWriter | None = None
        self.last = "new"
        """What the connection carried last (said when it fails: a server that closes a kept-alive
        connection without saying so shows up here)."""
        self.idle_since = time.monotonic()

    async def request(self, method: str, path: str, body: bytes = b"", *, headers: str = "",
                      stop_after_events: int | None = None, timeout: float = 60.0) -> Answer:
        if self.w is None:
            self.r, self.w = await asyncio.open_connection("127.0.0.1", self.port)
            self.last = "new"
        assert self.r is not None and self.w is not None
        self.w.write(f"{method} {path} HTTP/1.1\r\nhost: soak\r\ncontent-type: application/json\r\n"
                     f"content-length: {len(body)}\r\n{headers}\r\n".encode() + body)
        try:
            return await asyncio.wait_for(self._read(stop_after_events), timeout)
        except BaseException:
            self.close()
            raise

    async def _read(self, stop_after_events: int | None) -> Answer:
        r = self.r
        assert r is not None
        status_line = await r.readline()
        if not status_line:
            raise ConnectionError("closed before an answer")
        status = int(status_line.split()[1])
        headers: dict[str, str] = {}
        while True:
            line = await r.readline()
            if line in (b"\r\n", b""):
                break
            k, _, v = line.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        body = b""
        complete = True
        if "content-length" in headers:
            try:
                body = await r.readexactly(int(headers["content-length"]))
            except asyncio.IncompleteReadError as exc:
                body, complete = exc.partial, False
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            complete = False
            while True:
                size_line = await r.readline()
                if not size_line:
                    break
                size = int(size_line.split(b";")[0], 16)
                if size == 0:
                    await r.readline()
                    complete = True
                    break
                try:
                    body += await r.readexactly(size + 2)
                except asyncio.IncompleteReadError as exc:
                    body += exc.partial
                    break
                if stop_after_events is not None and body.count(b"\n\n") >= stop_after_events:
                    self.close()  # the client walks away mid-stream
                    return Answer(status, headers, body, False)
        if headers.get("connection", "").lower() == "close" or not complete:
            self.close()
        return Answer(status, headers, body, complete)

    def close(self) -> None:
        if self.w is not None:
            self.w.close()
        self.r = self.w = None


def chat(model: str, stream: bool) -> bytes:
    return json.dumps({"model": model, "stream": stream, "max_tokens": 24,
                       "messages": [{"role": "user", "content": "soak"}]}).encode()


def honest_error(a: Answer) -> bool:
    if a.status < 400:
        return False
    try:
        err = json.loads(a.body)["error"]
        return isinstance(err["message"], str) and "type" in err
    except (ValueError, KeyError, TypeError):
        return False


def sse_ended_with_error(a: Answer) -> bool:
    tail = a.body.rstrip().rsplit(b"\n\n", 1)[-1]
    return a.status == 200 and b'"error"' in tail


def classify(model: str, stream: bool, a: Answer) -> tuple[str, bool]:
    """(kind, asked-for) of one answer."""
    if a.status == 200 and a.complete:
        if stream and not a.body.rstrip().endswith(b"data: [DONE]"):
            if sse_ended_with_error(a):
                return "stream ended by an SSE error event", model == "chaos"
            return "stream without [DONE]", False
        if not stream:
            try:
                json.loads(a.body)["choices"]
            except (ValueError, KeyError, TypeError):
                return "200 without a JSON answer", False
        return "200", True
    if honest_error(a):
        return f"{a.status} {json.loads(a.body)['error'].get('code')}", model == "chaos"
    if a.status == 200 and stream and sse_ended_with_error(a):
        return "stream ended by an SSE error event", model == "chaos"
    return f"{a.status} {'complete' if a.complete else 'cut'} (not an honest failure)", False


# ---------------------------------------------------------------- the run


class Soak:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.tmp = Path(tempfile.mkdtemp(prefix="llmgw-soak-"))
        self.lport, self.aport = free_port(), free_port()
        self.eports = {"s0": free_port(), "s1": free_port(), "c0": free_port()}
        self.engines: dict[str, subprocess.Popen[bytes]] = {}
        self.serve: subprocess.Popen[bytes] | None = None
        self.kinds: Counter[tuple[str, str]] = Counter()
        self.unasked: Counter[str] = Counter()
        self.transport_errors: Counter[str] = Counter()
        self.samples: list[tuple[float, float, int]] = []
        self.reloads = Counter[str]()
        self.stop = asyncio.Event()
        self.attempts = 2

    def write_config(self) -> None:
        eps = "".join(
            f"  - {{id: {eid}, url: 'http://127.0.0.1:{port}', model: {'chaos' if eid == 'c0' else 'steady'}, "
            "engine: vllm}\n" for eid, port in self.eports.items())
        text = (f"listen: 127.0.0.1:{self.lport}\nadmin: 127.0.0.1:{self.aport}\nendpoints:\n{eps}"
                "upstream:\n  first_byte_timeout: 3s\n  read_timeout: 3s\n  idle_timeout: 2s\n"
                f"retries:\n  attempts: {self.attempts}\n"
                "scrape:\n  interval: 1s\n")
        tmp = self.tmp / "llmgw.yaml.tmp"
        tmp.write_text(text)
        os.replace(tmp, self.tmp / "llmgw.yaml")

    def start_engine(self, eid: str) -> None:
        with open(self.tmp / f"{eid}.log", "ab") as log:  # the child keeps its own descriptor
            self.engines[eid] = subprocess.Popen(
                [*LLMGW, "--log-level", "warning", "sim-engine", "--listen", f"127.0.0.1:{self.eports[eid]}",
                 "--model", "chaos" if eid == "c0" else "steady", "--ttft-ms", "20", "--tokens-per-second", "400",
                 "--slots", "64", "--seed", str(random.randrange(1 << 30))],
                stdout=log, stderr=log,
            )

    async def wait_port(self, port: int, what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                _, w = await asyncio.open_connection("127.0.0.1", port)
                w.close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit(f"soak: {what} did not listen on {port} within {timeout:g}s") from None
                await asyncio.sleep(0.1)

    async def setup(self) -> None:
        for eid in self.eports:
            self.start_engine(eid)
        for eid, port in self.eports.items():
            await self.wait_port(port, f"engine {eid}")
        self.write_config()
        with open(self.tmp / "serve.log", "ab") as log:
            self.serve = subprocess.Popen(
                [*LLMGW, "--log-level", "warning", "serve", "-c", str(self.tmp / "llmgw.yaml")], stdout=log, stderr=log
            )
        await self.wait_port(self.lport, "llmgw serve")
        for _ in range(100):  # every replica scraped once
            a = await Conn(self.aport).request("GET", "/ready")
            if a.status == 200:
                break
            await asyncio.sleep(0.1)

    async def one(self, conn: Conn) -> None:
        r = random.random()
        model, stream, abandon = "steady", False, None
        if r < 0.3:
            stream = True
        elif r < 0.4:
            stream, abandon = True, 2
        elif r < 0.6:
            model, stream = "chaos", random.random() < 0.5
        try:
            a = await conn.request("POST", "/v1/chat/completions", chat(model, stream), stop_after_events=abandon,
                                   timeout=30)
        except (OSError, ConnectionError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
            idle = time.monotonic() - conn.idle_since
            self.transport_errors[f"{model}: {type(exc).__name__} after {conn.last} (idle {idle:.1f}s)"] += 1
            self.unasked[f"{model}: transport {type(exc).__name__}"] += 1
            conn.close()
            return
        finally:
            conn.idle_since = time.monotonic()
        conn.last = f"{model} {'stream' if stream else 'json'} {a.status}{' abandoned' if abandon else ''}"
        if abandon is not None:
            self.kinds[(model, "abandoned by the client")] += 1
            return
        kind, asked = classify(model, stream, a)
        self.kinds[(model, kind)] += 1
        if not asked:
            self.unasked[f"{model}: {kind}"] += 1

    async def traffic(self) -> None:
        conns = [Conn(self.lport) for _ in range(32)]
        free: asyncio.Queue[Conn] = asyncio.Queue()
        for c in conns:
            free.put_nowait(c)
        tasks: set[asyncio.Task[None]] = set()
        gap = 1.0 / self.a.rate
        next_at = time.monotonic()
        while not self.stop.is_set():
            conn = await free.get()

            async def run(c: Conn = conn) -> None:
                try:
                    await self.one(c)
                finally:
                    free.put_nowait(c)

            t = asyncio.create_task(run())
            tasks.add(t)
            t.add_done_callback(tasks.discard)
            next_at += gap
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in conns:
            c.close()

    async def chaos(self) -> None:
        faults = [{"reset": True}, {"error_rate": 0.3, "error_status": 503}, {"cut_rate": 0.3, "cut_after_chunks": 2},
                  {"hang_rate": 0.1}, {"error_rate": 0.2, "error_status": 500, "cut_rate": 0.1}]
        t0 = time.monotonic()
        i = 0
        while not self.stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stop.wait(), 15)
                return
            i += 1
            if i % 4 == 0:  # every 60 s: the engine dies and comes back
                eng = self.engines["c0"]
                eng.send_signal(signal.SIGKILL)
                eng.wait(10)
                await asyncio.sleep(2)
                self.start_engine("c0")
                await self.wait_port(self.eports["c0"], "engine c0 (restarted)")
                continue
            f = {"reset": True, **faults[i % len(faults)]}
            with contextlib.suppress(OSError, ConnectionError, asyncio.TimeoutError):
                await Conn(self.eports["c0"]).request("POST", "/sim/faults", json.dumps(f).encode(), timeout=5)
            _ = t0

    async def operators(self) -> None:
        conn = Conn(self.aport)
        n = 0
        while not self.stop.is_set():
            n += 1
            try:
                a = await conn.request("GET", "/metrics", headers="accept: text/plain\r\n", timeout=10)
                if a.status != 200:
                    self.unasked[f"/metrics {a.status}"] += 1
                if n % 2 == 0:
                    for path in ("/admin/v1/endpoints", "/ready"):
                        a = await conn.request("GET", path, timeout=10)
                        if path != "/ready" and a.status != 200:
                            self.unasked[f"{path} {a.status}"] += 1
                if n % 30 == 0:
                    self.attempts = 3 - self.attempts  # 2 <-> 1: a reload that changes something
                    self.write_config()
                    a = await conn.request("POST", "/admin/v1/reload", timeout=10)
                    self.reloads["ok" if a.status == 200 else f"status {a.status}"] += 1
                    if a.status != 200:
                        self.unasked[f"reload {a.status}"] += 1
            except (OSError, ConnectionError, asyncio.TimeoutError, ValueError) as exc:
                self.unasked[f"admin transport {type(exc).__name__}"] += 1
                conn.close()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stop.wait(), 1.0)
        conn.close()

    async def sampler(self) -> None:
        assert self.serve is not None
        t0 = time.monotonic()
        while not self.stop.is_set():
            self.samples.append((time.monotonic() - t0, rss_mib(self.serve.pid), fds(self.serve.pid)))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stop.wait(), 5.0)

    async def gauges(self) -> dict[str, float]:
        conn = Conn(self.aport)
        try:
            a = await conn.request("GET", "/metrics", headers="accept: text/plain\r\nconnection: close\r\n")
        finally:
            conn.close()  # (its descriptor on the gateway's side must not count against the baseline)
        out: dict[str, float] = {}
        for line in a.body.decode().splitlines():
            if line.startswith(("llmgw_endpoint_inflight", "llmgw_admission_queue_depth",
                                'llmgw_connections{listener="client"}')):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    async def run(self) -> dict[str, Any]:
        await self.setup()
        assert self.serve is not None
        pid = self.serve.pid
        idle_fds_before, kinds_before = fds(pid), fd_kinds(pid)
        t0 = time.monotonic()
        jobs = [asyncio.create_task(j()) for j in (self.traffic, self.chaos, self.operators, self.sampler)]
        await asyncio.sleep(self.a.warmup)
        rss_warm = rss_mib(pid)
        await asyncio.sleep(max(0.0, self.a.duration - self.a.warmup))
        self.stop.set()
        await asyncio.gather(*jobs, return_exceptions=True)
        ran_s = time.monotonic() - t0
        await asyncio.sleep(1.0)
        gauges = await self.gauges()
        await asyncio.sleep(4.0)  # idle upstream connections expire (upstream.idle_timeout 2 s)
        idle_fds_after, kinds_after = fds(pid), fd_kinds(pid)
        rss_end = rss_mib(pid)
        after_warm = [r for t, r, _ in self.samples if t >= self.a.warmup]
        total = sum(self.kinds.values())
        return {
            "duration_s": round(ran_s, 1), "rate": self.a.rate, "requests": total,
            "answers": {f"{m}: {k}": n for (m, k), n in sorted(self.kinds.items())},
            "unasked_errors": dict(self.unasked), "unasked_total": sum(self.unasked.values()),
            "transport_errors": dict(self.transport_errors),
            "reloads": dict(self.reloads),
            "rss_mib": {"after_warmup": round(rss_warm, 1), "end": round(rss_end, 1),
                        "max_after_warmup": round(max(after_warm, default=rss_end), 1),
                        "growth_after_warmup": round(max(after_warm, default=rss_end) - rss_warm, 1),
                        "median_after_warmup": round(statistics.median(after_warm), 1) if after_warm else None},
            "fds": {"idle_before": idle_fds_before, "idle_after": idle_fds_after, "kinds_before": kinds_before,
                    "kinds_after": kinds_after,
                    "max_during": max((f for _, _, f in self.samples), default=None)},
            "gauges_after": gauges, "gauges_nonzero": {k: v for k, v in gauges.items() if v != 0},
        }

    def close(self) -> None:
        for p in [*self.engines.values(), *([self.serve] if self.serve else [])]:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in [*self.engines.values(), *([self.serve] if self.serve else [])]:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=600.0)
    ap.add_argument("--warmup", type=float, default=60.0)
    ap.add_argument("--rate", type=float, default=40.0, help="requests per second")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    random.seed(a.seed)
    soak = Soak(a)
    try:
        import uvloop

        res = uvloop.run(soak.run())
    finally:
        soak.close()
    print(json.dumps(res, indent=2))
    if a.json:
        a.json.write_text(json.dumps(res, indent=2))
    ok = res["unasked_total"] == 0 and not res["gauges_nonzero"] and res["rss_mib"]["growth_after_warmup"] < 16
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
