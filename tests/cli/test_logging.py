"""``--log-level``, ``--log-format`` and ``--log-config``, before or after the subcommand, driven through
the real ``llmgw`` entry point in a subprocess; under ``--log-format json`` every stderr line is JSON."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from ports import free_port as _free_port


def run(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmgw", *args], capture_output=True, text=True, timeout=60, cwd=cwd,
        env={**os.environ, **(env or {})},
    )


def json_lines(text: str) -> list[dict[str, Any]]:
    """Every line parsed as one JSON object (fails the test on the first line that is not)."""
    out = []
    for line in text.splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            raise AssertionError(f"not a JSON line: {line!r}\nin:\n{text}") from None
        assert isinstance(doc, dict), line
        out.append(doc)
    return out


def _serve(
    tmp_path: Path, before: tuple[str, ...] = (), after: tuple[str, ...] = ()
) -> tuple[subprocess.Popen[str], str, dict[str, Any]]:
    port, admin = _free_port(), _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmgw", *before, "serve", "--listen", f"127.0.0.1:{port}",
         "--admin", f"127.0.0.1:{admin}", *after],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stderr is not None
    deadline = time.monotonic() + 30
    first = None
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        first = json.loads(line)
        if "gateway on" in first["message"]:
            return proc, f"http://127.0.0.1:{port}", first
    proc.kill()
    out, err = proc.communicate(timeout=10)
    raise AssertionError(f"serve did not start: {first} {out} {err}")


@pytest.mark.parametrize("where", ["before", "after"])
def test_serve_json_logs_everything_json(tmp_path: Path, where: str) -> None:
    """``llmgw serve --log-level debug --log-format json`` (or before the subcommand) on the demo fleet."""
    opts = ("--log-level", "debug", "--log-format", "json")
    proc, base, banner = _serve(tmp_path, before=opts) if where == "before" else _serve(tmp_path, after=opts)
    try:
        assert banner["level"] == "info" and banner["logger"] == "llmgw.server" and banner["ts"] > 0
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        client.chat.completions.create(model="llama3", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
        stream = client.chat.completions.create(
            model="qwen", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
            extra_headers={"x-request-id": "req-abc-123"},
        )
        for _ in stream:
            pass
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    records = json_lines(err)
    assert {r["level"] for r in records} <= {"debug", "info", "warning", "error", "critical"}
    assert all({"ts", "level", "logger", "message"} <= set(r) for r in records), records
    assert any("shutting down" in r["message"] for r in records)
    assert out == ""  # the demo has no access log; the banner went to stderr


def test_access_log_under_json(tmp_path: Path) -> None:
    """With ``access_log: true`` stdout is the access log alone, one JSON object a line, shaped like stderr's."""
    sim_port = _free_port()
    sim = subprocess.Popen(
        [sys.executable, "-m", "llmgw", "sim-engine", "--listen", f"127.0.0.1:{sim_port}", "--model", "m",
         "--ttft-ms", "1", "--error-next", "1", "--error-status", "503", "--log-format", "json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert sim.stdout is not None and "serving" in sim.stdout.readline()
        (tmp_path / "llmgw.yaml").write_text(
            f"access_log: true\nendpoints:\n  - {{id: s0, url: 'http://127.0.0.1:{sim_port}', model: m, engine: vllm}}\n"
        )
        proc, base, _ = _serve(tmp_path, after=("--log-format=json", "--log-level=debug"))
        try:
            client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
            # The engine answers this one 503: the gateway logs the failed attempt (and may retry).
            with contextlib.suppress(openai.APIError):
                client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                               extra_headers={"x-request-id": "req-failed-1"})
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                           extra_headers={"x-request-id": "req-abc-123"})
            with pytest.raises(openai.NotFoundError):
                client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
        finally:
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=20)
    finally:
        sim.send_signal(signal.SIGTERM)
        _, sim_err = sim.communicate(timeout=20)
    assert proc.returncode == 0, err
    records = json_lines(err)
    json_lines(sim_err)
    access = json_lines(out)
    assert len(access) == 3, out
    assert all(a["logger"] == "llmgw.access" and a["level"] == "info" and a["ts"] > 0 for a in access)
    assert access[0]["id"] == "req-failed-1"
    assert access[1]["status"] == 200 and access[1]["id"] == "req-abc-123"
    assert access[2]["status"] == 404
    # The data path's records about one request carry its id.
    failed = [r for r in records if r.get("request_id") == "req-failed-1"]
    assert failed and failed[0]["logger"] == "llmgw.upstream", records


def test_text_is_the_default_and_access_log_stays_bare(tmp_path: Path) -> None:
    res = run("check-config", str(tmp_path / "nope.yaml"))
    assert res.returncode == 1
    assert res.stderr.startswith("llmgw: error: ")


@pytest.mark.parametrize(
    "args",
    [
        ("--log-format", "json", "check-config", "MISSING"),
        ("check-config", "MISSING", "--log-format", "json"),
        ("config", "check", "MISSING", "--log-format=json"),
        ("serve", "--bogus", "--log-format", "json"),
        ("--log-format", "json", "nosuch"),
        ("ctl", "endpoints", "--admin", "http://127.0.0.1:1", "--log-format", "json"),
        ("ctl", "--json", "drain", "--log-format", "json"),
        ("mirror", "show", "nothing", "--root", "ROOT", "--log-format", "json"),
        ("sim-engine", "--log-format", "json"),
    ],
)
def test_errors_under_json_are_json(tmp_path: Path, args: tuple[str, ...]) -> None:
    args = tuple(a.replace("MISSING", str(tmp_path / "nope.yaml")).replace("ROOT", str(tmp_path / "m")) for a in args)
    res = run(*args, cwd=tmp_path)
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert res.stdout == ""
    records = json_lines(res.stderr)
    assert len(records) == 1, res.stderr
    assert records[0]["level"] == "error" and records[0]["logger"] == "llmgw.cli"
    assert not records[0]["message"].startswith("llmgw:")


def test_env_vars_choose_format_and_level(tmp_path: Path) -> None:
    res = run("check-config", str(tmp_path / "nope.yaml"), env={"LLMGW_LOG_FORMAT": "json"})
    assert res.returncode == 1
    assert json_lines(res.stderr)[0]["level"] == "error"
    # An explicit option beats the environment.
    res = run("check-config", str(tmp_path / "nope.yaml"), "--log-format", "text", env={"LLMGW_LOG_FORMAT": "json"})
    assert res.stderr.startswith("llmgw: error: ")


def test_warnings_asyncio_and_uncaught_exceptions_are_json() -> None:
    """What the CLI's setup installs: warnings, asyncio/uvloop's logger, threads and the top level."""
    code = """
import asyncio, logging, threading, warnings
import uvloop
from llmgw.log import setup
setup("info", "json")
warnings.warn("a warning")
async def boom():
    raise RuntimeError("task died")
async def main():
    t = asyncio.get_running_loop().create_task(boom())
    await asyncio.sleep(0)
    asyncio.get_running_loop().call_exception_handler({"message": "loop trouble"})
    del t
uvloop.run(main())
import gc; gc.collect()
th = threading.Thread(target=lambda: 1 / 0); th.start(); th.join()
logging.getLogger("llmgw.upstream").warning("with an id", extra={"request_id": b"rid-1"})
raise SystemError("top level")
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1
    records = json_lines(res.stderr)
    by_logger = {r["logger"] for r in records}
    assert {"py.warnings", "asyncio", "llmgw", "llmgw.upstream"} <= by_logger, records
    assert any("top level" in r["message"] and "Traceback" in r["exc"] for r in records)
    assert any("thread" in r["message"] and "ZeroDivisionError" in r["exc"] for r in records)
    assert any(r.get("request_id") == "rid-1" for r in records)


def test_log_config_file(tmp_path: Path) -> None:
    log_file = tmp_path / "llmgw.log"
    cfg = tmp_path / "logging.yaml"
    cfg.write_text(
        "version: 1\n"
        "incremental: false\n"
        "formatters:\n  j: {'()': llmgw.log.JsonFormatter}\n"
        f"handlers:\n  f: {{class: logging.FileHandler, filename: '{log_file}', formatter: j}}\n"
        "loggers:\n  llmgw.cli: {handlers: [f], level: INFO, propagate: false}\n"
    )
    res = run("check-config", str(tmp_path / "nope.yaml"), "--log-config", str(cfg), "--log-format", "json")
    assert res.returncode == 1
    assert res.stderr == ""
    (rec,) = json_lines(log_file.read_text())
    assert rec["logger"] == "llmgw.cli" and rec["level"] == "error" and "nope.yaml" in rec["message"]


@pytest.mark.parametrize(
    ("name", "text", "needle"),
    [
        ("bad.json", "{", "not valid YAML/JSON"),
        ("bad.yaml", "version: 1\nhandlers: {x: {class: nope.Nope}}\n", "dictConfig refused it"),
        ("list.yaml", "- 1\n", "expected a logging.config.dictConfig mapping"),
        ("missing.yaml", None, "No such file"),
    ],
)
def test_bad_log_config_is_one_line(tmp_path: Path, name: str, text: str | None, needle: str) -> None:
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    for args in (("--log-config", str(path), "config", "schema"), ("config", "schema", "--log-config", str(path))):
        res = run(*args)
        assert res.returncode == 1
        assert res.stdout == ""
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"llmgw: error: --log-config {path}: "), res.stderr
        assert needle in lines[0]
        assert any(fix in lines[0] for fix in ("fix the file", "pass a readable", "expected a")), lines[0]


def test_log_config_does_not_silence_llmgw(tmp_path: Path) -> None:
    """dictConfig would disable every logger the file does not name; llmgw defaults that off."""
    cfg = tmp_path / "logging.json"
    cfg.write_text(json.dumps({"version": 1, "root": {"level": "WARNING"}}))
    res = run("check-config", str(tmp_path / "nope.yaml"), "--log-config", str(cfg), "--log-format", "json")
    assert res.returncode == 1
    (rec,) = json_lines(res.stderr)
    assert rec["logger"] == "llmgw.cli" and "nope.yaml" in rec["message"]


def test_a_log_config_cannot_open_hpack_or_h2_at_debug(tmp_path: Path) -> None:
    """SECURITY: hpack logs every header it decodes at DEBUG, an agent's join token among them: a
    ``--log-config`` naming hpack (or one of its modules) at DEBUG, with the root at DEBUG, still logs
    none of it, while other loggers do log at DEBUG."""
    from canary import secret

    token = secret("join-token-hpack-77")
    out = tmp_path / "all.log"
    cfg = tmp_path / "log.yaml"
    cfg.write_text(
        "version: 1\n"
        f"handlers:\n  file: {{class: logging.FileHandler, filename: '{out}', level: DEBUG}}\n"
        "root: {level: DEBUG, handlers: [file]}\n"
        "loggers:\n  hpack: {level: DEBUG}\n  hpack.hpack: {level: DEBUG}\n  h2: {level: DEBUG}\n"
    )
    code = (
        "import logging, sys, hpack, h2.connection, h2.config\n"
        "from llmgw import log\n"
        "log.setup('debug', config=sys.argv[1])\n"
        "tok = sys.argv[2].encode()\n"
        "block = hpack.Encoder().encode([(b':path', b'/x'), (b'authorization', b'Bearer ' + tok)], huffman=False)\n"
        "hpack.Decoder().decode(block)\n"
        "c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))\n"
        "c.initiate_connection()\n"
        "logging.getLogger('llmgw.test').debug('the other loggers still log at DEBUG')\n"
    )
    res = subprocess.run([sys.executable, "-c", code, str(cfg), token], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    text = out.read_text()
    assert "the other loggers still log at DEBUG" in text
    assert token not in text and token not in res.stderr
    assert "hpack" not in text and "Decoded" not in text
