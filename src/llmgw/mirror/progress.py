"""Progress reporting for long copies and hashes.

The store reports through the small :class:`Progress` interface; the CLI picks
:class:`RichProgress` (a bar with bytes, rate and time left on stderr) when stderr
is a terminal and ``--quiet`` is not given, and :class:`NullProgress` otherwise.
rich is imported only when a bar is actually shown.
"""

from __future__ import annotations

import sys
from typing import IO, Any

__all__ = ["NullProgress", "Progress", "RichProgress", "make_progress"]


class Progress:
    """Receives progress of one long operation at a time.

    ``start`` is called when an operation begins, ``advance`` after each chunk,
    and ``finish`` when it ends (also on failure). ``close`` ends the display.
    """

    def start(self, description: str, total: int) -> None:
        """Begin an operation over ``total`` bytes."""

    def advance(self, nbytes: int) -> None:
        """Record ``nbytes`` more bytes done."""

    def finish(self) -> None:
        """End the current operation."""

    def close(self) -> None:
        """Stop displaying anything."""

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NullProgress(Progress):
    """Shows nothing."""


class RichProgress(Progress):
    """A rich progress bar: description, bar, bytes done/total, rate, time left.

    Args:
        file: where to draw (stderr by default).
        force_terminal: draw even if ``file`` is not a terminal (tests).
    """

    def __init__(self, file: IO[str] | None = None, *, force_terminal: bool | None = None) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )
        from rich.progress import Progress as _RichProgress

        console = Console(file=file or sys.stderr, force_terminal=force_terminal)
        self._bar = _RichProgress(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=False,
        )
        self._task: Any = None
        self._started = False

    def start(self, description: str, total: int) -> None:
        if not self._started:
            self._bar.start()
            self._started = True
        self._task = self._bar.add_task(description, total=total)

    def advance(self, nbytes: int) -> None:
        if self._task is not None:
            self._bar.advance(self._task, nbytes)

    def finish(self) -> None:
        if self._task is not None:
            self._bar.stop_task(self._task)
            self._task = None

    def close(self) -> None:
        if self._started:
            self._bar.stop()
            self._started = False


def make_progress(*, quiet: bool = False, file: IO[str] | None = None) -> Progress:
    """Return a bar when ``file`` (stderr by default) is a terminal and not ``quiet``, else a no-op."""
    stream = file or sys.stderr
    from ..log import current_format

    if quiet or (file is None and current_format() == "json"):
        return NullProgress()  # --log-format json: stderr carries JSON lines only
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        tty = False
    return RichProgress(stream) if tty else NullProgress()
