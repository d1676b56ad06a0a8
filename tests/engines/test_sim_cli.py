"""``llmgw sim-engine`` as a process: start, serve, SIGTERM, errors."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys

from click.testing import CliRunner

from llmgw.cli import main


def _spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "llmgw", "sim-engine", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _get(port: int, method: str, path: str, body: dict | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body),
                     headers={"content-type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def test_runs_serves_and_stops_on_sigterm() -> None:
    proc = _spawn("--listen", "127.0.0.1:0", "--model", "tiny", "--engine", "sglang", "--slots", "2",
                  "--ttft-ms", "0", "--tokens-per-second", "1e6", "--seed", "3", "--api-key", "k")
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        assert m, line
        port = int(m.group(1))
        status, body = _get(port, "POST", "/v1/chat/completions",
                            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
                            {"authorization": "Bearer k"})
        assert status == 200, body
        assert json.loads(body)["usage"]["completion_tokens"] == 3
        status, body = _get(port, "GET", "/metrics")
        assert status == 200 and b"sglang:num_requests_total" in body
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "Traceback" not in err


def test_port_in_use_is_one_line() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = _spawn("--listen", f"127.0.0.1:{port}", "--model", "m")
        _out, err = proc.communicate(timeout=20)
    assert proc.returncode == 1
    assert err.strip().splitlines()[-1] == f"llmgw: error: 127.0.0.1:{port} is already in use"
    assert "Traceback" not in err


def test_bad_flags() -> None:
    res = CliRunner().invoke(main, ["sim-engine", "--model", "m", "--engine", "ollama"])
    assert res.exit_code == 1
    assert "--engine" in res.output
    res = CliRunner().invoke(main, ["sim-engine", "--model", "m", "--kv-tokens", "5"])
    assert res.exit_code == 1
    assert "--kv-tokens" in res.output
    res = CliRunner().invoke(main, ["sim-engine", "--help"])
    assert res.exit_code == 0 and "--tokens-per-second" in res.output
