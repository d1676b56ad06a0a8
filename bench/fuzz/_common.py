"""Helpers the targets share: how an input picks its feeding, and the twins."""

from __future__ import annotations

import importlib
from types import ModuleType

from _harness import Disagreement


def twins(name: str) -> tuple[ModuleType, ModuleType]:
    """(compiled, pure) ``llmgw._fast.<name>``; the compiled one must be built."""
    return importlib.import_module(f"llmgw._fast.{name}"), importlib.import_module(f"llmgw._fast.{name}_py")


def cut(data: bytes) -> list[bytes]:
    """Split an input into the reads a socket could deliver: the first byte picks how.

    0-2 whole; 3-4 two reads at a point the second byte picks; 5-6 reads of 1-16 bytes;
    7 one byte at a time (short inputs only).
    """
    if len(data) < 2:
        return [data]
    mode, arg, rest = data[0] & 7, data[1], data[2:]
    if mode <= 2 or not rest:
        return [rest]
    if mode <= 4:
        i = arg * len(rest) // 255
        return [rest[:i], rest[i:]]
    if mode <= 6 or len(rest) > 256:
        step = arg % 16 + 1
        return [rest[i : i + step] for i in range(0, len(rest), step)]
    return [rest[i : i + 1] for i in range(len(rest))]


def same(what: str, c: object, py: object, data: bytes, tag: str = "") -> None:
    if c != py:
        raise Disagreement(f"{what}: compiled {c!r} != pure {py!r} for {data[:300]!r}", tag or what)
