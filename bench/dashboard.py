#!/usr/bin/env python3
"""A static page of the guard's history: one plot per figure over commits.

    python bench/dashboard.py HISTORY --out DIR

``HISTORY`` is a directory of ``bench/guard.py --json`` files (one per commit, as the
``bench`` workflow keeps them on the ``bench-history`` branch: ``history/<sha>.json``) or
one such file. Each file's *head* figures are a point at that commit; commits are
ordered by commit time. ``DIR/index.html`` holds everything inline (SVG drawn here,
a few lines of JS for the hover box, CSS): it opens from disk, with no server and no
network. The gating figures (instruction counts) come first, the wall-clock medians
after them. A point whose figure rose above its limit against that commit's base is
drawn red and larger, and listed under the plot; hovering a point shows the commit,
its subject, the value and the change.
"""

from __future__ import annotations

import argparse
import html
import json
import sys
from pathlib import Path
from typing import Any

W, H = 560, 180
PAD_L, PAD_R, PAD_T, PAD_B = 70, 28, 12, 28


def load(history: Path) -> list[dict[str, Any]]:
    files = sorted(history.glob("*.json")) if history.is_dir() else [history]
    runs = []
    for f in files:
        doc = json.loads(f.read_text())
        docs = doc if isinstance(doc, list) else [doc]
        runs.extend(d for d in docs if isinstance(d, dict) and "head" in d and "figures" in d)
    # one point per commit: the latest run of a commit wins
    by_sha: dict[str, dict[str, Any]] = {}
    for r in sorted(runs, key=lambda r: r.get("when", "")):
        by_sha[r["head"]["sha"]] = r
    return sorted(by_sha.values(), key=lambda r: (r["head"].get("date", ""), r.get("when", "")))


def series(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for i, r in enumerate(runs):
        for f in r["figures"]:
            if f.get("head") is None:
                continue
            s = out.setdefault(f["name"], {"kind": f.get("kind", "instructions"), "unit": f.get("unit", ""),
                                           "points": []})
            s["points"].append({
                "i": i, "v": float(f["head"]), "change": f.get("change"), "regressed": bool(f.get("regressed")),
                "threshold": f.get("threshold"),
            })
    return dict(sorted(out.items(), key=lambda kv: (kv[1]["kind"] != "instructions", list(out).index(kv[0]))))


def _fmt(v: float, kind: str) -> str:
    return f"{v:,.0f}" if kind == "instructions" else f"{v:,.2f}"


def plot(name: str, s: dict[str, Any], runs: list[dict[str, Any]]) -> str:
    pts = s["points"]
    n = max(len(runs) - 1, 1)
    vals = [p["v"] for p in pts]
    lo, hi = min(vals), max(vals)
    if hi - lo < 1e-9 * max(abs(hi), 1.0):
        lo, hi = lo * 0.99 - 1e-9, hi * 1.01 + 1e-9
    span = hi - lo
    lo, hi = lo - 0.08 * span, hi + 0.08 * span

    def x(i: int) -> float:
        return PAD_L + (W - PAD_L - PAD_R) * (i / n if len(runs) > 1 else 0.5)

    def y(v: float) -> float:
        return PAD_T + (H - PAD_T - PAD_B) * (1 - (v - lo) / (hi - lo))

    parts = [f'<svg class="plot" data-figure="{html.escape(name)}" viewBox="0 0 {W} {H}" width="{W}" height="{H}" '
             f'role="img" aria-label="{html.escape(name)}">']
    for k in range(5):  # grid and y labels
        v = lo + (hi - lo) * k / 4
        yy = y(v)
        parts.append(f'<line class="grid" x1="{PAD_L}" x2="{W - PAD_R}" y1="{yy:.1f}" y2="{yy:.1f}"/>'
                     f'<text class="ylab" x="{PAD_L - 6}" y="{yy + 4:.1f}">{_fmt(v, s["kind"])}</text>')
    step = max(1, len(runs) // 8)
    for i in range(0, len(runs), step):
        parts.append(f'<text class="xlab" x="{x(i):.1f}" y="{H - 8}">{runs[i]["head"]["sha"][:7]}</text>')
    path = " ".join(f"{'M' if j == 0 else 'L'}{x(p['i']):.1f},{y(p['v']):.1f}" for j, p in enumerate(pts))
    parts.append(f'<path class="line" d="{path}"/>')
    for p in pts:
        head = runs[p["i"]]["head"]
        change = "" if p["change"] is None else f"{p['change'] * 100:+.2f}% vs {runs[p['i']]['base']['sha'][:7]}"
        tip = (f"{head['sha'][:10]} {head.get('date', '')[:10]}\n{head.get('subject', '')[:80]}\n"
               f"{_fmt(p['v'], s['kind'])} {s['unit']}" + (f"\n{change}" if change else "")
               + ("\nREGRESSION" if p["regressed"] else ""))
        cls = "pt reg" if p["regressed"] else "pt"
        r = 6 if p["regressed"] else 3.5
        parts.append(f'<circle class="{cls}" cx="{x(p["i"]):.1f}" cy="{y(p["v"]):.1f}" r="{r}" '
                     f'data-tip="{html.escape(tip)}"><title>{html.escape(tip)}</title></circle>')
    parts.append("</svg>")
    regs = [p for p in pts if p["regressed"]]
    note = ""
    if regs:
        items = ", ".join(f"{runs[p['i']]['head']['sha'][:7]} ({p['change'] * 100:+.1f}%)" for p in regs)
        note = f'<p class="regs">regressions: {html.escape(items)}</p>'
    kind = "gating" if s["kind"] == "instructions" else "wall clock, information only"
    return (f'<section class="fig"><h2>{html.escape(name)}</h2><p class="unit">{html.escape(s["unit"])} · {kind}'
            f"</p>{''.join(parts)}{note}</section>")


CSS = """
body{font:14px system-ui,sans-serif;margin:24px;color:#222;background:#fafafa}
h1{font-size:20px;margin:0 0 4px}h2{font-size:14px;margin:0}
.meta{color:#666;margin:0 0 16px}.grid-wrap{display:flex;flex-wrap:wrap;gap:16px}
.fig{background:#fff;border:1px solid #ddd;border-radius:6px;padding:10px}
.unit{color:#777;font-size:12px;margin:2px 0 4px}.regs{color:#b00020;font-size:12px;margin:4px 0 0}
svg .grid{stroke:#eee}svg .ylab{font-size:10px;fill:#777;text-anchor:end}
svg .xlab{font-size:10px;fill:#777;text-anchor:middle;font-family:monospace}
svg .line{fill:none;stroke:#3366cc;stroke-width:1.5}svg .pt{fill:#3366cc;cursor:pointer}
svg .pt.reg{fill:#d62728;stroke:#fff;stroke-width:1.5}
#tip{position:fixed;display:none;pointer-events:none;background:#222;color:#fff;font:12px monospace;
padding:6px 8px;border-radius:4px;white-space:pre;z-index:10}
"""

JS = """
(function () {
  var tip = document.getElementById("tip");
  var pts = document.querySelectorAll("circle.pt");
  for (var k = 0; k < pts.length; k++) {
    pts[k].addEventListener("mouseenter", function (e) {
      tip.textContent = e.target.getAttribute("data-tip");
      tip.style.display = "block";
    });
    pts[k].addEventListener("mousemove", function (e) {
      tip.style.left = (e.clientX + 12) + "px";
      tip.style.top = (e.clientY + 12) + "px";
    });
    pts[k].addEventListener("mouseleave", function () { tip.style.display = "none"; });
  }
  document.body.setAttribute("data-plots", String(document.querySelectorAll("svg.plot").length));
})();
"""


def render(runs: list[dict[str, Any]]) -> str:
    ss = series(runs)
    first, last = (runs[0]["head"], runs[-1]["head"]) if runs else ({}, {})
    meta = (f"{len(runs)} commits, {html.escape(first.get('sha', '')[:7])} → {html.escape(last.get('sha', '')[:7])}; "
            f"{len(ss)} figures; red: rose above its limit against the commit's base")
    body = "".join(plot(name, s, runs) for name, s in ss.items())
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>llmgw benchmarks</title>'
            f'<style>{CSS}</style></head><body data-figures="{len(ss)}"><h1>llmgw benchmark history</h1>'
            f'<p class="meta">{meta}</p><div class="grid-wrap">{body}</div><div id="tip"></div>'
            f"<script>{JS}</script></body></html>\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("history", type=Path, help="a directory of guard JSON files, or one file")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    runs = load(args.history)
    if not runs:
        print(f"dashboard: no guard results in {args.history}", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "index.html").write_text(render(runs))
    print(f"dashboard: {len(runs)} commits -> {args.out / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
