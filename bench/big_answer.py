"""Peak memory of the gateway relaying one huge non-streamed answer (a 64 MiB embeddings list).

What is measured: ``llmgw serve`` (a subprocess) in front of a stand-in engine
(another subprocess: a raw asyncio HTTP/1.1 server) that answers
``POST /v1/embeddings`` with a JSON body of ``--size`` MiB, framed with a
Content-Length or chunked (``--framing``). A client here sends one small request
first (warm-up: imports, pools, first allocations), reads the gateway's
``VmHWM`` (its peak resident set, ``/proc/<pid>/status``), then makes the big
request, reads the whole answer (checking its length and framing) and reads
``VmHWM`` again. The figure is the rise in peak RSS the big answer caused.

Non-streamed answers above ``upstream.max_buffered_body`` (default 4 MiB) are
relayed as they arrive, so the rise stays far below the answer's size; run with
``--max-buffered-body 128MiB`` to see the old behaviour (the whole answer buffered,
and joined once: about twice its size).

Usage::

    .venv/bin/python bench/big_answer.py [--size 64] [--framing cl|chunked]
        [--max-buffered-body 4MiB] [--limit-mib 16] [--json]

Exits 1 when the rise is ``--limit-mib`` or more.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENGINE = r'''
import asyncio, sys
SIZE, CHUNKED = int(sys.argv[1]), sys.argv[2] == "chunked"
ROW = b'{"object":"embedding","index":0,"embedding":[' + b",".join([b"0.0123456"] * 100) + b"]},"
HEAD, TAIL = b'{"object":"list","data":[', b'{"object":"embedding","index":1,"embedding":[]}],"usage":{"prompt_tokens":1,"total_tokens":1}}'

def body_pieces():
    left = SIZE - len(HEAD) - len(TAIL)
    yield HEAD
    block = ROW * (1048576 // len(ROW))
    while left >= len(block):
        yield block
        left -= len(block)
    yield ROW[:0] + b" " * left
    yield TAIL

async def serve(r, w):
    try:
        while True:
            head = await r.readuntil(b"\r\n\r\n")
            n = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    n = int(line.split(b":")[1])
            await r.readexactly(n)
            if b"/metrics" in head.split(b"\r\n")[0]:
                w.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                continue
            small = b"small" in head
            size = 200 if small else SIZE
            if small:
                body = b'{"object":"list","data":[],"usage":{"prompt_tokens":1,"total_tokens":1}}'
                w.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
                continue
            if CHUNKED:
                w.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n")
                for p in body_pieces():
                    if p:
                        w.write(b"%x\r\n%s\r\n" % (len(p), p))
                        await w.drain()
                w.write(b"0\r\n\r\n")
            else:
                w.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % size)
                for p in body_pieces():
                    w.write(p)
                    await w.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        w.close()

async def main():
    srv = await asyncio.start_server(serve, "127.0.0.1", 0)
    print(srv.sockets[0].getsockname()[1], flush=True)
    await srv.serve_forever()

asyncio.run(main())
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vm_hwm_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM")


async def post(port: int, path: bytes) -> tuple[int, int, str]:
    """One POST; returns (status, body bytes read, framing) and checks the framing is whole."""
    r, w = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
    body = b'{"model":"m","input":"hi"}'
    w.write(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (path, len(body), body))
    head = await r.readuntil(b"\r\n\r\n")
    status = int(head.split()[1])
    lower = head.lower()
    got = 0
    if b"transfer-encoding: chunked" in lower:
        framing = "chunked"
        while True:
            size = int((await r.readline()).strip(), 16)
            if size == 0:
                await r.readline()
                break
            left = size + 2
            while left:
                piece = await r.read(min(left, 1 << 20))
                if not piece:
                    raise RuntimeError("cut mid-chunk")
                left -= len(piece)
            got += size
    else:
        framing = "content-length"
        n = int(lower.split(b"content-length:")[1].split(b"\r\n")[0])
        while got < n:
            piece = await r.read(min(n - got, 1 << 20))
            if not piece:
                raise RuntimeError(f"cut at {got} of {n} bytes")
            got += len(piece)
    w.close()
    return status, got, framing


async def run(args: argparse.Namespace) -> dict[str, object]:
    size = args.size * 1024 * 1024
    eng = subprocess.Popen([sys.executable, "-c", ENGINE, str(size), args.framing], stdout=subprocess.PIPE, text=True)
    assert eng.stdout is not None
    eport = int(eng.stdout.readline())
    listen, admin = free_port(), free_port()
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(
            f"listen: 127.0.0.1:{listen}\nadmin: 127.0.0.1:{admin}\n"
            f"endpoints:\n  - {{id: e, url: 'http://127.0.0.1:{eport}', model: m, engine: external}}\n"
            f"upstream: {{max_buffered_body: {args.max_buffered_body}}}\n"
        )
        cfg = f.name
    gw = subprocess.Popen([sys.executable, "-m", "llmgw", "--log-level", "warning", "serve", "-c", cfg])
    try:
        for _ in range(200):
            try:
                status, _, _ = await post(listen, b"/v1/embeddings?small")
                break
            except OSError:
                await asyncio.sleep(0.05)
        else:
            raise RuntimeError("the gateway did not start")
        assert status == 200, status
        before = vm_hwm_kib(gw.pid)
        t0 = time.monotonic()
        status, got, framing = await post(listen, b"/v1/embeddings")
        seconds = time.monotonic() - t0
        after = vm_hwm_kib(gw.pid)
        assert status == 200 and got == size, (status, got, size)
        return {
            "answer_mib": args.size,
            "upstream_framing": args.framing,
            "client_framing": framing,
            "max_buffered_body": args.max_buffered_body,
            "peak_rss_before_mib": round(before / 1024, 1),
            "peak_rss_after_mib": round(after / 1024, 1),
            "peak_rss_rise_mib": round((after - before) / 1024, 1),
            "seconds": round(seconds, 3),
        }
    finally:
        gw.send_signal(signal.SIGTERM)
        eng.kill()
        gw.wait(10)
        eng.wait(10)
        os.unlink(cfg)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=64, help="answer size in MiB")
    ap.add_argument("--framing", choices=["cl", "chunked"], default="cl")
    ap.add_argument("--max-buffered-body", default="4MiB")
    ap.add_argument("--limit-mib", type=float, default=16.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    result = asyncio.run(run(args))
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:>22}: {v}")
    rise = result["peak_rss_rise_mib"]
    assert isinstance(rise, float)
    sys.exit(1 if rise >= args.limit_mib else 0)


if __name__ == "__main__":
    main()
