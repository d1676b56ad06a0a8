"""Deployments: desired state, placement of their replicas, and the router following them.

:class:`DeploymentController` implements :class:`llmgw.launch.spec.ReplicaController`.
It is level-triggered (STYLE §13): :meth:`~DeploymentController.sync` compares
what is wanted (each deployment's replica count) with what is placed and takes
the next steps; running it twice does nothing more. It runs on a short tick and
at once after every change (an API call, a report, a reload).

* **Desired state** lives in a :class:`~.db.DesiredStore` (``control.database``:
  SQLite or PostgreSQL, every write fenced by the leader's epoch): the
  deployments, and the replicas placed for them with their GPUs, claims and API
  keys, so a control-plane restart, or a standby taking over, hands every node
  the same set (no engine restarts, no replica launched twice) and loses no
  deployment. A placed replica is told to its node only once its row is
  committed (:attr:`Replica.durable`); the controller lives as long as one term
  of leadership and is made again from the database by the next. Entries of ``deployments:`` in the config
  file are applied at start and on every reload (an entry removed from the file is
  undeployed); ``ctl scale`` of one holds until that entry changes in the file.
  Deployments made through the API live in the store alone.
* **Placement**: :func:`.placement.place` per missing replica, over the node map
  and the claims of every placed replica. A deployment that cannot be placed
  keeps the reason (shown by ``ctl deployments``) and is retried on every pass.
* **Per node**: :meth:`~DeploymentController.desired` is the node's whole set with
  a generation that rises on every change (it starts at the wall clock in
  milliseconds, so it rises across a control-plane restart too).
* **The router follows** (:class:`Router`): a replica reported ``ready`` joins the
  router as an endpoint (its id is the replica's; pool = its node); one that stops
  being ready (restarting, failed, vanished from its node's report) leaves it. A
  scale-down first drains the chosen replicas (no new requests), waits until
  their requests in flight are done (or ``drain_grace``), and only then drops
  them from the node's set, so the agent stops them. A model whose deployment has
  no ready replica answers 503 ``model_unavailable``, not 404.
* **Failures**: a replica reported ``failed`` (the agent gave up after its
  restarts) is dropped and placed again after a backoff that doubles per failure
  (5 s to 5 min); the deployment shows the last failure's message. Before that,
  from its first crash, a replica the agent restarts makes the deployment say so
  (exit status, restarts, the end of its log): :meth:`~DeploymentController.view`.

SECURITY: each replica's API key comes from :func:`secrets.token_urlsafe`; it is
kept in the store (a ``0600`` file), sent to the agent and to the router, and
shown only by :meth:`~DeploymentController.view` with ``secrets=True``; never logged.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from google.protobuf.json_format import MessageToDict, ParseDict

from ..agent.wire import pb, runs_replicas, spec_from_proto, spec_to_proto
from ..config import DeploymentConfig, EndpointConfig, load
from ..engines import get as get_engine
from ..errors import ConfigError
from ..fleet.held import HeldModels
from ..launch.base import OWN_FLAGS, hide_secret_args
from ..launch.spec import (
    FAILED,
    FETCHING,
    LOG_TAIL,
    READY,
    STARTING,
    ReplicaSpec,
    ReplicaStatus,
    log_tail,
    reason_line,
)
from ..log import control_logger as log
from ..mirror.errors import CORRUPT_TRANSFER, MirrorError
from .db import DesiredStore, StoredDeployment, StoredReplica
from .placement import Choice, Claim, GpuInfo, Need, NodeInfo, Unplaceable, place
from .resolve import MirrorModel, Resolver, Verifier, is_model_path, memory_need

if TYPE_CHECKING:
    from ..config import Config
    from .nodes import NodeMap

__all__ = ["DeploymentController", "DeploymentError", "Router", "deployment_entry", "parse_deployment"]

CONFIG = "config"
API = "api"
BACKOFF_MIN_S = 5.0
BACKOFF_MAX_S = 300.0
FAILED_NODE_AVOID_S = 600.0
"""A node where a replica of a deployment failed is taken for its next ones only where no other node fits,
for this long."""
PASS_BUDGET_S = 0.02
"""A pass of the loop places replicas for at most this long (one at least), then yields to the event
loop and goes on at once in the next (a large cluster's placement never holds the data path up)."""
CALL_BUDGET_S = 0.05
"""The same for the pass an operator's call makes (``ctl deploy``, ``scale``): its answer shows what was placed."""
RESOLVE_AGAIN_S = 10.0
"""A model the mirror lacked is looked up again after this long (before placing another replica)."""
CHECK_AGAIN_S = 600.0
"""A mirror blob nodes refused is checked again (re-hashed) at most this often."""
NODE_LOST_S = 120.0
"""A node absent from the node map this long loses its replicas (they are placed elsewhere)."""


class DeploymentError(ValueError):
    """A request the controller refuses: ``status`` and ``code`` for the API."""

    def __init__(self, message: str, *, status: int = 400, code: str = "invalid_deployment", param: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        self.param = param


class Router(Protocol):
    """What the controller changes in the router (the composition root adapts the runtime to it)."""

    def add(self, ep: EndpointConfig) -> None:
        """Add an endpoint (``ValueError``: the id exists)."""

    def remove(self, endpoint_id: str) -> None:
        """Remove it (``KeyError``: no such id); requests in flight finish."""

    def set_draining(self, endpoint_id: str, draining: bool) -> None: ...

    def inflight(self, endpoint_id: str) -> int | None:
        """Requests in flight to it; ``None``: no such endpoint."""

    def hold(self, models: frozenset[str], wanted: frozenset[str]) -> None:
        """Models that answer 503 ``model_unavailable`` (not 404) while they have no replica (``models``),
        and those of them some replica is wanted for (``wanted``: ``/ready`` waits for one of each)."""


# -- deployments as config entries --


def deployment_entry(d: DeploymentConfig) -> dict[str, Any]:
    """``d`` as a config ``deployments[]`` entry (JSON): what the store keeps, what the API takes."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(d):
        v = getattr(d, f.name)
        if v is None:
            continue
        if isinstance(v, tuple):
            v = list(v)
        elif isinstance(v, Mapping):
            v = dict(v)
        out[f.name] = v
    return out


def _entry_key(d: DeploymentConfig) -> str:
    """What a ``ctl scale`` of a config deployment holds against: its entry but its ready timeout (which
    changes nothing its replicas run: a new timeout in the file does not end the scale, a new count does)."""
    return json.dumps(deployment_entry(dataclasses.replace(d, ready_timeout=None)), sort_keys=True)


def parse_deployment(body: Any) -> DeploymentConfig:
    """Validate a config ``deployments[]`` entry given over the API.

    Raises:
        DeploymentError: naming the offending key.
    """
    if not isinstance(body, dict):
        raise DeploymentError("the body must be a JSON object like a config deployments[] entry")
    try:
        cfg = load({"deployments": [body]})
    except ConfigError as exc:
        key = exc.key.removeprefix("deployments[0].").removeprefix("deployments[0]")
        raise DeploymentError(f"{key + ': ' if key else ''}{exc.message}", param=key or None) from None
    return cfg.deployments[0]


# -- what the controller keeps --


@dataclass
class Replica:
    """One placed replica: its claim (stored) and what its node last reported (not stored)."""

    id: str
    deployment: str
    node: str
    gpus: tuple[str, ...]
    gpu_memory: int
    exclusive: bool
    memory: int
    cpu_cores: float
    fraction: float | None
    api_key: str = field(repr=False)
    created_at: float
    status: ReplicaStatus | None = None
    address: str | None = None
    endpoint: str | None = None
    """Its endpoint id in the router while it is there (the replica's id)."""
    draining_since: float | None = None
    """Monotonic time the scale-down chose it; it leaves the node's set once drained."""
    spec: ReplicaSpec | None = field(default=None, repr=False)
    """What its node is told to run, made once (an equal spec means no restart)."""
    outdated: bool = False
    """It runs an earlier form of its deployment (engine, model, args... changed): it keeps serving until
    a replica of the new form is ready to take its place (a rolling update), then drains."""
    durable: bool = True
    """Its row is committed: only then is it in its node's desired set (a leader killed before that
    never had it launched; the next one, loading the rows, cannot launch it a second time)."""
    reported: bool = True
    """Its node has reported since this control plane has known it (a replica loaded from the database is
    not until its node's first heartbeat: until then nothing is known of whether it runs)."""
    crash: str | None = None
    """The agent's message from its last crash (``exited with status 1; restarting in 8s; its log ends:...``),
    kept while the agent starts it again (its message is then ``started: ...``); ``None`` once ready."""

    @property
    def state(self) -> str:
        if self.draining_since is not None:
            return "draining"
        return self.status.state if self.status is not None else "pending"

    def claim(self) -> Claim:
        return Claim(self.id, self.deployment, self.node, self.gpus, self.gpu_memory, self.exclusive, self.memory,
                     self.cpu_cores, loaded=self.state == READY)

    def stored(self) -> StoredReplica:
        """Its row, with the spec it runs (``form``: the wire's message as JSON, engine, model and its blobs,
        args...), so that a control plane that loads the row hands its node the same spec: the deployment's
        entry may have changed since (an outdated replica), or the mirror's answer for its model (a model
        removed, or imported again under the same name), and a spec made again would restart the engine."""
        form: dict[str, Any] = {}
        if self.spec is not None:
            form = {"form": MessageToDict(spec_to_proto(self.spec), preserving_proto_field_name=True)}
        return StoredReplica(self.id, self.deployment, self.node, {
            "gpus": list(self.gpus), "gpu_memory": self.gpu_memory, "exclusive": self.exclusive, "memory": self.memory,
            "cpu_cores": self.cpu_cores, "fraction": self.fraction, "api_key": self.api_key,
            **({"outdated": True} if self.outdated else {}), **form,
        }, self.created_at)

    @classmethod
    def from_stored(cls, r: StoredReplica) -> Replica:
        s = r.spec
        rep = cls(r.id, r.deployment, r.node, tuple(s.get("gpus", ())), int(s.get("gpu_memory", 0)),
                  bool(s.get("exclusive", True)), int(s.get("memory", 0)), float(s.get("cpu_cores", 0.0)),
                  s.get("fraction"), str(s.get("api_key", "")), r.created_at, outdated=bool(s.get("outdated")),
                  reported=False)
        form = s.get("form")
        if isinstance(form, Mapping):
            # (the spec it was given, equal to the one its agent runs: not restarted because the mirror
            # or the entry changed while no control plane ran; a rolling update goes on where it was)
            rep.spec = spec_from_proto(ParseDict(dict(form), pb.ReplicaSpec(), ignore_unknown_fields=True))
        return rep


@dataclass
class Deployment:
    cfg: DeploymentConfig
    source: str
    override: int | None = None
    override_of: str | None = None
    message: str | None = None
    """Why a replica is missing (unplaceable, the last failure), ``None`` when all are placed."""
    failures: int = 0
    retry_at: float = 0.0
    model: MirrorModel | None = None
    resolved: bool = False
    resolved_at: float = 0.0
    model_error: str | None = None
    """Why its mirror model cannot be used (a blob missing or corrupt), looked up again now and then."""
    unplaceable: str | None = None
    """Why the last replica it wanted could not be placed (its :attr:`message` then), until one is."""
    failed_on: dict[str, float] = field(default_factory=dict)
    """Nodes where a replica of it failed lately, and until when (the controller's clock) placement takes
    them only where no other node fits."""

    @property
    def desired(self) -> int:
        return self.override if self.override is not None else self.cfg.replicas

    def stored(self) -> StoredDeployment:
        return StoredDeployment(self.cfg.name, self.source, deployment_entry(self.cfg), self.override, self.override_of)


class DeploymentController:
    """Deployments, their replicas, and the router following them (module docstring).

    Args:
        nodes: the node map (read at placement).
        store: where desired state is kept.
        router: the router to follow (``None``: a control plane without a gateway in its process).
        config: the running configuration (its ``deployments`` are applied when it changes).
        resolver: a model string -> the mirror's model (``None``: not a mirror reference).
        drain_grace: seconds a replica scaled away may keep requests in flight before it is stopped anyway.
        in_router: endpoint ids a previous term of this process left in the router: its replicas are
            taken as there already, the rest leave it.
        tick: seconds between passes when nothing wakes the loop.
        clock: the monotonic clock.
        verifier: re-hashes mirror blobs in a thread (:func:`~.resolve.mirror_verifier`): when nodes refuse
            the bytes a model's blob came as (a failed replica saying so), the mirror's own copy is checked,
            and a corrupt one moved out of it (the model then placed nowhere until imported again);
            ``None``: not checked.
    """

    def __init__(
        self,
        *,
        nodes: NodeMap,
        store: DesiredStore,
        router: Router | None,
        config: Callable[[], Config],
        resolver: Resolver,
        drain_grace: float = 30.0,
        tick: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        in_router: frozenset[str] = frozenset(),
        verifier: Verifier | None = None,
    ) -> None:
        self.verifier = verifier
        self._checked: dict[str, float] = {}  # a blob digest -> when its mirror copy was last checked (clock)
        self._checking: set[asyncio.Task[None]] = set()
        self._check_stop = threading.Event()  # (ends a re-hash in its thread between two chunks)
        self._check_pool: concurrent.futures.ThreadPoolExecutor | None = None  # one check at a time, its own thread
        self.nodes = nodes
        self.store = store
        self.router = router
        self.config = config
        self.resolver = resolver
        self.drain_grace = drain_grace
        self.tick = tick
        self._health: dict[str, bool] = {}  # each node's up-ness at the last pass (its changes are logged)
        self.clock = clock
        self.deployments: dict[str, Deployment] = {}
        self.replicas: dict[str, Replica] = {}
        self._gen: dict[str, int] = {}
        self._specs: dict[str, tuple[ReplicaSpec, ...]] = {}
        self._subscribers: list[Callable[[str], None]] = []
        self._told: set[str] = set()
        """Nodes whose desired set gained a committed replica, told in :meth:`_tell` (soon)."""
        self._applied: tuple[DeploymentConfig, ...] | None = None
        self._missing_since: dict[str, float] = {}
        self._held: tuple[frozenset[str], frozenset[str], tuple[tuple[str, str], ...]] | None = None
        self._shared_seen = 0  # (how many deployments there were when a served name shared was last said)
        self._pass_nodes: list[NodeInfo] | None = None
        self._claims: list[Claim] | None = None
        """Every replica's claim, for placement; rebuilt after a replica comes, goes or turns ready."""
        self._node_cache: dict[str, tuple[tuple[Any, ...], NodeInfo]] = {}
        self._pass_end = 0.0
        self._placed_in_pass = 0
        self._by_node: dict[str, dict[str, Replica]] = {}
        self._by_deployment: dict[str, dict[str, Replica]] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        invalid: dict[str, str] = {}
        for sd in store.deployments():
            try:
                cfg = parse_deployment(dict(sd.spec))
            except DeploymentError as exc:
                invalid[sd.name] = str(exc)
                continue
            self.deployments[sd.name] = Deployment(cfg, sd.source, sd.replicas_override, sd.override_of)
        self._invalid: dict[str, list[str]] = {}
        """Deployments in the store this llmgw refuses, and their replicas' ids: rows kept, nothing run."""
        kept = self._invalid
        for name in invalid:
            kept[name] = []
        for sr in store.replicas():
            if sr.deployment in self.deployments:
                self._add(Replica.from_stored(sr))
            elif sr.deployment in invalid:
                # NOTE: its rows stay (a llmgw that accepts the deployment, or the same one redeployed,
                # finds them): deleting them here lost every replica of a deployment an older or newer
                # llmgw wrote with a value this one refuses.
                kept[sr.deployment].append(sr.id)
            else:
                store.delete_replica(sr.id)
        for name, why in invalid.items():
            log.error("deployment %s in %s is not valid for this llmgw (%s): not run, its row and its %d replica "
                      "row(s) kept; deploy it again under its name with values this llmgw accepts (llmgw ctl "
                      "deploy), or undeploy it (llmgw ctl undeploy)", name, _where(store), why, len(kept[name]))
        for eid in in_router:
            r = self.replicas.get(eid)
            if r is not None:
                r.endpoint = eid  # (still serving through this router from the last term)
            elif router is not None:
                try:
                    router.remove(eid)
                except KeyError:
                    pass
        self.apply_config()

    # -- running --

    async def start(self) -> None:
        """Start the reconcile loop (on the running event loop)."""
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="llmgw deployments")

    async def committed(self) -> None:
        """Wait until every change made so far is in the database (the API answers after it).

        Raises:
            NotLeader, DatabaseError: it could not be written (this process stops leading).
        """
        await self.store.flushed()

    def in_router(self) -> frozenset[str]:
        """The endpoint ids this controller has in the router (handed to the next term's)."""
        return frozenset(r.endpoint for r in self.replicas.values() if r.endpoint is not None)

    async def stop(self) -> None:
        """Stop the loop; the store is closed. Replicas keep running on their nodes."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        self._check_stop.set()
        for task in list(self._checking):
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        if self._check_pool is not None:
            self._check_pool.shutdown(wait=False, cancel_futures=True)  # (a re-hash running stops at its next chunk)
            self._check_pool = None
        self.store.close()

    def wake(self) -> None:
        """Run a pass soon (after the current callback)."""
        if self._wake is not None:
            self._wake.set()

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            try:
                self.sync()
            except Exception:
                log.exception("the deployments pass failed; retrying on the next tick")
            await asyncio.sleep(0)  # (a pass that asked for another at once still lets the loop run first)
            try:
                await asyncio.wait_for(self._wake.wait(), self.tick)
            except TimeoutError:
                pass
            self._wake.clear()

    # -- desired state --

    def apply_config(self) -> None:
        """Make the store's config deployments what the running configuration says (when it changed)."""
        entries = self.config().deployments
        if entries is self._applied:
            return
        self._applied = entries
        wanted = {d.name: d for d in entries}
        for name, dep in list(self.deployments.items()):
            if dep.source == CONFIG and name not in wanted:
                log.info("deployment %s left the config file: undeploying it", name)
                self._delete(name)
        for name, cfg in wanted.items():
            old = self.deployments.get(name)
            if old is not None and old.source == CONFIG and old.cfg == cfg:
                dep = old
                if dep.override is not None and dep.override_of != _entry_key(cfg):
                    dep.override = dep.override_of = None
                    self.store.put_deployment(dep.stored())
                continue
            if old is None:
                self._forget_invalid(name)  # (a row this llmgw refused at load: the file's entry replaces it)
            if old is not None and old.source == API:
                log.warning("deployment %s is in the config file now: the file's entry replaces the one made with "
                            "ctl deploy", name)
            override, override_of = (None, None)
            if old is not None and old.source == CONFIG:
                override, override_of = old.override, old.override_of
            if override is not None and override_of != _entry_key(cfg):
                override = override_of = None  # the entry changed in the file: its scale ends
            new = Deployment(cfg, CONFIG, override, override_of)
            self._replace(old, new)
        self.wake()

    def _replace(self, old: Deployment | None, new: Deployment) -> None:
        if old is not None and _placement_changed(old.cfg, new.cfg):
            # the replicas would differ (engine, model, GPUs, args, served name...): a rolling update. The
            # old ones keep what they run and keep serving; each drains once a new one is ready in its
            # place (or, with no room for a new one beside them, one at a time: see _converge)
            for r in self._of(new.cfg.name):
                if r.draining_since is None and not r.outdated:
                    self._spec(r)  # (made from the old entry, before it is replaced)
                    r.outdated = True
                    self.store.put_replica(r.stored())
        elif old is not None:  # only the count (or the ready timeout) changed: the same replicas, the same history
            new.message, new.failures, new.retry_at = old.message, old.failures, old.retry_at
            new.model, new.resolved, new.failed_on = old.model, old.resolved, old.failed_on
        self.deployments[new.cfg.name] = new
        self.store.put_deployment(new.stored())
        if old is not None and old.cfg.ready_timeout != new.cfg.ready_timeout:
            # the nodes are told the new timeout with the same replicas: the spec each runs, with the new
            # timeout only (made again, its model resolved anew could differ, and every engine restart at once),
            # kept in its row (a control plane that loads it hands the node the same); an outdated one keeps
            # its own. The engines run on, and one still loading is waited for as long as the new timeout says
            nodes = set()
            for r in self._of(new.cfg.name):
                if not r.outdated and r.spec is not None:
                    r.spec = dataclasses.replace(r.spec, ready_timeout=new.cfg.ready_timeout)
                    self.store.put_replica(r.stored())
                    nodes.add(r.node)
            for node in sorted(nodes):
                self._invalidate(node)

    def create(self, cfg: DeploymentConfig) -> dict[str, Any]:
        """``ctl deploy``: a new deployment in the store.

        Raises:
            DeploymentError: 409 when the name exists.
        """
        if cfg.name in self.deployments:
            dep = self.deployments[cfg.name]
            change = ("change it there and reload, or scale it" if dep.source == CONFIG
                      else "change it with ctl deploy --update (PUT), scale it, or undeploy it first")
            raise DeploymentError(
                f"deployment {cfg.name!r} exists (from {'the config file' if dep.source == CONFIG else 'ctl deploy'}); "
                f"{change}, or choose another name",
                status=409, code="deployment_exists", param="name",
            )
        self._check_model(cfg)
        self._forget_invalid(cfg.name)
        dep = Deployment(cfg, API)
        self.deployments[cfg.name] = dep
        self.store.put_deployment(dep.stored())
        log.info("deployment %s created: %d replica(s) of %s on %s", cfg.name, cfg.replicas, cfg.model, cfg.engine)
        self.sync(CALL_BUDGET_S)
        return self.view(cfg.name)

    def update(self, cfg: DeploymentConfig) -> dict[str, Any]:
        """``ctl deploy --update``: a deployment made with ``ctl deploy`` takes a new entry. When what its
        replicas run changes (model, engine, GPUs, args, env, served name...) this is a rolling update, as a
        changed config entry's is; a new count alone scales it.

        Raises:
            DeploymentError: 404 no such deployment; 409 for one from the config file; 400 as :meth:`create`.
        """
        old = self._get(cfg.name)
        if old.source == CONFIG:
            raise DeploymentError(
                f"deployment {cfg.name!r} is in the config file: change it there and reload",
                status=409, code="deployment_in_config",
            )
        self._check_model(cfg)
        if old.cfg == cfg:
            return self.view(cfg.name)
        rolling = _placement_changed(old.cfg, cfg)
        self._replace(old, Deployment(cfg, API))
        log.info("deployment %s updated: %s", cfg.name,
                 "a rolling update of its replicas" if rolling else f"{cfg.replicas} replica(s), the same form")
        self.sync(CALL_BUDGET_S)
        return self.view(cfg.name)

    def _check_model(self, cfg: DeploymentConfig) -> None:
        """Refuse (400) args that set llmgw's own flags, and a llama.cpp model that is neither in the mirror
        (usable) nor a path."""
        for a in cfg.args:
            flag = a.split("=", 1)[0]
            if flag in OWN_FLAGS:
                # (the agent would fail every replica for it: llmgw.launch.base.refuse_own_flags)
                raise DeploymentError(
                    f"args: {flag} is set by llmgw itself (each replica's address, port and API key are "
                    f"llmgw's, the router's way in): remove it",
                    status=400, code="invalid_deployment", param="args",
                )
        if cfg.engine == "llamacpp" and not is_model_path(cfg.model):
            # llama-server is given a file (-m): a name that is no path must be in the mirror, or
            # every replica would crash-loop on 'failed to open GGUF file'
            try:
                found = self.resolver(cfg.model)
            except MirrorError as exc:
                raise DeploymentError(
                    f"model {cfg.model!r} is in the control plane's mirror but cannot be used: {exc}",
                    status=400, code="model_not_usable", param="model",
                ) from None
            except Exception:
                found = None
            if found is None:
                raise DeploymentError(
                    f"model {cfg.model!r} is not in the control plane's mirror (llmgw mirror ls there; "
                    "llmgw mirror import or import-ollama adds it) and is no file path on the nodes: llama.cpp "
                    "needs a GGUF file (a mirror reference like tiny:1b, or a path like /models/tiny.gguf)",
                    status=400, code="model_not_found", param="model",
                )

    def scale(self, name: str, replicas: int) -> dict[str, Any]:
        """``ctl scale``: the replica count (a config deployment's holds until its entry changes in the file).

        Raises:
            DeploymentError: 404 no such deployment.
        """
        dep = self._get(name)
        if dep.source == CONFIG:
            dep.override = None if replicas == dep.cfg.replicas else replicas
            dep.override_of = _entry_key(dep.cfg) if dep.override is not None else None
        else:
            dep.cfg = dataclasses.replace(dep.cfg, replicas=replicas)
        self.store.put_deployment(dep.stored())
        log.info("deployment %s scaled to %d", name, replicas)
        self.sync(CALL_BUDGET_S)
        return self.view(name)

    def delete(self, name: str) -> dict[str, Any]:
        """``ctl undeploy``: its replicas drain, then stop.

        Raises:
            DeploymentError: 404 no such deployment; 409 for one from the config file.
        """
        if name in self._invalid and name not in self.deployments:
            self._forget_invalid(name)  # (one this llmgw refused at load: its rows go, nothing of it ran)
            self.store.delete_deployment(name)
            return {"deleted": name, "draining": []}
        dep = self._get(name)
        if dep.source == CONFIG:
            raise DeploymentError(
                f"deployment {name!r} is in the config file: remove it there and reload (or scale it to 0)",
                status=409, code="deployment_in_config",
            )
        draining = self._delete(name)
        self.sync(CALL_BUDGET_S)
        return {"deleted": name, "draining": draining}

    def _forget_invalid(self, name: str) -> None:
        """A deployment refused at load is made again or undeployed: its kept replica rows go."""
        for rid in self._invalid.pop(name, ()):
            self.store.delete_replica(rid)

    def _delete(self, name: str) -> list[str]:
        self.deployments.pop(name, None)
        self.store.delete_deployment(name)
        out = []
        for r in self._of(name):
            self._start_drain(r)
            out.append(r.id)
        return out

    def _get(self, name: str) -> Deployment:
        dep = self.deployments.get(name)
        if dep is None:
            raise DeploymentError(
                f"no deployment {name!r}; llmgw ctl deployments (GET /admin/v1/deployments) lists them", status=404,
                code="deployment_not_found", param="name",
            )
        return dep

    def _of(self, name: str) -> list[Replica]:
        return list(self._by_deployment.get(name, {}).values())

    def _on(self, node: str) -> list[Replica]:
        return list(self._by_node.get(node, {}).values())

    def _add(self, r: Replica) -> None:
        self._claims = None
        self.replicas[r.id] = r
        self._by_node.setdefault(r.node, {})[r.id] = r
        self._by_deployment.setdefault(r.deployment, {})[r.id] = r

    def _forget(self, r: Replica) -> None:
        self._claims = None
        self.replicas.pop(r.id, None)
        for index, key in ((self._by_node, r.node), (self._by_deployment, r.deployment)):
            group = index.get(key)
            if group is not None:
                group.pop(r.id, None)
                if not group:
                    del index[key]

    # -- the pass --

    def sync(self, budget: float = PASS_BUDGET_S) -> None:
        """One reconcile pass: config, lost nodes, placement, scale-down, drains, held models.

        Placement stops after ``budget`` seconds (one replica is always placed when one is missing
        and fits); the next pass then follows at once.
        """
        now = self.clock()
        self._pass_end = time.perf_counter() + budget
        self._placed_in_pass = 0
        with self.store.batch():
            self.apply_config()
            self._watch_nodes(now)
            self._pass_nodes = None
            for dep in list(self.deployments.values()):
                self._converge(dep, now)
            self._pass_nodes = None
            for r in [r for r in self.replicas.values() if r.draining_since is not None]:
                self._drain_step(r, now)
        self._hold()

    def _converge(self, dep: Deployment, now: float) -> None:
        mine = [r for r in self._of(dep.cfg.name) if r.draining_since is None]
        live = [r for r in mine if not r.outdated]
        old = [r for r in mine if r.outdated]
        want = dep.desired
        if want == 0 and dep.message is not None and not live and not old:
            # (scaled to 0: nothing is to be placed, so no "placing again"; the backoff starts anew)
            dep.message, dep.failures, dep.retry_at = None, 0, 0.0
        if old:
            self._retire(live, old, want)
        if len(live) < want:
            if now < dep.retry_at:
                return
            for _ in range(want - len(live)):
                if self._placed_in_pass and time.perf_counter() > self._pass_end:
                    self.wake()  # (more to place: the next pass goes on after the loop had its turn)
                    return
                got = self._place_one(dep)
                if isinstance(got, Unplaceable):
                    if old and self._make_room(dep, old):
                        return
                    if dep.message != got.reason:
                        log.warning("deployment %s: %d of %d replicas placed: %s", dep.cfg.name,
                                    len(self._live(dep)), want, got.reason)
                    dep.message = dep.unplaceable = got.reason
                    return
            # (a failure's message stays while its replacement starts; why none could be placed is over)
            dep.message = None if dep.failures == 0 or dep.message == dep.unplaceable else dep.message
            dep.unplaceable = None
        elif len(live) > want:
            if any(not r.reported for r in live):
                # (loaded from the database, its node not heard from since: which to keep is not known
                # yet. After a restart in the middle of a leaving node's drain, the replacement placed
                # elsewhere was the newest and went, and the deployment was left on the leaving node. A
                # node silent for long loses its replicas, so this waits a bounded while.)
                return
            per_node: dict[str, int] = {}
            for r in live:
                per_node[r.node] = per_node.get(r.node, 0) + 1
            away = {r.node for r in live if not self._staying(r.node)}
            # on a node leaving or down first, then not ready, then where the deployment is most crowded
            # (counted again after each pick: 2+2 scaled to 2 keeps one on each node, not both on one),
            # newest first
            for _ in range(len(live) - want):
                r = min(live, key=lambda r: (r.node not in away, r.state == READY, -per_node[r.node],
                                             -r.created_at))
                live.remove(r)
                per_node[r.node] -= 1
                self._start_drain(r)
            if want == 0 or dep.failures == 0:
                dep.message = None
        if dep.message is not None and want and len(live) == want and not old and all(
                r.state == READY for r in live):
            # every replica wanted is ready (a scale-down dropped the one that failed): nothing is missing,
            # and nothing is placed again (the message said "placing again" for as long as it ran)
            dep.message, dep.failures, dep.retry_at = None, 0, 0.0

    def _retire(self, live: list[Replica], old: list[Replica], want: int) -> None:
        """A rolling update's step: outdated replicas that serve nothing drain now; of those that serve,
        as many stay as the new form's ready replicas do not yet replace (oldest go first).

        One its node has not reported since this control plane loaded it (a restart halfway through the
        update) is neither: it waits for the report (a node silent for long loses its replicas anyway)."""
        ready_new = sum(1 for r in live if r.state == READY)
        serving = sorted((r for r in old if r.state == READY), key=lambda r: r.created_at)
        for r in old:
            if r.state != READY and r.reported:
                self._start_drain(r)
        for r in serving[: max(0, len(serving) - max(0, want - ready_new))]:
            self._start_drain(r)

    def _make_room(self, dep: Deployment, old: list[Replica]) -> bool:
        """No room for a new replica beside the outdated ones: one of them drains to make room, unless a
        new one is still on its way, or an old one still drains (its GPUs are held until it ends, the
        requests in flight there finish): then that one is waited for. Whether the update goes on."""
        # (the replicas of the new form as they are now: one placed earlier in this pass is on its way)
        if any(r.state != READY for r in self._of(dep.cfg.name) if r.draining_since is None and not r.outdated) \
                or any(r.outdated and r.draining_since is not None for r in self._of(dep.cfg.name)):
            return True
        serving = sorted((r for r in old if r.draining_since is None), key=lambda r: r.created_at)
        if not serving:
            return False
        log.info("deployment %s: no room for a new replica beside the old ones; replacing them one at a time",
                 dep.cfg.name)
        self._start_drain(serving[0])
        dep.message = "rolling update: replacing its replicas one at a time (no room for a new one beside the old)"
        return True

    def _live(self, dep: Deployment) -> list[Replica]:
        return [r for r in self._of(dep.cfg.name) if r.draining_since is None]

    def _need(self, dep: Deployment) -> Need:
        cfg = dep.cfg
        now = self.clock()
        if not dep.resolved or (dep.model is None and now - dep.resolved_at >= RESOLVE_AGAIN_S):
            # (a model not in the mirror is looked up again now and then: it may be imported later)
            dep.model_error = None
            try:
                dep.model = self.resolver(cfg.model)
            except MirrorError as exc:  # (in the mirror, but a blob is missing or corrupt: nothing to launch)
                _unusable(dep, exc)  # (logged by _converge as the reason no replica is placed, once)
            except Exception:
                log.exception("resolving %s in the mirror failed; treating it as a name the engine knows", cfg.model)
                dep.model = None
            dep.resolved, dep.resolved_at = True, now
        estimate = memory_need(dep.model, cfg.context) if dep.model is not None else None
        gpus = cfg.gpu_count
        if gpus > 0:
            per_gpu = cfg.gpu_memory
            if per_gpu is None and estimate is not None:
                per_gpu = -(-estimate // gpus)  # (split evenly over its GPUs, rounded up)
            return Need(cfg.name, gpus, per_gpu, cfg.share_gpus, cfg.gpu_model, cfg.node_labels)
        return Need(cfg.name, 0, None, False, None, cfg.node_labels, cfg.memory or estimate, cfg.cpu_cores)

    def node_infos(self) -> list[NodeInfo]:
        """The node map as placement reads it (a node's entry is rebuilt only when it changed)."""
        nodes = self.nodes
        now = nodes.monotonic()
        out = []
        cache = self._node_cache
        seen = set()
        for st in nodes:
            up = nodes.is_up(st, now)
            key = (st.node_id, st.generation, up, st.cordoned, st.leaving, tuple(st.labels.items()), st.protocol)
            seen.add(st.name)
            hit = cache.get(st.name)
            if hit is not None and hit[0] == key:
                out.append(hit[1])
                continue
            d = st.discovery
            gpus = tuple(
                GpuInfo(g.uuid, g.index, g.name, g.memory_total_bytes, g.memory_used_bytes,
                        # (not "unknown": its node's GPU source is failing now; no new replica there)
                        g.health in ("ok", "degraded", ""), g.health == "degraded", bool(g.mig_mode))
                for g in d.gpus
            )
            f = d.facts
            info = NodeInfo(st.name, up, st.cordoned, dict(st.labels), gpus, f.cpu_cores, f.memory_total_bytes,
                            f.memory_available_bytes, None if runs_replicas(st.protocol) else st.protocol,
                            st.leaving)
            cache[st.name] = (key, info)
            out.append(info)
        for name in [n for n in cache if n not in seen]:
            del cache[name]
        return out

    def _place_one(self, dep: Deployment) -> Replica | Unplaceable:
        need = self._need(dep)
        if dep.model_error is not None:
            return Unplaceable(dep.model_error)
        if self._pass_nodes is None:  # (once per pass: reading a node's GPUs converts its last heartbeat)
            self._pass_nodes = self.node_infos()
        if self._claims is None:
            self._claims = [r.claim() for r in self.replicas.values()]
        avoid: tuple[str, ...] = ()
        if dep.failed_on:
            now = self.clock()
            for node, until in list(dep.failed_on.items()):
                if until <= now:
                    del dep.failed_on[node]
            avoid = tuple(dep.failed_on)
        got = place(need, self._pass_nodes, self._claims, avoid)
        if isinstance(got, Unplaceable):
            return got
        assert isinstance(got, Choice)
        rid = self._new_id(dep.cfg.name)
        frac = None
        if dep.cfg.share_gpus and got.fractions:
            frac = round(min(got.fractions), 4)
        r = Replica(
            rid, dep.cfg.name, got.node, got.gpus, need.gpu_memory or 0, not need.share, need.memory or 0,
            need.cpu_cores or 0.0, frac, secrets.token_urlsafe(32), time.time(), durable=False,
        )
        self._spec(r)  # (made now, so that its row keeps the form it will run)
        # its node is told once the row is committed (_durable), never before
        self.store.put_replica(r.stored(), then=lambda: self._durable(r))
        self._add(r)
        self._placed_in_pass += 1
        log.info("replica %s of %s placed on %s%s", rid, dep.cfg.name, got.node,
                 f" (GPUs {', '.join(got.gpus)})" if got.gpus else " (CPU)")
        return r

    def _durable(self, r: Replica) -> None:
        """``r``'s row is committed: into its node's desired set.

        PERF: a commit of many rows (a ``ctl scale`` of 1,000) tells each node once, after the
        batch, rather than once per replica (each telling rebuilds the node's desired set and
        writes it on its stream): the nodes are collected and told in one callback soon after.
        """
        if self.replicas.get(r.id) is r and not r.durable:
            r.durable = True
            if not self._told:
                try:
                    asyncio.get_running_loop().call_soon(self._tell)
                except RuntimeError:  # (no loop: a synchronous caller, told at once)
                    self._invalidate(r.node)
                    return
            self._told.add(r.node)

    def _tell(self) -> None:
        nodes, self._told = self._told, set()
        for node in sorted(nodes):
            self._invalidate(node)

    def _new_id(self, name: str) -> str:
        while True:
            rid = f"{name[:100]}-{secrets.token_hex(3)}"
            if rid not in self.replicas:
                return rid

    def _start_drain(self, r: Replica) -> None:
        if r.draining_since is not None:
            return
        r.draining_since = self.clock()
        if r.endpoint is not None and self.router is not None:
            try:
                self.router.set_draining(r.endpoint, True)
            except KeyError:
                r.endpoint = None
        log.info("replica %s of %s on %s draining", r.id, r.deployment, r.node)

    def _drain_step(self, r: Replica, now: float) -> None:
        assert r.draining_since is not None
        if r.endpoint is not None and self.router is not None:
            busy = self.router.inflight(r.endpoint)
            if busy and now - r.draining_since < self.drain_grace:
                return
        self._drop(r, "drained" if r.endpoint is not None else "stopped")

    def _drop(self, r: Replica, why: str) -> None:
        """Out of the router and out of its node's set (the agent stops it)."""
        self._leave_router(r)
        self._forget(r)
        self.store.delete_replica(r.id)
        self._invalidate(r.node)
        log.info("replica %s of %s on %s %s: out of the node's set", r.id, r.deployment, r.node, why)

    def _watch_nodes(self, now: float) -> None:
        """Each node's change of health logged; the replicas of nodes gone for NODE_LOST_S placed elsewhere."""
        nodes = self.nodes
        present: set[str] = set()
        mono = nodes.monotonic()
        grace = nodes.grace()
        health = self._health
        # PERF: every pass, over every node (1,000 nodes: ~3 ms a pass through NodeMap.is_up; the
        # same test inline, the grace read once, a third of that)
        for st in nodes:
            if not st.heard:  # (known from the database only: gone until it registers, as far as replicas go)
                continue
            name = st.name
            up = mono - st.last_seen <= grace  # (NodeMap.is_up)
            if up:
                # (an unhealthy node counts as missing: silent for NODE_LOST_S, its replicas go elsewhere,
                # as a vanished node's do; they stayed on a dead machine for good while this process ran)
                present.add(name)
                if st.leaving:
                    self._drain_node(name)
            if health.get(name, True) != up:  # (a node registers up)
                if up:
                    log.info("node %s is up again", name)
                else:
                    log.warning("node %s is unhealthy: no heartbeat for %.1fs (heartbeat_grace %.1fs)", name,
                                st.age(mono), nodes.grace())
            health[name] = up
        if len(health) > len(nodes):
            for name in [n for n in health if nodes.get(n) is None]:
                del health[name]
        for node in list(self._by_node):
            if node in present:
                self._missing_since.pop(node, None)
                continue
            since = self._missing_since.setdefault(node, now)
            if now - since >= NODE_LOST_S:
                log.warning("node %s has been gone or silent %.0fs: its replicas are placed again elsewhere", node,
                            now - since)
                self.node_gone(node)

    def _staying(self, node: str) -> bool:
        """Whether ``node`` is up and not leaving."""
        st = self.nodes.get(node)
        return st is not None and not st.leaving and self.nodes.is_up(st, self.nodes.monotonic())

    def _drain_node(self, node: str) -> None:
        """A leaving node (its agent is stopping): each of its replicas drains (out of the routers once its
        requests in flight are done, then out of the node's set, so the agent stops it) and is placed again
        elsewhere."""
        starting = [r for r in self._by_node.get(node, {}).values() if r.draining_since is None]
        if starting:
            log.info("node %s is leaving (its agent is stopping): %d replica(s) drain and are placed again "
                     "elsewhere", node, len(starting))
        for r in starting:
            self._start_drain(r)

    # -- the router --

    def _hold(self) -> None:
        if self.router is None:
            return
        names = frozenset(d.cfg.model_name for d in self.deployments.values())
        wanted = frozenset(d.cfg.model_name for d in self.deployments.values() if d.desired > 0)
        reasons = {d.cfg.model_name: why for d in self.deployments.values() if (why := self._held_reason(d))}
        key = (names, wanted, tuple(sorted(reasons.items())))
        if key != self._held:
            self._held = key
            self.router.hold(HeldModels(names, reasons=reasons), wanted)
        if len(names) < len(self.deployments) and len(self.deployments) != self._shared_seen:
            self._shared_seen = len(self.deployments)  # (said again when the deployments change in number)
            self._say_shared_names()

    def _held_reason(self, dep: Deployment) -> str | None:
        """What a client asking for ``dep``'s model while it has no ready replica is told (in the 503): the
        kind of reason only (which nodes, what the engine printed are the operator's, in ``ctl
        deployments``); ``None`` while a replica is ready (the router has it)."""
        reps = self._of(dep.cfg.name)
        if any(self.ready_now(r) for r in reps):
            return None
        if dep.desired == 0:
            return "its deployment is scaled to 0"
        live = [r for r in reps if r.draining_since is None]
        if any(_restarting(r) for r in live):
            return "its replicas are restarting after a crash"
        if live and all(not self._staying(r.node) for r in live):
            return ("its replicas' nodes are not heard from (or leaving); they are placed again elsewhere "
                    "if they stay away")
        if not live and (dep.unplaceable is not None or (dep.model is None and dep.model_error is not None)):
            # (placing is refused now, for a reason a backoff does not end: its model unusable, no node
            # fits; after a failure too, which is how a corrupt blob is found)
            return "no replica of its deployment can be placed now (llmgw ctl deployments says why)"
        if dep.message is not None and not live:
            return ("no replica of its deployment can be placed now (llmgw ctl deployments says why)"
                    if dep.failures == 0 else "its replicas failed; new ones are placed after a backoff")
        return "its deployment's replicas are starting"

    def _say_shared_names(self) -> None:
        """Deployments serving one model name are one pool to the router: said, as it may be a mistake."""
        by_name: dict[str, list[str]] = {}
        for d in self.deployments.values():
            by_name.setdefault(d.cfg.model_name, []).append(d.cfg.name)
        for model, names in sorted(by_name.items()):
            if len(names) > 1:
                log.warning("deployments %s all serve model %r: its requests are spread over all their replicas "
                            "(as meant for a move from one to another; else give each its own served_name)",
                            ", ".join(sorted(names)), model)

    def _endpoint_config(self, r: Replica, port: int) -> EndpointConfig:
        dep = self.deployments.get(r.deployment)
        assert dep is not None and r.address is not None
        engine = dep.cfg.engine
        host = r.address
        shown = f"[{host}]" if ":" in host else host
        return EndpointConfig(
            id=r.id, url=f"http://{shown}:{port}", models=(dep.cfg.model_name,), engine=engine, pool=r.node,
            api_key=r.api_key, metrics_path=get_engine(engine).metrics_path, slots=dep.cfg.slots,
            scheme="http", host=host, port=port, deployment=r.deployment, node=r.node,
        )

    def _join_router(self, r: Replica) -> None:
        if self.router is None or r.status is None or r.status.port is None or r.address is None:
            return
        if r.deployment not in self.deployments:
            return
        ep = self._endpoint_config(r, r.status.port)
        try:
            self.router.add(ep)
        except ValueError:
            log.error("replica %s is ready but an endpoint with its id exists; it stays out of the router", r.id)
            return
        r.endpoint = r.id
        log.info("replica %s of %s ready on %s: in the router at %s", r.id, r.deployment, r.node, ep.url)
        dep = self.deployments[r.deployment]
        if dep.failures:  # it works again: the backoff and the failure's message end
            dep.failures, dep.retry_at, dep.message = 0, 0.0, None

    def _leave_router(self, r: Replica) -> None:
        if r.endpoint is None or self.router is None:
            r.endpoint = None
            return
        try:
            self.router.remove(r.endpoint)
        except KeyError:
            pass
        r.endpoint = None

    # -- ReplicaController --

    def desired(self, node: str) -> tuple[int, tuple[ReplicaSpec, ...]]:
        """``(generation, specs)`` for ``node``: every replica placed there and not yet drained."""
        gen = self._gen.get(node)
        if gen is None:
            gen = self._gen[node] = int(time.time() * 1000)
        specs = self._specs.get(node)
        if specs is None:
            specs = self._specs[node] = tuple(
                self._spec(r) for r in sorted(self._on(node), key=lambda r: r.id) if r.durable
            )
        return gen, specs

    def _spec(self, r: Replica) -> ReplicaSpec:
        if r.spec is not None:
            return r.spec
        dep = self.deployments[r.deployment]
        if not dep.resolved:
            self._need(dep)
        cfg = dep.cfg
        m = dep.model
        r.spec = ReplicaSpec(
            id=r.id, deployment=r.deployment, engine=cfg.engine, model=m.ref if m is not None else cfg.model,
            served_name=cfg.model_name, blobs=m.blobs if m is not None else (), gpus=r.gpus,
            gpu_memory_fraction=r.fraction, slots=cfg.slots, context=cfg.context, args=cfg.args, env=cfg.env,
            api_key=r.api_key, ready_timeout=cfg.ready_timeout,
        )
        return r.spec

    def _invalidate(self, node: str) -> None:
        self._specs.pop(node, None)
        old = self._gen.get(node, 0)
        self._gen[node] = max(old + 1, int(time.time() * 1000))
        for cb in list(self._subscribers):
            try:
                cb(node)
            except Exception:
                log.exception("a desired-set subscriber failed for node %s", node)

    def subscribe(self, changed: Callable[[str], None]) -> None:
        self._subscribers.append(changed)

    def report(self, node: str, address: str, statuses: Sequence[ReplicaStatus]) -> None:
        """The statuses a heartbeat from ``node`` carried: the router follows what is ready."""
        seen: set[str] = set()
        changed = False
        for placed in self._by_node.get(node, {}).values():
            placed.reported = True
        for s in statuses:
            r = self.replicas.get(s.id)
            if r is None or r.node != node:
                continue  # not ours (any more): the agent stops it, as its set lacks it
            seen.add(s.id)
            before = r.status
            if (before is not None and before.state == READY) != (s.state == READY):
                self._claims = None  # (a ready replica's memory is in its node's reading: Claim.loaded)
            r.status, r.address = s, address
            if s.state == READY:
                r.crash = None
            elif _in_backoff(s) and s.message:
                r.crash = s.message
            if r.draining_since is not None:
                continue
            if s.state == READY:
                if r.endpoint is not None and before is not None and before.port != s.port:
                    self._leave_router(r)  # restarted on another port
                if r.endpoint is None:
                    self._join_router(r)
                    changed = True
            elif s.state == FAILED:
                self._failed(r, s)
                changed = True
            elif r.endpoint is not None:  # (restarting, or the agent stopping it: not ready)
                log.info("replica %s of %s on %s is %s: out of the router until ready", r.id, r.deployment, node,
                         s.state)
                self._leave_router(r)
        for r in [r for r in self._on(node) if r.id not in seen]:
            if r.status is not None:  # reported before, not now: it vanished from its node
                log.warning("replica %s of %s vanished from node %s's report", r.id, r.deployment, node)
                r.status = None
                self._leave_router(r)
                if r.draining_since is not None:
                    self._drop(r, "gone")
                changed = True
        if changed:
            self.wake()

    def _failed(self, r: Replica, s: ReplicaStatus) -> None:
        dep = self.deployments.get(r.deployment)
        if dep is not None:
            dep.failures += 1
            delay = min(BACKOFF_MAX_S, BACKOFF_MIN_S * 2 ** (dep.failures - 1))
            dep.retry_at = self.clock() + delay
            dep.failed_on[r.node] = self.clock() + FAILED_NODE_AVOID_S
            why, tail = log_tail(s.message or "no message")
            # (the exit status once: the agent's reason for a crash loop says it already)
            code = f" (exit {s.exit_code})" if s.exit_code is not None and f"status {s.exit_code}" not in why else ""
            # (the end of the engine's log last, in the agent's form: reason_line() and a reader find it there)
            dep.message = (f"replica {r.id} failed on {r.node}{code}: {why}; placing again in {delay:g}s"
                           + (f"{LOG_TAIL}\n{tail}" if tail is not None else ""))
            log.warning("deployment %s: %s", r.deployment, reason_line(dep.message))
            self._recheck_model(dep)
            if dep.model is not None and CORRUPT_TRANSFER in (s.message or ""):
                self._check_blobs(dep.model)
        self._drop(r, "failed")

    def _check_blobs(self, model: MirrorModel) -> None:
        """Nodes refused the bytes the mirror sent for ``model``: check the mirror's own copy (in a thread,
        each blob at most once every :data:`CHECK_AGAIN_S`)."""
        if self.verifier is None:
            return
        now = self.clock()
        digests = frozenset(b.digest for b in model.blobs
                            if now - self._checked.get(b.digest, -CHECK_AGAIN_S) >= CHECK_AGAIN_S)
        if not digests:
            return
        for d in digests:
            self._checked[d] = now
        task = asyncio.get_running_loop().create_task(self._check(self.verifier, digests, model.ref))
        self._checking.add(task)
        task.add_done_callback(self._checking.discard)

    async def _check(self, verifier: Verifier, digests: frozenset[str], ref: str) -> None:
        listed = ", ".join(sorted(digests))
        log.warning("a node refused the bytes the mirror sent for %s (%s): checking the mirror's copy", ref, listed)
        if self._check_pool is None:
            self._check_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="llmgw-mirror-check")
        try:
            found = await asyncio.get_running_loop().run_in_executor(
                self._check_pool, verifier, digests, self._check_stop)
        except Exception as exc:
            log.warning("checking the mirror's copy of %s failed: %s", ref, str(exc))
            return
        moved = sorted(d for d, state in found.items() if state == "moved")
        kept = sorted(d for d, state in found.items() if state not in ("ok", "moved"))
        if kept:  # (the store said why it could not move a corrupt one)
            log.error("the mirror's copy of %s is %s (%s) and could not be moved out of the mirror: nodes are sent "
                      "it still, and refuse it; import the model again (llmgw mirror verify names it)", ref,
                      "/".join(sorted({found[d] for d in kept})), ", ".join(kept))
        if moved:
            log.error("the mirror's copy of %s is corrupt (%s): moved to the mirror's quarantine/; its deployments "
                      "are placed nowhere until the model is imported again", ref, ", ".join(moved))
            for dep in self.deployments.values():
                if dep.model is not None and any(b.digest in moved for b in dep.model.blobs):
                    self._recheck_model(dep)
            self.wake()
        elif not kept and found:
            log.info("the mirror's copy of %s is intact: the bytes were corrupted on the way to the node", ref)

    def _recheck_model(self, dep: Deployment) -> None:
        """A replica failed: is its mirror model still usable? A blob gone from the mirror, or one ``llmgw
        mirror verify`` found corrupt and moved out, would fail every replica placed from now on (each node
        asking the mirror for it in vain): none is placed until the model is imported again (looked up again
        every RESOLVE_AGAIN_S, as a model the mirror lacks)."""
        if dep.model is None:
            return
        try:
            self.resolver(dep.cfg.model)
        except MirrorError as exc:
            _unusable(dep, exc)
            dep.resolved_at = self.clock()
        except Exception as exc:  # (the mirror unreadable now: the model it had stays)
            log.debug("looking %s up again in the mirror failed: %s", dep.cfg.model, str(exc))

    def node_gone(self, node: str) -> None:
        """``node`` deregistered or was removed: its replicas are gone (placed again elsewhere)."""
        for r in self._on(node):
            self._leave_router(r)
            self._forget(r)
            self.store.delete_replica(r.id)
        # (a new generation: an agent that was only silent, forgotten and back, must apply the empty
        # set, not skip it as the one it applied: its engines ran on beside their replacements)
        self._invalidate(node)
        self._missing_since.pop(node, None)
        self.wake()

    # -- views --

    def node_blobs(self, node: str) -> frozenset[str]:
        """Digests of the mirror blobs the replicas placed on ``node`` need: what it may fetch (i18-fetch's
        authorizer)."""
        out: set[str] = set()
        for r in self._on(node):
            if r.durable:
                out.update(b.digest for b in self._spec(r).blobs)
        return frozenset(out)

    def claims(self) -> list[Claim]:
        return [r.claim() for r in self.replicas.values()]

    def allocated(self) -> dict[tuple[str, str], int]:
        """(node, GPU UUID) -> bytes the replicas placed there hold (``llmgw_gpu_memory_allocated_bytes``)."""
        out: dict[tuple[str, str], int] = {}
        for r in self.replicas.values():
            for u in r.gpus:
                out[(r.node, u)] = out.get((r.node, u), 0) + r.gpu_memory
        return out

    def replica_view(self, r: Replica, *, show_secrets: bool = False) -> dict[str, Any]:
        s = r.status
        out: dict[str, Any] = {
            "id": r.id, "deployment": r.deployment, "node": r.node, "state": r.state, "gpus": list(r.gpus),
            "gpu_memory": r.gpu_memory or None, "memory": r.memory or None, "address": r.address,
            "port": s.port if s is not None else None, "in_router": r.endpoint is not None,
            "restarts": s.restarts if s is not None else None, "exit_code": s.exit_code if s is not None else None,
            "message": (s.message or None) if s is not None else None,
            "fetched": s.fetched if s is not None else None, "fetch_total": s.fetch_total if s is not None else None,
            "outdated": r.outdated,
        }
        if show_secrets:
            out["api_key"] = r.api_key
        return out

    def ready_now(self, r: Replica) -> bool:
        """Whether ``r`` counts as ready: its node reported it so and is up (a silent node's last report
        is no evidence that its replicas serve)."""
        if r.state != READY:
            return False
        st = self.nodes.get(r.node)
        return st is not None and self.nodes.is_up(st, self.nodes.monotonic())

    def view(self, name: str, *, show_secrets: bool = False) -> dict[str, Any]:
        """One deployment as the API shows it: spec, desired and ready replicas, where each runs, why one is missing."""
        dep = self._get(name)
        cfg = dep.cfg
        reps = sorted(self._of(name), key=lambda r: r.created_at)
        spec = deployment_entry(cfg)
        if not show_secrets:
            spec["env"] = sorted(cfg.env)  # (names only: values may be tokens)
            spec["args"] = hide_secret_args(cfg.args)  # (--hf-token T: T never shown)
        spec["gpus"] = cfg.gpu_count
        return {
            "name": name, "source": dep.source, "model": cfg.model, "served_name": cfg.model_name,
            "engine": cfg.engine, "desired": dep.desired, "configured": cfg.replicas,
            "scaled": dep.override is not None, "ready": sum(1 for r in reps if self.ready_now(r)),
            "placed": sum(1 for r in reps if r.draining_since is None and not r.outdated),
            "outdated": sum(1 for r in reps if r.draining_since is None and r.outdated),
            "nodes": sorted({r.node for r in reps if r.draining_since is None}),
            "message": self._why(dep, reps), "mirror": dep.model.ref if dep.model is not None else None,
            "spec": spec, "replicas": [self.replica_view(r, show_secrets=show_secrets) for r in reps],
        }

    def _silent(self, reps: Sequence[Replica], desired: int | None = None) -> str | None:
        """Why replicas on a node that is not up are not ready: their node is silent (past its grace), or not
        heard from since this control plane took over (a restart, a new leader), or gone; and when they are
        placed elsewhere. Those its node last reported ready do not count as ready."""
        nodes = self.nodes
        mono = nodes.monotonic()
        by_node: dict[str, list[Replica]] = {}
        for r in reps:
            if r.draining_since is not None:
                continue
            st = nodes.get(r.node)
            if st is None or not st.heard or not nodes.is_up(st, mono):
                by_node.setdefault(r.node, []).append(r)
        if not by_node:
            return None
        node, on = min(by_node.items())
        st = nodes.get(node)
        if st is None:
            where = "gone (not registered)"
        elif not st.heard:
            where = "not heard from since this control plane took over"
        else:
            where = f"silent for {st.age(mono):.0f}s (no heartbeat from its agent)"
        more = f" (and {len(by_node) - 1} more node(s))" if len(by_node) > 1 else ""
        ready = sum(1 for r in on if r.state == READY)
        what = ("not counted as ready: the router sends them requests while their engines answer"
                if ready == len(on) else "waiting for its agent")
        live = [r for r in reps if r.draining_since is None and not r.outdated]
        if desired is not None and len(live) > desired and any(not r.reported for r in live):
            # (scaled down after a takeover, before the nodes reported: which go is decided on their reports)
            return (f"{len(on)} replica(s) on node {node}{more}, {where}: {what}; more replicas than wanted: "
                    "the extra drain once their nodes report (or are gone, if they stay away)")
        since = self._missing_since.get(node)
        if since is None:  # (not seen missing by a pass yet)
            when = f"{NODE_LOST_S:.0f}s after the heartbeat grace"
        else:
            when = f"in {max(0.0, NODE_LOST_S - (self.clock() - since)):.0f}s if it stays away"
        return f"{len(on)} replica(s) on node {node}{more}, {where}: {what}; placed again elsewhere {when}"

    def list_views(self, *, show_secrets: bool = False) -> list[dict[str, Any]]:
        return [self.view(n, show_secrets=show_secrets) for n in sorted(self.deployments)]

    def _why(self, dep: Deployment, reps: Sequence[Replica]) -> str | None:
        """The deployment's message, with why a replica the agent restarts after a crash is not ready.

        A placement reason (one line) comes first; a past failure gives way (its replica is gone and
        the one restarting now is the current cause). Made when shown, from the last reports, so it
        ends by itself once the replica is ready, failed or replaced.
        """
        crashed = [r for r in reps if _restarting(r)]
        if not crashed:
            silent = self._silent(reps, dep.desired)
            if silent is None:
                return dep.message
            return silent if dep.message is None else f"{' '.join(dep.message.split())}; {silent}"
        head, tail = _crash_reason(crashed[0])
        if len(crashed) > 1:
            head += f"; {len(crashed) - 1} more replica(s) restarting"
        if dep.failures:
            head += f"; {dep.failures} replica(s) failed before"
        reason = head + (f"{LOG_TAIL}\n{tail}" if tail is not None else "")
        if dep.message is None or dep.failures:
            return reason
        return f"{' '.join(dep.message.split())}; {reason}"


def _unusable(dep: Deployment, exc: MirrorError) -> None:
    """``dep``'s mirror model is there but cannot be used (a blob missing, corrupt, of the wrong size)."""
    dep.model = None
    dep.model_error = f"model {dep.cfg.model!r} is in the mirror but cannot be used: {exc}"


def _in_backoff(s: ReplicaStatus) -> bool:
    """Whether the agent waits to start the replica again after its engine exited (no process, an exit status)."""
    return s.state == STARTING and s.pid is None and (s.exit_code is not None or s.restarts > 0)


def _restarting(r: Replica) -> bool:
    """Whether ``r`` is not ready because its engine crashed: waiting to restart, or starting again."""
    s = r.status
    return (s is not None and r.draining_since is None and s.state in (STARTING, FETCHING)
            and (s.exit_code is not None or s.restarts > 0))


def _crash_reason(r: Replica) -> tuple[str, str | None]:
    """``(why, the end of its log)`` of a replica the agent restarts (:func:`_restarting`)."""
    s = r.status
    assert s is not None
    n = f" ({s.restarts} restart{'' if s.restarts == 1 else 's'} so far)" if s.restarts else ""
    if _in_backoff(s) and s.message:
        why, tail = log_tail(s.message)  # (the agent's own words: the exit status, when it restarts)
        return f"replica {r.id} on {r.node}: {why}{n}", tail
    code = f"exit status {s.exit_code}" if s.exit_code is not None else "a crash"
    return f"replica {r.id} on {r.node}: starting again after {code}{n}", log_tail(r.crash)[1] if r.crash else None


def _placement_changed(a: DeploymentConfig, b: DeploymentConfig) -> bool:
    """Whether running replicas of ``a`` are not replicas of ``b`` (only the count and the ready timeout may
    differ: neither changes what a replica runs)."""
    return dataclasses.replace(a, replicas=0, ready_timeout=None) != dataclasses.replace(b, replicas=0,
                                                                                        ready_timeout=None)


def _where(store: DesiredStore) -> str:
    return str(getattr(store, "path", "the store"))
