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

On a shared machine the wall-clock rates follow the other processes' load, so
the script also reports, per row, the CPU each side spends per GiB (which load
barely changes), the ratio of each round's fetch to the same round's openssl
(median over the rounds), how many cores other processes kept busy meanwhile
(from ``/proc/stat``), and the ratio to expect with no free core at all: openssl's
CPU per GiB over the fetch's (client + server), since then every process gets
the same share of the machine and the rate is that share over the CPU per byte.

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


def _machine_busy() -> tuple[float, float]:
    """``(busy, steal)`` CPU seconds of the whole machine so far (Linux ``/proc/stat``; zeros elsewhere)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0.0, 0.0
    tick = os.sysconf("SC_CLK_TCK")
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / tick, steal / tick


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
    ap.add_argument("--runs", type=int, default=5)
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
            # (a database of its own: the default one is shared with any other llmgw serve of the user)
            "control": {"listen": f"127.0.0.1:{_free_port()}", "join_token": "bench-join-token",
                        "database": f"sqlite:///{work / 'control.sqlite3'}"},
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
        steal0 = _machine_busy()[1]
        tmpfs = None if args.tmpfs is None or str(args.tmpfs) == "none" else Path(
            tempfile.mkdtemp(prefix="llmgw-transfer-", dir=args.tmpfs))
        times: dict[str, list[float]] = {"openssl": [], "disk": [], "fetch-disk": [], "fetch-tmpfs": []}
        cpu: dict[str, list[float]] = {"openssl": [], "fetch-disk": [], "fetch-tmpfs": []}
        server: dict[str, list[float]] = {"fetch-disk": [], "fetch-tmpfs": []}
        others: dict[str, list[float]] = {"openssl": [], "fetch-disk": [], "fetch-tmpfs": []}
        ratios: dict[str, list[float]] = {"fetch-disk": [], "fetch-tmpfs": []}
        for i in range(args.runs):
            subprocess.run(["sync"], check=True)
            c0, (b0, _) = _cpu_children(), _machine_busy()
            t0 = time.perf_counter()
            out = subprocess.run(["openssl", "dgst", "-sha256", str(blob_path)], check=True, capture_output=True,
                                 text=True).stdout
            took = time.perf_counter() - t0
            times["openssl"].append(took)
            cpu["openssl"].append(_cpu_children() - c0)
            others["openssl"].append((_machine_busy()[0] - b0 - cpu["openssl"][-1]) / took)
            assert f.digest[7:] in out, out
            subprocess.run(["sync"], check=True)
            times["disk"].append(_write_and_sync(work / "dd.bin", size))
            for row, where in (("fetch-disk", work), ("fetch-tmpfs", tmpfs)):
                if where is None:
                    continue
                node = where / f"node-mirror-{i}"
                subprocess.run(["sync"], check=True)
                c0, s0, (b0, _) = _cpu_self(), _cpu_of(proc.pid), _machine_busy()
                took = _run_loop(_fetch(served["url"], served["credential"], node, blob))
                times[row].append(took)
                cpu[row].append(_cpu_self() - c0)
                server[row].append(_cpu_of(proc.pid) - s0)
                others[row].append((_machine_busy()[0] - b0 - cpu[row][-1] - server[row][-1]) / took)
                ratios[row].append(times["openssl"][-1] / took)
                shutil.rmtree(node)
        if tmpfs is not None:
            shutil.rmtree(tmpfs, ignore_errors=True)
        mib = size / (1 << 20)
        gib = size / (1 << 30)
        med = statistics.median
        rate = {k: mib / med(v) for k, v in times.items() if v}
        print(f"blob: {args.size_mib} MiB, {args.runs} runs each (median), {os.cpu_count()} CPUs,"
              f" load average {os.getloadavg()[0]:.1f}, {_machine_busy()[1] - steal0:.1f} s stolen by the host")
        labels = {
            "openssl": "openssl dgst -sha256",
            "disk": "disk: write + fsync",
            "fetch-disk": "fetch, node store on disk",
            "fetch-tmpfs": "fetch, node store on tmpfs",
        }
        for k, v in times.items():
            if not v:
                continue
            line = f"{labels[k]:28s} {rate[k]:7.0f} MiB/s"
            if k in cpu:
                line += f"  CPU s/GiB {med(cpu[k]) / gib:.2f}"
            if k in server:
                line += f" client + {med(server[k]) / gib:.2f} server"
            if k in others:
                line += f"; other processes kept {med(others[k]):.1f} cores busy"
            print(line + f"  (runs {', '.join(f'{x:.3f}' for x in v)} s)")
        for k in ("fetch-disk", "fetch-tmpfs"):
            if not times[k]:
                continue
            ceiling = med(cpu["openssl"]) / (med(cpu[k]) + med(server[k]))
            print(f"{labels[k]}: {med(ratios[k]):.0%} of openssl (median of the rounds' ratios"
                  f" {', '.join(f'{x:.0%}' for x in ratios[k])}; goal: at least 80%); with no free core:"
                  f" {ceiling:.0%} (openssl's CPU per GiB over the fetch's)"
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
