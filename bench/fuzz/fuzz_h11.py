"""Fuzz target: the request reader (compiled) against h11, at volume.

The comparison of ``tests/http/test_h11_differential.py`` (``tests/http/h11_oracle.py``):
each input is read by llmgw's request reader and by h11 as a server; where they differ,
the difference must belong to one of the explained classes (``h11_oracle.EXPLAINED``,
each with its reason and RFC section). Each class met is counted under
``explained_differences``; a difference no class explains is a disagreement. The seeds
are the request target's valid requests (the first two bytes, its feeding choice,
are dropped here).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from _harness import Disagreement, explained, main

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "http"))

NAME = "h11"
INSTRUMENT = ["llmgw._fast.httpproto_py", "h11_oracle"]

_o: Any = None
_c: Any = None


def setup() -> None:
    global _o, _c
    import importlib

    import h11_oracle

    _o = h11_oracle
    _c = importlib.import_module("llmgw._fast.httpproto")


def one_input(data: bytes) -> None:
    ours, theirs = _o.llmgw_read(_c, data), _o.h11_read(data)
    if ours.end == theirs.end and (
        ours.end is not None or [_o.fields(r) for r in ours.requests] == [_o.fields(r) for r in theirs.requests]
    ):
        return
    name = _o.classify(data, ours, theirs)
    if name is None:
        raise Disagreement(f"unexplained: llmgw {ours}, h11 {theirs} for {data[:300]!r}",
                           f"{ours.end}/{ours.detail[:30]} vs {theirs.end}/{theirs.detail[:30]}")
    explained(name)


if __name__ == "__main__":
    main(sys.modules[__name__])
