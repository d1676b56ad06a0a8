"""The node agent's link to the control plane: register, heartbeat, reconnect, deregister.

:class:`AgentClient` runs on the event loop. Its GPU source is injected: any
object with ``read() -> Discovery`` and ``close()`` (:class:`GPUSource`); reads run
in a thread, one at a time, so a slow NVML call never stalls the loop. Nor does a
slow read delay a heartbeat: a beat waits at most a second for the reading in
flight, then goes with the last one (liveness is the beat, not the reading); a last
reading older than :data:`STALE_AFTER` goes without its numbers, an error saying why.

* Register, then heartbeat on the interval the control plane answered, each
  sleep jittered by ±10% (a fleet restarted together does not beat in step).
* The control plane away (UNAVAILABLE, a deadline): reconnect with exponential
  backoff and full jitter, capped at one heartbeat interval, so agents are back
  within about an interval of the control plane's return. A heartbeat answered
  NOT_FOUND (the control plane restarted and forgot the node) registers again at
  once: same name, same node.
* Refusals that retrying cannot fix (UNAUTHENTICATED: wrong join token;
  FAILED_PRECONDITION: incompatible protocol; INVALID_ARGUMENT) end the run with
  :class:`AgentRefused`, the control plane's message in it: at once with one control
  plane; with several, once every one has refused since the last success (a standby whose
  join tokens differ must not take a fleet's agents down while the leader would take them:
  the refusal is logged and the next address tried, as for one that does not answer), or
  once refusals have gone on for :data:`REFUSED_GIVE_UP_S` with no other control plane taking
  it (the others down, or a standby pointing at the one that refuses).
* ``stop`` set (SIGTERM): with replicas running and a control plane of protocol 1.3 or
  later, drain first: heartbeats say ``leaving``, the control plane drains the node's
  replicas (no new requests; each leaves the node's set once its requests in flight are
  done) and places them elsewhere, and the agent stops each as its set shrinks, until
  none runs, ``drain_timeout`` passes, the control plane cannot be reached, or ``hard``
  is set (a second SIGTERM). Then deregister (bounded), close the channel and the source.
* Replicas (protocol 1.2, with a :class:`~llmgw.launch.spec.Supervisor`): every
  beat carries the replica statuses and the generation of the desired set last
  applied; a desired set in an answer is handed to the supervisor (the latest
  wins; one ``apply`` at a time), and a status change (:meth:`AgentClient.poke`)
  sends a beat at once rather than an interval later. Log requests are answered
  with a ReplicaLogs call.
* Several control planes (HA, docs/ha.md): the agent is given all their addresses
  and follows the leader. A standby refuses with UNAVAILABLE and the leader's address
  in the ``llmgw-leader`` trailing metadata: the agent goes there at once and
  registers again (idempotent: same name, same node). A control plane that does not
  answer: the next address, and the backoff only after a whole round. A leader with
  a database announces its lease at registration (``llmgw-lease-ms``); the agent then
  expects an answer on its heartbeat stream at least every third of it and takes
  silence for a lost leader (a paused process keeps its TCP connections up), and
  times its calls out sooner.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from .. import __version__
from .._proto.agent.v1 import agent_pb2_grpc
from ..launch.spec import DRAINING, FETCHING, READY, STARTING
from ..log import agent_logger as log
from .model import Discovery, NodeFacts
from .wire import (
    CLIENT_OPTIONS,
    PROTOCOL,
    TOKEN_METADATA,
    compatible,
    discovery_to_proto,
    drains_leaving,
    pb,
    spec_from_proto,
    status_to_proto,
    streams_heartbeats,
)

if TYPE_CHECKING:
    from ..launch.spec import ReplicaSpec, Supervisor

__all__ = ["AgentClient", "AgentRefused", "GPUSource", "TLSFiles", "channel_credentials", "leader_hint"]

CALL_TIMEOUT = 10.0
_LIVE = frozenset((FETCHING, STARTING, READY, DRAINING))
DRAIN_TIMEOUT = 30.0
"""Seconds a stopping agent waits by default for its replicas to drain off the node (the control plane's
``drain_grace`` for a scale-down is 30 s too)."""
MIN_BEAT_GAP = 0.05
"""Early beats (a status changed) come at most this often, seconds."""
MAX_LOG_BYTES = 1 << 20
"""A log tail sent to the control plane keeps at most this many bytes (its end)."""
READ_WAIT = 1.0
"""Seconds a heartbeat waits for a GPU reading in flight before it goes with the last one (:meth:`AgentClient._read`)."""
FIRST_READ_WAIT = 10.0
"""The same for the first reading (registration), when there is no last one."""
STALE_AFTER = 30.0
"""A last reading older than this (or three intervals) goes without its numbers (:meth:`AgentClient._late`)."""
LEADER_METADATA = "llmgw-leader"  # (llmgw.control.service names them; the agent does not import the control plane)
LEASE_METADATA = "llmgw-lease-ms"


def leader_hint(exc: grpc.aio.AioRpcError) -> str | None:
    """The leader's address a standby's refusal names (trailing metadata), if any."""
    try:
        md = exc.trailing_metadata() or ()
    except Exception:  # (a constructed error may carry none)
        return None
    for key, value in md:
        if key == LEADER_METADATA and isinstance(value, str) and value:
            return value
    return None


def tls_hint(details: str, tls: bool) -> str | None:
    """What to change when a connection failed on TLS (gRPC's words in ``details``), or ``None``."""
    if "WRONG_VERSION_NUMBER" in details:
        return "the control plane there does not serve TLS: drop --tls/--tls-ca, or give the address of one that does"
    if "CERTIFICATE_VERIFY_FAILED" in details:
        return ("its certificate is not signed by a CA this agent trusts: give the CA that signed it with --tls-ca; "
                "without it, the system's CAs are trusted")
    if "not in peer certificate" in details or "Peer name" in details:
        return "its certificate does not name the address given: connect by a name or IP its certificate has"
    if not tls and ("Socket closed" in details or "End of TCP stream" in details):
        return "if the control plane serves TLS, add --tls, and --tls-ca for a private CA"
    return None


REFUSED_GIVE_UP_S = 60.0
"""Several control planes: refused by one (or more) and taken by none for this long, the agent gives up."""

_FATAL = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT,
          grpc.StatusCode.PERMISSION_DENIED)


class GPUSource(Protocol):
    """Where the agent's readings come from (``llmgw.agent.discovery.open_source`` makes the real ones)."""

    def read(self) -> Discovery:
        """One reading of the node and its GPUs (failures are in it, not raised)."""

    def close(self) -> None:
        """Release the library/handles."""


def _source_name(source: Any) -> str:
    """The name a source gives itself (``nvml``...); ``""`` (unknown) for one that gives none."""
    name = getattr(source, "name", "")
    return name if isinstance(name, str) else ""


class AgentRefused(Exception):
    """The control plane refused this agent for a reason retrying cannot fix."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.every = False
        """Every one of several control planes refused (this is the last one's refusal)."""
        self.waited: float | None = None
        """Several control planes: refused this long with none taking the agent (the others down)."""


@dataclass(frozen=True)
class TLSFiles:
    """The agent's TLS: the CA to trust (``None``: the system's), and a client pair for mutual TLS."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None


def channel_credentials(tls: TLSFiles) -> grpc.ChannelCredentials:
    def read(path: str | None) -> bytes | None:
        if path is None:
            return None
        with open(path, "rb") as f:
            return f.read()

    return grpc.ssl_channel_credentials(
        root_certificates=read(tls.ca), private_key=read(tls.key), certificate_chain=read(tls.cert)
    )


class AgentClient:
    """One agent's link (module docstring).

    Args:
        target: the control plane, ``HOST:PORT``, or every control plane's (HA: the leader is followed).
        name: this node's name.
        token: the join token.
        source: the GPU source (closed when :meth:`run` returns).
        credentials: TLS channel credentials; ``None``: plaintext.
        protocol: the wire protocol to announce (tests announce others).
        backoff_initial: the first reconnect delay, seconds (doubles up to one interval).
        instance: this agent's identity (``agent_instance``; ``None``: a new one for this object).
    """

    def __init__(
        self,
        target: str | Sequence[str],
        name: str,
        token: str,
        source: GPUSource,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        protocol: tuple[int, int] = PROTOCOL,
        backoff_initial: float = 0.1,
        rng: random.Random | None = None,
        on_registered: Callable[[pb.RegisterResponse], None] | None = None,
        supervisor: Supervisor | None = None,
        labels: Mapping[str, str] | None = None,
        advertise: str | None = None,
        engine_checker: Callable[[pb.EngineCheckRequest], Awaitable[Sequence[Mapping[str, Any]]]] | None = None,
        instance: str | None = None,
        drain_timeout: float = DRAIN_TIMEOUT,
    ) -> None:
        self.targets = [target] if isinstance(target, str) else list(target)
        if not self.targets:
            raise ValueError("no control-plane address")
        self.target = self.targets[0]
        """The control plane this agent talks to now."""
        self.name = name
        self.instance = instance or uuid.uuid4().hex
        """This agent's identity (``agent_instance``): kept in the state directory by ``llmgw agent``, so a
        restarted agent takes its node straight back; while the node is up, another one is refused its name."""
        self.token = token
        self.source = source
        self.credentials = credentials
        self.protocol = protocol
        self.backoff_initial = backoff_initial
        self.rng = rng or random.Random()
        self.on_registered = on_registered
        self.interval = 5.0
        self.lease: float | None = None
        """The leader's lease when it has a database (``llmgw-lease-ms`` at registration)."""
        self.call_timeout = CALL_TIMEOUT
        self.switches = 0
        """Times the agent moved to another control plane."""
        self._last_answer = 0.0
        self.node_id: str | None = None
        self.sequence = 0
        self.registrations = 0
        self.heartbeats = 0
        self.cordoned = False
        self.drain_timeout = drain_timeout
        """Seconds a stopping agent waits for its replicas to drain off the node (0: stop them at once)."""
        self.leaving = False
        """Stopping, and draining the node first: heartbeats say ``leaving``."""
        self.peer_protocol: tuple[int, int] = (0, 0)
        """The protocol the control plane answered at the latest registration."""
        self.streaming = False
        """Heartbeats go on a StreamHeartbeats stream (both sides speak protocol 1.1 or later)."""
        self._stream: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._stream_error: grpc.aio.AioRpcError | None = None
        self._errors_said: tuple[str, ...] = ()
        self._reading: asyncio.Future[Discovery] | None = None
        """The GPU read in flight (or the last one, done)."""
        self._read_started = 0.0
        self._last: Discovery | None = None
        """The latest reading the source gave, and when (monotonic)."""
        self._last_at = 0.0
        self._late_said = -1.0
        """When the stalled read that was last logged began (one warning per stall)."""
        self._wake = asyncio.Event()
        """Set when the heartbeat stream ended between beats: the loop acts at once, not an interval later."""
        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None
        self._metadata = ((TOKEN_METADATA, f"Bearer {token}"),)
        self.supervisor = supervisor
        """Runs this node's replicas; ``None``: the agent only reports its GPUs."""
        self.engine_checker = engine_checker
        """Runs ``llmgw ctl engine-check`` here when the control plane asks (``--node``); the checks as
        ``Check.as_dict`` gives them. ``None``: such requests are answered with an error."""
        self.labels = dict(labels or {})
        self.advertise = advertise
        self.applied = 0
        """The generation of the desired set last applied (0: none yet)."""
        self._applied_any = False
        self._wanted: tuple[int, tuple[ReplicaSpec, ...]] | None = None
        self._applier: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._last_beat = 0.0

    # -- plumbing --

    def _connect(self) -> Any:
        if self._stub is None:
            opts = [*CLIENT_OPTIONS]
            if self.credentials is not None:
                self._channel = grpc.aio.secure_channel(self.target, self.credentials, options=opts)
            else:
                self._channel = grpc.aio.insecure_channel(self.target, options=opts)
            self._stub = agent_pb2_grpc.AgentServiceStub(self._channel)
        return self._stub

    def _end_stream(self) -> None:
        call, self._stream = self._stream, None
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.cancel()
        if call is not None:
            call.cancel()

    async def _disconnect(self) -> None:
        self._end_stream()
        ch, self._channel, self._stub = self._channel, None, None
        if ch is not None:
            await ch.close()

    def _start_read(self) -> asyncio.Future[Discovery]:
        """The reading in flight, or a new one started: one at a time, in a daemon thread of its own
        (a read hung in the driver holds that thread, never the loop, a second thread or the exit)."""
        fut = self._reading
        if fut is not None and not fut.done():
            return fut
        loop = asyncio.get_running_loop()
        fut = self._reading = loop.create_future()
        self._read_started = started = time.monotonic()
        source = self.source

        def failed(why: str) -> Discovery:
            # (the GPUs last read stay listed by what does not change, their readings absent, as a source
            # keeps them through a failed read of its own: a GPU node never reads as one without GPUs)
            last = self._last
            facts = NodeFacts(hostname=socket.gethostname(), agent_version=__version__)
            if last is not None:
                facts = replace(last.facts, memory_available_bytes=None, infiniband=())
            return Discovery(facts=facts, gpus=tuple(g.identity() for g in last.gpus) if last is not None else (),
                             source=_source_name(source), errors=(f"GPU source failed: {why}",))

        def done(d: Any, exc: BaseException | None) -> None:
            if exc is not None:  # a source must not raise; if one does, report it, never zeros
                log.error("the GPU source failed; reporting the error instead of readings",
                          exc_info=(type(exc), exc, exc.__traceback__))
                d = failed(f"{type(exc).__name__}: {exc}")
            elif not isinstance(d, Discovery):
                log.error("the GPU source returned %s, not a reading; reporting the error instead", type(d).__name__)
                d = failed(f"it returned {type(d).__name__}, not a reading")
            self._last, self._last_at = d, time.monotonic()
            # (resolved before anything else can fail: a future left pending would stop every later read)
            if not fut.done():
                fut.set_result(d)
            if self._late_said == started:
                log.info("GPU discovery: the GPU source answered again, after %.0f s", time.monotonic() - started)
            self._say_errors(d)

        def work() -> None:
            try:
                d, exc = source.read(), None
            except Exception as e:
                d, exc = None, e
            try:
                loop.call_soon_threadsafe(done, d, exc)
            except RuntimeError:  # (the loop closed while the read ran: nobody waits for it)
                pass

        threading.Thread(target=work, name="llmgw-gpu-read", daemon=True).start()
        return fut

    async def _read(self, registering: bool = False) -> Discovery:
        """A reading for the next call: a fresh one when the source answers within :data:`READ_WAIT`
        seconds (capped at half an interval; a registration with no reading yet: :data:`FIRST_READ_WAIT`),
        else the last one (:meth:`_late`). A slow source never delays a beat by more than that, so a
        live node never looks silent because nvidia-smi is slow."""
        wait = FIRST_READ_WAIT if registering and self._last is None else min(READ_WAIT, self.interval / 2)
        fut = self._start_read()
        try:
            return await asyncio.wait_for(asyncio.shield(fut), wait)
        except asyncio.TimeoutError:
            return self._late()

    def _late(self) -> Discovery:
        """What a beat sends while a read is overdue: the last reading while it is recent (within
        :data:`STALE_AFTER`, or three intervals if longer); past that, its GPUs by what does not
        change (uuid, name, bus id, memory size) without their readings, and an error saying why:
        an old utilisation passed off as a live one would mislead as much as a zero would."""
        now = time.monotonic()
        last, running = self._last, now - self._read_started
        if last is not None and now - self._last_at <= max(STALE_AFTER, 3 * self.interval):
            return last
        msg = (f"the GPU source has not answered for {running:.0f} s (a read is still running: "
               "a hung driver, or nvidia-smi stuck?)")
        if last is None:  # (the source is known, what it would read is not: no GPUs claimed, none denied)
            return Discovery(facts=NodeFacts(hostname=socket.gethostname(), agent_version=__version__),
                             source=_source_name(self.source), errors=(msg,))
        if self._late_said != self._read_started:  # (said once per stalled read, not on every beat)
            log.warning("GPU discovery: %s; reporting the GPUs last read %.0f s ago without their readings "
                        "until it answers", msg, now - self._last_at)
            self._late_said = self._read_started
        # (health, MIG mode, the node's free memory and its InfiniBand counters are readings too: absent,
        # health "unknown", not the last ones passed off as current; a hung driver is when they matter)
        gpus = tuple(g.identity() for g in last.gpus)
        facts = replace(last.facts, memory_available_bytes=None, infiniband=())
        return Discovery(facts=facts, gpus=gpus, source=last.source,
                         errors=(*last.errors, f"{msg}; the GPUs as last read {now - self._last_at:.0f} s ago, "
                                 "without their readings"))

    def _say_errors(self, d: Discovery) -> None:
        """Log what discovery failed on (NVML not initialising, a GPU fallen off the bus) when it
        changes, not at every reading; and when it clears."""
        now = (*d.errors, *(f"GPU {g.index} ({g.uuid}): {e}" for g in d.gpus for e in g.errors))
        if now == self._errors_said:
            return
        for e in now:
            if e not in self._errors_said:
                log.warning("GPU discovery: %s (reported to the control plane as an error, not as readings)", e)
        if not now:
            log.info("GPU discovery: no errors now")
        self._errors_said = now

    async def _sleep(self, stop: asyncio.Event, seconds: float) -> bool:
        """Sleep, or return True at once when ``stop`` is set (early, False, when the heartbeat stream ended)."""
        if stop.is_set():
            return True
        waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._wake.wait())]
        try:
            await asyncio.wait(waiters, timeout=max(0.0, seconds), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()
        return stop.is_set()

    async def _sleep_plain(self, stop: asyncio.Event, seconds: float) -> bool:
        """Sleep ``seconds`` (not woken early by a poke); True when ``stop`` is set."""
        try:
            await asyncio.wait_for(stop.wait(), seconds)
        except asyncio.TimeoutError:
            pass
        return stop.is_set()

    def _jittered(self) -> float:
        return self.interval * self.rng.uniform(0.9, 1.1)

    # -- calls --

    async def register(self) -> pb.RegisterResponse:
        """One Register call (raises :class:`grpc.aio.AioRpcError` or :class:`AgentRefused`)."""
        discovery = await self._read(registering=True)
        req = pb.RegisterRequest(
            node_name=self.name, agent_version=__version__,
            protocol=pb.ProtocolVersion(major=self.protocol[0], minor=self.protocol[1]),
            discovery=discovery_to_proto(discovery), labels=self.labels, agent_instance=self.instance,
        )
        if self.advertise is not None:
            req.advertise_address = self.advertise
        call = self._connect().Register(req, metadata=self._metadata, timeout=self.call_timeout)
        resp: pb.RegisterResponse = await call
        self._learn_lease(await call.initial_metadata())
        theirs = resp.protocol.major
        if not compatible(theirs):
            raise AgentRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"incompatible wire protocol: the control plane at {self.target} (llmgw {resp.control_plane_version}) "
                f"speaks {theirs}.{resp.protocol.minor}, this agent (llmgw {__version__}) speaks "
                f"{PROTOCOL[0]}.{PROTOCOL[1]}; run agent and control plane of the same major version",
            )
        self.node_id = resp.node_id
        self.peer_protocol = (theirs, resp.protocol.minor)
        self._end_stream()  # a stream belongs to one registration
        self.streaming = streams_heartbeats(self.protocol) and streams_heartbeats((theirs, resp.protocol.minor))
        self.interval = resp.heartbeat_interval_seconds or self.interval
        self.sequence = 0
        self.registrations += 1
        log.info(
            "registered with %s as %s (node id %s, control plane llmgw %s, heartbeat every %gs)",
            self.target, self.name, resp.node_id, resp.control_plane_version, self.interval,
        )
        if self.on_registered is not None:
            self.on_registered(resp)
        return resp

    def _learn_lease(self, md: Any) -> None:
        lease = None
        for key, value in md or ():
            if key == LEASE_METADATA and isinstance(value, str) and value.isdigit():
                lease = int(value) / 1000
        self.lease = lease
        # a paused leader accepts connections (the kernel does) and answers nothing: give up on a
        # call sooner than CALL_TIMEOUT, so the next control plane is tried within the lease
        self.call_timeout = CALL_TIMEOUT if lease is None else min(CALL_TIMEOUT, max(1.0, lease / 2))

    def _answer_within(self) -> float | None:
        """How long the heartbeat stream may stay silent (a leader with a lease answers every third of it)."""
        if self.lease is None:
            return None
        return 2 * max(self.lease / 3, self.interval) + 0.5

    async def heartbeat(self) -> None:
        """One beat: a message on the heartbeat stream (opened on first use), or a Heartbeat call.

        Raises:
            grpc.aio.AioRpcError: the call or the stream failed (the stream is then dropped; the
                next beat opens another).
        """
        assert self.node_id is not None
        discovery = await self._read()
        self.sequence += 1
        self._wake.clear()  # (before the statuses are read: a change after this beats again)
        req = pb.HeartbeatRequest(
            node_id=self.node_id, node_name=self.name, sequence=self.sequence, discovery=discovery_to_proto(discovery),
            agent_instance=self.instance, leaving=self.leaving,
        )
        sup = self.supervisor
        if sup is not None:
            req.applied_generation = self.applied
            req.replicas.extend(status_to_proto(s) for s in sup.statuses())
        self._last_beat = time.monotonic()
        resp: pb.HeartbeatResponse | None = None
        if self.streaming:
            try:
                resp = await self._beat_on_stream(req)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                log.info("the control plane at %s has no heartbeat stream: heartbeat calls instead", self.target)
                self.streaming = False
        if not self.streaming:
            resp = await self._connect().Heartbeat(req, metadata=self._metadata, timeout=self.call_timeout)
        self.heartbeats += 1
        if resp is not None:
            self._answer(resp)

    async def _beat_on_stream(self, req: pb.HeartbeatRequest) -> pb.HeartbeatResponse | None:
        """One message on the heartbeat stream; the answer when one is due (a new stream's first).

        The control plane answers a stream's first message and then only when the answer changes
        (a cordon, a new interval): PERF, half its cost per beat. A reader task takes the answers as
        they come; when the stream ends between beats it records why and wakes the loop.
        """
        if self._stream_error is not None:  # it ended since the last beat
            exc, self._stream_error = self._stream_error, None
            self._end_stream()
            raise exc
        call = self._stream
        first = call is None
        within = self._answer_within()
        if not first and within is not None and time.monotonic() - self._last_answer > within:
            self._end_stream()
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                f"the control plane at {self.target} answered nothing on the heartbeat stream for {within:.1f}s "
                "(paused, or cut off): trying the others",
            )
        if call is None:
            call = self._stream = self._connect().StreamHeartbeats(metadata=self._metadata)
        try:
            await asyncio.wait_for(call.write(pb.StreamHeartbeatsRequest(heartbeat=req)), self.call_timeout)
            if not first:
                return None
            got = await asyncio.wait_for(call.read(), self.call_timeout)
        except asyncio.TimeoutError:
            self._end_stream()
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                f"no answer on the heartbeat stream within {self.call_timeout:g}s",
            ) from None
        except grpc.aio.AioRpcError:
            self._end_stream()
            raise
        except asyncio.InvalidStateError:  # written after the stream ended: its status says why
            got = grpc.aio.EOF
        if got is grpc.aio.EOF:
            self._end_stream()
            raise await self._ended(call)
        self._last_answer = time.monotonic()
        self._reader = asyncio.create_task(self._read_answers(call))
        return got.heartbeat

    @staticmethod
    async def _ended(call: Any) -> grpc.aio.AioRpcError:
        code = await call.code()
        try:
            trailing = await call.trailing_metadata()
        except Exception:
            trailing = None
        return grpc.aio.AioRpcError(
            code if code != grpc.StatusCode.OK else grpc.StatusCode.UNAVAILABLE,
            grpc.aio.Metadata(), trailing if trailing is not None else grpc.aio.Metadata(),
            await call.details() or "the heartbeat stream ended",
        )

    def _answer(self, resp: pb.HeartbeatResponse) -> None:
        if resp.heartbeat_interval_seconds > 0:
            self.interval = resp.heartbeat_interval_seconds
        self.cordoned = resp.cordoned
        for ec in resp.engine_checks:
            self._spawn(self._send_check(ec))
        if self.supervisor is None:
            return
        if resp.HasField("desired"):
            d = resp.desired
            gen = d.generation
            fresh = gen != self.applied or not self._applied_any  # (a first set of generation 0 too)
            if fresh and (self._wanted is None or self._wanted[0] != gen):
                self._wanted = (gen, tuple(spec_from_proto(m) for m in d.replicas))
                if self._applier is None or self._applier.done():
                    self._applier = asyncio.get_running_loop().create_task(self._apply())
        for lr in resp.log_requests:
            self._spawn(self._send_log(lr))

    def poke(self) -> None:
        """Beat soon (a replica's status changed): at once, or :data:`MIN_BEAT_GAP` after the last beat."""
        self._wake.set()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _apply(self) -> None:
        """Hand the desired set to the supervisor, the latest one when several came while one was applied."""
        sup = self.supervisor
        assert sup is not None
        while self._wanted is not None:
            gen, specs = self._wanted
            try:
                await sup.apply(specs)
            except Exception:  # the supervisor reports per-replica failures in its statuses; this is its own bug
                log.exception("applying desired generation %d (%d replica(s)) failed", gen, len(specs))
            log.info("applied desired generation %d: %d replica(s)", gen, len(specs))
            self.applied, self._applied_any = gen, True
            if self._wanted is not None and self._wanted[0] == gen:
                self._wanted = None  # (else a newer one came while this one was applied: apply it too)
            self.poke()  # tell the control plane now

    async def _send_check(self, ec: pb.EngineCheckRequest) -> None:
        if self.node_id is None:
            return
        req = pb.EngineCheckResultRequest(node_id=self.node_id, node_name=self.name, request_id=ec.request_id)
        if self.engine_checker is None:
            req.error = "this agent runs no engine checks"
        else:
            log.info("running the %s engine check the control plane asked for", ec.engine)
            try:
                for c in await self.engine_checker(ec):
                    req.checks.add(name=str(c.get("check", "")), status=str(c.get("status", "")),
                                   detail=str(c.get("detail", "")), fix=str(c.get("fix") or ""))
            except Exception as exc:  # (a check reports failures as checks; this is the checker itself failing)
                log.exception("the %s engine check failed to run", ec.engine)
                req.error = f"the {ec.engine} engine check could not run: {type(exc).__name__}: {exc}"[:2000]
        try:
            await self._connect().EngineCheckResult(req, metadata=self._metadata, timeout=CALL_TIMEOUT)
        except grpc.aio.AioRpcError as exc:
            log.warning("could not send the %s engine check (%s: %s)", ec.engine, exc.code().name, exc.details())

    async def _send_log(self, lr: pb.LogRequest) -> None:
        sup = self.supervisor
        if sup is None or self.node_id is None:
            return
        req = pb.ReplicaLogsRequest(node_id=self.node_id, node_name=self.name, request_id=lr.request_id)
        try:
            text = await asyncio.to_thread(sup.log_tail, lr.replica_id, max(1, lr.lines))
        except KeyError:
            req.error = f"no replica {lr.replica_id!r} on node {self.name}"
        except OSError as exc:
            req.error = f"cannot read replica {lr.replica_id}'s log: {exc.strerror or exc}"
        else:
            data = text.encode("utf-8", "replace")
            if len(data) > MAX_LOG_BYTES:
                text = data[-MAX_LOG_BYTES:].decode("utf-8", "ignore")
                text = text[text.find("\n") + 1:]
            req.text = text
        try:
            await self._connect().ReplicaLogs(req, metadata=self._metadata, timeout=CALL_TIMEOUT)
        except grpc.aio.AioRpcError as exc:
            log.warning("could not send replica %s's log (%s: %s)", lr.replica_id, exc.code().name, exc.details())

    async def _read_answers(self, call: Any) -> None:
        try:
            while True:
                got = await call.read()
                if got is grpc.aio.EOF:
                    self._stream_error = await self._ended(call)
                    break
                self._last_answer = time.monotonic()
                self._answer(got.heartbeat)
        except grpc.aio.AioRpcError as exc:
            self._stream_error = exc
        except asyncio.CancelledError:
            return
        if self._stream is call:
            self._wake.set()

    def _move(self, target: str, loud: bool = True) -> None:
        if target != self.target:
            # (quiet when it only repeats a round an outage already logged)
            log.log(logging.INFO if loud else logging.DEBUG, "moving to the control plane at %s (from %s)",
                    target, self.target)
            self.target = target
            self.switches += 1

    async def deregister(self, reason: str, timeout: float = 2.0) -> bool:
        if self.node_id is None:
            return False
        self._end_stream()
        req = pb.DeregisterRequest(node_id=self.node_id, node_name=self.name, reason=reason, agent_instance=self.instance)
        try:
            resp = await self._connect().Deregister(req, metadata=self._metadata, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            log.warning("deregistering from %s failed (%s: %s)", self.target, exc.code().name, exc.details())
            return False
        log.info("deregistered from %s (%s)", self.target, reason)
        return bool(resp.removed)

    # -- the loop --

    def _running(self) -> int:
        """The replicas this node still runs (or starts, or fetches a model for, or stops)."""
        sup = self.supervisor
        return 0 if sup is None else sum(1 for st in sup.statuses() if st.state in _LIVE)

    def _start_drain(self) -> float | None:
        """At the first stop: when the node should drain first (module docstring), say so and return the
        drain's deadline (monotonic); ``None``: stop at once."""
        n = self._running()
        if not n or self.node_id is None or self.drain_timeout <= 0 or not drains_leaving(self.peer_protocol):
            return None
        log.info("stopping: draining %d replica(s) off this node first: their requests in flight finish, the "
                 "control plane places them elsewhere (at most %gs; stop again to stop them at once)",
                 n, self.drain_timeout)
        self.leaving = True
        self.poke()  # (tell the control plane now, not an interval later)
        return time.monotonic() + self.drain_timeout

    def _drained(self, deadline: float, hard: asyncio.Event) -> bool:
        """While draining: whether to stop now (nothing runs any more, the timeout, a second stop)."""
        n = self._running()
        if not n:
            log.info("drained: no replica runs on this node any more")
            return True
        if hard.is_set():
            log.warning("stopped again while draining: stopping %d replica(s) now", n)
            return True
        if time.monotonic() >= deadline:
            log.warning("%d replica(s) still draining after %gs (drain_timeout): stopping them now", n,
                        self.drain_timeout)
            return True
        return False

    async def run(self, stop: asyncio.Event, reason: Callable[[], str] = lambda: "stopped",
                  hard: asyncio.Event | None = None) -> None:
        """Register and heartbeat until ``stop`` is set; then drain (until ``hard`` is set) and deregister.

        While draining the loop goes on as before (reconnects, a new leader followed), its heartbeats
        saying ``leaving``, until nothing runs, ``drain_timeout`` passes or ``hard`` is set.

        Raises:
            AgentRefused: wrong token, incompatible protocol, invalid name.
        """
        hard = hard or asyncio.Event()
        until = stop  # what ends a wait: the stop, then (draining) the second stop
        deadline: float | None = None  # draining: when it gives up
        delay = self.backoff_initial
        registered = False
        retry = False  # the last call failed: try again after the backoff, not after another interval
        said: set[str] = set()  # what went wrong since the last success, as logged (each said once)
        failed_at: str | None = None  # the address that failed first since the last success
        tried: set[str] = set()  # addresses that failed since the last success or sleep: a round
        refused: dict[str, AgentRefused] = {}  # addresses that refused this agent since the last success
        refused_since: float | None = None  # the first of those refusals (monotonic)
        try:
            while True:
                if stop.is_set():
                    if deadline is None:
                        deadline = self._start_drain()
                        if deadline is None:
                            break
                        until = hard
                        retry = True  # (beat at once)
                    if self._drained(deadline, hard):
                        break
                try:
                    if not registered:
                        await self.register()
                        registered = True
                        # a node running replicas beats at once: its stream is open for pushes from now on,
                        # and the control plane hears of the replicas it adopted without waiting an interval
                        retry = self.supervisor is not None
                    else:
                        nap = self._jittered() if deadline is None else min(self._jittered(), 0.5)
                        if not retry and await self._sleep(until, nap):
                            continue  # (stopped: the top of the loop decides)
                        gap = MIN_BEAT_GAP - (time.monotonic() - self._last_beat)
                        if gap > 0 and await self._sleep_plain(until, gap):
                            continue
                        retry = False
                        await self.heartbeat()
                    delay = self.backoff_initial
                    tried.clear()
                    refused.clear()
                    refused_since = None
                    if said:
                        if self.target == failed_at:
                            log.info("control plane at %s reachable again", self.target)
                        else:
                            log.info("connected to the control plane at %s", self.target)
                        said.clear()
                        failed_at = None
                except grpc.aio.AioRpcError as exc:
                    code = exc.code()
                    if code in _FATAL:
                        refusal = AgentRefused(code, exc.details() or code.name)
                        refused[self.target] = refusal
                        now = time.monotonic()
                        refused_since = now if refused_since is None else refused_since
                        if len(self.targets) <= 1 or all(t in refused for t in self.targets):
                            refusal.every = len(self.targets) > 1
                            raise refusal from None
                        if now - refused_since >= REFUSED_GIVE_UP_S:
                            refusal.waited = now - refused_since
                            raise refusal from None
                    if code == grpc.StatusCode.NOT_FOUND:
                        log.warning("the control plane does not know this node (it restarted?): registering again")
                        registered = False
                        continue
                    msg = f"{code.name}: {exc.details()}"
                    why = tls_hint(exc.details() or "", self.credentials is not None)
                    if why is not None:
                        msg = f"{msg} ({why})"
                    hint = leader_hint(exc)
                    said_now = f"{self.target} {msg}" not in said
                    if said_now:  # (an outage that goes round the addresses logs each answer once)
                        log.warning("control plane at %s: %s; %s", self.target, msg,
                                    f"following the leader at {hint}" if hint and hint != self.target
                                    else "trying the next address" if len(self.targets) > 1
                                    else "retrying with backoff")
                        said.add(f"{self.target} {msg}")
                        if len(said) > 64:  # (bounded: answers that keep changing)
                            said.clear()
                            said.add(f"{self.target} {msg}")
                    if failed_at is None:
                        failed_at = self.target
                    await self._disconnect()
                    retry = True
                    tried.add(self.target)
                    # within a round, at once: the leader a refusal names, else the next address not
                    # tried yet; the backoff only once every address (and every hint) failed
                    i = self.targets.index(self.target) if self.target in self.targets else -1
                    untried = [t for t in self.targets[i + 1:] + self.targets[:i + 1] if t not in tried]
                    nxt = hint if hint and hint not in tried else (untried[0] if untried else None)
                    if nxt is not None:
                        self._move(nxt, said_now)
                        registered = False
                        continue
                    tried.clear()
                    if len(self.targets) > 1 or self.target not in self.targets:  # (a hint's address: back to the list)
                        self._move(self.targets[(i + 1) % len(self.targets)], said_now)
                        registered = False
                    # full jitter, capped at one interval (2 s with several control planes: a new leader
                    # is found within seconds): back within about an interval of its return
                    cap = min(self.interval, 2.0) if len(self.targets) > 1 or self.lease is not None else self.interval
                    # (not cut short by a poke: a replica's change, or the end of a stream already
                    # known, is no reason to call an unreachable control plane again at once)
                    if deadline is not None:
                        cap = min(cap, 1.0, max(0.05, deadline - time.monotonic()))
                    if await self._sleep_plain(until, self.rng.uniform(0.5, 1.0) * min(delay, cap)):
                        continue
                    delay = min(delay * 2, cap)
            if registered or deadline is not None:
                await self.deregister(reason())
        finally:
            for t in [*self._tasks, *([self._applier] if self._applier is not None else [])]:
                t.cancel()
            await self._disconnect()
            if self._reading is not None and not self._reading.done():
                # (a read still running in its thread uses the source: closing NVML under it is not safe;
                # the process is ending, and the thread with it)
                log.warning("a GPU read is still running: the GPU source is left open")
            else:
                try:
                    self.source.close()
                except Exception:
                    log.exception("closing the GPU source failed")


