"""Each fuzz target of ``bench/fuzz/`` runs a few hundred inputs (its seeds, then
mutants of them) with no crash and no disagreement, so the targets do not rot.

The long runs (a million inputs a target, coverage-guided with atheris) are by hand:
``bench/fuzz/README.md``.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest

FUZZ = Path(__file__).resolve().parent.parent / "bench" / "fuzz"
TWINS = ["request", "response", "jsonscan", "promscan", "h11"]  # compare with the compiled modules
PLAIN = ["gguf", "ollama", "proto"]


if str(FUZZ) not in sys.path:
    sys.path.insert(0, str(FUZZ))  # (the targets import their runner as a sibling, as when run by hand)


def _target(name: str) -> ModuleType:
    return importlib.import_module(f"fuzz_{name}")


def test_every_target_is_listed() -> None:
    assert sorted(p.stem[5:] for p in FUZZ.glob("fuzz_*.py")) == sorted(TWINS + PLAIN)
    for name in TWINS + PLAIN:
        assert any((FUZZ / "corpus" / name).iterdir()), f"{name} has no seeds"


def _run(name: str) -> None:
    from _harness import run_random

    stats = run_random(_target(name), 300, seed=7)
    assert stats.inputs == 300
    assert (stats.crashes, stats.disagreements) == (0, 0), stats.kinds


@pytest.mark.c_extension
@pytest.mark.parametrize("name", TWINS)
def test_twin_target_runs_clean(name: str) -> None:
    _run(name)


@pytest.mark.parametrize("name", PLAIN)
def test_target_runs_clean(name: str) -> None:
    _run(name)


def test_a_finding_is_recorded_not_raised(tmp_path: Path) -> None:
    # the runner's own contract: a crash or a disagreement is counted and saved, and the run goes on
    from _harness import Disagreement, Stats, checked

    class Target:
        @staticmethod
        def one_input(data: bytes) -> None:
            if data == b"crash":
                raise KeyError(data)
            if data == b"differ":
                raise Disagreement("twins differ", "tag")

    stats = Stats(tmp_path / "s.json", tmp_path / "findings")
    run = checked(Target, stats)  # type: ignore[arg-type]
    for data in (b"ok", b"crash", b"differ", b"crash", b"ok"):
        run(data)
    assert (stats.inputs, stats.crashes, stats.disagreements) == (5, 2, 1)
    saved = sorted(p.name for p in (tmp_path / "findings").iterdir() if not p.name.endswith(".txt"))
    assert len(saved) == 2 and {(tmp_path / "findings" / n).read_bytes() for n in saved} == {b"crash", b"differ"}
