"""Pieces every ``llmgw`` subcommand shares."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from typing import Any

import click

from ..config import parse_hostport
from ..errors import ConfigError

__all__ = ["Fail", "apply_logging", "echo_err", "hostport", "json_mode_for", "print_table", "report_error",
           "run_loop"]


class Fail(click.ClickException):
    """A one-line error: ``llmgw: error: ...``, exit code 1; one such line per line of the message
    (a config error lists every problem)."""

    def show(self, file: Any = None) -> None:
        for line in self.message.splitlines() or [""]:
            echo_err(f"llmgw: error: {line}", level="error")


def apply_logging(settings: dict[str, Any]) -> None:
    """Set logging up from ``{"log_level", "log_format", "log_config"}``; a bad ``--log-config`` is a :class:`Fail`."""
    from ..log import LogConfigError, setup

    try:
        setup(settings["log_level"], settings["log_format"].lower(), settings.get("log_config"))
    except LogConfigError as exc:
        raise Fail(str(exc)) from None


def echo_err(text: str, level: str = "info") -> None:
    """A line for the operator on stderr: as is, or a JSON record of ``llmgw.cli`` under ``--log-format json``.

    ``text`` may start with ``llmgw: `` / ``llmgw: error: ``; the JSON record drops that prefix.
    """
    from ..log import cli_logger, current_format

    if current_format() != "json":
        click.echo(text, err=True)
        return
    for prefix in ("llmgw: error: ", "llmgw: warning: ", "llmgw: note: ", "llmgw: "):
        if text.startswith(prefix):
            text = text[len(prefix):]
            break
    cli_logger.log(logging.getLevelName(level.upper()), text)


def json_mode_for(args: Sequence[str]) -> bool:
    """Whether ``--log-format json`` is in force for ``args`` (before logging is set up: parse errors)."""
    from ..log import current_format

    fmt: str | None = None
    it = iter(args)
    for a in it:
        if a == "--":
            break
        if a == "--log-format":
            fmt = next(it, fmt)
        elif a.startswith("--log-format="):
            fmt = a.split("=", 1)[1]
    if fmt is None:
        fmt = os.environ.get("LLMGW_LOG_FORMAT") or current_format()
    return fmt.lower() == "json"


def report_error(exc: click.ClickException, args: Sequence[str]) -> int:
    """Show a click error as llmgw's one-line errors (JSON records under ``--log-format json``); the exit status.

    Usage errors (a bad flag, a missing argument) become ``llmgw: error: ... (see 'llmgw CMD --help')``
    with exit status 1, like every other error; the errors llmgw raises show themselves.
    """
    from ..log import setup

    if json_mode_for(args):
        from ..log import current_format

        if current_format() != "json":
            setup(os.environ.get("LLMGW_LOG_LEVEL") or "info", "json")
    if isinstance(exc, click.UsageError) and type(exc).show is click.UsageError.show:
        where = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else " (see 'llmgw --help')"
        for line in exc.format_message().splitlines() or [""]:
            echo_err(f"llmgw: error: {line}{where}", level="error")
        return 1
    if type(exc).show is click.ClickException.show:
        for line in exc.format_message().splitlines() or [""]:
            echo_err(f"llmgw: error: {line}", level="error")
        return exc.exit_code or 1
    exc.show()
    return exc.exit_code


def hostport(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[str, int] | None:
    """click callback: ``HOST:PORT`` as ``(host, port)``, a usage error otherwise."""
    if value is None:
        return None
    try:
        return parse_hostport(value, f"--{param.name}")
    except ConfigError as exc:
        raise click.BadParameter(exc.message) from None


def hostports(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[tuple[str, int], ...] | None:
    """click callback: ``HOST:PORT[,HOST:PORT…]`` as a tuple of ``(host, port)``, a usage error otherwise."""
    if value is None:
        return None
    out = []
    for item in value.split(","):
        try:
            out.append(parse_hostport(item.strip(), f"--{param.name}"))
        except ConfigError as exc:
            raise click.BadParameter(exc.message) from None
    return tuple(out)


def print_table(console: Any, table: Any) -> None:
    """Print a rich table without ever cutting a cell: a column that may not wrap (names, numbers) is
    shown whole, the line longer than the terminal if need be (the terminal wraps it, nothing is lost);
    off a terminal (piped, captured) each row is one whole line, however long. rich's own fitting
    would end a long node name or a number with an ellipsis: "8…" for 80 GiB reads as a wrong value."""
    from rich.measure import Measurement

    opts = console.options.update_width(1 << 16)
    if not console.is_terminal:
        need = Measurement.get(console, opts, table).maximum
    else:  # the columns that may not wrap whole, the others at their longest word
        need = 2 * max(0, len(table.columns) - 1)  # (padding between columns: box=None, pad_edge=False)
        for col in table.columns:
            ms = [Measurement.get(console, opts, c) for c in (col.header, *col.cells)]
            need += max(m.maximum for m in ms) if col.no_wrap else max(m.minimum for m in ms)
    width = console.width
    console.width = max(width, need)  # (print's own width= is capped at the console's)
    try:
        console.print(table, crop=False)
    finally:
        console.width = width


def run_loop(coro: Any) -> Any:
    """Run ``coro`` on uvloop (asyncio's loop where uvloop is not available)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on POSIX
        return asyncio.run(coro)
    return uvloop.run(coro)
