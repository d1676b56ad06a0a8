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


# -- a failed read keeps the GPUs seen (docs/agent.md, "Absent is not zero") --------------------------

READINGS = ("memory_used_bytes", "memory_free_bytes", "utilization_gpu_ratio", "utilization_memory_ratio",
            "temperature_celsius", "power_watts", "power_limit_watts", "sm_clock_mhz", "ecc_corrected_volatile",
            "ecc_uncorrected_volatile", "mig_mode")


def _scenario(monkeypatch, tmp_path, base, **changes):
    """The stand-in answers from ``base`` (a scenario dict) with ``changes``, from now on."""
    path = tmp_path / f"scenario-{len(list(tmp_path.iterdir()))}.json"
    path.write_text(json.dumps({**base, **changes}))
    monkeypatch.setenv("LLMGW_FAKE_SMI_SCENARIO", str(path))


def _assert_kept(seen, kept, health):
    """``kept`` lists the GPUs ``seen`` lists, by what does not change, every reading absent."""
    assert [g.uuid for g in kept] == [g.uuid for g in seen]
    for s, k in zip(seen, kept, strict=True):
        assert (k.index, k.name, k.pci_bus_id, k.memory_total_bytes) == (s.index, s.name, s.pci_bus_id,
                                                                         s.memory_total_bytes)
        assert all(getattr(k, m) is None for m in READINGS), k  # absent, never the last number nor 0
        assert k.health == health, k


@pytest.mark.parametrize(
    ("changes", "said"),
    [
        ({"sleep": 5}, "did not answer within 0.5 s"),  # hung past its timeout
        ({"fail": {"message": "Failed to initialize NVML: Unknown Error", "exit": 255}},
         "nvidia-smi: Failed to initialize NVML: Unknown Error"),  # an exit status
        ({"gpus": [], "extra_lines": ["\x1b[?garbage 0x0 ###"]}, "garbage"),  # garbage, exit 0
        ({"gpus": []}, "nvidia-smi listed no GPUs"),  # nothing at all, exit 0
    ],
    ids=["timeout", "exit-status", "garbage", "empty"],
)
def test_a_failed_run_keeps_the_gpus_seen_with_readings_absent(smi_scenario, tmp_path, monkeypatch, changes, said):
    base = json.loads(smi_scenario("smi_h100x8").read_text())
    source = SmiSource(str(FAKE_SMI), timeout=0.5)
    seen = source.read()
    assert len(seen.gpus) == 8 and seen.errors == ()

    _scenario(monkeypatch, tmp_path, base, **changes)
    d = source.read()
    # a GPU node does not read as a CPU node: its GPUs stay listed, nothing known of them now
    _assert_kept(seen.gpus, d.gpus, "unknown")
    assert any(said in e for e in d.errors), d.errors  # the failure: the node's
    assert all(g.errors == () for g in d.gpus)
    assert d.facts.driver_version == "550.54.15"  # as last read (the node's list shows it, not "–")
    assert source.read().gpus == d.gpus  # and on every failed read after

    _scenario(monkeypatch, tmp_path, base)  # answering again: the readings come back
    back = source.read()
    assert back == seen


def test_a_gpu_lost_keeps_its_row_with_health_error_and_the_line(smi_scenario, tmp_path, monkeypatch):
    base = json.loads(smi_scenario("smi_h100x8").read_text())
    source = SmiSource(str(FAKE_SMI))
    seen = source.read()
    line = "Unable to determine the device handle for GPU0000:5D:00.0: GPU is lost.  Reboot the system to recover this GPU"
    _scenario(monkeypatch, tmp_path, base, gpus=[g for g in base["gpus"] if g["index"] != 3], extra_lines=[line],
              exit=15)
    d = source.read()
    assert len(d.gpus) == 8 and [g.index for g in d.gpus] == list(range(8))  # 8, not 7; in its place
    lost = d.gpus[3]
    _assert_kept([seen.gpus[3]], [lost], "error")
    assert lost.errors == (line,)  # said on the GPU, as NVML says a GPU fallen off the bus
    assert [g for i, g in enumerate(d.gpus) if i != 3] == [g for i, g in enumerate(seen.gpus) if i != 3]
    assert d.errors == ("nvidia-smi: exit status 15",)
    assert d.facts.driver_version == "550.54.15"

    # left out without a word: the same, with the reason
    _scenario(monkeypatch, tmp_path, base, gpus=[g for g in base["gpus"] if g["index"] != 5])
    d = source.read()
    assert len(d.gpus) == 8 and d.gpus[5].health == "error" and d.errors == ()
    assert d.gpus[5].errors == ("nvidia-smi no longer lists this GPU (seen before)",)

    _scenario(monkeypatch, tmp_path, base)  # back (a reset): read again
    assert source.read() == seen


def test_the_only_gpu_lost_keeps_its_row(smi_scenario, tmp_path, monkeypatch):
    base = json.loads(smi_scenario("smi_gpu_lost").read_text())
    base["extra_lines"], base["exit"] = [], 0
    _scenario(monkeypatch, tmp_path, base)
    source = SmiSource(str(FAKE_SMI))
    (seen,) = source.read().gpus
    bus = seen.pci_bus_id[4:]  # (nvidia-smi's error lines write a shorter domain than its rows)
    line = f"Unable to determine the device handle for GPU{bus}: GPU is lost.  Reboot the system to recover this GPU"
    _scenario(monkeypatch, tmp_path, base, gpus=[], extra_lines=[line], exit=15)
    d = source.read()
    (lost,) = d.gpus
    _assert_kept([seen], [lost], "error")
    assert lost.errors == (f"nvidia-smi: {line}",)
    assert d.errors == ("nvidia-smi listed no GPUs",)


def test_a_gpu_lost_before_it_was_seen_is_a_node_error(smi_scenario):
    smi_scenario("smi_gpu_lost")  # GPU 0000:02:00.0 lost from the first read: no UUID to list it by
    d = SmiSource(str(FAKE_SMI)).read()
    assert len(d.gpus) == 1 and any("GPU is lost" in e for e in d.errors)


def test_a_board_replaced_at_the_same_bus_id_is_not_kept(smi_scenario, tmp_path, monkeypatch):
    base = json.loads(smi_scenario("smi_h100x8").read_text())
    source = SmiSource(str(FAKE_SMI))
    source.read()
    gpus = [dict(g) for g in base["gpus"]]
    gpus[2]["uuid"] = "GPU-99999999-0b2a-4c7d-9e1f-000000000002"
    _scenario(monkeypatch, tmp_path, base, gpus=gpus)
    d = source.read()
    assert [g.uuid for g in d.gpus] == [g["uuid"] for g in gpus] and d.errors == ()
    assert {g.health for g in d.gpus} == {"ok", "degraded"}
