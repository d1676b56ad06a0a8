"""``llmgw serve`` (``llmgw check-config`` is in :mod:`llmgw.cli.config`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from .. import __version__
from ..config import Config, EndpointConfig, ModelConfig, find_config, load, load_file
from ..config.loading import admin_unprotected, listeners_overlap
from ..errors import ConfigError, StartupError
from ..log import current_format, server_logger
from ._common import Fail, echo_err, hostport, run_loop

__all__ = ["DEMO_MODELS", "serve"]

# The built-in demo fleet: two models, two simulated replicas each.
DEMO_MODELS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("llama-3.1-8b", "vllm", ("llama3",)),
    ("qwen2.5-0.5b", "llamacpp", ("qwen",)),
)


def _load(config_path: str | None, listen: tuple[str, int] | None = None,
          admin: tuple[str, int] | None = None) -> tuple[Config | None, Path | None]:
    # (the flags over the file's listeners before the check: a clash they resolve is none)
    overrides = {k: f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for k, v in (("listen", listen), ("admin", admin))
                 if v is not None for h, p in (v,)}
    try:
        path = find_config(config_path)
        if path is None:
            return None, None
        # serve=True: refuse what check-config refuses (they share the check).
        return load_file(path, serve=True, overrides=overrides), path
    except ConfigError as exc:
        raise Fail(str(exc)) from None


async def _start_demo_fleet(seed: int) -> tuple[list[Any], list[EndpointConfig], dict[str, ModelConfig]]:
    from ..engines.sim import SimConfig, SimEngine

    engines: list[Any] = []
    endpoints: list[EndpointConfig] = []
    models: dict[str, ModelConfig] = {}
    for i, (model, engine, aliases) in enumerate(DEMO_MODELS):
        for r in range(2):
            sim = SimEngine(
                SimConfig(model=model, engine=engine, slots=8, ttft_ms=40.0, tokens_per_second=60.0, seed=seed + 10 * i + r)
            )
            host, port = await sim.start("127.0.0.1", 0)
            engines.append(sim)
            endpoints.append(
                EndpointConfig(
                    id=f"demo-{engine}-{r}",
                    url=f"http://{host}:{port}",
                    models=(model,),
                    engine=engine,
                    pool="demo",
                    host=host,
                    port=port,
                )
            )
        models[model] = ModelConfig(name=model, aliases=aliases)
    return engines, endpoints, models


def _demo_control(cfg: Config) -> Config:
    """The demo's control plane: a free loopback port, a random join token, a 2 s heartbeat,
    deployments kept in memory (the demo leaves nothing behind)."""
    import secrets

    from ..config import ControlConfig

    control = ControlConfig(
        listen=("127.0.0.1", 0), join_tokens=(secrets.token_urlsafe(24),), heartbeat_interval=2.0, heartbeat_grace=6.0,
        database="sqlite::memory:",
    )
    return dataclasses.replace(cfg, control=control)


async def _start_demo_agent(
    runtime: Any, cfg: Config
) -> tuple[Callable[[], None], asyncio.Future[None], int] | None:
    """One in-process agent on simulated GPUs, registered with the demo's control plane.

    It runs on the control plane's thread (gRPC stays off the data path's loop):
    ``(stop, done, control port)``, ``stop()`` callable from the main loop. Like a real
    node's agent it runs the replicas placed on it (``llmgw ctl deploy``), with its state in
    a temporary directory removed when it stops: an engine this machine lacks is reported
    as the replica's failure, as on any node.
    """
    import shutil
    import tempfile

    from ..agent.client import AgentClient
    from ..control.service import ControlPlane
    from ..launch.supervisor import ReplicaSupervisor
    from .agent import engine_checker, mirror_access, open_gpu_source

    cp = next((c for c in runtime.components if isinstance(c, ControlPlane)), None)
    if cp is None or cp.address is None or cfg.control is None:
        return None
    thread = cp.thread
    if thread is None:
        return None
    # (llmgw.agent.discovery's simulated source: every display says it is simulated)
    source = open_gpu_source("simulated", node="demo-node")
    state = tempfile.mkdtemp(prefix="llmgw-demo-node-")
    holder: list[AgentClient] = []
    supervisor = ReplicaSupervisor(state, on_change=lambda: holder[0].poke() if holder else None)
    fetchers: list[Any] = []  # (mirror models are fetched over the admin listener, as a real node's are)
    client = AgentClient(f"127.0.0.1:{cp.address[1]}", "demo-node", cfg.control.join_tokens[0], source,
                         supervisor=supervisor, on_registered=mirror_access(supervisor, state, fetchers),
                         engine_checker=engine_checker(None, "simulated", None),  # (as any node's agent)
                         drain_timeout=0.0)  # (the process it would drain to is the one stopping)
    holder.append(client)
    stop = asyncio.Event()  # bound to the control loop by its first wait there

    async def run() -> None:
        try:
            await client.run(stop, reason=lambda: "demo stopped")
        finally:
            try:
                await supervisor.close(stop=True)
                for f in fetchers:
                    await f.close()
            finally:
                shutil.rmtree(state, ignore_errors=True)

    done = thread.run(run())
    return (lambda: thread.call(stop.set)), done, cp.address[1]


async def _serve(cfg: Config, demo: bool) -> int:
    from ..runtime import GatewayRuntime, components_for

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    runtime: GatewayRuntime | None = None

    def on_signal() -> None:
        # The first SIGINT/SIGTERM shuts down gracefully; a second one (Ctrl-C again,
        # as with uvicorn) ends the requests still running now instead of at
        # server.shutdown_timeout: each still gets an answer (an SSE error event, a 503).
        if not stop.is_set():
            stop.set()
            return
        echo_err("llmgw: stopping now (ending the requests still running)")
        if runtime is not None:
            runtime.hurry()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    engines: list[Any] = []
    agent: tuple[Callable[[], None], asyncio.Future[None], int] | None = None
    try:
        if demo:
            engines, endpoints, models = await _start_demo_fleet(seed=1)
            cfg = dataclasses.replace(cfg, endpoints=tuple(endpoints), models=models)
            cfg = _demo_control(cfg)
        runtime = GatewayRuntime(cfg, components=components_for(cfg))
        starting = asyncio.ensure_future(runtime.start())
        stopping = asyncio.ensure_future(stop.wait())
        try:
            # (a start can wait: control.database_wait for a PostgreSQL not up yet; a stop meanwhile ends it)
            await asyncio.wait((starting, stopping), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
        if not starting.done():
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConfigError, StartupError, OSError):
                await starting
            echo_err("llmgw: stopped before the start finished")
            return 0
        try:
            starting.result()
        except (ConfigError, StartupError) as exc:
            raise Fail(str(exc)) from None
        except OSError as exc:
            said = str(exc.strerror or exc)
            ours = [f"{h}:{p}" for h, p in (cfg.listen, cfg.admin)]
            # (an address in use is named in the error; a name that does not resolve is not)
            where = "" if any(a in said for a in ours) else f"listening on {' and '.join(ours)}: "
            raise Fail(f"{said} ({where}choose another address with --listen / --admin)") from None
        assert runtime.listen_addr is not None and runtime.admin_addr is not None
        # PERF: what start-up made (modules, config schemas, grpc, the fleet) lives as long as the
        # process: out of the collector's sight, a full collection scans only what came since, so
        # it no longer holds the event loop for ~30 ms (seen under bench/cluster_scale.py).
        gc.collect()
        gc.freeze()
        host, port = runtime.listen_addr
        ahost, aport = runtime.admin_addr
        base = f"http://{host}:{port}"
        json_logs = current_format() == "json"
        # (with the access log on, stdout is its JSON lines alone: a log shipper reads it as such)
        banner_err = cfg.access_log.enabled

        def say(line: str, hint: bool = False) -> None:
            # --log-format json: stdout carries the access log alone; the banner is log records on stderr.
            if not json_logs:
                click.echo(line, err=banner_err)
            elif not hint:
                server_logger.info("%s", line.strip())

        say(f"llmgw {__version__}: gateway on {base}  (admin http://{ahost}:{aport}; Ctrl-C stops)")
        if demo:
            say("demo fleet (no config file given and no ./llmgw.yaml):")
            for model, engine, aliases in DEMO_MODELS:
                eps = [ep for ep in cfg.endpoints if model in ep.models]
                addrs = ", ".join(ep.address for ep in eps)
                say(f"  {model} (alias {', '.join(aliases)}): {len(eps)} simulated {engine} replicas at {addrs}")
            agent = await _start_demo_agent(runtime, cfg)
            if agent is not None:
                say(
                    f"  control plane on grpc://127.0.0.1:{agent[2]} with one local agent, demo-node, on 2 "
                    f"SIMULATED GPUs (llmgw ctl --admin http://{ahost}:{aport} nodes / gpus)"
                )
        first = cfg.model_names()[0] if cfg.model_names() else "MODEL"
        key = ' -H "authorization: Bearer $LLMGW_KEY"' if cfg.auth.enabled else ""
        say("try:", hint=True)
        say(
            f"  curl -s {base}/v1/chat/completions -H 'content-type: application/json'{key} "
            f"-d '{{\"model\": \"{first}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'",
            hint=True,
        )
        sys.stdout.flush()
        # PERF: what start-up allocated lives as long as the process; keep the
        # collector's full passes from walking it again and again.
        gc.collect()
        gc.freeze()

        uninstall = runtime.install_sighup()
        try:
            await stop.wait()
        finally:
            uninstall()
        echo_err(
            f"llmgw: shutting down (finishing in-flight requests for up to {cfg.server.shutdown_timeout:g}s; "
            "Ctrl-C again to stop now)"
        )
        if agent is not None:
            agent[0]()
            try:
                await asyncio.wait_for(agent[1], 5.0)
            except Exception as exc:  # the demo agent must not hold up the shutdown
                echo_err(f"llmgw: the demo agent stopped badly: {exc}")
            agent = None
        await runtime.stop()
    finally:
        if agent is not None:
            agent[1].cancel()
        for sim in engines:
            await sim.stop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return 0


def _grpc_defaults() -> None:
    """Settings of gRPC's core for a control plane, made before gRPC is first imported.

    PERF: grpcio 1.85's EventEngine listener costs the control plane's server about a
    tenth more CPU than the listener it replaces: 1,000 agents heartbeating every 5 s took
    5.5 and 5.47 % of a core with it, 4.73 and 4.97 % without (``bench/cluster_scale.py``,
    alternated; a bare grpc.aio stream server 3.8-4.1 % against 2.6-2.8 %). Only for the
    grpcio minor it was measured on (a name a later one no longer knows is an error line at
    every start), and never over the operator's own ``GRPC_EXPERIMENTS``.
    """
    if "GRPC_EXPERIMENTS" in os.environ:
        return
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = version("grpcio").split(".")[:2]
    except (PackageNotFoundError, ValueError):
        return
    if (major, minor) == ("1", "85"):
        os.environ["GRPC_EXPERIMENTS"] = "-event_engine_listener"


@click.command()
@click.option(
    "-c", "--config", "config_path", metavar="FILE", help="YAML config (default: ./llmgw.yaml, else the demo fleet)."
)
@click.option("--listen", callback=hostport, metavar="HOST:PORT", help="Client address (default 127.0.0.1:8080).")
@click.option("--admin", callback=hostport, metavar="HOST:PORT", help="Admin address (default 127.0.0.1:9090).")
def serve(config_path: str | None, listen: tuple[str, int] | None, admin: tuple[str, int] | None) -> None:
    """Run the gateway.

    With no config file (none given and no ./llmgw.yaml) it starts a built-in
    demo fleet: simulated engines for two models, two replicas each, on free
    loopback ports, with the gateway in front of them, and a control plane with
    one local agent on simulated GPUs (llmgw ctl nodes / gpus show them).
    """
    _grpc_defaults()
    cfg, _path = _load(config_path, listen, admin)
    demo = cfg is None
    if cfg is None:
        cfg = load({})
    if listen is not None:
        cfg = dataclasses.replace(cfg, listen=listen)
    if admin is not None:
        cfg = dataclasses.replace(cfg, admin=admin)
    why = listeners_overlap(cfg.listen, cfg.admin) or (admin_unprotected(cfg) if admin is not None else None)
    if why is not None:
        raise Fail(f"--admin {why}" if admin is not None and not why.startswith("the client") else why)
    sys.exit(run_loop(_serve(cfg, demo)))
