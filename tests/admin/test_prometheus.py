"""A real Prometheus scraping a real gateway, the dashboard's queries evaluated by it.

The test starts Debian's ``prometheus`` (``.ci/run`` installs the package) on a
free loopback port with its own data directory, pointed at the gateway's admin
``/metrics``; traffic comes from the official OpenAI SDK. Every expression of
``deploy/grafana/llmgw.json`` must evaluate without error, and the panels an
operator reads first must show numbers, not "No data": the error ratio of a
healthy model is 0.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from admin_helpers import Engine, admin_port, client_port, running
from prom_helpers import PROMETHEUS
from prom_helpers import query as _query
from prom_helpers import scrapes as _scrapes
from prom_helpers import until as _until
from test_admin_grafana import DASHBOARD, queries

from ports import free_port as _free_port

pytestmark = pytest.mark.needs_tool("prometheus", install="apt-get install prometheus")


def _instant(expr: str) -> str:
    """A dashboard expression as Prometheus can run it: Grafana's variables filled in."""
    return expr.replace("$__rate_interval", "1m").replace("$model", ".*").replace("$replica", ".*")


async def test_dashboard_queries_evaluated_by_a_real_prometheus(tmp_path: Path) -> None:
    from openai import AsyncOpenAI

    a, b = Engine("a"), Engine("b")
    async with running([a, b]) as rt:
        port = _free_port()
        cfg = tmp_path / "prometheus.yml"
        cfg.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "scrape_configs:\n"
            f"  - job_name: llmgw\n    static_configs: [{{targets: ['127.0.0.1:{admin_port(rt)}']}}]\n"
        )
        assert PROMETHEUS is not None
        proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        try:
            await _until(lambda: _scrapes(port) >= 2, 60)
            # traffic between scrapes, as in life: rate() sees it
            client = AsyncOpenAI(base_url=f"http://127.0.0.1:{client_port(rt)}/v1", api_key="unused", max_retries=0)
            try:
                for _ in range(4):
                    out = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
                    assert out.usage is not None and out.usage.completion_tokens == 7
                stream = await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}], stream=True
                )
                async for _ in stream:
                    pass
            finally:
                await client.close()
            seen = _scrapes(port)
            await _until(lambda: _scrapes(port) >= seen + 2, 30)
            up = _query(port, 'up{job="llmgw"}')["data"]["result"]
            assert up and up[0]["value"][1] == "1"

            exprs = queries(json.loads(DASHBOARD.read_text()))
            assert len(exprs) >= 20
            for expr in exprs:
                if "label_values(" in expr:  # a Grafana variable query, not PromQL
                    continue
                res = _query(port, _instant(expr))
                assert res["status"] == "success", (expr, res.get("error"))

            # the error-ratio panel: 0 for the healthy model, not "No data"
            ratio = next(e for e in exprs if 'status_class="5xx"' in e and "/" in e)
            result = _query(port, _instant(ratio))["data"]["result"]
            assert [(r["metric"]["model"], float(r["value"][1])) for r in result] == [("m", 0.0)]
            # the documented alert: no breaker open
            assert _query(port, "llmgw_endpoint_breaker_open == 1")["data"]["result"] == []
            # requests as the SDK made them, counted
            total = _query(port, 'sum(llmgw_requests_total{model="m",status_class="2xx"})')["data"]["result"]
            assert float(total[0]["value"][1]) == 5
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
            assert proc.stderr is not None
            proc.stderr.close()
