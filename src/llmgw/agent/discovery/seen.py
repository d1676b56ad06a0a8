"""The GPUs a source has seen, kept listed when a read fails: a GPU node never reads as a CPU node.

A read that fails as a whole (``nvidia-smi`` timing out, exiting with an error or
answering garbage; NVML failing to initialise, or turning ``Uninitialized``
mid-run) would otherwise report no GPUs, and the control plane would show the
node as one without any. A GPU that stops appearing in an answer the source did
give (``nvidia-smi``'s "GPU is lost" line in place of its row; NVML no longer
enumerating it after a re-initialisation) would otherwise vanish from the list.
:class:`SeenGPUs` remembers each GPU's identity and what does not change (uuid,
index, name, PCI bus id, parent, memory total; the driver and CUDA versions) and
puts them back with every reading absent (:meth:`~llmgw.agent.model.GPU.identity`):

* the whole read failed: the GPUs of the last answer, ``health="unknown"``, the
  failure in :attr:`Discovery.errors` (the node's);
* the source answered without a GPU seen before: that GPU, ``health="error"``,
  why in its own :attr:`GPU.errors` (as NVML reports a GPU fallen off the bus).

A GPU is kept until the agent restarts (the source is opened again), or until
another GPU answers at its PCI bus id (the board was replaced). MIG devices come
and go with the MIG configuration: they are kept only through a failed read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ..model import GPU, Discovery

__all__ = ["SeenGPUs"]


class SeenGPUs:
    """What one source has seen, by UUID (see the module docstring).

    Args:
        source: the source as the reason a GPU left out of an answer is given names it (``NVML``).
    """

    def __init__(self, source: str) -> None:
        self._source = source
        self._gpus: tuple[GPU, ...] = ()  # the last answer's, by identity, in its order
        self._driver: str | None = None
        self._cuda: str | None = None

    @property
    def gpus(self) -> tuple[GPU, ...]:
        """The GPUs of the last answer (with those kept in it), by identity."""
        return self._gpus

    def answered(self, d: Discovery, lost: Mapping[str, str] | None = None) -> Discovery:
        """A reading the source made: the physical GPUs seen before and missing from it, added.

        Args:
            d: the reading.
            lost: why a GPU is missing, by UUID, where the source said (nvidia-smi's "GPU is lost" line).

        Returns:
            ``d`` with each missing GPU by its identity, ``health="error"``, why in its errors.
        """
        present = {g.uuid for g in d.gpus}
        buses = {_bus(g.pci_bus_id) for g in d.gpus if g.pci_bus_id}
        gpus = list(d.gpus)
        for g in self._gpus:
            if g.parent_uuid is not None or g.uuid in present or (g.pci_bus_id and _bus(g.pci_bus_id) in buses):
                continue
            why = (lost or {}).get(g.uuid) or f"{self._source} no longer lists this GPU (seen before)"
            _insert(gpus, g.identity("error", (why,)))
        if len(gpus) != len(d.gpus):
            d = dataclasses.replace(d, gpus=tuple(gpus))
        self._gpus = tuple(g.identity() for g in gpus)
        if d.facts.driver_version is not None:
            self._driver = d.facts.driver_version
        if d.facts.cuda_driver_version is not None:
            self._cuda = d.facts.cuda_driver_version
        return d

    def failed(self, d: Discovery, lost: Mapping[str, str] | None = None) -> Discovery:
        """A reading that failed as a whole (its failure in ``d.errors``, no GPUs in it).

        Args:
            d: the failed reading.
            lost: GPUs the source said are lost, by UUID: those are ``health="error"`` with the reason.

        Returns:
            ``d`` with the GPUs of the last answer by identity, ``health="unknown"`` (nothing is known of
            them now), and the driver and CUDA versions last read.
        """
        if not self._gpus:
            return d  # (none seen: none claimed, none denied)
        lost = lost or {}
        gpus = tuple(g.identity("error", (lost[g.uuid],)) if g.uuid in lost else g.identity() for g in self._gpus)
        facts = dataclasses.replace(d.facts, driver_version=d.facts.driver_version or self._driver,
                                    cuda_driver_version=d.facts.cuda_driver_version or self._cuda)
        return dataclasses.replace(d, gpus=gpus, facts=facts)


def _bus(bus_id: str) -> str:
    return bus_id.strip().lower()


def _insert(gpus: list[GPU], g: GPU) -> None:
    """Put a kept physical GPU back in index order among the physical GPUs (at the end when unknown)."""
    if g.index is not None:
        for i, h in enumerate(gpus):
            if h.parent_uuid is None and h.index is not None and h.index > g.index:
                gpus.insert(i, g)
                return
    gpus.append(g)
