"""``llmgw.http.keepalive.should_retry_fresh``: the stale keep-alive rule, case by case."""

from __future__ import annotations

import pytest

from llmgw.http.keepalive import should_retry_fresh

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
def test_a_reused_connection_lost_before_the_answer_is_retried(exc: BaseException | None) -> None:
    assert should_retry_fresh(True, False, exc)


@pytest.mark.parametrize("exc", LOST + NOT_STALE, ids=repr)
def test_never_once_the_answer_began(exc: BaseException | None) -> None:
    assert not should_retry_fresh(True, True, exc)


@pytest.mark.parametrize("exc", LOST + NOT_STALE, ids=repr)
def test_never_on_a_new_connection(exc: BaseException | None) -> None:
    # (which also makes the fresh retry the only one)
    assert not should_retry_fresh(False, False, exc)


@pytest.mark.parametrize("exc", NOT_STALE, ids=repr)
def test_never_for_what_a_stale_connection_does_not_give(exc: BaseException) -> None:
    assert not should_retry_fresh(True, False, exc)
