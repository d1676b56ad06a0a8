"""Routing simulation: time to first token under each routing strategy, on a virtual clock.

A discrete-event simulation (``heapq``; no sleeping, no sockets) of a heterogeneous
fleet of engine replicas behind 1 or N routers, each router using llmgw's own
:class:`~llmgw._fast.score.Picker` and :class:`~llmgw._fast.score.EndpointState`
(compiled, or the pure twin with ``--impl py``). Deterministic for a given
``--seed``: the workload is generated once and replayed for every strategy.

The fleet (``FLEETS``, ``--fleet``)
    ``mixed`` (default), 16 replicas: 13 ordinary ones (speed 1, 8 slots), 2 faster ones (speed 1.5, 12
    slots) and one 4x slower one (speed 0.25, 8 slots). A replica runs up to
    ``slots`` requests at once and queues the rest FIFO. A request's prefill takes
    ``prompt * PREFILL_S`` seconds, slowed by ``PREFILL_INTERFERENCE`` per request
    already running (prefill shares the batch), and its decode ``output * DECODE_S``
    seconds, both divided by the replica's speed. Time to first token (TTFT) is the
    wait in the replica's queue plus the prefill. The KV-cache gauge is the tokens
    reserved by running requests over ``slots * KV_TOKENS_PER_SLOT``.

Prefix caches
    Each replica keeps an LRU of token blocks (``BLOCK_TOKENS`` = 64 tokens each, as
    vLLM's prefix caching and SGLang's radix cache keep blocks) holding what its KV
    capacity holds: ``slots * KV_TOKENS_PER_SLOT`` tokens. A request's prefill costs
    only the tokens after the longest cached prefix of its prompt (at most all but
    one token); its prompt's blocks are cached when it starts, and those of its
    prompt plus its answer (the next turn's prefix) when it ends. A block is named
    by the hash of its content and of every block before it, so equal names mean
    equal prefixes. The cache is apart from the running requests' KV (the KV gauge).

The workloads (``--workload``)
    Arrivals are bursty: a two-state Markov-modulated Poisson process (calm periods
    of mean 20 s at 0.9x the mean rate, bursts of mean 5 s at 1.4x: above the fleet's
    capacity at 85 % load, so queues build and must be steered around). The mean
    rate is ``--load`` (default 0.85) times the fleet's capacity (sum of slots x
    speed / mean service time, without any cache).

    ``chat`` (default; the figures of docs/routing.md §7): prompts with no reuse,
    70 % short chat turns (lognormal, median ~250 tokens), 30 % long RAG-style
    prompts (median ~2,500 tokens); output lengths lognormal (median ~150 tokens,
    up to 1,500).
    ``multiturn``: conversations of 3-10 turns (uniform). Each starts with one of
    ``SYSTEM_PROMPTS`` = 8 system prompts (200-800 tokens) and a user message
    (lognormal, median 60 tokens); each next turn's prompt is the previous prompt,
    its answer (lognormal, median 150 tokens, up to 600) and a new user message,
    sent a think time (exponential, mean ``THINK_S`` = 3 s) after the answer ended.
    Session starts follow the arrival process; with ``--session-ids`` each request
    also carries its conversation's session key (``prompt_cache_key``).
    ``shared-prefix``: single requests, each one of ``--shared-prompts`` (32) system
    prompts of 1-4 k tokens (picked uniformly) before a short question (median 50
    tokens); answers median 100 tokens. 32 such prompts (80 k tokens) are more than
    one replica's cache holds (32 k tokens on 8 slots) and less than the fleet's: with
    only a handful (``--shared-prompts 6``), every replica keeps them all and where a
    request goes hardly matters.
    ``unique``: no reuse, all prompts long (lognormal, median 1,500 tokens, 1-4 k
    mostly): where misplaced affinity would cost the most.

    The routers see what the gateway sees: the prompt's block chain (at most
    ``ROUTER_BLOCKS`` = 64 blocks; 64 tokens ~ the gateway's 256-byte blocks) and
    the session key, given to ``Picker.pick_prefix`` as the gateway gives them.

The routers
    Each request arrives at one router chosen at random. A router sees only its own
    dispatches and completions, plus a scrape of every replica every
    ``--scrape-interval`` (100 ms, at a random phase per router) that reaches it
    10-30 ms after it was taken (``--scrape-delay``; so numbers between scrapes are stale-ish, and the
    requests the other routers sent meanwhile are invisible to it). With ``prefix``,
    the routers share conversation routes as the gateway does (``routing.prefix.share``,
    llmgw.fleet.share): the pick of each turn that has a session or follows an earlier
    one reaches the other routers' pickers (``Picker.learn``) ``--share`` seconds later
    (0.15: a 100 ms flush and the control plane's relay; ``--share 0``: routers that
    share nothing, as routers without a control plane). ``--oracle``
    adds ``score*``: the same picker given an exact scrape before every pick, which
    shows what staleness costs.

The strategies (``--strategies``)
    ``round_robin``, ``least_inflight``, ``score`` and ``prefix`` are llmgw's own
    picker. ``oracle`` knows every replica's cache and queue exactly and sends each
    request where its first token comes soonest (its queue replayed with the
    requests ahead, then its uncached prefill): the bound to compare against. It also
    knows how long every answer will be, running and queued, which no router can.
    ``oracle_now`` knows all of the present as exactly (every cache, queue and running
    request, and how far each answer has got) but not the answers' lengths: it expects
    a running answer that has reached ``o`` tokens to go on for the mean of what the
    workload's answers longer than ``o`` have left, and a queued one to be of the mean
    length. The difference between the two is what knowing the future is worth.

Output: TTFT p50/p99, goodput (requests per second with TTFT within ``--slo``),
the cache hit ratio (prompt tokens served from a cache over all prompt tokens) and
the load imbalance (the largest replica's share of requests over its share of the
fleet's capacity; 1.0 is proportional), per strategy and router count, as a table
or ``--json``::

    .venv/bin/python bench/routing_sim.py --seed 1
    .venv/bin/python bench/routing_sim.py --seed 1 --workload multiturn --strategies score,prefix,oracle
    .venv/bin/python bench/routing_sim.py --seed 1 --requests 5000 --json
    .venv/bin/python bench/routing_sim.py --seed 1 --workload multiturn --strategies prefix,oracle --explain

``--explain`` breaks each run's tail (the requests at or above its p99 TTFT) down by
cause: ``queue`` (waited in a replica's queue longer than its prefill took), ``miss``
(mostly prefill, and some replica had a block or more of its prompt cached when it
arrived) or ``cold`` (nothing better cached anywhere); by the picker's reason, first
turns and turns whose conversation moved; and over all requests, the share of TTFT
spent queueing and of prompt tokens cached elsewhere than where they were sent.
"""

from __future__ import annotations

import argparse
import heapq
import importlib
import json
import math
import random
import struct
import sys
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

PREFILL_S = 0.0001  # s per prompt token at speed 1 (10k tokens/s)
PREFILL_INTERFERENCE = 0.03  # prefill slows by 3 % per request already running
DECODE_S = 0.010  # s per output token at speed 1 (100 tokens/s per request)
KV_TOKENS_PER_SLOT = 4000
BLOCK_TOKENS = 64  # tokens per cached block (and per router block: ~256 bytes of JSON)
ROUTER_BLOCKS = 64  # the gateway's routing.prefix.max_blocks
SYSTEM_PROMPTS = 8  # multiturn: shared system prompts, 200-800 tokens
SHARED_PROMPTS = 32  # shared-prefix: system prompts, 1-4 k tokens (--shared-prompts)
THINK_S = 3.0  # multiturn: mean think time between an answer and the next turn
WORKLOADS = ("chat", "multiturn", "shared-prefix", "unique")
_M64 = (1 << 64) - 1
_LATER_BYTE = 15 if sys.byteorder == "little" else 8  # the key's later-turn bit (bit 63 of word 1)

# (speed, slots) per replica
FLEETS: dict[str, list[tuple[float, int]]] = {
    "mixed": [(1.0, 8)] * 13 + [(1.5, 12)] * 2 + [(0.25, 8)],
    "uniform": [(1.0, 8)] * 16,
}

# event kinds, in tie-break order at equal times
EV_DONE, EV_FIRST, EV_DELIVER, EV_SNAP, EV_ARRIVE, EV_SHARE = range(6)


@dataclass(slots=True)
class Request:
    id: int
    arrival: float
    prompt: int
    output: int
    router: int
    replica: int = -1
    start: float = math.nan
    first: float = math.nan
    done: float = math.nan
    blocks: list[int] = field(default_factory=list)  # the prompt's block names (full blocks)
    after: list[int] = field(default_factory=list)  # ... of prompt + answer (cached at the end)
    chain: bytes = b""  # what the router sees (Picker.pick_prefix)
    session: int = 0
    next_turn: Request | None = None  # multiturn: sent THINK_S-ish after this one ends
    think: float = 0.0  # ... this long after
    cached: int = 0  # prompt tokens found in the replica's cache
    prefill: float = 0.0  # seconds of prefill it needed there
    turn: int = 0  # multiturn: its turn in the conversation (0: the first)
    # --explain: the picker's reason (REASONS index; -1: other strategies), the most
    # prompt tokens any replica had cached when it arrived, and the replica the
    # conversation's previous turn ran on (-1: none)
    reason: int = -1
    best_cached: int = 0
    prev_replica: int = -1


@dataclass(slots=True)
class Replica:
    speed: float
    slots: int
    running: int = 0
    kv_used: int = 0
    queue: deque[Request] = field(default_factory=deque)
    cache: OrderedDict[int, None] = field(default_factory=OrderedDict)  # block name -> (LRU order)
    cache_blocks: int = 0  # capacity in blocks
    ends: list[float] = field(default_factory=list)  # running requests' end times (oracle)
    live: list[Request] = field(default_factory=list)  # running requests (oracle_now)


def _names(segments: list[tuple[int, int]], anchor: int = -1, later: bool = False) -> tuple[list[int], list[int]]:
    """Block names of a token sequence given as (segment id, tokens): its full blocks, and
    the router's key as the gateway makes it (``jsonscan.json_route``): the anchor (the
    name of the first ``anchor`` tokens, where the first user message ends; 0: none),
    its whole blocks (bit 63: ``later``, more messages follow), then the names of the
    full blocks and of the last partial one."""
    full: list[int] = []
    h = 0x243F6A8885A308D3
    pieces: list[tuple[int, int, int]] = []
    fill = 0
    pos = 0
    a = 0
    for seg, n in segments:
        off = 0
        while off < n:
            take = min(n - off, BLOCK_TOKENS - fill)
            if pos < anchor < pos + take:  # the anchor ends inside this piece
                a = (hash((h, (*pieces, (seg, off, off + anchor - pos)))) & _M64) or 1
            pieces.append((seg, off, off + take))
            off += take
            fill += take
            pos += take
            if fill == BLOCK_TOKENS:
                h = (hash((h, tuple(pieces))) & _M64) or 1
                full.append(h)
                pieces = []
                fill = 0
            if pos == anchor:
                a = h if fill == 0 else (hash((h, tuple(pieces))) & _M64) or 1
    chain = full[:ROUTER_BLOCKS]
    if pieces and len(chain) < ROUTER_BLOCKS:
        chain = [*chain, (hash((h, tuple(pieces))) & _M64) or 1]
    if anchor > ROUTER_BLOCKS * BLOCK_TOKENS:
        a = 0
    return full, [a, (anchor // BLOCK_TOKENS | (1 << 63 if later else 0)) if a else 0, *chain]


def _seg(kind: int, a: int, b: int = 0) -> int:
    return (kind << 48) | (a << 16) | b


def _arrivals(rng: random.Random, rate: float) -> Any:
    """Arrival times of the bursty process at mean ``rate``."""
    calm, burst = 0.9 * rate, 1.4 * rate  # time shares 0.8 / 0.2: mean = rate
    t = 0.0
    bursting = False
    switch = rng.expovariate(1 / 20.0)
    while True:
        gap = rng.expovariate(burst if bursting else calm)
        if t + gap < switch:
            t += gap
            yield t
            continue
        t = switch  # memoryless: redraw in the new state
        bursting = not bursting
        switch = t + rng.expovariate(1 / (5.0 if bursting else 20.0))


def _capacity(fleet: list[tuple[float, int]], sizes: list[tuple[int, int]]) -> float:
    mean_service = sum(p * PREFILL_S + o * DECODE_S for p, o in sizes) / len(sizes)
    return sum(slots * speed for speed, slots in fleet) / mean_service


def _finish_request(
    r: Request, segs: list[tuple[int, int]], out_seg: int, anchor: int = -1, later: bool = False
) -> None:
    r.blocks, chain = _names(segs, anchor, later)
    r.after, _ = _names([*segs, (out_seg, r.output)])
    r.chain = struct.pack(f"={len(chain)}Q", *chain)


def workload_of(
    kind: str,
    seed: int,
    n: int,
    load: float,
    routers: int,
    fleet: list[tuple[float, int]],
    session_ids: bool,
    shared_prompts: int = SHARED_PROMPTS,
) -> tuple[list[Request], float]:
    """The requests of a workload (multiturn: each conversation's first turn, the rest
    linked by ``next_turn``), and the mean request rate."""
    if kind == "chat":
        reqs, rate = workload(seed, n, load, routers, fleet)
        for r in reqs:
            _finish_request(r, [(_seg(1, r.id), r.prompt)], _seg(2, r.id))
        return reqs, rate
    rng = random.Random(seed)
    if kind == "unique" or kind == "shared-prefix":
        sizes = []
        shared = [rng.randint(1000, 4000) for _ in range(shared_prompts)]
        picks = []
        for _ in range(n):
            if kind == "unique":
                prompt = max(200, min(int(rng.lognormvariate(math.log(1500), 0.5)), 8000))
                output = max(1, min(int(rng.lognormvariate(math.log(150), 0.8)), 1500))
                picks.append(-1)
            else:
                j = rng.randrange(shared_prompts)
                prompt = shared[j] + max(8, min(int(rng.lognormvariate(math.log(50), 0.6)), 400))
                output = max(1, min(int(rng.lognormvariate(math.log(100), 0.8)), 1000))
                picks.append(j)
            sizes.append((prompt, output))
        rate = load * _capacity(fleet, sizes)
        times = _arrivals(rng, rate)
        reqs = []
        for i, ((prompt, output), j) in enumerate(zip(sizes, picks, strict=True)):
            r = Request(i, next(times), prompt, output, rng.randrange(routers))
            if j < 0:
                segs = [(_seg(1, i), prompt)]
            else:
                segs = [(_seg(3, j), shared[j]), (_seg(1, i), prompt - shared[j])]
            # (a system message, then the question: its anchor ends the prompt)
            _finish_request(r, segs, _seg(2, i), prompt if j >= 0 else -1)
            reqs.append(r)
        return reqs, rate
    if kind != "multiturn":
        raise ValueError(f"unknown workload {kind!r}")
    systems = [rng.randint(200, 800) for _ in range(SYSTEM_PROMPTS)]
    convs = []
    total = 0
    while total < n:
        turns = min(rng.randint(3, 10), n - total)
        users = [max(8, min(int(rng.lognormvariate(math.log(60), 0.7)), 600)) for _ in range(turns)]
        outs = [max(1, min(int(rng.lognormvariate(math.log(150), 0.7)), 600)) for _ in range(turns)]
        convs.append((rng.randrange(SYSTEM_PROMPTS), users, outs, [rng.expovariate(1 / THINK_S) for _ in range(turns)]))
        total += turns
    sizes = []
    for sysj, users, outs, _ in convs:
        ctx = systems[sysj]
        for u, o in zip(users, outs, strict=True):
            sizes.append((ctx + u, o))
            ctx += u + o
    rate = load * _capacity(fleet, sizes)
    times = _arrivals(rng, rate * len(convs) / total)  # conversations start at rate / turns
    firsts = []
    rid = 0
    for c, (sysj, users, outs, thinks) in enumerate(convs):
        segs: list[tuple[int, int]] = [(_seg(3, sysj), systems[sysj])]
        prev: Request | None = None
        router = rng.randrange(routers)
        t0 = next(times)
        for k, (u, o) in enumerate(zip(users, outs, strict=True)):
            segs = [*segs, (_seg(4, c, 2 * k), u)]
            r = Request(rid, t0 if prev is None else math.nan, sum(x for _, x in segs), o, router)
            rid += 1
            r.think = thinks[k]
            r.turn = k
            r.session = ((c + 1) * 0x9E3779B97F4A7C15 & _M64) if session_ids else 0
            _finish_request(r, segs, _seg(4, c, 2 * k + 1), systems[sysj] + users[0], k > 0)
            segs = [*segs, (_seg(4, c, 2 * k + 1), o)]
            if prev is None:
                firsts.append(r)
            else:
                prev.next_turn = r
            prev = r
        # (each turn may come to any router: the client does not stick to one)
    return firsts, rate


def workload(
    seed: int, n: int, load: float, routers: int, fleet: list[tuple[float, int]]
) -> tuple[list[Request], float]:
    """``n`` requests with bursty arrivals at ``load`` x the fleet's capacity; also returns the rate."""
    rng = random.Random(seed)
    sizes = []
    for _ in range(n):
        if rng.random() < 0.7:
            prompt = int(rng.lognormvariate(math.log(250), 0.6))
        else:
            prompt = int(rng.lognormvariate(math.log(2500), 0.5))
        output = int(rng.lognormvariate(math.log(150), 0.8))
        sizes.append((max(16, min(prompt, 16000)), max(1, min(output, 1500))))
    mean_service = sum(p * PREFILL_S + o * DECODE_S for p, o in sizes) / n
    capacity = sum(slots * speed for speed, slots in fleet) / mean_service
    rate = load * capacity
    calm, burst = 0.9 * rate, 1.4 * rate  # time shares 0.8 / 0.2: mean = rate
    t = 0.0
    bursting = False
    switch = rng.expovariate(1 / 20.0)
    reqs = []
    for i, (prompt, output) in enumerate(sizes):
        while True:
            gap = rng.expovariate(burst if bursting else calm)
            if t + gap < switch:
                t += gap
                break
            t = switch  # memoryless: redraw in the new state
            bursting = not bursting
            switch = t + rng.expovariate(1 / (5.0 if bursting else 20.0))
        reqs.append(Request(i, t, prompt, output, rng.randrange(routers)))
    return reqs, rate


class Sim:
    """One run: a strategy, a router count, a workload."""

    def __init__(
        self,
        mod: ModuleType,
        strategy: str,
        routers: int,
        reqs: list[Request],
        seed: int,
        scrape_interval: float,
        stale_after: float,
        fleet: list[tuple[float, int]],
        oracle: bool = False,
        load_bound: float = 0.25,
        explain: bool = False,
        share: float = 0.0,
        scrape_delay: tuple[float, float] = (0.010, 0.030),
    ) -> None:
        self.mod = mod
        self.scrape_delay = scrape_delay
        # routes shared between routers (llmgw.fleet.share): a conversation turn's pick reaches the
        # other routers' pickers this many seconds later (0: routers share nothing)
        self.share = share if strategy == "prefix" and routers > 1 else 0.0
        self.explain = explain
        self.fleet = fleet
        self.oracle = oracle
        self.reqs = []
        for first in reqs:
            prev = None
            r: Request | None = first
            while r is not None:
                c = Request(
                    r.id, r.arrival, r.prompt, r.output, r.router % routers, blocks=r.blocks, after=r.after,
                    chain=r.chain, session=r.session, think=r.think, turn=r.turn,
                )
                if prev is not None:
                    prev.next_turn = c
                prev = c
                self.reqs.append(c)
                r = r.next_turn
        self.reqs.sort(key=lambda r: r.id)
        self.replicas = [Replica(speed, slots, cache_blocks=slots * KV_TOKENS_PER_SLOT // BLOCK_TOKENS) for speed, slots in fleet]
        self.routers = routers
        self.states = [[mod.EndpointState(i) for i in range(len(fleet))] for _ in range(routers)]
        self.oracle_pick = strategy in ("oracle", "oracle_now")
        self.now_only = strategy == "oracle_now"
        if self.now_only:
            # the mean of what is left of an answer that has reached o tokens, over the
            # workload's own answers: the best a router could expect without its length
            outs = sorted(r.output for r in self.reqs)
            top = outs[-1]
            self.rest = [0.0] * (top + 2)
            k = len(outs)
            tail_sum = 0
            j = len(outs)
            for o in range(top, -1, -1):
                while j > 0 and outs[j - 1] > o:
                    j -= 1
                    tail_sum += outs[j]
                n = k - j
                self.rest[o] = (tail_sum - n * o) / n if n else 1.0
            self.rest[top + 1] = 1.0
            self.mean_out = sum(outs) / k
        self.pickers = [
            mod.Picker("score" if self.oracle_pick else strategy, seed=seed * 1000 + r, load_bound=load_bound)
            for r in range(routers)
        ]
        if self.share:
            for p in self.pickers:
                p.shared = True
        self.turn_rng = random.Random(seed + 29)  # which router a conversation's next turn reaches
        self.rng = random.Random(seed + 17)
        self.scrape_interval = scrape_interval
        self.stale_after = stale_after
        self.events: list[tuple[float, int, int, Any]] = []
        self.seq = 0
        self.pending = len(self.reqs)
        self.unrouted = 0

    def at(self, t: float, kind: int, payload: Any) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, kind, self.seq, payload))

    def run(self) -> None:
        for r in self.reqs:
            if r.arrival == r.arrival:  # (later turns arrive when the one before has ended)
                self.at(r.arrival, EV_ARRIVE, r)
        for router in range(self.routers):
            self.at(self.rng.uniform(0.0, self.scrape_interval), EV_SNAP, router)
        while self.events and self.pending:
            now, kind, _, payload = heapq.heappop(self.events)
            if kind == EV_ARRIVE:
                self.arrive(now, payload)
            elif kind == EV_FIRST:
                payload.first = now
            elif kind == EV_DONE:
                self.finish(now, payload)
            elif kind == EV_SHARE:
                router, chain, session, tag = payload
                for r, p in enumerate(self.pickers):
                    if r != router:
                        p.learn(chain, session, tag, now)
            elif kind == EV_SNAP:
                for st in self.states[payload]:
                    st.on_scrape_sent()
                snap = self.snapshot()
                self.at(now + self.rng.uniform(*self.scrape_delay), EV_DELIVER, (payload, snap))
                self.at(now + self.scrape_interval, EV_SNAP, payload)
            else:  # EV_DELIVER
                router, snap = payload
                for st, (w, r, kv) in zip(self.states[router], snap, strict=True):
                    st.on_scrape(now, w, r, kv)

    def snapshot(self) -> list[tuple[int, int, float]]:
        return [
            (len(rep.queue), rep.running, min(1.0, rep.kv_used / (rep.slots * KV_TOKENS_PER_SLOT)))
            for rep in self.replicas
        ]

    def arrive(self, now: float, req: Request) -> None:
        req.arrival = now
        states = self.states[req.router]
        if self.oracle:  # perfect information: a fresh, exact scrape before every pick
            for st, (w, r, kv) in zip(states, self.snapshot(), strict=True):
                st.on_scrape(now, w, r, kv)
        if self.explain:
            req.best_cached = max(self.cached_tokens(rep, req) for rep in self.replicas)
        if self.oracle_pick:
            i = self.earliest_first_token(now, req)
        else:
            picker = self.pickers[req.router]
            before = picker.decisions() if self.explain else ()
            i = picker.pick_prefix(states, now, self.stale_after, req.chain, req.session)
            if self.explain:
                after = picker.decisions()
                req.reason = next((k for k in range(len(after)) if after[k] != before[k]), -1)
        if i < 0:
            r: Request | None = req
            while r is not None:  # (a conversation's later turns never come)
                self.unrouted += 1
                self.pending -= 1
                r = r.next_turn
            return
        states[i].on_dispatch(now)
        req.replica = i
        # as ModelPool.outbox keeps them: a conversation's turns (a session, or the later-turn bit)
        if self.share and (req.session or (len(req.chain) >= 24 and req.chain[_LATER_BYTE] & 0x80)):
            self.at(now + self.share, EV_SHARE, (req.router, req.chain, req.session, states[i].tag))
        rep = self.replicas[i]
        if rep.running < rep.slots:
            self.start(now, rep, req)
        else:
            rep.queue.append(req)

    @staticmethod
    def cached_tokens(rep: Replica, req: Request) -> int:
        """Prompt tokens of ``req`` in ``rep``'s cache: its longest cached prefix, at most all but one."""
        n = 0
        cache = rep.cache
        for b in req.blocks:
            if b not in cache:
                break
            n += 1
        return min(n * BLOCK_TOKENS, req.prompt - 1)

    @staticmethod
    def remember(rep: Replica, blocks: list[int]) -> None:
        cache = rep.cache
        for b in blocks:
            if b in cache:
                cache.move_to_end(b)
            else:
                cache[b] = None
        while len(cache) > rep.cache_blocks:
            cache.popitem(last=False)

    def start(self, now: float, rep: Replica, req: Request) -> None:
        req.cached = self.cached_tokens(rep, req)
        prefill = (req.prompt - req.cached) * PREFILL_S * (1.0 + PREFILL_INTERFERENCE * rep.running) / rep.speed
        decode = req.output * DECODE_S / rep.speed
        self.remember(rep, req.blocks)
        rep.running += 1
        rep.kv_used += req.prompt + req.output
        req.start = now
        req.prefill = prefill
        rep.ends.append(now + prefill + decode)
        rep.live.append(req)
        self.at(now + prefill, EV_FIRST, req)
        self.at(now + prefill + decode, EV_DONE, req)

    def finish(self, now: float, req: Request) -> None:
        rep = self.replicas[req.replica]
        rep.running -= 1
        rep.kv_used -= req.prompt + req.output
        rep.ends.remove(now)  # (the end time it was given, exactly)
        rep.live.remove(req)
        req.done = now
        self.pending -= 1
        self.remember(rep, req.after)
        self.states[req.router][req.replica].on_complete(now)
        nxt = req.next_turn
        if nxt is not None:
            nxt.router = self.turn_rng.randrange(self.routers)
            nxt.prev_replica = req.replica
            self.at(now + req.think, EV_ARRIVE, nxt)
        if rep.queue:
            self.start(now, rep, rep.queue.popleft())

    def earliest_first_token(self, now: float, req: Request) -> int:
        """The oracle: the replica where ``req``'s first token would come soonest, its
        queue replayed (the requests ahead take the slots as they free up) and its
        prefill counted without what that replica has cached."""
        best, best_t = -1, math.inf
        for i, rep in enumerate(self.replicas):
            if self.now_only:
                ends = []
                for q in rep.live:
                    if now < q.start + q.prefill:  # in its prefill: that, then a whole answer
                        ends.append(q.start + q.prefill + self.mean_out * DECODE_S / rep.speed)
                    else:
                        o = min(len(self.rest) - 1, int((now - q.start - q.prefill) * rep.speed / DECODE_S))
                        ends.append(now + self.rest[o] * DECODE_S / rep.speed)
            else:
                ends = rep.ends
            free = sorted(ends) if rep.running >= rep.slots else [now]
            if rep.queue:
                heap = [*ends, *([now] * (rep.slots - rep.running))]
                heapq.heapify(heap)
                for q in rep.queue:
                    t = heapq.heappop(heap)
                    out = self.mean_out if self.now_only else q.output
                    heapq.heappush(
                        heap, t + ((q.prompt - self.cached_tokens(rep, q)) * PREFILL_S + out * DECODE_S) / rep.speed
                    )
                free = [heapq.heappop(heap)]
            begin = max(now, free[0])
            running = min(rep.slots - 1, rep.running)
            t = begin + (req.prompt - self.cached_tokens(rep, req)) * PREFILL_S * (
                1.0 + PREFILL_INTERFERENCE * running
            ) / rep.speed
            if t < best_t:
                best, best_t = i, t
        return best


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return math.nan
    k = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[k]


def summarize(sim: Sim, warmup: float, slo: float) -> dict[str, Any]:
    fleet = sim.fleet
    measured = [r for r in sim.reqs if r.arrival >= warmup]
    ttft = sorted(r.first - r.arrival for r in measured if r.first == r.first)
    span = max(r.arrival for r in measured) - min(r.arrival for r in measured) if len(measured) > 1 else math.nan
    prompt_tokens = sum(r.prompt for r in measured if r.replica >= 0)
    cap = [speed * slots for speed, slots in fleet]
    served = [0] * len(fleet)
    for r in measured:
        if r.replica >= 0:
            served[r.replica] += 1
    total = max(1, sum(served))
    good = sum(1 for t in ttft if t <= slo)
    slow = min(range(len(fleet)), key=lambda i: fleet[i][0])
    return {
        "requests": len(measured),
        "ttft_p50": percentile(ttft, 0.50),
        "ttft_p99": percentile(ttft, 0.99),
        "ttft_mean": sum(ttft) / len(ttft) if ttft else math.nan,
        "goodput_rps": good / span if span else math.nan,
        "goodput_pct": 100.0 * good / len(measured) if measured else math.nan,
        "slow_share_pct": (
            100.0 * sum(1 for r in measured if r.replica == slow) / max(1, len(measured))
            if fleet[slow][0] < max(f[0] for f in fleet)
            else math.nan
        ),
        "unrouted": sim.unrouted,
        "hit_ratio": sum(r.cached for r in measured if r.replica >= 0) / prompt_tokens if prompt_tokens else math.nan,
        "imbalance": max(served[i] / total / (cap[i] / sum(cap)) for i in range(len(fleet))),
    }


def explain(sim: Sim, warmup: float, reasons: tuple[str, ...]) -> dict[str, Any]:
    """What makes the tail: the requests at or above the p99 TTFT, by cause.

    ``queue``: it waited in the replica's queue longer than its prefill took; ``miss``:
    mostly prefill, and some replica had at least a block more of its prompt cached
    when it arrived; ``cold``: mostly prefill, with nothing better cached anywhere.
    Also by the picker's reason, first turns, and turns whose conversation moved to
    another replica (``moved``); ``wait``/``prefill`` are mean seconds."""
    measured = [r for r in sim.reqs if r.arrival >= warmup and r.first == r.first]
    if not measured:
        return {}
    p99 = percentile(sorted(r.first - r.arrival for r in measured), 0.99)
    tail = [r for r in measured if r.first - r.arrival >= p99]

    def cause(r: Request) -> str:
        if r.start - r.arrival > r.prefill:
            return "queue"
        return "miss" if r.best_cached - r.cached >= BLOCK_TOKENS else "cold"

    def labels(r: Request) -> list[str]:
        out = [cause(r)]
        if r.turn == 0:
            out.append("first turn")
        if r.prev_replica >= 0 and r.prev_replica != r.replica:
            out.append("moved")
        if r.reason >= 0:
            out.append(f"reason {reasons[r.reason]}")
        return out

    out: dict[str, Any] = {"p99": p99, "tail": len(tail)}
    groups: dict[str, list[Request]] = {}
    for r in tail:
        for name in labels(r):
            groups.setdefault(name, []).append(r)
    order = ["queue", "miss", "cold", "first turn", "moved", *(f"reason {n}" for n in reasons)]
    for name in order:
        part = groups.get(name)
        if part:
            out[name] = {
                "n": len(part),
                "wait": sum(r.start - r.arrival for r in part) / len(part),
                "prefill": sum(r.prefill for r in part) / len(part),
                "prompt": sum(r.prompt for r in part) / len(part),
                "cached": sum(r.cached for r in part) / len(part),
                "best_cached": sum(r.best_cached for r in part) / len(part),
            }
    # over all requests: what share of the TTFT is queueing, and how much prefill a
    # better-placed request would have saved
    total = sum(r.first - r.arrival for r in measured)
    queued = sum(r.start - r.arrival for r in measured)
    out["all"] = {
        "queue_share": queued / total if total else math.nan,
        "queued_pct": 100.0 * sum(1 for r in measured if r.start > r.arrival) / len(measured),
        "missed_tokens_pct": 100.0 * sum(max(0, r.best_cached - r.cached) for r in measured)
        / max(1, sum(r.prompt for r in measured)),
        "moved_pct": 100.0 * sum(1 for r in measured if r.prev_replica >= 0 and r.prev_replica != r.replica)
        / max(1, sum(1 for r in measured if r.prev_replica >= 0)),
    }
    return out


def print_explain(name: str, routers: int, x: dict[str, Any]) -> None:
    if not x:
        return
    a = x["all"]
    print(
        f"{name} x{routers}: p99 {x['p99']:.3f}s, {x['tail']} requests at or above it; over all requests: "
        f"{100 * a['queue_share']:.0f}% of TTFT is queueing, {a['queued_pct']:.1f}% queued, "
        f"{a['missed_tokens_pct']:.1f}% of prompt tokens cached elsewhere but not where sent, "
        f"{a['moved_pct']:.1f}% of later turns moved"
    )
    for k, v in x.items():
        if isinstance(v, dict) and k != "all":
            print(
                f"    {k:<22}{v['n']:>5}  wait {v['wait']:.3f}s  prefill {v['prefill']:.3f}s  "
                f"prompt {v['prompt']:>6.0f}  cached {v['cached']:>6.0f}  best cached {v['best_cached']:>6.0f}"
            )


def load_impl(name: str) -> ModuleType:
    if name == "py":
        return importlib.import_module("llmgw._fast.score_py")
    try:
        return importlib.import_module("llmgw._fast.score")
    except ImportError:
        if name == "c":
            raise
        return importlib.import_module("llmgw._fast.score_py")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--load", type=float, default=0.85, help="offered load, fraction of fleet capacity")
    ap.add_argument("--routers", default="1,4", help="router counts to compare, comma-separated")
    ap.add_argument("--strategies", default="round_robin,least_inflight,score,prefix,oracle")
    ap.add_argument("--workload", choices=WORKLOADS, default="chat")
    ap.add_argument(
        "--session-ids", action="store_true", help="multiturn: each request carries its conversation's session key"
    )
    ap.add_argument("--impl", choices=("auto", "c", "py"), default="auto")
    ap.add_argument("--fleet", choices=sorted(FLEETS), default="mixed")
    ap.add_argument(
        "--oracle",
        action="store_true",
        help="add `score*`: score fed exact numbers before every pick (the staleness cost)",
    )
    ap.add_argument("--shared-prompts", type=int, default=SHARED_PROMPTS, help="shared-prefix: system prompts")
    ap.add_argument("--load-bound", type=float, default=0.25, help="prefix: routing.prefix.load_bound")
    ap.add_argument("--share", type=float, default=0.15, metavar="S",
                    help="prefix with several routers: conversation routes reach the other routers S seconds "
                         "after the pick (routing.prefix.share: a 100 ms flush and the relay); 0: none shared")
    ap.add_argument("--scrape-interval", type=float, default=0.1)
    ap.add_argument("--scrape-delay", default="0.010,0.030", metavar="LO,HI",
                    help="seconds from a scrape's taking to its landing at the router, drawn uniformly in [LO, HI]")
    ap.add_argument("--stale-after", type=float, default=1.0)
    ap.add_argument("--warmup", type=float, default=10.0, help="seconds of arrivals left out of the figures")
    ap.add_argument("--slo", type=float, default=2.0, help="TTFT target for goodput (s)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--explain", action="store_true", help="break the TTFT tail down by cause (queue, cache miss, cold) per run"
    )
    args = ap.parse_args(argv)

    mod = load_impl(args.impl)
    fleet = FLEETS[args.fleet]
    router_counts = [int(x) for x in args.routers.split(",")]
    runs = [(s, False) for s in args.strategies.split(",")]
    if args.oracle:
        runs.append(("score", True))
    base, rate = workload_of(
        args.workload, args.seed, args.requests, args.load, max(router_counts), fleet, args.session_ids,
        args.shared_prompts,
    )
    try:
        lo, hi = (float(x) for x in args.scrape_delay.split(","))
    except ValueError:
        ap.error("--scrape-delay: expected LO,HI in seconds (for example 0.010,0.030)")
    if not 0.0 <= lo <= hi:
        ap.error("--scrape-delay: expected 0 <= LO <= HI")
    scrape_delay = (lo, hi)
    results = []
    explained: list[tuple[str, int, dict[str, Any]]] = []
    t0 = time.perf_counter()
    for strategy, oracle in runs:
        for routers in router_counts:
            sim = Sim(
                mod, strategy, routers, base, args.seed, args.scrape_interval, args.stale_after, fleet, oracle,
                args.load_bound, args.explain, args.share, scrape_delay,
            )
            sim.run()
            name = strategy + ("*" if oracle else "")
            results.append({"strategy": name, "routers": routers, **summarize(sim, args.warmup, args.slo)})
            if args.explain:
                explained.append((name, routers, explain(sim, args.warmup, tuple(mod.REASONS))))
    wall = time.perf_counter() - t0
    meta = {
        "seed": args.seed,
        "requests": args.requests,
        "load": args.load,
        "rate_rps": rate,
        "simulated_s": max(r.arrival for r in base),
        "workload": args.workload,
        "session_ids": args.session_ids,
        "share_s": args.share,
        "impl": mod.__name__,
        "fleet": args.fleet,
        "slo_s": args.slo,
        "wall_s": wall,
    }
    if args.json:
        doc: dict[str, Any] = {"meta": meta, "results": results}
        if args.explain:
            doc["explain"] = [{"strategy": n, "routers": k, **x} for n, k, x in explained]
        json.dump(doc, sys.stdout, indent=2)
        print()
        return 0
    print(
        f"{args.requests} requests, {rate:.1f} req/s mean ({args.load:.0%} of capacity, bursty), "
        f"{args.workload} workload, {args.fleet} fleet, seed {args.seed}, {mod.__name__}, {wall:.1f} s wall"
    )
    head = (
        f"{'strategy':<15}{'routers':>8}{'TTFT p50':>10}{'TTFT p99':>10}{'goodput':>12}{'good %':>8}{'to slow':>9}"
        f"{'hit %':>7}{'imbal':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        slow = r["slow_share_pct"]
        slow_col = f"{slow:>8.1f}%" if slow == slow else f"{'-':>9}"
        print(
            f"{r['strategy']:<15}{r['routers']:>8}{r['ttft_p50']:>9.3f}s{r['ttft_p99']:>9.2f}s"
            f"{r['goodput_rps']:>8.1f} r/s{r['goodput_pct']:>7.1f}%{slow_col}"
            f"{100 * r['hit_ratio']:>6.1f}%{r['imbalance']:>7.2f}"
        )
    print(
        f"goodput: requests/s with TTFT <= {args.slo:g} s; 'to slow': share sent to the 4x slower replica; "
        "hit %: prompt tokens found cached; imbal: the busiest replica's share over its share of capacity"
    )
    if args.oracle:
        print(
            "score*: score with an exact scrape before every pick (no staleness, sees every router's requests)"
        )
    for name, routers, x in explained:
        print_explain(name, routers, x)
    return 0


if __name__ == "__main__":
    sys.exit(main())
