"""Commands the tests need (``promtool``, ``tmux``, ``openssl``, ...): skipped where missing, failed under CI.

Where none of the named commands is on PATH the test is skipped, saying how to install one;
under ``LLMGW_REQUIRE_TOOLS=1`` (``.ci/run``, which installs them all) it fails instead, so a
tool CI lost cannot turn its tests into silent skips. ``@pytest.mark.needs_tool(...)`` does
this for a whole test (``conftest.py``); :func:`need_tool` in the middle of one, and :func:`need`
for what is not a command (a file system that takes ``O_DIRECT``).
"""

from __future__ import annotations

import os
import shutil
from typing import NoReturn

import pytest


def need_tool(*commands: str, install: str = "install it") -> str:
    """The first of ``commands`` on PATH; else skip (or fail, under ``LLMGW_REQUIRE_TOOLS=1``)."""
    for c in commands:
        path = shutil.which(c)
        if path:
            return path
    missing(f"needs {' or '.join(commands)} on PATH ({install})")


def need(ok: bool, what: str) -> None:
    """Go on if ``ok``; else skip saying ``what`` the test needs (fail under ``LLMGW_REQUIRE_TOOLS=1``)."""
    if not ok:
        missing(f"needs {what}")


def missing(msg: str) -> NoReturn:
    """What a test needs is not here: a skip, or a failure where CI provides everything."""
    if os.environ.get("LLMGW_REQUIRE_TOOLS") == "1":
        pytest.fail(msg + "; LLMGW_REQUIRE_TOOLS=1 makes this a failure", pytrace=False)
    pytest.skip(msg)
