"""What differs between the simulated engines: errors, auth, health, models, metrics.

Each dialect reads its metric names from ``llmgw.engines.<engine>``; names that
module does not define yet are spelled here, next to the engine's own help text.
Facts and sources: ``shared/reference/engines.md`` sections 0 to 4.

vLLM, TensorRT-LLM and SGLang answer ``/metrics`` with what ``prometheus_client``
renders (as the engines do). The text format 0.0.4 (what llmgw's poller asks for) is
written from templates laid out when the engine starts (:mod:`.promtext`): a scrape
only formats the numbers that change, tens of microseconds instead of milliseconds.
Any other negotiated format (OpenMetrics) goes through a private ``prometheus_client``
registry per engine built from :meth:`Dialect.families`, the reference the fast text is
tested against. Series are read at scrape time from the scheduler and
:class:`~llmgw.engines.sim.scheduler.Stats`: the hot path only adds numbers.
llama.cpp writes its page by hand, and so does this module.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Sequence
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, ClassVar

import orjson
from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, choose_encoder, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from .. import llamacpp, sglang, trtllm, vllm
from ..base import EngineInfo
from .openai import WORDS, Job, RequestError
from .promtext import HistText, TextPage, process_text, process_text_available

if TYPE_CHECKING:
    from ...http.parser import Request
    from .config import SimConfig
    from .scheduler import Scheduler, SimRequest, Stats

__all__ = ["DIALECTS", "Dialect", "make_dialect"]

JSON_CT = (b"content-type", b"application/json")
TEXT_CT = (b"content-type", b"text/plain; charset=utf-8")
_PLAIN_CT = CONTENT_TYPE_PLAIN_0_0_4.encode()

# Accept header -> prometheus_client's (encoder, content type); text 0.0.4 is the fast path.
_NEGOTIATED: dict[bytes | None, tuple[Any, bytes]] = {}


def _negotiate(accept: bytes | None) -> tuple[Any, bytes]:
    got = _NEGOTIATED.get(accept)
    if got is None:
        encoder, content_type = choose_encoder(accept.decode("latin-1") if accept else "")
        got = (encoder, content_type.encode())
        if len(_NEGOTIATED) >= 256:
            _NEGOTIATED.clear()
        _NEGOTIATED[accept] = got
    return got

# vLLM v1 buckets (vllm/v1/metrics/loggers.py); TensorRT-LLM copies them.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                          7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                            60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# SGLang's defaults (its metrics collector).
_SGL_TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
_SGL_ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060,
                    0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000)
_SGL_E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200,
                    1800, 2400)


def _one_two_five(limit: int) -> tuple[float, ...]:
    """vLLM's ``build_1_2_5_buckets``: 1, 2, 5, 10, 20, 50, ... up to ``limit``."""
    out: list[float] = []
    exp = 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exp
            if v > limit:
                return tuple(out)
            out.append(float(v))
        exp += 1


def _type_name(status: int) -> str:
    """vLLM-style error type: ``BadRequestError``, ``ServiceUnavailableError``, ..."""
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        return "InternalServerError" if status >= 500 else "BadRequestError"
    name = phrase.replace(" ", "").replace("-", "")
    return name if name.endswith("Error") else name + "Error"  # (500's phrase ends in Error already)


class Dialect:
    """The base dialect; subclasses set the class attributes and override hooks.

    A dialect is made per engine instance (it holds that engine's private metrics
    registry and a view of its scheduler).
    """

    info: ClassVar[EngineInfo]
    sse_content_type: ClassVar[bytes] = b"text/event-stream; charset=utf-8"
    #: vLLM puts ``finish_reason`` on the last token's event; others send a separate event.
    finish_on_last_token: ClassVar[bool] = False
    #: ``delta.content`` of the first (role) chat event.
    role_content: ClassVar[Any] = ""
    #: ``stop_reason`` in each choice (vLLM).
    stop_reason_field: ClassVar[bool] = False
    #: llama.cpp: only the prompt must fit in the context.
    clamp_to_context: ClassVar[bool] = False
    #: TensorRT-LLM: ``stream_options`` present means ``include_usage`` unless it says otherwise.
    usage_default_with_options: ClassVar[bool] = False
    #: vLLM: 404 for a ``model`` it does not serve.
    checks_model: ClassVar[bool] = False
    message_extra: ClassVar[dict[str, Any]] = {}
    choice_extra: ClassVar[dict[str, Any]] = {}
    #: llama.cpp answers with the request's ``model`` field; the others with the served name.
    echo_model: ClassVar[bool] = False
    #: extra routes: (method, path) -> name. ``health`` and ``models`` are the app's own
    #: answers; any other name is a method ``route_<name>(request, now)`` here.
    routes: ClassVar[dict[tuple[bytes, bytes], str]] = {}

    def __init__(self, cfg: SimConfig, sched: Scheduler, stats: Stats, created: int) -> None:
        self.cfg = cfg
        self.sched = sched
        self.stats = stats
        self.created = created
        self.model = cfg.model
        self._keys = self._parse_keys(cfg.api_key)
        self._registry: CollectorRegistry | None = None
        self._text: TextPage | None = None
        self._text_built = False
        self._hists: list[HistText] = []
        self._with_process = False
        self._reasons: tuple[str, ...] = ()  # finish reasons laid out in the template

    @classmethod
    def buckets_for(cls, cfg: SimConfig) -> dict[str, Sequence[float]]:
        """Histogram buckets by kind (see :class:`~llmgw.engines.sim.scheduler.Stats`)."""
        return {}

    # -- auth --

    def _parse_keys(self, key: str | None) -> tuple[bytes, ...]:
        return () if key is None else (key.encode(),)

    def needs_key(self, method: bytes, path: bytes) -> bool:
        """Whether ``path`` is behind the API key (only asked when a key is set)."""
        return method != b"OPTIONS"

    def key_ok(self, request: Request) -> bool:
        auth = request.authorization
        if auth is None or not auth.startswith(b"Bearer "):
            return False
        return _any_equal(auth[7:], self._keys)

    @property
    def auth_enabled(self) -> bool:
        return bool(self._keys)

    def unauthorized(self) -> tuple[int, bytes]:
        return 401, b'{"error":"Unauthorized"}'

    # -- errors --

    def error_body(self, status: int, message: str, kind: str = "invalid", extra: dict[str, Any] | None = None,
                   param: str | None = None) -> bytes:
        """The engine's error body (vLLM since v0.10.1: nested, integer ``code``)."""
        return orjson.dumps(
            {"error": {"message": message, "type": _type_name(status), "param": param, "code": status}}
        )

    def request_error(self, exc: RequestError) -> tuple[int, bytes]:
        return exc.status, self.error_body(exc.status, exc.message, exc.kind, exc.extra)

    def not_found(self) -> tuple[int, bytes]:
        """Unknown path (FastAPI's answer)."""
        return 404, b'{"detail":"Not Found"}'

    def method_not_allowed(self) -> tuple[int, bytes]:
        return 405, b'{"detail":"Method Not Allowed"}'

    def loading(self) -> tuple[int, bytes]:
        """An inference request while the model is still loading."""
        return 503, self.error_body(503, "The model is still loading; retry shortly.", "unavailable")

    def unknown_model(self, name: str) -> tuple[int, bytes]:
        return 404, self.error_body(404, f"The model `{name}` does not exist.", "not_found", param="model")

    # -- health, models --

    def health(self, ready: bool) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        """``GET /health``: 200 empty when ready, 503 empty while loading."""
        return (200 if ready else 503), b"", []

    def metrics_loading(self) -> tuple[int, bytes, list[tuple[bytes, bytes]]] | None:
        """The answer to the Prometheus path while the model loads; ``None``: the page as when ready.

        vLLM, TensorRT-LLM and SGLang answer their ``/health`` 503 while not ready
        (engines.md §1.4, §3.4, §4), and nothing says their metrics pages do: they are served.
        """
        return None

    def model_card(self) -> dict[str, Any]:
        """The ``/v1/models`` card; ``owned_by`` is the engine module's (``info.owned_by``).

        Subclasses add their engine's extra fields to this card, so the card's
        common part, ``owned_by`` included, is written once.
        """
        return {"id": self.model, "object": "model", "created": self.created, "owned_by": self.info.owned_by}

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.model_card()]}

    def top_extra(self, job: Job, req: SimRequest | None) -> dict[str, Any]:
        """Extra top-level fields of a whole completion answer."""
        return {}

    def finish_extra(self, job: Job, req: SimRequest) -> dict[str, Any] | None:
        """Extra top-level fields of the streamed event that finishes a choice."""
        return None

    # -- metrics --

    @property
    def metrics_path(self) -> bytes:
        return self.info.metrics_path.encode()

    def metrics_page(self, accept: bytes | None) -> tuple[bytes, bytes]:
        """The Prometheus page and its content type, negotiated from ``Accept``.

        Text format 0.0.4 comes from the precomputed template (:meth:`fast_text`);
        other formats (OpenMetrics) from the ``prometheus_client`` registry.
        """
        encoder, content_type = _negotiate(accept)
        if encoder is generate_latest:
            text = self.fast_text()
            if text is not None:
                return text.encode(), content_type
        return self.registry_page(accept)

    def registry_page(self, accept: bytes | None) -> tuple[bytes, bytes]:
        """The page as ``prometheus_client`` renders it from :meth:`families` (slow)."""
        if self._registry is None:
            self._registry = self._make_registry()
        encoder, content_type = _negotiate(accept)
        return encoder(self._registry), content_type

    def fast_text(self) -> str | None:
        """The text-format page from the template; None: use the registry."""
        if not self._text_built:
            self._text = self._build_text()
            self._text_built = True
        page = self._text
        if page is None:
            return None
        values = self._text_values()
        if values is None:
            return None
        self.stats.flush()
        parts = [page.render(values)]
        parts += [h.render() for h in self._hists]
        if self._with_process:
            try:
                parts.append(process_text())
            except (OSError, ValueError, IndexError):
                return None
        return "".join(parts)

    def _build_text(self) -> TextPage | None:
        """Lay out the page's scalar families (and set ``_hists``); None: no fast text."""
        return None

    def _text_values(self) -> Sequence[float] | None:
        """The values of the template's slots, in order; None: the layout no longer fits."""
        return None

    def _hist_text(self, specs: Sequence[tuple[str, str, str]], labels: Sequence[str], values: Sequence[str],
                   created: bool) -> list[HistText]:
        lab = dict(zip(labels, values, strict=True))
        cr = self.stats.created if created else None
        return [HistText(name, doc, lab, self.stats.hist[kind], cr) for name, doc, kind in specs]

    def _make_registry(self) -> CollectorRegistry:
        reg = CollectorRegistry(auto_describe=False)
        reg.register(_Collector(self))
        return reg

    def families(self) -> Iterable[Metric]:
        """The metric families of one scrape."""
        return ()

    # helpers for families()

    def _hist(self, name: str, doc: str, kind: str, labels: Sequence[str], values: Sequence[str],
              created: bool) -> HistogramMetricFamily:
        self.stats.flush()
        h = self.stats.hist[kind]
        fam = HistogramMetricFamily(name, doc, labels=list(labels))
        cum = h.cumulative()
        buckets = [(floatToGoString(b), float(c)) for b, c in zip(h.bounds, cum, strict=False)]
        buckets.append(("+Inf", float(cum[-1])))
        fam.add_metric(list(values), buckets, h.sum)
        if created:
            fam.samples.append(Sample(name + "_created", dict(zip(labels, values, strict=True)), self.stats.created))
        return fam


class _Collector:
    """Adapts a dialect to ``prometheus_client``'s collector protocol."""

    def __init__(self, dialect: Dialect) -> None:
        self._dialect = dialect

    def collect(self) -> Iterable[Metric]:
        return self._dialect.families()


def _any_equal(given: bytes, keys: Sequence[bytes]) -> bool:
    ok = False
    for k in keys:  # SECURITY: constant time per key, no early exit
        ok |= hmac.compare_digest(given, k)
    return ok


def _gauge(name: str, doc: str, labels: Sequence[str], values: Sequence[str], value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=list(labels))
    g.add_metric(list(values), value)
    return g


def _counter(name: str, doc: str, labels: Sequence[str], values: Sequence[str], value: float,
             created: float | None) -> CounterMetricFamily:
    c = CounterMetricFamily(name, doc, labels=list(labels))
    c.add_metric(list(values), value, created=created)
    return c


# ---------------------------------------------------------------------------
# vLLM


class VllmDialect(Dialect):
    info = vllm.INFO
    finish_on_last_token = True
    stop_reason_field = True
    checks_model = True
    message_extra = {"refusal": None, "annotations": None, "audio": None, "function_call": None,
                     "tool_calls": [], "reasoning_content": None}
    routes = {(b"GET", b"/version"): "version"}

    # Names llmgw.engines.vllm does not define (yet).
    PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"
    PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"
    TPOT = "vllm:request_time_per_output_token_seconds"
    PREFILL_TIME = "vllm:request_prefill_time_seconds"
    DECODE_TIME = "vllm:request_decode_time_seconds"
    INFERENCE_TIME = "vllm:request_inference_time_seconds"
    MAX_TOKENS_HIST = "vllm:request_params_max_tokens"
    N_HIST = "vllm:request_params_n"

    @classmethod
    def buckets_for(cls, cfg: SimConfig) -> dict[str, Sequence[float]]:
        tokens = _one_two_five(cfg.max_model_len)
        return {
            "ttft": _TTFT_BUCKETS, "itl": _TOKEN_LATENCY_BUCKETS, "tpot": _TOKEN_LATENCY_BUCKETS,
            "e2e": _REQUEST_LATENCY_BUCKETS, "queue": _REQUEST_LATENCY_BUCKETS,
            "prefill": _REQUEST_LATENCY_BUCKETS, "decode": _REQUEST_LATENCY_BUCKETS,
            "inference": _REQUEST_LATENCY_BUCKETS, "prompt_tokens": tokens, "generation_tokens": tokens,
            "max_tokens": tokens, "n": (1, 2, 5, 10, 20),
        }

    def needs_key(self, method: bytes, path: bytes) -> bool:
        # vLLM's middleware checks only /v1* and lets OPTIONS through.
        return method != b"OPTIONS" and path.startswith(b"/v1")

    _TOP_EXTRA: ClassVar[dict[str, Any]] = {"service_tier": None, "system_fingerprint": None,
                                            "prompt_logprobs": None, "kv_transfer_params": None}

    def top_extra(self, job: Job, req: SimRequest | None) -> dict[str, Any]:
        return self._TOP_EXTRA

    def model_card(self) -> dict[str, Any]:
        return {
            **super().model_card(),
            "root": self.model, "parent": None, "max_model_len": self.cfg.max_model_len,
            "permission": [{
                "id": "modelperm-00000000000000000000000000000000", "object": "model_permission",
                "created": self.created, "allow_create_engine": False, "allow_sampling": True,
                "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False,
            }],
        }

    def route_version(self, request: Request, now: float) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        return 200, b'{"version":"0.11.0+sim"}', [JSON_CT]

    HISTS: ClassVar[tuple[tuple[str, str, str], ...]] = (
        (vllm.PROMPT_TOKENS_HIST, "Number of prefill tokens processed.", "prompt_tokens"),
        (vllm.GENERATION_TOKENS_HIST, "Number of generation tokens processed.", "generation_tokens"),
        (MAX_TOKENS_HIST, "Histogram of the max_tokens request parameter.", "max_tokens"),
        (N_HIST, "Histogram of the n request parameter.", "n"),
        (vllm.TTFT, "Histogram of time to first token in seconds.", "ttft"),
        (vllm.ITL, "Histogram of inter-token latency in seconds.", "itl"),
        (TPOT, "Histogram of time_per_output_token_seconds per request.", "tpot"),
        (vllm.E2E, "Histogram of e2e request latency in seconds.", "e2e"),
        (vllm.QUEUE_TIME, "Histogram of time spent in WAITING phase for request.", "queue"),
        (INFERENCE_TIME, "Histogram of time spent in RUNNING phase for request.", "inference"),
        (PREFILL_TIME, "Histogram of time spent in PREFILL phase for request.", "prefill"),
        (DECODE_TIME, "Histogram of time spent in DECODE phase for request.", "decode"),
    )

    def _cache_config(self) -> dict[str, str]:
        return {
            "block_size": "16", "cache_dtype": "auto", "enable_prefix_caching": "True",
            "gpu_memory_utilization": "0.9", "num_cpu_blocks": "0",
            "num_gpu_blocks": str(self.sched.kv_tokens // 16), "engine": "0",
        }

    def _make_registry(self) -> CollectorRegistry:
        reg = super()._make_registry()
        # vLLM's single API server uses the default registry, which carries these.
        ProcessCollector(registry=reg)
        PlatformCollector(registry=reg)
        GCCollector(registry=reg)
        return reg

    def families(self) -> Iterable[Metric]:
        sched, st = self.sched, self.stats
        now = sched.now()
        L = (vllm.MODEL_LABEL, vllm.ENGINE_LABEL)
        V = (self.model, "0")
        cr = st.created
        kv = sched.kv_used(now) / sched.kv_tokens
        yield _gauge(vllm.RUNNING, "Number of requests in model execution batches.", L, V, sched.n_running)
        yield _gauge(vllm.WAITING, "Number of requests waiting to be processed.", L, V, sched.n_waiting)
        yield _gauge(vllm.KV_CACHE_USAGE, "KV-cache usage. 1 means 100 percent usage.", L, V, kv)
        info = self._cache_config()
        yield _gauge(vllm.CACHE_CONFIG_INFO, "Information of the LLMEngine CacheConfig", list(info),
                     list(info.values()), 1.0)
        yield _counter(vllm.NUM_PREEMPTIONS, "Cumulative number of preemption from the engine.", L, V, 0, cr)
        yield _counter(vllm.PROMPT_TOKENS, "Number of prefill tokens processed.", L, V, st.prompt_tokens, cr)
        yield _counter(vllm.GENERATION_TOKENS, "Number of generation tokens processed.", L, V,
                       st.generation_tokens + sched.generating(now), cr)
        yield _counter(self.PREFIX_CACHE_QUERIES, "Prefix cache queries, in terms of number of queried tokens.",
                       L, V, st.prompt_tokens, cr)
        yield _counter(self.PREFIX_CACHE_HITS, "Prefix cache hits, in terms of number of cached tokens.",
                       L, V, 0, cr)
        ok = CounterMetricFamily(vllm.REQUEST_SUCCESS, "Count of successfully processed requests.",
                                 labels=[*L, "finished_reason"])
        for reason, count in st.finished.items():
            ok.add_metric([*V, reason], count, created=cr)
        yield ok
        for name, doc, kind in self.HISTS:
            yield self._hist(name, doc, kind, L, V, created=True)

    # The fast text: the layout of families(), then prometheus_client's default collectors.

    def _build_text(self) -> TextPage | None:
        if not process_text_available():
            return None
        L = {vllm.MODEL_LABEL: self.model, vllm.ENGINE_LABEL: "0"}
        cr = self.stats.created
        self._reasons = tuple(self.stats.finished)
        page = TextPage()
        page.gauge(vllm.RUNNING, "Number of requests in model execution batches.", L)
        page.gauge(vllm.WAITING, "Number of requests waiting to be processed.", L)
        page.gauge(vllm.KV_CACHE_USAGE, "KV-cache usage. 1 means 100 percent usage.", L)
        page.gauge(vllm.CACHE_CONFIG_INFO, "Information of the LLMEngine CacheConfig", self._cache_config(), 1.0)
        page.counter(vllm.NUM_PREEMPTIONS, "Cumulative number of preemption from the engine.", [L], cr, [0])
        page.counter(vllm.PROMPT_TOKENS, "Number of prefill tokens processed.", [L], cr)
        page.counter(vllm.GENERATION_TOKENS, "Number of generation tokens processed.", [L], cr)
        page.counter(self.PREFIX_CACHE_QUERIES, "Prefix cache queries, in terms of number of queried tokens.",
                     [L], cr)
        page.counter(self.PREFIX_CACHE_HITS, "Prefix cache hits, in terms of number of cached tokens.", [L], cr,
                     [0])
        page.counter(vllm.REQUEST_SUCCESS, "Count of successfully processed requests.",
                     [{**L, "finished_reason": r} for r in self._reasons], cr)
        self._hists = self._hist_text(self.HISTS, list(L), list(L.values()), created=True)
        self._with_process = True
        return page

    def _text_values(self) -> Sequence[float] | None:
        sched, st = self.sched, self.stats
        finished = st.finished
        if len(finished) != len(self._reasons):
            return None
        now = sched.now()
        running = sched.running
        kv = gen = 0
        for r in running:
            g = r.generated(now)
            gen += g
            kv += r.prompt_tokens + g
        return (len(running), sched.n_waiting, kv / sched.kv_tokens, st.prompt_tokens,
                st.generation_tokens + gen, st.prompt_tokens, *finished.values())


# ---------------------------------------------------------------------------
# llama.cpp


def _g(v: float) -> str:
    # llama-server streams doubles with C++'s default precision: like printf's %g.
    return f"{v:g}"


class LlamaCppDialect(Dialect):
    info = llamacpp.INFO
    sse_content_type = b"text/event-stream"
    role_content = None
    clamp_to_context = True
    echo_model = True
    routes = {
        (b"GET", b"/v1/health"): "health",
        (b"GET", b"/models"): "models",
        (b"GET", b"/slots"): "slots",
        (b"GET", b"/props"): "props",
    }
    PUBLIC = frozenset((b"/health", b"/v1/health", b"/models", b"/v1/models", b"/api/tags", b"/"))
    FINGERPRINT = "b0000-llmgw-sim"

    def _parse_keys(self, key: str | None) -> tuple[bytes, ...]:
        # llama-server takes a comma-separated list of keys.
        return () if key is None else tuple(k.encode() for k in key.split(",") if k)

    def needs_key(self, method: bytes, path: bytes) -> bool:
        return method != b"OPTIONS" and path not in self.PUBLIC

    def key_ok(self, request: Request) -> bool:
        auth = request.authorization
        if auth is not None and auth.startswith(b"Bearer ") and _any_equal(auth[7:], self._keys):
            return True
        x = request.x_api_key
        return x is not None and _any_equal(x, self._keys)

    def unauthorized(self) -> tuple[int, bytes]:
        return 401, self.error_body(401, "Invalid API Key")

    def error_body(self, status: int, message: str, kind: str = "invalid", extra: dict[str, Any] | None = None,
                   param: str | None = None) -> bytes:
        if kind == "context":
            etype = llamacpp.CONTEXT_ERROR_TYPE
        else:
            default = "server_error" if status >= 500 else "invalid_request_error"
            etype = llamacpp.ERROR_TYPES.get(status, default)
            if status == 429:
                etype = "unavailable_error"
        err: dict[str, Any] = {"code": status, "message": message, "type": etype}
        if extra:
            err.update(extra)
        return orjson.dumps({"error": err})

    def not_found(self) -> tuple[int, bytes]:
        return 404, self.error_body(404, "File Not Found")

    def method_not_allowed(self) -> tuple[int, bytes]:
        return self.not_found()

    def loading(self) -> tuple[int, bytes]:
        return 503, self.error_body(503, "Loading model")

    def health(self, ready: bool) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        if ready:
            return 200, b'{"status":"ok"}', [JSON_CT]
        return 503, self.loading()[1], [JSON_CT]

    def metrics_loading(self) -> tuple[int, bytes, list[tuple[bytes, bytes]]] | None:
        # llama-server answers /metrics as /health while it loads its model: 503 "Loading model"
        return 503, self.loading()[1], [JSON_CT]

    def model_card(self) -> dict[str, Any]:
        cfg = self.cfg
        return {
            **super().model_card(),
            "meta": {"vocab_type": 2, "n_vocab": len(WORDS), "n_ctx_train": cfg.max_model_len,
                     "n_embd": cfg.embedding_dim, "n_params": 1_000_000, "size": 2_000_000},
        }

    def models(self) -> dict[str, Any]:
        return {
            "models": [{
                "name": self.model, "model": self.model, "modified_at": "", "size": "", "digest": "",
                "type": "model", "description": "", "tags": [""], "capabilities": ["completion"],
                "parameters": "",
                "details": {"parent_model": "", "format": "gguf", "family": "", "families": [""],
                            "parameter_size": "", "quantization_level": ""},
            }],
            "object": "list",
            "data": [self.model_card()],
        }

    def _timings(self, req: SimRequest | None, n_out: int) -> dict[str, Any]:
        if req is None:
            return {}
        prompt_ms = (req.t_first - req.t_admit) * 1e3
        predicted_ms = max(0.0, (n_out - 1) * req.tpi * 1e3)
        return {
            "prompt_n": req.prompt_tokens, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / req.prompt_tokens,
            "prompt_per_second": req.prompt_tokens / (prompt_ms / 1e3) if prompt_ms > 0 else 0.0,
            "predicted_n": n_out, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / n_out if n_out else 0.0,
            "predicted_per_second": n_out / (predicted_ms / 1e3) if predicted_ms > 0 else 0.0,
        }

    def top_extra(self, job: Job, req: SimRequest | None) -> dict[str, Any]:
        return {"system_fingerprint": self.FINGERPRINT, "timings": self._timings(req, sum(job.n_list))}

    def finish_extra(self, job: Job, req: SimRequest) -> dict[str, Any] | None:
        return {"system_fingerprint": self.FINGERPRINT, "timings": self._timings(req, sum(job.n_list))}

    def route_slots(self, request: Request, now: float) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        sched = self.sched
        running = sorted(sched.running, key=lambda r: r.t_admit)
        if b"fail_on_no_slot" in request.target and len(running) >= sched.slots:
            return 503, self.error_body(503, "no slot available"), [JSON_CT]
        out = []
        for i in range(sched.slots):
            r = running[i] if i < len(running) else None
            out.append({
                "id": i, "id_task": i if r is not None else -1, "n_ctx": self.cfg.max_model_len,
                "speculative": False, "is_processing": r is not None,
                "params": {"n_predict": r.max_tokens if r is not None else -1},
                "next_token": [{
                    "has_next_token": r is not None, "has_new_line": False,
                    "n_remain": (r.n_max - r.steps(now)) if r is not None else -1,
                    "n_decoded": r.generated(now) if r is not None else 0,
                }],
            })
        return 200, orjson.dumps(out), [JSON_CT]

    def route_props(self, request: Request, now: float) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        body = {
            "default_generation_settings": {"n_ctx": self.cfg.max_model_len, "params": {"n_predict": -1}},
            "total_slots": self.sched.slots,
            "model_path": f"/models/{self.model}.gguf",
            "chat_template": "",
            "modalities": {"vision": False, "audio": False},
            "build_info": self.FINGERPRINT,
        }
        return 200, orjson.dumps(body), [JSON_CT]

    def metrics_page(self, accept: bytes | None) -> tuple[bytes, bytes]:
        st, sched = self.stats, self.sched
        p_tok, p_sec = st.bucket_prompt_tokens, st.bucket_prompt_seconds
        g_tok, g_sec = st.bucket_gen_tokens, st.bucket_decode_seconds
        # llama-server resets its throughput window on every /metrics read.
        st.bucket_prompt_tokens = 0
        st.bucket_prompt_seconds = 0.0
        st.bucket_gen_tokens = 0
        st.bucket_decode_seconds = 0.0
        finished_gen = st.generation_tokens
        rows = (
            ("counter", llamacpp.PROMPT_TOKENS_TOTAL, "Number of prompt tokens processed.", st.prompt_tokens),
            ("counter", llamacpp.PROMPT_SECONDS_TOTAL, "Prompt process time", st.prompt_seconds),
            ("counter", llamacpp.TOKENS_PREDICTED_TOTAL, "Number of generation tokens processed.", finished_gen),
            ("counter", llamacpp.TOKENS_PREDICTED_SECONDS_TOTAL, "Predict process time", st.decode_seconds),
            ("counter", llamacpp.N_DECODE_TOTAL, "Total number of llama_decode() calls", st.n_decode),
            ("counter", llamacpp.N_TOKENS_MAX, "Largest observed n_tokens.", st.n_tokens_max),
            ("gauge", llamacpp.N_BUSY_SLOTS_PER_DECODE, "Average number of busy slots per llama_decode() call",
             st.busy_at_admit / st.admitted if st.admitted else 0.0),
            ("gauge", llamacpp.PROMPT_TOKENS_SECONDS, "Average prompt throughput in tokens/s.",
             p_tok / p_sec if p_sec > 0 else 0.0),
            ("gauge", llamacpp.PREDICTED_TOKENS_SECONDS, "Average generation throughput in tokens/s.",
             g_tok / g_sec if g_sec > 0 else 0.0),
            ("gauge", llamacpp.RUNNING, "Number of requests processing.", sched.n_running),
            ("gauge", llamacpp.WAITING, "Number of requests deferred.", sched.n_waiting),
        )
        out = []
        for mtype, name, doc, value in rows:
            out.append(f"# HELP {name} {doc}\n# TYPE {name} {mtype}\n{name} {_g(value)}\n")
        return "".join(out).encode(), b"text/plain; version=0.0.4"


# ---------------------------------------------------------------------------
# TensorRT-LLM


class TrtllmDialect(Dialect):
    info = trtllm.INFO
    usage_default_with_options = True
    routes = {
        (b"GET", b"/metrics"): "iteration_stats",
        (b"GET", b"/health_generate"): "health",
        (b"GET", b"/version"): "version",
    }
    LABELS = (trtllm.MODEL_LABEL, "engine_type")
    VALUES = ("undefined", "undefined")  # hard-coded upstream
    TOKENS_PER_BLOCK = 32
    # Names llmgw.engines.trtllm does not define (yet).
    TPOT = "trtllm_time_per_output_token_seconds"
    PREFILL_TIME = "trtllm_request_prefill_time_seconds"
    DECODE_TIME = "trtllm_request_decode_time_seconds"
    KV_MAX_BLOCKS = "trtllm_kv_cache_max_blocks"
    KV_FREE_BLOCKS = "trtllm_kv_cache_free_blocks"
    KV_USED_BLOCKS = "trtllm_kv_cache_used_blocks"
    KV_TOKENS_PER_BLOCK = "trtllm_kv_cache_tokens_per_block"
    KV_HIT_RATE = "trtllm_kv_cache_hit_rate"
    REQUEST_ERROR = "trtllm_request_error"
    HISTS: ClassVar[tuple[tuple[str, str, str], ...]] = (
        (trtllm.E2E, "Histogram of end to end request latency in seconds.", "e2e"),
        (trtllm.TTFT, "Histogram of time to first token in seconds.", "ttft"),
        (TPOT, "Histogram of time per output token in seconds.", "tpot"),
        (trtllm.QUEUE_TIME, "Histogram of time spent in WAITING phase for request.", "queue"),
        (PREFILL_TIME, "Histogram of time spent in PREFILL phase for request.", "prefill"),
        (DECODE_TIME, "Histogram of time spent in DECODE phase for request.", "decode"),
    )

    def __init__(self, cfg: SimConfig, sched: Scheduler, stats: Stats, created: int) -> None:
        super().__init__(cfg, sched, stats, created)
        self._last_iteration = -1

    @classmethod
    def buckets_for(cls, cfg: SimConfig) -> dict[str, Sequence[float]]:
        return {"ttft": _TTFT_BUCKETS, "tpot": _TOKEN_LATENCY_BUCKETS, "e2e": _REQUEST_LATENCY_BUCKETS,
                "queue": _REQUEST_LATENCY_BUCKETS, "prefill": _REQUEST_LATENCY_BUCKETS,
                "decode": _REQUEST_LATENCY_BUCKETS}

    def _parse_keys(self, key: str | None) -> tuple[bytes, ...]:
        return ()  # trtllm-serve has no API-key support; the engine warns at start

    def error_body(self, status: int, message: str, kind: str = "invalid", extra: dict[str, Any] | None = None,
                   param: str | None = None) -> bytes:
        if kind == "invalid" and status == 400:
            # Request validation failures: {"error": str(exc)}.
            return orjson.dumps({"error": message})
        return orjson.dumps(
            {"object": "error", "message": message, "type": _type_name(status), "param": param, "code": status}
        )

    def health(self, ready: bool) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        if ready:
            return 200, b"", []
        return 503, b"LLM is unavailable. Please check the server logs for more details.", [TEXT_CT]

    def route_version(self, request: Request, now: float) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        return 200, b'{"version":"1.1.0+sim"}', [JSON_CT]

    def _blocks(self, now: float) -> tuple[int, int]:
        tpb = self.TOKENS_PER_BLOCK
        used = sum(-(-(r.prompt_tokens + r.generated(now)) // tpb) for r in self.sched.running)
        return self.sched.kv_tokens // tpb, used

    def route_iteration_stats(self, request: Request, now: float) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        # trtllm-serve's /metrics is a JSON queue of iteration stats, emptied by each
        # read; the simulation queues one snapshot whenever something happened.
        st, sched = self.stats, self.sched
        if st.iteration == self._last_iteration:
            return 200, b"[]", [JSON_CT]
        self._last_iteration = st.iteration
        max_blocks, used = self._blocks(now)
        snap = {
            "gpuMemUsage": 0, "iter": st.iteration, "iterLatencyMS": 0.0,
            "numActiveRequests": sched.n_running, "numQueuedRequests": sched.n_waiting,
            "maxNumActiveRequests": sched.slots, "numCompletedRequests": sum(st.finished.values()),
            "kvCacheStats": {"maxNumBlocks": max_blocks, "freeNumBlocks": max_blocks - used,
                             "usedNumBlocks": used, "tokensPerBlock": self.TOKENS_PER_BLOCK,
                             "allocTotalBlocks": used, "allocNewBlocks": used, "reusedBlocks": 0,
                             "missedBlocks": 0, "cacheHitRate": 0.0},
        }
        return 200, orjson.dumps([snap]), [JSON_CT]

    def _make_registry(self) -> CollectorRegistry:
        reg = super()._make_registry()
        ProcessCollector(registry=reg)
        PlatformCollector(registry=reg)
        GCCollector(registry=reg)
        return reg

    def families(self) -> Iterable[Metric]:
        sched, st = self.sched, self.stats
        now = sched.now()
        L, V, cr = self.LABELS, self.VALUES, st.created
        max_blocks, used = self._blocks(now)
        yield _gauge(trtllm.WAITING, "Number of requests waiting to be scheduled.", L, V, sched.n_waiting)
        yield _gauge(trtllm.RUNNING, "Number of requests currently running.", L, V, sched.n_running)
        yield _gauge(trtllm.KV_CACHE_USAGE, "KV cache utilization (used blocks / max blocks).", L, V,
                     sched.kv_used(now) / sched.kv_tokens)
        yield _gauge(self.KV_MAX_BLOCKS, "Maximum number of KV cache blocks.", L, V, max_blocks)
        yield _gauge(self.KV_FREE_BLOCKS, "Number of free KV cache blocks.", L, V, max_blocks - used)
        yield _gauge(self.KV_USED_BLOCKS, "Number of used KV cache blocks.", L, V, used)
        yield _gauge(self.KV_TOKENS_PER_BLOCK, "Number of tokens per KV cache block.", L, V, self.TOKENS_PER_BLOCK)
        yield _gauge(self.KV_HIT_RATE, "KV cache hit rate.", L, V, 0.0)
        ok = CounterMetricFamily(trtllm.REQUEST_SUCCESS, "Count of successfully processed requests.",
                                 labels=[*L, "finished_reason"])
        for reason, count in st.finished.items():
            ok.add_metric([*V, reason], count, created=cr)
        yield ok
        yield _counter(self.REQUEST_ERROR, "Count of failed requests.", L, V, st.errors, cr)
        yield _counter(trtllm.PROMPT_TOKENS, "Number of prefill tokens processed.", L, V, st.prompt_tokens, cr)
        yield _counter(trtllm.GENERATION_TOKENS, "Number of generation tokens processed.", L, V,
                       st.generation_tokens + sched.generating(now), cr)
        for name, doc, kind in self.HISTS:
            yield self._hist(name, doc, kind, L, V, created=True)

    def _build_text(self) -> TextPage | None:
        if not process_text_available():
            return None
        L = dict(zip(self.LABELS, self.VALUES, strict=True))
        cr = self.stats.created
        self._reasons = tuple(self.stats.finished)
        page = TextPage()
        page.gauge(trtllm.WAITING, "Number of requests waiting to be scheduled.", L)
        page.gauge(trtllm.RUNNING, "Number of requests currently running.", L)
        page.gauge(trtllm.KV_CACHE_USAGE, "KV cache utilization (used blocks / max blocks).", L)
        page.gauge(self.KV_MAX_BLOCKS, "Maximum number of KV cache blocks.", L)
        page.gauge(self.KV_FREE_BLOCKS, "Number of free KV cache blocks.", L)
        page.gauge(self.KV_USED_BLOCKS, "Number of used KV cache blocks.", L)
        page.gauge(self.KV_TOKENS_PER_BLOCK, "Number of tokens per KV cache block.", L, self.TOKENS_PER_BLOCK)
        page.gauge(self.KV_HIT_RATE, "KV cache hit rate.", L, 0.0)
        page.counter(trtllm.REQUEST_SUCCESS, "Count of successfully processed requests.",
                     [{**L, "finished_reason": r} for r in self._reasons], cr)
        page.counter(self.REQUEST_ERROR, "Count of failed requests.", [L], cr)
        page.counter(trtllm.PROMPT_TOKENS, "Number of prefill tokens processed.", [L], cr)
        page.counter(trtllm.GENERATION_TOKENS, "Number of generation tokens processed.", [L], cr)
        self._hists = self._hist_text(self.HISTS, self.LABELS, self.VALUES, created=True)
        self._with_process = True
        return page

    def _text_values(self) -> Sequence[float] | None:
        sched, st = self.sched, self.stats
        finished = st.finished
        if len(finished) != len(self._reasons):
            return None
        now = sched.now()
        tpb = self.TOKENS_PER_BLOCK
        kv = gen = used = 0
        for r in sched.running:
            g = r.generated(now)
            gen += g
            kv += r.prompt_tokens + g
            used += -(-(r.prompt_tokens + g) // tpb)
        max_blocks = sched.kv_tokens // tpb
        return (sched.n_waiting, len(sched.running), kv / sched.kv_tokens, max_blocks, max_blocks - used, used,
                *finished.values(), st.errors, st.prompt_tokens, st.generation_tokens + gen)


# ---------------------------------------------------------------------------
# SGLang


class SglangDialect(Dialect):
    info = sglang.INFO
    choice_extra = {"matched_stop": None}
    routes = {
        (b"GET", b"/health_generate"): "health",
        (b"GET", b"/get_model_info"): "model_info",
    }
    ITL = "sglang:inter_token_latency_seconds"
    HISTS: ClassVar[tuple[tuple[str, str, str], ...]] = (
        (sglang.TTFT, "Histogram of time to first token in seconds.", "ttft"),
        (ITL, "Histogram of inter-token latency in seconds.", "itl"),
        (sglang.E2E, "Histogram of End-to-end request latency in seconds", "e2e"),
    )

    @classmethod
    def buckets_for(cls, cfg: SimConfig) -> dict[str, Sequence[float]]:
        return {"ttft": _SGL_TTFT_BUCKETS, "itl": _SGL_ITL_BUCKETS, "e2e": _SGL_E2E_BUCKETS}

    def needs_key(self, method: bytes, path: bytes) -> bool:
        return not (method == b"OPTIONS" or path.startswith(b"/health") or path.startswith(b"/metrics"))

    def error_body(self, status: int, message: str, kind: str = "invalid", extra: dict[str, Any] | None = None,
                   param: str | None = None) -> bytes:
        return orjson.dumps(
            {"object": "error", "message": message, "type": _type_name(status), "param": param, "code": status}
        )

    def model_card(self) -> dict[str, Any]:
        return {**super().model_card(), "root": self.model, "max_model_len": self.cfg.max_model_len}

    def route_model_info(self, request: Request, now: float) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        body = {"model_path": self.model, "tokenizer_path": self.model, "is_generation": True}
        return 200, orjson.dumps(body), [JSON_CT]

    def families(self) -> Iterable[Metric]:
        # SGLang runs prometheus_client in multiprocess mode: no *_created series.
        sched, st = self.sched, self.stats
        now = sched.now()
        GL = (sglang.MODEL_LABEL, "engine_type", "tp_rank", "pp_rank")
        GV = (self.model, "unified", "0", "0")
        TL = (sglang.MODEL_LABEL, "engine_type")
        TV = (self.model, "unified")
        used = sched.kv_used(now)
        yield _gauge(sglang.RUNNING, "The number of running requests.", GL, GV, sched.n_running)
        yield _gauge(sglang.WAITING, "The number of requests in the waiting queue.", GL, GV, sched.n_waiting)
        yield _gauge(sglang.NUM_USED_TOKENS, "The number of used tokens.", GL, GV, used)
        yield _gauge(sglang.KV_CACHE_USAGE, "The token usage.", GL, GV, used / sched.kv_tokens)
        yield _gauge(sglang.MAX_TOTAL_NUM_TOKENS, "Maximum total number of tokens in the KV cache pool.", GL, GV,
                     sched.kv_tokens)
        yield _gauge(sglang.GEN_THROUGHPUT, "The generation throughput (token/s).", GL, GV,
                     sum(1.0 / r.tpi for r in sched.running if r.tpi > 0 and r.t_first <= now))
        yield _gauge(sglang.CACHE_HIT_RATE, "The prefix cache hit rate.", GL, GV, 0.0)
        yield _counter(sglang.PROMPT_TOKENS, "Number of prefill tokens processed.", TL, TV, st.prompt_tokens, None)
        yield _counter(sglang.GENERATION_TOKENS, "Number of generation tokens processed.", TL, TV,
                       st.generation_tokens + sched.generating(now), None)
        yield _counter(sglang.NUM_REQUESTS, "Number of requests processed.", TL, TV, sum(st.finished.values()), None)
        for name, doc, kind in self.HISTS:
            yield self._hist(name, doc, kind, TL, TV, created=False)

    def _build_text(self) -> TextPage | None:
        GL = {sglang.MODEL_LABEL: self.model, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0"}
        TL = {sglang.MODEL_LABEL: self.model, "engine_type": "unified"}
        page = TextPage()
        page.gauge(sglang.RUNNING, "The number of running requests.", GL)
        page.gauge(sglang.WAITING, "The number of requests in the waiting queue.", GL)
        page.gauge(sglang.NUM_USED_TOKENS, "The number of used tokens.", GL)
        page.gauge(sglang.KV_CACHE_USAGE, "The token usage.", GL)
        page.gauge(sglang.MAX_TOTAL_NUM_TOKENS, "Maximum total number of tokens in the KV cache pool.", GL,
                   self.sched.kv_tokens)
        page.gauge(sglang.GEN_THROUGHPUT, "The generation throughput (token/s).", GL)
        page.gauge(sglang.CACHE_HIT_RATE, "The prefix cache hit rate.", GL, 0.0)
        page.counter(sglang.PROMPT_TOKENS, "Number of prefill tokens processed.", [TL], None)
        page.counter(sglang.GENERATION_TOKENS, "Number of generation tokens processed.", [TL], None)
        page.counter(sglang.NUM_REQUESTS, "Number of requests processed.", [TL], None)
        self._hists = self._hist_text(self.HISTS, list(TL), list(TL.values()), created=False)
        return page

    def _text_values(self) -> Sequence[float] | None:
        sched, st = self.sched, self.stats
        now = sched.now()
        used = gen = 0
        for r in sched.running:
            g = r.generated(now)
            gen += g
            used += r.prompt_tokens + g
        # Summed in the running set's order, as families() does (float sums depend on order).
        throughput = sum(1.0 / r.tpi for r in sched.running if r.tpi > 0 and r.t_first <= now)
        return (len(sched.running), sched.n_waiting, used, used / sched.kv_tokens, throughput, st.prompt_tokens,
                st.generation_tokens + gen, sum(st.finished.values()))


DIALECTS: dict[str, type[Dialect]] = {
    "vllm": VllmDialect,
    "llamacpp": LlamaCppDialect,
    "trtllm": TrtllmDialect,
    "sglang": SglangDialect,
}


def make_dialect(cfg: SimConfig, sched: Scheduler, stats: Stats, created: int) -> Dialect:
    return DIALECTS[cfg.engine](cfg, sched, stats, created)
