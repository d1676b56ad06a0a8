"""The simulated engine's scheduler: slots, a bounded waiting queue, a KV budget.

Time is the event loop's clock (``loop.time()``); nothing here sleeps or blocks.
A request's timeline is fixed when it is admitted: first token at
``t_admit + ttft``, token ``k`` of each choice ``k * tpi`` later. Everything the
metrics report (tokens generated so far, KV in use) is computed from that
timeline at read time, so a scrape sees the exact simulated state without a
timer per token.
"""

from __future__ import annotations

import asyncio
import collections
import time
from bisect import bisect_left
from collections.abc import Iterable, Sequence

__all__ = [
    "DONE",
    "FINISH_REASONS",
    "RUNNING",
    "WAITING",
    "Hist",
    "QueueFullError",
    "Scheduler",
    "SimRequest",
    "Stats",
]

# SimRequest.state
NEW = 0
WAITING = 1
RUNNING = 2
DONE = 3

FINISH_REASONS = ("stop", "length", "abort")


class QueueFullError(Exception):
    """Every slot is busy and the waiting queue is at ``max_queue``."""


class SimRequest:
    """One generation request (all its choices) as the scheduler sees it.

    Attributes:
        prompt_tokens: prompt tokens (all prompts of a batched completion).
        n_list: output tokens of each choice, fixed in advance (max_tokens or an
            earlier stop).
        reasons: finish reason of each choice (``stop`` or ``length``).
        max_tokens: the request's ``max_tokens`` (for histograms).
        reserve: KV tokens reserved while running: prompt plus max_tokens per choice.
        ttft / tpi: seconds to the first token after admission, seconds per token after.
        cap: tokens per choice the engine will produce at most (lowered by a hang).
    """

    __slots__ = (
        "cap",
        "fut",
        "max_tokens",
        "n_list",
        "n_max",
        "n_total",
        "prompt_tokens",
        "reasons",
        "reserve",
        "state",
        "t_admit",
        "t_arrive",
        "t_first",
        "tpi",
        "ttft",
    )

    def __init__(
        self,
        prompt_tokens: int,
        n_list: Sequence[int],
        reasons: Sequence[str],
        max_tokens: int,
        ttft: float,
        tpi: float,
    ) -> None:
        self.prompt_tokens = prompt_tokens
        self.n_list = tuple(n_list)
        self.reasons = tuple(reasons)
        self.n_max = max(self.n_list)
        self.n_total = sum(self.n_list)
        self.max_tokens = max_tokens
        self.reserve = prompt_tokens + max_tokens * len(self.n_list)
        self.ttft = ttft
        self.tpi = tpi
        self.cap = self.n_max
        self.state = NEW
        self.fut: asyncio.Future[None] | None = None
        self.t_arrive = 0.0
        self.t_admit = 0.0
        self.t_first = 0.0

    @property
    def t_end(self) -> float:
        """When the last token of the longest choice is due."""
        return self.t_first + (self.n_max - 1) * self.tpi

    def steps(self, now: float) -> int:
        """Tokens per choice produced by ``now`` (0 before the first token)."""
        if now < self.t_first:
            return 0
        if self.tpi <= 0:
            return self.cap
        k = 1 + int((now - self.t_first) / self.tpi)
        return k if k < self.cap else self.cap

    def generated(self, now: float) -> int:
        """Output tokens of all choices produced by ``now``."""
        k = self.steps(now)
        if k >= self.n_max:
            return self.n_total
        if len(self.n_list) == 1:
            return k
        return sum(n if n < k else k for n in self.n_list)


class Hist:
    """A Prometheus histogram's state: per-bucket counts (last is ``+Inf``) and a sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Iterable[float]) -> None:
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float, n: int = 1) -> None:
        """Count ``value`` ``n`` times (``le`` semantics: a value equal to a bound is in it)."""
        self.counts[bisect_left(self.bounds, value)] += n
        self.sum += value * n

    def cumulative(self) -> list[int]:
        """Cumulative counts, one per bound then ``+Inf``."""
        out = []
        acc = 0
        for c in self.counts:
            acc += c
            out.append(acc)
        return out

    @property
    def count(self) -> int:
        return sum(self.counts)


class Stats:
    """What the simulation did, cumulative since start.

    Histograms exist for the kinds the dialect asks for (``hist``), by name:
    ``ttft``, ``itl``, ``tpot``, ``e2e``, ``queue``, ``prefill``, ``decode``,
    ``inference``, ``prompt_tokens``, ``generation_tokens``, ``max_tokens``, ``n``.
    """

    # Columns of a pending observation row (see _observe_finished).
    _COLUMNS = ("ttft", "e2e", "queue", "prefill", "decode", "inference", "prompt_tokens",
                "generation_tokens", "max_tokens", "n", "tpot", "itl")
    _FLUSH_AT = 4096

    def __init__(self, hist_buckets: dict[str, Sequence[float]]) -> None:
        self.created = time.time()
        self.hist = {k: Hist(b) for k, b in hist_buckets.items()}
        # PERF: finished requests append one row here; rows are binned into the
        # histograms in bulk (at a scrape, or every _FLUSH_AT rows), which costs a
        # tenth of twelve observe() calls per request.
        self.pending: list[tuple[float, ...]] = []
        self._columns = [(i, self.hist[k]) for i, k in enumerate(self._COLUMNS) if k in self.hist]
        self.finished = dict.fromkeys(FINISH_REASONS, 0)
        self.prompt_tokens = 0  # counted when a request is admitted (prefill starts)
        self.generation_tokens = 0  # of finished and aborted requests
        self.requests = 0  # inference requests received
        self.rejected = 0  # queue full
        self.errors = 0  # injected errors
        self.cuts = 0
        self.hangs = 0
        self.drops = 0
        self.embeddings = 0
        # llama.cpp-style accumulators
        self.prompt_seconds = 0.0
        self.decode_seconds = 0.0
        self.n_decode = 0
        self.n_tokens_max = 0
        self.busy_at_admit = 0  # sum of running requests seen by each admission
        self.admitted = 0
        # since the last llama.cpp /metrics read (its throughput gauges reset then)
        self.bucket_prompt_tokens = 0
        self.bucket_prompt_seconds = 0.0
        self.bucket_gen_tokens = 0
        self.bucket_decode_seconds = 0.0
        # activity marker for TensorRT-LLM's JSON /metrics queue
        self.iteration = 0

    def flush(self) -> None:
        """Bin the pending rows into the histograms (before reading them)."""
        rows = self.pending
        if not rows:
            return
        self.pending = []
        for col, h in self._columns:
            counts, bounds = h.counts, h.bounds
            total = 0.0
            if col == 11:  # itl: (value, count) per row
                for row in rows:
                    v, k = row[11], int(row[12])
                    if k:
                        counts[bisect_left(bounds, v)] += k
                        total += v * k
            else:
                for row in rows:
                    v = row[col]
                    if v >= 0:  # -1: no value (tpot of a one-token answer)
                        counts[bisect_left(bounds, v)] += 1
                        total += v
            h.sum += total


class Scheduler:
    """Slots, the waiting queue and the KV budget of one engine.

    Args:
        slots: requests running at once.
        max_queue: requests allowed to wait (-1: no limit).
        kv_tokens: KV capacity; the admitted requests' reservations must fit in it
            (a request alone always fits: the config guarantees it).
        stats: where finished requests are counted.
    """

    def __init__(self, slots: int, max_queue: int, kv_tokens: int, stats: Stats) -> None:
        self.slots = slots
        self.max_queue = max_queue
        self.kv_tokens = kv_tokens
        self.stats = stats
        self.running: set[SimRequest] = set()
        self.waiting: collections.deque[SimRequest] = collections.deque()
        self.kv_reserved = 0
        self.loop: asyncio.AbstractEventLoop | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Use ``loop``'s clock and futures (called when the engine starts)."""
        self.loop = loop

    def now(self) -> float:
        loop = self.loop
        return loop.time() if loop is not None else time.monotonic()

    # -- state --

    @property
    def n_running(self) -> int:
        return len(self.running)

    @property
    def n_waiting(self) -> int:
        return len(self.waiting)

    def kv_used(self, now: float | None = None) -> int:
        """KV tokens in use: each running request's prompt plus what it generated so far."""
        if now is None:
            now = self.now()
        return sum(r.prompt_tokens + r.generated(now) for r in self.running)

    def generating(self, now: float) -> int:
        """Output tokens produced so far by the running requests."""
        return sum(r.generated(now) for r in self.running)

    # -- transitions --

    def submit(self, req: SimRequest) -> bool:
        """Admit ``req`` now (True) or queue it (False: await ``req.fut``).

        Raises:
            QueueFullError: no slot and no room in the queue.
        """
        now = self.now()
        req.t_arrive = now
        if not self.waiting and self._fits(req):
            self._admit(req, now)
            return True
        if 0 <= self.max_queue <= len(self.waiting):
            self.stats.rejected += 1
            raise QueueFullError
        assert self.loop is not None
        req.fut = self.loop.create_future()
        req.state = WAITING
        self.waiting.append(req)
        self.stats.iteration += 1
        return False

    def finish(self, req: SimRequest, reason: str | None = None) -> None:
        """``req`` is over: finished (``reason`` None: its own) or aborted (``"abort"``).

        Idempotent; frees its slot or queue place and admits waiting requests.
        """
        state = req.state
        if state == DONE:
            return
        req.state = DONE
        now = self.now()
        st = self.stats
        st.iteration += 1
        if state == WAITING:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
            st.finished["abort"] += 1
            return
        if state != RUNNING:
            st.finished["abort"] += 1
            return
        self.running.discard(req)
        self.kv_reserved -= req.reserve
        if reason == "abort":
            gen = req.generated(now)
            st.finished["abort"] += 1
        else:
            gen = req.n_total
            st.finished[req.reasons[0] if reason is None else reason] += 1
            self._observe_finished(req, now, gen)
        st.generation_tokens += gen
        prefill = min(now, req.t_first) - req.t_admit
        decode = max(0.0, now - req.t_first)
        st.prompt_seconds += prefill
        st.decode_seconds += decode
        st.bucket_prompt_seconds += prefill
        st.bucket_gen_tokens += gen
        st.bucket_decode_seconds += decode
        st.n_decode += req.steps(now)
        ctx = req.prompt_tokens + gen
        if ctx > st.n_tokens_max:
            st.n_tokens_max = ctx
        if self.waiting:
            self._pump(now)

    def _observe_finished(self, req: SimRequest, now: float, gen: int) -> None:
        st = self.stats
        if not st._columns:
            return
        decode = now - req.t_first
        if decode < 0:
            decode = 0.0
        nseq = len(req.n_list)
        st.pending.append((
            req.t_first - req.t_arrive,  # ttft
            now - req.t_arrive,  # e2e
            req.t_admit - req.t_arrive,  # queue
            req.t_first - req.t_admit,  # prefill
            decode,
            now - req.t_admit,  # inference
            req.prompt_tokens,
            gen,
            req.max_tokens,
            nseq,
            decode / (req.n_max - 1) if req.n_max > 1 else -1.0,  # tpot
            # One inter-token interval per token after the first, all equal here.
            req.tpi,
            gen - nseq if gen > nseq else 0,
        ))
        if len(st.pending) >= st._FLUSH_AT:
            st.flush()

    def _fits(self, req: SimRequest) -> bool:
        if len(self.running) >= self.slots:
            return False
        return not self.running or self.kv_reserved + req.reserve <= self.kv_tokens

    def _admit(self, req: SimRequest, now: float) -> None:
        st = self.stats
        st.busy_at_admit += len(self.running) + 1
        st.admitted += 1
        st.iteration += 1
        self.running.add(req)
        self.kv_reserved += req.reserve
        req.state = RUNNING
        req.t_admit = now
        req.t_first = now + req.ttft
        st.prompt_tokens += req.prompt_tokens
        st.bucket_prompt_tokens += req.prompt_tokens

    def _pump(self, now: float) -> None:
        waiting = self.waiting
        while waiting and self._fits(waiting[0]):
            req = waiting.popleft()
            self._admit(req, now)
            fut = req.fut
            if fut is not None and not fut.done():
                fut.set_result(None)
