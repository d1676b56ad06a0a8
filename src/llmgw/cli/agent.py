"""``llmgw agent``: the node agent (register with a control plane, report this node's GPUs).

    llmgw agent --control cp0:7070 --token-env LLMGW_JOIN_TOKEN --tls-ca /etc/llmgw/ca.pem
    llmgw agent --control cp0:7070,cp1:7070,cp2:7070 ...   (HA: the agent follows the leader)
    llmgw agent --config /etc/llmgw/agent.yaml

Flags override the ``--config`` file. Plaintext needs a loopback control plane or
``--insecure``; ``--tls-ca``/``--tls-cert``/``--tls-key`` (or ``--tls``) turn TLS on.
The agent runs the replicas the control plane places on the node
(:mod:`llmgw.launch.supervisor`), keeping their records, logs and models under
``--state-dir``; at start it adopts the engines a previous agent left running.
SIGTERM or Ctrl-C deregisters, stops the node's replicas and exits 0.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import click

from .. import __version__
from ..config.loading import is_loopback
from ._common import Fail, hostports, run_loop

__all__ = ["NodeOptions", "agent", "open_gpu_source", "run_agent"]

GPU_SOURCE_CHOICES = ("auto", "nvml", "nvidia-smi", "none", "simulated")
# (SIGHUP: the terminal or SSH session it ran in went away: a clean stop, not a death that leaves the
# node registered and its engines running)
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass(frozen=True)
class NodeOptions:
    """How the agent runs this node's replicas (the agent config's ``state_dir``, ``engines``, ``labels``,
    ``advertise``)."""

    state_dir: str
    engines: Mapping[str, Any] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    advertise: str | None = None
    gpu_source: str = "auto"
    """Where engine checks read GPUs (the agent's own ``gpu_source``)."""
    replica_ports: tuple[int, int] | None = None
    """Where replicas listen (only there); None: any free port, preferably below the ephemeral range."""
    drain_timeout: float = 30.0
    """How long a stopping agent waits for its replicas to drain off the node (0: stop them at once)."""
    ready_timeout: float = 1800.0
    """How long a replica may take from its start to its health check's 200 (the agent file's)."""

    @property
    def bind(self) -> str:
        """Where the engines listen: the advertised address when it is an IP, else every interface."""
        if self.advertise is not None:
            try:
                return str(ipaddress.ip_address(self.advertise))
            except ValueError:
                pass
        return "0.0.0.0"

    def bind_towards(self, control: tuple[str, int]) -> str:
        """:attr:`bind`; with no ``advertise``, the address the control plane sees this node at (where
        routers are told the replicas are): this host's source address on its route to ``control``
        (a UDP socket connected, no packet sent); every interface when that cannot be told."""
        if self.advertise is not None:
            return self.bind
        import socket

        host, port = control
        try:
            info = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
            with socket.socket(info[0], socket.SOCK_DGRAM) as s:
                s.connect(info[4])
                local = str(s.getsockname()[0])
        except OSError:
            return "0.0.0.0"
        return "::" if local.startswith("fe80:") else local  # (a link-local source needs its scope: any)


def open_gpu_source(kind: str, node: str | None = None) -> Any:
    """The GPU source ``kind`` (:func:`llmgw.agent.discovery.open_source`) of node ``node``, reporting this
    agent's version."""
    from ..agent.discovery import open_source

    return open_source(kind, agent_version=__version__, node=node)


def check_tls_files(ca: str | None, cert: str | None, key: str | None) -> None:
    """Parse the TLS files the way a TLS library would use them: a file that is not PEM, or a key that
    is not the certificate's, fails here in one line, not as a handshake retried for ever.

    Raises:
        Fail: the file and what is wrong with it.
    """
    from ..config.loading import tls_pem_problems

    for option, path in (("--tls-ca", ca), ("--tls-cert", cert), ("--tls-key", key)):
        if path:
            try:
                with open(path, "rb"):
                    pass
            except OSError as exc:
                raise Fail(f"{option} {path}: cannot read it ({exc.strerror or exc})") from None
    pair, ca_why = tls_pem_problems(cert or None, key or None, ca or None, server=False)
    if ca_why is not None:
        raise Fail(f"--tls-ca {ca}: {ca_why}")
    if pair is not None:
        raise Fail(f"--tls-cert {cert} / --tls-key {key}: {pair}")


INSTANCE_FILE = "agent-instance"
LOCK_FILE = "agent.lock"


def claim_state_dir(path: str, where: str = "--state-dir") -> tuple[str, int]:
    """Make the state directory (mode 0700) and hold it for this process: ``(instance, lock fd)``.

    The lock (``flock`` on ``agent.lock``, released when the process ends, however it ends) keeps a
    second agent off the directory the first one's replicas live in. The instance is this agent's
    identity towards the control plane (``agent_instance``), made once and kept here, so an agent
    restarted after a crash takes its node straight back, while an agent elsewhere given the same
    ``--name`` is refused it.

    Raises:
        Fail: the directory cannot be made or written, or another agent holds it.
    """
    import fcntl
    import uuid

    def unusable(exc: OSError) -> Fail:
        return Fail(f"{where} {path}: cannot use it ({exc.strerror or exc}): give a directory this user "
                    "can write (under systemd: StateDirectory=llmgw-agent, as deploy/systemd/llmgw-agent.service has)")

    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise unusable(exc) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode("ascii", "replace").strip()
        os.close(fd)
        raise Fail(f"another llmgw agent{f' (pid {holder})' if holder.isdigit() else ''} runs with --state-dir "
                   f"{path}: stop it, or give this agent its own --state-dir (and its own --name)") from None
    except OSError as exc:
        os.close(fd)
        raise unusable(exc) from None
    ipath = os.path.join(path, INSTANCE_FILE)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            with open(ipath, encoding="ascii") as f:
                instance = f.read().strip()
        except (FileNotFoundError, UnicodeDecodeError):
            instance = ""
        if not (0 < len(instance) <= 64 and instance.isalnum()):
            instance = uuid.uuid4().hex
            tmp = f"{ipath}.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="ascii") as f:
                f.write(instance + "\n")
            os.replace(tmp, ipath)
    except OSError as exc:
        os.close(fd)
        raise unusable(exc) from None
    return instance, fd


def _target(hp: tuple[str, int]) -> str:
    host, port = hp
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def engine_checker(engines: Mapping[str, Any] | None, gpu_source: str,
                   replica_ports: tuple[int, int] | None) -> Callable[[Any], Awaitable[list[dict[str, Any]]]]:
    """What answers ``llmgw ctl engine-check ENGINE --node`` on a node: the checks run with its agent's
    ``engines:``, GPU source and replica ports."""

    async def check(req: Any) -> list[dict[str, Any]]:
        from ..launch.check import engine_check

        kw: dict[str, Any] = {"timeout": req.timeout_seconds} if req.HasField("timeout_seconds") else {}
        checks = await engine_check(req.engine, engines=engines, model=req.model if req.HasField("model") else None,
                                    live=not req.static_only, gpu_source=gpu_source, replica_ports=replica_ports,
                                    **kw)
        return [c.as_dict() for c in checks]

    return check


def mirror_access(supervisor: Any, state_dir: str, fetchers: list[Any]) -> Callable[[Any], None] | None:
    """What an agent does with each registration's mirror access: the fetcher ``supervisor``
    brings mirror models with (kept in ``state_dir``/mirror; made once, appended to
    ``fetchers`` for the caller to close, and given each new registration's credential).
    None without a supervisor (an agent that only reports)."""
    if supervisor is None:
        return None

    def registered(resp: Any) -> None:
        if not resp.HasField("mirror_url"):
            return
        from ..mirror.fetch import MirrorFetcher

        try:
            if fetchers:  # (each registration brings its own credential)
                fetchers[0].set_access(resp.mirror_url, resp.mirror_credential)
                return
            fetcher = MirrorFetcher(resp.mirror_url, resp.mirror_credential, os.path.join(state_dir, "mirror"))
        except (ValueError, OSError) as exc:
            from ..log import agent_logger

            agent_logger.error("cannot fetch models from the control plane's mirror at %s: %s", resp.mirror_url, exc)
            return
        fetchers.append(fetcher)
        supervisor.fetcher = fetcher

    return registered


async def run_agent(
    control: tuple[str, int] | tuple[tuple[str, int], ...],
    name: str,
    token: str,
    source: Any,
    *,
    credentials: Any = None,
    protocol: tuple[int, int] | None = None,
    node: NodeOptions | None = None,
    supervisor: Any = None,
    instance: str | None = None,
) -> int:
    """Run the agent until SIGTERM/SIGINT (then drain the node, deregister and stop the replicas; a second
    signal stops them at once); the exit status.

    ``node``: run replicas with a :class:`~llmgw.launch.supervisor.ReplicaSupervisor` made from it
    (``supervisor``: that one instead); neither: only report the node. ``instance``: this agent's
    identity (:func:`claim_state_dir`; ``None``: a new one for this run).

    Raises:
        Fail: the control plane refused the agent (wrong token, incompatible version).
    """
    from ..agent.client import AgentClient, AgentRefused
    from ..agent.wire import PROTOCOL

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    hard = asyncio.Event()  # (a second signal: no more draining)
    why = {"reason": "stopped"}

    def on_signal(signame: str) -> None:
        if stop.is_set():
            hard.set()
            return
        why["reason"] = signame
        stop.set()

    for sig in _STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig.name)
    controls: tuple[tuple[str, int], ...] = (control,) if isinstance(control[0], str) else control
    targets = [_target(hp) for hp in controls]
    holder: list[AgentClient] = []

    def changed() -> None:
        if holder:
            holder[0].poke()

    if supervisor is None and node is not None:
        from ..launch.supervisor import ReplicaSupervisor

        ports: dict[str, Any] = ({"port_range": node.replica_ports, "strict_ports": True}
                                 if node.replica_ports is not None else {})
        supervisor = ReplicaSupervisor(node.state_dir, host=node.bind_towards(controls[0]), engines=node.engines,
                                       on_change=changed, ready_timeout=node.ready_timeout, **ports)
    fetchers: list[Any] = []
    registered = mirror_access(supervisor, node.state_dir, fetchers) if node is not None else None
    check = engine_checker(node.engines, node.gpu_source, node.replica_ports) if node is not None else None
    client = AgentClient(
        targets, name, token, source, credentials=credentials, protocol=protocol or PROTOCOL, supervisor=supervisor,
        labels=node.labels if node is not None else None, advertise=node.advertise if node is not None else None,
        on_registered=registered, engine_checker=check, instance=instance,
        drain_timeout=node.drain_timeout if node is not None else 0.0,
    )
    holder.append(client)
    stopped = False
    try:
        if supervisor is not None:
            await supervisor.adopt()
        await client.run(stop, reason=lambda: why["reason"], hard=hard)
        stopped = True
    except AgentRefused as exc:
        every = "every control plane refused this agent; " if exc.every else ""
        waited = (f"; no other control plane took it in {exc.waited:.0f}s (--control: the others did not answer "
                  "or pointed at this one)" if exc.waited is not None else "")
        raise Fail(f"{every}the control plane at {client.target} refused this agent ({exc.code.name}): {exc}"
                   f"{waited}") from None
    finally:
        if supervisor is not None:
            if not stopped and any(st.pid is not None for st in supervisor.statuses()):
                from ..log import agent_logger

                agent_logger.warning("the node's replicas are left running: the next agent started here adopts them")
            await supervisor.close(stop=stopped)
        for f in fetchers:
            await f.close()
        for sig in _STOP_SIGNALS:
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
@click.option("--state-dir", metavar="DIR",
              help="Where replicas' records, logs and models are kept (default $STATE_DIRECTORY, systemd's, "
                   "else $XDG_STATE_HOME/llmgw-agent, /var/lib/llmgw-agent as root, else "
                   "~/.local/state/llmgw-agent).")
@click.option("--label", "label_flags", metavar="KEY=VALUE", multiple=True,
              help="A node label (repeatable; added to the config file's labels:).")
@click.option("--advertise", metavar="HOST", help="Where this node's replicas are reached (default: the address "
                                                   "the control plane sees).")
@click.option("--replica-ports", metavar="LOW-HIGH", help="The ports this node's replicas listen on, only these "
                                                           "(default: any free port, preferably in 20000-32767).")
@click.option("--drain-timeout", metavar="DURATION",
              help="On SIGTERM, how long to wait for the replicas to drain off the node (their requests in flight "
                   "finish, the control plane places them elsewhere) before stopping them; 0: at once "
                   "(default 30s; a second SIGTERM stops them at once).")
def agent(
    control: tuple[tuple[str, int], ...] | None, token_env: str | None, name: str | None, gpu_source: str | None,
    config_path: str | None, use_tls: bool, tls_ca: str | None, tls_cert: str | None, tls_key: str | None,
    insecure: bool, state_dir: str | None, label_flags: tuple[str, ...], advertise: str | None,
    replica_ports: str | None, drain_timeout: str | None,
) -> None:
    """Run the node agent: report this node's GPUs to a control plane and run the replicas it places here.

    It registers (same name: same node), heartbeats on the interval the control
    plane sets, reconnects with backoff when it is away, starts and stops engines
    as the control plane's desired set says, and on SIGTERM drains them off the
    node (their requests in flight finish), deregisters and stops them. The agent
    itself listens on nothing.
    """
    token: str | None = None
    engines: Mapping[str, Any] = {}
    labels: dict[str, str] = {}
    ports: tuple[int, int] | None = None
    drain = 30.0
    ready = 1800.0
    state_flag = state_dir is not None
    secret_envs: set[str] = set()  # (the variables that hold the join token)
    if config_path is not None:
        if not config_path:
            raise Fail('--config: the path is empty (-c "$VAR" with VAR unset?): give the file')
        from ..config.agent import load_agent_file
        from ..errors import ConfigError

        try:
            file_cfg = load_agent_file(config_path, require_control=not control)  # (flags override the file)
        except ConfigError as exc:
            raise Fail(str(exc)) from None
        control = control or file_cfg.control or None
        token = file_cfg.token
        if file_cfg.token_env is not None:
            secret_envs.add(file_cfg.token_env)
        name = name or file_cfg.name
        gpu_source = gpu_source or file_cfg.gpu_source
        use_tls = use_tls or file_cfg.tls
        if tls_cert is None and tls_key is None:
            tls_cert, tls_key = file_cfg.tls_cert, file_cfg.tls_key
        tls_ca = tls_ca or file_cfg.tls_ca
        insecure = insecure or file_cfg.insecure
        state_dir = state_dir or file_cfg.state_dir
        engines = file_cfg.engines
        labels.update(file_cfg.labels)
        advertise = advertise or file_cfg.advertise
        ports = file_cfg.replica_ports
        drain = file_cfg.drain_timeout
        ready = file_cfg.ready_timeout
    from ..config.agent import _host, _labels, _port_range, default_state_dir

    for item in label_flags:
        key, eq, value = item.partition("=")
        if not eq:
            raise click.UsageError(f"--label {item!r}: expected KEY=VALUE")
        labels[key] = value
    try:
        labels = dict(_labels(labels))
        advertise = _host(advertise) if advertise is not None else None
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if replica_ports is not None:
        try:
            ports = _port_range(replica_ports)
        except ValueError as exc:
            raise click.UsageError(f"--replica-ports {exc}") from None
    if drain_timeout is not None:
        from ..config._rules import parse_duration
        from ..errors import ConfigError

        try:
            drain = parse_duration(drain_timeout)
        except ConfigError:
            raise click.UsageError(f"--drain-timeout {drain_timeout!r}: expected a duration like 30s, 2m or 0 "
                                   "(seconds)") from None
        if drain > 86400:
            raise click.UsageError(f"--drain-timeout {drain_timeout!r}: at most 24h")
    if control is None:
        raise click.UsageError("--control HOST:PORT is required (or control: in --config FILE)")
    zero = next((h for h, p in control if p == 0), None)
    if zero is not None:
        raise click.UsageError(f"--control {zero}:0: port 0 is no address to call; give the control plane's "
                               "port (its control.listen)")
    if name is not None:
        from ..agent.wire import NODE_NAME

        if NODE_NAME.fullmatch(name) is None:  # (the rule name: has in the agent's file, and the control plane's)
            raise click.UsageError(f"--name {name!r}: use letters, digits, '.', '_' or '-' (at most 128), "
                                   "starting with a letter or digit")
    if token_env is not None:
        secret_envs.add(token_env)
        token = os.environ.get(token_env)
        if token is None:
            raise Fail(f"--token-env {token_env}: the environment variable is not set (it holds the join token)")
        if not token.strip():
            raise Fail(f"--token-env {token_env}: the environment variable is empty (it holds the join token)")
        from ..errors import unsendable_secret

        why = unsendable_secret(token)
        if why is not None:  # SECURITY: never the token itself (gRPC's error would quote it)
            raise Fail(f"--token-env {token_env}: the join token {why}")
    if not token:
        raise Fail("the agent needs the join token: --token-env NAME (or token_env: in --config FILE)")
    for name_ in secret_envs:
        # SECURITY: read once; not handed down to the engines it starts, nvidia-smi, or anything else
        os.environ.pop(name_, None)
    if (tls_cert is None) != (tls_key is None):
        raise click.UsageError("--tls-cert and --tls-key go together")
    credentials = None
    if use_tls or tls_ca or tls_cert:
        from ..agent.client import TLSFiles, channel_credentials

        check_tls_files(tls_ca, tls_cert, tls_key)  # (first: its errors name the option and the file)
        try:
            credentials = channel_credentials(TLSFiles(ca=tls_ca, cert=tls_cert, key=tls_key))
        except OSError as exc:
            raise Fail(f"cannot read a TLS file: {exc}") from None
    elif not all(is_loopback(c[0]) for c in control) and not insecure:
        off = next(c[0] for c in control if not is_loopback(c[0]))
        raise Fail(
            f"{off} is not a loopback address: the join token would travel in the clear; "
            "use TLS (--tls-ca FILE, or --tls) or pass --insecure on a network you trust"
        )
    node = NodeOptions(state_dir or default_state_dir(), engines=engines, labels=labels, advertise=advertise,
                       gpu_source=gpu_source or "auto", replica_ports=ports, drain_timeout=drain,
                       ready_timeout=ready)
    where = ("--state-dir" if state_flag else "state_dir: in --config FILE" if state_dir
             else "the default state directory")
    instance, _lock = claim_state_dir(node.state_dir, where)  # (held until the process ends)
    name = name or socket.gethostname()
    source = open_gpu_source(gpu_source or "auto", node=name)
    sys.exit(run_loop(run_agent(control, name, token, source, credentials=credentials,
                                node=node, instance=instance)))
