"""One simulated engine: its HTTP listener and the public programmatic API."""

from __future__ import annotations

import asyncio
import dataclasses
from types import TracebackType
from typing import Any

from ...http.server import HTTPServer, ServerLimits
from ...log import engine_logger as log
from .app import SimApp, SimState
from .config import SimConfig
from .faults import SimFaults

__all__ = ["SimEngine"]


class SimEngine:
    """A simulated vLLM, llama.cpp, TensorRT-LLM or SGLang server.

    Several can run in one process and one event loop (each has its own
    scheduler, metrics registry and listener).

    Args:
        config: how it behaves (default: a vLLM-like engine serving ``sim-model``).

    Example::

        eng = SimEngine(SimConfig(model="m", engine="vllm", slots=8))
        host, port = await eng.start("127.0.0.1", 0)
        ...
        await eng.stop()
    """

    def __init__(self, config: SimConfig | None = None) -> None:
        self.config = config or SimConfig()
        # The live switches start as a copy, so one SimConfig can seed several engines.
        self.faults = SimFaults(**dataclasses.asdict(self.config.faults))
        self.app = SimApp(self.config, self.faults)
        self._server: HTTPServer | None = None
        self.address: tuple[str, int] | None = None

    async def start(
        self, host: str = "127.0.0.1", port: int = 0, *, limits: ServerLimits | None = None
    ) -> tuple[str, int]:
        """Listen on ``host:port`` (0: any free port); returns the bound address.

        With ``startup_delay`` the engine listens at once and answers 503 (loading)
        until the delay has passed.

        Raises:
            OSError: the address cannot be bound (``"<host>:<port> is already in use"``).
            RuntimeError: already started.
        """
        if self._server is not None:
            raise RuntimeError("this SimEngine is already started")
        cfg = self.config
        loop = asyncio.get_running_loop()
        self.app.bind(loop)
        if cfg.api_key is not None and cfg.engine == "trtllm":
            log.warning(
                "sim-engine %s: trtllm-serve has no API-key support; --api-key is ignored "
                "(every request is accepted, as the real server would)", cfg.model,
            )
        server = HTTPServer(
            self.app, limits or ServerLimits(keepalive_timeout=cfg.keepalive_timeout), name=f"sim-{cfg.engine}"
        )
        self.address = await server.listen(host, port)
        self._server = server
        if cfg.startup_delay > 0:
            self.app.schedule_ready(cfg.startup_delay)
        log.info("sim-engine %s (%s) listening on %s:%d", cfg.model, cfg.engine, *self.address)
        return self.address

    async def stop(self, timeout: float = 5.0) -> None:
        """Stop accepting, let in-flight requests finish for up to ``timeout`` s, then cut.

        Hung requests (fault) are cut at once.
        """
        server, self._server = self._server, None
        if server is None:
            return
        self.app.set_ready(False)
        self.app.release_hung()
        await server.close(timeout)

    async def __aenter__(self) -> SimEngine:
        if self._server is None:
            await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    # -- observation and control --

    @property
    def url(self) -> str:
        """``http://host:port`` once started."""
        if self.address is None:
            raise RuntimeError("the SimEngine is not started")
        host, port = self.address
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    @property
    def state(self) -> SimState:
        """A snapshot of the scheduler and counters (what ``/metrics`` reports)."""
        return self.app.state()

    @property
    def arrivals(self) -> dict[bytes, int]:
        """Inference requests received per ``X-Request-Id`` (with ``count_arrivals``; else empty)."""
        return dict(self.app.arrivals)

    @property
    def ready(self) -> bool:
        return self.app.ready

    def set_ready(self, ready: bool) -> None:
        """Simulate loading (``False``: ``/health`` and inference answer 503) or ready."""
        self.app.set_ready(ready)

    def set_speed(self, *, ttft_ms: float | None = None, tokens_per_second: float | None = None) -> None:
        """Change the speed for requests admitted from now on.

        Raises:
            ConfigError: a value out of range.
        """
        self.app.set_speed(ttft_ms, tokens_per_second)

    def set_faults(self, **changes: Any) -> None:
        """Change fault switches, as ``POST /sim/faults`` does (see :class:`SimFaults`).

        Raises:
            ConfigError: an unknown key or a bad value (nothing changes).
        """
        self.app.apply_control(changes)
