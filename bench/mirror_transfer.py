"""Mirror transfer rate between two local mirrors, against ``openssl dgst -sha256`` of the same file.

What is measured, median of N runs each way (taking turns, so load from other
processes weighs on both alike):

* ``openssl dgst -sha256 FILE``: hashing the blob alone, from the page cache; the
  fastest SHA-256 on the machine, and so the ceiling of any verified transfer.
* ``fetch``: :class:`llmgw.mirror.fetch.MirrorFetcher` bringing the blob from a
  control plane's mirror into an empty second store: HTTP over loopback from the
  admin listener of a separate gateway process, SHA-256 while writing, fsync, link
  into place (what an agent does before it launches a replica). The server side
  is ``llmgw serve``'s runtime (``GatewayRuntime`` with its control plane, on
  uvloop) in its own process, started by this script with ``--serve CONFIG``: it
  issues a credential for one node and allows it every blob, which in a real
  cluster registration and placement do.

``sync`` runs (untimed) before each run, so one run's writeback does not slow
the next. Goal (issue 18): the fetch at least 80% of openssl's rate.

    python bench/mirror_transfer.py [--size-mib 384] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _make_source(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(8 << 20, left)
            f.write(os.urandom(n))
            left -= n


async def _serve(config_path: str) -> None:
    from llmgw.config import load_file
    from llmgw.runtime import GatewayRuntime, components_for

    cfg = load_file(config_path)
    rt = GatewayRuntime(cfg, components=components_for(cfg))
    await rt.start()
    try:
        cp: Any = rt.components[0]
        credential = cp.credentials.issue("bench-node")
        cp.mirror_server.allowed = lambda node, digest: node == "bench-node"
        assert rt.admin_addr is not None
        print(json.dumps({"url": f"http://127.0.0.1:{rt.admin_addr[1]}", "credential": credential}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes it
    finally:
        await rt.stop()


def _run_loop(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return asyncio.run(coro)
    return uvloop.run(coro)


async def _fetch(url: str, credential: str, root: Path, blob: Any) -> float:
    from llmgw.launch.spec import ReplicaSpec
    from llmgw.mirror.fetch import MirrorFetcher

    spec = ReplicaSpec(id="bench", deployment="bench", engine="llamacpp", model="bench:blob",
                       served_name="bench", blobs=(blob,))
    fetcher = MirrorFetcher(url, credential, root, attempts=1)
    try:
        t0 = time.perf_counter()
        await fetcher.ensure(spec, lambda done, total: None)
        took = time.perf_counter() - t0
        assert fetcher.downloads == 1, "the blob was not fetched"
        return took
    finally:
        await fetcher.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=384)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="where to put the mirrors (default: a temp dir)")
    ap.add_argument("--serve", metavar="CONFIG", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        _run_loop(_serve(args.serve))
        return

    from llmgw.launch.spec import ModelBlob
    from llmgw.mirror import MirrorStore, import_file

    if shutil.which("openssl") is None:
        sys.exit("openssl is not installed")
    size = args.size_mib << 20
    work = Path(tempfile.mkdtemp(prefix="llmgw-transfer-", dir=args.dir))
    proc: subprocess.Popen[str] | None = None
    try:
        src = work / "blob.bin"
        _make_source(src, size)
        with MirrorStore(work / "cp-mirror") as store:
            result = import_file(store, src, name="bench:blob", raw=True)
            f = result.record.files[0]
            blob = ModelBlob(digest=f.digest, size=f.size, role="model")
            blob_path = store.blob_path(f.digest)
        src.unlink()
        config = work / "llmgw.yaml"
        config.write_text(json.dumps({
            "listen": "127.0.0.1:0", "admin": "127.0.0.1:0", "mirror": {"root": str(work / "cp-mirror")},
            "control": {"listen": f"127.0.0.1:{_free_port()}", "join_token": "bench-join-token"},
        }))
        proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", str(config)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            sys.exit("the gateway did not start")
        served = json.loads(line)
        subprocess.run(["openssl", "dgst", "-sha256", str(blob_path)], check=True, capture_output=True)  # warm
        openssl: list[float] = []
        fetch: list[float] = []
        for i in range(args.runs):
            subprocess.run(["sync"], check=True)
            t0 = time.perf_counter()
            out = subprocess.run(["openssl", "dgst", "-sha256", str(blob_path)], check=True, capture_output=True,
                                 text=True).stdout
            openssl.append(time.perf_counter() - t0)
            assert f.digest[7:] in out, out
            node = work / f"node-mirror-{i}"
            subprocess.run(["sync"], check=True)
            fetch.append(_run_loop(_fetch(served["url"], served["credential"], node, blob)))
            shutil.rmtree(node)
        mib = size / (1 << 20)
        o = mib / statistics.median(openssl)
        t = mib / statistics.median(fetch)
        print(f"blob: {args.size_mib} MiB, {args.runs} runs each, {os.cpu_count()} CPUs")
        print(f"openssl dgst -sha256: {o:8.0f} MiB/s   (median {statistics.median(openssl):.3f} s;"
              f" runs {', '.join(f'{x:.3f}' for x in openssl)})")
        print(f"mirror fetch:         {t:8.0f} MiB/s   (median {statistics.median(fetch):.3f} s;"
              f" runs {', '.join(f'{x:.3f}' for x in fetch)})")
        print(f"ratio: {t / o:.0%} of openssl (goal: at least 80%)")
    finally:
        if proc is not None:
            assert proc.stdin is not None
            proc.stdin.close()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
