#!/usr/bin/env python3
"""The cluster scrape's cost on the event loop, in one process: N nodes x G GPUs, a fresh reading each.

Builds a real :class:`llmgw.control.nodes.NodeMap` and
:class:`llmgw.control.collector.ClusterCollector`, then, ``--rounds`` times: every node
gets a heartbeat whose readings all changed (the worst case for the per-node cache, and
what ``bench/cluster_scale.py``'s agents send), and ``/metrics``' cluster part is
rendered (``render_parts``, OpenMetrics unless ``--plain``) on a uvloop loop. Reports,
per scrape: the thread's CPU (``time.thread_time``: the main thread's cost in
``llmgw serve``), the wall time, the longest stretch between two yields to the loop
(the hold), the page's size and samples. ``--profile`` prints a cProfile of the renders.

    .venv/bin/python bench/cluster_render.py                    # 1000 x 8, 7 rounds
    .venv/bin/python bench/cluster_render.py --profile --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster_scale import ChangingSource
from llmgw.agent.wire import discovery_to_proto
from llmgw.control.collector import ClusterCollector
from llmgw.control.nodes import NodeMap
from llmgw.control.service import ControlStats


class _Holds:
    """The longest stretch the loop ran one callback (a 0.5 ms ticker measures the gaps)."""

    def __init__(self) -> None:
        self.worst = 0.0
        self.stop = False

    async def run(self) -> None:
        last = time.perf_counter()
        while not self.stop:
            await asyncio.sleep(0)
            t = time.perf_counter()
            self.worst = max(self.worst, t - last)
            last = t


async def run(a: argparse.Namespace) -> dict[str, Any]:
    nodes = NodeMap(lambda: 15.0)
    sources = [ChangingSource(i, a.gpus) for i in range(a.nodes)]
    ids = []
    for i, src in enumerate(sources):
        st, _ = nodes.register(f"node-{i:04d}", peer="ipv4:127.0.0.1:1", agent_version="bench", protocol=(1, 2),
                               discovery=discovery_to_proto(src.read()))
        ids.append(st.node_id)
    col = ClusterCollector(nodes, ControlStats())
    cpu, wall, holds, size, samples = [], [], [], 0, 0
    prof = None
    if a.profile:
        import cProfile

        prof = cProfile.Profile()
    for r in range(a.rounds + 1):
        for i, src in enumerate(sources):  # every reading changed (as in bench/cluster_scale.py)
            if r == 0 or i < a.changed * a.nodes:
                nodes.heartbeat(ids[i], r + 1, discovery_to_proto(src.read()))
        h = _Holds()
        ticker = asyncio.create_task(h.run())
        await asyncio.sleep(0)
        if prof is not None and r:
            prof.enable()
        c0, w0 = time.thread_time(), time.perf_counter()
        parts = await col.render_parts(openmetrics=not a.plain)
        c1, w1 = time.thread_time(), time.perf_counter()
        if prof is not None:
            prof.disable()
        h.stop = True
        await ticker
        page = b"".join(parts)
        if r == 0:
            continue  # the first render also warms the caches of the process
        cpu.append(c1 - c0)
        wall.append(w1 - w0)
        holds.append(h.worst)
        size = len(page)
        samples = page.count(b"\n") - page.count(b"\n#") - page.startswith(b"#")
    if prof is not None:
        import pstats

        pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    if a.dump:
        a.dump.write_bytes(page)
    return {
        "nodes": a.nodes, "gpus_per_node": a.gpus, "changed": a.changed, "rounds": a.rounds, "format": "text" if a.plain else "openmetrics",
        "page_bytes": size, "samples": samples, "rebuilt": col.rebuilt,
        "cpu_ms": {"median": round(1000 * statistics.median(cpu), 2), "min": round(1000 * min(cpu), 2),
                   "max": round(1000 * max(cpu), 2)},
        "wall_ms_median": round(1000 * statistics.median(wall), 2),
        "longest_hold_ms": {"median": round(1000 * statistics.median(holds), 3), "max": round(1000 * max(holds), 3)},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--changed", type=float, default=1.0,
                    help="the fraction of nodes that heartbeat between two scrapes (1: all, as with 15 s scrapes)")
    ap.add_argument("--plain", action="store_true", help="Prometheus text 0.0.4 (default: OpenMetrics)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--dump", type=Path, help="write the last page here")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    import uvloop

    res = uvloop.run(run(a))
    print(json.dumps(res, indent=2))
    if a.json:
        a.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
