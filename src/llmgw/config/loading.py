"""Loading ``llmgw.yaml``: :func:`load`, :func:`load_file`, :func:`serve_problems`, :func:`find_config`.

The validated input (:mod:`llmgw.config.model`'s ``_ConfigIn``) is compiled
into the :class:`Config` the rest of llmgw reads; the checks that span keys or
entries (duplicate ids, aliases clashing with served models, a timeout longer
than its interval, ...) are made here, on the raw document where an entry with
a bad value would otherwise hide them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..engines import get as get_engine
from ..errors import ConfigError, ConfigProblem
from ._problems import _FAILED, _document, _either, _Problems, _secret_of, _section
from ._yaml import _read_yaml
from .model import (
    DEFAULT_ADMIN,
    DEFAULT_LISTEN,
    AccessLogConfig,
    AdmissionConfig,
    AuthConfig,
    BreakerConfig,
    ClientKey,
    Config,
    ControlConfig,
    DeploymentConfig,
    EndpointConfig,
    FollowConfig,
    ModelConfig,
    RetryConfig,
    RoutingConfig,
    SaturationConfig,
    ScrapeConfig,
    ServerConfig,
    UpstreamConfig,
    _ConfigIn,
)


def _scrape(problems: _Problems, sc: ScrapeConfig, raw: Mapping[str, Any]) -> ScrapeConfig:
    timeout = sc.timeout if "timeout" in raw else min(sc.timeout, sc.interval * 0.8)
    stale_after = sc.stale_after if "stale_after" in raw else max(sc.stale_after, sc.interval * 3)
    if timeout >= sc.interval:
        problems.add(("scrape", "timeout"), f"must be shorter than scrape.interval ({sc.interval:g}s)")
    if stale_after < sc.interval:
        problems.add(("scrape", "stale_after"), f"must be at least scrape.interval ({sc.interval:g}s)")
    return dataclasses.replace(sc, timeout=timeout, stale_after=stale_after)


def _admission(problems: _Problems, ad: AdmissionConfig, raw: Mapping[str, Any]) -> AdmissionConfig:
    bands = ad.bands
    if "default_band" not in raw and ad.default_band not in bands:
        ad = dataclasses.replace(ad, default_band=bands[len(bands) // 2])
    if ad.default_band not in bands:
        problems.add(("admission", "default_band"), f"{ad.default_band!r} is not one of the bands ({', '.join(bands)})")
    return ad


def _breaker(problems: _Problems, br: BreakerConfig, raw: Mapping[str, Any]) -> BreakerConfig:
    if "max_cooldown" not in raw:
        br = dataclasses.replace(br, max_cooldown=max(br.max_cooldown, br.cooldown))
    if br.max_cooldown < br.cooldown:
        problems.add(("breaker", "max_cooldown"), "must be at least breaker.cooldown")
    return br


def _raw_models(item: Any) -> list[str]:
    if not isinstance(item, Mapping):
        return []
    models = item.get("models")
    if isinstance(models, list):
        return [m for m in models if isinstance(m, str)]
    model = item.get("model")
    return [str(model)] if isinstance(model, (str, int, float)) and not isinstance(model, bool) else []


def _endpoints(
    problems: _Problems, validated: Any, raw: Any, default_engine: str
) -> tuple[EndpointConfig, ...] | None:
    """``endpoints[]``; the checks across keys and entries look at the raw entries so they run even
    when some entry has a bad value."""
    if not isinstance(raw, list):
        return None if validated is _FAILED else ()
    seen_ids: dict[str, int] = {}
    for i, item in enumerate(raw):
        if not isinstance(item, Mapping):
            continue
        if "model" in item and "models" in item:
            problems.add(("endpoints", i, "models"), "give either model or models, not both")
        elif "model" not in item and "models" not in item:
            problems.add(("endpoints", i, "model"), "is required")
        _either(problems, item, ("endpoints", i), "api_key", "api_key_env")
        ep_id = item.get("id")
        if isinstance(ep_id, str):
            if ep_id in seen_ids:
                problems.add(("endpoints", i, "id"), f"duplicate id {ep_id!r} (also endpoints[{seen_ids[ep_id]}])")
            else:
                seen_ids[ep_id] = i
    if validated is _FAILED:
        return None
    out = []
    for e in validated:
        models = e.models or ((e.model,) if e.model is not None else ())
        if not models:
            continue
        engine = e.engine or default_engine
        names = {
            sig: v
            for sig in ("waiting", "running", "kv_cache_usage")
            if (v := getattr(e.metric_names, sig)) is not None
        }
        out.append(
            EndpointConfig(
                id=e.id,
                url=e.url.url,
                models=models,
                engine=engine,
                pool=e.pool,
                api_key=_secret_of(e.api_key, e.api_key_env),
                metrics_path=e.metrics_path or get_engine(engine).metrics_path,
                metric_names=names,
                draining=e.draining,
                slots=e.slots or None,
                scheme=e.url.scheme,
                host=e.url.host,
                port=e.url.port,
                base_path=e.url.base_path,
            )
        )
    return tuple(out)


def _models(problems: _Problems, validated: Any, raw_endpoints: Any) -> dict[str, ModelConfig]:
    if validated is _FAILED:
        return {}
    # Served names from the raw entries: an endpoint with a bad url still serves its model.
    served = {m for item in (raw_endpoints if isinstance(raw_endpoints, list) else ()) for m in _raw_models(item)}
    out: dict[str, ModelConfig] = {}
    alias_owner: dict[str, str] = {}
    for name, m in validated.items():
        if name not in served:
            problems.add(("models", name), f"no endpoint serves model {name!r}; add one under endpoints: or remove this entry")
        for a in m.aliases:
            if a in served:
                problems.add(("models", name, "aliases"), f"{a!r} is already a served model name")
            elif a in alias_owner:
                problems.add(("models", name, "aliases"), f"{a!r} is already an alias of {alias_owner[a]!r}")
            else:
                alias_owner[a] = name
        out[name] = ModelConfig(name=name, aliases=m.aliases, strategy=m.strategy, upstream_name=m.upstream_name)
    return out


def _scalar_text(v: Any) -> str | None:
    """A YAML scalar as the schema reads a name (a number is its text); ``None`` for anything else."""
    return None if isinstance(v, bool) or not isinstance(v, (str, int, float)) else str(v)


def _auth(problems: _Problems, validated: Any, raw: Any, bands: tuple[str, ...] | None) -> AuthConfig:
    raw_keys = raw.get("api_keys") if isinstance(raw, Mapping) else None
    for i, item in enumerate(raw_keys if isinstance(raw_keys, list) else ()):
        if isinstance(item, Mapping) and sum(k in item for k in ("key", "key_env", "key_sha256")) != 1:
            problems.add(("auth", "api_keys", i, "key"), "give exactly one of key, key_env or key_sha256")
        # (read from the file as written: one entry's bad key fails the whole section's validation, and
        # every problem is said in one pass)
        # (a YAML number is a name to the schema, as a model's may be: "max_band: 2" read as a position
        # must be refused here, not quietly match no band)
        named = {n: _scalar_text(item.get(n)) for n in ("band", "max_band")} if isinstance(item, Mapping) else {}
        for name, band in named.items():
            if band is not None and bands is not None and band not in bands:
                problems.add(("auth", "api_keys", i, name),
                             f"unknown band {band!r}; admission.bands is {', '.join(bands)} (name one of them)")
        band, top = named.get("band"), named.get("max_band")
        if (bands is not None and band is not None and top is not None and band in bands
                and top in bands and bands.index(band) < bands.index(top)):
            problems.add(("auth", "api_keys", i, "band"),
                         f"{band!r} is above the key's max_band {top!r} (bands are highest first: "
                         f"{', '.join(bands)}): lower band, or raise max_band")
    if validated is _FAILED:
        return AuthConfig()
    keys: list[ClientKey] = []
    seen: set[bytes] = set()
    for i, k in enumerate(validated.api_keys):
        given = [n for n in ("key", "key_env", "key_sha256") if getattr(k, n) is not None]
        if len(given) != 1:
            continue
        if k.key_sha256 is not None:
            digest = k.key_sha256
        else:
            secret = _secret_of(k.key, k.key_env)
            assert secret is not None
            digest = hashlib.sha256(secret.encode()).digest()
        loc = ("auth", "api_keys", i)
        if digest in seen:
            problems.add((*loc, given[0]), "the same key is listed twice")
        seen.add(digest)
        keys.append(ClientKey(name=k.name or f"key{i}", sha256=digest, band=k.band, max_band=k.max_band))
    return AuthConfig(keys=tuple(keys))


def _control(problems: _Problems, c: Any, raw: Any) -> ControlConfig | None:
    _either(problems, raw, ("control",), "join_token", "join_token_env")
    _either(problems, raw, ("control",), "database", "database_env")
    _either(problems, raw, ("control",), "router_token", "router_token_env")
    if c is _FAILED or c is None:
        return None
    grace = c.heartbeat_grace if c.heartbeat_grace is not None else 3 * c.heartbeat_interval
    if grace < c.heartbeat_interval:
        problems.add(
            ("control", "heartbeat_grace"), f"must be at least control.heartbeat_interval ({c.heartbeat_interval:g}s)"
        )
    if (c.tls_cert is None) != (c.tls_key is None):
        missing = "tls_key" if c.tls_key is None else "tls_cert"
        problems.add(("control", missing), "is required with " + ("tls_cert" if missing == "tls_key" else "tls_key"))
    if c.tls_client_ca is not None and c.tls_cert is None:
        problems.add(("control", "tls_client_ca"), "needs tls_cert and tls_key (mutual TLS is TLS first)")
    if c.state_file is not None and (c.database is not None or c.database_env is not None):
        problems.add(("control", "state_file"), "is not used with control.database (cordons are kept in the database; "
                     "state_file only places the default SQLite file): remove state_file")
    database = c.database_env.value if c.database_env else c.database
    if database is not None:
        from ..control.dburl import check_database_url

        why = check_database_url(database)
        if why is not None:
            problems.add(("control", "database_env" if c.database_env else "database"), why)
    tokens = tuple(e.value for e in c.join_token_env) if c.join_token_env else (c.join_token or ())
    if not tokens:
        # (checked with the rest of the file, so that a reload that drops the last token is refused with the
        # running configuration kept, instead of every agent being refused at its next heartbeat)
        problems.add(("control",), "the control plane needs a join token for agents: set control.join_token_env "
                     "(the name of an environment variable holding it) or control.join_token")
    routers = tuple(e.value for e in c.router_token_env) if c.router_token_env else (c.router_token or ())
    return ControlConfig(
        listen=c.listen, join_tokens=tokens, router_tokens=routers, heartbeat_interval=c.heartbeat_interval,
        heartbeat_grace=grace, database=database, database_wait=c.database_wait, lease=c.lease, advertise=c.advertise,
        state_file=c.state_file, tls_cert=c.tls_cert, tls_key=c.tls_key, tls_client_ca=c.tls_client_ca,
        allow_insecure=c.allow_insecure, grpc_server=c.grpc_server,
    )


def _follow(problems: _Problems, f: Any, raw: Any, control: Any) -> FollowConfig | None:
    _either(problems, raw, ("follow",), "token", "token_env")
    if f is _FAILED or f is None:
        return None
    if control is not None:
        problems.add(("follow",), "cannot be used together with control: a control plane routes to its own "
                     "deployments' replicas; run the router that follows it as a separate llmgw serve")
    token = f.token_env.value if f.token_env else f.token
    if token is None:
        problems.add(("follow",), "needs the router token: token_env: NAME (or token:), control.router_token "
                     "of the control planes")
    if (f.tls_cert is None) != (f.tls_key is None):
        missing = "tls_key" if f.tls_key is None else "tls_cert"
        problems.add(("follow", missing), "is required with " + ("tls_cert" if missing == "tls_key" else "tls_key"))
    tls = f.tls or f.tls_ca is not None or f.tls_cert is not None
    if not tls and not f.allow_plaintext:
        away = [h for h, _ in f.control if not is_loopback(h)]
        if away:
            problems.add(
                ("follow", "control"),
                f"{away[0]} is not a loopback address and follow has no TLS: the replica table (with every "
                "replica's API key) and the router token would travel in the clear; set follow.tls_ca (or "
                "follow.tls: true), or follow.allow_plaintext: true on a network you trust",
            )
    return FollowConfig(
        control=f.control, token=token, tls=tls, tls_ca=f.tls_ca, tls_cert=f.tls_cert, tls_key=f.tls_key,
        allow_plaintext=f.allow_plaintext, name=f.name,
    )


def _deployments(problems: _Problems, validated: Any, raw: Any) -> tuple[DeploymentConfig, ...]:
    seen: dict[str, int] = {}
    for i, item in enumerate(raw if isinstance(raw, list) else ()):
        name = item.get("name") if isinstance(item, Mapping) else None
        if isinstance(name, str):
            if name in seen:
                problems.add(("deployments", i, "name"), f"duplicate name {name!r} (also deployments[{seen[name]}])")
            else:
                seen[name] = i
    return () if validated is _FAILED else tuple(validated)


def _build(data: Any, problems: _Problems, *, serve: bool = False) -> Config:
    doc = _document(problems, data, _ConfigIn)
    if doc is None:
        problems.raise_if_any()
        raise AssertionError("unreachable")
    v = {name: _section(problems, _ConfigIn, doc, name) for name in _ConfigIn.model_fields}

    def raw(name: str) -> Any:
        return doc.get(name)

    def ok(name: str, fallback: Any) -> Any:
        return fallback if v[name] is _FAILED else v[name]

    scrape = ok("scrape", ScrapeConfig())
    if v["scrape"] is not _FAILED:
        scrape = _scrape(problems, scrape, raw("scrape") or {})
    endpoints = _endpoints(problems, v["endpoints"], raw("endpoints"), scrape.default_engine)
    models = _models(problems, v["models"], raw("endpoints"))
    admission = v["admission"]
    if admission is not _FAILED:
        admission = _admission(problems, admission, raw("admission") or {})
    auth = _auth(problems, v["auth"], raw("auth"), None if admission is _FAILED else admission.bands)
    if v["routing"] is not _FAILED:
        header = v["routing"].prefix.session_header
        if header in CONSUMED_HEADERS or (admission is not _FAILED and header == admission.header.lower()):
            problems.add(("routing", "prefix", "session_header"),
                         f"{header} is a header llmgw reads for itself (it never reaches routing); name another, "
                         "such as x-session-id")
    breaker = v["breaker"]
    if breaker is not _FAILED:
        breaker = _breaker(problems, breaker, raw("breaker") or {})
    _either(problems, doc, (), "admin_token", "admin_token_env")
    admin_token = None
    if v["admin_token"] is not _FAILED and v["admin_token_env"] is not _FAILED:
        admin_token = _secret_of(v["admin_token"], v["admin_token_env"])
    mirror_root = None
    if v["mirror"] is not _FAILED and v["mirror"].root is not None:
        mirror_root = os.path.expanduser(v["mirror"].root)
    control = _control(problems, v["control"], raw("control"))
    deployments = _deployments(problems, v["deployments"], raw("deployments"))
    follow = _follow(problems, v["follow"], raw("follow"), raw("control"))

    cfg = Config(
        listen=ok("listen", DEFAULT_LISTEN),
        admin=ok("admin", DEFAULT_ADMIN),
        endpoints=endpoints or (),
        models=models,
        server=ok("server", ServerConfig()),
        upstream=ok("upstream", UpstreamConfig()),
        retries=ok("retries", RetryConfig()),
        scrape=scrape,
        routing=ok("routing", RoutingConfig()),
        saturation=ok("saturation", SaturationConfig()),
        admission=AdmissionConfig() if admission is _FAILED else admission,
        breaker=BreakerConfig() if breaker is _FAILED else breaker,
        auth=auth,
        access_log=AccessLogConfig(enabled=ok("access_log", AccessLogConfig().enabled)),
        mirror_root=mirror_root,
        admin_token=admin_token,
        admin_allow_unauthenticated=ok("admin_allow_unauthenticated", False),
        source=problems.source,
        control=control,
        deployments=deployments,
        follow=follow,
    )
    # What serve refuses is asked of a file whose endpoints, control plane and follow:
    # are otherwise fine (a bad entry already says what is wrong with it; a control:
    # section that failed is not "no endpoints").
    if serve and not any(p.key.startswith(("endpoints", "control", "follow")) for p in problems.found):
        for p in serve_problems(cfg, problems.line(("endpoints",)) if "endpoints" in doc else None):
            if p.line is None and p.key:
                # (a check across keys names one of them: its line, where the file has the key)
                loc = tuple(p.key.split("."))
                if loc[0] in doc:
                    p = dataclasses.replace(p, line=problems.line(loc))
            problems.found.append(p)
    _distinct_secrets(problems, cfg, doc)
    problems.raise_if_any()
    return cfg


def _distinct_secrets(problems: _Problems, cfg: Config, doc: Mapping[str, Any]) -> None:
    """One secret in two roles gives whoever holds it both: a join token that is also the router token lets
    any node's holder follow the control plane (every replica's key); an admin token that is also a client
    key or a join token lets every client or node manage the gateway. Refused, naming the keys, never the
    values. (A join token listed twice is harmless: a rotation whose next token is not made yet.)"""

    def key(section: tuple[str, ...], name: str) -> tuple[str, ...]:
        where: Any = doc
        for part in section:
            where = where.get(part) if isinstance(where, Mapping) else None
        env = isinstance(where, Mapping) and f"{name}_env" in where
        return (*section, f"{name}_env" if env else name)

    def digest(secret: str) -> bytes:
        return hashlib.sha256(secret.encode()).digest()

    clients = {k.sha256 for k in cfg.auth.keys}
    c = cfg.control
    joins = c.join_tokens if c is not None else ()
    routers = c.router_tokens if c is not None else ()
    if set(routers) & set(joins):
        problems.add(key(("control",), "router_token"),
                     "is also a join token: every node's agent would hold the token that follows the control plane "
                     "and receives every replica's key; use a token of its own")
    if any(digest(t) in clients for t in (*joins, *routers)):
        problems.add(key(("control",), "join_token" if any(digest(t) in clients for t in joins) else "router_token"),
                     "is also a client API key (auth.api_keys): use a token of its own")
    admin = cfg.admin_token
    if admin:
        if digest(admin) in clients:
            problems.add(key((), "admin_token"), "is also a client API key (auth.api_keys): every client could "
                         "manage the gateway; use a token of its own")
        elif admin in joins or admin in routers:
            problems.add(key((), "admin_token"), f"is also a {'join' if admin in joins else 'router'} token "
                         "(control): whoever holds that could manage the gateway; use a token of its own")


# Request headers the client listener takes for itself (llmgw._fast.httpproto's _KINDS: framing,
# hop-by-hop, credentials, the request id): no routing knob may name one.
CONSUMED_HEADERS = frozenset({
    "content-length", "transfer-encoding", "connection", "keep-alive", "proxy-connection", "proxy-authorization",
    "proxy-authenticate", "te", "trailer", "upgrade", "expect", "authorization", "x-api-key", "api-key",
    "x-request-id", "host", "content-type", "accept-encoding",
})


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is a loopback address."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def plaintext_off_loopback(c: Any) -> str | None:
    """Why a control plane (``ControlConfig``) must not listen as configured: plaintext off
    loopback without ``allow_insecure``; ``None``: it may."""
    if (c.tls_cert is None or c.tls_key is None) and not is_loopback(c.listen[0]) and not c.allow_insecure:
        return (f"{c.listen[0]} is not a loopback address and the control plane has no TLS: join tokens and node "
                "data would travel in the clear; set control.tls_cert and control.tls_key "
                "(or control.allow_insecure: true on a network you trust)")
    return None


def admin_unprotected(cfg: Config) -> str | None:
    """Why the admin API must not listen as configured: off loopback with no token (and not allowed
    explicitly); ``None``: it may."""
    host = cfg.admin[0]
    if is_loopback(host) or cfg.admin_token or cfg.admin_allow_unauthenticated:
        return None
    more = ", mint join tokens, read replicas' keys and deploy" if cfg.control is not None else ""
    return (f"{host} is not a loopback address and there is no admin_token: anyone who reaches it could change "
            f"the fleet (add an endpoint that receives clients' requests, drain, reload{more}); set admin_token_env "
            "(or admin_token), bind admin to 127.0.0.1, or set admin_allow_unauthenticated: true on a network "
            "you trust")


def serve_problems(cfg: Config, line: int | None = None) -> list[ConfigProblem]:
    """What ``llmgw serve`` refuses in a configuration that is otherwise valid.

    A file can be valid and still describe no gateway (an empty file is a valid
    configuration of defaults): ``check-config`` and ``serve`` both ask this, so
    what one refuses the other refuses with the same words. A control plane
    (``control:``) is something to serve without endpoints: its nodes come first.
    """
    if not cfg.endpoints and cfg.control is None and cfg.follow is None:
        return [
            ConfigProblem(
                "endpoints", "no endpoints configured; add at least one (see docs/config.md)", cfg.source, line
            )
        ]
    found: list[ConfigProblem] = []
    why = listeners_overlap(cfg.listen, cfg.admin)
    if why is not None:
        found.append(ConfigProblem("admin", why, cfg.source, None))
    why = admin_unprotected(cfg)
    if why is not None:
        found.append(ConfigProblem("admin", why, cfg.source, None))
    if cfg.deployments and cfg.control is None:
        found.append(ConfigProblem("deployments", "needs control: (the control plane places and launches them on its "
                                   "nodes' agents); add a control: section, or remove deployments:", cfg.source, None))
    if cfg.control is not None:
        why = plaintext_off_loopback(cfg.control)
        if why is not None:
            found.append(ConfigProblem("control.listen", why, cfg.source, None))
        for other, addr in (("listen", cfg.listen), ("admin", cfg.admin)):
            if _overlap(cfg.control.listen, addr):
                h, p = cfg.control.listen
                found.append(ConfigProblem("control.listen", f"{h}:{p} is also the {other}: address: give the "
                                           "control plane's gRPC listener its own port", cfg.source, None))
        found.extend(ConfigProblem(f"control.{key}", why, cfg.source, None) for key, why in _tls_problems(
            cfg.control.tls_cert, cfg.control.tls_key, cfg.control.tls_client_ca, server=True))
    if cfg.follow is not None:
        f = cfg.follow
        found.extend(ConfigProblem(f"follow.{key}", why, cfg.source, None)
                     for key, why in _tls_problems(f.tls_cert, f.tls_key, f.tls_ca, server=False))
    return found


_ANY = ("", "0.0.0.0", "::", "[::]")


def listeners_overlap(listen: tuple[str, int], admin: tuple[str, int]) -> str | None:
    """Why the client and admin listeners cannot both bind (one address, or a wildcard over the
    other's port), or ``None``."""
    if not _overlap(listen, admin):
        return None
    fix = "give them different ports (--listen / --admin, or listen: / admin: in the config)"
    if listen == admin:
        return f"the client and admin listeners are both {listen[0]}:{listen[1]}: {fix}"
    return (f"the client and admin listeners ({listen[0]}:{listen[1]} and {admin[0]}:{admin[1]}) want one port, a "
            f"wildcard address taking it on every address: {fix}")


def _overlap(a: tuple[str, int], b: tuple[str, int]) -> bool:
    """Whether two listeners would want one socket: the same non-zero port, the hosts equal or one a wildcard."""
    return a[1] == b[1] and a[1] != 0 and (a[0] == b[0] or a[0] in _ANY or b[0] in _ANY)


def _tls_problems(cert: str | None, key: str | None, ca: str | None, *, server: bool) -> list[tuple[str, str]]:
    """The TLS files as a TLS library would take them: readable, PEM, the key the certificate's.
    ``[(key, what is wrong)]``; the CA's key is ``tls_client_ca`` (``server``) or ``tls_ca``."""
    out: list[tuple[str, str]] = []
    ca_key = "tls_client_ca" if server else "tls_ca"
    for k, path in (("tls_cert", cert), ("tls_key", key), (ca_key, ca)):
        if path is None:
            continue
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            out.append((k, f"cannot read {path}: {exc.strerror or exc}"))
    if out:
        return out
    pair, ca_why = tls_pem_problems(cert, key, ca, server=server)
    if pair is not None:
        out.append(("tls_cert", f"{cert} with {key}: {pair}"))
    if ca_why is not None:
        out.append((ca_key, f"{ca}: {ca_why}"))
    return out


def tls_pem_problems(cert: str | None, key: str | None, ca: str | None, *,
                     server: bool) -> tuple[str | None, str | None]:
    """Parse readable TLS files as OpenSSL will: what is wrong with the certificate and its key (both
    given), and with the CA file; ``None`` for each that is fine or not given. (``llmgw agent``'s
    flags are checked with it too.)"""
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    # (parsing only: OpenSSL's security level would refuse a small key gRPC itself takes)
    ctx.set_ciphers("DEFAULT:@SECLEVEL=0")
    pair = ca_why = None
    if cert is not None and key is not None:
        try:
            ctx.load_cert_chain(cert, key, password=lambda: b"")  # (gRPC takes no encrypted key: none asked for)
        except (ssl.SSLError, ValueError) as exc:
            pair = ("not a PEM certificate and its unencrypted private key, or the key is not the certificate's "
                    f"({getattr(exc, 'reason', None) or exc})")
    if ca is not None:
        try:
            ctx.load_verify_locations(cafile=ca)
        except (ssl.SSLError, ValueError) as exc:
            ca_why = f"not a PEM CA certificate ({getattr(exc, 'reason', None) or exc})"
    return pair, ca_why


def validate_for_serve(cfg: Config) -> None:
    """Raise what :func:`serve_problems` finds.

    Raises:
        ConfigError: the configuration cannot be served.
    """
    found = serve_problems(cfg)
    if found:
        raise ConfigError(problems=found)


def load(data: Any, source: str | None = None, *, serve: bool = False) -> Config:
    """Validate a parsed YAML document and build the :class:`Config`.

    ``serve``: also refuse what ``llmgw serve`` would (:func:`serve_problems`).

    Raises:
        ConfigError: every problem found, each naming its key.
    """
    return _build(data, _Problems(source), serve=serve)


def load_file(path: str | os.PathLike[str], *, serve: bool = False,
              overrides: Mapping[str, Any] | None = None) -> Config:
    """Read, parse and validate a YAML config file.

    ``serve``: also refuse what ``llmgw serve`` would (:func:`serve_problems`). ``overrides``:
    top-level keys set over the file's before it is checked (``serve --listen/--admin``: a clash
    the flags resolve is none, one they make is one).

    Raises:
        ConfigError: unreadable file, invalid YAML, or every invalid key.
    """
    data, problems = _read_yaml(path)
    if overrides and isinstance(data, Mapping):
        data = {**data, **overrides}
    return _build(data, problems, serve=serve)


def find_config(explicit: str | None) -> Path | None:
    """The config file to use: ``explicit`` (given, even empty: an unset ``-c "$VAR"`` is no reason to run
    something else), else ``./llmgw.yaml`` if anything is there by that name (a dangling link or a
    directory is an error to report, not a reason to run the demo).

    Raises:
        ConfigError: ``explicit`` is empty.
    """
    if explicit is not None:
        if not explicit:
            raise ConfigError("", 'the config file\'s path is empty (-c "$VAR" with VAR unset?): give the file')
        return Path(explicit)
    local = Path("llmgw.yaml")
    return local if local.is_file() or local.is_symlink() or local.exists() else None
