"""Pieces every ``llmgw`` subcommand shares."""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import click

from ..config import parse_hostport
from ..errors import ConfigError

__all__ = ["DEFAULT_ADMIN", "MAX_REPLICAS", "AdminURL", "Fail", "admin_url", "apply_logging", "echo_err", "grpc_port",
           "hostport", "json_mode_for", "print_table", "printable", "replica_count", "report_error", "run_loop", "tls_mismatch"]

DEFAULT_ADMIN = "http://127.0.0.1:9090"
MAX_REPLICAS = 1024  # (a deployment's replicas: llmgw ctl scale / deploy --replicas, the console's s)


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


def printable(value: Any, *, lines: bool = False) -> str:
    """Text an agent, an engine or the API reported, safe to show on a terminal: as is when printable,
    else each control character (ESC, BEL, a carriage return, a bidi override, ...) written as its Python
    escape (``\\x1b``), so nothing it holds can move the cursor, clear the screen or retitle the window.
    ``lines``: line breaks (``\\n``, ``\\r\\n``) and tabs are kept (a log's tail).

    One helper for ``llmgw ctl`` and ``llmgw console``; neither reads markup in what it returns (rich
    tables get it as ``Text``), so ``[/link]`` in a GPU's name is shown as written.
    """
    text = value if isinstance(value, str) else str(value)
    if text.isprintable():
        return text
    if lines:
        text = text.replace("\r\n", "\n")
    return "".join(c if c.isprintable() or (lines and c in "\n\t") else repr(c)[1:-1] for c in text)


class AdminURL:
    """``--admin``'s value taken apart: how to reach the admin API, and what to call it in messages."""

    __slots__ = ("base", "host", "https", "netloc", "port", "url")

    def __init__(self, https: bool, host: str, port: int, base: str, netloc: str) -> None:
        self.https, self.host, self.port, self.base, self.netloc = https, host, port, base, netloc
        self.url = f"{'https' if https else 'http'}://{netloc}{base}"


def admin_url(value: str) -> AdminURL:
    """``--admin URL`` (``http://host:port``; a bare ``host:port`` means http), for ``llmgw ctl`` and the console.

    Raises:
        ValueError: one line naming ``--admin`` and the fix (an empty value, another scheme, a broken IPv6
            address, a bad port, the admin API's own path /admin/v1 at its end).
    """
    like = f"is not a URL like {DEFAULT_ADMIN}"
    # SECURITY: a user:password@ in it is no business of the admin API (its token is a header): never quoted
    value = value.strip()  # (a pasted address's stray blank or line break: as urlsplit drops a leading one)
    shown = re.sub(r"^([^/]*//)?[^/@]*@", lambda m: f"{m.group(1) or ''}…@", value)
    if any(c.isspace() or not c.isprintable() for c in value):
        # (no host has a space or a control character: the console took "not a url" for a host, and said
        # "disconnected, retrying (unknown host not a url)" for as long as it ran)
        raise ValueError(f"--admin {shown!r} {like}")  # (repr: a control character shown escaped)
    try:
        parts = urlsplit(value if "://" in value else f"http://{value}")
    except ValueError:  # ("Invalid IPv6 URL": an unclosed [)
        raise ValueError(f"--admin {shown!r} {like} (an IPv6 address goes in brackets: http://[::1]:9090)") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--admin {shown!r} {like}")
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port == 0:
        raise ValueError(f"--admin {shown!r} has an invalid port (a number from 1 to 65535)")
    netloc = parts.netloc.rsplit("@", 1)[-1]
    base = parts.path.rstrip("/")
    if base.endswith("/admin/v1") or "/admin/v1/" in base:
        # (every call adds /admin/v1/...: under this one, nothing answers but "no admin route")
        root = f"{parts.scheme}://{netloc}{base[: base.index('/admin/v1')]}"
        raise ValueError(f"--admin {shown!r} holds the admin API's path /admin/v1, which llmgw adds itself: drop it "
                         f"(--admin {root})")
    https = parts.scheme == "https"
    return AdminURL(https, parts.hostname, port or (443 if https else 80), base, netloc)


_NOT_TLS = frozenset({"WRONG_VERSION_NUMBER", "HTTP_REQUEST", "PACKET_LENGTH_TOO_LONG", "RECORD_LAYER_FAILURE",
                      "UNKNOWN_PROTOCOL"})


def tls_mismatch(exc: BaseException, url: AdminURL) -> str | None:
    """The one-line error for an ``https://`` call answered by something that does not speak TLS (llmgw's admin
    listener speaks plain HTTP); ``None`` for any other failure (a certificate that does not verify says so)."""
    import ssl

    if not url.https or not isinstance(exc, ssl.SSLError) or isinstance(exc, ssl.SSLCertVerificationError):
        return None
    if getattr(exc, "reason", None) not in _NOT_TLS:
        return None
    return (f"the admin API at {url.url} speaks plain HTTP, not TLS: pass --admin http://{url.netloc}{url.base} "
            "(llmgw's admin listener has no TLS of its own; https:// is for a TLS proxy in front of it)")


def replica_count(text: str) -> int:
    """A replica count as typed: ASCII digits, 0 to :data:`MAX_REPLICAS` (``int()`` would take ``٣`` or ``1_0``).

    Raises:
        ValueError: one line saying what a replica count is.
    """
    s = text.strip()
    if not (s.isascii() and s.isdigit()) or int(s) > MAX_REPLICAS:
        raise ValueError(f"{text!r} is not a replica count: a whole number from 0 to {MAX_REPLICAS}")
    return int(s)


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


_TRAILING_SPACES = re.compile(r"[ \t]+((?:\x1b\[[0-9;]*m)*)$")  # (spaces before the line's last style codes too)


def grpc_port(url: str) -> str:
    """What ``llmgw ctl`` and ``llmgw console`` say when the address they were given answers in HTTP/2 frames."""
    return (f"{url} is a gRPC port, such as control.listen, not the admin listener: pass the admin address "
            "(admin: in the config) with --admin URL")


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
        whole = need
        for col in table.columns:
            ms = [Measurement.get(console, opts, c) for c in (col.header, *col.cells)]
            need += max(m.maximum for m in ms) if col.no_wrap else max(m.minimum for m in ms)
            whole += max(m.maximum for m in ms)
        if need > console.width:
            # The table is wider than the terminal whatever is wrapped: the terminal wraps each line. Wrapped
            # in the table too, a reason came a word a line, each line the table's width of padding, which the
            # terminal wrapped again: a screenful of one word and blank lines. Each row on one line instead,
            # as piped, which the terminal wraps once.
            need = whole
    width = console.width
    console.width = max(width, need)  # (print's own width= is capped at the console's)
    try:
        # (rich pads every cell to its column's width, the last one too: a piped line ended in up to a
        # column's width of spaces, which a script's `cut`/`awk '$NF'`/diff then carried, and a line wider than
        # the terminal in blank lines where the terminal wrapped that padding)
        with console.capture() as captured:
            console.print(table, crop=False)
        console.file.write("".join(_TRAILING_SPACES.sub(r"\1", line) + "\n" for line in captured.get().splitlines()))
        console.file.flush()
    finally:
        console.width = width


def run_loop(coro: Any) -> Any:
    """Run ``coro`` on uvloop (asyncio's loop where uvloop is not available)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on POSIX
        return asyncio.run(coro)
    return uvloop.run(coro)
