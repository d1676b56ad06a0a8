"""Shared fixtures.

Compiled modules are tested twice, once per twin: a fixture named after the
module (``httpproto``, ``promscan``, ...) is parametrized over ``c`` and ``py``.
Under ``LLMGW_NO_EXTENSIONS=1`` the ``c`` cases are deselected (not skipped).
"""

from __future__ import annotations

import gc
import importlib
from collections.abc import Iterator
from types import ModuleType

import pytest

from llmgw._accel import NO_EXTENSIONS

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
