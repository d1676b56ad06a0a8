"""The wheel ships the compiled modules and the contracts, not the C or Cython sources.

Builds the wheel of this checkout (``pip wheel . --no-deps --no-build-isolation``, or
with build isolation where the venv lacks setuptools/Cython; it
reuses the ``build/`` objects that installing the checkout left, so it is quick after
``pip install .``) and reads its file list. Under ``LLMGW_NO_EXTENSIONS=1`` the wheel is
the pure one (``py3-none-any``, no extension module). Skipped outside a source tree (the
wheel workflows run the suite against an installed wheel from a copy of ``tests/``).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FAST = ROOT / "src" / "llmgw" / "_fast"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (ROOT / "setup.py").exists() or not FAST.is_dir(), reason="not in a source tree"),
]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # --no-build-isolation where the build system is installed (a development venv); a venv
    # with only .[test] (CI's) lets pip fetch it (from its cache) into an isolated build env
    have_build = all(importlib.util.find_spec(m) for m in ("setuptools", "Cython", "wheel"))
    flags = ["--no-build-isolation"] if have_build else []
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", *flags, "-q",
         "--disable-pip-version-check", "-w", str(out)],
        cwd=ROOT, check=True, timeout=600,
    )
    (whl,) = out.glob("llmgw-*.whl")
    return whl


def test_wheel_holds_no_sources_and_the_contracts(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.endswith((".c", ".pyx", ".html"))], "C/Cython sources in the wheel"
    assert "llmgw/py.typed" in names
    pxd = {f"llmgw/_fast/{p.name}" for p in FAST.glob("*.pxd")}
    assert pxd and pxd <= set(names), sorted(pxd - set(names))
    assert "llmgw/_fast/debug.h" in names  # debug.pxd cimports it
    twins = {f"llmgw/_fast/{p.name}" for p in FAST.glob("*_py.py")}
    assert twins <= set(names), sorted(twins - set(names))


def test_wheel_holds_one_extension_per_compiled_module(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    exts = sorted(n.split("/")[-1].split(".")[0] for n in names if n.endswith((".so", ".pyd")))
    if os.environ.get("LLMGW_NO_EXTENSIONS"):
        assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
        assert exts == []
        return
    # a .pyx kernel, or a .pxd with a pure-mode _py twin and no .pyx: each one extension
    want = sorted({p.stem for p in FAST.glob("*.pyx")}
                  | {p.stem for p in FAST.glob("*.pxd") if (FAST / f"{p.stem}_py.py").exists()})
    assert exts == want
    assert "-none-any" not in wheel.name
