"""Security of the control plane: TLS, mutual TLS (both ways), plaintext off loopback, no token."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from cp_helpers import TOKEN, AgentProc, api, control_config, control_runtime, free_port, wait_for
from scenario import h100s, write_scenario

from llmgw._proto.agent.v1 import agent_pb2_grpc
from llmgw.agent.wire import PROTOCOL, pb
from llmgw.control.service import ControlPlane
from llmgw.errors import ConfigError

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.needs_tool("openssl", install="apt-get install openssl: it makes the certificates"),
]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def _make_pki(d: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1/localhost, and a client certificate, all EC P-256."""
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=llmgw test CA", cwd=d)
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"),
                      ("client", "extendedKeyUsage=clientAuth\n")):
        (d / f"{name}.ext").write_text(ext)
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=llmgw test {name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)
    return {k: d / k for k in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return _make_pki(tmp_path_factory.mktemp("pki"))


async def _register(port: int, creds: grpc.ChannelCredentials | None) -> pb.RegisterResponse:
    target = f"127.0.0.1:{port}"
    ch = grpc.aio.secure_channel(target, creds) if creds is not None else grpc.aio.insecure_channel(target)
    try:
        stub = agent_pb2_grpc.AgentServiceStub(ch)
        req = pb.RegisterRequest(node_name="probe", protocol=pb.ProtocolVersion(major=PROTOCOL[0]))
        return await stub.Register(req, metadata=[("authorization", f"Bearer {TOKEN}")], timeout=3)
    finally:
        await ch.close()


def _agent(tmp_path: Path, port: int, name: str, *extra: str) -> AgentProc:
    scenario = write_scenario(tmp_path / f"{name}.json", {"hostname": name, "gpus": h100s(1, name[0])})
    return AgentProc(port, name, scenario, tmp_path / f"{name}.log", *extra).start()


async def _up(rt, name: str) -> bool:  # type: ignore[no-untyped-def]
    _, body = await api(rt, "GET", "/admin/v1/nodes")
    return any(n["name"] == name and n["state"] == "up" for n in body["nodes"])


SERVERS = pytest.mark.parametrize("server", ["llmgw", "grpcio"])  # control.grpc_server: both serve TLS alike


@SERVERS
async def test_tls_agent_trusting_the_ca_joins_plaintext_does_not(pki: dict[str, Path], tmp_path: Path,
                                                                   server: str) -> None:
    port = free_port()
    async with control_runtime(port, tls_cert=str(pki["server.pem"]), tls_key=str(pki["server.key"]),
                               grpc_server=server) as rt:
        a = _agent(tmp_path, port, "tls-node", "--tls-ca", str(pki["ca.pem"]))
        try:
            await wait_for(lambda: _up(rt, "tls-node"), what="the TLS agent up")
        finally:
            a.stop()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await _register(port, None)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        # a server certificate from a CA the client does not trust: refused too
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await _register(port, grpc.ssl_channel_credentials(root_certificates=pki["client.pem"].read_bytes()))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


async def _agent_says(port: int, tmp_path: Path, *extra: str) -> str:
    """What a real ``llmgw agent`` writes until its first retry warning (at most 20 s), then stopped."""
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    env["LLMGW_JOIN_TOKEN"] = TOKEN
    proc = await asyncio.create_subprocess_exec(  # (the control plane runs on this loop)
        sys.executable, "-m", "llmgw", "agent", "--control", f"127.0.0.1:{port}", "--token-env", "LLMGW_JOIN_TOKEN",
        "--name", "tls-probe", "--gpu-source", "none", "--state-dir", str(tmp_path / "probe-state"), *extra,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, env=env,
    )
    assert proc.stderr is not None
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not any("retrying with backoff" in ln for ln in lines):
            try:
                raw = await asyncio.wait_for(proc.stderr.readline(), max(0.1, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                break
            if not raw:
                break
            lines.append(raw.decode(errors="replace"))
        await asyncio.sleep(1.0)  # (a few more tries: gRPC's own lines, if any, would come with each)
    finally:
        proc.terminate()
        rest = await asyncio.wait_for(proc.stderr.read(), 10)
        await asyncio.wait_for(proc.wait(), 10)
    return "".join(lines) + rest.decode(errors="replace")


async def test_a_tls_mismatch_is_said_once_with_the_fix(pki: dict[str, Path], tmp_path: Path) -> None:
    """A plaintext agent against TLS, an agent trusting the wrong CA, a TLS agent against plaintext:
    each says what to change in its warning, and none of gRPC's own per-handshake lines reach stderr."""
    port = free_port()
    async with control_runtime(port, tls_cert=str(pki["server.pem"]), tls_key=str(pki["server.key"])):
        plain = await _agent_says(port, tmp_path)
        wrong_ca = await _agent_says(port, tmp_path, "--tls-ca", str(pki["client.pem"]))
    port = free_port()
    async with control_runtime(port):
        tls_to_plain = await _agent_says(port, tmp_path, "--tls")
    for text, fix in ((plain, "if the control plane serves TLS, add --tls"),
                      (wrong_ca, "give the CA that signed it with --tls-ca"),
                      (tls_to_plain, "does not serve TLS: drop --tls")):
        said = [ln for ln in text.splitlines() if "retrying with backoff" in ln]
        assert said and all(fix in ln for ln in said), text
        assert "ssl_transport_security" not in text and "Handshake failed" not in text, text
        assert TOKEN not in text


@SERVERS
async def test_mutual_tls_needs_a_client_certificate(pki: dict[str, Path], tmp_path: Path, server: str) -> None:
    port = free_port()
    async with control_runtime(
        port, tls_cert=str(pki["server.pem"]), tls_key=str(pki["server.key"]), tls_client_ca=str(pki["ca.pem"]),
        grpc_server=server,
    ) as rt:
        a = _agent(tmp_path, port, "mtls-node", "--tls-ca", str(pki["ca.pem"]),
                   "--tls-cert", str(pki["client.pem"]), "--tls-key", str(pki["client.key"]))
        try:
            await wait_for(lambda: _up(rt, "mtls-node"), what="the mTLS agent up")
        finally:
            a.stop()
        # server-auth TLS only (no client certificate): the handshake fails
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await _register(port, grpc.ssl_channel_credentials(root_certificates=pki["ca.pem"].read_bytes()))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        ok = await _register(port, grpc.ssl_channel_credentials(
            root_certificates=pki["ca.pem"].read_bytes(), private_key=pki["client.key"].read_bytes(),
            certificate_chain=pki["client.pem"].read_bytes(),
        ))
        assert ok.node_id


async def test_plaintext_off_loopback_is_refused_unless_allowed() -> None:
    port = free_port()
    cfg = control_config(port)
    off = dataclasses.replace(cfg.control, listen=("0.0.0.0", port))
    cp = ControlPlane(lambda: _with(cfg, off))
    with pytest.raises(ConfigError) as e:
        await cp.start()
    assert "allow_insecure" in str(e.value) and "tls_cert" in str(e.value)
    allowed = dataclasses.replace(off, allow_insecure=True)
    cp = ControlPlane(lambda: _with(cfg, allowed))
    await cp.start()
    try:
        assert cp.address is not None and cp.address[1] == port and not cp.tls
    finally:
        await cp.stop()


async def test_no_join_token_is_a_config_error() -> None:
    cfg = control_config(free_port())
    none = dataclasses.replace(cfg.control, join_tokens=())
    with pytest.raises(ConfigError, match="join token"):
        await ControlPlane(lambda: _with(cfg, none)).start()


def test_tls_config_rules() -> None:
    from llmgw.config import load

    with pytest.raises(ConfigError, match="tls_key"):
        load({"control": {"listen": ":1", "join_token": "t", "tls_cert": "/x.pem"}})
    with pytest.raises(ConfigError, match="tls_client_ca"):
        load({"control": {"listen": ":1", "join_token": "t", "tls_client_ca": "/ca.pem"}})
    c = load({"control": {"listen": ":1", "join_token": "t", "tls_cert": "/c", "tls_key": "/k", "tls_client_ca": "/ca",
                          "allow_insecure": True}}).control
    assert c is not None and (c.tls_cert, c.tls_key, c.tls_client_ca, c.allow_insecure) == ("/c", "/k", "/ca", True)


def _with(cfg: Any, control: Any) -> Any:
    return dataclasses.replace(cfg, control=control)


def test_a_control_plane_alone_is_something_to_serve() -> None:
    from llmgw.config import load
    from llmgw.config.loading import serve_problems

    assert serve_problems(load({"control": {"listen": "127.0.0.1:1", "join_token": "t"}})) == []
    assert serve_problems(load({}))  # still refused: nothing to serve


async def test_agent_config_file_carries_mutual_tls(pki: dict[str, Path], tmp_path: Path) -> None:
    """``llmgw agent --config FILE`` as a process: tls_ca, tls_cert and tls_key from the file, against a control
    plane that requires a client certificate."""
    import os
    import signal
    import sys

    port = free_port()
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(
        f"control: 127.0.0.1:{port}\ntoken_env: JOIN\nname: mtls-file-node\ngpu_source: none\n"
        f"tls_ca: {pki['ca.pem']}\ntls_cert: {pki['client.pem']}\ntls_key: {pki['client.key']}\n"
        f"state_dir: {tmp_path / 'state'}\n"
    )
    async with control_runtime(port, tls_cert=str(pki["server.pem"]), tls_key=str(pki["server.key"]),
                               tls_client_ca=str(pki["ca.pem"])) as rt:
        p = subprocess.Popen([sys.executable, "-m", "llmgw", "agent", "--config", str(cfg)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, env={**os.environ, "JOIN": TOKEN})
        try:
            await wait_for(lambda: _up(rt, "mtls-file-node"), what="the mTLS agent from its file up")
        finally:
            p.send_signal(signal.SIGTERM)
            _, err = p.communicate(timeout=15)
        assert p.returncode == 0, err


def test_agent_file_tls_pair_must_be_whole(tmp_path: Path) -> None:
    from llmgw.config.agent import load_agent_file

    cfg = tmp_path / "agent.yaml"
    cfg.write_text("control: cp0:7070\ntls_cert: /etc/llmgw/client.pem\n")
    with pytest.raises(ConfigError) as e:
        load_agent_file(cfg)
    assert "tls_key: tls_cert and tls_key go together" in str(e.value)
