# Declarations that compile counters_py.py into the extension llmgw._fast.counters
# (Cython "augmenting .pxd"): the data path's traffic counters.
#
# The proxy calls record() once per finished request and the other hooks per
# event, through C; the admin app's PrometheusObserver (a Python subclass) reads
# the dicts at scrape time, on the same thread. Keys of the dicts are label tuples.

cimport cython


@cython.final
cdef class Hist:
    # One histogram series: per-bucket (not cumulative) counts, the last +Inf.
    cdef readonly list counts         # (the list is updated in place)
    cdef public double total          # (the admin app's loop-lag histogram adds to it too)


@cython.final
cdef class RequestSeries:
    # One (model, replica, status, band) combination and the histograms it feeds.
    cdef readonly Py_ssize_t n
    cdef readonly tuple mb            # (model, band): the key of dur and ttfb
    cdef readonly Hist dur            # None until the first timed answer
    cdef readonly Hist ttfb           # None until the first answer head
    cdef readonly Hist up             # (model, replica) upstream time; None without a replica


cdef class TrafficCounters:
    cdef readonly list bounds         # histogram upper bounds (s), ascending
    cdef readonly Py_ssize_t max_series
    cdef readonly dict _requests      # (model, replica, status, band) -> RequestSeries
    cdef readonly dict _duration      # (model, band) -> Hist
    cdef readonly dict _ttfb          # (model, band) -> Hist
    cdef readonly dict _upstream      # (model, replica) -> Hist
    cdef readonly dict _tokens        # model -> [prompt, completion]
    cdef readonly dict _errors        # (replica, kind) -> n
    cdef readonly dict _retries       # model -> n
    cdef readonly dict _admission     # (band, outcome, reason) -> n
    cdef readonly dict _admitted      # band -> admitted straight away (the usual decision)
    cdef readonly dict _breaker       # (replica, state) -> n
    cdef set _overflowed              # families already warned about

    @cython.locals(i=Py_ssize_t, n=Py_ssize_t, b=double)
    cdef Py_ssize_t _bucket(self, double value)
    cpdef request_done(self, model, replica, int status, band, duration, ttfb, upstream)
    @cython.locals(s=RequestSeries, h=Hist, u=Hist)
    cpdef record(self, model, replica, int status, band, double duration, double ttfb, double upstream)
    cpdef upstream_error(self, replica, kind)
    cpdef retry(self, model, replica)
    cpdef tokens(self, model, prompt, completion)
    cpdef admission(self, band, outcome, reason=*)
    cpdef breaker_transition(self, replica, state)
    cdef _first(self, dict d, key, family, other)
    cdef Hist _hist(self, dict d, key)
    cdef RequestSeries _new_requests(self, model, replica, int status, band)
