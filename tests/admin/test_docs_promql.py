"""Every PromQL query the docs give, evaluated by a real Prometheus scraping a real gateway.

The gateway runs a control plane with an in-process agent reporting two GPUs, in front of
an engine whose queue keeps its pool saturated, so requests wait in the admission queue.
Every expression of a ```` ```promql ```` block in ``docs/metrics.md``, ``docs/control-plane.md``
and ``docs/operations.md`` must evaluate; and "was the cluster full when requests queued?"
must mean what the docs say: the GPUs' mean utilisation at the moments requests waited,
and no value while nothing waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from admin_helpers import Engine, admin_port, chat, client_port, running
from prom_helpers import prometheus, scrapes

from llmgw.agent.client import AgentClient
from llmgw.agent.model import GPU, Discovery, NodeFacts
from ports import free_port

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "docs" / n for n in ("metrics.md", "control-plane.md", "operations.md")]
TOKEN = "join-token-for-docs-promql"
CLUSTER_FULL = "avg(llmgw_gpu_utilization_ratio) and on () sum(llmgw_admission_queue_depth) > 0"
pytestmark = [pytest.mark.needs_tool("prometheus", install="apt-get install prometheus"), pytest.mark.timeout(150)]


def doc_queries(text: str) -> list[str]:
    """The expressions of the ```promql blocks: ``#`` lines are comments, a trailing ``  # ...`` too,
    and an indented line continues the expression above it."""
    out: list[str] = []
    for block in re.findall(r"```promql\n(.*?)```", text, re.S):
        for line in block.splitlines():
            line = re.sub(r"\s{2,}#.*$", "", line).rstrip()
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            if line[0].isspace() and out:
                out[-1] += " " + line.strip()
            else:
                out.append(line.strip())
    return out


class TwoGPUs:
    """A node with two GPUs at 0.5 and 0.7 utilisation (the agent's source); ``xid``: GPU 0's XID events."""

    name = "nvml"

    def __init__(self) -> None:
        self.xid: tuple[tuple[int, int], ...] = ()

    def read(self) -> Discovery:
        return Discovery(
            facts=NodeFacts(hostname="host-q", cpu_cores=8, agent_version="test"),
            gpus=tuple(GPU(uuid=f"GPU-q000000{i}-0000-4000-8000-000000000000", index=i, name="NVIDIA H100 80GB HBM3",
                           memory_total_bytes=80 << 30, memory_used_bytes=40 << 30, utilization_gpu_ratio=u,
                           xid_errors=self.xid if i == 0 else ())
                       for i, u in enumerate((0.5, 0.7))),
            source="nvml",
        )

    def close(self) -> None:
        pass


def _get(port: int, path: str, **params: Any) -> dict[str, Any]:
    url = f"http://127.0.0.1:{port}{path}?" + urllib.parse.urlencode(params)
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        if exc.code == 503:
            raise ConnectionError("prometheus not ready") from None
        return json.loads(exc.read())


def _instant(port: int, expr: str) -> list[dict[str, Any]]:
    body = _get(port, "/api/v1/query", query=expr)
    assert body["status"] == "success", (expr, body.get("error"))
    return body["data"]["result"]


async def _until(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if await asyncio.to_thread(cond):
                return
        except (OSError, ValueError, AssertionError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.25)


def test_the_docs_have_queries() -> None:
    qs = [q for d in DOCS for q in doc_queries(d.read_text())]
    assert len(qs) >= 12 and CLUSTER_FULL in qs and "llmgw_gpu_xid_errors_total > 0" in qs
    # (a continued expression is one query)
    assert any(q.startswith("sum by (model) (rate(llmgw_requests_total{status_class=\"5xx\"}") and "> 0.01" in q
               for q in qs)


async def test_every_documented_query_evaluates_in_prometheus(tmp_path: Path) -> None:
    cport = free_port()
    control = {"listen": f"127.0.0.1:{cport}", "join_token": TOKEN, "heartbeat_interval": "200ms",
               "database": "sqlite::memory:"}
    # the engine's page says 2 waiting: past max_waiting 1, the pool is full and requests queue
    async with running([Engine("a")], control=control, saturation={"max_waiting": 1},
                       admission={"queue_timeout": "4s"}) as rt:
        stop = asyncio.Event()
        source = TwoGPUs()
        agent = asyncio.create_task(AgentClient(f"127.0.0.1:{cport}", "node-q", TOKEN, source).run(stop))
        try:
            async with prometheus(tmp_path, admin_port(rt)) as pport:
                await _until(lambda: len(_instant(pport, "llmgw_gpu_utilization_ratio")) == 2, 60, "the GPUs scraped")
                assert _instant(pport, CLUSTER_FULL) == []  # nothing waits yet: no value (not 0)
                t0 = time.time()
                waiting = [asyncio.create_task(chat(client_port(rt))) for _ in range(3)]
                await _until(lambda: _instant(pport, "sum(llmgw_admission_queue_depth) > 0"), 20, "a queue scraped")
                full = _instant(pport, CLUSTER_FULL)
                assert [float(r["value"][1]) for r in full] == [pytest.approx(0.6)]
                assert set(await asyncio.gather(*waiting)) == {429}  # (shed at queue_timeout: the pool stayed full)
                await _until(lambda: not _instant(pport, CLUSTER_FULL), 20, "the drained queue scraped")
                # over the incident: a value at each scrape that saw requests waiting, the GPUs' mean
                rng = _get(pport, "/api/v1/query_range", query=CLUSTER_FULL, start=t0 - 5, end=time.time(), step=1)
                assert rng["status"] == "success"
                values = [float(v) for r in rng["data"]["result"] for _, v in r["values"]]
                assert values and values == [pytest.approx(0.6)] * len(values), values

                # a GPU's first XID: its series appears at 1. increase() reads 0 over it (the trap the docs
                # name); the documented query finds it
                source.xid = ((79, 1),)
                await _until(lambda: _instant(pport, "llmgw_gpu_xid_errors_total"), 20, "the XID scraped")
                seen = await asyncio.to_thread(scrapes, pport)
                await _until(lambda: scrapes(pport) >= seen + 2, 20, "two more scrapes")
                assert [float(r["value"][1]) for r in _instant(pport, "increase(llmgw_gpu_xid_errors_total[1m])")] == [0.0]
                found = _instant(pport, "llmgw_gpu_xid_errors_total > 0")
                assert [(r["metric"]["gpu_index"], r["metric"]["xid"], float(r["value"][1])) for r in found] == [
                    ("0", "79", 1.0)]

                queries = [q for d in DOCS for q in doc_queries(d.read_text())]
                for q in queries:
                    _instant(pport, q)  # (asserts it evaluates)
        finally:
            stop.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(agent, 10)
