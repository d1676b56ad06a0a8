"""A bulk of desired-state writes (a ``ctl scale`` of 1,000 replicas) against a real PostgreSQL and SQLite:
committed in bounded transactions, each short, so the leader's lease row (which every fenced
transaction locks FOR SHARE and the renew updates) is never held for long; the renewals stay on
time and the leader never steps down meanwhile. (``bench/bulk_placement.py`` measures the whole
control plane doing it over 150 agents.)"""

from __future__ import annotations

import asyncio
import functools
import time
from pathlib import Path

import pytest
from cp_helpers import wait_for

from llmgw.control.db import MAX_TX_ROWS, DesiredStore, StoredDeployment, StoredReplica, open_database
from llmgw.control.leader import Leadership

pytestmark = pytest.mark.timeout(60)

LEASE = 1.5
N = 1000


async def _bulk(url: str) -> None:
    db = open_database(url)
    await db.open()
    try:
        await db.migrate()
        lead = Leadership(db, holder="a", lease=LEASE, grpc_address=None, admin_address=None)
        lead.start()
        await wait_for(lead.acting, what="a leads")
        epoch = lead.epoch
        assert epoch is not None
        store = DesiredStore(db, functools.partial(lead.transaction, epoch))
        told: list[str] = []
        store.put_deployment(StoredDeployment("bulk", "api", {"name": "bulk"}))
        for i in range(N):
            store.put_replica(StoredReplica(f"r-{i:04d}", "bulk", f"n-{i % 150}", {"api_key": "k"}, 1.0 + i),
                              then=functools.partial(told.append, f"r-{i:04d}"))
        # a deployment's delete straddling a transaction's end: both of its statements go together
        store.put_deployment(StoredDeployment("gone", "api", {"name": "gone"}))
        extra = MAX_TX_ROWS * 4 - N - 3  # (the 4th transaction's last write: the delete's first statement)
        for _ in range(extra):
            store.put_replica(StoredReplica("r-gone", "gone", "n-0", {"api_key": "k"}, 1.0))
        store.delete_deployment("gone")
        # meanwhile, what the renew does: an update of the lease row, timed (it waits for the writes' locks)
        waits: list[float] = []

        async def renews() -> None:
            while True:
                t0 = time.perf_counter()
                async with db.transaction(timeout=5, lease=True) as tx:
                    await tx.execute(db.sql("UPDATE llmgw_lease SET renewed_at = {now} WHERE name = 'control'"))
                waits.append(time.perf_counter() - t0)
                await asyncio.sleep(0.005)

        watcher = asyncio.create_task(renews())
        t0 = time.perf_counter()
        await store.flushed()
        took = time.perf_counter() - t0
        watcher.cancel()
        assert store.writes == 1 + N + 1 + extra + 2
        assert store.transactions == 4  # (the 4th one longer by the delete's second statement)
        assert told == [f"r-{i:04d}" for i in range(N)]  # every one told, in order, once committed
        assert lead.acting() and lead.stepped_down == 0
        check = DesiredStore(db, functools.partial(lead.transaction, epoch))
        await check.load()
        assert [d.name for d in check.deployments()] == ["bulk"]
        assert len(check.replicas()) == N and {r.deployment for r in check.replicas()} == {"bulk"}
        assert waits and max(waits) < LEASE / 3, (max(waits), took)
        await lead.stop()
    finally:
        await db.close()


async def test_a_thousand_replicas_in_short_transactions_on_postgres(pg_dsn: str) -> None:
    await _bulk(pg_dsn)


async def test_a_thousand_replicas_in_short_transactions_on_sqlite(tmp_path: Path) -> None:
    await _bulk(f"sqlite:///{tmp_path / 'control.db'}")
