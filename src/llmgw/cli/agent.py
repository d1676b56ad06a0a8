"""``llmgw agent``: the node agent (register with a control plane, report this node's GPUs).

    llmgw agent --control cp0:7070 --token-env LLMGW_JOIN_TOKEN --tls-ca /etc/llmgw/ca.pem
    llmgw agent --control cp0:7070,cp1:7070,cp2:7070 ...   (HA: the agent follows the leader)
    llmgw agent --config /etc/llmgw/agent.yaml

Flags override the ``--config`` file. Plaintext needs a loopback control plane or
``--insecure``; ``--tls-ca``/``--tls-cert``/``--tls-key`` (or ``--tls``) turn TLS on.
SIGTERM or Ctrl-C deregisters and exits 0.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import signal
import socket
import sys
from typing import Any

import click

from .. import __version__
from ._common import Fail, hostports, run_loop

__all__ = ["agent", "open_gpu_source", "run_agent"]

GPU_SOURCE_CHOICES = ("auto", "nvml", "nvidia-smi", "none", "simulated")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def open_gpu_source(kind: str) -> Any:
    """The GPU source ``kind`` (:func:`llmgw.agent.discovery.open_source`), reporting this agent's version."""
    from ..agent.discovery import open_source

    return open_source(kind, agent_version=__version__)


def _target(hp: tuple[str, int]) -> str:
    host, port = hp
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def run_agent(
    control: tuple[str, int] | tuple[tuple[str, int], ...],
    name: str,
    token: str,
    source: Any,
    *,
    credentials: Any = None,
    protocol: tuple[int, int] | None = None,
) -> int:
    """Run the agent until SIGTERM/SIGINT (then deregister); the exit status.

    Raises:
        Fail: the control plane refused the agent (wrong token, incompatible version).
    """
    from ..agent.client import AgentClient, AgentRefused
    from ..agent.wire import PROTOCOL

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    why = {"reason": "stopped"}

    def on_signal(signame: str) -> None:
        why["reason"] = signame
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig.name)
    controls: tuple[tuple[str, int], ...] = (control,) if isinstance(control[0], str) else control
    targets = [_target(hp) for hp in controls]
    target = ",".join(targets)
    client = AgentClient(targets, name, token, source, credentials=credentials, protocol=protocol or PROTOCOL)
    try:
        await client.run(stop, reason=lambda: why["reason"])
    except AgentRefused as exc:
        raise Fail(f"the control plane at {target} refused this agent ({exc.code.name}): {exc}") from None
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return 0


@click.command()
@click.option("--control", callback=hostports, metavar="HOST:PORT[,…]",
              help="The control plane's gRPC address; with several (HA), all of them, comma-separated.")
@click.option("--token-env", metavar="NAME", help="The environment variable holding the join token.")
@click.option("--name", metavar="NODE", help="This node's name (default: the host name).")
@click.option("--gpu-source", type=click.Choice(GPU_SOURCE_CHOICES), default=None,
              help="Where GPU readings come from (default auto: NVML, then nvidia-smi, then none).")
@click.option("-c", "--config", "config_path", metavar="FILE", help="The agent's YAML file (llmgw config schema --agent).")
@click.option("--tls", "use_tls", is_flag=True, help="Use TLS, trusting the system's CAs (implied by --tls-*).")
@click.option("--tls-ca", metavar="FILE", help="PEM CA that signed the control plane's certificate.")
@click.option("--tls-cert", metavar="FILE", help="PEM client certificate (mutual TLS).")
@click.option("--tls-key", metavar="FILE", help="PEM key of --tls-cert.")
@click.option("--insecure", is_flag=True, help="Allow plaintext to a non-loopback control plane.")
def agent(
    control: tuple[tuple[str, int], ...] | None, token_env: str | None, name: str | None, gpu_source: str | None,
    config_path: str | None, use_tls: bool, tls_ca: str | None, tls_cert: str | None, tls_key: str | None,
    insecure: bool,
) -> None:
    """Run the node agent: report this node's GPUs to a control plane.

    It registers (same name: same node), heartbeats on the interval the control
    plane sets, reconnects with backoff when it is away, and deregisters on
    SIGTERM. It listens on nothing.
    """
    token: str | None = None
    if config_path is not None:
        from ..config.agent import load_agent_file
        from ..errors import ConfigError

        try:
            file_cfg = load_agent_file(config_path)
        except ConfigError as exc:
            raise Fail(str(exc)) from None
        control = control or file_cfg.control
        token = file_cfg.token
        name = name or file_cfg.name
        gpu_source = gpu_source or file_cfg.gpu_source
        use_tls = use_tls or file_cfg.tls
        if tls_cert is None and tls_key is None:
            tls_cert, tls_key = file_cfg.tls_cert, file_cfg.tls_key
        tls_ca = tls_ca or file_cfg.tls_ca
        insecure = insecure or file_cfg.insecure
    if control is None:
        raise click.UsageError("--control HOST:PORT is required (or control: in --config FILE)")
    if token_env is not None:
        token = os.environ.get(token_env)
        if not token:
            raise Fail(f"--token-env {token_env}: the environment variable is not set (it holds the join token)")
    if not token:
        raise Fail("the agent needs the join token: --token-env NAME (or token_env: in --config FILE)")
    if (tls_cert is None) != (tls_key is None):
        raise click.UsageError("--tls-cert and --tls-key go together")
    credentials = None
    if use_tls or tls_ca or tls_cert:
        from ..agent.client import TLSFiles, channel_credentials

        try:
            credentials = channel_credentials(TLSFiles(ca=tls_ca, cert=tls_cert, key=tls_key))
        except OSError as exc:
            raise Fail(f"cannot read a TLS file: {exc}") from None
    elif not all(_is_loopback(c[0]) for c in control) and not insecure:
        off = next(c[0] for c in control if not _is_loopback(c[0]))
        raise Fail(
            f"{off} is not a loopback address: the join token would travel in the clear; "
            "use TLS (--tls-ca FILE, or --tls) or pass --insecure on a network you trust"
        )
    source = open_gpu_source(gpu_source or "auto")
    sys.exit(run_loop(run_agent(control, name or socket.gethostname(), token, source, credentials=credentials)))
