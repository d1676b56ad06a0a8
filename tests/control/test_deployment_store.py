"""Desired state on disk: deployments (from the file and from ``ctl deploy``) and their placed replicas
survive a real ``llmgw serve`` restart; a ``ctl scale`` of a config deployment holds until its entry
changes; a mirror reference brings its blobs and its memory need from the mirror's GGUF facts."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner, Result
from cp_helpers import TOKEN, free_port, wait_for
from test_deployments import register

from llmgw.agent.model import GPU, Discovery, NodeFacts
from llmgw.cli.ctl import ctl
from llmgw.config import load
from llmgw.control.db import MIGRATIONS, DesiredStore, Migration, open_database, unfenced
from llmgw.control.dburl import default_database, parse_database_url
from llmgw.control.deployments import DeploymentController, parse_deployment
from llmgw.control.nodes import NodeMap
from llmgw.control.resolve import mirror_resolver
from llmgw.errors import ConfigError
from llmgw.launch.spec import ReplicaStatus

pytestmark = pytest.mark.timeout(120)

GIB = 1024**3


def test_database_urls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SQLAlchemy's forms; the default where the earlier deployments store was (an upgrade finds it)."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    assert default_database(None).path == str(tmp_path / "xdg" / "llmgw" / "control.sqlite3")
    # under systemd's StateDirectory= (ProtectHome: the home is not writable), there
    monkeypatch.setenv("STATE_DIRECTORY", f"{tmp_path / 'sd'}:{tmp_path / 'other'}")
    assert default_database(None).path == str(tmp_path / "sd" / "control.sqlite3")
    monkeypatch.delenv("STATE_DIRECTORY")
    assert default_database(str(tmp_path / "s" / "control.json")).path == str(tmp_path / "s" / "deployments.sqlite3")
    assert parse_database_url("sqlite:///var/lib/llmgw/cp.db").path == "var/lib/llmgw/cp.db"  # (relative)
    assert parse_database_url("sqlite:////var/lib/llmgw/cp.db").path == "/var/lib/llmgw/cp.db"
    assert parse_database_url("sqlite::memory:").path == ":memory:"
    assert parse_database_url("postgres://u:pw@db:5432/llmgw").dialect == "postgresql"
    for bad in ("sqlite://host/cp.db", "sqlite:cp.db", "sqlite:", "sqlite:///"):
        with pytest.raises(ConfigError, match="sqlite:////ABSOLUTE/PATH"):
            parse_database_url(bad)
    with pytest.raises(ConfigError, match="expected postgresql://") as e:
        parse_database_url("mysql://u:pw-secret@db/x")
    assert "pw-secret" not in str(e.value)


async def test_the_store_keeps_what_the_controller_decides(tmp_path: Path) -> None:
    """Replicas reach their node's set only once their row is committed; a restart loads the same set;
    an older llmgw's deployments store in the same file is imported; a newer schema is refused."""
    path = tmp_path / "cp.sqlite3"
    with sqlite3.connect(path) as old:  # the earlier store's tables, as llmgw 0.x left them
        old.executescript(
            "CREATE TABLE deployments (name TEXT PRIMARY KEY, source TEXT NOT NULL, spec TEXT NOT NULL, "
            "replicas_override INTEGER, override_of TEXT, updated_at REAL NOT NULL);"
            "CREATE TABLE replicas (id TEXT PRIMARY KEY, deployment TEXT NOT NULL, node TEXT NOT NULL, "
            "spec TEXT NOT NULL, created_at REAL NOT NULL);")
        old.execute("INSERT INTO deployments VALUES ('old', 'api', ?, NULL, NULL, 1.0)",
                    (json.dumps({"name": "old", "model": "m0", "engine": "llamacpp", "replicas": 1}),))
        old.execute("INSERT INTO replicas VALUES ('old-abc123', 'old', 'n', ?, 2.0)",
                    (json.dumps({"gpus": [], "api_key": "k-old"}),))
    nodes = NodeMap(lambda: 60.0)
    nodes.register("n", peer="p", agent_version="t", protocol=(1, 2), discovery=Discovery(NodeFacts("h", cpu_cores=8)))
    db = open_database(f"sqlite:///{path}")
    await db.open()
    try:
        assert 4 in await db.migrate()
        store = DesiredStore(db, unfenced(db))
        await store.load()
        ctl_ = DeploymentController(nodes=nodes, store=store, router=None, config=lambda: load({}),
                                    resolver=lambda m: None)
        assert [s.id for s in ctl_.desired("n")[1]] == ["old-abc123"]
        ctl_.create(parse_deployment({"name": "new", "model": "/models/m1.gguf", "engine": "llamacpp", "replicas": 2}))
        assert store.pending > 0 and len(ctl_.desired("n")[1]) == 1  # placed, not told yet
        await ctl_.committed()
        assert store.pending == 0
        ids = sorted(s.id for s in ctl_.desired("n")[1])
        assert len(ids) == 3
        store2 = DesiredStore(db, unfenced(db))
        await store2.load()
        assert sorted(r.id for r in store2.replicas()) == ids and {d.name for d in store2.deployments()} == {"old", "new"}
        assert oct(os.stat(path).st_mode & 0o777) == "0o600"  # (it holds the replicas' API keys)
        future = (*MIGRATIONS, Migration(len(MIGRATIONS) + 1, "from the future", ("CREATE TABLE llmgw_f (x INT)",)))
        await db.migrate(future)
        with pytest.raises(ConfigError, match="upgrade llmgw"):
            await db.migrate()
    finally:
        await db.close()


async def _memory_store() -> tuple[Any, DesiredStore]:
    db = open_database("sqlite::memory:")
    await db.open()
    await db.migrate()
    store = DesiredStore(db, unfenced(db))
    await store.load()
    return db, store


async def test_a_mirror_reference_brings_blobs_and_its_memory_need(tmp_path: Path) -> None:
    from llmgw.mirror.importer import import_file
    from llmgw.mirror.store import MirrorStore
    from llmgw.testing.gguf_model import write_tiny_llama

    root = tmp_path / "mirror"
    with MirrorStore(root) as store:
        import_file(store, write_tiny_llama(tmp_path / "tiny.gguf", ctx=2048), name="tiny:1b")
    size = (tmp_path / "tiny.gguf").stat().st_size
    kv = 2 * 2 * 1024 * 16 * 4 * 2  # K and V, 2 layers, 1024 tokens, head dim 16, 4 KV heads, f16
    nodes = NodeMap(lambda: 60.0)
    need = size + kv + 256 * 2**20  # the file, the KV cache, the engine's compute buffers (the margin's floor)
    small = need - 1  # one byte short
    nodes.register("cpu-1", peer="ipv4:127.0.0.1:1", agent_version="t", protocol=(1, 2), discovery=Discovery(
        NodeFacts("h", cpu_cores=4, memory_total_bytes=small, memory_available_bytes=small)))
    cfg = load({"deployments": [{"name": "tiny", "model": "tiny:1b", "engine": "llamacpp", "context": 1024,
                                 "replicas": 2}]})
    db, store = await _memory_store()
    ctl_ = DeploymentController(nodes=nodes, store=store, router=None, config=lambda: cfg, resolver=mirror_resolver(root))
    try:
        ctl_.sync(10.0)
        d = ctl_.view("tiny")
        assert d["placed"] == 0 and d["mirror"] == "tiny:1b"
        assert d["message"].startswith(f"needs {need / 1024**2:.0f} MiB of node memory; no node is eligible; "
                                       "cpu-1 has"), d["message"]
        big = 2 * need  # room for both: CPU replicas share a node
        nodes.register("cpu-1", peer="ipv4:127.0.0.1:1", agent_version="t", protocol=(1, 2), discovery=Discovery(
            NodeFacts("h", cpu_cores=4, memory_total_bytes=big, memory_available_bytes=big)))
        ctl_.sync(10.0)
        await ctl_.committed()
        _, specs = ctl_.desired("cpu-1")
        assert len(specs) == 2 and ctl_.view("tiny")["message"] is None
        s = specs[0]
        assert (s.model, s.engine, s.gpus, s.context) == ("tiny:1b", "llamacpp", (), 1024)
        assert [(b.role, b.size) for b in s.blobs] == [("model", size)] and s.blobs[0].digest.startswith("sha256:")
        assert specs[0].api_key != specs[1].api_key
        assert ctl_.node_blobs("cpu-1") == {s.blobs[0].digest} and ctl_.node_blobs("elsewhere") == frozenset()
        # a path and a name the mirror lacks go to the engine as they are
        assert mirror_resolver(root)("/models/x.gguf") is None and mirror_resolver(root)("meta-llama/Llama-3") is None
    finally:
        await ctl_.stop()
        await db.close()


async def test_a_restart_hands_replicas_the_specs_they_run_whatever_the_mirror_says_now(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """Replicas of a mirror model run on while the control plane restarts after the model left the
    mirror (or was imported again under its name): the next control plane hands each node the specs
    its replicas run (a spec made again would restart them, as an engine name they crash on). A model
    whose blob is missing is refused by ``ctl deploy`` and placed by no entry, naming the blob, with no
    traceback."""
    from llmgw.control.deployments import DeploymentError
    from llmgw.mirror.errors import CorruptBlobError
    from llmgw.mirror.importer import import_file
    from llmgw.mirror.store import MirrorStore
    from llmgw.testing.gguf_model import write_tiny_llama

    root = tmp_path / "mirror"
    with MirrorStore(root) as ms:
        import_file(ms, write_tiny_llama(tmp_path / "tiny.gguf", ctx=2048), name="tiny:1b")
    nodes = NodeMap(lambda: 60.0)
    nodes.register("cpu-1", peer="ipv4:127.0.0.1:1", agent_version="t", protocol=(1, 2), discovery=Discovery(
        NodeFacts("h", cpu_cores=8, memory_total_bytes=64 * GIB, memory_available_bytes=64 * GIB)))
    cfg = load({"deployments": [{"name": "tiny", "model": "tiny:1b", "engine": "llamacpp", "context": 1024,
                                 "replicas": 2}]})
    db, store = await _memory_store()
    ctl_ = DeploymentController(nodes=nodes, store=store, router=None, config=lambda: cfg, resolver=mirror_resolver(root))
    try:
        await _sync(ctl_)
        before = ctl_.desired("cpu-1")[1]
        assert len(before) == 2 and all(s.blobs and s.model == "tiny:1b" for s in before)
    finally:
        await ctl_.stop()
    for resolver in (lambda m: None, mirror_resolver(tmp_path / "another-mirror")):  # gone from the mirror
        store2 = DesiredStore(db, unfenced(db))
        await store2.load()
        ctl2 = DeploymentController(nodes=nodes, store=store2, router=None, config=lambda: cfg, resolver=resolver)
        try:
            await _sync(ctl2)
            assert ctl2.desired("cpu-1")[1] == before  # the same specs: no engine restarted
        finally:
            await ctl2.stop()

    def corrupt(model: str) -> Any:
        raise CorruptBlobError("its model blob sha256:abc is missing; run llmgw mirror verify and import the model again")

    cfg2 = load({"deployments": [{"name": "broken", "model": "tiny:1b", "engine": "llamacpp", "replicas": 1}]})
    ctl3 = DeploymentController(nodes=nodes, store=(await _memory_store())[1], router=None, config=lambda: cfg2,
                                resolver=corrupt)
    try:
        caplog.clear()
        await _sync(ctl3)
        d = ctl3.view("broken")
        assert d["placed"] == 0 and "is in the mirror but cannot be used" in d["message"], d
        assert "blob sha256:abc is missing" in d["message"] and not ctl3.desired("cpu-1")[1]
        assert not any(r.exc_info for r in caplog.records), [r.getMessage() for r in caplog.records]
        with pytest.raises(DeploymentError) as e:
            ctl3.create(parse_deployment({"name": "again", "model": "tiny:1b", "engine": "llamacpp"}))
        assert e.value.code == "model_not_usable" and "blob sha256:abc is missing" in e.value.message
    finally:
        await ctl3.stop()
        await db.close()


async def test_a_failed_replica_whose_mirror_blob_was_found_corrupt_is_not_placed_again(tmp_path: Path) -> None:
    """A blob corrupt in the mirror with its size intact: nodes refuse the bytes and the replica fails, and
    a new one was placed every backoff, each node fetching the whole blob in vain, for good. Once ``llmgw
    mirror verify`` has moved it out, the next failure stops the placing with the reason and the fix; the
    model imported again, replicas are placed again. The replica that runs keeps running."""
    from llmgw.mirror.importer import import_file
    from llmgw.mirror.store import MirrorStore
    from llmgw.testing.gguf_model import write_tiny_llama

    root = tmp_path / "mirror"
    model = write_tiny_llama(tmp_path / "tiny.gguf", ctx=2048)
    with MirrorStore(root) as ms:
        import_file(ms, model, name="tiny:1b")
    clock = [100.0]
    nodes = NodeMap(lambda: 60.0)
    for name in ("cpu-1", "cpu-2"):
        nodes.register(name, peer="ipv4:127.0.0.1:1", agent_version="t", protocol=(1, 2), discovery=Discovery(
            NodeFacts("h", cpu_cores=8, memory_total_bytes=64 * GIB, memory_available_bytes=64 * GIB)))
    cfg = load({"deployments": [{"name": "tiny", "model": "tiny:1b", "engine": "llamacpp", "context": 1024,
                                 "replicas": 2}]})
    db, store = await _memory_store()
    ctl_ = DeploymentController(nodes=nodes, store=store, router=None, config=lambda: cfg,
                                resolver=mirror_resolver(root), clock=lambda: clock[0])
    try:
        await _sync(ctl_)
        (s1,), (s2,) = ctl_.desired("cpu-1")[1], ctl_.desired("cpu-2")[1]
        ctl_.report("cpu-1", "127.0.0.1", [ReplicaStatus(s1.id, "ready", port=9000)])
        with MirrorStore(root) as ms:
            (blob,) = ms.list_models()[0].files
            os.chmod(blob.path, 0o644)
            with open(blob.path, "r+b") as f:
                f.seek(100)
                f.write(b"\xff" * 8)
            (check,) = ms.verify(quarantine=True)
        assert check.status == "corrupt" and check.quarantined is not None and not blob.path.exists()
        ctl_.report("cpu-2", "127.0.0.1", [ReplicaStatus(s2.id, "failed", message="the bytes received hash to "
                                                          "sha256:0, not ...: the transfer was corrupt")])
        for _ in range(3):
            clock[0] += 120.0  # past any backoff
            await _sync(ctl_)
        d = ctl_.view("tiny")
        assert d["placed"] == 1 and [r["node"] for r in d["replicas"]] == ["cpu-1"], d["replicas"]
        assert f"was found corrupt and moved to {check.quarantined}; import the model again" \
            in d["message"], d["message"]
        assert ctl_.desired("cpu-1")[1] == (s1,)  # (the one that runs: the same spec, not restarted)
        with MirrorStore(root) as ms:
            import_file(ms, model, name="tiny:1b")  # (puts a verified copy back)
        clock[0] += 120.0
        await _sync(ctl_)
        assert ctl_.view("tiny")["placed"] == 2 and ctl_.view("tiny")["message"] is None
    finally:
        await ctl_.stop()
        await db.close()


async def test_nodes_refusing_a_mirror_blob_make_the_control_plane_check_its_own_copy(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """Nobody ran ``llmgw mirror verify``: a node's replica fails because the bytes the mirror sent did not
    hash to the blob. The control plane re-hashes its own copy (once, in a thread), finds it corrupt, moves
    it out of the mirror and places the model nowhere any more; a copy found intact changes nothing."""
    from llmgw.control.resolve import mirror_verifier
    from llmgw.mirror.errors import CORRUPT_TRANSFER
    from llmgw.mirror.importer import import_file
    from llmgw.mirror.store import MirrorStore
    from llmgw.testing.gguf_model import write_tiny_llama

    root = tmp_path / "mirror"
    with MirrorStore(root) as ms:
        import_file(ms, write_tiny_llama(tmp_path / "tiny.gguf", ctx=2048), name="tiny:1b")
        (blob,) = ms.list_models()[0].files
    clock = [100.0]
    nodes = NodeMap(lambda: 60.0)
    nodes.register("cpu-1", peer="ipv4:127.0.0.1:1", agent_version="t", protocol=(1, 2), discovery=Discovery(
        NodeFacts("h", cpu_cores=8, memory_total_bytes=64 * GIB, memory_available_bytes=64 * GIB)))
    cfg = load({"deployments": [{"name": "tiny", "model": "tiny:1b", "engine": "llamacpp", "context": 1024,
                                 "replicas": 1}]})
    db, store = await _memory_store()
    checked: list[frozenset[str]] = []
    verify = mirror_verifier(root)

    def verifier(digests: frozenset[str], stop: threading.Event) -> Mapping[str, str]:
        checked.append(digests)
        return verify(digests, stop)

    ctl_ = DeploymentController(nodes=nodes, store=store, router=None, config=lambda: cfg,
                                resolver=mirror_resolver(root), clock=lambda: clock[0], verifier=verifier)
    refused = f"the bytes received hash to sha256:0 (9 bytes), not {blob.digest}: {CORRUPT_TRANSFER} and was discarded"

    async def fail_the_replica() -> None:
        (spec,) = ctl_.desired("cpu-1")[1]
        ctl_.report("cpu-1", "127.0.0.1", [ReplicaStatus(spec.id, "failed", message=refused)])
        for _ in range(1000):  # (bounded: the check runs in a thread)
            if not ctl_._checking:
                break
            await asyncio.sleep(0.01)
        assert not ctl_._checking, "the check did not end within 10 s"
        clock[0] += 120.0  # past the backoff
        await _sync(ctl_)

    caplog.set_level("INFO", logger="llmgw.control")
    try:
        await _sync(ctl_)
        await fail_the_replica()  # the mirror's copy is intact: the transfer was corrupted on the way
        assert checked == [frozenset({blob.digest})] and blob.path.exists()
        assert ctl_.view("tiny")["placed"] == 1 and "intact" in caplog.text
        os.chmod(blob.path, 0o644)
        with open(blob.path, "r+b") as f:
            f.seek(100)
            f.write(b"\xff" * 8)
        await fail_the_replica()  # (checked at most once every CHECK_AGAIN_S)
        assert len(checked) == 1 and ctl_.view("tiny")["placed"] == 1
        clock[0] += 600.0
        await _sync(ctl_)
        await fail_the_replica()
        assert len(checked) == 2 and not blob.path.exists() and (root / "quarantine" / blob.digest[7:]).exists()
        d = ctl_.view("tiny")
        assert d["placed"] == 0 and "was found corrupt and moved to" in d["message"], d
        # clients are told it is not placed now, not that it will be after a backoff (it will not)
        assert ctl_._held_reason(ctl_.deployments["tiny"]) == (
            "no replica of its deployment can be placed now (llmgw ctl deployments says why)")
        assert "the mirror's copy of tiny:1b is corrupt" in caplog.text
        assert not any(r.exc_info for r in caplog.records)
    finally:
        await ctl_.stop()
        await db.close()


def test_the_mirror_check_says_what_it_found_stops_when_asked_and_hashes_only_what_it_is_asked(
    tmp_path: Path,
) -> None:
    """``mirror_verifier``: a corrupt blob it cannot move out (here: a file where quarantine/ goes) is
    'corrupt', not 'moved' (the controller then places on, and says so); a stop set ends the re-hash; only
    the digests asked for are hashed."""
    from llmgw.control.resolve import mirror_verifier
    from llmgw.mirror.importer import import_file
    from llmgw.mirror.store import MirrorStore
    from llmgw.testing.gguf_model import write_tiny_llama

    root = tmp_path / "mirror"
    with MirrorStore(root) as ms:
        import_file(ms, write_tiny_llama(tmp_path / "tiny.gguf", ctx=2048), name="tiny:1b")
        (blob,) = ms.list_models()[0].files
    verify = mirror_verifier(root)
    go, stop = threading.Event(), threading.Event()
    stop.set()
    assert verify(frozenset({blob.digest}), go) == {blob.digest: "ok"}
    assert verify(frozenset({"sha256:" + "0" * 64}), go) == {}  # (not the mirror's)
    assert verify(frozenset({blob.digest}), stop) == {}  # (stopped at the first chunk)
    os.chmod(blob.path, 0o644)
    with open(blob.path, "r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 8)
    (root / "quarantine").write_text("in the way")
    assert verify(frozenset({blob.digest}), go) == {blob.digest: "corrupt"} and blob.path.exists()
    (root / "quarantine").unlink()
    assert verify(frozenset({blob.digest}), go) == {blob.digest: "moved"} and not blob.path.exists()


def click_command_saying(say: Any) -> Any:
    import click

    return click.command()(lambda: say())


async def _ready(ctl_: DeploymentController, node: str, ids: set[str]) -> None:
    """``node``'s heartbeat: these replicas ready, the rest of its set starting."""
    ctl_.report(node, "127.0.0.1", [ReplicaStatus(s.id, "ready" if s.id in ids else "starting", port=9000 + i)
                                    for i, s in enumerate(ctl_.desired(node)[1])])
    await _sync(ctl_)


async def _sync(ctl_: DeploymentController) -> None:
    ctl_.sync(10.0)
    await ctl_.committed()  # (a placed replica joins its node's set once its row is in)


@pytest.mark.parametrize("gpus", [4, 2], ids=["room-beside", "one-at-a-time"])
async def test_a_changed_entry_rolls_its_replicas_over_without_a_gap(gpus: int) -> None:
    # 2 replicas of 1 GPU each; the entry's args change. With 4 GPUs the new replicas start beside the
    # old ones; with 2 there is no room, so one old replica makes room at a time. Either way an old one
    # leaves only when a new one is ready in its place (never fewer ready than before, but for the
    # one-at-a-time case's one), and the old ones keep running what they ran meanwhile.
    entry: dict[str, Any] = {"name": "c", "model": "m", "engine": "vllm", "replicas": 2, "gpu_memory": "10GiB"}
    cfg = [load({"deployments": [entry]})]
    nodes = NodeMap(lambda: 60.0)
    hw = tuple(GPU(f"GPU-{i}", i, "NVIDIA H100 80GB HBM3", memory_total_bytes=80 << 30, memory_used_bytes=0)
               for i in range(gpus))
    nodes.register("n", peer="p", agent_version="t", protocol=(1, 2), discovery=Discovery(NodeFacts("h"), hw))
    db, store = await _memory_store()
    ctl_ = DeploymentController(nodes=nodes, store=store, router=None, config=lambda: cfg[0], resolver=lambda m: None)
    try:
        await _rolls_over(ctl_, cfg, entry, gpus)
    finally:
        await ctl_.stop()
        await db.close()


async def _rolls_over(ctl_: DeploymentController, cfg: list[Any], entry: dict[str, Any], gpus: int) -> None:
    await _sync(ctl_)
    old = {s.id for s in ctl_.desired("n")[1]}
    assert len(old) == 2
    await _ready(ctl_, "n", old)
    assert ctl_.view("c")["ready"] == 2

    def ready_ids() -> set[str]:
        return {r["id"] for r in ctl_.view("c")["replicas"] if r["state"] == "ready"}

    cfg[0] = load({"deployments": [{**entry, "args": ["--enforce-eager"]}]})
    await _sync(ctl_)
    specs = {s.id: s for s in ctl_.desired("n")[1]}
    assert all(specs[i].args == () for i in old & set(specs))  # the old ones run on, unchanged
    new = set(specs) - old
    d = ctl_.view("c")
    if gpus == 4:
        assert old <= set(specs) and len(new) == 2 and d["outdated"] == 2 and d["placed"] == 2 and ready_ids() == old
    else:  # no room: one old replica drains (and, with nothing in flight, is gone) to make room
        assert d["message"] and "one at a time" in d["message"], d
        gone = old - set(specs)
        assert len(gone) == 1 and len(ready_ids() & old) == 1
        await _sync(ctl_)
        new = set(s.id for s in ctl_.desired("n")[1]) - old
        assert len(new) == 1
        # the pass that placed the new one did not drain the other old one too (it serves, alone, until
        # the new one is ready: before, the deployment went to 0 ready)
        assert len(ready_ids() & old) == 1 and len(old & {s.id for s in ctl_.desired("n")[1]}) == 1
    assert all(s.args == ("--enforce-eager",) for s in ctl_.desired("n")[1] if s.id in new)
    await _ready(ctl_, "n", (old | new) - {min(new)} if gpus == 4 else old)  # the new ones still starting
    assert old & ready_ids() == old & {s.id for s in ctl_.desired("n")[1]}  # no old one left for nothing
    for _ in range(4):  # each new replica ready in turn: an old one leaves for it, a new one is placed
        ids = {s.id for s in ctl_.desired("n")[1]}
        await _ready(ctl_, "n", ids)
        assert len(ready_ids()) >= (2 if gpus == 4 else 1)  # (one-at-a-time: the one making room)
        await _sync(ctl_)
    final = ctl_.desired("n")[1]
    assert len(final) == 2 and not ({s.id for s in final} & old)
    assert all(s.args == ("--enforce-eager",) for s in final)
    await _ready(ctl_, "n", {s.id for s in final})
    d = ctl_.view("c")
    assert (d["ready"], d["placed"], d["outdated"], d["message"]) == (2, 2, 0, None), d


async def test_a_rolling_update_goes_on_across_a_control_plane_restart() -> None:
    """Halfway through a rolling update the control plane restarts: the one that loads the rows hands
    the old replicas the same specs (their agents do not restart them in the new form, which would stop
    them all at once) and the update goes on to its end, never fewer ready than before."""
    entry: dict[str, Any] = {"name": "c", "model": "m", "engine": "vllm", "replicas": 2, "gpu_memory": "10GiB",
                             "env": {"A": "1"}}
    cfg = [load({"deployments": [entry]})]
    nodes = NodeMap(lambda: 60.0)
    hw = tuple(GPU(f"GPU-{i}", i, "NVIDIA H100 80GB HBM3", memory_total_bytes=80 << 30, memory_used_bytes=0)
               for i in range(4))
    nodes.register("n", peer="p", agent_version="t", protocol=(1, 2), discovery=Discovery(NodeFacts("h"), hw))
    db, store = await _memory_store()
    ctl_ = DeploymentController(nodes=nodes, store=store, router=None, config=lambda: cfg[0], resolver=lambda m: None)
    try:
        await _sync(ctl_)
        old_specs = {s.id: s for s in ctl_.desired("n")[1]}
        await _ready(ctl_, "n", set(old_specs))
        cfg[0] = load({"deployments": [{**entry, "args": ["--enforce-eager"], "env": {"A": "2"}}]})
        await _sync(ctl_)
        before = {s.id: s for s in ctl_.desired("n")[1]}
        assert ctl_.view("c")["outdated"] == 2 and len(before) == 4
    finally:
        await ctl_.stop()
    store2 = DesiredStore(db, unfenced(db))  # (the next control plane: the same database, loaded afresh)
    await store2.load()
    ctl2 = DeploymentController(nodes=nodes, store=store2, router=None, config=lambda: cfg[0], resolver=lambda m: None)
    try:
        await _sync(ctl2)
        after = {s.id: s for s in ctl2.desired("n")[1]}
        assert after == before  # every spec as it was: the old replicas' too, equal to what their agent runs
        assert all(after[i] == old_specs[i] for i in old_specs)
        assert all(after[i].args == () and after[i].env == {"A": "1"} for i in old_specs)
        d = ctl2.view("c")
        assert (d["outdated"], d["placed"]) == (2, 2), d
        new = set(after) - set(old_specs)
        assert all(after[i].args == ("--enforce-eager",) and after[i].env == {"A": "2"} for i in new)
        await _ready(ctl2, "n", set(old_specs))  # the agent reports what it runs: the old ones ready
        for _ in range(4):  # the new ones ready: the old ones leave, one for each
            await _ready(ctl2, "n", {s.id for s in ctl2.desired("n")[1]})
            assert sum(1 for r in ctl2.view("c")["replicas"] if r["state"] == "ready") >= 2
        final = ctl2.desired("n")[1]
        assert {s.id for s in final} == new
        d = ctl2.view("c")
        assert (d["ready"], d["placed"], d["outdated"]) == (2, 2, 0), d
    finally:
        await ctl2.stop()
        await db.close()


async def test_a_changed_entry_ends_a_scale_and_replaces_replicas(tmp_path: Path) -> None:
    entry: dict[str, Any] = {"name": "c", "model": "m", "engine": "llamacpp", "replicas": 1}
    cfg = [load({"deployments": [entry]})]
    nodes = NodeMap(lambda: 60.0)
    nodes.register("n", peer="p", agent_version="t", protocol=(1, 2), discovery=Discovery(NodeFacts("h")))
    db, store = await _memory_store()
    ctl_ = DeploymentController(nodes=nodes, store=store, router=None, config=lambda: cfg[0], resolver=lambda m: None)
    ctl_.sync(10.0)
    await ctl_.committed()
    first = ctl_.desired("n")[1][0].id
    ctl_.scale("c", 3)
    await ctl_.committed()
    assert ctl_.view("c")["desired"] == 3 and ctl_.view("c")["scaled"]
    cfg[0] = load({"deployments": [entry]})  # reloaded, the entry unchanged: the scale holds
    ctl_.sync(10.0)
    await ctl_.committed()
    assert ctl_.view("c")["desired"] == 3 and len(ctl_.desired("n")[1]) == 3
    cfg[0] = load({"deployments": [{**entry, "replicas": 2}]})  # changed in the file: the file wins
    ctl_.sync(10.0)
    await ctl_.committed()
    d = ctl_.view("c")
    assert d["desired"] == 2 and not d["scaled"] and d["placed"] == 2
    assert first in {s.id for s in ctl_.desired("n")[1]}
    cfg[0] = load({"deployments": [{**entry, "replicas": 2, "args": ["--flash-attn"]}]})  # new replicas
    ctl_.sync(10.0)
    await ctl_.committed()
    ids = {s.id for s in ctl_.desired("n")[1]}
    assert first not in ids and len(ids) == 2 and all(s.args == ("--flash-attn",) for s in ctl_.desired("n")[1])
    with pytest.raises(ValueError, match="in the config file"):
        ctl_.delete("c")
    with pytest.raises(ValueError, match="exists"):
        ctl_.create(parse_deployment({"name": "c", "model": "x"}))
    cfg[0] = load({})  # removed from the file: undeployed
    ctl_.sync(10.0)
    await ctl_.committed()
    assert ctl_.list_views() == [] and ctl_.desired("n")[1] == ()
    await db.close()


# -- a real llmgw serve --


def _free() -> int:
    return free_port()


class Serve:
    def __init__(self, path: Path, admin: int) -> None:
        self.path, self.admin = path, admin
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, log: Path) -> Serve:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "LLMGW_MIRROR": str(self.path.parent / "mirror")}
        with open(log, "ab") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "llmgw", "serve", "-c", str(self.path)], env=env,
                                         stdout=subprocess.DEVNULL, stderr=err)
        return self

    def stop(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


async def _ctl(admin: int, *args: str) -> Result:
    return await asyncio.to_thread(CliRunner().invoke, ctl, ["--admin", f"http://127.0.0.1:{admin}", *args],
                                   catch_exceptions=False)


async def _up(admin: int, proc: Serve, log: Path) -> None:
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        assert proc.proc is not None and proc.proc.poll() is None, log.read_text()
        res = await _ctl(admin, "deployments", "--json")
        if res.exit_code == 0:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"serve did not come up: {log.read_text()}")


async def test_deployments_survive_a_restart_of_llmgw_serve(tmp_path: Path) -> None:
    cp, admin = _free(), _free()
    doc: dict[str, Any] = {
        "listen": f"127.0.0.1:{_free()}", "admin": f"127.0.0.1:{admin}",
        "control": {"listen": f"127.0.0.1:{cp}", "join_token": TOKEN, "heartbeat_interval": "10s",
                    "heartbeat_grace": "60s", "database": f"sqlite:///{tmp_path}/state/cp.sqlite3"},
        "deployments": [{"name": "from-file", "model": "m1", "engine": "llamacpp", "replicas": 1}],
    }
    path = tmp_path / "llmgw.yaml"
    path.write_text(yaml.safe_dump(doc))
    log = tmp_path / "serve.log"
    serve = Serve(path, admin).start(log)
    try:
        await _up(admin, serve, log)
        await register(cp, "cpu-node", {"hostname": "h", "facts": {"cpu_cores": 8}})
        res = await _ctl(admin, "deploy", "made", "--model", "/models/m2.gguf", "--engine", "llamacpp", "--replicas", "2")
        assert res.exit_code == 0 and "2 of 2 replica(s) placed on cpu-node" in res.output, res.output
        res = await _ctl(admin, "scale", "from-file", "3")
        assert res.exit_code == 0, res.output

        async def placed() -> dict[str, Any] | None:
            res = await _ctl(admin, "deployments", "--json", "--show-secrets")
            data = {d["name"]: d for d in json.loads(res.stdout)["deployments"]}
            return data if data.get("from-file", {}).get("placed") == 3 else None

        before = await wait_for(placed, what="placed")
        assert serve.stop() == 0
        # NOTE: restarted on fresh ports: a port freed by the stop can be taken
        # meanwhile (another process's outgoing connection) and the bind refused.
        admin = _free()
        doc["listen"], doc["admin"] = f"127.0.0.1:{_free()}", f"127.0.0.1:{admin}"
        doc["control"]["listen"] = f"127.0.0.1:{_free()}"
        path.write_text(yaml.safe_dump(doc))
        serve = Serve(path, admin).start(log)
        await _up(admin, serve, log)
        res = await _ctl(admin, "deployments", "--json", "--show-secrets")
        after = {d["name"]: d for d in json.loads(res.stdout)["deployments"]}
        assert set(after) == {"from-file", "made"}
        assert (after["from-file"]["desired"], after["from-file"]["scaled"], after["from-file"]["source"]) == (3, True,
                                                                                                              "config")
        assert (after["made"]["desired"], after["made"]["source"]) == (2, "api")
        for name in after:  # the same replicas, keys and all: the node is handed the same set again
            assert [(r["id"], r["node"], r["api_key"]) for r in after[name]["replicas"]] == [
                (r["id"], r["node"], r["api_key"]) for r in before[name]["replicas"]]
        # the file's entry changes: the scale ends; the entry leaves the file: undeployed
        doc["deployments"][0]["replicas"] = 2
        path.write_text(yaml.safe_dump(doc))
        assert (await _ctl(admin, "reload")).exit_code == 0

        async def file_wins() -> bool:
            res = await _ctl(admin, "deployments", "--json")
            d = {x["name"]: x for x in json.loads(res.stdout)["deployments"]}
            return d["from-file"]["desired"] == 2 and not d["from-file"]["scaled"]

        await wait_for(file_wins, what="the file's entry applied")
        doc["deployments"] = []
        path.write_text(yaml.safe_dump(doc))
        assert (await _ctl(admin, "reload")).exit_code == 0

        async def gone() -> bool:
            res = await _ctl(admin, "deployments", "--json")
            return [x["name"] for x in json.loads(res.stdout)["deployments"]] == ["made"]

        await wait_for(gone, what="from-file undeployed")
        assert serve.stop() == 0
    finally:
        serve.kill()
    text = log.read_text()
    keys = [r["api_key"] for d in before.values() for r in d["replicas"]]
    assert keys and not any(k in text for k in keys), "a replica's API key reached the log"


async def test_a_transaction_cancelled_at_its_begin_leaves_none_open(tmp_path: Path) -> None:
    """SQLite: a transaction cancelled while its BEGIN runs in the connection's thread (as a lease renew is
    when its task is cancelled) is undone there, so the next transaction can begin."""
    db = open_database(f"sqlite:///{tmp_path / 'c.db'}")
    await db.open()
    try:
        for _ in range(20):  # (bounded) a cancel at every point of the BEGIN's round trip
            async def one() -> None:
                async with db.transaction() as tx:
                    await tx.execute("SELECT 1")

            task = asyncio.create_task(one())
            await asyncio.sleep(0)  # the BEGIN handed to the connection's thread
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            async with db.transaction() as tx:
                assert await tx.execute("SELECT 1") is not None
    finally:
        await db.close()


async def test_no_replica_is_placed_on_a_gpu_whose_health_is_unknown() -> None:
    """A GPU its node keeps by identity while the GPU source fails (health unknown: no reading, not
    even whether it works) takes no new replica; once its source answers again it does."""
    entry: dict[str, Any] = {"name": "c", "model": "m", "engine": "vllm", "replicas": 1, "gpu_memory": "10GiB"}
    cfg = load({"deployments": [entry]})
    nodes = NodeMap(lambda: 60.0)
    kept = (GPU("GPU-0", 0, "NVIDIA H100 80GB HBM3", memory_total_bytes=80 << 30, health="unknown"),)
    nodes.register("n", peer="p", agent_version="t", protocol=(1, 2), discovery=Discovery(NodeFacts("h"), kept))
    db, store = await _memory_store()
    ctl_ = DeploymentController(nodes=nodes, store=store, router=None, config=lambda: cfg, resolver=lambda m: None)
    try:
        await _sync(ctl_)
        assert ctl_.desired("n")[1] == () and "unhealthy" in ctl_.view("c")["message"], ctl_.view("c")
        well = (GPU("GPU-0", 0, "NVIDIA H100 80GB HBM3", memory_total_bytes=80 << 30, memory_used_bytes=0),)
        nodes.register("n", peer="p", agent_version="t", protocol=(1, 2), discovery=Discovery(NodeFacts("h"), well))
        await _sync(ctl_)
        assert len(ctl_.desired("n")[1]) == 1
    finally:
        await ctl_.stop()
        await db.close()


class _BusyRouter:
    """A router whose replicas always have a request in flight: a drain lasts (up to the grace)."""

    def __init__(self) -> None:
        self.endpoints: dict[str, Any] = {}
        self.draining: set[str] = set()

    def add(self, ep: Any) -> None:
        self.endpoints[ep.id] = ep

    def remove(self, endpoint_id: str) -> None:
        del self.endpoints[endpoint_id]

    def set_draining(self, endpoint_id: str, draining: bool) -> None:
        (self.draining.add if draining else self.draining.discard)(endpoint_id)

    def inflight(self, endpoint_id: str) -> int | None:
        return 1 if endpoint_id in self.endpoints else None

    def hold(self, models: frozenset[str], wanted: frozenset[str]) -> None:
        pass


async def test_a_rolling_update_with_no_room_drains_one_old_replica_at_a_time() -> None:
    """A full cluster: each old replica drained to make room holds its GPU until its drain ends (requests
    in flight there): the next one waits for it, never all at once (every pass drained another, and the
    deployment went to 0 ready)."""
    entry: dict[str, Any] = {"name": "c", "model": "m", "engine": "vllm", "replicas": 3, "gpu_memory": "70GiB"}
    cfg = [load({"deployments": [entry]})]
    nodes = NodeMap(lambda: 60.0)
    hw = tuple(GPU(f"GPU-{i}", i, "NVIDIA H100 80GB HBM3", memory_total_bytes=80 << 30, memory_used_bytes=0)
               for i in range(3))
    nodes.register("n", peer="p", agent_version="t", protocol=(1, 2), discovery=Discovery(NodeFacts("h"), hw))
    db, store = await _memory_store()
    router = _BusyRouter()
    ctl_ = DeploymentController(nodes=nodes, store=store, router=router, config=lambda: cfg[0],
                                resolver=lambda m: None)
    try:
        await _sync(ctl_)
        old = {s.id for s in ctl_.desired("n")[1]}
        await _ready(ctl_, "n", old)
        assert len(router.endpoints) == 3 and not router.draining
        cfg[0] = load({"deployments": [{**entry, "args": ["--enforce-eager"]}]})
        for _ in range(6):  # (passes while the first drain lasts: none drains another)
            await _sync(ctl_)
            assert len(router.draining) == 1, router.draining
            assert len(router.draining & old) == 1 and len(set(router.endpoints) - router.draining) == 2
    finally:
        await ctl_.stop()
        await db.close()


async def test_a_forgotten_node_is_handed_a_new_generation() -> None:
    """``ctl forget`` of a node that was only silent: its agent, back, must apply the empty set (a new
    generation), not skip it as the one it applied (its engines ran on beside their replacements)."""
    entry: dict[str, Any] = {"name": "c", "model": "m", "engine": "vllm", "replicas": 1, "gpu_memory": "10GiB"}
    cfg = load({"deployments": [entry]})
    nodes = NodeMap(lambda: 60.0)
    hw = (GPU("GPU-0", 0, "NVIDIA H100 80GB HBM3", memory_total_bytes=80 << 30, memory_used_bytes=0),)
    nodes.register("n", peer="p", agent_version="t", protocol=(1, 2), discovery=Discovery(NodeFacts("h"), hw))
    db, store = await _memory_store()
    ctl_ = DeploymentController(nodes=nodes, store=store, router=None, config=lambda: cfg, resolver=lambda m: None)
    try:
        await _sync(ctl_)
        gen, specs = ctl_.desired("n")
        assert len(specs) == 1
        ctl_.node_gone("n")
        again, specs = ctl_.desired("n")
        assert specs == () and again > gen
    finally:
        await ctl_.stop()
        await db.close()


async def test_a_silent_nodes_replicas_are_not_ready_and_go_elsewhere_after_a_while() -> None:
    """A node past its grace: its replicas are not counted ready (its last report is no evidence), and
    once it has been silent NODE_LOST_S they are placed elsewhere (as a vanished node's are; they
    stayed on the dead machine for as long as the control plane ran)."""
    from llmgw.control.deployments import NODE_LOST_S

    t = [1000.0]
    entry: dict[str, Any] = {"name": "c", "model": "m", "engine": "vllm", "replicas": 1, "gpu_memory": "10GiB"}
    cfg = load({"deployments": [entry]})
    nodes = NodeMap(lambda: 3.0, monotonic=lambda: t[0])
    hw = (GPU("GPU-0", 0, "NVIDIA H100 80GB HBM3", memory_total_bytes=80 << 30, memory_used_bytes=0),)
    for name in ("a", "b"):
        nodes.register(name, peer="p", agent_version="t", protocol=(1, 2), discovery=Discovery(NodeFacts(name), hw))
    db, store = await _memory_store()
    ctl_ = DeploymentController(nodes=nodes, store=store, router=None, config=lambda: cfg, resolver=lambda m: None,
                                clock=lambda: t[0])
    try:
        await _sync(ctl_)
        node = next(n for n in ("a", "b") if ctl_.desired(n)[1])
        other = "b" if node == "a" else "a"
        await _ready(ctl_, node, {s.id for s in ctl_.desired(node)[1]})
        assert ctl_.view("c")["ready"] == 1
        t[0] += 10.0  # both past the grace; the other one beats again
        nodes.register(other, peer="p", agent_version="t", protocol=(1, 2), discovery=Discovery(NodeFacts(other), hw))
        await _sync(ctl_)
        assert ctl_.view("c")["ready"] == 0 and ctl_.desired(other)[1] == ()
        t[0] += NODE_LOST_S + 1.0
        nodes.register(other, peer="p", agent_version="t", protocol=(1, 2), discovery=Discovery(NodeFacts(other), hw))
        await _sync(ctl_)
        await _sync(ctl_)
        assert ctl_.desired(node)[1] == () and len(ctl_.desired(other)[1]) == 1
    finally:
        await ctl_.stop()
        await db.close()


async def test_a_scale_down_keeps_the_replicas_spread_over_the_nodes() -> None:
    """4 replicas, 2 on each of two nodes, scaled to 2: one stays on each node (the crowding is counted
    again after each pick; before, both went from one node, and that node's failure took the deployment)."""
    nodes = NodeMap(lambda: 60.0)
    for name in ("n1", "n2"):
        nodes.register(name, peer="p", agent_version="t", protocol=(1, 2),
                       discovery=Discovery(NodeFacts(name, cpu_cores=64, memory_total_bytes=256 << 30,
                                                     memory_available_bytes=256 << 30)))
    db, store = await _memory_store()
    ctl_ = DeploymentController(nodes=nodes, store=store, router=None, config=lambda: load({}),
                                resolver=lambda m: None)
    try:
        nodes.set_cordoned("n2", True)  # (the first two on n1, the next two, newer, on n2)
        ctl_.create(parse_deployment({"name": "c", "model": "/models/m.gguf", "engine": "llamacpp", "replicas": 2,
                                      "memory": "1GiB"}))
        await _sync(ctl_)
        nodes.set_cordoned("n2", False)
        ctl_.scale("c", 4)
        await _sync(ctl_)
        assert [len(ctl_.desired(n)[1]) for n in ("n1", "n2")] == [2, 2]
        for n in ("n1", "n2"):
            await _ready(ctl_, n, {s.id for s in ctl_.desired(n)[1]})
        assert ctl_.view("c")["ready"] == 4
        ctl_.scale("c", 2)
        await _sync(ctl_)
        left = {n: [r["id"] for r in ctl_.view("c")["replicas"] if r["node"] == n and r["state"] != "draining"]
                for n in ("n1", "n2")}
        assert [len(v) for v in left.values()] == [1, 1], ctl_.view("c")["replicas"]
    finally:
        await ctl_.stop()
        await db.close()


async def test_a_silent_nodes_replicas_say_why_they_are_not_ready() -> None:
    """A node silent past its grace: its replicas last reported ready do not count as ready, and the
    deployment's message says why (before: ready 0 and no message, beside a replica row saying ready)."""
    mono = [100.0]
    nodes = NodeMap(lambda: 6.0, monotonic=lambda: mono[0])
    nodes.register("n", peer="p", agent_version="t", protocol=(1, 2),
                   discovery=Discovery(NodeFacts("n", cpu_cores=8, memory_total_bytes=64 << 30,
                                                 memory_available_bytes=64 << 30)))
    db, store = await _memory_store()
    ctl_ = DeploymentController(nodes=nodes, store=store, router=None, config=lambda: load({}),
                                resolver=lambda m: None)
    try:
        ctl_.create(parse_deployment({"name": "c", "model": "/models/m.gguf", "engine": "llamacpp", "replicas": 1,
                                      "memory": "1GiB"}))
        await _sync(ctl_)
        await _ready(ctl_, "n", {s.id for s in ctl_.desired("n")[1]})
        d = ctl_.view("c")
        assert d["ready"] == 1 and d["message"] is None
        mono[0] += 10.0  # past the 6 s grace
        d = ctl_.view("c")
        assert d["ready"] == 0 and d["replicas"][0]["state"] == "ready"
        assert d["message"] and "1 replica(s) on node n, silent for 10s" in d["message"], d["message"]
    finally:
        await ctl_.stop()
        await db.close()


async def test_replicas_on_a_node_not_heard_since_a_restart_say_where_they_wait() -> None:
    """The control plane restarts and a node's agent does not come back: its replicas (pending, nothing
    heard) said '–' for the two minutes until they were placed elsewhere, and a client was told they were
    starting. Now the message names the node, why, and when they go elsewhere; the 503 says the same kind."""
    mono, clock = [100.0], [50.0]
    nodes = NodeMap(lambda: 6.0, monotonic=lambda: mono[0])
    st, _ = nodes.register("n", peer="p", agent_version="t", protocol=(1, 2),
                           discovery=Discovery(NodeFacts("n", cpu_cores=8, memory_total_bytes=64 << 30,
                                                         memory_available_bytes=64 << 30)))
    db, store = await _memory_store()
    entry = {"name": "c", "model": "/models/m.gguf", "engine": "llamacpp", "replicas": 1, "memory": "1GiB"}
    ctl_ = DeploymentController(nodes=nodes, store=store, router=None, config=lambda: load({}),
                                resolver=lambda m: None, clock=lambda: clock[0])
    ctl_.create(parse_deployment(entry))
    await _sync(ctl_)
    assert len(ctl_.desired("n")[1]) == 1
    await ctl_.stop()
    # the next control plane: the same database; the node known from it only
    nodes2 = NodeMap(lambda: 6.0, monotonic=lambda: mono[0])
    nodes2.remember("n", st.node_id, "n", "t", [])
    store2 = DesiredStore(db, unfenced(db))
    await store2.load()
    held: list[Any] = []

    class Router(_BusyRouter):
        def hold(self, models: Any, wanted: frozenset[str]) -> None:
            held.append(dict(models.reasons))

    ctl2 = DeploymentController(nodes=nodes2, store=store2, router=Router(), config=lambda: load({}),
                                resolver=lambda m: None, clock=lambda: clock[0])
    try:
        await _sync(ctl2)
        d = ctl2.view("c")
        assert d["ready"] == 0 and d["replicas"][0]["node"] == "n"
        assert d["message"] == ("1 replica(s) on node n, not heard from since this control plane took over: "
                                "waiting for its agent; placed again elsewhere in 120s if it stays away"), d["message"]
        assert held[-1] == {"c": "its replicas' nodes are not heard from (or leaving); they are placed "
                                 "again elsewhere if they stay away"}, held
        clock[0] += 30.0
        await _sync(ctl2)
        assert "placed again elsewhere in 90s if it stays away" in ctl2.view("c")["message"]
        # scaled to 0 before the node reported: nothing is placed again; the extra goes once it reports
        d = ctl2.scale("c", 0)
        assert d["placed"] == 1 and d["desired"] == 0
        assert d["message"].endswith("waiting for its agent; more replicas than wanted: the extra drain once their "
                                     "nodes report (or are gone, if they stay away)"), d["message"]
        from llmgw.cli.ctl import _say_deployment

        runner = CliRunner()
        out = runner.invoke(click_command_saying(lambda: _say_deployment(d, "scaled to 0")))
        assert out.stdout.startswith("c: scaled to 0: 1 replica(s) placed on n, 1 more than wanted: they drain, "
                                     "then stop\n"), out.stdout
    finally:
        await ctl2.stop()
        await db.close()


async def test_a_control_plane_restart_while_a_node_drains_keeps_the_replacement() -> None:
    """A node leaving (its agent stopping): its replica drains and a replacement is placed on the other node;
    the control plane restarts before the drain ends. The next one loads both rows: it drains nothing
    before the nodes report (the replacement, the newest, went: the deployment was left on the leaving
    node), then the leaving node's replica, never the replacement."""
    cfg = load({"deployments": [{"name": "c", "model": "/models/m.gguf", "engine": "llamacpp", "replicas": 1,
                                 "memory": "1GiB"}]})
    nodes = NodeMap(lambda: 60.0)
    for name in ("n1", "n2"):
        nodes.register(name, peer="p", agent_version="t", protocol=(1, 3),
                       discovery=Discovery(NodeFacts(name, cpu_cores=8, memory_total_bytes=64 << 30,
                                                     memory_available_bytes=64 << 30)))
    db, store = await _memory_store()
    ctl_ = DeploymentController(nodes=nodes, store=store, router=_BusyRouter(), config=lambda: cfg,
                                resolver=lambda m: None)
    try:
        await _sync(ctl_)
        (first,) = [s.id for n in ("n1", "n2") for s in ctl_.desired(n)[1]]
        home = ctl_.replicas[first].node
        other = "n2" if home == "n1" else "n1"
        await _ready(ctl_, home, {first})
        st = nodes.get(home)
        assert st is not None
        st.leaving = True  # (its agent's heartbeats say so)
        await _sync(ctl_)
        (second,) = [s.id for s in ctl_.desired(other)[1]]
        await _ready(ctl_, other, {second})
        d = ctl_.view("c")
        assert {r["id"]: r["state"] for r in d["replicas"]} == {first: "draining", second: "ready"}, d
    finally:
        await ctl_.stop()
    store2 = DesiredStore(db, unfenced(db))  # (the next control plane: the same database)
    await store2.load()
    nodes2 = NodeMap(lambda: 60.0)  # (its node map: the agents register again, the leaving one not leaving yet)
    for name in ("n1", "n2"):
        nodes2.register(name, peer="p", agent_version="t", protocol=(1, 3),
                        discovery=Discovery(NodeFacts(name, cpu_cores=8, memory_total_bytes=64 << 30,
                                                      memory_available_bytes=64 << 30)))
    ctl2 = DeploymentController(nodes=nodes2, store=store2, router=_BusyRouter(), config=lambda: cfg,
                                resolver=lambda m: None)
    try:
        await _sync(ctl2)
        assert {r.id for r in ctl2.replicas.values() if r.draining_since is None} == {first, second}
        await _ready(ctl2, other, {second})
        assert {r.id for r in ctl2.replicas.values() if r.draining_since is None} == {first, second}
        st2 = nodes2.get(home)
        assert st2 is not None
        st2.leaving = True  # (its next beat says so)
        await _ready(ctl2, home, {first})
        kept = {r.id for r in ctl2.replicas.values() if r.draining_since is None}
        assert kept == {second}, ctl2.view("c")
    finally:
        await ctl2.stop()
        await db.close()


async def test_a_deployment_this_llmgw_refuses_keeps_its_rows(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A row written with a value this llmgw refuses (another release's, or edited by hand) is not run,
    and loading it deletes nothing: neither it nor its replicas' rows (it deleted the replicas' rows).
    Undeploying it, or deploying it again, replaces them."""
    path = tmp_path / "cp.sqlite3"
    nodes = NodeMap(lambda: 60.0)
    nodes.register("n", peer="p", agent_version="t", protocol=(1, 2), discovery=Discovery(NodeFacts("h", cpu_cores=8)))
    db = open_database(f"sqlite:///{path}")
    await db.open()
    try:
        await db.migrate()
        store = DesiredStore(db, unfenced(db))
        await store.load()
        first = DeploymentController(nodes=nodes, store=store, router=None, config=lambda: load({}),
                                     resolver=lambda m: None)
        first.create(parse_deployment({"name": "d", "model": "/models/m.gguf", "engine": "llamacpp", "replicas": 2}))
        await first.committed()
        ids = sorted(r.id for r in first.replicas.values())
        assert len(ids) == 2
        async with db.transaction() as tx:  # what this llmgw refuses: more replicas than it allows
            (spec,), = await tx.fetch("SELECT spec FROM llmgw_deployments WHERE name = 'd'")
            await tx.execute("UPDATE llmgw_deployments SET spec = $1 WHERE name = 'd'",
                             json.dumps({**json.loads(spec), "replicas": 5000}))

        async def loaded() -> tuple[DesiredStore, DeploymentController]:
            s = DesiredStore(db, unfenced(db))
            await s.load()
            c = DeploymentController(nodes=nodes, store=s, router=None, config=lambda: load({}),
                                     resolver=lambda m: None)
            await c.committed()
            return s, c

        with caplog.at_level("ERROR", logger="llmgw"):
            _, second = await loaded()
        assert "d" not in second.deployments and not second.replicas
        assert "deployment d in" in caplog.text and "its 2 replica row(s) kept" in caplog.text
        again, third = await loaded()  # a second load finds the same rows
        assert sorted(r.id for r in again.replicas()) == ids and [d.name for d in again.deployments()] == ["d"]
        assert third.delete("d") == {"deleted": "d", "draining": []}
        await third.committed()
        gone, _ = await loaded()
        assert not gone.replicas() and not gone.deployments()
    finally:
        await db.close()
