#!/usr/bin/env python3
"""Benchmark guard: build two revisions, compare their instruction counts, fail on a regression.

    python bench/guard.py --base origin/main                 # base vs HEAD
    python bench/guard.py --base HEAD~1 --head HEAD --json guard.json --markdown summary.md
    python bench/guard.py --base HEAD~1 --quick              # kernels + one request figure

What it does, in one run:

1. **Builds** each revision: ``git archive REV`` into a work directory, a venv per
   revision, ``pip install --no-build-isolation 'SRC[test]'`` (pip's cache is reused;
   the build needs only what ``.[test]`` and the build system pull in). A build is kept
   under ``--work`` (default ``~/.cache/llmgw-guard``) keyed by the revision's *tree*
   hash, so a rerun, or a commit with the same tree, does not build again.
   ``--head-venv``/``--base-venv`` use an existing venv instead (``.ci/run`` passes the
   venv it just built for the checkout).
2. **Kernels** (deterministic): ``bench/guard_kernels.py`` runs under
   ``valgrind --tool=callgrind --dump-before=getppid`` with each revision's Python. Each
   kernel runs a loop of 0 calls and a loop of N calls, each between two
   ``os.getppid()`` markers (callgrind starts a new part file at each); the per-call
   figure is ``(part_N - part_0) / N``: exact, the loop overhead subtracted. Figures:
   promscan on the real vLLM page, ``score`` (``Picker.pick`` over 64 replicas),
   ``admit`` (push + pop), ``jsonscan`` (``json_model`` on the ~1 KB chat body,
   ``usage_counts`` on an answer and on a stream read, ``sse_cut``).
3. **Data path** (near-deterministic): ``bench/dataplane/callgrind.py --llmgw
   VENV/bin/llmgw``: instructions per proxied request and per relayed 65-event stream,
   user space, ``llmgw serve`` under callgrind in front of the nginx engine. The stream
   uses ``--sse-gap-ms 1`` (events do not coalesce in one read, as they do at gap 0)
   and the median of ``--reps`` runs; base and head runs alternate.
4. **Wall clock** (informational, never gating): the pytest-benchmark suites
   ``bench/bench_{promscan,score,admit,jsonscan}.py`` of each revision, a short run
   (``--benchmark-min-rounds 5``), median per test, side by side.

Exit status: 1 when an instruction figure rises by more than its threshold (2% for the
kernels and the request; the stream's threshold is in ``THRESHOLDS``), 2 on an error,
0 otherwise. The table (Markdown: figure | base | head | change) goes to stdout and to
``--markdown FILE``; ``--json FILE`` keeps every figure with its samples (the format
``bench/dashboard.py`` reads).

Needs: ``git``, ``valgrind`` (Debian: ``valgrind``), ``nginx`` with the echo module
(Debian: ``nginx libnginx-mod-http-echo``), a C compiler and the Python headers for the
build. About 6-8 minutes on a 2-core VM (the two builds about 2.5 of them); ``--quick``
about half.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# Rise (fraction) above which a figure fails the guard. The kernels repeat to the
# instruction; the request figure moves by ~0.1% run to run; the stream figure (65
# events, --sse-gap-ms 1, median of --reps) moves by about 0.5%; see bench/README.md.
DEFAULT_THRESHOLD = 0.02
THRESHOLDS: dict[str, float] = {"relayed stream": 0.03}

WALL_SUITES = ("bench_promscan.py", "bench_score.py", "bench_admit.py", "bench_jsonscan.py")


@dataclass
class Figure:
    name: str
    kind: str  # "instructions" (gating) or "wall" (informational)
    unit: str
    base: float | None
    head: float | None
    threshold: float | None
    base_samples: list[float] = field(default_factory=list)
    head_samples: list[float] = field(default_factory=list)
    note: str = ""

    @property
    def change(self) -> float | None:
        if self.base is None or self.head is None or self.base == 0:
            return None
        return self.head / self.base - 1.0

    @property
    def regressed(self) -> bool:
        c = self.change
        return self.threshold is not None and c is not None and c > self.threshold


@dataclass
class Build:
    rev: str
    sha: str
    tree: str
    venv: Path
    src: Path
    date: str
    subject: str
    build_s: float = 0.0


def log(msg: str) -> None:
    print(f"guard: {msg}", file=sys.stderr, flush=True)


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True, text=True).stdout.strip()


def _run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)  # type: ignore[call-overload]
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({p.returncode}):\n{p.stdout[-3000:]}{p.stderr[-3000:]}")
    return p


def build(rev: str, work: Path, venv: str | None, fresh: bool) -> Build:
    sha = git("rev-parse", "--verify", f"{rev}^{{commit}}")
    tree = git("rev-parse", f"{sha}^{{tree}}")
    date = git("show", "-s", "--format=%cI", sha)
    subject = git("show", "-s", "--format=%s", sha)
    src = work / f"src-{tree[:12]}"
    if fresh or not (src / ".guard-tree").exists():
        shutil.rmtree(src, ignore_errors=True)
        src.mkdir(parents=True)
        archive = subprocess.run(["git", "archive", "--format=tar", sha], cwd=REPO, check=True,
                                 capture_output=True).stdout
        with tarfile.open(fileobj=__import__("io").BytesIO(archive)) as tf:
            tf.extractall(src, filter="data")
        (src / ".guard-tree").write_text(tree)
    if venv is not None:
        return Build(rev, sha, tree, Path(venv).resolve(), src, date, subject)
    v = work / f"venv-{tree[:12]}"
    ok = v / ".guard-ok"
    t0 = time.monotonic()
    if fresh or not ok.exists():
        shutil.rmtree(v, ignore_errors=True)
        log(f"building {rev} ({sha[:10]}) into {v}")
        _run([sys.executable, "-m", "venv", str(v)])
        pip = [str(v / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        _run([*pip, "setuptools>=77", "wheel", "Cython>=3.0.10,<4"])
        _run([*pip, "--no-build-isolation", f"{src}[test]"], cwd=str(work))
        ok.write_text(sha)
    else:
        log(f"reusing the build of {rev} ({sha[:10]}, tree {tree[:12]}) in {v}")
    return Build(rev, sha, tree, v, src, date, subject, time.monotonic() - t0)


def _parts(out: Path) -> list[int]:
    """Instruction totals of callgrind's part files ``out.1 .. out.K`` (in order)."""
    parts = []
    for p in sorted(out.parent.glob(out.name + ".*"), key=lambda p: int(p.suffix[1:])):
        m = re.search(r"^summary: (\d+)", p.read_text(errors="replace"), re.M)
        parts.append(int(m.group(1)) if m else 0)
    return parts


def kernels(b: Build, tmp: Path) -> dict[str, tuple[float | None, str]]:
    d = Path(tempfile.mkdtemp(prefix="kern-", dir=tmp))
    out = d / "cg.out"
    env = {**os.environ, "PYTHONHASHSEED": "0", "LLMGW_NO_EXTENSIONS": ""}
    env.pop("PYTHONPATH", None)
    p = _run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "--dump-before=getppid",
              "--dump-instr=no", str(b.venv / "bin" / "python"), str(HERE / "guard_kernels.py")],
             cwd=str(d), env=env)
    done = json.loads(p.stdout)["kernels"]
    parts = _parts(out)
    ran = [k for k in done if k[2] is None]
    # parts: the start, then per kernel its 0-call loop, its N-call loop and what follows (the
    # last kernel's "what follows" is the final dump, ``out`` itself, not globbed)
    if len(parts) != 3 * len(ran):
        raise RuntimeError(f"{b.rev}: {len(parts)} callgrind parts for {len(ran)} kernels (want {3 * len(ran)})")
    res: dict[str, tuple[float | None, str]] = {}
    i = 0
    for name, n, err in done:
        if err is not None:
            res[name] = (None, err)
            continue
        zero, full = parts[1 + 3 * i], parts[2 + 3 * i]
        res[name] = ((full - zero) / n, "")
        i += 1
    return res


def _free_base() -> int:
    """A port base whose +1, +2, +81 and +91 are free (other runs may share the machine)."""
    for base in range(31000, 60000, 137):
        try:
            for off in (1, 2, 80, 81, 82, 91):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", base + off))
        except OSError:
            continue
        return base
    raise RuntimeError("no free port base")


def dataplane(b: Build, tmp: Path, stream: bool, requests: int, gap_ms: float) -> float:
    """One run of the callgrind harness: one keep-alive connection; ``external`` endpoints, never
    scraped, so no scrape (they come with wall time, not with requests) falls in the window."""
    cmd = [sys.executable, str(HERE / "dataplane" / "callgrind.py"), "--llmgw", str(b.venv / "bin" / "llmgw"),
           "--requests", str(requests), "--connections", "1", "--warmup", "30" if stream else "200",
           "--engine", "external", "--top", "0", "--port-base", str(_free_base())]
    if stream:
        cmd += ["--stream", "--sse-gap-ms", f"{gap_ms:g}"]
    env = {**os.environ, "PYTHONHASHSEED": "0", "LLMGW_NO_EXTENSIONS": "", "TMPDIR": str(tmp)}
    env.pop("PYTHONPATH", None)
    p = _run(cmd, env=env, timeout=600)
    m = re.search(r"([\d,]+) instructions per (request|stream)", p.stdout)
    if not m:
        raise RuntimeError(f"callgrind.py printed no figure:\n{p.stdout[-2000:]}")
    return float(m.group(1).replace(",", ""))


def wall(b: Build, tmp: Path, suites: tuple[str, ...]) -> dict[str, float]:
    present = [s for s in suites if (b.src / "bench" / s).exists()]
    if not present:
        return {}
    out = Path(tempfile.mkdtemp(prefix="wall-", dir=tmp)) / "bench.json"
    env = {**os.environ, "LLMGW_NO_EXTENSIONS": ""}
    env.pop("PYTHONPATH", None)
    cmd = [str(b.venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           "--benchmark-enable", "--benchmark-only", "--benchmark-min-rounds=5", "--benchmark-max-time=0.05",
           "--benchmark-warmup=off", f"--benchmark-json={out}", *[f"bench/{s}" for s in present]]
    p = subprocess.run(cmd, cwd=b.src, env=env, capture_output=True, text=True, timeout=600)
    if not out.exists():
        log(f"{b.rev}: the wall-clock suites failed ({p.returncode}):\n{p.stdout[-2000:]}{p.stderr[-1000:]}")
        return {}
    data = json.loads(out.read_text())
    return {bm["fullname"].removeprefix("bench/"): bm["stats"]["median"] * 1e6 for bm in data["benchmarks"]}


def _fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "—"
    return f"{v:,.0f}" if unit == "instr" else f"{v:,.2f}"


def table(figs: list[Figure], base: Build, head: Build) -> str:
    lines = [
        f"### Benchmark guard: `{base.rev}` ({base.sha[:10]}) → `{head.rev}` ({head.sha[:10]})",
        "",
        "| figure | base | head | change | limit |",
        "|---|---:|---:|---:|---:|",
    ]
    for f in figs:
        c = f.change
        change = "—" if c is None else f"{c * 100:+.2f}%"
        if f.regressed:
            change = f"**{change} ✗**"
        limit = "info" if f.threshold is None else f"+{f.threshold * 100:.0f}%"
        unit = "instr" if f.kind == "instructions" else "µs"
        name = f"{f.name} ({'instr' if unit == 'instr' else 'µs median'})"
        if f.note:
            name += f" — {f.note}"
        lines.append(f"| {name} | {_fmt(f.base, unit)} | {_fmt(f.head, unit)} | {change} | {limit} |")
    bad = [f.name for f in figs if f.regressed]
    lines += ["", f"**{len(bad)} regression(s)**: " + ", ".join(bad) if bad else "No instruction count rose above its limit."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the revision to compare against (a commit, branch, tag)")
    ap.add_argument("--head", default="HEAD")
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--markdown", help="write the table here too (for $GITHUB_STEP_SUMMARY)")
    ap.add_argument("--quick", action="store_true", help="kernels and the request figure only")
    ap.add_argument("--requests", type=int, default=2000, help="requests per run of the request figure")
    ap.add_argument("--request-reps", type=int, default=3, help="request runs per revision (median)")
    ap.add_argument("--streams", type=int, default=60, help="streams per run of the stream figure")
    ap.add_argument("--stream-reps", type=int, default=3, help="stream runs per revision (max)")
    ap.add_argument("--sse-gap-ms", type=float, default=1.0, help="the engine's pause between SSE events")
    ap.add_argument("--no-wall", action="store_true", help="skip the wall-clock suites")
    ap.add_argument("--work", default=os.environ.get("LLMGW_GUARD_WORK",
                                                      str(Path.home() / ".cache" / "llmgw-guard")))
    ap.add_argument("--fresh", action="store_true", help="rebuild even when a build of the tree is kept")
    ap.add_argument("--base-venv", help="use this venv (with llmgw installed) for the base")
    ap.add_argument("--head-venv", help="use this venv (with llmgw installed) for the head")
    args = ap.parse_args()

    t_start = time.monotonic()
    for tool in ("valgrind", "callgrind_control", "git"):
        if shutil.which(tool) is None:
            log(f"{tool} not found (Debian: apt-get install valgrind git)")
            return 2
    work = Path(args.work).expanduser()
    work.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-guard-"))
    try:
        base = build(args.base, work, args.base_venv, args.fresh)
        head = build(args.head, work, args.head_venv, args.fresh)
        figs: list[Figure] = []

        log("kernels under callgrind")
        kb, kh = kernels(base, tmp), kernels(head, tmp)
        for name in dict.fromkeys([*kh, *kb]):
            vb, eb = kb.get(name, (None, "absent"))
            vh, eh = kh.get(name, (None, "absent"))
            note = "; ".join(f"{w}: {e}" for w, e in (("base", eb), ("head", eh)) if e)[:120]
            figs.append(Figure(name, "instructions", "instructions/call", vb, vh,
                               THRESHOLDS.get(name, DEFAULT_THRESHOLD), note=note))

        # (figure, stream?, requests per run, runs per revision, how the runs combine)
        settings = [("proxied request", False, args.requests, args.request_reps, "median")]
        if not args.quick:
            settings.append((f"relayed stream (65 events, gap {args.sse_gap_ms:g} ms)", True, args.streams,
                             args.stream_reps, "max"))
        for name, stream, n, reps, how in settings:
            log(f"{name}: {reps} run(s) per revision under callgrind")
            sb: list[float] = []
            sh: list[float] = []
            for _ in range(reps):  # alternate, so a drift of the machine hits both alike
                sb.append(dataplane(base, tmp, stream, n, args.sse_gap_ms))
                sh.append(dataplane(head, tmp, stream, n, args.sse_gap_ms))
            agg = statistics.median if how == "median" else max
            figs.append(Figure(name, "instructions", f"instructions/{'stream' if stream else 'request'}",
                               agg(sb), agg(sh), THRESHOLDS.get(name.split(" (")[0], DEFAULT_THRESHOLD), sb, sh,
                               note=f"{how} of {reps}" if reps > 1 else ""))

        if not (args.quick or args.no_wall):
            log("wall-clock suites (informational)")
            wb, wh = wall(base, tmp, WALL_SUITES), wall(head, tmp, WALL_SUITES)
            for name in dict.fromkeys([*wh, *wb]):
                figs.append(Figure(name, "wall", "µs/round (median)", wb.get(name), wh.get(name), None))

        text = table(figs, base, head)
        elapsed = time.monotonic() - t_start
        text += f"\n_{elapsed:.0f} s; builds {base.build_s:.0f} s + {head.build_s:.0f} s._\n"
        print(text)
        if args.markdown:
            Path(args.markdown).write_text(text)
        if args.json:
            doc = {
                "schema": 1,
                "when": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "elapsed_s": round(elapsed, 1),
                "quick": args.quick,
                "base": {k: str(v) for k, v in asdict(base).items() if k not in ("venv", "src")},
                "head": {k: str(v) for k, v in asdict(head).items() if k not in ("venv", "src")},
                "figures": [{**asdict(f), "change": f.change, "regressed": f.regressed} for f in figs],
                "ok": not any(f.regressed for f in figs),
            }
            Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        return 1 if any(f.regressed for f in figs) else 0
    except (RuntimeError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        log(f"error: {exc}")
        return 2
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
