"""``llmgw ctl`` against a running gateway (CliRunner in a thread, and one real subprocess)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from admin_helpers import Engine, admin_port, client_port, config_for, gone, running, wait_for
from click.testing import CliRunner, Result

from canary import secret
from llmgw.admin.summary import reload_summary
from llmgw.cli.ctl import ctl
from llmgw.config import load_file


async def invoke(*args: str, env: dict[str, str] | None = None) -> Result:
    # The gateway runs on this loop; the command's blocking HTTP runs in a thread.
    return await asyncio.to_thread(CliRunner().invoke, ctl, list(args), env=env, catch_exceptions=False)


def url(rt: Any) -> str:
    return f"http://127.0.0.1:{admin_port(rt)}"


async def test_endpoints_table_and_json() -> None:
    a, dark = Engine("a"), Engine("dark", page=None)
    async with running([a, dark], more=[gone()]) as rt:
        assert rt.registry is not None
        eps = rt.registry.endpoints
        await wait_for(lambda: eps["a"].scrape_ok > 0 and eps["dark"].scrape_failures > 0
                       and eps["gone"].scrape_failures > 0)
        res = await invoke("--admin", url(rt), "endpoints")
        assert res.exit_code == 0, res.output
        lines = res.output.splitlines()
        assert lines[0].split() == [
            "ID", "MODEL", "ENGINE", "POOL", "STATE", "INFLIGHT", "WAITING", "RUNNING", "KV", "DRAIN", "RATE",
        ]
        rows = {line.split()[0]: line.split() for line in lines[1:]}
        assert rows["a"] == ["a", "m", "vllm", "gpu", "ok", "0", "2", "3", "25%", "–"]
        # absent is –, never 0: an engine without a metrics page, and one that cannot be reached
        assert rows["dark"] == ["dark", "m", "vllm", "gpu", "ok", "0", "–", "–", "–", "–"]
        # (its scrapes are refused: down, so STATE says why nothing goes to it)
        assert rows["gone"] == ["gone", "m", "vllm", "gpu", "unreachable", "0", "–", "–", "–", "–"]

        res = await invoke("endpoints", "--json", env={"LLMGW_ADMIN": url(rt)})
        assert res.exit_code == 0, res.output
        data = json.loads(res.stdout)
        assert {e["id"] for e in data["endpoints"]} == {"a", "dark", "gone"}


async def test_drain_undrain_queues() -> None:
    a = Engine("a")
    async with running([a]) as rt:
        assert rt.registry is not None
        res = await invoke("--admin", url(rt), "drain", "a")
        assert res.exit_code == 0, res.output
        assert res.output == "a: draining: no new requests\n"
        assert rt.registry.endpoints["a"].draining
        res = await invoke("--admin", url(rt), "drain", "a")
        assert "already draining" in res.output
        res = await invoke("--admin", url(rt), "undrain", "a", "--json")
        assert res.exit_code == 0 and json.loads(res.stdout)["draining"] is False
        assert not rt.registry.endpoints["a"].draining
        res = await invoke("--admin", url(rt), "drain", "nope")
        assert res.exit_code == 1
        assert res.output == "llmgw: error: no endpoint 'nope'; llmgw ctl endpoints (GET /admin/v1/endpoints) lists them\n"
        res = await invoke("--admin", url(rt), "queues")
        assert res.exit_code == 0, res.output
        lines = res.output.splitlines()
        assert lines[0].split() == ["BAND", "DEPTH", "ADMITTED", "QUEUED", "REJECTED"]
        assert [line.split()[0] for line in lines[1:4]] == list(rt.config.admission.bands)  # type: ignore[attr-defined]
        assert lines[-1].startswith("saturation: m ")


async def test_reload(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    a, b = Engine("a"), Engine("b")
    await a.start()
    await b.start()
    conf = tmp_path / "llmgw.yaml"
    conf.write_text(yaml.safe_dump(config_for([a])))
    try:
        async with running([], config=load_file(conf)) as rt:
            conf.write_text(yaml.safe_dump(config_for([a, b])))
            res = await invoke("--admin", url(rt), "reload")
            assert res.exit_code == 0, res.output
            assert res.output == "configuration reloaded: added endpoint b\n"
            # a model's settings and a section changed: named (QA: a strategy change said nothing had)
            conf.write_text(yaml.safe_dump({**config_for([a, b]), "models": {"m": {"aliases": ["mm"]}},
                                            "routing": {"strategy": "least_inflight"}}))
            res = await invoke("--admin", url(rt), "reload")
            assert res.output == "configuration reloaded: changed the settings of model m; changed routing\n", res.output
            res = await invoke("--admin", url(rt), "reload")
            assert res.output == "configuration reloaded: nothing changed\n", res.output
            # a key that needs a restart: not said to be nothing, nor a change of a section reload after reload
            conf.write_text(yaml.safe_dump({**config_for([a, b]), "models": {"m": {"aliases": ["mm"]}},
                                            "routing": {"strategy": "least_inflight"}, "listen": "127.0.0.1:1"}))
            for _ in range(2):
                res = await invoke("--admin", url(rt), "reload")
                assert res.output.splitlines()[0] == (
                    "configuration reloaded: nothing changed that applies without a restart"), res.output
                assert "listen changed; that needs a restart" in res.output, res.output
            # an answer from an llmgw that does not name them claims nothing more than it knows
            assert reload_summary({"added": [], "removed": [], "changed": []}) == (
                "configuration reloaded: no endpoint or deployment changed")
            conf.write_text(yaml.safe_dump({**config_for([a]), "listen": "nowhere"}))
            res = await invoke("--admin", url(rt), "reload")
            assert res.exit_code == 1
            assert res.output.startswith("llmgw: error: reload failed, the running configuration is kept: ")
            assert "listen" in res.output and len(res.output.splitlines()) == 1
            # the server's log says why too, as for SIGHUP (QA: only the caller heard it)
            assert any(r.levelname == "ERROR" and "reload (api) failed, keeping the running configuration" in
                       r.getMessage() and "listen" in r.getMessage() for r in caplog.records), caplog.text
            # several problems: each is its own llmgw: error: line, as check-config and serve print them
            bad = config_for([a])
            bad["endpoints"][0] = {**bad["endpoints"][0], "modle": "m"}
            conf.write_text(yaml.safe_dump({**bad, "listen": "nowhere", "server": {"max_body_sise": 1}}))
            res = await invoke("--admin", url(rt), "reload")
            assert res.exit_code == 1
            lines = res.output.splitlines()
            assert len(lines) == 3 and all(line.startswith("llmgw: error: ") for line in lines), res.output
            assert lines[0].startswith("llmgw: error: reload failed, the running configuration is kept: ")
            assert sum("modle: unknown key" in line for line in lines) == 1
            assert sum("max_body_sise: unknown key" in line for line in lines) == 1
            # a control plane no agent could join (its last join token removed) is refused like any problem
            conf.write_text(yaml.safe_dump({**config_for([a]), "control": {"listen": "127.0.0.1:1"}}))
            res = await invoke("--admin", url(rt), "reload")
            assert res.exit_code == 1 and "the running configuration is kept" in res.output
            assert "needs a join token for agents" in res.output and len(res.output.splitlines()) == 1, res.output
    finally:
        await a.stop()
        await b.stop()


async def test_errors_name_the_fix() -> None:
    a = Engine("a")
    async with running([a]) as rt:
        port = admin_port(rt)
        res = await invoke("--admin", f"http://127.0.0.1:{client_port(rt)}", "endpoints")
        assert res.exit_code == 1
        assert "is the client port, not the admin port" in res.output
    # the gateway is gone now
    res = await invoke("--admin", f"http://127.0.0.1:{port}", "endpoints")
    assert res.exit_code == 1
    assert res.output == (
        f"llmgw: error: cannot reach the admin API at http://127.0.0.1:{port} "
        "(connection refused; is llmgw serve running? pass --admin URL)\n"
    )


async def test_token_errors() -> None:
    a = Engine("a")
    async with running([a]) as rt:
        real = rt.config

        class WithToken:
            admin_token = secret("tok-123")

            def __getattr__(self, name: str) -> Any:
                return getattr(real, name)

        rt.config = WithToken()  # type: ignore[assignment]
        try:
            res = await invoke("--admin", url(rt), "endpoints")
            assert res.exit_code == 1
            assert res.output == "llmgw: error: the admin API needs a token: pass --token or set LLMGW_ADMIN_TOKEN\n"
            res = await invoke("--admin", url(rt), "--token", "nope", "endpoints")
            assert "refused the token" in res.output
            res = await invoke("--admin", url(rt), "endpoints", "--json", env={"LLMGW_ADMIN_TOKEN": secret("tok-123")})
            assert res.exit_code == 0, res.output
        finally:
            rt.config = real


async def test_subprocess() -> None:
    a = Engine("a")
    async with running([a]) as rt:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "llmgw", "ctl", "endpoints", "--json",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "LLMGW_ADMIN": url(rt)},
        )
        out, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0, err.decode()
        assert [e["id"] for e in json.loads(out)["endpoints"]] == ["a"]
