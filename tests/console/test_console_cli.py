"""``llmgw console``'s options: errors are llmgw's one-line errors, before any screen is drawn."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from llmgw.cli.console import console

pytestmark = pytest.mark.timeout(60)


def test_a_bad_admin_url_is_one_line_error() -> None:
    full = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    res = subprocess.run([sys.executable, "-m", "llmgw", "console", "--admin", "ftp://gw:9090"], capture_output=True,
                         text=True, timeout=60, env=full, stdin=subprocess.DEVNULL)
    assert res.returncode == 1 and res.stdout == ""
    assert res.stderr.strip() == "llmgw: error: --admin 'ftp://gw:9090' is not a URL like http://127.0.0.1:9090"


def test_without_a_terminal_it_says_so_and_draws_nothing() -> None:
    full = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    res = subprocess.run([sys.executable, "-m", "llmgw", "console", "--admin", "http://127.0.0.1:9"],
                         capture_output=True, text=True, timeout=60, env=full, stdin=subprocess.DEVNULL)
    assert res.returncode == 1 and res.stdout == "", res
    assert res.stderr.strip() == (
        "llmgw: error: llmgw console needs a terminal on stdin and stdout; "
        "from a script, use llmgw ctl (endpoints, nodes, gpus, deployments, ... --json)"
    )


def test_options_and_the_environment_fallback() -> None:
    runner = CliRunner()
    res = runner.invoke(console, [], env={"LLMGW_ADMIN": "http://gw:notaport"})  # as for llmgw ctl
    assert res.exit_code == 1 and "has an invalid port" in res.output
    res = runner.invoke(console, ["--refresh", "soon"])
    assert res.exit_code == 2 and "expected a duration like 2s" in res.output
    res = runner.invoke(console, ["--refresh", "0s"])
    assert res.exit_code == 2 and "between 0.1s and 1h" in res.output
    res = runner.invoke(console, ["--help"])
    assert res.exit_code == 0 and "--read-only" in res.output and "LLMGW_ADMIN_TOKEN" in res.output


def test_a_filter_that_is_no_regular_expression_is_plain_text_in_any_case() -> None:
    from llmgw.console.views import compile_filter

    pred = compile_filter("GPU[(")  # (not a regular expression: the text itself, case-insensitively)
    assert pred is not None and pred("node-a GPU[(0)") and pred("gpu[(1)") and not pred("gpu 2")
    inv = compile_filter("!GPU[(")
    assert inv is not None and not inv("gpu[(1)") and inv("gpu 2")
    assert compile_filter("  ") is None and compile_filter("!") is None
