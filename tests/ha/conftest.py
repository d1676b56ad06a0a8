"""A real PostgreSQL for the HA tests (``llmgw.testing.postgres``): one server per session, a database per test.

Where PostgreSQL is not installed the tests are skipped, unless ``LLMGW_REQUIRE_POSTGRES=1`` or
``LLMGW_REQUIRE_TOOLS=1`` (``.ci/run`` sets both, having installed Debian's ``postgresql``): then they fail.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "control"))  # cp_helpers, agent_proc, scenario

from llmgw.testing.postgres import PostgresNotFound, PostgresServer

_count = itertools.count()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    try:
        pg = PostgresServer().start()
    except PostgresNotFound as exc:
        if "1" in (os.environ.get("LLMGW_REQUIRE_POSTGRES"), os.environ.get("LLMGW_REQUIRE_TOOLS")):
            pytest.fail(str(exc))
        pytest.skip(str(exc))
    try:
        yield pg
    finally:
        pg.stop()


@pytest.fixture
def pg_dsn(postgres_server: PostgresServer) -> str:
    """A fresh, empty database on the session's server: ``postgresql://postgres@127.0.0.1:PORT/llmgw_N``."""
    import asyncpg

    name = f"llmgw_{os.getpid()}_{next(_count)}"

    async def create() -> None:
        conn = await asyncpg.connect(postgres_server.dsn)
        try:
            await conn.execute(f'CREATE DATABASE "{name}"')
        finally:
            await conn.close()

    asyncio.run(create())
    return postgres_server.dsn.rsplit("/", 1)[0] + "/" + name
