"""The gateway process: built in one place, :mod:`llmgw.runtime` (this name is kept for existing imports)."""

from __future__ import annotations

from ..runtime import GatewayRuntime

__all__ = ["GatewayRuntime"]
