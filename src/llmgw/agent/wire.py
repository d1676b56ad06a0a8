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
from typing import Any

from .._proto.agent.v1 import agent_pb2 as pb
from .model import GPU, Discovery, InfinibandPort, NodeFacts

__all__ = [
    "CLIENT_OPTIONS",
    "PROTOCOL",
    "SERVER_OPTIONS",
    "TOKEN_METADATA",
    "compatible",
    "discovery_from_proto",
    "discovery_to_proto",
    "node_id_for",
    "pb",
    "streams_heartbeats",
]

# The wire protocol: a different major is refused at registration (FAILED_PRECONDITION)
# on both sides; a different minor works (unknown fields are ignored). 1.1 added
# StreamHeartbeats: an agent uses it when both sides speak 1.1 or later, Heartbeat calls
# otherwise.
PROTOCOL: tuple[int, int] = (1, 1)

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
)
SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 2),
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),
)


def streams_heartbeats(protocol: tuple[int, int]) -> bool:
    """Whether a peer speaking ``protocol`` (same major) knows StreamHeartbeats."""
    return protocol >= (1, 1)


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
        source=m.source or "none",
        errors=tuple(m.errors),
    )
