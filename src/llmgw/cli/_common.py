"""Pieces every ``llmgw`` subcommand shares."""

from __future__ import annotations

import asyncio
from typing import Any

import click

from ..config import parse_hostport
from ..errors import ConfigError

__all__ = ["Fail", "hostport", "run_loop"]


class Fail(click.ClickException):
    """A one-line error: ``llmgw: error: ...``, exit code 1; one such line per line of the message
    (a config error lists every problem)."""

    def show(self, file: Any = None) -> None:
        for line in self.message.splitlines() or [""]:
            click.echo(f"llmgw: error: {line}", err=True)


def hostport(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[str, int] | None:
    """click callback: ``HOST:PORT`` as ``(host, port)``, a usage error otherwise."""
    if value is None:
        return None
    try:
        return parse_hostport(value, f"--{param.name}")
    except ConfigError as exc:
        raise click.BadParameter(exc.message) from None


def run_loop(coro: Any) -> Any:
    """Run ``coro`` on uvloop (asyncio's loop where uvloop is not available)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on POSIX
        return asyncio.run(coro)
    return uvloop.run(coro)
