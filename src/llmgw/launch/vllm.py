"""vLLM: ``vllm serve MODEL --served-model-name NAME --host H --port P [--gpu-memory-utilization F]``.

The key goes in ``VLLM_API_KEY``, which vLLM reads as it reads ``--api-key``
(``args.api_key or envs.VLLM_API_KEY``), so that it is not on the command line
for any user of the node to see in ``ps``. vLLM checks it on ``/v1*`` only:
``/metrics`` and ``/health`` stay open (engines.md §1). The memory fraction is
the claim's share of each GPU (cluster.md §4.1: a fraction of the total, per
instance); ``--disable-log-stats`` is never passed (it freezes the gauges).

The executable: ``engines.vllm.binary``, else ``vllm`` beside
``engines.vllm.python``, else ``vllm`` on PATH.
"""

from __future__ import annotations

from pathlib import Path

from ..config.agent import AgentEngineConfig
from ..engines.vllm import INFO
from .base import LaunchError, LaunchPlan, find_binary, model_path, refuse_own_flags
from .spec import LocalModel, ReplicaSpec

__all__ = ["BINARY", "FLAGS", "KEY_ENV", "plan"]

BINARY = "vllm"
KEY_ENV = "VLLM_API_KEY"
FLAGS = ("--api-key", "--served-model-name", "--host", "--port", "--gpu-memory-utilization", "--max-model-len",
         "--max-num-seqs")
"""The flags llmgw passes to ``vllm serve`` (``ctl engine-check`` looks for each in ``--help=all``)."""


def binary(engine: AgentEngineConfig | None) -> str:
    return find_binary(engine, BINARY, "vllm", beside_python=True)


def plan(
    spec: ReplicaSpec,
    model: LocalModel | None,
    *,
    host: str,
    port: int,
    engine: AgentEngineConfig | None,
    work_dir: Path,
) -> LaunchPlan:
    if not spec.api_key:
        raise LaunchError(f"replica {spec.id}: no API key; llmgw never runs an engine open to the network")
    refuse_own_flags(spec)
    argv = [binary(engine), "serve", model_path(spec, model), "--served-model-name", spec.served_name,
            "--host", host, "--port", str(port)]
    if spec.gpu_memory_fraction is not None:
        argv += ["--gpu-memory-utilization", f"{spec.gpu_memory_fraction:.4f}"]
    if spec.context is not None:
        argv += ["--max-model-len", str(spec.context)]
    if spec.slots is not None:
        argv += ["--max-num-seqs", str(spec.slots)]
    argv += list(spec.args)
    return LaunchPlan(argv=tuple(argv), env={KEY_ENV: spec.api_key}, health_path="/health",
                      metrics_path=INFO.metrics_path, metrics_need_key=INFO.metrics_need_key)
