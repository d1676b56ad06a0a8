"""``llmgw agent`` itself, as a process: flags, the --config file, refusals, SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cp_helpers import TOKEN, api, control_runtime, free_port, wait_for

pytestmark = pytest.mark.timeout(60)


def _agent(*args: str, env: dict[str, str] | None = None, state: Path | None = None) -> subprocess.Popen[str]:
    extra = ("--state-dir", str(state)) if state is not None else ()
    return subprocess.Popen(
        [sys.executable, "-m", "llmgw", "agent", *args, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**os.environ, "JOIN": TOKEN, **(env or {})},
    )


async def _node(rt, name: str) -> dict | None:  # type: ignore[no-untyped-def]
    _, body = await api(rt, "GET", "/admin/v1/nodes")
    return next((n for n in body["nodes"] if n["name"] == name and n["state"] == "up"), None)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])  # (SIGHUP: its terminal went away)
async def test_agent_simulated_registers_then_sigterm_deregisters_exit_0(tmp_path: Path, sig: int) -> None:
    port = free_port()
    async with control_runtime(port) as rt:
        p = _agent("--control", f"127.0.0.1:{port}", "--token-env", "JOIN", "--name", "cli-node",
                   "--gpu-source", "simulated", state=tmp_path)
        try:
            node = await wait_for(lambda: _node(rt, "cli-node"), what="cli-node up")
            assert node["gpu_source"] == "simulated" and node["gpu_count"] >= 1
        finally:
            p.send_signal(sig)
            _, err = await asyncio.to_thread(p.communicate, timeout=15)  # (the control plane runs on this loop)
        assert p.returncode == 0, err
        assert await _node(rt, "cli-node") is None


async def test_agent_reads_its_config_file(tmp_path: Path) -> None:
    port = free_port()
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(f"control: 127.0.0.1:{port}\ntoken_env: JOIN\nname: file-node\ngpu_source: none\n"
                   f"state_dir: {tmp_path / 'state'}\nlabels: {{zone: eu-1, tier: gold}}\nadvertise: 127.0.0.1\n")
    async with control_runtime(port) as rt:
        p = _agent("--config", str(cfg), "--label", "tier=silver")
        try:
            node = await wait_for(lambda: _node(rt, "file-node"), what="file-node up")
            assert node["gpu_source"] == "none"
            assert node["labels"] == {"zone": "eu-1", "tier": "silver"}  # the flag over the file
            assert node["address"] == "127.0.0.1" and node["protocol"] == "1.3"
            assert (tmp_path / "state" / "replicas").is_dir()
        finally:
            p.send_signal(signal.SIGTERM)
            _, err = p.communicate(timeout=15)
        assert p.returncode == 0, err


async def test_a_config_file_without_control_takes_the_flag(tmp_path: Path) -> None:
    # flags override the file, so --control satisfies a file that leaves control: out
    port = free_port()
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(f"token_env: JOIN\ngpu_source: none\nstate_dir: {tmp_path / 'state'}\n")
    async with control_runtime(port) as rt:
        p = _agent("--config", str(cfg), "--control", f"127.0.0.1:{port}", "--name", "flag-node")
        try:
            await wait_for(lambda: _node(rt, "flag-node"), what="flag-node up")
        finally:
            p.send_signal(signal.SIGTERM)
            _, err = p.communicate(timeout=15)
        assert p.returncode == 0, err
    # neither: one line naming both ways to give it
    p = _agent("--config", str(cfg), "--name", "flag-node")
    _, err = p.communicate(timeout=30)
    assert p.returncode == 1, err
    assert "control: is required (or give llmgw agent --control HOST:PORT)" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_agent_refuses_what_it_cannot_do() -> None:
    p = _agent("--control", "127.0.0.1:1", "--token-env", "NOT_SET_ANYWHERE")
    _, err = p.communicate(timeout=30)
    assert p.returncode == 1 and "NOT_SET_ANYWHERE" in err and "not set" in err
    p = _agent("--control", "10.1.2.3:7070", "--token-env", "JOIN")
    _, err = p.communicate(timeout=30)
    assert p.returncode == 1 and "--insecure" in err and "--tls-ca" in err
    assert TOKEN not in err
    p = _agent("--control", "127.0.0.1:1", "--token-env", "SET_BUT_EMPTY", env={"SET_BUT_EMPTY": ""})
    _, err = p.communicate(timeout=30)
    assert p.returncode == 1 and "--token-env SET_BUT_EMPTY: the environment variable is empty" in err
    for bad in ("rack/1", "-lead", "..", "x" * 129):  # (the rule of the agent file's name:)
        p = _agent("--control", "127.0.0.1:1", "--token-env", "JOIN", "--name", bad)
        _, err = p.communicate(timeout=30)
        assert p.returncode == 1 and f"--name {bad!r}: use letters, digits" in err, err


async def test_agent_auto_discovery_reports_a_known_source(tmp_path: Path) -> None:
    """Needs GPU discovery (llmgw.agent.discovery, the other half of this issue)."""
    from llmgw.agent.model import SOURCES

    port = free_port()
    async with control_runtime(port) as rt:
        p = _agent("--control", f"127.0.0.1:{port}", "--token-env", "JOIN", "--name", "auto-node", state=tmp_path)
        try:
            node = await wait_for(lambda: _node(rt, "auto-node"), timeout=20, what="auto-node up")
            assert node["gpu_source"] in SOURCES
        finally:
            p.send_signal(signal.SIGTERM)
            p.communicate(timeout=15)
        assert p.returncode == 0


def test_replicas_listen_where_the_control_plane_sees_the_node() -> None:
    """With no advertise, the engines listen on the address the control plane sees this node at
    (the source address of the route to it), not on every interface."""
    from llmgw.cli.agent import NodeOptions

    plain = NodeOptions(state_dir="/nonexistent")
    assert plain.bind_towards(("127.0.0.1", 7070)) == "127.0.0.1"
    assert NodeOptions(state_dir="/x", advertise="10.0.0.5").bind_towards(("127.0.0.1", 7070)) == "10.0.0.5"
    assert NodeOptions(state_dir="/x", advertise="gpu-7.example").bind_towards(("127.0.0.1", 7070)) == "0.0.0.0"


async def test_an_agent_going_round_control_planes_that_are_away_logs_each_answer_once(tmp_path: Path) -> None:
    """Three addresses, none answering, for 6 s: each address's failure and the round are said once, not
    at every pass (a round takes about a second: it wrote about six lines a second), and the first
    success after them says it connected."""
    ports = [free_port() for _ in range(3)]
    control = ",".join(f"127.0.0.1:{p}" for p in ports)
    p = _agent("--control", control, "--token-env", "JOIN", "--name", "round-node", "--gpu-source", "none",
               state=tmp_path)
    try:
        await asyncio.sleep(6.0)
        async with control_runtime(ports[1]) as rt:
            await wait_for(lambda: _node(rt, "round-node"), timeout=15, what="round-node up")
            p.send_signal(signal.SIGTERM)
            _, err = await asyncio.to_thread(p.communicate, timeout=15)  # (the control plane runs on this loop)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate(timeout=10)
    lines = [line for line in err.splitlines() if "control plane at" in line or "moving to" in line]
    away = [line for line in lines if "Connection refused" in line]
    assert len(away) == 3, lines  # (each address's refusal once, over some six rounds)
    # a move is said beside a failure said (the control plane, leading a moment after it started, may
    # first answer as a standby: one more), never on its own
    assert sum("moving to" in line for line in lines) <= sum("UNAVAILABLE" in line for line in lines), lines
    assert any(f"connected to the control plane at 127.0.0.1:{ports[1]}" in line
               or f"control plane at 127.0.0.1:{ports[1]} reachable again" in line for line in err.splitlines()), err


def test_control_port_0_is_a_usage_error() -> None:
    r = subprocess.run([sys.executable, "-m", "llmgw", "agent", "--control", "127.0.0.1:0", "--token-env", "JOIN",
                        "--gpu-source", "none"], capture_output=True, text=True, timeout=30,
                       env={**os.environ, "JOIN": TOKEN})
    assert r.returncode == 1 and "--control 127.0.0.1:0: port 0 is no address to call" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
