"""Health, readiness and the management API (``/admin/v1/``) against a running gateway."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from admin_helpers import (
    Engine,
    admin_of,
    admin_port,
    chat,
    client_port,
    config_for,
    gone,
    http,
    running,
    wait_for,
)

from canary import secret
from llmgw.admin.app import AdminApp
from llmgw.admin.ports import Listeners
from llmgw.config import load, load_file
from llmgw.fleet.registry import Registry
from llmgw.runtime import GatewayRuntime

SECRET_B = secret("sk-b")
ADMIN_SECRET = secret("admin-token")
NEW_SECRET = secret("admin-token-reloaded")


async def api(rt: Any, method: str, path: str, body: Any = None, token: str | None = None) -> tuple[int, Any]:
    headers = {"authorization": f"Bearer {token}"} if token else None
    status, _, data = await http(admin_port(rt), method, path, body, headers)
    return status, orjson.loads(data) if data else None


def error_code(body: Any) -> str:
    return body["error"]["code"]


async def test_health_and_ready_names_unavailable_models() -> None:
    a, b = Engine("a"), Engine("b")
    async with running([a, b]) as rt:
        assert await api(rt, "GET", "/health") == (200, {"status": "ok"})
        status, body = await api(rt, "GET", "/ready")
        assert status == 200 and body == {"ready": True, "models_unavailable": [], "unavailable": {}}
        for eid in ("a", "b"):
            assert (await api(rt, "POST", f"/admin/v1/endpoints/{eid}/drain"))[0] == 200
        status, body = await api(rt, "GET", "/ready")
        assert status == 503
        assert body == {"ready": False, "models_unavailable": ["m"], "unavailable": {"m": {"a": "draining", "b": "draining"}}}
        assert (await api(rt, "POST", "/admin/v1/endpoints/b/undrain"))[0] == 200
        assert (await api(rt, "GET", "/ready"))[0] == 200
        # never on the client port
        status, _, _ = await http(client_port(rt), "GET", "/ready")
        assert status == 404
        status, _, _ = await http(client_port(rt), "GET", "/admin/v1/endpoints")
        assert status == 404


async def test_list_and_get_endpoints() -> None:
    a, dark = Engine("a"), Engine("dark", page=None)
    async with running([a, dark], more=[gone()]) as rt:
        assert rt.registry is not None
        eps_ = rt.registry.endpoints
        await wait_for(lambda: eps_["a"].scrape_ok > 0 and eps_["dark"].scrape_failures > 0
                       and eps_["gone"].scrape_failures > 0)
        assert await chat(client_port(rt)) in (200, 502)
        status, body = await api(rt, "GET", "/admin/v1/endpoints")
        assert status == 200
        eps = {e["id"]: e for e in body["endpoints"]}
        assert set(eps) == {"a", "dark", "gone"}
        ea = eps["a"]
        assert ea["state"] == "ok" and ea["models"] == ["m"] and ea["engine"] == "vllm" and ea["pool"] == "gpu"
        assert (ea["waiting"], ea["running"], ea["kv_cache_usage"]) == (2.0, 3.0, 0.25)
        assert ea["inflight"] == 0 and ea["stale"] is False and ea["scrape"]["ok"] >= 1
        assert ea["breaker"] == "closed" and ea["usable"] is True
        assert set(ea["score_inputs"]) >= {"latency_s", "capacity", "load", "slots"}
        # blind (answers, but no metrics page): fresh, engine numbers absent, never 0
        ed = eps["dark"]
        assert ed["state"] == "ok" and ed["stale"] is False
        assert ed["waiting"] is None and ed["running"] is None and ed["kv_cache_usage"] is None
        assert ed["scrape"]["problem"] and "404" in ed["scrape"]["problem"]
        # unreachable (its scrapes are refused): down, not usable, and why
        eg = eps["gone"]
        assert eg["state"] == "unreachable" and eg["stale"] is True and eg["waiting"] is None
        assert eg["usable"] is False and eg["down"] is True and eg["unusable_reason"] == "unreachable"
        assert eg["scrape"]["failing"] >= 1
        assert ea["unusable_reason"] is None and ea["down"] is False
        assert eg["last_scrape_age_s"] is None and eg["scrape"]["ok"] == 0
        status, one = await api(rt, "GET", "/admin/v1/endpoints/a")
        assert status == 200 and one["id"] == "a"
        status, body = await api(rt, "GET", "/admin/v1/endpoints/nope")
        assert status == 404 and error_code(body) == "endpoint_not_found"
        assert "nope" in body["error"]["message"]


async def test_add_remove_drain_endpoints() -> None:
    a, b = Engine("a"), Engine("b")
    await b.start()
    try:
        async with running([a]) as rt:
            assert rt.registry is not None and rt.poller is not None
            entry = {"id": "b", "url": b.url, "model": "m", "api_key": SECRET_B, "pool": "gpu"}
            status, body = await api(rt, "POST", "/admin/v1/endpoints", entry)
            assert status == 201, body
            assert body["id"] == "b" and body["url"] == b.url
            assert SECRET_B not in orjson.dumps(body).decode()
            assert "b" in rt.registry.endpoints
            # the poller follows
            await wait_for(lambda: rt.registry.endpoints["b"].scrape_ok > 0)
            status, body = await api(rt, "POST", "/admin/v1/endpoints", entry)
            assert status == 409 and error_code(body) == "endpoint_exists"

            # errors name the key, as in the config file
            bad = {"id": "c", "url": "localhost", "model": "m"}
            status, body = await api(rt, "POST", "/admin/v1/endpoints", bad)
            assert status == 400 and error_code(body) == "invalid_endpoint"
            assert body["error"]["message"].startswith("url: not a URL")
            assert body["error"]["param"] == "url"
            # a URL with CR/LF or spaces: the request line would not be the URL shown
            for url in (f"{b.url}/x HTTP/1.1\r\nX-Injected: yes\r\nX-Pad: ", f"{b.url}/a b", f"{b.url}/\tx"):
                status, body = await api(rt, "POST", "/admin/v1/endpoints", {"id": "c", "url": url, "model": "m"})
                assert status == 400 and error_code(body) == "invalid_endpoint", body
                assert "control characters" in body["error"]["message"]
            status, body = await api(rt, "POST", "/admin/v1/endpoints", {"id": "c", "url": b.url, "model": "m", "x": 1})
            assert status == 400 and body["error"]["message"].startswith("x: unknown key")
            status, body = await api(rt, "POST", "/admin/v1/endpoints", {"id": "c", "url": b.url, "model": "m",
                                                                        "api_key_env": "HOME"})
            assert status == 400 and body["error"]["param"] == "api_key_env"
            status, _, data = await http(admin_port(rt), "POST", "/admin/v1/endpoints", b"{not json")
            assert status == 400 and error_code(orjson.loads(data)) == "invalid_json"
            # a key given twice is not guessed at (the last would win), at any depth
            for dup in (b'{"id":"c","url":"%s","model":"m","url":"http://127.0.0.1:1"}' % b.url.encode(),
                        b'{"id":"c","url":"%s","model":"m","labels":{"a":"1","a":"2"}}' % b.url.encode()):
                status, _, data = await http(admin_port(rt), "POST", "/admin/v1/endpoints", dup)
                doc = orjson.loads(data)
                assert status == 400 and error_code(doc) == "invalid_json", doc
                assert "more than once" in doc["error"]["message"]
            assert "c" not in rt.registry.endpoints
            status, body = await api(rt, "POST", "/admin/v1/endpoints", [1, 2])
            assert status == 400

            # drain: no new requests reach it
            status, body = await api(rt, "POST", "/admin/v1/endpoints/a/drain")
            assert status == 200 and body["state"] == "draining" and body["changed"] is True
            status, body = await api(rt, "POST", "/admin/v1/endpoints/a/drain")
            assert status == 200 and body["changed"] is False
            for _ in range(4):
                _, hdrs, _ = await http(
                    client_port(rt), "POST", "/v1/chat/completions", {"model": "m", "messages": []},
                    {"content-type": "application/json"},
                )
                assert hdrs["x-llmgw-replica"] == "b"
            status, body = await api(rt, "POST", "/admin/v1/endpoints/a/undrain")
            assert status == 200 and body["draining"] is False and body["state"] != "draining"
            status, body = await api(rt, "POST", "/admin/v1/endpoints/zzz/drain")
            assert status == 404

            status, body = await api(rt, "DELETE", "/admin/v1/endpoints/b")
            assert status == 200 and body == {"removed": "b", "inflight": 0}
            assert "b" not in rt.registry.endpoints
            assert rt.poller.task_count == 1
            status, body = await api(rt, "DELETE", "/admin/v1/endpoints/b")
            assert status == 404

            # wrong methods and unknown routes
            status, body = await api(rt, "PUT", "/admin/v1/endpoints")
            assert status == 405 and error_code(body) == "method_not_allowed"
            status, body = await api(rt, "GET", "/admin/v1/endpoints/a/drain")
            assert status == 405
            status, body = await api(rt, "GET", "/admin/v1/nope")
            assert status == 404 and "GET /admin/v1/endpoints" in body["error"]["message"]
            status, body = await api(rt, "POST", "/metrics")
            assert status == 405
    finally:
        await b.stop()


async def test_queues_view() -> None:
    a = Engine("a")
    async with running([a]) as rt:
        assert rt.registry is not None
        await wait_for(lambda: rt.registry.endpoints["a"].scrape_ok > 0)
        assert await chat(client_port(rt)) == 200
        status, body = await api(rt, "GET", "/admin/v1/queues")
        assert status == 200 and body["admission"] is True
        bands = {b["band"]: b for b in body["bands"]}
        assert list(bands) == list(rt.config.admission.bands)  # type: ignore[attr-defined]
        assert all(b["depth"] == 0 for b in bands.values())
        assert sum(b["decisions"].get("admitted", 0) for b in bands.values()) == 1
        assert set(body["pool_saturation"]) == {"m"}

        # another admission controller, read defensively: a mapping or a method, NaN/None left out
        class Admission:
            def queue_depths(self) -> dict[str, float]:
                return {"interactive": 0, "batch": 4, "ghost": float("nan")}

            pool_saturation = {"m": 1.5, "n": None}

        # (an admin app given that controller, over the same registry and observer)
        other = AdminApp(
            registry=rt.registry, fleet=rt, config=lambda: rt.config, listeners=rt.listeners,
            observer=admin_of(rt).observer, admission=Admission(),
        )
        try:
            admin_of(rt).observer.admission("batch", "queued")
            admin_of(rt).observer.admission("batch", "rejected", "queue_full")
            body = other.api.queues()
        finally:
            other.close()
        assert body["admission"] is True
        bands = {b["band"]: b for b in body["bands"]}
        assert bands["batch"]["depth"] == 4
        assert bands["batch"]["decisions"] == {"queued": 1, "rejected": 1}
        assert bands["interactive"]["depth"] == 0 and "ghost" not in bands
        assert body["pool_saturation"] == {"m": 1.5}


async def test_admin_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The token of the real, loaded configuration guards the admin routes, and the
    one a reload brings in replaces it (the admin app reads the running config)."""
    a = Engine("a")
    await a.start()
    conf = tmp_path / "llmgw.yaml"
    _write(conf, config_for([a], admin_token=ADMIN_SECRET))
    try:
        async with running([], config=load_file(conf)) as rt:
            status, body = await api(rt, "GET", "/admin/v1/endpoints")
            assert status == 401 and error_code(body) == "missing_admin_token"
            assert ADMIN_SECRET not in orjson.dumps(body).decode()
            status, body = await api(rt, "GET", "/admin/v1/endpoints", token="wrong")
            assert status == 401 and error_code(body) == "invalid_admin_token"
            status, body = await api(rt, "GET", "/admin/v1/endpoints", token=ADMIN_SECRET)
            assert status == 200
            status, _, _ = await http(admin_port(rt), "GET", "/debug/pprof/tasks")
            assert status == 401
            status, _, _ = await http(
                admin_port(rt), "GET", "/debug/pprof/tasks", headers={"authorization": f"Bearer {ADMIN_SECRET}"}
            )
            assert status == 200
            # probes and the scraper stay open
            for path in ("/health", "/ready", "/metrics"):
                assert (await http(admin_port(rt), "GET", path))[0] == 200, path
            # A reload brings a new token (here from the environment): the old one stops working.
            monkeypatch.setenv("LLMGW_TEST_ADMIN_TOKEN", NEW_SECRET)
            _write(conf, config_for([a], admin_token_env="LLMGW_TEST_ADMIN_TOKEN"))
            status, body = await api(rt, "POST", "/admin/v1/reload", token=ADMIN_SECRET)
            assert status == 200, body
            assert rt.config.admin_token == NEW_SECRET
            status, body = await api(rt, "GET", "/admin/v1/endpoints", token=ADMIN_SECRET)
            assert status == 401 and error_code(body) == "invalid_admin_token"
            assert (await api(rt, "GET", "/admin/v1/endpoints", token=NEW_SECRET))[0] == 200
            # ... and a reload that drops it opens the routes again (bound to loopback)
            _write(conf, config_for([a]))
            assert (await api(rt, "POST", "/admin/v1/reload", token=NEW_SECRET))[0] == 200
            assert (await api(rt, "GET", "/admin/v1/endpoints"))[0] == 200
    finally:
        await a.stop()


def _write(path: Path, data: dict[str, Any]) -> None:
    path.write_text(yaml.safe_dump(data))


async def test_reload_from_disk_and_sighup(tmp_path: Path) -> None:
    a, b = Engine("a"), Engine("b")
    await a.start()
    await b.start()
    conf = tmp_path / "llmgw.yaml"
    _write(conf, config_for([a]))
    try:
        async with running([], config=load_file(conf)) as rt:
            assert rt.registry is not None
            assert await chat(client_port(rt)) == 200
            _write(conf, config_for([a, b]))
            status, body = await api(rt, "POST", "/admin/v1/reload")
            assert status == 200, body
            assert body["reloaded"] is True and body["added"] == ["b"] and body["removed"] == []
            assert "b" in rt.registry.endpoints

            conf.write_text("endpoints:\n  - id: a\n    url: nowhere\n    model: m\n")
            status, body = await api(rt, "POST", "/admin/v1/reload")
            assert status == 400 and error_code(body) == "invalid_config"
            assert "endpoints[0].url" in body["error"]["message"]
            assert "b" in rt.registry.endpoints  # nothing changed

            # SIGHUP reloads too
            _write(conf, config_for([b]))
            uninstall = rt.install_sighup()
            try:
                os.kill(os.getpid(), signal.SIGHUP)
                await wait_for(lambda: "a" not in rt.registry.endpoints)
            finally:
                uninstall()
            assert rt.reloads == {"ok": 2, "failed": 1} and admin_of(rt).reloads == rt.reloads
            _, _, text = await http(admin_port(rt), "GET", "/metrics")
            assert b'llmgw_config_reloads_total{result="ok"} 2.0' in text
            assert b'llmgw_config_reloads_total{result="failed"} 1.0' in text
    finally:
        await a.stop()
        await b.stop()


async def test_a_replica_changed_by_a_reload_is_scraped_and_served(tmp_path: Path) -> None:
    """A reload that changes an endpoint (its URL here, the same engine) replaces the replica under its
    id: the new one is scraped and takes requests, and the old one's scrape task is gone (it scraped
    the old replica for good, the new one never: the model stayed stale, its requests shed)."""
    a = Engine("a")
    await a.start()
    conf = tmp_path / "llmgw.yaml"
    _write(conf, config_for([a]))
    try:
        async with running([], config=load_file(conf)) as rt:
            assert rt.registry is not None
            assert await chat(client_port(rt)) == 200
            tasks = len(asyncio.all_tasks())
            data = config_for([a])
            data["endpoints"][0]["url"] = f"http://localhost:{a.port}"
            for change in (data, config_for([a])):
                _write(conf, change)
                status, body = await api(rt, "POST", "/admin/v1/reload")
                assert status == 200 and body["changed"] == ["a"], body
                new = rt.registry.endpoints["a"]
                await wait_for(lambda new=new: new.scrape_ok > 0)  # (the new replica, scraped)
                assert not new.stale and await chat(client_port(rt)) == 200
            assert len(asyncio.all_tasks()) <= tasks  # (the old replicas' scrape tasks stopped)
    finally:
        await a.stop()


async def test_reload_without_a_file_is_refused() -> None:
    a = Engine("a")
    async with running([a]) as rt:
        status, body = await api(rt, "POST", "/admin/v1/reload")
        assert status == 400 and "not read from a file" in body["error"]["message"]


async def test_shutting_down_is_not_ready() -> None:
    a = Engine("a")
    async with running([a]) as rt:
        assert rt.server is not None
        await asyncio.wait_for(rt.server.close(1.0), 5)  # the client listener shuts down (for real)
        assert rt.server.closing
        status, body = await api(rt, "GET", "/ready")
        assert status == 503 and body["reason"] == "shutting down"


@pytest.mark.parametrize("path", ["/nope", "/admin", "/debug/pprof/nope"])
async def test_unknown_admin_routes(path: str) -> None:
    a = Engine("a")
    async with running([a]) as rt:
        status, body = await api(rt, "GET", path)
        assert status == 404 and body["error"]["type"] == "invalid_request_error"
        await asyncio.sleep(0)


def _admin_app(config: Any) -> AdminApp:
    """An admin app over a runtime that is not started (built outside a loop: no lag timer)."""
    rt = GatewayRuntime(load({}))
    return AdminApp(registry=Registry(rt.config), fleet=rt, config=lambda: config, listeners=Listeners())


def test_warns_when_admin_is_exposed_without_token(caplog: pytest.LogCaptureFixture) -> None:
    base = load({})
    for host, token, warned in (("0.0.0.0", None, True), ("10.1.2.3", secret("t"), False), ("127.0.0.1", None, False),
                                ("::1", None, False), ("localhost", None, False)):
        caplog.clear()
        _admin_app(dataclasses.replace(base, admin=(host, 9090), admin_token=token))
        assert ("without admin_token" in caplog.text) is warned, host


def test_the_admin_token_is_the_typed_config_field(monkeypatch: pytest.MonkeyPatch) -> None:
    """The admin app reads ``Config.admin_token`` as a typed attribute (mypy checks
    it), and the loader fills that field from both spellings: a rename on either side
    fails the token tests with 500s or a load error, never with an open API."""
    assert "admin_token" in {f.name for f in dataclasses.fields(load({}))}
    assert load({"admin_token": "t0ken"}).admin_token == "t0ken"
    monkeypatch.setenv("LLMGW_TEST_ADMIN_TOKEN", "t0ken-from-env")
    assert load({"admin_token_env": "LLMGW_TEST_ADMIN_TOKEN"}).admin_token == "t0ken-from-env"
