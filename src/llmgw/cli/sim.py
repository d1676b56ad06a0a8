"""``llmgw sim-engine``: run one simulated inference engine."""

from __future__ import annotations

import asyncio
import signal
import sys
from typing import Any

import click

from ..engines import ENGINES, SIMULATED_ENGINES
from ..errors import ConfigError
from ._common import Fail, hostport, run_loop

__all__ = ["sim_engine"]


async def _serve(cfg: Any, host: str, port: int) -> int:
    from ..engines.sim import SimEngine

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    eng = SimEngine(cfg)
    try:
        try:
            bound = await eng.start(host, port)
        except OSError as exc:
            raise Fail(exc.strerror or str(exc)) from None
        h, p = bound
        where = f"[{h}]:{p}" if ":" in h else f"{h}:{p}"
        click.echo(
            f"llmgw sim-engine: simulated {ENGINES[cfg.engine].title} serving {cfg.model!r} "
            f"on http://{where} (metrics {'at ' + ENGINES[cfg.engine].metrics_path if cfg.metrics else 'off'})"
        )
        sys.stdout.flush()
        await stop.wait()
    finally:
        await eng.stop(timeout=5.0)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return 0


@click.command("sim-engine")
@click.option("--listen", callback=hostport, metavar="HOST:PORT",
              help="Address to listen on; port 0 picks a free one.  [default: 127.0.0.1:<engine's port>]")
@click.option("--model", required=True, metavar="NAME", help="Served model name (what /v1/models lists).")
@click.option("--engine", type=click.Choice(SIMULATED_ENGINES), default="vllm", show_default=True,
              help="Engine whose API, errors, auth rules and /metrics dialect to simulate.")
@click.option("--api-key", metavar="KEY", envvar="LLMGW_SIM_API_KEY",
              help="Require this key, checked as the engine checks it (trtllm: ignored, with a warning).")
@click.option("--slots", type=click.IntRange(1), default=8, show_default=True,
              help="Requests generating at once.")
@click.option("--max-queue", type=click.IntRange(-1), default=1024, show_default=True,
              help="Requests that may wait for a slot (-1: no limit); past it: --queue-full-status.")
@click.option("--queue-full-status", type=click.Choice(["429", "503"]), default="503", show_default=True,
              help="Status when the queue is full.")
@click.option("--ttft-ms", type=click.FloatRange(0, 3_600_000), default=50.0, show_default=True,
              help="Time to first token after admission.")
@click.option("--tokens-per-second", type=click.FloatRange(0, min_open=True), default=50.0, show_default=True,
              help="Decode speed of each stream.")
@click.option("--seed", type=int, default=0, show_default=True, help="Makes tokens and fault draws reproducible.")
@click.option("--max-model-len", type=click.IntRange(2), default=4096, show_default=True,
              help="Context length; longer requests get 400.")
@click.option("--kv-tokens", type=click.IntRange(0), default=0,
              help="KV-cache capacity in tokens.  [default: slots * max-model-len]")
@click.option("--startup-delay", type=click.FloatRange(0, 86_400), default=0.0, show_default=True,
              help="Seconds of simulated model loading (/health and inference answer 503; llamacpp: /metrics "
                   "too).")
@click.option("--no-metrics", is_flag=True, help="Serve no Prometheus page (404), like llama-server without --metrics.")
@click.option("--embedding-dim", type=click.IntRange(1, 65_536), default=384, show_default=True,
              help="Length of /v1/embeddings vectors.")
@click.option("--keepalive-timeout", type=click.FloatRange(0.01, 86_400), default=300.0, show_default=True,
              help="Close idle keep-alive connections after this many seconds (uvicorn-based engines: 5).")
@click.option("--drop-rate", type=click.FloatRange(0, 1), default=0.0,
              help="Fault: probability of closing the connection, unanswered, once a request arrived.")
@click.option("--drop-next", type=click.IntRange(0), default=0, help="Fault: drop the next N requests so.")
@click.option("--drop-how", type=click.Choice(["reset", "eof"]), default="reset", show_default=True,
              help="Fault: how a drop closes (a TCP reset, or an end of stream).")
@click.option("--error-rate", type=click.FloatRange(0, 1), default=0.0, help="Fault: probability of a 5xx answer.")
@click.option("--error-next", type=click.IntRange(0), default=0, help="Fault: the next N requests get a 5xx.")
@click.option("--error-status", type=click.IntRange(500, 599), default=500, show_default=True,
              help="Fault: the status of injected errors.")
@click.option("--cut-after-chunks", type=click.IntRange(0), default=None,
              help="Fault: cut streams (TCP abort) after N SSE events (for every request unless --cut-rate/--cut-next).")
@click.option("--cut-rate", type=click.FloatRange(0, 1), default=None, help="Fault: probability of a cut.")
@click.option("--cut-next", type=click.IntRange(0), default=None, help="Fault: cut the next N requests.")
@click.option("--hang-after-chunks", type=click.IntRange(0), default=None,
              help="Fault: hang streams after N SSE events (every request unless --hang-rate/--hang-next).")
@click.option("--hang-rate", type=click.FloatRange(0, 1), default=None,
              help="Fault: probability that a request hangs (holds its slot, never answers).")
@click.option("--hang-next", type=click.IntRange(0), default=None, help="Fault: hang the next N requests.")
@click.option("--extra-latency-ms", type=click.FloatRange(0, 3_600_000), default=0.0,
              help="Fault: added to every request's time to first token.")
def sim_engine(listen: tuple[str, int] | None, model: str, engine: str, api_key: str | None, slots: int,
               max_queue: int, queue_full_status: str, ttft_ms: float, tokens_per_second: float, seed: int,
               max_model_len: int, kv_tokens: int, startup_delay: float, no_metrics: bool, embedding_dim: int,
               keepalive_timeout: float, drop_rate: float, drop_next: int, drop_how: str, error_rate: float, error_next: int, error_status: int, cut_after_chunks: int | None,
               cut_rate: float | None, cut_next: int | None, hang_after_chunks: int | None,
               hang_rate: float | None, hang_next: int | None, extra_latency_ms: float) -> None:
    """Run a simulated inference engine (vLLM, llama.cpp, TensorRT-LLM or SGLang).

    It serves the OpenAI API (chat, completions, embeddings, models), schedules
    requests into --slots with a bounded queue, and reports /metrics in the
    engine's own dialect. Faults can also be switched at run time with
    POST /sim/faults; GET /sim/state shows the live state. See docs/sim-engine.md.

    \b
    Example:
      llmgw sim-engine --listen 127.0.0.1:8001 --model llama-3-8b --engine vllm --slots 4
    """
    from ..engines.sim import SimConfig, SimFaults

    host, port = listen if listen is not None else ("127.0.0.1", ENGINES[engine].default_port)
    faults = SimFaults()
    changes: dict[str, Any] = {
        "error_rate": error_rate, "error_next": error_next, "error_status": error_status,
        "extra_latency_ms": extra_latency_ms, "drop_rate": drop_rate, "drop_next": drop_next, "drop_how": drop_how,
    }
    for key, value in (("cut_after_chunks", cut_after_chunks), ("cut_rate", cut_rate), ("cut_next", cut_next),
                       ("hang_after_chunks", hang_after_chunks), ("hang_rate", hang_rate),
                       ("hang_next", hang_next)):
        if value is not None:
            changes[key] = value
    try:
        faults.update(changes)
        cfg = SimConfig(
            model=model, engine=engine, api_key=api_key, slots=slots, max_queue=max_queue,
            queue_full_status=int(queue_full_status), ttft_ms=ttft_ms, tokens_per_second=tokens_per_second,
            seed=seed, max_model_len=max_model_len, kv_tokens=kv_tokens, startup_delay=startup_delay,
            metrics=not no_metrics, embedding_dim=embedding_dim, keepalive_timeout=keepalive_timeout, faults=faults,
        )
    except ConfigError as exc:
        flag = "--" + exc.key.replace("_", "-") if exc.key else "a flag"
        raise click.UsageError(f"{flag}: {exc.message}") from None
    sys.exit(run_loop(_serve(cfg, host, port)))
