"""Cache-aware routing on real engines: ``score`` against ``prefix`` with llama-server.

Three ``llama-server`` replicas (prompt caching on, as it is by default: a slot
keeps its last prompt's KV cache and a request reuses the longest common prefix,
and ``--cache-ram`` MiB of host memory keep more prompts) run a random-weight GGUF big enough that prefill takes measurable time on a CPU
(:func:`llmgw.testing.gguf_model.write_tiny_llama`, ``--width`` wide,
``--layers`` deep; one thread each). For each strategy a fresh ``llmgw serve``
(``engine: llamacpp``) fronts the same replicas, restarted between strategies so
no cache carries over, and ``--conversations`` conversations of ``--turns`` turns
run, ``--concurrency`` at a time; each turn's prompt is the conversation so far (a
system prompt shared by all, then user and assistant messages) plus a new user
message. Figures per strategy: the answer time of each turn (``max_tokens`` 2:
prefill and two tokens), p50/p99; the engines' own prefill time
(``timings.prompt_ms``) p50/p99; and the prompt tokens they found in their cache
(``timings.cache_n``) over all prompt tokens. Turn 1 of each conversation can hit
only the shared system prompt.

``--cache-ram`` defaults to 48 MiB of host memory beside the two slots: about
eight of these conversations' KV (6 KiB a token at 256 x 6), more than the seven
a replica serves when conversations keep to one, fewer than the twenty a replica
sees when they wander, as a GPU's KV memory holds a fraction of the fleet's
working set. llama-server's own default, 8 GiB, keeps every conversation on every
replica it ever visited and leaves routing little to win; 0 (slots only) keeps
too little for either. Turns are ``--think`` seconds apart
(exponential): without a pause, a conversation's next turn finds the slot its last
turn just freed, and load-only routing sends it back there by accident.

With ``--routers N`` (default 1) N gateways front the same replicas: the first runs
a control plane (SQLite) and the others follow it, so ``prefix`` routers share
conversations' routes (``routing.prefix.share``; the strategy ``prefix-noshare``
turns that off), and each turn goes to one of them at random; the endpoints'
``slots`` are set, so that a replica busy with another router's requests does not
look full. The routers' decisions and shared routes (sent, received) are summed.

    LLMGW_SHARED_DIR=/work/shared nice .venv/bin/python bench/prefix_real.py
    .venv/bin/python bench/prefix_real.py --routers 3 --strategies score,prefix,prefix-noshare
    .venv/bin/python bench/prefix_real.py --conversations 20 --turns 6 --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from llmgw.testing.gguf_model import write_tiny_llama
from llmgw.testing.llamacpp import LlamaServer, find_llama_server, free_port

ROOT = Path(__file__).resolve().parent.parent
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu", "nu", "xi", "omicron", "pi", "rho", "sigma"]


def text(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    n = 0
    while n < chars:
        w = rng.choice(WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)


async def post(port: int, body: dict[str, Any]) -> tuple[float, dict[str, Any], str]:
    data = orjson.dumps(body)
    t0 = time.perf_counter()
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        w.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(data), data)
        )
        raw = await asyncio.wait_for(r.read(), 300)
    finally:
        w.close()
    elapsed = time.perf_counter() - t0
    head, _, payload = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if status != 200:
        raise RuntimeError(f"answer {status}: {payload[:300]!r}")
    replica = ""
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"x-llmgw-replica:"):
            replica = line.split(b":", 1)[1].strip().decode()
    return elapsed, orjson.loads(payload), replica


async def conversation(
    ports: list[int], rng: random.Random, system: str, turns: int, think: float, out: list[dict[str, Any]]
) -> None:
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    for turn in range(turns):
        if turn and think > 0:
            await asyncio.sleep(rng.expovariate(1.0 / think))  # the user reads and types
        messages.append({"role": "user", "content": text(rng, 150)})
        # (each turn to any of the routers: the client does not stick to one)
        port = ports[rng.randrange(len(ports))] if len(ports) > 1 else ports[0]
        elapsed, answer, replica = await post(port, {"model": "m", "messages": messages, "max_tokens": 2})
        timings = answer.get("timings") or {}
        out.append(
            {
                "turn": turn,
                "seconds": elapsed,
                "prompt_ms": timings.get("prompt_ms"),
                "prompt_n": timings.get("prompt_n"),
                "cache_n": timings.get("cache_n"),
                "prompt_tokens": (answer.get("usage") or {}).get("prompt_tokens"),
                "replica": replica,
            }
        )
        messages.append({"role": "assistant", "content": text(rng, 100)})


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, max(0, int(q * len(v) + 0.999999) - 1))]


async def routing_decisions(admin: int) -> dict[str, float]:
    """``llmgw_routing_decisions_total`` by reason, and ``llmgw_routing_shared_routes_total`` by
    direction (as ``shared_sent``, ``shared_received``), off the gateway's /metrics."""
    r, w = await asyncio.open_connection("127.0.0.1", admin)
    w.write(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    page = (await asyncio.wait_for(r.read(), 10)).decode()
    w.close()
    out = {}
    for line in page.splitlines():
        if line.startswith("llmgw_routing_decisions_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('reason="', 1)[1].split('"', 1)[0]] = float(value)
        elif line.startswith("llmgw_routing_shared_routes_total{"):
            labels, value = line.rsplit(" ", 1)
            key = "shared_" + labels.split('direction="', 1)[1].split('"', 1)[0]
            out[key] = out.get(key, 0.0) + float(value)
    return out


def _gateways(args: argparse.Namespace, strategy: str, replicas: list[LlamaServer], d: Path) -> list[tuple[int, int, Path]]:
    """The configs of ``--routers`` gateways for ``strategy``: (port, admin port, config file). With
    several, the first runs a control plane (SQLite) and the others follow it, so that ``prefix``
    routers share conversations' routes (``routing.prefix.share``); ``prefix-noshare`` turns that off."""
    name, _, variant = strategy.partition("-")
    # (several routers: slots known, so that a replica running the others' requests does not look full)
    slots = f", slots: {args.parallel}" if args.routers > 1 else ""
    routing = f"{{strategy: {name}}}" if variant != "noshare" else f"{{strategy: {name}, prefix: {{share: false}}}}"
    common = (
        f"routing: {routing}\n"
        "scrape: {interval: 250ms}\n"
        "endpoints:\n"
        + "".join(
            f'  - {{id: r{i}, url: "{s.url}", model: m, engine: llamacpp{slots}}}\n' for i, s in enumerate(replicas)
        )
    )
    cp_port = free_port()
    out = []
    for k in range(args.routers):
        port, admin = free_port(), free_port()
        role = ""
        if args.routers > 1 and k == 0:
            role = (
                f"control: {{listen: '127.0.0.1:{cp_port}', join_token: bench-join-token-0000,"
                f" router_token: bench-router-token-0000, database: 'sqlite:///{d}/cp-{strategy}.sqlite3'}}\n"
            )
        elif args.routers > 1:
            role = f"follow: {{control: '127.0.0.1:{cp_port}', token: bench-router-token-0000}}\n"
        cfg = d / f"llmgw-{strategy}-{k}.yaml"
        cfg.write_text(f"listen: 127.0.0.1:{port}\nadmin: 127.0.0.1:{admin}\n{role}{common}")
        out.append((port, admin, cfg))
    return out


async def run_strategy(args: argparse.Namespace, strategy: str, replicas: list[LlamaServer], d: Path) -> dict[str, Any]:
    gateways = _gateways(args, strategy, replicas, d)
    procs = []
    try:
        for k, (port, _, cfg) in enumerate(gateways):
            with open(d / f"llmgw-{strategy}-{k}.log", "wb") as log:
                procs.append(subprocess.Popen(
                    [str(ROOT / ".venv" / "bin" / "llmgw"), "serve", "-c", str(cfg)], stdout=subprocess.DEVNULL,
                    stderr=log,
                ))
            for _ in range(200):  # (bounded: 20 s) the gateway listens and has scraped
                try:
                    await post(port, {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1})
                    break
                except (OSError, RuntimeError):
                    await asyncio.sleep(0.1)
        ports = [port for port, _, _ in gateways]
        rng = random.Random(args.seed)
        system = text(rng, args.system_chars)
        out: list[dict[str, Any]] = []
        sem = asyncio.Semaphore(args.concurrency)

        async def one(k: int) -> None:
            async with sem:
                await conversation(ports, random.Random(args.seed * 1000 + k), system, args.turns, args.think, out)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(k) for k in range(args.conversations)))
        wall = time.perf_counter() - t0
        decisions: dict[str, float] = {}
        for _, admin, _ in gateways:
            for reason, n in (await routing_decisions(admin)).items():
                decisions[reason] = decisions.get(reason, 0.0) + n
    finally:
        for gw in procs:
            gw.terminate()
        for gw in procs:
            gw.wait(10)
    secs = [r["seconds"] for r in out]
    pms = [r["prompt_ms"] / 1000.0 for r in out if r["prompt_ms"] is not None]
    cached = sum(r["cache_n"] or 0 for r in out)
    prompt = sum((r["cache_n"] or 0) + (r["prompt_n"] or 0) for r in out)
    later = [r["seconds"] for r in out if r["turn"] > 0]
    per_replica: dict[str, int] = {}
    for r in out:
        per_replica[r["replica"]] = per_replica.get(r["replica"], 0) + 1
    return {
        "decisions": decisions,
        "per_replica": per_replica,
        "strategy": strategy,
        "routers": args.routers,
        "requests": len(out),
        "wall_s": wall,
        "answer_p50": pct(secs, 0.5),
        "answer_p99": pct(secs, 0.99),
        "answer_p50_later_turns": pct(later, 0.5) if later else None,
        "prefill_p50": pct(pms, 0.5) if pms else None,
        "prefill_p99": pct(pms, 0.99) if pms else None,
        "cached_tokens": cached,
        "prompt_tokens": prompt,
        "cache_hit_ratio": cached / prompt if prompt else None,
    }


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    d = Path(tempfile.mkdtemp(prefix="llmgw-prefix-real-"))
    model = write_tiny_llama(d / "model.gguf", ctx=args.ctx, n_embd=args.width, n_layer=args.layers, n_ff=3 * args.width)
    binary = find_llama_server()
    results = []
    for strategy in args.strategies.split(","):
        replicas = [
            LlamaServer(binary, model, parallel=args.parallel, ctx=args.ctx, alias="m", threads=1,
                        extra_args=("--cache-ram", str(args.cache_ram)), log_path=d / f"engine-{strategy}-{i}.log")
            for i in range(args.replicas)
        ]
        try:
            for s in replicas:
                s.start(timeout=120)
            results.append(await run_strategy(args, strategy, replicas, d))
        finally:
            for s in replicas:
                s.stop()
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--strategies", default="score,prefix")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--routers", type=int, default=1,
                    help="gateways in front of the replicas; with several, the first runs a control plane and the "
                         "others follow it (prefix routes shared; strategy prefix-noshare: not)")
    ap.add_argument("--parallel", type=int, default=2, help="slots per replica (-np)")
    ap.add_argument("--ctx", type=int, default=6144, help="context per replica (-c), split between its slots")
    ap.add_argument("--cache-ram", type=int, default=48,
                    help="llama-server --cache-ram (MiB): its host-memory prompt cache, beside the slots'")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--conversations", type=int, default=20)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--think", type=float, default=1.0, help="mean seconds between an answer and the next turn")
    ap.add_argument("--system-chars", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    results = asyncio.run(main_async(args))
    if args.json:
        json.dump({"results": results}, sys.stdout, indent=2)
        print()
        return 0
    print(f"{args.routers} router(s), {args.replicas} llama-server replicas x {args.parallel} slots, model {args.width} wide x {args.layers} layers; "
          f"{args.conversations} conversations x {args.turns} turns, {args.concurrency} at a time")
    print(f"{'strategy':<10}{'answer p50':>12}{'answer p99':>12}{'turns 2+ p50':>14}{'prefill p50':>13}"
          f"{'prefill p99':>13}{'cached/prompt tokens':>24}{'hit %':>7}")
    for r in results:
        print(f"{r['strategy']:<10}{r['answer_p50']:>11.3f}s{r['answer_p99']:>11.3f}s{r['answer_p50_later_turns']:>13.3f}s"
              f"{r['prefill_p50'] or 0:>12.3f}s{r['prefill_p99'] or 0:>12.3f}s"
              f"{r['cached_tokens']:>12}/{r['prompt_tokens']:<11}{100 * (r['cache_hit_ratio'] or 0):>6.1f}%")
    for r in results:
        print(f"{r['strategy']}: requests per replica {r['per_replica']}; decisions {r['decisions'] or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
