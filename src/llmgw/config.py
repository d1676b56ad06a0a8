"""llmgw's configuration: one YAML file, loaded once into immutable objects.

One schema describes the file. The sections whose YAML shape is their runtime
shape (``server:``, ``upstream:``, ``scrape:``, ...) are the frozen dataclasses
the rest of llmgw reads, and their defaults are written there once; the sections
whose YAML differs from what the code reads (``endpoints[]``, ``auth:``, secrets
given by environment variable) have an input model here and are compiled into
their dataclass. pydantic validates the input against that schema and exports it
as JSON Schema (``llmgw config schema``) for editors; every scalar is checked by
one of the rules below, so the messages are llmgw's own and say how to fix it.

Every problem is reported in one pass, one line each, naming the file, the YAML
line and the key by its path (``llmgw.yaml:14: endpoints[2].url: not a URL
(expected http://host:port), got 'localhost'``). Unknown keys are errors (with a
suggestion when one is close); so are duplicate keys, which YAML would otherwise
silently resolve to the last one. Durations are written ``2s``, ``500ms``,
``1m``; sizes ``16MiB``, ``64KiB``, or a plain number of bytes. Secrets can come
from the environment (``api_key_env: NAME``) and never appear in ``repr`` or in
a message. ``docs/config.md`` documents every key.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import os
import re
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, NamedTuple, Union, get_args, get_origin, get_type_hints
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator
from pydantic_core import PydanticCustomError, core_schema

# The routing kernel's pure module owns the strategy names (it imports nothing of llmgw's).
from ._fast.score_py import STRATEGIES
from .engines import ENGINE_NAMES
from .engines import get as get_engine
from .errors import ConfigError, ConfigProblem
from .http.server import ServerLimits

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

DEFAULT_LISTEN = ("127.0.0.1", 8080)
DEFAULT_ADMIN = ("127.0.0.1", 9090)
# Engines llmgw could start itself (deployments, the node agent): not the
# proxy-only dialects.
RUNNABLE_ENGINES: tuple[str, ...] = tuple(e for e in ENGINE_NAMES if e not in ("generic", "external"))
GPU_SOURCES = ("auto", "nvml", "nvidia-smi", "none")

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|KiB|MiB|GiB|K|M|G)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "b": 1, "k": 1024, "kb": 1000, "kib": 1024, "m": 1024**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1024**3, "gb": 1000**3, "gib": 1024**3,
}
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_MODEL = re.compile(r"^[^\s\x00-\x1f]{1,256}$")
_ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_METRIC = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_HEADER = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")
_HOSTPORT_PATTERN = r"^(\[[0-9A-Fa-f:.]+\]|[^:\s]*):\d+$"


_LIMITS = ServerLimits()  # the server's own defaults, written once there


def parse_duration(value: Any, key: str = "") -> float:
    """``2s``, ``500ms``, ``1.5m``, ``1h`` or a number of seconds, as seconds.

    Raises:
        ConfigError: not a duration.
    """
    if isinstance(value, bool):
        raise ConfigError(key, f"expected a duration like 2s or 500ms, got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        m = _DURATION.match(str(value))
        if not m:
            raise ConfigError(key, f"expected a duration like 2s or 500ms, got {value!r}")
        seconds = float(m.group(1)) * {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}[m.group(2)]
    if seconds < 0:
        raise ConfigError(key, "a duration cannot be negative")
    return seconds


def parse_size(value: Any, key: str = "") -> int:
    """``16MiB``, ``64KiB``, ``1GB`` or a number of bytes, as bytes."""
    if isinstance(value, bool):
        raise ConfigError(key, f"expected a size like 16MiB or a number of bytes, got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        m = _SIZE.match(str(value))
        if not m:
            raise ConfigError(key, f"expected a size like 16MiB or a number of bytes, got {value!r}")
        n = int(float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "b").lower()])
    if n < 0:
        raise ConfigError(key, "a size cannot be negative")
    return n


def parse_hostport(value: Any, key: str = "", default_host: str = "127.0.0.1") -> tuple[str, int]:
    """``HOST:PORT``, ``[v6]:PORT`` or ``:PORT`` as ``(host, port)``; port 0 picks a free one."""
    s = str(value).strip()
    m = re.match(r"^\[([0-9A-Fa-f:.]+)\]:(\d+)$", s) or re.match(r"^([^:\s]*):(\d+)$", s)
    if not m:
        raise ConfigError(key, f"expected HOST:PORT (e.g. 127.0.0.1:8080), got {value!r}")
    host, port = m.group(1) or default_host, int(m.group(2))
    if not 0 <= port <= 65535:
        raise ConfigError(key, f"port {port} is out of range 0-65535")
    return host, port


# -- rules: one per kind of scalar, each with its message and its JSON Schema --


class _Bad(ValueError):
    """A value a rule refuses; the message is shown to the user as it is."""


@dataclass(frozen=True, eq=False)
class _Rule:
    """A pydantic annotation: ``check`` validates and converts, ``schema`` is its JSON Schema.

    pydantic's own messages ("Input should be a valid integer") name neither the
    fix nor llmgw's units, so each scalar is checked here and pydantic is left
    the structure (mappings, lists, required and unknown keys).
    """

    check: Callable[[Any], Any]
    schema: Mapping[str, Any]

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> core_schema.CoreSchema:
        check = self.check

        def run(value: Any) -> Any:
            try:
                return check(value)
            except (_Bad, ConfigError) as exc:
                msg = exc.message if isinstance(exc, ConfigError) else str(exc)
                raise PydanticCustomError("llmgw", "{msg}", {"msg": msg}) from None

        return core_schema.no_info_plain_validator_function(run)

    def __get_pydantic_json_schema__(self, schema: Any, handler: Any) -> dict[str, Any]:
        return _copy(self.schema)


def _copy(schema: Any) -> Any:
    if isinstance(schema, Mapping):
        return {k: _copy(v) for k, v in schema.items()}
    if isinstance(schema, (list, tuple)):
        return [_copy(v) for v in schema]
    return schema


def _text(v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, (str, int, float)):
        raise _Bad(f"expected a string, got {type(v).__name__}")
    return str(v)


def _matching(regex: re.Pattern[str], message: str, *, lower: bool = False) -> _Rule:
    def check(v: Any) -> str:
        s = _text(v)
        if lower:
            s = s.lower()
        if not regex.match(s):
            raise _Bad(message.format(value=s))
        return s

    return _Rule(check, {"type": "string", "pattern": regex.pattern})


def _flag(v: Any) -> bool:
    if not isinstance(v, bool):
        raise _Bad(f"expected true or false, got {v!r}")
    return v


def _int(lo: int | None = None, hi: int | None = None) -> _Rule:
    def check(v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise _Bad(f"expected a whole number, got {v!r}")
        if lo is not None and v < lo:
            raise _Bad(f"must be at least {lo}, got {v}")
        if hi is not None and v > hi:
            raise _Bad(f"must be at most {hi}, got {v}")
        return v

    schema: dict[str, Any] = {"type": "integer"}
    if lo is not None:
        schema["minimum"] = lo
    if hi is not None:
        schema["maximum"] = hi
    return _Rule(check, schema)


def _num(lo: float | None = None, hi: float | None = None) -> _Rule:
    def check(v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise _Bad(f"expected a number, got {v!r}")
        if lo is not None and v < lo:
            raise _Bad(f"must be at least {lo}, got {v}")
        if hi is not None and v > hi:
            raise _Bad(f"must be at most {hi}, got {v}")
        return float(v)

    schema: dict[str, Any] = {"type": "number"}
    if lo is not None:
        schema["minimum"] = lo
    if hi is not None:
        schema["maximum"] = hi
    return _Rule(check, schema)


def _duration(min_s: float = 0.0) -> _Rule:
    def check(v: Any) -> float:
        seconds = parse_duration(v)
        if seconds < min_s:
            raise _Bad(f"must be at least {min_s * 1000:g}ms, got {v!r}")
        return seconds

    return _Rule(
        check,
        {
            "anyOf": [{"type": "number", "minimum": min_s}, {"type": "string", "pattern": _DURATION.pattern}],
            "description": "a duration: 500ms, 2s, 1.5m, 1h, or a number of seconds",
        },
    )


def _size(lo: int = 0) -> _Rule:
    def check(v: Any) -> int:
        n = parse_size(v)
        if n < lo:
            raise _Bad(f"must be at least {lo} bytes")
        return n

    return _Rule(
        check,
        {
            "anyOf": [{"type": "integer", "minimum": lo}, {"type": "string", "pattern": "(?i)" + _SIZE.pattern}],
            "description": "a size: 64KiB, 16MiB, 1GB, or a number of bytes",
        },
    )


def _hostport_value(v: Any) -> tuple[str, int]:
    return parse_hostport(_text(v))


def _choice(what: str, options: Sequence[str]) -> _Rule:
    def check(v: Any) -> str:
        s = _text(v)
        if s not in options:
            raise _Bad(f"unknown {what} {s!r}; choose one of {', '.join(options)}")
        return s

    return _Rule(check, {"enum": list(options)})


def _list_of(rule: _Rule, message: str, *, one_or_many: bool = False, non_empty: bool = True) -> _Rule:
    """A list whose items pass ``rule`` (or, with ``one_or_many``, a single item), as a tuple."""

    def check(v: Any) -> tuple[Any, ...]:
        if one_or_many and not isinstance(v, list):
            v = [v]
        if not isinstance(v, list) or (non_empty and not v):
            raise _Bad(message)
        try:
            return tuple(rule.check(x) for x in v)
        except (_Bad, ConfigError):
            raise _Bad(message) from None

    items = _copy(rule.schema)
    schema: dict[str, Any] = {"type": "array", "items": items}
    if non_empty:
        schema["minItems"] = 1
    return _Rule(check, {"anyOf": [items, schema]} if one_or_many else schema)


class _EnvValue:
    """A secret read from the environment: the variable's name, and its value kept out of ``repr``."""

    __slots__ = ("name", "value")

    def __init__(self, name: str, value: str) -> None:
        self.name = name
        self.value = value

    def __repr__(self) -> str:
        return f"_EnvValue({self.name!r})"


def _env(inline: str | None) -> _Rule:
    """``X_env: NAME``: NAME must be set and non-empty; ``inline`` names the key to use instead."""
    instead = f", or use {inline}:" if inline else ""

    def check(v: Any) -> _EnvValue:
        var = _text(v)
        if not _ENV.match(var):
            raise _Bad(f"expected an environment variable name, got {var!r}")
        value = os.environ.get(var)
        if value is None:
            raise _Bad(f"environment variable {var} is not set (export it{instead})")
        if not value:
            raise _Bad(f"environment variable {var} is empty")
        return _EnvValue(var, value)

    return _Rule(check, {"type": "string", "pattern": _ENV.pattern, "description": "an environment variable name"})


def _envs(inline: str) -> _Rule:
    """One environment variable name or a list of them; every unset one is named."""
    one = _env(inline)

    def check(v: Any) -> tuple[_EnvValue, ...]:
        names = v if isinstance(v, list) else [v]
        if not names:
            raise _Bad("expected an environment variable name or a non-empty list of them")
        out, unset = [], []
        for name in names:
            try:
                out.append(one.check(name))
            except _Bad:
                if not (isinstance(name, str) and os.environ.get(name) is None and _ENV.match(name)):
                    raise
                unset.append(name)
        if unset:
            s = "s" if len(unset) > 1 else ""
            raise _Bad(f"environment variable{s} {', '.join(unset)} {'are' if s else 'is'} not set "
                       f"(export {'them' if s else 'it'}, or use {inline}:)")
        return tuple(out)

    items = _copy(one.schema)
    return _Rule(check, {"anyOf": [items, {"type": "array", "items": items, "minItems": 1}]})


def _secret(v: Any) -> str:
    s = _text(v)
    if not s:
        raise _Bad("is empty")
    return s


class _Url(NamedTuple):
    url: str
    scheme: str
    host: str
    port: int
    base_path: str


def _url(v: Any) -> _Url:
    url = _text(v)
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _Bad(f"not a URL (expected http://host:port), got {url!r}")
    if parts.scheme == "https":
        raise _Bad("https upstreams are not supported yet; put the replica on a private network and use http://")
    if parts.query or parts.fragment or parts.username:
        raise _Bad("must not contain credentials, a query or a fragment")
    try:
        port = parts.port or 80
    except ValueError:
        raise _Bad(f"not a valid port in {url!r}") from None
    return _Url(url.rstrip("/"), parts.scheme, parts.hostname, port, parts.path.rstrip("/"))


def _model_list(v: Any) -> tuple[str, ...]:
    if not isinstance(v, list) or not v or not all(isinstance(m, str) for m in v):
        raise _Bad("expected a non-empty list of model names")
    for m in v:
        if not _MODEL.match(m):
            raise _Bad(f"invalid model name {m!r}")
    if len(set(v)) != len(v):
        raise _Bad("lists a model twice")
    return tuple(v)


def _bands(v: Any) -> tuple[str, ...]:
    if (
        not isinstance(v, list)
        or not v
        or not all(isinstance(b, str) and _ID.match(b) for b in v)
        or len(set(v)) != len(v)
    ):
        raise _Bad("expected a list of distinct band names, highest priority first")
    if len(v) > 16:
        raise _Bad("at most 16 bands")
    return tuple(v)


def _metrics_path(v: Any) -> str:
    s = _text(v)
    if not s.startswith("/"):
        raise _Bad(f"must start with '/', got {s!r}")
    return s


def _sha256_hex(v: Any) -> bytes:
    s = _text(v)
    if not re.fullmatch(r"[0-9a-fA-F]{64}", s):
        raise _Bad("expected 64 hex digits (sha256sum of the key)")
    return bytes.fromhex(s)


def _env_map(v: Any) -> Mapping[str, str]:
    message = "expected a mapping of environment variable names to strings"
    if not isinstance(v, Mapping):
        raise _Bad(message)
    out: dict[str, str] = {}
    for name, value in v.items():
        if not isinstance(name, str) or not _ENV.match(name):
            raise _Bad(f"{name!r} is not an environment variable name")
        try:
            out[name] = _text(value)
        except _Bad:
            raise _Bad(f"{name}: {message}") from None
    return out


_TEXT = _Rule(_text, {"type": ["string", "number"]})
_SECRET = _Rule(_secret, {"type": "string", "minLength": 1, "writeOnly": True})
_FLAG = _Rule(_flag, {"type": "boolean"})
_HOSTPORT = _Rule(_hostport_value, {"type": "string", "pattern": _HOSTPORT_PATTERN, "examples": ["127.0.0.1:8080"]})
_IDENT = _matching(_ID, "use letters, digits, '.', '_' or '-' (at most 128), starting with a letter or digit")
_MODEL_NAME = _matching(_MODEL, "invalid model name {value!r}")
_ENGINE = _choice("engine", ENGINE_NAMES)
_RUNNABLE_ENGINE = _choice("engine", RUNNABLE_ENGINES)
_STRATEGY = _choice("strategy", STRATEGIES)
_URL = _Rule(_url, {"type": "string", "pattern": r"^http://[^\s/?#@]+", "examples": ["http://127.0.0.1:8001"]})
_MODELS = _Rule(_model_list, {"type": "array", "items": _MODEL_NAME.schema, "minItems": 1, "uniqueItems": True})
_ALIASES = _list_of(_MODEL_NAME, "expected a list of model names", non_empty=False)
_METRIC_NAMES = _list_of(
    _matching(_METRIC, "bad metric name"),
    "expected a metric name or a list of them (letters, digits, '_' and ':')",
    one_or_many=True,
)
_BANDS = _Rule(_bands, {"type": "array", "items": _IDENT.schema, "minItems": 1, "maxItems": 16, "uniqueItems": True})
_HEADER_NAME = _matching(_HEADER, "not a valid header name: {value!r}", lower=True)
_METRICS_PATH = _Rule(_metrics_path, {"type": "string", "pattern": "^/"})
_SHA256 = _Rule(_sha256_hex, {"type": "string", "pattern": "^[0-9a-fA-F]{64}$"})
_STRINGS = _list_of(_TEXT, "expected a list of strings", non_empty=False)
_ENV_MAP = _Rule(
    _env_map, {"type": "object", "propertyNames": {"pattern": _ENV.pattern}, "additionalProperties": _TEXT.schema}
)
_ADDRESSES = _list_of(_HOSTPORT, "expected HOST:PORT or a non-empty list of them", one_or_many=True)
_GPU_SOURCE = _choice("gpu source", GPU_SOURCES)

# pydantic config of every section: unknown keys are errors. A field's docstring
# is its description in the exported JSON Schema (added by config_schema: pydantic's
# use_attribute_docstrings re-reads the module's source per class, a quarter second
# on every start).
_SECTION = ConfigDict(extra="forbid")


# -- what the rest of llmgw reads --


@dataclass(frozen=True, slots=True)
class EndpointConfig:
    """One replica: an engine process serving one or more models."""

    id: str
    url: str
    models: tuple[str, ...]
    engine: str = "vllm"
    pool: str | None = None
    api_key: str | None = field(default=None, repr=False)
    metrics_path: str = "/metrics"
    metric_names: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    draining: bool = False
    slots: int | None = None
    # derived
    scheme: str = "http"
    host: str = "127.0.0.1"
    port: int = 80
    base_path: str = ""

    @property
    def model(self) -> str:
        """The first (usually only) model it serves."""
        return self.models[0]

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Per-model settings (``models:`` section)."""

    name: str
    aliases: tuple[str, ...] = ()
    strategy: str | None = None  # None: routing.strategy
    upstream_name: str | None = None  # rewrite `model` in the body to this before forwarding


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Client-listener limits and timeouts (``server:`` section)."""

    # (defaults: the server's own, _LIMITS)
    max_body_size: Annotated[int, _size(lo=1024)] = _LIMITS.max_body
    """Larger request bodies get 413."""
    max_header_bytes: Annotated[int, _size(lo=1024)] = _LIMITS.max_head_bytes
    """Request line plus headers; more gets 431."""
    max_headers: Annotated[int, _int(8, 10_000)] = _LIMITS.max_headers
    """Header lines per request; more gets 431."""
    header_timeout: Annotated[float, _duration(0.01)] = _LIMITS.header_timeout
    """From a request's first byte to its complete head; then 408 and close."""
    body_timeout: Annotated[float, _duration(0.01)] = _LIMITS.body_timeout
    """From the complete head to the complete body; then 408 and close."""
    keepalive_timeout: Annotated[float, _duration(0.01)] = _LIMITS.keepalive_timeout
    """An idle keep-alive connection is closed after this."""
    max_connections: Annotated[int, _int(1)] = _LIMITS.max_connections
    """Connections past this are answered 503 and closed at once."""
    shutdown_timeout: Annotated[float, _duration()] = 10.0
    """On SIGINT/SIGTERM in-flight requests get this long, then are cut."""

    __pydantic_config__ = _SECTION


@dataclass(frozen=True, slots=True)
class UpstreamConfig:
    """How llmgw talks to replicas (``upstream:`` section)."""

    connect_timeout: Annotated[float, _duration(0.001)] = 2.0
    """TCP connect to a replica; past it the request is retried elsewhere."""
    first_byte_timeout: Annotated[float, _duration(0.001)] = 120.0
    """Request sent to response head; past it 504."""
    read_timeout: Annotated[float, _duration(0.001)] = 300.0
    """Longest silence inside a response."""
    max_idle_connections: Annotated[int, _int(0)] = 64
    """Keep-alive connections kept per replica."""
    idle_timeout: Annotated[float, _duration(0.01)] = 30.0
    """An idle upstream connection is closed after this."""

    __pydantic_config__ = _SECTION


@dataclass(frozen=True, slots=True)
class RetryConfig:
    """Retries before the first byte reached the client (``retries:`` section)."""

    attempts: Annotated[int, _int(0, 10)] = 1
    """How many other replicas are tried when one fails before any byte reached the client."""
    budget: Annotated[float, _num(0.0, 1.0)] = 0.2
    """Retries in flight may not exceed this fraction of the requests in flight."""

    __pydantic_config__ = _SECTION


@dataclass(frozen=True, slots=True)
class ScrapeConfig:
    """Engine telemetry polling (``scrape:`` section).

    ``timeout`` defaults to 80 % of ``interval`` when that is shorter than 800ms,
    ``stale_after`` to three intervals when that is longer than 3s.
    """

    interval: Annotated[float, _duration(0.05)] = 1.0
    """How often each replica's metrics are read."""
    timeout: Annotated[float, _duration(0.01)] = 0.8
    """A scrape slower than this fails; shorter than interval."""
    stale_after: Annotated[float, _duration(0.05)] = 3.0
    """A replica whose last good scrape is older is stale."""
    default_engine: Annotated[str, _ENGINE] = "vllm"
    """The engine of endpoints that name none."""

    __pydantic_config__ = _SECTION


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """How a replica is chosen (``routing:`` section)."""

    strategy: Annotated[str, _STRATEGY] = "score"
    """score, least_inflight or round_robin."""

    __pydantic_config__ = _SECTION


@dataclass(frozen=True, slots=True)
class SaturationConfig:
    """When a replica counts as full (``saturation:`` section)."""

    max_waiting: Annotated[int, _int(1)] = 8
    """A replica whose queue reaches this is full."""
    max_kv_cache_usage: Annotated[float, _num(0.01, 1.0)] = 0.9
    """A replica whose KV-cache use reaches this is full."""

    __pydantic_config__ = _SECTION


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """Priority bands and their queues (``admission:`` section).

    ``default_band`` defaults to ``standard``, or the middle band when the bands have no ``standard``.
    """

    bands: Annotated[tuple[str, ...], _BANDS] = ("critical", "standard", "batch")
    """Priority bands, highest first."""
    default_band: Annotated[str, _IDENT] = "standard"
    """The band of a request that names none."""
    header: Annotated[str, _HEADER_NAME] = _LIMITS.priority_header.decode()
    """The request header that names a band."""
    queue_size: Annotated[int, _int(0, 10_000_000)] = 1000
    """Waiting requests per band (per model)."""
    queue_timeout: Annotated[float, _duration(0.001)] = 30.0
    """A request that waited this long is shed."""

    __pydantic_config__ = _SECTION

    def band_index(self, name: str) -> int:
        return self.bands.index(name)


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    """Per-replica circuit breakers (``breaker:`` section). ``max_cooldown`` is at least ``cooldown``."""

    failures: Annotated[int, _int(1, 1000)] = 5
    """Consecutive failures that open the breaker."""
    cooldown: Annotated[float, _duration(0.001)] = 5.0
    """An open breaker lets one probe through after this; each reopening doubles it."""
    max_cooldown: Annotated[float, _duration(0.001)] = 60.0
    """The longest cooldown."""

    __pydantic_config__ = _SECTION


@dataclass(frozen=True, slots=True)
class ClientKey:
    """A client API key, kept only as its SHA-256."""

    name: str
    sha256: bytes = field(repr=False)
    band: str | None = None


@dataclass(frozen=True, slots=True)
class AuthConfig:
    """Client authentication (``auth:`` section). No keys: the gateway is open."""

    keys: tuple[ClientKey, ...] = ()

    @property
    def enabled(self) -> bool:
        return bool(self.keys)


@dataclass(frozen=True, slots=True)
class AccessLogConfig:
    """The JSON access log (``access_log:``)."""

    enabled: bool = False


@dataclass(frozen=True, slots=True)
class ControlConfig:
    """The control plane (``control:``). Reserved: validated, not used yet.

    ``heartbeat_grace`` defaults to three heartbeat intervals.
    """

    listen: tuple[str, int]
    join_tokens: tuple[str, ...] = field(default=(), repr=False)
    heartbeat_interval: float = 5.0
    heartbeat_grace: float = 15.0
    database: str | None = None


@dataclass(frozen=True, slots=True)
class DeploymentConfig:
    """One model deployment the control plane would run (``deployments[]``). Reserved: not used yet."""

    name: Annotated[str, _IDENT]
    """Unique name of the deployment."""
    model: Annotated[str, _MODEL_NAME]
    """The model to run (a mirror name or a path the engine understands)."""
    engine: Annotated[str, _RUNNABLE_ENGINE] = "vllm"
    """The engine that runs it."""
    replicas: Annotated[int, _int(0, 1024)] = 1
    """How many replicas to run."""
    gpus: Annotated[int, _int(0, 64)] = 1
    """GPUs per replica (0: CPU)."""
    gpu_memory: Annotated[int, _size()] | None = None
    """GPU memory per replica (a size), when the engine should be held to less than a whole GPU."""
    args: Annotated[tuple[str, ...], _STRINGS] = ()
    """Extra command-line arguments for the engine."""
    env: Annotated[Mapping[str, str], _ENV_MAP] = field(default_factory=dict, repr=False)
    """Extra environment variables for the engine."""
    served_name: Annotated[str, _MODEL_NAME] | None = None
    """The model name clients use (default: model)."""

    __pydantic_config__ = _SECTION


@dataclass(frozen=True, slots=True)
class FollowConfig:
    """Follow a control plane for the fleet (``follow:``). Reserved: validated, not used yet."""

    control: tuple[tuple[str, int], ...]
    token: str | None = field(default=None, repr=False)


@dataclass(frozen=True, slots=True)
class Config:
    """The whole configuration. Build it with :func:`load` or :func:`load_file`."""

    listen: tuple[str, int] = DEFAULT_LISTEN
    admin: tuple[str, int] = DEFAULT_ADMIN
    endpoints: tuple[EndpointConfig, ...] = ()
    models: Mapping[str, ModelConfig] = field(default_factory=dict)
    server: ServerConfig = field(default_factory=ServerConfig)
    upstream: UpstreamConfig = field(default_factory=UpstreamConfig)
    retries: RetryConfig = field(default_factory=RetryConfig)
    scrape: ScrapeConfig = field(default_factory=ScrapeConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    saturation: SaturationConfig = field(default_factory=SaturationConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    access_log: AccessLogConfig = field(default_factory=AccessLogConfig)
    mirror_root: str | None = None
    admin_token: str | None = field(default=None, repr=False)
    source: str | None = None
    # reserved for the control plane: validated, nothing reads them yet
    control: ControlConfig | None = None
    deployments: tuple[DeploymentConfig, ...] = ()
    follow: FollowConfig | None = None

    def model_names(self) -> tuple[str, ...]:
        """Every model the fleet serves, in configuration order."""
        seen: dict[str, None] = {}
        for ep in self.endpoints:
            for m in ep.models:
                seen.setdefault(m, None)
        return tuple(seen)

    def aliases(self) -> dict[str, str]:
        """Alias -> model name."""
        out: dict[str, str] = {}
        for m in self.models.values():
            for a in m.aliases:
                out[a] = m.name
        return out


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
    """The node agent's own file. Reserved: validated, nothing runs it yet."""

    control: tuple[str, int]
    token: str | None = field(default=None, repr=False)
    name: str | None = None  # None: the host name
    gpu_source: str = "auto"
    engines: Mapping[str, AgentEngineConfig] = field(default_factory=dict)
    source: str | None = None


def _default(cls: type, name: str) -> Any:
    """The default of dataclass field ``cls.name``: input models take theirs from it, so it is written once."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _address_default(cls: type, name: str) -> Any:
    """An address field's default, written in the schema as the file writes it (HOST:PORT)."""
    host, port = _default(cls, name)
    return Field(default=(host, port), json_schema_extra={"default": f"{host}:{port}"})


# -- the input schema of what is not read as written --


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)


class _MetricNamesIn(_In):
    """Per signal, the metric name(s) to read instead of the engine's, most preferred first."""

    waiting: Annotated[tuple[str, ...], _METRIC_NAMES] | None = None
    running: Annotated[tuple[str, ...], _METRIC_NAMES] | None = None
    kv_cache_usage: Annotated[tuple[str, ...], _METRIC_NAMES] | None = None


class _EndpointIn(_In):
    """One replica: an engine process serving one or more models."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["model"]}, {"required": ["models"]}]})

    id: Annotated[str, _IDENT]
    """Unique name used in metrics, logs and the x-llmgw-replica header."""
    url: Annotated[_Url, _URL]
    """http://host:port[/base-path] of the engine's OpenAI server."""
    model: Annotated[str, _MODEL_NAME] | None = None
    """The model it serves (or models: for several)."""
    models: Annotated[tuple[str, ...], _MODELS] | None = None
    """The models it serves (or model: for one)."""
    engine: Annotated[str, _ENGINE] | None = None
    """Which dialect llmgw speaks with it (default: scrape.default_engine)."""
    api_key: Annotated[str, _SECRET] | None = Field(default=None, repr=False)
    """The replica's own key, sent upstream (prefer api_key_env)."""
    api_key_env: Annotated[_EnvValue, _env("api_key")] | None = None
    """The environment variable holding the replica's key."""
    pool: Annotated[str, _TEXT] | None = None
    """A grouping label used in metrics."""
    metrics_path: Annotated[str, _METRICS_PATH] | None = None
    """Where its Prometheus text is scraped (default: the engine's)."""
    metric_names: _MetricNamesIn = Field(default_factory=_MetricNamesIn)
    draining: Annotated[bool, _FLAG] = _default(EndpointConfig, "draining")
    """true: no new requests; in-flight ones finish."""
    slots: Annotated[int, _int(0, 1_000_000)] = 0
    """Requests the replica runs at once (0: unknown)."""


class _ModelIn(_In):
    """Per-model settings."""

    aliases: Annotated[tuple[str, ...], _ALIASES] = _default(ModelConfig, "aliases")
    """Other names clients may use."""
    strategy: Annotated[str, _STRATEGY] | None = _default(ModelConfig, "strategy")
    """This model's replica choice (default: routing.strategy)."""
    upstream_name: Annotated[str, _TEXT] | None = _default(ModelConfig, "upstream_name")
    """Rewrite model in the request body to this before forwarding."""


class _KeyIn(_In):
    """A client key: the key itself (a string), or a mapping."""

    model_config = ConfigDict(
        json_schema_extra={"oneOf": [{"required": ["key"]}, {"required": ["key_env"]}, {"required": ["key_sha256"]}]}
    )

    name: Annotated[str, _TEXT] | None = None
    """A label for logs (default keyN)."""
    band: Annotated[str, _IDENT] | None = None
    """The key's default priority band."""
    key: Annotated[str, _SECRET] | None = Field(default=None, repr=False)
    """The key inline."""
    key_env: Annotated[_EnvValue, _env("key")] | None = None
    """The environment variable holding the key."""
    key_sha256: Annotated[bytes, _SHA256] | None = None
    """The hex SHA-256 of the key."""

    @model_validator(mode="before")
    @classmethod
    def _bare_key(cls, data: Any) -> Any:
        return {"key": data} if isinstance(data, str) else data


class _AuthIn(_In):
    """Client API keys; with none the gateway is open."""

    api_keys: tuple[_KeyIn, ...] = ()
    """The keys: a string, or name/band and one of key, key_env, key_sha256."""


class _MirrorIn(_In):
    """The model mirror (llmgw mirror)."""

    root: Annotated[str, _TEXT] | None = None
    """The mirror's directory (~ is expanded); default $LLMGW_MIRROR, else ~/.local/share/llmgw/mirror."""


class _ControlIn(_In):
    """The control plane. Reserved: validated, not used yet."""

    listen: Annotated[tuple[str, int], _HOSTPORT]
    """HOST:PORT the control plane would listen on."""
    join_token: Annotated[tuple[str, ...], _list_of(_SECRET, "expected a token or a list of tokens",
                                                    one_or_many=True)] | None = Field(default=None, repr=False)
    """Token(s) a node agent must present to join (prefer join_token_env)."""
    join_token_env: Annotated[tuple[_EnvValue, ...], _envs("join_token")] | None = None
    """Environment variable(s) holding the join token(s)."""
    heartbeat_interval: Annotated[float, _duration(0.1)] = _default(ControlConfig, "heartbeat_interval")
    """How often a node agent reports."""
    heartbeat_grace: Annotated[float, _duration(0.1)] | None = None
    """A node silent this long is lost (default: three heartbeat intervals)."""
    database: Annotated[str, _TEXT] | None = _default(ControlConfig, "database")
    """Where the control plane would keep its state."""


class _FollowIn(_In):
    """Follow a control plane. Reserved: validated, not used yet."""

    control: Annotated[tuple[tuple[str, int], ...], _ADDRESSES]
    """The control plane's address(es), HOST:PORT."""
    token_env: Annotated[_EnvValue, _env(None)] | None = None
    """The environment variable holding the token to present."""


class _ConfigIn(_In):
    """llmgw.yaml: the gateway's configuration (docs/config.md)."""

    listen: Annotated[tuple[str, int], _HOSTPORT] = _address_default(Config, "listen")
    """Client address: the OpenAI API under /v1/."""
    admin: Annotated[tuple[str, int], _HOSTPORT] = _address_default(Config, "admin")
    """Admin address: /health, /ready, /metrics. Keep it private."""
    endpoints: tuple[_EndpointIn, ...] = ()
    """The replicas."""
    models: dict[str, _ModelIn] = Field(default_factory=dict)
    """Per-model settings, by served model name."""
    server: ServerConfig = Field(default_factory=ServerConfig)
    upstream: UpstreamConfig = Field(default_factory=UpstreamConfig)
    retries: RetryConfig = Field(default_factory=RetryConfig)
    scrape: ScrapeConfig = Field(default_factory=ScrapeConfig)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    saturation: SaturationConfig = Field(default_factory=SaturationConfig)
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    breaker: BreakerConfig = Field(default_factory=BreakerConfig)
    auth: _AuthIn = Field(default_factory=_AuthIn)
    access_log: Annotated[bool, _FLAG] = _default(AccessLogConfig, "enabled")
    """true: one JSON line per request on stdout."""
    admin_token: Annotated[str, _SECRET] | None = Field(default=None, repr=False)
    """Protects /admin/v1 and /debug/pprof (prefer admin_token_env)."""
    admin_token_env: Annotated[_EnvValue, _env("admin_token")] | None = None
    """The environment variable holding the admin token."""
    mirror: _MirrorIn = Field(default_factory=_MirrorIn)
    control: _ControlIn | None = None
    deployments: tuple[DeploymentConfig, ...] = ()
    """Reserved for the control plane: the deployments it would run."""
    follow: _FollowIn | None = None


class _AgentIn(_In):
    """The llmgw node agent's configuration. Reserved: validated, nothing runs it yet."""

    control: Annotated[tuple[str, int], _HOSTPORT]
    """The control plane's address, HOST:PORT."""
    token_env: Annotated[_EnvValue, _env(None)] | None = None
    """The environment variable holding the join token."""
    name: Annotated[str, _IDENT] | None = _default(AgentConfig, "name")
    """This node's name (default: the host name)."""
    gpu_source: Annotated[str, _GPU_SOURCE] = _default(AgentConfig, "gpu_source")
    """Where GPU telemetry comes from: auto, nvml, nvidia-smi or none."""
    engines: dict[Annotated[str, _RUNNABLE_ENGINE], AgentEngineConfig] = Field(
        default_factory=dict, json_schema_extra={"propertyNames": {"enum": list(RUNNABLE_ENGINES)}}
    )
    """Per engine, how to start it."""


# -- problems, with their YAML lines --

_Loc = tuple[Any, ...]
_FAILED: Any = object()  # a section that did not validate


def _dotted(loc: _Loc) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _unwrap(tp: Any) -> Any:
    while True:
        origin = get_origin(tp)
        if origin is Annotated:
            tp = get_args(tp)[0]
        elif origin in (Union, types.UnionType):
            args = [a for a in get_args(tp) if a is not type(None)]
            if len(args) != 1:
                return tp
            tp = args[0]
        else:
            return tp


def _fields_of(tp: Any) -> dict[str, Any] | None:
    tp = _unwrap(tp)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return {(f.alias or n): f.annotation for n, f in tp.model_fields.items()}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        hints = get_type_hints(tp)
        return {f.name: hints[f.name] for f in dataclasses.fields(tp)}
    return None


def _step(tp: Any, part: Any) -> Any:
    """The type found at ``part`` inside a value of type ``tp`` (None when unknown)."""
    tp = _unwrap(tp)
    fields = _fields_of(tp)
    if fields is not None:
        return fields.get(part) if isinstance(part, str) else None
    args = get_args(tp)
    if get_origin(tp) in (list, tuple, Sequence) and args:
        return args[0]
    if get_origin(tp) in (dict, Mapping) and len(args) == 2:
        return args[1]
    return None


class _Problems:
    """The problems found so far in one document, each placed on its YAML line."""

    def __init__(self, source: str | None, lines: Mapping[_Loc, int] | None = None) -> None:
        self.source = source
        self.lines = lines or {}
        self.found: list[ConfigProblem] = []

    def line(self, loc: _Loc) -> int | None:
        for n in range(len(loc), -1, -1):
            line = self.lines.get(loc[:n])
            if line is not None:
                return line
        return None

    def add(self, loc: _Loc, message: str, *, key: str | None = None) -> None:
        self.found.append(ConfigProblem(_dotted(loc) if key is None else key, message, self.source, self.line(loc)))

    def unknown(self, loc: _Loc, known: Sequence[str]) -> None:
        hint = difflib.get_close_matches(str(loc[-1]), sorted(known), n=1)
        tip = f"; did you mean {hint[0]!r}?" if hint else f"; known keys: {', '.join(sorted(known))}"
        self.add(loc, f"unknown key{tip}")

    def validation(self, exc: ValidationError, prefix: _Loc, tp: Any) -> None:
        """pydantic's errors, in llmgw's words."""
        for err in exc.errors(include_url=False):
            loc = prefix + tuple(p for p in err["loc"] if p != "[key]")
            kind = err["type"]
            value = err.get("input")
            if kind == "llmgw":
                self.add(loc, err["ctx"]["msg"])
            elif kind in ("missing", "missing_argument", "missing_keyword_only_argument"):
                self.add(loc, "is required")
            elif kind in ("extra_forbidden", "unexpected_keyword_argument"):
                parent = tp
                for part in loc[len(prefix):-1]:
                    parent = _step(parent, part)
                self.unknown(loc, sorted(_fields_of(parent) or ()))
            elif kind in ("model_type", "model_attributes_type", "dataclass_type", "dataclass_exact_type", "dict_type"):
                self.add(loc, f"expected a mapping of keys, got {type(value).__name__}")
            elif kind in ("list_type", "tuple_type"):
                self.add(loc, f"expected a list, got {type(value).__name__}")
            else:  # pragma: no cover - every other kind is one of the rules'
                self.add(loc, err["msg"])

    def raise_if_any(self) -> None:
        if self.found:
            # Top to bottom through the file; problems without a line first.
            raise ConfigError(problems=sorted(self.found, key=lambda p: p.line or 0))


_ADAPTERS: dict[tuple[type, str], TypeAdapter[Any]] = {}


def _section(problems: _Problems, model: type[_In], data: Mapping[str, Any], name: str) -> Any:
    """Section ``name`` of ``data`` validated alone, so one bad section hides no other's problems."""
    info = model.model_fields[name]
    if name not in data:
        return info.get_default(call_default_factory=True)
    adapter = _ADAPTERS.get((model, name))
    if adapter is None:
        adapter = _ADAPTERS[(model, name)] = TypeAdapter(info.rebuild_annotation())
    try:
        return adapter.validate_python(data[name])
    except ValidationError as exc:
        problems.validation(exc, (name,), info.annotation)
        return _FAILED


def _unset_nulls(value: Any) -> Any:
    """``key:`` with no value (null) means the key is not set, as in most YAML tools."""
    if isinstance(value, Mapping):
        return {k: _unset_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_unset_nulls(v) for v in value]
    return value


def _document(problems: _Problems, data: Any, model: type[_In]) -> dict[str, Any] | None:
    """The top-level mapping, checked for unknown keys; None when it is not a mapping."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        problems.add((), f"expected a mapping of keys, got {type(data).__name__}", key="(top level)")
        return None
    data = _unset_nulls(data)
    for k in data:
        if k not in model.model_fields:
            problems.unknown((str(k),), list(model.model_fields))
    return data


def _either(problems: _Problems, raw: Any, loc: _Loc, inline: str, env: str) -> None:
    if isinstance(raw, Mapping) and inline in raw and env in raw:
        problems.add((*loc, env), f"give either {inline} or {env}, not both")


def _secret_of(inline: str | None, env: _EnvValue | None) -> str | None:
    return env.value if env is not None else inline


# -- compiling: the validated input into what llmgw reads --


def _scrape(problems: _Problems, sc: ScrapeConfig, raw: Mapping[str, Any]) -> ScrapeConfig:
    timeout = sc.timeout if "timeout" in raw else min(sc.timeout, sc.interval * 0.8)
    stale_after = sc.stale_after if "stale_after" in raw else max(sc.stale_after, sc.interval * 3)
    if timeout >= sc.interval:
        problems.add(("scrape", "timeout"), f"must be shorter than scrape.interval ({sc.interval:g}s)")
    if stale_after < sc.interval:
        problems.add(("scrape", "stale_after"), f"must be at least scrape.interval ({sc.interval:g}s)")
    return dataclasses.replace(sc, timeout=timeout, stale_after=stale_after)


def _admission(problems: _Problems, ad: AdmissionConfig, raw: Mapping[str, Any]) -> AdmissionConfig:
    bands = ad.bands
    if "default_band" not in raw and ad.default_band not in bands:
        ad = dataclasses.replace(ad, default_band=bands[len(bands) // 2])
    if ad.default_band not in bands:
        problems.add(("admission", "default_band"), f"{ad.default_band!r} is not one of the bands ({', '.join(bands)})")
    return ad


def _breaker(problems: _Problems, br: BreakerConfig, raw: Mapping[str, Any]) -> BreakerConfig:
    if "max_cooldown" not in raw:
        br = dataclasses.replace(br, max_cooldown=max(br.max_cooldown, br.cooldown))
    if br.max_cooldown < br.cooldown:
        problems.add(("breaker", "max_cooldown"), "must be at least breaker.cooldown")
    return br


def _raw_models(item: Any) -> list[str]:
    if not isinstance(item, Mapping):
        return []
    models = item.get("models")
    if isinstance(models, list):
        return [m for m in models if isinstance(m, str)]
    model = item.get("model")
    return [str(model)] if isinstance(model, (str, int, float)) and not isinstance(model, bool) else []


def _endpoints(
    problems: _Problems, validated: Any, raw: Any, default_engine: str
) -> tuple[EndpointConfig, ...] | None:
    """``endpoints[]``; the checks across keys and entries look at the raw entries so they run even
    when some entry has a bad value."""
    if not isinstance(raw, list):
        return None if validated is _FAILED else ()
    seen_ids: dict[str, int] = {}
    for i, item in enumerate(raw):
        if not isinstance(item, Mapping):
            continue
        if "model" in item and "models" in item:
            problems.add(("endpoints", i, "models"), "give either model or models, not both")
        elif "model" not in item and "models" not in item:
            problems.add(("endpoints", i, "model"), "is required")
        _either(problems, item, ("endpoints", i), "api_key", "api_key_env")
        ep_id = item.get("id")
        if isinstance(ep_id, str):
            if ep_id in seen_ids:
                problems.add(("endpoints", i, "id"), f"duplicate id {ep_id!r} (also endpoints[{seen_ids[ep_id]}])")
            else:
                seen_ids[ep_id] = i
    if validated is _FAILED:
        return None
    out = []
    for e in validated:
        models = e.models or ((e.model,) if e.model is not None else ())
        if not models:
            continue
        engine = e.engine or default_engine
        names = {
            sig: v
            for sig in ("waiting", "running", "kv_cache_usage")
            if (v := getattr(e.metric_names, sig)) is not None
        }
        out.append(
            EndpointConfig(
                id=e.id,
                url=e.url.url,
                models=models,
                engine=engine,
                pool=e.pool,
                api_key=_secret_of(e.api_key, e.api_key_env),
                metrics_path=e.metrics_path or get_engine(engine).metrics_path,
                metric_names=names,
                draining=e.draining,
                slots=e.slots or None,
                scheme=e.url.scheme,
                host=e.url.host,
                port=e.url.port,
                base_path=e.url.base_path,
            )
        )
    return tuple(out)


def _models(problems: _Problems, validated: Any, raw_endpoints: Any) -> dict[str, ModelConfig]:
    if validated is _FAILED:
        return {}
    # Served names from the raw entries: an endpoint with a bad url still serves its model.
    served = {m for item in (raw_endpoints if isinstance(raw_endpoints, list) else ()) for m in _raw_models(item)}
    out: dict[str, ModelConfig] = {}
    alias_owner: dict[str, str] = {}
    for name, m in validated.items():
        if name not in served:
            problems.add(("models", name), f"no endpoint serves model {name!r}; add one under endpoints: or remove this entry")
        for a in m.aliases:
            if a in served:
                problems.add(("models", name, "aliases"), f"{a!r} is already a served model name")
            elif a in alias_owner:
                problems.add(("models", name, "aliases"), f"{a!r} is already an alias of {alias_owner[a]!r}")
            else:
                alias_owner[a] = name
        out[name] = ModelConfig(name=name, aliases=m.aliases, strategy=m.strategy, upstream_name=m.upstream_name)
    return out


def _auth(problems: _Problems, validated: Any, raw: Any, bands: tuple[str, ...] | None) -> AuthConfig:
    raw_keys = raw.get("api_keys") if isinstance(raw, Mapping) else None
    for i, item in enumerate(raw_keys if isinstance(raw_keys, list) else ()):
        if isinstance(item, Mapping) and sum(k in item for k in ("key", "key_env", "key_sha256")) != 1:
            problems.add(("auth", "api_keys", i, "key"), "give exactly one of key, key_env or key_sha256")
    if validated is _FAILED:
        return AuthConfig()
    keys: list[ClientKey] = []
    seen: set[bytes] = set()
    for i, k in enumerate(validated.api_keys):
        given = [n for n in ("key", "key_env", "key_sha256") if getattr(k, n) is not None]
        if len(given) != 1:
            continue
        if k.key_sha256 is not None:
            digest = k.key_sha256
        else:
            secret = _secret_of(k.key, k.key_env)
            assert secret is not None
            digest = hashlib.sha256(secret.encode()).digest()
        loc = ("auth", "api_keys", i)
        if digest in seen:
            problems.add((*loc, given[0]), "the same key is listed twice")
        seen.add(digest)
        if k.band is not None and bands is not None and k.band not in bands:
            problems.add((*loc, "band"), f"unknown band {k.band!r}; admission.bands is {', '.join(bands)}")
        keys.append(ClientKey(name=k.name or f"key{i}", sha256=digest, band=k.band))
    return AuthConfig(keys=tuple(keys))


def _control(problems: _Problems, c: Any, raw: Any) -> ControlConfig | None:
    _either(problems, raw, ("control",), "join_token", "join_token_env")
    if c is _FAILED or c is None:
        return None
    grace = c.heartbeat_grace if c.heartbeat_grace is not None else 3 * c.heartbeat_interval
    if grace < c.heartbeat_interval:
        problems.add(
            ("control", "heartbeat_grace"), f"must be at least control.heartbeat_interval ({c.heartbeat_interval:g}s)"
        )
    tokens = tuple(e.value for e in c.join_token_env) if c.join_token_env else (c.join_token or ())
    return ControlConfig(
        listen=c.listen, join_tokens=tokens, heartbeat_interval=c.heartbeat_interval, heartbeat_grace=grace,
        database=c.database,
    )


def _deployments(problems: _Problems, validated: Any, raw: Any) -> tuple[DeploymentConfig, ...]:
    seen: dict[str, int] = {}
    for i, item in enumerate(raw if isinstance(raw, list) else ()):
        name = item.get("name") if isinstance(item, Mapping) else None
        if isinstance(name, str):
            if name in seen:
                problems.add(("deployments", i, "name"), f"duplicate name {name!r} (also deployments[{seen[name]}])")
            else:
                seen[name] = i
    return () if validated is _FAILED else tuple(validated)


def _build(data: Any, problems: _Problems, *, serve: bool = False) -> Config:
    doc = _document(problems, data, _ConfigIn)
    if doc is None:
        problems.raise_if_any()
        raise AssertionError("unreachable")
    v = {name: _section(problems, _ConfigIn, doc, name) for name in _ConfigIn.model_fields}

    def raw(name: str) -> Any:
        return doc.get(name)

    def ok(name: str, fallback: Any) -> Any:
        return fallback if v[name] is _FAILED else v[name]

    scrape = ok("scrape", ScrapeConfig())
    if v["scrape"] is not _FAILED:
        scrape = _scrape(problems, scrape, raw("scrape") or {})
    endpoints = _endpoints(problems, v["endpoints"], raw("endpoints"), scrape.default_engine)
    models = _models(problems, v["models"], raw("endpoints"))
    admission = v["admission"]
    if admission is not _FAILED:
        admission = _admission(problems, admission, raw("admission") or {})
    auth = _auth(problems, v["auth"], raw("auth"), None if admission is _FAILED else admission.bands)
    breaker = v["breaker"]
    if breaker is not _FAILED:
        breaker = _breaker(problems, breaker, raw("breaker") or {})
    _either(problems, doc, (), "admin_token", "admin_token_env")
    admin_token = None
    if v["admin_token"] is not _FAILED and v["admin_token_env"] is not _FAILED:
        admin_token = _secret_of(v["admin_token"], v["admin_token_env"])
    mirror_root = None
    if v["mirror"] is not _FAILED and v["mirror"].root is not None:
        mirror_root = os.path.expanduser(v["mirror"].root)
    control = _control(problems, v["control"], raw("control"))
    deployments = _deployments(problems, v["deployments"], raw("deployments"))
    follow = None
    if v["follow"] is not _FAILED and v["follow"] is not None:
        f = v["follow"]
        follow = FollowConfig(control=f.control, token=f.token_env.value if f.token_env else None)

    cfg = Config(
        listen=ok("listen", DEFAULT_LISTEN),
        admin=ok("admin", DEFAULT_ADMIN),
        endpoints=endpoints or (),
        models=models,
        server=ok("server", ServerConfig()),
        upstream=ok("upstream", UpstreamConfig()),
        retries=ok("retries", RetryConfig()),
        scrape=scrape,
        routing=ok("routing", RoutingConfig()),
        saturation=ok("saturation", SaturationConfig()),
        admission=AdmissionConfig() if admission is _FAILED else admission,
        breaker=BreakerConfig() if breaker is _FAILED else breaker,
        auth=auth,
        access_log=AccessLogConfig(enabled=ok("access_log", AccessLogConfig().enabled)),
        mirror_root=mirror_root,
        admin_token=admin_token,
        source=problems.source,
        control=control,
        deployments=deployments,
        follow=follow,
    )
    # What serve refuses is asked of a file whose endpoints are otherwise fine (a bad
    # entry already says what is wrong with it).
    if serve and not any(p.key.startswith("endpoints") for p in problems.found):
        for p in serve_problems(cfg, problems.line(("endpoints",)) if "endpoints" in doc else None):
            problems.found.append(p)
    problems.raise_if_any()
    return cfg


def serve_problems(cfg: Config, line: int | None = None) -> list[ConfigProblem]:
    """What ``llmgw serve`` refuses in a configuration that is otherwise valid.

    A file can be valid and still describe no gateway (an empty file is a valid
    configuration of defaults): ``check-config`` and ``serve`` both ask this, so
    what one refuses the other refuses with the same words.
    """
    if not cfg.endpoints:
        return [
            ConfigProblem(
                "endpoints", "no endpoints configured; add at least one (see docs/config.md)", cfg.source, line
            )
        ]
    return []


def validate_for_serve(cfg: Config) -> None:
    """Raise what :func:`serve_problems` finds.

    Raises:
        ConfigError: the configuration cannot be served.
    """
    found = serve_problems(cfg)
    if found:
        raise ConfigError(problems=found)


def load(data: Any, source: str | None = None, *, serve: bool = False) -> Config:
    """Validate a parsed YAML document and build the :class:`Config`.

    ``serve``: also refuse what ``llmgw serve`` would (:func:`serve_problems`).

    Raises:
        ConfigError: every problem found, each naming its key.
    """
    return _build(data, _Problems(source), serve=serve)


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
    problems.raise_if_any()
    return AgentConfig(
        control=v["control"],
        token=v["token_env"].value if v["token_env"] is not None else None,
        name=v["name"],
        gpu_source=v["gpu_source"],
        engines=v["engines"],
        source=problems.source,
    )


# -- files: YAML with the line of every key --


class _Loader(yaml.SafeLoader):
    """A safe loader that notes duplicate keys (YAML keeps the last one silently)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        # id(mapping node) -> [(key, first line, repeated line)]
        self.duplicates: dict[int, list[tuple[Any, int, int]]] = {}

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            first: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                    continue
                key = self.construct_object(key_node)
                line = key_node.start_mark.line + 1
                if key in first:
                    self.duplicates.setdefault(id(node), []).append((key, first[key], line))
                else:
                    first[key] = line
        return super().construct_mapping(node, deep=deep)


def _note_lines(
    loader: _Loader, node: yaml.Node, loc: _Loc, lines: dict[_Loc, int], dups: list[tuple[_Loc, int, int]],
    seen: set[int],
) -> None:
    if id(node) in seen:  # an alias of a node already walked (or a recursive one)
        return
    seen = seen | {id(node)}
    if isinstance(node, yaml.MappingNode):
        for key, first, again in loader.duplicates.get(id(node), ()):
            dups.append(((*loc, key), first, again))
        for key_node, value in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                continue
            key = loader.construct_object(key_node)
            lines.setdefault((*loc, key), key_node.start_mark.line + 1)
            _note_lines(loader, value, (*loc, key), lines, dups, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines[(*loc, i)] = item.start_mark.line + 1
            _note_lines(loader, item, (*loc, i), lines, dups, seen)


def _read_yaml(path: str | os.PathLike[str]) -> tuple[Any, _Problems]:
    """The document in ``path`` and a problem list that knows its lines (with any duplicate keys in it).

    Raises:
        ConfigError: unreadable file or invalid YAML.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("", f"config file {str(p)!r} does not exist") from None
    except OSError as exc:
        raise ConfigError("", f"cannot read config file {str(p)!r}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError("", f"config file {str(p)!r} is not UTF-8 text") from exc
    loader = _Loader(text)
    lines: dict[_Loc, int] = {}
    dups: list[tuple[_Loc, int, int]] = []
    try:
        node = loader.get_single_node()
        data = None
        if node is not None:
            data = loader.construct_document(node)
            lines[()] = node.start_mark.line + 1
            _note_lines(loader, node, (), lines, dups, set())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(
            "", f"not valid YAML{where}: {problem}", source=str(p), line=mark.line + 1 if mark is not None else None
        ) from None
    finally:
        loader.dispose()
    problems = _Problems(str(p), lines)
    for loc, first, again in dups:
        problems.found.append(
            ConfigProblem(_dotted(loc), f"duplicate key {str(loc[-1])!r} (first at line {first}, again at line {again})",
                          str(p), again)
        )
    return data, problems


def load_file(path: str | os.PathLike[str], *, serve: bool = False) -> Config:
    """Read, parse and validate a YAML config file.

    ``serve``: also refuse what ``llmgw serve`` would (:func:`serve_problems`).

    Raises:
        ConfigError: unreadable file, invalid YAML, or every invalid key.
    """
    data, problems = _read_yaml(path)
    return _build(data, problems, serve=serve)


def load_agent_file(path: str | os.PathLike[str]) -> AgentConfig:
    """Read, parse and validate a node agent's YAML config file.

    Raises:
        ConfigError: unreadable file, invalid YAML, or every invalid key.
    """
    data, problems = _read_yaml(path)
    return _build_agent(data, problems)


def config_schema(*, agent: bool = False) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of ``llmgw.yaml`` (or, with ``agent``, the node agent's file).

    It describes the file's shape and every value's form; what needs more than
    the file (an environment variable being set, an alias clashing with a model
    another endpoint serves) only the loader checks.
    """
    model = _AgentIn if agent else _ConfigIn
    schema = TypeAdapter(model).json_schema()
    docs = _field_docs()
    for name, sub in [(model.__name__, schema), *schema.get("$defs", {}).items()]:
        for key, prop in sub.get("properties", {}).items():
            doc = docs.get(name, {}).get(key)
            if doc:
                form = prop.get("description")
                prop["description"] = f"{doc} ({form})" if form else doc
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        **schema,
        "title": "llmgw node agent" if agent else "llmgw.yaml",
    }


def _field_docs() -> dict[str, dict[str, str]]:
    """Class name -> field -> the docstring written under the field in this module."""
    import ast
    import inspect
    import sys
    from itertools import pairwise

    try:
        tree = ast.parse(inspect.getsource(sys.modules[__name__]))
    except (OSError, TypeError):  # pragma: no cover - no source shipped: no descriptions
        return {}
    out: dict[str, dict[str, str]] = {}
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for stmt, nxt in pairwise(cls.body):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                out.setdefault(cls.name, {})[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return out


def find_config(explicit: str | None) -> Path | None:
    """The config file to use: ``explicit``, else ``./llmgw.yaml`` if present."""
    if explicit:
        return Path(explicit)
    local = Path("llmgw.yaml")
    return local if local.is_file() else None
