"""``ctl deploy`` refuses args that set what llmgw sets itself: the agent would fail every replica for them
(before: the engine listened on the args' port while llmgw probed its own, and each replica sat in
``starting`` for the ready timeout, 30 minutes)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from cp_helpers import control_plane, control_runtime, free_port

from llmgw.cli.ctl import ctl

pytestmark = pytest.mark.timeout(60)


async def invoke(*args: str) -> Result:
    return await asyncio.to_thread(CliRunner().invoke, ctl, list(args), catch_exceptions=False)


@pytest.mark.parametrize("args", [["--arg=--port", "--arg", "9999"], ["--arg=--port=9999"],
                                  ["--arg=--host", "--arg", "0.0.0.0"], ["--arg=--api-key", "--arg", "mine-123"]])
async def test_args_that_set_llmgws_own_flags_are_refused(args: list[str], tmp_path: Path) -> None:
    async with control_runtime(free_port(), database=f"sqlite:///{tmp_path}/cp.sqlite3") as rt:
        url = f"http://127.0.0.1:{rt.admin_addr[1]}"  # type: ignore[index]
        flag = args[0].removeprefix("--arg=").split("=")[0]
        res = await invoke("--admin", url, "deploy", "d", "--model", "/m/tiny.gguf", "--engine", "llamacpp", *args)
        assert res.exit_code == 1, res.output
        assert f"args: {flag} is set by llmgw itself" in res.output and "remove it" in res.output
        assert "mine-123" not in res.output
        assert "d" not in control_plane(rt).deployments.deployments
        ok = await invoke("--admin", url, "deploy", "d", "--model", "/m/tiny.gguf", "--engine", "llamacpp")
        assert ok.exit_code == 0, ok.output
        res = await invoke("--admin", url, "deploy", "d", "--update", "--model", "/m/tiny.gguf", "--engine",
                           "llamacpp", *args)
        assert res.exit_code == 1 and f"args: {flag} is set by llmgw itself" in res.output, res.output
        # an arg that only begins like one is the engine's
        ok = await invoke("--admin", url, "deploy", "e", "--model", "/m/tiny.gguf", "--engine", "llamacpp",
                          "--arg=--port-range-hint", "--arg", "x")
        assert ok.exit_code == 0, ok.output


async def test_a_credential_in_args_is_never_shown(tmp_path: Path) -> None:
    # (vLLM's --hf-token, and the like: the engine needs it, nobody reading the deployments does)
    from llmgw.launch.base import LaunchPlan, hide_secret_args, secret_arg_values

    token = "hf_secret-token-for-the-args-test"
    args = ["--hf-token", token, "--db-password=pw-in-args-9", "--api-key-file", "/etc/k", "--ctx-size", "4096"]
    assert secret_arg_values(args) == [token, "pw-in-args-9"]
    assert hide_secret_args(args) == ["--hf-token", "***", "--db-password=***", "--api-key-file", "/etc/k",
                                      "--ctx-size", "4096"]
    shown = LaunchPlan(argv=("vllm", "serve", "m", *args)).shown()
    assert token not in shown and "pw-in-args-9" not in shown and "/etc/k" in shown
    async with control_runtime(free_port(), database=f"sqlite:///{tmp_path}/cp.sqlite3") as rt:
        url = f"http://127.0.0.1:{rt.admin_addr[1]}"  # type: ignore[index]
        ok = await invoke("--admin", url, "deploy", "d", "--model", "/m/tiny.gguf", "--engine", "llamacpp",
                          "--arg=--hf-token", f"--arg={token}", "--arg=--db-password=pw-in-args-9")
        assert ok.exit_code == 0, ok.output
        for cmd in (["deployments", "--json"], ["deployments"]):
            res = await invoke("--admin", url, *cmd)
            assert res.exit_code == 0, (cmd, res.output)
            assert token not in res.output and "pw-in-args-9" not in res.output, (cmd, res.output)
        # the replica's spec (what the agent is handed) keeps it: the engine needs it
        assert token in control_plane(rt).deployments.deployments["d"].cfg.args
