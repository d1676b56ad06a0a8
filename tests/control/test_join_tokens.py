"""Join tokens made at run time (``llmgw ctl tokens``) on one control plane with its SQLite database:
an agent joins with one over real gRPC, an expired one is refused saying so, the secret is printed
once and appears in no list, log or error; and the tokens outlive the control plane's restart."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import grpc
import orjson
import pytest
from click.testing import CliRunner, Result
from cp_helpers import TOKEN, control_plane, control_runtime, free_port, metrics, pick
from scenario import discovery_of, h100s

from llmgw._proto.agent.v1 import agent_pb2_grpc
from llmgw.agent.wire import PROTOCOL, discovery_to_proto, pb
from llmgw.cli.ctl import ctl
from llmgw.control.tokens import JoinTokens, parse_expiry
from llmgw.runtime import GatewayRuntime

pytestmark = pytest.mark.timeout(60)


async def invoke(rt: GatewayRuntime, *args: str) -> Result:
    assert rt.admin_addr is not None
    admin = f"http://127.0.0.1:{rt.admin_addr[1]}"
    return await asyncio.to_thread(CliRunner().invoke, ctl, ["--admin", admin, *args], catch_exceptions=False)


async def register(port: int, name: str, token: str) -> pb.RegisterResponse:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = agent_pb2_grpc.AgentServiceStub(ch)
        req = pb.RegisterRequest(node_name=name, agent_version="test",
                                 protocol=pb.ProtocolVersion(major=PROTOCOL[0], minor=PROTOCOL[1]),
                                 discovery=discovery_to_proto(discovery_of({"gpus": h100s(1)})))
        resp: pb.RegisterResponse = await stub.Register(req, metadata=[("authorization", f"Bearer {token}")],
                                                        timeout=5)
        return resp


async def admin(rt: GatewayRuntime, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    assert rt.admin_addr is not None
    data = b"" if body is None else orjson.dumps(body)
    r, w = await asyncio.open_connection("127.0.0.1", rt.admin_addr[1])
    try:
        w.write(f"{method} {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: {len(data)}\r\n"
                "content-type: application/json\r\n\r\n".encode() + data)
        raw = await asyncio.wait_for(r.read(), 10)
    finally:
        w.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), orjson.loads(payload)


async def test_ctl_tokens_create_list_revoke_and_an_agent_joining(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    url = f"sqlite:///{tmp_path / 'control.db'}"
    port = free_port()
    async with control_runtime(port, database=url) as rt:
        made = await invoke(rt, "tokens", "create", "--name", "rack-1", "--expires", "7d")
        assert made.exit_code == 0, made.output
        secret = made.stdout.strip()
        assert secret.startswith("llmgw-join-") and "\n" not in secret
        assert "not shown again" in made.stderr and secret not in made.stderr
        tid = secret.split("-")[2]

        listed = await invoke(rt, "tokens", "list")
        assert listed.exit_code == 0 and tid in listed.stdout and "rack-1" in listed.stdout
        assert "active" in listed.stdout and "1 token(s) from the configuration" in listed.stdout
        assert secret not in listed.stdout
        as_json = orjson.loads((await invoke(rt, "tokens", "list", "--json")).stdout)
        row = next(t for t in as_json["tokens"] if t["id"] == tid)
        assert row["last_used_at"] is None  # never used: absent, not 0
        assert 7 * 86400 - 5 < row["expires_at"] - row["created_at"] <= 7 * 86400

        # an agent joins with it (the config's token is not needed); the token is now "used"
        resp = await register(port, "gpu-a", secret)
        assert resp.node_id
        row = next(t for t in orjson.loads((await invoke(rt, "tokens", "list", "--json")).stdout)["tokens"]
                   if t["id"] == tid)
        assert row["last_used_at"] is not None and row["last_used_at"] >= row["created_at"]

        # revoked: refused at the next call, saying which token and why
        out = await invoke(rt, "tokens", "revoke", tid)
        assert out.exit_code == 0 and f"join token {tid} revoked" in out.stdout and "gpu-a" in out.stdout
        assert "gpu-a" not in control_plane(rt).credentials  # (its blob-mirror credential went with it)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await register(port, "gpu-a", secret)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert f"join token {tid} (rack-1) is revoked" in (err.value.details() or "")
        assert secret not in (err.value.details() or "")
        assert "already revoked" in (await invoke(rt, "tokens", "revoke", tid)).stdout
        missing = await invoke(rt, "tokens", "revoke", "0badc0de")
        assert missing.exit_code == 1 and "no join token" in missing.output

        # an expired token: refused as expired
        status, short = await admin(rt, "POST", "/admin/v1/join-tokens", {"expires": 1})
        assert status == 201
        await register(port, "gpu-b", short["token"])
        await asyncio.sleep(1.1)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await register(port, "gpu-b", short["token"])
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and "is expired" in (err.value.details() or "")
        # a made-up one is a wrong token, as before; the config's token still joins
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await register(port, "gpu-c", f"llmgw-join-{tid}-guessed")
        assert "wrong join token" in (err.value.details() or "")
        await register(port, "gpu-c", TOKEN)

        m = await metrics(rt)
        assert pick(m, "llmgw_control_joins_refused_total", reason="revoked_token") == [1.0]
        assert pick(m, "llmgw_control_joins_refused_total", reason="expired_token") == [1.0]

        # bad requests
        for body, param in (({"expires": "tomorrow"}, "expires"), ({"expires": -5}, "expires"),
                            ({"name": ""}, "name"), ({"secret": "x"}, None)):
            status, e = await admin(rt, "POST", "/admin/v1/join-tokens", body)
            assert status == 400 and e["error"].get("param") == param, (body, e)
        assert control_plane(rt).api_tokens.get(tid) is not None
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert secret not in logged and short["token"] not in logged
    assert f"join token {tid} (rack-1) made" in logged

    # the tokens are in the database: a restarted control plane honours the revocation and the active one
    async with control_runtime(port, database=url) as rt:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await register(port, "gpu-a", secret)
        assert "is revoked" in (err.value.details() or "")
        status, listed = await admin(rt, "GET", "/admin/v1/join-tokens")
        assert status == 200 and [t["state"] for t in listed["tokens"]] == ["revoked", "expired"]


def test_expiry_durations() -> None:
    assert parse_expiry("90s") == 90 and parse_expiry("30m") == 1800 and parse_expiry("12h") == 43200
    assert parse_expiry("7d") == 7 * 86400 and parse_expiry("2w") == 14 * 86400 and parse_expiry(60) == 60
    assert parse_expiry(None) is None
    for bad in ("0s", "soon", "-1d", True, [], "11000d"):
        with pytest.raises(ValueError):
            parse_expiry(bad)


def test_a_secret_is_never_in_a_repr_and_a_miss_is_unknown() -> None:
    from llmgw.control.tokens import JoinToken, new_token

    tid, secret = new_token()
    import hashlib

    reg = JoinTokens()
    reg.put(JoinToken(tid, "n", hashlib.sha256(secret.encode()).digest(), 1.0))
    assert secret not in repr(reg.all()) and hashlib.sha256(secret.encode()).hexdigest() not in repr(reg.all())
    assert reg.check(secret, now=2.0)[0] == "ok"
    reg.joined("node", secret)
    assert reg.check(secret[:-1] + ("A" if secret[-1] != "A" else "B"), now=2.0) == ("unknown", None)
    assert reg.check("not-a-join-token") == ("unknown", None)
    assert reg.revoked(tid, 3.0) == ["node"]
    assert reg.check(secret, now=4.0)[0] == "revoked"


def _tok(tid: str, created: float = 1.0, revoked: float | None = None) -> Any:
    import hashlib

    from llmgw.control.tokens import JoinToken

    return JoinToken(tid, None, hashlib.sha256(tid.encode()).digest(), created, None, revoked)


def test_a_read_begun_before_a_change_never_undoes_it() -> None:
    reg = JoinTokens()
    reg.merge([_tok("00000001")], reg.version)
    since = reg.version  # a read begins here: it sees 00000001 active and not 00000002
    reg.revoked("00000001", 5.0)
    reg.put(_tok("00000002", 4.0))
    reg.merge([_tok("00000001")], since)
    got = reg.get("00000001")
    assert got is not None and got.revoked_at == 5.0  # the revocation holds
    assert reg.get("00000002") is not None  # the token made meanwhile is kept
    # a read begun after both: the database's answer is taken (a row gone from it goes here too)
    reg.merge([_tok("00000001", revoked=5.0)], reg.version)
    assert reg.get("00000002") is None and reg.get("00000001") is not None
    # a read never clears a revocation, and the earlier revocation time stays
    reg.merge([_tok("00000001", revoked=9.0)], reg.version)
    reg.merge([_tok("00000001")], reg.version)
    got = reg.get("00000001")
    assert got is not None and got.revoked_at == 5.0


def test_node_names_are_remembered_only_once_registered_and_forgotten_when_they_leave() -> None:
    import hashlib

    from llmgw.control.tokens import JoinToken, new_token

    reg = JoinTokens()
    tid, secret = new_token()
    reg.put(JoinToken(tid, None, hashlib.sha256(secret.encode()).digest(), 1.0, 10.0))
    for _ in range(3):  # (checks alone remember nothing: a heartbeat's claimed name is not recorded)
        assert reg.check(secret, now=2.0)[0] == "ok"
    assert reg.dead_nodes(20.0) == []
    reg.joined("gpu-a", secret)
    reg.joined("gpu-b", "not-an-api-token")
    assert reg.dead_nodes(5.0) == [] and reg.dead_nodes(10.0) == ["gpu-a"]  # expired at 10
    reg.forget("gpu-a")
    assert reg.dead_nodes(20.0) == [] and reg.revoked(tid, 3.0) == []


def test_ctl_prints_node_names_safely() -> None:
    from llmgw.cli.ctl import _printable

    assert _printable("gpu-a") == "gpu-a"
    shown = _printable("evil\x1b[2J\x07name")
    assert "\x1b" not in shown and "\x07" not in shown and "evil" in shown
    assert len(_printable("n" * 500)) == 100


async def _load_delayed(monkeypatch: pytest.MonkeyPatch, delay: float) -> asyncio.Event:
    """The next ApiTokenStore.load answers ``delay`` seconds after its rows were read (the answer of a
    busy database connection); later loads answer at once. Set when that slow read has begun."""
    from llmgw.control import db as dbmod

    real = dbmod.ApiTokenStore.load
    begun = asyncio.Event()

    async def load(self: Any) -> list[tuple[Any, ...]]:
        rows = await real(self)
        if not begun.is_set():
            begun.set()
            await asyncio.sleep(delay)
        return rows

    monkeypatch.setattr(dbmod.ApiTokenStore, "load", load)
    return begun


async def test_a_list_read_before_a_revoke_does_not_undo_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    async with control_runtime(port, database=f"sqlite:///{tmp_path / 'control.db'}") as rt:
        cp = control_plane(rt)
        status, made = await admin(rt, "POST", "/admin/v1/join-tokens", {"name": "rack-1"})
        assert status == 201
        secret, tid = made["token"], made["id"]
        await register(port, "gpu-a", secret)
        begun = await _load_delayed(monkeypatch, 0.5)
        lister = asyncio.create_task(admin(rt, "GET", "/admin/v1/join-tokens"))  # a dashboard polling the list
        await asyncio.wait_for(begun.wait(), 5)
        status, revoked = await admin(rt, "DELETE", f"/admin/v1/join-tokens/{tid}")
        assert status == 200 and revoked["changed"] is True and revoked["state"] == "revoked"
        status, other = await admin(rt, "POST", "/admin/v1/join-tokens", {"name": "rack-2"})
        assert status == 201
        status, listed = await asyncio.wait_for(lister, 10)
        assert status == 200  # (it answers from memory after taking in its read: the changes made meanwhile)
        assert {t["id"]: t["state"] for t in listed["tokens"]} == {tid: "revoked", other["id"]: "active"}
        assert cp.api_tokens.check(secret)[0] == "revoked"  # the stale read changed nothing
        assert cp.api_tokens.get(other["id"]) is not None
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await register(port, "gpu-a", secret)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and "is revoked" in (err.value.details() or "")
        await register(port, "gpu-b", other["token"])


async def test_mirror_credentials_go_however_the_token_stopped_being_active(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from llmgw.control.db import ApiTokenStore

    port = free_port()
    async with control_runtime(port, database=f"sqlite:///{tmp_path / 'control.db'}", lease="0.9s") as rt:
        cp = control_plane(rt)
        # revoked in the database behind this process's back (the last leader, or a revoke whose answer was lost)
        status, made = await admin(rt, "POST", "/admin/v1/join-tokens", {})
        assert status == 201
        await register(port, "gpu-a", made["token"])
        assert "gpu-a" in cp.credentials
        async with cp.leadership.transaction() as (tx, epoch):
            assert await ApiTokenStore(cp.db).revoke(tx, made["id"], 1.0, epoch) == 1
        status, again = await admin(rt, "DELETE", f"/admin/v1/join-tokens/{made['id']}")
        assert status == 200 and again["changed"] is False and again["nodes"] == ["gpu-a"]
        assert "gpu-a" not in cp.credentials

        # expired: the token loop takes the credential within a third of the lease, even after failing
        status, short = await admin(rt, "POST", "/admin/v1/join-tokens", {"expires": 1})
        assert status == 201
        await register(port, "gpu-b", short["token"])
        assert "gpu-b" in cp.credentials
        real, fails = JoinTokens.dead_nodes, [0]

        def flaky(self: JoinTokens, now: float) -> list[str]:
            if fails[0] < 2:  # (the loop's first rounds fail as a bad row would)
                fails[0] += 1
                raise ValueError("non-hexadecimal number found in fromhex() arg")
            return real(self, now)

        monkeypatch.setattr(JoinTokens, "dead_nodes", flaky)
        caplog.set_level(logging.INFO)
        for _ in range(100):  # (bounded: 10 s)
            if "gpu-b" not in cp.credentials:
                break
            await asyncio.sleep(0.1)
        assert "gpu-b" not in cp.credentials and fails[0] == 2
        errors = [r for r in caplog.records if "join tokens: ValueError" in r.getMessage()]
        assert len(errors) == 1  # said once, not once a round
        assert short["token"] not in caplog.text and made["token"] not in caplog.text


async def test_a_bad_node_name_is_not_remembered_and_a_node_that_left_is_forgotten(tmp_path: Path) -> None:
    port = free_port()
    async with control_runtime(port, database=f"sqlite:///{tmp_path / 'control.db'}") as rt:
        status, made = await admin(rt, "POST", "/admin/v1/join-tokens", {})
        assert status == 201
        secret = made["token"]
        for bad in ("evil\x1b]0;owned\x07", "has space", "n" * 500):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await register(port, bad, secret)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        resp = await register(port, "gpu-a", secret)
        await register(port, "gpu-c", secret)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = agent_pb2_grpc.AgentServiceStub(ch)
            gone = await stub.Deregister(pb.DeregisterRequest(node_id=resp.node_id, node_name="gpu-a", reason="test"),
                                         metadata=[("authorization", f"Bearer {secret}")], timeout=5)
        assert gone.removed
        status, revoked = await admin(rt, "DELETE", f"/admin/v1/join-tokens/{made['id']}")
        assert status == 200 and revoked["nodes"] == ["gpu-c"]
        out = await invoke(rt, "tokens", "revoke", made["id"])
        assert out.exit_code == 0 and "already revoked" in out.stdout


async def test_token_routes_answer_503_before_the_database_is_ready(tmp_path: Path) -> None:
    port = free_port()
    async with control_runtime(port, database=f"sqlite:///{tmp_path / 'control.db'}") as rt:
        cp = control_plane(rt)
        lead, db = cp.leadership, cp.db
        cp.leadership = cp.db = None  # (as between attach_tokens and the database's start)
        try:
            for method, path in (("GET", "/admin/v1/join-tokens"), ("DELETE", "/admin/v1/join-tokens/0badc0de"),
                                 ("POST", "/admin/v1/join-tokens")):
                status, e = await admin(rt, method, path, {} if method == "POST" else None)
                assert status == 503 and e["error"]["code"] == "database_unavailable", (method, e)
        finally:
            cp.leadership, cp.db = lead, db
