"""The admin listener: health, readiness, metrics, profiling and the management API.

Served on its own port (loopback by default), never on the client port, so the
client port can be exposed without exposing operations.

=================================  ======  ==========================================
route                              token   what
=================================  ======  ==========================================
``GET /health``                    no      the process is up
``GET /ready``                     no      config loaded, listeners bound, every model
                                           has a usable replica (503 + which not); a
                                           control-plane standby: 503 ``standby``;
                                           ``?role=control``: the leader's 200 asks
                                           nothing of its models
``GET /metrics``                   no      Prometheus text or OpenMetrics (``Accept``)
``/admin/v1/...``                  yes     the management API (:mod:`.manage`)
``/admin/v1/mirror/...``           yes     the mirror and Ollama imports (:mod:`.mirror_api`)
``GET /debug/pprof/profile``       yes     CPU profile for ``seconds`` (speedscope,
                                           collapsed or pstats)
``GET /debug/pprof/tasks``         yes     every asyncio task and its await chain
``GET /debug/pprof/threads``       yes     every thread's stack
``GET /debug/pprof/heap``          yes     tracemalloc: top allocation sites
``GET /mirror/v1/blobs/sha256:…``  node    a mirror blob for a node agent (with a
                                           control plane: :mod:`llmgw.mirror.serve`)
``GET /debug/pprof/loop``          yes     how long the event loop is held, for
                                           ``seconds`` (CPU and wall, JSON)
=================================  ======  ==========================================

"token": when ``admin_token`` is configured those routes need
``Authorization: Bearer <admin_token>``; probes and scrapers stay open.
"node": a node's mirror credential (issued at registration), never the admin token.

The app is given what it works on (the registry, the process's operations, the
running configuration, the listeners: :mod:`.ports`) by the composition root,
:mod:`llmgw.runtime`; it never imports or probes the process that runs it.
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import hmac
import ipaddress
import time
import zlib
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import parse_qs

import orjson
from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from ..errors import BadRequestError, NotFoundError, UnauthorizedError
from ..http.parser import Request
from ..http.server import ResponseWriter
from ..log import admin_logger as log
from .manage import ManagementAPI, conflict, method_not_allowed
from .metrics import FleetCollector, Known, LoopLagMonitor, PrometheusObserver, RuntimeCollector
from .mirror_api import MirrorAPI
from .profiling import (
    DEFAULT_HZ,
    MAX_HZ,
    MAX_SECONDS,
    ProfileBusyError,
    Profiler,
    format_heap,
    format_tasks,
    heap_report,
    loop_holds,
    task_dump,
    thread_dump,
)

if TYPE_CHECKING:
    from ..config import Config
    from ..fleet.registry import Registry
    from .ports import DeploymentControl, FleetControl, Listeners, MirrorBlobs, NodeControl, TokenControl

__all__ = ["AdminApp", "FleetCollector", "PrometheusObserver", "TextCollector"]


def _gzip_parts(parts: list[bytes]) -> bytes:
    z = zlib.compressobj(1, zlib.DEFLATED, 31)  # 31: a gzip header, like gzip.compress
    return b"".join([*(z.compress(p) for p in parts), z.flush()])


class _CollectorList:
    """``collect()`` over a list of collectors (what prometheus_client's encoders read)."""

    def __init__(self) -> None:
        self.collectors: list[Any] = []

    def collect(self) -> Iterable[Metric]:
        for c in list(self.collectors):
            yield from c.collect()


class TextCollector(Protocol):
    """A collector that also renders its own Prometheus text (the control plane's cluster collector)."""

    def collect(self) -> Iterable[Metric]:
        """prometheus_client families (OpenMetrics, readers of ``AdminApp.metrics``)."""

    async def render_parts(self, openmetrics: bool = False) -> list[bytes]:
        """Its families as Prometheus text format 0.0.4 (HELP/TYPE included), in pieces to write in order;
        ``openmetrics``: as OpenMetrics 1.0 families (no ``# EOF``: the page adds it once)."""

_TEXT = ((b"content-type", b"text/plain; charset=utf-8"),)
_OM_EOF = b"# EOF\n"
_WRITE_SLICE = 256 * 1024
_GZIP_MIN = 4096  # smaller pages are not worth compressing


def _query(req: Request) -> dict[str, str]:
    target = req.target
    q = target.find(b"?")
    if q < 0:
        return {}
    parsed = parse_qs(target[q + 1:].decode("latin-1"), keep_blank_values=True)
    return {k: v[-1] for k, v in parsed.items()}


def _number(q: dict[str, str], name: str, default: float, lo: float, hi: float) -> float:
    raw = q.get(name)
    if raw is None or raw == "":
        return default
    try:
        v = float(raw)
    except ValueError:
        raise BadRequestError(f"{name} must be a number, got {raw[:50]!r}", param=name) from None
    if not lo <= v <= hi or v != v:
        raise BadRequestError(f"{name} must be between {lo:g} and {hi:g}, got {raw[:50]}", param=name)
    return v


def _flag(q: dict[str, str], name: str) -> bool:
    return q.get(name, "0").lower() in ("1", "true", "yes", "")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class AdminApp:
    """The admin port's app (see the module docstring for the routes).

    Args:
        registry: the replicas (read at request and scrape time, so changes show).
        fleet: the process's operations: add, remove, drain, reload, readiness,
            and the reload counts.
        config: the running configuration, called per request (a reload swaps
            it): the admin token and address are read off it.
        listeners: the client and admin listeners (``/ready`` answers 503 while
            the client one closes; ``/metrics`` counts their connections). The
            admin one may be set after the app is made.
        observer: where the data path reports; one is made when not given. Wire
            it into the gateway with ``gateway.set_observer(admin.observer)``.
        admission: another admission controller to read queue depths and
            saturation from instead of the registry (the default).
    """

    def __init__(
        self,
        *,
        registry: Registry,
        fleet: FleetControl,
        config: Callable[[], Config],
        listeners: Listeners,
        observer: PrometheusObserver | None = None,
        admission: object | None = None,
    ) -> None:
        self.registry = registry
        self.fleet = fleet
        self.config = config
        self.listeners = listeners
        self.observer = observer if observer is not None else PrometheusObserver()
        self.observer.know(
            lambda: Known(
                tuple(registry.models()),
                tuple(registry.endpoints),
                tuple(config().admission.bands),
                tuple((m, ep.id) for m, eps in registry.by_model.items() for ep in eps),
            )
        )
        # Every collector is in `metrics`; `_plain` holds all but those with their own
        # text renderer (register_text_collector), which the text format appends.
        self.metrics = CollectorRegistry(auto_describe=False)
        self._plain = _CollectorList()
        self._text_collectors: list[TextCollector] = []
        for c in (ProcessCollector(registry=self.metrics), PlatformCollector(registry=self.metrics),
                  GCCollector(registry=self.metrics)):
            self._plain.collectors.append(c)
        self.register_collector(self.observer)
        self.register_collector(FleetCollector(registry, admission))
        self.lag: LoopLagMonitor | None = LoopLagMonitor(stopped=listeners.admin_closing)
        try:
            self.lag.start()
        except RuntimeError:  # built outside a running loop (a unit test): no lag measurement
            self.lag = None
        self.register_collector(RuntimeCollector(listeners, self.lag, lambda: fleet.reloads))
        self.api = ManagementAPI(
            registry=registry, fleet=fleet, config=config, observer=self.observer, admission=admission
        )
        self.role: Callable[[], dict[str, Any] | None] | None = None
        self.mirror_api = MirrorAPI(config)  # /admin/v1/mirror/...: the mirror, the Ollama store, import jobs
        self.profiler = Profiler()
        self.mirror: MirrorBlobs | None = None
        self._token_src: str | None = None
        self._token_digest: bytes | None = None
        cfg = config()
        host = cfg.admin[0]
        if not _is_loopback(host) and not cfg.admin_token:
            log.warning(
                "the admin listener is bound to %s without admin_token (admin_allow_unauthenticated): anyone who "
                "can reach it can change the fleet%s; set admin_token (or admin_token_env) or bind it to 127.0.0.1",
                host, ", mint join tokens and read replicas' keys" if cfg.control is not None else "",
            )

    @property
    def reloads(self) -> Mapping[str, int]:
        """Reloads so far by result (``ok``, ``failed``), as ``llmgw_config_reloads_total`` shows them."""
        return self.fleet.reloads

    def close(self) -> None:
        """Stop the loop-lag timer (the runtime's ``stop`` may call this; it also stops on its own)."""
        if self.lag is not None:
            self.lag.stop()
        self.mirror_api.close()

    def attach_role(self, role: Callable[[], dict[str, Any] | None] | None) -> None:
        """A control-plane standby's ``/ready``: ``role()`` is ``None`` on the leader, else the 503 body
        (``reason: standby`` and the leader); ``None``: no election (docs/ha.md)."""
        self.role = role

    def attach_nodes(self, nodes: NodeControl | None) -> None:
        """Serve ``/admin/v1/nodes`` from this control plane (``None``: no control plane, the routes answer 404)."""
        self.api.nodes = nodes

    def attach_deployments(self, deployments: DeploymentControl | None) -> None:
        """Serve ``/admin/v1/deployments`` from this controller (``None``: the routes answer 404)."""
        self.api.deployments = deployments

    def attach_tokens(self, tokens: TokenControl | None) -> None:
        """Serve ``/admin/v1/join-tokens`` from this control plane (``None``: the routes answer 404)."""
        self.api.tokens = tokens

    def attach_mirror(self, mirror: MirrorBlobs | None) -> None:
        """Serve ``/mirror/v1/...`` (blobs for node agents) from ``mirror`` (``None``: the routes answer 404)."""
        self.mirror = mirror

    def register_collector(self, collector: Collector) -> None:
        """Add a collector to the admin ``/metrics`` (the control plane and other parts use this)."""
        self.metrics.register(collector)
        self._plain.collectors.append(collector)

    def register_text_collector(self, collector: TextCollector) -> None:
        """Add a collector that renders its own Prometheus text (``async render_text() -> bytes``).

        The text format (what Prometheus asks for by default) uses that; OpenMetrics
        and readers of :attr:`metrics` use its ``collect()``.
        """
        self.metrics.register(collector)
        self._text_collectors.append(collector)

    def unregister_collector(self, collector: Collector) -> None:
        """Remove a collector added with :meth:`register_collector` or :meth:`register_text_collector`."""
        self.metrics.unregister(collector)
        if collector in self._text_collectors:
            self._text_collectors.remove(collector)
        else:
            self._plain.collectors.remove(collector)

    # -- reload (admin API) --

    def reload(self, trigger: str) -> dict[str, Any]:
        """Re-read the config file through the process's :meth:`FleetControl.reload`; the summary.

        Raises:
            HTTPError: 400 ``invalid_config`` (the file is invalid; nothing changed),
                409 (a conflict with endpoints added at run time), 503 (not running).
        """
        return self.api.reload(trigger)

    # -- auth --

    def _authorize(self, req: Request) -> None:
        # SECURITY: read as an attribute, never probed: a renamed field fails every
        # request instead of quietly opening the API.
        token = self.config().admin_token
        if not token:
            return
        if token is not self._token_src:
            self._token_src = token
            self._token_digest = hashlib.sha256(token.encode()).digest()
        auth = req.authorization
        given = auth[7:].strip() if auth is not None and auth[:7].lower() == b"bearer " else None
        if not given:
            raise UnauthorizedError(
                "this admin route needs the admin token: send Authorization: Bearer <admin_token>",
                code="missing_admin_token",
            )
        # SECURITY: digests of equal length compared in constant time; the token is never logged or echoed.
        assert self._token_digest is not None
        if not hmac.compare_digest(hashlib.sha256(given).digest(), self._token_digest):
            raise UnauthorizedError("wrong admin token", code="invalid_admin_token")

    # -- routing --

    def handle(self, req: Request, w: ResponseWriter) -> Awaitable[None] | None:
        path = req.path
        method = req.method
        if path in (b"/health", b"/ready", b"/metrics"):
            if method not in (b"GET", b"HEAD"):
                raise method_not_allowed(method, path, "GET")
            if path == b"/health":
                w.send_json(200, {"status": "ok"})
            elif path == b"/ready":
                role = _query(req).get("role")
                if role not in (None, "control"):  # (a probe's typo would otherwise pass as plain /ready)
                    raise BadRequestError(f"role must be control (or left out), got {role[:50]!r}", param="role")
                self._ready(w, control=role == "control")
            else:
                return self._metrics(req, w)
            return None
        if path.startswith(b"/admin/v1"):
            self._authorize(req)
            if path.startswith(b"/admin/v1/replicas/"):
                return self.api.handle_replicas(req, w)
            if path.startswith(b"/admin/v1/nodes/") and path.rstrip(b"/").endswith(b"/engine-check"):
                return self.api.handle_engine_check(req, w)
            if path.startswith(b"/admin/v1/mirror"):
                return self.mirror_api.handle(req, w)
            return self.api.handle(req, w)
        if path.startswith(b"/debug/pprof"):
            self._authorize(req)
            if method not in (b"GET", b"HEAD"):
                raise method_not_allowed(method, path, "GET")
            return self._pprof(req, w, path)
        if path.startswith(b"/mirror/v1/"):
            # (its own credentials, per node: not the admin token)
            mirror = self.mirror
            if mirror is None:
                raise NotFoundError(
                    "this llmgw serves no mirror blobs: they are served by a control plane (a control: section)"
                )
            return mirror.handle(req, w)
        raise NotFoundError(
            f"no admin route {path.decode('latin-1')[:200]}; try /health, /ready, /metrics, /admin/v1/endpoints "
            "or /debug/pprof/"
        )

    def _ready(self, w: ResponseWriter, control: bool = False) -> None:
        """``control``: readiness as a control plane (a Service that reaches the leader alone): 200 while
        this process leads, whatever its deployments' replicas are doing (a deployment still loading, or
        broken, must not take the management API away with it); a standby's 503 as ever."""
        if self.listeners.client_closing():
            w.send_json(503, {"ready": False, "reason": "shutting down"})
            return
        role = self.role
        standby = role() if role is not None else None
        if standby is not None:
            w.send_json(503, standby)
            return
        if control:
            if role is None:
                w.send_json(503, {"ready": False, "reason": "no_control_plane"})
            else:
                w.send_json(200, {"ready": True, "role": "leader"})
            return
        ready, body = self.fleet.readiness()
        w.send_json(200 if ready else 503, body)

    def _metrics(self, req: Request, w: ResponseWriter) -> Awaitable[None] | None:
        encoder, content_type = choose_encoder((req.header(b"accept") or b"").decode("latin-1"))
        if self._text_collectors:
            return self._metrics_text(req, w, encoder, content_type)
        self._send_metrics(req, w, encoder(self.metrics), content_type)
        return None

    async def _metrics_text(self, req: Request, w: ResponseWriter, encoder: Any, content_type: str) -> None:
        # PERF: a cluster's page is megabytes: its parts are written one after another
        # (no join), and compressed off the loop (zlib releases the GIL).
        # (a real Prometheus asks for OpenMetrics: the cluster must not fall back to prometheus_client's
        # renderer there, which takes ~1 s for 1,000 nodes and would hold the loop all that time)
        om = not content_type.startswith("text/plain")
        head = encoder(self._plain)
        if om:
            head = head.removesuffix(_OM_EOF)
        parts = [head]
        for c in list(self._text_collectors):
            parts.extend(await c.render_parts(openmetrics=om))
        if om:
            parts.append(_OM_EOF)
        total = sum(map(len, parts))
        headers = [(b"content-type", content_type.encode())]
        if total >= _GZIP_MIN and b"gzip" in (req.header(b"accept-encoding") or b""):
            body = await asyncio.to_thread(_gzip_parts, parts)
            headers.append((b"content-encoding", b"gzip"))
            w.send(200, body, headers)
            return
        w.start(200, headers, content_length=total)
        # PERF: a slice at a time, at the client's pace. Handed the whole page at once, the
        # transport would write it in one go while a fast reader keeps the socket draining:
        # 19 MB for 1,000 nodes held the event loop ~15 ms (bench/cluster_scale.py).
        for part in parts:
            for i in range(0, len(part), _WRITE_SLICE):
                if w.disconnected:
                    return
                w.write(part[i:i + _WRITE_SLICE] if len(part) > _WRITE_SLICE else part)
                if w.write_paused:
                    await w.drain()
                else:
                    await asyncio.sleep(0)
        w.end()

    def _send_metrics(self, req: Request, w: ResponseWriter, body: bytes, content_type: str) -> None:
        headers = [(b"content-type", content_type.encode())]
        if len(body) >= _GZIP_MIN and b"gzip" in (req.header(b"accept-encoding") or b""):
            body = gzip.compress(body, compresslevel=1)
            headers.append((b"content-encoding", b"gzip"))
        w.send(200, body, headers)

    # -- profiling --

    def _pprof(self, req: Request, w: ResponseWriter, path: bytes) -> Awaitable[None] | None:
        q = _query(req)
        name = path[len(b"/debug/pprof"):].strip(b"/")
        if name == b"":
            w.send(200, _PPROF_INDEX, _TEXT)
        elif name == b"profile":
            return self._profile(q, w)
        elif name == b"tasks":
            tasks = task_dump()
            if q.get("format") == "json":
                w.send_json(200, {"tasks": tasks})
            else:
                w.send(200, format_tasks(tasks).encode(), _TEXT)
        elif name == b"threads":
            w.send(200, thread_dump().encode(), _TEXT)
        elif name == b"loop":
            return self._loop_holds(q, w)
        elif name == b"heap":
            report = heap_report(
                int(_number(q, "top", 25, 1, 1000)),
                stop=_flag(q, "stop"),
                diff=_flag(q, "diff"),
                frames=int(_number(q, "frames", 1, 1, 64)),
            )
            if q.get("format") == "json":
                w.send_json(200, report)
            else:
                w.send(200, format_heap(report).encode(), _TEXT)
        else:
            raise NotFoundError(f"no profile {name.decode('latin-1')[:100]!r}; see /debug/pprof/")
        return None

    async def _loop_holds(self, q: dict[str, str], w: ResponseWriter) -> None:
        w.send_json(200, await loop_holds(_number(q, "seconds", 10.0, 0.01, MAX_SECONDS)))

    async def _profile(self, q: dict[str, str], w: ResponseWriter) -> None:
        seconds = _number(q, "seconds", 10.0, 0.01, MAX_SECONDS)
        fmt = q.get("format", "speedscope")
        stamp = time.strftime("%Y%m%dT%H%M%S")
        try:
            if fmt == "pstats":
                data = await self.profiler.cprofile(seconds)
                w.send(200, data, _attachment(b"application/octet-stream", f"llmgw-{stamp}.pstats"))
                return
            if fmt not in ("speedscope", "collapsed"):
                raise BadRequestError(
                    f"format must be speedscope, collapsed or pstats, got {fmt[:50]!r}", param="format"
                )
            hz = _number(q, "hz", DEFAULT_HZ, 1, MAX_HZ)
            prof = await self.profiler.sample(seconds, hz)
        except ProfileBusyError as exc:
            raise conflict(str(exc), code="profile_in_progress") from None
        if fmt == "collapsed":
            w.send(200, prof.collapsed().encode(), _TEXT)
        else:
            w.send(
                200,
                orjson.dumps(prof.speedscope()),
                _attachment(b"application/json", f"llmgw-{stamp}.speedscope.json"),
            )


def _attachment(content_type: bytes, filename: str) -> list[tuple[bytes, bytes]]:
    return [
        (b"content-type", content_type),
        (b"content-disposition", b'attachment; filename="%s"' % filename.encode()),
    ]


_PPROF_INDEX = b"""llmgw profiles (the admin token is needed when one is configured)

/debug/pprof/profile?seconds=10             CPU profile of the event loop thread, sampled at ~200 Hz,
                                            as speedscope JSON (open at https://www.speedscope.app)
/debug/pprof/profile?seconds=10&format=collapsed   the same as collapsed stacks (flamegraph.pl)
/debug/pprof/profile?seconds=10&format=pstats      cProfile (deterministic, slower) for python -m pstats
/debug/pprof/tasks[?format=json]            every asyncio task and the await chain it is suspended in
/debug/pprof/threads                        every thread's stack
/debug/pprof/heap?top=25                    tracemalloc: starts tracing on the first call, then the top
                                            allocation sites; &diff=1 growth since the last call; &stop=1
/debug/pprof/loop?seconds=10                how long the event loop ran without reaching its timers:
                                            its thread's CPU (the loop's doing) and wall time (with the
                                            waits for a core), worst, p99 and counts over 1-50 ms
"""
