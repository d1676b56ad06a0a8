"""The rules that check every scalar of llmgw's config files, each with its message and its JSON Schema.

pydantic is left the structure of a file (mappings, lists, required and unknown
keys); each scalar (a duration, a size, ``HOST:PORT``, an id, a model or header
name, a URL, a secret given by environment variable, ...) is an ``Annotated``
type whose :class:`_Rule` converts it, refuses it in llmgw's own words, and says
what it looks like in the exported JSON Schema. ``parse_duration``,
``parse_size`` and ``parse_hostport`` are also used on their own (the CLI's
``--listen``).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from pydantic_core import PydanticCustomError, core_schema

# The routing kernel's pure module owns the strategy names (it imports nothing of llmgw's).
from .._fast.score_py import STRATEGIES
from ..engines import ENGINE_NAMES
from ..errors import ConfigError, unsendable_secret

# Engines llmgw could start itself (deployments, the node agent): not the
# proxy-only dialects.
RUNNABLE_ENGINES: tuple[str, ...] = tuple(e for e in ENGINE_NAMES if e not in ("generic", "external"))

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB|K|M|G|T)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "b": 1, "k": 1024, "kb": 1000, "kib": 1024, "m": 1024**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1024**3, "gb": 1000**3, "gib": 1024**3, "t": 1024**4, "tb": 1000**4, "tib": 1024**4,
}
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_MODEL = re.compile(r"^[^\s\x00-\x1f]{1,256}$")
_ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_METRIC = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_HEADER = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")
_HOSTPORT_PATTERN = r"^(\[[0-9A-Fa-f:.]+\]|[^:\s]*):\d+$"


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
        m = _DURATION.fullmatch(str(value))
        if not m:
            raise ConfigError(key, f"expected a duration like 2s or 500ms, got {value!r}")
        seconds = float(m.group(1)) * {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}[m.group(2)]
    if not math.isfinite(seconds):
        raise ConfigError(key, f"expected a duration like 2s or 500ms, got {value!r}")
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
        m = _SIZE.fullmatch(str(value))
        if not m:
            raise ConfigError(key, f"expected a size like 16MiB or a number of bytes, got {value!r}")
        n = int(float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "b").lower()])
    if n < 0:
        raise ConfigError(key, "a size cannot be negative")
    return n


def parse_hostport(value: Any, key: str = "", default_host: str = "127.0.0.1") -> tuple[str, int]:
    """``HOST:PORT``, ``[v6]:PORT`` or ``:PORT`` as ``(host, port)``; port 0 picks a free one."""
    s = str(value).strip()
    m = re.fullmatch(r"^\[([0-9A-Fa-f:.]+)\]:(\d+)$", s) or re.fullmatch(r"^([^:\s]*):(\d+)$", s)
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
        if not regex.fullmatch(s):
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


MAX_DURATION = 365 * 86400.0
"""The longest duration any key takes (a year): a larger one is a typo, and NaN or infinity no duration."""


def _duration(min_s: float = 0.0, max_s: float | None = None) -> _Rule:
    if max_s is None:
        max_s = MAX_DURATION

    def check(v: Any) -> float:
        seconds = parse_duration(v)
        if seconds < min_s:
            raise _Bad(f"must be at least {min_s * 1000:g}ms, got {v!r}")
        if max_s is not None and seconds > max_s:
            raise _Bad(f"must be at most {_human(max_s)}, got {v!r}")
        return seconds

    number: dict[str, Any] = {"type": "number", "minimum": min_s}
    if max_s is not None:
        number["maximum"] = max_s
    return _Rule(
        check,
        {
            "anyOf": [number, {"type": "string", "pattern": _DURATION.pattern}],
            "description": "a duration: 500ms, 2s, 1.5m, 1h, or a number of seconds"
                           + (f" (at most {_human(max_s)})" if max_s is not None else ""),
        },
    )


def _human(seconds: float) -> str:
    for unit, size in (("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


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
        if not _ENV.fullmatch(var):
            # SECURITY: not quoted: what stands where a variable's name belongs is most often the secret itself
            raise _Bad(f"expected an environment variable name (letters, digits, '_'), got {len(var)} characters "
                       f"that are not one (the secret itself? put it in the environment and give the variable's "
                       f"name{', or use ' + inline + ':' if inline else ''})")
        value = os.environ.get(var)
        if value is None:
            raise _Bad(f"environment variable {var} is not set (export it{instead})")
        if not value:
            raise _Bad(f"environment variable {var} is empty")
        why = unsendable_secret(value)
        if why is not None:  # SECURITY: the value is never quoted
            raise _Bad(f"environment variable {var} {why}")
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
                if not (isinstance(name, str) and os.environ.get(name) is None and _ENV.fullmatch(name)):
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
    if not isinstance(v, str):
        # (YAML reads 0777 as 511, 0x1F as 31, 1_000 as 1000: the secret would not be the one written)
        raise _Bad(f"expected a string, got {'a boolean' if isinstance(v, bool) else type(v).__name__}: "
                   "quote it (YAML reads an unquoted 0777 or 0x1F as a number)")
    if not v:
        raise _Bad("is empty")
    why = unsendable_secret(v)
    if why is not None:  # SECURITY: the value is never quoted
        raise _Bad(why)
    return v


class _Url(NamedTuple):
    url: str
    scheme: str
    host: str
    port: int
    base_path: str


def _shown(url: str) -> str:
    """A URL to quote in an error: what is before an ``@`` in its authority (credentials) replaced."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    authority, slash, path = rest.partition("/")
    if "@" in authority:
        authority = "***@" + authority.rpartition("@")[2]
    return f"{scheme}{sep}{authority}{slash}{path}"


def _url(v: Any) -> _Url:
    url = _text(v)
    if any(c.isspace() or not c.isprintable() for c in url):
        # (urlsplit drops CR, LF and tab silently: the request line would differ from the URL shown)
        raise _Bad(f"must not contain spaces or control characters (percent-encode them), got {_shown(url)[:80]!r}")
    try:
        parts = urlsplit(url)
        hostname = parts.hostname
    except ValueError:  # (an unclosed "[" of an IPv6 address)
        raise _Bad(f"not a URL (expected http://host:port), got {_shown(url)!r}") from None
    if parts.scheme not in ("http", "https") or not hostname:
        raise _Bad(f"not a URL (expected http://host:port), got {_shown(url)!r}")
    if parts.scheme == "https":
        raise _Bad("https upstreams are not supported yet; put the replica on a private network and use http://")
    if parts.query or parts.fragment or "@" in parts.netloc:  # (a password with no user name is credentials too)
        raise _Bad("must not contain credentials, a query or a fragment")
    try:
        port = parts.port or 80
    except ValueError:
        raise _Bad(f"not a valid port in {url!r}") from None
    return _Url(url.rstrip("/"), parts.scheme, hostname, port, parts.path.rstrip("/"))


def _model_list(v: Any) -> tuple[str, ...]:
    if not isinstance(v, list) or not v or not all(isinstance(m, str) for m in v):
        raise _Bad("expected a non-empty list of model names")
    for m in v:
        if not _MODEL.fullmatch(m):
            raise _Bad(f"invalid model name {m!r}")
    if len(set(v)) != len(v):
        raise _Bad("lists a model twice")
    return tuple(v)


def _bands(v: Any) -> tuple[str, ...]:
    if (
        not isinstance(v, list)
        or not v
        or not all(isinstance(b, str) and _ID.fullmatch(b) for b in v)
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
        if not isinstance(name, str) or not _ENV.fullmatch(name):
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
# A deployment's model: a mirror reference, a file path on the nodes or an engine's model id, said so
# A file path may hold spaces (``/models/Llama 3 (Q4).gguf``): engines are run from an argv, never a shell.
# Control characters (a line break would forge log lines) and whitespace at either end (a paste's stray
# blank, never meant) are refused; up to PATH_MAX.
_DEPLOYED = re.compile(r"^[^\s\x00-\x1f\x7f](?:[^\x00-\x1f\x7f]{0,4094}[^\s\x00-\x1f\x7f])?$")


def _deployed_model(v: Any) -> str:
    s = _text(v)
    if not _DEPLOYED.fullmatch(s):  # (not match: its $ passes a trailing line break)
        raise _Bad(f"invalid model {s!r}: no control characters, no whitespace at either end, at most 4096 characters")
    return s


_DEPLOYED_MODEL = _Rule(_deployed_model, {"type": "string", "pattern": _DEPLOYED.pattern})
_ENGINE = _choice("engine", ENGINE_NAMES)
_RUNNABLE_ENGINE = _choice("engine", RUNNABLE_ENGINES)
_STRATEGY = _choice("strategy", STRATEGIES)
_GRPC_SERVER = _choice("gRPC server", ("llmgw", "grpcio"))
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
_LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$")


def _label_map(v: Any) -> Mapping[str, str]:
    message = "expected a mapping of label names to values, e.g. {zone: eu-1}"
    if not isinstance(v, Mapping):
        raise _Bad(message)
    out: dict[str, str] = {}
    for name, value in v.items():
        if not isinstance(name, str) or not _LABEL.fullmatch(name):
            raise _Bad(f"{name!r} is not a label name (letters, digits, '.', '_', '/', '-'; at most 63)")
        text = _text(value)
        if len(text) > 63 or any(c.isspace() for c in text):
            raise _Bad(f"{name}: a label value has at most 63 characters and no spaces")
        out[name] = text
    return out


_LABEL_MAP = _Rule(
    _label_map,
    {"type": "object", "propertyNames": {"pattern": _LABEL.pattern}, "additionalProperties": {"type": "string"}},
)
_ADDRESSES = _list_of(_HOSTPORT, "expected HOST:PORT or a non-empty list of them", one_or_many=True)
