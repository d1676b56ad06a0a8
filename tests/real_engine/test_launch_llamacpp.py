"""The replica supervisor running the real llama.cpp ``llama-server``.

Start -> ready -> a request with the key answers, one without gets 401 -> stop;
the same spec again changes nothing; a changed spec replaces the engine; an
engine killed with SIGKILL is restarted; a model that cannot load fails the
replica after repeated crashes, with the engine's last lines; an agent killed
with SIGKILL leaves its engine to the next agent, which adopts it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import orjson
import pytest

from canary import secret
from launch.helpers import Watched, gone, http, wait_gone
from llmgw.config.agent import AgentEngineConfig
from llmgw.launch.spec import DRAINING, FAILED, READY, STOPPED, ReplicaSpec

pytestmark = pytest.mark.real_engine

KEY = secret("replica")


def spec_for(model: Path, **kw: object) -> ReplicaSpec:
    fields: dict[str, object] = dict(id="chat-1", deployment="chat", engine="llamacpp", model=str(model),
                                     served_name="tiny", slots=1, context=1024, args=("-t", "1"), api_key=KEY)
    fields.update(kw)
    return ReplicaSpec(**fields)  # type: ignore[arg-type]


def engines(binary: Path) -> dict[str, AgentEngineConfig]:
    return {"llamacpp": AgentEngineConfig(binary=str(binary))}


CHAT = orjson.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})


async def test_start_ready_auth_restart_and_stop(llama_server_bin: Path, tiny_model: Path, tmp_path: Path) -> None:
    w = Watched(tmp_path / "state", engines=engines(llama_server_bin))
    spec = spec_for(tiny_model)
    try:
        await w.sup.apply([spec])
        st = await w.wait_state("chat-1", READY)
        assert st.port and st.pid and st.log_path
        assert (tmp_path / "state" / "replicas" / "chat-1.json").is_file()
        assert KEY not in (tmp_path / "state" / "replicas" / "chat-1.json").read_text()
        # the key works; without it: 401 (and /metrics is behind the key)
        status, body = await http(st.port, "POST", "/v1/chat/completions", key=KEY, body=CHAT)
        assert status == 200, body
        assert orjson.loads(body)["model"] == "tiny"
        assert (await http(st.port, "POST", "/v1/chat/completions", body=CHAT))[0] == 401
        assert (await http(st.port, "GET", "/metrics"))[0] == 401
        status, body = await http(st.port, "GET", "/metrics", key=KEY)
        assert status == 200 and b"llamacpp:requests_processing" in body
        # the engine's own output is in its log file, not in the agent's pipes
        assert "llama" in w.sup.log_tail("chat-1", 200).lower()
        assert KEY not in w.sup.log_tail("chat-1", 10_000)

        # the same spec again: nothing restarts
        await w.sup.apply([spec])
        assert w.status("chat-1") == st

        # killed: restarted, ready again with a new process
        os.kill(st.pid, signal.SIGKILL)
        again = await w.wait(
            "chat-1", lambda s: s.state == READY and s.restarts == 1 and s.pid != st.pid, timeout=60)
        assert again.exit_code == -signal.SIGKILL
        assert "exited with status -9" in again.message or again.message == "ready"
        assert (await http(again.port or 0, "POST", "/v1/chat/completions", key=KEY, body=CHAT))[0] == 200

        # a changed spec replaces it (a new process, answering to the new name)
        changed = dataclasses.replace(spec, served_name="tiny2")
        await w.sup.apply([changed])
        new = await w.wait("chat-1", lambda s: s.state == READY and s.pid != again.pid, timeout=60)
        await wait_gone(again.pid or 0)
        status, body = await http(new.port or 0, "GET", "/v1/models", key=KEY)
        assert status == 200 and b"tiny2" in body

        # not asked for any more: drained and stopped, its record gone
        seen: list[str] = []
        w.on_change_too = lambda: seen.extend(x.state for x in w.sup.statuses())
        await w.sup.apply([])
        await w.wait_state("chat-1", STOPPED)
        assert DRAINING in seen
        assert gone(new.pid or 0)
        assert not (tmp_path / "state" / "replicas" / "chat-1.json").exists()
    finally:
        await w.sup.close()


async def test_a_model_that_cannot_load_fails_after_repeated_crashes(
    llama_server_bin: Path, tmp_path: Path
) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    w = Watched(tmp_path / "state", engines=engines(llama_server_bin), max_crashes=3, backoff=0.01)
    try:
        await w.sup.apply([spec_for(bad)])
        st = await w.wait_state("chat-1", FAILED, timeout=60)
        assert st.restarts == 2
        assert st.exit_code not in (None, 0)
        assert "crashed 3 times" in st.message
        # the engine's own last lines explain it
        assert "model" in st.message.split("its log ends:", 1)[1].lower()
        # an equal spec leaves it failed; none asked: it goes
        await w.sup.apply([spec_for(bad)])
        assert w.status("chat-1").state == FAILED  # type: ignore[union-attr]
        await w.sup.apply([])
        assert w.status("chat-1").state == STOPPED  # type: ignore[union-attr]
    finally:
        await w.sup.close()


AGENT = textwrap.dedent(
    """
    import asyncio, sys
    from llmgw.config.agent import AgentEngineConfig
    from llmgw.launch.spec import ReplicaSpec
    from llmgw.launch.supervisor import ReplicaSupervisor

    async def main():
        state, binary, model, key = sys.argv[1:5]
        ready = asyncio.Event()
        sup = None
        def changed():
            if any(s.state == "ready" for s in sup.statuses()):
                ready.set()
        sup = ReplicaSupervisor(state, engines={"llamacpp": AgentEngineConfig(binary=binary)}, on_change=changed)
        await sup.adopt()
        await sup.apply([ReplicaSpec(id="chat-1", deployment="chat", engine="llamacpp", model=model,
                                     served_name="tiny", slots=1, context=1024, args=("-t", "1"), api_key=key)])
        await asyncio.wait_for(ready.wait(), 60)
        print("ready", sup.statuses()[0].pid, flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())
    """
)


async def test_an_agent_killed_with_sigkill_leaves_no_orphan(
    llama_server_bin: Path, tiny_model: Path, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT, str(state), str(llama_server_bin), str(tiny_model), KEY],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )
    try:
        assert agent.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(agent.stdout.readline), 90)
        assert line.startswith(b"ready "), line
        pid = int(line.split()[1])
    finally:
        agent.kill()
        agent.wait()
        if agent.stdout is not None:
            agent.stdout.close()
    assert not gone(pid)  # the engine outlived its agent

    # A stale record too: an engine that died while no agent ran.
    dead = subprocess.Popen(["true"])
    dead.wait()
    (state / "replicas" / "old-1.json").write_text(orjson.dumps(
        {"version": 1, "id": "old-1", "pid": dead.pid, "start_time": 1, "port": 1, "fingerprint": "x"}).decode())

    w = Watched(state, engines=engines(llama_server_bin))
    try:
        await w.sup.adopt()
        st = await w.wait_state("chat-1", READY)
        assert st.pid == pid
        assert w.status("old-1") is None
        assert not (state / "replicas" / "old-1.json").exists()
        # the control plane's set names it with the same spec: kept, not restarted
        await w.sup.apply([spec_for(tiny_model)])
        assert w.status("chat-1").pid == pid  # type: ignore[union-attr]
        assert (await http(st.port or 0, "POST", "/v1/chat/completions", key=KEY, body=CHAT))[0] == 200
    finally:
        await w.sup.close()
    await wait_gone(pid)
    assert w.status("chat-1").state == STOPPED  # type: ignore[union-attr]


# -- llmgw ctl engine-check llamacpp --


def _wrapper(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def test_engine_check_passes_on_the_real_binary(llama_server_bin: Path, tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "llmgw", "ctl", "engine-check", "llamacpp", "--binary",
                          str(llama_server_bin), "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    doc = orjson.loads(out.stdout)
    assert doc["ok"] is True
    got = {c["check"]: c["status"] for c in doc["checks"]}
    assert got == {"found": "pass", "version": "pass", "flags": "pass", "devices": "info", "gpu": got["gpu"],
                   "start": "pass", "ready": "pass", "metrics": "pass", "auth": "pass", "stop": "pass"}


def test_engine_check_names_the_fix_for_a_missing_flag_or_metrics(llama_server_bin: Path, tmp_path: Path) -> None:
    # A build whose --help lacks --metrics (the flag llmgw passes for the router's signals).
    lacking = _wrapper(tmp_path / "llama-old", textwrap.dedent(f"""\
        if [ "$1" = --help ]; then "{llama_server_bin}" --help 2>&1 | grep -v -- '^--metrics'; exit 0; fi
        exec "{llama_server_bin}" "$@"
        """))
    out = subprocess.run([sys.executable, "-m", "llmgw", "ctl", "engine-check", "llamacpp", "--binary",
                          str(lacking)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "FAIL  flags    `llama-server --help` lacks --metrics, which llmgw passes" in out.stdout
    assert "fix: use a newer llama.cpp build" in out.stdout
    assert "skipped: a static check failed" in out.stdout
    # One that takes --metrics but serves no /metrics (drops the flag).
    deaf = _wrapper(tmp_path / "llama-deaf", textwrap.dedent(f"""\
        for a; do shift; [ "$a" = --metrics ] || set -- "$@" "$a"; done
        exec "{llama_server_bin}" "$@"
        """))
    out = subprocess.run([sys.executable, "-m", "llmgw", "ctl", "engine-check", "llamacpp", "--binary",
                          str(deaf)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stdout
    line = next(ln for ln in out.stdout.splitlines() if "metrics" in ln and ln.startswith("FAIL"))
    assert "/metrics answered 501" in line, out.stdout
    assert "fix: start llama-server with --metrics" in out.stdout
    assert "PASS  stop" in out.stdout
