"""A deployment's own ``ready_timeout``, end to end: ``llmgw serve``'s demo node (a real agent over real
gRPC) runs a stand-in ``llama-server`` that answers 503 "Loading model" for as long as it runs, as a
large model on slow storage does. The deployment's timeout fails it, not the agent's 30 minutes; a new
timeout sent with ``ctl deploy --update`` reaches the engine already loading (the same process)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from cp_helpers import DemoServe

pytestmark = pytest.mark.timeout(120)

LOADING = '''#!{python}
# llama-server while it loads a model that takes longer than anyone waits: 503 on every path
import http.server, json, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
body = json.dumps({{"error": {{"code": 503, "message": "Loading model", "type": "unavailable_error"}}}}).encode()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(503)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
print("llama_model_load: loading model tensors, this can take a while...", flush=True)
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def test_a_deployments_ready_timeout_fails_it_and_a_new_one_reaches_the_loading_engine(tmp_path: Path) -> None:
    model = tmp_path / "big.gguf"
    model.write_bytes(b"GGUF")
    demo = DemoServe(tmp_path, LOADING.format(python=sys.executable))
    env, ctl_ = demo.env, demo.ctl

    def deployments() -> dict[str, dict[str, Any]]:
        return {d["name"]: d for d in demo.get("/admin/v1/deployments")["deployments"]}

    def ports(name: str) -> list[int]:
        # (each start of an engine is on a port of its own: the same port, the same engine)
        return [r["port"] for r in deployments()[name]["replicas"] if r.get("port")]

    try:
        deadline = time.monotonic() + 60
        for name, more in (("quick", ["--ready-timeout", "2s"]), ("patient", [])):
            out = subprocess.run([*ctl_, "deploy", name, "--engine", "llamacpp", f"--model={model}", *more],
                                 capture_output=True, text=True, timeout=20, env=env)
            assert out.returncode == 0 and "placed on demo-node" in out.stdout, out
        while time.monotonic() < deadline and "not ready within" not in (deployments()["quick"]["message"] or ""):
            time.sleep(0.1)
        d = deployments()
        assert "not ready within 2s (/health never answered 200)" in (d["quick"]["message"] or ""), d["quick"]
        assert d["quick"]["spec"]["ready_timeout"] == 2.0
        # the other one waits as long as the agent's ready_timeout says (30m): still loading
        assert d["patient"]["message"] is None or "not ready" not in d["patient"]["message"], d["patient"]
        assert d["patient"]["replicas"][0]["state"] == "starting", d["patient"]
        loading = ports("patient")
        ids = [r["id"] for r in d["patient"]["replicas"]]
        assert loading, d["patient"]
        # a ready timeout alone restarts nothing: the engine loading since the deploy is told 6s and fails
        # 6s after its own start (a restarted one would load afresh)
        out = subprocess.run([*ctl_, "deploy", "patient", "--engine", "llamacpp", f"--model={model}",
                              "--ready-timeout", "6s", "--update"], capture_output=True, text=True, timeout=20, env=env)
        assert out.returncode == 0, out
        d = deployments()["patient"]
        assert d["outdated"] == 0 and [r["id"] for r in d["replicas"]] == ids, d
        assert d["spec"]["ready_timeout"] == 6.0
        while time.monotonic() < deadline and "not ready within" not in (deployments()["patient"]["message"] or ""):
            assert ports("patient") in ([], loading)  # (the same engine until it fails)
            time.sleep(0.1)
        why = deployments()["patient"]["message"] or ""
        assert "not ready within 6s" in why, why
        out = subprocess.run([*ctl_, "deployments"], capture_output=True, text=True, timeout=20, env=env)
        assert out.returncode == 0 and "not ready within 6s" in out.stdout, out.stdout
    finally:
        code, err = demo.stop()
    assert code == 0, err[-3000:]
