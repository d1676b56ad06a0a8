"""A recorded admin API: fixed JSON answers served over real HTTP, for snapshots and benchmarks.

A gateway with 1,000 simulated endpoints and 8,000 GPUs is heavy to run on a small
machine; what the console sees of it is only the admin API's JSON. This serves such
answers (``{path: json}``, made by :func:`fleet` or saved from a real gateway's
``/admin/v1/...``) with llmgw's own HTTP server, so the console under test speaks
HTTP to a socket exactly as it does to a gateway, with fixed data (deterministic
snapshots) or a fleet of any size (``bench/console_load.py``).

    python -m llmgw.console.replay --endpoints 1000 --gpus 8000 [--port 9091]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import orjson

from ..http.server import HTTPServer

__all__ = ["ReplayAPI", "fleet", "serve_in_thread"]


class ReplayAPI:
    """An app for :class:`~llmgw.http.server.HTTPServer`: ``GET path`` answers the recorded JSON.

    ``POST``s answer ``{"changed": true}`` and are counted in :attr:`posts` (a benchmark's actions);
    an unknown path answers 404 in the admin API's error shape.
    """

    def __init__(self, routes: dict[str, Any]) -> None:
        self.set(routes)
        self.posts: list[str] = []
        self.gets = 0

    def set(self, routes: dict[str, Any]) -> None:
        """Replace the answers (pre-encoded once: serving costs the server nothing per call)."""
        self._bodies = {p.encode(): orjson.dumps(v) for p, v in routes.items()}

    def handle(self, req: Any, w: Any) -> None:
        path = req.path
        if req.method == b"POST":
            self.posts.append(path.decode("latin-1"))
            w.send_json(200, {"changed": True})
            return
        body = self._bodies.get(path)
        if body is None:
            w.send(404, orjson.dumps({"error": {"message": f"no admin route {path.decode('latin-1')}",
                                                "type": "invalid_request_error", "code": "not_found"}}),
                   ((b"content-type", b"application/json"),))
            return
        self.gets += 1
        w.send(200, body, ((b"content-type", b"application/json"),))


@contextlib.contextmanager
def serve_in_thread(api: ReplayAPI, host: str = "127.0.0.1", port: int = 0) -> Iterator[int]:
    """Serve ``api`` on its own event loop in a thread (the console keeps its loop); yields the port."""
    started = threading.Event()
    box: dict[str, Any] = {}

    def run() -> None:
        async def start() -> None:
            box["loop"] = asyncio.get_running_loop()
            server = HTTPServer(api, name="replay")
            _, box["port"] = await server.listen(host, port)
            box["stop"] = asyncio.Event()
            started.set()
            await box["stop"].wait()
            await server.close(1.0)

        try:
            # NOTE: asyncio.run, not run_until_complete: a connection accepted just
            # before the stop is still being set up by a task, and only a loop ended
            # as asyncio.run ends it (its tasks cancelled and run out) closes that
            # socket; else it outlives the closed loop, unclosed.
            asyncio.run(start())
        except BaseException as exc:  # pragma: no cover - reported to the caller
            box["error"] = exc
            started.set()

    t = threading.Thread(target=run, name="llmgw-replay", daemon=True)
    t.start()
    if not started.wait(10):
        raise RuntimeError("the replay server did not start")
    if "error" in box:
        raise box["error"]
    try:
        yield int(box["port"])
    finally:
        box["loop"].call_soon_threadsafe(box["stop"].set)
        t.join(10)


def fleet(endpoints: int = 8, nodes: int = 2, gpus_per_node: int = 4, *, seed: int = 7) -> dict[str, Any]:
    """A made-up fleet as the admin API would show it: deterministic for a given ``seed``.

    Every sort of value the views show appears: absent numbers (a llama.cpp replica without KV
    use, a MIG GPU without utilisation), a draining, a stale and an open-breaker replica, an
    unhealthy and a cordoned node, XID errors, an empty and a non-empty mirror entry.
    """
    import random

    rnd = random.Random(seed)
    models = ["llama-3.1-8b", "qwen2.5-7b", "mistral-7b", "gemma-2-9b"]
    eps = []
    for i in range(endpoints):
        model = models[i % len(models)]
        engine = "llamacpp" if i % 4 == 1 else "vllm"
        state = "ok"
        if i % 37 == 5:
            state = "draining"
        elif i % 41 == 7:
            state = "stale"
        elif i % 43 == 9:
            state = "open"
        fresh = state != "stale"
        eps.append({
            "id": f"{engine}-{i:04d}", "url": f"http://10.0.{i // 250}.{i % 250}:8000", "models": [model],
            "engine": engine, "pool": f"pool-{i % 3}", "state": state, "draining": state == "draining",
            "inflight": rnd.randint(0, 12), "completed": rnd.randint(0, 10**6), "failures": 0,
            "waiting": rnd.randint(0, 5) if fresh else None, "running": rnd.randint(0, 16) if fresh else None,
            "kv_cache_usage": round(rnd.random(), 3) if fresh and engine == "vllm" else None,
            "drain_rate": round(rnd.random() * 20, 2) if fresh else None,
            "breaker": "open" if state == "open" else "closed", "stale": not fresh,
            "usable": state == "ok", "last_scrape_age_s": round(rnd.random() * 2, 3) if fresh else 31.5,
        })
    bands = ["critical", "standard", "batch"]
    queues = {
        "admission": True,
        "bands": [{"band": b, "depth": 2 * k, "models": {models[k]: 2 * k} if k else {},
                   "decisions": {"admitted": 1000 * (k + 1), "queued": 10 * k, "rejected": 3 * k}}
                  for k, b in enumerate(bands)],
        "pool_saturation": {m: round(0.3 + 0.2 * k, 2) for k, m in enumerate(models[:3])},
    }
    node_rows = []
    gpu_rows = []
    for n in range(nodes):
        name = f"node-{n:03d}"
        state = "unhealthy" if n % 17 == 3 else "up"
        node_rows.append({
            "name": name, "id": f"id-{n}", "state": state, "cordoned": n % 11 == 1, "hostname": f"host-{n:03d}",
            "agent_version": "0.9.0", "heartbeat_age_s": round(rnd.random() * 2, 3), "gpu_source": "nvml",
            "gpu_count": gpus_per_node, "errors": [], "facts": {"driver_version": "550.90.07"},
        })
        for g in range(gpus_per_node):
            mig = g == gpus_per_node - 1 and n % 5 == 2
            total = 85899345920
            gpu_rows.append({
                "node": name, "node_state": state, "heartbeat_age_s": 0.5,
                "uuid": f"GPU-{n:04d}{g:04d}-0000-4000-8000-000000000000", "index": g,
                "name": "NVIDIA H100 80GB HBM3", "memory_total_bytes": total,
                "memory_used_bytes": int(total * rnd.random()),
                "utilization_gpu_ratio": None if mig else round(rnd.random(), 2),
                "temperature_celsius": float(rnd.randint(30, 85)), "power_watts": float(rnd.randint(80, 700)),
                "ecc_corrected_volatile": 0, "ecc_uncorrected_volatile": 0,
                "xid_errors": {"79": 1} if (n + g) % 13 == 4 else {}, "mig_mode": mig,
                "health": "degraded" if (n + g) % 13 == 4 else "ok", "errors": [],
            })
    mirror = {
        "root": "/var/lib/llmgw/mirror",
        "models": [
            {"ref": "llama3.2:1b", "name": "llama3.2", "tag": "1b", "size": 1321098329, "architecture": "llama",
             "quantization": "Q8_0", "parameter_count": 1235814432, "context_length": 131072,
             "digest": "sha256:" + "74701a8c35f6" + "0" * 52, "projector": None, "source_kind": "ollama"},
            {"ref": "llava:7b", "name": "llava", "tag": "7b", "size": 4733363377, "architecture": "llama",
             "quantization": "Q4_0", "parameter_count": 6738415616, "context_length": 4096,
             "digest": "sha256:" + "170370233dd5" + "0" * 52, "projector": "sha256:" + "72d6f08a42f6" + "0" * 52,
             "source_kind": "ollama"},
            {"ref": "tiny:latest", "name": "tiny", "tag": "latest", "size": 3104, "architecture": None,
             "quantization": None, "parameter_count": None, "context_length": None,
             "digest": "sha256:" + "0123456789ab" + "0" * 52, "projector": None, "source_kind": "file"},
        ],
    }
    deployments = [
        {"name": "chat", "model": "llama3.2:1b", "served_name": "chat", "engine": "llamacpp", "desired": 3, "ready": 2,
         "nodes": ["node-000", "node-001"], "message": "1 replica not placed: no node has 12.0 GB of free GPU memory",
         "replicas": [
             {"id": "chat-a1", "node": "node-000", "state": "ready", "message": None},
             {"id": "chat-b2", "node": "node-001", "state": "ready", "message": None},
         ]},
        {"name": "vision", "model": "llava:7b", "served_name": "vision", "engine": "vllm", "desired": 1, "ready": 0,
         "nodes": ["node-001"],
         "message": None, "replicas": [{"id": "vision-c3", "node": "node-001", "state": "starting",
                                        "message": "fetching the model"}]},
    ]
    return {
        "/admin/v1/endpoints": {"endpoints": eps},
        "/admin/v1/deployments": {"deployments": deployments},
        "/admin/v1/replicas/chat-a1/logs": {"replica": "chat-a1", "node": "node-000", "lines": 100,
                                            "text": "main: server is listening on http://0.0.0.0:41001\n"
                                                    "srv  update_slots: all slots are idle"},
        "/admin/v1/queues": queues,
        "/admin/v1/nodes": {"nodes": node_rows},
        "/admin/v1/gpus": {"gpus": gpu_rows},
        "/admin/v1/mirror/models": mirror,
        "/admin/v1/mirror/ollama": {"stores": [], "searched": [], "models": [], "truncated": False},
    }


def main() -> None:  # pragma: no cover - a tool
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--endpoints", type=int, default=1000)
    ap.add_argument("--gpus", type=int, default=8000, help="GPUs in all (8 a node)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    a = ap.parse_args()
    api = ReplayAPI(fleet(a.endpoints, max(1, a.gpus // 8), 8))

    async def run() -> None:
        server = HTTPServer(api, name="replay")
        host, port = await server.listen(a.host, a.port)
        print(f"http://{host}:{port}", flush=True)
        await asyncio.Event().wait()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())


if __name__ == "__main__":  # pragma: no cover
    main()
