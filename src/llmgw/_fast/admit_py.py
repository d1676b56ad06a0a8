"""Admission queues: the pure-Python twin of ``admit.pyx``.

This module is the readable spec; the compiled module matches it name for name and
call for call (same return values, same order of items, same errors).

Requests wait here while their model's pool is saturated. :class:`AdmissionQueue`
holds one queue per priority band (band 0 is served first) and inside a band one
FIFO per tenant (any hashable key: the API key's name, say), served round-robin
over the tenants that have waiters, so no tenant can starve the others of its band.

Bounds: a band holds ``queue_size`` items, and the whole queue ``bands *
queue_size``. A push into a band that is at its size, or while the whole queue is
full, takes the slot of the newest item of the lowest non-empty band *below* it:
that item is evicted and returned, for the caller to answer 429. With nothing below
to evict, the push is refused (``False``). So a higher band may grow past its own
size by displacing lower bands, lower bands are shed first, and memory never
exceeds ``bands * queue_size`` items.

Every operation is O(1) (``pop`` and eviction are O(bands)): items and tenants sit
in intrusive doubly linked lists, and an item is found by identity through one
dict, so :meth:`AdmissionQueue.remove` (client gone, time limit passed) unlinks it
at once, and a tenant with no waiters left is dropped on the spot: nothing leaks.
Items are opaque, found by identity (``id``), need not be hashable, and must not be
``None`` or ``False`` (the values :meth:`AdmissionQueue.push` returns).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Hashable

__all__ = ["AdmissionQueue"]

_NAN = math.nan


class _Entry:
    """One queued item: a link in its tenant's FIFO and in its band's arrival list."""

    __slots__ = ("band", "bnext", "bprev", "enqueued", "item", "tenant", "tnext", "tprev")

    def __init__(self, item: object, tenant: _Tenant, band: int, enqueued: float) -> None:
        self.item = item
        self.tenant = tenant
        self.band = band
        self.enqueued = enqueued
        self.tprev: _Entry | None = None
        self.tnext: _Entry | None = None
        self.bprev: _Entry | None = None
        self.bnext: _Entry | None = None


class _Tenant:
    """One tenant's FIFO in one band, and its link in the band's round-robin ring."""

    __slots__ = ("count", "head", "key", "next", "prev", "tail")

    def __init__(self, key: Hashable) -> None:
        self.key = key
        self.head: _Entry | None = None
        self.tail: _Entry | None = None
        self.count = 0
        self.prev: _Tenant | None = None
        self.next: _Tenant | None = None


class _Band:
    """One band: its tenants (dict + ring, next to serve at the head) and arrival order."""

    __slots__ = ("count", "head", "ring_head", "ring_tail", "tail", "tenants")

    def __init__(self) -> None:
        self.tenants: dict[Hashable, _Tenant] = {}
        self.ring_head: _Tenant | None = None
        self.ring_tail: _Tenant | None = None
        self.head: _Entry | None = None  # oldest
        self.tail: _Entry | None = None  # newest
        self.count = 0


class AdmissionQueue:
    """Bounded per-band queues, fair across tenants within a band.

    Args:
        bands: number of priority bands (>= 1); band 0 is served first.
        queue_size: items per band (>= 0); the whole queue holds ``bands * queue_size``.

    Raises:
        ValueError: an argument is out of range.
    """

    __slots__ = ("_bands", "_capacity", "_entries", "_len", "_nbands", "_queue_size")

    def __init__(self, bands: int, queue_size: int) -> None:
        bands = int(bands)
        queue_size = int(queue_size)
        if bands < 1:
            raise ValueError("bands must be at least 1")
        if queue_size < 0:
            raise ValueError("queue_size must be >= 0")
        self._nbands = bands
        self._queue_size = queue_size
        self._capacity = bands * queue_size
        self._bands = [_Band() for _ in range(bands)]
        self._entries: dict[int, _Entry] = {}
        self._len = 0

    @property
    def bands(self) -> int:
        return self._nbands

    @property
    def queue_size(self) -> int:
        return self._queue_size

    def __len__(self) -> int:
        return self._len

    def __contains__(self, item: object) -> bool:
        return id(item) in self._entries

    def depth(self, band: int) -> int:
        """Items queued in ``band``."""
        return self._bands[self._check_band(band)].count

    def tenants(self, band: int) -> int:
        """Tenants with items queued in ``band``."""
        return len(self._bands[self._check_band(band)].tenants)

    def _check_band(self, band: int) -> int:
        band = operator.index(band)
        if band < 0 or band >= self._nbands:
            raise ValueError(f"band {band} out of range 0..{self._nbands - 1}")
        return band

    def push(self, band: int, tenant: Hashable, item: object, now: float = _NAN) -> object:
        """Queue ``item`` for ``tenant`` in ``band``; ``now`` (monotonic s) dates it for :meth:`oldest_age`.

        Returns:
            ``None``: queued. An item: queued, and that item was evicted to make room
            (the newest of the lowest non-empty band below ``band``; or, with nothing
            lower, the newest of the tenant with the most waiting in ``band``, when it
            holds at least two more than ``tenant``); the caller answers it 429.
            ``False``: not queued (full, nothing to evict); the caller answers 429.

        Raises:
            ValueError: ``band`` out of range, or ``item`` is already queued.
        """
        band = self._check_band(band)
        key = id(item)
        if key in self._entries:
            raise ValueError("item is already queued")
        evicted: object = None
        if self._bands[band].count >= self._queue_size or self._len >= self._capacity:
            lower = self._nbands - 1
            while lower > band and self._bands[lower].count == 0:
                lower -= 1
            if lower > band:
                victim = self._bands[lower].tail
            else:
                # nothing lower: the tenant with the most waiting in this band gives up its newest,
                # if it holds at least two more than the newcomer's tenant (a tenant with many
                # clients kept the band full, and others were refused at the door)
                b = self._bands[band]
                mine = b.tenants.get(tenant)
                most = (mine.count if mine is not None else 0) + 1
                biggest = None
                t = b.ring_head
                while t is not None:
                    if t.count > most:
                        biggest = t
                        most = t.count
                    t = t.next
                if biggest is None:
                    return False
                victim = biggest.tail
            assert victim is not None
            self._unlink(victim)
            evicted = victim.item
        b = self._bands[band]
        t = b.tenants.get(tenant)
        if t is None:
            t = _Tenant(tenant)
            b.tenants[tenant] = t
            # a new tenant joins the ring at the back
            t.prev = b.ring_tail
            if b.ring_tail is None:
                b.ring_head = t
            else:
                b.ring_tail.next = t
            b.ring_tail = t
        e = _Entry(item, t, band, float(now))
        e.tprev = t.tail
        if t.tail is None:
            t.head = e
        else:
            t.tail.tnext = e
        t.tail = e
        t.count += 1
        e.bprev = b.tail
        if b.tail is None:
            b.head = e
        else:
            b.tail.bnext = e
        b.tail = e
        b.count += 1
        self._entries[key] = e
        self._len += 1
        return evicted

    def pop(self) -> object:
        """The next item to admit, or ``None`` when empty.

        Highest band first; within it the tenant at the front of the round-robin
        ring, which then moves to the back if it has more waiters.
        """
        for b in self._bands:
            if b.count:
                t = b.ring_head
                assert t is not None and t.head is not None
                e = t.head
                item = e.item
                self._unlink(e)
                # the tenant had its turn: to the back of the ring (if still there)
                if t.count and t.next is not None:
                    self._ring_unlink(b, t)
                    self._ring_append(b, t)
                return item
        return None

    def remove(self, item: object) -> bool:
        """Take ``item`` out of the queue (client gone, time limit passed); ``False`` if not queued."""
        e = self._entries.get(id(item))
        if e is None:
            return False
        self._unlink(e)
        return True

    def clear(self) -> list[object]:
        """Empty the queue; returns the items in the order :meth:`pop` would have."""
        out: list[object] = []
        while self._len:
            out.append(self.pop())
        return out

    def oldest_age(self, now: float) -> float:
        """Seconds the oldest item has waited (0.0 when empty; NaN if it was pushed without ``now``)."""
        oldest = math.inf
        seen = False
        for b in self._bands:
            e = b.head
            if e is not None:
                seen = True
                t = e.enqueued
                if t != t:
                    return _NAN
                if t < oldest:
                    oldest = t
        if not seen:
            return 0.0
        return now - oldest

    # -- links ----------------------------------------------------------------

    def _ring_unlink(self, b: _Band, t: _Tenant) -> None:
        if t.prev is None:
            b.ring_head = t.next
        else:
            t.prev.next = t.next
        if t.next is None:
            b.ring_tail = t.prev
        else:
            t.next.prev = t.prev
        t.prev = t.next = None

    def _ring_append(self, b: _Band, t: _Tenant) -> None:
        t.prev = b.ring_tail
        t.next = None
        if b.ring_tail is None:
            b.ring_head = t
        else:
            b.ring_tail.next = t
        b.ring_tail = t

    def _unlink(self, e: _Entry) -> None:
        b = self._bands[e.band]
        t = e.tenant
        if e.tprev is None:
            t.head = e.tnext
        else:
            e.tprev.tnext = e.tnext
        if e.tnext is None:
            t.tail = e.tprev
        else:
            e.tnext.tprev = e.tprev
        t.count -= 1
        if e.bprev is None:
            b.head = e.bnext
        else:
            e.bprev.bnext = e.bnext
        if e.bnext is None:
            b.tail = e.bprev
        else:
            e.bnext.bprev = e.bprev
        b.count -= 1
        if t.count == 0:
            self._ring_unlink(b, t)
            del b.tenants[t.key]
        del self._entries[id(e.item)]
        self._len -= 1
        e.tprev = e.tnext = e.bprev = e.bnext = None

    def __repr__(self) -> str:
        depths = ", ".join(str(b.count) for b in self._bands)
        return f"<AdmissionQueue [{depths}] of {self._queue_size}>"
