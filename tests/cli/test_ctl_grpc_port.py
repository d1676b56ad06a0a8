"""``--admin`` given a gRPC port (``control.listen``) instead of the admin listener: one line that says so
and names the fix, for ``llmgw ctl`` (exit 1, nothing on stdout, ``--json`` too) and ``llmgw console``.

It used to read "cannot reach the admin API at ... (it answered in HTTP/2 frames ...; is llmgw serve
running? ...)": the port was reached, and the gateway was running. A real gRPC server on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from llmgw.console.client import AdminClient, NotAdminAPI

pytestmark = pytest.mark.timeout(60)

LLMGW = Path(sys.executable).with_name("llmgw")


@pytest.fixture(scope="module")
def grpc_url() -> Iterator[str]:
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop(None)


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_ctl_names_the_grpc_port_and_the_fix(grpc_url: str, json_flag: list[str]) -> None:
    proc = subprocess.run([str(LLMGW), "ctl", *json_flag, "--admin", grpc_url, "nodes"], capture_output=True,
                          text=True, timeout=30, env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"})
    assert proc.returncode == 1
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert lines == [f"llmgw: error: {grpc_url} is a gRPC port, such as control.listen, not the admin "
                     "listener: pass the admin address (admin: in the config) with --admin URL"], proc.stderr
    assert "is llmgw serve running" not in proc.stderr


def test_the_console_s_client_says_it_is_no_admin_api(grpc_url: str) -> None:
    async def go() -> NotAdminAPI:
        with pytest.raises(NotAdminAPI) as info:
            await AdminClient(grpc_url, timeout=5).get("/admin/v1/endpoints")
        return info.value

    err = asyncio.run(go())
    assert str(err).startswith(f"{grpc_url} is a gRPC port, such as control.listen, not the admin listener")
    assert "--admin URL" in str(err)
