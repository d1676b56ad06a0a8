"""Problem collection: every mistake in a config file, in llmgw's words, each on its YAML line.

A document is validated section by section (:func:`_section`), so one bad
section hides no other's problems; :class:`_Problems` turns pydantic's errors
into one line each (the key by its path, ``endpoints[2].url``, with a
suggestion for an unknown key) and raises them all at once.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Annotated, Any, Union, get_args, get_origin, get_type_hints

from pydantic import BaseModel, TypeAdapter, ValidationError

from ..errors import ConfigError, ConfigProblem

if TYPE_CHECKING:
    from ._rules import _EnvValue
    from .model import _In


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
