"""llmgw's configuration: one YAML file, loaded once into immutable objects.

One schema describes the file. The sections whose YAML shape is their runtime
shape (``server:``, ``upstream:``, ``scrape:``, ...) are the frozen dataclasses
the rest of llmgw reads, and their defaults are written there once; the sections
whose YAML differs from what the code reads (``endpoints[]``, ``auth:``, secrets
given by environment variable) have an input model and are compiled into their
dataclass. pydantic validates the input against that schema and exports it as
JSON Schema (``llmgw config schema``) for editors; every scalar is checked by one
of the rules in ``_rules``, so the messages are llmgw's own and say how to fix it.

Every problem is reported in one pass, one line each, naming the file, the YAML
line and the key by its path (``llmgw.yaml:14: endpoints[2].url: not a URL
(expected http://host:port), got 'localhost'``). Unknown keys are errors (with a
suggestion when one is close); so are duplicate keys, which YAML would otherwise
silently resolve to the last one. Durations are written ``2s``, ``500ms``,
``1m``; sizes ``16MiB``, ``64KiB``, or a plain number of bytes. Secrets can come
from the environment (``api_key_env: NAME``) and never appear in ``repr`` or in
a message. ``docs/config.md`` documents every key.

The package, by concern (this module re-exports the public names):

- ``_rules``: the rule of every scalar (durations, sizes, ``HOST:PORT``, ids,
  names, URLs, secrets), with its message and JSON Schema;
- ``model``: the frozen dataclasses the rest of llmgw reads (:class:`Config`,
  :class:`EndpointConfig`, :class:`ServerConfig`, ...) and the input models of
  ``llmgw.yaml``;
- ``_problems``: problem collection, each problem on its YAML line;
- ``_yaml``: the YAML reader that records each key's line and refuses duplicate keys;
- ``loading``: :func:`load`, :func:`load_file`, :func:`serve_problems`, :func:`find_config`;
- ``agent``: the node agent's file (:func:`load_agent_file`, :func:`load_agent`);
- ``schema``: :func:`config_schema`, the JSON Schema export.
"""

from __future__ import annotations

from ._rules import RUNNABLE_ENGINES, STRATEGIES, parse_duration, parse_hostport, parse_size
from .loading import find_config, load, load_file, serve_problems, validate_for_serve
from .model import DEFAULT_ADMIN as DEFAULT_ADMIN
from .model import DEFAULT_LISTEN as DEFAULT_LISTEN
from .model import (
    AccessLogConfig,
    AdmissionConfig,
    AuthConfig,
    BreakerConfig,
    ClientKey,
    Config,
    ControlConfig,
    DeploymentConfig,
    EndpointConfig,
    FollowConfig,
    ModelConfig,
    RetryConfig,
    RoutingConfig,
    SaturationConfig,
    ScrapeConfig,
    ServerConfig,
    UpstreamConfig,
)
from .schema import config_schema

__all__ = [
    "GPU_SOURCES",
    "RUNNABLE_ENGINES",
    "STRATEGIES",
    "AccessLogConfig",
    "AdmissionConfig",
    "AgentConfig",
    "AgentEngineConfig",
    "AuthConfig",
    "BreakerConfig",
    "ClientKey",
    "Config",
    "ControlConfig",
    "DeploymentConfig",
    "EndpointConfig",
    "FollowConfig",
    "ModelConfig",
    "RetryConfig",
    "RoutingConfig",
    "SaturationConfig",
    "ScrapeConfig",
    "ServerConfig",
    "UpstreamConfig",
    "config_schema",
    "find_config",
    "load",
    "load_agent",
    "load_agent_file",
    "load_file",
    "parse_duration",
    "parse_hostport",
    "parse_size",
    "serve_problems",
    "validate_for_serve",
]


_AGENT_NAMES = frozenset({"GPU_SOURCES", "AgentConfig", "AgentEngineConfig", "load_agent", "load_agent_file"})


def __getattr__(name: str) -> object:
    # PERF: the node agent's file and its schema (~0.15 s and a few MiB to build) load on first use,
    # not with every `llmgw serve`, which never reads an agent's file.
    if name in _AGENT_NAMES:
        from . import agent

        return getattr(agent, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
