"""Shared fixtures.

Compiled modules are tested twice, once per twin: a fixture named after the
module (``httpproto``, ``promscan``, ...) is parametrized over ``c`` and ``py``.
Under ``LLMGW_NO_EXTENSIONS=1`` the ``c`` cases are deselected (not skipped).

Canary secrets (``tests/canary.py``): the keys and tokens in test configs carry a
mark; a test during which one reached a log record (its message or traceback) or
the bytes a test client read from an asyncio stream (what a gateway answered)
fails. The watch is session-wide and costs one search per record and per read.
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import logging
import subprocess
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
from click.testing import CliRunner

from canary import MARK, MARK_BYTES, check_text
from canary import leaks as _leaks
from hard_timeout import pytest_runtest_protocol  # noqa: F401  (the hook: a hard limit on each test)
from hard_timeout import start as _start_watchdog
from llmgw._accel import NO_EXTENSIONS
from tools import need_tool

TWINS = [pytest.param("c", marks=pytest.mark.c_extension, id="c"), pytest.param("py", id="py")]


def load_twin(name: str, which: str) -> ModuleType:
    """Import ``llmgw._fast.<name>`` (``c``) or its pure twin (``py``)."""
    return importlib.import_module(f"llmgw._fast.{name}" if which == "c" else f"llmgw._fast.{name}_py")


def _twin_fixture(name: str):  # type: ignore[no-untyped-def]
    @pytest.fixture(params=TWINS, name=name)
    def _fixture(request: pytest.FixtureRequest) -> ModuleType:
        return load_twin(name, request.param)

    return _fixture


httpproto = _twin_fixture("httpproto")
promscan = _twin_fixture("promscan")
score = _twin_fixture("score")
admit = _twin_fixture("admit")
jsonscan = _twin_fixture("jsonscan")
server = _twin_fixture("server")
upstream = _twin_fixture("upstream")
nodetext = _twin_fixture("nodetext")


@pytest.fixture(autouse=True)
def _state_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """The control plane's default store (``$XDG_STATE_HOME/llmgw/``) in a fresh directory per test,
    never the user's own (a subprocess inherits it)."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state")))


@pytest.fixture(autouse=True)
def _no_live_objects_left(request: pytest.FixtureRequest) -> Iterator[None]:
    """In the compiled debug build, a test leaves no connection, writer, call or
    upstream connection of its own alive (uvloop's test base checks its handles
    the same way). Counted against the test's start, so objects of wider-scoped
    fixtures are not blamed on it."""
    from llmgw._fast import _live

    if not _live.enabled:
        yield
        return
    caplog: pytest.LogCaptureFixture = request.getfixturevalue("caplog")
    gc.collect()
    before = _live.live()
    yield
    # NOTE: pytest keeps the test's log records until after teardown; a record of
    # a logged exception holds its traceback, and so the frames and every object
    # they saw. The text is captured already: drop the tracebacks.
    for when in ("setup", "call"):
        for rec in caplog.get_records(when):  # type: ignore[arg-type]
            rec.exc_info = None
    left: dict[str, int] = {}
    for _ in range(3):  # (objects in reference cycles wait for the collector)
        gc.collect()
        now = _live.live()
        left = {k: now[k] - before[k] for k in now if now[k] != before[k]}
        if not left:
            return
    raise AssertionError(f"live objects left by this test (debug build): {left}")


def pytest_runtest_setup(item: pytest.Item) -> None:
    """``@pytest.mark.needs_tool("promtool", install="apt-get install prometheus")``: see ``tools.py``."""
    for mark in item.iter_markers("needs_tool"):
        need_tool(*mark.args, **mark.kwargs)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not NO_EXTENSIONS:
        return
    keep, drop = [], []
    for item in items:
        (drop if item.get_closest_marker("c_extension") else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, object]:
    """Run async tests on uvloop: the loop llmgw runs on in production."""
    import uvloop

    return {"uvloop": uvloop.new_event_loop}


# -- canary secrets --

class _CanaryHandler(logging.Handler):
    """Sees every log record (on the root logger, and on ``llmgw.access``, which may
    not propagate) and notes those that carry a canary secret."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
        except Exception:  # (a record whose arguments do not format: its parts then)
            text = f"{record.msg!r} {record.args!r}"
        if record.exc_info and record.exc_info[1] is not None:
            text += " " + logging.Formatter().formatException(record.exc_info)
        if MARK in text:
            _leaks.append(f"log record of {record.name} ({record.levelname}): {text[:300]!r}")


_handler = _CanaryHandler(level=0)
_feed_data = asyncio.StreamReader.feed_data


def _watched_feed_data(self: asyncio.StreamReader, data: Any) -> None:
    raw = data if isinstance(data, bytes) else bytes(data)
    at = raw.find(MARK_BYTES)
    if at >= 0:
        _leaks.append(f"bytes a test client read: {raw[max(0, at - 120) : at + 60]!r}")
    _feed_data(self, data)


def _check_output(where: str, *outputs: Any) -> None:
    for out in outputs:
        if isinstance(out, bytes):
            out = out.decode("utf-8", "replace")
        if isinstance(out, str):
            check_text(where, out)


_communicate = subprocess.Popen.communicate


def _watched_communicate(self: subprocess.Popen[Any], *args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """What a process a test ran printed (captured output: llmgw's CLI, serve, agents; ``subprocess.run``
    captures through this too) is watched as well."""
    out, err = _communicate(self, *args, **kwargs)
    _check_output(f"output of {str(self.args)[:120]}", out, err)
    return out, err


def _watched_invoke(self: Any, *args: Any, **kwargs: Any) -> Any:
    res = _invoke(self, *args, **kwargs)
    _check_output("output of a CliRunner run", res.output)
    return res


_invoke = CliRunner.invoke


def pytest_configure(config: pytest.Config) -> None:
    _start_watchdog(config)
    logging.getLogger().addHandler(_handler)
    logging.getLogger("llmgw.access").addHandler(_handler)
    asyncio.StreamReader.feed_data = _watched_feed_data  # type: ignore[method-assign]
    subprocess.Popen.communicate = _watched_communicate  # type: ignore[method-assign]
    CliRunner.invoke = _watched_invoke  # type: ignore[method-assign]


def pytest_unconfigure(config: pytest.Config) -> None:
    logging.getLogger().removeHandler(_handler)
    logging.getLogger("llmgw.access").removeHandler(_handler)
    asyncio.StreamReader.feed_data = _feed_data  # type: ignore[method-assign]
    subprocess.Popen.communicate = _communicate  # type: ignore[method-assign]
    CliRunner.invoke = _invoke  # type: ignore[method-assign]


@pytest.fixture(autouse=True)
def _no_canary_leaked() -> Iterator[None]:
    """Fail the test during which a canary secret leaked (see the module docstring)."""
    _leaks.clear()
    yield
    if _leaks:
        found = list(_leaks)
        _leaks.clear()
        pytest.fail("a canary secret leaked:\n  " + "\n  ".join(found[:5]), pytrace=False)


@pytest.fixture
def canary_leaks() -> Iterator[list[str]]:
    """The leaks noted so far in this test, for a test that leaks on purpose (to
    show the watch works); cleared after it, so it does not fail for them."""
    yield _leaks
    _leaks.clear()


@pytest.fixture(autouse=True)
def _access_log_propagation_restored() -> Iterator[None]:
    """A test that runs llmgw's CLI in-process (CliRunner) calls ``llmgw.log.setup``, which puts a
    handler on the root logger (writing to whatever ``sys.stderr`` is when a record comes: in a
    later test, the output a CliRunner captures), sets levels, and stops ``llmgw.access``
    propagating to the root logger, all for the rest of the session. Each test gets the logging
    set-up back as it found it."""
    root, llmgw_log, access = logging.getLogger(), logging.getLogger("llmgw"), logging.getLogger("llmgw.access")
    before = (root.handlers[:], root.level, llmgw_log.handlers[:], llmgw_log.level, access.handlers[:], access.level,
              access.propagate)
    yield
    for logger, handlers in ((root, before[0]), (llmgw_log, before[2]), (access, before[4])):
        for h in logger.handlers[:]:
            if h not in handlers:
                logger.removeHandler(h)
    root.setLevel(before[1])
    llmgw_log.setLevel(before[3])
    access.setLevel(before[5])
    access.propagate = before[6]
