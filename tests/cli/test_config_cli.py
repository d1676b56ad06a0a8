"""``llmgw check-config`` and ``llmgw config``, run as the real ``llmgw`` command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import yaml
from click.testing import CliRunner

from llmgw.cli import main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_ENV = {"GPU0_KEY": "x", "TEAM_A_KEY": "y", "LLMGW_ADMIN_TOKEN": "z"}


def run(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmgw", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env={**os.environ, **(env or {})},
    )


def test_check_config_and_serve_agree_on_an_empty_file(tmp_path: Path) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    check = run("check-config", str(empty))
    serve = run("serve", "-c", str(empty), "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0")
    expected = f"llmgw: error: {empty}: endpoints: no endpoints configured; add at least one (see docs/config.md)"
    assert check.returncode == serve.returncode == 1
    assert check.stderr.strip().splitlines() == serve.stderr.strip().splitlines() == [expected]
    assert check.stdout == ""


def test_check_config_and_serve_agree_on_a_plaintext_control_plane_off_loopback(tmp_path: Path) -> None:
    cfg = tmp_path / "cp.yaml"
    cfg.write_text("control:\n  listen: 0.0.0.0:28071\n  join_token: abc\n")
    check = run("check-config", str(cfg))
    serve = run("serve", "-c", str(cfg), "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0")
    expected = (f"llmgw: error: {cfg}:2: control.listen: 0.0.0.0 is not a loopback address and the control plane has "
                "no TLS: join tokens and node data would travel in the clear; set control.tls_cert and "
                "control.tls_key (or control.allow_insecure: true on a network you trust)")
    assert check.returncode == serve.returncode == 1
    assert check.stderr.strip().splitlines() == serve.stderr.strip().splitlines() == [expected]
    cfg.write_text("control:\n  listen: 0.0.0.0:28071\n  join_token: abc\n  allow_insecure: true\n")
    assert run("check-config", str(cfg)).returncode == 0


def test_a_bad_control_section_is_not_also_no_endpoints(tmp_path: Path) -> None:
    cfg = tmp_path / "cp.yaml"
    cfg.write_text("endpoints: []\ncontrol:\n  listen: 127.0.0.1:28071\n  join_token_env: LLMGW_TEST_UNSET_VAR\n")
    check = run("check-config", str(cfg))
    assert check.returncode == 1 and check.stderr.strip().splitlines() == [
        f"llmgw: error: {cfg}:4: control.join_token_env: environment variable LLMGW_TEST_UNSET_VAR is not set "
        "(export it, or use join_token:)"
    ]


def test_every_problem_is_one_stderr_line(tmp_path: Path) -> None:
    bad = tmp_path / "llmgw.yaml"
    bad.write_text(
        "endpoints:\n  - id: a\n    url: localhost\n    model: m\n    modle: m\n"
        "server:\n  max_body_sise: 1\n  max_body_size: 1\n  max_body_size: 2\n"
    )
    res = run("check-config", cwd=tmp_path)  # ./llmgw.yaml by default
    assert res.returncode == 1
    assert res.stdout == ""
    assert res.stderr.strip().splitlines() == [
        "llmgw: error: llmgw.yaml:3: endpoints[0].url: not a URL (expected http://host:port), got 'localhost'",
        "llmgw: error: llmgw.yaml:5: endpoints[0].modle: unknown key; did you mean 'model'?",
        "llmgw: error: llmgw.yaml:7: server.max_body_sise: unknown key; did you mean 'max_body_size'?",
        "llmgw: error: llmgw.yaml:8: server.max_body_size: must be at least 1024 bytes",
        "llmgw: error: llmgw.yaml:9: server.max_body_size: duplicate key 'max_body_size' (first at line 8, again at line 9)",
    ]
    # serve refuses the same file with the same lines
    assert run("serve", cwd=tmp_path).stderr == res.stderr


def test_check_config_json_ok() -> None:
    res = run("check-config", "--json", str(ROOT / "llmgw.example.yaml"), env=EXAMPLE_ENV)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["ok"] is True and doc["problems"] == []
    assert doc["file"].endswith("llmgw.example.yaml")
    summary = doc["summary"]
    assert summary["listen"] == "127.0.0.1:8080" and summary["admin"] == "127.0.0.1:9090"
    llama = summary["models"][0]
    assert llama["name"] == "llama-3-8b" and llama["aliases"] == ["llama3", "gpt-4o-mini"]
    assert [e["id"] for e in llama["endpoints"]] == ["gpu0-llama", "gpu1-llama"]
    assert llama["endpoints"][0] == {"id": "gpu0-llama", "url": "http://127.0.0.1:8001", "engine": "vllm", "draining": False}
    assert "replica-secret" not in res.stdout


def test_check_config_json_problems(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("listen: nowhere\nendpoints:\n  - {id: a, url: 'http://h:1', model: m, api_key_env: NOPE_CLI}\n")
    res = run("check-config", "--json", str(bad), env={"NOPE_CLI": ""})
    assert res.returncode == 1
    doc = json.loads(res.stdout)  # stdout is the JSON document alone
    assert doc["ok"] is False and doc["summary"] is None
    assert doc["problems"] == [
        {"file": str(bad), "key": "listen", "line": 1,
         "message": "expected HOST:PORT (e.g. 127.0.0.1:8080), got 'nowhere'"},
        {"file": str(bad), "key": "endpoints[0].api_key_env", "line": 3,
         "message": "environment variable NOPE_CLI is empty"},
    ]
    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")
    doc = json.loads(run("check-config", "--json", str(empty)).stdout)
    assert [p["key"] for p in doc["problems"]] == ["endpoints"]
    missing = run("check-config", "--json", str(tmp_path / "nope.yaml"))
    assert missing.returncode == 1 and "does not exist" in json.loads(missing.stdout)["problems"][0]["message"]


def test_config_check_is_check_config(tmp_path: Path) -> None:
    res = CliRunner().invoke(main, ["config", "check", str(ROOT / "llmgw.example.yaml")], env=EXAMPLE_ENV)
    assert res.exit_code == 0, res.output
    assert "model llama-3-8b: 2 endpoint(s): gpu0-llama, gpu1-llama" in res.output


def test_config_schema_validates_the_example(tmp_path: Path) -> None:
    res = run("config", "schema")
    assert res.returncode == 0, res.stderr
    schema = json.loads(res.stdout)
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    assert list(validator.iter_errors(yaml.safe_load((ROOT / "llmgw.example.yaml").read_text()))) == []
    assert list(validator.iter_errors({"endpoints": [{"id": "a", "url": "http://h:1", "model": "m", "engien": "x"}]}))
    agent = json.loads(run("config", "schema", "--agent").stdout)
    assert agent["title"] == "llmgw node agent"
    assert list(jsonschema.Draft202012Validator(agent).iter_errors({"control": "cp:7070", "gpu_source": "auto"})) == []


def test_help_lists_the_config_commands() -> None:
    res = CliRunner().invoke(main, ["--help"])
    assert "check-config" in res.output and "config " in res.output
    res = CliRunner().invoke(main, ["config", "schema", "--help"])
    assert res.exit_code == 0 and "yaml-language-server" in res.output


def _free_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def test_check_config_refuses_what_serve_refuses_before_it_binds(tmp_path: Path) -> None:
    """Colliding listeners and TLS files that are missing, not PEM, or a key not the certificate's:
    check-config said OK and serve refused them; now both refuse, in the same words, before binding."""
    gw, admin, grpc_port = _free_ports(3)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    pki = tmp_path / "pki"
    pki.mkdir()
    for n in ("one", "two"):
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-days", "1", "-subj", f"/CN={n}", "-keyout", str(pki / f"{n}.key"),
                        "-out", str(pki / f"{n}.pem")], check=True, capture_output=True, timeout=60)
    base = f"listen: 127.0.0.1:{gw}\nadmin: 127.0.0.1:{admin}\n"
    control = f"control:\n  listen: 127.0.0.1:{grpc_port}\n  join_token_env: JOIN\n"
    cases = {
        "same-admin": (f"listen: 127.0.0.1:{gw}\nadmin: 127.0.0.1:{gw}\n"
                       "endpoints:\n  - {id: a, url: 'http://127.0.0.1:9', models: [m]}\n",
                       f"admin: the client and admin listeners are both 127.0.0.1:{gw}"),
        "control-on-admin": (base + f"control:\n  listen: 127.0.0.1:{admin}\n  join_token_env: JOIN\n",
                             f"control.listen: 127.0.0.1:{admin} is also the admin: address"),
        "control-on-listen": (base + f"control:\n  listen: 0.0.0.0:{gw}\n  join_token_env: JOIN\n  allow_insecure: true\n",
                              f"control.listen: 0.0.0.0:{gw} is also the listen: address"),
        "missing-tls": (base + control + "  tls_cert: /nonexistent/cert.pem\n  tls_key: /nonexistent/key.pem\n",
                        "control.tls_cert: cannot read /nonexistent/cert.pem: No such file or directory"),
        "not-pem": (base + control + f"  tls_cert: {garbage}\n  tls_key: {pki / 'one.key'}\n",
                    f"control.tls_cert: {garbage} with {pki / 'one.key'}: not a PEM certificate"),
        "wrong-key": (base + control + f"  tls_cert: {pki / 'one.pem'}\n  tls_key: {pki / 'two.key'}\n",
                      "the key is not the certificate's"),
        "bad-client-ca": (base + control + f"  tls_cert: {pki / 'one.pem'}\n  tls_key: {pki / 'one.key'}\n"
                          f"  tls_client_ca: {garbage}\n", f"control.tls_client_ca: {garbage}: not a PEM CA"),
    }
    env = {"JOIN": "join-token-for-the-check", "XDG_STATE_HOME": str(tmp_path / "state")}
    for name, (text, fragment) in cases.items():
        f = tmp_path / f"{name}.yaml"
        f.write_text(text)
        check = run("check-config", str(f), env=env)
        serve = run("serve", "-c", str(f), env=env)
        assert check.returncode == serve.returncode == 1, (name, check.stdout, serve.stderr)
        assert fragment in check.stderr, (name, check.stderr)
        assert check.stderr.strip().splitlines() == serve.stderr.strip().splitlines(), (name, serve.stderr)
        assert "Traceback" not in serve.stderr
    # a small RSA key gRPC takes is not refused by the check (OpenSSL's security level is for handshakes)
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:1024", "-nodes", "-days", "1", "-subj", "/CN=small",
                    "-keyout", str(pki / "small.key"), "-out", str(pki / "small.pem")], check=True, capture_output=True,
                   timeout=60)
    small = tmp_path / "small.yaml"
    small.write_text(base + control + f"  tls_cert: {pki / 'small.pem'}\n  tls_key: {pki / 'small.key'}\n")
    check = run("check-config", str(small), env=env)
    assert check.returncode == 0, check.stderr
    good = tmp_path / "good.yaml"
    good.write_text(base + control + f"  tls_cert: {pki / 'one.pem'}\n  tls_key: {pki / 'one.key'}\n"
                    f"  tls_client_ca: {pki / 'two.pem'}\n")
    check = run("check-config", str(good), env=env)
    assert check.returncode == 0 and f"{good}: OK" in check.stdout, check.stderr


def test_serve_checks_the_listeners_its_flags_give(tmp_path: Path) -> None:
    """--listen/--admin are set over the file's before the check: a clash they resolve is none, and one
    they make (with control.listen) is refused like the file's own."""
    import signal
    import time

    gw, admin, grpc_port = _free_ports(3)
    env = {"JOIN": "join-token-for-the-check", "XDG_STATE_HOME": str(tmp_path / "state")}
    f = tmp_path / "cp.yaml"
    f.write_text(f"listen: 127.0.0.1:{gw}\nadmin: 127.0.0.1:{gw}\n"
                 f"control:\n  listen: 127.0.0.1:{grpc_port}\n  join_token_env: JOIN\n")
    made = run("serve", "-c", str(f), "--admin", f"127.0.0.1:{grpc_port}", env=env)
    assert made.returncode == 1
    assert f"control.listen: 127.0.0.1:{grpc_port} is also the admin: address" in made.stderr, made.stderr
    log = tmp_path / "serve.log"
    with open(log, "wb") as err:
        p = subprocess.Popen([sys.executable, "-m", "llmgw", "serve", "-c", str(f), "--admin", f"127.0.0.1:{admin}"],
                             stdout=subprocess.DEVNULL, stderr=err, env={**os.environ, **env})
    try:
        deadline = time.monotonic() + 30
        while "gateway listening" not in log.read_text():
            assert p.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(20)
    assert p.returncode == 0, log.read_text()
