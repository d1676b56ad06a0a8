"""open_source: the auto order, the none and simulated sources, the stand-in's fidelity."""

from __future__ import annotations

import os

import pynvml
import pytest
from discovery_helpers import BIN, FAKE_SMI, SCENARIOS

from llmgw.agent.discovery import (
    SIMULATED_NAME,
    NoneSource,
    NvmlSource,
    SimulatedSource,
    SmiSource,
    open_source,
)
from llmgw.agent.model import SOURCES
from llmgw.testing.fake_nvml import FakeNvml


def test_real_pynvml_without_a_gpu_is_not_an_nvml_node(monkeypatch, tmp_path):
    # This machine has no NVIDIA driver: the real nvmlInit raises LibraryNotFound.
    with pytest.raises(pynvml.NVMLError_LibraryNotFound):
        pynvml.nvmlInit()
    monkeypatch.setenv("PATH", str(tmp_path))  # and no nvidia-smi
    source = open_source("auto", root=tmp_path)
    assert isinstance(source, NoneSource)
    d = source.read()
    assert d.source == "none" and d.gpus == () and d.errors == ()
    assert d.facts.hostname and d.facts.cpu_cores  # a CPU node is a valid node


def test_auto_prefers_nvml(fake_nvml):
    nvml = fake_nvml("h100x8")
    source = open_source("auto", nvml=nvml)
    assert isinstance(source, NvmlSource)
    d = source.read()
    assert d.source == "nvml" and len(d.gpus) == 8
    source.close()


def test_auto_nvml_unavailable_then_nvidia_smi_on_path(monkeypatch, smi_scenario):
    smi_scenario("smi_h100x8")
    monkeypatch.setenv("PATH", f"{BIN}{os.pathsep}{os.environ['PATH']}")
    no_driver = FakeNvml({"init_failures": 1, "init_error": "LibraryNotFound"})
    source = open_source("auto", nvml=no_driver)
    assert isinstance(source, SmiSource)
    d = source.read()
    assert d.source == "nvidia-smi" and len(d.gpus) == 8


def test_auto_nvml_failing_falls_back_to_nvidia_smi(monkeypatch, smi_scenario):
    smi_scenario("smi_h100x8")
    monkeypatch.setenv("PATH", f"{BIN}{os.pathsep}{os.environ['PATH']}")
    broken = FakeNvml(SCENARIOS / "init_unknown.yaml")
    assert isinstance(open_source("auto", nvml=broken), SmiSource)


def test_auto_nvml_failing_without_nvidia_smi_reports_the_failure(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    broken = FakeNvml(SCENARIOS / "init_unknown.yaml")
    source = open_source("auto", nvml=broken)
    # Not "none": a node whose driver fails must not read as a node without GPUs.
    assert isinstance(source, NvmlSource)
    d = source.read()
    assert d.errors == ("Failed to initialize NVML: Unknown Error",)
    assert len(source.read().gpus) == 1  # the third init succeeds


def test_auto_without_pynvml(monkeypatch, tmp_path):
    import llmgw.agent.discovery as discovery

    def no_pynvml():
        raise ImportError("No module named 'pynvml'")

    monkeypatch.setattr(discovery, "_import_pynvml", no_pynvml)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert isinstance(open_source("auto"), NoneSource)


def test_explicit_kinds(fake_nvml):
    assert isinstance(open_source("none"), NoneSource)
    assert isinstance(open_source("nvidia-smi", smi_path=str(FAKE_SMI)), SmiSource)
    assert isinstance(open_source("nvml", nvml=fake_nvml("h100x8")), NvmlSource)
    assert isinstance(open_source("simulated"), SimulatedSource)
    # nvml asked for and not there: it says so on every read, and retries.
    d = open_source("nvml").read()
    assert d.source == "nvml" and d.gpus == ()
    assert d.errors == ("Failed to initialize NVML: NVML Shared Library Not Found",)
    with pytest.raises(ValueError, match="unknown GPU source"):
        open_source("dcgm")
    for source in (NoneSource(), SimulatedSource(), SmiSource()):
        assert source.name in SOURCES


def test_agent_version_in_facts():
    assert open_source("none", agent_version="9.9.9").read().facts.agent_version == "9.9.9"


def test_simulated_says_so_and_moves():
    t = [1000.0]
    source = SimulatedSource(2, clock=lambda: t[0])
    first = source.read()
    assert first.source == "simulated"
    assert len(first.gpus) == 2
    for g in first.gpus:
        assert g.name == SIMULATED_NAME and "Simulated" in g.name and "demo" in g.name
        assert "simulated" in g.uuid
        assert 0.0 <= g.utilization_gpu_ratio <= 1.0
        assert g.memory_used_bytes + g.memory_free_bytes == g.memory_total_bytes
        assert g.health == "ok"
    t[0] += 60.0
    later = source.read()
    assert [g.utilization_gpu_ratio for g in later.gpus] != [g.utilization_gpu_ratio for g in first.gpus]
    assert all(b.energy_joules > a.energy_joules for a, b in zip(first.gpus, later.gpus, strict=True))
    assert len(open_source("simulated", simulated_gpus=1).read().gpus) == 1
    with pytest.raises(ValueError):
        SimulatedSource(0)


def test_simulated_gpus_of_two_nodes_never_share_a_uuid():
    """GPUs are keyed by UUID (the dashboard, placement): two agents on one machine are two nodes."""
    a = [g.uuid for g in open_source("simulated", node="node-a").read().gpus]
    b = [g.uuid for g in open_source("simulated", node="node-b").read().gpus]
    assert len(set(a)) == 2 and not set(a) & set(b)
    assert a == [g.uuid for g in SimulatedSource(2, node="node-a").read().gpus]  # (stable across restarts)


def test_stand_in_errors_are_the_real_classes():
    nvml = FakeNvml(SCENARIOS / "old_driver.yaml")
    assert nvml.NVMLError is pynvml.NVMLError
    assert nvml.NVMLError_NotSupported is pynvml.NVMLError_NotSupported
    assert nvml.nvmlMemory_v2 == pynvml.nvmlMemory_v2
    assert nvml.NVML_NVLINK_MAX_LINKS == pynvml.NVML_NVLINK_MAX_LINKS
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetCount()
    nvml.nvmlInit()
    with pytest.raises(pynvml.NVMLError_FunctionNotFound) as info:
        nvml.nvmlDeviceGetRemappedRows(nvml.nvmlDeviceGetHandleByIndex(0))
    assert info.value.value == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND == 13
    # A function the stand-in does not implement behaves as a symbol the driver lacks.
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        nvml.nvmlDeviceGetPcieThroughput(nvml.nvmlDeviceGetHandleByIndex(0), 0)
    with pytest.raises(pynvml.NVMLError_NotSupported) as info:
        nvml.nvmlDeviceGetTotalEnergyConsumption(nvml.nvmlDeviceGetHandleByIndex(0))
    assert info.value.value == 3
    nvml.nvmlShutdown()


def test_diagnostic_main_prints_json(capsys):
    import json

    from llmgw.agent.discovery.__main__ import main

    assert main(["--source", "simulated", "--reads", "2", "--interval", "0"]) == 0
    out = capsys.readouterr().out
    decoder = json.JSONDecoder()
    first, end = decoder.raw_decode(out)
    second, _ = decoder.raw_decode(out[end:].lstrip())
    assert first["source"] == "simulated" and first["read"] == 0 and second["read"] == 1
    assert first["gpus"][0]["name"] == SIMULATED_NAME
    assert first["gpus"][0]["parent_uuid"] is None  # absent stays null in JSON, never 0
