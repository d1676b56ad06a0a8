"""SGLang: ``PYTHON -m sglang.launch_server --model-path M --served-model-name N --api-key K --enable-metrics ...``.

The interpreter is ``engines.sglang.python`` (the environment that has SGLang),
else ``python3`` on PATH. SGLang reads the key from ``--api-key`` only, so it is
on the command line (blanked wherever llmgw shows the command). The memory
fraction is ``--mem-fraction-static``. ``/health`` answers 503 while the server
starts; newer builds leave ``/metrics`` outside the key, older ones guard it
(engines.md §4): llmgw sends the key on every scrape, which works with both.
"""

from __future__ import annotations

from pathlib import Path

from ..config.agent import AgentEngineConfig
from ..engines.sglang import INFO
from .base import LaunchError, LaunchPlan, find_python, model_path, refuse_own_flags
from .spec import LocalModel, ReplicaSpec

__all__ = ["FLAGS", "MODULE", "plan"]

MODULE = "sglang.launch_server"
FLAGS = ("--model-path", "--served-model-name", "--api-key", "--enable-metrics", "--host", "--port",
         "--mem-fraction-static", "--context-length", "--max-running-requests")
"""The flags llmgw passes (``ctl engine-check`` looks for each in ``--help``)."""


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
    python = find_python(engine, "sglang")
    argv = [python, "-m", MODULE, "--model-path", model_path(spec, model), "--served-model-name", spec.served_name,
            "--api-key", spec.api_key, "--enable-metrics", "--host", host, "--port", str(port)]
    if spec.gpu_memory_fraction is not None:
        argv += ["--mem-fraction-static", f"{spec.gpu_memory_fraction:.4f}"]
    if spec.context is not None:
        argv += ["--context-length", str(spec.context)]
    if spec.slots is not None:
        argv += ["--max-running-requests", str(spec.slots)]
    argv += list(spec.args)
    return LaunchPlan(argv=tuple(argv), secrets=(spec.api_key,), health_path="/health",
                      metrics_path=INFO.metrics_path, metrics_need_key=INFO.metrics_need_key)
