"""GPU discovery through ``nvidia-smi --query-gpu`` (the fallback when NVML is missing or fails).

One run per read: ``nvidia-smi --query-gpu=<fields> --format=csv,noheader,nounits``,
with a timeout and a bound on the output it keeps.

**Old drivers.** A field the installed driver does not know either makes the
whole query fail (``Field "utilization.gpu" is not a valid field to query.``,
exit 2) or, on some drivers, yields a shorter row. Both are handled so that an
upgrade of llmgw never stops discovering GPUs on such a node:

* every field past the identity and memory columns is optional; an optional
  field the driver names as invalid is dropped, remembered, and the query run
  again without it;
* the fields most likely to be missing come last (``utilization.gpu`` is the
  very last), so a short row loses only its tail: missing trailing columns are
  absent.

``[N/A]``, ``[Not Supported]``, ``N/A`` and any other bracketed answer are absent
(``None``), never 0.

**Failures keep the GPUs listed** (:class:`~llmgw.agent.discovery.seen.SeenGPUs`): a run
that fails as a whole (timeout, an exit status without rows, no GPU rows at all) reports
the GPUs of the last answer by their identity, ``health="unknown"``, the failure in the
node's errors; a GPU seen before and missing from an answer is ``health="error"``, with
the line naming its PCI bus id ("… GPU is lost …") in its own errors when there is one.
"""

from __future__ import annotations

import csv
import dataclasses
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from typing import Any

from ..model import GPU, Discovery, NodeFacts
from .seen import SeenGPUs

__all__ = ["FIELDS", "REQUIRED_FIELDS", "SmiSource", "parse_rows"]

MIB = 1024 * 1024

# (nvidia-smi field, GPU attribute, converter). Order matters: see the module docstring.
FIELDS: tuple[tuple[str, str | None, Callable[[str], Any]], ...] = (
    ("uuid", "uuid", str),
    ("index", "index", int),
    ("name", "name", str),
    ("pci.bus_id", "pci_bus_id", str),
    ("memory.total", "memory_total_bytes", lambda v: int(float(v) * MIB)),
    ("memory.used", "memory_used_bytes", lambda v: int(float(v) * MIB)),
    ("memory.free", "memory_free_bytes", lambda v: int(float(v) * MIB)),
    ("temperature.gpu", "temperature_celsius", float),
    ("power.draw", "power_watts", float),
    ("power.limit", "power_limit_watts", float),
    ("clocks.sm", "sm_clock_mhz", float),
    ("ecc.errors.corrected.volatile.total", "ecc_corrected_volatile", int),
    ("ecc.errors.uncorrected.volatile.total", "ecc_uncorrected_volatile", int),
    ("mig.mode.current", "mig_mode", lambda v: v.strip().lower() == "enabled"),
    ("driver_version", None, str),
    ("utilization.memory", "utilization_memory_ratio", lambda v: float(v) / 100.0),
    ("utilization.gpu", "utilization_gpu_ratio", lambda v: float(v) / 100.0),
)
# Old enough to be in every driver llmgw meets; a driver that lacks one of these is an error.
REQUIRED_FIELDS = ("uuid", "index", "name", "pci.bus_id", "memory.total", "memory.used", "memory.free")

_ABSENT = {"n/a", "not supported", "unknown error", "insufficient permissions", ""}
_INVALID_FIELD = re.compile(r'Field "([^"]+)" is not a valid field to query')
# A PCI bus id as nvidia-smi writes it: "00000000:3B:00.0" in rows, "0000:3B:00.0" in its error lines
# (the domain is always written: a time such as 10:45:12.3 is not a bus id).
_BUS_ID = re.compile(r"([0-9a-f]{4,8}):([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])", re.IGNORECASE)
_MAX_OUTPUT = 1 << 20  # 1 MiB: a few hundred GPUs' rows; more is not nvidia-smi answering
_MAX_ERROR_TEXT = 500


def _absent(value: str) -> bool:
    v = value.strip()
    return (v.startswith("[") and v.endswith("]")) or v.lower() in _ABSENT


def parse_rows(text: str, fields: tuple[str, ...]) -> tuple[list[dict[str, str | None]], list[str]]:
    """Rows of ``--format=csv,noheader,nounits`` output, each ``{field: value or None}``.

    A row shorter than ``fields`` has its missing tail absent. Lines that are not
    rows (no ``GPU-`` UUID in the first column: a per-GPU error such as "Unable to
    determine the device handle for GPU 0000:3B:00.0: GPU is lost") are returned
    as errors.

    Returns:
        (rows, error lines)
    """
    rows: list[dict[str, str | None]] = []
    errors: list[str] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        cols = next(csv.reader([line], skipinitialspace=True))
        if not cols or not cols[0].strip().startswith(("GPU-", "MIG-")):
            errors.append(line.strip()[:_MAX_ERROR_TEXT])
            continue
        row: dict[str, str | None] = {}
        for i, f in enumerate(fields):
            value = cols[i].strip() if i < len(cols) else None
            row[f] = None if value is None or _absent(value) else value
        rows.append(row)
    return rows, errors


class SmiSource:
    """GPU discovery through the ``nvidia-smi`` executable: :meth:`read` returns one :class:`Discovery`.

    Args:
        path: the executable (a name looked up on PATH, or a path).
        facts: called on every read for the node's facts (the driver version is filled in).
        timeout: seconds one run may take (a hung driver blocks nvidia-smi for minutes).
    """

    name = "nvidia-smi"

    def __init__(
        self,
        path: str = "nvidia-smi",
        *,
        facts: Callable[[], NodeFacts] | None = None,
        timeout: float = 10.0,
    ) -> None:
        self.path = path
        self._facts = facts or (lambda: NodeFacts(hostname=""))
        self._timeout = timeout
        self._dropped: set[str] = set()  # optional fields this driver does not know
        self._probed = False
        self._seen = SeenGPUs(self.name)
        self._lock = threading.Lock()

    @property
    def fields(self) -> tuple[str, ...]:
        """The fields asked for now (without the ones the driver said it does not know)."""
        return tuple(f for f, _, _ in FIELDS if f not in self._dropped)

    def available(self) -> bool:
        """Whether the executable exists (on PATH or at the path given)."""
        return shutil.which(self.path) is not None

    def close(self) -> None:
        """Nothing held between runs."""

    def read(self) -> Discovery:
        """Run ``nvidia-smi`` once.

        Returns:
            The node's GPUs with ``source="nvidia-smi"``. A failed run (missing
            executable, timeout, "Failed to initialize NVML: Unknown Error", no GPU rows)
            has the failure in ``errors``, retried on the next read, and the GPUs seen
            before by their identity (``health="unknown"``; none when none were seen); a
            GPU seen before and missing from an answer is kept with ``health="error"``.
        """
        with self._lock:
            d = self._query()
            lost = self._lost(d)
            if lost:  # (said on the GPU it names, not the node)
                d = dataclasses.replace(d, errors=tuple(e for e in d.errors if e not in lost.values()))
            if d.gpus:
                return self._seen.answered(d, lost)
            if self._seen.gpus and not d.errors:
                d = dataclasses.replace(d, errors=("nvidia-smi listed no GPUs",))
            return self._seen.failed(d, lost)

    def _lost(self, d: Discovery) -> dict[str, str]:
        """The GPUs seen before that an error line names by PCI bus id ("Unable to determine the
        device handle for GPU0000:3B:00.0: GPU is lost"), and the line, by UUID."""
        by_bus = {k: g.uuid for g in self._seen.gpus if g.pci_bus_id and (k := _pci_key(g.pci_bus_id))}
        lost: dict[str, str] = {}
        for e in d.errors:
            for m in _BUS_ID.finditer(e):
                uuid = by_bus.get(_pci_match_key(m))
                if uuid is not None and uuid not in {g.uuid for g in d.gpus}:
                    lost.setdefault(uuid, e)
        return lost

    def _query(self) -> Discovery:
        facts = self._facts()
        for _ in range(len(FIELDS)):  # at most one retry per optional field
            fields = self.fields
            rc, out, err = self._run(fields)
            if rc is None:
                return Discovery(facts=facts, source=self.name, errors=(err,))
            unknown = set(_INVALID_FIELD.findall(out + "\n" + err))
            if rc != 0 and unknown:
                required = unknown & set(REQUIRED_FIELDS)
                if required or not unknown & set(fields):
                    msg = f"nvidia-smi does not know the field(s) {', '.join(sorted(unknown))}"
                    return Discovery(facts=facts, source=self.name, errors=(msg,))
                self._dropped |= unknown
                continue
            break
        rows, line_errors = parse_rows(out, fields)
        if not self._probed and any(len(r) < len(fields) for r in _raw_rows(out)):
            # A short row: the driver left out fields it does not know, and only the tail's
            # position is certain. Ask each optional field alone once, drop the unknown ones,
            # and ask again; a row still short after that has its tail absent.
            self._probed = True
            if self._probe(fields):
                return self._query()
        errors = list(line_errors)
        if rc != 0 and not rows:
            # (one error a line: a line naming a GPU's bus id is said on that GPU, see read)
            lines = line_errors or [(err.strip() or f"exit status {rc}")[:_MAX_ERROR_TEXT]]
            return Discovery(facts=facts, source=self.name, errors=tuple(f"nvidia-smi: {t}" for t in lines))
        if rc != 0:
            errors.append(f"nvidia-smi: exit status {rc}")
        gpus = [_gpu(row, errors) for row in rows]
        driver = next((r["driver_version"] for r in rows if r.get("driver_version")), None)
        facts = dataclasses.replace(facts, driver_version=driver)
        return Discovery(facts=facts, gpus=tuple(g for g in gpus if g), source=self.name, errors=tuple(errors))

    def _probe(self, fields: tuple[str, ...]) -> bool:
        """Find the optional fields the driver does not know, one run each; whether any were."""
        unknown = set()
        for f in fields:
            if f in REQUIRED_FIELDS:
                continue
            rc, out, err = self._run(("uuid", f))
            if rc is None:
                return False  # not answering now: keep what we have
            rows = _raw_rows(out)
            if (rc != 0 and f in _INVALID_FIELD.findall(out + "\n" + err)) or (rows and min(map(len, rows)) < 2):
                unknown.add(f)
        self._dropped |= unknown
        return bool(unknown)

    def _run(self, fields: tuple[str, ...]) -> tuple[int | None, str, str]:
        """Run the query; ``(None, "", reason)`` when it could not run or did not finish."""
        cmd = [self.path, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"]
        # Output goes to files, not pipes: what is kept is bounded without reading it all.
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            try:
                proc = subprocess.run(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, timeout=self._timeout)
            except FileNotFoundError:
                return None, "", f"nvidia-smi not found: {self.path}"
            except PermissionError as exc:
                return None, "", f"nvidia-smi: {exc}"
            except subprocess.TimeoutExpired:
                return None, "", f"nvidia-smi did not answer within {self._timeout:g} s"
            out.seek(0)
            err.seek(0)
            stdout = out.read(_MAX_OUTPUT + 1)
            stderr = err.read(_MAX_OUTPUT)
        if len(stdout) > _MAX_OUTPUT:
            return None, "", f"nvidia-smi answered more than {_MAX_OUTPUT} bytes"
        return proc.returncode, stdout.decode(errors="replace"), stderr.decode(errors="replace")


def _pci_match_key(m: re.Match[str]) -> tuple[int, int, int, int]:
    domain, bus, dev, fn = m.groups()
    return int(domain, 16), int(bus, 16), int(dev, 16), int(fn)


def _pci_key(bus_id: str) -> tuple[int, int, int, int] | None:
    """A PCI bus id, whatever its zero padding and case: ``00000000:3B:00.0`` = ``0000:3b:00.0``."""
    m = _BUS_ID.fullmatch(bus_id.strip())
    return _pci_match_key(m) if m else None


def _raw_rows(text: str) -> list[list[str]]:
    """The CSV rows that are GPU rows (first column a UUID)."""
    out = []
    for line in text.splitlines():
        cols = next(csv.reader([line], skipinitialspace=True), [])
        if cols and cols[0].strip().startswith(("GPU-", "MIG-")):
            out.append(cols)
    return out


def _gpu(row: dict[str, str | None], errors: list[str]) -> GPU | None:
    values: dict[str, Any] = {}
    for f, attr, conv in FIELDS:
        raw = row.get(f)
        if attr is None or raw is None:
            continue
        try:
            values[attr] = conv(raw)
        except ValueError:
            errors.append(f"nvidia-smi: {f} of {row.get('uuid')}: unreadable value {raw[:40]!r}")
    if "uuid" not in values:
        return None
    health = "degraded" if (values.get("ecc_uncorrected_volatile") or 0) > 0 else "ok"
    return GPU(health=health, **values)
