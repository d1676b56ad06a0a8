#!/usr/bin/env python3
"""HA figures on a real PostgreSQL (``llmgw.testing.postgres``): failover time, and the database's load.

Two measurements (docs/ha.md quotes them):

* **Failover** (default): ``--serve`` real ``llmgw serve`` processes on one database,
  ``--agents`` real agent processes (``tests/control/agent_proc.py``) heartbeating
  with every address. ``--kills`` times: find the leader, ``kill -9`` it, and time
  (a) until another process reports ``llmgw_control_leader 1`` (polled every 20 ms on
  ``/metrics``): the failover time; (b) until every agent is ``up`` on the new leader:
  the agents' follow time. The killed process is restarted (it comes back a standby)
  before the next kill. With ``--route``, the agents are real ``llmgw agent`` processes
  running a deployment (one replica each, on the vLLM stand-in engine), a router
  (``llmgw serve`` with ``follow:``) follows every control plane, and a client sends
  requests through it without pause (two at a time) all through the kills: the
  requests that failed are counted (goal: none).
* **Database load** (``--db-load``): a leader and a standby with the default lease,
  ``--fleet`` simulated agents (``bench/cluster_scale.py``'s, in this process) with 8 GPUs
  each heartbeating every ``--interval`` s. Once every node is up, the statistics are
  reset and, over ``--window`` s, the database's transactions, rows written and write
  statements are read from ``pg_stat_database`` and ``pg_stat_statements``: heartbeats
  must not become writes (only registrations that change a node's identity do).
  With ``--replicas`` (default: one per agent) a deployment of that many replicas is
  placed first (its writes counted): the window then runs with deployments present.
  Then the leader is killed, and the re-registration of the whole fleet on the new
  leader is timed and its writes counted.

    .venv/bin/python bench/failover.py --kills 20 --lease 2
    .venv/bin/python bench/failover.py --kills 20 --lease 2 --route   # + a router and a client
    .venv/bin/python bench/failover.py --db-load --fleet 1000 --window 30

Every process it starts is stopped on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))  # canary (cp_helpers imports it)
sys.path.insert(0, str(ROOT / "tests" / "ha"))
sys.path.insert(0, str(ROOT / "tests" / "control"))
sys.path.insert(0, str(HERE))

from serve_helpers import Serve, gauge, the_leader, wait_until  # noqa: E402

from llmgw.testing.postgres import PostgresServer  # noqa: E402

TOKEN = "bench-join-token"
FLUSH = 11.0
"""PostgreSQL 15 flushes a backend's table and transaction counters at most once a second and an
idle one's after 10 s: this long after an interval its counts are all in pg_stat_*. (The write
*statements* come from pg_stat_statements, which counts at once.)"""


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


async def _create_db(dsn: str, name: str) -> str:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    return dsn.rsplit("/", 1)[0] + "/" + name


async def _up(p: Serve) -> int:
    text = await p.metrics()
    if text is None:
        return -1
    for line in text.splitlines():
        if line.startswith('llmgw_control_nodes{state="up"}'):
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


async def kills(a: argparse.Namespace, pg: PostgresServer, work: Path) -> dict[str, Any]:
    from cp_helpers import AgentProc
    from scenario import h100s, write_scenario

    dsn = await _create_db(pg.dsn, "failover")
    env: dict[str, str] = {}
    token = TOKEN
    if a.route:
        from cp_helpers import TOKEN as token  # (the test's Agent presents it)
        from test_deployments_failover import ROUTER_TOKEN, ROUTER_TOKEN_ENV, Agent, Load, Router, _ok, _ready

        from llmgw.testing import standins

        bin_dir = standins.install(work / "bin")
        env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
               "PYTHONPATH": os.pathsep.join(x for x in (str(standins.PYTHONPATH), os.environ.get("PYTHONPATH", ""))
                                             if x),
               "LLMGW_MIRROR": str(work / "mirror"), ROUTER_TOKEN_ENV: ROUTER_TOKEN}
    procs = [Serve(work, f"cp{i}", dsn, token, lease=a.lease, interval=a.interval, env=env,
                   router_token_env=ROUTER_TOKEN_ENV if a.route else None).start() for i in range(a.serve)]
    agents: list[Any] = []
    failover: list[float] = []
    follow: list[float] = []
    router: Any = None
    load: Any = None
    routed: dict[str, Any] = {}
    try:
        leader = await the_leader(procs, 60)
        control = ",".join(p.address for p in procs)
        for i in range(a.agents):
            if a.route:
                agents.append(Agent(work, f"node-{i}", control, env))
                continue
            scen = write_scenario(work / f"n{i}.json", {"hostname": f"h{i}", "source": "nvml", "gpus": h100s(1, "x")})
            agents.append(AgentProc(control, f"node-{i}", scen, work / f"node-{i}.log", token=TOKEN).start())
        if a.route:
            await wait_until(lambda p=leader: _up_all(p, a.agents), 60, "every agent on the leader")
            status, _, d = await leader.api("POST", "/admin/v1/deployments", {
                "name": "chat", "replicas": a.agents, "model": "stand-in/chat", "engine": "vllm", "gpu_memory": "1GiB"})
            assert status == 201, d
            await wait_until(lambda: _ready(leader, "chat", a.agents), 120, "the deployment's replicas ready")
            router = Router(work, [p.address for p in procs], env)
            await wait_until(lambda: _ok(router.port, "chat"), 60, "the router routing chat")
            load = Load(router.port, "chat")
        for k in range(a.kills):
            leader = await the_leader(procs, 60)
            await wait_until(lambda p=leader: _up_all(p, a.agents), 30, "every agent on the leader")
            others = [p for p in procs if p is not leader]
            t0 = time.monotonic()
            leader.kill()

            async def new_leader(others: list[Serve] = others) -> Serve | None:
                for p in others:
                    if await p.leading():
                        return p
                return None

            new: Serve = await wait_until(new_leader, 10 * a.lease, "a new leader", step=0.02)
            t1 = time.monotonic()
            await wait_until(lambda p=new: _up_all(p, a.agents), 30, "the agents on the new leader", step=0.02)
            t2 = time.monotonic()
            failover.append(t1 - t0)
            follow.append(t2 - t1)
            print(f"kill {k + 1}/{a.kills}: new leader after {t1 - t0:.3f}s, agents back {t2 - t1:.3f}s later",
                  flush=True)
            leader.start()
            await wait_until(lambda p=leader: _answers(p), 60, "the restarted process")
        if load is not None:
            await load.stop()
            launches: dict[str, int] = {}
            for ag in agents:
                for rid, n in ag.launches().items():
                    launches[rid] = launches.get(rid, 0) + n
            routed = {"requests_ok": load.ok, "requests_failed": len(load.failed),
                      "failed_statuses": sorted(set(load.failed)),
                      "replicas_launched_more_than_once": sorted(r for r, n in launches.items() if n > 1)}
            print(f"through the router: {load.ok} requests answered, {len(load.failed)} failed", flush=True)
            load = None
    except BaseException:
        for f in sorted(work.glob("*.log")):
            print(f"== {f.name}\n" + "".join(f.read_text(errors="replace").splitlines(True)[-25:]), file=sys.stderr)
        raise
    finally:
        if load is not None:
            await load.stop()
        if router is not None:
            router.stop()
        for ag in agents:
            ag.stop()
        for p in procs:
            p.stop()
    return {
        **routed,
        "lease_s": a.lease, "serve": a.serve, "agents": a.agents, "kills": len(failover),
        "failover_s": {"median": statistics.median(failover), "p90": pct(failover, 0.9), "max": max(failover),
                       "min": min(failover)},
        "agents_back_after_new_leader_s": {"median": statistics.median(follow), "max": max(follow)},
    }


async def _up_all(p: Serve, n: int) -> bool:
    return await _up(p) >= n


async def _answers(p: Serve) -> bool:
    return await p.leading() is not None


async def _stats(conn: Any, db: str) -> dict[str, Any]:
    """Since the last reset: transactions (pg_stat_database), rows written to llmgw's tables
    (pg_stat_user_tables: not the catalogs autovacuum's ANALYZE writes), and statements by calls."""
    row = await conn.fetchrow("SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = $1", db)
    rows = await conn.fetchval(
        "SELECT COALESCE(sum(n_tup_ins + n_tup_upd + n_tup_del), 0) FROM pg_stat_user_tables")
    by = await conn.fetch(
        "SELECT left(regexp_replace(query, '\\s+', ' ', 'g'), 70) AS q, calls FROM pg_stat_statements s "
        "JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = $1 AND query NOT ILIKE '%pg_stat%' "
        "ORDER BY calls DESC LIMIT 12", db)
    writes = sum(int(r[1]) for r in by if r[0].split(" ", 1)[0].upper() in ("INSERT", "UPDATE", "DELETE"))
    return {"xact": float(row[0]), "rows_written": float(rows), "write_statements": float(writes),
            "by_statement": {r[0]: int(r[1]) for r in by}}


async def _reset(conn: Any) -> None:
    await conn.execute("SELECT pg_stat_reset()")
    await conn.execute("SELECT pg_stat_statements_reset()")
    await asyncio.sleep(0.6)  # (the statistics collector's flush; PostgreSQL 15 writes them on commit + 0.5-1 s)


async def db_load(a: argparse.Namespace, pg: PostgresServer, work: Path) -> dict[str, Any]:
    import asyncpg

    from cluster_scale import ChangingSource
    from llmgw.agent.client import AgentClient

    dsn = await _create_db(pg.dsn, "dbload")
    admin = await asyncpg.connect(pg.dsn.rsplit("/", 1)[0] + "/dbload")
    await admin.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    procs = [Serve(work, f"cp{i}", dsn, TOKEN, lease=a.lease, interval=a.interval).start() for i in range(2)]
    stop = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []
    out: dict[str, Any] = {"fleet": a.fleet, "gpus": 8, "interval_s": a.interval, "lease_s": a.lease}
    try:
        leader = await the_leader(procs, 60)
        targets = [p.address for p in procs]
        clients = [AgentClient(targets, f"node-{i:04d}", TOKEN, ChangingSource(i, 8)) for i in range(a.fleet)]
        await _reset(admin)
        t_start = time.monotonic()
        for i, c in enumerate(clients):
            tasks.append(asyncio.create_task(c.run(stop)))
            if i % 50 == 49:
                await asyncio.sleep(0.05)
        await wait_until(lambda: _up_all(leader, a.fleet), 300, "the whole fleet up", step=0.5)
        await asyncio.sleep(FLUSH)
        reg = await _stats(admin, "dbload")
        out["registration"] = {"seconds": round(time.monotonic() - t_start, 1), **reg}
        if a.replicas:
            # deployments present: a.replicas replicas placed (one GPU each) and kept in the database
            await _reset(admin)
            t_start = time.monotonic()
            status, _, body = await leader.api("POST", "/admin/v1/deployments", {
                "name": "fleet", "model": "bench/model", "engine": "vllm", "replicas": a.replicas,
                "gpu_memory": "1GiB"}, timeout=120)
            assert status == 201, body

            async def placed() -> bool:
                st, _, d = await leader.api("GET", "/admin/v1/deployments/fleet", timeout=30)
                return st == 200 and d["placed"] == a.replicas

            await wait_until(placed, 300, "every replica placed", step=0.5)
            await asyncio.sleep(FLUSH)
            dep = await _stats(admin, "dbload")
            out["placement"] = {"replicas": a.replicas, "seconds": round(time.monotonic() - t_start - FLUSH, 1), **dep}
        await _reset(admin)
        t0 = time.monotonic()
        await asyncio.sleep(a.window)  # (longer than FLUSH: what the window did is in the statistics)
        s = await _stats(admin, "dbload")
        dt = time.monotonic() - t0
        beats = a.fleet * dt / a.interval
        out["steady"] = {
            "window_s": round(dt, 1), "heartbeats_approx": int(beats),
            "transactions_per_s": round(s["xact"] / dt, 2), "rows_written_per_s": round(s["rows_written"] / dt, 3),
            "write_statements_per_s": round(s["write_statements"] / dt, 3), "by_statement": s["by_statement"],
        }
        print(json.dumps(out["steady"]), flush=True)
        # failover with the fleet: the new leader knows every node from the database, so the
        # re-registrations change nothing and write nothing
        await _reset(admin)
        other = next(p for p in procs if p is not leader)
        t0 = time.monotonic()
        leader.kill()
        await wait_until(other.leading, 10 * a.lease, "the standby leading", step=0.05)
        t1 = time.monotonic()
        await wait_until(lambda: _up_all(other, a.fleet), 120, "the fleet on the new leader", step=0.2)
        t2 = time.monotonic()
        await asyncio.sleep(FLUSH)
        f = await _stats(admin, "dbload")
        out["failover_with_fleet"] = {"new_leader_s": round(t1 - t0, 2), "fleet_back_s": round(t2 - t1, 2),
                                      "rows_written": f["rows_written"], "by_statement": f["by_statement"]}
        if a.replicas:
            st, _, d = await other.api("GET", "/admin/v1/deployments/fleet", timeout=30)
            out["failover_with_fleet"]["replicas_on_new_leader"] = d["placed"] if st == 200 else None
        text = await other.metrics()
        out["new_leader_epoch"] = gauge(text or "", "llmgw_control_leader_epoch")
    finally:
        stop.set()
        if tasks:
            await asyncio.wait(tasks, timeout=60)
        await admin.close()
        for p in procs:
            p.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--serve", type=int, default=3, help="llmgw serve processes (failover)")
    ap.add_argument("--agents", type=int, default=2, help="agent processes (failover)")
    ap.add_argument("--lease", type=float, default=None, help="control.lease, seconds (2 failover, 15 db-load)")
    ap.add_argument("--interval", type=float, default=None, help="heartbeat interval (0.2 failover, 5 db-load)")
    ap.add_argument("--route", action="store_true",
                    help="failover: agents run a deployment, a router follows, a client's requests through it are "
                         "counted")
    ap.add_argument("--db-load", action="store_true")
    ap.add_argument("--fleet", type=int, default=1000, help="simulated agents (db-load)")
    ap.add_argument("--window", type=float, default=30.0)
    ap.add_argument("--replicas", type=int, default=None,
                    help="db-load: a deployment of this many replicas placed first (default: one per agent; 0: none)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--keep", type=Path, help="keep the processes' logs in this directory (and log at info)")
    a = ap.parse_args()
    a.lease = a.lease or (15.0 if a.db_load else 2.0)
    a.interval = a.interval or (5.0 if a.db_load else 0.2)
    a.replicas = a.fleet if a.replicas is None else a.replicas
    os.environ.setdefault("LLMGW_LOG_LEVEL", "info" if a.keep else "warning")
    with tempfile.TemporaryDirectory(prefix="llmgw-failover-") as tmp, \
            PostgresServer(preload="pg_stat_statements" if a.db_load else "") as pg:
        import uvloop

        work = Path(tmp)
        if a.keep:
            work = a.keep
            work.mkdir(parents=True, exist_ok=True)
        res = uvloop.run((db_load if a.db_load else kills)(a, pg, work))
    print(json.dumps(res, indent=2))
    if a.json:
        a.json.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
