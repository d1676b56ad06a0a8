"""GPU and node discovery: one :class:`~llmgw.agent.model.Discovery` per read.

:func:`open_source` picks a source (``--gpu-source``); the agent calls
``read()`` on each heartbeat (from a worker thread: NVML and ``nvidia-smi``
block) and ``close()`` on the way out::

    source = open_source("auto", agent_version=llmgw.__version__)
    discovery = source.read()

Sources: :class:`NvmlSource` (``nvidia-ml-py``), :class:`SmiSource`
(``nvidia-smi --query-gpu``), :class:`NoneSource` (a node without GPUs: its
facts only) and :class:`SimulatedSource` (the demo's stand-in). ``docs/agent.md``
says what each reads and how absent readings are reported.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, Literal, Protocol

from ..model import Discovery, NodeFacts
from .node import infiniband_ports, node_facts
from .nvml import NvmlSource
from .simulated import SIMULATED_NAME, SimulatedSource
from .smi import SmiSource

__all__ = [
    "KINDS",
    "SIMULATED_NAME",
    "DiscoverySource",
    "NoneSource",
    "NvmlSource",
    "SimulatedSource",
    "SmiSource",
    "infiniband_ports",
    "node_facts",
    "open_source",
]

Kind = Literal["auto", "nvml", "nvidia-smi", "none", "simulated"]
KINDS: tuple[str, ...] = ("auto", "nvml", "nvidia-smi", "none", "simulated")

# nvmlInit's answers that mean "no NVIDIA driver on this node" rather than "NVML is broken".
_NO_DRIVER = ("NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded", "NVMLError_FunctionNotFound")


class DiscoverySource(Protocol):
    """What every source offers."""

    name: str
    """One of :data:`~llmgw.agent.model.SOURCES`."""

    def read(self) -> Discovery: ...

    def close(self) -> None: ...


class NoneSource:
    """No GPU source: the node's facts, no GPUs (a CPU node running llama.cpp is a valid node)."""

    name = "none"

    def __init__(self, *, facts: Callable[[], NodeFacts] | None = None) -> None:
        self._facts = facts or (lambda: NodeFacts(hostname=""))

    def read(self) -> Discovery:
        """The node's facts with ``source="none"``."""
        return Discovery(facts=self._facts(), source=self.name)

    def close(self) -> None:
        """Nothing to release."""


def _import_pynvml() -> Any:
    import pynvml

    return pynvml


def open_source(
    kind: Kind | str = "auto",
    *,
    agent_version: str | None = None,
    nvml: Any = None,
    smi_path: str = "nvidia-smi",
    smi_timeout: float = 10.0,
    root: str | os.PathLike[str] = "/",
    simulated_gpus: int = 2,
    node: str | None = None,
) -> DiscoverySource:
    """Open a discovery source.

    Args:
        kind: ``auto`` tries NVML (``import pynvml``; ``nvmlInit``), then
            ``nvidia-smi`` on PATH, then ``none``. ``nvml`` and ``nvidia-smi`` are
            used even when they fail now (the failure is reported on every read and
            retried); ``none`` reads no GPUs; ``simulated`` is the demo's stand-in.
        agent_version: reported in the node's facts.
        nvml: the ``pynvml`` module to use (tests pass :class:`llmgw.testing.fake_nvml.FakeNvml`);
            default: ``import pynvml``.
        smi_path: the ``nvidia-smi`` executable.
        smi_timeout: seconds one ``nvidia-smi`` run may take.
        root: where the node's ``/etc``, ``/proc`` and ``/sys`` are read from.
        simulated_gpus: how many GPUs ``simulated`` shows.
        node: the node's name (``simulated`` derives its GPUs' UUIDs from it; default the host name).

    Returns:
        A source with ``read() -> Discovery`` and ``close()``.

    Raises:
        ValueError: an unknown ``kind``.
        ImportError: ``kind="nvml"`` and ``pynvml`` is not installed.
    """
    facts = functools.partial(node_facts, agent_version, root=root)
    if kind == "none":
        return NoneSource(facts=facts)
    if kind == "simulated":
        return SimulatedSource(simulated_gpus, facts=facts, node=node)
    if kind == "nvidia-smi":
        return SmiSource(smi_path, facts=facts, timeout=smi_timeout)
    if kind == "nvml":
        return NvmlSource(nvml if nvml is not None else _import_pynvml(), facts=facts)
    if kind != "auto":
        raise ValueError(f"unknown GPU source {kind!r}: one of {', '.join(KINDS)}")

    nvml_source: NvmlSource | None = None
    if nvml is None:
        try:
            nvml = _import_pynvml()
        except ImportError:
            nvml = None
    if nvml is not None:
        nvml_source = NvmlSource(nvml, facts=facts)
        no_driver: tuple[type[BaseException], ...] = tuple(
            c for n in _NO_DRIVER if isinstance(c := getattr(nvml, n, None), type)
        )
        nvml_error: type[BaseException] = getattr(nvml, "NVMLError", Exception)
        try:
            nvml_source.init()
            return nvml_source
        except no_driver:
            nvml_source = None  # no NVIDIA driver: not an NVML node
        except nvml_error:
            pass  # NVML is there but failing ("Unknown Error"): try nvidia-smi, else report it
    smi = SmiSource(smi_path, facts=facts, timeout=smi_timeout)
    if smi.available():
        if nvml_source is not None:
            nvml_source.close()
        return smi
    if nvml_source is not None:
        # A driver is there and NVML fails: reporting the failure (and retrying) is right;
        # "none" would read as a node without GPUs.
        return nvml_source
    return NoneSource(facts=facts)
