"""llmgw's configuration: one YAML file, loaded once into immutable objects.

Every key is validated on load; an error names the key by its path and says how
to fix it (``endpoints[2].url: not a URL (expected http://host:port)``). Unknown
keys are errors (with a suggestion when one is close). Durations are written
``2s``, ``500ms``, ``1m``; sizes ``16MiB``, ``64KiB``, or a plain number of bytes.
Secrets can come from the environment (``api_key_env: NAME``) and never appear in
``repr``. ``docs/config.md`` documents every key.
"""

from __future__ import annotations

import difflib
import hashlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from .engines import ENGINE_NAMES
from .engines import get as get_engine
from .errors import ConfigError

__all__ = [
    "STRATEGIES",
    "AccessLogConfig",
    "AdmissionConfig",
    "AuthConfig",
    "BreakerConfig",
    "ClientKey",
    "Config",
    "EndpointConfig",
    "ModelConfig",
    "RetryConfig",
    "RoutingConfig",
    "SaturationConfig",
    "ScrapeConfig",
    "ServerConfig",
    "UpstreamConfig",
    "find_config",
    "load",
    "load_file",
    "parse_duration",
    "parse_hostport",
    "parse_size",
]

DEFAULT_LISTEN = ("127.0.0.1", 8080)
DEFAULT_ADMIN = ("127.0.0.1", 9090)

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|KiB|MiB|GiB|K|M|G)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "b": 1, "k": 1024, "kb": 1000, "kib": 1024, "m": 1024**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1024**3, "gb": 1000**3, "gib": 1024**3,
}
STRATEGIES = ("score", "least_inflight", "round_robin")
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_MODEL = re.compile(r"^[^\s\x00-\x1f]{1,256}$")
_ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_METRIC = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_HEADER = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")


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

    max_body_size: int = 16 * 1024 * 1024
    max_header_bytes: int = 16 * 1024
    max_headers: int = 100
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    keepalive_timeout: float = 75.0
    max_connections: int = 10_000
    shutdown_timeout: float = 10.0


@dataclass(frozen=True, slots=True)
class UpstreamConfig:
    """How llmgw talks to replicas (``upstream:`` section)."""

    connect_timeout: float = 2.0
    first_byte_timeout: float = 120.0
    read_timeout: float = 300.0
    max_idle_connections: int = 64
    idle_timeout: float = 30.0


@dataclass(frozen=True, slots=True)
class RetryConfig:
    """Retries before the first byte reached the client (``retries:`` section)."""

    attempts: int = 1
    budget: float = 0.2


@dataclass(frozen=True, slots=True)
class ScrapeConfig:
    """Engine telemetry polling (``scrape:`` section)."""

    interval: float = 1.0
    timeout: float = 0.8
    stale_after: float = 3.0
    default_engine: str = "vllm"


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """How a replica is chosen (``routing:`` section)."""

    strategy: str = "score"


@dataclass(frozen=True, slots=True)
class SaturationConfig:
    """When a replica counts as full (``saturation:`` section)."""

    max_waiting: int = 8
    max_kv_cache_usage: float = 0.9


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """Priority bands and their queues (``admission:`` section)."""

    bands: tuple[str, ...] = ("critical", "standard", "batch")
    default_band: str = "standard"
    header: str = "x-llmgw-priority"
    queue_size: int = 1000
    queue_timeout: float = 30.0

    def band_index(self, name: str) -> int:
        return self.bands.index(name)


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    """Per-replica circuit breakers (``breaker:`` section)."""

    failures: int = 5
    cooldown: float = 5.0
    max_cooldown: float = 60.0


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


# -- loading --


class _Reader:
    """Reads one mapping, tracking the keys used so leftovers are reported."""

    def __init__(self, data: Any, path: str, source: str | None) -> None:
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(path or "(top level)", f"expected a mapping of keys, got {type(data).__name__}", source=source)
        self.data = data
        self.path = path
        self.source = source
        self.used: set[str] = set()

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def err(self, name: str, message: str) -> ConfigError:
        return ConfigError(self.key(name), message, source=self.source)

    def has(self, name: str) -> bool:
        return name in self.data

    def raw(self, name: str, default: Any = None) -> Any:
        self.used.add(name)
        return self.data.get(name, default)

    def text(self, name: str, default: str | None = None, *, required: bool = False) -> str | None:
        self.used.add(name)
        if name not in self.data or self.data[name] is None:
            if required:
                raise self.err(name, "is required")
            return default
        v = self.data[name]
        if not isinstance(v, (str, int, float)) or isinstance(v, bool):
            raise self.err(name, f"expected a string, got {type(v).__name__}")
        return str(v)

    def flag(self, name: str, default: bool) -> bool:
        self.used.add(name)
        v = self.data.get(name, default)
        if not isinstance(v, bool):
            raise self.err(name, f"expected true or false, got {v!r}")
        return v

    def integer(self, name: str, default: int, *, lo: int | None = None, hi: int | None = None) -> int:
        self.used.add(name)
        v = self.data.get(name, default)
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.err(name, f"expected a whole number, got {v!r}")
        if lo is not None and v < lo:
            raise self.err(name, f"must be at least {lo}, got {v}")
        if hi is not None and v > hi:
            raise self.err(name, f"must be at most {hi}, got {v}")
        return v

    def number(self, name: str, default: float, *, lo: float | None = None, hi: float | None = None) -> float:
        self.used.add(name)
        v = self.data.get(name, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self.err(name, f"expected a number, got {v!r}")
        if lo is not None and v < lo:
            raise self.err(name, f"must be at least {lo}, got {v}")
        if hi is not None and v > hi:
            raise self.err(name, f"must be at most {hi}, got {v}")
        return float(v)

    def duration(self, name: str, default: float, *, min_s: float = 0.0) -> float:
        self.used.add(name)
        if name not in self.data:
            return default
        try:
            v = parse_duration(self.data[name], self.key(name))
        except ConfigError as exc:
            raise ConfigError(exc.key, exc.message, source=self.source) from None
        if v < min_s:
            raise self.err(name, f"must be at least {min_s * 1000:g}ms, got {self.data[name]!r}")
        return v

    def size(self, name: str, default: int, *, lo: int = 0) -> int:
        self.used.add(name)
        if name not in self.data:
            return default
        try:
            v = parse_size(self.data[name], self.key(name))
        except ConfigError as exc:
            raise ConfigError(exc.key, exc.message, source=self.source) from None
        if v < lo:
            raise self.err(name, f"must be at least {lo} bytes")
        return v

    def section(self, name: str) -> _Reader:
        self.used.add(name)
        return _Reader(self.data.get(name), self.key(name), self.source)

    def secret(self, name: str, env_name: str) -> str | None:
        """A secret given inline (``name``) or by environment variable (``env_name``)."""
        if self.has(name) and self.has(env_name):
            raise self.err(env_name, f"give either {name} or {env_name}, not both")
        if self.has(env_name):
            var = self.text(env_name)
            if not var or not _ENV.match(var):
                raise self.err(env_name, f"expected an environment variable name, got {var!r}")
            value = os.environ.get(var)
            if value is None:
                raise self.err(env_name, f"environment variable {var} is not set (export it, or use {name}:)")
            if not value:
                raise self.err(env_name, f"environment variable {var} is empty")
            return value
        value = self.text(name)
        if value is not None and not value:
            raise self.err(name, "is empty")
        return value

    def done(self) -> None:
        extra = [k for k in self.data if k not in self.used]
        if extra:
            k = extra[0]
            hint = difflib.get_close_matches(str(k), sorted(self.used), n=1)
            tip = f"; did you mean {hint[0]!r}?" if hint else f"; known keys: {', '.join(sorted(self.used))}"
            raise self.err(str(k), f"unknown key{tip}")


def _endpoint(r: _Reader, index: int, default_engine: str) -> EndpointConfig:
    ep_id = r.text("id", required=True)
    assert ep_id is not None
    if not _ID.match(ep_id):
        raise r.err("id", "use letters, digits, '.', '_' or '-' (at most 128), starting with a letter or digit")
    url = r.text("url", required=True)
    assert url is not None
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise r.err("url", f"not a URL (expected http://host:port), got {url!r}")
    if parts.scheme == "https":
        raise r.err("url", "https upstreams are not supported yet; put the replica on a private network and use http://")
    if parts.query or parts.fragment or parts.username:
        raise r.err("url", "must not contain credentials, a query or a fragment")
    try:
        port = parts.port or 80
    except ValueError:
        raise r.err("url", f"not a valid port in {url!r}") from None
    if r.has("model") and r.has("models"):
        raise r.err("models", "give either model or models, not both")
    if r.has("models"):
        raw = r.raw("models")
        if not isinstance(raw, list) or not raw or not all(isinstance(m, str) for m in raw):
            raise r.err("models", "expected a non-empty list of model names")
        models = tuple(raw)
    else:
        m = r.text("model", required=True)
        assert m is not None
        models = (m,)
    for m in models:
        if not _MODEL.match(m):
            raise r.err("model", f"invalid model name {m!r}")
    if len(set(models)) != len(models):
        raise r.err("models", "lists a model twice")
    engine = r.text("engine", default_engine)
    assert engine is not None
    if engine not in ENGINE_NAMES:
        raise r.err("engine", f"unknown engine {engine!r}; choose one of {', '.join(ENGINE_NAMES)}")
    api_key = r.secret("api_key", "api_key_env")
    pool = r.text("pool")
    metrics_path = r.text("metrics_path")
    if metrics_path is not None and not metrics_path.startswith("/"):
        raise r.err("metrics_path", f"must start with '/', got {metrics_path!r}")
    names: dict[str, tuple[str, ...]] = {}
    mn = r.section("metric_names")
    for sig in ("waiting", "running", "kv_cache_usage"):
        if mn.has(sig):
            v = mn.raw(sig)
            if isinstance(v, str):
                v = [v]
            if not isinstance(v, list) or not v or not all(isinstance(x, str) and _METRIC.match(x) for x in v):
                raise mn.err(sig, "expected a metric name or a list of them (letters, digits, '_' and ':')")
            names[sig] = tuple(v)
    mn.done()
    draining = r.flag("draining", False)
    slots = r.integer("slots", 0, lo=0, hi=1_000_000) or None
    r.done()
    return EndpointConfig(
        id=ep_id,
        url=url.rstrip("/"),
        models=models,
        engine=engine,
        pool=pool,
        api_key=api_key,
        metrics_path=metrics_path or get_engine(engine).metrics_path,
        metric_names=names,
        draining=draining,
        slots=slots,
        scheme=parts.scheme,
        host=parts.hostname,
        port=port,
        base_path=parts.path.rstrip("/"),
    )


def load(data: Any, source: str | None = None) -> Config:
    """Validate a parsed YAML document and build the :class:`Config`.

    Raises:
        ConfigError: the first problem found, naming its key.
    """
    r = _Reader(data, "", source)
    listen = parse_hostport(r.text("listen", "127.0.0.1:8080"), "listen")
    admin = parse_hostport(r.text("admin", "127.0.0.1:9090"), "admin")

    sc = r.section("scrape")
    interval = sc.duration("interval", 1.0, min_s=0.05)
    timeout = sc.duration("timeout", min(0.8, interval * 0.8), min_s=0.01)
    stale_after = sc.duration("stale_after", max(3.0, interval * 3), min_s=0.05)
    if timeout >= interval:
        raise sc.err("timeout", f"must be shorter than scrape.interval ({interval:g}s)")
    if stale_after < interval:
        raise sc.err("stale_after", f"must be at least scrape.interval ({interval:g}s)")
    default_engine = sc.text("default_engine", "vllm")
    assert default_engine is not None
    if default_engine not in ENGINE_NAMES:
        raise sc.err("default_engine", f"unknown engine {default_engine!r}; choose one of {', '.join(ENGINE_NAMES)}")
    sc.done()
    scrape = ScrapeConfig(interval=interval, timeout=timeout, stale_after=stale_after, default_engine=default_engine)

    eps_raw = r.raw("endpoints", [])
    if eps_raw is None:
        eps_raw = []
    if not isinstance(eps_raw, list):
        raise r.err("endpoints", "expected a list of endpoints")
    endpoints = []
    seen_ids: dict[str, int] = {}
    for i, item in enumerate(eps_raw):
        ep = _endpoint(_Reader(item, f"endpoints[{i}]", source), i, default_engine)
        if ep.id in seen_ids:
            raise ConfigError(
                f"endpoints[{i}].id", f"duplicate id {ep.id!r} (also endpoints[{seen_ids[ep.id]}])", source=source
            )
        seen_ids[ep.id] = i
        endpoints.append(ep)
    served = {m for ep in endpoints for m in ep.models}

    models: dict[str, ModelConfig] = {}
    mr = r.section("models")
    alias_owner: dict[str, str] = {}
    for name in list(mr.data):
        mr.used.add(name)
        sec = _Reader(mr.data[name], mr.key(str(name)), source)
        if name not in served:
            raise ConfigError(
                mr.key(str(name)),
                f"no endpoint serves model {name!r}; add one under endpoints: or remove this entry",
                source=source,
            )
        aliases_raw = sec.raw("aliases", [])
        if not isinstance(aliases_raw, list) or not all(isinstance(a, str) and _MODEL.match(a) for a in aliases_raw):
            raise sec.err("aliases", "expected a list of model names")
        for a in aliases_raw:
            if a in served:
                raise sec.err("aliases", f"{a!r} is already a served model name")
            if a in alias_owner:
                raise sec.err("aliases", f"{a!r} is already an alias of {alias_owner[a]!r}")
            alias_owner[a] = name
        upstream_name = sec.text("upstream_name")
        strategy = sec.text("strategy")
        if strategy is not None and strategy not in STRATEGIES:
            raise sec.err("strategy", f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
        sec.done()
        models[name] = ModelConfig(
            name=name, aliases=tuple(aliases_raw), strategy=strategy, upstream_name=upstream_name
        )

    s = r.section("server")
    server = ServerConfig(
        max_body_size=s.size("max_body_size", 16 * 1024 * 1024, lo=1024),
        max_header_bytes=s.size("max_header_bytes", 16 * 1024, lo=1024),
        max_headers=s.integer("max_headers", 100, lo=8, hi=10_000),
        header_timeout=s.duration("header_timeout", 10.0, min_s=0.01),
        body_timeout=s.duration("body_timeout", 60.0, min_s=0.01),
        keepalive_timeout=s.duration("keepalive_timeout", 75.0, min_s=0.01),
        max_connections=s.integer("max_connections", 10_000, lo=1),
        shutdown_timeout=s.duration("shutdown_timeout", 10.0),
    )
    s.done()

    u = r.section("upstream")
    upstream = UpstreamConfig(
        connect_timeout=u.duration("connect_timeout", 2.0, min_s=0.001),
        first_byte_timeout=u.duration("first_byte_timeout", 120.0, min_s=0.001),
        read_timeout=u.duration("read_timeout", 300.0, min_s=0.001),
        max_idle_connections=u.integer("max_idle_connections", 64, lo=0),
        idle_timeout=u.duration("idle_timeout", 30.0, min_s=0.01),
    )
    u.done()

    rt = r.section("retries")
    retries = RetryConfig(
        attempts=rt.integer("attempts", 1, lo=0, hi=10), budget=rt.number("budget", 0.2, lo=0.0, hi=1.0)
    )
    rt.done()

    ro = r.section("routing")
    strategy = ro.text("strategy", "score")
    assert strategy is not None
    if strategy not in STRATEGIES:
        raise ro.err("strategy", f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    ro.done()
    sa = r.section("saturation")
    saturation = SaturationConfig(
        max_waiting=sa.integer("max_waiting", 8, lo=1),
        max_kv_cache_usage=sa.number("max_kv_cache_usage", 0.9, lo=0.01, hi=1.0),
    )
    sa.done()
    ad = r.section("admission")
    bands_raw = ad.raw("bands", ["critical", "standard", "batch"])
    if (
        not isinstance(bands_raw, list)
        or not bands_raw
        or not all(isinstance(b, str) and _ID.match(b) for b in bands_raw)
        or len(set(bands_raw)) != len(bands_raw)
    ):
        raise ad.err("bands", "expected a list of distinct band names, highest priority first")
    if len(bands_raw) > 16:
        raise ad.err("bands", "at most 16 bands")
    default_band = ad.text("default_band", "standard" if "standard" in bands_raw else bands_raw[len(bands_raw) // 2])
    assert default_band is not None
    if default_band not in bands_raw:
        raise ad.err("default_band", f"{default_band!r} is not one of the bands ({', '.join(bands_raw)})")
    header = (ad.text("header", "x-llmgw-priority") or "").lower()
    if not _HEADER.match(header):
        raise ad.err("header", f"not a valid header name: {header!r}")
    admission = AdmissionConfig(
        bands=tuple(bands_raw),
        default_band=default_band,
        header=header,
        queue_size=ad.integer("queue_size", 1000, lo=0, hi=10_000_000),
        queue_timeout=ad.duration("queue_timeout", 30.0, min_s=0.001),
    )
    ad.done()
    br = r.section("breaker")
    cooldown = br.duration("cooldown", 5.0, min_s=0.001)
    breaker = BreakerConfig(
        failures=br.integer("failures", 5, lo=1, hi=1000),
        cooldown=cooldown,
        max_cooldown=br.duration("max_cooldown", max(60.0, cooldown), min_s=0.001),
    )
    if breaker.max_cooldown < cooldown:
        raise br.err("max_cooldown", "must be at least breaker.cooldown")
    br.done()

    a = r.section("auth")
    keys: list[ClientKey] = []
    keys_raw = a.raw("api_keys", [])
    if not isinstance(keys_raw, list):
        raise a.err("api_keys", "expected a list of keys")
    seen_hash: set[bytes] = set()
    for i, item in enumerate(keys_raw):
        kr = _Reader(item if not isinstance(item, str) else {"key": item}, a.key(f"api_keys[{i}]"), source)
        given = [k for k in ("key", "key_env", "key_sha256") if kr.has(k)]
        if len(given) != 1:
            raise kr.err("key", "give exactly one of key, key_env or key_sha256")
        if given[0] == "key_sha256":
            hexd = kr.text("key_sha256") or ""
            if not re.fullmatch(r"[0-9a-fA-F]{64}", hexd):
                raise kr.err("key_sha256", "expected 64 hex digits (sha256sum of the key)")
            digest = bytes.fromhex(hexd)
        else:
            secret = kr.secret("key", "key_env")
            assert secret is not None
            digest = hashlib.sha256(secret.encode()).digest()
        if digest in seen_hash:
            raise kr.err(given[0], "the same key is listed twice")
        seen_hash.add(digest)
        kname = kr.text("name", f"key{i}") or f"key{i}"
        band = kr.text("band")
        if band is not None and band not in admission.bands:
            raise kr.err("band", f"unknown band {band!r}; admission.bands is {', '.join(admission.bands)}")
        kr.done()
        keys.append(ClientKey(name=kname, sha256=digest, band=band))
    a.done()
    auth = AuthConfig(keys=tuple(keys))

    al = r.raw("access_log", False)
    if not isinstance(al, bool):
        raise r.err("access_log", f"expected true or false, got {al!r}")

    admin_token = r.secret("admin_token", "admin_token_env")
    mirror = r.section("mirror")
    mirror_root = mirror.text("root")
    if mirror_root is not None:
        mirror_root = os.path.expanduser(mirror_root)
    mirror.done()

    r.done()
    return Config(
        listen=listen,
        admin=admin,
        endpoints=tuple(endpoints),
        models=models,
        server=server,
        upstream=upstream,
        retries=retries,
        scrape=scrape,
        routing=RoutingConfig(strategy=strategy),
        saturation=saturation,
        admission=admission,
        breaker=breaker,
        auth=auth,
        access_log=AccessLogConfig(enabled=al),
        mirror_root=mirror_root,
        admin_token=admin_token,
        source=source,
    )


def load_file(path: str | os.PathLike[str]) -> Config:
    """Read, parse and validate a YAML config file.

    Raises:
        ConfigError: unreadable file, invalid YAML, or an invalid key.
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
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError("", f"not valid YAML{where}: {problem}", source=str(p)) from exc
    return load(data, source=str(p))


def find_config(explicit: str | None) -> Path | None:
    """The config file to use: ``explicit``, else ``./llmgw.yaml`` if present."""
    if explicit:
        return Path(explicit)
    local = Path("llmgw.yaml")
    return local if local.is_file() else None
