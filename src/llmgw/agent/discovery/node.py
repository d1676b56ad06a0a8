"""The node's own facts: hostname, OS, kernel, CPU, memory, InfiniBand ports.

Read from ``/etc/os-release``, ``/proc`` and ``/sys/class/infiniband`` under a
root directory (``/`` on a node; a fake tree in tests). Whatever a file does not
say is absent, as for GPUs.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

from ..model import InfinibandPort, NodeFacts

__all__ = ["infiniband_ports", "node_facts"]

# /proc/cpuinfo keys naming the model, by architecture: x86 "model name", some ARM
# kernels "Model"/"Hardware", POWER "cpu", s390 "processor 0"-style lines skipped.
_CPU_MODEL_KEYS = ("model name", "Model", "Hardware", "cpu model", "cpu")
_RATE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*Gb/sec")


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


def _os_name(root: Path) -> str | None:
    for rel in ("etc/os-release", "usr/lib/os-release"):
        text = _read(root / rel)
        if text is None:
            continue
        for line in text.splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "PRETTY_NAME":
                return value.strip().strip('"').strip("'") or None
    return None


def _cpu_model(root: Path) -> str | None:
    text = _read(root / "proc/cpuinfo")
    if text is None:
        return None
    found: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        key = key.strip()
        if sep and key in _CPU_MODEL_KEYS and key not in found and value.strip():
            found[key] = value.strip()
    return next((found[k] for k in _CPU_MODEL_KEYS if k in found), None)


def _cpu_cores() -> int | None:
    # The CPUs this process may run on (a cgroup/taskset limit), else all of them.
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def _meminfo(root: Path) -> tuple[int | None, int | None]:
    text = _read(root / "proc/meminfo")
    if text is None:
        return None, None
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            scale = 1024 if len(parts) > 1 and parts[1] == "kB" else 1
            values[key.strip()] = int(parts[0]) * scale
    return values.get("MemTotal"), values.get("MemAvailable")


def _counter(path: Path, scale: int = 1) -> int | None:
    text = _read(path)
    if text is None:
        return None
    text = text.strip()
    # Some devices answer "N/A (no PMA)" (cluster.md §3.4): absent.
    return int(text) * scale if text.isdigit() else None


def infiniband_ports(root: str | os.PathLike[str] = "/") -> tuple[InfinibandPort, ...]:
    """Every port under ``<root>/sys/class/infiniband/<device>/ports/<n>/``, by device and port.

    ``port_rcv_data``/``port_xmit_data`` count 4-octet words (cluster.md §3.4): bytes are ×4.
    """
    base = Path(root) / "sys/class/infiniband"
    try:
        devices = sorted(p for p in base.iterdir() if p.is_dir())
    except OSError:
        return ()
    out: list[InfinibandPort] = []
    for dev in devices:
        try:
            ports = sorted((p for p in (dev / "ports").iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
        except OSError:
            continue
        for port in ports:
            state = _read(port / "state")
            rate = _read(port / "rate")
            match = _RATE.match(rate) if rate else None
            counters = port / "counters"
            out.append(
                InfinibandPort(
                    device=dev.name,
                    port=int(port.name),
                    # "4: ACTIVE" -> "ACTIVE"
                    state=(state.strip().partition(":")[2].strip() or state.strip()) if state else None,
                    rate_gbps=float(match.group(1)) if match else None,
                    rcv_bytes=_counter(counters / "port_rcv_data", 4),
                    xmit_bytes=_counter(counters / "port_xmit_data", 4),
                    link_downed=_counter(counters / "link_downed"),
                    symbol_errors=_counter(counters / "symbol_error"),
                )
            )
    return tuple(out)


def node_facts(agent_version: str | None = None, *, root: str | os.PathLike[str] = "/") -> NodeFacts:
    """The node's facts as of now.

    Args:
        agent_version: the agent's version, reported as is (``llmgw.__version__``).
        root: where ``etc/``, ``proc/`` and ``sys/`` are read from (tests pass a fake tree).
            Hostname, kernel and CPU count come from this process's own system calls.
    """
    base = Path(root)
    total, available = _meminfo(base)
    return NodeFacts(
        hostname=socket.gethostname(),
        os=_os_name(base),
        kernel=os.uname().release,
        cpu_model=_cpu_model(base),
        cpu_cores=_cpu_cores(),
        memory_total_bytes=total,
        memory_available_bytes=available,
        agent_version=agent_version,
        infiniband=infiniband_ports(base),
    )
