"""``llmgw serve`` as README's first command runs it: the demo fleet, answered for real."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from ports import free_port as _free_port


def _start(*args: str, cwd: Path) -> tuple[subprocess.Popen[str], list[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmgw", "serve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: list[str] = []
    assert proc.stdout is not None
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if line.startswith("  curl "):
            return proc, lines
    proc.kill()
    out, err = proc.communicate(timeout=10)
    raise AssertionError(f"serve did not start: {lines} {out} {err}")


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[tuple[str, str, list[str]]]:
    port, admin = _free_port(), _free_port()
    proc, lines = _start("--listen", f"127.0.0.1:{port}", "--admin", f"127.0.0.1:{admin}", cwd=tmp_path)
    try:
        yield f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}", lines
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
        assert proc.returncode == 0, err


def test_demo_fleet_prints_where_and_how(demo: tuple[str, str, list[str]]) -> None:
    base, admin, lines = demo
    text = "\n".join(lines)
    assert f"gateway on {base}" in text
    assert f"admin {admin}" in text
    assert "llama-3.1-8b" in text and "qwen2.5-0.5b" in text
    assert "2 simulated vllm replicas" in text and "2 simulated llamacpp replicas" in text
    assert f"curl -s {base}/v1/chat/completions" in lines[-1]


def test_demo_fleet_serves_the_openai_client(demo: tuple[str, str, list[str]]) -> None:
    base, _, _ = demo
    with openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=20) as client:
        models = {m.id for m in client.models.list()}
        assert {"llama-3.1-8b", "qwen2.5-0.5b", "llama3", "qwen"} <= models
        chat = client.chat.completions.create(
            model="llama-3.1-8b", messages=[{"role": "user", "content": "Hello"}], max_tokens=5
        )
        assert chat.choices[0].message.content
        assert chat.usage is not None and chat.usage.completion_tokens == 5
        stream = client.chat.completions.create(
            model="qwen",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces, usage = [], None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        assert len(pieces) == 4
        assert usage is not None and usage.completion_tokens == 4
        comp = client.completions.create(model="llama3", prompt="Once", max_tokens=3)
        assert comp.choices[0].text
        emb = client.embeddings.create(model="llama-3.1-8b", input=["a", "b"])
        assert len(emb.data) == 2 and len(emb.data[0].embedding) > 0
        with pytest.raises(openai.NotFoundError) as ei:
            client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
        assert ei.value.code == "model_not_found"


def test_port_in_use_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        res = subprocess.run(
            [sys.executable, "-m", "llmgw", "serve", "--listen", f"127.0.0.1:{busy}", "--admin", "127.0.0.1:0"],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=tmp_path,
        )
    assert res.returncode == 1
    assert res.stderr.strip().splitlines()[-1] == (
        f"llmgw: error: 127.0.0.1:{busy} is already in use (choose another address with --listen / --admin)"
    )
    assert "Traceback" not in res.stderr


def test_the_same_address_for_clients_and_admin_is_one_line(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "llmgw", "serve", "--listen", "127.0.0.1:18080", "--admin", "127.0.0.1:18080"],
        capture_output=True, text=True, timeout=30, cwd=tmp_path,
    )
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert res.stderr.strip() == (
        "llmgw: error: the client and admin listeners are both 127.0.0.1:18080: give them different ports "
        "(--listen / --admin, or listen: / admin: in the config)"
    )


def test_sigint_stops_cleanly(tmp_path: Path) -> None:
    proc, _ = _start("--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", cwd=tmp_path)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=15)
    assert proc.returncode == 0, err
    assert "shutting down" in err


def _serve_config(tmp_path: Path, control: str) -> Path:
    cfg = tmp_path / "llmgw.yaml"
    cfg.write_text(
        "listen: 127.0.0.1:0\nadmin: 127.0.0.1:0\n"
        "endpoints:\n  - {id: e0, url: 'http://127.0.0.1:9', model: m, engine: vllm}\n"
        f"control:\n  listen: 127.0.0.1:0\n  join_token_env: QA_JOIN\n{control}"
    )
    return cfg


def _serve_fails(tmp_path: Path, cfg: Path, **env: str) -> str:
    res = subprocess.run(
        [sys.executable, "-m", "llmgw", "serve", "-c", str(cfg)], capture_output=True, text=True, timeout=60,
        cwd=tmp_path, env={**os.environ, "QA_JOIN": "join-token-for-the-test", **env},
    )
    assert res.returncode == 1, res
    assert "Traceback" not in res.stderr, res.stderr
    assert "gateway listening" not in res.stderr + res.stdout  # (it did not start: nothing says it did)
    return res.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("wait", ["0s", "1500ms"])
def test_a_database_that_cannot_be_reached_is_one_line_naming_the_fix(tmp_path: Path, wait: str) -> None:
    closed = _free_port()
    cfg = _serve_config(tmp_path, f"  database_env: QA_DB\n  database_wait: {wait}\n")
    t0 = time.monotonic()
    last = _serve_fails(tmp_path, cfg, QA_DB=f"postgresql://llmgw:pw-Secret-77@127.0.0.1:{closed}/llmgw")
    took = time.monotonic() - t0
    assert last.startswith(f"llmgw: error: control.database: postgresql://llmgw:***@127.0.0.1:{closed}"
                           "/llmgw: ConnectionRefusedError"), last
    fix = "(is PostgreSQL running and listening at that host and port?)"
    if wait == "0s":
        assert last.endswith(fix), last
    else:  # tried again for database_wait, then the same line, saying so
        assert last.endswith(f"{fix}; gave up after 1.5s (control.database_wait)"), last
        assert took >= 1.0, took
    assert "--listen" not in last and "Secret-77" not in last


@pytest.mark.parametrize("url", [
    "postgresql//llmgw:pw-Secret-77@127.0.0.1:5432/llmgw",  # (the colon forgotten)
    "postgresql:/llmgw:pw-Secret-77@127.0.0.1:5432/llmgw",
    "postgresql://llmgw:pw@Secret-77@127.0.0.1:5432/llmgw",  # (an "@" in the password, not encoded)
    "postgresql://llmgw:pw-Secret-77@127.0.0.1:notaport/llmgw",
])
def test_a_mistyped_database_url_is_refused_by_check_config_without_its_password(tmp_path: Path, url: str) -> None:
    cfg = _serve_config(tmp_path, "  database_env: QA_DB\n")
    env = {**os.environ, "QA_JOIN": "join-token-for-the-test", "QA_DB": url}
    res = subprocess.run([sys.executable, "-m", "llmgw", "check-config", str(cfg)], capture_output=True, text=True,
                         timeout=30, cwd=tmp_path, env=env)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res
    assert "control.database_env" in res.stderr and "***" in res.stderr, res.stderr
    assert "Secret-77" not in res.stderr + res.stdout
    assert "Secret-77" not in _serve_fails(tmp_path, cfg, QA_DB=url)


def test_with_the_access_log_on_stdout_is_json_lines_alone(tmp_path: Path) -> None:
    """A log shipper reads stdout as JSON lines: the start-up banner goes to stderr then."""
    import json
    import time
    import urllib.request

    port, admin = _free_port(), _free_port()
    cfg = tmp_path / "llmgw.yaml"
    cfg.write_text(f"listen: 127.0.0.1:{port}\nadmin: 127.0.0.1:{admin}\naccess_log: true\n"
                   "endpoints:\n  - {id: a, url: 'http://127.0.0.1:9', model: m, engine: vllm}\n")
    proc = subprocess.Popen([sys.executable, "-m", "llmgw", "serve", "-c", str(cfg)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "serve did not start"
                time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=15)
    assert f"gateway on http://127.0.0.1:{port}" in err
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines and all(json.loads(line)["path"] for line in lines), out
