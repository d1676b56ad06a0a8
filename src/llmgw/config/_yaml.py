"""Reading a config file: YAML with the line of every key, and duplicate keys refused.

YAML would silently keep the last of two equal keys; :class:`_Loader` notes
them, and :func:`_read_yaml` returns the document with a :class:`_Problems` that
knows the line of every key (and already holds one problem per duplicate).

A file that would exhaust the reader, or the checks after it, is refused in one
line rather than read: nested deeper than :data:`_MAX_DEPTH` (PyYAML composes
and merges by recursion), merge keys bringing more than :data:`_MAX_MERGED`
pairs into one mapping, aliases expanding it by more than
:data:`_MAX_EXPANDED` values ("billion laughs"), or an alias inside its own
anchor (data that nests without end).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError, ConfigProblem
from ._problems import _dotted, _Loc, _Problems

# text PyYAML quotes from the document in a problem (an alias, a tag: not its grammar's '<tokens>', nor a
# character such as '\t')
_QUOTED = re.compile(r"'(?!<)[^'\n]{4,}'")

_MERGE = "tag:yaml.org,2002:merge"

# Python's recursion limit is 1000 frames and PyYAML spends 3 on each level it
# composes: 128 levels leave room for the caller's stack (pytest, a reload on
# the event loop), and no config file comes near them.
_MAX_DEPTH = 128

# PyYAML before 6.0.4 copies every merged pair, so merges of merges
# (``<<: [*a, *a, ...]`` over a few levels) grow exponentially; a config
# mapping holds tens of keys.
_MAX_MERGED = 10_000

# The values that aliases may add to a document, copies of what their anchors hold: a generous config
# shares a few thousand this way, and loading one that shares 75,000 took 30ms.
_MAX_EXPANDED = 100_000


class _RefusedError(yaml.MarkedYAMLError):
    """Valid YAML that the loader will not read: too deep, too large once merged or expanded, or recursive."""


class _Loader(yaml.SafeLoader):
    """A safe loader that notes duplicate keys (YAML keeps the last one silently) and bounds nesting."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        # id(mapping node) -> [(key, first line, repeated line)]
        self.duplicates: dict[int, list[tuple[Any, int, int]]] = {}
        # id(mapping node) -> {key written in it, not brought by a merge key: its first line}
        self.written: dict[int, dict[Any, int]] = {}
        self._flattened: set[int] = set()
        self._depth = 0

    def _enter(self, mark: yaml.Mark | None, what: str) -> None:
        if self._depth >= _MAX_DEPTH:
            raise _RefusedError(problem=f"{what} too deeply (more than {_MAX_DEPTH} levels)", problem_mark=mark)
        self._depth += 1

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        self._enter(self.peek_event().start_mark, "nested")
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        # PyYAML flattens every mapping before building it, and the mappings a merge key names on the way,
        # so the first call sees a mapping as written: its duplicates are noted then (once flattened, a key
        # it overrides would look like one). Flattening the merged mappings here first, each once, bounds
        # the recursion of a chain of merges; PyYAML's own calls then find nothing left to merge.
        if id(node) in self._flattened:
            return
        self._flattened.add(id(node))
        first = self.written[id(node)] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE or not isinstance(key_node, yaml.ScalarNode):
                continue
            key = self.construct_object(key_node)
            line = key_node.start_mark.line + 1
            if key in first:
                self.duplicates.setdefault(id(node), []).append((key, first[key], line))
            else:
                first[key] = line
        merged = [
            source
            for key_node, value in node.value if key_node.tag == _MERGE
            for source in (value.value if isinstance(value, yaml.SequenceNode) else [value])
            if isinstance(source, yaml.MappingNode)  # PyYAML refuses the others, with their line
        ]
        self._enter(node.start_mark, "merge keys nested")
        try:
            for source in merged:
                self.flatten_mapping(source)
        finally:
            self._depth -= 1
        if sum(len(source.value) for source in merged) > _MAX_MERGED:
            raise _RefusedError(
                problem=f"merge keys bring more than {_MAX_MERGED} keys into one mapping", problem_mark=node.start_mark
            )
        super().flatten_mapping(node)


class _Lines(Mapping[_Loc, int]):
    """The line of every key path, aliases included, though only each node's first path was walked.

    A path under an alias (or under a collection a merge key shares) has the
    line of the same path under the first path of that node.
    """

    def __init__(self) -> None:
        self.walked: dict[_Loc, int] = {}
        # path of a node met again -> the path it was walked under
        self.shared: dict[_Loc, _Loc] = {}

    def __getitem__(self, loc: _Loc) -> int:
        # Ends: nothing was walked under a path in ``shared``, so the part of ``loc`` after the one
        # prefix found there is not empty, and a later prefix found leaves less of it.
        while loc not in self.walked:
            for n in range(len(loc) - 1, 0, -1):
                first = self.shared.get(loc[:n])
                if first is not None:
                    loc = first + loc[n:]
                    break
            else:
                raise KeyError(loc)
        return self.walked[loc]

    def __iter__(self) -> Iterator[_Loc]:
        return iter(self.walked)

    def __len__(self) -> int:
        return len(self.walked)


class _Walk:
    """One walk of a composed document: the line of every key path, its duplicate keys, and how far its aliases expand.

    PERF: an alias is its anchor's node, met again at another path. Walking it
    again there is exponential in levels of aliases of aliases ("billion
    laughs"), so each node is walked once, at its first path, and its other
    paths share that one's lines (:class:`_Lines`).
    """

    def __init__(self, loader: _Loader) -> None:
        self.loader = loader
        self.lines = _Lines()
        self.dups: list[tuple[_Loc, int, int]] = []
        self._first: dict[int, _Loc] = {}  # id(collection node) -> the path it was walked at
        self._size: dict[int, int] = {}  # id(collection node) -> the values it holds, its aliases expanded
        # NOTE: the loader's own expansions are cheap (an alias builds as the object of its anchor), but the
        # checks after it copy the document (``_unset_nulls``) as a tree, every alias expanded.
        self._expanded = 0

    def walk(self, node: yaml.Node, loc: _Loc) -> int:
        """Note the lines under ``node``, walked at ``loc``; the number of values it holds, aliases expanded.

        Raises:
            _RefusedError: an alias inside its own anchor, or aliases expanding past :data:`_MAX_EXPANDED`.
        """
        if not isinstance(node, (yaml.MappingNode, yaml.SequenceNode)):
            return 1
        if id(node) in self._first:  # an alias of a node already walked, or a merge key's value
            size = self._size.get(id(node))
            if size is None:  # still being walked: its own descendant
                raise _RefusedError(problem="an alias inside its own anchor nests the data without end",
                                    problem_mark=node.start_mark)
            self.lines.shared[loc] = self._first[id(node)]
            self._expanded += size
            if self._expanded > _MAX_EXPANDED:
                raise _RefusedError(problem=f"aliases expand the document past {_MAX_EXPANDED} values",
                                    problem_mark=node.start_mark)
            return size
        self._first[id(node)] = loc
        size = 1
        if isinstance(node, yaml.MappingNode):
            for key, first, again in self.loader.duplicates.get(id(node), ()):
                self.dups.append(((*loc, key), first, again))
            # The value walked is the one the data holds, the last of equal keys: PyYAML's flattening puts
            # the merged pairs first, so a key written in the mapping wins over one a merge key brought.
            # A key written in the mapping is on the line it is first written (twice is a problem of its
            # own); one a merge key brought, on the line of the pair the data holds.
            written = self.loader.written.get(id(node), {})
            kept: dict[Any, tuple[yaml.Node, yaml.Node]] = {}
            for key_node, value in node.value:
                if isinstance(key_node, yaml.ScalarNode):
                    kept[self.loader.construct_object(key_node)] = (key_node, value)
            for key, (key_node, value) in kept.items():
                self.lines.walked[(*loc, key)] = written.get(key, key_node.start_mark.line + 1)
                size += self.walk(value, (*loc, key))
        else:
            for i, item in enumerate(node.value):
                self.lines.walked[(*loc, i)] = item.start_mark.line + 1
                size += self.walk(item, (*loc, i))
        self._size[id(node)] = size
        return size


def _read_yaml(path: str | os.PathLike[str]) -> tuple[Any, _Problems]:
    """The document in ``path`` and a problem list that knows its lines (with any duplicate keys in it).

    Raises:
        ConfigError: unreadable file, invalid YAML, or YAML past the loader's limits (see the module).
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
    walk = _Walk(loader)
    try:
        node = loader.get_single_node()
        data = None
        if node is not None:
            data = loader.construct_document(node)
            walk.lines.walked[()] = node.start_mark.line + 1
            walk.walk(node, ())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or "invalid YAML"
        if not isinstance(exc, _RefusedError):
            # SECURITY: PyYAML quotes the token it stopped at ("found undefined alias 'X'", "the tag '!X'"): an
            # unquoted value starting with '*' or '!' (a key) would be shown; the line and column locate it
            problem = _QUOTED.sub("'…'", problem)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = f"not valid YAML{where}: {problem}"
        raise ConfigError("", problem, source=str(p), line=mark.line + 1 if mark is not None else None) from None
    finally:
        loader.dispose()
    problems = _Problems(str(p), walk.lines)
    for loc, first, again in walk.dups:
        problems.found.append(
            ConfigProblem(_dotted(loc), f"duplicate key {str(loc[-1])!r} (first at line {first}, again at line {again})",
                          str(p), again)
        )
    return data, problems
