"""One node, one agent: ``llmgw agent`` processes given one ``--name``, or one ``--state-dir``.

Real agents (``python -m llmgw agent``) against a real control plane over gRPC on 127.0.0.1
(heartbeat 0.2 s, grace 0.6 s). Before, a second agent with a node's name and the join token
silently shared the node (its GPU set flipping beat by beat between the two hosts' readings), and
its SIGTERM deregistered the first one's node.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cp_helpers import TOKEN, control_plane, control_runtime, free_port, wait_for

pytestmark = pytest.mark.timeout(90)


def _agent(port: int, name: str, state: Path, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    with open(log, "ab") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "llmgw", "agent", "--control", f"127.0.0.1:{port}", "--token-env", "JOIN",
             "--name", name, "--gpu-source", "simulated", "--state-dir", str(state), *extra],
            stdout=subprocess.DEVNULL, stderr=err, env={**os.environ, "JOIN": TOKEN},
        )


def _stop(p: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> int:
    if p.poll() is None:
        p.send_signal(sig)
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)
    return p.returncode


async def test_a_second_agent_with_a_live_nodes_name_is_refused_and_takes_over_when_it_stops(tmp_path: Path) -> None:
    port = free_port()
    async with control_runtime(port) as rt:
        cp = control_plane(rt)
        a = _agent(port, "dup", tmp_path / "a", tmp_path / "a.log")
        b: subprocess.Popen[bytes] | None = None
        try:
            await wait_for(lambda: (st := cp.nodes.get("dup")) is not None and st.heartbeats >= 2, 20, "a's node")
            st = cp.nodes.get("dup")
            assert st is not None
            first = st.instance
            assert first == (tmp_path / "a" / "agent-instance").read_text().strip() and len(first) == 32

            b = _agent(port, "dup", tmp_path / "b", tmp_path / "b.log")
            await wait_for(lambda: "run by another agent" in (tmp_path / "b.log").read_text(), 20, "b refused")
            beats = st.heartbeats
            await asyncio.sleep(1.0)  # (b retrying meanwhile: its backoff is capped at an interval)
            st2 = cp.nodes.get("dup")
            assert st2 is st and st.instance == first and st.registrations == 1 and st.heartbeats > beats
            assert cp.stats.refused.get("node_taken", 0) >= 1
            b_log = (tmp_path / "b.log").read_text()
            assert "ALREADY_EXISTS" in b_log and "give this one another --name, or stop the other" in b_log
            assert "Traceback" not in b_log

            # a's SIGTERM: its node deregistered; b, still trying, takes the name
            assert _stop(a) == 0
            await wait_for(lambda: (n := cp.nodes.get("dup")) is not None and n.instance != first, 20, "b taking over")
            second = cp.nodes.get("dup")
            assert second is not None
            assert second.instance == (tmp_path / "b" / "agent-instance").read_text().strip()

            # a back while b runs: now a is the one refused, and b's node is untouched by it
            a = _agent(port, "dup", tmp_path / "a", tmp_path / "a2.log")
            await wait_for(lambda: "run by another agent" in (tmp_path / "a2.log").read_text(), 20, "a refused")
            assert _stop(a) == 0  # (never registered: nothing to deregister)
            node = cp.nodes.get("dup")
            assert node is second and cp.nodes.is_up(node)
        finally:
            _stop(a)
            if b is not None:
                _stop(b)


async def test_an_agent_killed_takes_its_node_straight_back_from_its_state_dir(tmp_path: Path) -> None:
    port = free_port()
    async with control_runtime(port) as rt:
        cp = control_plane(rt)
        a = _agent(port, "crash", tmp_path / "s", tmp_path / "1.log")
        try:
            await wait_for(lambda: (st := cp.nodes.get("crash")) is not None and st.heartbeats >= 1, 20, "the node")
            _stop(a, signal.SIGKILL)
            st = cp.nodes.get("crash")
            assert st is not None and cp.nodes.is_up(st)  # (within the grace: the killed agent's node is up)
            a = _agent(port, "crash", tmp_path / "s", tmp_path / "2.log")
            await wait_for(lambda: st.registrations == 2, 20, "the restarted agent registered")
            assert "another agent" not in (tmp_path / "2.log").read_text()
        finally:
            _stop(a)


def test_a_second_agent_on_one_state_dir_is_refused_in_one_line(tmp_path: Path) -> None:
    port = free_port()  # (nothing listens: the first agent retries, holding its state directory)
    a = _agent(port, "one", tmp_path / "s", tmp_path / "a.log")
    try:
        deadline = time.monotonic() + 20
        while not (tmp_path / "s" / "agent-instance").exists():
            assert time.monotonic() < deadline and a.poll() is None, (tmp_path / "a.log").read_text()
            time.sleep(0.05)
        b = subprocess.run(
            [sys.executable, "-m", "llmgw", "agent", "--control", f"127.0.0.1:{port}", "--token-env", "JOIN",
             "--name", "two", "--gpu-source", "simulated", "--state-dir", str(tmp_path / "s")],
            capture_output=True, text=True, timeout=30, env={**os.environ, "JOIN": TOKEN},
        )
        assert b.returncode == 1
        assert b.stderr.strip() == (f"llmgw: error: another llmgw agent (pid {a.pid}) runs with --state-dir "
                                    f"{tmp_path / 's'}: stop it, or give this agent its own --state-dir (and its "
                                    "own --name)"), b.stderr
    finally:
        _stop(a)


@pytest.mark.parametrize("where", ["file", "unwritable"])
def test_an_unusable_state_dir_is_one_line_and_exit_1(tmp_path: Path, where: str) -> None:
    if where == "file":
        (tmp_path / "f").write_text("")
        state = tmp_path / "f" / "sub"
    else:
        if os.geteuid() == 0:
            state = Path("/proc/llmgw-state")  # (root writes any mode: /proc refuses even root)
        else:
            (tmp_path / "ro").mkdir(mode=0o500)
            state = tmp_path / "ro" / "sub"
    r = subprocess.run(
        [sys.executable, "-m", "llmgw", "agent", "--control", "127.0.0.1:9", "--token-env", "JOIN",
         "--gpu-source", "none", "--state-dir", str(state)],
        capture_output=True, text=True, timeout=30, env={**os.environ, "JOIN": TOKEN},
    )
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"llmgw: error: --state-dir {state}: cannot use it ("), r.stderr
    assert "StateDirectory=" in lines[0]


@pytest.mark.parametrize("bad", ["ca", "cert", "mismatch"])
def test_tls_files_that_are_not_pem_are_one_line_and_exit_1(tmp_path: Path, bad: str) -> None:
    pki = tmp_path / "pki"
    pki.mkdir()

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    for n in ("one", "two"):
        openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1",
                "-subj", f"/CN={n}", "-keyout", str(pki / f"{n}.key"), "-out", str(pki / f"{n}.pem"))
    garbage = pki / "garbage.pem"
    garbage.write_text("not a certificate\n")
    ca, cert, key = str(pki / "one.pem"), str(pki / "one.pem"), str(pki / "one.key")
    if bad == "ca":
        ca = str(garbage)
    elif bad == "cert":
        cert = str(garbage)
    else:
        key = str(pki / "two.key")
    r = subprocess.run(
        [sys.executable, "-m", "llmgw", "agent", "--control", "127.0.0.1:9", "--token-env", "JOIN",
         "--gpu-source", "none", "--state-dir", str(tmp_path / "s"), "--tls-ca", ca, "--tls-cert", cert,
         "--tls-key", key],
        capture_output=True, text=True, timeout=30, env={**os.environ, "JOIN": TOKEN},
    )
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    if bad == "ca":
        assert lines[0].startswith(f"llmgw: error: --tls-ca {garbage}: not a PEM CA certificate")
    else:
        assert lines[0].startswith(f"llmgw: error: --tls-cert {cert} / --tls-key {key}: not a PEM certificate")
