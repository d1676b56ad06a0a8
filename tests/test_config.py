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
        ({"routing": {"prefix": {"block_bytes": 8}}}, "routing.prefix.block_bytes", "at least 64"),
        ({"routing": {"prefix": {"load_bound": -1}}}, "routing.prefix.load_bound", "at least 0"),
        ({"routing": {"prefix": {"session_header": "bad header"}}}, "routing.prefix.session_header", "header"),
        ({"routing": {"prefix": {"blocks": 3}}}, "routing.prefix.blocks", "unknown key"),
        ({"admission": {"default_band": "vip"}}, "admission.default_band", "not one of the bands"),
        ({"admission": {"bands": []}}, "admission.bands", "distinct band names"),
        ({"admission": {"bands": ["a", "a"]}}, "admission.bands", "distinct band names"),
        ({"auth": {"api_keys": [{"key": "k", "band": "gold"}]}}, "auth.api_keys[0].band", "unknown band"),
        ({"auth": {"api_keys": [{"key": "k", "max_band": "gold"}]}}, "auth.api_keys[0].max_band", "unknown band"),
        ({"auth": {"api_keys": [{"key": "k", "max_band": 2}]}}, "auth.api_keys[0].max_band", "unknown band '2'"),
        ({"auth": {"api_keys": [{"key": "k", "band": 0}]}}, "auth.api_keys[0].band", "unknown band '0'"),
        ({"auth": {"api_keys": [{"key": "k", "band": "critical", "max_band": "batch"}]}}, "auth.api_keys[0].band",
         "'critical' is above the key's max_band 'batch'"),
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


# -- every problem in one pass, on its line --


def _write(tmp_path: Path, text: str, name: str = "llmgw.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_every_problem_in_one_pass_with_file_line_and_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOPE_A", raising=False)
    p = _write(
        tmp_path,
        "endpoints:\n"  # 1
        "  - id: a\n"  # 2
        "    url: http://127.0.0.1:8001\n"  # 3
        "    model: m\n"  # 4
        "  - id: b\n"  # 5
        "    url: localhost\n"  # 6
        "    modle: x\n"  # 7
        "    model: m\n"  # 8
        "server:\n"  # 9
        "  max_body_sise: 1\n"  # 10
        "  header_timeout: soon\n"  # 11
        "scrape:\n"  # 12
        "  interval: 1s\n"  # 13
        "  timeout: 2s\n"  # 14
        "bogus: 1\n",  # 15
    )
    with pytest.raises(ConfigError) as ei:
        load_file(p)
    assert str(ei.value).splitlines() == [
        f"{p}:6: endpoints[1].url: not a URL (expected http://host:port), got 'localhost'",
        f"{p}:7: endpoints[1].modle: unknown key; did you mean 'model'?",
        f"{p}:10: server.max_body_sise: unknown key; did you mean 'max_body_size'?",
        f"{p}:11: server.header_timeout: expected a duration like 2s or 500ms, got 'soon'",
        f"{p}:14: scrape.timeout: must be shorter than scrape.interval (1s)",
        f"{p}:15: bogus: unknown key; known keys: access_log, admin, admin_allow_unauthenticated, admin_token, admin_token_env, admission, auth, breaker, "
        "control, deployments, endpoints, follow, listen, mirror, models, retries, routing, saturation, scrape, "
        "server, upstream",
    ]
    first = ei.value.problems[0]
    assert (first.source, first.key, first.line) == (str(p), "endpoints[1].url", 6)
    assert first.message.startswith("not a URL")
    assert (ei.value.key, ei.value.line, ei.value.source) == ("endpoints[1].url", 6, str(p))
    assert first.as_dict() == {"file": str(p), "key": "endpoints[1].url", "line": 6, "message": first.message}


def test_a_missing_key_points_at_its_entry(tmp_path: Path) -> None:
    p = _write(tmp_path, "listen: 127.0.0.1:8080\nendpoints:\n  - id: a\n    url: http://h:1\n")
    with pytest.raises(ConfigError) as ei:
        load_file(p)
    assert str(ei.value) == f"{p}:3: endpoints[0].model: is required"


def test_every_unset_env_variable_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("GPU0_KEY", "GPU1_KEY", "TEAM_KEY", "ADMIN_TOK", "JOIN_A", "JOIN_B", "FOLLOW_TOK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("EMPTY_KEY", "")
    p = _write(
        tmp_path,
        "endpoints:\n"
        "  - {id: a, url: 'http://h:1', model: m, api_key_env: GPU0_KEY}\n"
        "  - {id: b, url: 'http://h:2', model: m, api_key_env: GPU1_KEY, engine: tgi}\n"
        "  - {id: c, url: 'http://h:3', model: m, api_key_env: EMPTY_KEY}\n"
        "auth:\n"
        "  api_keys:\n"
        "    - {key_env: TEAM_KEY}\n"
        "admin_token_env: ADMIN_TOK\n"
        "control:\n"
        "  listen: :7000\n"
        "  join_token_env: [JOIN_A, JOIN_B]\n"
        "follow:\n"
        "  control: [cp:7000]\n"
        "  token_env: FOLLOW_TOK\n",
    )
    with pytest.raises(ConfigError) as ei:
        load_file(p)
    text = str(ei.value)
    assert f"{p}:2: endpoints[0].api_key_env: environment variable GPU0_KEY is not set (export it, or use api_key:)" in text
    assert f"{p}:3: endpoints[1].api_key_env: environment variable GPU1_KEY is not set" in text
    assert f"{p}:3: endpoints[1].engine: unknown engine 'tgi'" in text
    assert f"{p}:4: endpoints[2].api_key_env: environment variable EMPTY_KEY is empty" in text
    assert f"{p}:7: auth.api_keys[0].key_env: environment variable TEAM_KEY is not set (export it, or use key:)" in text
    assert f"{p}:8: admin_token_env: environment variable ADMIN_TOK is not set (export it, or use admin_token:)" in text
    assert f"{p}:11: control.join_token_env: environment variables JOIN_A, JOIN_B are not set" in text
    assert f"{p}:14: follow.token_env: environment variable FOLLOW_TOK is not set (export it, or use token:)" in text
    assert len(ei.value.problems) == 8


def test_duplicate_keys_are_refused(tmp_path: Path) -> None:
    p = _write(
        tmp_path,
        "listen: 127.0.0.1:8080\n"
        "endpoints:\n"
        "  - id: a\n"
        "    url: http://h:1\n"
        "    model: m\n"
        "    url: http://h:2\n"
        "listen: 127.0.0.1:8081\n",
    )
    with pytest.raises(ConfigError) as ei:
        load_file(p)
    assert str(ei.value).splitlines() == [
        f"{p}:6: endpoints[0].url: duplicate key 'url' (first at line 4, again at line 6)",
        f"{p}:7: listen: duplicate key 'listen' (first at line 1, again at line 7)",
    ]


def test_yaml_merge_keys_are_not_duplicates(tmp_path: Path) -> None:
    p = _write(
        tmp_path,
        "x-base: &base {url: 'http://h:1', model: m, engine: vllm}\n"
        "endpoints:\n"
        "  - {<<: *base, id: a, engine: llamacpp}\n",
    )
    with pytest.raises(ConfigError) as ei:  # x-base is not a key llmgw knows
        load_file(p)
    assert [pr.key for pr in ei.value.problems] == ["x-base"]
    p.write_text("endpoints:\n  - &a {id: a, url: 'http://h:1', model: m}\n  - {<<: *a, id: b, engine: llamacpp}\n")
    cfg = load_file(p)
    assert [(e.id, e.engine) for e in cfg.endpoints] == [("a", "vllm"), ("b", "llamacpp")]


def test_config_error_keeps_its_one_problem_form() -> None:
    exc = ConfigError("server.max_headers", "must be at least 8, got 1", source="f.yaml")
    assert str(exc) == "f.yaml: server.max_headers: must be at least 8, got 1"
    assert (exc.key, exc.message, exc.source, exc.line) == ("server.max_headers", "must be at least 8, got 1", "f.yaml", None)
    assert len(exc.problems) == 1
    assert str(ConfigError("", "nothing to reload")) == "nothing to reload"
    assert str(ConfigError("k", "bad", source="f.yaml", line=3)) == "f.yaml:3: k: bad"
    assert isinstance(exc, ValueError)


def test_secrets_stay_out_of_every_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOK", "env-secret-1")
    doc = {
        "endpoints": [{**EP, "api_key": "inline-secret-2", "api_key_env": "TOK", "url": "bad"}],
        "auth": {"api_keys": ["inline-secret-3", "inline-secret-3", {"key": {"x": "inline-secret-4"}}]},
        "admin_token": "",
        "control": {"listen": ":1", "join_token": ["inline-secret-5"], "join_token_env": "TOK"},
    }
    with pytest.raises(ConfigError) as ei:
        load(doc)
    text = str(ei.value)
    assert "secret" not in text, text
    assert "admin_token: is empty" in text


# -- defaults, sections the control plane will read --


def test_dynamic_defaults_follow_their_base() -> None:
    cfg = load({"scrape": {"interval": "500ms"}, "breaker": {"cooldown": "90s"}, "admission": {"bands": ["hi", "lo"]}})
    assert cfg.scrape.timeout == 0.4 and cfg.scrape.stale_after == 3.0
    assert load({"scrape": {"interval": "2s"}}).scrape.stale_after == 6.0
    assert cfg.breaker.max_cooldown == 90.0
    assert cfg.admission.default_band == "lo"
    assert load({"admission": {"header": "X-Prio"}}).admission.header == "x-prio"


def test_empty_values_mean_unset() -> None:
    cfg = load({"server": None, "endpoints": None, "models": None, "listen": None})
    assert cfg.server == load({}).server and cfg.listen == ("127.0.0.1", 8080) and cfg.endpoints == ()


def test_config_can_be_replaced() -> None:
    import dataclasses

    cfg = load({"endpoints": [EP]})
    moved = dataclasses.replace(cfg, listen=("0.0.0.0", 1))
    assert moved.listen == ("0.0.0.0", 1) and moved.endpoints == cfg.endpoints


def test_routing_prefix_section() -> None:
    cfg = load({"endpoints": [EP], "routing": {"strategy": "prefix", "prefix": {"block_bytes": 1000, "max_blocks": 1024,
                                                                                "entry_ttl": "2m"}}})
    p = cfg.routing.prefix
    assert cfg.routing.strategy == "prefix" and p.entry_ttl == 120.0
    assert p.block == 1000 and p.blocks == 65  # (a multiple of 8; block x blocks at most 64 KiB)
    assert load({"endpoints": [EP]}).routing.prefix.session_header == "x-session-id"


def test_strategies_come_from_the_routing_kernel() -> None:
    from llmgw import config, routing
    from llmgw._fast import score_py

    assert config.STRATEGIES is score_py.STRATEGIES
    assert tuple(routing.STRATEGIES) == config.STRATEGIES


def test_config_imports_without_a_cycle() -> None:
    import subprocess
    import sys

    for first in ("llmgw.config", "llmgw.routing", "llmgw._fast.score_py", "llmgw.errors"):
        code = f"import {first}; import llmgw.config, llmgw.routing"
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr


def test_reserved_control_plane_sections(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JOIN", "join-secret-1")
    monkeypatch.setenv("FOLLOW", "follow-secret-1")
    cfg = load(
        {
            "control": {"listen": "0.0.0.0:7070", "join_token_env": "JOIN", "database": "sqlite:////var/lib/llmgw/cp.db"},
            "deployments": [
                {"name": "llama", "model": "llama-3-8b", "engine": "vllm", "replicas": 2, "gpus": 1,
                 "gpu_memory": "40GiB", "args": ["--max-model-len", "8192"], "env": {"HF_TOKEN": "hf-secret-1"}},
                {"name": "qwen", "model": "qwen2.5-0.5b", "engine": "llamacpp", "gpus": 0, "served_name": "qwen"},
            ],
        }
    )
    followed = load({"follow": {"control": "cp0:7070", "token_env": "FOLLOW", "tls_ca": "/etc/ca.pem"}}).follow
    assert cfg.control is not None
    assert cfg.control.listen == ("0.0.0.0", 7070) and cfg.control.join_tokens == ("join-secret-1",)
    assert cfg.control.heartbeat_interval == 5.0 and cfg.control.heartbeat_grace == 15.0
    d = cfg.deployments[0]
    assert (d.replicas, d.gpus, d.gpu_memory, d.args, d.env) == (2, 1, 40 * 2**30, ("--max-model-len", "8192"),
                                                               {"HF_TOKEN": "hf-secret-1"})
    assert cfg.deployments[1].served_name == "qwen" and cfg.deployments[1].replicas == 1
    assert followed is not None and followed.control == (("cp0", 7070),) and followed.token == "follow-secret-1"
    assert followed.tls and followed.tls_ca == "/etc/ca.pem"
    for secret in ("join-secret-1", "follow-secret-1", "hf-secret-1"):
        assert secret not in repr(cfg) + repr(followed)
    tok = {"listen": ":1", "join_token": "t"}
    assert load({"control": {**tok, "heartbeat_interval": "2s"}}).control.heartbeat_grace == 6.0  # type: ignore[union-attr]
    assert load({"control": {"listen": ":1", "join_token": ["a", "b"]}}).control.join_tokens == ("a", "b")  # type: ignore[union-attr]
    assert load({}).control is None and load({}).deployments == () and load({}).follow is None
    c = load({"control": {**tok, "database": "postgresql://u:pw-secret-1@db/x", "lease": "5s",
                          "advertise": "cp0.example"}}).control
    assert c is not None and (c.database, c.lease, c.advertise) == ("postgresql://u:pw-secret-1@db/x", 5.0, "cp0.example")
    assert "pw-secret-1" not in repr(c) and load({"control": tok}).control.lease == 15.0  # type: ignore[union-attr]
    # a control plane agents cannot join is refused with the file (check-config, a reload), not at start only
    for no_token in ({"listen": ":1"}, {"listen": ":1", "join_token": []}):
        with pytest.raises(ConfigError, match=r"control(\.join_token)?: "):
            load({"control": no_token})
    with pytest.raises(ConfigError, match=r"needs a join token for agents: set control\.join_token_env"):
        load({"control": {"listen": ":1"}})


@pytest.mark.parametrize(
    ("data", "key", "fragment"),
    [
        ({"control": {}}, "control.listen", "is required"),
        ({"control": {"listen": ":1", "heartbeat_interval": "1s", "heartbeat_grace": "500ms"}},
         "control.heartbeat_grace", "at least control.heartbeat_interval"),
        ({"control": {"listen": ":1", "heartbeat_interval": "100000h"}}, "control.heartbeat_interval",
         "must be at most 1h, got '100000h'"),
        ({"control": {"listen": ":1", "heartbeat_grace": "2d"}}, "control.heartbeat_grace", ""),
        ({"control": {"listen": ":1", "heartbeat_grace": 90000}}, "control.heartbeat_grace", "must be at most 24h"),
        ({"control": {"listen": ":1", "join_token": "a", "join_token_env": "B"}}, "control.join_token_env", "not both"),
        ({"control": {"listen": ":1", "hearbeat_interval": "1s"}}, "control.hearbeat_interval",
         "did you mean 'heartbeat_interval'"),
        ({"deployments": [{"name": "a"}]}, "deployments[0].model", "is required"),
        ({"deployments": [{"name": "a", "model": "m", "engine": "external"}]}, "deployments[0].engine", "choose one of"),
        ({"deployments": [{"name": "a", "model": "m", "gpu_memory": "lots"}]}, "deployments[0].gpu_memory", "size like"),
        ({"deployments": [{"name": "a", "model": "m", "env": {"1X": "y"}}]}, "deployments[0].env", "environment variable name"),
        ({"deployments": [{"name": "a", "model": "m"}, {"name": "a", "model": "n"}]}, "deployments[1].name", "duplicate name"),
        ({"deployments": [{"name": "a", "model": "m", "replica": 2}]}, "deployments[0].replica", "did you mean 'replicas'"),
        ({"deployments": [{"name": "a", "model": "m", "node_labels": {"bad key": "x"}}]}, "deployments[0].node_labels",
         "is not a label name"),
        ({"deployments": [{"name": "a", "model": "m", "node_labels": ["zone=eu"]}]}, "deployments[0].node_labels",
         "mapping of label names"),
        ({"deployments": [{"name": "a", "model": "m", "slots": 0}]}, "deployments[0].slots", "at least 1"),
        ({"deployments": [{"name": "a", "model": "m", "share_gpus": "often"}]}, "deployments[0].share_gpus", ""),
        ({"follow": {"control": []}}, "follow.control", "HOST:PORT"),
        ({"control": {"listen": ":1", "database": "sqlite:///x", "database_env": "B"}}, "control.database_env",
         "not both"),
        ({"control": {"listen": ":1", "lease": "100ms"}}, "control.lease", "at least 300ms"),
        ({"control": {"listen": ":1", "grpc_server": "grpclib"}}, "control.grpc_server", "choose one of llmgw, grpcio"),
        ({"control": {"listen": ":1", "database": "sqlite:///x", "state_file": "s.json"}}, "control.state_file",
         "not used with control.database"),
        ({"control": {"listen": ":1", "database": "/var/lib/llmgw/cp.db"}}, "control.database",
         "sqlite:////ABSOLUTE/PATH"),
        ({"control": {"listen": ":1", "database": "sqlite:cp.db"}}, "control.database", "sqlite:///RELATIVE/PATH"),
        ({"control": {"listen": ":1", "database": "mysql://db/x"}}, "control.database", "postgresql://"),
        ({"follow": {"control": "10.0.0.5:7070", "token": "t"}}, "follow.control", "not a loopback address"),
        ({"follow": {"control": "127.0.0.1:7070", "token": "t", "tls_cert": "c.pem"}}, "follow.tls_key", "required"),
        ({"follow": {"control": "127.0.0.1:7070", "token": "t", "token_env": "X"}}, "follow.token_env", "not both"),
        ({"control": {"listen": ":1", "router_token": "a", "router_token_env": "B"}}, "control.router_token_env",
         "not both"),
    ],
)
def test_reserved_sections_are_validated(data: object, key: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as ei:
        load(data)
    assert any(p.key == key and fragment in p.message for p in ei.value.problems), str(ei.value)


def test_deployment_defaults_and_selectors() -> None:
    cfg = load({"deployments": [
        {"name": "v", "model": "m"},
        {"name": "l", "model": "tiny:1b", "engine": "llamacpp", "slots": 4, "context": 8192, "memory": "2GiB"},
        {"name": "g", "model": "m", "engine": "llamacpp", "gpus": 1, "gpu_model": "H100", "share_gpus": True,
         "gpu_memory": "8GiB", "node_labels": {"zone": "eu-1", "llmgw.io/pool": "a"}, "served_name": "chat"},
    ]})
    v, lc, g = cfg.deployments
    assert (v.gpu_count, v.model_name, v.engine) == (1, "v", "vllm")  # vLLM: one GPU; clients ask for the name
    assert (lc.gpu_count, lc.slots, lc.context, lc.memory) == (0, 4, 8192, 2 * 2**30)  # llama.cpp: CPU
    assert (g.gpu_count, g.gpu_model, g.share_gpus, g.model_name) == (1, "H100", True, "chat")
    assert g.node_labels == {"zone": "eu-1", "llmgw.io/pool": "a"}


def test_agent_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from llmgw.config import load_agent_file

    monkeypatch.setenv("AGENT_TOKEN", "agent-secret-9f")
    p = _write(
        tmp_path,
        "control: cp0:7070\ntoken_env: AGENT_TOKEN\nname: node-1\ngpu_source: nvidia-smi\n"
        "engines:\n  vllm: {python: /opt/vllm/bin/python}\n  llamacpp: {binary: /usr/local/bin/llama-server}\n",
        "agent.yaml",
    )
    a = load_agent_file(p)
    assert a.control == (("cp0", 7070),) and a.token == "agent-secret-9f" and a.name == "node-1" and a.gpu_source == "nvidia-smi"
    assert a.engines["vllm"].python == "/opt/vllm/bin/python" and a.engines["llamacpp"].binary.endswith("llama-server")  # type: ignore[union-attr]
    assert "agent-secret-9f" not in repr(a)
    p.write_text("token_env: NOPE_AGENT\ngpu_source: rocm\nengines:\n  tgi: {}\n  vllm: {pyhton: x}\n")
    monkeypatch.delenv("NOPE_AGENT", raising=False)
    with pytest.raises(ConfigError) as ei:
        load_agent_file(p)
    assert str(ei.value).splitlines() == [
        f"{p}:1: control: is required (or give llmgw agent --control HOST:PORT)",
        f"{p}:1: token_env: environment variable NOPE_AGENT is not set (export it)",
        f"{p}:2: gpu_source: unknown gpu source 'rocm'; choose one of auto, nvml, nvidia-smi, none, simulated",
        f"{p}:4: engines.tgi: unknown engine 'tgi'; choose one of vllm, llamacpp, trtllm, sglang",
        f"{p}:5: engines.vllm.pyhton: unknown key; did you mean 'python'?",
    ]


# -- the JSON Schema editors use --


def test_schema_validates_the_example_and_rejects_a_bad_file() -> None:
    import jsonschema
    import yaml

    from llmgw.config import config_schema

    schema = config_schema()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    example = yaml.safe_load((ROOT / "llmgw.example.yaml").read_text())
    assert list(validator.iter_errors(example)) == []
    bad = {
        "listen": "nowhere",
        "endpoints": [{"id": "a", "url": "localhost", "modle": "m"}],
        "server": {"max_body_sise": 1, "header_timeout": "soon"},
        "routing": {"strategy": "random"},
    }
    wrong = {tuple(e.absolute_path) for e in validator.iter_errors(bad)}
    assert {("listen",), ("endpoints", 0), ("endpoints", 0, "url"), ("server",), ("server", "header_timeout"),
            ("routing", "strategy")} <= wrong
    # both model and models, or neither, is refused too
    assert list(validator.iter_errors({"endpoints": [{**EP, "models": ["m"]}]}))
    agent = config_schema(agent=True)
    jsonschema.Draft202012Validator.check_schema(agent)
    av = jsonschema.Draft202012Validator(agent)
    assert list(av.iter_errors({"control": "cp:1", "engines": {"vllm": {"python": "/p"}}})) == []
    assert list(av.iter_errors({"control": "cp:1", "engines": {"tgi": {}}}))
    assert list(av.iter_errors({"gpu_source": "nvml"}))  # control is required


def test_validate_for_serve() -> None:
    from llmgw.config import serve_problems, validate_for_serve

    validate_for_serve(load({"endpoints": [EP]}))
    with pytest.raises(ConfigError, match="no endpoints configured"):
        validate_for_serve(load({}, source="x.yaml"))
    with pytest.raises(ConfigError) as ei:
        load({"endpoints": []}, source="x.yaml", serve=True)
    assert [str(p) for p in ei.value.problems] == [str(p) for p in serve_problems(load({}, source="x.yaml"))]


@pytest.mark.parametrize("header", ["x-request-id", "Authorization", "x-api-key", "content-length", "x-llmgw-priority"])
def test_a_session_header_llmgw_consumes_is_refused(header: str) -> None:
    with pytest.raises(ConfigError) as ei:
        load({"endpoints": [{"id": "a", "url": "http://127.0.0.1:9", "model": "m"}],
              "routing": {"prefix": {"session_header": header}}})
    assert [p.key for p in ei.value.problems] == ["routing.prefix.session_header"]
    assert "is a header llmgw reads for itself" in ei.value.problems[0].message
    with pytest.raises(ConfigError, match="reads for itself"):  # the configured priority header too
        load({"endpoints": [{"id": "a", "url": "http://127.0.0.1:9", "model": "m"}], "admission": {"header": "x-prio"},
              "routing": {"prefix": {"session_header": "X-Prio"}}})


def test_the_consumed_headers_are_the_client_listeners() -> None:
    from llmgw._fast import httpproto_py
    from llmgw.config.loading import CONSUMED_HEADERS

    assert {k.decode() for k in httpproto_py._KINDS} == CONSUMED_HEADERS


def test_control_grpc_server_defaults_to_llmgws_own() -> None:
    assert load({"control": {"listen": "127.0.0.1:1", "join_token": "t"}}).control.grpc_server == "llmgw"
    c = load({"control": {"listen": "127.0.0.1:1", "join_token": "t", "grpc_server": "grpcio"}}).control
    assert c is not None and c.grpc_server == "grpcio"


def test_every_api_key_problem_is_said_in_one_pass() -> None:
    """One entry's bad key fails the section's validation; another entry's unknown band is still said."""
    with pytest.raises(ConfigError) as ei:
        load({"auth": {"api_keys": [{"key": ""}, {"key": "k-SECRET", "band": "nosuchband"}]}})
    found = {p.key: p.message for p in ei.value.problems}
    assert found.get("auth.api_keys[0].key") == "is empty", found
    assert "unknown band 'nosuchband'" in found.get("auth.api_keys[1].band", ""), found
    assert "k-SECRET" not in str(ei.value)


@pytest.mark.parametrize("value, says", [
    (float("nan"), "expected a duration like 2s or 500ms, got nan"),
    (float("inf"), "expected a duration like 2s or 500ms, got inf"),
    (".nan", "expected a duration like 2s or 500ms"),
    ("9999999999999h", "must be at most 8760h, got '9999999999999h'"),
    (1e300, "must be at most 8760h"),
])
def test_a_duration_is_finite_and_at_most_a_year(value: object, says: str) -> None:
    """QA: ``scrape.interval: 9999999999999h`` was taken (requests then waited for ever for a first scrape),
    and NaN passed every bound a duration has."""
    with pytest.raises(ConfigError) as err:
        load({"scrape": {"interval": value}})
    assert err.value.key == "scrape.interval" and says in err.value.message, err.value.message
    assert load({"scrape": {"interval": "8760h", "stale_after": "8760h", "timeout": "1s"}}).scrape.interval == 8760 * 3600.0


@pytest.mark.parametrize("text", [
    # a secret where a variable's name belongs (the commonest slip): never quoted back
    "endpoints:\n  - {id: a, url: 'http://127.0.0.1:9', model: m, api_key_env: sk-CANARY-ENVKEY-5521}\n",
    "admin_token_env: CANARY-ADMIN-5521\n",
    "control:\n  listen: 127.0.0.1:0\n  join_token_env: [CANARY-JOIN-5521]\n",
    "control:\n  listen: 127.0.0.1:0\n  join_token: abcdefghijklmnop\n"
    "  database_env: 'postgresql://u:CANARY-DBPW-5521@127.0.0.1:5432/db'\n",
    # a value starting with '*' or '!' is YAML's alias or tag: PyYAML quotes it in its problem
    "endpoints:\n  - id: a\n    url: http://127.0.0.1:9\n    model: m\n    api_key: *CANARY-ALIAS-5521\n",
    "endpoints:\n  - id: a\n    url: http://127.0.0.1:9\n    model: m\n    api_key: !CANARY-TAG-5521 x\n",
    # an SQLite URL with a password in it
    "control:\n  listen: 127.0.0.1:0\n  join_token: abcdefghijklmnop\n  database: 'sqlite://u:CANARY-SQLITE-5521@/x.db'\n",
], ids=["api_key_env", "admin_token_env", "join_token_env", "database_env", "alias", "tag", "sqlite"])
def test_a_secret_in_the_wrong_place_is_never_quoted_in_the_error(tmp_path: Path, text: str) -> None:
    p = tmp_path / "llmgw.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_file(p)
    said = str(e.value)
    assert "CANARY" not in said and "5521" not in said, said
    assert f"{p}:" in said or "line" in said, said  # (where it is, instead)


@pytest.mark.parametrize(("doc", "key", "said"), [
    ({"control": {"listen": "127.0.0.1:0", "join_token": "tok-aaaaaaaaaaaa", "router_token": "tok-aaaaaaaaaaaa"}},
     "control.router_token", "is also a join token"),
    ({"admin_token": "tok-bbbbbbbbbbbb", "auth": {"api_keys": [{"key": "tok-bbbbbbbbbbbb"}]}},
     "admin_token", "is also a client API key"),
    ({"admin_token": "tok-cccccccccccc", "control": {"listen": "127.0.0.1:0", "join_token": "tok-cccccccccccc"}},
     "admin_token", "is also a join token"),
    ({"auth": {"api_keys": [{"key": "tok-eeeeeeeeeeee"}]},
      "control": {"listen": "127.0.0.1:0", "join_token": "tok-eeeeeeeeeeee"}},
     "control.join_token", "is also a client API key"),
], ids=["router-is-join", "admin-is-client", "admin-is-join", "join-is-client"])
def test_one_secret_in_two_roles_is_refused_without_quoting_it(doc: dict[str, object], key: str, said: str) -> None:
    # (whoever holds it would have both: a node's token following the control plane and its replicas' keys)
    with pytest.raises(ConfigError) as e:
        load(doc)
    text = str(e.value)
    assert f"{key}: {said}" in text and "tok-" not in text, text
