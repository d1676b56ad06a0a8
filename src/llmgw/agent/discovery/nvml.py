"""GPU discovery through NVML (``nvidia-ml-py``, module ``pynvml``).

:class:`NvmlSource` takes the ``pynvml`` module as an argument, so the tests
hand it :mod:`llmgw.testing.fake_nvml` and everything above the module is the
code that runs on a GPU node.

What it does with failures (``docs/agent.md``, "Absent is not zero"):

* A reading that fails on its own (``NotSupported``, ``FunctionNotFound`` on an
  old driver, ``NoPermission``, ``InvalidArgument``, ``ArgumentVersionMismatch``,
  a field value whose own ``nvmlReturn`` failed) is ``None``; the GPU's other
  readings still report. ``FunctionNotFound`` is remembered per function: the
  installed driver will not grow the symbol while the agent runs.
* ``GpuIsLost``/``Unknown``/``ResetRequired`` on a handle mean the GPU no longer
  answers: it is reported with ``health="error"``, its identity as last known (and
  its memory total) and every measurement absent; its handle is dropped and looked
  up again by UUID on the next read. One NVML no longer enumerates at all (after a
  re-initialisation) is kept the same way (:class:`~llmgw.agent.discovery.seen.SeenGPUs`).
* A failed ``nvmlInit`` ("Failed to initialize NVML: Unknown Error", a container
  that lost its devices) is a node-level error in :attr:`Discovery.errors`, never
  an empty GPU list read as "no GPUs": the GPUs seen before are kept by their
  identity with ``health="unknown"``; the next read initialises again.

Readings are synchronous C calls (a few ms for eight GPUs); the agent calls
:meth:`NvmlSource.read` from a worker thread, never on its event loop.
"""

from __future__ import annotations

import ctypes
import dataclasses
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from ..model import GPU, Discovery, NodeFacts
from .seen import SeenGPUs

__all__ = ["NvmlSource", "format_cuda_version"]

# Error classes by name, looked up on the injected module (the real pynvml and the
# stand-in share them). A reading that raises one of these is absent.
_ABSENT = (
    "NVMLError_NotSupported",
    "NVMLError_FunctionNotFound",
    "NVMLError_NoPermission",
    "NVMLError_InvalidArgument",
    "NVMLError_ArgumentVersionMismatch",
    "NVMLError_NotFound",
    "NVMLError_Deprecated",
    "NVMLError_NotReady",
)
# The GPU no longer answers.
_LOST = ("NVMLError_GpuIsLost", "NVMLError_Unknown", "NVMLError_ResetRequired", "NVMLError_GpuNotFound")
# NVML itself went away (a shutdown elsewhere, a driver reload): initialise again.
_REINIT = ("NVMLError_Uninitialized", "NVMLError_DriverNotLoaded", "NVMLError_LibRmVersionMismatch")

_FABRIC_STATES = {0: "not_supported", 1: "not_started", 2: "in_progress", 3: "completed"}
_FABRIC_HEALTH_UNHEALTHY = 2

# A burst of XIDs (a GPU in trouble can raise hundreds) must not hold a read: the
# rest stays queued in the event set for the next read.
_MAX_EVENTS_PER_READ = 1024


class _GpuLostError(Exception):
    """Raised inside a GPU's read when the GPU stops answering; carries the call and NVML's text."""

    def __init__(self, call: str, exc: BaseException) -> None:
        super().__init__(f"{call}: {exc}")


class _ReinitError(Exception):
    def __init__(self, call: str, exc: BaseException) -> None:
        super().__init__(f"{call}: {exc}")


def format_cuda_version(value: int) -> str:
    """``12040`` -> ``"12.4"`` (NVML's CUDA driver version: 1000 * major + 10 * minor)."""
    return f"{value // 1000}.{(value % 1000) // 10}"


def _text(value: Any) -> str:
    # nvidia-ml-py returns str (@convertStrBytes); bindings before 11.515 returned bytes.
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _handle_key(handle: Any) -> Any:
    """A hashable key for an NVML device handle (a ctypes pointer: compare addresses, not objects)."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return handle


@dataclasses.dataclass
class _Known:
    """What the source remembers of one physical GPU between reads."""

    uuid: str
    index: int | None
    handle: Any  # None: lost, look it up again by UUID on the next read
    name: str | None = None
    pci_bus_id: str | None = None
    memory_total: int | None = None
    events_registered: bool = False


class NvmlSource:
    """GPU discovery through NVML: :meth:`read` returns one :class:`Discovery`.

    Args:
        nvml: the ``pynvml`` module, or anything with its names (the stand-in).
        facts: called on every read for the node's facts; the driver and CUDA
            versions NVML reports are filled in on top.
    """

    name = "nvml"

    def __init__(self, nvml: Any, *, facts: Callable[[], NodeFacts] | None = None) -> None:
        self._nvml = nvml
        self._facts = facts or (lambda: NodeFacts(hostname=""))
        self._lock = threading.Lock()
        self._initialized = False
        self._missing: set[str] = set()  # functions the driver lacks (FunctionNotFound)
        self._known: dict[str, _Known] = {}  # by UUID, in discovery order
        self._count: int | None = None
        self._event_set: Any = None
        self._xids: dict[str, Counter[int]] = {}
        self._sink: list[str] = []  # unexpected per-reading failures of the GPU being read
        self._absent = self._classes(_ABSENT)
        self._lost = self._classes(_LOST)
        self._reinit = self._classes(_REINIT)
        self._timeout = self._classes(("NVMLError_Timeout",))
        self._not_found = self._classes(("NVMLError_NotFound",))
        self._function_not_found = self._classes(("NVMLError_FunctionNotFound",))
        self._error = getattr(nvml, "NVMLError", Exception)
        self._seen = SeenGPUs("NVML")  # (outlives a re-initialisation, which forgets _known)
        self._index_failures: dict[int, str] = {}  # this read's: "GPU at index N: …" by N

    def _classes(self, names: tuple[str, ...]) -> tuple[type[BaseException], ...]:
        return tuple(c for n in names if isinstance(c := getattr(self._nvml, n, None), type))

    # -- init ----------------------------------------------------------------------------------------

    def init(self) -> None:
        """Initialise NVML now (``read`` does it when needed).

        Raises:
            NVMLError: whatever ``nvmlInit`` raised (``NVMLError_LibraryNotFound`` on a
                node without the driver), so :func:`open_source` can decide on a fallback.
        """
        with self._lock:
            self._init()

    def _init(self) -> None:
        if self._initialized:
            return
        self._nvml.nvmlInit()
        self._initialized = True
        self._known.clear()
        self._count = None
        try:
            self._event_set = self._nvml.nvmlEventSetCreate()
        except self._error:
            self._event_set = None  # no events here (Windows, an old driver): XIDs absent

    def _shutdown(self) -> None:
        if not self._initialized:
            return
        self._initialized = False
        self._known.clear()
        self._count = None
        if self._event_set is not None:
            try:
                self._nvml.nvmlEventSetFree(self._event_set)
            except self._error:
                pass  # NOTE: freeing on the way out; nothing to recover
            self._event_set = None
        try:
            self._nvml.nvmlShutdown()
        except self._error:
            pass

    def close(self) -> None:
        """Free the event set and shut NVML down (its refcount: other users in the process keep theirs)."""
        with self._lock:
            self._shutdown()

    # -- one reading -----------------------------------------------------------------------------

    def read(self) -> Discovery:
        """Read every GPU once.

        Returns:
            The node's facts and GPUs with ``source="nvml"``. NVML failing to
            initialise has the failure in ``errors`` (retried next read) and the GPUs
            seen before by their identity, ``health="unknown"`` (none when none were seen).
        """
        with self._lock:
            self._index_failures = {}
            d, answered = self._read()
            if not answered:
                return self._seen.failed(d)
            # A GPU seen before (then re-initialised) that fails at its index: said on it, not the node.
            present = {g.uuid for g in d.gpus}
            lost = {g.uuid: self._index_failures[g.index] for g in self._seen.gpus
                    if g.parent_uuid is None and g.index in self._index_failures and g.uuid not in present}
            if lost:
                said = set(lost.values())
                d = dataclasses.replace(d, errors=tuple(e for e in d.errors if e not in said))
            return self._seen.answered(d, lost)

    def _read(self) -> tuple[Discovery, bool]:
        """One reading, and whether NVML answered (False: initialising failed or NVML went away)."""
        facts = self._facts()
        errors: list[str] = []
        self._sink = errors
        try:
            self._init()
        except self._error as exc:
            # nvidia-smi's own words for the same failure, so both sources read alike.
            return Discovery(facts=facts, source=self.name, errors=(f"Failed to initialize NVML: {exc}",)), False
        try:
            driver, cuda = self._versions()
            self._enumerate(errors)
            for known in self._known.values():
                if known.handle is not None:
                    try:
                        self._register_events(known)
                    except _GpuLostError:
                        pass  # its own read below reports it
            self._drain_events()
            gpus: list[GPU] = []
            for known in list(self._known.values()):
                gpus.extend(self._read_gpu(known))
        except _ReinitError as exc:
            # NVML went away under us: report it, initialise again next read.
            self._shutdown()
            return Discovery(facts=facts, source=self.name, errors=(*errors, f"NVML: {exc}")), False
        facts = dataclasses.replace(facts, driver_version=driver, cuda_driver_version=cuda)
        return Discovery(facts=facts, gpus=tuple(gpus), source=self.name, errors=tuple(errors)), True

    def _call(self, fn: str, *args: Any, symbol: str | None = None, **kwargs: Any) -> Any:
        """Call one NVML function; ``None`` when that reading is not available.

        ``symbol`` names the C symbol when one Python function calls several (the memory
        v2 struct is ``nvmlDeviceGetMemoryInfo_v2``): a missing one is remembered by it.

        Raises:
            _GpuLostError: the device no longer answers.
            _ReinitError: NVML must be initialised again.
        """
        symbol = symbol or fn
        if symbol in self._missing:
            return None
        try:
            return getattr(self._nvml, fn)(*args, **kwargs)
        except self._function_not_found:
            self._missing.add(symbol)
            return None
        except self._absent:
            return None
        except self._lost as exc:
            raise _GpuLostError(fn, exc) from exc
        except self._reinit as exc:
            raise _ReinitError(fn, exc) from exc
        except self._error as exc:
            # Anything else (Timeout, CorruptedInforom, InsufficientPower, …): the reading is
            # absent and the failure is said on the GPU being read (it is not "ok" then).
            self._sink.append(f"{fn}: {exc}")
            return None

    def _versions(self) -> tuple[str | None, str | None]:
        driver = self._system_call("nvmlSystemGetDriverVersion")
        cuda = self._system_call("nvmlSystemGetCudaDriverVersion_v2")
        if cuda is None:
            cuda = self._system_call("nvmlSystemGetCudaDriverVersion")
        return (
            _text(driver) if driver is not None else None,
            format_cuda_version(int(cuda)) if cuda is not None else None,
        )

    def _system_call(self, fn: str) -> Any:
        try:
            return self._call(fn)
        except _GpuLostError:
            return None

    def _enumerate(self, errors: list[str]) -> None:
        """Learn the GPUs' UUIDs (once, and again when the count changes); key everything by UUID."""
        try:
            count = self._nvml.nvmlDeviceGetCount()
        except self._reinit as exc:
            raise _ReinitError("nvmlDeviceGetCount", exc) from exc
        except self._error as exc:
            errors.append(f"nvmlDeviceGetCount: {exc}")
            return
        if count == self._count and all(k.handle is not None for k in self._known.values()):
            return
        complete = True
        for index in range(count):
            try:
                handle = self._nvml.nvmlDeviceGetHandleByIndex(index)
                uuid = _text(self._nvml.nvmlDeviceGetUUID(handle))
            except self._reinit as exc:
                raise _ReinitError("nvmlDeviceGetHandleByIndex", exc) from exc
            except self._error as exc:
                # Nothing known by UUID yet at this index: a node-level error; a GPU
                # already known is reported lost below when its own handle fails.
                if not any(k.index == index for k in self._known.values()):
                    errors.append(msg := f"GPU at index {index}: {exc}")
                    self._index_failures[index] = msg
                complete = False  # (enumerate again next read: it may answer then)
                continue
            known = self._known.get(uuid)
            if known is None:
                self._known[uuid] = _Known(uuid=uuid, index=index, handle=handle)
            elif known.handle is None:
                known.handle, known.index, known.events_registered = handle, index, False
        self._count = count if complete else None

    def _drain_events(self) -> None:
        """Count the XID events queued since the last read (non-blocking wait)."""
        if self._event_set is None:
            return
        by_handle = {_handle_key(k.handle): k.uuid for k in self._known.values() if k.handle is not None}
        xid_type = getattr(self._nvml, "nvmlEventTypeXidCriticalError", 0x8)
        for _ in range(_MAX_EVENTS_PER_READ):
            try:
                data = self._nvml.nvmlEventSetWait(self._event_set, 0)
            except self._timeout:
                return  # nothing more queued
            except self._reinit as exc:
                raise _ReinitError("nvmlEventSetWait", exc) from exc
            except self._error:
                return  # a lost GPU's events: its own read reports it
            if not int(data.eventType) & xid_type:
                continue
            uuid = by_handle.get(_handle_key(data.device))
            if uuid is not None:
                self._xids.setdefault(uuid, Counter())[int(data.eventData)] += 1

    def _register_events(self, known: _Known) -> None:
        if self._event_set is None or known.events_registered:
            return
        xid_type = getattr(self._nvml, "nvmlEventTypeXidCriticalError", 0x8)
        # NotSupported (no events on this GPU/OS): XIDs stay empty; lost: the read below reports it.
        self._call("nvmlDeviceRegisterEvents", known.handle, xid_type, self._event_set)
        known.events_registered = True

    def _read_gpu(self, known: _Known) -> list[GPU]:
        """One physical GPU and its MIG devices; a lost GPU is one ``health="error"`` entry."""
        try:
            if known.handle is None:
                known.handle = self._call("nvmlDeviceGetHandleByUUID", known.uuid)
                if known.handle is None:
                    raise _GpuLostError("nvmlDeviceGetHandleByUUID", RuntimeError("not found"))
            self._register_events(known)  # a handle found again by UUID
            return self._read_physical(known)
        except _GpuLostError as exc:
            known.handle = None
            known.events_registered = False
            self._count = None  # enumerate again next read
            return [
                GPU(
                    uuid=known.uuid,
                    index=known.index,
                    name=known.name,
                    pci_bus_id=known.pci_bus_id,
                    memory_total_bytes=known.memory_total,
                    xid_errors=self._xid_tuple(known.uuid),
                    health="error",
                    errors=(str(exc),),
                )
            ]

    def _xid_tuple(self, uuid: str) -> tuple[tuple[int, int], ...]:
        return tuple(sorted(self._xids.get(uuid, Counter()).items()))

    def _read_physical(self, known: _Known) -> list[GPU]:
        nv, h = self._nvml, known.handle
        errors: list[str] = []
        self._sink = errors
        name = self._call("nvmlDeviceGetName", h)
        if name is not None:
            known.name = _text(name)
        pci = self._call("nvmlDeviceGetPciInfo", h)
        if pci is not None:
            known.pci_bus_id = _text(pci.busId)
        index = self._call("nvmlDeviceGetIndex", h)
        if index is not None:
            known.index = int(index)

        values: dict[str, Any] = {}
        values.update(self._memory(h))
        if values.get("memory_total_bytes") is not None:
            known.memory_total = values["memory_total_bytes"]
        values.update(self._utilization(h))
        temp = self._call("nvmlDeviceGetTemperatureV", h, nv.NVML_TEMPERATURE_GPU)
        if temp is None and "nvmlDeviceGetTemperatureV" in self._missing:
            temp = self._call("nvmlDeviceGetTemperature", h, nv.NVML_TEMPERATURE_GPU)
        values["temperature_celsius"] = _float(temp)
        values["power_watts"] = _per_thousand(self._call("nvmlDeviceGetPowerUsage", h))
        values["power_limit_watts"] = _per_thousand(self._call("nvmlDeviceGetEnforcedPowerLimit", h))
        values["energy_joules"] = _per_thousand(self._call("nvmlDeviceGetTotalEnergyConsumption", h))
        values["sm_clock_mhz"] = _float(self._call("nvmlDeviceGetClockInfo", h, nv.NVML_CLOCK_SM))
        values["ecc_corrected_volatile"] = _int(
            self._call("nvmlDeviceGetTotalEccErrors", h, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC)
        )
        values["ecc_uncorrected_volatile"] = _int(
            self._call(
                "nvmlDeviceGetTotalEccErrors", h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC
            )
        )
        values.update(self._remapped_rows(h))
        values.update(self._nvlink(h))
        values.update(self._fabric(h))
        mig = self._call("nvmlDeviceGetMigMode", h)
        mig_mode = None if mig is None else int(mig[0]) == nv.NVML_DEVICE_MIG_ENABLE
        values["mig_mode"] = mig_mode

        xids = self._xid_tuple(known.uuid)
        health = _health(values, xids, errors)
        gpu = GPU(
            uuid=known.uuid,
            index=known.index,
            name=known.name,
            pci_bus_id=known.pci_bus_id,
            xid_errors=xids,
            health=health,
            errors=tuple(errors),
            **values,
        )
        out = [gpu]
        if mig_mode:
            out.extend(self._mig_devices(known, health))
        return out

    def _memory(self, h: Any) -> dict[str, Any]:
        mem = None
        v2 = getattr(self._nvml, "nvmlMemory_v2", None)
        if v2 is not None:
            # The v2 struct (driver-reserved memory apart) is the one nvidia-smi matches
            # (cluster.md §1.3); older drivers lack the _v2 symbol or the version: v1.
            mem = self._call("nvmlDeviceGetMemoryInfo", h, version=v2, symbol="nvmlDeviceGetMemoryInfo_v2")
        if mem is None:
            mem = self._call("nvmlDeviceGetMemoryInfo", h)
        if mem is None:
            return {}
        return {
            "memory_total_bytes": int(mem.total),
            "memory_used_bytes": int(mem.used),
            "memory_free_bytes": int(mem.free),
        }

    def _utilization(self, h: Any) -> dict[str, Any]:
        # NotSupported on MIG-enabled GPUs and MIG devices: absent, never 0 (cluster.md §0 #2).
        util = self._call("nvmlDeviceGetUtilizationRates", h)
        if util is None:
            return {}
        return {"utilization_gpu_ratio": util.gpu / 100.0, "utilization_memory_ratio": util.memory / 100.0}

    def _remapped_rows(self, h: Any) -> dict[str, Any]:
        rows = self._call("nvmlDeviceGetRemappedRows", h)
        if rows is not None:
            cor, unc, pending, failure = rows
            return {
                "remapped_rows_correctable": int(cor),
                "remapped_rows_uncorrectable": int(unc),
                "remapped_rows_pending": bool(pending),
                "remapped_rows_failure": bool(failure),
            }
        if "nvmlDeviceGetRemappedRows" not in self._missing:
            return {}  # NotSupported (pre-Ampere): no remapping on this GPU
        # A driver without the call may still know the field IDs; each field carries its own
        # return code, and the call succeeds even when every field failed (cluster.md §1.8).
        nv = self._nvml
        ids = (
            ("remapped_rows_correctable", getattr(nv, "NVML_FI_DEV_REMAPPED_COR", 142), int),
            ("remapped_rows_uncorrectable", getattr(nv, "NVML_FI_DEV_REMAPPED_UNC", 143), int),
            ("remapped_rows_pending", getattr(nv, "NVML_FI_DEV_REMAPPED_PENDING", 144), bool),
            ("remapped_rows_failure", getattr(nv, "NVML_FI_DEV_REMAPPED_FAILURE", 145), bool),
        )
        fields = self._call("nvmlDeviceGetFieldValues", h, [fid for _, fid, _ in ids])
        if fields is None:
            return {}
        out: dict[str, Any] = {}
        for (key, _, conv), fv in zip(ids, fields, strict=False):
            value = _field_value(nv, fv)
            if value is not None:
                out[key] = conv(value)
        return out

    def _nvlink(self, h: Any) -> dict[str, Any]:
        nv = self._nvml
        active = total = 0
        for link in range(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18)):
            if "nvmlDeviceGetNvLinkState" in self._missing:
                break
            try:
                state = nv.nvmlDeviceGetNvLinkState(h, link)
            except self._function_not_found:
                self._missing.add("nvmlDeviceGetNvLinkState")
                break
            except self._absent:
                break  # past the last link (InvalidArgument) or no NVLink at all (NotSupported)
            except self._lost as exc:
                raise _GpuLostError("nvmlDeviceGetNvLinkState", exc) from exc
            except self._reinit as exc:
                raise _ReinitError("nvmlDeviceGetNvLinkState", exc) from exc
            total += 1
            active += int(state) == getattr(nv, "NVML_FEATURE_ENABLED", 1)
        if total == 0:
            return {}  # a PCIe board without NVLink: absent, not "0 of 0"
        return {"nvlink_links_active": active, "nvlink_links_total": total}

    def _fabric(self, h: Any) -> dict[str, Any]:
        nv = self._nvml
        info = None
        for fn, struct in (
            ("nvmlDeviceGetGpuFabricInfoV", "c_nvmlGpuFabricInfo_v3_t"),
            ("nvmlDeviceGetGpuFabricInfoV", "c_nvmlGpuFabricInfo_v2_t"),
            ("nvmlDeviceGetGpuFabricInfo", "c_nvmlGpuFabricInfo_t"),  # deprecated, for old drivers
        ):
            cls = getattr(nv, struct, None)
            if cls is None or fn in self._missing:
                continue
            candidate = cls()
            if self._call(fn, h, ctypes.byref(candidate)) is not None:
                info = candidate
                break
        if info is None:
            return {}
        state = _FABRIC_STATES.get(int(info.state), f"unknown_{int(info.state)}")
        if state == "not_supported":
            return {"fabric_state": state}
        if state == "completed":
            healthy = int(info.status) == getattr(nv, "NVML_SUCCESS", 0)
            if healthy and hasattr(info, "healthSummary"):
                healthy = int(info.healthSummary) != _FABRIC_HEALTH_UNHEALTHY
        else:
            # Not started / in progress: CUDA engines fail with error 802 until it completes
            # (cluster.md §3.2), so the GPU is not usable yet.
            healthy = False
        return {"fabric_state": state, "fabric_healthy": healthy}

    def _mig_devices(self, parent: _Known, parent_health: str) -> list[GPU]:
        count = self._call("nvmlDeviceGetMaxMigDeviceCount", parent.handle)
        out: list[GPU] = []
        for i in range(int(count or 0)):
            mh = self._call("nvmlDeviceGetMigDeviceHandleByIndex", parent.handle, i)
            if mh is None:
                continue  # an empty slot (NotFound)
            uuid = self._call("nvmlDeviceGetUUID", mh)
            if uuid is None:
                continue
            errors: list[str] = []
            self._sink = errors
            name = self._call("nvmlDeviceGetName", mh)
            values = {**self._memory(mh), **self._utilization(mh)}
            out.append(
                GPU(
                    uuid=_text(uuid),
                    index=i,
                    name=_text(name) if name is not None else None,
                    pci_bus_id=parent.pci_bus_id,
                    parent_uuid=parent.uuid,
                    health="degraded" if parent_health == "degraded" or errors else "ok",
                    errors=tuple(errors),
                    **values,
                )
            )
        return out


def _field_value(nv: Any, fv: Any) -> Any:
    """One ``c_nvmlFieldValue_t``'s value, or ``None`` when its own ``nvmlReturn`` failed."""
    if int(fv.nvmlReturn) != getattr(nv, "NVML_SUCCESS", 0):
        return None
    member = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}.get(
        int(fv.valueType)
    )
    return None if member is None else getattr(fv.value, member)


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def _per_thousand(value: Any) -> float | None:
    return None if value is None else float(value) / 1000.0


def _health(values: dict[str, Any], xids: tuple[tuple[int, int], ...], errors: list[str]) -> str:
    """``degraded`` when the GPU answers but something is wrong with it; see :data:`GPU_HEALTH`."""
    if (
        (values.get("ecc_uncorrected_volatile") or 0) > 0
        or values.get("remapped_rows_pending")
        or values.get("remapped_rows_failure")
        or xids
        or values.get("fabric_healthy") is False
        or errors
    ):
        return "degraded"
    return "ok"
