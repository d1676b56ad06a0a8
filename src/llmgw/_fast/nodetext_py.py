"""A node's cluster readings as Prometheus text, straight from the heartbeat's wire bytes: the pure twin of
``nodetext.pyx``.

This module is the readable spec; the compiled module matches it byte for byte and error for error.

``render_message(msg, node, opens)`` is ``render(msg.SerializeToString(), node, opens)`` for a parsed
message (what the collector calls: the pure twin walks the message, the compiled one reads its bytes).

``render(data, node, opens)`` reads ``data``, a serialized ``llmgw.agent.v1.Discovery``
(``proto/llmgw/agent/v1/agent.proto``; what ``SerializeToString`` of the heartbeat's message gives), and
returns one ``bytes`` per slot of :data:`SLOTS` (``b""`` where the node has no sample): the sample
lines of the node's readings, each line ``opens[slot] + labels + "} " + value + "\\n"``. ``opens`` are
the families' ``name{`` prefixes, in :data:`SLOTS` order (the caller owns the names and their
``_total`` suffixes). ``node`` is the node's name (escaped here like every label value).

The wire is read as protobuf parsers read it: fields in any order, a scalar field seen twice keeps its
last value, ``facts`` seen twice is merged, unknown fields (and known ones on an unexpected wire type)
are skipped, strings must be valid UTF-8. A malformed message raises :class:`ValueError` (nothing is
rendered from it). What is rendered does not depend on the order fields came in: each message is read
whole, then rendered in field-number order (the order ``ListFields`` gives), so the output is that of
a renderer walking the parsed message:

* ``cpu_cores``, ``memory_total_bytes``, ``memory_available_bytes`` of the facts, when set;
* ``discovery_errors``: the count of the node's ``errors`` (always);
* per InfiniBand port, in order: receive and transmit bytes, when set, labelled ``device`` and ``port``;
* per GPU, in order, labelled ``node``, ``gpu_uuid``, ``gpu_index`` (``""`` when unset): its info line
  (``gpu_model``, ``pci_bus_id``, ``parent_gpu_uuid``, ``""`` when unset), then each reading that is set:
  integers as integers, doubles as ``repr`` (non-finite ones as ``+Inf``, ``-Inf``, ``NaN``), the SM
  clock in hertz, ECC errors and remapped rows with their kind, flags as ``1.0``/``0.0``, one sample
  per XID code, one per fabric state (1 on the current one); and one per health state, 1 on the
  current one (``ok``/``degraded``/``error`` read as ``healthy``/``degraded``/``unhealthy``; another
  word as it is, an empty one as ``unknown``).

Absent is not zero: a reading the agent did not set has no line.
"""

from __future__ import annotations

import struct
from typing import Any

__all__ = ["FABRIC_STATES", "HEALTH_STATES", "SLOTS", "render", "render_message"]

SLOTS: tuple[str, ...] = (
    "llmgw_node_cpu_cores",
    "llmgw_node_memory_total_bytes",
    "llmgw_node_memory_available_bytes",
    "llmgw_node_discovery_errors",
    "llmgw_node_ib_port_receive_bytes",
    "llmgw_node_ib_port_transmit_bytes",
    "llmgw_gpu_info",
    "llmgw_gpu_memory_total_bytes",
    "llmgw_gpu_memory_used_bytes",
    "llmgw_gpu_memory_free_bytes",
    "llmgw_gpu_utilization_ratio",
    "llmgw_gpu_memory_bandwidth_utilization_ratio",
    "llmgw_gpu_temperature_celsius",
    "llmgw_gpu_power_watts",
    "llmgw_gpu_power_limit_watts",
    "llmgw_gpu_energy_joules",
    "llmgw_gpu_sm_clock_hertz",
    "llmgw_gpu_ecc_errors",
    "llmgw_gpu_remapped_rows",
    "llmgw_gpu_row_remap_pending",
    "llmgw_gpu_row_remap_failure",
    "llmgw_gpu_xid_errors",
    "llmgw_gpu_mig_mode",
    "llmgw_gpu_nvlink_active_links",
    "llmgw_gpu_fabric_state",
    "llmgw_gpu_health_state",
)
"""The families :func:`render` writes, by slot (family names: counters without ``_total``)."""

(S_CPU, S_MEM_TOTAL, S_MEM_AVAIL, S_ERRORS, S_IB_RCV, S_IB_XMIT, S_INFO, S_GMEM_TOTAL, S_GMEM_USED, S_GMEM_FREE,
 S_UTIL, S_MEMBW, S_TEMP, S_POWER, S_POWER_LIMIT, S_ENERGY, S_SM_CLOCK, S_ECC, S_REMAP, S_REMAP_PENDING,
 S_REMAP_FAILURE, S_XID, S_MIG, S_NVLINK, S_FABRIC, S_HEALTH) = range(len(SLOTS))

HEALTH_STATES = {"ok": "healthy", "degraded": "degraded", "error": "unhealthy"}
"""The agent's word -> the exported state (fleet.md §1.5 names); another word is exported as it is."""
FABRIC_STATES = ("not_supported", "not_started", "in_progress", "completed")

_MASK64 = (1 << 64) - 1
_MASK32 = (1 << 32) - 1
_MAX_GROUP_DEPTH = 64
_VARINT, _I64, _LEN, _SGROUP, _EGROUP, _I32 = 0, 1, 2, 3, 4, 5

# Gpu fields by number: (slot, kind, extra); kinds: integer, double, labelled integer, flag
_G_INT, _G_FLOAT, _G_LABELLED, _G_FLAG = range(4)
_GPU_READINGS: dict[int, tuple[int, int, Any]] = {
    6: (S_GMEM_TOTAL, _G_INT, None),
    7: (S_GMEM_USED, _G_INT, None),
    8: (S_GMEM_FREE, _G_INT, None),
    9: (S_UTIL, _G_FLOAT, 1.0),
    10: (S_MEMBW, _G_FLOAT, 1.0),
    11: (S_TEMP, _G_FLOAT, 1.0),
    12: (S_POWER, _G_FLOAT, 1.0),
    13: (S_POWER_LIMIT, _G_FLOAT, 1.0),
    14: (S_ENERGY, _G_FLOAT, 1.0),
    15: (S_SM_CLOCK, _G_FLOAT, 1e6),  # MHz on the wire, hertz on the page
    16: (S_ECC, _G_LABELLED, ',error_type="corrected"} '),
    17: (S_ECC, _G_LABELLED, ',error_type="uncorrected"} '),
    18: (S_REMAP, _G_LABELLED, ',kind="correctable"} '),
    19: (S_REMAP, _G_LABELLED, ',kind="uncorrectable"} '),
    20: (S_REMAP_PENDING, _G_FLAG, None),
    21: (S_REMAP_FAILURE, _G_FLAG, None),
    23: (S_MIG, _G_FLAG, None),
    24: (S_NVLINK, _G_INT, None),
}
# the wire type each known field is read on, per message (another wire type: skipped, as unknown)
_DISCOVERY = {1: _LEN, 2: _LEN, 3: _LEN, 4: _LEN}
_FACTS = {1: _LEN, 2: _LEN, 3: _LEN, 4: _LEN, 5: _VARINT, 6: _VARINT, 7: _VARINT, 8: _LEN, 9: _LEN, 10: _LEN,
          11: _LEN}
_PORT = {1: _LEN, 2: _VARINT, 3: _LEN, 4: _I64, 5: _VARINT, 6: _VARINT, 7: _VARINT, 8: _VARINT}
_XID = {1: _VARINT, 2: _VARINT}
_GPU = {1: _LEN, 2: _VARINT, 3: _LEN, 4: _LEN, 5: _LEN, **{n: _VARINT for n in (6, 7, 8, 16, 17, 18, 19)},
        **{n: _I64 for n in range(9, 16)}, 20: _VARINT, 21: _VARINT, 22: _LEN, 23: _VARINT, 24: _VARINT,
        25: _VARINT, 26: _LEN, 27: _VARINT, 28: _LEN, 29: _LEN}
# the string fields (checked as UTF-8), per message
_STRINGS_DISCOVERY = frozenset((3, 4))
_STRINGS_FACTS = frozenset((1, 2, 3, 4, 8, 9, 10))
_STRINGS_PORT = frozenset((1, 3))
_STRINGS_GPU = frozenset((1, 3, 4, 5, 26, 28, 29))
_BAD = "not a Discovery message"
_DOUBLE = struct.Struct("<d")


def _varint(b: bytes, i: int, end: int) -> tuple[int, int]:
    """The varint at ``i`` (at most 10 bytes, read modulo 2**64) and the index after it."""
    out = shift = 0
    while True:
        if i >= end or shift > 63:
            raise ValueError(_BAD)
        c = b[i]
        i += 1
        out |= (c & 0x7F) << shift
        if c < 0x80:
            return out & _MASK64, i
        shift += 7


def _fields(b: bytes, i: int, end: int, known: dict[int, int], strings: frozenset[int]) -> list[tuple[int, Any]]:
    """The fields of the message in ``b[i:end]`` that ``known`` has on their wire type, in wire order:
    ``(number, value)``, a varint as an int, a fixed64 as its 8 bytes, a length-delimited one as
    ``(start, end)`` (a string field checked as UTF-8). The rest are skipped; malformed: ValueError."""
    out: list[tuple[int, Any]] = []
    while i < end:
        tag, i = _varint(b, i, end)
        num, wt = tag >> 3, tag & 7
        if num == 0 or tag > _MASK32:
            raise ValueError(_BAD)
        value: Any
        if wt == _VARINT:
            value, i = _varint(b, i, end)
        elif wt == _I64:
            if end - i < 8:
                raise ValueError(_BAD)
            value, i = b[i:i + 8], i + 8
        elif wt == _LEN:
            n, i = _varint(b, i, end)
            if n > end - i:
                raise ValueError(_BAD)
            value, i = (i, i + n), i + n
            if num in strings and known.get(num) == _LEN:
                try:
                    b[i - n:i].decode("utf-8")
                except UnicodeDecodeError:
                    raise ValueError(_BAD) from None  # (the same error as any other malformation)
        elif wt == _I32:
            if end - i < 4:
                raise ValueError(_BAD)
            value, i = None, i + 4
        elif wt == _SGROUP:
            i = _skip_group(b, i, end, num, 1)
            continue
        else:  # an end-group with no group open, or wire types 6 and 7
            raise ValueError(_BAD)
        if known.get(num) == wt:
            out.append((num, value))
    if i != end:
        raise ValueError(_BAD)
    return out


def _skip_group(b: bytes, i: int, end: int, num: int, depth: int) -> int:
    """The index after the (unknown) group ``num`` that starts at ``i``."""
    if depth > _MAX_GROUP_DEPTH:
        raise ValueError(_BAD)
    while i < end:
        tag, i = _varint(b, i, end)
        n, wt = tag >> 3, tag & 7
        if n == 0 or tag > _MASK32:
            raise ValueError(_BAD)
        if wt == _VARINT:
            _, i = _varint(b, i, end)
        elif wt == _I64:
            i += 8
        elif wt == _LEN:
            ln, i = _varint(b, i, end)
            i += ln
        elif wt == _I32:
            i += 4
        elif wt == _SGROUP:
            i = _skip_group(b, i, end, n, depth + 1)
        elif wt == _EGROUP:
            if n != num:
                raise ValueError(_BAD)
            return i
        else:
            raise ValueError(_BAD)
        if i > end:
            raise ValueError(_BAD)
    raise ValueError(_BAD)


def _unpack(raw: bytes) -> float:
    return float(_DOUBLE.unpack(raw)[0])


def _num(v: float) -> str:
    """A double as Prometheus text: ``repr`` (exact, parses), non-finite ones as Prometheus spells them."""
    if v - v == 0:
        return repr(v)
    return "NaN" if v != v else ("+Inf" if v > 0 else "-Inf")


def _escape(v: str) -> str:
    if "\\" in v or '"' in v or "\n" in v:
        return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
    return v


def _text(b: bytes, span: tuple[int, int]) -> str:
    s, e = span
    return b[s:e].decode("utf-8")


def render(data: bytes, node: str, opens: tuple[bytes, ...]) -> tuple[bytes, ...]:
    """The node's reading lines per slot of :data:`SLOTS` (module docstring).

    Raises:
        ValueError: ``data`` is not a well-formed ``Discovery`` message (a string that is not UTF-8
            too: a plain ``ValueError`` with the same message whatever the malformation, so the
            twins, which meet a message's faults in different orders, raise the same error), or
            ``opens`` has not one prefix per slot (:class:`UnicodeDecodeError` for a prefix that
            is not UTF-8).
        TypeError: ``data`` is not ``bytes``, ``node`` not ``str``, ``opens`` not a tuple of ``bytes``.
    """
    if not isinstance(data, bytes) or not isinstance(node, str) or not isinstance(opens, tuple):
        raise TypeError("render(data: bytes, node: str, opens: tuple[bytes, ...])")
    if len(opens) != len(SLOTS):
        raise ValueError(f"opens: {len(SLOTS)} prefixes expected, got {len(opens)}")
    if not all(isinstance(o, bytes) for o in opens):
        raise TypeError("opens: a tuple of bytes")
    op = [o.decode("utf-8") for o in opens]
    b = data
    parts: list[list[str]] = [[] for _ in SLOTS]
    n = _escape(node)
    nl = f'node="{n}"}} '
    facts: dict[int, Any] = {}
    ports: list[dict[int, Any]] = []
    gpus: list[tuple[int, int]] = []
    n_errors = 0
    for num, value in _fields(b, 0, len(b), _DISCOVERY, _STRINGS_DISCOVERY):
        s, e = value
        if num == 1:  # facts: merged, as a parser merges a message field seen twice
            for fnum, fvalue in _fields(b, s, e, _FACTS, _STRINGS_FACTS):
                if fnum == 11:
                    ps, pe = fvalue
                    ports.append(dict(_fields(b, ps, pe, _PORT, _STRINGS_PORT)))
                else:
                    facts[fnum] = fvalue
        elif num == 2:
            gpus.append((s, e))
        elif num == 4:
            n_errors += 1
    for fnum, slot in ((5, S_CPU), (6, S_MEM_TOTAL), (7, S_MEM_AVAIL)):
        if fnum in facts:
            v = facts[fnum]
            parts[slot].append(f"{op[slot]}{nl}{v & _MASK32 if fnum == 5 else v}\n")
    parts[S_ERRORS].append(f"{op[S_ERRORS]}{nl}{n_errors}\n")
    for p in ports:
        device = _escape(_text(b, p[1])) if 1 in p else ""
        pl = f'node="{n}",device="{device}",port="{p.get(2, 0) & _MASK32}"}} '
        if 5 in p:
            parts[S_IB_RCV].append(f"{op[S_IB_RCV]}{pl}{p[5]}\n")
        if 6 in p:
            parts[S_IB_XMIT].append(f"{op[S_IB_XMIT]}{pl}{p[6]}\n")
    for s, e in gpus:
        _render_gpu(b, s, e, n, op, parts)
    return tuple("".join(lines).encode() for lines in parts)


def _render_gpu(b: bytes, s: int, e: int, n: str, op: list[str], parts: list[list[str]]) -> None:
    g: dict[int, Any] = {}
    xids: list[tuple[int, int]] = []
    for num, value in _fields(b, s, e, _GPU, _STRINGS_GPU):
        if num == 22:
            xs, xe = value
            x = dict(_fields(b, xs, xe, _XID, frozenset()))
            xids.append((x.get(1, 0) & _MASK32, x.get(2, 0)))
        elif num != 29:
            g[num] = value

    def text(num: int) -> str:
        return _escape(_text(b, g[num])) if num in g else ""

    index = g[2] & _MASK32 if 2 in g else ""
    gp = f'node="{n}",gpu_uuid="{text(1)}",gpu_index="{index}"'
    gl = gp + "} "
    parts[S_INFO].append(f'{op[S_INFO]}{gp},gpu_model="{text(3)}",pci_bus_id="{text(4)}",'
                         f'parent_gpu_uuid="{text(5)}"}} 1.0\n')
    for num in sorted(g):  # field-number order, as ListFields gives
        spec = _GPU_READINGS.get(num)
        if spec is None:
            continue
        slot, kind, extra = spec
        v = g[num]
        if kind == _G_FLOAT:
            parts[slot].append(f"{op[slot]}{gl}{_num(_unpack(v) * extra)}\n")
        elif kind == _G_INT:
            parts[slot].append(f"{op[slot]}{gl}{v & _MASK32 if num == 24 else v}\n")
        elif kind == _G_LABELLED:
            parts[slot].append(f"{op[slot]}{gp}{extra}{v}\n")
        else:
            parts[slot].append(f"{op[slot]}{gl}{'1.0' if v else '0.0'}\n")
    for code, count in xids:
        parts[S_XID].append(f'{op[S_XID]}{gp},xid="{code}"}} {count}\n')
    if 26 in g:
        fabric = _text(b, g[26])
        for st in dict.fromkeys([*FABRIC_STATES, fabric]):
            parts[S_FABRIC].append(f'{op[S_FABRIC]}{gp},state="{_escape(st)}"}} {"1.0" if st == fabric else "0.0"}\n')
    h = (_text(b, g[28]) if 28 in g else "") or "unknown"
    state = HEALTH_STATES.get(h, h)
    lst = parts[S_HEALTH]
    for st in dict.fromkeys([*HEALTH_STATES.values(), state]):
        lst.append(f'{op[S_HEALTH]}{gp},state="{_escape(st)}"}} {"1.0" if st == state else "0.0"}\n')



# -- from the parsed message --

# Gpu fields by name, as ListFields names them: (slot, kind, extra)
_M_XID, _M_FABRIC = 4, 5
_GPU_BY_NAME: dict[str, tuple[int, int, Any]] = {
    "memory_total_bytes": (S_GMEM_TOTAL, _G_INT, None),
    "memory_used_bytes": (S_GMEM_USED, _G_INT, None),
    "memory_free_bytes": (S_GMEM_FREE, _G_INT, None),
    "utilization_gpu_ratio": (S_UTIL, _G_FLOAT, 1.0),
    "utilization_memory_ratio": (S_MEMBW, _G_FLOAT, 1.0),
    "temperature_celsius": (S_TEMP, _G_FLOAT, 1.0),
    "power_watts": (S_POWER, _G_FLOAT, 1.0),
    "power_limit_watts": (S_POWER_LIMIT, _G_FLOAT, 1.0),
    "energy_joules": (S_ENERGY, _G_FLOAT, 1.0),
    "sm_clock_mhz": (S_SM_CLOCK, _G_FLOAT, 1e6),
    "ecc_corrected_volatile": (S_ECC, _G_LABELLED, ',error_type="corrected"} '),
    "ecc_uncorrected_volatile": (S_ECC, _G_LABELLED, ',error_type="uncorrected"} '),
    "remapped_rows_correctable": (S_REMAP, _G_LABELLED, ',kind="correctable"} '),
    "remapped_rows_uncorrectable": (S_REMAP, _G_LABELLED, ',kind="uncorrectable"} '),
    "remapped_rows_pending": (S_REMAP_PENDING, _G_FLAG, None),
    "remapped_rows_failure": (S_REMAP_FAILURE, _G_FLAG, None),
    "mig_mode": (S_MIG, _G_FLAG, None),
    "nvlink_links_active": (S_NVLINK, _G_INT, None),
    "xid_errors": (S_XID, _M_XID, None),
    "fabric_state": (S_FABRIC, _M_FABRIC, None),
}
_FACTS_BY_NAME = {"cpu_cores": S_CPU, "memory_total_bytes": S_MEM_TOTAL, "memory_available_bytes": S_MEM_AVAIL}


def render_message(msg: Any, node: str, opens: tuple[bytes, ...]) -> tuple[bytes, ...]:
    """:func:`render` of ``msg.SerializeToString()``, from the parsed ``Discovery`` message itself.

    PERF: what the pure build renders a scrape with: the protobuf runtime has the message parsed
    already and ``ListFields`` lists, in C, only the fields that are set; reading the bytes again in
    Python would cost 4-5x as much. (The compiled twin serializes it and renders the bytes.)
    """
    if not isinstance(node, str) or not isinstance(opens, tuple):
        raise TypeError("render_message(msg, node: str, opens: tuple[bytes, ...])")
    if len(opens) != len(SLOTS):
        raise ValueError(f"opens: {len(SLOTS)} prefixes expected, got {len(opens)}")
    if not all(isinstance(o, bytes) for o in opens):
        raise TypeError("opens: a tuple of bytes")
    op = [o.decode("utf-8") for o in opens]
    parts: list[list[str]] = [[] for _ in SLOTS]
    n = _escape(node)
    nl = f'node="{n}"}} '
    f = msg.facts
    for fd, v in f.ListFields():
        i = _FACTS_BY_NAME.get(fd.name)
        if i is not None:
            parts[i].append(f"{op[i]}{nl}{v}\n")
    parts[S_ERRORS].append(f"{op[S_ERRORS]}{nl}{len(msg.errors)}\n")
    for p in f.infiniband:
        pl = f'node="{n}",device="{_escape(p.device)}",port="{p.port}"}} '
        if p.HasField("rcv_bytes"):
            parts[S_IB_RCV].append(f"{op[S_IB_RCV]}{pl}{p.rcv_bytes}\n")
        if p.HasField("xmit_bytes"):
            parts[S_IB_XMIT].append(f"{op[S_IB_XMIT]}{pl}{p.xmit_bytes}\n")
    spec_of = _GPU_BY_NAME.get
    info, health, health_open = parts[S_INFO], parts[S_HEALTH], op[S_HEALTH]
    for g in msg.gpus:
        gp = f'node="{n}",gpu_uuid="{_escape(g.uuid)}",gpu_index="{g.index if g.HasField("index") else ""}"'
        gl = gp + "} "
        info.append(f'{op[S_INFO]}{gp},gpu_model="{_escape(g.name)}",pci_bus_id="{_escape(g.pci_bus_id)}",'
                    f'parent_gpu_uuid="{_escape(g.parent_uuid)}"}} 1.0\n')
        for fd, v in g.ListFields():
            spec = spec_of(fd.name)
            if spec is None:
                continue
            i, kind, extra = spec
            if kind == _G_FLOAT:
                parts[i].append(f"{op[i]}{gl}{_num(v * extra)}\n")
            elif kind == _G_INT:
                parts[i].append(f"{op[i]}{gl}{v}\n")
            elif kind == _G_LABELLED:
                parts[i].append(f"{op[i]}{gp}{extra}{v}\n")
            elif kind == _G_FLAG:
                parts[i].append(f"{op[i]}{gl}{'1.0' if v else '0.0'}\n")
            elif kind == _M_XID:
                lst = parts[i]
                for x in v:
                    lst.append(f'{op[i]}{gp},xid="{x.xid}"}} {x.count}\n')
            else:  # fabric state: one sample per known state, 1 on the current one
                lst = parts[i]
                for s in dict.fromkeys([*FABRIC_STATES, v]):
                    lst.append(f'{op[i]}{gp},state="{_escape(s)}"}} {"1.0" if s == v else "0.0"}\n')
        h = g.health or "unknown"
        state = HEALTH_STATES.get(h, h)
        for s in dict.fromkeys([*HEALTH_STATES.values(), state]):
            health.append(f'{health_open}{gp},state="{_escape(s)}"}} {"1.0" if s == state else "0.0"}\n')
    return tuple("".join(lines).encode() for lines in parts)
