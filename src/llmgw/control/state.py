"""What the control plane keeps across restarts without a database: operators' decisions.

Node state itself needs no keeping (agents re-register within about an interval
of a restart); what an operator decided does: a cordon lost on restart would let
new replicas land on a node taken out for maintenance. ``control.state_file``
holds those decisions as JSON::

    {"version": 1, "cordoned": ["gpu-7", "gpu-9"]}

Written whole on every change: a temporary file beside it, fsynced, renamed over
it, and the directory fsynced, so a crash leaves the old file or the new one,
never a torn one. (The PostgreSQL store of the HA issue replaces it.)
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from ..errors import ConfigError

__all__ = ["StateFile"]

VERSION = 1


class StateFile:
    """``control.state_file``: load once at start, save on every change."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def load(self) -> set[str]:
        """The saved cordons (none when the file does not exist yet).

        Raises:
            ConfigError: unreadable, not this format, or from a newer llmgw.
        """
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return set()
        except OSError as exc:
            raise ConfigError("control.state_file", f"cannot read {self.path}: {exc.strerror or exc}") from None
        try:
            doc = json.loads(raw)
            version = doc["version"]
            cordoned = doc["cordoned"]
        except (ValueError, TypeError, KeyError):
            raise ConfigError(
                "control.state_file", f"{self.path} is not a state file llmgw wrote (fix it, or move it away to start "
                "with no cordons)"
            ) from None
        if version != VERSION:
            raise ConfigError(
                "control.state_file", f"{self.path} has version {version!r}; this llmgw reads version {VERSION}"
            )
        if not isinstance(cordoned, list) or not all(isinstance(n, str) for n in cordoned):
            raise ConfigError("control.state_file", f"{self.path}: 'cordoned' must be a list of node names")
        return set(cordoned)

    def save(self, cordoned: set[str]) -> None:
        """Replace the file atomically.

        Raises:
            OSError: it could not be written (the old file is left as it was).
        """
        data = json.dumps({"version": VERSION, "cordoned": sorted(cordoned)}, indent=1).encode() + b"\n"
        d = self.path.parent
        d.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=d)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        dfd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
