"""A model file whose path has spaces in it, deployed as an operator does: ``llmgw serve`` with a control
plane, ``llmgw agent`` and ``llmgw ctl deploy`` as processes, the real ``llama-server``, a chat through the
gateway. (Before, the config's model rule refused any whitespace: such a file could not be deployed at all.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cp_helpers import free_port

from llmgw.testing.gguf_model import write_tiny_llama
from llmgw.testing.llamacpp import EngineUnavailableError, find_llama_server

pytestmark = [pytest.mark.real_engine, pytest.mark.slow]

JOIN = "join-paths-test-1234567"
LLMGW = [sys.executable, "-m", "llmgw"]


@pytest.fixture(scope="module")
def llama_bin() -> Path:
    try:
        return find_llama_server(build=False)
    except EngineUnavailableError as exc:
        pytest.fail(f"this test needs llama.cpp's llama-server: {exc}", pytrace=False)


def _get(url: str, timeout: float = 5.0) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def _post(url: str, body: dict[str, Any], timeout: float = 20.0) -> tuple[int, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def _until(cond: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.2)


@pytest.fixture
def cluster(tmp_path: Path, llama_bin: Path) -> Iterator[dict[str, Any]]:
    listen, admin, control = free_port(), free_port(), free_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"listen: 127.0.0.1:{listen}\nadmin: 127.0.0.1:{admin}\n"
                   f"control:\n  listen: 127.0.0.1:{control}\n  join_token_env: QA_JOIN\n"
                   f"  heartbeat_interval: 200ms\n  heartbeat_grace: 1s\n"
                   f"  database: sqlite:///{tmp_path}/cp.sqlite3\n")
    agent_cfg = tmp_path / "agent.yaml"
    agent_cfg.write_text(f"engines:\n  llamacpp: {{binary: {json.dumps(str(llama_bin))}}}\n")
    env = {**os.environ, "QA_JOIN": JOIN, "LLMGW_MIRROR": str(tmp_path / "mirror")}
    procs: list[subprocess.Popen[bytes]] = []
    logs = [open(tmp_path / "serve.log", "wb"), open(tmp_path / "agent.log", "wb")]  # noqa: SIM115
    try:
        procs.append(subprocess.Popen([*LLMGW, "serve", "-c", str(cfg)], env=env, stdout=logs[0], stderr=logs[0]))
        base = f"http://127.0.0.1:{admin}"
        _until(lambda: _try(lambda: _get(f"{base}/admin/v1/nodes")[0] == 200), 30, "the control plane")
        procs.append(subprocess.Popen(
            [*LLMGW, "agent", "--control", f"127.0.0.1:{control}", "--token-env", "QA_JOIN", "--name", "node-1",
             "--gpu-source", "none", "-c", str(agent_cfg), "--state-dir", str(tmp_path / "agent"),
             "--drain-timeout", "0"], env=env, stdout=logs[1], stderr=logs[1]))
        _until(lambda: _get(f"{base}/admin/v1/nodes")[1].get("nodes"), 30, "the agent to register")
        yield {"admin": base, "gateway": f"http://127.0.0.1:{listen}", "env": env, "tmp": tmp_path}
    finally:
        for p in reversed(procs):  # the agent first: SIGTERM stops its engines
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
        for f in logs:
            f.close()


def _try(fn: Any) -> Any:
    try:
        return fn()
    except OSError:
        return False


def _ctl(c: dict[str, Any], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*LLMGW, "ctl", "--admin", c["admin"], *args], env=c["env"], capture_output=True,
                          text=True, timeout=30)


def test_a_model_file_whose_path_has_spaces_is_deployed_and_serves(cluster: dict[str, Any]) -> None:
    model = cluster["tmp"] / "my models" / "Tiny Llama (Q8_0).gguf"
    model.parent.mkdir()
    write_tiny_llama(model, ctx=512)
    res = _ctl(cluster, "deploy", "tiny", "--model", str(model), "--engine", "llamacpp", "--context", "512",
               "--arg=-t", "--arg", "1")
    assert res.returncode == 0, res.stderr

    def ready() -> bool:
        status, body = _get(f"{cluster['admin']}/admin/v1/deployments/tiny")
        return status == 200 and body["ready"] == 1

    _until(ready, 60, "the replica to be ready")
    status, body = _post(f"{cluster['gateway']}/v1/chat/completions",
                         {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200, body
    assert body["model"] == "tiny"
    # what a path may not hold: a line break (it would forge log lines), whitespace at either end (a stray paste)
    for bad in (f"{model}\n", f" {model}", "/models/a\tb.gguf"):
        res = _ctl(cluster, "deploy", "bad", "--model", bad, "--engine", "llamacpp")
        assert res.returncode == 1 and "invalid model" in res.stderr, res
