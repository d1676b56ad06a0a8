"""``llmgw console``: a terminal console for the fleet (Textual), talking only to the admin API.

* :mod:`.client`: the async admin API client (bounded timeouts; the UI never waits on it).
* :mod:`.views`: each view's API paths, columns and rows, as plain data.
* :mod:`.table`: a table that renders only the lines on screen (8,000 GPUs stay responsive).
* :mod:`.app`: the app: polling, command mode, filter, sort, actions, help, the Ollama import.

Usage: ``docs/console.md``.
"""

from __future__ import annotations

__all__: list[str] = []
