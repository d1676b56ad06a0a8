"""SmiSource against the stand-in nvidia-smi (tests/agent/bin/nvidia-smi), a real subprocess."""

from __future__ import annotations

import json

import pytest
from discovery_helpers import FAKE_SMI

from llmgw.agent.discovery import SmiSource
from llmgw.agent.discovery.smi import FIELDS, REQUIRED_FIELDS, parse_rows


def test_field_order_utilization_gpu_last():
    names = [f for f, _, _ in FIELDS]
    assert names[-1] == "utilization.gpu"
    assert names[-2] == "utilization.memory"
    assert names[: len(REQUIRED_FIELDS)] == list(REQUIRED_FIELDS)


def test_eight_h100s(smi_scenario):
    smi_scenario("smi_h100x8")
    d = SmiSource(str(FAKE_SMI)).read()
    assert d.source == "nvidia-smi" and d.errors == ()
    assert d.facts.driver_version == "550.54.15"
    assert d.facts.cuda_driver_version is None  # nvidia-smi --query-gpu has no such field
    assert len(d.gpus) == 8 and [g.index for g in d.gpus] == list(range(8))
    g = d.gpus[0]
    assert g.uuid == "GPU-8d1c3f5e-0b2a-4c7d-9e1f-000000000000"
    assert g.name == "NVIDIA H100 80GB HBM3" and g.pci_bus_id == "00000000:18:00.0"
    assert g.memory_total_bytes == 81559 * 1024 * 1024  # MiB -> bytes
    assert g.memory_used_bytes == 69001 * 1024 * 1024
    assert g.utilization_gpu_ratio == 0.87 and g.utilization_memory_ratio == 0.41  # % -> ratio
    assert g.power_watts == 612.34 and g.power_limit_watts == 700.0
    assert g.temperature_celsius == 54.0 and g.sm_clock_mhz == 1980.0
    assert g.mig_mode is False
    assert g.health == "ok"
    # What nvidia-smi does not report is absent, not 0.
    assert g.energy_joules is None and g.nvlink_links_total is None and g.remapped_rows_pending is None
    assert d.gpus[3].ecc_uncorrected_volatile == 2 and d.gpus[3].health == "degraded"


def test_not_available_and_not_supported_are_absent(smi_scenario):
    smi_scenario("smi_geforce")
    (g,) = SmiSource(str(FAKE_SMI)).read().gpus
    assert g.power_watts is None  # [Not Supported]
    assert g.ecc_corrected_volatile is None  # [N/A]
    assert g.ecc_uncorrected_volatile is None  # N/A
    assert g.mig_mode is None
    assert g.utilization_gpu_ratio == 0.0  # an idle card reads 0, and that is a reading
    assert g.power_limit_watts == 450.0


def test_mig_enabled_utilisation_absent(smi_scenario):
    smi_scenario("smi_mig")
    (g,) = SmiSource(str(FAKE_SMI)).read().gpus
    assert g.mig_mode is True
    assert g.utilization_gpu_ratio is None and g.utilization_memory_ratio is None


def test_old_driver_invalid_field_error_retried_without_it(smi_scenario, tmp_path, monkeypatch):
    path = smi_scenario("smi_old_driver_error")
    log = tmp_path / "calls.log"
    scenario = json.loads(path.read_text())
    scenario["log"] = str(log)
    copy = tmp_path / "scenario.json"
    copy.write_text(json.dumps(scenario))
    monkeypatch.setenv("LLMGW_FAKE_SMI_SCENARIO", str(copy))
    source = SmiSource(str(FAKE_SMI))
    d = source.read()
    assert d.errors == ()
    (g,) = d.gpus
    assert g.uuid == "GPU-0e1d2c3b-4a59-4687-9788-a9b0c1d2e3f4"
    assert g.utilization_gpu_ratio is None and g.mig_mode is None
    assert g.utilization_memory_ratio == 0.0 and g.memory_total_bytes == 32510 * 1024 * 1024
    assert "utilization.gpu" not in source.fields and "mig.mode.current" not in source.fields
    runs = len(log.read_text().splitlines())
    assert runs == 3  # told "mig.mode.current" (the first unknown asked), then "utilization.gpu", then rows
    source.read()
    assert len(log.read_text().splitlines()) == runs + 1  # remembered: one run per read from now on


def test_old_driver_shorter_row(smi_scenario):
    smi_scenario("smi_old_driver_short_row")
    source = SmiSource(str(FAKE_SMI))
    d = source.read()
    assert d.errors == ()
    (g,) = d.gpus
    assert g.uuid == "GPU-eeeeeeee-1111-4222-8333-444444444444"
    assert g.name == "Tesla P100-PCIE-16GB"
    assert g.utilization_gpu_ratio is None
    # The unknown middle field was found by asking each optional field once: no shifted columns.
    assert g.mig_mode is None
    assert d.facts.driver_version == "390.157"
    assert g.utilization_memory_ratio == 0.0 and g.ecc_uncorrected_volatile == 0


def test_short_row_tail_absent_without_probe():
    fields = tuple(f for f, _, _ in FIELDS)
    row = "GPU-x, 0, Tesla P100, 00000000:04:00.0, 16280, 0, 16280, 31, 26.5, 250.00, 405, 0, 0, [N/A], 390.157, 0"
    rows, errors = parse_rows(row + "\n", fields)
    assert errors == []
    assert rows[0]["utilization.gpu"] is None and rows[0]["utilization.memory"] == "0"
    assert rows[0]["mig.mode.current"] is None


def test_init_failure_reported(smi_scenario):
    smi_scenario("smi_init_unknown")
    d = SmiSource(str(FAKE_SMI)).read()
    assert d.gpus == ()
    assert d.errors == ("nvidia-smi: Failed to initialize NVML: Unknown Error",)


def test_lost_gpu_line_is_an_error_others_still_report(smi_scenario):
    smi_scenario("smi_gpu_lost")
    d = SmiSource(str(FAKE_SMI)).read()
    assert len(d.gpus) == 1 and d.gpus[0].utilization_gpu_ratio == 0.12
    assert any("GPU is lost" in e for e in d.errors)


def test_missing_executable_and_timeout(smi_scenario, tmp_path, monkeypatch):
    d = SmiSource(str(tmp_path / "no-such-nvidia-smi")).read()
    assert d.gpus == () and d.errors and "not found" in d.errors[0]
    path = smi_scenario("smi_h100x8")
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps({**json.loads(path.read_text()), "sleep": 5}))
    monkeypatch.setenv("LLMGW_FAKE_SMI_SCENARIO", str(slow))
    d = SmiSource(str(FAKE_SMI), timeout=0.5).read()
    assert d.gpus == () and "did not answer within 0.5 s" in d.errors[0]


@pytest.mark.parametrize("value", ["[N/A]", "[Not Supported]", "N/A", "[Unknown Error]", ""])
def test_absent_markers(value):
    rows, _ = parse_rows(f"GPU-x, {value}\n", ("uuid", "temperature.gpu"))
    assert rows[0]["temperature.gpu"] is None
