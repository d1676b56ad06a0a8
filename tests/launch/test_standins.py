"""The vLLM, TensorRT-LLM and SGLang launchers, run by the supervisor against the stand-in engines.

The stand-ins (``llmgw.testing.standins``) accept the documented command lines,
refuse flags the real ones lack, and serve each engine's dialect through the
simulated engine. TensorRT-LLM runs behind llmgw's own launcher file, which must
work with nothing but the standard library.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from canary import secret
from launch.helpers import Watched, gone, http
from llmgw.config.agent import AgentEngineConfig
from llmgw.launch import trtllm
from llmgw.launch.spec import FAILED, READY, STOPPED, LocalModel, ModelBlob, ReplicaSpec

KEY = secret("replica")


def spec(engine: str, model: str = "org/tiny", **kw: object) -> ReplicaSpec:
    fields: dict[str, object] = dict(id=f"{engine}-1", deployment="d", engine=engine, model=model,
                                     served_name="tiny", gpus=("GPU-0000",), gpu_memory_fraction=0.5,
                                     api_key=KEY)
    fields.update(kw)
    return ReplicaSpec(**fields)  # type: ignore[arg-type]


ENGINES = {
    "vllm": AgentEngineConfig(),
    "sglang": AgentEngineConfig(python=sys.executable),
    "trtllm": AgentEngineConfig(python=sys.executable),
}
METRIC = {"vllm": b"vllm:num_requests_waiting", "sglang": b"sglang:num_queue_reqs",
          "trtllm": b"num_requests_waiting"}
CHAT = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'


@pytest.mark.parametrize("engine", ["vllm", "sglang", "trtllm"])
@pytest.mark.usefixtures("standin_env")
async def test_launched_ready_and_guarded(engine: str, tmp_path: Path) -> None:
    w = Watched(tmp_path / "state", engines=ENGINES)
    s = spec(engine, model=str(tmp_path / "tiny") if engine == "trtllm" else "org/tiny", env={"LLMGW_T": "1"})
    try:
        await w.sup.apply([s])
        st = await w.wait_state(s.id, READY)
        assert st.port is not None
        # its GPUs and the deployment's env reach the engine's environment
        environ = Path(f"/proc/{st.pid}/environ").read_bytes().split(b"\0")
        assert b"CUDA_VISIBLE_DEVICES=GPU-0000" in environ and b"LLMGW_T=1" in environ
        assert KEY not in st.message and KEY not in w.sup.log_tail(s.id, 1000)
        if engine == "sglang":  # it prints its settings, key included: the file has it, the tail does not
            assert st.log_path is not None and KEY in Path(st.log_path).read_text()
            assert "api_key='***'" in w.sup.log_tail(s.id, 1000)
        assert (await http(st.port, "GET", "/health"))[0] == 200
        status, body = await http(st.port, "POST", "/v1/chat/completions", key=KEY, body=CHAT)
        assert status == 200, body
        assert (await http(st.port, "POST", "/v1/chat/completions", body=CHAT))[0] == 401
        assert (await http(st.port, "POST", "/v1/chat/completions", key="wrong", body=CHAT))[0] == 401
        path = trtllm.INFO.metrics_path if engine == "trtllm" else "/metrics"
        status, body = await http(st.port, "GET", path, key=KEY)
        assert status == 200 and METRIC[engine] in body, body[:300]
        if engine == "trtllm":
            # the guard demands the key for the metrics too; the engine behind it is on loopback only
            assert (await http(st.port, "GET", path))[0] == 401
            assert "--config" in w.sup.log_tail(s.id, 50)
        pid = st.pid
        await w.sup.apply([])
        await w.wait(s.id, lambda x: x.state == "stopped")
        assert pid is not None and gone(pid)
    finally:
        await w.sup.close()


@pytest.mark.parametrize("engine", ["vllm", "sglang", "trtllm"])
@pytest.mark.usefixtures("standin_env")
async def test_a_flag_the_engine_lacks_fails_the_replica(engine: str, tmp_path: Path) -> None:
    w = Watched(tmp_path / "state", engines=ENGINES, max_crashes=2, backoff=0.01, log_max_bytes=200, log_backups=1)
    s = spec(engine, model=str(tmp_path / "tiny"), args=("--no-such-flag",))
    try:
        await w.sup.apply([s])
        st = await w.wait_state(s.id, FAILED)
        assert st.exit_code == 2, st
        assert "unrecognized arguments: --no-such-flag" in st.message, st
        # the log passed its size at the restart: rotated, one old file kept
        assert st.log_path is not None
        assert Path(st.log_path + ".1").is_file() and not Path(st.log_path + ".2").exists()
        assert "unrecognized arguments" in Path(st.log_path + ".1").read_text()
    finally:
        await w.sup.close()


def test_the_standins_refuse_unknown_flags_and_show_their_help(standin_env: dict[str, str]) -> None:
    vllm = shutil.which("vllm")
    assert vllm is not None and vllm.startswith(standin_env["bin"])
    out = subprocess.run([vllm, "serve", "--help=all"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--served-model-name" in out.stdout
    bad = subprocess.run([vllm, "serve", "m", "--api-keys", "x"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unrecognized arguments" in bad.stderr
    # trtllm-serve has no API-key flag at all
    bad = subprocess.run(["trtllm-serve", "m", "--api-key", "x"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    env = dict(os.environ, LLMGW_STANDIN_LACKS="--enable-metrics")
    out = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--help"], capture_output=True,
                         text=True, timeout=60, env=env)
    assert out.returncode == 0 and "--api-key" in out.stdout and "--enable-metrics" not in out.stdout


def test_the_trtllm_launcher_is_one_self_contained_file(tmp_path: Path) -> None:
    """It runs with ``python -I -S`` from a copy alone in a directory: the standard library only."""
    alone = tmp_path / "alone" / "guard.py"
    alone.parent.mkdir()
    shutil.copyfile(trtllm.GUARD, alone)
    env = {"PATH": os.environ.get("PATH", "")}
    cmd = [sys.executable, "-I", "-S", str(alone), "--port", "1", "--work-dir", str(tmp_path / "w"), "--", "x"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert out.returncode == 2 and "refusing to start: no API key" in out.stderr
    out = subprocess.run([sys.executable, "-I", "-S", str(alone), "--help"], capture_output=True, text=True,
                         timeout=60, env=env, cwd=tmp_path)
    assert out.returncode == 0 and "trtllm-serve" in out.stdout
    source = trtllm.GUARD.read_text()
    assert "llmgw." not in source.replace("llmgw's", "") and "import llmgw" not in source


@pytest.mark.usefixtures("standin_env")
async def test_loading_then_a_readiness_timeout_fails_and_kills(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLMGW_STANDIN_STARTUP_DELAY", "60")
    w = Watched(tmp_path / "state", engines=ENGINES, ready_timeout=1.5)
    s = spec("vllm")
    try:
        await w.sup.apply([s])
        st = await w.wait(s.id, lambda x: x.state == "starting" and x.pid is not None)
        # it listens and answers 503 while loading: still starting, not ready
        assert st.port is not None
        st = await w.wait_state(s.id, FAILED, timeout=30)
        assert "not ready within 1.5s" in st.message
        assert st.restarts == 0
        assert st.pid is not None and gone(st.pid)
    finally:
        await w.sup.close()


@pytest.mark.usefixtures("standin_env")
async def test_the_specs_ready_timeout_wins_and_a_new_one_restarts_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the deployment's ready_timeout (on the spec) rather than the agent's
    monkeypatch.setenv("LLMGW_STANDIN_STARTUP_DELAY", "60")
    w = Watched(tmp_path / "state", engines=ENGINES, ready_timeout=600.0)
    s = spec("vllm", ready_timeout=1.5)
    try:
        await w.sup.apply([s])
        st = await w.wait_state(s.id, FAILED, timeout=30)
        assert "not ready within 1.5s" in st.message
        assert st.pid is not None and gone(st.pid)
    finally:
        await w.sup.close()
    # a longer one sent while the engine loads: the same engine is waited for, not replaced
    monkeypatch.setenv("LLMGW_STANDIN_STARTUP_DELAY", "4")
    w = Watched(tmp_path / "state2", engines=ENGINES, ready_timeout=600.0)
    s = spec("vllm", ready_timeout=2.0)
    try:
        await w.sup.apply([s])
        st = await w.wait(s.id, lambda x: x.state == "starting" and x.pid is not None)
        pid = st.pid
        await w.sup.apply([spec("vllm", ready_timeout=60.0)])
        st = await w.wait_state(s.id, READY, timeout=30)
        assert st.pid == pid and st.restarts == 0
    finally:
        await w.sup.close()


class DirFetcher:
    """A ModelFetcher over a local directory of ``sha256-<hex>`` files (the mirror client's stand-in)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.calls = 0

    async def ensure(self, spec: ReplicaSpec, progress: Callable[[int, int], None]) -> LocalModel:
        self.calls += 1
        total = sum(b.size for b in spec.blobs)
        done = 0
        paths = {}
        for b in spec.blobs:
            done += b.size
            progress(done, total)
            paths[b.role] = str(self.root / b.digest.replace(":", "-"))
        return LocalModel(path=paths["model"], projector=paths.get("projector"))


@pytest.mark.usefixtures("standin_env")
async def test_a_mirror_model_is_fetched_first(tmp_path: Path) -> None:
    fetcher = DirFetcher(tmp_path / "blobs")
    w = Watched(tmp_path / "state", engines=ENGINES, fetcher=fetcher)
    seen: list[str] = []
    w.on_change_too = lambda: seen.extend(x.state for x in w.sup.statuses())
    s = spec("vllm", model="tiny:1b", blobs=(ModelBlob("sha256:" + "a" * 64, 10),))
    try:
        await w.sup.apply([s])
        await w.wait_state(s.id, READY)
        assert seen[0] == "fetching" and fetcher.calls == 1
        assert str(tmp_path / "blobs" / ("sha256-" + "a" * 64)) in w.sup.log_tail(s.id, 20)
    finally:
        await w.sup.close()


@pytest.mark.usefixtures("standin_env")
async def test_asked_again_while_stopping_it_comes_back(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="llmgw.agent.launch")  # (its own level: an agent's CLI sets it)
    w = Watched(tmp_path / "state", engines=ENGINES)
    s = spec("vllm")
    try:
        await w.sup.apply([s])
        first = await w.wait_state(s.id, READY)
        await w.sup.apply([])
        await w.sup.apply([s])
        again = await w.wait(s.id, lambda x: x.state == READY and x.pid != first.pid)
        assert first.pid is not None and gone(first.pid) and again.restarts == 0
        # the agent's log says it ended the engine, and when it was gone
        said = caplog.text
        assert f"replica {s.id}: stopping its engine (pid {first.pid})" in said
        assert f"replica {s.id}: its engine (pid {first.pid}) stopped in " in said
    finally:
        await w.sup.close()


def _two_free_ports() -> int:
    """``lo`` such that ``lo`` and ``lo + 1`` are both free on 127.0.0.1 now."""
    import socket

    from ports import free_port

    for _ in range(50):
        lo = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", lo + 1))
            except OSError:
                continue
        return lo
    raise AssertionError("no two adjacent free ports")


@pytest.mark.usefixtures("standin_env")
async def test_replica_ports_only_in_the_range_given(tmp_path: Path) -> None:
    import socket

    lo = _two_free_ports()
    w = Watched(tmp_path / "state", engines=ENGINES, port_range=(lo, lo + 1), strict_ports=True)
    busy = socket.socket()
    busy.bind(("127.0.0.1", lo))  # (another process's listener on the range's first port)
    busy.listen()
    try:
        await w.sup.apply([spec("vllm", id="a")])
        assert (await w.wait_state("a", READY)).port == lo + 1
        # the range is full: the next replica fails saying so, never listening outside it
        await w.sup.apply([spec("vllm", id="a"), spec("vllm", id="b")])
        st = await w.wait_state("b", FAILED)
        assert f"no free port in replica_ports {lo}-{lo + 1}" in st.message and "widen the range" in st.message
        assert st.port is None
        # a stopped replica's port is free again at once, though its status stays listed (QA: held for
        # keep_stopped, 5 minutes, every new replica failed "no free port" with nothing running)
        await w.sup.apply([])
        await w.wait_state("a", STOPPED)
        assert "a" in {x.id for x in w.sup.statuses()}
        await w.sup.apply([spec("vllm", id="c")])
        assert (await w.wait_state("c", READY)).port == lo + 1
    finally:
        busy.close()
        await w.sup.close()


@pytest.mark.usefixtures("standin_env")
async def test_a_replica_on_the_gpus_of_one_leaving_starts_once_that_one_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One desired set replaces replica a with replica b on the same GPU: b's engine starts only once a's has
    exited (two engines at once may not fit in the GPU's memory); and each run's end is in its log."""
    monkeypatch.setenv("LLMGW_STANDIN_TOKENS_PER_SECOND", "20")
    w = Watched(tmp_path / "state", engines=ENGINES)
    a, b = spec("vllm", id="a-1"), spec("vllm", id="b-1")
    try:
        await w.sup.apply([a])
        st = await w.wait_state(a.id, READY)
        pid, port = st.pid, st.port
        assert pid is not None and port is not None
        # a request in flight there: the stand-in finishes it before exiting (up to 5 s), so a stops slowly
        stream = asyncio.ensure_future(http(port, "POST", "/v1/chat/completions", key=KEY, body=(
            b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 60}')))
        await asyncio.sleep(0.3)
        await w.sup.apply([b])
        overlap = False
        while not gone(pid):
            sb = w.status(b.id)
            overlap = overlap or (sb is not None and sb.pid is not None)
            await asyncio.sleep(0.02)
        assert not overlap, "b's engine ran while a's still did"
        await w.wait_state(b.id, READY)
        stream.cancel()
        log = Path(tmp_path / "state" / "logs" / "a-1.log").read_text()
        assert "a-1: its engine stopped" in log, log[-500:]
    finally:
        await w.sup.close()
