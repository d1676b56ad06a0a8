"""A stand-in for the ``pynvml`` module, driven by a scenario file: mock only the GPU.

:class:`FakeNvml` has the function names the discovery code calls, with the
signatures and return types of ``nvidia-ml-py`` (the same ctypes structs, filled
in), and it *is* ``pynvml`` for everything else: constants, struct classes and the
``NVMLError`` classes are the real module's, so ``except pynvml.NVMLError_NotSupported``
catches what the stand-in raises and ``exc.value`` is the real code. A function
the stand-in does not implement raises ``NVMLError_FunctionNotFound`` when called,
as a symbol missing from an old driver's ``libnvidia-ml`` does.

A scenario (YAML or JSON; ``tests/agent/scenarios/``)::

    driver_version: "550.54.15"
    cuda_driver_version: 12040        # nvmlSystemGetCudaDriverVersion(_v2)
    missing_functions: [nvmlDeviceGetRemappedRows]   # FunctionNotFound: an old driver
    init_failures: 1                  # the first N nvmlInit calls raise init_error
    init_error: Unknown               # an NVMLError_* suffix
    gpus:
      - uuid: GPU-…                   # required
        name: NVIDIA H100 80GB HBM3
        pci_bus_id: "00000000:18:00.0"
        memory: {total: 85520809984, used: 3276800, free: 85517533184, reserved: 0}
        utilization: {gpu: 87, memory: 41}       # percent, as NVML reports it
        temperature: 41                          # °C
        power_mw: 312000
        power_limit_mw: 700000
        energy_mj: 123456789
        sm_clock_mhz: 1980
        ecc: {corrected: 0, uncorrected: 0}      # volatile totals
        remapped_rows: [0, 0, 0, 0]              # correctable, uncorrectable, pending, failure
        field_values: {142: 0, 144: NotSupported}  # nvmlDeviceGetFieldValues, per field
        mig_mode: [0, 0]                         # current, pending
        nvlink: 18                               # links, all active; or a list of 0/1 per link
        fabric: {state: 3, status: 0, health_summary: 1}
        xid_events: [79]                         # queued when the GPU is registered for events
        lost_after_reads: 2                      # GPU_IS_LOST from the 3rd read on…
        recovers_after_reads: 4                  # …until the 5th read
        mig_devices: [{uuid: MIG-…, name: …, memory: {…}}]

Every reading left out is ``NotSupported``; a reading whose value is an error
name (``NotSupported``, ``NoPermission``, ``Timeout``, ``GpuIsLost`` …) raises it.
A "read" is one ``nvmlDeviceGetCount`` call: :class:`~llmgw.agent.discovery.NvmlSource`
makes one per read, as any poller that notices hot-plugged or lost GPUs does.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pynvml

__all__ = ["FakeNvml", "load_scenario"]


def load_scenario(path: str | Path) -> dict[str, Any]:
    """A scenario file (``.yaml``/``.yml`` or ``.json``) as a dict."""
    path = Path(path)
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a scenario is a mapping")
    return data


def _error(name: str) -> pynvml.NVMLError:
    cls = getattr(pynvml, f"NVMLError_{name}", None)
    if not isinstance(cls, type) or not issubclass(cls, pynvml.NVMLError):
        raise ValueError(f"unknown NVML error name {name!r}")
    return cls()  # the generated subclasses set .value to their code


def _raise(code: int) -> None:
    raise pynvml.NVMLError(code)


def _value(value: Any) -> Any:
    """A scenario value, raising it when it names an error."""
    if isinstance(value, str) and hasattr(pynvml, f"NVMLError_{value}"):
        raise _error(value)
    return value


class _Device:
    def __init__(self, spec: dict[str, Any], index: int, address: int, parent: _Device | None = None):
        if "uuid" not in spec:
            raise ValueError("every GPU in a scenario has a uuid")
        self.spec = spec
        self.index = index
        self.parent = parent
        self.handle = ctypes.cast(ctypes.c_void_p(address), pynvml.c_nvmlDevice_t)
        self.address = address
        self.children = [
            _Device(child, j, address + 0x10 * (j + 1), parent=self)
            for j, child in enumerate(spec.get("mig_devices") or ())
        ]

    def get(self, key: str) -> Any:
        if key not in self.spec:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return _value(self.spec[key])


class _EventSet:
    def __init__(self) -> None:
        self.queue: collections.deque[Any] = collections.deque()
        self.registered: set[int] = set()  # device addresses


def _nvml_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Checks what a real call checks first: a symbol the driver lacks, then init."""

    @functools.wraps(fn)
    def call(self: FakeNvml, *args: Any, **kwargs: Any) -> Any:
        name = fn.__name__
        self.calls[name] += 1
        if name in self._missing:
            _raise(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        if name not in ("nvmlInit", "nvmlInitWithFlags") and self._refcount <= 0:
            _raise(pynvml.NVML_ERROR_UNINITIALIZED)
        return fn(self, *args, **kwargs)

    return call


class FakeNvml:
    """A ``pynvml``-compatible module object over one scenario.

    Args:
        scenario: the scenario (a dict, or a path to a file, see the module docstring).

    Attributes:
        calls: how many times each function was called (for tests).
        reads: ``nvmlDeviceGetCount`` calls so far.
    """

    def __init__(self, scenario: dict[str, Any] | str | Path) -> None:
        if not isinstance(scenario, dict):
            scenario = load_scenario(scenario)
        self.scenario = scenario
        self.calls: collections.Counter[str] = collections.Counter()
        self.reads = 0
        self._missing = set(scenario.get("missing_functions") or ())
        self._refcount = 0
        self._init_failures = int(scenario.get("init_failures", 0))
        self._devices = [
            _Device(spec, i, 0x10000 * (i + 1)) for i, spec in enumerate(scenario.get("gpus") or ())
        ]
        self._by_address: dict[int, _Device] = {}
        for dev in self._devices:
            self._by_address[dev.address] = dev
            for child in dev.children:
                self._by_address[child.address] = child
        self._event_sets: dict[int, _EventSet] = {}
        self._next_event_set = 0x7000

    def __getattr__(self, name: str) -> Any:
        # Everything not implemented here is the real module's: constants, structs, errors.
        # A real NVML *function* the stand-in lacks behaves as a symbol the driver lacks.
        real = getattr(pynvml, name)
        if name.startswith("nvml") and callable(real) and not isinstance(real, type):

            def missing(*args: Any, **kwargs: Any) -> Any:
                self.calls[name] += 1
                _raise(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

            return missing
        return real

    # -- test controls ---------------------------------------------------------------------------

    def queue_xid(self, uuid: str, xid: int) -> None:
        """Deliver an XID event for ``uuid`` to every event set it is registered with."""
        dev = self._find(uuid)
        for events in self._event_sets.values():
            if dev.address in events.registered:
                events.queue.append(self._xid_event(dev, xid))

    @property
    def initialized(self) -> bool:
        return self._refcount > 0

    # -- helpers ---------------------------------------------------------------------------------

    def _find(self, uuid: str) -> _Device:
        for dev in self._by_address.values():
            if dev.spec["uuid"] == uuid:
                return dev
        _raise(pynvml.NVML_ERROR_NOT_FOUND)
        raise AssertionError  # unreachable

    def _lost(self, dev: _Device) -> bool:
        root = dev.parent or dev
        after = root.spec.get("lost_after_reads")
        if after is None or self.reads <= int(after):
            return False
        recovers = root.spec.get("recovers_after_reads")
        return recovers is None or self.reads <= int(recovers)

    def _dev(self, handle: Any) -> _Device:
        try:
            address = ctypes.cast(handle, ctypes.c_void_p).value
        except (TypeError, ctypes.ArgumentError):
            address = None
        dev = self._by_address.get(address or -1)
        if dev is None:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            raise AssertionError  # unreachable
        if self._lost(dev):
            _raise(pynvml.NVML_ERROR_GPU_IS_LOST)
        return dev

    def _check_errors(self, dev: _Device, fn: str) -> None:
        name = (dev.spec.get("errors") or {}).get(fn)
        if name:
            raise _error(name)

    def _xid_event(self, dev: _Device, xid: int) -> pynvml.c_nvmlEventData_t:
        data = pynvml.c_nvmlEventData_t()
        data.device = dev.handle
        data.eventType = pynvml.nvmlEventTypeXidCriticalError
        data.eventData = int(xid)
        return data

    def _device_call(self, fn: str, handle: Any) -> _Device:
        dev = self._dev(handle)
        self._check_errors(dev, fn)
        return dev

    # -- init and system -------------------------------------------------------------------------

    @_nvml_function
    def nvmlInit(self) -> None:
        if self._init_failures > 0:
            self._init_failures -= 1
            raise _error(str(self.scenario.get("init_error", "Unknown")))
        self._refcount += 1

    @_nvml_function
    def nvmlShutdown(self) -> None:
        self._refcount -= 1

    @_nvml_function
    def nvmlSystemGetDriverVersion(self) -> str:
        if "driver_version" not in self.scenario:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return str(_value(self.scenario["driver_version"]))

    @_nvml_function
    def nvmlSystemGetCudaDriverVersion(self) -> int:
        if "cuda_driver_version" not in self.scenario:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return int(_value(self.scenario["cuda_driver_version"]))

    @_nvml_function
    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        return self.nvmlSystemGetCudaDriverVersion.__wrapped__(self)  # type: ignore[attr-defined]

    # -- enumeration -----------------------------------------------------------------------------

    @_nvml_function
    def nvmlDeviceGetCount(self) -> int:
        self.reads += 1
        return len(self._devices)

    @_nvml_function
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        if not 0 <= index < len(self._devices):
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        dev = self._devices[index]
        if self._lost(dev):
            _raise(pynvml.NVML_ERROR_GPU_IS_LOST)
        return dev.handle

    @_nvml_function
    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Any:
        dev = self._find(uuid)
        if self._lost(dev):
            _raise(pynvml.NVML_ERROR_GPU_IS_LOST)
        return dev.handle

    @_nvml_function
    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        return str(self._device_call("nvmlDeviceGetUUID", handle).spec["uuid"])

    @_nvml_function
    def nvmlDeviceGetName(self, handle: Any) -> str:
        return str(self._device_call("nvmlDeviceGetName", handle).get("name"))

    @_nvml_function
    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        dev = self._device_call("nvmlDeviceGetIndex", handle)
        if dev.parent is not None:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return dev.index

    @_nvml_function
    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:
        dev = self._device_call("nvmlDeviceGetPciInfo", handle)
        info = pynvml.nvmlPciInfo_t()
        info.busId = str(dev.get("pci_bus_id")).encode()
        return info

    # -- readings --------------------------------------------------------------------------------

    @_nvml_function
    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        dev = self._device_call("nvmlDeviceGetMemoryInfo", handle)
        if version and "nvmlDeviceGetMemoryInfo_v2" in self._missing:
            _raise(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        mem = dev.get("memory")
        if not version:
            out = pynvml.c_nvmlMemory_t()
            # v1 "used" counts the driver's reservation too (cluster.md §1.3).
            out.used = int(mem.get("used", 0)) + int(mem.get("reserved", 0))
        else:
            if version != pynvml.nvmlMemory_v2:
                _raise(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
            out = pynvml.c_nvmlMemory_v2_t()
            out.version = version
            out.reserved = int(mem.get("reserved", 0))
            out.used = int(mem.get("used", 0))
        out.total = int(mem["total"])
        out.free = int(mem.get("free", out.total - out.used))
        return out

    @_nvml_function
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        dev = self._device_call("nvmlDeviceGetUtilizationRates", handle)
        util = dev.get("utilization")
        out = pynvml.c_nvmlUtilization_t()
        out.gpu, out.memory = int(util["gpu"]), int(util["memory"])
        return out

    @_nvml_function
    def nvmlDeviceGetTemperatureV(self, handle: Any, sensor: int, version: int | None = None) -> int:
        dev = self._device_call("nvmlDeviceGetTemperatureV", handle)
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return int(dev.get("temperature"))

    @_nvml_function
    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        dev = self._device_call("nvmlDeviceGetTemperature", handle)
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return int(dev.get("temperature"))

    @_nvml_function
    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        return int(self._device_call("nvmlDeviceGetPowerUsage", handle).get("power_mw"))

    @_nvml_function
    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Any) -> int:
        return int(self._device_call("nvmlDeviceGetEnforcedPowerLimit", handle).get("power_limit_mw"))

    @_nvml_function
    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Any) -> int:
        return int(self._device_call("nvmlDeviceGetTotalEnergyConsumption", handle).get("energy_mj"))

    @_nvml_function
    def nvmlDeviceGetClockInfo(self, handle: Any, type: int) -> int:
        dev = self._device_call("nvmlDeviceGetClockInfo", handle)
        if type != pynvml.NVML_CLOCK_SM:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return int(dev.get("sm_clock_mhz"))

    @_nvml_function
    def nvmlDeviceGetTotalEccErrors(self, handle: Any, errorType: int, counterType: int) -> int:
        dev = self._device_call("nvmlDeviceGetTotalEccErrors", handle)
        ecc = dev.get("ecc")
        if counterType != pynvml.NVML_VOLATILE_ECC:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        key = "corrected" if errorType == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED else "uncorrected"
        return int(_value(ecc[key]))

    @_nvml_function
    def nvmlDeviceGetRemappedRows(self, handle: Any) -> tuple[int, int, int, int]:
        rows = self._device_call("nvmlDeviceGetRemappedRows", handle).get("remapped_rows")
        cor, unc, pending, failure = (int(v) for v in rows)
        return (cor, unc, pending, failure)

    @_nvml_function
    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: list[Any]) -> Any:
        dev = self._device_call("nvmlDeviceGetFieldValues", handle)
        known = {int(k): v for k, v in (dev.spec.get("field_values") or {}).items()}
        values = (pynvml.c_nvmlFieldValue_t * len(fieldIds))()
        for i, field_id in enumerate(fieldIds):
            fid, scope = field_id if isinstance(field_id, tuple) else (field_id, 0)
            values[i].fieldId, values[i].scopeId = fid, scope
            value = known.get(int(fid), "NotSupported")
            if isinstance(value, str):
                # The call succeeds; this element carries its own failure (cluster.md §1.8).
                values[i].nvmlReturn = _error(value).value
                continue
            values[i].nvmlReturn = pynvml.NVML_SUCCESS
            values[i].valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
            values[i].value.ullVal = int(value)
        return values

    @_nvml_function
    def nvmlDeviceGetNvLinkState(self, handle: Any, link: int) -> int:
        dev = self._device_call("nvmlDeviceGetNvLinkState", handle)
        links = dev.get("nvlink")
        states = [1] * int(links) if isinstance(links, int) else [int(v) for v in links]
        if not 0 <= link < pynvml.NVML_NVLINK_MAX_LINKS:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if link >= len(states):
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return states[link]

    def _fill_fabric(self, fn: str, handle: Any, ref: Any) -> int:
        dev = self._device_call(fn, handle)
        fabric = dev.get("fabric")
        info = getattr(ref, "_obj", ref)  # ctypes.byref(struct), as the real call takes
        version = getattr(info, "version", None)
        max_version = int(fabric.get("max_version", 3))
        if version is not None and (version >> 24) > max_version:
            _raise(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        info.state = int(fabric.get("state", pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED))
        info.status = int(fabric.get("status", pynvml.NVML_SUCCESS))
        if hasattr(info, "healthSummary"):
            info.healthSummary = int(fabric.get("health_summary", 0))
        return int(pynvml.NVML_SUCCESS)

    @_nvml_function
    def nvmlDeviceGetGpuFabricInfoV(self, handle: Any, gpuFabricInfo: Any) -> int:
        return self._fill_fabric("nvmlDeviceGetGpuFabricInfoV", handle, gpuFabricInfo)

    @_nvml_function
    def nvmlDeviceGetGpuFabricInfo(self, handle: Any, gpuFabricInfo: Any) -> int:
        return self._fill_fabric("nvmlDeviceGetGpuFabricInfo", handle, gpuFabricInfo)

    # -- MIG -------------------------------------------------------------------------------------

    @_nvml_function
    def nvmlDeviceGetMigMode(self, handle: Any) -> list[int]:
        mode = self._device_call("nvmlDeviceGetMigMode", handle).get("mig_mode")
        return [int(mode[0]), int(mode[1])]

    @_nvml_function
    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Any) -> int:
        dev = self._device_call("nvmlDeviceGetMaxMigDeviceCount", handle)
        return int(dev.spec.get("max_mig_devices", 7 if dev.children else 0))

    @_nvml_function
    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: Any, index: int) -> Any:
        dev = self._device_call("nvmlDeviceGetMigDeviceHandleByIndex", device)
        if index >= len(dev.children):
            _raise(pynvml.NVML_ERROR_NOT_FOUND)  # an empty slot
        return dev.children[index].handle

    # -- events ----------------------------------------------------------------------------------

    @_nvml_function
    def nvmlEventSetCreate(self) -> Any:
        self._next_event_set += 0x10
        self._event_sets[self._next_event_set] = _EventSet()
        return ctypes.cast(ctypes.c_void_p(self._next_event_set), pynvml.c_nvmlEventSet_t)

    def _events(self, event_set: Any) -> _EventSet:
        events = self._event_sets.get(ctypes.cast(event_set, ctypes.c_void_p).value or -1)
        if events is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return events

    @_nvml_function
    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None:
        dev = self._device_call("nvmlDeviceRegisterEvents", handle)
        events = self._events(eventSet)
        if dev.address in events.registered:
            return
        events.registered.add(dev.address)
        if eventTypes & pynvml.nvmlEventTypeXidCriticalError:
            for xid in dev.spec.get("xid_events") or ():
                events.queue.append(self._xid_event(dev, int(xid)))

    @_nvml_function
    def nvmlEventSetWait(self, eventSet: Any, timeoutms: int) -> Any:
        events = self._events(eventSet)
        if not events.queue:
            _raise(pynvml.NVML_ERROR_TIMEOUT)  # the stand-in never blocks
        return events.queue.popleft()

    @_nvml_function
    def nvmlEventSetFree(self, eventSet: Any) -> None:
        address = ctypes.cast(eventSet, ctypes.c_void_p).value
        self._events(eventSet)
        del self._event_sets[address or -1]
