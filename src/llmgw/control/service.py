"""The control plane's gRPC service and the :class:`ControlPlane` component ``llmgw serve`` plugs in.

``AgentService`` (``proto/llmgw/agent/v1/agent.proto``) on ``control.listen``,
served by llmgw's own gRPC server (:mod:`.grpcserver`; ``control.grpc_server: grpcio``:
by ``grpc.aio``'s) on the control plane's own thread and loop
(:mod:`.thread`): the handlers read and write the wire there, and hand what
changes state (the node map, the counters the scrape reads) to the main loop. Every call carries the join token as
``authorization: Bearer <token>`` metadata; tokens are kept as SHA-256 digests and
compared in constant time. A refusal is logged with the node name and the peer
address, never the token.

Security (docs/control-plane.md): TLS with ``control.tls_cert``/``tls_key``, mutual
TLS when ``control.tls_client_ca`` is set too (on grpc.aio's server then, and only then,
``require_client_auth=True``: with roots but without it gRPC would not even ask
for a client certificate). Plaintext is refused off loopback unless
``control.allow_insecure``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import hmac
import itertools
import json
import re
import socket
import ssl
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import grpc

from .. import __version__
from .._proto.agent.v1 import agent_pb2_grpc
from .._proto.router.v1 import router_pb2_grpc
from ..agent.wire import (
    NODE_NAME,
    PROTOCOL,
    SERVER_OPTIONS,
    TOKEN_METADATA,
    compatible,
    node_id_for,
    pb,
    runs_replicas,
    spec_to_proto,
    status_from_proto,
)
from ..config.loading import plaintext_off_loopback
from ..errors import ConfigError, HTTPError, StartupError
from ..fleet.held import HeldModels
from ..log import control_logger as log
from ..mirror.serve import BlobServer
from . import limits
from .credentials import NodeCredentials
from .follow import FollowCollector, FollowHub, RouterService
from .follow import attach as attach_follow
from .grpcserver import Limits, Server, server_ssl_context
from .nodes import NodeMap, NodeState, peer_host
from .thread import PACE_AFTER_ACCEPT_S, PACE_FROM, ControlThread, MainHop
from .tokens import JoinTokens

if TYPE_CHECKING:
    from ..admin.app import AdminApp
    from ..config import Config, ControlConfig
    from ..launch.spec import ReplicaController
    from .db import Database
    from .deployments import DeploymentController, Router
    from .resolve import Resolver

__all__ = ["LEADER_METADATA", "LEASE_METADATA", "ControlPlane", "ControlStats", "ReplicaLogsError"]

MAX_NAME = 128
MAX_LABELS = 64
MAX_LABEL = 253
MAX_LOG_LINES = 10_000
_TRIM_LOG_EVERY_S = 60.0
LEADER_METADATA = "llmgw-leader"
"""Trailing metadata of a standby's refusal (UNAVAILABLE): the leader's gRPC address, when known."""
LEASE_METADATA = "llmgw-lease-ms"
"""Initial metadata of a leader's RegisterResponse (with a database): its lease, milliseconds. The
agent then expects an answer on its heartbeat stream at least every third of it (a paused
leader's silence is noticed though its TCP connection stays up) and times its calls out sooner."""
LOG_TIMEOUT = 10.0
"""How long ``ctl logs`` waits for the node's answer, seconds (a stream agent answers at once;
one on Heartbeat calls at its next beat)."""


CHECK_ALLOWANCE = 180.0
"""Seconds an engine check may take beyond its readiness timeout (the static checks: a --help each)."""


def _put_asks(resp: pb.HeartbeatResponse, asks: list[pb.LogRequest | pb.EngineCheckRequest]) -> None:
    for a in asks:
        if isinstance(a, pb.LogRequest):
            resp.log_requests.append(a)
        else:
            resp.engine_checks.append(a)


class ReplicaLogsError(Exception):
    """What a node was asked and cannot be had (a log tail, an engine check): ``status`` (404 unknown
    replica or node, 409 an agent too old, 504 no answer, 502 the node's error) and ``code``."""

    def __init__(self, message: str, status: int, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code



@dataclass
class ControlStats:
    """The control plane's own counters (exported by the cluster collector).

    Each counter has one writer: registrations, deregistrations and heartbeats are
    counted on the main loop (with the node map), refusals, RPC errors and open
    streams on the control thread; the scrape only reads them.
    """

    registrations: int = 0
    reregistrations: int = 0
    deregistrations: int = 0
    heartbeats: int = 0
    streams_open: int = 0
    """Heartbeat streams open now (one per agent on protocol 1.1 or later)."""
    refused: dict[str, int] = field(default_factory=dict)
    """Refused joins by reason: ``invalid_token``, ``missing_token``, ``revoked_token``, ``expired_token``,
    ``incompatible_version``, ``invalid_request``, ``oversized_discovery``."""
    rpc_errors: dict[tuple[str, str], int] = field(default_factory=dict)
    """(method, status code name) -> calls answered with that error."""

    def refuse(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1

    def error(self, method: str, code: grpc.StatusCode) -> None:
        key = (method, code.name)
        self.rpc_errors[key] = self.rpc_errors.get(key, 0) + 1


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(f"control.{what}", f"cannot read {path}: {exc.strerror or exc}") from None


def server_credentials(c: ControlConfig) -> grpc.ServerCredentials | None:
    """TLS (or mutual TLS) credentials for grpc.aio's server (``control.grpc_server: grpcio``); ``None`` for plaintext.

    Raises:
        ConfigError: a file cannot be read, or plaintext off loopback without ``allow_insecure``.
    """
    if c.tls_cert is None or c.tls_key is None:
        why = plaintext_off_loopback(c)
        if why is not None:
            raise ConfigError("control.listen", why)
        return None
    pair = (_read(c.tls_key, "tls_key"), _read(c.tls_cert, "tls_cert"))
    if c.tls_client_ca is None:
        return grpc.ssl_server_credentials([pair])
    # SECURITY: with roots but require_client_auth=False gRPC would not even request a client
    # certificate (cluster.md §7.6): mutual TLS needs both.
    return grpc.ssl_server_credentials(
        [pair], root_certificates=_read(c.tls_client_ca, "tls_client_ca"), require_client_auth=True
    )


def server_tls(c: ControlConfig) -> ssl.SSLContext | None:
    """The TLS (or mutual TLS: a client certificate required) context of llmgw's own gRPC server; ``None`` for
    plaintext.

    Raises:
        ConfigError: a file cannot be read or is not a certificate and its key, or plaintext off loopback
            without ``allow_insecure``.
    """
    if c.tls_cert is None or c.tls_key is None:
        why = plaintext_off_loopback(c)
        if why is not None:
            raise ConfigError("control.listen", why)
        return None
    for path, what in ((c.tls_cert, "tls_cert"), (c.tls_key, "tls_key"), (c.tls_client_ca, "tls_client_ca")):
        if path is not None:
            _read(path, what)
    try:
        return server_ssl_context(c.tls_cert, c.tls_key, c.tls_client_ca)
    except ssl.SSLError as exc:
        raise ConfigError("control.tls_cert", f"cannot use {c.tls_cert} with {c.tls_key}: {exc.reason or exc}") from None


class _Taken(NamedTuple):
    """A registration refused while the node is up: ``why`` for the log, ``message`` for the agent."""

    why: str
    message: str


class _NotYours(Exception):
    """A call for a node registered with another join token (it does not speak for that node)."""


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def _same(a: bytes, b: bytes) -> bool:
    return not a or hmac.compare_digest(a, b)  # (b"": a node recorded before tokens were kept: anyone's)


NOT_LEADING = ("this control plane no longer leads (it is stopping, or another took over): "
               "the agent registers with the leader")


class _Tokens:
    """The join tokens as SHA-256 digests, rebuilt when a reload changes them."""

    def __init__(self) -> None:
        self._src: tuple[str, ...] | None = None
        self._digests: tuple[bytes, ...] = ()

    def check(self, tokens: tuple[str, ...], given: str) -> bool:
        if tokens is not self._src:
            self._src = tokens
            self._digests = tuple(hashlib.sha256(t.encode()).digest() for t in tokens)
        got = hashlib.sha256(given.encode()).digest()
        ok = False
        for d in self._digests:  # SECURITY: constant time, and no early exit that tells which matched
            ok |= hmac.compare_digest(got, d)
        return ok


class _Stream:
    """One agent's heartbeat stream: answers the main loop decides, written on the control loop."""

    __slots__ = ("acked", "closed", "context", "loop", "node", "queue", "replicas", "said", "said_at", "sent", "stats",
                 "token")

    def __init__(self, context: Any, loop: asyncio.AbstractEventLoop, stats: ControlStats) -> None:
        self.context = context
        self.loop = loop
        self.stats = stats
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        # (the rest: main loop only)
        self.said: tuple[float, bool] | None = None
        """The answer last sent: the next one only when it differs."""
        self.said_at = 0.0
        """When it was sent (monotonic; with a database answers also come every third of the lease)."""
        self.node: str | None = None
        self.replicas = False
        """The agent runs replicas (its beats carry applied_generation)."""
        self.acked: int | None = None
        """The generation the agent last said it applied."""
        self.sent: int | None = None
        """The generation last sent on this stream (not again until the agent acknowledges another)."""
        self.closed = False
        self.token = b""
        """SHA-256 of the join token the stream's calls carry."""

    def push(self, item: Any) -> None:
        """Queue a response (or an ``(code, message)`` ending) for the agent; from any thread."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the control loop is closed: the stream is gone
            pass

    async def write_loop(self) -> None:
        while True:
            item = await self.queue.get()
            if isinstance(item, tuple):
                code, message = item
                self.stats.error("StreamHeartbeats", code)
                with contextlib.suppress(grpc.aio.AbortError):  # (raised here, in the writer: nobody awaits it)
                    await self.context.abort(code, message)  # the handler's pending read ends with it
                return
            await self.context.write(item)


class AgentService(agent_pb2_grpc.AgentServiceServicer):
    """The four RPCs over a :class:`NodeMap`.

    The handlers run on the control loop; ``hop`` takes their state changes to the
    main loop (``None``: both are one loop, as in a bare test).
    """

    def __init__(
        self, nodes: NodeMap, control: Callable[[], ControlConfig], stats: ControlStats, hop: MainHop | None = None,
        controller: ReplicaController | None = None,
    ) -> None:
        self.nodes = nodes
        self.control = control
        self.stats = stats
        self.hop = hop
        self._tokens = _Tokens()
        self.standby: Callable[[], str | None] | None = None
        """With a database: ``None`` while this process leads, else the leader's gRPC address ('' unknown).
        (Called on the control loop: it reads a few attributes the main loop sets.)"""
        self.on_register: Callable[[str, str, Any, str], Awaitable[None]] | None = None
        """Awaited on the main loop before a registration is taken (the leader records the node, fenced)."""
        self.on_deregister: Callable[[str], Awaitable[None]] | None = None
        self.lease_ms: int | None = None
        """With a database: the lease (answers on a heartbeat stream come at least every third of it)."""
        self.streams: set[asyncio.Task[Any]] = set()
        """The heartbeat streams' handler tasks (control loop; cancelled when this process stops leading)."""
        self._handed_over: set[asyncio.Task[Any]] = set()  # those cancel_streams ended (they end NOT_LEADING)
        # (the rest: main loop only)
        self.controller: ReplicaController | None = None
        self._links: dict[str, _Stream] = {}
        """Node name -> its open heartbeat stream (the latest one)."""
        self._ask_ids = itertools.count(1)
        self._asks: dict[str, list[pb.LogRequest | pb.EngineCheckRequest]] = {}
        self._trim_told: dict[str, float] = {}  # node -> when a trimmed reading was last logged (monotonic)
        """Node name -> what it is asked (log tails, engine checks) and has not been written yet."""
        self._waits: dict[int, tuple[str, asyncio.Future[Any]]] = {}
        """Request id -> (the node asked, the answer's future)."""
        self.credentials: NodeCredentials | None = None  # the nodes' mirror credentials (ControlPlane sets it)
        self.api_tokens: JoinTokens | None = None
        """Join tokens made through the management API (ControlPlane sets it; checked after the config's)."""
        self.mirror_access: Callable[[str], tuple[str, str] | None] | None = None
        """Node name -> ``(mirror base URL, the node's credential)`` sent in Register's answer; ``None``
        (or a ``None`` answer): the agents are given no mirror access."""
        if controller is not None:
            self.attach(controller)

    # -- the replica controller (main loop) --

    def attach(self, controller: ReplicaController | None) -> None:
        """Use ``controller`` for desired sets and statuses (``None``: none; no replicas are sent)."""
        self.controller = controller
        if controller is not None:
            controller.subscribe(self._changed)

    def _changed(self, node: str) -> None:
        """``node``'s desired set changed: pushed on its stream at once (agents on calls get it on their next beat)."""
        link = self._links.get(node)
        if link is not None and link.replicas and self.controller is not None:
            self._answer_stream(link, None)

    def _desired(self, node: str, applied: int | None, sent: int | None) -> tuple[int, pb.DesiredReplicas] | None:
        """The desired set to send ``node`` when its generation is neither what it applied nor already sent."""
        ctl = self.controller
        if ctl is None:
            return None
        try:
            gen, specs = ctl.desired(node)
        except Exception:
            log.exception("the replica controller failed to give node %s's desired set", node)
            return None
        if gen == sent or (gen == applied and applied != 0):  # (0: the agent applied nothing yet: send even a 0)
            return None
        msg = pb.DesiredReplicas(generation=gen)
        msg.replicas.extend(spec_to_proto(s) for s in specs)
        return gen, msg

    def _report(self, st: NodeState, hb: pb.HeartbeatRequest) -> None:
        """A beat's replica statuses: kept on the node and handed to the controller."""
        statuses = tuple(status_from_proto(m) for m in hb.replicas) if hb.replicas else ()
        st.replicas = statuses
        ctl = self.controller
        if ctl is not None:
            try:
                ctl.report(st.name, st.address, statuses)
            except Exception:
                log.exception("the replica controller failed on node %s's report", st.name)

    def _gone(self, node: str) -> None:
        link = self._links.pop(node, None)
        if link is not None:
            link.closed = True
        self._asks.pop(node, None)
        for rid, (n, fut) in list(self._waits.items()):
            if n == node and not fut.done():
                fut.set_exception(ReplicaLogsError(f"node {node} left the cluster", 502, "node_gone"))
                self._waits.pop(rid, None)
        if self.controller is not None:
            try:
                self.controller.node_gone(node)
            except Exception:
                log.exception("the replica controller failed on node %s leaving", node)

    def _answer_stream(self, link: _Stream, st: NodeState | None) -> None:
        """Push the stream's answer when one is due: a new interval or cordon, a desired set, requests."""
        if link.closed or link.node is None:
            return
        if st is None:
            st = self.nodes.get(link.node)
            if st is None:
                return
        answer = (self.control().heartbeat_interval, st.cordoned)
        desired = self._desired(link.node, link.acked, link.sent) if link.replicas else None
        asks = self._asks.pop(link.node, None)
        # with a database, also at least every third of the lease: the agent takes silence for a lost leader
        every = self.lease_ms / 3000 if self.lease_ms is not None else None
        now = time.monotonic() if every is not None else 0.0
        if answer == link.said and desired is None and not asks and (every is None or now - link.said_at < every):
            return
        resp = pb.HeartbeatResponse(heartbeat_interval_seconds=answer[0], cordoned=answer[1])
        if desired is not None:
            resp.desired.CopyFrom(desired[1])
            link.sent = desired[0]
        if asks:
            _put_asks(resp, asks)
        link.said = answer
        link.said_at = now
        link.push(pb.StreamHeartbeatsResponse(heartbeat=resp))

    def _unlink(self, link: _Stream) -> None:
        link.closed = True
        if link.node is not None and self._links.get(link.node) is link:
            del self._links[link.node]

    async def close(self) -> None:
        """Nothing to cancel (pushes go through each stream's queue); kept for the component's stop."""


    # -- log tails (ctl logs) --

    def node_of_replica(self, replica_id: str) -> str | None:
        """The node whose latest heartbeat reported ``replica_id``."""
        for st in self.nodes:
            for r in st.replicas:
                if r.id == replica_id:
                    return st.name
        return None

    async def replica_logs(self, replica_id: str, lines: int = 100, timeout: float = LOG_TIMEOUT) -> str:
        """The last ``lines`` lines of a replica's log, asked of the node that runs it.

        Raises:
            ReplicaLogsError: no node reports that replica (404), the node did not answer in time (504),
                or it could not read the log (502).
        """
        node = self.node_of_replica(replica_id)
        st = self.nodes.get(node) if node is not None else None
        if node is None or st is None:
            raise ReplicaLogsError(
                f"no node reports a replica {replica_id!r}; llmgw ctl deployments lists them", 404, "replica_not_found"
            )
        rid = next(self._ask_ids)
        req = pb.LogRequest(request_id=rid, replica_id=replica_id, lines=max(1, min(lines, MAX_LOG_LINES)))
        text: str = await self._ask(
            node, rid, req, timeout,
            f"node {node} did not answer for replica {replica_id}'s log within {timeout:g}s (is its agent up?)",
        )
        return text

    async def _ask(self, node: str, rid: int, req: pb.LogRequest | pb.EngineCheckRequest, timeout: float,
                   late: str) -> Any:
        """Ask ``node`` (in its next stream answer, written at once, or call answer); its answer, bounded."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waits[rid] = (node, fut)
        self._asks.setdefault(node, []).append(req)
        link = self._links.get(node)
        if link is not None:
            self._answer_stream(link, None)
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise ReplicaLogsError(late, 504, "node_timeout") from None
        finally:
            self._waits.pop(rid, None)
            q = self._asks.get(node)
            if q is not None:
                if req in q:
                    q.remove(req)
                if not q:
                    self._asks.pop(node, None)

    # -- engine checks on a node (ctl engine-check --node) --

    async def engine_check(self, node: str, engine: str, *, model: str | None = None, static_only: bool = False,
                           timeout: float = 600.0) -> list[dict[str, Any]]:
        """Run ``llmgw ctl engine-check ENGINE`` on ``node``'s agent; the checks as ``Check.as_dict`` gives them.

        Raises:
            ReplicaLogsError: no such node (404), an agent that cannot run checks (409), no answer
                within ``timeout`` plus the static checks' allowance (504), or the agent could not run them (502).
        """
        st = self.nodes.get(node)
        if st is None:
            raise ReplicaLogsError(f"no node {node!r}; llmgw ctl nodes lists them", 404, "node_not_found")
        if not st.heard:
            raise ReplicaLogsError(f"node {node} has not registered since this control plane took over: its agent "
                                   "is not connected (llmgw ctl nodes shows it unhealthy)", 409, "node_not_connected")
        if not runs_replicas(st.protocol):
            raise ReplicaLogsError(
                f"node {node}'s agent speaks protocol {st.protocol[0]}.{st.protocol[1]}: it cannot run engine checks "
                "(1.2 or later can); upgrade it, or run llmgw ctl engine-check on the node itself", 409, "agent_too_old",
            )
        rid = next(self._ask_ids)
        req = pb.EngineCheckRequest(request_id=rid, engine=engine, static_only=static_only, timeout_seconds=timeout)
        if model is not None:
            req.model = model
        wait = (0.0 if static_only else timeout) + CHECK_ALLOWANCE
        checks: list[dict[str, Any]] = await self._ask(
            node, rid, req, wait, f"node {node} did not answer the {engine} engine check within {wait:g}s",
        )
        return checks

    async def EngineCheckResult(
        self, request: pb.EngineCheckResultRequest, context: Any
    ) -> pb.EngineCheckResultResponse:
        await self._authenticate(context, "EngineCheckResult", request.node_name)
        if request.HasField("error"):
            result: Any = ReplicaLogsError(f"node {request.node_name}: {request.error}", 502, "check_failed")
        else:
            result = [{"check": c.name, "status": c.status, "detail": c.detail, "fix": c.fix or None}
                      for c in request.checks]
        accepted = await self._on_main(self._resolve, request.node_id, request.request_id, result)
        if accepted is None:
            await self._abort(context, "EngineCheckResult", grpc.StatusCode.NOT_FOUND,
                              f"node {request.node_name!r} is not registered here: register again")
        return pb.EngineCheckResultResponse(accepted=bool(accepted))

    def _resolve(self, node_id: str, request_id: int, result: Any) -> bool | None:
        """On the main loop: resolve what this node was asked and is still awaited (``None``: no such node)."""
        st = self.nodes.by_id(node_id)
        if st is None:
            return None
        wait = self._waits.get(request_id)
        if wait is None or wait[0] != st.name or wait[1].done():  # a node answers only what it was asked
            return False
        if isinstance(result, Exception):
            wait[1].set_exception(result)
        else:
            wait[1].set_result(result)
        return True

    async def ReplicaLogs(self, request: pb.ReplicaLogsRequest, context: Any) -> pb.ReplicaLogsResponse:
        await self._authenticate(context, "ReplicaLogs", request.node_name)
        result: Any = request.text
        if request.HasField("error"):
            result = ReplicaLogsError(f"node {request.node_name}: {request.error}", 502, "log_unavailable")
        accepted = await self._on_main(self._resolve, request.node_id, request.request_id, result)
        if accepted is None:
            await self._abort(context, "ReplicaLogs", grpc.StatusCode.NOT_FOUND,
                              f"node {request.node_name!r} is not registered here: register again")
        return pb.ReplicaLogsResponse(accepted=bool(accepted))

    async def _on_main(self, fn: Callable[..., Any], *args: Any) -> Any:
        hop = self.hop
        return fn(*args) if hop is None else await hop.run(fn, *args)

    async def _on_main_async(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Await ``fn(*args)`` on the main loop (the database's pool lives there)."""
        hop = self.hop
        if hop is None:
            return await fn(*args)
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(fn(*args), hop.loop))  # type: ignore[arg-type]

    def cancel_streams(self) -> None:
        """End every heartbeat stream (on the control loop), UNAVAILABLE with :data:`NOT_LEADING`: the
        agents go to the new leader."""
        for task in list(self.streams):
            self._handed_over.add(task)
            task.cancel()

    async def _leader_only(self, context: Any, method: str) -> None:
        """Refuse the call on a standby (UNAVAILABLE; the leader's address in the trailing metadata)."""
        standby = self.standby
        if standby is None:
            return
        leader = standby()
        if leader is None:
            return
        if leader:
            context.set_trailing_metadata(((LEADER_METADATA, leader),))
        await self._abort(
            context, method, grpc.StatusCode.UNAVAILABLE,
            f"this control plane is a standby; the leader is at {leader}" if leader
            else "this control plane is a standby and does not know the leader yet: try another control plane",
        )

    async def _refuse_write(self, context: Any, method: str, exc: Exception) -> None:
        from .db import DatabaseError
        from .leader import NotLeader

        if isinstance(exc, NotLeader):
            li = exc.leader
            if li is not None and li.grpc_address:
                context.set_trailing_metadata(((LEADER_METADATA, li.grpc_address),))
            await self._abort(context, method, grpc.StatusCode.UNAVAILABLE, f"not the leader any more: {exc}")
        assert isinstance(exc, DatabaseError)
        log.error("%s: the database failed: %s", method, exc)
        await self._abort(context, method, grpc.StatusCode.UNAVAILABLE, "the control plane's database failed; retry")

    async def _abort(self, context: Any, method: str, code: grpc.StatusCode, message: str) -> None:
        self.stats.error(method, code)
        await context.abort(code, message)

    async def _authenticate(self, context: Any, method: str, node: str) -> str:
        """Check the call's join token (aborting with UNAUTHENTICATED); the token, for a stream to recheck."""
        given: str | None = None
        for key, value in context.invocation_metadata() or ():
            if key == TOKEN_METADATA and isinstance(value, str):
                given = value[7:].strip() if value[:7].lower() == "bearer " else value.strip()
        if not given:
            self.stats.refuse("missing_token")
            log.warning("refused %s from node %r at %s: no join token", method, node, context.peer())
            await self._abort(
                context, method, grpc.StatusCode.UNAUTHENTICATED,
                "no join token: the agent must send the control plane's join token (llmgw agent --token-env NAME)",
            )
        # SECURITY: never log or echo the token.
        await self._check(context, method, node, given or "")
        return given or ""

    async def _check(self, context: Any, method: str, node: str, given: str) -> None:
        if self._tokens.check(self.control().join_tokens, given):
            return
        api = self.api_tokens
        if api is not None:
            state, tok = api.check(given)
            if state == "ok":
                return
            if tok is not None:  # revoked or expired: said so, by the token's id (never the token)
                self.stats.refuse(f"{state}_token")
                log.warning("refused %s from node %r at %s: join token %s is %s", method, node, context.peer(),
                            tok.id, state)
                await self._abort(
                    context, method, grpc.StatusCode.UNAUTHENTICATED,
                    f"join token {tok.id}{f' ({tok.name})' if tok.name else ''} is {state}: give the agent "
                    "another (llmgw ctl tokens create) and restart it",
                )
        self.stats.refuse("invalid_token")
        log.warning("refused %s from node %r at %s: wrong join token", method, node, context.peer())
        await self._abort(
            context, method, grpc.StatusCode.UNAUTHENTICATED,
            "wrong join token: check the agent's --token-env variable against control.join_token "
            "(or the tokens llmgw ctl tokens list shows)",
        )

    async def Register(self, request: pb.RegisterRequest, context: Any) -> pb.RegisterResponse:
        name = request.node_name
        given = await self._authenticate(context, "Register", name)
        peer = context.peer()
        theirs = (request.protocol.major, request.protocol.minor)
        if not compatible(theirs[0]):
            self.stats.refuse("incompatible_version")
            msg = (
                f"incompatible wire protocol: agent {name!r} (llmgw {request.agent_version or '?'}) speaks "
                f"llmgw.agent protocol {theirs[0]}.{theirs[1]}, this control plane (llmgw {__version__}) speaks "
                f"{PROTOCOL[0]}.{PROTOCOL[1]}; run agent and control plane of the same major version"
            )
            log.error("refused Register from node %r at %s: %s", name, peer, msg)
            await self._abort(context, "Register", grpc.StatusCode.FAILED_PRECONDITION, msg)
        if NODE_NAME.fullmatch(name) is None:  # (the rule the agent's --name and a deployment's node: have)
            self.stats.refuse("invalid_request")
            await self._abort(
                context, "Register", grpc.StatusCode.INVALID_ARGUMENT,
                f"node_name must be 1-{MAX_NAME} letters, digits, '.', '_' or '-', starting with a letter or digit; "
                f"got {name[:60]!r}",
            )
        labels = dict(request.labels)
        bad = [k for k, v in labels.items() if not k or len(k) > MAX_LABEL or len(v) > MAX_LABEL
               or not (k + v).isprintable()]
        advertise = request.advertise_address if request.HasField("advertise_address") else None
        if len(labels) > MAX_LABELS or bad or (advertise is not None and _ADVERTISE.fullmatch(advertise) is None):
            self.stats.refuse("invalid_request")
            await self._abort(
                context, "Register", grpc.StatusCode.INVALID_ARGUMENT,
                f"labels: at most {MAX_LABELS}, keys and values of 1-{MAX_LABEL} printable characters"
                f"{f' (bad: {bad[0][:60]!r})' if bad else ''}; advertise_address: a host name or IP without spaces",
            )
        agent_version = request.agent_version
        if len(agent_version) > limits.MAX_TEXT or not agent_version.isprintable():
            self.stats.refuse("invalid_request")
            await self._abort(
                context, "Register", grpc.StatusCode.INVALID_ARGUMENT,
                f"agent_version: at most {limits.MAX_TEXT} printable characters",
            )
        discovery = request.discovery
        over = limits.problem(discovery)
        if over is not None:  # (a reading no real node sends: see control/limits.py)
            self.stats.refuse("oversized_discovery")
            log.warning("refused Register from node %r at %s: discovery over the limits: %s", name, peer, over)
            await self._abort(
                context, "Register", grpc.StatusCode.INVALID_ARGUMENT,
                f"discovery over the control plane's limits: {over}",
            )
        instance = request.agent_instance
        if len(instance) > 64 or not instance.isprintable() or any(c.isspace() for c in instance):
            self.stats.refuse("invalid_request")
            await self._abort(context, "Register", grpc.StatusCode.INVALID_ARGUMENT,
                              "agent_instance: at most 64 printable characters without spaces")
        await self._leader_only(context, "Register")
        taken = await self._on_main(self._taken, name, _digest(given), instance)
        if taken is not None:
            await self._refuse_taken(context, name, peer, taken)
        if self.on_register is not None:
            from .db import DatabaseError
            from .leader import NotLeader

            try:
                await self._on_main_async(self.on_register, name, node_id_for(name), discovery, request.agent_version)
            except (NotLeader, DatabaseError) as exc:
                await self._refuse_write(context, "Register", exc)
        registered = await self._on_main(
            self._register, name, peer, request.agent_version, theirs, discovery, labels, advertise, _digest(given),
            instance,
        )
        if isinstance(registered, _Taken):
            await self._refuse_taken(context, name, peer, registered)
        assert not isinstance(registered, _Taken)
        st, created, access = registered
        if self.api_tokens is not None:  # (the name is valid and registered: the token's nodes, for its revocation)
            self.api_tokens.joined(name, given)
        log.info(
            "node %s %sregistered from %s (agent %s, protocol %d.%d, %d GPU(s), source %s)",
            name, "" if created else "re-", peer, request.agent_version or "?", *theirs, len(discovery.gpus),
            discovery.source or "unknown",
        )
        c = self.control()
        if self.lease_ms is not None:
            await context.send_initial_metadata(((LEASE_METADATA, str(self.lease_ms)),))
        resp = pb.RegisterResponse(
            node_id=st.node_id,
            control_plane_version=__version__,
            protocol=pb.ProtocolVersion(major=PROTOCOL[0], minor=PROTOCOL[1]),
            heartbeat_interval_seconds=c.heartbeat_interval,
            heartbeat_grace_seconds=c.heartbeat_grace,
        )
        if access is not None:
            resp.mirror_url, resp.mirror_credential = access  # SECURITY: the credential is never logged
        return resp

    def _taken(self, name: str, token: bytes, instance: str) -> _Taken | None:
        """Why a registration of ``name`` is refused while the node is up (``None``: it is not): the node
        was registered with another join token, or by another agent (``agent_instance``)."""
        known = self.nodes.get(name)
        if known is None or not self.nodes.is_up(known):
            return None
        grace = self.control().heartbeat_grace
        if token and not _same(known.token, token):
            return _Taken(
                "the node is up, registered with another join token",
                f"node {name!r} is up, registered with another join token: another agent runs under this name "
                "(give this one another --name), or this one restarted with a new token: it is taken back once "
                f"the node has been silent for heartbeat_grace ({grace:g}s)",
            )
        if known.another_agent(instance):
            where = peer_host(known.peer)
            return _Taken(
                f"the node is up, run by another agent (at {where})",
                f"node {name!r} is up, run by another agent (at {where}): two agents were given one name; give "
                f"this one another --name, or stop the other (a node silent for heartbeat_grace, {grace:g}s, is "
                "taken over)",
            )
        return None

    async def _refuse_taken(self, context: Any, name: str, peer: str, taken: _Taken) -> None:
        self.stats.refuse("node_taken")
        log.warning("refused Register of node %r from %s: %s", name, peer, taken.why)
        await self._abort(context, "Register", grpc.StatusCode.ALREADY_EXISTS, taken.message)

    def _register(
        self, name: str, peer: str, agent_version: str, protocol: tuple[int, int], discovery: Any,
        labels: dict[str, str] | None = None, advertise: str | None = None, token: bytes = b"", instance: str = "",
    ) -> tuple[NodeState, bool, tuple[str, str] | None] | _Taken:
        """The registration, or why it is refused (:meth:`_taken`: the node is up, another agent's)."""
        taken = self._taken(name, token, instance)
        if taken is not None:
            return taken
        st, created = self.nodes.register(
            name, peer=peer, agent_version=agent_version, protocol=protocol, discovery=discovery, labels=labels,
            advertise=advertise,
        )
        st.token = token
        st.instance = instance
        self.stats.registrations += 1
        if not created:
            self.stats.reregistrations += 1
        access = self.mirror_access(name) if self.mirror_access is not None and runs_replicas(protocol) else None
        return st, created, access

    def _beat(self, hb: Any, peer: str, at: tuple[float, float] | None = None, token: bytes = b"",
              over: str | bool | None = True) -> NodeState | None:
        """A heartbeat, on the main loop: the node (its statuses reported), ``None`` when not registered here.

        ``over``: what :func:`limits.trim` said of the reading, when the control thread trimmed it
        already (``True``: not trimmed yet, done here).

        Raises:
            _NotYours: the node was registered with another join token.
        """
        known = self.nodes.by_id(hb.node_id)
        if known is not None and not known.heard:
            return None  # (known from the database only: it registers first, and is told so by NOT_FOUND)
        if known is not None and token and not _same(known.token, token):
            raise _NotYours(known.name)
        if known is not None and known.another_agent(hb.agent_instance):
            return None  # (the node is another agent's now: this one registers again, and is told so)
        discovery = hb.discovery
        if over is True:
            over = limits.trim(discovery)
        st = self.nodes.heartbeat(hb.node_id, hb.sequence, discovery, peer=peer, at=at)
        if st is None:
            return None
        if isinstance(over, str):
            self._told_trim(st.name, peer, over)
        self.stats.heartbeats += 1
        if hb.leaving != st.leaving:
            st.leaving = hb.leaving
            # (debug: the controller says what the leave does, once, with the replicas it drains)
            log.debug("node %s at %s %s", st.name, peer, "is leaving" if hb.leaving else "is no longer leaving")
            if self.controller is not None:
                self.controller.wake()
        if hb.HasField("applied_generation") and runs_replicas(st.protocol):
            if len(hb.replicas) > 16 or hb.ByteSize() > limits.SMALL * 4:  # (PERF: a real beat is checked by size)
                cut = limits.trim_replicas(hb.replicas)
                if cut is not None:
                    self._told_trim(st.name, peer, cut)
            self._report(st, hb)
        return st

    def _told_trim(self, name: str, peer: str, over: str) -> None:
        """Log a heartbeat reading trimmed to the limits: once a minute per node at most."""
        now = time.monotonic()
        told = self._trim_told
        if now - told.get(name, -_TRIM_LOG_EVERY_S) < _TRIM_LOG_EVERY_S:
            return
        if len(told) > 10_000:  # (bounded: nodes that went away)
            told.clear()
        told[name] = now
        log.warning("node %r at %s sent a reading over the limits (%s): trimmed to them (said once a minute)",
                    name, peer, over)

    def _unary_beat(self, hb: Any, peer: str, token: bytes = b"") -> pb.HeartbeatResponse | None:
        """A Heartbeat call, on the main loop: its answer (the desired set when due, requests); ``None``: unknown."""
        st = self._beat(hb, peer, None, token)
        if st is None:
            return None
        resp = pb.HeartbeatResponse(heartbeat_interval_seconds=self.control().heartbeat_interval, cordoned=st.cordoned)
        if hb.HasField("applied_generation") and runs_replicas(st.protocol):
            desired = self._desired(st.name, hb.applied_generation, None)
            if desired is not None:
                resp.desired.CopyFrom(desired[1])
        asks = self._asks.pop(st.name, None)
        if asks:
            _put_asks(resp, asks)
        return resp

    async def Heartbeat(self, request: pb.HeartbeatRequest, context: Any) -> pb.HeartbeatResponse:
        given = await self._authenticate(context, "Heartbeat", request.node_name)
        await self._leader_only(context, "Heartbeat")
        try:
            resp: pb.HeartbeatResponse | None = await self._on_main(
                self._unary_beat, request, context.peer(), _digest(given))
        except _NotYours as exc:
            await self._not_yours(context, "Heartbeat", str(exc))
            raise AssertionError("unreachable") from None
        if resp is None:
            await self._abort(
                context, "Heartbeat", grpc.StatusCode.NOT_FOUND,
                f"node {request.node_name!r} is not registered here (the control plane restarted?): register again",
            )
            raise AssertionError("unreachable")
        return resp

    async def StreamHeartbeats(self, request_iterator: Any, context: Any) -> None:  # type: ignore[override]
        """Heartbeats on one stream: each message recorded and answered as :meth:`Heartbeat` would.

        (grpc.aio takes a coroutine that reads and writes through ``context``; the generated stub only
        knows the iterator form, hence the override ignore.)

        PERF: the control plane's cost at scale. A unary call per beat costs grpc.aio about 0.55 ms of
        CPU, a message on an open stream read and answered about 0.3 ms, read alone about 0.2 ms: so
        the first message is answered and later ones only when the answer changes (a cordon, a new
        interval). ``context.read`` and ``write`` rather than the iterators, which add a task switch
        per message.
        """
        method = "StreamHeartbeats"
        msg = await context.read()
        if msg is grpc.aio.EOF:
            return
        given = await self._authenticate(context, method, msg.heartbeat.node_name)
        await self._leader_only(context, method)
        peer = context.peer()
        stats = self.stats
        stats.streams_open += 1
        task = asyncio.current_task()
        if task is not None:
            self.streams.add(task)
        try:
            await self._stream_beats(context, method, msg, given, peer)
        except asyncio.CancelledError:
            if task is None or task not in self._handed_over:
                raise
            # (said as what it is, for the agent's log: not a bare "cancelled by the server")
            await self._abort(context, method, grpc.StatusCode.UNAVAILABLE, NOT_LEADING)
        finally:
            stats.streams_open -= 1
            if task is not None:
                self.streams.discard(task)
                self._handed_over.discard(task)

    async def _stream_beats(self, context: Any, method: str, msg: Any, given: str, peer: str) -> None:
        stream = _Stream(context, asyncio.get_running_loop(), self.stats)
        stream.token = _digest(given)
        writer = asyncio.create_task(stream.write_loop(), name="llmgw heartbeat answers")
        hop, nodes = self.hop, self.nodes
        standby = self.standby
        try:
            while msg is not grpc.aio.EOF:
                hb = msg.heartbeat
                await self._check(context, method, hb.node_name, given)  # a reload may have removed the token
                if standby is not None and standby() is not None:
                    await self._leader_only(context, method)
                if hop is None:
                    self._stream_beat(stream, hb, peer, None)
                else:  # recorded with the time it arrived; answered (when the answer changes) from there
                    # (PERF: the reading is brought within the limits here, off the data path's loop: its
                    # size alone is a walk over the message, 5 us of a 1.5 KB one)
                    hop.submit(self._stream_beat, stream, hb, peer, (nodes.clock(), nodes.monotonic()),
                               limits.trim(hb.discovery))
                msg = await context.read()
        finally:
            writer.cancel()
            if hop is None:
                self._unlink(stream)
            else:
                hop.submit(self._unlink, stream)

    def _stream_beat(self, stream: _Stream, hb: Any, peer: str, at: tuple[float, float] | None,
                     over: str | bool | None = True) -> None:
        """A streamed heartbeat, on the main loop: recorded, and answered when the answer changed."""
        try:
            st = self._beat(hb, peer, at, stream.token, over)
        except _NotYours as exc:
            self.stats.refuse("not_this_node")
            log.warning("refused StreamHeartbeats for node %r from %s: it was registered with another join token",
                        str(exc), peer)
            stream.push((grpc.StatusCode.PERMISSION_DENIED, _not_yours_message(str(exc))))
            return
        if st is None:
            stream.push((grpc.StatusCode.NOT_FOUND,
                         f"node {hb.node_name!r} is not registered here (the control plane restarted?): register again"))
            return
        if stream.node != st.name:
            if stream.node is not None and self._links.get(stream.node) is stream:
                del self._links[stream.node]
            stream.node = st.name
        if not stream.closed:
            self._links[st.name] = stream
        if hb.HasField("applied_generation") and runs_replicas(st.protocol):
            stream.replicas = True
            stream.acked = hb.applied_generation
        self._answer_stream(stream, st)

    async def Deregister(self, request: pb.DeregisterRequest, context: Any) -> pb.DeregisterResponse:
        given = await self._authenticate(context, "Deregister", request.node_name)
        await self._leader_only(context, "Deregister")
        known = self.nodes.by_id(request.node_id)  # (a read of a dict from this thread: no change is made)
        if known is not None and known.heard and not _same(known.token, _digest(given)):
            await self._not_yours(context, "Deregister", known.name)  # (before anything is written)
        if known is not None and not known.heard:
            # (known from the database only: no agent has spoken for it in this term; llmgw ctl forget removes it)
            return pb.DeregisterResponse(removed=False)
        if known is not None and known.another_agent(request.agent_instance):
            log.info("Deregister of node %s from %s not applied: the node is another agent's (it took the name over)",
                     known.name, context.peer())
            return pb.DeregisterResponse(removed=False)
        if self.on_deregister is not None:
            from .db import DatabaseError
            from .leader import NotLeader

            if known is not None:
                try:
                    await self._on_main_async(self.on_deregister, known.name)
                except (NotLeader, DatabaseError) as exc:
                    await self._refuse_write(context, "Deregister", exc)
        try:
            removed = await self._on_main(self._deregister, request.node_id, request.reason, _digest(given),
                                          request.agent_instance)
        except _NotYours as exc:
            await self._not_yours(context, "Deregister", str(exc))
            raise AssertionError("unreachable") from None
        return pb.DeregisterResponse(removed=removed)

    async def _not_yours(self, context: Any, method: str, node: str) -> None:
        self.stats.refuse("not_this_node")
        log.warning("refused %s for node %r from %s: it was registered with another join token", method, node,
                    context.peer())
        await self._abort(context, method, grpc.StatusCode.PERMISSION_DENIED, _not_yours_message(node))

    def _deregister(self, node_id: str, reason: str, token: bytes = b"", instance: str = "") -> bool:
        known = self.nodes.by_id(node_id)
        if known is not None and known.heard and token and not _same(known.token, token):
            raise _NotYours(known.name)
        if known is not None and instance and (known.another_agent(instance) or not known.heard):
            return False  # (another agent's node since the check on the gRPC thread, or one not heard from)
        st = self.nodes.deregister(node_id)
        if st is None:
            return False
        reason = reason[:200]  # (the agent's words, logged: bounded, and quoted below)
        self.stats.deregistrations += 1
        if self.credentials is not None:
            self.credentials.revoke(st.name)
        if self.api_tokens is not None:
            self.api_tokens.forget(st.name)
        log.info("node %s deregistered (%s)", st.name, repr(reason) if reason else "no reason given")
        self._gone(st.name)
        return True


# a host name, an IPv4 address or a bracketless IPv6 one (replica URLs are made from it)
_ADVERTISE = re.compile(r"[A-Za-z0-9._:-]{1,253}")


def _not_yours_message(node: str) -> str:
    return (f"node {node!r} was registered with another join token: this agent does not speak for it (another agent "
            "runs under this name: give one of them another --name)")


def _no_database() -> HTTPError:
    return HTTPError("this control plane has no database yet (starting): retry", status=503,
                     type="service_unavailable_error", code="database_unavailable", retry_after=1)


def _no_blobs(node: str, digest: str) -> bool:
    return False


_STANDBY = ("this gateway is a standby control plane, which routes to no deployment's replicas (the leader and "
            "the routers that follow it do): retry, through another address if this persists")


def _never() -> bool:
    return False


class ControlPlane:
    """The control plane as a runtime component: gRPC listener, node map, cluster collector, nodes API,
    and the deployments (:attr:`deployments`, a :class:`~.deployments.DeploymentController`, made at start).

    Args:
        config: the running configuration (called per use: a reload changes tokens
            and intervals); its ``control`` section must be set.
        admin: the admin app: the cluster collector goes on its ``/metrics`` and the
            node and deployment routes on its management API. ``None``: neither (a bare control plane).
        router: the router deployment replicas join when ready (``None``: they are placed and
            launched but nobody routes to them here).
        resolver: a model string -> the mirror's model (default: the mirror at ``mirror.root``).
    """

    name = "control plane"

    def __init__(
        self, config: Callable[[], Config], admin: AdminApp | None = None, admin_addr: tuple[str, int] | None = None,
        router: Router | None = None, resolver: Resolver | None = None,
    ) -> None:
        self.config = config
        self.admin = admin
        self.admin_addr = admin_addr
        # Routers following this control plane (control/follow.py) see what the process's own router sees.
        self.follow_hub = FollowHub(router)
        self._router_tokens = _Tokens()
        self.router_service = RouterService(self.follow_hub, self._router_token_ok)
        self.router: Router | None = self.follow_hub
        self.route_share: Any = None
        """This process's router's shared routes (``llmgw.fleet.share.RouteShare``) while it routes by prefix."""
        self.resolver = resolver
        self.deployments: DeploymentController | None = None
        """The replicas' desired state (``ReplicaController``): the agent service asks it what each node runs."""
        self.stats = ControlStats()
        self.nodes = NodeMap(lambda: self._control().heartbeat_grace)
        self.service = AgentService(self.nodes, self._control, self.stats)
        # Mirror blobs for the agents (admin listener, /mirror/v1/blobs/...), each node with its own
        # credential; a node may fetch what the replicas placed on it need (mirror_server.allowed).
        self.credentials = NodeCredentials()
        self.service.credentials = self.credentials
        self.service.mirror_access = self.mirror_access
        self.mirror_server = BlobServer(self._mirror_root, self.credentials)
        # join tokens made through the management API (control/tokens.py), beside the config's
        self.api_tokens = JoinTokens()
        self.service.api_tokens = self.api_tokens
        self._tokens_task: asyncio.Task[None] | None = None
        self.server: Server | grpc.aio.Server | None = None
        self.thread: ControlThread | None = None
        """The thread gRPC runs on (:mod:`.thread`), while the control plane runs."""
        self.address: tuple[str, int] | None = None
        self.tls = False
        self._collector: Any = None
        self._leader_collector: Any = None
        self._follow_collector: FollowCollector | None = None
        self._share_collector: Any = None
        self._last: ControlConfig | None = None
        self._import_cordon_names: tuple[str, set[str]] | None = None
        """``control.state_file`` whose cordons go into the database just created (the upgrade from it)."""
        # with control.database (docs/ha.md); all of it on the main loop
        self.db: Any = None
        self.leadership: Any = None  # leader.Leadership
        self._cordons: Any = None  # db.CordonStore
        self._node_store: Any = None  # db.NodeStore
        self._node_records: dict[str, tuple[str, str | None, str | None, str]] = {}
        self._ready_epoch: int | None = None
        self._waiting_for: str | None = None
        """While a start waits for its database (``control.database_wait``): why, as the log says it."""
        self._in_router: frozenset[str] = frozenset()
        """Endpoints the last term's controller left in the router (the next one takes them over)."""
        self._stopping: list[asyncio.Future[None]] = []
        self._terms_ended = 0  # (counts the steps down: a later one cancels an earlier one's forgetting)
        """The epoch whose state is loaded: this process acts as leader only when it is the current one."""

    def _router_token_ok(self, given: str) -> bool | None:
        tokens = self._control().router_tokens
        return self._router_tokens.check(tokens, given) if tokens else None

    def _control(self) -> ControlConfig:
        c = self.config().control
        if c is not None:
            self._last = c
        if self._last is None:
            raise RuntimeError("the configuration has no control: section")
        return self._last

    async def _open_database(self, db: Database, wait: float) -> list[int]:
        """Open and migrate ``db``; the migrations applied. A shared database that cannot be reached
        yet (a PostgreSQL starting beside this process, a network not up) is tried again, backing
        off to 5 s, for up to ``wait`` seconds (``control.database_wait``); the first failure and
        then one every 30 s are logged. One that refuses raises at once.

        Raises:
            DatabaseError: it refused, or could not be reached within ``wait``.
        """
        from .db import DatabaseError, unreachable
        from .dburl import redact

        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        pause = 0.5
        logged_at: float | None = None
        while True:
            try:
                await db.open()
                migrated = await db.migrate()
            except DatabaseError as exc:
                now = loop.time()
                if not (db.shared and unreachable(exc)) or now + pause > deadline:
                    if logged_at is not None:
                        raise DatabaseError(f"{exc}; gave up after {wait:g}s (control.database_wait)") from exc
                    raise
                self._waiting_for = str(exc)
                if logged_at is None or now - logged_at >= 30.0:
                    log.warning("%s; trying again for up to %.0fs more (control.database_wait)", exc,
                                deadline - now)
                    logged_at = now
                await db.close()
                await asyncio.sleep(pause)
                pause = min(pause * 2, 5.0)
                continue
            if logged_at is not None:
                log.info("database %s reached", redact(db.url))
            return migrated

    async def start(self) -> None:
        """Bind ``control.listen`` and serve.

        Raises:
            ConfigError: no join token, unreadable TLS files, plaintext off loopback.
            OSError: the address cannot be bound.
        """
        c = self._control()
        if not c.join_tokens:
            raise ConfigError(
                "control.join_token",
                "the control plane needs a join token for agents (control.join_token_env: NAME, or join_token)",
            )
        creds: Any = server_credentials(c) if c.grpc_server == "grpcio" else server_tls(c)
        self.tls = creds is not None
        from .db import DatabaseError, open_database
        from .dburl import default_database, redact

        url = c.database if c.database is not None else default_database(c.state_file).url
        self.db = db = open_database(url)  # (raises ConfigError on a bad URL before anything binds)
        if self.admin is not None:
            # (/ready is 503 from here on until this process leads: while it waits for its database, a
            # deployed model is not even known to its data path)
            self.admin.attach_role(self.role)
        try:
            migrated = await self._open_database(db, c.database_wait)
        except BaseException as exc:
            await db.close()
            self.db = None
            if isinstance(exc, DatabaseError):
                raise StartupError(f"control.database: {exc}") from None
            raise
        finally:
            self._waiting_for = None
        log.info("control-plane state in %s", redact(db.url))
        try:
            await self._load_api_tokens()
        except DatabaseError as exc:  # (a standby reads them again soon; a leader before it acts)
            log.warning("could not read the join tokens from the database yet: %s", exc)
        if db.shared:
            from .db import JoinTokenStore, token_digests, tokens_differ

            try:
                why = tokens_differ(await JoinTokenStore(db).load(), token_digests(c.join_tokens))
            except DatabaseError:
                why = None  # (the election reports the database)
            if why is not None:
                log.warning("%s", why)
        if c.state_file is not None:
            from .state import StateFile

            try:  # (read on every start: a file that cannot be read stops it with its name, as it always did)
                names = StateFile(c.state_file).load()
            except ConfigError:
                await db.close()
                self.db = None
                raise
            if 2 in migrated:  # (2: the cordons' table, new in this database: the upgrade from the file)
                self._import_cordon_names = (c.state_file, names)
        # a standby from the first call on: until it has won the lease (and loaded its state)
        # this process refuses agents, so none registers with it before the election
        self.service.standby = self._standby
        if db.shared:
            self.service.lease_ms = int(c.lease * 1000)
        host, port = c.listen
        addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        thread = ControlThread()
        thread.start()
        assert thread.loop is not None
        self.service.hop = hop = MainHop(asyncio.get_running_loop(), thread.loop)
        self.router_service.to_main = hop.submit
        attach_follow(thread, self.follow_hub, self.router_service)
        registry = getattr(self.follow_hub.inner, "registry", None)
        if registry is not None and self.config().routing.prefix.share:
            # this process's router shares conversation routes with the routers that follow it
            from ..fleet.share import RouteShare

            service = self.router_service
            self.route_share = RouteShare(registry, lambda routes: thread.call(service.share_local, routes))
            service.local = self.route_share
        self.router_service.standby = self._standby  # (routers are refused by a standby, as agents are)
        self.follow_hub.settled = _never  # (until a term's controller knows which replicas are ready: _lead_deployments)
        self.follow_hub.start()
        try:
            server, bound = await thread.run(self._serve(addr, creds))
        except BaseException:
            thread.stop()
            self.service.hop = None
            await db.close()
            self.db = None
            raise
        self.thread = thread
        self.server = server
        self.address = (host, bound)
        if isinstance(server, Server):  # (grpc.aio's completion queue is polled by threads of its own)
            thread.pace(lambda: len(server.connections) >= PACE_FROM
                        and time.monotonic() - server.accepted_at > PACE_AFTER_ACCEPT_S)
        if self.admin is not None:
            from .collector import ClusterCollector
            from .ha import LeaderCollector

            # (its deployments: the leader's, _lead)
            self._collector = ClusterCollector(self.nodes, self.stats, leading=self.leading)
            self.admin.register_text_collector(self._collector)
            self._leader_collector = LeaderCollector(self)
            self.admin.register_collector(self._leader_collector)
            self._follow_collector = FollowCollector(self.follow_hub.stats, leading=self.leading)
            self.admin.register_collector(self._follow_collector)
            if self.route_share is not None:
                from ..fleet.share import ShareCollector

                self._share_collector = ShareCollector(self.route_share.stats)
                self.admin.register_collector(self._share_collector)
            self.admin.attach_nodes(self)
            self.admin.attach_role(self.role)
            self.admin.attach_mirror(self.mirror_server)
            self.admin.attach_tokens(self)
        await self._start_database(c, bound)
        log.info(
            "control plane listening on %s://%s:%d (heartbeat every %gs, grace %gs%s)",
            "grpcs" if self.tls else "grpc", host, bound, c.heartbeat_interval, c.heartbeat_grace,
            ", mutual TLS" if c.tls_client_ca else "",
        )

    async def _serve(self, addr: str, creds: Any) -> tuple[Any, int]:
        """On the control loop: the gRPC server (llmgw's own, or grpc.aio's), bound and started."""
        c = self._control()
        if c.grpc_server == "grpcio":
            server: Any = grpc.aio.server(options=list(SERVER_OPTIONS))
        else:
            opts = dict(SERVER_OPTIONS)
            server = Server(Limits(
                max_receive_message_length=opts["grpc.max_receive_message_length"],
                keepalive_time=opts["grpc.keepalive_time_ms"] / 1000,
                keepalive_timeout=opts["grpc.keepalive_timeout_ms"] / 1000,
                min_ping_interval_without_data=opts["grpc.http2.min_ping_interval_without_data_ms"] / 1000,
                max_ping_strikes=opts["grpc.http2.max_ping_strikes"],
            ))
            stats = self.stats
            server.on_bad_request = lambda method, code: stats.error(method.rpartition("/")[2], code)
        agent_pb2_grpc.add_AgentServiceServicer_to_server(self.service, server)
        router_pb2_grpc.add_RouterServiceServicer_to_server(self.router_service, server)
        if isinstance(server, Server):
            host, _, port = addr.rpartition(":")
            try:
                bound = await server.bind(host.strip("[]"), int(port), creds)
            except OSError as exc:
                raise StartupError(
                    f"control.listen: cannot bind {addr} ({exc.strerror or exc}): choose another control.listen"
                ) from None
        else:
            try:
                bound = server.add_secure_port(addr, creds) if creds is not None else server.add_insecure_port(addr)
            except RuntimeError as exc:
                raise StartupError(f"control.listen: cannot bind {addr} ({exc}): choose another control.listen") from None
            if not bound:
                raise StartupError(f"control.listen: cannot bind {addr} (in use?): choose another control.listen")
        await server.start()
        return server, bound

    async def stop(self) -> None:
        ctl = self.deployments
        if ctl is not None:  # what it decided last goes into the database before the lease is handed back
            try:
                await asyncio.wait_for(ctl.committed(), 5.0)
            except Exception as exc:
                log.warning("stopping with deployment changes not saved (%s: %s)", type(exc).__name__, exc)
        if self.admin is not None:
            self.admin.attach_nodes(None)
            self.admin.attach_role(None)
            self.admin.attach_deployments(None)
            self.admin.attach_mirror(None)
            self.admin.attach_tokens(None)
            for attr in ("_collector", "_leader_collector", "_follow_collector", "_share_collector"):
                col = getattr(self, attr)
                if col is not None:
                    self.admin.unregister_collector(col)
                    setattr(self, attr, None)
        task, self._tokens_task = self._tokens_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.leadership is not None:
            await self.leadership.stop(release=True)
        server, thread = self.server, self.thread
        self.server = self.thread = None
        if server is not None and thread is not None:
            try:
                await thread.run(server.stop(1.0))
            finally:
                thread.stop()
                self.service.hop = None
        self.follow_hub.close()
        if self.route_share is not None:
            self.route_share.close()
            self.route_share = None
        self.mirror_server.close()
        await self.service.close()
        if self.deployments is not None:
            ctl = self.deployments
            self._attach_deployments(None)
            await ctl.stop()
        while self._stopping:
            await self._stopping.pop()
        if self.db is not None:
            await self.db.close()
            self.db = None

    # -- with a database: the election and the fenced state (docs/ha.md) --

    @staticmethod
    def _advertised(advertise: str | None, bound_host: str, port: int) -> str:
        """``HOST:PORT`` others reach a listener at: ``control.advertise``, else its own host (FQDN for a wildcard)."""
        host = advertise or bound_host
        if host in ("0.0.0.0", "::", "", "[::]"):
            host = socket.getfqdn()
        return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"

    async def _start_database(self, c: ControlConfig, grpc_port: int) -> None:
        from .db import CordonStore, NodeStore
        from .leader import Leadership

        db = self.db
        self._cordons = CordonStore(db)
        self._node_store = NodeStore(db)
        me = self._advertised(c.advertise, c.listen[0], grpc_port)
        admin = None
        if self.admin_addr is not None:
            admin = "http://" + self._advertised(c.advertise, self.admin_addr[0], self.admin_addr[1])
        self.leadership = Leadership(
            db, holder=f"{socket.gethostname()}/{me}", lease=c.lease, grpc_address=me, admin_address=admin,
            on_elected=self._elected, on_deposed=self._deposed,
        )
        self.service.on_register = self._record_node
        self.service.on_deregister = self._forget_node
        # the first campaign before start() returns: alone (SQLite, or the first of several), this
        # process leads before any agent calls; a standby knows whom to name
        await self.leadership.first()
        self._tokens_task = asyncio.create_task(self._tokens_loop(c.lease / 3), name="llmgw join tokens")
        log.info("campaigning for the control-plane lease (%gs) as %s%s", c.lease, me,
                 "" if db.shared else " (SQLite: one process, it leads)")

    async def _elected(self, epoch: int) -> None:
        assert self._cordons is not None and self._node_store is not None
        if self._import_cordon_names is not None:
            await self._import_cordons(*self._import_cordon_names)
        cordons = await self._cordons.load()
        records = await self._node_store.load()
        if self.leadership is None or self.leadership.epoch != epoch:
            return
        self.nodes.clear()
        self.nodes.restore_cordons(cordons)
        self._node_records = records
        for name, (node_id, hostname, agent_version, gpus) in records.items():
            # listed (unhealthy, never heard from) until its agent registers: a node whose agent died
            # with the last term does not vanish, and can be forgotten
            try:
                uuids = [u for u in json.loads(gpus) if isinstance(u, str)]
            except (ValueError, TypeError):
                uuids = []
            self.nodes.remember(name, node_id, hostname, agent_version, uuids)
        await self._record_tokens()
        await self._load_api_tokens()  # (revocations made under the last leader hold from this term's first call)
        await self._lead_deployments(epoch)
        if self.leadership is None or self.leadership.epoch != epoch:
            return
        self._ready_epoch = epoch
        ctl = self.deployments
        log.info("leading with %d cordon(s), %d known node(s), %d deployment(s) and %d replica(s) from the database",
                 len(cordons), len(records), len(ctl.deployments) if ctl else 0, len(ctl.replicas) if ctl else 0)

    async def _record_tokens(self) -> None:
        """The join tokens' digests into the database when they differ from what it holds (a rare write)."""
        from .db import JoinTokenStore, token_digests, tokens_differ

        lead, db = self.leadership, self.db
        assert lead is not None and db is not None
        store = JoinTokenStore(db)
        have, mine = await store.load(), token_digests(self._control().join_tokens)
        if have == mine:
            return
        why = tokens_differ(have, mine)
        if why is not None:
            log.warning("%s; the database now holds this leader's", why)
        async with lead.transaction() as (tx, epoch):
            await store.replace(tx, mine, have, epoch)

    # -- join tokens made through the management API (control/tokens.py) --

    async def _load_api_tokens(self) -> None:
        from .db import ApiTokenStore
        from .tokens import JoinToken

        assert self.db is not None
        since = self.api_tokens.version  # (a read begun before a revoke or create here never undoes it: merge)
        rows = await ApiTokenStore(self.db).load()
        self.api_tokens.merge([JoinToken.from_row(r) for r in rows], since)
        self._cut_mirror()

    def _cut_mirror(self) -> None:
        """Revoke the mirror credentials of the nodes whose API token is revoked or expired (however this
        process learnt it: its own revoke, a read of one another leader made, the clock passing the expiry)."""
        creds = self.credentials
        for node in self.api_tokens.dead_nodes(time.time()):
            if node in creds:
                creds.revoke(node)
                log.info("node %s: mirror credential revoked (its join token is revoked or expired)", node)

    async def _tokens_loop(self, every: float) -> None:
        """Standbys read the tokens again (revocations reach them within ``every``); the leader writes
        when they were last used (one transaction for all, only for those used since)."""
        from .db import ApiTokenStore, DatabaseError
        from .leader import NotLeader

        every = max(0.2, every)
        failed: str | None = None
        while True:
            await asyncio.sleep(every)
            try:
                if not self.leading():
                    if self.db is not None and self.db.shared:
                        await self._load_api_tokens()
                        await self._hold_deployed_models()
                elif self.leadership is not None and self.db is not None:
                    used = self.api_tokens.unflushed()
                    if used:
                        async with self.leadership.transaction() as (tx, _epoch):
                            await ApiTokenStore(self.db).touch(tx, used)
                        self.api_tokens.flushed(used)
                self._cut_mirror()  # (a token that expired since: its nodes' blob access goes within every)
                failed = None
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # (a bad row, a database error: said once per distinct failure, kept going)
                msg = f"{type(exc).__name__}: {exc}"
                if isinstance(exc, NotLeader):
                    # (the term ended between the check and the write: the next pass reads as a standby;
                    # the uses not recorded are kept for the next term this process leads)
                    if msg != failed:
                        log.info("join tokens: their last uses were not recorded: this control plane stopped leading")
                    failed = msg
                    continue
                if msg != failed:
                    if isinstance(exc, DatabaseError | asyncio.TimeoutError):
                        log.warning("join tokens: %s (retrying every %.1fs)", msg, every)
                    else:
                        log.error("join tokens: %s (retrying every %.1fs)", msg, every, exc_info=True)
                    failed = msg

    async def _hold_deployed_models(self) -> None:
        """A standby's data path answers the deployments' models 503 ``model_unavailable`` (saying why),
        not 404 as models nobody serves: a client that reached the wrong process is told to retry."""
        from .db import DesiredStore

        assert self.db is not None
        models = await DesiredStore.served_models(self.db)
        models |= {d.model_name for d in self.config().deployments}
        router = self.router
        if router is None or self.leading() or self.deployments is not None:
            return  # (leading since the read began: the term's controller holds what it serves)
        router.hold(HeldModels(models, reason=_STANDBY), frozenset())

    def _write_error(self, exc: Exception, what: str, topic: str = "join tokens") -> HTTPError:
        """The admin API's 503 for a write the database refused (``exc``: not the leader, or it failed)."""
        from .db import DatabaseError
        from .leader import NotLeader

        if isinstance(exc, NotLeader):
            li = exc.leader
            return HTTPError(
                f"{exc}; {what}" + (f": the leader is at {li.admin_address}" if li and li.admin_address else ""),
                status=503, type="service_unavailable_error", code="not_leader", retry_after=1,
                headers=((b"llmgw-leader", li.admin_address.encode()),) if li and li.admin_address else None,
            )
        log.error("%s: the database failed: %s", topic, exc)
        # (a DatabaseError's text names the database with its password redacted, as the election's warning does)
        why = str(exc) if isinstance(exc, DatabaseError) else type(exc).__name__
        return HTTPError(f"the control plane's database failed ({why}); {what}: retry", status=503,
                         type="service_unavailable_error", code="database_unavailable", retry_after=1)

    async def create_token(self, name: str | None, expires_in: float | None) -> dict[str, Any]:
        """A new join token: its view with ``token``, the secret (the only time it is shown).

        Raises:
            HTTPError: 503 (not the leader, the database failed: nothing was made).
        """
        from .db import ApiTokenStore, DatabaseError
        from .leader import NotLeader
        from .tokens import JoinToken, new_token

        lead, db = self.leadership, self.db
        if lead is None or db is None:
            raise _no_database()
        tid, secret = new_token()
        while self.api_tokens.get(tid) is not None:  # (8 hex digits: a repeat is rare; bounded by the ids free)
            tid, secret = new_token()
        now = time.time()
        tok = JoinToken(tid, name, hashlib.sha256(secret.encode()).digest(), now,
                        None if expires_in is None else now + expires_in)
        try:
            async with lead.transaction() as (tx, epoch):
                await ApiTokenStore(db).insert(tx, (tid, name, tok.digest.hex(), now, tok.expires_at), epoch)
        except (NotLeader, DatabaseError, asyncio.TimeoutError) as exc:
            raise self._write_error(exc, "no token was made") from None
        self.api_tokens.put(tok)
        log.info("join token %s%s made%s", tid, f" ({name})" if name else "",
                 f", expires in {expires_in:g}s" if expires_in is not None else "")
        return {**tok.view(now), "token": secret}  # SECURITY: the one answer that carries it

    async def list_tokens(self) -> dict[str, Any]:
        """The API-made tokens (read from the database: a standby answers too) and how many the config has."""
        from .db import DatabaseError

        if self.db is None:
            raise _no_database()
        try:
            await self._load_api_tokens()
        except DatabaseError as exc:
            log.warning("join tokens: listing from memory, the database failed: %s", exc)
        now = time.time()
        return {"tokens": [t.view(now, self.api_tokens.last_used(t.id)) for t in self.api_tokens.all()],
                "config_tokens": len(self._control().join_tokens)}

    async def revoke_token(self, token_id: str) -> dict[str, Any] | None:
        """Revoke it on every control plane (agents presenting it are refused from their next call);
        its view with ``changed``; ``None``: no such token.

        Raises:
            HTTPError: 503 (not the leader, the database failed: nothing was revoked).
        """
        from .db import ApiTokenStore, DatabaseError
        from .leader import NotLeader

        lead, db = self.leadership, self.db
        if lead is None or db is None:
            raise _no_database()
        try:
            await self._load_api_tokens()
        except DatabaseError as exc:
            raise self._write_error(exc, "nothing was revoked") from None
        tok = self.api_tokens.get(token_id)
        if tok is None:
            return None
        now = time.time()
        changed = False
        if tok.revoked_at is None:
            try:
                async with lead.transaction() as (tx, epoch):
                    changed = await ApiTokenStore(db).revoke(tx, token_id, now, epoch) == 1
            except (NotLeader, DatabaseError, asyncio.TimeoutError) as exc:
                raise self._write_error(exc, "nothing was revoked") from None
        nodes = self.api_tokens.revoked(token_id, now)
        self._cut_mirror()  # (changed or not: a revoke whose answer was lost, or made by the last leader)
        if changed:
            log.info("join token %s revoked (%d node(s) had joined with it: refused at their next call)",
                     token_id, len(nodes))
        tok = self.api_tokens.get(token_id) or tok
        return {**tok.view(now, self.api_tokens.last_used(token_id)), "changed": changed, "nodes": sorted(nodes)}

    async def _lead_deployments(self, epoch: int) -> None:
        """A new term's controller, made from what the database holds (the last term's is gone)."""
        from .db import DesiredStore
        from .deployments import DeploymentController
        from .resolve import mirror_resolver, mirror_verifier

        lead = self.leadership
        assert lead is not None and self.db is not None
        store = DesiredStore(self.db, functools.partial(lead.transaction, epoch),
                             on_failed=functools.partial(self._write_failed, epoch))
        await store.load()
        if lead.epoch != epoch:
            return
        # (on the main loop, beside the node map it places on: the agent service reaches it there)
        resolver = self.resolver
        verifier = None
        if resolver is None:
            # the mirror root as the config says now (a reload that sets or moves mirror.root
            # takes effect at the next placement, as it does for the blobs served to agents)
            made: dict[str | None, Any] = {}
            config = self.config

            def resolver(model: str) -> Any:
                root = config().mirror_root
                r = made.get(root)
                if r is None:
                    made.clear()
                    r = made[root] = mirror_resolver(root)
                return r(model)

            def verifier(digests: frozenset[str], stop: threading.Event) -> Mapping[str, str]:  # (in a thread)
                return mirror_verifier(config().mirror_root)(digests, stop)

        ctl = DeploymentController(
            nodes=self.nodes, store=store, router=self.router, config=self.config,
            resolver=resolver, in_router=self._in_router, verifier=verifier,
        )
        self._in_router = frozenset()
        await ctl.start()
        self._attach_deployments(ctl)
        loop = asyncio.get_running_loop()
        settle_by = loop.time() + self._control().heartbeat_grace  # (a node not reporting by then is not coming soon)
        self.follow_hub.settled = lambda: loop.time() >= settle_by or all(
            r.status is not None for r in ctl.replicas.values())

    def _attach_deployments(self, ctl: DeploymentController | None) -> None:
        """Desired sets to the agents, statuses back, blobs to fetch, the API and the families: ``ctl``'s."""
        from ..mirror.serve import placed_blobs

        self.deployments = ctl
        self.service.attach(ctl)
        self.mirror_server.allowed = placed_blobs(ctl) if ctl is not None else _no_blobs  # what a node's replicas need
        if self.admin is not None:
            self.admin.attach_deployments(ctl)
        if self._collector is not None:
            self._collector.deployments = ctl

    def _write_failed(self, epoch: int, exc: BaseException) -> None:
        """A fenced write of ``epoch`` failed: stop leading (the next term starts from the database)."""
        lead = self.leadership
        if lead is not None and lead.epoch == epoch:
            lead.resign(f"a write to the database failed ({type(exc).__name__})")

    async def _import_cordons(self, path: str, names: set[str]) -> None:
        """The upgrade from ``control.state_file``: its cordons go into the database created now (once)."""
        lead, store = self.leadership, self._cordons
        assert lead is not None and store is not None
        async with lead.transaction() as (tx, epoch):
            for name in sorted(names):
                await store.set(tx, name, True, epoch)
        self._import_cordon_names = None
        log.info("imported %d cordon(s) from %s into the database (the file is not used any more)", len(names), path)

    def _deposed(self) -> None:
        self._ready_epoch = None
        ctl = self.deployments
        if ctl is not None:  # the term's controller ends; its replicas keep running (and serving) meanwhile
            self._in_router = ctl.in_router()
            names = frozenset(d.cfg.model_name for d in ctl.deployments.values())
            self._attach_deployments(None)
            self._stopping = [f for f in self._stopping if not f.done()]
            stopping = asyncio.ensure_future(ctl.stop())
            stopping.add_done_callback(lambda _f: self._hold_after_term(names))
            self._stopping.append(stopping)
            if self._in_router:
                # ... for a lease: re-elected by then, the next term takes them over; else another
                # process leads, and this one's data path drops them, as a standby that never led has
                # none (a copy frozen at its last term would route to replicas scaled away since)
                self._terms_ended += 1
                asyncio.get_running_loop().call_later(self._control().lease, self._forget_last_term,
                                                      self._terms_ended)
        # the agents' streams end (on the control loop, where they run): they go to the new leader
        self.follow_hub.settled = _never
        if self.thread is not None:
            self.thread.call(self.service.cancel_streams)
            self.thread.call(self.router_service.end_streams)  # (routers go to the new leader too)
        else:
            self.service.cancel_streams()
            self.router_service.end_streams()
        self.nodes.clear()

    def _hold_after_term(self, names: frozenset[str]) -> None:
        """The term's controller stopped, this process not leading again: what a client asking for its models
        is told from now on (the term's words said "scaled to 0, or its replicas are starting" once its
        replicas left this router, all through a database outage, whose standbys' holds are not read)."""
        router = self.router
        if router is not None and names and self.deployments is None:
            router.hold(HeldModels(names, reason=_STANDBY), frozenset())

    def _forget_last_term(self, term: int) -> None:
        """A lease after stepping down, not leading again: the last term's replicas out of this router."""
        if term != self._terms_ended or self.deployments is not None or not self._in_router:
            return  # (re-elected meanwhile: the new term took them over; or stepped down again since)
        gone, self._in_router = self._in_router, frozenset()
        router = self.router
        if router is not None:
            for eid in sorted(gone):
                with contextlib.suppress(KeyError):
                    router.remove(eid)
        log.info("no longer leading: this process's data path stops routing to the %d replica(s) of its last "
                 "term (the leader's routers have them)", len(gone))

    def leading(self) -> bool:
        """Whether this process acts as the control plane now (always, without a database)."""
        if self.db is None and self.leadership is None:
            return True
        lead = self.leadership
        return lead is not None and lead.acting() and self._ready_epoch == lead.epoch

    def _standby(self) -> str | None:
        if self.leading():
            return None
        li = self.leadership.other_leader() if self.leadership is not None else None
        return (li.grpc_address or "") if li is not None else ""

    def role(self) -> dict[str, Any] | None:
        """``None`` on the leader; a standby's ``/ready`` body (503) naming the leader."""
        if self.leading():
            return None
        if self._waiting_for is not None:  # (the database named, its password never: DatabaseError's text)
            return {"ready": False, "reason": "waiting_for_database", "role": "starting",
                    "database": self._waiting_for}
        lead = self.leadership
        if lead is None:  # (the start goes on: the database opened, the election not begun)
            return {"ready": False, "reason": "starting", "role": "starting"}
        li = lead.other_leader() if lead is not None else None
        body: dict[str, Any] = {"ready": False, "reason": "standby", "role": "standby"}
        if li is not None:
            body["leader"] = {"grpc": li.grpc_address, "admin": li.admin_address, "epoch": li.epoch}
        elif lead.database_error is not None:  # (why no leader is known: its password never in it)
            body["database_error"] = lead.database_error
        return body

    def not_leader(self) -> str | None:
        """The management API's answer on a standby (``None`` on the leader): who leads."""
        if self.leading():
            return None
        lead = self.leadership
        li = lead.other_leader() if lead is not None else None
        if li is None:
            why = lead.database_error if lead is not None else None
            if why is not None:  # (as the election's warning logs it: the database's password never in it)
                return (f"no control plane leads: the control-plane database does not answer ({why}); "
                        "retry once it does")
            return ("this control plane is a standby and does not know the leader yet (it has not read the lease "
                    "since it started or stopped leading): retry in a few seconds")
        return f"this control plane is a standby; the leader is at {li.admin_address or li.grpc_address} (epoch {li.epoch})"

    def leader_admin(self) -> str | None:
        lead = self.leadership
        li = lead.other_leader() if lead is not None else None
        return li.admin_address if li is not None else None

    @staticmethod
    def _node_record(discovery: Any, agent_version: str, node_id: str) -> tuple[str, str | None, str | None, str]:
        gpus = json.dumps([g.uuid for g in discovery.gpus])
        return (node_id, discovery.facts.hostname or None, agent_version or None, gpus)

    async def _record_node(self, name: str, node_id: str, discovery: Any, agent_version: str) -> None:
        """Register's write: the node's identity, only when it changed (never per heartbeat)."""
        lead, store = self.leadership, self._node_store
        assert lead is not None and store is not None
        rec = self._node_record(discovery, agent_version, node_id)
        if self._node_records.get(name) == rec and self.leading():
            return
        async with lead.transaction() as (tx, epoch):
            await store.put(tx, name, rec, epoch)
        self._node_records[name] = rec

    async def _forget_node(self, name: str) -> None:
        lead, store = self.leadership, self._node_store
        assert lead is not None and store is not None
        async with lead.transaction() as (tx, _epoch):
            await store.delete(tx, name)
        self._node_records.pop(name, None)

    def _mirror_root(self) -> str:
        from ..mirror.store import default_root

        return self.config().mirror_root or str(default_root())

    def mirror_url(self) -> str | None:
        """Where agents fetch blobs: the admin listener, ``http://HOST:PORT`` (``None`` without one).

        A wildcard admin address (``0.0.0.0``, ``::``) is named by the ``control.listen`` host
        when that is a specific one (the address agents already reach), else by this host's name.
        """
        listener = self.admin.listeners.admin if self.admin is not None else None
        if listener is None or not listener.sockets:
            return None
        port = listener.sockets[0].getsockname()[1]
        host = self.config().admin[0]
        if host in ("", "0.0.0.0", "::"):
            listen = self._control().listen[0]
            host = listen if listen not in ("", "0.0.0.0", "::") else socket.getfqdn()
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def mirror_access(self, node: str) -> tuple[str, str] | None:
        """``(mirror URL, a new credential for node)`` for its RegisterResponse; ``None``: no mirror served.

        Issuing revokes the credential the node had: each registration gets its own.
        SECURITY: the caller sends it to that node alone and never logs it.
        """
        url = self.mirror_url()
        if url is None:
            return None
        return url, self.credentials.issue(node)

    # -- the nodes API (admin.ports.NodeControl) --

    async def replica_logs(self, replica_id: str, lines: int = 100) -> str:
        """The end of a replica's log, from its node (:meth:`AgentService.replica_logs`)."""
        ctl = self.deployments
        placed = ctl.replicas.get(replica_id) if ctl is not None else None
        if placed is not None and self.service.node_of_replica(replica_id) is None:
            # (placed there, but its node has not reported it: silent, or not back since a restart)
            st = self.nodes.get(placed.node)
            if st is None or not st.heard or not self.nodes.is_up(st):
                why = ("is not connected" if st is None or not st.heard
                       else f"has been silent for {st.age(self.nodes.monotonic()):.0f}s")
                raise ReplicaLogsError(f"replica {replica_id!r} is placed on node {placed.node}, which {why}: its "
                                       "log is on that node, for when its agent is back", 502, "node_unavailable")
        return await self.service.replica_logs(replica_id, lines)

    async def engine_check(self, node: str, engine: str, *, model: str | None = None, static_only: bool = False,
                           timeout: float = 600.0) -> list[dict[str, Any]]:
        """``llmgw ctl engine-check --node`` (:meth:`AgentService.engine_check`)."""
        return await self.service.engine_check(node, engine, model=model, static_only=static_only, timeout=timeout)

    def node_of_replica(self, replica_id: str) -> str | None:
        return self.service.node_of_replica(replica_id)


    def list_nodes(self) -> list[dict[str, Any]]:
        from .views import node_view

        return [node_view(self.nodes, st, gpus=False) for st in self.nodes]

    def list_gpus(self) -> list[dict[str, Any]]:
        from .views import gpu_rows

        return gpu_rows(self.nodes)

    def node(self, name: str) -> dict[str, Any] | None:
        from .views import node_view

        st = self.nodes.get(name)
        return node_view(self.nodes, st, gpus=True) if st is not None else None

    async def forget_node(self, name: str) -> dict[str, Any] | None:
        """Remove a node nothing hears from (``unhealthy``: its agent was killed, its machine is
        gone, its token revoked), as its agent's deregistration would: its identity, its record in
        the database, its replicas' places. The node's view as it was; ``None``: no such node.

        Raises:
            HTTPError: 409 while the node is up (its agent would only register it again: stop the
                agent first); 503 (not the leader, the database failed).
        """
        from .views import node_view

        st = self.nodes.get(name)
        if st is None:
            return None
        if self.nodes.is_up(st):
            raise HTTPError(
                f"node {name!r} is up: stop its agent first (SIGTERM deregisters it), or it registers again",
                status=409, type="invalid_request_error", code="node_up",
            )
        view = node_view(self.nodes, st, gpus=False)
        if self._node_store is not None and self.leadership is not None:
            from .db import DatabaseError
            from .leader import NotLeader

            try:
                await self._forget_node(name)
            except (NotLeader, DatabaseError) as exc:
                raise self._write_error(exc, f"node {name} was not forgotten", topic=f"forgetting node {name}") from None
        if self.nodes.get(name) is st:  # (not registered again meanwhile)
            self.service._deregister(st.node_id, "forgotten by the operator (llmgw ctl forget)")
        return view

    async def set_cordoned(self, name: str, cordoned: bool) -> dict[str, Any] | None:
        """Cordon/uncordon; the node's view with ``changed``, ``None`` when there is no such node.

        With a database the change is written first, fenced by the leader's epoch: a deposed
        leader changes nothing (503 ``not_leader``).

        Raises:
            HTTPError: 503 (not the leader any more, the database or the state file failed).
        """
        from .views import node_view

        st = self.nodes.get(name)
        if st is None:
            # a node away (deregistered for maintenance, or forgotten): its cordon is kept by
            # name, so it can be cleared meanwhile (and asked for again: already cordoned)
            if name not in self.nodes.cordoned:
                return None
            if not cordoned:
                await self._write_cordon(name, False)
                self.nodes.cordoned.discard(name)
                log.info("node %s (not registered now) uncordoned", name)
            return {"name": name, "state": "absent", "cordoned": cordoned, "changed": not cordoned}
        if st.cordoned != cordoned:
            await self._write_cordon(name, cordoned)
        try:
            st, changed = self.nodes.set_cordoned(name, cordoned)
        except KeyError:
            return None
        if changed:
            log.info("node %s %s", name, "cordoned" if cordoned else "uncordoned")
        view = node_view(self.nodes, st, gpus=False)
        view["changed"] = changed
        return view
    async def _write_cordon(self, name: str, cordoned: bool) -> None:
        from .db import DatabaseError
        from .leader import NotLeader

        lead, store = self.leadership, self._cordons
        assert lead is not None and store is not None
        try:
            async with lead.transaction() as (tx, epoch):
                await store.set(tx, name, cordoned, epoch)
        except NotLeader as exc:
            li = exc.leader
            raise HTTPError(
                f"{exc}; nothing was changed" + (f": the leader is at {li.admin_address}" if li and li.admin_address
                                                 else ""),
                status=503, type="service_unavailable_error", code="not_leader",
                headers=((b"llmgw-leader", li.admin_address.encode()),) if li and li.admin_address else None,
            ) from None
        except (DatabaseError, asyncio.TimeoutError) as exc:
            log.error("could not write the cordon of %s to the database: %s", name, exc)
            raise HTTPError(
                f"the control plane's database failed ({type(exc).__name__}); node {name} was left "
                f"{'uncordoned' if cordoned else 'cordoned'}: retry", status=503,
                type="service_unavailable_error", code="database_unavailable",
            ) from None
