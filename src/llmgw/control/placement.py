"""Where a replica goes: filter the nodes, then score what is left (GPUStack's split).

Pure functions over plain data (no I/O, no clock): :func:`place` takes the nodes
(:class:`NodeInfo`), the claims already made (:class:`Claim`) and what one replica
needs (:class:`Need`), and returns a :class:`Choice` or an :class:`Unplaceable`
that says exactly why, e.g. ``needs 2 GPUs with 40.0 GiB free each; the largest
free set is 1 on gpu-node-3``.

Filter (a node is out when any fails):

* up (heard from within the heartbeat grace), not cordoned nor leaving (its agent stopping), its agent new
  enough to launch (protocol 1.2);
* every label the deployment asks for, with that value;
* a GPU replica: ``gpus`` GPUs of the asked model (a case-insensitive substring of
  the GPU's name: ``H100`` matches ``NVIDIA H100 80GB HBM3``), healthy, each with
  the memory the replica needs free. A GPU held by a replica that does not share
  takes nobody else; without ``share`` a replica takes only GPUs nobody holds. A
  physical GPU in MIG mode is skipped (its MIG devices are listed on their own);
* a CPU replica: the node memory it needs free and, when it states cores, that
  many cores not yet claimed.

Free memory is the total less every claim on it and less what something else
uses: the memory the node reported in use beyond the claims of replicas that are
ready (a ready replica's memory is in that reading; one still loading may not be
yet, so its claim counts whole). A GPU whose total or memory in use was not reported
(a GPU kept by its identity while its source fails) can take only a replica that
states no memory need (absent is not zero).

Score (the lowest wins): the fewest degraded GPUs it would have to take (a GPU with an
XID, uncorrected ECC errors or its fabric not started is healthy enough to place on,
but only where nothing fits without it), then fewest replicas of the same deployment
already on the node (spreading is a preference, not a rule: several replicas share a
node when it is the only one that fits), then the most GPUs left that nobody holds (a CPU replica: the
fewest GPUs nobody holds on the node, so that CPU nodes take CPU replicas before GPU nodes lend them the memory
and cores their GPU replicas need), then the most memory left free, then the name (so the choice is
deterministic). On
the chosen node the GPUs that are not degraded come first, then those with the most
free memory, lowest index first on a tie.

The explanation (:func:`_explain`) stays one short line on a thousand nodes: for a GPU
replica, the eligible node with GPUs of the asked model that came closest (most GPUs
that fit, then the most free memory on one short of it); or that no node has such a GPU
(or a label asked for); then at most :data:`MAX_EXCLUDED_NAMED` nodes left out that
could have helped, by name, and the rest counted by why ("and 37 more down").
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["Choice", "Claim", "GpuInfo", "Need", "NodeInfo", "Unplaceable", "fmt_bytes", "place"]

GIB = 1024**3


def fmt_bytes(n: int | float) -> str:
    """``40.0 GiB``, ``512 MiB``: sizes in explanations."""
    if n >= GIB:
        return f"{n / GIB:.1f} GiB"
    return f"{n / 1024**2:.0f} MiB"


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """One GPU as placement sees it (from the node's last heartbeat)."""

    uuid: str
    index: int | None = None
    name: str | None = None
    memory_total: int | None = None
    memory_used: int | None = None
    healthy: bool = True
    degraded: bool = False
    """Healthy enough to place on, but degraded (an XID, uncorrected ECC errors, its fabric not started):
    taken only when no other fits (:func:`place`)."""
    mig_parent: bool = False
    """A physical GPU in MIG mode: its MIG devices are placed on instead."""


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """One node as placement sees it."""

    name: str
    up: bool = True
    cordoned: bool = False
    labels: Mapping[str, str] = field(default_factory=dict)
    gpus: tuple[GpuInfo, ...] = ()
    cpu_cores: int | None = None
    memory_total: int | None = None
    memory_available: int | None = None
    launch_protocol: tuple[int, int] | None = None
    """The agent's wire protocol when it is too old to launch replicas (before 1.2), else ``None``."""
    leaving: bool = False
    """Its agent is stopping and drains it: no new replica, as a cordoned node."""


@dataclass(frozen=True, slots=True)
class Claim:
    """What one placed replica holds."""

    replica: str
    deployment: str
    node: str
    gpus: tuple[str, ...] = ()
    """GPU UUIDs."""
    gpu_memory: int = 0
    """Bytes held on each of its GPUs."""
    exclusive: bool = True
    """Its GPUs take no other replica (the deployment does not share GPUs)."""
    memory: int = 0
    """Node memory held (CPU replicas)."""
    cpu_cores: float = 0.0
    loaded: bool = False
    """The replica is ready: its memory shows in the node's reading of memory in use."""


@dataclass(frozen=True, slots=True)
class Need:
    """What one replica of a deployment needs."""

    deployment: str
    gpus: int = 0
    gpu_memory: int | None = None
    """Bytes per GPU; ``None``: not known (a whole free GPU, not shared)."""
    share: bool = False
    """May share a GPU with other sharing replicas."""
    gpu_model: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    memory: int | None = None
    """Node memory a CPU replica needs."""
    cpu_cores: float | None = None


@dataclass(frozen=True, slots=True)
class Choice:
    """Where the replica goes."""

    node: str
    gpus: tuple[str, ...] = ()
    fractions: tuple[float, ...] = ()
    """Per chosen GPU: the claim's share of its total memory (``gpu_memory / total``), where both are known."""


@dataclass(frozen=True, slots=True)
class Unplaceable:
    """Why no node fits; ``reason`` is one line an operator can act on."""

    reason: str


def _free(total: int | None, claimed: int, loaded: int, used: int | None) -> int | None:
    if total is None:
        return None
    others = max(0, (used or 0) - loaded)
    return max(0, total - claimed - others)


@dataclass(slots=True)
class _GpuUse:
    claimed: int = 0
    loaded: int = 0
    holders: int = 0
    exclusive: bool = False


def _gpu_uses(claims: Iterable[Claim]) -> dict[tuple[str, str], _GpuUse]:
    out: dict[tuple[str, str], _GpuUse] = {}
    for c in claims:
        for u in c.gpus:
            use = out.setdefault((c.node, u), _GpuUse())
            use.claimed += c.gpu_memory
            if c.loaded:
                use.loaded += c.gpu_memory
            use.holders += 1
            use.exclusive = use.exclusive or c.exclusive
    return out


def _label_miss(node: NodeInfo, want: Mapping[str, str]) -> tuple[tuple[str, str], str] | None:
    """The first label asked for that the node lacks, and how it lacks it."""
    for k, v in want.items():
        got = node.labels.get(k)
        if got != v:
            return (k, v), (f"lacks label {k}={v}" if got is None else f"has label {k}={got}, not {v}")
    return None


def _gpu_need_text(need: Need) -> str:
    n = need.gpus
    what = f"{n} GPU{'s' if n != 1 else ''}"
    if need.gpu_model:
        what += f" ({need.gpu_model})"
    if need.gpu_memory is not None:
        what += f" with {fmt_bytes(need.gpu_memory)} free" + (" each" if n > 1 else "")
    elif not need.share:
        what += " nobody else holds"
    return what


@dataclass(slots=True)
class _Short:
    """Why a node's GPUs could not take a replica: reason -> GPUs, the most free memory among those
    with too little, and how many are of the asked model (all of them when none is asked)."""

    why: dict[str, int] = field(default_factory=dict)
    most_free: int | None = None
    of_model: int = 0


def _fits_gpus(
    node: NodeInfo, need: Need, uses: Mapping[tuple[str, str], _GpuUse]
) -> tuple[list[tuple[int, GpuInfo]], _Short, int]:
    """The node's GPUs that could take the replica, as ``(free bytes, gpu)``; why others could not
    (:class:`_Short`); and how many of its GPUs nobody holds."""
    fit: list[tuple[int, GpuInfo]] = []
    short = _Short()
    why = short.why
    unheld = 0
    model = need.gpu_model.lower() if need.gpu_model else None
    name = node.name
    for g in node.gpus:
        if g.mig_parent:
            continue
        use = uses.get((name, g.uuid))
        if use is None:
            unheld += 1
        if model is not None and model not in (g.name or "").lower():
            why["another model"] = why.get("another model", 0) + 1
            continue
        short.of_model += 1
        if not g.healthy:
            why["unhealthy"] = why.get("unhealthy", 0) + 1
            continue
        if use is not None and (use.exclusive or not need.share):
            why["held by another replica"] = why.get("held by another replica", 0) + 1
            continue
        # (memory in use not reported, e.g. a GPU kept by its identity while its source fails: its free
        # memory is not known either, not its total)
        free = None if g.memory_used is None else _free(g.memory_total, use.claimed if use else 0,
                                                          use.loaded if use else 0, g.memory_used)
        if need.gpu_memory is not None:
            if free is None:
                why["memory not reported"] = why.get("memory not reported", 0) + 1
                continue
            if free < need.gpu_memory:
                why["too little free memory"] = why.get("too little free memory", 0) + 1
                if short.most_free is None or free > short.most_free:
                    short.most_free = free
                continue
        fit.append((free if free is not None else 0, g))
    return fit, short, unheld


def _why_text(short: _Short) -> str:
    return ", ".join(f"{n} {w}" + (f" (at most {fmt_bytes(short.most_free)})"
                                   if w == "too little free memory" and short.most_free is not None else "")
                     for w, n in short.why.items())


def _order_key(item: tuple[int, GpuInfo]) -> tuple[bool, int, int, str]:
    free, g = item
    return (g.degraded, -free, g.index if g.index is not None else 1 << 30, g.uuid)


def place(need: Need, nodes: Sequence[NodeInfo], claims: Sequence[Claim],
          avoid: Collection[str] = ()) -> Choice | Unplaceable:
    """Choose a node (and its GPUs) for one replica of ``need.deployment``.

    Args:
        need: what the replica needs.
        nodes: every registered node.
        claims: what placed replicas hold (including the deployment's own).
        avoid: nodes where a replica of the deployment failed lately: taken only where no other node
            fits (a failure of one node's own, its ports, a file or an engine missing there, must not keep
            the deployment down while other nodes are idle).

    Returns:
        A :class:`Choice`, or an :class:`Unplaceable` with the reason.
    """
    if not nodes:
        return Unplaceable("no nodes are registered (start llmgw agent on a node)")
    if need.gpus > 0 and need.share and need.gpu_memory is None:
        return Unplaceable("shares GPUs but its GPU memory is not known: set gpu_memory")
    uses = _gpu_uses(claims)
    same: dict[str, int] = {}
    mem_claimed: dict[str, int] = {}
    mem_loaded: dict[str, int] = {}
    cores_claimed: dict[str, float] = {}
    for c in claims:
        if c.deployment == need.deployment:
            same[c.node] = same.get(c.node, 0) + 1
        mem_claimed[c.node] = mem_claimed.get(c.node, 0) + c.memory
        if c.loaded:
            mem_loaded[c.node] = mem_loaded.get(c.node, 0) + c.memory
        cores_claimed[c.node] = cores_claimed.get(c.node, 0.0) + c.cpu_cores
    excluded: list[_Excluded] = []
    # (the GPU node that came closest: the most GPUs that fit, then the most free memory on a GPU short of
    # it, then the most GPUs of the asked model; nodes with none of that model are no candidates)
    best_partial: tuple[tuple[int, int, int], str, _Short, int] | None = None  # (rank, node, why, fits)
    best: tuple[tuple[bool, int, int, int, int, str], NodeInfo, list[tuple[int, GpuInfo]]] | None = None
    for node in nodes:
        if not node.up:
            excluded.append(_Excluded(node, "down", f"{node.name} is down"))
            continue
        if node.cordoned:
            excluded.append(_Excluded(node, "cordoned", f"{node.name} is cordoned"))
            continue
        if node.leaving:
            excluded.append(_Excluded(node, "leaving", f"{node.name} is leaving (its agent is stopping)"))
            continue
        if node.launch_protocol is not None:
            major, minor = node.launch_protocol
            excluded.append(_Excluded(node, "with an agent too old to launch replicas",
                                      f"{node.name}'s agent speaks protocol {major}.{minor}, which cannot launch "
                                      f"replicas (upgrade its llmgw)"))
            continue
        miss = _label_miss(node, need.labels)
        if miss is not None:
            (k, v), text = miss
            excluded.append(_Excluded(node, f"without label {k}={v}", f"{node.name} {text}", (k, v)))
            continue
        if need.gpus > 0:
            fit, short, unheld = _fits_gpus(node, need, uses)
            if len(fit) < need.gpus:
                if fit or short.of_model:
                    rank = (len(fit), -1 if short.most_free is None else short.most_free, short.of_model)
                    if best_partial is None or rank > best_partial[0] or (
                            rank == best_partial[0] and node.name < best_partial[1]):
                        best_partial = (rank, node.name, short, len(fit))
                continue
            # (scored without sorting its GPUs: only the winner's are sorted. The GPUs nobody holds
            # have the most free memory, so the replica takes those first.)
            fit_unheld = sum(1 for _, g in fit if (node.name, g.uuid) not in uses)
            left = sum(f for f, _ in fit) - need.gpus * (need.gpu_memory or 0)
            # (a degraded GPU only where no node fits without one: its engine may well fail on it)
            forced = max(0, need.gpus - sum(1 for _, g in fit if not g.degraded))
            key = (node.name in avoid, forced, same.get(node.name, 0), -(unheld - min(need.gpus, fit_unheld)),
                   -left, node.name)
            if best is None or key < best[0]:
                best = (key, node, fit)
            continue
        # a CPU replica
        free = _free(node.memory_total, mem_claimed.get(node.name, 0), mem_loaded.get(node.name, 0),
                     None if node.memory_available is None or node.memory_total is None
                     else node.memory_total - node.memory_available)
        if need.memory:
            if free is None:
                excluded.append(_Excluded(node, "not reporting their memory", f"{node.name} did not report its memory"))
                continue
            if free < need.memory:
                excluded.append(_Excluded(node, "with too little memory free",
                                          f"{node.name} has {fmt_bytes(free)} of memory free"))
                continue
        if need.cpu_cores:
            if node.cpu_cores is None:
                excluded.append(_Excluded(node, "not reporting their CPU cores",
                                          f"{node.name} did not report its CPU cores"))
                continue
            spare = node.cpu_cores - cores_claimed.get(node.name, 0.0)
            if spare < need.cpu_cores:
                excluded.append(_Excluded(node, "with too few CPU cores unclaimed",
                                          f"{node.name} has {spare:g} CPU cores unclaimed"))
                continue
        left_mem = (free or 0) - (need.memory or 0)
        # (the fewest GPUs left idle under it: a CPU replica on a GPU node takes the memory and cores its GPU
        # replicas need, so a node without free GPUs (a CPU node) is taken first, spreading still before it)
        idle_gpus = sum(1 for g in node.gpus if not g.mig_parent and g.healthy and (node.name, g.uuid) not in uses)
        key = (node.name in avoid, 0, same.get(node.name, 0), idle_gpus, -left_mem, node.name)
        if best is None or key < best[0]:
            best = (key, node, [])
    if best is not None:
        _, node, fit = best
        if need.gpus == 0:
            return Choice(node.name)
        fit.sort(key=_order_key)
        chosen = fit[: need.gpus]
        fractions: tuple[float, ...] = ()
        if need.gpu_memory is not None and all(g.memory_total for _, g in chosen):
            fractions = tuple(need.gpu_memory / g.memory_total for _, g in chosen if g.memory_total)
        return Choice(node.name, tuple(g.uuid for _, g in chosen), fractions)
    return Unplaceable(_explain(need, nodes, excluded, best_partial))


MAX_EXCLUDED_NAMED = 5
"""An explanation names at most this many excluded nodes, then counts the rest by why ("and 37 more down")."""
MAX_MODELS_NAMED = 4
"""... and at most this many GPU models when none matches the one asked."""


@dataclass(frozen=True, slots=True)
class _Excluded:
    """A node that was not considered, and why (``kind``: how the rest are counted)."""

    node: NodeInfo
    kind: str
    text: str
    label: tuple[str, str] | None = None


def _has_model(node: NodeInfo, model: str | None) -> bool:
    """Whether the node reports a GPU of ``model`` (any GPU when ``None``)."""
    m = model.lower() if model else None
    return any(not g.mig_parent and (m is None or m in (g.name or "").lower()) for g in node.gpus)


def _explain(need: Need, nodes: Sequence[NodeInfo], excluded: list[_Excluded],
             best_partial: tuple[tuple[int, int, int], str, _Short, int] | None) -> str:
    """Why no node fits, in one line that stays short on a thousand nodes: what is needed; the GPU node
    that came closest, or that no node has a GPU (of the model) or a label asked for; then the nodes
    left out that could have helped (a GPU of the model, the labels or only the labels missing), at most
    :data:`MAX_EXCLUDED_NAMED` of them by name, the others counted by why."""
    model = need.gpu_model
    nowhere = [kv for kv in need.labels.items() if not any(n.labels.get(kv[0]) == kv[1] for n in nodes)]
    if need.gpus > 0:
        head = f"needs {_gpu_need_text(need)}"
        what = f"a GPU matching {model}" if model else "a GPU"
        if best_partial is not None:
            _, where, short, n = best_partial
            others = _why_text(short)
            tail = f"the largest free set is {n} on {where}" + (f" (others: {others})" if others else "")
        elif not nowhere and not any(_has_model(x, model) for x in nodes):
            tail = f"no node has {what}"
            if model:
                names = sorted({g.name for x in nodes for g in x.gpus if g.name and not g.mig_parent})
                if names:
                    tail += " (the GPUs there: " + _capped(names, MAX_MODELS_NAMED, "more models") + ")"
            if not model or not any(g.name is None for x in nodes for g in x.gpus):
                return f"{head}; {tail}"  # (which nodes are down or cordoned cannot help: none has one)
        elif len(excluded) < len(nodes):
            tail = f"no eligible node has {what}"
        else:
            tail = "no node is eligible"
    else:
        head = "needs " + (f"{fmt_bytes(need.memory)} of node memory" if need.memory else "a node")
        if need.cpu_cores:
            head += f" and {need.cpu_cores:g} CPU cores"
        tail = "no node is eligible"
    parts = [head, tail]

    def could_help(e: _Excluded) -> bool:
        if need.gpus > 0 and not _has_model(e.node, model):
            return False
        return e.label is not None or _label_miss(e.node, need.labels) is None

    # (first those left out only for being down, cordoned or too old: back, they would take it)
    named = sorted((e for e in excluded if could_help(e)), key=lambda e: e.label is not None)[:MAX_EXCLUDED_NAMED]
    said: set[tuple[str, str]] = set()
    for e in named:
        text = e.text
        if e.label is not None and e.label in nowhere and e.label not in said:
            said.add(e.label)
            text += " (no node has it)"
        parts.append(text)
    rest: dict[str, int] = {}
    skip = {id(e) for e in named}
    for e in excluded:
        if id(e) not in skip:
            rest[e.kind] = rest.get(e.kind, 0) + 1
    if rest:
        total = sum(rest.values())
        lead = f"and {total} more" if named else f"{total} node{'s' if total != 1 else ''}"
        if len(rest) == 1:
            parts.append(f"{lead} {next(iter(rest))}")
        else:
            parts.append(f"{lead} {'left out ' if not named else ''}(" + ", ".join(f"{n} {k}" for k, n in rest.items())
                         + ")")
    parts.extend(f"no node has label {k}={v}" for k, v in nowhere if (k, v) not in said)
    return "; ".join(parts)


def _capped(items: Sequence[str], cap: int, more: str) -> str:
    """``a, b, c and 4 more models``: at most ``cap`` items named."""
    out = ", ".join(items[:cap])
    return out + (f" and {len(items) - cap} {more}" if len(items) > cap else "")
