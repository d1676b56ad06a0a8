"""The node agent's own file (``llmgw config schema --agent``): its schema, dataclasses and loader.

``llmgw agent --config FILE`` reads it (flags override it). It is read like
``llmgw.yaml`` (every problem in one pass, each on its YAML line), by the same
rules and problem collection. ``engines:`` says where each engine is,
``state_dir:`` where the agent keeps its replicas' records, logs and models
(:func:`default_state_dir`), ``labels:`` what deployments' node selectors match,
``advertise:`` where the node's replicas are reached, ``replica_ports:`` the ports
they listen on.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import Field

from ._problems import _document, _Problems, _section
from ._rules import (
    _ADDRESSES,
    _FLAG,
    _IDENT,
    _RUNNABLE_ENGINE,
    _TEXT,
    RUNNABLE_ENGINES,
    _Bad,
    _choice,
    _duration,
    _env,
    _EnvValue,
    _Rule,
    _text,
)
from ._yaml import _read_yaml
from .model import _SECTION, _default, _In

GPU_SOURCES = ("auto", "nvml", "nvidia-smi", "none", "simulated")
_GPU_SOURCE = _choice("gpu source", GPU_SOURCES)

_LABEL_KEY = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._/-]{0,251}[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^[^\x00-\x1f\x7f]{0,253}$")
_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")


def _labels(v: Any) -> Mapping[str, str]:
    if not isinstance(v, Mapping):
        raise _Bad("expected a mapping of label names to values, e.g. {zone: eu-1, gpu: h100}")
    if len(v) > 64:
        raise _Bad("at most 64 labels")
    out: dict[str, str] = {}
    for k, value in v.items():
        if not isinstance(k, str) or not _LABEL_KEY.fullmatch(k):
            raise _Bad(f"label {k!r}: use letters, digits, '.', '_', '/' or '-' (at most 253), "
                       "starting and ending with a letter or digit")
        text = _text(value)
        if not _LABEL_VALUE.fullmatch(text):
            raise _Bad(f"label {k}: the value must be at most 253 characters without control characters")
        out[k] = text
    return out


def _host(v: Any) -> str:
    s = _text(v).strip()
    try:
        return str(ipaddress.ip_address(s[1:-1] if s.startswith("[") and s.endswith("]") else s))
    except ValueError:
        pass
    if not _HOST.fullmatch(s) or s.replace(".", "").isdigit():
        raise _Bad(f"{s!r} is not a host name or IP address (no port: the agent picks each replica's)")
    return s


def _port_range(v: Any) -> tuple[int, int]:
    s = _text(v).strip()
    lo_s, dash, hi_s = s.partition("-")
    if not dash or not lo_s.strip().isdigit() or not hi_s.strip().isdigit():
        raise _Bad(f"{s!r}: expected a port range LOW-HIGH, e.g. 20000-20999")
    lo, hi = int(lo_s), int(hi_s)
    if not 1 <= lo <= hi <= 65535:
        raise _Bad(f"{s!r}: expected 1 <= LOW <= HIGH <= 65535")
    return lo, hi


_PORT_RANGE = _Rule(_port_range, {"type": "string", "pattern": r"^\s*[0-9]{1,5}\s*-\s*[0-9]{1,5}\s*$",
                                  "examples": ["20000-20999"]})
_LABELS = _Rule(_labels, {"type": "object", "additionalProperties": {"type": "string", "maxLength": 253},
                          "maxProperties": 64})
_ADVERTISE = _Rule(_host, {"type": "string", "examples": ["10.0.0.5", "gpu-node-3.example.net"]})


def default_state_dir() -> str:
    """Where the agent keeps its replicas' state, logs and models when ``state_dir:`` is not set:
    ``$STATE_DIRECTORY`` (systemd's ``StateDirectory=``) when that is set, else
    ``$XDG_STATE_HOME/llmgw-agent``, else ``/var/lib/llmgw-agent`` as root, else
    ``~/.local/state/llmgw-agent``."""
    systemd = os.environ.get("STATE_DIRECTORY", "").split(":")[0]
    if systemd:
        return systemd
    xdg = os.environ.get("XDG_STATE_HOME")
    if xdg:
        return os.path.join(xdg, "llmgw-agent")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        return "/var/lib/llmgw-agent"
    return os.path.join(os.path.expanduser("~"), ".local", "state", "llmgw-agent")


@dataclass(frozen=True, slots=True)
class AgentEngineConfig:
    """How the node agent starts one engine (``engines.<name>``)."""

    binary: Annotated[str, _TEXT] | None = None
    """The engine's executable (e.g. llama-server); default: found on PATH."""
    python: Annotated[str, _TEXT] | None = None
    """The Python interpreter whose environment has the engine (vllm, sglang)."""

    __pydantic_config__ = _SECTION


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """The node agent's own file (``llmgw agent --config FILE``)."""

    control: tuple[tuple[str, int], ...]
    """Every control plane's address (one, or all of an HA set: the agent follows the leader)."""
    token: str | None = field(default=None, repr=False)
    token_env: str | None = None  # the variable that held it (the agent takes it out of its environment)
    name: str | None = None  # None: the host name
    gpu_source: str = "auto"
    tls: Annotated[bool, _FLAG] = False
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    insecure: Annotated[bool, _FLAG] = False
    engines: Mapping[str, AgentEngineConfig] = field(default_factory=dict)
    state_dir: str | None = None  # None: default_state_dir()
    labels: Mapping[str, str] = field(default_factory=dict)
    advertise: str | None = None  # None: the address the control plane sees the agent at
    replica_ports: tuple[int, int] | None = None  # None: the supervisor's default, loosely
    drain_timeout: float = 30.0
    ready_timeout: float = 1800.0
    source: str | None = None


class _AgentIn(_In):
    """The llmgw node agent's configuration (llmgw agent --config FILE; its flags override it)."""

    control: Annotated[tuple[tuple[str, int], ...], _ADDRESSES]
    """The control plane's address, HOST:PORT, or a list of every control plane's (HA: the agent follows the
    leader)."""
    token_env: Annotated[_EnvValue, _env(None)] | None = None
    """The environment variable holding the join token."""
    name: Annotated[str, _IDENT] | None = _default(AgentConfig, "name")
    """This node's name (default: the host name)."""
    gpu_source: Annotated[str, _GPU_SOURCE] = _default(AgentConfig, "gpu_source")
    """Where GPU telemetry comes from: auto (NVML, then nvidia-smi, then none), nvml, nvidia-smi, none, or
    simulated (stand-in GPUs that say so: demos and tests)."""
    tls: Annotated[bool, _FLAG] = _default(AgentConfig, "tls")
    """Use TLS, trusting the system's CAs (implied by tls_ca / tls_cert)."""
    tls_ca: Annotated[str, _TEXT] | None = _default(AgentConfig, "tls_ca")
    """PEM CA that signed the control plane's certificate."""
    tls_cert: Annotated[str, _TEXT] | None = _default(AgentConfig, "tls_cert")
    """PEM client certificate (mutual TLS); needs tls_key."""
    tls_key: Annotated[str, _TEXT] | None = _default(AgentConfig, "tls_key")
    """PEM key of tls_cert."""
    insecure: Annotated[bool, _FLAG] = _default(AgentConfig, "insecure")
    """Allow plaintext to a control plane that is not on loopback (a network you trust)."""
    engines: dict[Annotated[str, _RUNNABLE_ENGINE], AgentEngineConfig] = Field(
        default_factory=dict, json_schema_extra={"propertyNames": {"enum": list(RUNNABLE_ENGINES)}}
    )
    """Per engine, how to start it."""
    state_dir: Annotated[str, _TEXT] | None = _default(AgentConfig, "state_dir")
    """Where the agent keeps its replicas' records, their log files and the models fetched from the control
    plane's mirror (default $STATE_DIRECTORY, systemd's, when set, else $XDG_STATE_HOME/llmgw-agent when set,
    else /var/lib/llmgw-agent as root, else
    ~/.local/state/llmgw-agent). A restarted agent
    finds the replicas still running there and adopts them."""
    labels: Annotated[Mapping[str, str], _LABELS] = Field(default_factory=dict)
    """This node's labels, e.g. {zone: eu-1}: deployments' node_labels select nodes by them."""
    advertise: Annotated[str, _ADVERTISE] | None = _default(AgentConfig, "advertise")
    """The host name or IP where this node's replicas are reached (the engines listen there); default: the
    address the control plane sees the agent at, with the engines listening on every interface."""
    replica_ports: Annotated[tuple[int, int], _PORT_RANGE] | None = _default(AgentConfig, "replica_ports")
    """The ports this node's replicas listen on, LOW-HIGH (a firewall's opening between routers and nodes): only
    these are used, a replica failing to start when none is free. Default: any free port, preferably in
    20000-32767 (below the kernel's ephemeral ports)."""
    drain_timeout: Annotated[float, _duration(0.0, 86400.0)] = _default(AgentConfig, "drain_timeout")
    """How long a stopping agent (SIGTERM) waits for its replicas to drain off the node (their requests in
    flight finish; the control plane places them elsewhere) before it stops them; a second SIGTERM stops them
    at once; 0: stop them at once (default 30s)."""
    ready_timeout: Annotated[float, _duration(1.0, 7 * 86400.0)] = _default(AgentConfig, "ready_timeout")
    """How long a replica's engine may take from its start to answering its health check before the replica
    fails (loading a large model from slow storage takes long; default 30m)."""


def load_agent(data: Any, source: str | None = None, require_control: bool = True) -> AgentConfig:
    """Validate a parsed node-agent document and build the :class:`AgentConfig`.

    ``require_control=False``: the file may leave ``control:`` out (the caller has
    the addresses from elsewhere, ``llmgw agent --control``); its ``control`` is then
    empty.

    Raises:
        ConfigError: every problem found, each naming its key.
    """
    return _build_agent(data, _Problems(source), require_control)


def _build_agent(data: Any, problems: _Problems, require_control: bool = True) -> AgentConfig:
    doc = _document(problems, data, _AgentIn)
    if doc is None:
        problems.raise_if_any()
        raise AssertionError("unreachable")
    if "control" not in doc and require_control:
        problems.add(("control",), "is required (or give llmgw agent --control HOST:PORT)")
    v = {name: _section(problems, _AgentIn, doc, name) for name in _AgentIn.model_fields}
    if (v["tls_cert"] is None) != (v["tls_key"] is None):
        problems.add(("tls_key" if v["tls_key"] is None else "tls_cert",), "tls_cert and tls_key go together")
    problems.raise_if_any()
    return AgentConfig(
        control=v["control"] or (),
        token=v["token_env"].value if v["token_env"] is not None else None,
        token_env=v["token_env"].name if v["token_env"] is not None else None,
        name=v["name"],
        gpu_source=v["gpu_source"],
        tls=v["tls"],
        tls_ca=v["tls_ca"],
        tls_cert=v["tls_cert"],
        tls_key=v["tls_key"],
        insecure=v["insecure"],
        engines=v["engines"],
        state_dir=v["state_dir"],
        labels=v["labels"] or {},
        advertise=v["advertise"],
        replica_ports=v["replica_ports"],
        drain_timeout=v["drain_timeout"],
        ready_timeout=v["ready_timeout"],
        source=problems.source,
    )


def load_agent_file(path: str | os.PathLike[str], require_control: bool = True) -> AgentConfig:
    """Read, parse and validate a node agent's YAML config file (``require_control``:
    as :func:`load_agent`).

    Raises:
        ConfigError: unreadable file, invalid YAML, or every invalid key.
    """
    data, problems = _read_yaml(path)
    return _build_agent(data, problems, require_control)
