"""llama.cpp's ``llama-server``: ``llama-server -m FILE --metrics -np N -c N --alias NAME --host H --port P``.

The key goes in ``LLAMA_API_KEY`` (the environment variable ``--api-key`` reads,
shown as ``(env: LLAMA_API_KEY)`` in ``--help``), not on the command line, where
any user of the node could read it in ``ps``. ``/metrics`` is behind the key
(engines.md §2.3); ``/health`` answers 503 while the model loads, 200 once ready.
A vision model's projector (a mirror blob with role ``projector``) is passed with
``--mmproj``. llama.cpp runs on CPU-only nodes: a replica without GPUs gets
``--device none``.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..config.agent import AgentEngineConfig
from ..engines.llamacpp import INFO
from .base import LaunchError, LaunchPlan, find_binary, model_path, refuse_own_flags
from .spec import LocalModel, ReplicaSpec

__all__ = ["BINARY", "FLAGS", "KEY_ENV", "plan"]

BINARY = "llama-server"
KEY_ENV = "LLAMA_API_KEY"
FLAGS = ("-m", "--metrics", "--api-key", KEY_ENV, "-np", "-c", "--alias", "--host", "--port", "--mmproj", "--device")
"""The flags llmgw passes (``ctl engine-check`` looks for each in ``--help``)."""


def _check_model_file(path: str, where: str) -> None:
    """A model named by its ``path`` (``where``: as the engine will open it) must be a readable file here:
    llama-server exits at once on one that is not, and each restart would only say so again (a crash loop
    whose log line is cut before the path)."""
    if not os.path.exists(where):
        raise LaunchError(f"model file {path} not found on this node: check the deployment's model (a GGUF "
                          "file's path on the nodes, or a mirror reference such as tiny:1b)")
    if os.path.isdir(where):
        raise LaunchError(f"model {path} is a directory on this node: llama.cpp runs a GGUF file; name the file")
    if not os.access(where, os.R_OK):
        raise LaunchError(f"model file {path} cannot be read by the agent's user on this node: make it readable")


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
    binary = find_binary(engine, BINARY, "llamacpp")
    path = model_path(spec, model)
    if model is None:
        # (a relative path is the engine's to resolve, from its work directory, where it runs)
        _check_model_file(path, os.path.join(work_dir, path))
    argv = [binary, "-m", path, "--metrics", "--host", host, "--port", str(port)]
    if spec.slots is not None:
        argv += ["-np", str(spec.slots)]
    if spec.context is not None:
        argv += ["-c", str(spec.context)]
    argv += ["--alias", spec.served_name]
    if not spec.gpus:
        # NOTE: a CUDA build that sees no GPU (CUDA_VISIBLE_DEVICES is empty for a
        # CPU replica) fails with "invalid value for main_gpu" unless told to offload
        # nothing (cluster.md §4.1).
        argv += ["--device", "none"]
    if model is not None and model.projector:
        argv += ["--mmproj", model.projector]
    argv += list(spec.args)
    return LaunchPlan(
        argv=tuple(argv),
        env={KEY_ENV: spec.api_key},
        health_path="/health",
        metrics_path=INFO.metrics_path,
        metrics_need_key=INFO.metrics_need_key,
    )
