"""``llmgw ctl engine-check`` against the stand-in vLLM, SGLang and TensorRT-LLM (the real llama-server's
checks are in tests/real_engine/test_launch_llamacpp.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from llmgw.config.agent import AgentEngineConfig
from llmgw.launch import vllm
from llmgw.launch.base import LaunchError, find_python
from llmgw.launch.check import engine_check, render

PY = {"python": sys.executable}


def statuses(checks: list) -> dict[str, str]:  # type: ignore[type-arg]
    return {c.name: c.status for c in checks}


@pytest.mark.parametrize(("engine", "model"), [("vllm", "org/tiny"), ("sglang", "org/tiny"), ("trtllm", "/m/tiny")])
@pytest.mark.usefixtures("standin_env")
async def test_passes_on_the_standins(engine: str, model: str) -> None:
    engines = {engine: AgentEngineConfig(**PY)} if engine != "vllm" else {}
    checks = await engine_check(engine, engines=engines, model=model, gpu_source="simulated", timeout=60)
    assert not any(c.failed for c in checks), render(checks)
    got = statuses(checks)
    assert {"found", "version", "flags", "gpu", "start", "ready", "metrics", "auth", "stop"} <= set(got)
    if engine == "trtllm":
        assert got["launcher"] == "pass" and got["serve"] == "pass"
        metrics = next(c for c in checks if c.name == "metrics")
        assert "/prometheus/metrics" in metrics.detail and "without the key: 401" in metrics.detail


@pytest.mark.usefixtures("standin_env")
async def test_the_live_check_listens_in_the_agents_replica_ports() -> None:
    """On a node whose replicas are confined to replica_ports (a firewall's opening), so is the check's
    engine: it is a replica in all but name."""
    from ports import free_port

    lo = free_port()
    checks = await engine_check("vllm", model="org/tiny", gpu_source="simulated", timeout=60,
                                replica_ports=(lo, min(lo + 20, 32767)))
    assert not any(c.failed for c in checks), render(checks)
    start = next(c for c in checks if c.name == "start")
    port = int(start.detail.rsplit("port ", 1)[1].split()[0].rstrip(",)"))
    assert lo <= port <= lo + 20, start.detail


@pytest.mark.usefixtures("standin_env")
async def test_a_build_lacking_a_flag_fails_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMGW_STANDIN_LACKS", "--served-model-name")
    checks = await engine_check("vllm", model="org/tiny", gpu_source="simulated")
    flags = next(c for c in checks if c.name == "flags")
    assert flags.failed and "lacks --served-model-name" in flags.detail and flags.fix.startswith("upgrade vLLM")
    assert checks[-1].detail == "skipped: a static check failed"
    assert "fix: upgrade vLLM" in render(checks)


@pytest.mark.usefixtures("standin_env")
async def test_no_metrics_page_fails_the_metrics_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMGW_STANDIN_NO_METRICS", "1")
    checks = await engine_check("sglang", engines={"sglang": AgentEngineConfig(**PY)}, model="org/tiny",
                                gpu_source="simulated", timeout=60)
    metrics = next(c for c in checks if c.name == "metrics")
    assert metrics.failed and "answered 404" in metrics.detail and "--enable-metrics" in metrics.fix
    assert statuses(checks)["stop"] == "pass"


async def test_missing_engines_and_gpus_say_how_to_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    checks = await engine_check("vllm", gpu_source="none")
    assert statuses(checks) == {"found": "fail", "gpu": "fail", "live": "info"}
    assert checks[0].detail == "vllm: 'vllm' is not found on PATH"
    assert "set engines.vllm.binary" in checks[0].fix
    assert "install the NVIDIA driver" in checks[1].fix
    checks = await engine_check("trtllm", engines={"trtllm": AgentEngineConfig(**PY)}, gpu_source="none")
    version = next(c for c in checks if c.name == "version")
    assert version.failed and "cannot import tensorrt_llm" in version.detail
    assert "engines.trtllm.python" in version.fix


def test_not_on_path_and_not_an_executable_are_told_apart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Absent means install it or point engines.vllm.binary at it; present but not runnable means fix the file."""
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LaunchError) as absent:
        vllm.binary(None)
    assert str(absent.value) == (
        "vllm: 'vllm' is not found on PATH; install it or set engines.vllm.binary in the agent's config")
    (tmp_path / "vllm").write_text("#!/bin/sh\n")  # there, but without the execute bit
    with pytest.raises(LaunchError, match=r"^vllm: 'vllm' on PATH \(.*/vllm\) is not an executable; "):
        vllm.binary(None)
    with pytest.raises(LaunchError, match=r"^vllm: engines.vllm.binary = '.*/nope' does not exist; install it"):
        vllm.binary(AgentEngineConfig(binary=str(tmp_path / "nope")))
    with pytest.raises(LaunchError, match=r"^vllm: engines.vllm.binary = '.*/vllm' is not an executable; "):
        vllm.binary(AgentEngineConfig(binary=str(tmp_path / "vllm")))
    with pytest.raises(LaunchError, match=r"^vllm: engines.vllm.binary = 'my-vllm' is not found on PATH; "):
        vllm.binary(AgentEngineConfig(binary="my-vllm"))
    with pytest.raises(LaunchError, match=r"^sglang: 'python3' is not found on PATH; set engines.sglang.python"):
        find_python(None, "sglang")
    (tmp_path / "vllm").chmod(0o755)
    assert vllm.binary(None) == str(tmp_path / "vllm")


def test_ctl_node_goes_through_the_control_plane() -> None:
    """(The node's side: tests/control/test_replica_wire.py and tests/real_engine/test_agent_replicas.py.)"""
    out = subprocess.run([sys.executable, "-m", "llmgw", "ctl", "--admin", "http://127.0.0.1:1", "engine-check", "vllm",
                          "--node", "gpu-1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "cannot reach the admin API at http://127.0.0.1:1" in out.stderr
    out = subprocess.run([sys.executable, "-m", "llmgw", "ctl", "engine-check", "vllm", "--node", "gpu-1",
                          "--binary", "/x"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "the node's agent uses its own config file" in out.stderr
