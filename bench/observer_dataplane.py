#!/usr/bin/env python3
"""The data path with metrics on vs off: CPU per proxied request, side by side.

Gateways run in front of the same nginx "engine" (``dataplane/run.py``'s),
identical but for the observer: one reports to the admin app's
``PrometheusObserver`` (metrics on), one to ``NullObserver`` (off) and, with
``--hooks``, one to the observer but without reading token usage from answers.
Rounds are interleaved (on, off, on, ...) and each measures the gateway's CPU per
request under ``wrk -t1 -c16`` with ``post.lua`` (and ``stream.lua`` unless
``--no-stream``). The issue's bar: the difference stays under 5%.

    .venv/bin/python bench/observer_dataplane.py --rounds 5 --hooks
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "dataplane"))

import run as dp  # noqa: E402  (bench/dataplane/run.py: processes, wrk, the nginx engine)

LAUNCH = """
import asyncio, sys
import uvloop
from llmgw.config import load_file
from llmgw.runtime import GatewayRuntime
from llmgw.gateway.observe import NullObserver

async def main():
    rt = GatewayRuntime(load_file(sys.argv[1]))
    await rt.start()
    admin = rt.admin_server.app
    mode = sys.argv[2]
    if mode.startswith("off"):
        rt.gateway.set_observer(NullObserver())
    else:  # "hooks": the observer's hooks alone, without reading usage from answers
        rt.gateway.set_observer(admin.observer, count_tokens=False if mode == "hooks" else None)
    await asyncio.Event().wait()

uvloop.run(main())
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--connections", type=int, default=16)
    ap.add_argument("--proxy-core", type=int, default=0)
    ap.add_argument("--load-core", type=int, default=1)
    ap.add_argument("--port-base", type=int, default=29000)
    ap.add_argument("--no-stream", action="store_true")
    ap.add_argument("--hooks", action="store_true",
                    help="also run metrics on without token counting (the observer's hooks alone)")
    ap.add_argument("--modes", help="comma list of on, off, hooks, off2 (a second 'off': the noise floor)")
    args = ap.parse_args()

    base = args.port_base
    up = (base + 1, base + 2)
    modes = args.modes.split(",") if args.modes else ["on", "off"] + (["hooks"] if args.hooks else [])
    gws = {m: (base + 10 + i, base + 20 + i) for i, m in enumerate(modes)}
    d = Path(tempfile.mkdtemp(prefix="llmgw-observer-bench-"))
    (d / "tmp").mkdir()
    dp.start_engine(d, up, core=args.load_core)
    procs = {}
    for name, (port, admin) in gws.items():
        cfg = d / f"{name}.yaml"
        cfg.write_text(
            f"listen: 127.0.0.1:{port}\nadmin: 127.0.0.1:{admin}\nendpoints:\n"
            f'  - {{id: up0, url: "http://127.0.0.1:{up[0]}", model: m, engine: vllm}}\n'
            f'  - {{id: up1, url: "http://127.0.0.1:{up[1]}", model: m, engine: vllm}}\n'
        )
        procs[name] = dp.start(["taskset", "-c", str(args.proxy_core), sys.executable, "-c", LAUNCH, str(cfg), name],
                               d / f"{name}.out")
        dp.wait_port(port, procs[name], f"llmgw ({name})")
    scripts = ["post.lua"] + ([] if args.no_stream else ["stream.lua"])
    for port, _ in gws.values():  # warm-up
        for s in scripts:
            dp.wrk(args.load_core, f"http://127.0.0.1:{port}", s, args.connections, 2)
    res: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        for name in (modes if r % 2 == 0 else modes[::-1]):
            port = gws[name][0]
            for s in scripts:
                c0, t0 = dp.cpu_seconds(procs[name].pid), time.monotonic()
                w = dp.wrk(args.load_core, f"http://127.0.0.1:{port}", s, args.connections, args.duration)
                cpu = dp.cpu_seconds(procs[name].pid) - c0
                if w["errors"]:
                    raise SystemExit(f"{name} {s}: {w['errors']} errors")
                us = cpu / w["requests"] * 1e6
                res.setdefault((name, s), []).append(us)
                print(f"round {r + 1} metrics {name:3s} {s:10s} {us:7.1f} us/request "
                      f"({w['rps']:.0f}/s in {time.monotonic() - t0:.1f}s)", flush=True)
    print()
    for s in scripts:
        off = statistics.median(res[("off", s)])
        for m in modes[::-1]:
            if m != "off":
                v = statistics.median(res[(m, s)])
                print(f"{s:10s} median CPU per request: metrics {m} {v:.1f} us, off {off:.1f} us: "
                      f"{(v - off) / off * 100:+.1f}%")
    dp._stop_all()


if __name__ == "__main__":
    main()
