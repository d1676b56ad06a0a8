"""The async tests run on uvloop, as llmgw does in production."""

from __future__ import annotations

import asyncio


async def test_tests_run_on_uvloop() -> None:
    assert type(asyncio.get_running_loop()).__module__.startswith("uvloop")
