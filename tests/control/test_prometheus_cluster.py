"""A real Prometheus scraping a gateway with a control plane and two agents as real processes.

Prometheus asks for OpenMetrics: the cluster's families must come through that way, the
"absent is not zero" rule must survive into PromQL (a MIG GPU's utilisation is no series at
all, never 0), and the dashboard's Cluster row must show numbers.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from cp_helpers import TOKEN, AgentProc, api, control_runtime, free_port, wait_for
from scenario import h100s, write_scenario

PROMETHEUS = shutil.which("prometheus")
pytestmark = [pytest.mark.needs_tool("prometheus", install="apt-get install prometheus"),
              pytest.mark.timeout(120)]
DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "llmgw.json"


def _query(port: int, expr: str) -> list[dict[str, Any]]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            body = json.loads(r.read())
    except urllib.error.HTTPError as exc:
        body = json.loads(exc.read())
    assert body["status"] == "success", (expr, body.get("error"))
    return body["data"]["result"]  # type: ignore[no-any-return]


def _values(port: int, expr: str, by: str) -> dict[str, float]:
    return {r["metric"].get(by, ""): float(r["value"][1]) for r in _query(port, expr)}


async def test_a_real_prometheus_scrapes_the_cluster(tmp_path: Path) -> None:
    port = free_port()
    mig = {"hostname": "host-m", "source": "nvml",
           "gpus": [{"uuid": "GPU-m0000000-0000-4000-8000-000000000000", "index": 0, "name": "NVIDIA A100-SXM4-80GB",
                     "mig_mode": True, "memory_total_bytes": 85899345920, "memory_used_bytes": 0}]}
    specs = {"node-a": {"hostname": "host-a", "source": "nvml", "gpus": h100s(2, "a")}, "node-m": mig}
    async with control_runtime(port) as rt:
        procs = [AgentProc(port, name, write_scenario(tmp_path / f"{name}.json", spec), tmp_path / f"{name}.log",
                           token=TOKEN).start() for name, spec in specs.items()]
        prom: subprocess.Popen[bytes] | None = None
        try:
            async def both_up() -> bool:
                _, body = await api(rt, "GET", "/admin/v1/nodes")
                return sum(n["state"] == "up" and n["heartbeats"] >= 1 for n in body["nodes"]) == 2

            await wait_for(both_up, what="both nodes up")
            pport = free_port()
            assert rt.admin_addr is not None
            cfg = tmp_path / "prometheus.yml"
            cfg.write_text(
                "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
                "scrape_configs:\n"
                f"  - job_name: llmgw\n    static_configs: [{{targets: ['127.0.0.1:{rt.admin_addr[1]}']}}]\n"
            )
            assert PROMETHEUS is not None
            prom = subprocess.Popen(
                [PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'data'}",
                 f"--web.listen-address=127.0.0.1:{pport}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )

            def scraped() -> bool:
                try:
                    return _values(pport, 'up{job="llmgw"}', "job").get("llmgw") == 1.0 and bool(
                        _query(pport, "llmgw_gpu_memory_total_bytes"))
                except (OSError, ValueError, AssertionError):  # starting: refused, or not JSON yet
                    return False

            await wait_for(lambda: asyncio.to_thread(scraped), timeout=60, what="prometheus scraping the cluster")
            assert _values(pport, "llmgw_node_up", "node") == {"node-a": 1.0, "node-m": 1.0}
            assert set(_values(pport, "llmgw_gpu_utilization_ratio", "gpu_uuid")) == {
                "GPU-a0000000-0000-4000-8000-000000000000", "GPU-a0000001-0000-4000-8000-000000000000"}
            assert _values(pport, 'llmgw_gpu_utilization_ratio{node="node-m"}', "node") == {}  # absent, not 0
            assert _values(pport, 'llmgw_gpu_memory_used_bytes{node="node-m"}', "node") == {"node-m": 0.0}
            assert _query(pport, "llmgw_gpu_energy_joules_total")  # a counter, through OpenMetrics
            # the dashboard's Cluster row: every expression on llmgw_node_/llmgw_gpu_ families has data
            exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p.get("targets", [])
                     if "llmgw_gpu_" in t.get("expr", "") or "llmgw_node_" in t.get("expr", "")]
            assert exprs
            for expr in exprs:
                expr = expr.replace("$__rate_interval", "1m")
                res = _query(pport, expr)
                if "increase(" not in expr:  # ECC/XID increases are legitimately empty or 0 here
                    assert res, expr
        finally:
            if prom is not None:
                prom.terminate()
                try:
                    prom.wait(10)
                except subprocess.TimeoutExpired:
                    prom.kill()
            for p in procs:
                p.stop()
