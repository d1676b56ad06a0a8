"""Configuration: the example loads; every mistake names its key and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.config import load, load_file, parse_duration, parse_hostport, parse_size
from llmgw.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent

EP = {"id": "a", "url": "http://127.0.0.1:8001", "model": "m"}


def test_example_config_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPU0_KEY", "k0")
    monkeypatch.setenv("TEAM_A_KEY", "ka")
    monkeypatch.setenv("LLMGW_ADMIN_TOKEN", "tok-9f3e")
    cfg = load_file(ROOT / "llmgw.example.yaml")
    assert cfg.admin_token == "tok-9f3e"
    assert cfg.listen == ("127.0.0.1", 8080)
    assert [e.id for e in cfg.endpoints] == ["gpu0-llama", "gpu1-llama", "cpu0-qwen"]
    assert cfg.endpoints[0].api_key == "k0"
    assert cfg.model_names() == ("llama-3-8b", "qwen2.5-0.5b")
    assert cfg.aliases() == {"llama3": "llama-3-8b", "gpt-4o-mini": "llama-3-8b"}
    assert cfg.server.max_body_size == 16 * 1024 * 1024
    assert cfg.upstream.connect_timeout == 2.0
    assert len(cfg.auth.keys) == 2
    assert cfg.auth.keys[0].band == "critical"
    assert cfg.models["llama-3-8b"].strategy == "score"
    assert cfg.routing.strategy == "score"
    assert cfg.saturation.max_waiting == 8 and cfg.saturation.max_kv_cache_usage == 0.9
    assert cfg.admission.bands == ("critical", "standard", "batch")
    assert cfg.admission.queue_timeout == 30.0
    assert cfg.breaker.failures == 5 and cfg.breaker.cooldown == 5.0
    assert cfg.retries.budget == 0.2
    assert cfg.scrape.interval == 1.0 and cfg.scrape.timeout == 0.8 and cfg.scrape.stale_after == 3.0
    qwen = cfg.endpoints[2]
    assert qwen.slots == 4
    assert qwen.metric_names["waiting"] == ("llamacpp:requests_deferred",)
    assert cfg.endpoints[0].metrics_path == "/metrics"
    # secrets never show in repr
    assert "k0" not in repr(cfg) and "ka" not in repr(cfg) and "tok-9f3e" not in repr(cfg)


def test_defaults_without_a_file() -> None:
    cfg = load({})
    assert cfg.listen == ("127.0.0.1", 8080)
    assert cfg.admin == ("127.0.0.1", 9090)
    assert cfg.endpoints == ()
    assert not cfg.auth.enabled


def test_config_is_immutable() -> None:
    cfg = load({"endpoints": [EP]})
    with pytest.raises(AttributeError):
        cfg.listen = ("0.0.0.0", 1)  # type: ignore[misc]
    with pytest.raises(AttributeError):
        cfg.endpoints[0].url = "x"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("data", "key", "fragment"),
    [
        ({"endpoints": [EP, EP, {**EP, "id": "c", "url": "localhost"}]}, "endpoints[1].id", "duplicate id"),
        ({"endpoints": [EP, {**EP, "id": "b"}, {**EP, "id": "c", "url": "localhost"}]}, "endpoints[2].url", "not a URL"),
        ({"endpoints": [{**EP, "engine": "tgi"}]}, "endpoints[0].engine", "choose one of vllm"),
        ({"endpoints": [{"id": "a", "url": "http://h:1"}]}, "endpoints[0].model", "is required"),
        ({"endpoints": [{**EP, "modle": "x"}]}, "endpoints[0].modle", "did you mean 'model'"),
        ({"endpoints": [{**EP, "models": ["x"]}]}, "endpoints[0].models", "either model or models"),
        ({"listen": "nonsense"}, "listen", "HOST:PORT"),
        ({"listen": "127.0.0.1:99999"}, "listen", "out of range"),
        ({"server": {"max_body_sise": 1}}, "server.max_body_sise", "did you mean 'max_body_size'"),
        ({"server": {"header_timeout": "soon"}}, "server.header_timeout", "duration like 2s"),
        ({"server": {"max_body_size": "lots"}}, "server.max_body_size", "size like 16MiB"),
        ({"retries": {"attempts": -1}}, "retries.attempts", "at least 0"),
        ({"endpoints": [EP], "models": {"other": {}}}, "models.other", "no endpoint serves"),
        ({"endpoints": [EP], "models": {"m": {"aliases": ["m"]}}}, "models.m.aliases", "already a served model"),
        ({"auth": {"api_keys": [{"name": "x"}]}}, "auth.api_keys[0].key", "exactly one of"),
        ({"auth": {"api_keys": [{"key_sha256": "zz"}]}}, "auth.api_keys[0].key_sha256", "64 hex"),
        ({"access_log": "yes"}, "access_log", "true or false"),
        ({"routing": {"strategy": "random"}}, "routing.strategy", "choose one of score"),
        ({"endpoints": [EP], "models": {"m": {"strategy": "x"}}}, "models.m.strategy", "unknown strategy"),
        ({"admission": {"default_band": "vip"}}, "admission.default_band", "not one of the bands"),
        ({"admission": {"bands": []}}, "admission.bands", "distinct band names"),
        ({"admission": {"bands": ["a", "a"]}}, "admission.bands", "distinct band names"),
        ({"auth": {"api_keys": [{"key": "k", "band": "gold"}]}}, "auth.api_keys[0].band", "unknown band"),
        ({"saturation": {"max_kv_cache_usage": 1.5}}, "saturation.max_kv_cache_usage", "at most 1.0"),
        ({"breaker": {"failures": 0}}, "breaker.failures", "at least 1"),
        ({"scrape": {"interval": "1s", "timeout": "2s"}}, "scrape.timeout", "shorter than scrape.interval"),
        ({"scrape": {"interval": "10ms"}}, "scrape.interval", "at least 50ms"),
        ({"endpoints": [{**EP, "metrics_path": "metrics"}]}, "endpoints[0].metrics_path", "must start with"),
        ({"endpoints": [{**EP, "metric_names": {"waiting": "bad name"}}]}, "endpoints[0].metric_names.waiting", "metric name"),
        ({"endpoints": [{**EP, "metric_names": {"queue": "x"}}]}, "endpoints[0].metric_names.queue", "unknown key"),
        ({"bogus": 1}, "bogus", "unknown key"),
        ([1, 2], "(top level)", "mapping"),
    ],
)
def test_errors_name_the_key(data: object, key: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as ei:
        load(data)
    # Every problem is reported: the one this case is about is among them.
    found = [p for p in ei.value.problems if p.key == key]
    assert found, str(ei.value)
    assert fragment in str(found[0])
    assert isinstance(ei.value, ValueError)


def test_api_key_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOPE_KEY", raising=False)
    with pytest.raises(ConfigError) as ei:
        load({"endpoints": [{**EP, "api_key_env": "NOPE_KEY"}]})
    assert ei.value.key == "endpoints[0].api_key_env"
    assert "NOPE_KEY is not set" in str(ei.value)
    monkeypatch.setenv("NOPE_KEY", "s3cret")
    cfg = load({"endpoints": [{**EP, "api_key_env": "NOPE_KEY"}]})
    assert cfg.endpoints[0].api_key == "s3cret"
    assert "s3cret" not in repr(cfg)


def test_secret_never_in_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError) as ei:
        load({"endpoints": [{**EP, "api_key": "topsecret", "api_key_env": "X"}]})
    assert "topsecret" not in str(ei.value)


def test_client_keys_are_hashed() -> None:
    cfg = load({"auth": {"api_keys": ["plain-key", {"name": "b", "key": "other"}]}})
    assert cfg.auth.enabled
    assert all(len(k.sha256) == 32 for k in cfg.auth.keys)
    assert "plain-key" not in repr(cfg)
    with pytest.raises(ConfigError, match="listed twice"):
        load({"auth": {"api_keys": ["same", "same"]}})


@pytest.mark.parametrize(
    ("text", "seconds"), [("2s", 2.0), ("500ms", 0.5), ("1.5m", 90.0), ("1h", 3600.0), (3, 3.0), ("7", 7.0)]
)
def test_durations(text: object, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(("text", "n"), [("16MiB", 16 * 2**20), ("64KiB", 65536), ("1GB", 10**9), (100, 100)])
def test_sizes(text: object, n: int) -> None:
    assert parse_size(text) == n


def test_hostport() -> None:
    assert parse_hostport("127.0.0.1:80") == ("127.0.0.1", 80)
    assert parse_hostport(":0") == ("127.0.0.1", 0)
    assert parse_hostport("[::1]:8080") == ("::1", 8080)


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_file(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("listen: [\n")
    with pytest.raises(ConfigError, match="not valid YAML at line"):
        load_file(bad)
