"""The runner every ``fuzz_<target>.py`` shares (see README.md).

A target module defines ``NAME``, ``INSTRUMENT`` (the pure modules whose bytecode
atheris instruments for coverage), ``setup()`` (imports, called inside the
instrumentation) and ``one_input(data: bytes)``, which raises:

* :class:`Disagreement` when the compiled module and its pure twin (or the parser
  and its oracle) answer differently: a finding;
* any other exception when the parser fails in a way its contract does not allow
  (it may only raise its documented error classes): a crash, a finding.

``one_input`` returning is a pass. The runner (parent) starts a worker (the same
script with ``--worker``) that fuzzes with atheris (libFuzzer) and counts every
input; the worker catches findings itself, saves each distinct one under
``OUT/findings/`` and goes on, so one finding does not end a run. An input that
runs past ``--timeout`` seconds is a hang: libFuzzer kills the worker and writes
the input as an artifact; the parent records it and starts a new worker for the
inputs left. At the end the parent writes ``OUT/summary.json``.

``--engine random`` is a small mutational fuzzer (no coverage) for where atheris
does not install; the pytest smoke test uses it through :func:`run_random`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

STATS_EVERY = 2000  # the worker writes its counts this often (libFuzzer's exit skips atexit)


class Disagreement(AssertionError):
    """Two implementations (or a parser and its oracle) answered the same input differently.

    ``tag`` names the kind of difference: findings are grouped by it.
    """

    def __init__(self, message: str, tag: str = "") -> None:
        super().__init__(message)
        self.tag = tag


_EXPLAINED: dict[str, int] = {}


def explained(tag: str) -> None:
    """Note a difference between the twins that is by design (each such tag is named,
    with its reason, where the target calls this): counted, not a finding."""
    _EXPLAINED[tag] = _EXPLAINED.get(tag, 0) + 1


class Stats:
    def __init__(self, path: Path | None, findings: Path | None) -> None:
        self.path = path
        self.findings = findings
        self.inputs = 0
        self.crashes = 0
        self.disagreements = 0
        self.slowest_s = 0.0
        self.kinds: dict[str, dict[str, Any]] = {}  # signature -> {kind, count, example}
        self.started = time.monotonic()

    def record(self, kind: str, data: bytes, exc: BaseException) -> None:
        if kind == "crash":
            self.crashes += 1
        else:
            self.disagreements += 1
        tb = traceback.extract_tb(exc.__traceback__)
        where = f"{tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno}" if tb else "?"
        sig = f"{kind}:{type(exc).__name__}:{getattr(exc, 'tag', '') or where}"
        entry = self.kinds.get(sig)
        if entry is None:
            name = f"{kind}-{hashlib.sha1(data).hexdigest()[:16]}"
            entry = self.kinds[sig] = {"kind": kind, "count": 0, "input": name, "error": f"{exc!r}"[:500]}
            if self.findings is not None:
                self.findings.mkdir(parents=True, exist_ok=True)
                (self.findings / name).write_bytes(data)
                (self.findings / (name + ".txt")).write_text("".join(traceback.format_exception(exc)))
        entry["count"] += 1

    def dump(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.as_dict()))
        os.replace(tmp, self.path)

    def as_dict(self) -> dict[str, Any]:
        return {
            "inputs": self.inputs,
            "crashes": self.crashes,
            "disagreements": self.disagreements,
            "slowest_s": round(self.slowest_s, 4),
            "seconds": round(time.monotonic() - self.started, 1),
            "explained": dict(_EXPLAINED),
            "findings": self.kinds,
        }


def checked(target: ModuleType, stats: Stats) -> Callable[[bytes], None]:
    """``target.one_input`` that counts each input and records (never raises) findings."""
    one = target.one_input
    clock = time.perf_counter

    def run(data: bytes) -> None:
        t0 = clock()
        try:
            one(data)
        except Disagreement as exc:
            stats.record("disagreement", data, exc)
        except Exception as exc:  # every other exception is a crash
            stats.record("crash", data, exc)
        dt = clock() - t0
        if dt > stats.slowest_s:
            stats.slowest_s = dt
        stats.inputs += 1
        if stats.inputs % STATS_EVERY == 0:
            stats.dump()

    return run


def seeds(target: ModuleType) -> list[bytes]:
    d = HERE / "corpus" / target.NAME
    return [p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()] if d.is_dir() else []


# -- the random engine ------------------------------------------------------------------

_INTERESTING = [b"\x00", b"\xff", b"\r\n", b"\n", b"\r", b" ", b"\t", b":", b",", b'"', b"\\", b"{", b"}",
                b"[", b"]", b"0", b"-1", b"\x7f", b"\xc3\xa9", b"\xed\xa0\x80", b"\r\n\r\n", b"9" * 20]


def mutations(corpus: list[bytes], rng: random.Random, max_len: int) -> Iterator[bytes]:
    """An endless stream of mutants of ``corpus`` (bit flips, byte sets, inserts,
    deletes, duplications, splices): what libFuzzer does, without the coverage."""
    pool = corpus or [b""]
    while True:
        data = bytearray(rng.choice(pool))
        for _ in range(rng.randint(1, 4)):
            op = rng.randrange(7)
            n = len(data)
            if op == 0 and n:
                data[rng.randrange(n)] ^= 1 << rng.randrange(8)
            elif op == 1 and n:
                data[rng.randrange(n)] = rng.randrange(256)
            elif op == 2:
                i = rng.randint(0, n)
                data[i:i] = rng.choice(_INTERESTING)
            elif op == 3 and n:
                i = rng.randrange(n)
                del data[i : i + rng.randint(1, 8)]
            elif op == 4 and n:
                i = rng.randrange(n)
                j = min(n, i + rng.randint(1, 32))
                data[j:j] = data[i:j]
            elif op == 5:
                other = rng.choice(pool)
                i = rng.randint(0, n)
                data[i:] = other[rng.randint(0, len(other)) :]
            elif op == 6:
                data.extend(rng.randbytes(rng.randint(1, 8)))
        yield bytes(data[:max_len])


def run_random(target: ModuleType, runs: int, *, seed: int = 0, max_len: int = 4096,
               stats: Stats | None = None) -> Stats:
    """Feed ``runs`` inputs (the seeds, then mutants of them) to ``target``."""
    target.setup()
    stats = stats or Stats(None, None)
    run = checked(target, stats)
    corpus = seeds(target)
    for data in corpus[:runs]:
        run(data)
    gen = mutations(corpus, random.Random(seed), max_len)
    while stats.inputs < runs:
        run(next(gen))
    return stats


# -- worker and parent ---------------------------------------------------------------


def _worker(target: ModuleType, args: argparse.Namespace) -> None:
    out = Path(args.out)
    stats = Stats(out / f"worker-{args.worker}.json", out / "findings")
    if args.engine == "random":
        run_random(target, args.runs, seed=args.worker, max_len=args.max_len, stats=stats)
        stats.dump()
        return
    import atheris  # type: ignore[import-not-found]

    with atheris.instrument_imports(include=list(target.INSTRUMENT)):
        target.setup()
    run = checked(target, stats)
    left = args.runs

    def one(data: bytes) -> None:
        run(data)
        if stats.inputs >= left:
            stats.dump()

    corpus = out / "corpus"
    argv = [sys.argv[0], str(corpus), f"-runs={args.runs}", f"-timeout={args.timeout}",
            f"-max_len={args.max_len}", "-rss_limit_mb=4096", f"-artifact_prefix={out}/",
            f"-seed={args.worker + 1}", "-print_final_stats=1", "-reduce_inputs=1"]
    atheris.Setup(argv, one)
    stats.dump()
    atheris.Fuzz()


def _commit() -> str:
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def main(target: ModuleType) -> None:
    p = argparse.ArgumentParser(description=f"fuzz {target.NAME} (see bench/fuzz/README.md)")
    p.add_argument("--runs", type=int, default=1_000_000, help="inputs to execute in all")
    p.add_argument("--timeout", type=int, default=10, help="seconds one input may take before it is a hang")
    p.add_argument("--max-len", type=int, default=getattr(target, "MAX_LEN", 4096), help="longest input")
    p.add_argument("--engine", choices=("atheris", "random"), default="atheris")
    p.add_argument("--out", default=None, help=f"results folder (default bench/fuzz/out/{target.NAME})")
    p.add_argument("--worker", type=int, default=-1, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.out = args.out or str(HERE / "out" / target.NAME)
    if args.worker >= 0:
        _worker(target, args)
        return

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    corpus = out / "corpus"
    corpus.mkdir(exist_ok=True)
    for i, s in enumerate(seeds(target)):  # the committed seeds start the working corpus
        (corpus / f"seed-{i}").write_bytes(s)
    t0 = time.monotonic()
    commit = _commit()  # (at the start: the code under test)
    total: dict[str, Any] = {"inputs": 0, "crashes": 0, "disagreements": 0, "slowest_s": 0.0, "findings": {},
                             "explained": {}}
    hangs: list[str] = []
    deaths: list[str] = []
    worker = 0
    while total["inputs"] < args.runs and worker < 200:
        stats_file = out / f"worker-{worker}.json"
        stats_file.unlink(missing_ok=True)
        before = set(out.iterdir())
        cmd = [sys.executable, sys.argv[0], "--worker", str(worker), "--runs", str(args.runs - total["inputs"]),
               "--timeout", str(args.timeout), "--max-len", str(args.max_len), "--engine", args.engine,
               "--out", str(out)]
        with open(out / f"worker-{worker}.log", "wb") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
        got = json.loads(stats_file.read_text()) if stats_file.exists() else {"inputs": 0, "findings": {}}
        for k in ("inputs", "crashes", "disagreements"):
            total[k] += got.get(k, 0)
        total["slowest_s"] = max(total["slowest_s"], got.get("slowest_s", 0.0))
        for tag, n in got.get("explained", {}).items():
            total["explained"][tag] = total["explained"].get(tag, 0) + n
        for sig, entry in got.get("findings", {}).items():
            mine = total["findings"].setdefault(sig, {**entry, "count": 0})
            mine["count"] += entry["count"]
        new = sorted(p.name for p in set(out.iterdir()) - before if p.name.startswith(("timeout-", "crash-", "oom-", "slow-unit-")))
        if rc != 0:
            if any(n.startswith("timeout-") for n in new):
                hangs.extend(n for n in new if n.startswith("timeout-"))
                total["inputs"] += 1  # the input that hung
            else:
                deaths.append(f"worker {worker} exited {rc}: {', '.join(new) or 'no artifact'} (see worker-{worker}.log)")
                if not got.get("inputs"):
                    break  # it cannot start: do not loop
        worker += 1
    seconds = time.monotonic() - t0
    import platform

    summary = {
        "target": target.NAME,
        "engine": args.engine,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": commit,
        "python": platform.python_version(),
        "inputs": total["inputs"],
        "seconds": round(seconds, 1),
        "exec_per_s": round(total["inputs"] / seconds, 1) if seconds else None,
        "crashes": total["crashes"],
        "hangs": len(hangs),
        "disagreements": total["disagreements"],
        "explained_differences": total["explained"],
        "worker_deaths": deaths,
        "timeout_s": args.timeout,
        "slowest_input_s": total["slowest_s"],
        "hang_inputs": hangs,
        "findings": total["findings"],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "findings"}, indent=2))
    for sig, e in summary["findings"].items():
        print(f"  {e['count']:>8} x {sig}  e.g. {out}/findings/{e['input']}: {e['error'][:160]}")
    sys.exit(1 if summary["crashes"] or summary["hangs"] or summary["disagreements"] or deaths else 0)

