"""The management API (JSON under ``/admin/v1/``).

Every change goes through the process's own operations (a
:class:`~llmgw.admin.ports.FleetControl`: ``add_endpoint``, ``remove_endpoint``,
``set_draining``, ``reload``, implemented by :class:`llmgw.runtime.GatewayRuntime`),
so the registry, the data path and the scrape poller follow together, and
connections in flight are never dropped.

Routes::

    GET    /admin/v1/endpoints              every replica: live state and score inputs
    POST   /admin/v1/endpoints              add one (body: a config ``endpoints[]`` entry)
    GET    /admin/v1/endpoints/{id}         one replica
    DELETE /admin/v1/endpoints/{id}         remove it (requests in flight finish)
    POST   /admin/v1/endpoints/{id}/drain   no new requests
    POST   /admin/v1/endpoints/{id}/undrain take requests again
    POST   /admin/v1/reload                 re-read the config file
    GET    /admin/v1/queues                 admission queues per priority band
    GET    /admin/v1/nodes                  the control plane's nodes: state, heartbeat age, facts
    GET    /admin/v1/nodes/{name}           one node with its GPUs
    DELETE /admin/v1/nodes/{name}           forget a node that is not up (409 while it is)
    POST   /admin/v1/nodes/{name}/cordon    no new replicas go there
    POST   /admin/v1/nodes/{name}/uncordon
    GET    /admin/v1/gpus                   every GPU of every node
    GET    /admin/v1/replicas/{id}/logs     the end of a replica's log, from its node (?lines=N, default 100)
    POST   /admin/v1/nodes/{name}/engine-check  run ``ctl engine-check`` on the node (body: engine, model, static, timeout)
    GET    /admin/v1/deployments            every deployment: desired/ready replicas, where, why not
    POST   /admin/v1/deployments            create one (body: a config ``deployments[]`` entry)
    GET    /admin/v1/deployments/{name}     one deployment
    POST   /admin/v1/deployments/{name}/scale  body ``{"replicas": N}``
    DELETE /admin/v1/deployments/{name}     undeploy (its replicas drain, then stop)
    GET    /admin/v1/join-tokens            join tokens made here: id, name, state, created, expires, last used
    POST   /admin/v1/join-tokens            make one (body: ``name``, ``expires``): the secret, shown once
    DELETE /admin/v1/join-tokens/{id}       revoke it (agents presenting it are refused at their next call)

The node and deployment routes need a control plane in the process (``control:``);
without one they answer 404 saying so. ``?show_secrets=1`` on the deployment reads
adds each replica's API key and the engine environment's values.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import orjson

from ..config import EndpointConfig, load
from ..errors import BadRequestError, ConfigError, HTTPError, NotFoundError
from ..fleet.registry import EngineUnavailable
from ..http.parser import Request
from ..http.server import ResponseWriter
from ..log import admin_logger as log
from .metrics import admission_source, breaker_state, pool_saturations, read_mapping

if TYPE_CHECKING:
    from ..config import Config
    from ..fleet.registry import Endpoint, Registry
    from .metrics import PrometheusObserver
    from .ports import DeploymentControl, FleetControl, NodeControl, TokenControl

__all__ = ["ManagementAPI", "endpoint_state", "endpoint_view", "reload_answer"]

PREFIX = b"/admin/v1/"
ROUTES = (
    "GET /admin/v1/endpoints",
    "POST /admin/v1/endpoints",
    "GET /admin/v1/endpoints/{id}",
    "DELETE /admin/v1/endpoints/{id}",
    "POST /admin/v1/endpoints/{id}/drain",
    "POST /admin/v1/endpoints/{id}/undrain",
    "POST /admin/v1/reload",
    "GET /admin/v1/queues",
    "GET /admin/v1/nodes",
    "GET /admin/v1/nodes/{name}",
    "DELETE /admin/v1/nodes/{name}",
    "POST /admin/v1/nodes/{name}/cordon",
    "POST /admin/v1/nodes/{name}/uncordon",
    "GET /admin/v1/gpus",
    "GET /admin/v1/replicas/{id}/logs",
    "POST /admin/v1/nodes/{name}/engine-check",
    "GET /admin/v1/deployments",
    "POST /admin/v1/deployments",
    "GET /admin/v1/deployments/{name}",
    "PUT /admin/v1/deployments/{name}",
    "POST /admin/v1/deployments/{name}/scale",
    "DELETE /admin/v1/deployments/{name}",
    "GET /admin/v1/join-tokens",
    "POST /admin/v1/join-tokens",
    "DELETE /admin/v1/join-tokens/{id}",
)
MAX_LOG_LINES = 10_000


def conflict(message: str, code: str = "conflict") -> HTTPError:
    """A 409 in OpenAI's error shape."""
    return HTTPError(message, status=409, type="invalid_request_error", code=code)


def method_not_allowed(method: bytes, path: bytes, allowed: str) -> HTTPError:
    return HTTPError(
        f"method {method.decode('latin-1')} is not allowed on {path.decode('latin-1')[:200]}; use {allowed}",
        status=405,
        type="invalid_request_error",
        code="method_not_allowed",
    )


def endpoint_state(ep: Any) -> str:
    """One word for an operator: ``draining``, ``auth_failed``, ``unreachable``, ``loading``,
    ``unavailable``, ``open``, ``half-open``, ``stale`` or ``ok``."""
    if ep.draining:
        return "draining"
    if ep.auth_failed:
        return "auth_failed"  # (the replica refuses the key the gateway sends it: fix the config)
    if ep.down and ep.unreachable:
        return "unreachable"
    problem = getattr(ep, "scrape_problem", None)
    if ep.down and isinstance(problem, EngineUnavailable):
        return problem.state  # (its engine answers its scrapes 503: loading its model, or unavailable)
    b = breaker_state(ep)
    if b == "open":
        return "open"
    if b == "half_open":
        return "half-open"
    if ep.stale:
        return "stale"
    return "ok"


def _num(v: Any) -> float | None:
    """A finite float, else ``None`` (absent: None, NaN, a missing attribute)."""
    if v is None or isinstance(v, bool):
        return None
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _call(obj: Any, name: str) -> Any:
    fn = getattr(obj, name, None)
    if not callable(fn):
        return None
    try:
        return fn()
    except Exception:
        log.exception("reading %s.%s() for the admin API failed; leaving it out", type(obj).__name__, name)
        return None


def score_inputs(ep: Any) -> dict[str, Any]:
    """What routing scores the replica on beyond the engine gauges (docs/routing.md §1, §2).

    Read defensively from ``ep.state`` (the routing layer's ``EndpointState``):
    fields it does not have are ``null``.
    """
    st = getattr(ep, "state", None)
    return {
        "latency_s": _num(getattr(ep, "latency", None)),
        "capacity": _num(_call(st, "capacity")),
        "slots": _num(getattr(st, "slots", None)),
        "max_running": _num(getattr(st, "max_running", None)),
        "seen_full": getattr(st, "seen_full", None),
        "load": _num(_call(st, "load")),
        "dispatched_since_scrape": getattr(st, "dispatched_since_scrape", None),
        "completed_since_scrape": getattr(st, "completed_since_scrape", None),
    }


def endpoint_view(ep: Endpoint, now: float | None = None) -> dict[str, Any]:
    """A replica as the API shows it: identity, live state and what routing scores it on.

    Engine numbers (``waiting``, ``running``, ``kv_cache_usage``) are the fresh
    ones routing uses: ``null`` when absent or stale, never 0.
    """
    now = time.monotonic() if now is None else now
    waiting, running, kv = ep.fresh()
    last = ep.last_scrape
    cfg = ep.cfg
    return {
        "id": ep.id,
        "url": cfg.url,
        "models": list(ep.models),
        "engine": cfg.engine,
        "pool": cfg.pool,
        "deployment": cfg.deployment,
        "node": cfg.node,
        "state": endpoint_state(ep),
        "draining": ep.draining,
        "inflight": ep.inflight,
        "completed": ep.completed,
        "failures": ep.failures,
        "consecutive_failures": ep.consecutive_failures,
        "waiting": waiting,
        "running": running,
        "kv_cache_usage": kv,
        "drain_rate": _num(getattr(ep, "drain_rate", None)),
        "breaker": breaker_state(ep),
        "auth_failed": bool(getattr(ep, "auth_failed", False)),
        "usable": getattr(ep, "usable", None),
        # why not (replica_py.UNUSABLE_REASONS: draining, unreachable, stale,
        # breaker_open, breaker_probing; and the poller's loading, unavailable), null when usable
        "unusable_reason": ep.unusable_reason(now),
        "down": getattr(ep, "down", None),
        "score_inputs": score_inputs(ep),
        "stale": ep.stale,
        "scraped": ep.engine.scraped,
        "last_scrape_age_s": round(now - last, 3) if last is not None else None,
        "scrape": {
            "ok": ep.scrape_ok,
            "failed": ep.scrape_failures,
            "failing": getattr(ep, "scrape_failing", None),
            "seconds": round(ep.scrape_seconds, 6),
            "problem": ep.scrape_problem,
        },
    }


def _lines(req: Request) -> int:
    """``?lines=N`` (1 to :data:`MAX_LOG_LINES`, default 100)."""
    target = req.target
    q = target.find(b"?")
    raw: bytes | None = None
    if q >= 0:
        for part in target[q + 1:].split(b"&"):
            k, _, v = part.partition(b"=")
            if k == b"lines":
                raw = v
    if raw is None:
        return 100
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_LOG_LINES:
        raise BadRequestError(
            f"lines must be a whole number from 1 to {MAX_LOG_LINES}, got {raw[:20].decode('latin-1')!r}",
            param="lines", code="invalid_lines",
        )
    return int(raw)
def _truthy(req: Request, name: str) -> bool:
    target = req.target
    q = target.find(b"?")
    if q < 0:
        return False
    for part in target[q + 1:].split(b"&"):
        k, _, v = part.partition(b"=")
        if k.decode("latin-1") == name:
            return v.lower() in (b"", b"1", b"true", b"yes")
    return False


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise BadRequestError(
                    f"the body gives {key!r} more than once; give each field once", param=key, code="invalid_json"
                )
            seen.add(key)
    return out


def json_body(req: Request, empty: str = "the request needs a JSON body") -> Any:
    """The request's JSON body, each object's keys given once.

    RFC 8259 leaves an object with a repeated name to each parser; a management
    call that names ``api_key`` twice must not be guessed at (orjson keeps the
    last), so it is a 400 naming the field.

    Raises:
        BadRequestError: no body (``empty`` says what to send), not JSON, or a key repeated.
    """
    if not req.body:
        raise BadRequestError(empty, code="invalid_json")
    try:
        body = orjson.loads(req.body)
    except orjson.JSONDecodeError as exc:
        raise BadRequestError(f"the body is not valid JSON ({exc})", code="invalid_json") from None
    if isinstance(body, (dict, list)) and req.body.count(b":") > 1:
        # (valid JSON already: the standard parser only looks for repeated keys)
        json.loads(req.body, object_pairs_hook=_unique_keys)
    return body


def parse_endpoint(body: Any, default_engine: str) -> EndpointConfig:
    """Validate a config ``endpoints[]`` entry given over the API.

    Raises:
        BadRequestError: naming the offending key.
    """
    if not isinstance(body, dict):
        raise BadRequestError("the body must be a JSON object like a config endpoints[] entry", code="invalid_endpoint")
    if "api_key_env" in body:
        # SECURITY: an API caller must not make the gateway read its own environment
        # and send the value to a URL of the caller's choosing.
        raise BadRequestError(
            "api_key_env is not accepted over the API; give api_key, or put the endpoint in the config file and reload",
            param="api_key_env",
            code="invalid_endpoint",
        )
    try:
        cfg = load({"endpoints": [body], "scrape": {"default_engine": default_engine}})
    except ConfigError as exc:
        key = exc.key.removeprefix("endpoints[0].").removeprefix("endpoints[0]")
        where = f"{key}: " if key else ""
        raise BadRequestError(f"{where}{exc.message}", param=key or None, code="invalid_endpoint") from None
    return cfg.endpoints[0]


def reload_answer(fleet: FleetControl, trigger: str) -> dict[str, Any]:
    """Reload through ``fleet`` (``trigger``: ``api``, ``sighup``, ...); the answer to ``POST /admin/v1/reload``.

    Raises:
        HTTPError: 400 ``invalid_config`` (the file is invalid; nothing changed),
            409 (a conflict with endpoints added at run time), 503 (not running).
    """
    try:
        summary = fleet.reload(trigger=trigger)
    except ConfigError as exc:
        raise BadRequestError(
            f"reload failed, the running configuration is kept: {exc}", code="invalid_config"
        ) from exc
    except ValueError as exc:
        raise conflict(f"reload failed, the running configuration is kept: {exc}") from exc
    except RuntimeError as exc:
        raise HTTPError(str(exc), status=503, type="service_unavailable_error", code="service_unavailable") from exc
    return {"reloaded": True, **summary}


class ManagementAPI:
    """Routes under ``/admin/v1/`` (the admin app checks the token first).

    Args:
        registry: the replicas (read per request, so changes show).
        fleet: the process's operations; every change goes through them.
        config: the running configuration (called per request: a reload swaps it).
        observer: the data path's counters (admission decisions for the queues view).
        admission: another admission controller to read queues from instead of
            the registry (:func:`~llmgw.admin.metrics.admission_source`).
    """

    def __init__(
        self,
        *,
        registry: Registry,
        fleet: FleetControl,
        config: Callable[[], Config],
        observer: PrometheusObserver,
        admission: object | None = None,
    ) -> None:
        self.registry = registry
        self.fleet = fleet
        self.config = config
        self.observer = observer
        self.admission = admission
        self.nodes: NodeControl | None = None
        """The control plane's nodes (attached by the control plane when it starts)."""
        self.deployments: DeploymentControl | None = None
        """The control plane's deployments (attached likewise)."""
        self.tokens: TokenControl | None = None
        """The control plane's API-made join tokens (attached likewise)."""

    def _endpoint(self, endpoint_id: str) -> Endpoint:
        ep: Endpoint | None = self.registry.endpoints.get(endpoint_id)
        if ep is None:
            raise NotFoundError(
                f"no endpoint {endpoint_id!r}; llmgw ctl endpoints (GET /admin/v1/endpoints) lists them", param="id", code="endpoint_not_found"
            )
        return ep

    def handle(self, req: Request, w: ResponseWriter) -> Awaitable[None] | None:
        path = req.path.rstrip(b"/")
        method = req.method
        parts = path[len(PREFIX):].split(b"/") if path.startswith(PREFIX) else []
        if parts[:1] == [b"endpoints"]:
            if len(parts) == 1:
                if method in (b"GET", b"HEAD"):
                    self.list_endpoints(w)
                    return None
                if method == b"POST":
                    self.add_endpoint(req, w)
                    return None
                raise method_not_allowed(method, path, "GET or POST")
            endpoint_id = unquote(parts[1].decode("latin-1"))
            if len(parts) == 2:
                if method in (b"GET", b"HEAD"):
                    w.send_json(200, endpoint_view(self._endpoint(endpoint_id)))
                    return None
                if method == b"DELETE":
                    self.remove_endpoint(endpoint_id, w)
                    return None
                raise method_not_allowed(method, path, "GET or DELETE")
            if len(parts) == 3 and parts[2] in (b"drain", b"undrain"):
                if method != b"POST":
                    raise method_not_allowed(method, path, "POST")
                self.set_draining(endpoint_id, parts[2] == b"drain", w)
                return None
        elif parts == [b"reload"]:
            if method != b"POST":
                raise method_not_allowed(method, path, "POST")
            w.send_json(200, self.reload("api"))
            return None
        elif parts[:1] in ([b"nodes"], [b"gpus"]):
            return self.handle_nodes(parts, method, path, w)
        elif parts[:1] == [b"deployments"]:
            return self.handle_deployments(req, parts, method, path, w)
        elif parts[:1] == [b"join-tokens"]:
            return self.handle_tokens(req, parts, method, path, w)
        elif parts == [b"queues"]:
            if method not in (b"GET", b"HEAD"):
                raise method_not_allowed(method, path, "GET")
            w.send_json(200, self.queues())
            return None
        raise NotFoundError(
            f"no admin route {path.decode('latin-1')[:200]}; routes: {', '.join(ROUTES)}"
        )

    # -- nodes (the control plane) --

    def handle_nodes(self, parts: list[bytes], method: bytes, path: bytes, w: ResponseWriter) -> Awaitable[None] | None:
        nodes = self.nodes
        if nodes is None:
            raise NotFoundError(
                "this llmgw runs no control plane (add a control: section to the config); no nodes here",
                code="no_control_plane",
            )
        _refuse_on_standby(nodes)
        if parts == [b"gpus"]:
            if method not in (b"GET", b"HEAD"):
                raise method_not_allowed(method, path, "GET")
            w.send_json(200, {"gpus": nodes.list_gpus()})
            return None
        if len(parts) == 1:
            if method not in (b"GET", b"HEAD"):
                raise method_not_allowed(method, path, "GET")
            w.send_json(200, {"nodes": nodes.list_nodes()})
            return None
        name = unquote(parts[1].decode("latin-1"))
        missing = NotFoundError(
            f"no node {name!r}; llmgw ctl nodes (GET /admin/v1/nodes) lists them", param="name", code="node_not_found"
        )
        if len(parts) == 2:
            if method == b"DELETE":
                return self._forget_node(nodes, name, missing, w)
            if method not in (b"GET", b"HEAD"):
                raise method_not_allowed(method, path, "GET or DELETE")
            view = nodes.node(name)
            if view is None:
                raise missing
            w.send_json(200, view)
            return None
        if len(parts) == 3 and parts[2] in (b"cordon", b"uncordon"):
            if method != b"POST":
                raise method_not_allowed(method, path, "POST")
            return self._set_cordoned(nodes, name, parts[2] == b"cordon", missing, w)
        raise NotFoundError(f"no admin route {path.decode('latin-1')[:200]}; routes: {', '.join(ROUTES)}")

    @staticmethod
    async def _forget_node(nodes: NodeControl, name: str, missing: HTTPError, w: ResponseWriter) -> None:
        view = await nodes.forget_node(name)
        if view is None:
            raise missing
        w.send_json(200, {"forgotten": view})

    @staticmethod
    async def _set_cordoned(nodes: NodeControl, name: str, cordoned: bool, missing: HTTPError, w: ResponseWriter) -> None:
        view = await nodes.set_cordoned(name, cordoned)
        if view is None:
            raise missing
        w.send_json(200, view)
    def handle_replicas(self, req: Request, w: ResponseWriter) -> Awaitable[None]:
        """``/admin/v1/replicas/...`` (answered asynchronously: the node is asked)."""
        path = req.path.rstrip(b"/")
        parts = path[len(PREFIX):].split(b"/")
        if len(parts) != 3 or parts[0] != b"replicas" or parts[2] != b"logs" or not parts[1]:
            raise NotFoundError(f"no admin route {path.decode('latin-1')[:200]}; routes: {', '.join(ROUTES)}")
        if req.method not in (b"GET", b"HEAD"):
            raise method_not_allowed(req.method, path, "GET")
        replica_id = unquote(parts[1].decode("latin-1"))
        lines = _lines(req)
        nodes = self.nodes
        if nodes is None:
            raise NotFoundError(
                "this llmgw runs no control plane (add a control: section to the config); no replicas here",
                code="no_control_plane",
            )
        _refuse_on_standby(nodes)
        return self._replica_logs(nodes, replica_id, lines, w)

    def handle_engine_check(self, req: Request, w: ResponseWriter) -> Awaitable[None]:
        """``POST /admin/v1/nodes/{name}/engine-check`` (answered once the node's agent has run the checks)."""
        path = req.path.rstrip(b"/")
        parts = path[len(PREFIX):].split(b"/")
        if len(parts) != 3 or not parts[1]:
            raise NotFoundError(f"no admin route {path.decode('latin-1')[:200]}; routes: {', '.join(ROUTES)}")
        if req.method != b"POST":
            raise method_not_allowed(req.method, path, "POST")
        nodes = self.nodes
        if nodes is None:
            raise NotFoundError(
                "this llmgw runs no control plane (add a control: section to the config); no nodes here",
                code="no_control_plane",
            )
        _refuse_on_standby(nodes)
        body = json_body(req) if req.body else {}
        if not isinstance(body, dict):
            raise BadRequestError("the body must be a JSON object", code="invalid_body")
        engine = body.get("engine")
        if engine not in ("vllm", "llamacpp", "trtllm", "sglang"):
            raise BadRequestError("engine must be one of vllm, llamacpp, trtllm, sglang", param="engine",
                                  code="invalid_engine")
        model = body.get("model")
        if model is not None and (not isinstance(model, str) or not model or len(model) > 1024):
            raise BadRequestError("model must be a path or a model id (a non-empty string)", param="model",
                                  code="invalid_model")
        static = body.get("static", False)
        if not isinstance(static, bool):
            raise BadRequestError("static must be true or false", param="static", code="invalid_static")
        timeout = body.get("timeout", 600)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 1 <= timeout <= 86_400:
            raise BadRequestError("timeout must be seconds from 1 to 86400", param="timeout", code="invalid_timeout")
        return self._engine_check(nodes, unquote(parts[1].decode("latin-1")), engine, model, static, float(timeout), w)

    async def _engine_check(self, nodes: NodeControl, node: str, engine: str, model: str | None, static: bool,
                            timeout: float, w: ResponseWriter) -> None:
        try:
            checks = await nodes.engine_check(node, engine, model=model, static_only=static, timeout=timeout)
        except Exception as exc:
            status = getattr(exc, "status", None)
            if status is None:
                raise
            raise HTTPError(
                str(exc), status=status, type="invalid_request_error" if status < 500 else "server_error",
                code=getattr(exc, "code", None), param="name" if status == 404 else None,
            ) from None
        w.send_json(200, {"node": node, "engine": engine, "ok": not any(c.get("status") == "fail" for c in checks),
                          "checks": checks})

    async def _replica_logs(self, nodes: NodeControl, replica_id: str, lines: int, w: ResponseWriter) -> None:
        try:
            text = await nodes.replica_logs(replica_id, lines)
        except Exception as exc:
            status = getattr(exc, "status", None)
            if status is None:
                raise
            raise HTTPError(
                str(exc), status=status, type="invalid_request_error" if status < 500 else "server_error",
                code=getattr(exc, "code", None), param="id" if status == 404 else None,
            ) from None
        w.send_json(200, {"replica": replica_id, "node": nodes.node_of_replica(replica_id), "lines": lines,
                          "text": text})

    # -- deployments (the control plane) --

    def handle_deployments(
        self, req: Request, parts: list[bytes], method: bytes, path: bytes, w: ResponseWriter
    ) -> Awaitable[None] | None:
        """``/admin/v1/deployments...``; a change is answered once it is in the control plane's database."""
        if self.nodes is not None:
            _refuse_on_standby(self.nodes)  # (a standby holds no deployments: the leader does)
        ctl = self.deployments
        if ctl is None:
            raise NotFoundError(
                "this llmgw runs no control plane (add a control: section to the config); no deployments here",
                code="no_control_plane",
            )
        show = _truthy(req, "show_secrets")
        try:
            if len(parts) == 1:
                if method in (b"GET", b"HEAD"):
                    w.send_json(200, {"deployments": ctl.list_views(show_secrets=show)})
                    return None
                if method == b"POST":
                    from ..control.deployments import parse_deployment

                    return _committed(ctl, w, 201, ctl.create(parse_deployment(json_body(req))))
                raise method_not_allowed(method, path, "GET or POST")
            name = unquote(parts[1].decode("latin-1"))
            if len(parts) == 2:
                if method in (b"GET", b"HEAD"):
                    w.send_json(200, ctl.view(name, show_secrets=show))
                    return None
                if method == b"DELETE":
                    return _committed(ctl, w, 200, ctl.delete(name))
                if method == b"PUT":
                    from ..control.deployments import parse_deployment

                    body = json_body(req)
                    if isinstance(body, dict):
                        given = body.setdefault("name", name)
                        if given != name:
                            raise BadRequestError(
                                f"the body names deployment {str(given)[:100]!r}, the path {name[:100]!r}: "
                                "they must be the same (a deployment is not renamed)",
                                param="name", code="name_mismatch",
                            )
                    return _committed(ctl, w, 200, ctl.update(parse_deployment(body)))
                raise method_not_allowed(method, path, "GET, PUT or DELETE")
            if len(parts) == 3 and parts[2] == b"scale":
                if method != b"POST":
                    raise method_not_allowed(method, path, "POST")
                body = json_body(req)
                n = body.get("replicas") if isinstance(body, dict) else None
                if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= 1024:
                    raise BadRequestError(
                        'the body must be {"replicas": N} with N a whole number from 0 to 1024',
                        param="replicas", code="invalid_replicas",
                    )
                return _committed(ctl, w, 200, ctl.scale(name, n))
        except ValueError as exc:
            status = getattr(exc, "status", None)
            if status is None:
                raise
            raise HTTPError(
                str(exc), status=status, type="invalid_request_error", code=getattr(exc, "code", None),
                param=getattr(exc, "param", None),
            ) from None
        raise NotFoundError(f"no admin route {path.decode('latin-1')[:200]}; routes: {', '.join(ROUTES)}")

    # -- join tokens (the control plane) --

    def handle_tokens(
        self, req: Request, parts: list[bytes], method: bytes, path: bytes, w: ResponseWriter
    ) -> Awaitable[None]:
        """``/admin/v1/join-tokens...``: reads on any control plane (from the database), changes on the leader."""
        tokens = self.tokens
        if tokens is None:
            raise NotFoundError(
                "this llmgw runs no control plane (add a control: section to the config); no join tokens here",
                code="no_control_plane",
            )
        if len(parts) == 1:
            if method in (b"GET", b"HEAD"):
                return _send(w, 200, tokens.list_tokens())
            if method == b"POST":
                if self.nodes is not None:
                    _refuse_on_standby(self.nodes)
                name, expires = _token_body(json_body(req) if req.body else {})
                return _send(w, 201, tokens.create_token(name, expires))
            raise method_not_allowed(method, path, "GET or POST")
        if len(parts) == 2:
            token_id = unquote(parts[1].decode("latin-1"))
            if method != b"DELETE":
                raise method_not_allowed(method, path, "DELETE")
            if self.nodes is not None:
                _refuse_on_standby(self.nodes)
            return self._revoke_token(tokens, token_id, w)
        raise NotFoundError(f"no admin route {path.decode('latin-1')[:200]}; routes: {', '.join(ROUTES)}")

    @staticmethod
    async def _revoke_token(tokens: TokenControl, token_id: str, w: ResponseWriter) -> None:
        view = await tokens.revoke_token(token_id)
        if view is None:
            raise NotFoundError(f"no join token {token_id[:40]!r}; llmgw ctl tokens list (GET /admin/v1/join-tokens) lists them",
                                param="id", code="token_not_found")
        w.send_json(200, view)

    def reload(self, trigger: str) -> dict[str, Any]:
        """Re-read the config file (:func:`reload_answer`)."""
        return reload_answer(self.fleet, trigger)

    # -- endpoints --

    def list_endpoints(self, w: ResponseWriter) -> None:
        now = time.monotonic()
        eps = [endpoint_view(ep, now) for ep in list(self.registry.endpoints.values())]
        w.send_json(200, {"endpoints": eps})

    def add_endpoint(self, req: Request, w: ResponseWriter) -> None:
        cfg = parse_endpoint(json_body(req), self.config().scrape.default_engine)
        try:
            self.fleet.add_endpoint(cfg)
        except ValueError as exc:
            raise conflict(f"{exc}; remove it first or choose another id", code="endpoint_exists") from None
        w.send_json(201, endpoint_view(self._endpoint(cfg.id)))

    def remove_endpoint(self, endpoint_id: str, w: ResponseWriter) -> None:
        ep = self._endpoint(endpoint_id)
        inflight = ep.inflight
        self.fleet.remove_endpoint(endpoint_id)
        w.send_json(200, {"removed": endpoint_id, "inflight": inflight})

    def set_draining(self, endpoint_id: str, draining: bool, w: ResponseWriter) -> None:
        ep = self._endpoint(endpoint_id)
        changed = ep.draining != draining
        if changed:
            self.fleet.set_draining(endpoint_id, draining)
        view = endpoint_view(ep)
        view["changed"] = changed
        w.send_json(200, view)

    # -- queues --

    def queues(self) -> dict[str, Any]:
        """Admission queues: depth per band (and per model), decisions so far, pool saturation."""
        depths = read_mapping(admission_source(self.registry, self.admission), "queue_depths")
        per_model = self._model_depths()
        counts = self.observer.admission_counts()
        bands: list[dict[str, Any]] = []
        for band in dict.fromkeys([*(depths or {}), *counts]):
            row: dict[str, Any] = {"band": band, "depth": int((depths or {}).get(band, 0))}
            if band in per_model:
                row["models"] = per_model[band]
            row["decisions"] = counts.get(band, {})
            bands.append(row)
        return {
            "admission": depths is not None,
            "bands": bands,
            "pool_saturation": pool_saturations(self.registry, self.admission),
        }

    def _model_depths(self) -> dict[str, dict[str, int]]:
        """Band -> model -> queued, from ``registry.pools[model].queue.depth(i)`` (empty if not there)."""
        pools = self.registry.pools
        bands = self.registry.config.admission.bands
        out: dict[str, dict[str, int]] = {}
        if not pools or not bands:
            return out
        try:
            for model, pool in pools.items():
                for i, band in enumerate(bands):
                    n = int(pool.queue.depth(i))
                    if n:
                        out.setdefault(band, {})[model] = n
        except Exception:
            log.exception("reading the admission queues per model failed; leaving them out")
            return {}
        return out


def _refuse_on_standby(nodes: NodeControl) -> None:
    """503 ``not_leader`` on a control-plane standby (it has no nodes or deployments: the leader has), naming
    the leader in ``llmgw-leader``."""
    standby = nodes.not_leader()
    if standby is None:
        return
    leader = nodes.leader_admin()
    raise HTTPError(
        standby, status=503, type="service_unavailable_error", code="not_leader", retry_after=1,
        headers=((b"llmgw-leader", leader.encode()),) if leader else None,
    )


async def _committed(ctl: DeploymentControl, w: ResponseWriter, status: int, body: dict[str, Any]) -> None:
    """Answer a deployment change once the database has it (a 503 when it could not be written)."""
    try:
        await ctl.committed()
    except Exception as exc:
        from ..control.db import DatabaseError
        from ..control.leader import NotLeader

        if isinstance(exc, NotLeader):
            raise HTTPError(
                f"{exc}; the change was not saved: retry with the leader", status=503, type="service_unavailable_error",
                code="not_leader", retry_after=1,
            ) from None
        if isinstance(exc, DatabaseError):
            raise HTTPError(
                f"the control plane's database failed ({exc}); the change was not saved: retry",
                status=503, type="service_unavailable_error", code="database_unavailable", retry_after=1,
            ) from None
        raise
    w.send_json(status, body)


async def _send(w: ResponseWriter, status: int, answer: Awaitable[dict[str, Any]]) -> None:
    w.send_json(status, await answer)


def _token_body(body: Any) -> tuple[str | None, float | None]:
    """``(name, expires in seconds)`` from ``{"name": ..., "expires": "7d"}`` (both optional)."""
    from ..control.tokens import MAX_NAME, parse_expiry

    if not isinstance(body, dict) or set(body) - {"name", "expires"}:
        raise BadRequestError('the body must be {"name": "...", "expires": "7d"} (both optional)',
                              code="invalid_token_request")
    name = body.get("name")
    if name is not None and (not isinstance(name, str) or not name or len(name) > MAX_NAME
                             or not name.isprintable()):
        raise BadRequestError(f"name: 1-{MAX_NAME} printable characters", param="name", code="invalid_token_request")
    try:
        expires = parse_expiry(body.get("expires"))
    except ValueError as exc:
        raise BadRequestError(str(exc), param="expires", code="invalid_token_request") from None
    return name, expires
