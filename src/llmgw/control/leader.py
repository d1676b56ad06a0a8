"""Leader election on the control plane's database: a lease row, an epoch that fences every write.

Several ``llmgw serve`` processes with the same ``control.database`` run one
:class:`Leadership` each. The lease is one row (``llmgw_lease``, name ``control``):

* **Acquire** (a standby, every ``lease/3`` with jitter and just after the holder's
  lease runs out; forever: it never gives up after losing once): in one transaction,
  lock the row; when it has expired *by the database's clock* (``expires_at <=
  now``), take it: holder = me, ``epoch + 1``, ``expires_at = now + lease``.
* **Renew** (the leader, every ``lease/3``): ``UPDATE … SET expires_at = now + lease
  WHERE holder = me AND epoch = mine AND expires_at > now``. One row changed: still
  the leader; none: someone else took over (step down at once).
* **Act only before the renew deadline.** The leader records, on its own monotonic
  clock, when it *sent* the renew that succeeded; it acts only until that moment
  plus ``2/3`` of the lease, which is before the database can expire the lease (the
  database set ``expires_at`` after the request was sent). Past that deadline it
  steps down by itself, whether or not the database answers: a process paused with
  SIGSTOP (or in a long GC, or cut off from the database) finds its deadline gone
  when it resumes and acts on nothing, even though its TCP session, and with it any
  advisory lock, would still be alive (the kernel answers keepalives).
* **Fence every write.** :meth:`Leadership.transaction` opens a transaction that
  first locks the lease row ``FOR SHARE`` and checks holder, epoch and expiry: a
  leader deposed meanwhile fails with :class:`NotLeader` before writing anything,
  and the row lock orders the write before any takeover (the takeover's update
  waits for the share lock).
* **Release** on a clean stop: the row expires at once, so a successor takes over
  in one retry period instead of a whole lease (KubeAI's ``ReleaseOnCancel: false``
  makes its successors wait).

An advisory lock alone is not used: it lives as long as the session, which a paused
process keeps (``cluster.md`` §8.1). Through PgBouncer in transaction mode this
works too: nothing depends on a session.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ..log import control_logger as log
from .db import Database, DatabaseError, Tx

__all__ = ["LEASE_NAME", "LeaderInfo", "Leadership", "NotLeader"]

LEASE_NAME = "control"


class NotLeader(Exception):
    """This process does not lead (or no longer does): the write was not made."""

    def __init__(self, message: str, leader: LeaderInfo | None = None) -> None:
        super().__init__(message)
        self.leader = leader


@dataclass(frozen=True)
class LeaderInfo:
    """Who holds the lease, as last read."""

    holder: str
    epoch: int
    grpc_address: str | None
    admin_address: str | None


class Leadership:
    """One process's side of the election (module docstring).

    Args:
        db: the open database (migrated).
        holder: this process's identity: unique among running processes (host name and advertised
            gRPC address: two cannot bind one port) and stable across a restart, which then takes
            the lease back at once, in a new term, instead of waiting it out.
        lease: the lease, seconds (``control.lease``).
        grpc_address: where agents reach this process (``control.advertise`` + the gRPC port).
        admin_address: where the management API is (``http://HOST:PORT``).
        on_elected: awaited with the new epoch when this process wins (before it acts).
        on_deposed: called when it stops leading (the deadline passed, or someone took over).
    """

    def __init__(
        self,
        db: Database,
        *,
        holder: str,
        lease: float,
        grpc_address: str | None,
        admin_address: str | None,
        on_elected: Callable[[int], Awaitable[None]] | None = None,
        on_deposed: Callable[[], None] | None = None,
        name: str = LEASE_NAME,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.db = db
        self.holder = holder
        self.lease = lease
        self.grpc_address = grpc_address
        self.admin_address = admin_address
        self.on_elected = on_elected
        self.on_deposed = on_deposed
        self.name = name
        self.clock = clock
        self.rng = rng or random.Random()
        self.renew_every = lease / 3
        self.exclusive = not db.shared
        """SQLite: this process alone opens the database (module docstring of :mod:`.db`)."""
        self._live = "" if self.exclusive else " AND expires_at > {now}"
        """The fence's expiry condition (none on an exclusive database: its lease cannot pass to another)."""
        self.renew_deadline = lease * 2 / 3
        self.epoch: int | None = None
        """The epoch of the term this process leads (``None``: not leading)."""
        self.deadline = 0.0
        """Monotonic time after which it must not act (until a renew moves it)."""
        self.leader: LeaderInfo | None = None
        """The holder as last read (this process while it leads)."""
        self.terms = 0
        self.stepped_down = 0
        self._last_won: int | None = None  # the last epoch this process won (None: none yet in this run)
        self._twin_said = False
        self._task: asyncio.Task[None] | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()
        self._last_error: str | None = None
        self._until_expiry: tuple[float, float] | None = None
        """(seconds the holder's lease had left by the database's clock, when that was read on ours)."""
        self._leader_until: float | None = None
        """When the other holder's lease, as last read, runs out (this process's clock)."""

    # -- state --

    def acting(self) -> bool:
        """Whether this process leads now: it has a term and its renew deadline has not passed.

        On a database no other process can open (SQLite, under its file lock) there is no
        deadline: nobody can take over, so a process paused or held up acts on when it resumes.
        """
        return self.epoch is not None and (self.exclusive or self.clock() < self.deadline)

    @property
    def last_epoch(self) -> int | None:
        """The newest epoch known (this process's term, else the holder's as last read)."""
        if self.epoch is not None:
            return self.epoch
        return self.leader.epoch if self.leader is not None else None

    def other_leader(self) -> LeaderInfo | None:
        """The leader as last read when it is another process (standbys name it), unless its lease
        has run out since on this process's clock with nothing read to say it was renewed (the
        database is unreachable, say): then no leader is known, rather than one that may have
        stepped down."""
        li = self.leader
        if li is None or li.holder == self.holder or not li.holder:
            return None
        until = self._leader_until
        if until is not None and self.clock() > until + self.renew_every:
            return None
        return li

    # -- the loop --

    def start(self, *, attempted: bool = False) -> None:
        """Campaign (or renew) in a loop from now on (``attempted``: :meth:`first` just made an attempt)."""
        self._task = asyncio.create_task(self._run(not attempted), name="llmgw-leader-election")

    async def first(self) -> None:
        """The first attempt, awaited, then :meth:`start`: alone, this process leads when it returns."""
        await self._attempt()
        self.start(attempted=True)

    async def stop(self, release: bool = True) -> None:
        """Stop campaigning; with ``release``, hand the lease back (successors need not wait it out)."""
        self._stop.set()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        epoch = self.epoch
        self._step_down("stopping")
        if release and epoch is not None:
            try:
                async with self.db.transaction(timeout=max(1.0, self.renew_every), lease=True) as tx:
                    await tx.execute(self.db.sql(
                        "UPDATE llmgw_lease SET expires_at = {now} - 1 WHERE name = $1 AND holder = $2 AND epoch = $3"),
                        self.name, self.holder, epoch)
                log.info("released the control-plane lease (epoch %d)", epoch)
            except (DatabaseError, asyncio.TimeoutError, OSError) as exc:
                log.warning("could not release the control-plane lease (%s); a successor waits it out", exc)

    @property
    def database_error(self) -> str | None:
        """Why the last campaign or renew failed (the database away, a timeout), as logged; ``None`` once
        it answers again."""
        return self._last_error

    async def _attempt(self) -> None:
        """One renew (leading) or campaign (not), its failure logged once: it never gives up."""
        try:
            if self.epoch is not None:
                await self._renew()
            else:
                await self._campaign()
            if self._last_error is not None:
                log.info("the control-plane database answers again")
                self._last_error = None
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the database away, a timeout: keep campaigning, never give up
            msg = f"{type(exc).__name__}: {exc}"
            if msg != self._last_error:
                log.warning("leader election: %s (retrying every %.1fs)", msg, self.renew_every)
                self._last_error = msg

    async def _run(self, now: bool = True) -> None:
        while not self._stop.is_set():
            if now:
                await self._attempt()
            now = True
            if self.epoch is not None:
                # a period after the last renew that succeeded was *sent* (the deadline counts from then),
                # not a period after this attempt returned: a term's first attempt returns only once its
                # state is loaded, and a renew a whole period after that missed the deadline
                delay = self._renew_due()
                if self._last_error is not None:
                    delay = self.renew_every / 3  # a failed renew: try again sooner, while the deadline still allows
            else:
                delay = self.renew_every * self.rng.uniform(0.5, 1.0)
                left = self._until_expiry
                if left is not None:
                    # campaign again just after the holder's lease runs out, not up to a period later:
                    # a takeover within the lease of the leader's last renew (a duration, no clock sync)
                    delay = min(delay, max(0.0, left[0] - (self.clock() - left[1])) + self.rng.uniform(0.01, 0.05))
                    self._until_expiry = None
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay)

    async def _campaign(self) -> None:
        sent = self.clock()
        won: int | None = None
        async with self.db.transaction(timeout=self.renew_every, lease=True) as tx:
            row = await self._lock_row(tx)
            if row is None:
                await tx.execute(
                    "INSERT INTO llmgw_lease (name, holder, epoch, expires_at) VALUES ($1, '', 0, 0) "
                    "ON CONFLICT (name) DO NOTHING", self.name)
                row = await self._lock_row(tx)
                assert row is not None
            holder, epoch, expires_at, now, grpc_addr, admin_addr = row
            # A live lease in this process's name with a term it never won: another process runs under
            # the same name (one host name, one advertised address and port): it is left to lead, and said,
            # rather than each taking the lease from the other on every renew, two leaders in turn
            twin = (holder == self.holder and self._last_won is not None and int(epoch) > self._last_won)
            if twin and expires_at > now and self.db.shared and not self._twin_said:
                log.error("another control plane campaigns as %s (the same host name and advertised address) "
                          "and leads (epoch %d); this one stays a standby: give each process its own "
                          "control.advertise (or host name)", self.holder, int(epoch))
                self._twin_said = True
            # (SQLite is one process's, under a file lock: whatever holder the file names is a previous
            # run of this one, so it takes the lease at once rather than waiting a crash's lease out)
            if expires_at > now and holder and (holder != self.holder or twin) and self.db.shared:
                self.leader = LeaderInfo(holder, int(epoch), grpc_addr, admin_addr)
                self._until_expiry = (float(expires_at) - float(now), self.clock())
                self._leader_until = self.clock() + float(expires_at) - float(now)
                return
            # (expired, or held by this very process: restarted on the same address, or deposed by
            # its own deadline; a new term either way, so what the old one might still write is fenced)
            won = int(epoch) + 1
            await tx.execute(self.db.sql(
                "UPDATE llmgw_lease SET holder = $2, epoch = $3, grpc_address = $4, admin_address = $5, "
                "acquired_at = {now}, renewed_at = {now}, expires_at = {now} + $6 WHERE name = $1"),
                self.name, self.holder, won, self.grpc_address, self.admin_address, self.lease)
        self.deadline = sent + self.renew_deadline
        # (its own term even when too late to act in it: the next campaign, finding it, takes the lease
        # again at once rather than taking it for a twin's and waiting a whole lease with no leader)
        self._last_won = won
        if self.clock() >= self.deadline:
            log.warning("won the control-plane lease (epoch %d) too late to act in that term (the database took "
                        "%.1fs to answer); campaigning again", won, self.clock() - sent)
            return
        self.epoch = won
        self._twin_said = False
        self.leader = LeaderInfo(self.holder, won, self.grpc_address, self.admin_address)
        self.terms += 1
        self._arm()
        log.info("this control plane leads now (epoch %d, lease %gs)", won, self.lease)
        if self.on_elected is not None:
            # the lease is renewed while the term's state loads (a large fleet's deployments and replicas
            # take longer than the renew deadline on a short lease: the term used to end by its own
            # deadline as soon as it had loaded, and the next one loaded everything again)
            loaded = asyncio.Event()
            keeper = asyncio.create_task(self._renew_while(won, loaded), name="llmgw-leader-renew-while-loading")
            try:
                await self.on_elected(won)
            except Exception:
                # never hold the lease without acting: step down (the next campaign, finding the
                # lease still this process's, takes it again in a new epoch and retries)
                self._step_down("loading its state failed")
                raise
            finally:
                loaded.set()
                if not keeper.done():
                    await asyncio.wait({keeper})  # (a renew in flight finishes: within its timeout)

    def _renew_due(self) -> float:
        """Seconds until the next renew is due: a period after the last successful one was sent."""
        return max(0.0, self.deadline - self.renew_deadline + self.renew_every - self.clock())

    async def _renew_while(self, epoch: int, loaded: asyncio.Event) -> None:
        """Renew term ``epoch`` on schedule until ``loaded`` is set (or the term ends)."""
        while self.epoch == epoch and not loaded.is_set():
            delay = self.renew_every / 3 if self._last_error is not None else self._renew_due()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(loaded.wait(), delay)
            if loaded.is_set() or self.epoch != epoch:
                return
            await self._attempt()

    async def _lock_row(self, tx: Tx) -> tuple[Any, ...] | None:
        return await tx.fetchrow(self.db.sql(
            "SELECT holder, epoch, expires_at, {now}, grpc_address, admin_address FROM llmgw_lease "
            "WHERE name = $1 {for_update}"), self.name)

    async def _renew(self) -> None:
        epoch = self.epoch
        assert epoch is not None
        sent = self.clock()
        async with self.db.transaction(timeout=self.renew_every, lease=True) as tx:
            n = await tx.execute(self.db.sql(
                "UPDATE llmgw_lease SET expires_at = {now} + $4, renewed_at = {now} "
                "WHERE name = $1 AND holder = $2 AND epoch = $3" + self._live),
                self.name, self.holder, epoch, self.lease)
            if n != 1:
                row = await self._lock_row(tx)
        if self.epoch != epoch:
            return  # deposed meanwhile (the watchdog)
        if n == 1:
            self.deadline = max(self.deadline, sent + self.renew_deadline)
            self._arm()
            return
        if row is not None and row[0]:
            self.leader = LeaderInfo(row[0], int(row[1]), row[4], row[5])
            self._leader_until = self.clock() + float(row[2]) - float(row[3])
        self._step_down("another control plane took the lease" if row is not None and row[0] != self.holder
                        else "the lease expired before it was renewed")

    def _arm(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self.exclusive:
            return
        loop = asyncio.get_running_loop()
        # (time.monotonic and the loop's clock are the same clock in asyncio; a test clock is not)
        self._watchdog = loop.call_later(max(0.0, self.deadline - self.clock()), self._check_deadline)

    def _check_deadline(self) -> None:
        self._watchdog = None
        if self.epoch is None:
            return
        if self.clock() >= self.deadline:
            self._step_down("its renew deadline passed (the database did not answer in time, or this process "
                            "was paused)")
            self._wake.set()
        else:
            self._arm()

    def _step_down(self, why: str) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self.epoch is None:
            return
        epoch, self.epoch = self.epoch, None
        self.stepped_down += 1
        if why != "stopping":
            log.warning("this control plane stopped leading (epoch %d): %s; campaigning again", epoch, why)
        if self.on_deposed is not None:
            try:
                self.on_deposed()
            except Exception:
                log.exception("stepping down failed half-way")

    def resign(self, why: str) -> None:
        """Stop acting now (a fenced write failed); the next campaign, soon, decides who leads."""
        self._step_down(why)
        self._wake.set()

    # -- fenced writes --

    @contextlib.asynccontextmanager
    async def transaction(self, term: int | None = None) -> AsyncIterator[tuple[Tx, int]]:
        """A transaction for a leader's write, fenced by its epoch: ``(tx, epoch)``.

        ``term``: only in that epoch (what one term queued is never written by the next).

        Raises:
            NotLeader: this process does not lead, its deadline passed, or the database
                says another holds the lease (nothing was written).
            DatabaseError: the database failed (nothing was written).
        """
        epoch = self.epoch
        if epoch is None or not self.acting() or (term is not None and term != epoch):
            raise NotLeader("this control plane is not the leader" if term is None or epoch is None
                            else f"epoch {term} is over", self.other_leader())
        async with self.db.transaction(timeout=max(1.0, self.renew_every)) as tx:
            ok = await tx.fetchval(self.db.sql(
                "SELECT 1 FROM llmgw_lease WHERE name = $1 AND holder = $2 AND epoch = $3" + self._live +
                " {for_share}"), self.name, self.holder, epoch)
            if ok is None:
                raise NotLeader(f"fenced: epoch {epoch} no longer holds the lease", self.other_leader())
            yield tx, epoch
        if not self.acting() and self.epoch == epoch:
            # committed under the lease (the row lock says so), but the deadline passed while it ran
            log.info("a fenced write of epoch %d committed just before its deadline", epoch)
