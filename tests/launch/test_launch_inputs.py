"""What an operator hands a deployment, launched as given: model paths (spaces, ``~``, ``./``), args that
would take llmgw's own flags, and an engine whose exit is seen as it happened (its status, not a guess).

The paths are run by the real ``llama-server`` (it must load the file the operator named).
"""

from __future__ import annotations

import asyncio
import os
import sys
import textwrap
from pathlib import Path

import orjson
import pytest

from canary import secret
from launch.helpers import Watched, http
from llmgw.config.agent import AgentEngineConfig
from llmgw.launch.spec import FAILED, READY, ReplicaSpec
from llmgw.testing.gguf_model import write_tiny_llama
from llmgw.testing.llamacpp import EngineUnavailableError, find_llama_server

KEY = secret("replica")
CHAT = orjson.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})


def spec_for(model: str, **kw: object) -> ReplicaSpec:
    fields: dict[str, object] = dict(id="chat-1", deployment="chat", engine="llamacpp", model=model,
                                     served_name="tiny", slots=1, context=512, args=("-t", "1"), api_key=KEY)
    fields.update(kw)
    return ReplicaSpec(**fields)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def llama_bin() -> Path:
    try:
        return find_llama_server(build=False)
    except EngineUnavailableError as exc:
        pytest.fail(f"these tests need llama.cpp's llama-server: {exc}", pytrace=False)


def _tiny(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_tiny_llama(path, ctx=512)


async def _serves(w: Watched, rid: str = "chat-1") -> None:
    st = await w.wait_state(rid, READY, timeout=60)
    assert st.port is not None
    status, body = await http(st.port, "POST", "/v1/chat/completions", key=KEY, body=CHAT)
    assert status == 200, body


@pytest.mark.real_engine
async def test_a_model_path_with_spaces_and_brackets_is_loaded(llama_bin: Path, tmp_path: Path) -> None:
    model = _tiny(tmp_path / "my models" / "tiny (Q8, v2) it's.gguf")
    w = Watched(tmp_path / "state", engines={"llamacpp": AgentEngineConfig(binary=str(llama_bin))})
    try:
        await w.sup.apply([spec_for(str(model))])
        await _serves(w)
        # the log's command line reads back as the argv it ran (the path one argument)
        head = next(line for line in w.sup.log_tail("chat-1").splitlines() if "starting chat-1" in line)
        assert f"-m '{tmp_path}/my models/tiny (Q8, v2) it'\"'\"'s.gguf' --metrics" in head, head
    finally:
        await w.sup.close()


@pytest.mark.real_engine
async def test_a_model_path_under_home_or_relative_is_the_agents(
    llama_bin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    _tiny(home / "models" / "tiny.gguf")
    _tiny(cwd / "tiny.gguf")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    w = Watched(tmp_path / "state", engines={"llamacpp": AgentEngineConfig(binary=str(llama_bin))})
    try:
        # (the engine runs in its replica's work directory: "./tiny.gguf" there is nothing)
        await w.sup.apply([spec_for("~/models/tiny.gguf"), spec_for("./tiny.gguf", id="chat-2")])
        await _serves(w, "chat-1")
        await _serves(w, "chat-2")
        assert f"-m {home}/models/tiny.gguf " in w.sup.log_tail("chat-1")
        assert f"-m {cwd}/tiny.gguf " in w.sup.log_tail("chat-2")
    finally:
        await w.sup.close()


@pytest.mark.parametrize("engine", ["llamacpp", "vllm", "sglang"])
@pytest.mark.parametrize("args", [("--port", "18999"), ("--port=18999",), ("--host", "0.0.0.0"),
                                  ("--api-key", "mine")])
async def test_args_that_take_llmgws_own_flags_fail_the_replica_at_once(
    engine: str, args: tuple[str, ...], tmp_path: Path
) -> None:
    # (before: the engine listened on the args' port while /health was probed on llmgw's, and the replica sat
    # in "starting" for the ready timeout, 30 minutes; with its own key, the router's was refused)
    fake = tmp_path / "engine"
    fake.write_text("#!/bin/sh\nsleep 30\n")
    fake.chmod(0o755)
    w = Watched(tmp_path / "state", ready_timeout=60.0,
                engines={engine: AgentEngineConfig(binary=str(fake), python=str(fake))})
    try:
        await w.sup.apply([spec_for("/m/tiny.gguf", engine=engine, args=args)])
        st = await w.wait_state("chat-1", FAILED, timeout=10)
        flag = args[0].split("=")[0]
        assert f"args set {flag}, which llmgw sets itself" in st.message, st.message
        assert f"remove {flag} from args" in st.message
        assert "18999" not in st.message and "mine" not in st.message
    finally:
        await w.sup.close()


async def test_an_engine_whose_first_thread_exits_first_is_reported_with_its_own_status(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A multithreaded engine's leader thread can end before its other threads (it shows "Z" in /proc while they
    # run on); it cannot be reaped until they have. Seen as gone then, the engine was SIGKILLed and reported
    # "exited with status None" or -9 ("survives SIGKILL"), not with the status it exited with.
    if not sys.platform.startswith("linux"):
        pytest.skip("Linux: raw exit of one thread")
    sys_exit = {"x86_64": 60, "aarch64": 93}.get(os.uname().machine)
    if sys_exit is None:
        pytest.skip("the exit syscall's number on this machine is not known here")
    fake = tmp_path / "engine"
    fake.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import ctypes, os, threading, time
        def later():
            time.sleep(1.0)
            os._exit(3)
        threading.Thread(target=later).start()
        ctypes.CDLL(None).syscall({sys_exit}, 0)  # the leader thread alone exits
        """))
    fake.chmod(0o755)
    # (the polling watch, as on a kernel without pidfd_open; the pidfd one looks once at its start)
    def no_pidfd(pid: int) -> int:
        raise OSError("pidfd_open: not here")

    monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    w = Watched(tmp_path / "state", poll_interval=0.05, backoff=30.0,
                engines={"llamacpp": AgentEngineConfig(binary=str(fake))})
    model = tmp_path / "tiny.gguf"
    model.write_bytes(b"GGUF")
    try:
        await w.sup.apply([spec_for(str(model))])
        st = await w.wait("chat-1", lambda s: s.restarts >= 1 or s.exit_code is not None, timeout=20)
        assert st.exit_code == 3, st
        assert "exited with status 3" in st.message, st.message
    finally:
        await w.sup.close()


async def test_an_engine_left_to_be_reaped_later_is_reaped(tmp_path: Path) -> None:
    # One that survived SIGKILL for a moment (stuck in the kernel) is kept aside "to be reaped later": it was
    # never reaped, and stayed a zombie as long as the agent ran.
    import subprocess

    from llmgw.launch import supervisor

    proc = subprocess.Popen(["/bin/sh", "-c", "exit 0"])
    supervisor._DETACHED.append(proc)
    deadline = asyncio.get_running_loop().time() + 10
    while True:  # (exited, not yet reaped: a zombie)
        with open(f"/proc/{proc.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.02)
    w = Watched(tmp_path / "state")
    try:
        w.sup.statuses()  # (every heartbeat asks)
        assert proc not in supervisor._DETACHED
        assert not os.path.exists(f"/proc/{proc.pid}")
    finally:
        await w.sup.close()
