"""A real gateway for the console tests: simulated engines, a control plane with registered nodes,
a mirror, a hand-made Ollama store; and the console driven by Textual's Pilot."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
for sub in ("mirror", "control"):  # the mirror tests' Ollama store, the control tests' registrations
    if str(HERE.parent / sub) not in sys.path:
        sys.path.insert(0, str(HERE.parent / sub))

import grpc  # noqa: E402
import yaml  # noqa: E402
from cp_helpers import TOKEN, free_port  # noqa: E402
from mirror_helpers import OllamaStore, minimal_gguf, sha  # noqa: E402
from scenario import discovery_of, h100s  # noqa: E402

from llmgw._proto.agent.v1 import agent_pb2_grpc  # noqa: E402
from llmgw.agent.wire import PROTOCOL, discovery_to_proto, pb  # noqa: E402
from llmgw.config import load_file  # noqa: E402
from llmgw.engines.sim import SimConfig, SimEngine  # noqa: E402
from llmgw.runtime import GatewayRuntime, components_for  # noqa: E402

__all__ = ["Gateway", "gateway", "wait_for"]


async def wait_for(cond: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Poll ``cond`` until truthy (bounded); for state that changes in another task."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if asyncio.iscoroutine(v):
            v = await v
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


async def register(port: int, name: str, spec: dict[str, Any]) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = agent_pb2_grpc.AgentServiceStub(ch)
        req = pb.RegisterRequest(node_name=name, agent_version="test", protocol=pb.ProtocolVersion(major=PROTOCOL[0], minor=PROTOCOL[1]),
                                 discovery=discovery_to_proto(discovery_of(spec)))
        await stub.Register(req, metadata=[("authorization", f"Bearer {TOKEN}")], timeout=5)


def ollama_store(root: Path) -> OllamaStore:
    """An Ollama store with one good model, one with a corrupt blob, one stored as safetensors."""
    store = OllamaStore(root)
    store.add_model("tiny", gguf=minimal_gguf(elements=64))
    broken = minimal_gguf(elements=32)
    store.add_model("broken", gguf=broken)
    data = bytearray(broken)
    data[-3] ^= 0x01  # a flipped bit in the weights: same size, wrong digest
    store.blob_path(sha(broken)).write_bytes(bytes(data))
    store.write_manifest([{**store.layer("tensor", b"\x08\x00" * 50), "name": "w"}],
                         {"model_format": "safetensors"}, model="newengine")
    return store


@dataclass
class Gateway:
    runtime: GatewayRuntime
    engines: list[SimEngine]
    url: str
    control_port: int
    config_path: Path

    @property
    def admin_port(self) -> int:
        assert self.runtime.admin_addr is not None
        return self.runtime.admin_addr[1]


def write_config(path: Path, engines: list[tuple[str, int]], *, admin_port: int = 0, control_port: int | None = None,
                 mirror: Path | None = None, admin_token: str | None = None, grace: str = "60s") -> Path:
    doc: dict[str, Any] = {
        "listen": "127.0.0.1:0",
        "admin": f"127.0.0.1:{admin_port}",
        "endpoints": [{"id": name, "url": f"http://127.0.0.1:{port}", "model": "sim-model", "engine": "vllm",
                       "pool": "gpu"} for name, port in engines],
        "scrape": {"interval": "100ms", "timeout": "90ms", "stale_after": "5s"},
    }
    if control_port is not None:
        doc["control"] = {"listen": f"127.0.0.1:{control_port}", "join_token": TOKEN,
                          "heartbeat_interval": "10s" if grace == "60s" else "0.1s", "heartbeat_grace": grace}
    if mirror is not None:
        doc["mirror"] = {"root": str(mirror)}
    if admin_token is not None:
        doc["admin_token"] = admin_token
    path.write_text(yaml.safe_dump(doc))
    return path


@contextlib.asynccontextmanager
async def gateway(tmp: Path, *, control: bool = True, admin_port: int = 0, nodes: bool = True,
                  admin_token: str | None = None, grace: str = "60s") -> AsyncIterator[Gateway]:
    """Two simulated vLLM replicas behind a gateway (config from a file, so reload works).

    ``grace``: the control plane's heartbeat grace (the nodes registered here send no heartbeat: a
    short one puts them past it, unhealthy, soon after).
    """
    engines: list[SimEngine] = []
    rt: GatewayRuntime | None = None
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        ports = []
        for i, name in enumerate(("sim-a", "sim-b")):
            sim = SimEngine(SimConfig(model="sim-model", engine="vllm", slots=4, ttft_ms=5.0, seed=i))
            _, port = await sim.start("127.0.0.1", 0)
            engines.append(sim)
            ports.append((name, port))
        cport = free_port() if control else None
        path = write_config(tmp / "llmgw.yaml", ports, admin_port=admin_port, control_port=cport,
                            mirror=tmp / "mirror", admin_token=admin_token, grace=grace)
        cfg = load_file(path)
        rt = GatewayRuntime(cfg, components=components_for(cfg))
        await rt.start()
        gw = Gateway(rt, engines, "", cport or 0, path)
        gw.url = f"http://127.0.0.1:{gw.admin_port}"
        if control and nodes:
            assert cport is not None
            await register(cport, "node-a", {"hostname": "host-a", "source": "nvml", "gpus": h100s(2)})
            await register(cport, "node-b", {"hostname": "host-b", "gpus": [
                {"uuid": "GPU-mig", "index": 0, "name": "NVIDIA A100", "mig_mode": True, "memory_total_bytes": 2**30}]})
        yield gw
    finally:
        if rt is not None:
            await rt.stop()
        for e in engines:
            await e.stop()
