"""When a request lost on a pooled keep-alive connection is sent again on a new one.

One rule for every exchange the upstream client makes: proxied calls
(``Call`` in the data path) and scrapes (:func:`llmgw.fleet.poller.scrape_once`).
Plain Python with no imports, so that any module can use it without an import cycle.
"""

from __future__ import annotations

__all__ = ["should_retry_fresh"]


def should_retry_fresh(reused: bool, got_response_head: bool, exc: BaseException | None) -> bool:
    """Whether an exchange lost with ``exc`` is sent once more, on a new connection.

    A connection that sat idle in the pool may have been closed by the replica in
    the meantime (idle timeouts; llama-server closes after a streamed answer while
    it advertises keep-alive, see ``shared/reference/engines.md`` §2). The request
    written to it then meets a reset or an end of stream, and the replica never saw
    it: sending it again on a new connection to the *same* replica is safe and is
    not a failure of the replica. Each condition says why:

    * ``reused``: only a connection taken from the pool can be stale. A new one that
      fails is the replica's own answer (down, refusing, overloaded), for the
      caller's ordinary failure path (another replica, a breaker outcome). This also
      makes the retry happen at most once: it runs on a new connection.
    * not ``got_response_head``: once an answer began, the replica had the request
      and may have acted on it (generated tokens); a second send would do the work
      twice, and a proxy could not take back what it relayed.
    * ``exc`` is a lost connection: ``None`` (closed, no error) or a
      :class:`ConnectionError` (reset, broken pipe, aborted), which is what a stale
      connection gives. Not a malformed answer (a ``ValueError``: the replica
      answered, badly), not a timeout (it may be working on the request: sending
      it again doubles the load), not another ``OSError`` (an unreachable host: a
      new connection to it fares no better than the old one).

    Args:
        reused: the exchange ran on a connection taken from the pool.
        got_response_head: a response head had been read when it was lost.
        exc: why it was lost (the sink's ``on_upstream_lost`` argument).

    Returns:
        ``True``: send the request again, on a new connection to the same replica.
    """
    if not reused or got_response_head:
        return False
    return exc is None or isinstance(exc, ConnectionError)
