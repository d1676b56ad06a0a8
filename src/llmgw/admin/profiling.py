"""Profiling the running gateway, the way Go's pprof does it, on the admin port.

* :class:`Profiler` takes one CPU profile at a time: a sampler thread reads the
  event loop thread's stack (``sys._current_frames()``) ~200 times a second for N
  seconds and returns speedscope JSON or collapsed stacks; or, on request,
  ``cProfile`` runs on the loop thread for N seconds and returns a pstats file.
* :func:`task_dump` lists every asyncio task with the chain of coroutines it is
  suspended in (``await`` by ``await``), and :func:`thread_dump` every thread.
* :func:`heap_report` drives ``tracemalloc``: the first call starts tracing, the
  next ones report the lines that hold the most memory (or what grew since the
  previous report).

PERF: sampling costs the loop thread the GIL hand-offs to the sampler (a stack
walk of ~20 µs per sample: about 0.5% at 200 Hz) and, while a profile runs, a
short switch interval (see :meth:`Profiler.sample`). ``cProfile`` is a
deterministic profiler and slows Python code several times while it runs.

NOTE: only Python frames are seen. Time in C (uvloop's loop, socket calls, the
compiled ``_fast`` modules) counts against the nearest Python frame; with uvloop,
idle time and the loop's own work both show as its ``run`` frame.
"""

from __future__ import annotations

import asyncio
import cProfile
import linecache
import marshal
import os
import sys
import threading
import time
import tracemalloc
from collections import Counter
from dataclasses import dataclass, field
from types import CodeType, FrameType
from typing import Any

from .. import __version__

__all__ = [
    "MAX_SECONDS",
    "Profile",
    "ProfileBusyError",
    "Profiler",
    "heap_report",
    "task_dump",
    "thread_dump",
]

MAX_SECONDS = 60.0
MAX_HZ = 1000
DEFAULT_HZ = 199  # not a divisor of common timer periods, so samples don't lock step with them
_MAX_DEPTH = 256
_SWITCH_INTERVAL = 0.000005  # seconds; see Profiler.sample


class ProfileBusyError(RuntimeError):
    """Another profile is being taken (one at a time)."""


_short_cache: dict[str, str] = {}


def short_path(filename: str) -> str:
    """``filename`` relative to the ``sys.path`` entry that holds it (``asyncio/tasks.py``)."""
    s = _short_cache.get(filename)
    if s is None:
        s = filename
        best = 0
        for p in sys.path:
            if p and len(p) > best and filename.startswith(p.rstrip(os.sep) + os.sep):
                best = len(p)
                s = filename[len(p.rstrip(os.sep)) + 1 :]
        _short_cache[filename] = s
    return s


def _name(code: CodeType) -> str:
    return getattr(code, "co_qualname", code.co_name)


@dataclass
class Profile:
    """A sampled CPU profile of one thread.

    Attributes:
        frames: the distinct functions seen, as code objects.
        samples: one stack per sample, as indices into ``frames``, outermost first.
        weights: seconds each sample stands for (the time since the previous one).
        duration: seconds sampled.
        hz: the requested sampling rate.
    """

    frames: list[CodeType] = field(default_factory=list)
    samples: list[tuple[int, ...]] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    duration: float = 0.0
    hz: float = DEFAULT_HZ
    thread_name: str = "event loop"

    def speedscope(self) -> dict[str, Any]:
        """The profile in speedscope's file format (open it at https://www.speedscope.app)."""
        return {
            "$schema": "https://www.speedscope.app/file-format-schema.json",
            "shared": {
                "frames": [
                    {"name": _name(c), "file": short_path(c.co_filename), "line": c.co_firstlineno}
                    for c in self.frames
                ]
            },
            "profiles": [
                {
                    "type": "sampled",
                    "name": f"llmgw pid {os.getpid()} {self.thread_name} thread ({len(self.samples)} samples at {self.hz:g} Hz)",
                    "unit": "seconds",
                    "startValue": 0.0,
                    "endValue": round(sum(self.weights), 6),
                    "samples": [list(s) for s in self.samples],
                    "weights": [round(w, 6) for w in self.weights],
                }
            ],
            "name": f"llmgw {__version__} CPU profile",
            "activeProfileIndex": 0,
            "exporter": f"llmgw {__version__}",
        }

    def collapsed(self) -> str:
        """Brendan Gregg's collapsed stacks (``flamegraph.pl``, speedscope, inferno read it)."""
        names = [f"{_name(c)} ({short_path(c.co_filename)}:{c.co_firstlineno})".replace(";", ":") for c in self.frames]
        counts = Counter(self.samples)
        lines = [";".join(names[i] for i in stack) + f" {n}" for stack, n in counts.most_common()]
        return "\n".join(lines) + ("\n" if lines else "")


def _sample(
    tid: int, seconds: float, hz: float, stop: threading.Event, prof: Profile
) -> None:
    index: dict[CodeType, int] = {}
    frames = prof.frames
    samples = prof.samples
    weights = prof.weights
    interval = 1.0 / hz
    t0 = last = time.perf_counter()
    deadline = t0 + seconds
    nxt = t0
    while True:
        nxt += interval
        delay = nxt - time.perf_counter()
        if delay > 0 and stop.wait(delay):
            break
        now = time.perf_counter()
        if now >= deadline or stop.is_set():
            break
        f: FrameType | None = sys._current_frames().get(tid)
        if f is None:  # the thread ended
            break
        stack: list[int] = []
        while f is not None and len(stack) < _MAX_DEPTH:
            code = f.f_code
            i = index.get(code)
            if i is None:
                i = index[code] = len(frames)
                frames.append(code)
            stack.append(i)
            f = f.f_back
        del f
        stack.reverse()
        samples.append(tuple(stack))
        weights.append(now - last)
        last = now
        if now - nxt > interval:  # fell behind (the GIL was busy): don't burst to catch up
            nxt = now
    prof.duration = time.perf_counter() - t0


class Profiler:
    """Takes CPU profiles of the event loop thread, one at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    async def sample(self, seconds: float, hz: float = DEFAULT_HZ) -> Profile:
        """Sample the calling (event loop) thread's stack for ``seconds``.

        Raises:
            ProfileBusyError: another profile is being taken.
        """
        if not self._lock.acquire(blocking=False):
            raise ProfileBusyError("a profile is already being taken; try again when it ends")
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        stop = threading.Event()
        prof = Profile(hz=hz)
        tid = threading.get_ident()

        def finished() -> None:
            if not done.done():
                done.set_result(None)

        def run() -> None:
            try:
                _sample(tid, seconds, hz, stop, prof)
            finally:
                # NOTE: released by the sampler itself, so a cancelled request
                # cannot start a second sampler while the first winds down.
                self._lock.release()
                try:
                    loop.call_soon_threadsafe(finished)
                except RuntimeError:  # the loop closed meanwhile
                    pass

        # NOTE: a thread waiting for the GIL makes the holder drop it only after the
        # switch interval (5 ms by default). Until then the sampler gets the GIL
        # when the loop thread lets go of it by itself: in epoll, or (uvloop)
        # between two callbacks, so nearly every sample would look idle. With a
        # 5 µs interval the loop thread drops it mid-callback, near the sample's due
        # time. This costs nothing while no other thread waits for the GIL.
        switch = sys.getswitchinterval()
        sys.setswitchinterval(min(switch, _SWITCH_INTERVAL))
        try:
            threading.Thread(target=run, name="llmgw-profiler", daemon=True).start()
        except BaseException:
            sys.setswitchinterval(switch)
            self._lock.release()
            raise
        try:
            await done
        finally:
            stop.set()
            sys.setswitchinterval(switch)
        return prof

    async def cprofile(self, seconds: float) -> bytes:
        """Run ``cProfile`` on the event loop thread for ``seconds``; a pstats file's bytes.

        Raises:
            ProfileBusyError: another profile is being taken.
        """
        if not self._lock.acquire(blocking=False):
            raise ProfileBusyError("a profile is already being taken; try again when it ends")
        try:
            prof = cProfile.Profile()
            try:
                prof.enable()
            except ValueError as exc:  # another profiler (a debugger, coverage) holds the hook
                raise ProfileBusyError(f"cannot start cProfile: {exc}") from exc
            try:
                await asyncio.sleep(seconds)
            finally:
                prof.disable()
            prof.create_stats()
            # The format pstats.Stats(path) and snakeviz read (what dump_stats writes).
            return marshal.dumps(prof.stats)
        finally:
            self._lock.release()


# -- tasks and threads --


def _await_chain(coro: Any) -> tuple[list[tuple[str, int, str]], str | None]:
    """The frames of ``coro`` and the coroutines it awaits, outermost first, and what the innermost waits on."""
    frames: list[tuple[str, int, str]] = []
    c = coro
    for _ in range(_MAX_DEPTH):
        f = getattr(c, "cr_frame", None) or getattr(c, "gi_frame", None) or getattr(c, "ag_frame", None)
        if f is None:
            return frames, None
        frames.append((f.f_code.co_filename, f.f_lineno, _name(f.f_code)))
        nxt = getattr(c, "cr_await", None) or getattr(c, "gi_yieldfrom", None) or getattr(c, "ag_await", None)
        if nxt is None:
            return frames, None
        if not any(hasattr(nxt, a) for a in ("cr_frame", "gi_frame", "ag_frame")):
            return frames, _describe(nxt, f)
        c = nxt
    return frames, None


def _describe(obj: Any, frame: FrameType) -> str:
    if type(obj).__name__ == "FutureIter":
        # NOTE: the C future's iterator does not expose its future; the awaiting
        # frame usually holds it in a local (asyncio.sleep's `future`, wait_for's `waiter`).
        futures = [v for v in frame.f_locals.values() if isinstance(v, asyncio.Future) and not v.done()]
        obj = futures[0] if len(futures) == 1 else None
        if obj is None:
            return "<Future>"
    if isinstance(obj, asyncio.Future):
        state = "cancelled" if obj.cancelled() else "done" if obj.done() else "pending"
        return f"<{type(obj).__name__} {state}>"
    return f"<{type(obj).__name__}>"


def task_dump(loop: asyncio.AbstractEventLoop | None = None) -> list[dict[str, Any]]:
    """Every task on ``loop`` (default: the running one) with its await chain.

    Returns:
        dicts with ``name``, ``state``, ``coro``, ``stack`` (``{file, line, function}``,
        outermost first) and ``awaiting`` (what the innermost coroutine waits on).
    """
    loop = loop or asyncio.get_running_loop()
    current = asyncio.current_task(loop)
    out = []
    for t in asyncio.all_tasks(loop):
        coro = t.get_coro()
        frames, awaiting = _await_chain(coro)
        state = "cancelled" if t.cancelled() else "done" if t.done() else "pending"
        if t is current:
            state = "running"
        out.append(
            {
                "name": t.get_name(),
                "state": state,
                "coro": getattr(coro, "__qualname__", type(coro).__name__),
                "stack": [{"file": f, "line": n, "function": fn} for f, n, fn in frames],
                "awaiting": awaiting,
            }
        )
    out.sort(key=lambda d: (d["name"], d["coro"]))
    return out


def format_tasks(tasks: list[dict[str, Any]]) -> str:
    """:func:`task_dump` as text, like a traceback per task."""
    lines = [f"{len(tasks)} asyncio tasks", ""]
    for t in tasks:
        lines.append(f"Task {t['name']!r} ({t['state']}) {t['coro']}")
        for fr in t["stack"]:
            lines.append(f'  File "{fr["file"]}", line {fr["line"]}, in {fr["function"]}')
            # (a frame between instructions, e.g. a coroutine not started, has no line number)
            src = linecache.getline(fr["file"], fr["line"]).strip() if fr["line"] else ""
            if src:
                lines.append(f"    {src}")
        if t["awaiting"]:
            lines.append(f"  awaiting {t['awaiting']}")
        lines.append("")
    return "\n".join(lines)


def thread_dump() -> str:
    """Every thread's Python stack as text (a goroutine dump's analogue)."""
    import traceback

    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    lines = []
    for tid, frame in sys._current_frames().items():
        mark = " (this request)" if tid == me else ""
        lines.append(f"Thread {names.get(tid, '?')!r} id={tid}{mark}")
        lines.extend(x.rstrip("\n") for x in traceback.format_stack(frame))
        lines.append("")
    return "\n".join(lines)


# -- memory --

_last_snapshot: tracemalloc.Snapshot | None = None


def heap_report(top: int = 20, *, stop: bool = False, diff: bool = False, frames: int = 1) -> dict[str, Any]:
    """Drive ``tracemalloc`` and report the top allocation sites.

    Args:
        top: how many lines to report.
        stop: stop tracing (frees its memory) instead of reporting.
        diff: report growth since the previous report rather than totals.
        frames: stack depth recorded per allocation when tracing starts.

    Returns:
        ``tracing``, ``started`` (this call started it), ``traced_bytes``,
        ``peak_bytes`` and ``top``: ``{file, line, size_bytes, count}`` (plus
        ``size_diff_bytes``/``count_diff`` with ``diff``), largest first.
    """
    global _last_snapshot
    if stop:
        was = tracemalloc.is_tracing()
        tracemalloc.stop()
        _last_snapshot = None
        return {"tracing": False, "stopped": was, "top": []}
    if not tracemalloc.is_tracing():
        tracemalloc.start(frames)
        return {
            "tracing": True,
            "started": True,
            "message": "tracing started now; allocations from now on are traced: ask again to see the top sites",
            "top": [],
        }
    snap = tracemalloc.take_snapshot().filter_traces(
        (
            tracemalloc.Filter(False, tracemalloc.__file__),
            tracemalloc.Filter(False, "<frozen importlib._bootstrap>"),
            tracemalloc.Filter(False, "<frozen importlib._bootstrap_external>"),
            tracemalloc.Filter(False, "<unknown>"),
        )
    )
    current, peak = tracemalloc.get_traced_memory()
    rows: list[dict[str, Any]] = []
    if diff and _last_snapshot is not None:
        for st in snap.compare_to(_last_snapshot, "lineno")[:top]:
            fr = st.traceback[0]
            rows.append(
                {
                    "file": fr.filename, "line": fr.lineno, "size_bytes": st.size, "count": st.count,
                    "size_diff_bytes": st.size_diff, "count_diff": st.count_diff,
                }
            )
    else:
        for s in snap.statistics("lineno")[:top]:
            fr = s.traceback[0]
            rows.append({"file": fr.filename, "line": fr.lineno, "size_bytes": s.size, "count": s.count})
    _last_snapshot = snap
    return {"tracing": True, "started": False, "traced_bytes": current, "peak_bytes": peak, "top": rows}


def format_heap(report: dict[str, Any]) -> str:
    """:func:`heap_report` as text."""
    if not report.get("tracing"):
        return "tracemalloc stopped\n"
    if report.get("started"):
        return f"{report['message']}\n"
    lines = [
        f"traced memory: {report['traced_bytes'] / 1048576:.1f} MiB (peak {report['peak_bytes'] / 1048576:.1f} MiB)",
        "",
    ]
    for r in report["top"]:
        where = f"{short_path(r['file'])}:{r['line']}"
        if "size_diff_bytes" in r:
            lines.append(f"{r['size_diff_bytes'] / 1024:+12.1f} KiB {r['count_diff']:+8d} blocks  {where}")
        else:
            lines.append(f"{r['size_bytes'] / 1024:12.1f} KiB {r['count']:8d} blocks  {where}")
        src = linecache.getline(r["file"], r["line"]).strip()
        if src:
            lines.append(f"{'':32}{src}")
    return "\n".join(lines) + "\n"


# The loop-hold watch's tick: often enough to see a 2 ms hold, rare enough to cost nothing.
HOLD_TICK = 0.001
HOLD_BUCKETS_MS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0)


async def loop_holds(seconds: float, tick: float = HOLD_TICK) -> dict[str, Any]:
    """How long the event loop thread ran without getting back to its timers, for ``seconds``.

    A timer every ``tick`` reads the thread's own CPU clock (``time.thread_time``)
    and the monotonic clock. Between two ticks the loop ran its other callbacks:
    the CPU the thread used in between is how long they held the loop (an upper
    bound on the longest single callback: several may run between two ticks); the
    wall time in between adds what the thread spent waiting for a core, which on a
    busy machine is not the loop's doing. Both are reported, worst and by bucket.
    """
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    cpu_gaps: list[float] = []
    wall_gaps: list[float] = []
    end = time.monotonic() + seconds
    last = (time.thread_time(), time.monotonic())

    def on_tick() -> None:
        nonlocal last
        now = (time.thread_time(), time.monotonic())
        # the tick's own wait is no hold: only the time past it counts
        cpu_gaps.append(now[0] - last[0])
        wall_gaps.append(max(0.0, now[1] - last[1] - tick))
        last = now
        if now[1] >= end:
            if not done.done():
                done.set_result(None)
        else:
            loop.call_later(tick, on_tick)

    loop.call_later(tick, on_tick)
    await done

    def summary(gaps: list[float]) -> dict[str, Any]:
        ms = sorted(1000 * g for g in gaps)
        return {
            "max_ms": round(ms[-1], 3) if ms else None,
            "p99_ms": round(ms[int(0.99 * (len(ms) - 1))], 3) if ms else None,
            "over_ms": {f"{b:g}": sum(1 for x in ms if x > b) for b in HOLD_BUCKETS_MS},
        }

    return {"seconds": seconds, "ticks": len(cpu_gaps), "cpu": summary(cpu_gaps), "wall": summary(wall_gaps)}
