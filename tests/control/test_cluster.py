"""The control plane end to end: a real runtime, agents as separate processes, real gRPC on 127.0.0.1.

Heartbeats every 0.2 s, grace 0.6 s; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cp_helpers import (
    INTERVAL,
    TOKEN,
    AgentProc,
    api,
    control_plane,
    control_runtime,
    free_port,
    http,
    metrics,
    metrics_text,
    parse,
    pick,
    wait_for,
)
from scenario import h100s, write_scenario

pytestmark = pytest.mark.timeout(60)

GRACE = 3 * INTERVAL


def _spec(prefix: str, n: int = 2, **extra: object) -> dict[str, object]:
    return {"hostname": f"host-{prefix}", "source": "nvml",
            "facts": {"driver_version": "550.90.07", "cuda_driver_version": "12.4", "cpu_cores": 32},
            "gpus": h100s(n, prefix), **extra}


# MIG-enabled A100: utilisation NotSupported (absent), no power reading either
MIG_SPEC = {
    "hostname": "host-m", "source": "nvml",
    "gpus": [{"uuid": "GPU-m0000000-0000-4000-8000-000000000000", "index": 0, "name": "NVIDIA A100-SXM4-80GB",
              "mig_mode": True, "memory_total_bytes": 85899345920, "memory_used_bytes": 0}],
}


@pytest.fixture
def agents(tmp_path: Path):  # type: ignore[no-untyped-def]
    made: list[AgentProc] = []

    def make(port: int, name: str, spec: dict[str, object], *extra: str, token: str = TOKEN) -> AgentProc:
        scenario = write_scenario(tmp_path / f"{name}.json", spec)
        a = AgentProc(port, name, scenario, tmp_path / f"{name}.log", *extra, token=token)
        made.append(a)
        return a.start()

    yield make
    for a in made:
        a.stop()


async def _nodes(rt) -> dict[str, dict]:  # type: ignore[no-untyped-def]
    status, body = await api(rt, "GET", "/admin/v1/nodes")
    assert status == 200
    return {n["name"]: n for n in body["nodes"]}


async def _up(rt, *names: str) -> bool:  # type: ignore[no-untyped-def]
    nodes = await _nodes(rt)
    return all(n in nodes and nodes[n]["state"] == "up" and nodes[n]["heartbeats"] >= 1 for n in names)


async def _state(rt, name: str, state: str) -> bool:  # type: ignore[no-untyped-def]
    node = (await _nodes(rt)).get(name)
    return node is not None and node["state"] == state


async def test_agents_register_and_report_on_metrics_and_api(agents) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    async with control_runtime(port) as rt:
        agents(port, "node-a", _spec("a"))
        agents(port, "node-m", MIG_SPEC)
        await wait_for(lambda: _up(rt, "node-a", "node-m"), what="both nodes up")
        s = await metrics(rt)
        assert pick(s, "llmgw_node_up", node="node-a") == [1.0]
        assert pick(s, "llmgw_node_up", node="node-m") == [1.0]
        info = [lab for (n, lab) in s if n == "llmgw_node_info" and ("node", "node-a") in lab]
        assert len(info) == 1 and {("hostname", "host-a"), ("driver_version", "550.90.07"),
                                   ("cuda_driver_version", "12.4")} <= info[0]
        a0 = "GPU-a0000000-0000-4000-8000-000000000000"
        assert pick(s, "llmgw_gpu_utilization_ratio", node="node-a", gpu_uuid=a0, gpu_index="0") == [0.0]
        assert pick(s, "llmgw_gpu_memory_total_bytes", node="node-a", gpu_uuid=a0) == [85899345920.0]
        assert pick(s, "llmgw_gpu_xid_errors_total", node="node-a", xid="79") == [1.0]
        assert pick(s, "llmgw_gpu_health_state", node="node-a", state="degraded") == [0.0, 1.0]
        assert pick(s, "llmgw_gpu_ecc_errors_total", node="node-a", gpu_uuid=a0, error_type="corrected") == [0.0]
        # absent is not zero: the MIG GPU reports no utilisation, no power, no temperature
        m0 = "GPU-m0000000-0000-4000-8000-000000000000"
        assert pick(s, "llmgw_gpu_info", node="node-m", gpu_uuid=m0) == [1.0]
        for fam in ("llmgw_gpu_utilization_ratio", "llmgw_gpu_power_watts", "llmgw_gpu_temperature_celsius",
                    "llmgw_gpu_ecc_errors_total"):
            assert pick(s, fam, node="node-m") == [], fam
        assert pick(s, "llmgw_gpu_memory_used_bytes", node="node-m") == [0.0]
        assert pick(s, "llmgw_control_registrations_total", kind="new") == [2.0]
        assert pick(s, "llmgw_control_heartbeats_total")[0] >= 2
        # the API: one node with its GPUs, absent as null
        status, node = await api(rt, "GET", "/admin/v1/nodes/node-m")
        assert status == 200 and node["state"] == "up" and node["gpu_count"] == 1
        assert node["gpus"][0]["utilization_gpu_ratio"] is None and node["gpus"][0]["mig_mode"] is True
        assert node["heartbeat_age_s"] < GRACE
        status, gpus = await api(rt, "GET", "/admin/v1/gpus")
        assert status == 200 and len(gpus["gpus"]) == 3
        status, _ = await api(rt, "GET", "/admin/v1/nodes/nope")
        assert status == 404


async def test_readings_change_with_heartbeats(agents, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    async with control_runtime(port) as rt:
        a = agents(port, "node-a", _spec("a", 1))
        await wait_for(lambda: _up(rt, "node-a"), what="node up")
        spec = _spec("a", 1)
        spec["gpus"][0]["utilization_gpu_ratio"] = 0.75  # type: ignore[index]
        write_scenario(a.scenario, spec)

        async def changed() -> bool:
            return pick(await metrics(rt), "llmgw_gpu_utilization_ratio", node="node-a") == [0.75]

        await wait_for(changed, what="the new reading on /metrics")
        spec["gpus"] = []  # the GPU vanished: its series go
        write_scenario(a.scenario, spec)

        async def gone() -> bool:
            return pick(await metrics(rt), "llmgw_gpu_info", node="node-a") == []

        await wait_for(gone, what="the removed GPU to vanish")


async def test_kill9_goes_unhealthy_within_grace_and_comes_back_as_the_same_node(  # type: ignore[no-untyped-def]
    agents, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="llmgw")
    port = free_port()
    async with control_runtime(port) as rt:
        a = agents(port, "node-a", _spec("a"))
        agents(port, "node-b", _spec("b"))
        await wait_for(lambda: _up(rt, "node-a", "node-b"), what="both up")
        before = (await _nodes(rt))["node-a"]
        a.signal(signal.SIGKILL)
        await a.wait()

        async def a_down() -> bool:
            return pick(await metrics(rt), "llmgw_node_up", node="node-a") == [0.0]

        # within the grace (plus one interval of scheduling slack)
        await wait_for(a_down, timeout=GRACE + 2 * INTERVAL + 1.0, what="node-a down")
        s = await metrics(rt)
        assert pick(s, "llmgw_node_last_heartbeat_timestamp_seconds", node="node-a")[0] > 0
        assert pick(s, "llmgw_gpu_info", node="node-a") == []
        assert pick(s, "llmgw_gpu_memory_used_bytes", node="node-a") == []
        assert pick(s, "llmgw_node_up", node="node-b") == [1.0]
        assert pick(s, "llmgw_gpu_memory_used_bytes", node="node-b") != []
        assert (await _nodes(rt))["node-a"]["state"] == "unhealthy"

        def said(text: str) -> bool:
            return any(text in r.getMessage() for r in caplog.records)

        await wait_for(lambda: said("node node-a is unhealthy: no heartbeat for"), timeout=5, what="logged")
        # restart: same node (same id), up again, not a second one
        agents(port, "node-a", _spec("a"))

        async def a_back() -> bool:
            n = (await _nodes(rt)).get("node-a")
            return n is not None and n["state"] == "up" and n["registrations"] == 2

        await wait_for(a_back, what="node-a back")
        nodes = await _nodes(rt)
        assert sorted(nodes) == ["node-a", "node-b"] and nodes["node-a"]["id"] == before["id"]
        s = await metrics(rt)
        assert pick(s, "llmgw_node_up", node="node-a") == [1.0]
        assert pick(s, "llmgw_control_registrations_total", kind="re") == [1.0]
        await wait_for(lambda: said("node node-a is up again"), timeout=5, what="logged")
        assert not said("node node-b is unhealthy")


async def test_sigterm_deregisters_and_exits_0(agents) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    async with control_runtime(port) as rt:
        a = agents(port, "node-a", _spec("a"))
        await wait_for(lambda: _up(rt, "node-a"), what="node up")
        a.signal(signal.SIGTERM)
        assert await a.wait() == 0, a.stderr()
        assert "node-a" not in await _nodes(rt)
        s = await metrics(rt)
        assert pick(s, "llmgw_node_up", node="node-a") == [] and pick(s, "llmgw_gpu_info", node="node-a") == []
        assert pick(s, "llmgw_control_deregistrations_total") == [1.0]


async def test_control_plane_restart_agents_come_back_nothing_duplicated(agents) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    procs = []
    async with control_runtime(port) as rt:
        for name in ("n1", "n2", "n3"):
            procs.append(agents(port, name, _spec(name)))
        await wait_for(lambda: _up(rt, "n1", "n2", "n3"), what="three up")
        ids = {k: v["id"] for k, v in (await _nodes(rt)).items()}
    async with control_runtime(port) as rt2:
        # back within about an interval of the restart (bounded generously for a loaded CI box)
        await wait_for(lambda: _up(rt2, "n1", "n2", "n3"), timeout=3 * GRACE + 2.0, what="agents re-registered")
        nodes = await _nodes(rt2)
        assert sorted(nodes) == ["n1", "n2", "n3"]
        assert {k: v["id"] for k, v in nodes.items()} == ids
        # known nodes (the database remembers them: listed unhealthy until they came back) came back
        s = await metrics(rt2)
        assert pick(s, "llmgw_control_registrations_total", kind="re") == [3.0]
        assert pick(s, "llmgw_control_registrations_total", kind="new") == [0.0]
    # the stop said why each stream ended, in the agents' own logs
    for a in procs:
        text = a.stderr()
        assert "UNAVAILABLE: this control plane no longer leads" in text, text
        assert "cancelled by the server" not in text


async def test_wrong_token_is_refused_and_never_logged(agents, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    bad = "wrong-token-5b1d9e"
    caplog.set_level(logging.INFO, logger="llmgw")
    async with control_runtime(port) as rt:
        a = agents(port, "intruder", _spec("x"), token=bad)
        assert await a.wait(timeout=30) == 1
        err = a.stderr()
        assert "UNAUTHENTICATED" in err and "wrong join token" in err
        assert bad not in err and TOKEN not in err
        assert "intruder" not in await _nodes(rt)
        assert pick(await metrics(rt), "llmgw_control_joins_refused_total", reason="invalid_token") == [1.0]
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "'intruder'" in logged and "ipv4:127.0.0.1:" in logged and "wrong join token" in logged
    assert bad not in logged and TOKEN not in logged


async def test_a_control_plane_refusing_the_token_is_passed_over_for_one_that_takes_it(agents) -> None:  # type: ignore[no-untyped-def]
    """Several control planes: one whose join tokens differ (a standby restarted with a rotated token) refused
    the agent and the agent exited, its engines orphaned, while the next would have taken it. Now it goes on
    to the next address; only when every one refused does it exit, saying so."""
    other, good = free_port(), free_port()
    rotated = "rotated-token-3c9e1a77"
    mem = "sqlite::memory:"  # (one database each: an SQLite file serves one process)
    async with control_runtime(other, join_token=rotated, database=mem), control_runtime(good, database=mem) as rt:
        a = agents(f"127.0.0.1:{other},127.0.0.1:{good}", "n1", _spec("n"))
        await wait_for(lambda: _up(rt, "n1"), timeout=20, what="n1 registered with the control plane taking its token")
        assert a.proc is not None and a.proc.poll() is None
        err = a.stderr()
        assert f"control plane at 127.0.0.1:{other}: UNAUTHENTICATED" in err and "trying the next address" in err
        assert rotated not in err and TOKEN not in err
    third = free_port()
    async with control_runtime(other, join_token=rotated, database=mem), \
            control_runtime(third, join_token=rotated, database=mem):
        b = agents(f"127.0.0.1:{other},127.0.0.1:{third}", "n2", _spec("m"))
        assert await b.wait(timeout=30) == 1
        err = b.stderr()
        assert "llmgw: error: every control plane refused this agent; the control plane at" in err
        assert "UNAUTHENTICATED" in err and "wrong join token" in err
        # one refuses, the other never answers: not for ever (REFUSED_GIVE_UP_S, 60 s; 2 s here)
        c = agents(f"127.0.0.1:{other},127.0.0.1:{free_port()}", "n3", _spec("k"), "--refused-give-up", "2")
        assert await c.wait(timeout=30) == 1
        err = c.stderr()
        assert f"llmgw: error: the control plane at 127.0.0.1:{other} refused this agent (UNAUTHENTICATED)" in err
        assert re.search(r"no other control plane took it in [2-9]s", err), err  # (2 s and the round it ends)


async def test_incompatible_protocol_is_refused_clearly_on_both_sides(agents, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    caplog.set_level(logging.INFO, logger="llmgw")
    async with control_runtime(port) as rt:
        a = agents(port, "future", _spec("f"), "--protocol-major", "2")
        assert await a.wait(timeout=30) == 1
        err = a.stderr()
        assert "FAILED_PRECONDITION" in err and "incompatible wire protocol" in err and "2.0" in err
        assert "future" not in await _nodes(rt)
        assert pick(await metrics(rt), "llmgw_control_joins_refused_total", reason="incompatible_version") == [1.0]
    assert any("incompatible wire protocol" in r.getMessage() for r in caplog.records)


async def test_cordon_and_uncordon(agents) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    async with control_runtime(port) as rt:
        agents(port, "node-a", _spec("a", 1))
        await wait_for(lambda: _up(rt, "node-a"), what="node up")
        status, body = await api(rt, "POST", "/admin/v1/nodes/node-a/cordon")
        assert status == 200 and body["cordoned"] is True and body["changed"] is True
        status, body = await api(rt, "POST", "/admin/v1/nodes/node-a/cordon")
        assert body["changed"] is False
        assert pick(await metrics(rt), "llmgw_node_cordoned", node="node-a") == [1.0]
        assert control_plane(rt).nodes.get("node-a").cordoned
        status, body = await api(rt, "POST", "/admin/v1/nodes/node-a/uncordon")
        assert status == 200 and body["cordoned"] is False
        status, _ = await api(rt, "POST", "/admin/v1/nodes/nope/cordon")
        assert status == 404
        status, _ = await api(rt, "GET", "/admin/v1/nodes/node-a/cordon")
        assert status == 405


@pytest.mark.needs_tool("promtool", install="apt-get install prometheus")
async def test_promtool_check_metrics_with_a_cluster(agents) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    async with control_runtime(port) as rt:
        agents(port, "node-a", _spec("a", 3))
        agents(port, "node-m", MIG_SPEC)
        await wait_for(lambda: _up(rt, "node-a", "node-m"), what="nodes up")
        text = await metrics_text(rt)
    res = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.strip() == "" and res.stderr.strip() == "", res.stdout + res.stderr


# what a real Prometheus (2.x, 3.x) sends: OpenMetrics first
PROMETHEUS_ACCEPT = ("accept: application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
                     "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1\r\n")


async def test_openmetrics_page_has_the_same_cluster_samples_and_parses_strictly(agents) -> None:  # type: ignore[no-untyped-def]
    """Prometheus asks for OpenMetrics: the cluster is rendered by llmgw's own renderer there too (never by
    prometheus_client's, which holds the loop ~1 s at 1,000 nodes), and the page is valid OpenMetrics."""
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_families

    port = free_port()
    async with control_runtime(port) as rt:
        agents(port, "node-a", _spec("a", 3))
        agents(port, "node-m", MIG_SPEC)
        await wait_for(lambda: _up(rt, "node-a", "node-m"), what="nodes up")
        cp = control_plane(rt)
        cp.nodes.grace = lambda: 3600.0  # readings must not expire between the two pages below
        status, om = await http(rt, "GET", "/metrics", headers=PROMETHEUS_ACCEPT)
        text = await metrics_text(rt)
    assert status == 200
    page = om.decode()
    assert page.endswith("# EOF\n") and page.count("# EOF") == 1
    om_samples = {(s.name, frozenset(s.labels.items())): s.value
                  for fam in om_families(page) for s in fam.samples}  # the strict parser: raises on bad OpenMetrics
    plain = parse(text)
    moving = ("llmgw_node_heartbeat_age_seconds", "llmgw_node_last_heartbeat_timestamp_seconds",
              "llmgw_cluster_collect_duration_seconds", "llmgw_control_heartbeats_total")

    def cluster(s: dict) -> dict:  # type: ignore[type-arg]
        return {k: v for k, v in s.items() if k[0].startswith(("llmgw_node_", "llmgw_gpu_")) and k[0] not in moving}

    assert cluster(om_samples) == cluster(plain) and len(cluster(plain)) > 40
    assert "# TYPE llmgw_gpu_energy_joules counter" in page  # OpenMetrics: counter families without _total
    assert pick(om_samples, "llmgw_gpu_utilization_ratio", node="node-m") == []  # absent stays absent


async def test_forget_removes_a_node_nothing_hears_from_and_refuses_one_that_is_up(  # type: ignore[no-untyped-def]
    agents, tmp_path: Path
) -> None:
    port = free_port()
    async with control_runtime(port, database=f"sqlite:///{tmp_path}/cp.sqlite3") as rt:
        url = f"http://127.0.0.1:{rt.admin_addr[1]}"  # type: ignore[index]

        def ctl(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "llmgw", "ctl", "--admin", url, *args],
                                  capture_output=True, text=True, timeout=30)

        a = agents(port, "node-a", _spec("a"))
        agents(port, "node-b", _spec("b"))
        await wait_for(lambda: _up(rt, "node-a", "node-b"), what="both up")
        up = await asyncio.to_thread(ctl, "forget", "node-b")
        assert up.returncode == 1 and "node 'node-b' is up: stop its agent first" in up.stderr, up
        a.signal(signal.SIGKILL)
        await a.wait()
        await wait_for(lambda: _state(rt, "node-a", "unhealthy"), timeout=GRACE + 2 * INTERVAL + 5.0,
                       what="node-a unhealthy")
        done = await asyncio.to_thread(ctl, "forget", "node-a")
        assert done.returncode == 0 and done.stdout.strip() == (
            "node-a: forgotten (it was unhealthy); its agent, started again, registers it anew"), done
        assert sorted(await _nodes(rt)) == ["node-b"]
        s = await metrics(rt)
        assert pick(s, "llmgw_node_up", node="node-a") == [] and pick(s, "llmgw_node_up", node="node-b") == [1.0]
        again = await asyncio.to_thread(ctl, "forget", "node-a")
        assert again.returncode == 1 and "no node 'node-a'" in again.stderr, again
        # its agent, started again, registers it anew (a new node, not the forgotten one's record)
        agents(port, "node-a", _spec("a"))
        await wait_for(lambda: _up(rt, "node-a", "node-b"), what="node-a registered again")
