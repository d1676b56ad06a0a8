"""A hard limit on each test, behind pytest-timeout.

pytest-timeout (``timeout = 120`` in pyproject.toml, ``method = signal``) fails a test by raising in
its main thread. Two things escape it: a test whose timeout fired during its call has no timer left
for its teardown (a ``finally`` waiting on a process, an event loop's shutdown waiting on a thread),
and a wait in C code that does not return to the interpreter never sees the signal. Either hangs the
whole run until CI's own limit, with nothing in the log to say where.

This watchdog is one thread for the session. Each test's protocol (setup, call, teardown together)
gets a deadline: its pytest-timeout limit (read as pytest-timeout reads it: marker, ``--timeout``,
``PYTEST_TIMEOUT``, ini; none, or 0, is none) plus ``GRACE`` seconds; while a debugger is attached it
waits. Past it, the watchdog prints every
thread's stack and the test's id on the terminal (global capture suspended first), kills the
processes this run started (its descendants, so that no engine or server is left holding a port or
the CI log open), and ends the run with exit status 3. A run that would have hung fails, naming the
test and the line it was stuck on.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

GRACE = 120.0
"""Seconds past a test's own timeout before the run is ended: enough for any bounded teardown."""


def _timeout_of(item: pytest.Item) -> float | None:
    """The test's pytest-timeout limit as pytest-timeout itself reads it (marker, ``--timeout``,
    ``PYTEST_TIMEOUT``, the ini), falling back to the marker and the ini; ``None``: no limit."""
    try:
        from pytest_timeout import _get_item_settings

        value: object = _get_item_settings(item).timeout
    except Exception:  # (a pytest-timeout without that function, or none loaded)
        mark = item.get_closest_marker("timeout")
        if mark is not None:
            value = mark.args[0] if mark.args else mark.kwargs.get("timeout")
        else:
            value = item.config.getini("timeout")
    try:
        t = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return t if t > 0 else None


def _debugging() -> bool:
    """A debugger is attached (``--pdb``, ``breakpoint()``): a person is looking, nothing is hung."""
    try:
        from pytest_timeout import is_debugging

        return bool(is_debugging())
    except Exception:
        return False


def _descendants(root: int) -> list[int]:
    """This process's children, theirs, and so on (from /proc; empty where there is none)."""
    parent: dict[int, int] = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces and parentheses
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1:
            parent[int(d.name)] = int(fields[1])
    out: list[int] = []
    frontier = [root]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out.extend(kids)
        frontier.extend(kids)
    return out


class Watchdog:
    def __init__(self, config: pytest.Config) -> None:
        self._config = config
        self._cond = threading.Condition()
        self._deadline: float | None = None
        self._item = ""
        self._limit = 0.0
        threading.Thread(target=self._run, name="llmgw-test-watchdog", daemon=True).start()

    def arm(self, item: pytest.Item) -> bool:
        t = _timeout_of(item)
        if t is None:
            return False
        with self._cond:
            self._deadline, self._item, self._limit = time.monotonic() + t + GRACE, item.nodeid, t + GRACE
            self._cond.notify()
        return True

    def disarm(self) -> None:
        with self._cond:
            self._deadline = None
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._deadline is None:
                    self._cond.wait()
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                item, limit = self._item, self._limit
                if _debugging():
                    self._deadline = time.monotonic() + GRACE  # (looked at again later)
                    continue
            self._fire(item, limit)

    def _fire(self, item: str, limit: float) -> None:
        capman = self._config.pluginmanager.getplugin("capturemanager")
        if capman is not None:
            try:
                capman.suspend_global_capture(in_=True)
            except Exception:  # (the stacks matter more than the capture's state)
                pass
        sys.stderr.write(f"\n\n!!! watchdog: {item} still running {limit:.0f}s after it started "
                         "(its timeout and the grace past it): every thread's stack, then the run ends\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        for pid in _descendants(os.getpid()):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        os._exit(3)


_watchdog: Watchdog | None = None


def start(config: pytest.Config) -> None:
    """From ``pytest_configure`` (conftest.py): the watchdog's thread, once per run."""
    global _watchdog
    if _watchdog is None:
        _watchdog = Watchdog(config)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    armed = _watchdog is not None and _watchdog.arm(item)
    try:
        yield
    finally:
        if armed and _watchdog is not None:
            _watchdog.disarm()
