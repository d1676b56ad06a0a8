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

The workload
    Bursty arrivals: a two-state Markov-modulated Poisson process (calm periods of
    mean 20 s at 0.9x the mean rate, bursts of mean 5 s at 1.4x: above the fleet's
    capacity at 85 % load, so queues build and must be steered around). The mean
    rate is ``--load`` (default 0.85) times the fleet's capacity (sum of slots x
    speed / mean service time). Prompt lengths: 70 % short chat turns (lognormal,
    median ~250 tokens), 30 % long RAG-style prompts (median ~2,500 tokens); output
    lengths lognormal (median ~150 tokens, up to 1,500).

The routers
    Each request arrives at one router chosen at random. A router sees only its own
    dispatches and completions, plus a scrape of every replica every
    ``--scrape-interval`` (100 ms, at a random phase per router) that reaches it
    10-30 ms after it was taken (so numbers between scrapes are stale-ish, and the
    requests the other routers sent meanwhile are invisible to it). ``--oracle``
    adds ``score*``: the same picker given an exact scrape before every pick, which
    shows what staleness costs.

Output: TTFT p50/p99 and goodput (requests per second with TTFT within ``--slo``)
per strategy and router count, as a table or ``--json``::

    .venv/bin/python bench/routing_sim.py --seed 1
    .venv/bin/python bench/routing_sim.py --seed 1 --requests 5000 --json
"""

from __future__ import annotations

import argparse
import heapq
import importlib
import json
import math
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

PREFILL_S = 0.0001  # s per prompt token at speed 1 (10k tokens/s)
PREFILL_INTERFERENCE = 0.03  # prefill slows by 3 % per request already running
DECODE_S = 0.010  # s per output token at speed 1 (100 tokens/s per request)
KV_TOKENS_PER_SLOT = 4000

# (speed, slots) per replica
FLEETS: dict[str, list[tuple[float, int]]] = {
    "mixed": [(1.0, 8)] * 13 + [(1.5, 12)] * 2 + [(0.25, 8)],
    "uniform": [(1.0, 8)] * 16,
}

# event kinds, in tie-break order at equal times
EV_DONE, EV_FIRST, EV_DELIVER, EV_SNAP, EV_ARRIVE = range(5)


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


@dataclass(slots=True)
class Replica:
    speed: float
    slots: int
    running: int = 0
    kv_used: int = 0
    queue: deque[Request] = field(default_factory=deque)


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
    ) -> None:
        self.mod = mod
        self.fleet = fleet
        self.oracle = oracle
        self.reqs = [Request(r.id, r.arrival, r.prompt, r.output, r.router % routers) for r in reqs]
        self.replicas = [Replica(speed, slots) for speed, slots in fleet]
        self.routers = routers
        self.states = [[mod.EndpointState(i) for i in range(len(fleet))] for _ in range(routers)]
        self.pickers = [mod.Picker(strategy, seed=seed * 1000 + r) for r in range(routers)]
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
            elif kind == EV_SNAP:
                for st in self.states[payload]:
                    st.on_scrape_sent()
                snap = self.snapshot()
                self.at(now + self.rng.uniform(0.010, 0.030), EV_DELIVER, (payload, snap))
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
        states = self.states[req.router]
        if self.oracle:  # perfect information: a fresh, exact scrape before every pick
            for st, (w, r, kv) in zip(states, self.snapshot(), strict=True):
                st.on_scrape(now, w, r, kv)
        i = self.pickers[req.router].pick(states, now, self.stale_after)
        if i < 0:
            self.unrouted += 1
            self.pending -= 1
            return
        states[i].on_dispatch(now)
        req.replica = i
        rep = self.replicas[i]
        if rep.running < rep.slots:
            self.start(now, rep, req)
        else:
            rep.queue.append(req)

    def start(self, now: float, rep: Replica, req: Request) -> None:
        prefill = req.prompt * PREFILL_S * (1.0 + PREFILL_INTERFERENCE * rep.running) / rep.speed
        decode = req.output * DECODE_S / rep.speed
        rep.running += 1
        rep.kv_used += req.prompt + req.output
        req.start = now
        self.at(now + prefill, EV_FIRST, req)
        self.at(now + prefill + decode, EV_DONE, req)

    def finish(self, now: float, req: Request) -> None:
        rep = self.replicas[req.replica]
        rep.running -= 1
        rep.kv_used -= req.prompt + req.output
        req.done = now
        self.pending -= 1
        self.states[req.router][req.replica].on_complete(now)
        if rep.queue:
            self.start(now, rep, rep.queue.popleft())


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return math.nan
    k = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[k]


def summarize(sim: Sim, warmup: float, slo: float) -> dict[str, Any]:
    fleet = sim.fleet
    measured = [r for r in sim.reqs if r.arrival >= warmup]
    ttft = sorted(r.first - r.arrival for r in measured if r.first == r.first)
    span = measured[-1].arrival - measured[0].arrival if len(measured) > 1 else math.nan
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
    }


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
    ap.add_argument("--strategies", default="round_robin,least_inflight,score")
    ap.add_argument("--impl", choices=("auto", "c", "py"), default="auto")
    ap.add_argument("--fleet", choices=sorted(FLEETS), default="mixed")
    ap.add_argument(
        "--oracle",
        action="store_true",
        help="add `score*`: score fed exact numbers before every pick (the staleness cost)",
    )
    ap.add_argument("--scrape-interval", type=float, default=0.1)
    ap.add_argument("--stale-after", type=float, default=1.0)
    ap.add_argument("--warmup", type=float, default=10.0, help="seconds of arrivals left out of the figures")
    ap.add_argument("--slo", type=float, default=2.0, help="TTFT target for goodput (s)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    mod = load_impl(args.impl)
    fleet = FLEETS[args.fleet]
    router_counts = [int(x) for x in args.routers.split(",")]
    runs = [(s, False) for s in args.strategies.split(",")]
    if args.oracle:
        runs.append(("score", True))
    base, rate = workload(args.seed, args.requests, args.load, max(router_counts), fleet)
    results = []
    t0 = time.perf_counter()
    for strategy, oracle in runs:
        for routers in router_counts:
            sim = Sim(
                mod, strategy, routers, base, args.seed, args.scrape_interval, args.stale_after, fleet, oracle
            )
            sim.run()
            name = strategy + ("*" if oracle else "")
            results.append({"strategy": name, "routers": routers, **summarize(sim, args.warmup, args.slo)})
    wall = time.perf_counter() - t0
    meta = {
        "seed": args.seed,
        "requests": args.requests,
        "load": args.load,
        "rate_rps": rate,
        "simulated_s": base[-1].arrival,
        "impl": mod.__name__,
        "fleet": args.fleet,
        "slo_s": args.slo,
        "wall_s": wall,
    }
    if args.json:
        json.dump({"meta": meta, "results": results}, sys.stdout, indent=2)
        print()
        return 0
    print(
        f"{args.requests} requests, {rate:.1f} req/s mean ({args.load:.0%} of capacity, bursty), "
        f"{meta['simulated_s']:.0f} s simulated, {args.fleet} fleet, seed {args.seed}, {mod.__name__}, {wall:.1f} s wall"
    )
    head = f"{'strategy':<15}{'routers':>8}{'TTFT p50':>10}{'TTFT p99':>10}{'goodput':>12}{'good %':>8}{'to slow':>9}"
    print(head)
    print("-" * len(head))
    for r in results:
        slow = r["slow_share_pct"]
        slow_col = f"{slow:>8.1f}%" if slow == slow else f"{'-':>9}"
        print(
            f"{r['strategy']:<15}{r['routers']:>8}{r['ttft_p50']:>9.3f}s{r['ttft_p99']:>9.2f}s"
            f"{r['goodput_rps']:>8.1f} r/s{r['goodput_pct']:>7.1f}%{slow_col}"
        )
    print(f"goodput: requests/s with TTFT <= {args.slo:g} s; 'to slow': share sent to the 4x slower replica")
    if args.oracle:
        print(
            "score*: score with an exact scrape before every pick (no staleness, sees every router's requests)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
