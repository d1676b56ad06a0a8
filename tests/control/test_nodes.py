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
