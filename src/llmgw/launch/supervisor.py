"""The node agent's replica supervisor: makes the node run exactly the replicas it is asked to.

:class:`ReplicaSupervisor` implements :class:`llmgw.launch.spec.Supervisor`.
``apply(desired)`` is declarative: a replica missing is started, one no longer
asked for is stopped, an equal spec is left alone and a changed one (same id,
different spec) is replaced.

Each replica, from start to end::

    fetching -> starting -> ready -> draining -> stopped
                   \\-> (crash) -> backoff -> starting ...     -> failed

* The engine's output goes straight into ``<state_dir>/logs/<id>.log`` (the
  file is the child's stdout and stderr; the agent holds no pipe), so an engine
  outlives an agent restart. The agent rotates the file by copy-and-truncate
  (the child writes with ``O_APPEND``, so it carries on at the new end).
* A free port is picked for every start (in :data:`PORT_RANGE`, below the
  kernel's ephemeral ports, so no outgoing connection takes it first); the engine is in its own session and
  process group, so a stop reaches its children too: SIGTERM to the group,
  SIGKILL after the grace.
* Readiness: ``GET /health`` (the plan's path) answers 200 within the spec's
  ``ready_timeout`` (its deployment's), else the agent's; an exit before that is a
  crash, a timeout fails the replica.
* A crash is restarted after an exponential backoff; ``max_crashes`` crashes
  within ``crash_window`` seconds fail it, with the exit status and the end of its log.
* ``<state_dir>/replicas/<id>.json`` (written atomically) records each running
  engine's pid, its start time (``/proc/PID/stat``, so a reused pid is not taken
  for it), its port and a fingerprint of its spec. :meth:`adopt` at agent start
  takes over those still running and kills what is left of the others: an agent
  killed with SIGKILL and started again leaves no orphaned engine.

The per-replica API key is never logged, and never written to the state
directory (the record keeps a SHA-256 fingerprint of the spec).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import importlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config.agent import AgentEngineConfig
from ..log import agent_logger
from .base import Launcher, LaunchError, LaunchPlan, secret_arg_values
from .spec import (
    DRAINING,
    FAILED,
    FETCHING,
    LOG_HEADER,
    LOG_TAIL,
    READY,
    STARTING,
    STOPPED,
    LocalModel,
    ModelFetcher,
    ReplicaSpec,
    ReplicaStatus,
)

__all__ = ["LAUNCHERS", "ReplicaSupervisor", "fingerprint", "launcher_for", "process_start_time"]

log = agent_logger.getChild("launch")

LAUNCHERS = {"llamacpp": "llamacpp", "vllm": "vllm", "sglang": "sglang", "trtllm": "trtllm"}
"""Engine name -> the module in :mod:`llmgw.launch` whose ``plan`` builds its launch."""

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_RECORD_VERSION = 1
_TAIL_LINES = 12
_TAIL_CHARS = 2000
_DETACHED: list[subprocess.Popen[bytes]] = []


def _sweep_detached() -> None:
    """Reap what in :data:`_DETACHED` has exited since (else each stays a zombie as long as the agent runs)."""
    _DETACHED[:] = [p for p in _DETACHED if p.poll() is None]


def launcher_for(engine: str) -> Launcher:
    """The ``plan`` function of ``engine``'s launcher module.

    Raises:
        LaunchError: no launcher for that engine.
    """
    mod = LAUNCHERS.get(engine)
    if mod is None:
        raise LaunchError(f"no launcher for engine {engine!r}; llmgw runs {', '.join(sorted(LAUNCHERS))}")
    plan: Launcher = importlib.import_module(f"{__package__}.{mod}").plan
    return plan


def fingerprint(spec: ReplicaSpec) -> str:
    """A SHA-256 over what ``spec`` runs (key and env included): equal fingerprints, the same engine. The
    ready timeout is not part of it: a new one applies to the running replica, restarting nothing."""
    doc = {
        "id": spec.id, "deployment": spec.deployment, "engine": spec.engine, "model": spec.model,
        "served_name": spec.served_name, "blobs": [[b.digest, b.size, b.role] for b in spec.blobs],
        "gpus": list(spec.gpus), "gpu_memory_fraction": spec.gpu_memory_fraction, "slots": spec.slots,
        "context": spec.context, "args": list(spec.args), "env": sorted(spec.env.items()), "api_key": spec.api_key,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def process_start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22); None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or ')'.
    rest = data[data.rfind(b")") + 2:].split()
    try:
        if rest[0] == b"Z":  # a zombie is gone for our purposes
            return None
        return int(rest[19])
    except (IndexError, ValueError):
        return None


def _probe_host(host: str) -> str:
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host


_KEY_SHOWN = re.compile(r"""(?i)((?:api[_-]?key|--api-key)['"]?(?:\s*[=:]\s*|\s+)['"]?)[^'"\s,)]{6,}""")
"""A key as engines print one in their settings or command line: ``api_key='…'`` (SGLang's server_args),
``--api-key …``, ``"api_key": "…"``."""

PORT_RANGE = (20000, 32767)
"""Where replica ports are picked by default: below Linux's ephemeral range (32768-60999), so that
no outgoing connection of the node takes the port between the pick and the engine's bind."""


def _bindable(host: str, port: int) -> bool:
    """Whether an engine could listen on ``port`` now. As the engines do (uvicorn, cpp-httplib), with
    SO_REUSEADDR: the connections a stopped engine closed last (TIME_WAIT) do not hold its port, a
    listener does."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def _free_port(host: str, span: tuple[int, int] | None = PORT_RANGE, taken: frozenset[int] = frozenset(),
               strict: bool = False) -> int:
    """A port ``host`` can bind now: random in ``span`` (skipping ``taken``), else one the kernel picks;
    ``strict``: in ``span`` or none (every port of it tried before :class:`LaunchError`)."""
    if span is not None:
        lo, hi = span
        for _ in range(64):
            port = random.randint(lo, hi)
            if port not in taken and _bindable(host, port):
                return port
        if strict:
            start = random.randint(lo, hi)  # (then each in turn from a random start: small ranges fill up)
            for i in range(hi - lo + 1):
                port = lo + (start - lo + i) % (hi - lo + 1)
                if port not in taken and _bindable(host, port):
                    return port
            raise LaunchError(f"no free port in replica_ports {lo}-{hi} on {host} ({len(taken)} taken by this "
                              "node's replicas, the rest by other processes): widen the range")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


async def http_status(host: str, port: int, path: str, timeout: float = 2.0,
                      headers: Mapping[str, str] | None = None) -> int | None:
    """``GET path`` on ``host:port``: the status, or None when nothing answered within ``timeout``."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, asyncio.TimeoutError):
        return None
    try:
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {where}\r\n{extra}Connection: close\r\n\r\n".encode())
        line = await asyncio.wait_for(reader.readline(), timeout)
        parts = line.split()
        return int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else None
    except (OSError, asyncio.TimeoutError, ValueError, RuntimeError):
        # (RuntimeError: uvloop's word for a write on a transport the peer closed meanwhile)
        return None
    finally:
        writer.close()
        with contextlib.suppress(OSError, RuntimeError):
            await writer.wait_closed()


def _kill_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


@dataclass(eq=False)
class _Replica:
    id: str
    spec: ReplicaSpec | None
    """None for an adopted replica until an ``apply`` names it."""
    fp: str
    log_path: Path
    state: str = STARTING
    port: int | None = None
    pid: int | None = None
    start_time: int | None = None
    restarts: int = 0
    exit_code: int | None = None
    message: str = ""
    fetched: int | None = None
    fetch_total: int | None = None
    health_path: str = "/health"
    popen: subprocess.Popen[bytes] | None = None
    task: asyncio.Task[None] | None = None
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    next_spec: ReplicaSpec | None = None
    """Set when a changed spec replaces this one: started once this one has stopped."""
    crashes: deque[float] = field(default_factory=deque)
    ended_at: float | None = None

    def status(self) -> ReplicaStatus:
        return ReplicaStatus(
            id=self.id, state=self.state, port=self.port, pid=self.pid, restarts=self.restarts,
            exit_code=self.exit_code, message=self.message, log_path=str(self.log_path),
            fetched=self.fetched, fetch_total=self.fetch_total,
        )


class ReplicaSupervisor:
    """Runs a node's replicas; see the module docstring.

    Args:
        state_dir: where records (``replicas/``), logs (``logs/``) and per-replica
            work directories (``run/<id>/``) live; kept across agent restarts.
        host: the address engines listen on (what the control plane reaches).
        engines: the agent config's ``engines:`` (binary / python per engine).
        fetcher: brings mirror models onto the node (specs with ``blobs``); None:
            such specs fail with a message saying so.
        on_change: called (on the loop) whenever any replica's status changes.
        ready_timeout: seconds from start to ``/health`` 200 before the replica fails, for a spec that
            names none.
        stop_grace: seconds between SIGTERM and SIGKILL.
        max_crashes: crashes within ``crash_window`` seconds that fail a replica.
        backoff: the first restart delay, doubled per crash up to ``backoff_max``.
        log_max_bytes: a log is rotated past this size; ``log_backups`` old ones are kept.
        keep_stopped: seconds a stopped replica stays in :meth:`statuses`.
        base_env: the environment engines start from (default: the agent's).
        poll_interval: the longest wait between readiness probes.
        port_range: where replica ports are picked (None: any free port the kernel gives).
        strict_ports: only in ``port_range`` (the operator's ``replica_ports``): a replica fails to start
            when none is free there, rather than taking one the kernel gives.
    """

    def __init__(
        self,
        state_dir: str | os.PathLike[str],
        *,
        host: str = "127.0.0.1",
        engines: Mapping[str, AgentEngineConfig] | None = None,
        fetcher: ModelFetcher | None = None,
        on_change: Callable[[], None] | None = None,
        ready_timeout: float = 1800.0,
        stop_grace: float = 30.0,
        max_crashes: int = 5,
        crash_window: float = 600.0,
        backoff: float = 1.0,
        backoff_max: float = 60.0,
        log_max_bytes: int = 16 << 20,
        log_backups: int = 3,
        keep_stopped: float = 300.0,
        base_env: Mapping[str, str] | None = None,
        poll_interval: float = 0.2,
        port_range: tuple[int, int] | None = PORT_RANGE,
        strict_ports: bool = False,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.host = host
        self.engines = dict(engines or {})
        self.fetcher = fetcher
        self.on_change = on_change
        self.ready_timeout = ready_timeout
        self.stop_grace = stop_grace
        self.max_crashes = max_crashes
        self.crash_window = crash_window
        self.backoff = backoff
        self.backoff_max = backoff_max
        self.log_max_bytes = log_max_bytes
        self.log_backups = log_backups
        self.keep_stopped = keep_stopped
        self.base_env = dict(base_env) if base_env is not None else None
        self.poll_interval = poll_interval
        self.port_range = port_range
        self.strict_ports = strict_ports and port_range is not None
        self._records = self.state_dir / "replicas"
        self._logs = self.state_dir / "logs"
        self._run = self.state_dir / "run"
        for d in (self._records, self._logs, self._run):
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._reps: dict[str, _Replica] = {}
        self._closed = False
        self._adopted = False

    # -- the Supervisor protocol --

    async def adopt(self) -> None:
        """Take over engines recorded in the state dir that still run; kill the rest of the others."""
        self._adopted = True
        for path in sorted(self._records.glob("*.json")):
            rid = path.stem
            if rid in self._reps:
                continue
            try:
                rec = json.loads(path.read_text())
                pid, start = int(rec["pid"]), int(rec["start_time"])
                port, fp, health = int(rec["port"]), str(rec["fingerprint"]), str(rec.get("health_path", "/health"))
                if rec.get("version") != _RECORD_VERSION or rec.get("id") != rid:
                    raise ValueError("another version or id")
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("replica record %s is unreadable (%s); removed", path, exc)
                path.unlink(missing_ok=True)
                continue
            if process_start_time(pid) != start:
                self._sweep_stale(rid, pid)
                path.unlink(missing_ok=True)
                continue
            rep = _Replica(id=rid, spec=None, fp=fp, log_path=self._log_path(rid), port=port, pid=pid,
                           start_time=start, health_path=health)
            rep.message = "adopted from before the agent restarted"
            self._reps[rid] = rep
            rep.task = asyncio.get_running_loop().create_task(self._lifecycle(rep, adopted=True))
            log.info("replica %s: adopted the running engine (pid %d, port %d)", rid, pid, port)
        self._changed()

    async def apply(self, desired: Sequence[ReplicaSpec]) -> None:
        if self._closed:
            raise RuntimeError("the supervisor is closed")
        if not self._adopted:
            # (an engine left by an earlier agent must be adopted or stopped, never run twice)
            await self.adopt()
        wanted: dict[str, ReplicaSpec] = {}
        for spec in desired:
            wanted[spec.id] = spec
        changed = False
        # (those that leave first: a new replica on the GPUs of one that leaves starts once it has stopped)
        for rid, leaving in list(self._reps.items()):
            if rid in wanted:
                continue
            leaving.next_spec = None
            if leaving.task is not None:
                leaving.stop.set()
            elif leaving.state != STOPPED:
                leaving.state = STOPPED
                leaving.ended_at = time.monotonic()
                changed = True
        for rid, spec in wanted.items():
            fp = fingerprint(spec)
            rep = self._reps.get(rid)
            if rep is None or (rep.state == STOPPED and rep.task is None):
                self._start(spec, fp)
                changed = True
            elif rep.fp == fp:
                # (an adopted replica: now it can be restarted after a crash; or a new ready timeout, which the
                # replica's wait for readiness reads as it goes)
                rep.spec = spec
                # (asked again while it is being stopped: start it again once it has stopped)
                rep.next_spec = spec if rep.stop.is_set() else None
            elif rep.task is None:  # failed or stopped: start the new spec afresh
                self._start(spec, fp)
                changed = True
            else:
                if rep.next_spec is None or fingerprint(rep.next_spec) != fp:
                    log.info("replica %s: its spec changed; replacing it", rid)
                rep.next_spec = spec
                rep.stop.set()
        if changed:
            self._changed()

    def statuses(self) -> list[ReplicaStatus]:
        _sweep_detached()  # (asked on every heartbeat)
        now = time.monotonic()
        for rid, rep in list(self._reps.items()):
            if rep.state == STOPPED and rep.task is None and rep.ended_at is not None \
                    and now - rep.ended_at > self.keep_stopped:
                del self._reps[rid]
        return [rep.status() for rep in self._reps.values()]

    def log_tail(self, replica_id: str, lines: int = 100) -> str:
        rep = self._reps.get(replica_id)
        path = rep.log_path if rep is not None else self._log_path(replica_id)
        if rep is None and not path.is_file():
            raise KeyError(replica_id)
        text = _tail(path, lines, max(_TAIL_CHARS, lines * 400))
        # NOTE: some engines print their whole configuration, key included (SGLang's server_args); a
        # replica adopted from before a restart, or one no longer known, has no spec to say its key
        return _KEY_SHOWN.sub(r"\1***", self._redact(rep, text) if rep is not None else text)

    async def close(self, *, stop: bool = True) -> None:
        self._closed = True
        reps = [r for r in self._reps.values() if r.task is not None]
        if stop:
            for rep in reps:
                rep.next_spec = None
                rep.stop.set()
            await asyncio.gather(*(r.task for r in reps if r.task is not None), return_exceptions=True)
        else:
            for rep in reps:
                if rep.task is not None:
                    rep.task.cancel()
            await asyncio.gather(*(r.task for r in reps if r.task is not None), return_exceptions=True)
            for rep in reps:
                if rep.popen is not None:
                    # The engine goes on without us (the next agent adopts it): keep its
                    # Popen alive so that it does not warn, when collected, that its child runs.
                    _DETACHED.append(rep.popen)
                    rep.popen = None

    # -- one replica's life --

    def _log_path(self, rid: str) -> Path:
        return self._logs / f"{rid}.log"

    def _record_path(self, rid: str) -> Path:
        return self._records / f"{rid}.json"

    def _start(self, spec: ReplicaSpec, fp: str) -> None:
        rep = _Replica(id=spec.id, spec=spec, fp=fp, log_path=self._log_path(spec.id),
                       state=FETCHING if spec.blobs else STARTING)
        self._reps[spec.id] = rep
        if not _ID.fullmatch(spec.id):
            rep.state, rep.message = FAILED, (
                f"replica id {spec.id!r} is not a name the agent can use (letters, digits, '.', '_', '-')")
            rep.ended_at = time.monotonic()
            return
        gpus = set(spec.gpus)
        # the engines being stopped on its GPUs: on a GPU, two engines at once may not fit in its memory
        before = [o.task for o in self._reps.values()
                  if o is not rep and o.task is not None and o.stop.is_set() and o.spec is not None
                  and gpus.intersection(o.spec.gpus)] if gpus else []
        rep.task = asyncio.get_running_loop().create_task(self._lifecycle(rep, adopted=False, after=before))

    def _set(self, rep: _Replica, state: str, message: str | None = None) -> None:
        if message is not None:
            message = self._redact(rep, message)
        if rep.state == state and (message is None or message == rep.message):
            return
        rep.state = state
        if message is not None:
            rep.message = message
        self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            try:
                self.on_change()
            except Exception:  # a callback's bug must not stop supervision
                log.exception("the replica on_change callback failed")

    @staticmethod
    def _redact(rep: _Replica, text: str) -> str:
        spec = rep.spec
        if spec is not None:
            for secret in (spec.api_key, *spec.env.values(), *secret_arg_values(spec.args)):
                if secret and len(secret) >= 6:
                    text = text.replace(secret, "***")
        return text

    async def _lifecycle(self, rep: _Replica, *, adopted: bool, after: Sequence[asyncio.Task[None]] = ()) -> None:
        try:
            if after:
                log.info("replica %s: starts once %d replica(s) stopping on its GPUs have stopped", rep.id,
                         len(after))
                # (bounded: a stop takes at most the grace, then SIGKILL and its own bounded wait)
                await asyncio.wait(after, timeout=self.stop_grace + 40.0)
            while True:
                if adopted:
                    adopted = False
                    outcome = await self._watch(rep)
                    if outcome == "exited" and rep.spec is None:
                        # Died while the agent was away and no apply has named it yet:
                        # the next apply that does starts it afresh.
                        self._end(rep, STOPPED, "exited while the agent was away")
                        return
                else:
                    outcome = await self._run_once(rep)
                if outcome == "stopped":
                    nxt = rep.next_spec
                    if nxt is not None and not self._closed:
                        rep.next_spec = None
                        rep.spec, rep.fp = nxt, fingerprint(nxt)
                        rep.stop.clear()
                        rep.restarts, rep.exit_code, rep.port, rep.pid = 0, None, None, None
                        rep.crashes.clear()
                        continue
                    self._end(rep, STOPPED, "stopped")
                    return
                if outcome == "failed":
                    self._end(rep, FAILED, None)
                    return
                # crashed: restart after a backoff, unless that is once too often
                now = time.monotonic()
                rep.crashes.append(now)
                while rep.crashes and now - rep.crashes[0] > self.crash_window:
                    rep.crashes.popleft()
                tail = _tail(rep.log_path, _TAIL_LINES, _TAIL_CHARS)
                if len(rep.crashes) >= self.max_crashes:
                    self._end(rep, FAILED, (
                        f"crashed {len(rep.crashes)} times within {self.crash_window:g}s; last exit status "
                        f"{rep.exit_code}{LOG_TAIL}\n{tail}"))
                    return
                delay = min(self.backoff_max, self.backoff * 2 ** (len(rep.crashes) - 1))
                self._set(rep, STARTING, f"exited with status {rep.exit_code}; restarting in {delay:g}s"
                                         f"{LOG_TAIL}\n{tail}")
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(rep.stop.wait(), delay)
                if rep.stop.is_set():
                    continue_with = rep.next_spec
                    if continue_with is None or self._closed:
                        self._end(rep, STOPPED, "stopped")
                        return
                    rep.next_spec = None
                    rep.spec, rep.fp = continue_with, fingerprint(continue_with)
                    rep.stop.clear()
                    rep.restarts = 0
                    rep.crashes.clear()
                    continue
                rep.restarts += 1
        except asyncio.CancelledError:
            # close(stop=False): the engine keeps running; its record lets the next agent adopt it.
            raise
        except Exception as exc:  # a bug here must show as a failed replica, not vanish
            log.exception("replica %s: supervision failed", rep.id)
            await self._kill_and_collect(rep)
            self._end(rep, FAILED, f"the agent's supervision failed: {type(exc).__name__}: {exc}")
        finally:
            if rep.popen is not None and rep.popen.poll() is not None:
                rep.popen = None

    @staticmethod
    async def _kill_and_collect(rep: _Replica) -> None:
        """SIGKILL what is left of the engine's group and collect its status (waiting a bounded while)."""
        if rep.pid is None:
            return
        _kill_group(rep.pid, signal.SIGKILL)
        popen = rep.popen
        if popen is None:
            return
        for _ in range(100):  # 5 s at most
            if popen.poll() is not None:
                rep.popen = None
                return
            await asyncio.sleep(0.05)
        log.warning("replica %s: pid %d survives SIGKILL; left to be reaped later", rep.id, rep.pid)
        _DETACHED.append(popen)
        rep.popen = None

    def _end(self, rep: _Replica, state: str, message: str | None) -> None:
        rep.task = None
        rep.ended_at = time.monotonic()
        if state == STOPPED:
            rep.pid = None
        self._record_path(rep.id).unlink(missing_ok=True)
        self._set(rep, state, message)
        if state == FAILED:
            log.warning("replica %s failed: %s", rep.id, rep.message.splitlines()[0] if rep.message else "")

    async def _run_once(self, rep: _Replica) -> str:
        """Fetch, launch and watch one engine process: ``stopped``, ``exited`` (a crash) or ``failed``."""
        spec = rep.spec
        assert spec is not None
        model: LocalModel | None = None
        if spec.blobs:
            if self.fetcher is None:
                rep.message = "its model is a mirror reference, but this agent has no mirror fetcher"
                return "failed"
            rep.fetched, rep.fetch_total = 0, sum(b.size for b in spec.blobs)
            self._set(rep, FETCHING, "fetching the model from the control plane's mirror")
            last = [0.0]

            def progress(done: int, total: int) -> None:
                rep.fetched, rep.fetch_total = done, total
                now = time.monotonic()
                if now - last[0] >= 0.5:
                    last[0] = now
                    self._changed()

            fetch = asyncio.ensure_future(self.fetcher.ensure(spec, progress))
            stop = asyncio.ensure_future(rep.stop.wait())
            try:
                await asyncio.wait({fetch, stop}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stop.cancel()
            if not fetch.done():
                fetch.cancel()
                with contextlib.suppress(BaseException):
                    await fetch
                return "stopped"
            try:
                model = fetch.result()
            except Exception as exc:  # MirrorError and anything else: the replica fails, saying why
                rep.message = f"fetching the model failed: {exc}"
                return "failed"
            rep.fetched = rep.fetch_total = None
        if rep.stop.is_set():
            return "stopped"
        work = self._run / rep.id
        work.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            # (the ports of this node's engines that run, or start: a stopped or failed replica's port is
            # free again at once, though its status stays listed for keep_stopped)
            taken = frozenset(r.port for r in self._reps.values()
                              if r.port is not None and r is not rep and r.task is not None and r.state != STOPPED
                              and r.state != FAILED)
            port = _free_port(self.host, self.port_range, taken, self.strict_ports)
            plan = launcher_for(spec.engine)(spec, model, host=self.host, port=port,
                                             engine=self.engines.get(spec.engine), work_dir=work)
        except (LaunchError, OSError) as exc:
            rep.message = str(exc)
            return "failed"
        try:
            self._spawn(rep, plan, port, work)
        except OSError as exc:
            rep.message = f"cannot run {plan.argv[0]}: {exc.strerror or exc}"
            return "failed"
        self._set(rep, STARTING, f"started: {plan.shown()}")
        return await self._watch(rep)

    def _spawn(self, rep: _Replica, plan: LaunchPlan, port: int, work: Path) -> None:
        spec = rep.spec
        assert spec is not None
        _sweep_detached()
        env = dict(self.base_env if self.base_env is not None else os.environ)
        env.update(spec.env)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(spec.gpus)
        env.update(plan.env)
        self._rotate(rep.log_path)
        fd = os.open(rep.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            os.write(fd, f"{LOG_HEADER}{stamp}: starting {rep.id}: {self._redact(rep, plan.shown())}\n".encode())
            popen = subprocess.Popen(
                list(plan.argv), stdin=subprocess.DEVNULL, stdout=fd, stderr=fd, cwd=work, env=env,
                start_new_session=True, close_fds=True,
            )
        finally:
            os.close(fd)
        rep.popen, rep.pid, rep.port = popen, popen.pid, port
        rep.health_path = plan.health_path
        rep.start_time = process_start_time(popen.pid)
        self._write_record(rep, spec)

    def _write_record(self, rep: _Replica, spec: ReplicaSpec) -> None:
        if rep.start_time is None:
            return  # it exited already: nothing to adopt
        doc: dict[str, Any] = {
            "version": _RECORD_VERSION, "id": rep.id, "pid": rep.pid, "start_time": rep.start_time,
            "port": rep.port, "fingerprint": rep.fp, "health_path": rep.health_path, "engine": spec.engine,
            "deployment": spec.deployment, "served_name": spec.served_name, "host": self.host,
        }
        path = self._record_path(rep.id)
        tmp = path.with_name(f".{path.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    async def _watch(self, rep: _Replica) -> str:
        """Wait for readiness, then for the end: ``stopped``, ``exited`` or ``failed`` (readiness timeout)."""
        assert rep.pid is not None
        exited = self._exit_future(rep)
        stop = asyncio.ensure_future(rep.stop.wait())
        either: set[asyncio.Future[Any]] = {exited, stop}
        try:
            started = time.monotonic()
            host = _probe_host(self.host)
            interval = min(self.poll_interval, 0.05)
            while rep.state != READY:
                if exited.done():
                    return self._exited(rep, exited)
                if stop.done():
                    return await self._terminate(rep, exited)
                assert rep.port is not None
                if await http_status(host, rep.port, rep.health_path) == 200:
                    self._set(rep, READY, "ready")
                    log.info("replica %s ready on port %d (pid %d)", rep.id, rep.port, rep.pid)
                    break
                timeout = self._ready_timeout(rep)
                if time.monotonic() > started + timeout:
                    tail = _tail(rep.log_path, _TAIL_LINES, _TAIL_CHARS)
                    await self._terminate(rep, exited, quiet=True)
                    rep.message = (f"not ready within {timeout:g}s ({rep.health_path} never answered 200)"
                                   f"{LOG_TAIL}\n{tail}")
                    return "failed"
                await asyncio.wait(either, timeout=interval, return_when=asyncio.FIRST_COMPLETED)
                interval = min(self.poll_interval, interval * 2)
            while True:
                await asyncio.wait(either, timeout=10.0, return_when=asyncio.FIRST_COMPLETED)
                if exited.done():
                    return self._exited(rep, exited)
                if stop.done():
                    return await self._terminate(rep, exited)
                self._rotate(rep.log_path)
        finally:
            stop.cancel()
            if not exited.done():
                exited.cancel()

    def _ready_timeout(self, rep: _Replica) -> float:
        """The replica's deployment's ready timeout, else this agent's."""
        t = rep.spec.ready_timeout if rep.spec is not None else None
        return self.ready_timeout if t is None else t

    def _exited(self, rep: _Replica, exited: asyncio.Future[None]) -> str:
        self._reap(rep)
        how = (f"with status {rep.exit_code}" if rep.exit_code is not None
               else "(status unknown: adopted from an earlier agent, it is not this agent's child)")
        log.warning("replica %s: its engine (pid %s) exited %s", rep.id, rep.pid, how)
        self._note(rep, f"its engine (pid {rep.pid}) exited {how}")
        self._record_path(rep.id).unlink(missing_ok=True)
        rep.pid = None
        return "exited"

    def _reap(self, rep: _Replica) -> None:
        """The leader has exited: kill what is left of its group, then collect its status."""
        if rep.pid is not None:
            # NOTE: before reaping the leader, whose unreaped pid keeps the group id from being reused.
            _kill_group(rep.pid, signal.SIGKILL)
        if rep.popen is not None:
            code = rep.popen.poll()
            if code is None:
                # Unkillable for now (stuck in the kernel): never block the loop on it.
                log.warning("replica %s: pid %d survives SIGKILL; left to be reaped later", rep.id, rep.pid)
                _DETACHED.append(rep.popen)
            rep.exit_code = code
            rep.popen = None
        elif rep.pid is not None:
            # Adopted: our child only if this same process started it before (tests); else init reaps it.
            with contextlib.suppress(ChildProcessError):
                pid, status = os.waitpid(rep.pid, os.WNOHANG)
                if pid == rep.pid:
                    rep.exit_code = os.waitstatus_to_exitcode(status)

    async def _terminate(self, rep: _Replica, exited: asyncio.Future[None], *, quiet: bool = False) -> str:
        """SIGTERM to the engine's group, SIGKILL after the grace; ``stopped``."""
        if not quiet:
            self._set(rep, DRAINING, "stopping")
        assert rep.pid is not None
        # (said in the agent's log: an engine the agent ends is otherwise seen only to be gone)
        log.info("replica %s: stopping its engine (pid %d): SIGTERM, SIGKILL after %gs", rep.id, rep.pid,
                 self.stop_grace)
        t0 = time.monotonic()
        _kill_group(rep.pid, signal.SIGTERM)
        await asyncio.wait({exited}, timeout=self.stop_grace)
        if not exited.done():
            log.warning("replica %s: still running %gs after SIGTERM; SIGKILL", rep.id, self.stop_grace)
            _kill_group(rep.pid, signal.SIGKILL)
            await asyncio.wait({exited}, timeout=30.0)
        self._reap(rep)
        log.info("replica %s: its engine (pid %d) stopped in %.1fs%s", rep.id, rep.pid, time.monotonic() - t0,
                 f" (status {rep.exit_code})" if rep.exit_code is not None else "")
        self._record_path(rep.id).unlink(missing_ok=True)
        self._note(rep, f"its engine stopped (status {rep.exit_code})" if rep.exit_code is not None
                   else "its engine stopped")
        return "stopped"

    @staticmethod
    def _note(rep: _Replica, text: str) -> None:
        """A line of the supervisor's in the replica's log (``ctl logs`` shows why a run ended, beside its
        ``starting`` line); a log that cannot be written loses only the line."""
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        with contextlib.suppress(OSError):
            fd = os.open(rep.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                os.write(fd, f"{LOG_HEADER}{stamp}: {rep.id}: {text}\n".encode())
            finally:
                os.close(fd)

    def _exit_future(self, rep: _Replica) -> asyncio.Future[None]:
        """Done when the engine process exits (a pidfd where the kernel has them, else polling)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        pid, start = rep.pid, rep.start_time
        assert pid is not None

        def gone() -> bool:
            if rep.popen is not None:
                # Our child: gone once it can be reaped, asked without reaping it (WNOWAIT: poll() would, and
                # _reap() wants its status). Not "a zombie in /proc": a multithreaded engine's leader thread
                # shows Z there while its other threads still exit, and cannot be reaped until they have.
                try:
                    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
                except ChildProcessError:
                    return True
            return process_start_time(pid) != start

        fd = -1
        with contextlib.suppress(AttributeError, OSError):
            fd = os.pidfd_open(pid)
        if fd >= 0:
            def on_exit() -> None:
                loop.remove_reader(fd)
                os.close(fd)
                if not fut.done():
                    fut.set_result(None)

            loop.add_reader(fd, on_exit)

            def cleanup(_f: asyncio.Future[None]) -> None:
                if fut.cancelled():
                    with contextlib.suppress(OSError, ValueError):
                        loop.remove_reader(fd)
                        os.close(fd)

            fut.add_done_callback(cleanup)
            if gone() and not fut.done():
                on_exit()
            return fut

        async def poll() -> None:
            while not gone():
                await asyncio.sleep(self.poll_interval)

        task = loop.create_task(poll())
        task.add_done_callback(lambda t: None if fut.done() or t.cancelled() else fut.set_result(None))
        fut.add_done_callback(lambda _f: task.cancel())
        return fut

    def _sweep_stale(self, rid: str, pid: int) -> None:
        """A record whose engine is gone: kill what may be left of its process group."""
        if process_start_time(pid) is None and not Path(f"/proc/{pid}").exists():
            # NOTE: the leader's pid is free, so no new group can have this id: anything
            # still in group ``pid`` is left from that engine (vLLM's engine cores, ...).
            _kill_group(pid, signal.SIGKILL)
        log.info("replica %s: its recorded engine (pid %d) no longer runs; record removed", rid, pid)

    # -- log files --

    def _rotate(self, path: Path) -> None:
        """Copy-and-truncate ``path`` once it passes ``log_max_bytes`` (the engine appends, so it carries on)."""
        try:
            if path.stat().st_size <= self.log_max_bytes:
                return
        except FileNotFoundError:
            return
        try:
            for i in range(self.log_backups - 1, 0, -1):
                older = path.with_name(f"{path.name}.{i}")
                if older.exists():
                    os.replace(older, path.with_name(f"{path.name}.{i + 1}"))
            if self.log_backups > 0:
                shutil.copyfile(path, path.with_name(f"{path.name}.1"))
            os.truncate(path, 0)
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                log.warning("cannot rotate %s: %s", path, exc)


def _tail(path: Path, lines: int, limit: int) -> str:
    """The last ``lines`` lines of ``path`` (at most ``limit`` characters); empty if there is no file."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - limit))
            data = f.read()
    except OSError:
        return ""
    text = data.decode("utf-8", "replace").rstrip("\n")
    return "\n".join(text.splitlines()[-lines:])
