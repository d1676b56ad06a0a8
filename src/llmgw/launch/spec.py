"""What a node agent is asked to run (:class:`ReplicaSpec`) and what it reports (:class:`ReplicaStatus`).

The control plane is declarative: it hands each node the complete set of
replicas that should run there, and the agent's supervisor starts what is
missing and stops what is no longer asked for (:class:`Supervisor`). Sending
the same set twice changes nothing, so a lost or repeated message, an agent
restart or a control-plane restart all converge on the same state.

The wire (``proto/llmgw/agent/v1``) carries these as messages; this module is
the Python side both halves share.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

# Replica states, in the order a healthy replica passes through them.
FETCHING = "fetching"  # the model's blobs are being fetched from the control plane's mirror
STARTING = "starting"  # the engine runs; readiness not reached yet
READY = "ready"  # readiness reached: the router may send it requests
DRAINING = "draining"  # asked to stop: SIGTERM sent, waiting for the engine to exit
STOPPED = "stopped"  # exited after being asked to
FAILED = "failed"  # gave up: repeated crashes, readiness timeout, missing binary, bad model
STATES = (FETCHING, STARTING, READY, DRAINING, STOPPED, FAILED)

MAX_READY_TIMEOUT = 7 * 86400.0
"""The longest ready timeout a deployment or an agent file may set (seconds)."""


@dataclass(frozen=True, slots=True)
class ModelBlob:
    """One content-addressed file of a mirror model the replica needs."""

    digest: str
    """``sha256:<64 hex>``."""
    size: int
    """Bytes."""
    role: str = "model"
    """``model`` (the GGUF the engine loads) or ``projector`` (a vision model's mmproj)."""


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """One replica a node should run. Equal specs mean the same replica: no restart."""

    id: str
    """Unique in the cluster, stable for the replica's life (e.g. ``chat-3f9a1c``)."""
    deployment: str
    engine: str
    """``vllm``, ``llamacpp``, ``trtllm`` or ``sglang``."""
    model: str
    """A mirror reference (then ``blobs`` is set), a file path on the node, or an id the engine fetches itself."""
    served_name: str
    """The model name clients use; the engine is told to answer to it."""
    blobs: tuple[ModelBlob, ...] = ()
    """Set for a mirror reference: the agent fetches these into its own store before launching."""
    gpus: tuple[str, ...] = ()
    """GPU UUIDs (``GPU-…`` or ``MIG-…``), passed as ``CUDA_VISIBLE_DEVICES``; empty: CPU."""
    gpu_memory_fraction: float | None = None
    """The share of each GPU's memory the claim holds (vLLM/SGLang memory fraction); None: the engine's default."""
    slots: int | None = None
    """Parallel sequences (llama.cpp ``-np``); None: the engine's default."""
    context: int | None = None
    """Context length in tokens (llama.cpp ``-c``); None: the engine's default."""
    args: tuple[str, ...] = field(default=(), repr=False)
    """Extra engine arguments from the deployment, appended after llmgw's own (not in the repr: they may hold
    a credential, ``--hf-token VALUE``)."""
    env: Mapping[str, str] = field(default_factory=dict, repr=False)
    api_key: str = field(default="", repr=False)
    """The per-replica key the control plane generated: the engine demands it, the router sends it."""
    ready_timeout: float | None = None
    """Seconds from the engine's start to its health check's first 200 before the replica fails; None: the
    agent's own ``ready_timeout``. Not part of what the replica runs: a change restarts nothing."""


@dataclass(frozen=True, slots=True)
class ReplicaStatus:
    """What the agent knows about one replica, reported on every heartbeat."""

    id: str
    state: str
    """One of :data:`STATES`."""
    port: int | None = None
    """The port the engine listens on (the agent picks it); None until launched."""
    pid: int | None = None
    restarts: int = 0
    """Crashes restarted so far."""
    exit_code: int | None = None
    """The last exit status (negative: killed by that signal)."""
    message: str = ""
    """Why it failed or is waiting, in a line, with the engine's last output lines where they explain it
    (``<why>; its log ends:`` then the lines: :data:`LOG_TAIL`)."""
    log_path: str | None = None
    fetched: int | None = None
    """Bytes of the model fetched so far, while ``fetching``."""
    fetch_total: int | None = None


LOG_TAIL = "; its log ends:"
"""How a message gives the end of the engine's log: ``<why>; its log ends:\n<the last lines>``. The
supervisor's messages take this form, and so do the control plane's that carry one of them on."""
LOG_HEADER = "--- llmgw "
"""How the lines the supervisor writes into a replica's log begin (``--- llmgw <time>: starting <id>: <argv>``)."""
REASON_WIDTH = 200
"""The most characters :func:`reason_line` gives: two or three lines of a table's last column."""

_TELLING = re.compile(r"(?i)(error|fatal|panic)\b[^:]{0,40}:")
"""A line that says what went wrong: ``error: invalid argument: -x``, ``error loading model: ...``,
``ValueError: ...``, ``FATAL: ...`` (not ``exiting due to model loading error``, which only repeats it)."""


def log_tail(message: str) -> tuple[str, str | None]:
    """``(why, the log's last lines)`` of a message in the :data:`LOG_TAIL` form; ``(message, None)`` without one."""
    why, sep, tail = message.partition(LOG_TAIL)
    return (why, tail.removeprefix("\n")) if sep else (message, None)


def telling_line(log: str) -> str | None:
    """The line of a log's end that best says why the engine stopped, or ``None`` when it printed nothing.

    Only the last run's output counts (the lines after the supervisor's last :data:`LOG_HEADER` line,
    unless that run printed nothing): its last line that names an error (:data:`_TELLING`), else its
    last line.
    """
    runs: list[list[str]] = [[]]
    for raw in log.splitlines():
        line = " ".join(raw.split())  # (tabs, carriage returns and runs of spaces as one space)
        if line.startswith(LOG_HEADER):
            runs.append([])
        elif line:
            runs[-1].append(line)
    lines = next((r for r in reversed(runs) if r), [])
    return next((x for x in reversed(lines) if _TELLING.search(x)), lines[-1] if lines else None)


def reason_line(message: str | None, width: int = REASON_WIDTH) -> str | None:
    """A replica's or a deployment's message as one line of at most ``width`` characters, for a table.

    The reason before :data:`LOG_TAIL`, then ``; log:`` and the log's most telling line
    (:func:`telling_line`); what is too long is cut with ``…``, the log's line keeping at
    least half the width. The whole message stays in the API's JSON (``llmgw ctl
    deployments --json``) and the log in ``llmgw ctl logs REPLICA``.

    Returns:
        ``None`` for no message (or only white space).
    """
    if message is None:
        return None
    why, tail = log_tail(message)
    line = " ".join(why.split())
    telling = telling_line(tail) if tail else None
    if telling and line:
        room = width - len(_LOG_SEP)
        telling = _cut(telling, max(room - len(line), room // 2))
        line = f"{_cut(line, room - len(telling))}{_LOG_SEP}{telling}"
    elif telling:
        line = telling
    return _cut(line, width) or None


def deployment_reason(d: Mapping[str, Any]) -> str | None:
    """A deployment's WHY NOT (``llmgw ctl deployments``, the console): its message, else the message of its
    first replica that is not ready (``fetching the model``, ``started: ...``), as :func:`reason_line` gives
    it: a replica still starting says so rather than nothing."""
    message = d.get("message")
    if not message:
        reps = d.get("replicas")
        message = next((str(r["message"]) for r in reps if isinstance(r, Mapping) and r.get("message")
                        and r.get("state") != "ready"), None) if isinstance(reps, list) else None
    return reason_line(str(message)) if message else None


_LOG_SEP = "; log: "


def _cut(text: str, n: int) -> str:
    return text if len(text) <= n else text[: max(0, n - 1)].rstrip() + "…"


@dataclass(frozen=True, slots=True)
class LocalModel:
    """Where a replica's model files are on the node."""

    path: str
    projector: str | None = None


class ModelFetcher(Protocol):
    """Brings a mirror model's blobs onto the node (the agent's mirror client)."""

    async def ensure(self, spec: ReplicaSpec, progress: Callable[[int, int], None]) -> LocalModel:
        """Return the local files for ``spec.blobs``, fetching what the node lacks.

        ``progress(done, total)`` is called as bytes arrive. Concurrent calls for the
        same blobs share one download. Raises :class:`llmgw.mirror.errors.MirrorError`
        (a clear message) when a blob cannot be fetched or fails its digest.
        """
        ...


class Supervisor(Protocol):
    """Runs a node's replicas (``llmgw.launch.supervisor``)."""

    async def adopt(self) -> None:
        """At agent start: take over replicas still running from before, stop what cannot be adopted."""
        ...

    async def apply(self, desired: Sequence[ReplicaSpec]) -> None:
        """Make the node run exactly ``desired``: start what is missing, stop what is not asked for.

        Returns once the changes are under way (it does not wait for readiness).
        """
        ...

    def statuses(self) -> list[ReplicaStatus]:
        """Every replica known, including failed and recently stopped ones."""
        ...

    def log_tail(self, replica_id: str, lines: int = 100) -> str:
        """The last ``lines`` lines of a replica's log file. Raises KeyError for an unknown replica."""
        ...

    async def close(self, *, stop: bool = True) -> None:
        """Stop supervising; with ``stop``, stop every replica (SIGTERM, then SIGKILL after the grace)."""
        ...


class ReplicaController(Protocol):
    """The control plane's side (``llmgw.control.deployments``): what each node should run, and what it reports.

    The agent service (``llmgw.control.service``) asks it for a node's desired set
    when a heartbeat arrives and whenever it announces a change, and hands it the
    statuses each heartbeat carries.
    """

    def desired(self, node: str) -> tuple[int, tuple[ReplicaSpec, ...]]:
        """``(generation, specs)`` for ``node``; the generation rises whenever that node's set changes."""
        ...

    def report(self, node: str, address: str, statuses: Sequence[ReplicaStatus]) -> None:
        """The replica statuses a heartbeat from ``node`` carried; ``address`` is where its replicas are reached."""
        ...

    def node_gone(self, node: str) -> None:
        """``node`` deregistered or was removed: its replicas are gone."""
        ...

    def wake(self) -> None:
        """Reconcile soon: a node changed in a way that matters (its agent is leaving)."""
        ...

    def subscribe(self, changed: Callable[[str], None]) -> None:
        """Call ``changed(node)`` (on the control plane's loop) whenever ``node``'s desired set changes."""
        ...
