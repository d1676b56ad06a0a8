"""llmgw's launcher for TensorRT-LLM's ``trtllm-serve``, which has no API-key support.

This one file is all it needs: the standard library, no llmgw (the agent runs it
with ``engines.trtllm.python``, an interpreter that has ``tensorrt_llm`` but not
llmgw, as ``PYTHON -I -S trtllm_guard.py``: no site-packages, no current directory)::

    trtllm_guard.py --host H --port P --work-dir DIR -- trtllm-serve MODEL [ARGS...]

* It refuses to start without a key in ``$LLMGW_TRTLLM_API_KEY`` (exit 2), and
  removes it from the engine's environment.
* It writes ``DIR/llmgw-trtllm.yaml`` (``return_perf_metrics: true`` mounts
  ``/prometheus/metrics``; ``enable_iter_perf_stats: true`` fills its queue and
  KV gauges) and starts ``trtllm-serve ... --host 127.0.0.1 --port <free loopback
  port> --config DIR/llmgw-trtllm.yaml``.
* It listens on ``H:P`` and proxies every request to it; all but ``GET /health``
  need ``Authorization: Bearer <key>`` (401 otherwise, in trtllm-serve's error
  shape). Each proxied request gets ``Connection: close`` upstream, so the bytes
  after the head can be piped both ways without parsing bodies (streams pass as
  they come).
* SIGTERM/SIGINT are passed to ``trtllm-serve``; the guard exits with its status.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

KEY_ENV = "LLMGW_TRTLLM_API_KEY"
OPEN_PATHS = frozenset({"/health"})
CONFIG_NAME = "llmgw-trtllm.yaml"
CONFIG_TEXT = "# written by llmgw's TensorRT-LLM launcher\nreturn_perf_metrics: true\nenable_iter_perf_stats: true\n"
_OWN_FLAGS = ("--host", "--port", "--config", "--extra_llm_api_options")
_HOP = {b"connection", b"keep-alive", b"proxy-connection", b"te", b"upgrade"}
_MAX_HEAD = 64 * 1024


def _say(msg: str) -> None:
    print(f"trtllm_guard: {msg}", file=sys.stderr, flush=True)


def _error(status: int, reason: str, message: str) -> bytes:
    # trtllm-serve's ErrorResponse shape (flat, with the HTTP status as code).
    body = json.dumps({"object": "error", "message": message, "type": reason.replace(" ", ""),
                       "param": None, "code": status}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n\r\n").encode() + body


class Guard:
    def __init__(self, key: str, upstream_port: int) -> None:
        self._key = ("Bearer " + key).encode()
        self._upstream = upstream_port

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._handle(reader, writer)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            writer.write(_error(431, "Request Header Fields Too Large", "request head too large"))
            return
        lines = head[:-4].split(b"\r\n")
        parts = lines[0].split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            writer.write(_error(400, "Bad Request", "malformed request line"))
            return
        path = parts[1].split(b"?", 1)[0].decode("latin-1")
        kept = [lines[0]]
        auth = b""
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            lname = name.strip().lower()
            if lname == b"authorization":
                auth = value.strip()
            if lname in _HOP:
                continue
            kept.append(line)
        if path not in OPEN_PATHS and not hmac.compare_digest(auth, self._key):
            writer.write(_error(401, "Unauthorized", "a valid API key is required (Authorization: Bearer <key>)"))
            await writer.drain()
            return
        kept.append(b"Connection: close")
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self._upstream)
        except OSError:
            writer.write(_error(503, "Service Unavailable",
                                "LLM is unavailable. Please check the server logs for more details."))
            return
        try:
            up_w.write(b"\r\n".join(kept) + b"\r\n\r\n")
            to_up = asyncio.ensure_future(_pipe(reader, up_w))
            try:
                await _pipe(up_r, writer)
            finally:
                to_up.cancel()
                with contextlib.suppress(BaseException):
                    await to_up
        finally:
            up_w.close()
            with contextlib.suppress(OSError):
                await up_w.wait_closed()


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    while True:
        data = await src.read(65536)
        if not data:
            return
        dst.write(data)
        await dst.drain()


def _free_port() -> int:
    # NOTE: below Linux's ephemeral range (32768-60999), where no outgoing connection
    # can take the port before trtllm-serve binds it.
    for _ in range(64):
        port = random.randint(20000, 32767)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _serve(args: argparse.Namespace, key: str, cmd: list[str]) -> int:
    internal = _free_port()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    config = work / CONFIG_NAME
    config.write_text(CONFIG_TEXT)
    env = dict(os.environ)
    env.pop(KEY_ENV, None)
    argv = [*cmd, "--host", "127.0.0.1", "--port", str(internal), "--config", str(config)]
    _say(f"starting {' '.join(argv)}")
    try:
        child = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL)
    except OSError as exc:
        _say(f"cannot run {cmd[0]}: {exc.strerror or exc}")
        return 127
    loop = asyncio.get_running_loop()
    guard = Guard(key, internal)
    try:
        server = await asyncio.start_server(guard.handle, args.host, args.port, limit=_MAX_HEAD)
    except OSError as exc:
        _say(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}")
        child.terminate()
        child.wait()
        return 1
    _say(f"listening on {args.host}:{args.port}, trtllm-serve on 127.0.0.1:{internal}; "
         "the key is needed for all but /health")

    def forward(sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(sig)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, forward, sig)
    try:
        code = await asyncio.to_thread(child.wait)
    finally:
        server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 2.0)
    _say(f"trtllm-serve exited with status {code}")
    return code if code >= 0 else 128 - code


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="trtllm_guard", description="llmgw's API-key guard in front of trtllm-serve.")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    p.add_argument("--port", type=int, required=True, help="the port to listen on")
    p.add_argument("--work-dir", required=True, help="where the trtllm-serve config file is written")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- trtllm-serve MODEL [ARGS...]")
    args = p.parse_args(argv)
    cmd = list(args.command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        p.error("no trtllm-serve command after --")
    key = os.environ.get(KEY_ENV, "")
    if not key:
        _say(f"refusing to start: no API key in ${KEY_ENV} (trtllm-serve has no key of its own, "
             "and llmgw never runs an engine open to the network)")
        return 2
    for a in cmd[1:]:
        if a.split("=", 1)[0] in _OWN_FLAGS:
            _say(f"refusing {a}: llmgw passes its own --host, --port and --config to trtllm-serve; "
                 "put other LlmArgs settings in the deployment's args as --set path=value")
            return 2
    return asyncio.run(_serve(args, key, cmd))


if __name__ == "__main__":
    sys.exit(main())
