"""A real Prometheus for the admin tests: started on a free port scraping one llmgw admin listener every
second (its own data directory under the test's tmp_path), queried over its HTTP API, always stopped.

Needs the ``prometheus`` binary (Debian/Ubuntu: ``apt-get install prometheus``; elsewhere the release
tarball from prometheus.io); tests using it carry ``needs_tool("prometheus", ...)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from ports import free_port

__all__ = ["PROMETHEUS", "prometheus", "query", "scrapes", "until"]

PROMETHEUS = shutil.which("prometheus")


def query(port: int, expr: str) -> dict[str, Any]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]
    except urllib.error.HTTPError as exc:  # a bad query is a 400 with the error in the body
        if exc.code == 503:  # still starting (its TSDB not open yet): "Service Unavailable", not JSON
            raise ConnectionError(f"prometheus not ready: {exc.code}") from None
        return json.loads(exc.read())  # type: ignore[no-any-return]


async def until(cond: Any, timeout: float, what: str = "prometheus to get there") -> None:
    """Poll ``cond`` (run in a thread; an OSError counts as not yet) until truthy; bounded."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            if await asyncio.to_thread(cond):
                return
        except OSError:
            pass
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(0.25)


def scrapes(port: int) -> float:
    """How many scrapes of the llmgw job Prometheus has recorded in the last 5 minutes."""
    result = query(port, 'count_over_time(up{job="llmgw"}[5m])')["data"]["result"]
    return float(result[0]["value"][1]) if result else 0.0


@contextlib.asynccontextmanager
async def prometheus(tmp_path: Path, target_port: int, stderr: Any = subprocess.DEVNULL) -> AsyncIterator[int]:
    """A Prometheus scraping ``127.0.0.1:target_port`` every second, for the block: its port."""
    assert PROMETHEUS is not None
    port = free_port()
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: llmgw\n    static_configs: [{{targets: ['127.0.0.1:{target_port}']}}]\n"
    )
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=stderr,
    )
    try:
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
