"""Bounds on a node's reading (``Discovery``) as the control plane accepts it.

A reading is small on the wire and large once rendered: an empty GPU (2 bytes) becomes some
30 samples with the GPU's labels on ``/metrics``, an empty XID entry (3 bytes) a sample with
them, a long string is repeated in every sample of its GPU. Without bounds one agent with a
valid token could make a scrape render hundreds of MB while it blocks the event loop (the wire
takes 16 MiB messages). The limits, with their reasons (real nodes: 8-16 GPUs, up to 7 MIG
devices each):

* :data:`MAX_GPUS` 256 GPUs per node, MIG devices counted: 16 GPUs of 7 MIG devices each are
  128; twice that is room without letting a node look like a rack.
* :data:`MAX_XIDS` 32 XID codes per GPU: each entry is one distinct code seen; a GPU shows a
  handful (13, 31, 43, 48, 63, 64, 74, 79, ...), 32 distinct ones is a GPU long past service.
* :data:`MAX_TEXT` 128 characters per string (UUIDs ~40, model names ~30, PCI bus ids 16,
  versions and kernel releases < 64, InfiniBand device names < 16).
* :data:`MAX_IB_PORTS` 64 InfiniBand/RoCE ports per node (8-16 on a GPU node).
* :data:`MAX_ERRORS` 32 error messages per list (node and GPU), :data:`MAX_ERROR_TEXT` 1024
  characters each (an NVML or nvidia-smi message is one line).

With them a node renders at most a few MB (256 GPUs of every field and 32 XIDs, with every
string at its limit), against ~50 KB for a real 8-GPU node.

A registration over a limit is refused (:func:`problem`: INVALID_ARGUMENT naming the limit): it
is not a real node. A heartbeat's reading is trimmed to the limits (:func:`trim`) and kept: a
node already admitted is not lost for one odd reading, and the caller logs what was trimmed.
"""

from __future__ import annotations

from typing import Any

MAX_GPUS = 256
MAX_XIDS = 32
MAX_TEXT = 128
MAX_IB_PORTS = 64
MAX_ERRORS = 32
MAX_ERROR_TEXT = 1024
SMALL = 4096
"""A heartbeat's reading of at most this many bytes on the wire is taken as it is, unchecked.

PERF: checking a real 8-GPU reading (~1.4 KB) field by field costs ~7 us a heartbeat, its size
(``ByteSize``, in C) ~1 us. Whatever its shape, a reading of ``B`` bytes renders at most about
``B*B/8`` bytes (a string of ``B/2`` repeated in the samples of ``B/4`` XID entries) plus
``220*B`` (empty GPUs of 2 bytes, ~440 rendered): under 3 MB for 4 KiB, what the limits allow.
A registration is always checked field by field."""

_GPU_TEXT = ("uuid", "name", "pci_bus_id", "parent_uuid", "fabric_state", "health")
_NODE_TEXT = ("hostname", "os", "kernel", "cpu_model", "agent_version", "driver_version", "cuda_driver_version")
_IB_TEXT = ("device", "state")


def _long_text(msg: Any, fields: tuple[str, ...]) -> str | None:
    for f in fields:
        if len(getattr(msg, f)) > MAX_TEXT:
            return f
    return None


def _long_error(errors: Any) -> bool:
    return len(errors) > MAX_ERRORS or any(len(e) > MAX_ERROR_TEXT for e in errors)


def problem(d: Any) -> str | None:
    """What puts the reading ``d`` (a ``pb.Discovery``) over a limit, in words; ``None``: within them.

    PERF: a heartbeat's check (and :func:`trim`'s first step): lengths only, a few attribute
    reads per GPU; nothing is copied.
    """
    gpus = d.gpus
    if len(gpus) > MAX_GPUS:
        return f"{len(gpus)} GPUs (MIG devices counted), at most {MAX_GPUS}"
    t, x = MAX_TEXT, MAX_XIDS
    for g in gpus:
        if (len(g.xid_errors) <= x and len(g.uuid) <= t and len(g.name) <= t and len(g.pci_bus_id) <= t
                and len(g.parent_uuid) <= t and len(g.fabric_state) <= t and len(g.health) <= t and not g.errors):
            continue  # (the common case, in one expression: a real GPU)
        if len(g.xid_errors) > MAX_XIDS:
            return f"GPU {g.uuid[:60]!r} has {len(g.xid_errors)} XID entries, at most {MAX_XIDS}"
        f = _long_text(g, _GPU_TEXT)
        if f is not None:
            return f"GPU {g.uuid[:60]!r}: {f} of {len(getattr(g, f))} characters, at most {MAX_TEXT}"
        if g.errors and _long_error(g.errors):
            return f"GPU {g.uuid[:60]!r}: errors: at most {MAX_ERRORS} of at most {MAX_ERROR_TEXT} characters"
    facts = d.facts
    f = _long_text(facts, _NODE_TEXT)
    if f is not None:
        return f"facts.{f} of {len(getattr(facts, f))} characters, at most {MAX_TEXT}"
    if len(d.source) > MAX_TEXT:
        return f"source of {len(d.source)} characters, at most {MAX_TEXT}"
    ib = facts.infiniband
    if len(ib) > MAX_IB_PORTS:
        return f"{len(ib)} InfiniBand ports, at most {MAX_IB_PORTS}"
    for p in ib:
        f = _long_text(p, _IB_TEXT)
        if f is not None:
            return f"InfiniBand port {f} of {len(getattr(p, f))} characters, at most {MAX_TEXT}"
    if d.errors and _long_error(d.errors):
        return f"errors: at most {MAX_ERRORS} of at most {MAX_ERROR_TEXT} characters"
    return None


def _cut_text(msg: Any, fields: tuple[str, ...]) -> None:
    for f in fields:
        v = getattr(msg, f)
        if len(v) > MAX_TEXT:
            setattr(msg, f, v[:MAX_TEXT])


def _cut_errors(errors: Any) -> None:
    if len(errors) > MAX_ERRORS or any(len(e) > MAX_ERROR_TEXT for e in errors):
        kept = [e[:MAX_ERROR_TEXT] for e in errors[:MAX_ERRORS]]
        del errors[:]
        errors.extend(kept)


def trim(d: Any) -> str | None:
    """Bring the reading ``d`` (a ``pb.Discovery``) within the limits, in place; what was over them
    (as :func:`problem` says it: the first), ``None`` when nothing was.

    GPUs past :data:`MAX_GPUS` are dropped (the first ones kept, the agent's order), a GPU's XID
    entries past :data:`MAX_XIDS` (the most often seen kept, in their order), InfiniBand ports
    and error messages past theirs; strings are cut to their limit.
    """
    if d.ByteSize() <= SMALL:
        return None  # (bounded whatever its shape: see SMALL)
    what = problem(d)
    if what is None:
        return None
    gpus = d.gpus
    if len(gpus) > MAX_GPUS:
        del gpus[MAX_GPUS:]
    for g in gpus:
        xids = g.xid_errors
        if len(xids) > MAX_XIDS:
            keep = sorted(sorted(range(len(xids)), key=lambda i: -xids[i].count)[:MAX_XIDS])
            kept = [(xids[i].xid, xids[i].count) for i in keep]
            del xids[:]
            for xid, count in kept:
                xids.add(xid=xid, count=count)
        _cut_text(g, _GPU_TEXT)
        _cut_errors(g.errors)
    facts = d.facts
    _cut_text(facts, _NODE_TEXT)
    if len(d.source) > MAX_TEXT:
        d.source = d.source[:MAX_TEXT]
    ib = facts.infiniband
    if len(ib) > MAX_IB_PORTS:
        del ib[MAX_IB_PORTS:]
    for p in ib:
        _cut_text(p, _IB_TEXT)
    _cut_errors(d.errors)
    return what


MAX_REPLICAS = 256
"""Replica statuses a heartbeat carries (a node runs a handful; one per GPU, MIG devices counted, at most)."""
MAX_REPLICA_MESSAGE = 4096
"""Characters of a replica status's message (a log tail of a failed start is kept to ~2 KB by the agent)."""


def trim_replicas(replicas: Any) -> str | None:
    """Cut a heartbeat's replica statuses to the limits, in place; what was over (``None``: nothing)."""
    over = None
    if len(replicas) > MAX_REPLICAS:
        del replicas[MAX_REPLICAS:]
        over = f"more than {MAX_REPLICAS} replica statuses"
    for r in replicas:
        for f in ("id", "state"):
            if len(getattr(r, f)) > MAX_TEXT:
                setattr(r, f, getattr(r, f)[:MAX_TEXT])
                over = over or f"a replica status's {f} over {MAX_TEXT} characters"
        if len(r.message) > MAX_REPLICA_MESSAGE:
            r.message = r.message[:MAX_REPLICA_MESSAGE]
            over = over or f"a replica status's message over {MAX_REPLICA_MESSAGE} characters"
        if r.HasField("log_path") and len(r.log_path) > 1024:
            r.log_path = r.log_path[:1024]
            over = over or "a replica status's log_path over 1024 characters"
    return over
