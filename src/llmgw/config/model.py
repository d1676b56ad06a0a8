"""The configuration the rest of llmgw reads, and the input schema of ``llmgw.yaml``.

The sections whose YAML shape is their runtime shape (``server:``,
``upstream:``, ``scrape:``, ...) are frozen dataclasses that pydantic validates
as they are, with their defaults written here once; the sections whose YAML
differs from what the code reads (``endpoints[]``, ``auth:``, secrets given by
environment variable) have an input model (``_EndpointIn``, ``_AuthIn``, ...,
all under ``_ConfigIn``) that :mod:`llmgw.config.loading` compiles into their
dataclass. A field's docstring is its description in the JSON Schema.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..http.server import ServerLimits
from ._rules import (
    _ADDRESSES,
    _ALIASES,
    _BANDS,
    _DEPLOYED_MODEL,
    _ENGINE,
    _ENV_MAP,
    _FLAG,
    _GRPC_SERVER,
    _HEADER_NAME,
    _HOSTPORT,
    _IDENT,
    _LABEL_MAP,
    _METRIC_NAMES,
    _METRICS_PATH,
    _MODEL_NAME,
    _MODELS,
    _RUNNABLE_ENGINE,
    _SECRET,
    _SHA256,
    _STRATEGY,
    _STRINGS,
    _TEXT,
    _URL,
    _duration,
    _env,
    _envs,
    _EnvValue,
    _int,
    _list_of,
    _num,
    _size,
    _Url,
)

DEFAULT_LISTEN = ("127.0.0.1", 8080)
DEFAULT_ADMIN = ("127.0.0.1", 9090)

_LIMITS = ServerLimits()  # the server's own defaults, written once there


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
    draining: Annotated[bool, _FLAG] = False
    slots: int | None = None
    # derived
    scheme: str = "http"
    host: str = "127.0.0.1"
    port: int = 80
    base_path: str = ""
    # set on a replica the control plane runs (llmgw.control.deployments); None for endpoints: entries
    deployment: str | None = None
    node: str | None = None

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
    expose_replica: Annotated[bool, _FLAG] = True
    """Proxied answers carry x-llmgw-replica: <id>; false keeps replica names from clients
    (the access log and metrics name them anyway)."""

    __pydantic_config__ = _SECTION


@dataclass(frozen=True, slots=True)
class UpstreamConfig:
    """How llmgw talks to replicas (``upstream:`` section)."""

    connect_timeout: Annotated[float, _duration(0.001)] = 2.0
    """TCP connect to a replica; past it the request is retried elsewhere."""
    # NOTE: 540s: a non-streamed answer arrives whole, so this bounds its whole
    # generation: 3,000 tokens at 10 tokens/s is 300s, plus prefill and the
    # engine's own queue. It stays under the OpenAI SDKs' 600s timeout less
    # admission.queue_timeout (30s), so the client hears llmgw's 504 (with
    # x-should-retry: false) before its own timeout makes it resend.
    first_byte_timeout: Annotated[float, _duration(0.001)] = 540.0
    """Request sent to response head (for a non-streamed request, its whole generation); past it 504, not retried."""
    read_timeout: Annotated[float, _duration(0.001)] = 300.0
    """Longest silence inside a response."""
    max_idle_connections: Annotated[int, _int(0)] = 64
    """Keep-alive connections kept per replica."""
    idle_timeout: Annotated[float, _duration(0.01)] | None = None
    """An idle upstream connection is closed after this; default per engine, below its own keep-alive (4s for
    vLLM, SGLang, trtllm-serve and llama-server, which close idle connections at 5s)."""
    max_buffered_body: Annotated[int, _size(lo=1024)] = 4 * 1024 * 1024
    """A non-streamed answer up to this size is buffered (a cut one becomes a 502); a larger
    one is relayed as it arrives, with the engine's framing (a cut shows as an incomplete body)."""

    __pydantic_config__ = _SECTION


@dataclass(frozen=True, slots=True)
class RetryConfig:
    """Retries before the first byte reached the client (``retries:`` section)."""

    attempts: Annotated[int, _int(0, 10)] = 1
    """How many other replicas are tried when one could not be reached or answered 502/503."""
    budget: Annotated[float, _num(0.0, 1.0)] = 0.2
    """Retries in flight may not exceed this fraction of the requests in flight."""
    after_send: Annotated[bool, _FLAG] = False
    """true: also resend a request whose bytes reached a replica that then failed (reset, end of stream, stalled
    answer) before any byte reached the client. Off: such a request is answered 502, never sent twice."""

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
class PrefixConfig:
    """The ``prefix`` strategy's knobs (``routing.prefix:``); docs/routing.md explains them.

    ``block_bytes`` is rounded down to a multiple of 8, and ``max_blocks`` lowered so
    that ``block_bytes * max_blocks`` is at most 64 KiB.
    """

    block_bytes: Annotated[int, _int(64, 4096)] = 256
    """The prompt's leading content is hashed in blocks of this many bytes (about 64 tokens)."""
    max_blocks: Annotated[int, _int(1, 1024)] = 64
    """Blocks hashed per request at most: the longest prefix routing can tell apart."""
    index_entries: Annotated[int, _int(64, 1 << 24)] = 16384
    """Slots of each model's prefix index (24 bytes each: 384 KiB by default), per router."""
    session_entries: Annotated[int, _int(64, 1 << 24)] = 4096
    """Slots of each model's session table (24 bytes each), per router."""
    entry_ttl: Annotated[float, _duration(1.0)] = 600.0
    """An index or session entry not used for this long is forgotten."""
    load_bound: Annotated[float, _num(0.0, 100.0)] = 0.25
    """A cached replica is preferred while it has a free slot or its utilisation (load / slots)
    exceeds the least-loaded choice's by at most this much (and, while that choice has a free slot,
    only if the wait is shorter than the prefill the cache saves); past it the request spills along
    the prefix's rendezvous order."""
    session_header: Annotated[str, _HEADER_NAME] = "x-session-id"
    """The request header naming a conversation (else the body's prompt_cache_key, safety_identifier, user)."""
    share: Annotated[bool, _FLAG] = True
    """Share where conversations' turns went with the other routers of the same control plane (a router
    with ``follow:``, or the one ``control:`` runs in), so a turn that reaches another router than the one
    before it finds its replica's cache (docs/routing.md "Several routers")."""

    __pydantic_config__ = _SECTION

    @property
    def block(self) -> int:
        """``block_bytes`` as used: a multiple of 8."""
        return self.block_bytes // 8 * 8

    @property
    def blocks(self) -> int:
        """``max_blocks`` as used: ``block * blocks`` is at most 64 KiB."""
        return min(self.max_blocks, 65536 // self.block)


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """How a replica is chosen (``routing:`` section)."""

    strategy: Annotated[str, _STRATEGY] = "score"
    """score, least_inflight, round_robin or prefix."""
    prefix: PrefixConfig = field(default_factory=PrefixConfig)
    """The prefix strategy's knobs."""

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
    max_band: str | None = None


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

    enabled: Annotated[bool, _FLAG] = False


@dataclass(frozen=True, slots=True)
class ControlConfig:
    """The control plane (``control:``): ``llmgw serve`` runs it (docs/control-plane.md).

    ``heartbeat_grace`` defaults to three heartbeat intervals. TLS: ``tls_cert`` and
    ``tls_key`` (PEM files) together; ``tls_client_ca`` on top makes it mutual TLS.
    Without TLS the listener must be on loopback unless ``allow_insecure``.
    """

    listen: tuple[str, int]
    join_tokens: tuple[str, ...] = field(default=(), repr=False)
    router_tokens: tuple[str, ...] = field(default=(), repr=False)
    """Tokens a router following this control plane presents (``follow:``; docs/follow.md); none: no router may."""
    heartbeat_interval: float = 5.0
    heartbeat_grace: float = 15.0
    database: str | None = field(default=None, repr=False)
    database_wait: float = 60.0
    lease: float = 15.0
    advertise: str | None = None
    state_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    allow_insecure: Annotated[bool, _FLAG] = False
    grpc_server: str = "llmgw"
    """``llmgw``: the control plane's own gRPC server (:mod:`llmgw.control.grpcserver`); ``grpcio``: grpc.aio's."""


@dataclass(frozen=True, slots=True)
class DeploymentConfig:
    """One model deployment the control plane runs (``deployments[]``; docs/deployments.md)."""

    name: Annotated[str, _IDENT]
    """Unique name of the deployment."""
    model: Annotated[str, _DEPLOYED_MODEL]
    """The model: a mirror reference (tiny:1b), a file path on the nodes, or an id the engine downloads itself."""
    engine: Annotated[str, _RUNNABLE_ENGINE] = "vllm"
    """The engine that runs it."""
    replicas: Annotated[int, _int(0, 1024)] = 1
    """How many replicas to run."""
    gpus: Annotated[int, _int(0, 64)] | None = None
    """GPUs per replica (0: CPU); default 1, or 0 for llamacpp."""
    gpu_memory: Annotated[int, _size()] | None = None
    """GPU memory each replica needs on each of its GPUs (a size); default: from the mirror's GGUF facts."""
    args: Annotated[tuple[str, ...], _STRINGS] = field(default=(), repr=False)
    """Extra command-line arguments for the engine (not in the repr: ``--hf-token VALUE`` and the like)."""
    env: Annotated[Mapping[str, str], _ENV_MAP] = field(default_factory=dict, repr=False)
    """Extra environment variables for the engine."""
    served_name: Annotated[str, _MODEL_NAME] | None = None
    """The model name clients use (default: the deployment's name)."""
    gpu_model: Annotated[str, _TEXT] | None = None
    """Only GPUs whose name contains this (case-insensitive): H100, A100-SXM4-80GB."""
    node_labels: Annotated[Mapping[str, str], _LABEL_MAP] = field(default_factory=dict)
    """Only nodes with every one of these labels (the agent's labels:)."""
    share_gpus: Annotated[bool, _FLAG] = False
    """true: replicas may share a GPU (each holds gpu_memory of it); default one replica per GPU."""
    slots: Annotated[int, _int(1, 4096)] | None = None
    """Parallel sequences per replica (llama.cpp -np)."""
    context: Annotated[int, _int(1, 10_000_000)] | None = None
    """Context length in tokens (llama.cpp -c: shared by the slots)."""
    memory: Annotated[int, _size()] | None = None
    """Node memory a CPU replica needs (default: from the mirror's GGUF facts)."""
    cpu_cores: Annotated[float, _num(0.0, 4096.0)] | None = None
    """CPU cores a CPU replica claims (default: none claimed)."""
    ready_timeout: Annotated[float, _duration(1.0, 7 * 86400.0)] | None = None
    """How long each replica's engine may take from its start to its health check's first 200 before it
    fails (default: its agent's ``ready_timeout``, 30m). Changing it alone restarts nothing."""

    __pydantic_config__ = _SECTION

    @property
    def gpu_count(self) -> int:
        """GPUs per replica, the engine's default applied."""
        if self.gpus is not None:
            return self.gpus
        return 0 if self.engine == "llamacpp" else 1

    @property
    def model_name(self) -> str:
        """The name clients use."""
        return self.served_name or self.name


@dataclass(frozen=True, slots=True)
class FollowConfig:
    """Follow control planes for the fleet's replicas (``follow:``; docs/follow.md).

    The router receives the ready-replica table from whichever of ``control`` leads.
    TLS: ``tls`` (the system's CAs) or ``tls_ca``; ``tls_cert``/``tls_key`` on top for
    mutual TLS. Plaintext to an address off loopback needs ``allow_plaintext``.
    """

    control: tuple[tuple[str, int], ...]
    token: str | None = field(default=None, repr=False)
    tls: Annotated[bool, _FLAG] = False
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    allow_plaintext: Annotated[bool, _FLAG] = False
    name: str | None = None


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
    admin_allow_unauthenticated: bool = False
    source: str | None = None
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
    max_band: Annotated[str, _IDENT] | None = None
    """The highest band the key's requests may ask for (with the priority header); a request asking
    for a higher one is refused (403). Without band, the key's default is admission.default_band, or
    max_band where the default is higher."""
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
    """The mirror's directory (~ is expanded); default $LLMGW_MIRROR, else $XDG_DATA_HOME/llmgw/mirror, else
    ~/.local/share/llmgw/mirror."""


class _ControlIn(_In):
    """The control plane: node agents register with it over gRPC (docs/control-plane.md)."""

    listen: Annotated[tuple[str, int], _HOSTPORT]
    """HOST:PORT of the control plane's gRPC listener for node agents."""
    join_token: Annotated[tuple[str, ...], _list_of(_SECRET, "expected a token or a list of tokens",
                                                    one_or_many=True)] | None = Field(default=None, repr=False)
    """Token(s) a node agent must present to join (prefer join_token_env)."""
    join_token_env: Annotated[tuple[_EnvValue, ...], _envs("join_token")] | None = None
    """Environment variable(s) holding the join token(s)."""
    router_token: Annotated[tuple[str, ...], _list_of(_SECRET, "expected a token or a list of tokens",
                                                      one_or_many=True)] | None = Field(default=None, repr=False)
    """Token(s) a router with follow: must present to receive the replica table (prefer router_token_env)."""
    router_token_env: Annotated[tuple[_EnvValue, ...], _envs("router_token")] | None = None
    """Environment variable(s) holding the router token(s)."""
    heartbeat_interval: Annotated[float, _duration(0.1, 3600.0)] = _default(ControlConfig, "heartbeat_interval")
    """How often a node agent reports."""
    heartbeat_grace: Annotated[float, _duration(0.1, 86400.0)] | None = None
    """A node silent this long is lost (default: three heartbeat intervals)."""
    database: Annotated[str, _SECRET] | None = Field(default=None, repr=False)
    """Where the control plane keeps all its state: postgresql://USER@HOST:PORT/DB (several llmgw serve processes share
    it and elect a leader; docs/ha.md), sqlite:///RELATIVE/PATH, sqlite:////ABSOLUTE/PATH or sqlite::memory:; default:
    an SQLite file (deployments.sqlite3 beside state_file, else ~/.local/state/llmgw/control.sqlite3)."""
    database_env: Annotated[_EnvValue, _env("database")] | None = None
    """The environment variable holding control.database (it may carry a password)."""
    database_wait: Annotated[float, _duration(0.0, 86400.0)] = _default(ControlConfig, "database_wait")
    """At start, how long to keep trying a PostgreSQL that cannot be reached yet (refused, timed out, starting up)
    before giving up; 0: at once. One that refuses (a password, no such database) stops the start at once."""
    lease: Annotated[float, _duration(0.3)] = _default(ControlConfig, "lease")
    """The leader's lease; a standby takes over this long after the leader stops renewing."""
    advertise: Annotated[str, _TEXT] | None = _default(ControlConfig, "advertise")
    """The host name or address other processes and agents reach this one at (standbys name the leader by it);
    default: the listen host, or this machine's FQDN when that is a wildcard."""
    state_file: Annotated[str, _TEXT] | None = _default(ControlConfig, "state_file")
    """A JSON file keeping operators' decisions (cordons) across restarts; default: memory only."""
    tls_cert: Annotated[str, _TEXT] | None = _default(ControlConfig, "tls_cert")
    """PEM certificate (chain) the gRPC listener presents; with tls_key."""
    tls_key: Annotated[str, _TEXT] | None = _default(ControlConfig, "tls_key")
    """PEM private key of tls_cert."""
    tls_client_ca: Annotated[str, _TEXT] | None = _default(ControlConfig, "tls_client_ca")
    """PEM CA bundle: agents must present a certificate it signed (mutual TLS)."""
    allow_insecure: Annotated[bool, _FLAG] = _default(ControlConfig, "allow_insecure")
    """true: allow plaintext gRPC on a non-loopback address (join tokens travel in the clear)."""
    grpc_server: Annotated[str, _GRPC_SERVER] = _default(ControlConfig, "grpc_server")
    """What serves control.listen: llmgw (its own gRPC server, a quarter of grpcio's CPU per heartbeat) or grpcio
    (grpc.aio's server, as before 2026-12)."""


class _FollowIn(_In):
    """Follow control planes: the router receives their ready-replica table (docs/follow.md; not with control:)."""

    control: Annotated[tuple[tuple[str, int], ...], _ADDRESSES]
    """The control planes' gRPC address(es), HOST:PORT (every one of an HA group: the leader is followed)."""
    token: Annotated[str, _SECRET] | None = Field(default=None, repr=False)
    """The router token (control.router_token) to present (prefer token_env)."""
    token_env: Annotated[_EnvValue, _env("token")] | None = None
    """The environment variable holding the router token."""
    tls: Annotated[bool, _FLAG] = _default(FollowConfig, "tls")
    """true: TLS, trusting the system's CAs (implied by tls_ca)."""
    tls_ca: Annotated[str, _TEXT] | None = _default(FollowConfig, "tls_ca")
    """PEM CA bundle the control planes' certificates are checked against (turns TLS on)."""
    tls_cert: Annotated[str, _TEXT] | None = _default(FollowConfig, "tls_cert")
    """PEM client certificate for mutual TLS; with tls_key."""
    tls_key: Annotated[str, _TEXT] | None = _default(FollowConfig, "tls_key")
    """PEM private key of tls_cert."""
    allow_plaintext: Annotated[bool, _FLAG] = _default(FollowConfig, "allow_plaintext")
    """true: allow plaintext gRPC to a control plane off loopback (the table carries replica keys)."""
    name: Annotated[str, _IDENT] | None = _default(FollowConfig, "name")
    """This router's name in the control planes' logs and reports (default: the host name)."""


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
    admin_allow_unauthenticated: Annotated[bool, _FLAG] = _default(Config, "admin_allow_unauthenticated")
    """true: serve the admin API off loopback without admin_token (a network you trust); refused otherwise."""
    mirror: _MirrorIn = Field(default_factory=_MirrorIn)
    control: _ControlIn | None = None
    deployments: tuple[DeploymentConfig, ...] = ()
    """The deployments the control plane runs (needs control:)."""
    follow: _FollowIn | None = None
