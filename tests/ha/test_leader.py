"""The election and the fenced writes against a real PostgreSQL (and SQLite), in process."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from pathlib import Path

import pytest
from cp_helpers import wait_for

from llmgw.control.db import MIGRATIONS, CordonStore, Migration, open_database
from llmgw.control.leader import Leadership, NotLeader
from llmgw.errors import ConfigError

LEASE = 1.0


class Clock:
    """A monotonic clock a test can freeze (a paused process sees no time pass until it resumes)."""

    def __init__(self) -> None:
        self.frozen: float | None = None

    def __call__(self) -> float:
        import time

        return self.frozen if self.frozen is not None else time.monotonic()


async def test_one_leads_the_other_takes_over_and_the_old_epoch_is_fenced(pg_dsn: str) -> None:
    db_a, db_b = open_database(pg_dsn), open_database(pg_dsn)
    await db_a.open()
    await db_b.open()
    try:
        # both migrate at once: the advisory lock lets one do it, the other finds nothing to do
        applied = await asyncio.gather(db_a.migrate(), db_b.migrate())
        assert sorted(applied, key=len) == [[], [m.version for m in MIGRATIONS]]
        assert await db_a.migrate() == []
        elected: list[tuple[str, int]] = []

        async def on_a(epoch: int) -> None:
            elected.append(("a", epoch))

        async def on_b(epoch: int) -> None:
            elected.append(("b", epoch))

        clock_a = Clock()
        a = Leadership(db_a, holder="a", lease=LEASE, grpc_address="a:1", admin_address="http://a:2",
                       on_elected=on_a, clock=clock_a)
        a.start()
        await wait_for(a.acting, what="a leads")
        b = Leadership(db_b, holder="b", lease=LEASE, grpc_address="b:1", admin_address="http://b:2", on_elected=on_b)
        b.start()
        await wait_for(lambda: b.leader is not None, what="b read the lease")
        assert not b.acting() and b.other_leader() is not None and b.other_leader().admin_address == "http://a:2"  # type: ignore[union-attr]
        epoch_a = a.epoch
        assert epoch_a is not None and elected == [("a", epoch_a)]
        cordons = CordonStore(db_a)
        async with a.transaction() as (tx, epoch):
            await cordons.set(tx, "gpu-1", True, epoch)
        with pytest.raises(NotLeader):
            async with b.transaction():
                pass
        # a "pauses": its loop stops (no renew, no release) and its clock stands still, so by its
        # own reckoning it still leads; the database's clock runs on and b takes over
        task = a._task
        assert task is not None
        task.cancel()
        clock_a.frozen = clock_a()
        await wait_for(b.acting, timeout=10 * LEASE, what="b takes over")
        assert b.epoch == epoch_a + 1 and a.acting()  # (a's view, frozen)
        # a's write is fenced by the database: nothing written
        with pytest.raises(NotLeader, match="fenced"):
            async with a.transaction() as (tx, epoch):
                await cordons.set(tx, "gpu-2", True, epoch)
        assert await CordonStore(db_b).load() == {"gpu-1"}
        # resumed: its deadline is long gone, it steps down by itself and acts on nothing
        clock_a.frozen = None
        assert not a.acting()
        a._check_deadline()
        assert a.epoch is None and a.stepped_down == 1
        # b stops cleanly: the lease is released, so a (campaigning again) leads at once
        a._stop.clear()
        a.start()
        await b.stop(release=True)
        await wait_for(a.acting, timeout=3 * LEASE, what="a leads again after b's release")
        assert a.epoch == epoch_a + 2 and a.terms == 2
        await a.stop()
    finally:
        await db_a.close()
        await db_b.close()


async def test_a_standby_that_cannot_read_the_lease_names_no_leader_once_it_ran_out(pg_dsn: str) -> None:
    """While the database is out of reach a standby reads nothing: the leader it read last is named until
    that lease has run out on its clock (and a renew period more), then none (the leader, out of reach
    too, has stepped down by then), never one that may be gone."""
    db_a, db_b = open_database(pg_dsn), open_database(pg_dsn)
    await db_a.open()
    await db_b.open()
    try:
        await db_a.migrate()
        a = Leadership(db_a, holder="a", lease=LEASE, grpc_address="a:1", admin_address="http://a:2")
        a.start()
        await wait_for(a.acting, what="a leads")
        b = Leadership(db_b, holder="b", lease=LEASE, grpc_address="b:1", admin_address="http://b:2")
        b.start()
        await wait_for(lambda: b.leader is not None, what="b read the lease")
        assert b.other_leader() is not None
        task = b._task  # b reads no more: as if the database were out of its reach
        assert task is not None
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert b.other_leader() is not None  # (within the lease it read: still the leader)
        await asyncio.sleep(LEASE + b.renew_every + 0.2)
        assert b.other_leader() is None
        await a.stop()
    finally:
        await db_a.close()
        await db_b.close()


async def test_a_newer_schema_is_refused(pg_dsn: str) -> None:
    db = open_database(pg_dsn)
    await db.open()
    try:
        future = (*MIGRATIONS, Migration(len(MIGRATIONS) + 1, "from the future", ("CREATE TABLE llmgw_future (x INT)",)))
        assert await db.migrate(future) == [m.version for m in future]
        with pytest.raises(ConfigError, match="upgrade llmgw"):
            await db.migrate()
    finally:
        await db.close()


async def test_sqlite_for_one_machine(tmp_path: Path) -> None:
    path = tmp_path / "state" / "control.db"
    db = open_database(f"sqlite:///{path}")
    await db.open()
    try:
        assert await db.migrate() == [m.version for m in MIGRATIONS]
        lead = Leadership(db, holder="only", lease=LEASE, grpc_address=None, admin_address=None)
        lead.start()
        await wait_for(lead.acting, what="the only process leads")
        async with lead.transaction() as (tx, epoch):
            await CordonStore(db).set(tx, "n1", True, epoch)
        await lead.stop()
    finally:
        await db.close()
    rows = sqlite3.connect(path).execute("SELECT node, epoch FROM llmgw_cordons").fetchall()
    assert rows == [("n1", 1)]
    with pytest.raises(ConfigError, match="sqlite:///RELATIVE/PATH"):
        open_database("sqlite://nohost")
    with pytest.raises(ConfigError, match="postgresql://"):
        open_database("mysql://x")


def test_a_database_password_is_never_shown() -> None:
    from llmgw.control.db import redact

    assert redact("postgresql://llmgw:pw-9f@db:5432/llmgw") == "postgresql://llmgw:***@db:5432/llmgw"
    assert redact("postgresql://llmgw@db/llmgw") == "postgresql://llmgw@db/llmgw"
    with pytest.raises(ConfigError) as ei:
        open_database("mysql://u:pw-9f@db/x")
    assert "pw-9f" not in str(ei.value)
    # mistyped, or a password with an unencoded "@": still never shown
    for url, shown in [
        ("postgresql//llmgw:pw-9f@db:5432/llmgw", "postgresql//llmgw:***@db:5432/llmgw"),
        ("postgresql:/llmgw:pw-9f@db/llmgw", "postgresql:/llmgw:***@db/llmgw"),
        ("postgresql:///llmgw:pw-9f@db/llmgw", "postgresql:///llmgw:***@db/llmgw"),
        ("postgres//u:pw-9f@db/d", "postgres//u:***@db/d"),
        ("postgresql://u:pw@9f-x:9f@db:5432/d", "postgresql://u:***@db:5432/d"),
        ("u:pw-9f@db/d", "***@db/d"),
        # the password as a query parameter, as libpq and asyncpg take it too
        ("postgresql://llmgw@db/llmgw?password=pw-9f", "postgresql://llmgw@db/llmgw?password=***"),
        ("postgresql://llmgw@db/llmgw?sslmode=require&Password=pw-9f&x=1",
         "postgresql://llmgw@db/llmgw?sslmode=require&Password=***&x=1"),
        ("postgresql://u:pw-9f@db/d?sslpassword=pw-9f", "postgresql://u:***@db/d?sslpassword=***"),
    ]:
        assert redact(url) == shown, url
        with contextlib.suppress(ConfigError):
            open_database(url)
    for url, says in [("postgresql://u:pw@9f-x@db/d", "percent-encode"), ("postgresql://u:pw-9f@db:x9f/d", "no port"),
                      # unencoded '/', '?', '#': the URL's host and port end early, inside the password
                      ("postgresql://u:9fPW/9fPW@db:5432/d", "no port"),
                      ("postgresql://u:9fPW?9fPW@db:5432/d", "no port"),
                      ("postgresql://u:9fPW#9fPW@db:5432/d", "no port"),
                      # a '[' or ']' in it: urlsplit refuses the URL, quoting it (a traceback before)
                      ("postgresql://u:[9fPW]@db:5432/d", "percent-encoded"),
                      ("postgresql://u:9f[PW@db:5432/d", "percent-encoded")]:
        with pytest.raises(ConfigError, match=says) as ei:
            open_database(url)
        assert "9f" not in str(ei.value).replace("db:x9f", ""), str(ei.value)


async def test_a_database_that_does_not_exist_says_to_create_it(pg_dsn: str) -> None:
    from llmgw.control.db import DatabaseError

    db = open_database(pg_dsn.rsplit("/", 1)[0] + "/no_such_database_here")
    with pytest.raises(DatabaseError) as ei:
        await db.open()
        await db.migrate()
    await db.close()
    assert "InvalidCatalogNameError" in str(ei.value) and "create the database" in str(ei.value), str(ei.value)


async def test_what_one_term_queued_is_never_written_by_the_next(pg_dsn: str) -> None:
    """The desired-state writes are pinned to the term that queued them: a process deposed and elected
    again (a new epoch) does not commit its old term's queue; the failure resigns only that term."""
    import functools

    from llmgw.control.db import DesiredStore, StoredReplica

    db = open_database(pg_dsn)
    await db.open()
    try:
        await db.migrate()
        lead = Leadership(db, holder="a", lease=LEASE, grpc_address=None, admin_address=None)
        lead.start()
        await wait_for(lead.acting, what="a leads")
        first = lead.epoch
        assert first is not None
        failed: list[BaseException] = []
        old = DesiredStore(db, functools.partial(lead.transaction, first), on_failed=failed.append)
        old.put_replica(StoredReplica("r-1", "d", "n", {"api_key": "k"}))
        await old.flushed()  # (in its own term: written)
        lead.resign("a test")
        await wait_for(lambda: lead.acting() and lead.epoch != first, timeout=5 * LEASE, what="a new term")
        told: list[str] = []
        old.put_replica(StoredReplica("r-2", "d", "n", {"api_key": "k"}), then=lambda: told.append("r-2"))
        with pytest.raises(NotLeader, match=f"epoch {first} is over"):
            await old.flushed()
        assert told == [] and len(failed) == 1 and lead.acting()  # (the new term goes on)
        new = DesiredStore(db, functools.partial(lead.transaction, lead.epoch))
        await new.load()
        assert [(r.id, r.spec["api_key"]) for r in new.replicas()] == [("r-1", "k")]
        await lead.stop()
    finally:
        await db.close()


async def test_two_processes_under_one_name_do_not_lead_in_turn(pg_dsn: str, caplog: pytest.LogCaptureFixture) -> None:
    """Two control planes with one holder name (one host name, one advertised address and port: two
    bind addresses, or containers given one host name) took the lease from each other on every renew,
    both leading in turn. The one that finds its name on a term it never won stays a standby, and says
    why; the other leads on."""
    db_a, db_b = open_database(pg_dsn), open_database(pg_dsn)
    await db_a.open()
    await db_b.open()
    a = b = None
    try:
        await db_a.migrate()
        a = Leadership(db_a, holder="host/cp:7070", lease=LEASE, grpc_address="cp:7070", admin_address="http://cp:9090")
        a.start()
        await wait_for(a.acting, what="a leads")
        b = Leadership(db_b, holder="host/cp:7070", lease=LEASE, grpc_address="cp:7070", admin_address="http://cp:9090")
        b.start()  # (a restart looks the same to it: it takes the lease at once)
        await wait_for(b.acting, timeout=5 * LEASE, what="b takes the lease in its name")
        await asyncio.sleep(6 * LEASE)  # (18 renews: before, as many changes of leader)
        assert b.acting() and not a.acting() and b.terms == 1 and a.terms == 1, (a.terms, b.terms)
        said = [r.getMessage() for r in caplog.records if "another control plane campaigns as host/cp:7070" in r.getMessage()]
        assert len(said) == 1 and "give each process its own control.advertise" in said[0], said
    finally:
        for lead in (a, b):
            if lead is not None:
                await lead.stop()
        await db_a.close()
        await db_b.close()


async def test_a_database_that_does_not_answer_is_named_to_api_clients(pg_dsn: str) -> None:
    """While no campaign reaches the database, a management write is not told "no leader is known yet,
    retry in a few seconds" (as if an election were under way) but that the database does not answer."""
    from types import SimpleNamespace

    from llmgw.control.db import DatabaseError
    from llmgw.control.service import ControlPlane

    db = open_database(pg_dsn)
    await db.open()
    lead = None
    try:
        await db.migrate()

        def away(*args: object, **kwargs: object) -> object:
            raise DatabaseError("connection refused (127.0.0.1:5)")

        db.transaction = away  # type: ignore[method-assign]
        lead = Leadership(db, holder="h/x:1", lease=LEASE, grpc_address="x:1", admin_address="http://x:2")
        lead.start()
        await wait_for(lambda: lead.database_error is not None, what="a failed campaign")
        cp = SimpleNamespace(leading=lambda: False, leadership=lead)
        said = ControlPlane.not_leader(cp)  # type: ignore[arg-type]
        assert said is not None and said.startswith("no control plane leads: the control-plane database does not "
                                                   "answer (DatabaseError: connection refused"), said
    finally:
        if lead is not None:
            await lead.stop(release=False)
        await db.close()


async def test_a_campaign_won_too_late_to_act_is_taken_again_at_once_not_for_a_twin(
    pg_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A campaign that wins the lease but returns past its own deadline (the database slow to answer: here
    the lease row is locked by another session while this process's clock runs past the deadline) acts in
    no term. The next campaign finds the lease in its own name with a term it won (too late): it takes it
    again at once, in a new epoch. It used to take that term for another process's under the same name
    (a "twin"), log an error naming control.advertise and stay a standby for a whole lease: no leader."""
    import asyncpg

    lease = 3.0

    class Stepped:
        offset = 0.0

        def __call__(self) -> float:
            import time

            return time.monotonic() + self.offset

    clock = Stepped()
    db = open_database(pg_dsn)
    await db.open()
    locker = await asyncpg.connect(pg_dsn)
    try:
        await db.migrate()
        a = Leadership(db, holder="a", lease=lease, grpc_address="a:1", admin_address="http://a:2", clock=clock)
        await a._attempt()
        assert a.acting() and a.epoch == 1
        a._step_down("the test: its deadline passed")
        # the next campaign waits on the lease row (locked by another session) while its clock runs past the
        # deadline: it wins epoch 2 in the database, too late to act in it
        tx = locker.transaction()
        await tx.start()
        await locker.execute("SELECT 1 FROM llmgw_lease FOR UPDATE")
        campaign = asyncio.ensure_future(a._attempt())
        await asyncio.sleep(0.2)
        clock.offset += lease
        await tx.rollback()
        await asyncio.wait_for(campaign, 5.0)
        assert a.epoch is None and not a.acting()
        assert await locker.fetchval("SELECT epoch FROM llmgw_lease WHERE holder = 'a'") == 2
        # the lease is still this process's (epoch 2, not run out): taken again at once, no "twin"
        caplog.clear()
        await a._attempt()
        assert a.acting() and a.epoch == 3, (a.epoch, caplog.text)
        assert "another control plane campaigns as" not in caplog.text
        await a.stop()
    finally:
        await locker.close()
        await db.close()


async def test_the_lease_is_renewed_while_a_new_term_loads_its_state(pg_dsn: str) -> None:
    """A new leader loads its state (cordons, nodes, deployments, replicas) before it acts; with a large
    fleet on a short lease that takes longer than the renew deadline. The lease is renewed meanwhile, and
    the first renew after it is due a period after the last one was sent: the term goes on, in the same
    epoch. It used to end by its own deadline as soon as it had loaded (no renew while loading, the next
    a whole period after), and the next term loaded everything again."""
    db = open_database(pg_dsn)
    await db.open()
    try:
        await db.migrate()
        loads: list[int] = []

        async def load(epoch: int) -> None:
            loads.append(epoch)
            await asyncio.sleep(1.5 * LEASE)  # (past the renew deadline: 2/3 of the lease)

        a = Leadership(db, holder="a", lease=LEASE, grpc_address="a:1", admin_address="http://a:2", on_elected=load)
        a.start()
        await wait_for(lambda: len(loads) == 1, what="a elected")
        await asyncio.sleep(4 * LEASE)  # loading, then leading
        assert a.acting() and a.epoch == loads[0] and a.stepped_down == 0 and a.terms == 1, (a.epoch, loads)
        await a.stop()
    finally:
        await db.close()
