"""TensorRT-LLM: ``trtllm-serve`` run behind llmgw's own launcher, :mod:`llmgw.launch.trtllm_guard`.

``trtllm-serve`` has no API-key support (engines.md §3.4), so the agent runs
``PYTHON -I -S trtllm_guard.py --host H --port P --work-dir D -- trtllm-serve MODEL ...``
with ``engines.trtllm.python`` (the interpreter that has ``tensorrt_llm``; it
need not have llmgw: the guard is one standard-library file). The guard takes
the key from ``LLMGW_TRTLLM_API_KEY`` (it refuses to start without one), runs
``trtllm-serve`` on a loopback port of its own with ``return_perf_metrics`` and
``enable_iter_perf_stats`` on, and proxies, demanding the key for everything but
``/health``. The router reads ``/prometheus/metrics`` (with the key).

``trtllm-serve``: ``engines.trtllm.binary``, else beside the interpreter, else on PATH.
"""

from __future__ import annotations

from pathlib import Path

from ..config.agent import AgentEngineConfig
from ..engines.trtllm import INFO
from . import trtllm_guard
from .base import LaunchError, LaunchPlan, find_binary, find_python, model_path
from .spec import LocalModel, ReplicaSpec

__all__ = ["BINARY", "FLAGS", "GUARD", "plan"]

BINARY = "trtllm-serve"
GUARD = Path(trtllm_guard.__file__)
"""The launcher file the agent runs with ``engines.trtllm.python``."""
FLAGS = ("--host", "--port", "--config", "--max_seq_len", "--max_batch_size")
"""The flags llmgw passes to ``trtllm-serve`` (``ctl engine-check`` looks for each in ``--help``)."""


def binary(engine: AgentEngineConfig | None) -> str:
    return find_binary(engine, BINARY, "trtllm", beside_python=True)


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
        raise LaunchError(f"replica {spec.id}: no API key; the TensorRT-LLM launcher refuses to start without one")
    python = find_python(engine, "trtllm")
    serve = [binary(engine), model_path(spec, model)]
    if spec.context is not None:
        serve += ["--max_seq_len", str(spec.context)]
    if spec.slots is not None:
        serve += ["--max_batch_size", str(spec.slots)]
    serve += list(spec.args)
    argv = [python, "-I", "-S", str(GUARD), "--host", host, "--port", str(port), "--work-dir", str(work_dir), "--", *serve]
    return LaunchPlan(argv=tuple(argv), env={trtllm_guard.KEY_ENV: spec.api_key}, health_path="/health",
                      metrics_path=INFO.metrics_path, metrics_need_key=True)
