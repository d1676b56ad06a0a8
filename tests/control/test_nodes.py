"""The node map and the cluster collector on plain data, with a fake clock."""

from __future__ import annotations

from cp_helpers import parse, pick
from prometheus_client import CollectorRegistry, generate_latest
from scenario import discovery_of, h100s

from llmgw.control.collector import ClusterCollector
from llmgw.control.nodes import NodeMap
from llmgw.control.service import ControlStats


class Clock:
    def __init__(self) -> None:
        self.wall = 1_800_000_000.0
        self.mono = 100.0

    def advance(self, s: float) -> None:
        self.wall += s
        self.mono += s


def _map(clock: Clock, grace: float = 15.0) -> NodeMap:
    return NodeMap(lambda: grace, clock=lambda: clock.wall, monotonic=lambda: clock.mono)


D = discovery_of({"hostname": "h", "gpus": h100s(2)})


def test_register_is_idempotent_by_name_and_keeps_the_cordon() -> None:
    c = Clock()
    m = _map(c)
    st, created = m.register("n", peer="p", agent_version="1", protocol=(1, 0), discovery=D)
    assert created and len(m) == 1
    m.set_cordoned("n", True)
    c.advance(3)
    st2, created2 = m.register("n", peer="q", agent_version="2", protocol=(1, 1), discovery=D)
    assert not created2 and st2 is st and len(m) == 1 and st.registrations == 2
    assert st.cordoned and st.peer == "q" and st.registered_at == c.wall


def test_up_unhealthy_and_up_again_on_the_control_planes_clock() -> None:
    c = Clock()
    m = _map(c, grace=15.0)
    st, _ = m.register("n", peer="p", agent_version="1", protocol=(1, 0), discovery=D)
    c.advance(15.0)
    assert m.state(st) == "up"
    c.advance(0.1)
    assert m.state(st) == "unhealthy"
    assert m.heartbeat(st.node_id, 1, D) is st
    assert m.state(st) == "up" and st.last_heartbeat == c.wall and st.heartbeats == 1
    assert m.heartbeat("unknown-id", 1, D) is None
    assert m.deregister(st.node_id) is st and len(m) == 0 and m.deregister(st.node_id) is None


def test_collector_past_grace_keeps_up_0_and_timestamp_drops_gpu_gauges() -> None:
    c = Clock()
    m = _map(c, grace=15.0)
    st, _ = m.register("n", peer="p", agent_version="1", protocol=(1, 0), discovery=D)
    reg = CollectorRegistry(auto_describe=False)
    reg.register(ClusterCollector(m, ControlStats()))
    text = generate_latest(reg).decode()
    assert 'llmgw_node_up{node="n"} 1.0' in text and "llmgw_gpu_memory_total_bytes{" in text
    assert "as of the node's last heartbeat" in text
    c.advance(20)
    text = generate_latest(reg).decode()
    assert 'llmgw_node_up{node="n"} 0.0' in text
    assert pick(parse(text), "llmgw_node_last_heartbeat_timestamp_seconds", node="n") == [st.last_heartbeat]
    assert "llmgw_gpu_memory_total_bytes{" not in text and "llmgw_gpu_info{" not in text
    assert 'llmgw_node_info{' in text
    m.deregister(st.node_id)
    text = generate_latest(reg).decode()
    assert 'node="n"' not in text


def test_absent_readings_have_no_sample() -> None:
    c = Clock()
    m = _map(c)
    d = discovery_of({"hostname": "h", "gpus": [{"uuid": "GPU-x", "index": 3, "memory_total_bytes": 10}]})
    m.register("n", peer="p", agent_version="1", protocol=(1, 0), discovery=d)
    reg = CollectorRegistry(auto_describe=False)
    reg.register(ClusterCollector(m, ControlStats()))
    text = generate_latest(reg).decode()
    assert 'llmgw_gpu_memory_total_bytes{gpu_index="3",gpu_uuid="GPU-x",node="n"} 10.0' in text
    for fam in ("llmgw_gpu_utilization_ratio", "llmgw_gpu_temperature_celsius", "llmgw_gpu_power_watts",
                "llmgw_gpu_memory_used_bytes", "llmgw_gpu_ecc_errors_total", "llmgw_gpu_sm_clock_hertz"):
        assert f"{fam}{{" not in text, fam


async def test_own_text_renderer_matches_prometheus_client_and_caches_per_node() -> None:
    import asyncio

    c = Clock()
    m = _map(c, grace=15.0)
    specs = [{"hostname": f"h{i}", "gpus": h100s(8, chr(97 + i % 26))} for i in range(40)]
    specs[3]["gpus"][0]["name"] = 'odd "name" \\ with\nnewline'  # type: ignore[index]
    states = [m.register(f"n{i}", peer="p", agent_version="1", protocol=(1, 0), discovery=discovery_of(s))[0]
              for i, s in enumerate(specs)]
    col = ClusterCollector(m, ControlStats(), slice_s=0.0)  # yield at every chance
    reg = CollectorRegistry(auto_describe=False)
    reg.register(col)

    def norm(text: str) -> dict:  # type: ignore[type-arg]
        return {k: v for k, v in parse(text).items()
                if k[0] not in ("llmgw_cluster_collect_duration_seconds",)}

    other_ran = 0

    async def other() -> None:
        nonlocal other_ran
        while True:
            other_ran += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(other())
    ours = (await col.render_text()).decode()
    task.cancel()
    assert other_ran > 1, "render_text must yield to the loop"
    assert norm(ours) == norm(generate_latest(reg).decode())
    assert col.rebuilt == 40
    await col.render_text()
    assert col.rebuilt == 40  # nothing changed: every node from the cache
    m.heartbeat(states[0].node_id, 1, states[0].discovery)
    c.advance(1)
    await col.render_text()
    assert col.rebuilt == 41  # only the node that heartbeat
    c.advance(20)  # all past grace (node 0 too): readings go, cache follows the state
    text = (await col.render_text()).decode()
    assert "llmgw_gpu_info{" not in text and text.count("llmgw_node_up{") == 40
    assert norm(text) == norm(generate_latest(reg).decode())
    m.deregister(states[5].node_id)
    text = (await col.render_text()).decode()
    assert 'node="n5"' not in text


def test_wire_renderer_matches_the_model_on_every_kind_of_reading() -> None:
    """The scrape renders from the heartbeat's message; prometheus_client's path reads the model: every
    field kind (MIG, XIDs, fabric, remaps, InfiniBand, errors, absent readings) agrees."""
    from llmgw.agent.model import GPU, Discovery, InfinibandPort, NodeFacts
    from llmgw.agent.wire import discovery_to_proto

    d = Discovery(
        facts=NodeFacts(hostname="h", cpu_cores=64, memory_total_bytes=10, driver_version="550.1",
                        infiniband=(InfinibandPort("mlx5_0", 1, rcv_bytes=4, xmit_bytes=None),)),
        gpus=(
            GPU(uuid="GPU-a", index=0, name="NVIDIA A100", mig_mode=True, memory_total_bytes=80, health="degraded",
                xid_errors=((79, 2), (48, 1)), remapped_rows_correctable=3, remapped_rows_pending=False,
                fabric_state="in_progress", ecc_uncorrected_volatile=0, errors=("nvmlDeviceGetX: Unknown",)),
            GPU(uuid="MIG-b", index=1, parent_uuid="GPU-a", memory_used_bytes=5, sm_clock_mhz=1410.0,
                health="some-new-word"),
            GPU(uuid="GPU-c", health="error"),
        ),
        source="nvml", errors=("partial",),
    )
    c = Clock()
    model_map, wire_map = _map(c), _map(c)
    model_map.register("n", peer="p", agent_version="1", protocol=(1, 0), discovery=d)
    wire_map.register("n", peer="p", agent_version="1", protocol=(1, 0), discovery=discovery_to_proto(d))

    def texts(m: NodeMap) -> tuple[dict, dict]:  # type: ignore[type-arg]
        import asyncio

        col = ClusterCollector(m, ControlStats())
        reg = CollectorRegistry(auto_describe=False)
        reg.register(col)
        keep = lambda t: {k: v for k, v in parse(t).items() if k[0] != "llmgw_cluster_collect_duration_seconds"}  # noqa: E731
        return keep(asyncio.run(col.render_text()).decode()), keep(generate_latest(reg).decode())

    ours_m, client_m = texts(model_map)
    ours_w, client_w = texts(wire_map)
    assert ours_m == client_m == ours_w == client_w
    assert pick(ours_w, "llmgw_gpu_xid_errors_total", node="n", gpu_uuid="GPU-a", xid="79") == [2.0]
    assert pick(ours_w, "llmgw_gpu_health_state", gpu_uuid="MIG-b", state="some-new-word") == [1.0]
    assert pick(ours_w, "llmgw_gpu_sm_clock_hertz", gpu_uuid="MIG-b") == [1.41e9]
    assert pick(ours_w, "llmgw_gpu_ecc_errors_total", gpu_uuid="GPU-a", error_type="uncorrected") == [0.0]
    assert not pick(ours_w, "llmgw_gpu_ecc_errors_total", gpu_uuid="GPU-a", error_type="corrected")
    assert not pick(ours_w, "llmgw_gpu_utilization_ratio", gpu_uuid="GPU-a")  # absent: no sample
    assert not pick(ours_w, "llmgw_node_ib_port_transmit_bytes_total", node="n")
