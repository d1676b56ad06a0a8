"""Node facts from a fake /etc, /proc and /sys tree."""

from __future__ import annotations

import os
import socket

from llmgw.agent.discovery import infiniband_ports, node_facts

MEMINFO = """MemTotal:       2113470832 kB
MemFree:        1000000000 kB
MemAvailable:   1987654321 kB
Buffers:           12345 kB
"""
CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9654 96-Core Processor
flags\t\t: fpu vme

processor\t: 1
model name\t: AMD EPYC 9654 96-Core Processor
"""


def _port(root, dev, port, state, rate, counters):
    base = root / "sys/class/infiniband" / dev / "ports" / str(port)
    (base / "counters").mkdir(parents=True)
    (base / "state").write_text(state + "\n")
    (base / "rate").write_text(rate + "\n")
    for name, value in counters.items():
        (base / "counters" / name).write_text(f"{value}\n")


def test_node_facts_from_fake_root(tmp_path):
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/os-release").write_text('NAME="Ubuntu"\nPRETTY_NAME="Ubuntu 22.04.4 LTS"\nID=ubuntu\n')
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/meminfo").write_text(MEMINFO)
    (tmp_path / "proc/cpuinfo").write_text(CPUINFO)
    _port(tmp_path, "mlx5_0", 1, "4: ACTIVE", "400 Gb/sec (4X NDR)",
          {"port_rcv_data": 1000, "port_xmit_data": 2500, "link_downed": 1, "symbol_error": 0})
    _port(tmp_path, "mlx5_1", 1, "1: DOWN", "10 Gb/sec (4X SDR)",
          {"port_rcv_data": "N/A (no PMA)", "port_xmit_data": 0})
    facts = node_facts("0.17.0", root=tmp_path)
    assert facts.hostname == socket.gethostname()
    assert facts.os == "Ubuntu 22.04.4 LTS"
    assert facts.kernel == os.uname().release
    assert facts.cpu_model == "AMD EPYC 9654 96-Core Processor"
    assert facts.cpu_cores == len(os.sched_getaffinity(0))
    assert facts.memory_total_bytes == 2113470832 * 1024
    assert facts.memory_available_bytes == 1987654321 * 1024
    assert facts.agent_version == "0.17.0"
    assert facts.driver_version is None  # a GPU source fills it
    p0, p1 = facts.infiniband
    assert (p0.device, p0.port, p0.state, p0.rate_gbps) == ("mlx5_0", 1, "ACTIVE", 400.0)
    assert (p0.rcv_bytes, p0.xmit_bytes) == (4000, 10000)  # 4-octet words -> bytes
    assert (p0.link_downed, p0.symbol_errors) == (1, 0)
    assert (p1.device, p1.state, p1.rate_gbps) == ("mlx5_1", "DOWN", 10.0)
    assert p1.rcv_bytes is None  # "N/A (no PMA)": absent
    assert p1.xmit_bytes == 0
    assert p1.link_downed is None and p1.symbol_errors is None  # no such file: absent


def test_empty_root_everything_absent_but_the_process_facts(tmp_path):
    facts = node_facts(root=tmp_path)
    assert facts.os is None and facts.cpu_model is None
    assert facts.memory_total_bytes is None and facts.memory_available_bytes is None
    assert facts.infiniband == ()
    assert facts.hostname and facts.kernel and facts.cpu_cores


def test_this_machine():
    facts = node_facts()
    assert facts.memory_total_bytes and facts.memory_available_bytes
    assert facts.memory_available_bytes <= facts.memory_total_bytes
    assert isinstance(infiniband_ports(), tuple)


def test_arm_cpuinfo(tmp_path):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/cpuinfo").write_text("processor\t: 0\nBogoMIPS\t: 2000.00\nCPU part\t: 0xd4f\n\nModel\t: NVIDIA Grace\n")
    assert node_facts(root=tmp_path).cpu_model == "NVIDIA Grace"
