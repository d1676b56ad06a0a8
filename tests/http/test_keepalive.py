"""``should_retry_fresh`` (the upstream client's stale keep-alive rule), case by case, on both twins."""

from __future__ import annotations

from types import ModuleType

import pytest

LOST = [
    None,  # closed, nothing said
    ConnectionResetError("the replica closed the connection"),
    BrokenPipeError(),
    ConnectionAbortedError(),
]
NOT_STALE = [
    ValueError("malformed upstream response: ..."),  # the replica answered, badly
    TimeoutError("scrape timed out"),  # it may be working on the request
    OSError(113, "No route to host"),  # a new connection fares no better
    RuntimeError("a bug in the sink"),
]


@pytest.mark.parametrize("exc", LOST, ids=repr)
def test_a_reused_connection_lost_before_the_answer_is_retried(upstream: ModuleType, exc: BaseException | None) -> None:
    assert upstream.should_retry_fresh(True, False, exc)


@pytest.mark.parametrize("exc", LOST + NOT_STALE, ids=repr)
def test_never_once_the_answer_began(upstream: ModuleType, exc: BaseException | None) -> None:
    assert not upstream.should_retry_fresh(True, True, exc)


@pytest.mark.parametrize("exc", LOST + NOT_STALE, ids=repr)
def test_never_on_a_new_connection(upstream: ModuleType, exc: BaseException | None) -> None:
    # (which also makes the fresh retry the only one)
    assert not upstream.should_retry_fresh(False, False, exc)


@pytest.mark.parametrize("exc", NOT_STALE, ids=repr)
def test_never_for_what_a_stale_connection_does_not_give(upstream: ModuleType, exc: BaseException) -> None:
    assert not upstream.should_retry_fresh(True, False, exc)
