"""Read an engine's routing signals from its Prometheus ``/metrics`` page.

llmgw routes on three numbers per replica, each read from the engine's own metrics:

``waiting``
    requests queued in the engine (vLLM ``vllm:num_requests_waiting``, SGLang
    ``sglang:num_queue_reqs``, llama.cpp ``llamacpp:requests_deferred``, ...).
``running``
    requests being decoded now.
``kv_cache_usage``
    the fraction of the KV cache in use, 0..1.

A signal the page does not carry is ``None`` (absent), never 0: a replica with
metrics switched off must not look idle. Which names are read, and how series that
differ only in extra labels combine (vLLM's ``engine``, SGLang's ``dp_rank``: summed;
KV usage: the max), comes from the engine's module in :mod:`llmgw.engines`. Old and
new names are both accepted (vLLM's ``gpu_cache_usage_perc`` before 0.9.2); the first
one present wins.

:func:`read_stats` is the one-call reading. The poller builds a :class:`Mapping` per
endpoint once with :func:`mapping_for` (which takes metric-name overrides from the
config) and calls :func:`scan_stats` per scrape, which also reports what was missing
and which lines were malformed. Both parse Prometheus text 0.0.4 and OpenMetrics 1.0
(see ``llmgw._fast.promscan_py`` for the exact grammar, the limits and the two modes).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from collections.abc import Mapping as AbcMapping
from types import ModuleType
from typing import TYPE_CHECKING, Final, Literal, NamedTuple

from llmgw import engines
from llmgw._accel import select as _select_impl
from llmgw.engines.base import EngineInfo, MetricSpec
from llmgw.errors import PromParseError

if TYPE_CHECKING:
    from llmgw._fast import promscan_py as promscan
    from llmgw._fast.promscan_py import Mapping, ScanResult
else:
    promscan = _select_impl("promscan")
    Mapping = promscan.Mapping
    ScanResult = promscan.ScanResult

__all__ = [
    "ACCEPT",
    "GENERIC",
    "SIGNALS",
    "Mapping",
    "ScanResult",
    "Stats",
    "engine_choices",
    "label_values",
    "mapping_for",
    "metrics_path_for",
    "missing_signals",
    "read_stats",
    "scan_stats",
]

SIGNALS: Final = ("waiting", "running", "kv_cache_usage")
"""The routing signals, in the order of :class:`Stats` and of every mapping built here."""

GENERIC: Final = "generic"
"""The engine for "anything else" (``llmgw.engines.generic``): it reads only overridden names."""

# NOTE: no OpenMetrics in the offer. prometheus_client (what vLLM and SGLang serve
# with) picks OpenMetrics whenever the Accept header mentions it, whatever its q, and
# its OpenMetrics output escapes ':' in names to '_' (vllm:num_requests_waiting
# becomes vllm_num_requests_waiting). The scanner still reads OpenMetrics, and the
# escaped names too, for servers that answer it unasked.
ACCEPT: Final = "text/plain;version=0.0.4;q=1.0,*/*;q=0.1"
"""The ``Accept`` header for scrapes: classic text preferred (smaller), OpenMetrics read too."""


class _Default(enum.Enum):
    ENGINE = "engine"


class Stats(NamedTuple):
    """An engine's routing signals; each ``None`` when absent (never 0).

    Attributes:
        waiting: requests queued in the engine.
        running: requests being processed.
        kv_cache_usage: fraction of the KV cache in use, 0..1.
    """

    waiting: float | None
    running: float | None
    kv_cache_usage: float | None


def engine_choices() -> tuple[str, ...]:
    """The accepted ``engine`` values: the engines in :mod:`llmgw.engines` (``generic`` among them)."""
    return engines.ENGINE_NAMES


def _engine(engine: str) -> EngineInfo:
    try:
        return engines.get(engine)
    except KeyError:
        raise ValueError(f"unknown engine {engine!r}; choose one of: {', '.join(engine_choices())}") from None


def mapping_for(
    engine: str,
    overrides: AbcMapping[str, Sequence[str] | MetricSpec] | None = None,
    *,
    model_label: str | Literal[_Default.ENGINE] | None = _Default.ENGINE,
    select: AbcMapping[str, str] | None = None,
    impl: ModuleType | None = None,
) -> Mapping:
    """Build the :class:`Mapping` that reads one endpoint's signals (once; reuse it per scrape).

    Args:
        engine: an engine name from :mod:`llmgw.engines` (``vllm``, ``sglang``, ``llamacpp``,
            ``trtllm``, ``generic``, ``external``).
        overrides: per signal (``waiting``, ``running``, ``kv_cache_usage``), the metric
            names to read instead of the engine's, most preferred first (e.g. when a new
            engine version renames a metric); a :class:`~llmgw.engines.base.MetricSpec`
            also sets the aggregate. An empty list makes the signal absent. For
            ``"generic"`` these are the only names (aggregates: sum, sum, max).
        model_label: the label naming the served model; default: the engine's
            (``model_name`` for vLLM and SGLang; none for llama.cpp, TensorRT-LLM, generic).
        select: label values a sample must have to count, when it has the label
            (e.g. ``{"tp_rank": "0"}``).
        impl: the promscan implementation (tests and benchmarks pass a twin); default:
            the one :mod:`llmgw._accel` selected.

    Returns:
        a mapping whose signals are :data:`SIGNALS`, in that order.

    Raises:
        ValueError: unknown engine or signal, or an invalid metric or label name.
    """
    info = _engine(engine)
    specs = {"waiting": info.waiting, "running": info.running, "kv_cache_usage": info.kv_cache_usage}
    if overrides:
        for signal, names in overrides.items():
            if signal not in specs:
                raise ValueError(
                    f"unknown signal {signal!r} in metric overrides; choose from: {', '.join(SIGNALS)}"
                )
            if isinstance(names, MetricSpec):
                specs[signal] = names
            elif isinstance(names, (str, bytes)) or not isinstance(names, Sequence):
                raise ValueError(f"metric overrides for {signal!r}: expected a list of metric names")
            else:
                specs[signal] = MetricSpec(tuple(names), specs[signal].aggregate)
    # Accept each name's underscore-escaped spelling (OpenMetrics output of
    # prometheus_client) after the name itself.
    for signal, spec in list(specs.items()):
        names = list(spec.names)
        for n in spec.names:
            alt = n.replace(":", "_")
            if alt != n and alt not in names:
                names.append(alt)
        if len(names) != len(spec.names):
            specs[signal] = MetricSpec(tuple(names), spec.aggregate)
    label = info.model_label if model_label is _Default.ENGINE else model_label
    module = promscan if impl is None else impl
    mapping: Mapping = module.Mapping(
        {s: (specs[s].names, specs[s].aggregate) for s in SIGNALS}, model_label=label, select=select
    )
    return mapping


def metrics_path_for(engine: str) -> str:
    """Where ``engine`` serves its Prometheus text (``/prometheus/metrics`` for TensorRT-LLM).

    Raises:
        ValueError: unknown engine.
    """
    return _engine(engine).metrics_path


def _stats(values: tuple[float | None, ...]) -> Stats:
    # NaN says "the engine does not know": absent for routing, like a missing gauge.
    w, r, k = values
    return Stats(
        None if w is None or w != w else w,
        None if r is None or r != r else r,
        None if k is None or k != k else k,
    )


_engine_mappings: dict[str, Mapping] = {}


def read_stats(page: bytes, engine: str, model: str | None = None, *, strict: bool = False) -> Stats:
    """Read the routing signals from one engine's metrics page, as llmgw does.

    Example::

        >>> page = (b'# TYPE vllm:num_requests_waiting gauge\\n'
        ...         b'vllm:num_requests_waiting{engine="0",model_name="llama"} 2.0\\n'
        ...         b'vllm:num_requests_waiting{engine="1",model_name="llama"} 1.0\\n'
        ...         b'vllm:num_requests_running{engine="0",model_name="llama"} 5.0\\n')
        >>> read_stats(page, "vllm")
        Stats(waiting=3.0, running=5.0, kv_cache_usage=None)

    The two data-parallel engines' queues are summed; the page has no KV gauge, so
    ``kv_cache_usage`` is ``None``, not 0.

    Args:
        page: the response body of the engine's metrics path (Prometheus text 0.0.4 or
            OpenMetrics 1.0, already decompressed).
        engine: ``vllm``, ``sglang``, ``llamacpp``, ``trtllm`` (any name in
            :mod:`llmgw.engines`; ``generic`` reads nothing without the metric-name
            overrides that :func:`mapping_for` takes).
        model: where one page covers several models, count only this one's samples
            (by the engine's model label; samples without it still count).
        strict: raise on the first malformed line; by default malformed lines are
            skipped, as the gateway does.

    Returns:
        the signals; each ``None`` when the page does not have it, or has it as NaN.

    Raises:
        ValueError: unknown engine.
        PromParseError: the page is over the size limit (16 MiB), or ``strict`` and a
            line is malformed; ``lineno`` says which.
        TypeError: ``page`` is not ``bytes``.
    """
    mapping = _engine_mappings.get(engine)
    if mapping is None:
        mapping = _engine_mappings[engine] = mapping_for(engine)
    return _stats(mapping.scan(page, model, strict=strict).values)


def scan_stats(
    page: bytes, mapping: Mapping, model: str | None = None, *, strict: bool = False
) -> tuple[Stats, ScanResult]:
    """Read the routing signals with a mapping from :func:`mapping_for` (the poller's call).

    Returns:
        the signals, as :func:`read_stats` gives them, and the raw :class:`ScanResult`:
        which metric supplied each signal (``found``), how many lines were skipped as
        malformed (``bad_lines``) and the first of them (``error``), and whether the
        page ended with ``# EOF``.

    Raises:
        ValueError: ``mapping`` was not built by :func:`mapping_for`.
        PromParseError, TypeError: as :func:`read_stats`.
    """
    if mapping.signals != SIGNALS:
        raise ValueError(
            "mapping must come from mapping_for(): its signals are not waiting, running, kv_cache_usage"
        )
    result = mapping.scan(page, model, strict=strict)
    return _stats(result.values), result


def missing_signals(mapping: Mapping, result: ScanResult) -> dict[str, tuple[str, ...]]:
    """The signals a page lacked although the mapping names metrics for them.

    Returns:
        signal -> the metric names looked for, e.g. ``{"kv_cache_usage":
        ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")}``; a signal the
        engine does not report at all (llama.cpp's KV usage) is not listed. For a
        warn-once log line.
    """
    return {
        signal: names
        for signal, names, found in zip(mapping.signals, mapping.names, result.found, strict=True)
        if names and found is None
    }


def label_values(page: bytes, names: Iterable[str], label: str) -> list[str]:
    """The values ``label`` has on the samples of ``names`` on a page, in page order, each once.

    For messages (which model names a page's gauges are for): a cold path that reads the lines of
    those metrics only, each strictly; a malformed one is skipped.

    Example::

        >>> label_values(b'vllm:num_requests_running{engine="0",model_name="llama"} 1\\n',
        ...              ["vllm:num_requests_running"], "model_name")
        ['llama']
    """
    starts = tuple(n.encode("ascii") + b"{" for n in names)
    seen: dict[str, None] = {}
    if not starts:
        return []
    for line in page.split(b"\n"):
        line = line.lstrip(b" \t")
        if not line.startswith(starts):
            continue
        try:
            samples = promscan.parse(line.rstrip(b"\r") + b"\n")
        except PromParseError:
            continue
        for _, labels, _ in samples:
            value = labels.get(label)
            if value is not None:
                seen[value] = None
    return list(seen)
