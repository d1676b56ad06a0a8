# cython: language_level=3
"""Admission queues (compiled twin of ``admit_py``; see its docstring)."""

cimport cython
from cpython.list cimport PyList_GET_ITEM
from libc.math cimport INFINITY, NAN, isnan

__all__ = ["AdmissionQueue"]


@cython.final
@cython.freelist(64)
cdef class _Entry:
    pass


@cython.final
@cython.freelist(16)
cdef class _Tenant:
    pass


@cython.final
cdef class _Band:
    def __cinit__(self):
        self.tenants = {}
        self.count = 0


cdef inline _Band _band_at(list bands, Py_ssize_t i):
    return <_Band>PyList_GET_ITEM(bands, i)


@cython.final
cdef class AdmissionQueue:
    """Bounded per-band queues, fair across tenants within a band (see admit_py.AdmissionQueue)."""

    def __init__(self, bands, queue_size):
        cdef Py_ssize_t nb = int(bands)
        cdef Py_ssize_t qs = int(queue_size)
        if nb < 1:
            raise ValueError("bands must be at least 1")
        if qs < 0:
            raise ValueError("queue_size must be >= 0")
        self._nbands = nb
        self._queue_size = qs
        self._capacity = nb * qs
        self._bands = [_Band() for _ in range(nb)]
        self._entries = {}
        self._len = 0

    @property
    def bands(self):
        return self._nbands

    @property
    def queue_size(self):
        return self._queue_size

    def __len__(self):
        return self._len

    def __contains__(self, item):
        return id(item) in self._entries

    cdef Py_ssize_t _check_band(self, Py_ssize_t band) except -1:
        if band < 0 or band >= self._nbands:
            raise ValueError(f"band {band} out of range 0..{self._nbands - 1}")
        return band

    def depth(self, Py_ssize_t band):
        """Items queued in ``band``."""
        return _band_at(self._bands, self._check_band(band)).count

    def tenants(self, Py_ssize_t band):
        """Tenants with items queued in ``band``."""
        return len(_band_at(self._bands, self._check_band(band)).tenants)

    def push(self, Py_ssize_t band, tenant, item, double now=NAN):
        """Queue ``item`` for ``tenant`` in ``band``: ``None`` queued, an item evicted, ``False`` refused."""
        cdef Py_ssize_t bi = self._check_band(band)
        cdef Py_ssize_t lower, most
        cdef object key = id(item)
        cdef object evicted = None
        cdef _Band b
        cdef _Tenant t, mine, biggest
        cdef _Entry e, victim
        if key in self._entries:
            raise ValueError("item is already queued")
        b = _band_at(self._bands, bi)
        if b.count >= self._queue_size or self._len >= self._capacity:
            lower = self._nbands - 1
            while lower > bi and _band_at(self._bands, lower).count == 0:
                lower -= 1
            if lower > bi:
                victim = _band_at(self._bands, lower).tail
            else:
                # nothing lower: the tenant with the most waiting here gives up its newest (see the twin)
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
            self._unlink(victim)
            evicted = victim.item
        t = b.tenants.get(tenant)
        if t is None:
            t = _Tenant.__new__(_Tenant)
            t.key = tenant
            t.count = 0
            b.tenants[tenant] = t
            self._ring_append(b, t)
        e = _Entry.__new__(_Entry)
        e.item = item
        e.tenant = t
        e.band = bi
        e.enqueued = now
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

    def pop(self):
        """The next item to admit, or ``None`` when empty."""
        cdef Py_ssize_t i
        cdef _Band b
        cdef _Tenant t
        cdef object item
        for i in range(self._nbands):
            b = _band_at(self._bands, i)
            if b.count:
                t = b.ring_head
                item = t.head.item
                self._unlink(t.head)
                if t.count and t.next is not None:
                    self._ring_unlink(b, t)
                    self._ring_append(b, t)
                return item
        return None

    def remove(self, item):
        """Take ``item`` out of the queue (client gone, time limit passed); ``False`` if not queued."""
        e = self._entries.get(id(item))
        if e is None:
            return False
        self._unlink(<_Entry>e)
        return True

    def clear(self):
        """Empty the queue; returns the items in the order :meth:`pop` would have."""
        cdef list out = []
        while self._len:
            out.append(self.pop())
        return out

    def oldest_age(self, double now):
        """Seconds the oldest item has waited (0.0 when empty; NaN if it was pushed without ``now``)."""
        cdef double oldest = INFINITY, t
        cdef bint seen = False
        cdef Py_ssize_t i
        cdef _Entry e
        for i in range(self._nbands):
            e = _band_at(self._bands, i).head
            if e is not None:
                seen = True
                t = e.enqueued
                if isnan(t):
                    return NAN
                if t < oldest:
                    oldest = t
        if not seen:
            return 0.0
        return now - oldest

    # -- links ----------------------------------------------------------------

    cdef void _ring_unlink(self, _Band b, _Tenant t) noexcept:
        if t.prev is None:
            b.ring_head = t.next
        else:
            t.prev.next = t.next
        if t.next is None:
            b.ring_tail = t.prev
        else:
            t.next.prev = t.prev
        t.prev = None
        t.next = None

    cdef void _ring_append(self, _Band b, _Tenant t) noexcept:
        t.prev = b.ring_tail
        t.next = None
        if b.ring_tail is None:
            b.ring_head = t
        else:
            b.ring_tail.next = t
        b.ring_tail = t

    cdef int _unlink(self, _Entry e) except -1:
        cdef _Band b = _band_at(self._bands, e.band)
        cdef _Tenant t = e.tenant
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
        e.tprev = None
        e.tnext = None
        e.bprev = None
        e.bnext = None
        return 0

    def __repr__(self):
        depths = ", ".join([str(_band_at(self._bands, i).count) for i in range(self._nbands)])
        return f"<AdmissionQueue [{depths}] of {self._queue_size}>"
