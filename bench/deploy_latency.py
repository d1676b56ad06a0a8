"""Deploy latency: ``llmgw ctl deploy`` -> the first answered request, against llama-server's own start.

    python bench/deploy_latency.py [--rounds 5] [--json FILE]

Two figures on the same tiny llama model (``llmgw.testing.gguf_model.write_tiny_llama``) and the
same engine flags (``-np 2 -c 1024 -t 1``):

* **llama-server alone**: from ``exec`` of ``llama-server`` to its first answered
  ``/v1/chat/completions`` (asked every 5 ms);
* **llmgw**: from the ``POST /admin/v1/deployments`` that ``llmgw ctl deploy`` sends, to the first
  request answered through the gateway (asked every 5 ms): placement, the desired set pushed to a
  real ``llmgw agent`` process, the model fetched from the control plane's mirror (round 1 only:
  later rounds find it in the node's store), llama-server started and ready, the status
  reported, the router following. Each round undeploys and waits until the engine is gone.

The goal (issue 18): llmgw within 1 s of llama-server's own start. The gateway and control plane run
in this process, the agent in its own; LLMGW_SHARED_DIR or $LLAMA_SERVER says where llama-server is
(``llmgw.testing.llamacpp.find_llama_server``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ARGS = ("-np", "2", "-c", "1024", "-t", "1")
CHAT = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'


def _free() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _post(port: int, path: str, body: bytes, key: str | None = None, timeout: float = 10.0) -> int:
    """One ``POST`` to 127.0.0.1:``port``; the status, 0 when the connection is refused or cut."""
    try:
        r, w = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return 0
    try:
        auth = f"authorization: Bearer {key}\r\n" if key else ""
        w.write(f"POST {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\n{auth}"
                f"content-length: {len(body)}\r\n\r\n".encode() + body)
        raw = await asyncio.wait_for(r.read(), timeout)
    except (OSError, asyncio.TimeoutError):
        return 0
    finally:
        w.close()
    try:
        return int(raw.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return 0


async def _first_answer(port: int, t0: float, key: str | None = None, limit: float = 120.0) -> float:
    while True:
        if await _post(port, "/v1/chat/completions", CHAT, key) == 200:
            return time.monotonic() - t0
        if time.monotonic() - t0 > limit:
            raise SystemExit(f"no answer within {limit:g}s")
        await asyncio.sleep(0.005)


async def engine_alone(binary: Path, model: Path) -> float:
    port, key = _free(), secrets.token_hex(16)
    t0 = time.monotonic()
    p = subprocess.Popen([str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "--api-key", key,
                          "--metrics", "--alias", "tiny", *ARGS], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        return await _first_answer(port, t0, key)
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(30)


async def through_llmgw(binary: Path, model: Path, tmp: Path, rounds: int) -> list[dict[str, float]]:
    from llmgw.config import load
    from llmgw.mirror import MirrorStore, import_file
    from llmgw.runtime import GatewayRuntime, components_for

    with MirrorStore(tmp / "cp-mirror") as store:
        import_file(store, model, name="tiny:1b")
    token = secrets.token_hex(16)
    cp_port = _free()
    cfg = load({
        "listen": "127.0.0.1:0", "admin": "127.0.0.1:0", "mirror": {"root": str(tmp / "cp-mirror")},
        "control": {"listen": f"127.0.0.1:{cp_port}", "join_token": token, "heartbeat_interval": "5s",
                    "database": f"sqlite:///{tmp}/cp.sqlite3"},
    })
    state = tmp / "agent-state"
    (tmp / "agent.yaml").write_text(
        f"control: 127.0.0.1:{cp_port}\ntoken_env: JOIN\nname: bench-node\ngpu_source: none\nadvertise: 127.0.0.1\n"
        f"state_dir: {state}\nengines:\n  llamacpp:\n    binary: {binary}\n"
    )
    rt = GatewayRuntime(cfg, components=components_for(cfg))
    await rt.start()
    assert rt.admin_addr is not None and rt.listen_addr is not None
    with open(tmp / "agent.log", "ab") as err:
        agent = subprocess.Popen([sys.executable, "-m", "llmgw", "agent", "--config", str(tmp / "agent.yaml")],
                                 env={**os.environ, "JOIN": token}, stdout=subprocess.DEVNULL, stderr=err)
    out: list[dict[str, float]] = []
    try:
        cp = rt.components[0]
        deadline = time.monotonic() + 30
        while (st := cp.nodes.get("bench-node")) is None or st.heartbeats == 0:
            if time.monotonic() > deadline:
                raise SystemExit("the agent did not register")
            await asyncio.sleep(0.05)
        body = json.dumps({"name": "tiny", "model": "tiny:1b", "engine": "llamacpp", "replicas": 1, "slots": 2,
                           "context": 1024, "args": ["-t", "1"]}).encode()
        for i in range(rounds):
            t0 = time.monotonic()
            status = await _post(rt.admin_addr[1], "/admin/v1/deployments", body)
            if status != 201:
                raise SystemExit(f"POST /admin/v1/deployments answered {status}")
            joined: list[float] = []

            async def watch_router(t0: float = t0, joined: list[float] = joined) -> None:
                while not rt.registry.endpoints:
                    await asyncio.sleep(0.002)
                joined.append(time.monotonic() - t0)

            watcher = asyncio.create_task(watch_router())
            total = await _first_answer(rt.listen_addr[1], t0)
            await watcher
            out.append({"round": i + 1, "first_answer_s": total, "in_router_s": joined[0]})
            print(f"  round {i + 1}: in the router after {joined[0]:.3f}s, first answer after {total:.3f}s"
                  f"{' (model fetched from the mirror)' if i == 0 else ''}", flush=True)
            r, w = await asyncio.open_connection("127.0.0.1", rt.admin_addr[1])
            w.write(b"DELETE /admin/v1/deployments/tiny HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            await r.read()
            w.close()
            deadline = time.monotonic() + 60
            while rt.registry.endpoints or any((state / "replicas").glob("*.json")):
                if time.monotonic() > deadline:
                    raise SystemExit("the replica did not stop after undeploy")
                await asyncio.sleep(0.05)
    finally:
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(30)
        except subprocess.TimeoutExpired:
            agent.kill()
        await rt.stop()
    return out


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path, help="write the figures here")
    a = ap.parse_args()
    from llmgw.log import setup
    from llmgw.testing.gguf_model import write_tiny_llama
    from llmgw.testing.llamacpp import find_llama_server

    setup("warning")
    binary = find_llama_server()
    with tempfile.TemporaryDirectory(prefix="llmgw-deploy-bench-") as d:
        tmp = Path(d)
        model = write_tiny_llama(tmp / "tiny.gguf", ctx=4096)
        print(f"llama-server alone ({binary}), exec -> first answer:", flush=True)
        alone = []
        for i in range(a.rounds):
            alone.append(await engine_alone(binary, model))
            print(f"  round {i + 1}: {alone[-1]:.3f}s", flush=True)
        print("llmgw: ctl deploy (POST /admin/v1/deployments) -> first answer through the router:", flush=True)
        runs = await through_llmgw(binary, model, tmp, a.rounds)
    llmgw = [r["first_answer_s"] for r in runs]
    warm = llmgw[1:] or llmgw
    res: dict[str, Any] = {
        "llama_server_alone_s": {"median": statistics.median(alone), "min": min(alone), "max": max(alone)},
        "llmgw_deploy_s": {"first_with_fetch": llmgw[0], "median_model_on_node": statistics.median(warm),
                           "min": min(warm), "max": max(warm)},
        "rounds": runs,
    }
    gap = statistics.median(warm) - statistics.median(alone)
    res["gap_s"] = gap
    print(f"\nllama-server alone: median {statistics.median(alone):.3f}s; llmgw ctl deploy: median "
          f"{statistics.median(warm):.3f}s (first, with the fetch: {llmgw[0]:.3f}s); gap {gap:+.3f}s "
          f"(goal: within 1 s) {'MET' if gap <= 1.0 else 'NOT MET'}")
    if a.json is not None:
        a.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
