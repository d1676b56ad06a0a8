"""Import throughput of ``llmgw mirror import`` against ``cp`` and ``cp`` + ``sha256sum``.

What is measured: wall time to bring one file (1 GiB by default, random bytes)
into a directory on the same file system, median of N runs each way:

* ``cp``: copy only; nothing verified, nothing made durable (the data may still
  sit in the page cache when it returns).
* ``cp + sync``: the copy, then ``sync FILE`` (fsync) so it is on disk, which is
  what the mirror guarantees.
* ``sha256sum``: hashing the source alone, for scale.
* ``cp + sha256sum``: copy, then hash the copy (the manual way to get a verified copy).
* ``llmgw import``: ``python -m llmgw mirror import --raw --quiet`` as a user
  runs it (interpreter start-up included): copy and SHA-256 in one pass,
  fsync, atomic rename, catalogue row.

The source is read once before timing, so every row reads it from the page cache;
``sync`` runs (untimed) before each run so one run's writeback does not slow the next,
and the rows take turns, so load from other processes weighs on all of them alike.
This is a script, not a pytest benchmark: ``python bench/bench_mirror_import.py [--size-mib N] [--runs N]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path


def _make_source(path: Path, size: int) -> None:
    chunk = 8 << 20
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(chunk, left)
            f.write(os.urandom(n))
            left -= n


def _sync() -> None:
    subprocess.run(["sync"], check=True)


Row = tuple[str, Callable[[int], None], Callable[[int], None]]


def _timed(runs: int, rows: list[Row]) -> list[tuple[str, list[float]]]:
    # Round-robin (run 1 of every row, then run 2, ...): load from other
    # processes then weighs on every row alike instead of on whichever ran during it.
    times: dict[str, list[float]] = {name: [] for name, _, _ in rows}
    for i in range(runs):
        for name, prepare, run in rows:
            prepare(i)
            _sync()
            t0 = time.perf_counter()
            run(i)
            times[name].append(time.perf_counter() - t0)
    return [(name, times[name]) for name, _, _ in rows]


def main() -> int:
    """Run the benchmark and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024, help="file size in MiB (default 1024)")
    parser.add_argument("--runs", type=int, default=3, help="runs per row; the median is shown (default 3)")
    parser.add_argument(
        "--dir", type=Path, default=None, help="where to work (default: a temporary directory)"
    )
    args = parser.parse_args()
    size = args.size_mib << 20

    with tempfile.TemporaryDirectory(prefix="llmgw-bench-", dir=args.dir) as tmp:
        work = Path(tmp)
        src = work / "source.bin"
        dst = work / "copy.bin"
        print(f"creating a {args.size_mib} MiB source file in {work} ...", file=sys.stderr)
        _make_source(src, size)
        subprocess.run(["cat", str(src)], stdout=subprocess.DEVNULL, check=True)  # warm the page cache

        def rm_dst(_: int) -> None:
            dst.unlink(missing_ok=True)

        def rm_root(i: int) -> None:
            shutil.rmtree(work / f"mirror{i}", ignore_errors=True)

        def sh(*cmd: str) -> Callable[[int], None]:
            return lambda _: subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)

        def cp_then(*cmd: str) -> Callable[[int], None]:
            def run(_: int) -> None:
                subprocess.run(["cp", str(src), str(dst)], check=True)
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)

            return run

        def llmgw(i: int) -> None:
            subprocess.run(
                [sys.executable, "-m", "llmgw", "mirror", "--root", str(work / f"mirror{i}"), "import", "--raw",
                 "--quiet", str(src)],
                check=True,
            )  # fmt: skip

        rows = _timed(
            args.runs,
            [
                ("cp", rm_dst, sh("cp", str(src), str(dst))),
                ("cp + sync", rm_dst, cp_then("sync", str(dst))),
                ("sha256sum", rm_dst, sh("sha256sum", str(src))),
                ("cp + sha256sum", rm_dst, cp_then("sha256sum", str(dst))),
                ("llmgw import", rm_root, llmgw),
            ],
        )
        for i in range(args.runs):
            rm_root(i)
        dst.unlink(missing_ok=True)

    med = {name: statistics.median(t) for name, t in rows}
    cp, cp_sha = med["cp"], med["cp + sha256sum"]
    print(f"\n{args.size_mib} MiB, median of {args.runs} runs (source in page cache)\n")
    print(f"{'':16} {'seconds':>8} {'MB/s':>8} {'vs cp':>7} {'vs cp+sha':>10}   runs")
    for name, times in rows:
        m = med[name]
        runs = " ".join(f"{t:.2f}" for t in times)
        print(f"{name:16} {m:8.2f} {size / m / 1e6:8.0f} {m / cp:6.2f}x {m / cp_sha:9.2f}x   {runs}")
    target = 1.25 * cp
    verdict = "met" if med["llmgw import"] <= target else "not met"
    print(f"\ntarget (llmgw import <= cp + 25% = {target:.2f} s): {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
