"""A served model's first tokens show in ``rate()``: ``llmgw_tokens_total`` starts at 0.

Prometheus reads no increase over a counter series' first sample: a series that appears
at 7 (the first answer's completion tokens) has ``increase()`` 0. Real gateway and engine
on loopback sockets, a real Prometheus scraping the admin ``/metrics``, the official
OpenAI SDK's single request between scrapes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from admin_helpers import Engine, admin_port, client_port, families, http, running, sample
from prom_helpers import prometheus, query, scrapes, until

pytestmark = pytest.mark.needs_tool("prometheus", install="apt-get install prometheus")


async def test_the_first_answers_tokens_show_in_increase(tmp_path: Path) -> None:
    from openai import AsyncOpenAI

    async with running([Engine("a")]) as rt:
        # before any answer: each served model's tokens, at 0 (not "No data")
        _, _, body = await http(admin_port(rt), "GET", "/metrics")
        fams = families(body.decode())
        assert sample(fams, "llmgw_tokens_total", model="m", kind="prompt") == 0
        assert sample(fams, "llmgw_tokens_total", model="m", kind="completion") == 0
        assert sample(fams, "llmgw_tokens_total", model="(unknown)") is None
        # and a client gone before an answer: status class none, with no replica (its first shows in rate())
        assert sample(fams, "llmgw_requests_total", model="m", replica="", status_class="none") == 0
        assert sample(fams, "llmgw_requests_total", model="m", replica="a", status_class="none") is None

        async with prometheus(tmp_path, admin_port(rt)) as port:
            await until(lambda: scrapes(port) >= 2, 60)
            client = AsyncOpenAI(base_url=f"http://127.0.0.1:{client_port(rt)}/v1", api_key="unused", max_retries=0)
            try:
                out = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
                assert out.usage is not None and out.usage.completion_tokens == 7
            finally:
                await client.close()
            seen = scrapes(port)
            await until(lambda: scrapes(port) >= seen + 2, 30)
            res = query(port, 'increase(llmgw_tokens_total{model="m",kind="completion"}[1m])')
            assert res["status"] == "success", res
            assert [float(r["value"][1]) for r in res["data"]["result"]] == [pytest.approx(7, rel=0.5)]  # (extrapolated)
