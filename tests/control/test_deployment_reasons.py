"""Why a deployment is not ready, from a replica's first crash on, and how ``llmgw ctl`` shows it: one
line of reason in the table (the reason and the most telling line of the engine's log), the whole
message in ``--json``. In process with reported statuses, and end to end with ``llmgw serve``'s demo
node running a stand-in ``llama-server`` that crash-loops."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from cp_helpers import DemoServe, control_plane, control_runtime, free_port
from scenario import h100s
from test_deployments import admin, register

from llmgw.cli.ctl import ctl
from llmgw.control.deployments import DeploymentController
from llmgw.launch.spec import ReplicaStatus, reason_line, telling_line

pytestmark = pytest.mark.timeout(90)

HEADER = ("--- llmgw 2025-01-01T00:00:00Z: starting {rid}: /usr/bin/llama-server -m /models/tiny.gguf --metrics "
          "--host 127.0.0.1 --port 40001 --alias crash --device none --no-such-flag")
ERROR = "error: invalid argument: --no-such-flag"


def tail(rid: str, runs: int) -> str:
    return "\n".join(line for _ in range(runs) for line in (HEADER.format(rid=rid), ERROR))


async def invoke(*args: str) -> Result:
    # (wide: a row that wraps would read as several lines)
    return await asyncio.to_thread(CliRunner().invoke, ctl, list(args), env={"COLUMNS": "400"},
                                   catch_exceptions=False)


def controller(rt: Any) -> DeploymentController:
    c = control_plane(rt).deployments
    assert c is not None
    return c


def row(output: str, name: str) -> str:
    [line] = [line.rstrip() for line in output.splitlines() if line.startswith(f"{name} ")]
    return line


def test_reason_line_keeps_the_reason_and_the_telling_line() -> None:
    rid = "crash-1a2b3c"
    msg = f"crashed 5 times within 600s; last exit status 1; its log ends:\n{tail(rid, 5)}"
    assert reason_line(msg) == f"crashed 5 times within 600s; last exit status 1; log: {ERROR}"
    # the error line, not the line after it that only repeats it; the last run's output only
    load = ("build: 1 (abc) with cc\ngguf_init_from_file: failed to open GGUF file '/nope.gguf'\n"
            "llama_model_load: error loading model: failed to open /nope.gguf: No such file or directory\n"
            "main: exiting due to model loading error\n")
    assert telling_line(f"{HEADER}\nerror: old run\n{HEADER}\n{load}") == (
        "llama_model_load: error loading model: failed to open /nope.gguf: No such file or directory")
    assert telling_line("Traceback (most recent call last):\n  File x\nValueError: bad  model\n") == (
        "ValueError: bad model")
    assert telling_line("loading\nbye\n") == "bye"  # (no error line: the last one)
    assert telling_line(HEADER) is None  # (the engine printed nothing)
    assert reason_line("exited with status 1; restarting in 1s; its log ends:\n") == (
        "exited with status 1; restarting in 1s")
    assert reason_line("needs a node; no node is eligible") == "needs a node; no node is eligible"
    cut = reason_line("x" * 500)
    assert cut is not None and len(cut) == 200 and cut.endswith("…")
    # too long: the reason gives way first, the log's line keeps at least half the width
    cut = reason_line(f"{'why ' * 20}; its log ends:\nerror: {'e' * 30}", width=60)
    assert cut == f"why why why why why why wh…; log: error: {'e' * 18}…" and len(cut) == 60
    assert reason_line(f"short; its log ends:\nerror: {'e' * 100}", width=60) == f"short; log: error: {'e' * 40}…"
    assert reason_line(None) is None and reason_line(" \n") is None


async def test_a_restarting_replica_says_why_from_its_first_crash(tmp_path: Path) -> None:
    port = free_port()
    async with control_runtime(port, heartbeat_interval="10s", heartbeat_grace="60s",
                               database=f"sqlite:///{tmp_path}/cp.sqlite3") as rt:
        url = f"http://127.0.0.1:{rt.admin_addr[1]}"  # type: ignore[index]
        await register(port, "node-1", {"hostname": "h1", "gpus": h100s(1)})
        c = controller(rt)
        res = await invoke("--admin", url, "deploy", "crash", "--model", "/models/tiny.gguf", "--engine", "llamacpp",
                           "--arg=--no-such-flag")
        assert res.exit_code == 0, res.output
        await c.committed()
        [spec] = c.desired("node-1")[1]
        rid = spec.id

        def report(state: str, **kw: Any) -> None:
            c.report("node-1", "127.0.0.1", [ReplicaStatus(rid, state, **kw)])

        async def message() -> str | None:
            status, d = await admin(rt, "GET", "/admin/v1/deployments/crash")
            assert status == 200, d
            return d["message"]  # type: ignore[no-any-return]

        report("starting", pid=10, port=40001, message="started: llama-server ...")
        assert await message() is None  # (starting for the first time: nothing to explain)
        # ...but the table says what the replica is doing, as the console does, rather than –
        res = await invoke("--admin", url, "deployments")
        assert res.exit_code == 0 and row(res.output, "crash").endswith("started: llama-server ..."), res.output
        # the first crash: the agent waits before starting it again, and the deployment says why
        report("starting", exit_code=1, message=f"exited with status 1; restarting in 1s; its log ends:\n{tail(rid, 1)}")
        assert await message() == (f"replica {rid} on node-1: exited with status 1; restarting in 1s; "
                                   f"its log ends:\n{tail(rid, 1)}")
        # started again (its message is now "started: ..."): still why, with the log of the crash
        report("starting", pid=11, port=40002, exit_code=1, restarts=1, message="started: llama-server ...")
        assert await message() == (f"replica {rid} on node-1: starting again after exit status 1 (1 restart so far)"
                                   f"; its log ends:\n{tail(rid, 1)}")
        report("starting", exit_code=1, restarts=3,
               message=f"exited with status 1; restarting in 8s; its log ends:\n{tail(rid, 4)}")
        res = await invoke("--admin", url, "deployments")
        assert res.exit_code == 0, res.output
        assert row(res.output, "crash").endswith(
            f"replica {rid} on node-1: exited with status 1; restarting in 8s (3 restarts so far); log: {ERROR}")
        assert "--- llmgw" not in res.output
        res = await invoke("--admin", url, "deployments", "--json")
        [d] = json.loads(res.stdout)["deployments"]
        assert d["message"].endswith(f"its log ends:\n{tail(rid, 4)}")  # (the whole text, as the API has it)

        # ready: nothing to explain any more
        report("ready", pid=12, port=40003, exit_code=1, restarts=4, message="ready")
        assert await message() is None

        # failed at last: the failure's message, its log at the end, one line in the table
        report("failed", exit_code=1, restarts=4,
               message=f"crashed 5 times within 600s; last exit status 1; its log ends:\n{tail(rid, 5)}")
        msg = await message()
        assert msg is not None and msg.startswith(
            f"replica {rid} failed on node-1: crashed 5 times within 600s; last exit status 1; "
            "placing again in 5s; its log ends:\n")
        res = await invoke("--admin", url, "deployments")
        assert row(res.output, "crash").endswith(
            f"replica {rid} failed on node-1: crashed 5 times within 600s; last exit status 1; "
            f"placing again in 5s; log: {ERROR}")
        assert "--- llmgw" not in res.output
        res = await invoke("--admin", url, "scale", "crash", "1")  # (its warning is the same one line)
        assert res.exit_code == 0 and f"crash: replica {rid} failed on node-1" in res.output
        assert "--- llmgw" not in res.output and len(res.output.splitlines()) == 2, res.output
        # scaled to 0: nothing is placed again, so nothing says it will be
        res = await invoke("--admin", url, "scale", "crash", "0")
        assert res.exit_code == 0, res.output
        assert await message() is None


async def test_a_placement_reason_and_a_crash_are_both_said(tmp_path: Path) -> None:
    port = free_port()
    async with control_runtime(port, heartbeat_interval="10s", heartbeat_grace="60s",
                               database=f"sqlite:///{tmp_path}/cp.sqlite3") as rt:
        await register(port, "node-1", {"hostname": "h1", "gpus": h100s(1)})
        c = controller(rt)
        status, d = await admin(rt, "POST", "/admin/v1/deployments",
                                {"name": "chat", "model": "sim-weights", "gpu_memory": "10GiB", "replicas": 2})
        assert status == 201 and d["placed"] == 1, d
        placement = d["message"]
        assert placement.startswith("needs 1 GPU"), placement
        await c.committed()
        [spec] = c.desired("node-1")[1]
        c.report("node-1", "127.0.0.1", [ReplicaStatus(
            spec.id, "starting", exit_code=137, restarts=2,
            message="exited with status 137; restarting in 4s; its log ends:\nKilled")])
        _, d = await admin(rt, "GET", "/admin/v1/deployments/chat")
        assert d["message"] == (f"{placement}; replica {spec.id} on node-1: exited with status 137; restarting in 4s "
                                "(2 restarts so far); its log ends:\nKilled")
        line = reason_line(d["message"], width=1000)
        assert line == (f"{placement}; replica {spec.id} on node-1: exited with status 137; restarting in 4s "
                        "(2 restarts so far); log: Killed")


STANDIN = """#!/bin/sh
# llama-server as the QA repro saw it: a flag it does not know, or a model file that is not there
for a in "$@"; do
  if [ "$a" = --no-such-flag ]; then echo "error: invalid argument: --no-such-flag" >&2; exit 1; fi
done
echo "build: 1 (standin) with cc for x86_64-linux-gnu"
echo "gguf_init_from_file: failed to open GGUF file '$2'"
echo "llama_model_load: error loading model: failed to open $2: No such file or directory"
echo "main: exiting due to model loading error"
exit 1
"""


def test_crash_looping_deployments_show_one_line_from_the_first_crash(tmp_path: Path) -> None:
    """The QA repro, end to end: the demo node runs a ``llama-server`` that exits at once."""
    model = tmp_path / "tiny.gguf"
    model.write_bytes(b"GGUF")
    demo = DemoServe(tmp_path, STANDIN)
    env, ctl_ = demo.env, demo.ctl
    try:
        deadline = time.monotonic() + 60
        for name, more in (("crash", [f"--model={model}", "--arg=--no-such-flag"]), ("nofile", ["--model=/nope.gguf"])):
            out = subprocess.run([*ctl_, "deploy", name, "--engine", "llamacpp", *more], capture_output=True,
                                 text=True, timeout=20, env=env)
            assert out.returncode == 0 and "placed on demo-node" in out.stdout, out

        def whys() -> dict[str, str]:
            return {d["name"]: d["message"] or "" for d in demo.get("/admin/v1/deployments")["deployments"]}

        # from the first crash on, the deployment says why it is not ready (before: null until it failed); a
        # model file the node lacks is said at once, the file named, without a crash loop
        while time.monotonic() < deadline and not ("restarting in" in whys()["crash"]
                                                   and "not found" in whys()["nofile"]):
            time.sleep(0.1)
        why = whys()
        assert "exited with status 1; restarting in" in why["crash"], why
        assert why["nofile"].startswith("replica nofile-") and (
            "failed on demo-node: model file /nope.gguf not found on this node: check the deployment's model"
            in why["nofile"]), why
        out = subprocess.run([*ctl_, "deployments"], capture_output=True, text=True, timeout=20, env=env)
        assert out.returncode == 0, out
        crash, nofile = row(out.stdout, "crash"), row(out.stdout, "nofile")
        assert "exited with status 1; restarting in" in crash and crash.endswith(
            "log: error: invalid argument: --no-such-flag"), crash
        assert "model file /nope.gguf not found on this node" in nofile and "log:" not in nofile, nofile
        assert "--- llmgw" not in out.stdout and "its log ends" not in out.stdout
        # crashed 5 times (backoff 1, 2, 4, 8 s): failed, the whole text in the API; then placed again
        # after 5 s, and restarting again: one line each in the table either way
        failed = ""
        while time.monotonic() < deadline and "crashed 5 times" not in failed:
            time.sleep(0.2)
            failed = whys()["crash"]
        assert failed.startswith("replica crash-"), failed
        assert "failed on demo-node: crashed 5 times within 600s; last exit status 1; placing again" in failed
        assert failed.count("--- llmgw ") >= 2 and "; its log ends:\n" in failed, failed
        out = subprocess.run([*ctl_, "deployments"], capture_output=True, text=True, timeout=20, env=env)
        crash = row(out.stdout, "crash")
        assert "failed on demo-node: crashed 5 times" in crash or "restarting in" in crash, crash
        assert crash.endswith("log: error: invalid argument: --no-such-flag"), crash
        assert "--- llmgw" not in out.stdout
        top = out.stdout.split("\n\n")[0].splitlines()
        assert len(top) == 3, out.stdout  # the header and one line per deployment
    finally:
        demo.stop()


async def test_a_failed_replica_goes_elsewhere_and_a_ready_deployment_says_nothing_failed(tmp_path: Path) -> None:
    """QA: a replica failing on a node for a reason of that node's own (no free port there) was placed on
    that node again and again, the best-scored one, while another was idle; and once a scale-down dropped
    the failed replica, the deployment, every replica ready, still said "failed ...; placing again"."""
    port = free_port()
    async with control_runtime(port, heartbeat_interval="10s", heartbeat_grace="60s",
                               database=f"sqlite:///{tmp_path}/cp.sqlite3") as rt:
        url = f"http://127.0.0.1:{rt.admin_addr[1]}"  # type: ignore[index]
        await register(port, "cpu-1", {"hostname": "h1"})
        await register(port, "gpu-1", {"hostname": "h2", "gpus": h100s(1)})
        c = controller(rt)
        res = await invoke("--admin", url, "deploy", "d", "--model", "/models/tiny.gguf", "--engine", "llamacpp",
                           "--replicas", "2")
        assert res.exit_code == 0, res.output
        await c.committed()
        where = {r.id: r.node for r in c.replicas.values()}
        assert sorted(where.values()) == ["cpu-1", "gpu-1"], where  # (the CPU node first, then spread)
        on_cpu = next(i for i, n in where.items() if n == "cpu-1")
        on_gpu = next(i for i, n in where.items() if n == "gpu-1")
        c.report("gpu-1", "127.0.0.1", [ReplicaStatus(on_gpu, "ready", pid=2, port=free_port())])
        c.report("cpu-1", "127.0.0.1", [ReplicaStatus(on_cpu, "failed", message="no free port in replica_ports "
                                                      "40000-40001 on 127.0.0.1: widen the range")])
        d = c.view("d")
        assert d["message"].startswith(f"replica {on_cpu} failed on cpu-1: no free port"), d["message"]
        c.deployments["d"].retry_at = 0.0  # (its backoff passed)
        c.sync(10.0)
        await c.committed()
        again = [r for r in c.replicas.values() if r.id not in where]
        assert [r.node for r in again] == ["gpu-1"], again  # not the node it just failed on
        # scaled down to the ready one: nothing is missing, nothing is placed again, nothing said
        res = await invoke("--admin", url, "scale", "d", "1")
        assert res.exit_code == 0, res.output
        c.sync(10.0)
        d = c.view("d")
        assert d["ready"] == 1 and d["desired"] == 1 and d["message"] is None, d
