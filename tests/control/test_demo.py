"""``llmgw serve`` with no config: the demo also runs a control plane with one local agent on simulated GPUs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from cp_helpers import free_port

pytestmark = pytest.mark.timeout(60)


def _get(url: str) -> object:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def test_demo_shows_a_simulated_node_and_its_gpus(tmp_path: Path) -> None:
    port, admin = free_port(), free_port()
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    # (PATH without the engines: the demo node reports what it cannot launch)
    path = os.pathsep.join([os.path.dirname(sys.executable), "/usr/bin", "/bin"])
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmgw", "serve", "--listen", f"127.0.0.1:{port}", "--admin", f"127.0.0.1:{admin}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp), "PATH": path},
    )
    try:
        assert proc.stdout is not None
        lines = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if not line or line.startswith("  curl "):
                break
        text = "".join(lines)
        assert "control plane on grpc://127.0.0.1:" in text and "SIMULATED GPUs" in text, text
        base = f"http://127.0.0.1:{admin}"
        nodes: list[dict[str, object]] = []
        while time.monotonic() < deadline:
            nodes = _get(f"{base}/admin/v1/nodes")["nodes"]  # type: ignore[index]
            if nodes:
                break
            time.sleep(0.1)
        assert [n["name"] for n in nodes] == ["demo-node"] and nodes[0]["gpu_source"] == "simulated"
        node = _get(f"{base}/admin/v1/nodes/demo-node")
        assert node["gpus"] and all("imulated" in g["name"] for g in node["gpus"])  # type: ignore[index]
        with urllib.request.urlopen(f"{base}/metrics", timeout=5) as r:
            page = r.read().decode()
        assert 'llmgw_node_up{node="demo-node"} 1.0' in page and 'gpu_source="simulated"' in page
        # the demo node runs what is placed on it, as any node does: an engine it lacks is the
        # replica's failure, said where the deployment is shown
        assert list(tmp.iterdir()), "the demo node keeps its replicas' state in a temporary directory"
        ctl = [sys.executable, "-m", "llmgw", "ctl", "--admin", base]
        out = subprocess.run([*ctl, "deploy", "d1", "--model", "facebook/opt-125m"], capture_output=True, text=True,
                             timeout=20, env={**os.environ, "PATH": path})
        assert out.returncode == 0 and "placed on demo-node" in out.stdout, out
        why = ""
        while time.monotonic() < deadline and "failed on demo-node" not in why:
            time.sleep(0.2)
            dep = _get(f"{base}/admin/v1/deployments/d1")
            why = json.dumps(dep)
        assert "failed on demo-node" in why and "'vllm' is not found on PATH" in why, why
        # the demo node runs engine checks as any node's agent does (QA: "this agent runs no engine checks")
        out = subprocess.run([*ctl, "engine-check", "vllm", "--node", "demo-node", "--static", "--json"],
                             capture_output=True, text=True, timeout=30, env={**os.environ, "PATH": path})
        said = json.loads(out.stdout)
        assert said["node"] == "demo-node" and said["ok"] is False, out
        assert {c["check"]: c["status"] for c in said["checks"]} == {"found": "fail", "gpu": "pass"}, said
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert "node demo-node deregistered" in err
    assert not list(tmp.iterdir()), "the demo node's state is removed when it stops"


def test_the_demo_node_fetches_mirror_models_as_any_node_does(tmp_path: Path) -> None:
    """A deployment of a mirror model is placed on the demo node, which fetches it over the
    admin listener like a real agent (before, it failed for ever: "no mirror fetcher")."""
    from llmgw.testing.gguf_model import write_tiny_llama

    port, admin = free_port(), free_port()
    tmp, mirror = tmp_path / "tmp", tmp_path / "mirror"
    tmp.mkdir()
    model = tmp_path / "tiny.gguf"
    write_tiny_llama(model)
    # (PATH without the engines: once the model is on the node, the engine it lacks is the failure)
    path = os.pathsep.join([os.path.dirname(sys.executable), "/usr/bin", "/bin"])
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp), "PATH": path, "LLMGW_MIRROR": str(mirror)}
    out = subprocess.run([sys.executable, "-m", "llmgw", "mirror", "import", str(model), "--name", "tiny"],
                         capture_output=True, text=True, timeout=30, env=env)
    assert out.returncode == 0, out
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmgw", "serve", "--listen", f"127.0.0.1:{port}", "--admin", f"127.0.0.1:{admin}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env,
    )
    try:
        base = f"http://127.0.0.1:{admin}"
        deadline = time.monotonic() + 30
        nodes: list[object] = []
        while time.monotonic() < deadline and not nodes:
            time.sleep(0.1)
            try:
                nodes = _get(f"{base}/admin/v1/nodes")["nodes"]  # type: ignore[index]
            except OSError:
                continue
        assert nodes, "the demo node never registered"
        ctl = [sys.executable, "-m", "llmgw", "ctl", "--admin", base]
        out = subprocess.run([*ctl, "deploy", "tiny", "--model", "tiny", "--engine", "llamacpp"], capture_output=True,
                             text=True, timeout=20, env=env)
        assert out.returncode == 0 and "placed on demo-node" in out.stdout, out
        why = ""
        while time.monotonic() < deadline and "llama-server" not in why:
            time.sleep(0.2)
            why = json.dumps(_get(f"{base}/admin/v1/deployments/tiny"))
        assert "no mirror fetcher" not in why and "'llama-server' is not found on PATH" in why, why
        # the model's blob came over to the node's own store, verified
        blobs = [p for p in tmp.glob("llmgw-demo-node-*/mirror/**/*") if p.is_file() and p.stat().st_size
                 == model.stat().st_size]
        assert blobs and blobs[0].read_bytes() == model.read_bytes()
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert not list(tmp.iterdir()), "the demo node's state is removed when it stops"
