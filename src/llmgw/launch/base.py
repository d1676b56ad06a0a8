"""What every engine launcher builds: a :class:`LaunchPlan` (argv, environment, readiness).

One module per engine (:mod:`.llamacpp`, :mod:`.vllm`, :mod:`.sglang`,
:mod:`.trtllm`) turns a :class:`~llmgw.launch.spec.ReplicaSpec` into a plan;
the supervisor runs it. Facts about each engine's server (metrics path, whether
``/metrics`` is behind the key) come from :mod:`llmgw.engines`.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ..config.agent import AgentEngineConfig
from .spec import LocalModel, ReplicaSpec

__all__ = ["OWN_FLAGS", "LaunchError", "LaunchPlan", "Launcher", "find_binary", "find_python", "hide_secret_args",
           "model_path", "refuse_own_flags", "secret_arg_values"]

# A flag whose value is a credential by its name (vLLM's --hf-token, a --password, an --api-key-file is a
# path, not a secret: "file" and "path" names are left shown)
_SECRET_FLAG = re.compile(r"^--?[A-Za-z0-9_-]*(token|secret|passw|api[-_]?key|credential)(?![A-Za-z0-9_-]*(file|path|dir))"
                          r"[A-Za-z0-9_-]*$", re.IGNORECASE)


def secret_arg_values(args: tuple[str, ...] | list[str]) -> list[str]:
    """The values given to flags named as credentials in an engine's ``args`` (``--hf-token T`` or
    ``--hf-token=T``): never shown in logs, messages or the management API."""
    out = []
    for i, a in enumerate(args):
        flag, eq, value = a.partition("=")
        if not _SECRET_FLAG.match(flag):
            continue
        if eq:
            out.append(value)
        elif i + 1 < len(args) and not args[i + 1].startswith("-"):
            out.append(args[i + 1])
    return [v for v in out if v]


def hide_secret_args(args: tuple[str, ...] | list[str]) -> list[str]:
    """``args`` with :func:`secret_arg_values` replaced by ``***``."""
    hidden = set(secret_arg_values(args))
    out = []
    for a in args:
        flag, eq, value = a.partition("=")
        out.append("***" if a in hidden else f"{flag}=***" if eq and value in hidden else a)
    return out



class LaunchError(Exception):
    """The replica cannot be launched as asked (missing binary, a model the engine cannot take); the message says why."""


@dataclass(frozen=True, slots=True)
class LaunchPlan:
    """How to run one replica's engine and how to tell it is ready."""

    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict, repr=False)
    """Added to the agent's environment (the API key may be in it: never log it)."""
    secrets: tuple[str, ...] = field(default=(), repr=False)
    """Values to blank out wherever the plan is shown (the key when it is on argv)."""
    health_path: str = "/health"
    """200 here means ready (llama-server answers 503 while loading)."""
    metrics_path: str = "/metrics"
    metrics_need_key: bool = False

    def shown(self) -> str:
        """The command line with secrets replaced by ``***`` (for logs and messages), quoted as a shell would
        need it (a model path with a space in it reads as one argument)."""
        out = []
        secrets = (*self.secrets, *secret_arg_values(self.argv))
        for a in self.argv:
            hidden = a
            for s in secrets:
                if s:
                    hidden = hidden.replace(s, "***")
            # (an argument that held a secret is shown bare, ``--api-key ***``: quoted, the secret could be
            # split by the quoting and no longer found by a redaction looking for it)
            out.append(shlex.quote(a) if hidden == a else hidden)
        return " ".join(out)


class Launcher(Protocol):
    """A per-engine launcher module's entry point."""

    def __call__(
        self,
        spec: ReplicaSpec,
        model: LocalModel | None,
        *,
        host: str,
        port: int,
        engine: AgentEngineConfig | None,
        work_dir: Path,
    ) -> LaunchPlan:
        """The plan for ``spec`` listening on ``host:port``.

        ``model`` is the fetched mirror model (None: ``spec.model`` is a path or an id
        the engine resolves itself). ``work_dir`` is the replica's own directory for
        files the launch needs (a config file).

        Raises:
            LaunchError: the binary is missing or the spec cannot be run by this engine.
        """
        ...


def _which(name: str) -> tuple[str | None, str]:
    """``shutil.which(name)``; when it finds nothing, also why, worded to follow the name.

    ``which`` skips a file it may not execute as if it were absent, so a PATH entry that
    has the file is looked for again: "not found" and "not an executable" need different fixes.
    """
    found = shutil.which(name)
    if found is not None:
        return found, ""
    if os.path.dirname(name):  # a path: which() looked only there
        if not os.path.exists(name):
            return None, "does not exist"
        return None, "is a directory, not an executable" if os.path.isdir(name) else "is not an executable"
    for d in os.environ.get("PATH", os.defpath).split(os.pathsep):
        candidate = os.path.join(d, name)
        if d and os.path.exists(candidate):
            return None, f"on PATH ({candidate}) is not an executable"
    return None, "is not found on PATH"


def find_binary(engine: AgentEngineConfig | None, default: str, what: str, *, beside_python: bool = False) -> str:
    """``engines.<name>.binary`` from the agent config, else (``beside_python``) ``default`` in the
    directory of ``engines.<name>.python`` (a virtualenv's bin), else ``default`` found on PATH."""
    configured = engine.binary if engine is not None else None
    if beside_python and configured is None and engine is not None and engine.python:
        beside = Path(engine.python).absolute().parent / default
        if beside.is_file():
            return str(beside)
    name = configured or default
    found, why = _which(name)
    if found is None:
        where = f"engines.{what}.binary = {configured!r}" if configured else repr(default)
        raise LaunchError(f"{what}: {where} {why}; install it or set engines.{what}.binary in the agent's config")
    return os.path.abspath(found)  # (engines run in their own work directory)


def find_python(engine: AgentEngineConfig | None, what: str) -> str:
    """``engines.<name>.python`` from the agent config, else ``python3`` on PATH."""
    configured = engine.python if engine is not None else None
    name = configured or "python3"
    found, why = _which(name)
    if found is None:
        where = f"engines.{what}.python = {configured!r}" if configured else "'python3'"
        raise LaunchError(f"{what}: {where} {why}; set engines.{what}.python to the interpreter that has {what}")
    return os.path.abspath(found)


def model_path(spec: ReplicaSpec, model: LocalModel | None) -> str:
    """The model argument: the fetched file, else ``spec.model``; a path in it that the engine would not
    resolve as the operator meant is made absolute here, on the node: ``~`` or ``~user`` (no shell expands it
    for an argv) is the agent's home, ``./`` and ``../`` are the agent's working directory (the engine runs in
    its replica's own work directory). Anything else (``/models/x.gguf``, ``org/model``) is passed as given."""
    if model is not None:
        return model.path
    if spec.model.startswith(("~", "./", "../")):
        return os.path.abspath(os.path.expanduser(spec.model))
    return spec.model


OWN_FLAGS = ("--host", "--port", "--api-key")
"""Flags llmgw passes itself (``--api-key`` through the engine's environment variable where it reads one) and
a deployment's ``args`` may not give again: on another address or port the engine listens where nobody probes
it (the replica sits in ``starting`` until the ready timeout); with a key of its own the router's is refused."""


def refuse_own_flags(spec: ReplicaSpec, flags: tuple[str, ...] = OWN_FLAGS) -> None:
    """Raise :class:`LaunchError` when ``spec.args`` sets one of ``flags`` (``--port N`` or ``--port=N``)."""
    for a in spec.args:
        flag = a.split("=", 1)[0]
        if flag in flags:
            raise LaunchError(f"the deployment's args set {flag}, which llmgw sets itself (each replica's address, "
                              f"port and API key are llmgw's, the router's way in): remove {flag} from args")
