"""The figures table of README.md, from each target's ``out/<target>/summary.json``.

    .venv/bin/python bench/fuzz/figures.py [OUT]

A target whose run is not finished (no summary yet) is read from its worker's counts
and marked "(unfinished)".
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TARGETS = ["request", "response", "jsonscan", "promscan", "gguf", "ollama", "proto", "h11"]


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "out"
    print("| target | inputs | exec/s | crashes | hangs | disagreements | explained differences | date, commit |")
    print("|---|---:|---:|---:|---:|---:|---|---|")
    for t in TARGETS:
        s = out / t / "summary.json"
        if s.exists():
            d = json.loads(s.read_text())
            note, hangs, when = "", d["hangs"], f"{d['date']}, {d['commit']}"
            explained = d.get("explained_differences", {})
        else:
            workers = sorted((out / t).glob("worker-*.json")) if (out / t).is_dir() else []
            if not workers:
                print(f"| {t} | not run | | | | | | |")
                continue
            d = {"inputs": 0, "seconds": 0.0, "crashes": 0, "disagreements": 0}
            explained = {}
            for w in workers:
                got = json.loads(w.read_text())
                for k in ("inputs", "seconds", "crashes", "disagreements"):
                    d[k] += got[k]
                for k, n in got.get("explained", {}).items():
                    explained[k] = explained.get(k, 0) + n
            d["exec_per_s"] = round(d["inputs"] / d["seconds"], 1) if d["seconds"] else 0
            note, hangs, when = " (unfinished)", 0, "see the run's log"
        ex = ", ".join(f"{k} {n:,}" for k, n in sorted(explained.items(), key=lambda kv: -kv[1])) or "none"
        print(f"| {t} | {d['inputs']:,}{note} | {d['exec_per_s']:,.0f} | {d['crashes']} | {hangs} | "
              f"{d['disagreements']} | {ex} | {when} |")


if __name__ == "__main__":
    main()
