"""NvmlSource over the stand-in pynvml, one scenario at a time.

Everything above the pynvml module is the code that runs on a GPU node; only the
GPU is mocked (llmgw.testing.fake_nvml, scenarios under tests/agent/scenarios/).
"""

from __future__ import annotations

import dataclasses

import pynvml

from llmgw.agent.discovery import NvmlSource
from llmgw.agent.discovery.nvml import format_cuda_version
from llmgw.agent.model import GPU, GPU_HEALTH, NodeFacts

MEASUREMENTS = [
    f.name
    for f in dataclasses.fields(GPU)
    if f.name not in ("uuid", "index", "name", "pci_bus_id", "parent_uuid", "xid_errors", "health", "errors")
]


def test_eight_h100s_every_reading(fake_nvml):
    source = NvmlSource(fake_nvml("h100x8"), facts=lambda: NodeFacts(hostname="gpu-node-1"))
    d = source.read()
    assert d.source == "nvml" and d.errors == ()
    assert d.facts.hostname == "gpu-node-1"
    assert d.facts.driver_version == "550.54.15"
    assert d.facts.cuda_driver_version == "12.4"
    assert len(d.gpus) == 8
    assert len({g.uuid for g in d.gpus}) == 8
    assert [g.index for g in d.gpus] == list(range(8))
    g = d.gpus[0]
    assert g.uuid == "GPU-8d1c3f5e-0b2a-4c7d-9e1f-000000000000"
    assert g.name == "NVIDIA H100 80GB HBM3"
    assert g.pci_bus_id == "00000000:18:00.0"
    assert g.parent_uuid is None
    # v2 memory: "used" without the driver's reservation (v1 would add 553648128).
    assert (g.memory_total_bytes, g.memory_used_bytes, g.memory_free_bytes) == (
        85520809984,
        72351744000,
        12615417856,
    )
    assert g.utilization_gpu_ratio == 0.87 and g.utilization_memory_ratio == 0.41
    assert g.temperature_celsius == 54.0
    assert g.power_watts == 612.345  # mW -> W
    assert g.power_limit_watts == 700.0
    assert g.energy_joules == 98765432.1  # mJ -> J
    assert g.sm_clock_mhz == 1980.0
    assert (g.ecc_corrected_volatile, g.ecc_uncorrected_volatile) == (0, 0)
    assert (g.remapped_rows_correctable, g.remapped_rows_uncorrectable) == (0, 0)
    assert (g.remapped_rows_pending, g.remapped_rows_failure) == (False, False)
    assert g.mig_mode is False
    assert (g.nvlink_links_active, g.nvlink_links_total) == (18, 18)
    assert (g.fabric_state, g.fabric_healthy) == ("completed", True)
    assert g.health == "ok" and g.errors == () and g.xid_errors == ()
    # Every measurement was read on a healthy H100: none absent.
    assert all(getattr(gpu, m) is not None for gpu in d.gpus for m in MEASUREMENTS)
    source.close()


def test_xid_event_counted_per_gpu_and_degrades_it(fake_nvml):
    nvml = fake_nvml("h100x8")
    source = NvmlSource(nvml)
    d = source.read()
    by_index = {g.index: g for g in d.gpus}
    assert by_index[3].xid_errors == ((79, 1),)
    assert by_index[3].health == "degraded"
    assert all(by_index[i].xid_errors == () and by_index[i].health == "ok" for i in by_index if i != 3)
    # Drained without blocking: the set is empty now, counts are kept since the start.
    nvml.queue_xid(by_index[3].uuid, 79)
    nvml.queue_xid(by_index[3].uuid, 94)
    nvml.queue_xid(by_index[5].uuid, 13)
    d = source.read()
    by_index = {g.index: g for g in d.gpus}
    assert by_index[3].xid_errors == ((79, 2), (94, 1))
    assert by_index[5].xid_errors == ((13, 1),) and by_index[5].health == "degraded"
    assert nvml.calls["nvmlDeviceRegisterEvents"] == 8  # registered once per GPU, not per read
    source.close()


def test_handles_kept_by_uuid_not_looked_up_each_read(fake_nvml):
    nvml = fake_nvml("h100x8")
    source = NvmlSource(nvml)
    for _ in range(3):
        source.read()
    assert nvml.calls["nvmlDeviceGetHandleByIndex"] == 8
    assert nvml.calls["nvmlInit"] == 1
    source.close()
    assert not nvml.initialized
    assert nvml.calls["nvmlEventSetFree"] == 1


def test_mig_enabled_a100_utilisation_absent_and_mig_devices_with_parent(fake_nvml):
    d = NvmlSource(fake_nvml("a100_mig")).read()
    assert d.errors == ()
    parent, *migs = d.gpus
    assert parent.uuid.startswith("GPU-") and parent.mig_mode is True
    # NotSupported on a MIG-enabled GPU: absent, never 0.
    assert parent.utilization_gpu_ratio is None and parent.utilization_memory_ratio is None
    # The aggregate memory needs privileges (NoPermission): absent too.
    assert parent.memory_total_bytes is None and parent.memory_used_bytes is None
    assert parent.temperature_celsius == 38.0 and parent.ecc_corrected_volatile == 2
    assert (parent.nvlink_links_active, parent.nvlink_links_total) == (11, 12)
    assert parent.fabric_state is None and parent.fabric_healthy is None  # not an NVSwitch system
    assert parent.health == "ok"
    assert len(migs) == 2
    for i, mig in enumerate(migs):
        assert mig.uuid.startswith("MIG-")
        assert mig.parent_uuid == parent.uuid
        assert mig.index == i
        assert mig.name == "NVIDIA A100-SXM4-80GB MIG 3g.40gb"
        assert mig.memory_total_bytes == 42314694656
        assert mig.utilization_gpu_ratio is None and mig.utilization_memory_ratio is None
        assert mig.power_watts is None and mig.temperature_celsius is None
    assert migs[1].memory_used_bytes == 30064771072


def test_old_driver_missing_functions_still_discovers(fake_nvml):
    nvml = fake_nvml("old_driver")
    source = NvmlSource(nvml)
    d = source.read()
    assert d.errors == ()
    assert d.facts.driver_version == "418.226.00"
    # nvmlSystemGetCudaDriverVersion_v2 missing: the v1 call answers.
    assert d.facts.cuda_driver_version == "10.1"
    (g,) = d.gpus
    assert g.uuid == "GPU-0e1d2c3b-4a59-4687-9788-a9b0c1d2e3f4"
    assert g.health == "ok" and g.errors == ()
    # Memory v2 symbol missing: v1.
    assert g.memory_total_bytes == 34089730048 and g.memory_used_bytes == 1048576
    # nvmlDeviceGetTemperatureV missing: the deprecated call answers.
    assert g.temperature_celsius == 33.0
    # The utilisation of an idle card is 0, and reported as 0 (it was read).
    assert g.utilization_gpu_ratio == 0.0
    # Remapped rows: the call is missing; the field values answer two of four, each
    # with its own return code.
    assert (g.remapped_rows_correctable, g.remapped_rows_uncorrectable) == (0, 0)
    assert g.remapped_rows_pending is None and g.remapped_rows_failure is None
    # Fabric calls missing, no NVLink, no energy counter, no MIG: absent.
    for absent in ("fabric_state", "fabric_healthy", "nvlink_links_active", "nvlink_links_total",
                   "energy_joules", "mig_mode"):
        assert getattr(g, absent) is None, absent
    # A missing symbol is asked once, not on every read.
    source.read()
    source.read()
    assert nvml.calls["nvmlDeviceGetRemappedRows"] == 1
    assert nvml.calls["nvmlDeviceGetGpuFabricInfoV"] == 1
    assert nvml.calls["nvmlSystemGetCudaDriverVersion_v2"] == 1
    source.close()


def test_gpu_lost_mid_run_is_an_error_then_read_again(fake_nvml):
    nvml = fake_nvml("gpu_lost")
    source = NvmlSource(nvml)
    healthy = source.read()
    assert [g.health for g in healthy.gpus] == ["ok", "ok"]
    source.read()
    lost_reads = [source.read(), source.read()]  # reads 3 and 4: the GPU is lost
    for d in lost_reads:
        assert d.errors == ()  # the node still reads; the other GPU still reports
        ok, lost = d.gpus
        assert ok.health == "ok" and ok.utilization_gpu_ratio == 0.12
        assert lost.uuid == "GPU-bbbbbbbb-1111-4222-8333-444444444444"
        assert lost.health == "error"
        assert any("GPU is lost" in e for e in lost.errors)
        # Identity and memory total as last known (what does not change); every measurement absent, never zero.
        assert lost.index == 1 and lost.name == "NVIDIA L40S" and lost.pci_bus_id == "00000000:02:00.0"
        assert lost.memory_total_bytes == 48305799168
        assert all(getattr(lost, m) is None for m in MEASUREMENTS if m != "memory_total_bytes")
    back = source.read()  # read 5: the GPU answers again
    assert [g.health for g in back.gpus] == ["ok", "ok"]
    assert back.gpus[1].uuid == "GPU-bbbbbbbb-1111-4222-8333-444444444444"
    assert back.gpus[1].memory_used_bytes == 20971520000
    assert nvml.calls["nvmlDeviceGetHandleByUUID"] >= 1  # retried by UUID, not by index
    source.close()


def test_init_failure_reported_then_recovered(fake_nvml):
    nvml = fake_nvml("init_unknown")
    source = NvmlSource(nvml, facts=lambda: NodeFacts(hostname="n1", cpu_cores=4))
    for _ in range(2):
        d = source.read()
        assert d.source == "nvml"
        assert d.errors == ("Failed to initialize NVML: Unknown Error",)
        assert d.gpus == ()
        assert d.facts.hostname == "n1" and d.facts.cpu_cores == 4  # the node still reports
        assert d.facts.driver_version is None
    d = source.read()
    assert d.errors == ()
    assert len(d.gpus) == 1 and d.gpus[0].health == "ok"
    assert nvml.calls["nvmlInit"] == 3
    source.close()
    assert not nvml.initialized


def test_uninitialized_midway_reinitialises(fake_nvml):
    nvml = fake_nvml("h100x8")
    source = NvmlSource(nvml)
    source.read()
    nvml.nvmlShutdown()  # someone else in the process shut NVML down
    d = source.read()
    assert d.errors and "Uninitialized" in d.errors[0]
    # the GPUs seen stay listed by what does not change, their readings absent (not a node without GPUs)
    assert len(d.gpus) == 8 and {g.health for g in d.gpus} == {"unknown"}
    assert all(getattr(g, m) is None for g in d.gpus for m in MEASUREMENTS if m != "memory_total_bytes")
    assert d.facts.driver_version == "550.54.15"
    d = source.read()
    assert len(d.gpus) == 8 and d.errors == ()
    source.close()


def test_unexpected_error_on_one_reading_is_absent_and_said(fake_nvml):
    nvml = fake_nvml("gpu_lost")
    nvml.scenario["gpus"][0]["errors"] = {"nvmlDeviceGetPowerUsage": "Timeout"}
    d = NvmlSource(nvml).read()
    g = d.gpus[0]
    assert g.power_watts is None
    assert g.power_limit_watts == 350.0
    assert g.errors == ("nvmlDeviceGetPowerUsage: Timeout",)
    assert g.health == "degraded"
    assert d.gpus[1].health == "ok"


def test_fabric_not_started_and_unhealthy(fake_nvml):
    nvml = fake_nvml("h100x8")
    gpus = nvml.scenario["gpus"]
    gpus[0]["fabric"] = {"state": 1}  # fabric manager not running
    gpus[1]["fabric"] = {"state": 3, "status": pynvml.NVML_ERROR_UNKNOWN}
    gpus[2]["fabric"] = {"state": 3, "status": 0, "health_summary": 2}
    gpus[3]["fabric"] = {"state": 0}  # not an NVSwitch system
    gpus[4]["fabric"] = {"state": 3, "status": 0, "max_version": 2}  # driver without the v3 struct
    d = NvmlSource(nvml).read()
    g = d.gpus
    assert (g[0].fabric_state, g[0].fabric_healthy, g[0].health) == ("not_started", False, "degraded")
    assert (g[1].fabric_state, g[1].fabric_healthy, g[1].health) == ("completed", False, "degraded")
    assert (g[2].fabric_state, g[2].fabric_healthy) == ("completed", False)
    assert (g[3].fabric_state, g[3].fabric_healthy) == ("not_supported", None)
    assert (g[4].fabric_state, g[4].fabric_healthy, g[4].health) == ("completed", True, "ok")


def test_uncorrected_ecc_and_pending_rows_degrade(fake_nvml):
    nvml = fake_nvml("h100x8")
    nvml.scenario["gpus"][0]["ecc"] = {"corrected": 5, "uncorrected": 1}
    nvml.scenario["gpus"][1]["remapped_rows"] = [0, 1, 1, 0]
    nvml.scenario["gpus"][2]["ecc"] = {"corrected": 12, "uncorrected": 0}
    d = NvmlSource(nvml).read()
    assert d.gpus[0].health == "degraded" and d.gpus[0].ecc_uncorrected_volatile == 1
    assert d.gpus[1].health == "degraded" and d.gpus[1].remapped_rows_pending is True
    assert d.gpus[2].health == "ok"  # corrected errors alone are what ECC is for
    assert {g.health for g in d.gpus} <= set(GPU_HEALTH)


def test_format_cuda_version():
    assert format_cuda_version(12040) == "12.4"
    assert format_cuda_version(11080) == "11.8"
    assert format_cuda_version(13000) == "13.0"


def test_a_gpu_lost_across_a_reinitialisation_stays_listed(fake_nvml):
    nvml = fake_nvml("gpu_lost")  # GPU 1 lost from the third read to the fourth
    source = NvmlSource(nvml)
    seen = source.read()
    source.read()
    nvml.nvmlShutdown()  # NVML went away: initialised again on the next read, which forgets the handles
    d = source.read()
    assert d.errors and "Uninitialized" in d.errors[0]
    assert [g.uuid for g in d.gpus] == [g.uuid for g in seen.gpus] and {g.health for g in d.gpus} == {"unknown"}
    for _ in range(2):  # initialised again, GPU 1 fails at its index: known by no handle, still listed
        d = source.read()
        assert d.errors == ()  # (said on the GPU)
        ok, lost = d.gpus
        assert ok.health == "ok" and ok.utilization_gpu_ratio == 0.12
        assert lost.uuid == seen.gpus[1].uuid and lost.health == "error"
        assert lost.errors == ("GPU at index 1: GPU is lost",)
        assert (lost.index, lost.name, lost.pci_bus_id, lost.memory_total_bytes) == (
            1, "NVIDIA L40S", "00000000:02:00.0", 48305799168)
        assert all(getattr(lost, m) is None for m in MEASUREMENTS if m != "memory_total_bytes")
    back = source.read()  # it answers again: enumerated again, read again
    assert [g.health for g in back.gpus] == ["ok", "ok"] and back.gpus[1].memory_used_bytes == 20971520000
    source.close()
