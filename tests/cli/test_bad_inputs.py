"""Inputs an operator gets wrong, run as the real ``llmgw`` command: each is one line that names the
fix, exit status 1, and never quotes a secret (a token with a trailing newline from a file, a number
YAML read for a secret, a password in an upstream URL, listeners that share a port, deployments with
no control plane, an empty ``-c``, a ``./llmgw.yaml`` that is not a file)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ENDPOINT = '  - {id: a, url: "http://127.0.0.1:9", model: m}\n'


def run(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
        timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llmgw", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, env={**os.environ, **(env or {})})


def one_error(res: subprocess.CompletedProcess[str], *secrets: str) -> str:
    """The single ``llmgw: error:`` line of a failed run (no traceback), checked free of ``secrets``."""
    assert res.returncode == 1, res
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("llmgw: error: "), res.stderr
    for s in secrets:
        assert s not in res.stderr and s not in res.stdout
    return lines[0]


@pytest.mark.parametrize("key", ["admin_token_env", "join_token_env", "api_key_env"])
@pytest.mark.parametrize("value", ["tok-SECRET-1\n", "tok-SECRET-1\r", " tok-SECRET-1", "tok\x1bSECRET-1"])
def test_a_secret_from_the_environment_no_client_can_send_is_refused(tmp_path: Path, key: str, value: str) -> None:
    doc = "listen: 127.0.0.1:0\nadmin: 127.0.0.1:0\n"
    if key == "admin_token_env":
        doc += "admin_token_env: XSEC\nendpoints:\n" + ENDPOINT
    elif key == "join_token_env":
        doc += "control: {listen: '127.0.0.1:0', join_token_env: XSEC}\n"
    else:
        doc += 'endpoints:\n  - {id: a, url: "http://127.0.0.1:9", model: m, api_key_env: XSEC}\n'
    f = tmp_path / "c.yaml"
    f.write_text(doc)
    line = one_error(run("check-config", str(f), env={"XSEC": value}), "SECRET")
    assert "environment variable XSEC " in line and "remove it" in line, line


def test_an_inline_secret_yaml_reads_as_a_number_or_with_a_line_break(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("admin_token: 0777\nendpoints:\n" + ENDPOINT)
    line = one_error(run("check-config", str(f)))
    assert "admin_token: expected a string, got int: quote it" in line, line
    f.write_text('admin_token: "adm-SECRET-1\\n"\nendpoints:\n' + ENDPOINT)
    line = one_error(run("check-config", str(f)), "SECRET")
    assert "admin_token: holds a line break" in line, line
    f.write_text("admin_token: '0777'\nendpoints:\n" + ENDPOINT)  # (quoted: the string it says)
    assert run("check-config", str(f)).returncode == 0


@pytest.mark.parametrize("url, says", [
    ("http://:PW-SECRET@127.0.0.1:9", "must not contain credentials"),
    ("http://user:PW-SECRET@127.0.0.1:9", "must not contain credentials"),
    ("ftp://user:PW-SECRET@127.0.0.1/x", "not a URL (expected http://host:port), got 'ftp://***@127.0.0.1/x'"),
    ("http://[::1:9", "not a URL (expected http://host:port)"),
])
def test_an_upstream_url_with_credentials_is_refused_without_quoting_them(tmp_path: Path, url: str, says: str) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(f"endpoints:\n  - {{id: a, url: '{url}', model: m}}\n")
    assert says in one_error(run("check-config", str(f)), "PW-SECRET")


def test_listeners_that_share_a_port_through_a_wildcard(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("listen: 0.0.0.0:20584\nadmin: 127.0.0.1:20584\nendpoints:\n" + ENDPOINT)
    want = "the client and admin listeners (0.0.0.0:20584 and 127.0.0.1:20584) want one port"
    line = one_error(run("check-config", str(f)))
    assert want in line and f"{f}:2: admin: " in line, line
    g = tmp_path / "g.yaml"
    g.write_text("endpoints:\n" + ENDPOINT)
    line = one_error(run("serve", "-c", str(g), "--listen", "[::]:20585", "--admin", "127.0.0.1:20585"))
    assert "([::]:20585 and 127.0.0.1:20585) want one port" in line or "(:::20585" in line, line


def test_an_admin_api_off_loopback_needs_a_token_or_an_explicit_allowance(tmp_path: Path) -> None:
    """Anyone who reaches an open admin API can add an endpoint that receives clients' requests (and,
    with a control plane, mint join tokens and read replicas' keys): off loopback it needs a token."""
    from ports import free_port

    f = tmp_path / "c.yaml"
    f.write_text("admin: 0.0.0.0:20586\nendpoints:\n" + ENDPOINT)
    line = one_error(run("check-config", str(f)))
    assert "admin: 0.0.0.0 is not a loopback address and there is no admin_token" in line, line
    assert "admin_allow_unauthenticated: true" in line and "mint join tokens" not in line
    assert f"{f}:1: admin: " in line, line  # (the key's YAML line, as every other problem has: QA)
    f.write_text("admin: 0.0.0.0:20586\ncontrol: {listen: 127.0.0.1:20587, join_token: a-join-token-of-length}\n")
    assert "mint join tokens" in one_error(run("check-config", str(f)))
    # the flag over a file, and over the demo, alike
    g = tmp_path / "g.yaml"
    g.write_text("endpoints:\n" + ENDPOINT)
    port = free_port()
    for args in (("-c", str(g)), ()):
        line = one_error(run("serve", *args, "--listen", "127.0.0.1:0", "--admin", f"0.0.0.0:{port}",
                             cwd=tmp_path, timeout=30))
        assert "is not a loopback address and there is no admin_token" in line, line
    # a token, or the explicit allowance, and it is served
    for extra in ("admin_token_env: T\n", "admin_allow_unauthenticated: true\n"):
        f.write_text(f"admin: 0.0.0.0:20586\n{extra}endpoints:\n" + ENDPOINT)
        res = run("check-config", str(f), env={**os.environ, "T": "an-admin-token-for-the-test"})
        assert res.returncode == 0, res.stdout + res.stderr


def test_deployments_without_a_control_plane_are_refused(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("endpoints:\n" + ENDPOINT + "deployments: [{name: d, model: x}]\n")
    assert "deployments: needs control:" in one_error(run("check-config", str(f)))


def test_an_empty_config_path_or_a_local_file_that_is_none_never_runs_the_demo(tmp_path: Path) -> None:
    for args in (("serve", "-c", "", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"), ("check-config", "")):
        assert "the config file's path is empty" in one_error(run(*args, cwd=tmp_path, timeout=20))
    (tmp_path / "llmgw.yaml").symlink_to(tmp_path / "gone.yaml")  # a dangling link
    line = one_error(run("serve", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", cwd=tmp_path, timeout=20))
    assert "config file 'llmgw.yaml' does not exist" in line, line
    (tmp_path / "llmgw.yaml").unlink()
    (tmp_path / "llmgw.yaml").mkdir()  # a directory
    assert "Is a directory" in one_error(run("check-config", cwd=tmp_path))


def test_the_agent_names_what_is_wrong_with_its_token_and_files(tmp_path: Path) -> None:
    base = ("agent", "--control", "127.0.0.1:9", "--token-env", "XJOIN", "--gpu-source", "none")
    res = run(*base, "--state-dir", str(tmp_path / "s"), env={"XJOIN": "join-SECRET-1\n"}, timeout=20)
    assert "--token-env XJOIN: the join token holds a line break" in one_error(res, "SECRET")
    res = run(*base, "--tls-ca", str(tmp_path / "nope.pem"), env={"XJOIN": "t"}, timeout=20)
    assert one_error(res) == f"llmgw: error: --tls-ca {tmp_path / 'nope.pem'}: cannot read it (No such file or directory)"
    res = run("agent", "-c", "", env={"XJOIN": "t"}, timeout=20)
    assert "--config: the path is empty" in one_error(res)
    blocked = tmp_path / "file"
    blocked.write_text("")
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(f"control: 127.0.0.1:9\ntoken_env: XJOIN\nstate_dir: {blocked}/sub\n")
    res = run("agent", "-c", str(cfg), "--gpu-source", "none", env={"XJOIN": "t"}, timeout=20)
    assert one_error(res).startswith(f"llmgw: error: state_dir: in --config FILE {blocked}/sub: cannot use it"), res


def test_a_deployed_model_path_with_a_space_is_taken_and_a_stray_blank_is_not(tmp_path: Path) -> None:
    # engines run from an argv, never a shell: a space inside a path is a path
    f = tmp_path / "c.yaml"
    f.write_text('control: {listen: "127.0.0.1:0", join_token: t}\n'
                 'deployments: [{name: d, model: "/m/my model.gguf", engine: llamacpp}]\n')
    res = run("check-config", str(f))
    assert res.returncode == 0, res.stderr
    # a paste's stray blank at an end, or a line break (it would forge log lines), says what is wrong
    for bad in ('" /m/x.gguf"', '"/m/x.gguf "', '"/m/x.gguf\\n"'):
        f.write_text('control: {listen: "127.0.0.1:0", join_token: t}\n'
                     f'deployments: [{{name: d, model: {bad}, engine: llamacpp}}]\n')
        line = one_error(run("check-config", str(f)))
        assert "deployments[0].model: invalid model" in line, line
        assert "no control characters, no whitespace at either end" in line, line


def test_check_config_reads_the_agents_file_as_the_agent_does(tmp_path: Path) -> None:
    import json

    ok = tmp_path / "agent.yaml"
    ok.write_text("control: 127.0.0.1:7070\ntoken_env: JOIN_FOR_CHECK\nreplica_ports: 20000-20100\n")
    res = run("check-config", "--agent", str(ok), env={"JOIN_FOR_CHECK": "a-join-token-for-the-check"})
    assert res.returncode == 0 and "OK (the node agent's file)" in res.stdout and "20000-20100" in res.stdout, res
    assert "a-join-token-for-the-check" not in res.stdout + res.stderr
    # every problem, one line each, as the agent would refuse the file (an unset token variable too)
    bad = tmp_path / "bad.yaml"
    bad.write_text("control: 127.0.0.1:7070\ntoken_env: JOIN_UNSET_HERE\nreplica_ports: 9-1\nbogus: 1\n")
    res = run("check-config", "--agent", str(bad))
    assert res.returncode == 1 and res.stderr.count("llmgw: error: ") == 3, res.stderr
    assert "bad.yaml:3: replica_ports" in res.stderr and "bad.yaml:4: bogus: unknown key" in res.stderr
    doc = json.loads(run("config", "check", "--agent", "--json", str(bad)).stdout)
    assert doc["ok"] is False and {p["key"] for p in doc["problems"]} >= {"replica_ports", "bogus"}
    assert "give the agent's file" in one_error(run("check-config", "--agent"))


def test_the_agents_ready_timeout_is_the_agent_files() -> None:
    # (a 30-minute limit fails a large model loading from slow storage, for ever: the node's own to set)
    from llmgw.config.agent import load_agent
    from llmgw.errors import ConfigError

    assert load_agent({"control": "127.0.0.1:7070"}).ready_timeout == 1800.0
    assert load_agent({"control": "127.0.0.1:7070", "ready_timeout": "2h"}).ready_timeout == 7200.0
    for bad in ("0s", "forever", -1):
        with pytest.raises(ConfigError, match="ready_timeout"):
            load_agent({"control": "127.0.0.1:7070", "ready_timeout": bad})
