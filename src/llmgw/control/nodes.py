"""The node map: every registered node, its last reading and when it was heard from.

Plain data, no I/O. Times are the control plane's own, taken on receipt: the
wall clock (``clock``) for timestamps people and Prometheus read, the monotonic
clock (``monotonic``) for ages; an agent's clock is never used (skew).

A node is ``up`` while its last heartbeat (or registration) is within the grace,
``unhealthy`` past it, and up again on the next heartbeat. ``cordoned`` is a flag
beside that state: an operator's decision, kept by node name, so it outlives the
node's deregistration (an agent restarted for maintenance comes back cordoned) and,
with ``control.state_file``, the control plane's restart. Deregistration removes the
node.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..agent.model import GPU, Discovery, NodeFacts
from ..agent.wire import discovery_from_proto, discovery_to_proto, node_id_for, pb

if TYPE_CHECKING:
    from ..launch.spec import ReplicaStatus

Reading = Discovery | pb.Discovery
"""A node's reading: the model, or the message as it arrived (kept as it is until read)."""

__all__ = ["NodeMap", "NodeState", "peer_host"]

UP = "up"
UNHEALTHY = "unhealthy"


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string: ``ipv4:10.0.0.5:41234`` -> ``10.0.0.5``, ``ipv6:[::1]:5`` -> ``::1``."""
    kind, _, rest = peer.partition(":")
    if not rest:
        return peer
    if kind == "ipv6":
        return rest[1:rest.index("]")] if rest.startswith("[") and "]" in rest else rest.rpartition(":")[0]
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    return rest  # unix:... and the like: as it is


@dataclass
class NodeState:
    """One node as the control plane knows it."""

    node_id: str
    name: str
    peer: str
    """The agent's address as gRPC saw it (``ipv4:10.0.0.5:41234``)."""
    agent_version: str
    protocol: tuple[int, int]
    reading: Reading
    """The latest reading as given: a heartbeat's message is kept as it arrived (PERF: turning it
    into the model costs ~0.3 ms for 8 GPUs, 20x the rest of a heartbeat; most are never read, the
    scrape renders straight from the message: :attr:`wire`)."""
    registered_at: float
    """Wall clock (Unix seconds) of the latest registration, on receipt."""
    last_heartbeat: float
    """Wall clock of the latest heartbeat (or registration), on receipt."""
    last_seen: float
    """Monotonic clock of the same moment: ages are measured on it."""
    registrations: int = 1
    heartbeats: int = 0
    sequence: int = 0
    cordoned: bool = False
    leaving: bool = False
    """Its agent is stopping and asked for its replicas to be drained off it (heartbeat ``leaving``): no
    new replica is placed there. Set from every heartbeat; a registration clears it."""
    generation: int = 0
    """Bumped on every change (a cache of what was rendered from it can compare)."""
    labels: Mapping[str, str] = field(default_factory=dict)
    """The node's labels (agent config ``labels:``), as its latest registration said."""
    advertise: str | None = None
    """Where its replicas are reached, as the agent said (``advertise:``); ``None``: :attr:`peer`'s host."""
    replicas: tuple[ReplicaStatus, ...] = ()
    """The replica statuses its latest heartbeat carried (agents of protocol 1.2 or later)."""
    token: bytes = field(default=b"", repr=False)
    """SHA-256 of the join token its registration used: only calls with that token speak for it."""
    heard: bool = True
    """Heard from since this control plane took over. ``False``: known from the database only (it was
    registered under an earlier leader or before a restart, and has not registered since): shown
    ``unhealthy``, its heartbeat times absent, its GPUs by UUID only, until its agent registers."""
    instance: str = ""
    """The identity of the agent that registered it (``agent_instance``; empty: an older agent): while the
    node is up, only that agent speaks for it."""
    _model: Discovery | None = field(default=None, repr=False)
    _wire: pb.Discovery | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.set_reading(self.reading)

    def set_reading(self, reading: Reading) -> None:
        self.reading = reading
        if isinstance(reading, Discovery):
            self._model, self._wire = reading, None
        else:
            self._model, self._wire = None, reading

    @property
    def discovery(self) -> Discovery:
        """The latest reading as the model (converted on first use after a heartbeat)."""
        m = self._model
        if m is None:
            m = self._model = discovery_from_proto(self.reading)  # type: ignore[arg-type]
        return m

    @property
    def wire(self) -> pb.Discovery:
        """The latest reading as its protobuf message."""
        w = self._wire
        if w is None:
            w = self._wire = discovery_to_proto(self.reading)  # type: ignore[arg-type]
        return w

    @property
    def address(self) -> str:
        """Where the node's replicas are reached: the advertised address, else the host gRPC saw the agent at."""
        return self.advertise or peer_host(self.peer)

    def another_agent(self, instance: str) -> bool:
        """Whether ``instance`` is not the agent that registered this node (both known: an older agent
        sends none, and is not told apart)."""
        return bool(instance and self.instance and instance != self.instance)

    def age(self, now: float) -> float:
        """Seconds since it was last heard from (``now``: monotonic; infinite for a node not :attr:`heard`)."""
        return max(0.0, now - self.last_seen)


class NodeMap:
    """The registered nodes by name.

    Args:
        grace: the heartbeat grace in seconds (called on each read: a reload may change it).
        clock: wall clock (Unix seconds).
        monotonic: the clock ages are measured on.
    """

    def __init__(
        self,
        grace: Callable[[], float],
        *,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.grace = grace
        self.clock = clock
        self.monotonic = monotonic
        self._nodes: dict[str, NodeState] = {}
        self._by_id: dict[str, str] = {}
        self.cordoned: set[str] = set()
        """Names of cordoned nodes, registered or not (:meth:`set_cordoned`, :meth:`restore_cordons`)."""

    def __len__(self) -> int:
        return len(self._nodes)

    def __iter__(self) -> Iterator[NodeState]:
        return iter(list(self._nodes.values()))

    def get(self, name: str) -> NodeState | None:
        return self._nodes.get(name)

    def by_id(self, node_id: str) -> NodeState | None:
        name = self._by_id.get(node_id)
        return self._nodes.get(name) if name is not None else None

    def register(
        self, name: str, *, peer: str, agent_version: str, protocol: tuple[int, int], discovery: Reading,
        labels: Mapping[str, str] | None = None, advertise: str | None = None,
    ) -> tuple[NodeState, bool]:
        """Add the node, or take it back (same name: same node, same id); ``(state, created)``."""
        wall, mono = self.clock(), self.monotonic()
        st = self._nodes.get(name)
        if st is None:
            st = NodeState(
                node_id=node_id_for(name), name=name, peer=peer, agent_version=agent_version, protocol=protocol,
                reading=discovery, registered_at=wall, last_heartbeat=wall, last_seen=mono,
                cordoned=name in self.cordoned, labels=dict(labels or {}), advertise=advertise,
            )
            self._nodes[name] = st
            self._by_id[st.node_id] = name
            return st, True
        st.peer, st.agent_version, st.protocol = peer, agent_version, protocol
        st.labels, st.advertise = dict(labels or {}), advertise
        st.heard = True
        st.set_reading(discovery)
        st.registered_at = st.last_heartbeat = wall
        st.last_seen = mono
        st.registrations += 1
        st.sequence = 0
        st.leaving = False
        st.generation += 1
        return st, False

    def heartbeat(
        self, node_id: str, sequence: int, discovery: Reading, peer: str | None = None,
        at: tuple[float, float] | None = None,
    ) -> NodeState | None:
        """Record a heartbeat; ``None`` when the node is not registered (register again).

        ``at``: ``(wall, monotonic)`` when it arrived, on this map's clocks, when it is
        recorded later than that (the control thread hands heartbeats over in batches).
        """
        st = self.by_id(node_id)
        if st is None or not st.heard:
            return None  # (a node known from the database only registers first)
        st.set_reading(discovery)
        if at is None:
            st.last_heartbeat, st.last_seen = self.clock(), self.monotonic()
        else:
            st.last_heartbeat, st.last_seen = at
        st.heartbeats += 1
        st.sequence = sequence
        if peer is not None:
            st.peer = peer
        st.generation += 1
        return st

    def remember(self, name: str, node_id: str, hostname: str | None, agent_version: str | None,
                 gpu_uuids: list[str]) -> NodeState:
        """A node the database knows that has not registered here yet (:attr:`NodeState.heard` false):
        ``unhealthy`` from the start (never heard from), so that a node whose agent died with the last
        control plane is still listed, counted down (``llmgw_node_up 0``) and can be forgotten, rather
        than vanishing. Its agent's registration turns it into an ordinary node."""
        st = self._nodes.get(name)
        if st is not None:
            return st
        reading = Discovery(  # (source "": not known until its agent says; "none" would claim a node without GPUs)
            facts=NodeFacts(hostname=hostname or ""), gpus=tuple(GPU(uuid=u, health="unknown") for u in gpu_uuids),
            source="",
            errors=("not heard from since this control plane took over: known from the database; its readings "
                    "come when its agent registers",),
        )
        st = NodeState(
            node_id=node_id, name=name, peer="", agent_version=agent_version or "", protocol=(0, 0), reading=reading,
            registered_at=0.0, last_heartbeat=0.0, last_seen=float("-inf"), registrations=0,
            cordoned=name in self.cordoned, heard=False,
        )
        self._nodes[name] = st
        self._by_id[node_id] = name
        return st

    def clear(self) -> None:
        """Forget every node (a control plane that stops leading: its agents go to the new leader)."""
        self._nodes.clear()
        self._by_id.clear()

    def deregister(self, node_id: str) -> NodeState | None:
        """Remove the node; ``None`` when it was not registered."""
        name = self._by_id.pop(node_id, None)
        return self._nodes.pop(name, None) if name is not None else None

    def set_cordoned(self, name: str, cordoned: bool) -> tuple[NodeState, bool]:
        """Cordon or uncordon a registered node; ``(state, changed)``.

        Raises:
            KeyError: no such node.
        """
        st = self._nodes[name]
        changed = st.cordoned != cordoned
        st.cordoned = cordoned
        if cordoned:
            self.cordoned.add(name)
        else:
            self.cordoned.discard(name)
        if changed:
            st.generation += 1
        return st, changed

    def restore_cordons(self, names: set[str]) -> None:
        """The cordons a saved state had (applied to nodes as they register)."""
        self.cordoned = set(names)
        for st in self._nodes.values():
            if st.cordoned != (st.name in names):
                st.cordoned = st.name in names
                st.generation += 1

    def is_up(self, st: NodeState, now: float | None = None) -> bool:
        """Whether the node was heard from within the grace (``now``: monotonic)."""
        return st.age(self.monotonic() if now is None else now) <= self.grace()

    def state(self, st: NodeState, now: float | None = None) -> str:
        """``up`` or ``unhealthy``."""
        return UP if self.is_up(st, now) else UNHEALTHY
