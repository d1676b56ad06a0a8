"""Models from the control plane's mirror: the blob route on the admin listener, the agent's
MirrorFetcher, and resolving a mirror reference for placement.

Everything runs for real: a gateway runtime with its control plane serving its mirror on
the admin listener, the fetcher on real sockets into a second store, and, to cut a
transfer half-way, a TCP proxy in between that reports what it forwarded.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import resource
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest
from mirror_helpers import write_gguf, write_projector

from llmgw.agent.client import AgentClient
from llmgw.agent.model import Discovery, NodeFacts
from llmgw.config import load
from llmgw.control.credentials import CREDENTIAL_PREFIX, NodeCredentials
from llmgw.launch.spec import ModelBlob, ReplicaSpec
from llmgw.mirror import MirrorStore, import_file
from llmgw.mirror.errors import FetchError, ModelNotFoundError
from llmgw.mirror.fetch import MirrorFetcher
from llmgw.mirror.resolve import find, kv_cache_bytes, memory_needed, resolve
from llmgw.mirror.serve import RangeNotSatisfiableError, parse_range
from llmgw.runtime import GatewayRuntime, components_for
from ports import free_port as _free_port
from tools import need

JOIN = "join-token-for-mirror-tests"


@dataclass
class Mirror:
    """A running control plane serving ``store`` (its mirror), with a credential for node ``node-a``."""

    rt: GatewayRuntime
    store: MirrorStore
    blobs: tuple[ModelBlob, ...]
    credential: str
    control_port: int
    allowed: set[tuple[str, str]] = field(default_factory=set)

    @property
    def url(self) -> str:
        assert self.rt.admin_addr is not None
        return f"http://127.0.0.1:{self.rt.admin_addr[1]}"

    @property
    def cp(self) -> Any:
        return self.rt.components[0]

    def spec(self, rid: str = "chat-1") -> ReplicaSpec:
        return ReplicaSpec(id=rid, deployment="chat", engine="llamacpp", model="tiny:1b", served_name="tiny",
                           blobs=self.blobs)


@contextlib.asynccontextmanager
async def mirror_runtime(tmp_path: Path, *, big: int = 0) -> AsyncIterator[Mirror]:
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    model = write_gguf(src / "tiny.gguf", big_tensor_elements=big)
    proj = write_projector(src / "mmproj.gguf")
    store = MirrorStore(tmp_path / "cp-mirror")
    import_file(store, model, name="tiny:1b", projectors=[proj])
    blobs, _ = resolve(store, "tiny:1b")
    control_port = _free_port()
    cfg = load({
        "listen": "127.0.0.1:0", "admin": "127.0.0.1:0", "mirror": {"root": str(store.root)},
        "control": {"listen": f"127.0.0.1:{control_port}", "join_token": JOIN, "heartbeat_interval": 0.1},
    })
    rt = GatewayRuntime(cfg, components=components_for(cfg))
    await rt.start()
    try:
        cp = rt.components[0]
        m = Mirror(rt, store, blobs, cp.credentials.issue("node-a"), control_port)
        cp.mirror_server.allowed = lambda node, digest: (node, digest) in m.allowed
        m.allowed.update(("node-a", b.digest) for b in blobs)
        yield m
    finally:
        await rt.stop()
        store.close()


async def raw_get(url: str, path: str, headers: dict[str, str], method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        writer.write(f"{method} {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n{head}\r\n".encode())
        raw = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    top, _, body = raw.partition(b"\r\n\r\n")
    lines = top.decode("latin-1").split("\r\n")
    hdrs = dict((k.lower(), v.strip()) for k, _, v in (line.partition(":") for line in lines[1:]))
    return int(lines[0].split()[1]), hdrs, body


def sha(path: str | Path) -> str:
    return "sha256:" + hashlib.sha256(Path(path).read_bytes()).hexdigest()


class CuttingProxy:
    """A TCP proxy to ``target``: the first connection is cut after ``cut_after`` bytes of the
    answer; every connection's request bytes are kept in :attr:`requests`."""

    def __init__(
        self, target: tuple[str, int], cut_after: int, *, stall: bool = False, gate: asyncio.Event | None = None
    ) -> None:
        self.target = target
        self.cut_after = cut_after
        self.stall = stall  # after cut_after bytes, hold the connection open instead of closing it
        self.gate = gate  # after cut_after bytes, wait for it to be set, then forward the rest
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.server.wait_closed()

    async def _conn(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        index = len(self.requests)
        self.requests.append(b"")
        limit = self.cut_after if index == 0 else None
        ur, uw = await asyncio.open_connection(*self.target)

        async def up() -> None:
            while data := await cr.read(65536):
                self.requests[index] += data
                uw.write(data)
                await uw.drain()

        async def down() -> bool:
            sent = 0
            cut = limit
            while data := await ur.read(65536):
                if cut is not None and sent + len(data) >= cut:
                    cw.write(data[: cut - sent])
                    await cw.drain()
                    if self.gate is None:
                        return self.stall
                    await self.gate.wait()
                    data, sent, cut = data[cut - sent:], cut, None
                sent += len(data)
                cw.write(data)
                await cw.drain()
            return False

        t_up = asyncio.ensure_future(up())
        self._tasks.add(t_up)
        try:
            if await down():
                await t_up  # stalled: hold the connection until the client closes its side
        finally:
            t_up.cancel()
            self._tasks.discard(t_up)
            for w in (cw, uw):
                w.close()


def node_files(root: Path) -> tuple[list[str], list[str]]:
    blobs = sorted(p.name for p in (root / "blobs" / "sha256").rglob("*") if p.is_file())
    tmp = sorted(p.name for p in (root / "tmp").iterdir()) if (root / "tmp").exists() else []
    return blobs, tmp


# -- fetching ------------------------------------------------------------------------------


async def test_fetch_verifies_shares_one_download_and_reuses(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    async with mirror_runtime(tmp_path) as m:
        node_root = tmp_path / "node-mirror"
        fetcher = MirrorFetcher(m.url, m.credential, node_root, backoff=0.01)
        try:
            seen: list[list[tuple[int, int]]] = [[], []]
            one, two = await asyncio.gather(
                fetcher.ensure(m.spec("chat-1"), lambda d, t: seen[0].append((d, t))),
                fetcher.ensure(m.spec("chat-2"), lambda d, t: seen[1].append((d, t))),
            )
            assert one == two
            # one download per blob for both replicas
            assert fetcher.downloads == 2
            assert m.cp.mirror_server.served["requests"] == 2
            total = sum(b.size for b in m.blobs)
            for calls in seen:
                assert calls[-1] == (total, total)
                assert [d for d, _ in calls] == sorted(d for d, _ in calls)
            model, projector = m.blobs
            assert (model.role, projector.role) == ("model", "projector")
            assert sha(one.path) == model.digest and os.path.getsize(one.path) == model.size
            assert one.projector is not None and sha(one.projector) == projector.digest
            assert Path(one.path).is_relative_to(node_root)
            blobs, tmp = node_files(node_root)
            assert len(blobs) == 2 and tmp == []
            # the node's catalogue records it, so its gc keeps the blobs
            with MirrorStore(node_root) as node:
                assert [f.digest for f in node.get_model("tiny", "1b").files] == [model.digest, projector.digest]
            # again: nothing fetched
            again = await fetcher.ensure(m.spec("chat-3"), lambda d, t: None)
            assert again == one and fetcher.downloads == 2
        finally:
            await fetcher.close()
        # a new fetcher (an agent restart) verifies what the store has and fetches nothing
        fetcher = MirrorFetcher(m.url, "wrong-credential-now", node_root)
        try:
            assert await fetcher.ensure(m.spec(), lambda d, t: None) == one
            assert fetcher.downloads == 0
        finally:
            await fetcher.close()
    assert m.credential.startswith(CREDENTIAL_PREFIX)
    assert not any(m.credential in r.getMessage() for r in caplog.records)


async def test_a_model_imported_again_on_the_control_plane_replaces_the_nodes_record(tmp_path: Path) -> None:
    """The control plane's tiny:1b imported again with other files: the node records the new one
    (it was logged and left, so gc on the node deleted the blob the replica ran on)."""
    async with mirror_runtime(tmp_path) as m:
        node_root = tmp_path / "node-mirror"
        fetcher = MirrorFetcher(m.url, m.credential, node_root, backoff=0.01)
        try:
            await fetcher.ensure(m.spec("chat-1"), lambda d, t: None)
            m.store.remove_model("tiny", "1b")
            import_file(m.store, write_gguf(tmp_path / "src" / "tiny-v2.gguf", vocab=333), name="tiny:1b")
            m.blobs, _ = resolve(m.store, "tiny:1b")
            assert len(m.blobs) == 1
            m.allowed.update(("node-a", b.digest) for b in m.blobs)
            local = await fetcher.ensure(m.spec("chat-2"), lambda d, t: None)
        finally:
            await fetcher.close()
        with MirrorStore(node_root) as node:
            rec = node.get_model("tiny", "1b")
            assert [f.digest for f in rec.files] == [m.blobs[0].digest] and rec.source_kind == "mirror"
            node.gc()  # removes the old files, keeps what the replica runs on
        assert Path(local.path).is_file() and sha(local.path) == m.blobs[0].digest
        # a model imported on the node itself is never overwritten by a fetch
        with MirrorStore(node_root) as node:
            node.remove_model("tiny", "1b")
            import_file(node, write_gguf(tmp_path / "src" / "own.gguf", vocab=334), name="tiny:1b")
            own = [f.digest for f in node.get_model("tiny", "1b").files]
        fetcher = MirrorFetcher(m.url, m.credential, node_root, backoff=0.01)
        try:
            await fetcher.ensure(m.spec("chat-3"), lambda d, t: None)
        finally:
            await fetcher.close()
        with MirrorStore(node_root) as node:
            assert [f.digest for f in node.get_model("tiny", "1b").files] == own


async def test_interrupted_transfer_resumes_with_a_range(tmp_path: Path) -> None:
    async with mirror_runtime(tmp_path, big=600_000) as m:  # a model blob of ~2.4 MB
        model = m.blobs[0]
        assert model.size > 2_000_000
        assert m.rt.admin_addr is not None
        proxy = CuttingProxy(("127.0.0.1", m.rt.admin_addr[1]), cut_after=1_000_000)
        url = await proxy.start()
        node_root = tmp_path / "node-mirror"
        fetcher = MirrorFetcher(url, m.credential, node_root, backoff=0.01, chunk=64 * 1024)
        try:
            spec = ReplicaSpec(id="r", deployment="d", engine="llamacpp", model="tiny:1b", served_name="t",
                               blobs=(model,))
            local = await fetcher.ensure(spec, lambda d, t: None)
        finally:
            await fetcher.close()
            await proxy.close()
        assert sha(local.path) == model.digest
        assert len(proxy.requests) == 2
        first, second = proxy.requests
        assert b"range:" not in first.lower()
        ranges = [line for line in second.split(b"\r\n") if line.lower().startswith(b"range:")]
        assert len(ranges) == 1
        start = int(ranges[0].split(b"=")[1].rstrip(b"-"))
        assert 0 < start < 1_000_000  # it resumed from what the cut transfer had written
        assert m.cp.mirror_server.served["requests"] == 2
        assert node_files(node_root)[1] == []


_O_DIRECT_FS = "a file system that takes O_DIRECT under the test's directory (not tmpfs: pytest --basetemp=DIR)"


def _takes_o_direct(where: Path, misaligned: bool = False) -> bool:
    """Whether the file system under ``where`` takes an aligned O_DIRECT write (``misaligned``:
    one from a buffer a byte past a page, which a block device refuses and tmpfs takes)."""
    import mmap

    probe = where / "o-direct-probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o600)
    except OSError:
        return False
    try:
        buf = mmap.mmap(-1, 2 * 4096)
        return os.pwrite(fd, memoryview(buf)[1: 1 + 4096] if misaligned else memoryview(buf)[:4096], 0) == 4096
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink()


@pytest.mark.parametrize("io", ["direct", "page-cache", "env-off", "small-blob"])
async def test_big_blobs_are_written_with_o_direct_and_resume_at_any_offset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, io: str
) -> None:
    """A blob of at least ``direct_min`` bytes goes to the disk with O_DIRECT: every whole 4 KiB
    block but the one a resumed transfer starts in (written through the page cache up to the
    boundary) and the blob's last partial block. Turned off (the parameter, or
    LLMGW_FETCH_DIRECT_IO=0), or for a blob under ``direct_min``, nothing is; either way the
    blob is verified and whole, and the cut transfer resumes where it stopped."""
    if io == "direct":
        need(hasattr(os, "O_DIRECT") and _takes_o_direct(tmp_path), _O_DIRECT_FS)
    if io == "env-off":
        monkeypatch.setenv("LLMGW_FETCH_DIRECT_IO", "0")
    kwargs: dict[str, Any] = {
        "direct": {"direct_io": True, "direct_min": 0},
        "page-cache": {"direct_io": False, "direct_min": 0},
        "env-off": {"direct_min": 0},
        "small-blob": {"direct_io": True},  # (the default direct_min: 64 MiB)
    }[io]
    async with mirror_runtime(tmp_path, big=600_000) as m:  # a model blob of ~2.4 MB
        model = m.blobs[0]
        assert m.rt.admin_addr is not None
        proxy = CuttingProxy(("127.0.0.1", m.rt.admin_addr[1]), cut_after=1_000_000)
        url = await proxy.start()
        node_root = tmp_path / "node-mirror"
        fetcher = MirrorFetcher(url, m.credential, node_root, backoff=0.01, chunk=64 * 1024, **kwargs)
        try:
            spec = ReplicaSpec(id="r", deployment="d", engine="llamacpp", model="tiny:1b", served_name="t",
                               blobs=(model,))
            local = await fetcher.ensure(spec, lambda d, t: None)
        finally:
            await fetcher.close()
            await proxy.close()
        assert sha(local.path) == model.digest and os.path.getsize(local.path) == model.size
        assert node_files(node_root)[1] == []
        assert len(proxy.requests) == 2 and fetcher.downloads == 2
        ranges = [line for line in proxy.requests[1].split(b"\r\n") if line.lower().startswith(b"range:")]
        start = int(ranges[0].split(b"=")[1].rstrip(b"-"))
        assert 0 < start < 1_000_000
        if io == "direct":
            block = 4096
            # the first transfer: every whole block of [0, start); the second: from the block
            # boundary after `start` to the blob's last whole block
            expected = start // block * block + (model.size // block - -(-start // block)) * block
            assert fetcher.direct_bytes == expected
            assert expected > model.size // 2
        else:
            assert fetcher.direct_bytes == 0


def test_a_refused_o_direct_write_falls_back_to_the_page_cache(tmp_path: Path) -> None:
    """A file system (or a buffer) that O_DIRECT refuses with EINVAL: the writer writes the same
    bytes through the page cache, and stays there. The refusal is real: the buffer starts one
    byte past a page, which no block device's DMA alignment takes."""
    import fcntl
    import mmap

    from llmgw.mirror.fetch import _Writer

    need(hasattr(os, "O_DIRECT") and _takes_o_direct(tmp_path) and not _takes_o_direct(tmp_path, misaligned=True),
         "a file system that takes O_DIRECT and refuses a misaligned buffer (a block device's, not tmpfs's)"
         " under the test's directory (pytest --basetemp=DIR)")
    page = mmap.mmap(-1, 3 * 4096)
    page[:] = os.urandom(len(page))
    misaligned = memoryview(page)[1: 1 + 2 * 4096]
    aligned = memoryview(page)[:4096]
    path = tmp_path / "out"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        writer = _Writer(fd, direct=True)
        writer.write(aligned, 0)  # taken: page-aligned memory, offset and length
        assert writer.direct and writer.direct_bytes == 4096
        writer.write(misaligned, 4096)
        assert not writer.direct and writer.direct_bytes == 4096
        writer.write(aligned, 3 * 4096)  # (the page cache from now on)
        assert writer.direct_bytes == 4096
        writer.close()
        assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT == 0  # the fd is left as it was
    finally:
        os.close(fd)
    assert path.read_bytes() == bytes(aligned) + bytes(misaligned) + bytes(aligned)


async def test_a_stopped_replica_stops_its_fetch_and_the_next_resumes(tmp_path: Path) -> None:
    async with mirror_runtime(tmp_path, big=600_000) as m:
        model = m.blobs[0]
        assert m.rt.admin_addr is not None
        proxy = CuttingProxy(("127.0.0.1", m.rt.admin_addr[1]), cut_after=1_000_000, stall=True)
        url = await proxy.start()
        fetcher = MirrorFetcher(url, m.credential, tmp_path / "node-mirror", backoff=0.01, chunk=64 * 1024)
        spec = ReplicaSpec(id="r", deployment="d", engine="llamacpp", model="tiny:1b", served_name="t",
                           blobs=(model,))
        try:
            started = asyncio.Event()
            first = asyncio.ensure_future(fetcher.ensure(spec, lambda d, t: started.set() if d > 0 else None))
            await asyncio.wait_for(started.wait(), 10)
            first.cancel()  # the supervisor stops the replica while it fetches
            with pytest.raises(asyncio.CancelledError):
                await first
            local = await asyncio.wait_for(fetcher.ensure(spec, lambda d, t: None), 20)
        finally:
            await fetcher.close()
            await proxy.close()
        assert sha(local.path) == model.digest
        assert len(proxy.requests) == 2 and b"range: bytes=" in proxy.requests[1].lower()


async def test_corrupt_transfer_is_refused_and_nothing_kept(tmp_path: Path) -> None:
    async with mirror_runtime(tmp_path) as m:
        model = m.blobs[0]
        on_disk = m.store.blob_path(model.digest)
        os.chmod(on_disk, 0o644)
        with open(on_disk, "r+b") as f:  # the mirror's copy rots: same size, other bytes
            f.seek(model.size // 2)
            byte = f.read(1)
            f.seek(model.size // 2)
            f.write(bytes([byte[0] ^ 0xFF]))
        node_root = tmp_path / "node-mirror"
        fetcher = MirrorFetcher(m.url, m.credential, node_root, attempts=2, backoff=0.01)
        try:
            with pytest.raises(FetchError, match=r"in 2 attempts.*corrupt and was discarded"):
                await fetcher.ensure(m.spec(), lambda d, t: None)
            assert fetcher.downloads >= 2
        finally:
            await fetcher.close()
        blobs, tmp = node_files(node_root)
        assert model.digest[7:] not in blobs
        assert tmp == []


@pytest.mark.parametrize("direct_io", [True, False], ids=["direct", "page-cache"])
async def test_a_failed_write_stops_the_hash_thread_and_keeps_nothing(tmp_path: Path, direct_io: bool) -> None:
    """The disk refuses a write half-way (here: the file may not grow past 1 MB, EFBIG, as a full
    disk refuses with ENOSPC) while the hash thread digests the chunks before it: the fetch fails
    with a message that says so, the hash thread is gone, the partial file removed; not retried.
    The same with O_DIRECT writes and through the page cache."""
    async with mirror_runtime(tmp_path, big=600_000) as m:
        model = m.blobs[0]
        assert model.size > 2_000_000
        node_root = tmp_path / "node-mirror"
        fetcher = MirrorFetcher(m.url, m.credential, node_root, attempts=3, backoff=0.01, chunk=64 * 1024,
                                direct_io=direct_io, direct_min=0)
        spec = ReplicaSpec(id="r", deployment="d", engine="llamacpp", model="tiny:1b", served_name="t",
                           blobs=(model,))
        heard: list[int] = []
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        try:
            resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, hard))  # (Python ignores SIGXFSZ: EFBIG)
            try:
                with pytest.raises(FetchError, match=r"cannot write sha256:[0-9a-f]{64} \(\d+ bytes\) into the"
                                   r" node's mirror at .*: File too large"):
                    await asyncio.wait_for(fetcher.ensure(spec, lambda d, t: heard.append(d)), 20)
            finally:
                resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            assert fetcher.downloads == 1  # a local failure is not one a retry of the transfer fixes
            assert max(heard) > 0 and heard[-1] == 0  # progress went back to nothing kept
            assert node_files(node_root) == ([], [])
            assert not [t for t in threading.enumerate() if t.name.startswith(("llmgw-fetch-hash", "llmgw-fetch-write"))]
            # the disk takes writes again: the next ensure() fetches the blob whole
            local = await asyncio.wait_for(fetcher.ensure(spec, lambda d, t: None), 20)
            assert sha(local.path) == model.digest and fetcher.downloads == 2
            assert (fetcher.direct_bytes > 0) == (direct_io and _takes_o_direct(tmp_path))
        finally:
            await fetcher.close()


class _NodeSource:
    def read(self) -> Discovery:
        return Discovery(facts=NodeFacts(hostname="node-a"), source="simulated")

    def close(self) -> None:
        pass


async def test_heartbeats_go_on_while_a_blob_is_fetched(tmp_path: Path) -> None:
    """The transfer runs off the event loop: with a fetch held half-way (the mirror's bytes stop
    coming), the agent registers and heartbeats on the same loop, then the fetch completes."""
    async with mirror_runtime(tmp_path, big=600_000) as m:
        model = m.blobs[0]
        assert m.rt.admin_addr is not None
        gate = asyncio.Event()
        proxy = CuttingProxy(("127.0.0.1", m.rt.admin_addr[1]), cut_after=1_000_000, gate=gate)
        url = await proxy.start()
        fetcher = MirrorFetcher(url, m.credential, tmp_path / "node-mirror", chunk=64 * 1024)
        spec = ReplicaSpec(id="r", deployment="d", engine="llamacpp", model="tiny:1b", served_name="t",
                           blobs=(model,))
        agent = AgentClient(f"127.0.0.1:{m.control_port}", "node-a", JOIN, _NodeSource())
        stop = asyncio.Event()
        running: asyncio.Task[None] | None = None
        halfway = asyncio.Event()
        fetch = asyncio.ensure_future(fetcher.ensure(spec, lambda d, t: halfway.set() if d > 0 else None))
        try:
            await asyncio.wait_for(halfway.wait(), 10)
            running = asyncio.ensure_future(agent.run(stop))
            for _ in range(500):  # (bounded: 3 beats at the 0.1 s interval take ~0.3 s)
                if agent.heartbeats >= 3 or running.done():
                    break
                await asyncio.sleep(0.02)
            assert agent.heartbeats >= 3 and agent.registrations == 1
            assert not fetch.done()  # the blob is still on its way
            gate.set()
            local = await asyncio.wait_for(fetch, 20)
            assert sha(local.path) == model.digest and fetcher.downloads == 1
        finally:
            gate.set()
            stop.set()
            if running is not None:
                await asyncio.wait_for(running, 10)
            fetch.cancel()
            await asyncio.gather(fetch, return_exceptions=True)
            await fetcher.close()
            await proxy.close()


# -- the route ------------------------------------------------------------------------------


async def test_blob_route_auth_ranges_and_errors(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    async with mirror_runtime(tmp_path) as m:
        model = m.blobs[0]
        path = f"/mirror/v1/blobs/{model.digest}"
        auth = {"authorization": f"Bearer {m.credential}"}
        data = m.store.blob_path(model.digest).read_bytes()

        def err(body: bytes) -> str:
            e = orjson.loads(body)["error"]
            assert set(e) == {"message", "type", "param", "code"}
            return str(e["code"])

        status, h, body = await raw_get(m.url, path, {})
        assert (status, err(body)) == (401, "missing_node_credential")
        status, h, body = await raw_get(m.url, path, {"authorization": "Bearer llmgw-node-guess"})
        assert (status, err(body)) == (401, "invalid_node_credential")
        # the admin token is not a node credential (and none is configured here: still refused)
        other = m.cp.credentials.issue("node-b")
        status, h, body = await raw_get(m.url, path, {"authorization": f"Bearer {other}"})
        assert (status, err(body)) == (403, "blob_not_allowed")
        assert "node-b" in orjson.loads(body)["error"]["message"]
        status, h, body = await raw_get(m.url, f"/mirror/v1/blobs/sha256:{'0' * 64}", auth)
        assert (status, err(body)) == (403, "blob_not_allowed")  # decided before existence: no probing
        m.allowed.add(("node-a", f"sha256:{'0' * 64}"))
        status, h, body = await raw_get(m.url, f"/mirror/v1/blobs/sha256:{'0' * 64}", auth)
        assert (status, err(body)) == (404, "blob_not_found")
        status, h, body = await raw_get(m.url, "/mirror/v1/blobs/md5:abc", auth)
        assert (status, err(body)) == (404, "blob_not_found")

        status, h, body = await raw_get(m.url, path, auth)
        assert status == 200 and body == data
        assert h["etag"] == f'"{model.digest}"' and h["x-llmgw-digest"] == model.digest
        assert h["accept-ranges"] == "bytes" and int(h["content-length"]) == model.size
        status, h, body = await raw_get(m.url, path, auth, method="HEAD")
        assert status == 200 and body == b"" and int(h["content-length"]) == model.size
        status, h, body = await raw_get(m.url, path, {**auth, "range": "bytes=100-199"})
        assert status == 206 and body == data[100:200]
        assert h["content-range"] == f"bytes 100-199/{model.size}"
        status, h, body = await raw_get(m.url, path, {**auth, "range": "bytes=-10"})
        assert status == 206 and body == data[-10:]
        m.cp.mirror_server.use_sendfile = False  # the path TLS connections take: read, then write
        m.cp.mirror_server.chunk = 4096
        status, h, body = await raw_get(m.url, path, auth)
        assert status == 200 and body == data
        status, h, body = await raw_get(m.url, path, {**auth, "range": "bytes=5000-"})
        assert status == 206 and body == data[5000:]
        m.cp.mirror_server.use_sendfile = True
        for bad in (f"bytes={model.size}-", "bytes=5-2", "bytes=0-1,5-6", "items=0-1", "bytes=-0"):
            status, h, body = await raw_get(m.url, path, {**auth, "range": bad})
            assert (status, err(body)) == (416, "range_not_satisfiable"), bad
            assert h["content-range"] == f"bytes */{model.size}"

        # a fetcher with a wrong credential fails at once, not after retries
        fetcher = MirrorFetcher(m.url, "llmgw-node-wrong", tmp_path / "n1", attempts=5, backoff=30)
        try:
            with pytest.raises(FetchError, match="401 unknown or revoked node credential"):
                await asyncio.wait_for(fetcher.ensure(m.spec(), lambda d, t: None), 10)
        finally:
            await fetcher.close()
        # revoked (the node deregistered): refused
        m.cp.credentials.revoke("node-a")
        status, h, body = await raw_get(m.url, path, auth)
        assert (status, err(body)) == (401, "invalid_node_credential")
    for secret in (m.credential, other):
        assert not any(secret in r.getMessage() for r in caplog.records)


async def test_a_stalled_transfer_holds_no_other_node_back(tmp_path: Path) -> None:
    """A node that stops reading mid-blob (SIGSTOPped, its link gone) holds its own transfer until
    STALL_S, never another's: with one pool thread, a second node's fetch of the same blob is served at
    once (it used to wait, silent, for the stalled one's thread). Past max_transfers a request is told
    503 mirror_busy with Retry-After, before any byte, and a fetcher waits for it without spending an
    attempt; each transfer's thread ends with its connection."""
    async with mirror_runtime(tmp_path, big=12_000_000) as m:  # a model blob of ~48 MB: more than the socket buffers
        server = m.cp.mirror_server
        server._threads = 1  # (the pool is made at the first transfer)
        model = m.blobs[0]
        path = f"/mirror/v1/blobs/{model.digest}"
        auth = {"authorization": f"Bearer {m.credential}"}
        host, port = m.url.removeprefix("http://").split(":")
        r, w = await asyncio.open_connection(host, int(port))
        try:
            w.write(f"GET {path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {m.credential}\r\n\r\n".encode())
            await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 10)  # (then reads nothing more)
            await asyncio.sleep(0.5)
            assert server.active == 1
            status, _, body = await raw_get(m.url, path, auth)  # (10 s at most)
            assert status == 200 and hashlib.sha256(body).hexdigest() == model.digest[7:]
            server.max_transfers = 1
            status, h, body = await raw_get(m.url, path, auth)
            assert status == 503 and orjson.loads(body)["error"]["code"] == "mirror_busy"
            assert int(h["retry-after"]) >= 1
            # a node told so waits and asks again, spending none of its attempts (here: one)
            fetcher = MirrorFetcher(m.url, m.credential, tmp_path / "n1", attempts=1, backoff=0.1)
            try:
                fetching = asyncio.ensure_future(fetcher.ensure(m.spec(), lambda d, t: None))
                await asyncio.sleep(1.0)
                assert not fetching.done()
                w.close()  # (the stalled node goes: its transfer ends, a place frees)
                await asyncio.wait_for(fetching, 30)
            finally:
                await fetcher.close()
            assert node_files(tmp_path / "n1")[0]
            server.max_transfers = 1024
        finally:
            w.close()

        async def threads_gone() -> None:
            while server.active or any(t.name == "llmgw-mirror-send" for t in threading.enumerate()):
                await asyncio.sleep(0.05)

        await asyncio.wait_for(threads_gone(), 5)


async def test_transfers_cut_mid_read_leave_no_file_open_and_no_slot_taken(tmp_path: Path) -> None:
    """Nodes that go away mid-blob on the read-and-write path (TLS takes it): each transfer's task is
    cancelled wherever it waits (a read in the pool, the socket's drain), and its blob file is closed (after
    a read still running) and its place among max_transfers given back."""
    async with mirror_runtime(tmp_path, big=3_000_000) as m:  # ~12 MB
        server = m.cp.mirror_server
        server.use_sendfile = False
        server.chunk = 64 * 1024
        path = f"/mirror/v1/blobs/{m.blobs[0].digest}"
        host, port = m.url.removeprefix("http://").split(":")

        def fds() -> int:
            return len(os.listdir("/proc/self/fd"))

        before = fds()
        for i in range(20):
            r, w = await asyncio.open_connection(host, int(port))
            w.write(f"GET {path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {m.credential}\r\n\r\n".encode())
            await asyncio.wait_for(r.readexactly(1 + i * 7919), 10)  # (cut at a different point each time)
            w.transport.abort()

        async def settled() -> None:
            while server.active or fds() > before:
                await asyncio.sleep(0.05)

        await asyncio.wait_for(settled(), 10)
        assert server.active == 0


async def test_registration_access_deregistration_revokes_and_placement_authorizes(tmp_path: Path) -> None:
    import grpc

    from llmgw._proto.agent.v1 import agent_pb2_grpc
    from llmgw.agent.wire import PROTOCOL, pb
    from llmgw.mirror.serve import placed_blobs

    async with mirror_runtime(tmp_path) as m:
        cp = m.cp
        # what Register's answer carries (i18-wire: AgentService.mirror_access)
        assert cp.service.mirror_access is not None
        access = cp.service.mirror_access("node-c")
        assert access is not None
        url, credential = access
        assert url == m.url and cp.credentials.node_for(credential) == "node-c"

        # the authorizer from the controller's desired sets: only blobs of replicas placed there
        class Placed:
            def desired(self, node: str) -> tuple[int, tuple[ReplicaSpec, ...]]:
                return (1, (m.spec(),)) if node == "node-c" else (0, ())

        cp.mirror_server.allowed = placed_blobs(Placed())  # type: ignore[arg-type]
        path = f"/mirror/v1/blobs/{m.blobs[1].digest}"
        status, _, body = await raw_get(url, path, {"authorization": f"Bearer {credential}"})
        assert status == 200 and "sha256:" + hashlib.sha256(body).hexdigest() == m.blobs[1].digest
        status, _, _ = await raw_get(url, path, {"authorization": f"Bearer {m.credential}"})
        assert status == 403  # node-a has nothing placed

        # a node that registers and deregisters over gRPC loses its credential
        assert cp.address is not None
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cp.address[1]}") as ch:
            stub = agent_pb2_grpc.AgentServiceStub(ch)
            meta = [("authorization", f"Bearer {JOIN}")]
            reg = await stub.Register(pb.RegisterRequest(node_name="node-c", protocol=pb.ProtocolVersion(
                major=PROTOCOL[0], minor=PROTOCOL[1])), metadata=meta, timeout=5)
            await stub.Deregister(pb.DeregisterRequest(node_name="node-c", node_id=reg.node_id), metadata=meta,
                                  timeout=5)
        assert "node-c" not in cp.credentials
        status, _, _ = await raw_get(url, path, {"authorization": f"Bearer {credential}"})
        assert status == 401


async def test_no_control_plane_no_mirror_route(tmp_path: Path) -> None:
    rt = GatewayRuntime(load({"listen": "127.0.0.1:0", "admin": "127.0.0.1:0"}))
    await rt.start()
    try:
        assert rt.admin_addr is not None
        status, _, body = await raw_get(f"http://127.0.0.1:{rt.admin_addr[1]}", f"/mirror/v1/blobs/sha256:{'a' * 64}", {})
        assert status == 404 and b"control plane" in body
    finally:
        await rt.stop()


# -- pieces on their own ----------------------------------------------------------------------


def test_parse_range() -> None:
    assert parse_range(None, 10) is None
    assert parse_range(b"bytes=0-", 10) == (0, 10)
    assert parse_range(b"bytes=3-5", 10) == (3, 6)
    assert parse_range(b"bytes=3-50", 10) == (3, 10)
    assert parse_range(b"bytes=-4", 10) == (6, 10)
    assert parse_range(b"bytes=-40", 10) == (0, 10)
    for bad in (b"bytes=10-", b"bytes=4-3", b"bytes=-", b"bytes=1-2,4-5", b"lines=1-2", b"bytes=-0", b"bytes=x-"):
        with pytest.raises(RangeNotSatisfiableError):
            parse_range(bad, 10)
    with pytest.raises(RangeNotSatisfiableError):
        parse_range(b"bytes=0-", 0)


def test_the_range_unit_is_case_insensitive() -> None:
    """RFC 9110 section 14.1: "bytes", "BYTES" and "Bytes" are the same unit."""
    for unit in (b"BYTES", b"Bytes", b"bYtEs"):
        assert parse_range(unit + b"=3-5", 10) == (3, 6)
        assert parse_range(unit + b" = -4", 10) == (6, 10)


def test_credentials_issue_check_revoke() -> None:
    creds = NodeCredentials()
    a = creds.issue("node-a")
    b = creds.issue("node-b")
    assert a != b and a.startswith(CREDENTIAL_PREFIX) and len(a) > 40
    assert creds.node_for(a) == "node-a" and creds.node_for(b.encode()) == "node-b"
    assert creds.node_for(a + "x") is None and creds.node_for("") is None and creds.node_for(None) is None
    a2 = creds.issue("node-a")  # a new registration replaces the old credential
    assert creds.node_for(a) is None and creds.node_for(a2) == "node-a"
    assert creds.revoke("node-a") and not creds.revoke("node-a")
    assert creds.node_for(a2) is None and "node-a" not in creds and len(creds) == 1
    assert a2 not in repr(creds) and b not in repr(creds)


def test_resolve_gives_blobs_and_placement_facts(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    model = write_gguf(src / "m.gguf", context_length=4096, block_count=3,
                       extra={"llama.attention.head_count_kv": 2})
    with MirrorStore(tmp_path / "mirror") as store:
        import_file(store, model, name="tiny:1b", projectors=[write_projector(src / "p.gguf")])
        blobs, facts = resolve(store, "tiny:1b")
        assert [b.role for b in blobs] == ["model", "projector"]
        assert blobs[0].digest == sha(model) and blobs[0].size == model.stat().st_size
        assert facts.ref == "tiny:1b" and facts.model_size == blobs[0].size
        assert facts.projector_size == blobs[1].size and facts.size == blobs[0].size + blobs[1].size
        assert (facts.context_length, facts.block_count, facts.head_count, facts.head_count_kv) == (4096, 3, 4, 2)
        assert (facts.embedding_length, facts.key_length, facts.value_length) == (32, 8, 8)
        # 3 layers x 2 KV heads x (8 + 8) x 2 bytes (f16) = 192 bytes a token
        assert facts.kv_bytes_per_token() == 192
        assert kv_cache_bytes(facts, 1000, slots=4) == 192 * 4000
        assert kv_cache_bytes(facts) == 192 * 4096
        assert memory_needed(facts, 1000) == facts.model_size + facts.projector_size + 192_000
        with pytest.raises(ModelNotFoundError, match="no model nope:latest in the mirror; see the names"):
            resolve(store, "nope")
    # by root, from another thread's point of view (a fresh connection)
    assert resolve(tmp_path / "mirror", "tiny:1b")[0] == blobs
    found = find(tmp_path / "mirror", "tiny:1b")
    assert found is not None and found[0] == blobs
    for other in ("nope", "/models/x.gguf", "meta-llama/Llama-3.1-8B-Instruct"):
        assert find(tmp_path / "mirror", other) is None
    assert find(tmp_path / "no-mirror-here", "tiny:1b") is None


async def test_fetcher_refuses_a_bad_url(tmp_path: Path) -> None:
    for bad in ("ftp://x", "localhost:9", "http://"):
        with pytest.raises(ValueError, match="http://HOST:PORT"):
            MirrorFetcher(bad, "c", tmp_path / "m")
    fetcher = MirrorFetcher("http://127.0.0.1:9/prefix/", "c", tmp_path / "m")
    try:
        with pytest.raises(ValueError, match="http://HOST:PORT"):
            fetcher.set_access("nope", "d")
        fetcher.set_access("https://mirror.example:8443", "d")
        assert (fetcher.base_url, fetcher.credential) == ("https://mirror.example:8443", "d")
    finally:
        await fetcher.close()


def test_a_failed_write_beats_a_read_that_broke_meanwhile(tmp_path: Path) -> None:
    """The O_DIRECT path writes on a thread of its own: when a write fails (here: a real EBADF,
    the fd is read-only) while the read after it breaks off (the mirror closes the connection),
    the write's error goes up, not the read's retry: the partial file, with a hole past the
    failed write, is discarded by the caller rather than resumed from."""
    import http.client
    import socket

    from llmgw.mirror.fetch import _Job, _Retry

    chunk = 64 * 1024
    size = 1 << 20
    body = os.urandom(chunk)
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(10)

    def serve() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(f"HTTP/1.1 200 OK\r\ncontent-length: {size}\r\n\r\n".encode() + body)
            # (then closes: the next read breaks off, 1 MiB announced, 64 KiB sent)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    path = tmp_path / "partial"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDONLY)  # every write fails, for real
    loop = asyncio.new_event_loop()
    fetcher = MirrorFetcher("http://127.0.0.1:1", "c", tmp_path / "store", direct_io=True, direct_min=0, chunk=chunk)
    conn = http.client.HTTPConnection("127.0.0.1", srv.getsockname()[1], timeout=10)
    try:
        conn.request("GET", "/")
        resp = conn.getresponse()
        job = _Job(ModelBlob(digest="sha256:" + "0" * 64, size=size))
        with pytest.raises(OSError) as exc:
            fetcher._pump(job, resp, fd, size, hashlib.sha256(), 0, loop)
        assert not isinstance(exc.value, _Retry) and exc.value.errno == 9  # EBADF: the write's, not the read's
    finally:
        conn.close()
        os.close(fd)
        loop.close()
        srv.close()
        t.join(10)


async def test_deployments_resolve_in_the_mirror_root_a_reload_sets(tmp_path: Path) -> None:
    """mirror.root added by a reload: the next deployment's model is looked up there (the
    resolver was made once, at the term's start, with the root of then)."""
    src = tmp_path / "src"
    src.mkdir()
    with MirrorStore(tmp_path / "later-mirror") as store:
        import_file(store, write_gguf(src / "tiny.gguf"), name="tiny:1b")
        blobs, _ = resolve(store, "tiny:1b")
    base = {"listen": "127.0.0.1:0", "admin": "127.0.0.1:0",
            "control": {"listen": f"127.0.0.1:{_free_port()}", "join_token": JOIN, "heartbeat_interval": 0.1,
                        "database": "sqlite::memory:"}}
    os.environ["LLMGW_MIRROR"] = str(tmp_path / "no-mirror-yet")  # (the default root: never the user's own)
    try:
        rt = GatewayRuntime(load(base), components=components_for(load(base)))
        await rt.start()
        try:
            ctl = rt.components[0].deployments
            assert ctl is not None and ctl.resolver("tiny:1b") is None
            rt.reload(load({**base, "mirror": {"root": str(tmp_path / "later-mirror")}}))
            got = ctl.resolver("tiny:1b")
            assert got is not None and tuple(got.blobs) == tuple(blobs)
        finally:
            await rt.stop()
    finally:
        del os.environ["LLMGW_MIRROR"]
