"""What the stand-ins share: the test switches, a parser that can lack flags, and serving the simulated engine."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from typing import Any

__all__ = ["Parser", "lacking", "serve"]


def lacking() -> set[str]:
    return {f.strip() for f in os.environ.get("LLMGW_STANDIN_LACKS", "").split(",") if f.strip()}


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose ``add_argument`` drops the flags ``LLMGW_STANDIN_LACKS`` names."""

    def add_argument(self, *names: Any, **kw: Any) -> Any:
        gone = lacking()
        kept = [n for n in names if n not in gone]
        if names and not kept:
            return None
        return super().add_argument(*kept, **kw)


async def _serve(engine: str, model: str, host: str, port: int, api_key: str | None, metrics: bool,
                 slots: int, max_model_len: int) -> int:
    from llmgw.engines.sim import SimConfig, SimEngine

    delay = float(os.environ.get("LLMGW_STANDIN_STARTUP_DELAY", "0") or 0)
    tps = float(os.environ.get("LLMGW_STANDIN_TOKENS_PER_SECOND", "500") or 500)
    if os.environ.get("LLMGW_STANDIN_NO_METRICS"):
        metrics = False
    cfg = SimConfig(model=model, engine=engine, api_key=api_key, metrics=metrics, slots=slots,
                    max_model_len=max_model_len, startup_delay=delay, ttft_ms=5.0, tokens_per_second=tps,
                    keepalive_timeout=5.0)
    eng = SimEngine(cfg)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        h, p = await eng.start(host, port)
    except OSError as exc:
        print(f"error: cannot listen on {host}:{port}: {exc.strerror or exc}", file=sys.stderr, flush=True)
        return 1
    print(f"llmgw stand-in for {engine}: serving {model!r} on http://{h}:{p} (simulated engine)", flush=True)
    await stop.wait()
    await eng.stop(timeout=5.0)
    print("shutting down", flush=True)
    return 0


def serve(engine: str, model: str, host: str, port: int, *, api_key: str | None, metrics: bool,
          slots: int = 8, max_model_len: int = 4096) -> int:
    return asyncio.run(_serve(engine, model, host, port, api_key, metrics, slots, max_model_len))
