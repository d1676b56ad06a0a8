#!/usr/bin/env python3
"""Instructions per proxied request, by function: llmgw under callgrind.

Wall-clock CPU numbers on a shared 2-core VM move by 10-15% between runs;
callgrind's instruction counts do not (same binary, same input: same count), so
this is the tool for deciding whether a change to the data path helped. It starts
the ``run.py`` nginx "engine", runs ``llmgw serve`` under
``valgrind --tool=callgrind`` with collection off, warms it up, switches
collection on for a fixed number of requests (a bounded keep-alive client on
16 connections, ``post.lua``'s request) and prints instructions per request, user
space only (kernel time is not seen), plus the top functions.

    .venv/bin/python bench/dataplane/callgrind.py --requests 4000
    .venv/bin/python bench/dataplane/callgrind.py --stream --requests 300
    .venv/bin/python bench/dataplane/callgrind.py --metrics off    # the data path's observer off
    .venv/bin/python bench/dataplane/callgrind.py --strategy prefix  # routing.strategy (default: llmgw's, score)
    .venv/bin/python bench/dataplane/callgrind.py --stream --api-key   # replicas with keys (redaction's checks)

Needs valgrind (``callgrind_control``, ``callgrind_annotate``) and nginx with the
echo module, as ``run.py`` does.
"""

from __future__ import annotations

import argparse
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run as dp  # noqa: E402

_BODY = (HERE / "post.lua").read_text()


def _request(stream: bool) -> bytes:
    body = re.search(r"^wrk\.body = '(.*)'$", _BODY, re.M)
    if body is None:
        raise SystemExit("post.lua: no wrk.body line")
    payload = body.group(1).encode()
    if stream:
        payload = payload.replace(b'"stream":false', b'"stream":true', 1)
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        + (b"x-bench-stream: 1\r\n" if stream else b"")
        + b"content-length: %d\r\n\r\n" % len(payload)
    )
    return head + payload


def _read_response(sock: socket.socket, buf: bytearray) -> int:
    """Read one HTTP/1.1 response (Content-Length or chunked) off ``sock``; its count of SSE events."""
    while True:
        end = buf.find(b"\r\n\r\n")
        if end >= 0:
            break
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    head = bytes(buf[:end]).lower()
    del buf[: end + 4]
    if not head.startswith(b"http/1.1 200"):
        raise ConnectionError(f"answer {head[:60]!r}: the figure would not be a proxied request's")
    m = re.search(rb"content-length: (\d+)", head)
    if m:
        n = int(m.group(1))
        while len(buf) < n:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed")
            buf += chunk
        events = buf[:n].count(b"data: ")
        del buf[:n]
        return events
    while True:  # chunked: until the last chunk
        i = buf.find(b"0\r\n\r\n")
        if i >= 0 and (i == 0 or buf[i - 2 : i] == b"\r\n"):
            events = buf[:i].count(b"data: ")
            del buf[: i + 5]
            return events
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk


def drive(port: int, total: int, conns: int, stream: bool) -> None:
    """Send ``total`` requests over ``conns`` keep-alive connections, one at a time each."""
    req = _request(stream)
    per = [total // conns + (1 if i < total % conns else 0) for i in range(conns)]

    def worker(n: int) -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
            buf = bytearray()
            for _ in range(n):
                s.sendall(req)
                events = _read_response(s, buf)
                if stream and events != 65:
                    raise ConnectionError(f"a stream of {events} events, not 65")

    threads = [threading.Thread(target=worker, args=(n,)) for n in per]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--connections", type=int, default=16)
    ap.add_argument("--stream", action="store_true", help="65-event SSE answers instead of the JSON one")
    ap.add_argument("--port-base", type=int, default=29000)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--llmgw", default=str(dp.REPO / ".venv" / "bin" / "llmgw"))
    ap.add_argument("--out", default=None, help="keep the callgrind file here")
    ap.add_argument("--sse-gap-ms", type=float, default=0.0,
                    help="the engine's pause between SSE events (0: back to back; run.py's default is 1)")
    ap.add_argument("--metrics", choices=["on", "off"], default="on",
                    help="off: the gateway reports to NullObserver (bench/observer_dataplane.py's launcher)")
    ap.add_argument("--warmup", type=int, default=200, help="requests before collection starts")
    ap.add_argument("--scrape-interval", type=float, default=None,
                    help="llmgw's scrape.interval in seconds (default: llmgw's, 1 s); the first scrapes "
                    "are spread over one interval and routing waits for them")
    ap.add_argument("--strategy", default=None,
                    help="routing.strategy (default: llmgw's, score); prefix also hashes the body's prompt")
    ap.add_argument("--engine", default="vllm",
                    help="the endpoints' engine; external: never scraped, so the poller's scrapes, which "
                    "come with wall time and not with requests, stay out of the figure (bench/guard.py)")
    ap.add_argument("--api-key", action="store_true",
                    help="give the endpoints an api_key (as every replica an agent runs has): the paths that "
                    "look for it in what the engine sends (redaction) run too")
    args = ap.parse_args()

    base = args.port_base
    up = (base + 1, base + 2)
    for p in (*up, base + 81, base + 91):  # a stale engine on these ports would answer instead
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
            except OSError as exc:
                raise SystemExit(f"callgrind.py: port {p} is taken ({exc}); another --port-base?") from exc
    d = Path(tempfile.mkdtemp(prefix="llmgw-callgrind-"))
    (d / "tmp").mkdir()
    upstream = dp.start_engine(d, up, gap=args.sse_gap_ms / 1000.0)

    port, admin = base + 81, base + 91
    key = ', api_key: "replica-key-for-the-callgrind-run-0123456789"' if args.api_key else ""
    (d / "llmgw.yaml").write_text(
        f"listen: 127.0.0.1:{port}\nadmin: 127.0.0.1:{admin}\n"
        + (f"scrape: {{interval: {args.scrape_interval:g}}}\n" if args.scrape_interval else "")
        + (f"routing: {{strategy: {args.strategy}}}\n" if args.strategy else "")
        + "endpoints:\n"
        f'  - {{id: up0, url: "http://127.0.0.1:{up[0]}", model: m, engine: {args.engine}{key}}}\n'
        f'  - {{id: up1, url: "http://127.0.0.1:{up[1]}", model: m, engine: {args.engine}{key}}}\n'
    )
    out = Path(args.out) if args.out else d / "callgrind.out"
    if args.metrics == "on":
        cmd = [args.llmgw, "serve", "-c", str(d / "llmgw.yaml")]
    else:
        sys.path.insert(0, str(HERE.parent))
        from observer_dataplane import LAUNCH

        cmd = [sys.executable, "-c", LAUNCH, str(d / "llmgw.yaml"), "off"]
    gw = dp.start(["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}", *cmd],
                  d / "llmgw.out")
    dp.wait_port(port, gw, "llmgw under callgrind", timeout=180)
    drive(port, args.warmup, args.connections, args.stream)  # warm-up: pools, caches, first-use allocations
    subprocess.run(["callgrind_control", "-i", "on", str(gw.pid)], check=True, capture_output=True)
    t0 = time.monotonic()
    drive(port, args.requests, args.connections, args.stream)
    wall = time.monotonic() - t0
    subprocess.run(["callgrind_control", "-i", "off", str(gw.pid)], check=True, capture_output=True)
    subprocess.run(["callgrind_control", "-d", str(gw.pid)], check=True, capture_output=True)
    gw.terminate()
    gw.wait(60)
    upstream.terminate()
    dump = max(out.parent.glob(out.name + ".*"), key=lambda p: p.stat().st_size)  # the -d dump
    ann = subprocess.run(["callgrind_annotate", "--inclusive=no", str(dump)], capture_output=True, text=True).stdout
    m = re.search(r"^([\d,]+) \(100\.0%\)\s+PROGRAM TOTALS", ann, re.M)
    total = int(m.group(1).replace(",", "")) if m else 0
    kind = "stream" if args.stream else "request"
    print(f"{args.requests} {kind}s in {wall:.1f}s under callgrind; "
          f"{total / args.requests:,.0f} instructions per {kind} (user space)")
    body = ann.split("file:function", 1)[-1].splitlines()[1 : args.top + 1]
    for line in body:
        print(line[:150])
    print(f"callgrind file: {dump}")


if __name__ == "__main__":
    main()
