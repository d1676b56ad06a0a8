"""The agent <-> control plane wire: protocol version, gRPC channel options, and
:mod:`llmgw.agent.model` values to and from their protobuf messages
(``proto/llmgw/agent/v1/agent.proto``).

Presence is kept both ways: a ``None`` in the model is an unset ``optional``
field on the wire and comes back as ``None``, never as 0. A value the wire cannot
carry (a negative count for an unsigned field) is left absent and noted in the
GPU's or node's errors rather than sent as something else.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from .._proto.agent.v1 import agent_pb2 as pb
from ..launch.spec import MAX_READY_TIMEOUT, ModelBlob, ReplicaSpec, ReplicaStatus
from .model import GPU, Discovery, InfinibandPort, NodeFacts

__all__ = [
    "CLIENT_OPTIONS",
    "NODE_NAME",
    "PROTOCOL",
    "SERVER_OPTIONS",
    "TOKEN_METADATA",
    "compatible",
    "discovery_from_proto",
    "discovery_to_proto",
    "drains_leaving",
    "node_id_for",
    "pb",
    "runs_replicas",
    "spec_from_proto",
    "spec_to_proto",
    "status_from_proto",
    "status_to_proto",
    "streams_heartbeats",
]

# The wire protocol: a different major is refused at registration (FAILED_PRECONDITION)
# on both sides; a different minor works (unknown fields are ignored). 1.1 added
# StreamHeartbeats: an agent uses it when both sides speak 1.1 or later, Heartbeat calls
# otherwise. 1.2 added replicas: the desired set in heartbeat answers, replica statuses in
# heartbeats, node labels and the advertise address in Register, the mirror credential in
# its answer, and log tails (LogRequest, ReplicaLogs). An older agent runs no replicas.
# 1.3 added ``leaving`` in heartbeats: an agent stopped drains its replicas off the node
# first when the control plane speaks 1.3 or later (an older one ignores the field).
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
"""A node's name (``fullmatch``): the agent refuses any other ``--name`` before it calls, and the
control plane any other ``node_name`` (the rule of a deployment's node names, ``config._rules._ID``)."""

PROTOCOL: tuple[int, int] = (1, 3)

# The join token travels as call metadata: ``authorization: Bearer <token>``.
TOKEN_METADATA = "authorization"

# Keepalive (reference cluster.md §7.4): the agent pings every 30 s, even between
# calls, and drops a connection whose ping is unanswered for 10 s; the server
# accepts pings every 10 s or slower without data (its default minimum, 5 min, would
# GOAWAY the agent with too_many_pings) and pings idle agents every 60 s itself.
CLIENT_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # Reconnect on the agent's own backoff, not gRPC's (which grows to 120 s).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 5_000),
    # Each channel its own subchannels: a channel made after a failure connects at once, not when
    # the previous channel's subchannel (shared process-wide by default) is next due to retry,
    # up to max_reconnect_backoff_ms later: the agent's backoff, capped at one interval, decides.
    ("grpc.use_local_subchannel_pool", 1),
)
SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # (GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS: the macro says RECV, the key does not)
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 2),
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),
)


def streams_heartbeats(protocol: tuple[int, int]) -> bool:
    """Whether a peer speaking ``protocol`` (same major) knows StreamHeartbeats."""
    return protocol >= (1, 1)


def runs_replicas(protocol: tuple[int, int]) -> bool:
    """Whether an agent speaking ``protocol`` (same major) runs replicas (a desired set can be sent to it)."""
    return protocol >= (1, 2)


def drains_leaving(protocol: tuple[int, int]) -> bool:
    """Whether a control plane speaking ``protocol`` (same major) drains a leaving node's replicas."""
    return protocol >= (1, 3)


def compatible(major: int) -> bool:
    """Whether a peer speaking protocol ``major`` can talk to this one."""
    return major == PROTOCOL[0]


def node_id_for(name: str) -> str:
    """A node's id: derived from its name, so it is the same after a control plane restart."""
    import uuid

    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"llmgw-node:{name}"))


# -- model -> wire --

def _fill(msg: Any, obj: Any, skip: frozenset[str], errors: list[str]) -> None:
    for f in dataclasses.fields(obj):
        name = f.name
        if name in skip:
            continue
        value = getattr(obj, name)
        if value is None:
            continue
        try:
            if isinstance(value, tuple):
                getattr(msg, name).extend(value)
            else:
                setattr(msg, name, value)
        except (TypeError, ValueError) as exc:
            msg.ClearField(name)
            errors.append(f"{name}: {value!r} cannot be sent ({exc}); left absent")


_GPU_SKIP = frozenset({"xid_errors", "errors"})
_FACTS_SKIP = frozenset({"infiniband"})


def _gpu_to_proto(g: GPU) -> pb.Gpu:
    m = pb.Gpu()
    errors = list(g.errors)
    _fill(m, g, _GPU_SKIP, errors)
    for xid, count in g.xid_errors:
        m.xid_errors.add(xid=xid, count=count)
    m.errors.extend(errors)
    return m


def discovery_to_proto(d: Discovery) -> pb.Discovery:
    """A :class:`Discovery` as its protobuf message (absent readings stay unset)."""
    errors = list(d.errors)
    facts = pb.NodeFacts()
    _fill(facts, d.facts, _FACTS_SKIP, errors)
    for port in d.facts.infiniband:
        pm = facts.infiniband.add()
        _fill(pm, port, frozenset(), errors)
    msg = pb.Discovery(facts=facts, source=d.source)
    msg.gpus.extend(_gpu_to_proto(g) for g in d.gpus)
    msg.errors.extend(errors)
    return msg


# -- wire -> model --

def _names(cls: Any) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls))


_GPU_FIELDS, _FACTS_FIELDS, _PORT_FIELDS = _names(GPU), _names(NodeFacts), _names(InfinibandPort)


def _read(msg: Any, names: frozenset[str]) -> dict[str, Any]:
    """The fields set on ``msg`` (PERF: ``ListFields`` lists only those, in C) that the model has;
    repeated ones as tuples. An unset ``optional`` is left out: the model's ``None``."""
    out: dict[str, Any] = {}
    for fd, value in msg.ListFields():
        name = fd.name
        if name in names:
            out[name] = tuple(value) if fd.is_repeated else value
    return out


def _gpu_from_proto(m: pb.Gpu) -> GPU:
    kw = _read(m, _GPU_FIELDS)
    kw.setdefault("uuid", "")
    kw["health"] = kw.get("health") or "unknown"
    if "xid_errors" in kw:
        kw["xid_errors"] = tuple((x.xid, x.count) for x in kw["xid_errors"])
    return GPU(**kw)


def discovery_from_proto(m: pb.Discovery) -> Discovery:
    """A received :class:`pb.Discovery` as the model (unset fields are ``None``)."""
    kw = _read(m.facts, _FACTS_FIELDS)
    if "infiniband" in kw:
        kw["infiniband"] = tuple(
            InfinibandPort(**{"device": "", "port": 0, **_read(p, _PORT_FIELDS)}) for p in kw["infiniband"]
        )
    kw.setdefault("hostname", "")
    return Discovery(
        facts=NodeFacts(**kw),
        gpus=tuple(_gpu_from_proto(g) for g in m.gpus),
        source=m.source,  # ("": a source that has not read yet, known by none of its readings)
        errors=tuple(m.errors),
    )


# -- replicas (llmgw.launch.spec) --

def spec_to_proto(s: ReplicaSpec) -> pb.ReplicaSpec:
    """A :class:`ReplicaSpec` as its message (the api_key and env travel: the wire is the one place they may)."""
    m = pb.ReplicaSpec(
        id=s.id, deployment=s.deployment, engine=s.engine, model=s.model, served_name=s.served_name,
        gpus=s.gpus, args=s.args, env=dict(s.env), api_key=s.api_key,
    )
    m.blobs.extend(pb.ModelBlob(digest=b.digest, size=b.size, role=b.role) for b in s.blobs)
    if s.gpu_memory_fraction is not None:
        m.gpu_memory_fraction = s.gpu_memory_fraction
    if s.slots is not None:
        m.slots = s.slots
    if s.context is not None:
        m.context = s.context
    if s.ready_timeout is not None:
        m.ready_timeout_seconds = s.ready_timeout
    return m


def spec_from_proto(m: pb.ReplicaSpec) -> ReplicaSpec:
    """A received :class:`pb.ReplicaSpec` as the dataclass (unset optionals are ``None``)."""
    return ReplicaSpec(
        id=m.id, deployment=m.deployment, engine=m.engine, model=m.model, served_name=m.served_name,
        blobs=tuple(ModelBlob(digest=b.digest, size=b.size, role=b.role or "model") for b in m.blobs),
        gpus=tuple(m.gpus),
        gpu_memory_fraction=m.gpu_memory_fraction if m.HasField("gpu_memory_fraction") else None,
        slots=m.slots if m.HasField("slots") else None,
        context=m.context if m.HasField("context") else None,
        args=tuple(m.args), env=dict(m.env), api_key=m.api_key,
        ready_timeout=_ready_timeout(m),
    )


def _ready_timeout(m: pb.ReplicaSpec) -> float | None:
    """The spec's ready timeout when it is one the deployment could have said (1 s to 7 days); else ``None``,
    the agent's own."""
    if not m.HasField("ready_timeout_seconds"):
        return None
    t = m.ready_timeout_seconds
    return t if 1.0 <= t <= MAX_READY_TIMEOUT else None


def status_to_proto(s: ReplicaStatus) -> pb.ReplicaStatus:
    """A :class:`ReplicaStatus` as its message (``None`` stays unset; a value the field cannot hold is left out)."""
    m = pb.ReplicaStatus(id=s.id, state=s.state, message=s.message, restarts=max(0, s.restarts))
    for name, value in (("port", s.port), ("pid", s.pid), ("exit_code", s.exit_code), ("log_path", s.log_path),
                        ("fetched_bytes", s.fetched), ("fetch_total_bytes", s.fetch_total)):
        if value is not None:
            try:
                setattr(m, name, value)
            except (TypeError, ValueError):  # out of the field's range: left absent, never sent as another value
                pass
    return m


def status_from_proto(m: pb.ReplicaStatus) -> ReplicaStatus:
    """A received :class:`pb.ReplicaStatus` as the dataclass."""
    has = m.HasField
    return ReplicaStatus(
        id=m.id, state=m.state, message=m.message,
        port=m.port if has("port") else None,
        pid=m.pid if has("pid") else None,
        restarts=m.restarts if has("restarts") else 0,
        exit_code=m.exit_code if has("exit_code") else None,
        log_path=m.log_path if has("log_path") else None,
        fetched=m.fetched_bytes if has("fetched_bytes") else None,
        fetch_total=m.fetch_total_bytes if has("fetch_total_bytes") else None,
    )
