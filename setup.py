"""Build llmgw's compiled hot path (``src/llmgw/_fast/*.pyx``).

Every ``.pyx`` in ``src/llmgw/_fast`` becomes one extension module; each has a
pure-Python twin (``<name>_py.py``) that the package uses under
``LLMGW_NO_EXTENSIONS=1``. A ``<name>.pxd`` with no ``.pyx`` beside it declares
types for ``<name>_py.py`` itself (Cython's pure-Python mode): that file is both
the twin and, compiled, the extension ``<name>`` (the data path is built so).

Build switches (environment variables, so that ``pip install .`` carries them):

``LLMGW_NO_EXTENSIONS=1``
    build a pure-Python package (no compiler needed); the twins are used.
``LLMGW_DEBUG_BUILD=1``
    bounds checks back on, ``LLMGW_DEBUG`` invariant checks compiled in, ``-O0 -g``.
``LLMGW_CYTHON_ANNOTATE=1``
    write ``cython -a`` HTML next to each ``.pyx``.
``LLMGW_ONLY=name[,name]``
    build only these modules (development: ``LLMGW_ONLY=promscan python setup.py build_ext -i``).

A compiler failure is a hard error that says how to get the pure build: a silent
fallback would ship a gateway several times slower than the user expects.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent
FAST = ROOT / "src" / "llmgw" / "_fast"

NO_EXTENSIONS = bool(os.environ.get("LLMGW_NO_EXTENSIONS")) or sys.implementation.name != "cpython"
DEBUG = bool(os.environ.get("LLMGW_DEBUG_BUILD"))
ANNOTATE = bool(os.environ.get("LLMGW_CYTHON_ANNOTATE"))
ONLY = {n.strip() for n in os.environ.get("LLMGW_ONLY", "").split(",") if n.strip()}

# Directives live here and only here (STYLE.md §12).
DIRECTIVES = {
    "language_level": "3",
    "embedsignature": True,
    "binding": False,
    "boundscheck": DEBUG,
    "wraparound": DEBUG,
    "initializedcheck": DEBUG,
    "cdivision": True,
    "freethreading_compatible": False,
}


class BuildExt(build_ext):
    """``build_ext`` that turns a compiler failure into an actionable error."""

    force_all = False  # set when the build mode changed since the last build

    def finalize_options(self) -> None:
        super().finalize_options()
        if not self.parallel:
            self.parallel = os.cpu_count() or 1  # compile the modules side by side

    def run(self) -> None:
        if self.force_all:
            self.force = True
        try:
            super().run()
        except Exception as exc:
            raise SystemExit(
                "llmgw: building the compiled extensions failed "
                f"({exc}).\nInstall a C compiler and the Python headers "
                "(Debian: apt-get install gcc python3-dev), or build the pure-Python "
                "package with LLMGW_NO_EXTENSIONS=1 (several times slower on the request path)."
            ) from exc

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:
            raise SystemExit(
                f"llmgw: compiling {ext.name} failed ({exc}). "
                "Set LLMGW_NO_EXTENSIONS=1 to build the pure-Python package instead."
            ) from exc


def extensions() -> list[Extension]:
    if NO_EXTENSIONS:
        print("llmgw: LLMGW_NO_EXTENSIONS is set: building the pure-Python package", file=sys.stderr)
        return []
    from Cython.Build import cythonize

    if DEBUG:
        cflags = ["-O0", "-g3", "-UNDEBUG"]
        macros = [("LLMGW_DEBUG", "1"), ("CYTHON_TRACE", "0")]
    else:
        cflags = ["-O2"]
        macros = [("LLMGW_DEBUG", "0")]
    if sys.platform != "win32":
        cflags += ["-fno-strict-aliasing", "-Wno-unused-function", "-Wno-unreachable-code"]
    sources = {pyx.stem: pyx for pyx in FAST.glob("*.pyx")}
    newest_pxd = max((p.stat().st_mtime for p in FAST.glob("*.pxd")), default=0.0)
    for pxd in FAST.glob("*.pxd"):
        twin = FAST / f"{pxd.stem}_py.py"
        if pxd.stem not in sources and twin.exists():
            sources[pxd.stem] = twin  # pure-Python mode: the twin is the source
            # NOTE: Cython's up-to-date check does not follow the cimports of an
            # augmenting .pxd; a changed .pxd must regenerate the C file (a stale
            # one fails at import with "size changed").
            generated = twin.with_suffix(".c")
            if generated.exists() and generated.stat().st_mtime < newest_pxd:
                generated.unlink()
    exts = [
        Extension(
            f"llmgw._fast.{name}",
            [str(src.relative_to(ROOT))],
            extra_compile_args=cflags,
            define_macros=macros,
            include_dirs=[str(FAST.relative_to(ROOT))],
        )
        for name, src in sorted(sources.items())
        if not ONLY or name in ONLY
    ]
    # Directives and macros are not part of Cython's or setuptools' up-to-date
    # checks: a build mode switch (debug <-> release) must regenerate and recompile.
    stamp = ROOT / "build" / "llmgw-build-mode"
    mode = f"debug={DEBUG}"
    force = not stamp.exists() or stamp.read_text() != mode
    if force:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.write_text(mode)
        BuildExt.force_all = True
    return cythonize(
        exts,
        compiler_directives=DIRECTIVES,
        annotate=ANNOTATE,
        nthreads=os.cpu_count() or 0,
        quiet=True,
        force=force,
        include_path=[str(FAST.parent.parent.relative_to(ROOT))],
    )


class BuildPy(build_py):
    """``build_py`` that keeps the C and Cython sources out of the wheel (they are in the sdist).

    ``include_package_data`` takes every file MANIFEST.in names, ``.pyx`` included, and
    ``exclude-package-data`` did not drop them; the built tree is cleaned instead (a stale
    copy from an earlier build too). tests/test_wheel.py checks the result.
    """

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):  # an editable install copies nothing
            return
        for pattern in ("*.pyx", "*.c", "*.html"):
            for f in (Path(self.build_lib) / "llmgw" / "_fast").glob(pattern):
                f.unlink()


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildExt, "build_py": BuildPy})
