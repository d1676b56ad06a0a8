"""What llmgw knows about one inference engine, in one immutable record.

The scraper, the simulated engine and (later) the launchers read an engine's
facts from its module (``engines/vllm.py``, ...), never from literals of their own.
Facts and sources: ``shared/reference/engines.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Aggregate = Literal["sum", "max", "mean"]

__all__ = ["DEFAULT_KEEP_ALIVE", "Aggregate", "EngineInfo", "MetricSpec"]

# An idle keep-alive connection's life on a server whose timeout is not known:
# uvicorn's and Node.js's default (5 s), the shortest of the common servers'.
DEFAULT_KEEP_ALIVE = 5.0


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """How to read one routing signal from an engine's ``/metrics`` page.

    Attributes:
        names: accepted metric (sample) names, most preferred first; the first one
            present on a page wins. Empty: the engine does not report this signal,
            which is then *absent*, never 0.
        aggregate: how series that differ only in extra labels (vLLM's ``engine``,
            SGLang's ``tp_rank``/``dp_rank``) combine.
    """

    names: tuple[str, ...]
    aggregate: Aggregate = "sum"


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """One engine's dialect.

    Attributes:
        name: the config value (``engine: vllm``).
        title: a human name for messages.
        metrics_path: where its Prometheus text lives.
        metrics_need_key: whether ``metrics_path`` is behind the engine's API key.
        waiting / running / kv_cache_usage: the routing signals.
        model_label: label that names the served model on its samples, if any.
        health_path: readiness probe path.
        owned_by: ``owned_by`` in its ``/v1/models`` cards.
        default_port: the engine's default listening port.
        integer_error_code: its error bodies put the HTTP status (an int) in ``code``,
            which then says nothing the status does not: llmgw answers OpenAI's string
            code for the status instead. Without it, an integer ``code`` other than
            the status is the engine's own and is passed on as a string.
        error_type_codes: ``(engine type, OpenAI code)`` pairs: the string ``code``
            an error of the engine's own ``type`` gets (its bodies carry none).
        error_extra_fields: members of its error object passed on to clients beside
            OpenAI's four (they tell the client what to change).
        scraped: whether llmgw scrapes it at all (external providers are not).
        keep_alive: seconds the engine keeps an idle keep-alive connection before
            closing it (``None``: not known, taken to be :data:`DEFAULT_KEEP_ALIVE`).
            llmgw closes its idle connections to the engine before that
            (:meth:`idle_timeout`): a request written just as the engine closes is
            lost, and llmgw never sends a request twice.
        closes_after_stream: the engine closes the connection right after a streamed
            answer although the answer says keep-alive: llmgw closes it too instead
            of pooling it (a request written to it as the close arrives is lost).
        error_message_codes: ``(text, OpenAI code)`` pairs: the string ``code`` of a
            400 whose message contains ``text`` (an engine that names an error only in
            its words, such as vLLM's context overflow).
        notes: what to do when ``metrics_path`` serves no page (404; the first is shown).
        missing_metrics_hint: what to check when the page is served but lacks the
            routing gauges (shown in the scrape warning), if the engine has a known cause.

    The error fields are read by :func:`llmgw.engines.errors.normalize_error`.
    """

    name: str
    title: str
    metrics_path: str
    metrics_need_key: bool
    waiting: MetricSpec
    running: MetricSpec
    kv_cache_usage: MetricSpec
    model_label: str | None
    health_path: str = "/health"
    owned_by: str = "llmgw"
    default_port: int = 8000
    integer_error_code: bool = True
    error_type_codes: tuple[tuple[str, str], ...] = ()
    error_extra_fields: tuple[str, ...] = ()
    error_message_codes: tuple[tuple[str, str], ...] = ()
    scraped: bool = True
    keep_alive: float | None = None
    closes_after_stream: bool = False
    notes: tuple[str, ...] = field(default=())
    missing_metrics_hint: str | None = None

    def idle_timeout(self) -> float:
        """How long llmgw keeps an idle connection to this engine (``upstream.idle_timeout``'s
        default): 80 % of its keep-alive, 4 s of 5 s. The margin covers what separates the
        engine's clock from llmgw's (the answer's last bytes in flight, a busy loop); a
        connection is never handed out past it, even before the sweep closes it."""
        return 0.8 * (self.keep_alive if self.keep_alive is not None else DEFAULT_KEEP_ALIVE)
