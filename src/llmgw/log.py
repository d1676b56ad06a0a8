"""llmgw's named loggers and the one place logging is set up.

Importing this module configures nothing; the CLI calls :func:`setup` (again, when
an option given after the subcommand changes something).

Two formats (``--log-format`` / ``$LLMGW_LOG_FORMAT``):

``text`` (default)
    ``time level logger: message`` lines on stderr.
``json``
    one JSON object a line on stderr: ``ts`` (Unix seconds, as in the access log),
    ``level``, ``logger``, ``message``, ``request_id`` when the record is about one
    request, ``exc`` with the traceback when there is one. Python warnings, asyncio's
    (and uvloop's) logger, uncaught exceptions and the CLI's error lines all come out
    this way, so nothing else reaches stderr.

The access log (``llmgw.access``) is JSON lines on stdout in both formats and does not
propagate, so it can be collected separately. Under ``json`` each line also carries
``"level": "info"`` and ``"logger": "llmgw.access"``; its request id is ``id``.

``--log-config FILE`` (YAML or JSON) is handed to :func:`logging.config.dictConfig`
after the above (``disable_existing_loggers`` defaults to false there), so it may
replace or add handlers and formatters;
:class:`JsonFormatter` can be named there as ``llmgw.log.JsonFormatter``.
"""

from __future__ import annotations

import json
import logging
import logging.config
import sys
import threading
from pathlib import Path
from types import TracebackType
from typing import Any

from .errors import LlmgwError

__all__ = [
    "FORMATS",
    "LEVELS",
    "QUIET",
    "JsonFormatter",
    "LogConfigError",
    "accel_logger",
    "access_logger",
    "admin_logger",
    "agent_logger",
    "cli_logger",
    "config_logger",
    "control_logger",
    "current_format",
    "engine_logger",
    "load_log_config",
    "mirror_logger",
    "quiet_protocol_loggers",
    "scrape_logger",
    "server_logger",
    "setup",
    "upstream_logger",
]

server_logger = logging.getLogger("llmgw.server")
upstream_logger = logging.getLogger("llmgw.upstream")
access_logger = logging.getLogger("llmgw.access")
scrape_logger = logging.getLogger("llmgw.scrape")
config_logger = logging.getLogger("llmgw.config")
admin_logger = logging.getLogger("llmgw.admin")
engine_logger = logging.getLogger("llmgw.engine")
mirror_logger = logging.getLogger("llmgw.mirror")
accel_logger = logging.getLogger("llmgw.accel")
control_logger = logging.getLogger("llmgw.control")
agent_logger = logging.getLogger("llmgw.agent")
cli_logger = logging.getLogger("llmgw.cli")

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_format = "text"
_captured = False  # whether setup() turned logging.captureWarnings on


class LogConfigError(LlmgwError, ValueError):
    """``--log-config`` names a file that cannot be read or that dictConfig refuses."""


def current_format() -> str:
    """``"text"`` or ``"json"``: what the last :func:`setup` chose."""
    return _format


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line: ts, level, logger, message[, request_id, exc, stack]."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        rid = getattr(record, "request_id", None)
        if rid:
            doc["request_id"] = rid.decode("latin-1") if isinstance(rid, bytes) else str(rid)
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            doc["exc"] = record.exc_text
        if record.stack_info:
            doc["stack"] = self.formatStack(record.stack_info)
        return json.dumps(doc, ensure_ascii=False, default=str)


class _AccessJsonFormatter(logging.Formatter):
    """The access line is already a JSON object: add ``level`` and ``logger`` to it, nothing else."""

    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        if msg.startswith("{") and msg.endswith("}"):
            extra = f'"level":"{record.levelname.lower()}","logger":"{record.name}"'
            return msg[:-1] + ("," if len(msg) > 2 else "") + extra + "}"
        return JsonFormatter().format(record)


class _StdHandler(logging.StreamHandler):  # type: ignore[type-arg,unused-ignore]
    """A stream handler that writes to whatever ``sys.stderr`` / ``sys.stdout`` is at the time."""

    _llmgw = True

    def __init__(self, which: str) -> None:
        super().__init__()
        self._std = which

    @property  # type: ignore[override,unused-ignore]
    def stream(self) -> Any:
        return getattr(sys, self._std)

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def _excepthook(etype: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    if issubclass(etype, KeyboardInterrupt):
        sys.__excepthook__(etype, value, tb)
        return
    logging.getLogger("llmgw").critical("uncaught exception: %s", value or etype.__name__, exc_info=(etype, value, tb))


def _thread_excepthook(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    logging.getLogger("llmgw").critical(
        "uncaught exception in thread %s: %s",
        args.thread.name if args.thread is not None else "?",
        args.exc_value,
        exc_info=(args.exc_type, args.exc_value, args.exc_traceback),  # type: ignore[arg-type]
    )


def load_log_config(path: str | Path) -> None:
    """Apply a ``logging.config.dictConfig`` document from a YAML or JSON file.

    Raises:
        LogConfigError: the file is missing, not YAML/JSON, not a mapping, or refused
            by dictConfig (the message says which and what to do).
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise LogConfigError(
            f"--log-config {p}: {exc.strerror or exc}; pass a readable YAML or JSON dictConfig file"
        ) from None
    try:
        if p.suffix.lower() == ".json":
            doc = json.loads(text)
        else:
            import yaml

            doc = yaml.safe_load(text)
    except (ValueError, Exception) as exc:  # yaml.YAMLError is an Exception
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise LogConfigError(f"--log-config {p}: not valid YAML/JSON ({first}); fix the file") from None
    if not isinstance(doc, dict) or "version" not in doc:
        raise LogConfigError(
            f"--log-config {p}: expected a logging.config.dictConfig mapping with 'version: 1'"
        )
    # dictConfig's default would silence every logger the file does not name (llmgw's among them).
    doc.setdefault("disable_existing_loggers", False)
    try:
        logging.config.dictConfig(doc)
    except (ValueError, TypeError, AttributeError, ImportError) as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise LogConfigError(
            f"--log-config {p}: logging.config.dictConfig refused it ({reason}); fix the file"
        ) from None


QUIET = ("hpack", "h2")
"""Loggers never below WARNING. SECURITY: hpack logs every header it encodes or decodes at DEBUG (an
agent's join token in its authorization header among them), h2 every frame."""


def quiet_protocol_loggers() -> None:
    """Hold :data:`QUIET` and every logger under them at WARNING or above, whatever a ``--log-config`` or
    ``--log-level debug`` asked (a level set on ``hpack.hpack`` itself would pass the parent's)."""
    for name in QUIET:
        top = logging.getLogger(name)
        if top.level < logging.WARNING:
            top.setLevel(logging.WARNING)
    under = tuple(q + "." for q in QUIET)
    for name, lg in list(logging.root.manager.loggerDict.items()):
        if (isinstance(lg, logging.Logger) and name.startswith(under)
                and logging.NOTSET < lg.level < logging.WARNING):
            lg.setLevel(logging.WARNING)


def setup(level: str | int = "INFO", fmt: str = "text", config: str | Path | None = None) -> None:
    """Send logs to stderr as ``fmt`` (``text`` or ``json``), llmgw's at ``level``; then apply ``config``.

    Idempotent: calling it again changes the level and format in place. The handler
    sits on the root logger, so asyncio's and other libraries' warnings share the format.

    Raises:
        LogConfigError: ``config`` cannot be applied.
        ValueError: ``fmt`` is not one of :data:`FORMATS`.
    """
    global _format, _captured
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: use one of {', '.join(FORMATS)}")
    _format = fmt
    llmgw = logging.getLogger("llmgw")
    if isinstance(level, str):
        level = logging.getLevelName(level.upper())
    llmgw.setLevel(level)
    # Older setups put the handler on "llmgw"; one handler, on the root, from now on.
    for h in list(llmgw.handlers):
        if getattr(h, "_llmgw", False):
            llmgw.removeHandler(h)
    root = logging.getLogger()
    handler = next((h for h in root.handlers if getattr(h, "_llmgw", False)), None)
    if handler is None:
        handler = _StdHandler("stderr")
        root.addHandler(handler)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    if root.level > logging.WARNING or root.level == logging.NOTSET:
        root.setLevel(logging.WARNING)

    ah = next((h for h in access_logger.handlers if getattr(h, "_llmgw", False)), None)
    if ah is None:
        ah = _StdHandler("stdout")
        access_logger.addHandler(ah)
        access_logger.propagate = False
    ah.setFormatter(_AccessJsonFormatter() if fmt == "json" else logging.Formatter("%(message)s"))

    json_mode = fmt == "json"
    if json_mode or _captured:
        logging.captureWarnings(json_mode)
        _captured = json_mode
    if json_mode:
        sys.excepthook = _excepthook
        threading.excepthook = _thread_excepthook
    else:
        if sys.excepthook is _excepthook:
            sys.excepthook = sys.__excepthook__
        if threading.excepthook is _thread_excepthook:
            threading.excepthook = threading.__excepthook__
    if config is not None:
        load_log_config(config)
        if not root.handlers:
            # The file configured the root without handlers: keep llmgw's stderr one (and its format).
            root.addHandler(handler)
    quiet_protocol_loggers()
