"""The one place that decides between compiled modules and their pure twins.

Every module in ``llmgw._fast`` exists twice: ``x`` (Cython) and ``x_py`` (pure
Python, the readable spec). ``NO_EXTENSIONS`` is true when ``LLMGW_NO_EXTENSIONS``
is set to a non-empty value other than ``0`` or when the interpreter is not
CPython; then the twins are used. Otherwise the compiled module is imported, and
if it cannot be, llmgw logs one warning per module naming the cause: a silent fall
back to the twins would be a silent slowdown.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from types import ModuleType

__all__ = ["NO_EXTENSIONS", "loaded", "select"]


def _env_flag(name: str) -> bool:
    value = os.environ.get(name, "")
    return value not in ("", "0", "false", "no")


NO_EXTENSIONS: bool = _env_flag("LLMGW_NO_EXTENSIONS") or sys.implementation.name != "cpython"

_loaded: dict[str, str] = {}
_chosen: dict[str, ModuleType] = {}
_log = logging.getLogger("llmgw.accel")


def select(name: str) -> ModuleType:
    """Return the implementation of ``llmgw._fast.<name>`` to use.

    Args:
        name: the module's base name, e.g. ``"httpproto"``.

    Returns:
        the compiled module, or its ``<name>_py`` twin under ``NO_EXTENSIONS`` or
        when the compiled one is missing (logged as a warning).
    """
    chosen = _chosen.get(name)
    if chosen is not None:
        return chosen  # (decided once: the warning of a missing compiled module is said once)
    if not NO_EXTENSIONS:
        try:
            module = importlib.import_module(f"llmgw._fast.{name}")
        except ImportError as exc:
            _log.warning(
                "compiled module llmgw._fast.%s is not available (%s); using the pure-Python twin, "
                "which is several times slower. Reinstall llmgw with a C compiler present, or set "
                "LLMGW_NO_EXTENSIONS=1 to choose the pure build on purpose.",
                name,
                exc,
            )
        else:
            _loaded[name] = "compiled"
            _chosen[name] = module
            return module
    module = importlib.import_module(f"llmgw._fast.{name}_py")
    _loaded[name] = "pure"
    _chosen[name] = module
    return module


def loaded() -> dict[str, str]:
    """Which implementation each selected module uses: ``{"httpproto": "compiled", ...}``."""
    return dict(_loaded)
