#!/usr/bin/env python3
"""Summarise a ``py-spy record --format raw`` profile: top functions by self and total time.

    python pyspy_top.py llmgw_nonstream.raw [--top 40] [--strip-lines]

Self = samples whose innermost frame is the function; total = samples with the
function anywhere on the stack (counted once per sample). With ``--native``
profiles, C frames (uvloop, httptools, CPython) show as their symbol names.
"""

from __future__ import annotations

import argparse
import collections
import re


def norm(frame: str, strip_lines: bool) -> str:
    frame = frame.strip()
    if strip_lines:
        frame = re.sub(r":\d+\)$", ")", frame)
    frame = re.sub(r"\(/.*?/(site-packages|src)/", "(", frame)
    return frame


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("raw")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--strip-lines", action="store_true", help="merge a function's lines")
    ap.add_argument("--idle", action="append", default=["epoll_wait", "epoll_pwait", "uv__io_poll"],
                    help="innermost frames counted as idle (excluded from percentages)")
    args = ap.parse_args()
    selfc: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    n = idle = 0
    with open(args.raw) as fh:
        lines = fh.read().splitlines()
    for line in lines:
        line = line.rstrip("\n")
        if not line:
            continue
        stack, _, cnt = line.rpartition(" ")
        c = int(cnt)
        frames = [norm(f, args.strip_lines) for f in stack.split(";") if f]
        if frames and any(i in frames[-1] for i in args.idle):
            idle += c
            continue
        n += c
        if frames:
            selfc[frames[-1]] += c
        for f in set(frames):
            total[f] += c
    print(f"{n} busy samples ({idle} idle in epoll excluded)")
    print(f"\n{'self%':>6s}  function (innermost frame)")
    for f, c in selfc.most_common(args.top):
        print(f"{100 * c / n:6.1f}  {f}")
    print(f"\n{'total%':>6s}  function (anywhere on the stack)")
    for f, c in total.most_common(args.top):
        print(f"{100 * c / n:6.1f}  {f}")


if __name__ == "__main__":
    main()
