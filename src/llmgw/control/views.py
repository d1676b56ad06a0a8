"""Nodes and GPUs as the management API shows them (JSON-ready dicts).

Absent readings are ``null``, never 0. A node past its grace (``state: unhealthy``,
its ``heartbeat_age_s``) has no current readings: its GPUs are listed by what they are
(uuid, index, name, PCI bus id, parent, memory total) and their last errors, every reading
``null`` and ``health: unknown``, as ``/metrics`` stops exporting them; of its facts, the
memory available and its InfiniBand ports' counters are ``null`` (its ``errors`` are the
last ones said). A node known from
the database that has not registered since this control plane took over has ``null``
heartbeat times.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..agent.model import GPU
from .nodes import NodeMap, NodeState

__all__ = ["gpu_rows", "gpu_view", "node_view"]


# What a GPU is, kept when its node is past its grace (every other field is a reading then not current)
_IDENTITY = frozenset({"uuid", "index", "name", "pci_bus_id", "parent_uuid", "memory_total_bytes", "errors"})
# ... and what an InfiniBand port is
_PORT_IDENTITY = frozenset({"device", "port"})


def gpu_view(g: GPU, current: bool = True) -> dict[str, Any]:
    """One GPU: every field of :class:`~llmgw.agent.model.GPU` (``xid_errors`` as ``{code: count}``).

    ``current``: ``False`` for a GPU of a node past its grace: its identity and last errors, every
    reading ``null`` (``xid_errors`` too) and ``health`` ``unknown``: its last readings are not current.
    """
    out = {f.name: getattr(g, f.name) for f in dataclasses.fields(g)}
    out["xid_errors"] = {str(x): n for x, n in g.xid_errors}
    out["errors"] = list(g.errors)
    if not current:
        out = {k: v if k in _IDENTITY else None for k, v in out.items()}
        out["health"] = "unknown"
    return out


def node_view(nodes: NodeMap, st: NodeState, *, gpus: bool) -> dict[str, Any]:
    """One node: identity, state, heartbeat times (control plane clock), facts; GPUs when ``gpus``."""
    now = nodes.monotonic()
    d = st.discovery
    f = d.facts
    state = nodes.state(st, now)
    facts = {k.name: getattr(f, k.name) for k in dataclasses.fields(f) if k.name != "infiniband"}
    facts["infiniband"] = [dataclasses.asdict(p) for p in f.infiniband]
    if state != "up":
        # (past its grace: what the node is stays, its readings are not current)
        facts["memory_available_bytes"] = None
        facts["infiniband"] = [{k: v if k in _PORT_IDENTITY else None for k, v in p.items()}
                               for p in facts["infiniband"]]
    view: dict[str, Any] = {
        "name": st.name,
        "id": st.node_id,
        "state": state,
        "cordoned": st.cordoned,
        "leaving": st.leaving,
        "labels": dict(st.labels),
        "hostname": f.hostname,
        "agent_version": st.agent_version or None,
        "protocol": f"{st.protocol[0]}.{st.protocol[1]}" if st.heard else None,  # (not said before its agent did)
        "peer": st.peer,
        "address": st.address,
        "registered_at": round(st.registered_at, 3) if st.heard else None,
        "last_heartbeat": round(st.last_heartbeat, 3) if st.heard else None,
        "heartbeat_age_s": round(st.age(now), 3) if st.heard else None,
        "heartbeats": st.heartbeats,
        "registrations": st.registrations,
        "gpu_source": d.source or None,
        "gpu_count": len(d.gpus),
        "errors": list(d.errors),
        "facts": facts,
        "replica_count": len(st.replicas),
    }
    if gpus:
        view["gpus"] = [gpu_view(g, view["state"] == "up") for g in d.gpus]
        view["replicas"] = [dataclasses.asdict(r) for r in st.replicas]
    return view


def gpu_rows(nodes: NodeMap) -> list[dict[str, Any]]:
    """Every GPU of every node, each with ``node``, ``node_state`` and ``heartbeat_age_s``."""
    now = nodes.monotonic()
    rows: list[dict[str, Any]] = []
    for st in nodes:
        state = nodes.state(st, now)
        for g in st.discovery.gpus:
            row = {"node": st.name, "node_state": state,
                   "heartbeat_age_s": round(st.age(now), 3) if st.heard else None}
            row.update(gpu_view(g, state == "up"))
            rows.append(row)
    return rows
