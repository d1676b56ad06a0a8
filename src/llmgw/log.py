"""llmgw's named loggers.

Importing this module configures nothing; the CLI calls :func:`setup` once.
"""

from __future__ import annotations

import logging
import sys

__all__ = [
    "accel_logger",
    "access_logger",
    "admin_logger",
    "agent_logger",
    "config_logger",
    "control_logger",
    "engine_logger",
    "mirror_logger",
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


def setup(level: str | int = "INFO") -> None:
    """Send llmgw's logs to stderr as ``time level logger: message`` lines.

    The access log (``llmgw.access``) writes bare JSON lines to stdout and does not
    propagate, so it can be collected separately.
    """
    root = logging.getLogger("llmgw")
    if isinstance(level, str):
        level = logging.getLevelName(level.upper())
    root.setLevel(level)
    if not any(getattr(h, "_llmgw", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        handler._llmgw = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    if not any(getattr(h, "_llmgw", False) for h in access_logger.handlers):
        ah = logging.StreamHandler(sys.stdout)
        ah.setFormatter(logging.Formatter("%(message)s"))
        ah._llmgw = True  # type: ignore[attr-defined]
        access_logger.addHandler(ah)
        access_logger.propagate = False
