"""A deployment's details (enter on it, when it has no replica) show its spec's memory in GiB, as every
other memory in the console: ``gpu_memory: 70.0 GiB``, not ``gpu_memory: 75161927680``."""

from __future__ import annotations

from llmgw.console.views import details


def test_a_deployment_s_spec_memory_is_in_gib() -> None:
    record = {"name": "chat", "spec": {"gpu_memory": 75161927680, "memory": 2 * 2**30, "replicas": 2,
                                       "gpus": 1}, "gpu_memory": None}
    lines = details(record).splitlines()
    assert "  gpu_memory: 70.0 GiB" in lines
    assert "  memory: 2.0 GiB" in lines
    assert "  replicas: 2" in lines and "  gpus: 1" in lines  # (counts stay counts)
    assert "gpu_memory: –" in lines  # (absent is –, never 0)
