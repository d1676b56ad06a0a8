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

The fetch runs twice per round: into a node store on the work directory's disk,
and into one on tmpfs (``/dev/shm``, where there is one). A fetch is durable (the
blob is fsync'd before it counts), so on disk it cannot beat the disk's own write
rate: the script measures that too (writing the same number of bytes and
fsyncing, as ``dd conv=fdatasync`` does). The tmpfs row is the transfer itself:
socket, hash and copy.

``sync`` runs (untimed) before each run, so one run's writeback does not slow
the next. Goal (issue 18): the fetch at least 80% of openssl's rate.

    python bench/mirror_transfer.py [--size-mib 384] [--runs 5] [--dir DIR] [--tmpfs DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
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


def _cpu_self() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _cpu_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _cpu_of(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used (Linux ``/proc``; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _write_and_sync(path: Path, size: int) -> float:
    """Seconds to write ``size`` bytes to a new file and fsync it (what ``dd conv=fdatasync`` measures)."""
    buf = memoryview(bytearray(os.urandom(1 << 20)) * 4)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        left = size
        while left:
            left -= os.write(fd, buf[: min(len(buf), left)])
        os.fsync(fd)
    finally:
        os.close(fd)
    took = time.perf_counter() - t0
    path.unlink()
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=384)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="where to put the mirrors (default: a temp dir)")
    ap.add_argument("--tmpfs", type=Path, default=Path("/dev/shm") if Path("/dev/shm").is_dir() else None,
                    help="a memory file system for the second node store (default /dev/shm; 'none': skip)")
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
        tmpfs = None if args.tmpfs is None or str(args.tmpfs) == "none" else Path(
            tempfile.mkdtemp(prefix="llmgw-transfer-", dir=args.tmpfs))
        times: dict[str, list[float]] = {"openssl": [], "disk": [], "fetch-disk": [], "fetch-tmpfs": []}
        cpu: dict[str, list[float]] = {"openssl": [], "client": [], "server": []}
        for i in range(args.runs):
            subprocess.run(["sync"], check=True)
            c0 = _cpu_children()
            t0 = time.perf_counter()
            out = subprocess.run(["openssl", "dgst", "-sha256", str(blob_path)], check=True, capture_output=True,
                                 text=True).stdout
            times["openssl"].append(time.perf_counter() - t0)
            cpu["openssl"].append(_cpu_children() - c0)
            assert f.digest[7:] in out, out
            subprocess.run(["sync"], check=True)
            times["disk"].append(_write_and_sync(work / "dd.bin", size))
            for row, where in (("fetch-disk", work), ("fetch-tmpfs", tmpfs)):
                if where is None:
                    continue
                node = where / f"node-mirror-{i}"
                subprocess.run(["sync"], check=True)
                c0, s0 = _cpu_self(), _cpu_of(proc.pid)
                times[row].append(_run_loop(_fetch(served["url"], served["credential"], node, blob)))
                cpu["client"].append(_cpu_self() - c0)
                cpu["server"].append(_cpu_of(proc.pid) - s0)
                shutil.rmtree(node)
        if tmpfs is not None:
            shutil.rmtree(tmpfs, ignore_errors=True)
        mib = size / (1 << 20)
        rate = {k: mib / statistics.median(v) for k, v in times.items() if v}
        print(f"blob: {args.size_mib} MiB, {args.runs} runs each (median), {os.cpu_count()} CPUs,"
              f" load average {os.getloadavg()[0]:.1f}")
        labels = {
            "openssl": "openssl dgst -sha256",
            "disk": "disk: write + fsync",
            "fetch-disk": "fetch, node store on disk",
            "fetch-tmpfs": "fetch, node store on tmpfs",
        }
        for k, v in times.items():
            if v:
                print(f"{labels[k]:28s} {rate[k]:7.0f} MiB/s  (runs {', '.join(f'{x:.3f}' for x in v)} s)")
        gib = size / (1 << 30)
        print("CPU seconds per GiB (load-independent): openssl {:.2f}; fetch: client {:.2f} (the hash alone is"
              " openssl's, on its own thread), server {:.2f}".format(
                  *(statistics.median(cpu[k]) / gib for k in ("openssl", "client", "server"))))
        for k in ("fetch-disk", "fetch-tmpfs"):
            if k in rate:
                print(f"{labels[k]}: {rate[k] / rate['openssl']:.0%} of openssl (goal: at least 80%)"
                      + (f"; {rate[k] / rate['disk']:.0%} of the disk's write rate" if k == "fetch-disk" else ""))
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
