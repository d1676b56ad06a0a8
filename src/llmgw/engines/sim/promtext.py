"""Prometheus text pages (format 0.0.4) rendered from precomputed templates.

What ``prometheus_client.generate_latest`` writes for a collector whose families,
label sets and buckets never change, written here without building a registry at
scrape time: every HELP/TYPE line, label string, ``le`` string and ``_created``
value is laid out once into a list of static pieces, and a scrape only formats the
numbers (``floatToGoString`` style) into the holes between them and joins. The output is byte for byte what
``generate_latest`` renders for the same values (``tests/engines/test_sim_metrics_speed.py``
checks it against the registry path); only the text format 0.0.4 is made here,
OpenMetrics stays on ``prometheus_client``.

:func:`process_text` renders the ``process_*``, ``python_info`` and ``python_gc_*``
families of ``prometheus_client``'s default collectors (Linux only, see
:func:`process_text_available`).
"""

from __future__ import annotations

import gc
import os
import platform
import resource
import time
from collections.abc import Mapping, Sequence
from itertools import accumulate
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, PlatformCollector, generate_latest
from prometheus_client.openmetrics.exposition import escape_label_name, escape_metric_name
from prometheus_client.utils import floatToGoString

if TYPE_CHECKING:
    from .scheduler import Hist

__all__ = ["HistText", "TextPage", "fgo", "label_string", "process_text", "process_text_available"]


# fgo(n) for small counts ("12.0"), grown on demand: a lookup costs less than formatting.
_SMALL: list[str] = []
_SMALL_CAP = 1 << 15


def _small_ints(n: int) -> list[str]:
    """A table of ``fgo(i)`` covering ``0..n`` (``n < _SMALL_CAP``)."""
    table = _SMALL
    if n >= len(table):
        size = max(256, len(table))
        while size <= n:
            size *= 2
        table.extend(f"{i}.0" for i in range(len(table), min(size, _SMALL_CAP)))
    return table


def fgo(v: float) -> str:
    """``floatToGoString(v)``, with fast paths for ints and the usual magnitudes."""
    if type(v) is int:
        if 0 <= v < 1_000_000:
            return _SMALL[v] if v < len(_SMALL) else f"{v}.0"
        if 1_000_000 <= v < 2**53:  # exact as a float: repr is the digits then ".0"
            t = str(v)
            return f"{(t[0] + '.' + t[1:]).rstrip('0.')}e+{len(t) - 1:02d}"
        return floatToGoString(v)
    d = float(v)
    if -1e6 < d < 1e6:  # repr is Go's form here (NaN and infinities fail the test)
        return repr(d)
    return floatToGoString(d)


def _doc(doc: str) -> str:
    return doc.replace("\\", r"\\").replace("\n", r"\n")


def _value(v: str) -> str:
    return v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def label_string(labels: Mapping[str, str]) -> str:
    """``{a="x",b="y"}`` as ``generate_latest`` writes it: names sorted, values escaped."""
    if not labels:
        return ""
    return "{" + ",".join(f'{escape_label_name(k)}="{_value(v)}"' for k, v in sorted(labels.items())) + "}"


def _head(name: str, doc: str, mtype: str) -> str:
    n = escape_metric_name(name)
    return f"# HELP {n} {_doc(doc)}\n# TYPE {n} {mtype}\n"


def _line(name: str, labels: Mapping[str, str]) -> str:
    return f"{escape_metric_name(name)}{label_string(labels)} "


class _Parts:
    """Static text with holes: ``parts[0] v0 parts[1] v1 ... parts[n]``, kept as a list
    with the holes at the odd places, so a render is one slice assignment and one join."""

    def __init__(self) -> None:
        self._text: list[str] = [""]  # static pieces; a hole between each two

    def add(self, text: str) -> None:
        self._text[-1] += text

    def hole(self) -> None:
        self._text.append("")

    @property
    def slots(self) -> int:
        return len(self._text) - 1

    def buffer(self) -> list[str]:
        """The pieces with ``""`` in the holes: copy it, fill ``[1::2]``, join."""
        out = [""] * (2 * len(self._text) - 1)
        out[::2] = self._text
        return out


class TextPage:
    """The families with fixed label sets, laid out once; one hole per changing value.

    Families are added in page order; :meth:`render` fills the holes from values given
    in the same order.
    """

    def __init__(self) -> None:
        self._parts = _Parts()
        self._buf: list[str] | None = None

    def _sample(self, name: str, labels: Mapping[str, str], value: str | None) -> None:
        if value is None:
            self._parts.add(_line(name, labels))
            self._parts.hole()
            self._parts.add("\n")
        else:
            self._parts.add(_line(name, labels) + value + "\n")

    @property
    def slots(self) -> int:
        return self._parts.slots

    def gauge(self, name: str, doc: str, labels: Mapping[str, str], value: float | None = None) -> None:
        """A one-sample gauge; ``value`` given: a constant."""
        self._parts.add(_head(name, doc, "gauge"))
        self._sample(name, labels, None if value is None else fgo(value))

    def counter(self, name: str, doc: str, label_sets: Sequence[Mapping[str, str]], created: float | None,
                values: Sequence[float | None] | None = None) -> None:
        """A counter with one sample per label set, then its ``_created`` gauge when ``created`` is set.

        ``values``: constants by sample (``None``: a hole); all holes by default.
        """
        if name.endswith("_total"):  # as CounterMetricFamily
            name = name[:-6]
        self._parts.add(_head(name + "_total", doc, "counter"))
        for i, labels in enumerate(label_sets):
            v = None if values is None else values[i]
            self._sample(name + "_total", labels, None if v is None else fgo(v))
        if created is not None and label_sets:
            self._parts.add(_head(name + "_created", doc, "gauge"))
            for labels in label_sets:
                self._sample(name + "_created", labels, fgo(created))

    def text(self, text: str) -> None:
        """Constant text (whole lines)."""
        self._parts.add(text)

    def render(self, values: Sequence[float]) -> str:
        buf = self._buf
        if buf is None:
            buf = self._buf = self._parts.buffer()
        buf = buf.copy()
        buf[1::2] = [fgo(v) for v in values]
        return "".join(buf)


class HistText:
    """One histogram family (one label set), rendered from a live :class:`Hist`.

    The text is kept until the histogram changes: its counts only grow, so the same
    total count and sum mean the same buckets.
    """

    __slots__ = ("_buf", "_key", "_text", "hist")

    def __init__(self, name: str, doc: str, labels: Mapping[str, str], hist: Hist, created: float | None) -> None:
        self.hist = hist
        bounds = [floatToGoString(b) for b in hist.bounds] + ["+Inf"]
        parts = _Parts()
        parts.add(_head(name, doc, "histogram"))
        for le in bounds:
            parts.add(_line(name + "_bucket", {**labels, "le": le}))
            parts.hole()
            parts.add("\n")
        for suffix in ("_count", "_sum"):
            parts.add(_line(name + suffix, labels))
            parts.hole()
            parts.add("\n")
        if created is not None:
            parts.add(_head(name + "_created", doc, "gauge") + _line(name + "_created", labels) + fgo(created) + "\n")
        self._buf = parts.buffer()
        self._key: tuple[int, float] | None = None
        self._text = ""

    def render(self) -> str:
        h = self.hist
        counts = h.counts
        total = sum(counts)
        key = (total, h.sum)
        if key == self._key:
            return self._text
        cum = list(accumulate(counts))  # one per bucket, +Inf last: then _count
        cum.append(total)
        buf = self._buf.copy()
        if total < _SMALL_CAP:
            table = _small_ints(total)
            buf[1:-2:2] = [table[c] for c in cum]
        else:
            buf[1:-2:2] = map(fgo, cum)
        buf[-2] = fgo(h.sum)
        text = "".join(buf)
        self._key, self._text = key, text
        return text


# ---------------------------------------------------------------------------
# prometheus_client's default collectors: ProcessCollector, PlatformCollector, GCCollector


class _Proc:
    """``/proc/self/stat`` kept open (re-read with ``pread``), and the constant parts."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.fd = os.open(f"/proc/{self.pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
        self.ticks = float(os.sysconf("SC_CLK_TCK"))
        self.pagesize = resource.getpagesize()
        btime = 0.0
        with open("/proc/stat", "rb") as f:
            for line in f:
                if line.startswith(b"btime "):
                    btime = float(line.split()[1])
        parts = self.stat()
        self.start_time = float(parts[19]) / self.ticks + btime
        # As the collector: nothing when /proc has no btime.
        self.ok = bool(btime)

    def stat(self) -> list[bytes]:
        return os.pread(self.fd, 4096, 0).split(b")")[-1].split()


_proc: _Proc | None = None
_tail_page: TextPage | None = None
_GC = hasattr(gc, "get_stats") and platform.python_implementation() == "CPython"


def _get_proc() -> _Proc:
    global _proc, _tail_page
    p = _proc
    if p is None or p.pid != os.getpid():  # first use, or a forked child
        if p is not None:
            os.close(p.fd)
            _tail_page = None  # its start time was the parent's
        p = _proc = _Proc()
    return p


def process_text_available() -> bool:
    """Whether :func:`process_text` can stand in for the default collectors here."""
    try:
        return _get_proc().ok and _max_fds() is not None
    except (OSError, ValueError, IndexError):
        return False


def _max_fds() -> int | None:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def _tail() -> TextPage:
    global _tail_page
    if _tail_page is None:
        p = _get_proc()
        page = TextPage()
        page.gauge("process_virtual_memory_bytes", "Virtual memory size in bytes.", {})
        page.gauge("process_resident_memory_bytes", "Resident memory size in bytes.", {})
        page.gauge("process_start_time_seconds", "Start time of the process since unix epoch in seconds.", {},
                   p.start_time)
        page.counter("process_cpu_seconds_total", "Total user and system CPU time spent in seconds.", [{}], None)
        page.gauge("process_open_fds", "Number of open file descriptors.", {})
        page.gauge("process_max_fds", "Maximum number of open file descriptors.", {})
        reg = CollectorRegistry(auto_describe=False)
        PlatformCollector(registry=reg)
        page.text(generate_latest(reg).decode())
        if _GC:
            gens = [{"generation": str(g)} for g in range(len(gc.get_stats()))]
            page.counter("python_gc_objects_collected", "Objects collected during gc", gens, None)
            page.counter("python_gc_objects_uncollectable", "Uncollectable objects found during GC", gens, None)
            page.counter("python_gc_collections", "Number of times this generation was collected", gens, None)
        _tail_page = page
    return _tail_page


# The process block is the same for every simulated engine in a process. It is
# rendered at most once per _PROCESS_TTL and shared: the demo fleet and the
# scrape benchmark run hundreds of engines in one process, and counting open fds
# costs O(fds) per page (quadratic over the fleet). Values are then up to 50 ms
# old, finer than the 10 ms CPU-time tick matters for a simulation.
_PROCESS_TTL = 0.05
_process_cache: tuple[float, str] | None = None


def process_text() -> str:
    """What ProcessCollector, PlatformCollector and GCCollector render, in that order.

    Raises:
        OSError: ``/proc`` could not be read (render with the collectors instead).
    """
    global _process_cache
    now = time.monotonic()
    cached = _process_cache
    if cached is not None and now - cached[0] < _PROCESS_TTL and cached[0] <= now:
        return cached[1]
    text = _process_text()
    _process_cache = (now, text)
    return text


def _process_text() -> str:
    page = _tail()
    p = _get_proc()
    parts = p.stat()
    ticks = p.ticks
    max_fds = _max_fds()
    if max_fds is None:
        raise OSError("unlimited open files: ProcessCollector fails here too")
    values: list[float] = [
        int(parts[20]),  # ints: exact as floats, and faster to write
        int(parts[21]) * p.pagesize,
        float(parts[11]) / ticks + float(parts[12]) / ticks,
        len(os.listdir("/proc/self/fd")),
        max_fds,
    ]
    if _GC:
        stats = gc.get_stats()
        values += [s["collected"] for s in stats]
        values += [s["uncollectable"] for s in stats]
        values += [s["collections"] for s in stats]
    return page.render(values)
