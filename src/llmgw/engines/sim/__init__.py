"""A simulated inference engine: the stand-in for vLLM, llama.cpp, TensorRT-LLM and SGLang.

It speaks the OpenAI API, schedules requests into slots with a bounded queue,
simulates time to first token and decode speed on the event loop's clock, and
reports ``/metrics`` in the chosen engine's own dialect. Faults (errors, cuts,
hangs, latency, slow starts) can be switched on by config or at run time.
See ``docs/sim-engine.md``.
"""

from __future__ import annotations

from .app import SimState
from .config import SimConfig
from .engine import SimEngine
from .faults import SimFaults

__all__ = ["SimConfig", "SimEngine", "SimFaults", "SimState"]
