# The contract of admit.pyx; the spec is its pure twin, admit_py.py.
#
# Call order: AdmissionQueue.push() may evict (_unlink) the newest entry of a lower
# band before linking the new one; pop() unlinks the head entry of the front tenant
# of the highest non-empty band, then moves that tenant to the back of its ring;
# remove() unlinks an entry found through _entries. _unlink() drops a tenant whose
# FIFO became empty, so no operation leaves an empty tenant behind.

cdef class _Entry:
    cdef object item
    cdef _Tenant tenant
    cdef Py_ssize_t band
    cdef double enqueued          # monotonic s; NaN: pushed without `now`
    cdef _Entry tprev, tnext      # the tenant's FIFO
    cdef _Entry bprev, bnext      # the band's arrival order (eviction takes its tail)


cdef class _Tenant:
    cdef object key
    cdef _Entry head, tail
    cdef Py_ssize_t count
    cdef _Tenant prev, next       # the band's round-robin ring (head: next to serve)


cdef class _Band:
    cdef dict tenants             # key -> _Tenant with count > 0
    cdef _Tenant ring_head, ring_tail
    cdef _Entry head, tail        # oldest, newest
    cdef Py_ssize_t count


cdef class AdmissionQueue:
    cdef Py_ssize_t _nbands
    cdef Py_ssize_t _queue_size
    cdef Py_ssize_t _capacity     # _nbands * _queue_size
    cdef list _bands              # [_Band]
    cdef dict _entries            # id(item) -> _Entry
    cdef Py_ssize_t _len

    cdef Py_ssize_t _check_band(self, Py_ssize_t band) except -1
    cdef void _ring_unlink(self, _Band b, _Tenant t) noexcept
    cdef void _ring_append(self, _Band b, _Tenant t) noexcept
    cdef int _unlink(self, _Entry e) except -1
