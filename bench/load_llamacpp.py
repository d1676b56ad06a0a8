"""Streaming throughput of two real llama.cpp replicas, direct and through llmgw.

What is measured: ``--streams`` concurrent client loops (default 16), each sending
streamed ``POST /v1/completions`` requests (``--max-tokens`` tokens, usage
included) one after another on a keep-alive connection for ``--duration``
seconds. *Direct*, the loops are split evenly over the two ``llama-server``
replicas (with their key); *through llmgw*, all go to one ``llmgw serve -c
<config>`` process in front of the same replicas (``engine: llamacpp``). Tokens
are counted from each response's ``usage``. Each figure is the median of
``--runs`` runs; the modes alternate so drift hits both alike.

llmgw's CPU is read from ``/proc/<pid>/stat`` (utime + stime) of the gateway
process around each run and divided by the tokens it streamed: CPU milliseconds
per 1,000 streamed tokens (this includes its scrape poller).

The replicas run the tiny random-weight model of :mod:`llmgw.testing.gguf_model`
(``--metrics --api-key -np --parallel -c``, one thread each); the engine binary
comes from :func:`llmgw.testing.llamacpp.find_llama_server`. Engines, llmgw and
this load generator share the machine's cores, so *through llmgw* also pays for
the CPU the gateway takes from the engines.

Usage::

    .venv/bin/python bench/load_llamacpp.py [--streams 16] [--duration 5] [--runs 3]
        [--max-tokens 256] [--parallel 8] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from llmgw.testing.gguf_model import write_tiny_llama
from llmgw.testing.llamacpp import LlamaServer, find_llama_server, free_port

KEY = "bench-engine-key"
MODEL = "tiny"
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, in seconds (``/proc/<pid>/stat`` fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        # The command name (field 2) may contain spaces: split after its closing paren.
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


class Conn:
    """One keep-alive HTTP/1.1 connection sending streamed completions."""

    def __init__(self, host: str, port: int, key: str | None, body: bytes) -> None:
        self.host, self.port = host, port
        auth = f"Authorization: Bearer {key}\r\n" if key else ""
        self.request = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"{auth}Content-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def _send(self) -> bytes:
        """Send the request and return the response head, reconnecting once if a reused connection was closed.

        NOTE: llama-server closes the connection after every streamed answer even
        though it announced keep-alive, so a direct client reconnects each time.
        """
        for _ in range(2):
            reused = self.writer is not None
            if self.writer is None:
                self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            assert self.reader is not None
            self.writer.write(self.request)
            try:
                return await self.reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionResetError):
                await self.close()
                if not reused:
                    raise
        raise RuntimeError("unreachable")

    async def one(self) -> int:
        """Send one request, read the whole stream; returns the completion tokens."""
        head = await self._send()
        reader = self.reader
        assert reader is not None
        status = int(head.split(None, 2)[1])
        lower = head.lower()
        body = bytearray()
        if b"transfer-encoding: chunked" in lower:
            while True:
                size = int((await reader.readline()).split(b";")[0], 16)
                if size == 0:
                    await reader.readline()
                    break
                body += await reader.readexactly(size + 2)
        elif b"content-length:" in lower:
            n = int(lower.split(b"content-length:")[1].split(b"\r\n")[0])
            body += await reader.readexactly(n)
        else:
            body += await reader.read(-1)
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {bytes(body[:300])!r}")
        if b"connection: close" in lower:
            await self.close()
        at = body.rfind(b'"usage"')
        if at < 0:
            raise RuntimeError("a stream without usage")
        start = body.rfind(b"data: ", 0, at) + 6
        event = json.loads(body[start:body.index(b"\n", at)])
        if b"[DONE]" not in body[-32:]:
            raise RuntimeError("a stream that did not end with [DONE]")
        return int(event["usage"]["completion_tokens"])

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(OSError):
                await self.writer.wait_closed()
        self.reader = self.writer = None


async def run_load(
    targets: list[tuple[str, int, str | None]], streams: int, duration: float, max_tokens: int
) -> tuple[int, int, float]:
    """``streams`` loops spread over ``targets`` for ``duration`` s: (requests, tokens, seconds)."""
    body = json.dumps(
        {"model": MODEL, "prompt": "Tell me a long story about a gateway.", "max_tokens": max_tokens,
         "stream": True, "stream_options": {"include_usage": True}}
    ).encode()
    conns = [Conn(*targets[i % len(targets)], body) for i in range(streams)]
    totals = [0, 0]
    t0 = time.monotonic()
    deadline = t0 + duration

    async def loop(c: Conn) -> None:
        while time.monotonic() < deadline:
            tokens = await c.one()  # NOTE: not `totals[1] += await ...`: that reads totals[1] before awaiting
            totals[1] += tokens
            totals[0] += 1

    try:
        await asyncio.gather(*(loop(c) for c in conns))
    finally:
        for c in conns:
            await c.close()
    return totals[0], totals[1], time.monotonic() - t0


def start_gateway(servers: list[LlamaServer], workdir: Path) -> tuple[subprocess.Popen[bytes], int, int]:
    listen, admin = free_port(), free_port()
    lines = [f"listen: 127.0.0.1:{listen}", f"admin: 127.0.0.1:{admin}", "endpoints:"]
    for i, s in enumerate(servers):
        lines += [f"  - id: ls{i}", f"    url: {s.url}", f"    model: {MODEL}", "    engine: llamacpp",
                  f"    api_key: {KEY}"]
    cfg = workdir / "llmgw.yaml"
    cfg.write_text("\n".join(lines) + "\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmgw", "--log-level", "warning", "serve", "-c", str(cfg)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,  # its banner; warnings still reach stderr
    )
    import http.client

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llmgw serve exited with status {proc.returncode}")
        conn = http.client.HTTPConnection("127.0.0.1", admin, timeout=1)
        try:
            conn.request("GET", "/ready")
            if conn.getresponse().status == 200:
                return proc, listen, admin
        except OSError:
            pass
        finally:
            conn.close()
        time.sleep(0.1)
    proc.kill()
    proc.wait()
    raise RuntimeError("llmgw serve was not ready within 20s")


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    binary = find_llama_server(log=lambda m: print(m, file=sys.stderr))
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-") as tmp:
        workdir = Path(tmp)
        slot_ctx = max(1024, args.max_tokens + 256)
        model = write_tiny_llama(workdir / "tiny.gguf", ctx=slot_ctx)
        servers = [
            LlamaServer(binary, model, api_key=KEY, parallel=args.parallel, ctx=slot_ctx * args.parallel,
                        alias=MODEL, threads=args.threads)
            for _ in range(2)
        ]
        gw: subprocess.Popen[bytes] | None = None
        try:
            for s in servers:
                s.start()
            gw, listen, _admin = start_gateway(servers, workdir)
            direct = [(s.host, s.port, KEY) for s in servers]
            through = [("127.0.0.1", listen, None)]
            # Warm up both paths (connections, caches) before measuring.
            await run_load(direct, args.streams, 1.0, args.max_tokens)
            await run_load(through, args.streams, 1.0, args.max_tokens)
            results: dict[str, list[dict[str, float]]] = {"direct": [], "llmgw": []}
            for _ in range(args.runs):
                reqs, toks, secs = await run_load(direct, args.streams, args.duration, args.max_tokens)
                results["direct"].append({"tokens_per_s": toks / secs, "requests_per_s": reqs / secs})
                cpu0 = cpu_seconds(gw.pid)
                reqs, toks, secs = await run_load(through, args.streams, args.duration, args.max_tokens)
                cpu = cpu_seconds(gw.pid) - cpu0
                results["llmgw"].append({
                    "tokens_per_s": toks / secs,
                    "requests_per_s": reqs / secs,
                    "cpu_ms_per_1k_tokens": 1000 * cpu / (toks / 1000),
                    "cpu_share": cpu / secs,
                })
        finally:
            if gw is not None:
                stop_process(gw)
            for s in servers:
                s.stop()

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in results[mode])

    summary = {
        "streams": args.streams,
        "max_tokens": args.max_tokens,
        "parallel_per_replica": args.parallel,
        "duration_s": args.duration,
        "runs": args.runs,
        "direct": {k: med("direct", k) for k in ("tokens_per_s", "requests_per_s")},
        "llmgw": {k: med("llmgw", k) for k in ("tokens_per_s", "requests_per_s", "cpu_ms_per_1k_tokens", "cpu_share")},
        "raw": results,
    }
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--parallel", type=int, default=8, help="-np per replica (default 8: all 16 streams run)")
    ap.add_argument("--threads", type=int, default=1, help="-t per replica")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    out = asyncio.run(bench(args))
    if args.json:
        print(json.dumps(out, indent=2))
        return
    d, g = out["direct"], out["llmgw"]
    print(f"{args.streams} concurrent streams, {args.max_tokens} tokens each, 2 replicas x -np {args.parallel}, "
          f"median of {args.runs} x {args.duration:g}s")
    print(f"  direct:        {d['tokens_per_s']:9.0f} tokens/s  {d['requests_per_s']:7.2f} requests/s")
    print(f"  through llmgw: {g['tokens_per_s']:9.0f} tokens/s  {g['requests_per_s']:7.2f} requests/s"
          f"  ({100 * (g['tokens_per_s'] / d['tokens_per_s'] - 1):+.1f}%)")
    print(f"  llmgw CPU:     {g['cpu_ms_per_1k_tokens']:.1f} ms per 1,000 streamed tokens"
          f" ({100 * g['cpu_share']:.0f}% of one core)")


if __name__ == "__main__":
    main()
