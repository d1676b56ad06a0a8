"""``/admin/v1/mirror/...``: the mirror, the local Ollama store and import jobs, over HTTP."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "mirror"))
from mirror_helpers import OllamaStore, catalogue_models, minimal_gguf, sha

from llmgw.config import load
from llmgw.runtime import GatewayRuntime

pytestmark = pytest.mark.timeout(60)


async def call(port: int, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = orjson.dumps(body) if body is not None else b""
    writer.write(f"{method} {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: {len(data)}\r\n"
                 "content-type: application/json\r\n\r\n".encode() + data)
    raw = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), orjson.loads(payload)


async def test_mirror_routes_and_an_import_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ollama = OllamaStore(tmp_path / "ollama")
    ollama.add_model("tiny", gguf=minimal_gguf())
    monkeypatch.setenv("OLLAMA_MODELS", str(ollama.root))
    mirror = tmp_path / "mirror"
    rt = GatewayRuntime(load({"listen": "127.0.0.1:0", "admin": "127.0.0.1:0", "mirror": {"root": str(mirror)}}))
    await rt.start()
    try:
        assert rt.admin_addr is not None
        port = rt.admin_addr[1]
        status, doc = await call(port, "GET", "/admin/v1/mirror/models")
        assert status == 200 and doc == {"root": str(mirror), "models": []}
        assert not mirror.exists()  # a GET does not create the mirror
        status, doc = await call(port, "GET", "/admin/v1/mirror/ollama")
        assert status == 200 and str(ollama.root) in doc["stores"]
        tiny = next(m for m in doc["models"] if m["name"] == "tiny:latest")
        assert tiny["format"] == "gguf" and tiny["problem"] is None and tiny["size"] > 0
        assert tiny["in_mirror"] == []  # (not imported yet)

        # refusals: a bad name at once (400), unknown fields, no body, an unknown job
        status, doc = await call(port, "POST", "/admin/v1/mirror/imports", {"ollama": "../../etc"})
        assert status == 400 and doc["error"]["code"] == "invalid_name"
        assert "not a valid Ollama model name" in doc["error"]["message"]
        status, doc = await call(port, "POST", "/admin/v1/mirror/imports", {"ollama": "tiny", "name": "a//b"})
        assert status == 400 and doc["error"]["param"] == "name"
        status, doc = await call(port, "POST", "/admin/v1/mirror/imports", {"ollama": "tiny", "path": "/etc"})
        assert status == 400 and doc["error"]["param"] == "path"
        status, doc = await call(port, "POST", "/admin/v1/mirror/imports")
        assert status == 400 and doc["error"]["code"] == "invalid_json"
        status, doc = await call(port, "GET", "/admin/v1/mirror/imports/nope")
        assert status == 404 and doc["error"]["code"] == "import_not_found"
        status, doc = await call(port, "DELETE", "/admin/v1/mirror/models")
        assert status == 405

        # a job: 202 at once, then done (off the loop); a missing model fails with its reason
        status, job = await call(port, "POST", "/admin/v1/mirror/imports", {"ollama": "tiny"})
        assert status == 202 and job["state"] in ("queued", "running") and job["ollama"] == "tiny"
        for _ in range(200):
            status, job = await call(port, "GET", f"/admin/v1/mirror/imports/{job['id']}")
            if job["state"] in ("done", "failed"):
                break
            await asyncio.sleep(0.02)
        assert job["state"] == "done", job
        assert job["model"]["ref"] == "tiny:latest" and job["progress"] == 1.0
        assert catalogue_models(mirror) == ["tiny:latest"]
        status, doc = await call(port, "GET", "/admin/v1/mirror/models")
        assert [m["ref"] for m in doc["models"]] == ["tiny:latest"]
        assert doc["models"][0]["architecture"] == "llama" and doc["models"][0]["digest"].startswith("sha256:")
        status, doc = await call(port, "GET", "/admin/v1/mirror/ollama")
        assert next(m for m in doc["models"] if m["name"] == "tiny:latest")["in_mirror"] == ["tiny:latest"]

        status, job = await call(port, "POST", "/admin/v1/mirror/imports", {"ollama": "absent:1b"})
        for _ in range(200):
            status, job = await call(port, "GET", f"/admin/v1/mirror/imports/{job['id']}")
            if job["state"] in ("done", "failed"):
                break
            await asyncio.sleep(0.02)
        assert job["state"] == "failed" and job["error"]["code"] == "ollama_model_not_found"
        assert "ollama pull absent:1b" in job["error"]["message"]
        status, doc = await call(port, "GET", "/admin/v1/mirror/imports")
        assert [j["ollama"] for j in doc["imports"]] == ["absent:1b", "tiny"]
    finally:
        await rt.stop()


async def _finished(port: int, job: dict[str, Any]) -> dict[str, Any]:
    for _ in range(200):
        _, job = await call(port, "GET", f"/admin/v1/mirror/imports/{job['id']}")
        if job["state"] in ("done", "failed"):
            break
        await asyncio.sleep(0.02)
    return job


async def test_broken_blobs_are_listed_and_a_missing_one_fails_as_missing_blob(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ollama = OllamaStore(tmp_path / "ollama")
    ollama.add_model("missing", gguf=minimal_gguf(elements=16))
    absent = ollama.blob_path(sha(minimal_gguf(elements=16)))
    absent.unlink()
    ollama.add_model("wrongsize", gguf=minimal_gguf(elements=24))
    short = ollama.blob_path(sha(minimal_gguf(elements=24)))
    short.write_bytes(b"GGUF")
    monkeypatch.setenv("OLLAMA_MODELS", str(ollama.root))
    rt = GatewayRuntime(load({"listen": "127.0.0.1:0", "admin": "127.0.0.1:0",
                              "mirror": {"root": str(tmp_path / "mirror")}}))
    await rt.start()
    try:
        assert rt.admin_addr is not None
        port = rt.admin_addr[1]
        status, doc = await call(port, "GET", "/admin/v1/mirror/ollama")
        assert status == 200
        problem = {m["name"]: m["problem"] for m in doc["models"]}
        assert f"blob {absent.name} of missing:latest is missing from {ollama.root / 'blobs'}" in problem[
            "missing:latest"]
        assert f"blob {short.name} of wrongsize:latest has 4 bytes but the manifest says" in problem[
            "wrongsize:latest"]

        _, job = await call(port, "POST", "/admin/v1/mirror/imports", {"ollama": "missing"})
        job = await _finished(port, job)
        assert job["state"] == "failed" and job["error"]["code"] == "missing_blob", job
        assert absent.name in job["error"]["message"] and str(ollama.root / "blobs") in job["error"]["message"]
        _, job = await call(port, "POST", "/admin/v1/mirror/imports", {"ollama": "wrongsize"})
        job = await _finished(port, job)
        assert job["state"] == "failed" and job["error"]["code"] == "corrupt_blob", job
    finally:
        await rt.stop()


async def test_an_import_with_no_ollama_store_creates_no_mirror(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """QA: the job failed ollama_store_not_found and left a new mirror (catalogue, blobs/, tmp/) behind; its
    hint named --ollama-dir, which a caller of the API cannot pass."""
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "no-ollama-here"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    mirror = tmp_path / "mirror"
    rt = GatewayRuntime(load({"listen": "127.0.0.1:0", "admin": "127.0.0.1:0", "mirror": {"root": str(mirror)}}))
    await rt.start()
    try:
        assert rt.admin_addr is not None
        port = rt.admin_addr[1]
        _, job = await call(port, "POST", "/admin/v1/mirror/imports", {"ollama": "llama3.2:1b"})
        job = await _finished(port, job)
        assert job["state"] == "failed" and job["error"]["code"] == "ollama_store_not_found", job
        message = job["error"]["message"]
        assert "--ollama-dir" not in message and "start the gateway with OLLAMA_MODELS" in message, message
        assert not mirror.exists()
    finally:
        await rt.stop()
