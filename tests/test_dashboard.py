"""``bench/dashboard.py``'s page in a real headless Chromium: it loads from disk, with no
console error, and draws one plot per figure.

Chromium is Debian's ``chromium`` package (``.ci/run`` installs it); the test is skipped
only when no Chromium is on PATH. The console is read from Chromium's own log
(``--enable-logging=stderr --v=0`` prints every console message as ``CONSOLE(...)``);
a page with a deliberate error first proves that the log shows one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "bench" / "dashboard.py"
CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)

pytestmark = [
    pytest.mark.skipif(not DASHBOARD.exists(), reason="not in a source tree (bench/ absent)"),
    pytest.mark.needs_tool("chromium", "chromium-browser", "google-chrome", install="apt-get install chromium"),
]

FIGURES = ["promscan.scan vllm page", "score Picker.pick 64", "proxied request", "bench_score.py::test_pick_64"]


def _sha(i: int) -> str:
    return f"{i:02d}" + "ab" * 19


def _history(d: Path, commits: int = 6) -> Path:
    """``commits`` guard results, as the workflow keeps them; commit 4 regresses the request."""
    d.mkdir()
    for i in range(commits):
        figs = []
        for k, name in enumerate(FIGURES):
            kind = "wall" if "::" in name else "instructions"
            base = 1000.0 * (k + 1) + i
            head = base * (1.05 if (i == 4 and name == "proxied request") else 1.001)
            figs.append({"name": name, "kind": kind, "unit": "instr", "base": base, "head": head,
                         "threshold": None if kind == "wall" else 0.02, "change": head / base - 1,
                         "regressed": kind != "wall" and head / base - 1 > 0.02})
        doc = {"schema": 1, "when": f"2026-01-0{i + 1}T00:00:00+00:00", "figures": figs,
               "base": {"sha": _sha(i)}, "head": {"sha": _sha(i + 1), "subject": f"commit {i + 1}",
                                                      "date": f"2026-01-0{i + 1}T00:00:00+00:00"}}
        (d / f"{_sha(i + 1)}.json").write_text(json.dumps(doc))
    return d


def _chromium(url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    profile = Path(os.environ.get("TMPDIR", "/tmp")) / f"llmgw-chromium-{os.getpid()}"
    try:
        return subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
             "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0",
             "--virtual-time-budget=3000", *extra, url],
            capture_output=True, text=True, timeout=90,
        )
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def _console(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "CONSOLE" in line]


def test_the_console_check_sees_an_error(tmp_path: Path) -> None:
    page = tmp_path / "bad.html"
    page.write_text("<!doctype html><html><body><script>no_such_function();</script></body></html>")
    assert any("no_such_function" in line for line in _console(_chromium(page.as_uri(), "--dump-dom").stderr))


def test_dashboard_loads_with_one_plot_per_figure(tmp_path: Path) -> None:
    history = _history(tmp_path / "history")
    out = tmp_path / "site"
    subprocess.run([sys.executable, str(DASHBOARD), str(history), "--out", str(out)], check=True, timeout=60)
    page = out / "index.html"
    text = page.read_text()
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", text), "the page must not fetch anything"

    p = _chromium(page.as_uri(), "--dump-dom")
    assert p.returncode == 0, p.stderr[-2000:]
    assert _console(p.stderr) == []
    dom = p.stdout
    # the inline script ran (it stamps the count of plots it found) and drew one per figure
    assert f'data-plots="{len(FIGURES)}"' in dom
    assert len(re.findall(r'<svg class="plot"', dom)) == len(FIGURES)
    assert set(re.findall(r'data-figure="([^"]+)"', dom)) == set(FIGURES)
    # one point per commit per figure, the commit on hover, the regression marked
    assert len(re.findall(r'<circle class="pt', dom)) == 6 * len(FIGURES)
    assert _sha(5)[:10] in dom and "commit 5" in dom  # commit 5's sha and subject in its points' tips
    assert len(re.findall(r'<circle class="pt reg"', dom)) == 1
    assert "regressions: " in dom

    shot = tmp_path / "shot.png"
    p = _chromium(page.as_uri(), f"--screenshot={shot}", "--window-size=1280,900", "--hide-scrollbars")
    assert shot.exists() and shot.stat().st_size > 10_000, p.stderr[-2000:]
    if os.environ.get("LLMGW_DASHBOARD_SHOT"):  # docs/bench-dashboard.png is made so
        shutil.copy(shot, os.environ["LLMGW_DASHBOARD_SHOT"])
