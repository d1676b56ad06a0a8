"""Reading a config file: YAML with the line of every key, and duplicate keys refused.

YAML would silently keep the last of two equal keys; :class:`_Loader` notes
them, and :func:`_read_yaml` returns the document with a :class:`_Problems` that
knows the line of every key (and already holds one problem per duplicate).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError, ConfigProblem
from ._problems import _dotted, _Loc, _Problems


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
