#!/usr/bin/env python3
"""Bulk placement on a real PostgreSQL: does the leader keep its lease while it places ~1,000 replicas at once?

A leader and a standby (real ``llmgw serve`` processes, ``control.lease`` ``--lease``) on one
database (``llmgw.testing.postgres``), ``--fleet`` simulated agents (the real
:class:`llmgw.agent.client.AgentClient`, in this process, 8 GPUs each, heartbeating every
``--interval`` s on their streams). A deployment of 0 replicas is created, then ``ctl scale``'s
call sets it to ``--replicas`` (one GPU each). Meanwhile:

* the lease row (``llmgw_lease.renewed_at``, the database's clock) is read every 20 ms on a
  connection of this process: the longest gap between two renewals, against the renew period
  (``lease/3``) and the leader's own deadline (``2/3`` of the lease: past it, it steps down);
* the leader's ``/health`` is asked every 5 ms on a kept-alive connection (a thread of its own):
  the slowest answer bounds how long its event loop (where placement, the node map and the
  renewals run) was held;
* the epoch: a takeover during the scale is a failure (the standby led because renewals starved).

Then: seconds until every replica's row is committed, the nodes the leader still has up
(heartbeats not starved past their grace), how many times agents registered again meanwhile
(each one an agent that took the leader's silence for its loss), and the scale call's own time.

    .venv/bin/python bench/bulk_placement.py                      # 200 agents x 8 GPUs, 1,000 replicas
    .venv/bin/python bench/bulk_placement.py --fleet 125 --replicas 1000 --json /tmp/bp.json

Every process it starts is stopped on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "ha"))
sys.path.insert(0, str(ROOT / "tests" / "control"))
sys.path.insert(0, str(HERE))

from serve_helpers import Serve, gauge, the_leader, wait_until  # noqa: E402

from llmgw.testing.postgres import PostgresServer  # noqa: E402

TOKEN = "bench-join-token"


def health_pinger(port: int, stop: threading.Event, out: list[tuple[float, float]]) -> None:
    """(when, seconds) of a GET /health every 5 ms on one kept-alive connection."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(30)
    f = sock.makefile("rb")
    req = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
    try:
        while not stop.is_set():
            t0 = time.perf_counter()
            sock.sendall(req)
            length = 0
            while True:
                line = f.readline()
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
                if line in (b"\r\n", b""):
                    break
            f.read(length)
            out.append((time.monotonic(), time.perf_counter() - t0))
            time.sleep(0.005)
    finally:
        sock.close()


async def _up(p: Serve) -> int:
    st, _, body = await p.api("GET", "/admin/v1/nodes", timeout=30)
    return sum(1 for n in body.get("nodes", []) if n.get("state") == "up") if st == 200 else 0


async def run(a: argparse.Namespace, pg: PostgresServer, work: Path) -> dict[str, Any]:
    import asyncpg

    from cluster_scale import ChangingSource
    from llmgw.agent.client import AgentClient

    conn0 = await asyncpg.connect(pg.dsn)
    await conn0.execute("CREATE DATABASE bulk")
    await conn0.close()
    dsn = pg.dsn.rsplit("/", 1)[0] + "/bulk"
    watch = await asyncpg.connect(dsn)
    count = await asyncpg.connect(dsn)  # (one connection each: the lease watch runs meanwhile)
    procs = [Serve(work, f"cp{i}", dsn, TOKEN, lease=a.lease, interval=a.interval).start() for i in range(2)]
    stop = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []
    out: dict[str, Any] = {"fleet": a.fleet, "gpus_per_agent": 8, "replicas": a.replicas, "lease_s": a.lease,
                           "renew_every_s": round(a.lease / 3, 3), "deadline_s": round(a.lease * 2 / 3, 3),
                           "interval_s": a.interval}
    pings: list[tuple[float, float]] = []
    ping_stop = threading.Event()
    pinger: threading.Thread | None = None
    try:
        leader = await the_leader(procs, 60)
        targets = [p.address for p in procs]
        clients = [AgentClient(targets, f"node-{i:04d}", TOKEN, ChangingSource(i, 8)) for i in range(a.fleet)]
        for i, c in enumerate(clients):
            tasks.append(asyncio.create_task(c.run(stop)))
            if i % 50 == 49:
                await asyncio.sleep(0.05)
        await wait_until(lambda: _up(leader) if leader.alive() else 0, 300, "the whole fleet up", step=0.5)
        while await _up(leader) < a.fleet:
            await asyncio.sleep(0.5)
        status, _, body = await leader.api("POST", "/admin/v1/deployments", {
            "name": "bulk", "model": "bench/model", "engine": "vllm", "replicas": 0, "gpu_memory": "1GiB"})
        assert status == 201, body
        epoch0 = gauge(await leader.metrics() or "", "llmgw_control_leader_epoch")
        await asyncio.sleep(2 * a.interval)
        pinger = threading.Thread(target=health_pinger, args=(leader.admin, ping_stop, pings), daemon=True)
        pinger.start()
        renewals: list[tuple[float, float, int]] = []  # (our monotonic, renewed_at, epoch)

        async def watch_lease() -> None:
            last = None
            while True:
                row = await watch.fetchrow("SELECT renewed_at, epoch FROM llmgw_lease WHERE name = 'control'")
                if row is not None and row[0] != last:
                    last = row[0]
                    renewals.append((time.monotonic(), float(row[0]), int(row[1])))
                await asyncio.sleep(0.02)

        watcher = asyncio.create_task(watch_lease())
        await asyncio.sleep(2 * a.lease)  # a baseline of renewals before the scale
        regs0 = sum(c.registrations for c in clients)
        t_scale = time.monotonic()
        status, _, body = await leader.api("POST", "/admin/v1/deployments/bulk/scale", {"replicas": a.replicas},
                                           timeout=120)
        call_s = time.monotonic() - t_scale
        assert status == 200, body
        t_all = None
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            n = await count.fetchval("SELECT count(*) FROM llmgw_replicas")
            if n >= a.replicas:
                t_all = time.monotonic()
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(2 * a.lease)  # (what placement's aftermath does: the nodes told, their answers)
        t_end = time.monotonic()
        watcher.cancel()
        ping_stop.set()
        pinger.join(30)
        during = [r for r in renewals if r[0] >= t_scale - a.lease / 3]
        gaps = [b[1] - a_[1] for a_, b in itertools.pairwise(during)]
        before = [r for r in renewals if r[0] < t_scale]
        base_gaps = [b[1] - a_[1] for a_, b in itertools.pairwise(before)]
        epochs = sorted({r[2] for r in renewals})
        hp = [s for w, s in pings if t_scale <= w <= t_end]
        hb = [s for w, s in pings if w < t_scale]
        up_after = await _up(leader) if leader.alive() else 0
        out.update({
            "scale_call_s": round(call_s, 3),
            "all_rows_committed_s": round(t_all - t_scale, 2) if t_all is not None else None,
            "renewal_gap_s_before": {"median": round(statistics.median(base_gaps), 3) if base_gaps else None,
                                     "max": round(max(base_gaps), 3) if base_gaps else None},
            "renewal_gap_s_during": {"median": round(statistics.median(gaps), 3) if gaps else None,
                                     "max": round(max(gaps), 3) if gaps else None, "n": len(gaps),
                                     "late": sum(1 for g in gaps if g > a.lease / 3 * 1.5)},
            "epochs_seen": epochs, "epoch_before": epoch0, "took_over": len(epochs) > 1,
            "health_ms_before": {"median": round(1000 * statistics.median(hb), 2) if hb else None,
                                 "max": round(1000 * max(hb), 2) if hb else None},
            "health_ms_during": {"median": round(1000 * statistics.median(hp), 2) if hp else None,
                                 "max": round(1000 * max(hp), 2) if hp else None, "n": len(hp)},
            "nodes_up_after": up_after,
            "agents_registered_again": sum(c.registrations for c in clients) - regs0,
            "leader_log_stepped_down": "stopped leading" in leader.stderr(),
        })
    finally:
        ping_stop.set()
        stop.set()
        if tasks:
            await asyncio.wait(tasks, timeout=60)
        await watch.close()
        await count.close()
        for p in procs:
            p.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fleet", type=int, default=200, help="simulated agents (8 GPUs each)")
    ap.add_argument("--replicas", type=int, default=1000, help="the scale (at most 1024: the API's limit)")
    ap.add_argument("--lease", type=float, default=3.0, help="control.lease, seconds")
    ap.add_argument("--interval", type=float, default=1.0, help="heartbeat interval, seconds")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--keep", type=Path, help="keep the processes' logs in this directory")
    a = ap.parse_args()
    os.environ.setdefault("LLMGW_LOG_LEVEL", "info" if a.keep else "warning")
    with tempfile.TemporaryDirectory(prefix="llmgw-bulk-") as tmp, PostgresServer() as pg:
        import uvloop

        work = Path(tmp)
        if a.keep is not None:
            work = a.keep
            work.mkdir(parents=True, exist_ok=True)
        res = uvloop.run(run(a, pg, work))
    print(json.dumps(res, indent=2))
    if a.json:
        a.json.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
