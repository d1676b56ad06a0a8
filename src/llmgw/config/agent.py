"""The node agent's own file (``llmgw config schema --agent``): its schema, dataclasses and loader.

``llmgw agent --config FILE`` reads it (flags override it). It is read like
``llmgw.yaml`` (every problem in one pass, each on its YAML line), by the same
rules and problem collection. ``engines:`` is validated now and used by the
launchers (the replica issue).
"""

from __future__ import annotations

import os
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
    _choice,
    _env,
    _EnvValue,
)
from ._yaml import _read_yaml
from .model import _SECTION, _default, _In

GPU_SOURCES = ("auto", "nvml", "nvidia-smi", "none", "simulated")
_GPU_SOURCE = _choice("gpu source", GPU_SOURCES)


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
    name: str | None = None  # None: the host name
    gpu_source: str = "auto"
    tls: bool = False
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    insecure: bool = False
    engines: Mapping[str, AgentEngineConfig] = field(default_factory=dict)
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


def load_agent(data: Any, source: str | None = None) -> AgentConfig:
    """Validate a parsed node-agent document and build the :class:`AgentConfig`.

    Raises:
        ConfigError: every problem found, each naming its key.
    """
    return _build_agent(data, _Problems(source))


def _build_agent(data: Any, problems: _Problems) -> AgentConfig:
    doc = _document(problems, data, _AgentIn)
    if doc is None:
        problems.raise_if_any()
        raise AssertionError("unreachable")
    if "control" not in doc:
        problems.add(("control",), "is required")
    v = {name: _section(problems, _AgentIn, doc, name) for name in _AgentIn.model_fields}
    if (v["tls_cert"] is None) != (v["tls_key"] is None):
        problems.add(("tls_key" if v["tls_key"] is None else "tls_cert",), "tls_cert and tls_key go together")
    problems.raise_if_any()
    return AgentConfig(
        control=v["control"],
        token=v["token_env"].value if v["token_env"] is not None else None,
        name=v["name"],
        gpu_source=v["gpu_source"],
        tls=v["tls"],
        tls_ca=v["tls_ca"],
        tls_cert=v["tls_cert"],
        tls_key=v["tls_key"],
        insecure=v["insecure"],
        engines=v["engines"],
        source=problems.source,
    )


def load_agent_file(path: str | os.PathLike[str]) -> AgentConfig:
    """Read, parse and validate a node agent's YAML config file.

    Raises:
        ConfigError: unreadable file, invalid YAML, or every invalid key.
    """
    data, problems = _read_yaml(path)
    return _build_agent(data, problems)
