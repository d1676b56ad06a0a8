"""A control plane started before its PostgreSQL (``control.database_wait``): it waits and then leads;
one that refuses stops the start at once; a stop while it waits ends it."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import pytest
from serve_helpers import Serve, http, the_leader, wait_until

from llmgw.testing.postgres import PostgresServer

pytestmark = pytest.mark.timeout(120)

TOKEN = "join-token-database-wait"


def _restart(pg: PostgresServer) -> None:
    """Start ``pg`` again on its port (its data kept)."""
    assert pg.bindir is not None and pg.dir is not None and pg.port is not None
    opts = (f"-c listen_addresses=127.0.0.1 -c port={pg.port} -c unix_socket_directories={pg.socket_dir} "
            "-c fsync=off")
    r = pg._run([str(pg.bindir / "pg_ctl"), "start", "-w", "-t", "60", "-D", str(pg.data),
                 "-l", str(pg.dir / "server.log"), "-o", opts], timeout=70)
    assert r.returncode == 0, r.stderr + pg.log_tail()


@pytest.fixture
def stopped_pg(postgres_server: PostgresServer) -> PostgresServer:
    """A PostgreSQL of its own (the session's one stays up for the other tests), stopped: its port known."""
    pg = PostgresServer()
    try:
        pg.start()
    except Exception as exc:  # (postgres_server above already skipped or failed where none is installed)
        pytest.fail(str(exc))
    pg._pg_ctl_stop()
    try:
        yield pg
    finally:
        pg.stop()


async def test_a_control_plane_started_before_its_database_waits_for_it_and_leads(
    tmp_path: Path, stopped_pg: PostgresServer,
) -> None:
    s = Serve(tmp_path, "early", stopped_pg.dsn, TOKEN).start()
    try:
        # the gateway is up (listeners bound first), not ready, while the database is away
        await wait_until(lambda: "trying again for up to" in s.stderr(), 20, "the wait said in the log")
        status, _, body = await wait_until(lambda: _get(s.admin, "/ready"), 20, "the admin listener")
        assert status == 503, body  # (a deployed model is not even known yet: no traffic to send here)
        ready = json.loads(body)
        assert ready["reason"] == "waiting_for_database" and "127.0.0.1" in ready["database"], ready
        await asyncio.sleep(1.0)
        assert s.alive(), s.stderr()[-2000:]
        assert "Traceback" not in s.stderr()
        _restart(stopped_pg)
        leader = await the_leader([s], 30)
        assert leader is s
        assert "reached" in s.stderr()
    finally:
        s.stop()
    assert s.proc is not None and s.proc.returncode == 0, s.stderr()[-2000:]


async def test_a_stop_while_it_waits_for_the_database_ends_it(tmp_path: Path, stopped_pg: PostgresServer) -> None:
    s = Serve(tmp_path, "stopped", stopped_pg.dsn, TOKEN).start()
    try:
        await wait_until(lambda: "trying again for up to" in s.stderr(), 20, "the wait said in the log")
        t0 = time.monotonic()
        s.signal(signal.SIGTERM)
        assert s.proc is not None
        rc = await asyncio.to_thread(s.proc.wait, 15)
        assert time.monotonic() - t0 < 10
        assert rc == 0, s.stderr()[-2000:]
        assert "stopped before the start finished" in s.stderr()
        assert "Traceback" not in s.stderr()
    finally:
        s.stop()


async def test_a_database_that_refuses_stops_the_start_at_once(tmp_path: Path, pg_dsn: str) -> None:
    missing = pg_dsn.rsplit("/", 1)[0] + "/llmgw_no_such_database"
    s = Serve(tmp_path, "refused", missing, TOKEN).start()  # (database_wait: the default, 60 s)
    assert s.proc is not None
    t0 = time.monotonic()
    rc = await asyncio.to_thread(s.proc.wait, 30)
    assert time.monotonic() - t0 < 20
    assert rc == 1
    last = s.stderr().strip().splitlines()[-1]
    assert "InvalidCatalogNameError" in last and "createdb" in last, last
    assert "trying again" not in s.stderr()


async def _get(port: int, path: str) -> tuple[int, dict[str, str], bytes] | None:
    try:
        return await http(port, "GET", path, timeout=2.0)
    except (OSError, asyncio.TimeoutError):
        return None
