"""The console's views as plain data: which API paths each reads, its columns, its rows.

No Textual here: a view turns the admin API's JSON into rows of text plus sort
keys, so what the screen shows can be checked (and timed) without a terminal.
Absent numbers are ``–``, never 0; every state is a word (a colour only repeats it);
bars carry their number beside them. What agents and engines report is shown as written:
cells are plain text (never markup), their control characters escaped (:func:`printable`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.text import Text

from ..cli._common import printable
from ..launch.spec import deployment_reason

__all__ = [
    "ABSENT",
    "VIEWS",
    "BarCell",
    "Cell",
    "Column",
    "Row",
    "View",
    "apply_filter",
    "bar",
    "column_widths",
    "cut_point",
    "sort_rows",
]

ABSENT = "–"  # an en dash, as llmgw ctl shows absent values

_GOOD = "green"
_WARN = "yellow"
_BAD = "red"
_STATE_STYLE = {
    "ok": _GOOD, "up": _GOOD, "closed": _GOOD, "ready": _GOOD, "running": _GOOD,
    "draining": _WARN, "stale": _WARN, "half-open": _WARN, "half_open": _WARN, "degraded": _WARN,
    "cordoned": _WARN, "pending": _WARN, "starting": _WARN, "unknown": _WARN, "loading": _WARN,
    "unreachable": _BAD, "open": _BAD, "auth_failed": _BAD, "unhealthy": _BAD, "failed": _BAD, "fatal": _BAD,
    "lost": _BAD, "unavailable": _BAD,
}


@dataclass(frozen=True, slots=True)
class Column:
    key: str
    label: str
    right: bool = False


class Cell:
    """A styled cell kept as plain text plus a style: a rich ``Text`` is made only for the lines on
    screen (8,000 GPUs × a dozen cells as ``Text`` objects would cost more than the poll itself)."""

    __slots__ = ("plain", "style")

    def __init__(self, plain: str, style: str = "") -> None:
        self.plain = plain
        self.style = style

    def text(self) -> Text:
        return Text(self.plain, style=self.style)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Cell) and self.plain == other.plain and self.style == other.style

    def __repr__(self) -> str:
        return f"Cell({self.plain!r}, {self.style!r})"


class BarCell(Cell):
    """``█████░░░ 62%``: ``full`` filled of ``width``, then the number."""

    __slots__ = ("full", "width")

    def __init__(self, plain: str, style: str, full: int, width: int) -> None:
        super().__init__(plain, style)
        self.full = full
        self.width = width

    def text(self) -> Text:
        t = Text()
        t.append(self.plain[: self.full], style=self.style)
        t.append(self.plain[self.full : self.width], style="dim")
        t.append(self.plain[self.width :])
        return t


CellType = str | Cell


@dataclass(slots=True)
class Row:
    """One line: its key (stable across refreshes), the cells, a sort value per column, the record."""

    key: str
    cells: tuple[CellType, ...]
    sort: tuple[Any, ...]
    record: dict[str, Any] = field(default_factory=dict)
    text: str = ""  # what the filter matches (every cell, lower case, one a line)


# -- formatting --


def num(v: Any) -> float | None:
    if v is None or isinstance(v, bool):
        return None
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) or x == math.inf else None


def fmt_int(v: Any) -> str:
    x = num(v)
    return ABSENT if x is None else str(int(x))


def fmt_pct(v: Any) -> str:
    x = num(v)
    if x is None:
        return ABSENT
    if x == math.inf:
        return "∞"
    return f"{x * 100:.0f}%"


def fmt_float(v: Any, digits: int = 2, unit: str = "") -> str:
    x = num(v)
    return ABSENT if x is None else f"{x:.{digits}f}{unit}"


def fmt_age(v: Any, show: bool = True) -> str:
    x = num(v)
    if x is None:
        return ABSENT
    if not show:
        return "·"  # (snapshot tests: ages would differ run to run)
    if x < 60:
        return f"{x:.1f}s"
    if x < 3600:
        return f"{x / 60:.0f}m"
    return f"{x / 3600:.1f}h"


def _fmt_units(v: Any, base: float, units: tuple[str, ...]) -> str:
    x = num(v)
    if x is None:
        return ABSENT
    for unit in units:
        if x < base or unit == units[-1]:
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= base
    return ABSENT  # pragma: no cover


def fmt_bytes(v: Any) -> str:
    return _fmt_units(v, 1000.0, ("B", "KB", "MB", "GB", "TB"))


def fmt_gib(v: Any) -> str:
    x = num(v)
    return ABSENT if x is None else f"{x / 1024**3:.1f}"


def word(state: Any) -> Cell:
    s = str(state) if state is not None else ABSENT
    return Cell(s, _STATE_STYLE.get(s, ""))


def bar(ratio: float | None, width: int = 8, label: str | None = None) -> CellType:
    """``█████░░░ 62%``: the bar and its number (never a colour alone); ``–`` when absent."""
    if ratio is None:
        return ABSENT
    r = max(0.0, min(1.0, ratio))
    full = round(r * width)
    style = _BAD if r >= 0.9 else _WARN if r >= 0.7 else _GOOD
    return BarCell("█" * full + "░" * (width - full) + " " + (label if label is not None else f"{r * 100:3.0f}%"),
                   style, full, width)


def fmt_ibytes(v: Any) -> str:
    """Bytes in binary units (GiB, as the GPUs view shows memory)."""
    return _fmt_units(v, 1024.0, ("B", "KiB", "MiB", "GiB", "TiB"))


def fmt_value(key: str, v: Any, show_ages: bool = True) -> str:
    """One value of a details screen, as the tables show it: yes/no, – when absent, numbers in their units
    (a ratio as a percentage, bytes, °C, W, an age, a parameter count), text as written (control
    characters escaped)."""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int | float):
        if num(v) is None:
            return ABSENT
        if key.endswith("_ratio") or key == "kv_cache_usage":
            return fmt_pct(v)
        if key.endswith("_bytes") or key in ("gpu_memory", "memory"):  # (a deployment's spec: bytes too)
            return fmt_ibytes(v)
        if key == "size":
            return fmt_bytes(v)
        if key == "parameter_count":
            return _params(num(v))
        if key.endswith("_celsius"):
            return fmt_float(v, 0, "°C")
        if key.endswith("_watts"):
            return fmt_float(v, 0, " W")
        if key.endswith("_age_s"):
            return fmt_age(v, show_ages)
        if isinstance(v, float):
            return str(int(v)) if v.is_integer() else f"{v:.2f}"
        return str(v)
    if v is None:
        return ABSENT
    return printable(v)


def details(record: dict[str, Any], indent: str = "", show_ages: bool = True) -> str:
    """An item's details (enter): every field of its record, one a line, each value as the tables show it
    (:func:`fmt_value`); empty lists and mappings are ``none``; nothing is read as markup."""
    lines = []
    for k, v in record.items():
        key = printable(k)
        if isinstance(v, dict) and v:
            lines.append(f"{indent}{key}:")
            lines.append(details(v, indent + "  ", show_ages))
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            lines.append(f"{indent}{key}:")
            for i, x in enumerate(v):
                lines.append(f"{indent}  [{i}]")
                lines.append(details(x, indent + "    ", show_ages))
        elif isinstance(v, list | dict) and len(v) != 1:
            lines.append(f"{indent}{key}: none" if not v else f"{indent}{key}:")
            lines.extend(f"{indent}  - {fmt_value(str(k), x, show_ages)}" for x in v)
        elif isinstance(v, list):
            lines.append(f"{indent}{key}: {fmt_value(str(k), v[0], show_ages)}")
        else:
            lines.append(f"{indent}{key}: {fmt_value(str(k), v, show_ages)}")
    return "\n".join(lines)


def short_digest(d: Any) -> str:
    return ABSENT if not d else str(d).removeprefix("sha256:")[:12]


def _sortval(v: Any) -> Any:
    return v


# -- rows --


def _safe(c: CellType) -> CellType:
    """A cell whose text holds no control character (an agent's ESC would reach the terminal)."""
    if isinstance(c, str):
        return c if c.isprintable() else printable(c)
    return c if c.plain.isprintable() or isinstance(c, BarCell) else Cell(printable(c.plain), c.style)


def _row(key: str, cells: Sequence[CellType], sort: Sequence[Any], record: dict[str, Any]) -> Row:
    plain = [c if isinstance(c, str) else c.plain for c in cells]
    if not "".join(plain).isprintable():  # PERF: one check a row; a cell at a time only when one needs it
        cells = [_safe(c) for c in cells]
        plain = [c if isinstance(c, str) else c.plain for c in cells]
    # one cell a line: ^ and $ (re.MULTILINE) anchor at a cell's start and end
    return Row(key, tuple(cells), tuple(sort), record, "\n".join(plain).lower())


def cut_point(plain: str, width: int) -> int:
    """Where to cut ``plain``, longer than ``width`` cells, so that it and an ``…`` fit in ``width``.

    At a word boundary (the last space that keeps at least half the width, the separators before it
    dropped: ``"needs 2 GPUs; the largest…"``, never ``"the large…"``); a cell with no such space (an
    id, a path) is cut at ``width - 1``. One terminal cell per character, as :func:`column_widths`.
    """
    room = max(0, width - 1)
    if room == 0 or plain[room] == " ":  # (the next character ends a word: the word before it is whole)
        cut = room
    else:
        space = plain.rfind(" ", 0, room + 1)
        cut = space if space >= max(1, width // 2) else room
    kept = plain[:cut].rstrip(" ,;:([{")
    return len(kept) if kept else cut


def column_widths(columns: Sequence[Column], rows: Sequence[Row], cap: int = 48) -> list[int]:
    """Each column's width: its label (and a sort arrow) or its longest cell, at most ``cap``.

    PERF: ``len()`` of the plain text: the console's cells are one terminal cell per character
    (ASCII, block elements, –, °, ×).
    """
    widths = [len(c.label) + 1 for c in columns]
    for i in range(len(columns)):
        longest = max((len(c) if isinstance(c, str) else len(c.plain) for c in (r.cells[i] for r in rows)), default=0)
        widths[i] = min(max(widths[i], longest), cap)
    return widths


def sort_rows(rows: list[Row], column: int, reverse: bool) -> list[Row]:
    """Sorted by column ``column``; absent values (``None``) last either way; ties by key."""
    present = [r for r in rows if r.sort[column] is not None]
    absent = [r for r in rows if r.sort[column] is None]

    def k(r: Row) -> Any:
        v = r.sort[column]
        return (0, v, r.key) if isinstance(v, (int, float)) else (1, str(v).lower(), r.key)

    try:
        present.sort(key=k, reverse=reverse)
    except TypeError:
        present.sort(key=lambda r: str(r.sort[column]), reverse=reverse)
    absent.sort(key=lambda r: r.key)
    return present + absent


def compile_filter(text: str) -> Callable[[str], bool] | None:
    """``/text``: a case-insensitive regular expression (or the plain text when it is not one);
    ``!text`` keeps the rows that do *not* match. ``None``: no filter."""
    s = text.strip()
    if not s or s == "!":
        return None
    invert = s.startswith("!")
    if invert:
        s = s[1:]
    try:
        rx = re.compile(s, re.IGNORECASE | re.MULTILINE)
        match: Callable[[str], bool] = lambda t: rx.search(t) is not None  # noqa: E731
    except re.error:
        needle = s.lower()
        match = lambda t: needle in t.lower()  # noqa: E731
    return (lambda t: not match(t)) if invert else match


def apply_filter(rows: list[Row], text: str) -> list[Row]:
    pred = compile_filter(text)
    return rows if pred is None else [r for r in rows if pred(r.text)]


# -- the views --


class View:
    """A table over one or more admin API answers."""

    name = ""
    title = ""
    paths: tuple[str, ...] = ()
    # (what the view shows more of when it answers: a gateway with no control plane has no deployments,
    # and that is no problem of a view that only adds them)
    optional: tuple[str, ...] = ()
    columns: tuple[Column, ...] = ()
    default_sort = 0
    hint = ""  # the view's own keys, for the status line

    def rows(self, data: dict[str, Any], show_ages: bool = True) -> list[Row]:
        raise NotImplementedError

    def summary(self, data: dict[str, Any]) -> str:
        return ""

    def paths_for(self, scope: tuple[str, str] | None) -> tuple[str, ...]:
        """The API paths to poll for this view scoped to ``scope`` (a drill-down may need more)."""
        return self.paths + self.optional

    def note(self, data: dict[str, Any], scope: tuple[str, str] | None) -> str:
        """What a drill-down's scope says of itself, shown above the table (``""``: nothing)."""
        return ""

    def empty(self, data: dict[str, Any], read_only: bool = False) -> str:
        """What an empty table means, and how to fill it (a key only where it is not hidden by --read-only)."""
        return f"no {self.name}"

    def empty_in(self, data: dict[str, Any], scope: tuple[str, str], read_only: bool = False) -> str:
        """What an empty drill-down (enter on a row: ``scope`` is its field and value) means."""
        return self.empty(data, read_only)


class EndpointsView(View):
    name = "endpoints"
    title = "Endpoints"
    paths = ("/admin/v1/endpoints",)
    columns = (
        Column("id", "ID"), Column("state", "STATE"), Column("inflight", "INFL", True),
        Column("waiting", "WAIT", True), Column("running", "RUN", True), Column("kv", "KV", True),
        Column("drain", "DRAIN/s", True), Column("breaker", "BREAKER"), Column("stale", "STALE"),
        Column("age", "SCRAPED", True), Column("model", "MODEL"), Column("pool", "POOL"),
        Column("engine", "ENGINE"),
    )
    hint = "d drain  u undrain  r reload"

    def rows(self, data: dict[str, Any], show_ages: bool = True) -> list[Row]:
        out = []
        for ep in (data.get("/admin/v1/endpoints") or {}).get("endpoints", []):
            age = num(ep.get("last_scrape_age_s"))
            models = ",".join(ep.get("models") or []) or ABSENT
            stale = ep.get("stale")
            cells = (
                str(ep.get("id")), word(ep.get("state")), fmt_int(ep.get("inflight")), fmt_int(ep.get("waiting")),
                fmt_int(ep.get("running")), fmt_pct(ep.get("kv_cache_usage")), fmt_float(ep.get("drain_rate")),
                word(ep.get("breaker")), ABSENT if stale is None else ("yes" if stale else "no"),
                fmt_age(age, show_ages), models, str(ep.get("pool") or ABSENT), str(ep.get("engine") or ABSENT),
            )
            sort = (
                str(ep.get("id")), ep.get("state"), num(ep.get("inflight")), num(ep.get("waiting")),
                num(ep.get("running")), num(ep.get("kv_cache_usage")), num(ep.get("drain_rate")),
                ep.get("breaker"), None if stale is None else int(bool(stale)), age, models, ep.get("pool"),
                ep.get("engine"),
            )
            out.append(_row(str(ep.get("id")), cells, sort, ep))
        return out

    def summary(self, data: dict[str, Any]) -> str:
        eps = (data.get("/admin/v1/endpoints") or {}).get("endpoints", [])
        states: dict[str, int] = {}
        for ep in eps:
            states[str(ep.get("state"))] = states.get(str(ep.get("state")), 0) + 1
        return ", ".join(f"{n} {s}" for s, n in sorted(states.items()))

    def empty(self, data: dict[str, Any], read_only: bool = False) -> str:
        how = "llmgw ctl reload" if read_only else "press r"
        return f"no endpoints (add them to the config file and {how} to reload)"


class ModelsView(View):
    name = "models"
    title = "Models"
    paths = ("/admin/v1/endpoints", "/admin/v1/queues")
    optional = ("/admin/v1/deployments",)
    columns = (
        Column("model", "MODEL"), Column("pools", "POOLS"), Column("replicas", "USABLE", True),
        Column("deployed", "DEPLOYED", True), Column("saturation", "SATURATION"), Column("queued", "QUEUED", True),
        Column("bands", "QUEUED BY BAND"),
    )

    def rows(self, data: dict[str, Any], show_ages: bool = True) -> list[Row]:
        eps = (data.get("/admin/v1/endpoints") or {}).get("endpoints", [])
        q = data.get("/admin/v1/queues") or {}
        sat = q.get("pool_saturation") or {}
        per: dict[str, dict[str, Any]] = {}
        new = lambda: {"pools": set(), "usable": 0, "total": 0, "ready": None, "desired": None}  # noqa: E731
        for ep in eps:
            for m in ep.get("models") or []:
                d = per.setdefault(m, new())
                if ep.get("pool"):
                    d["pools"].add(str(ep["pool"]))
                d["total"] += 1
                d["usable"] += 1 if ep.get("usable") or (ep.get("usable") is None and ep.get("state") == "ok") else 0
        # A deployed model is a model before any replica of it is ready (a row that waits for its first
        # endpoint would hide the model in the very minutes it is being looked for): ready of desired.
        for dep in (data.get("/admin/v1/deployments") or {}).get("deployments", []):
            # (by the name clients ask for, as endpoints list it: "model" is where it comes from)
            served = dep.get("served_name") or dep.get("name") if isinstance(dep, dict) else None
            if not served:
                continue
            d = per.setdefault(str(served), new())
            for k in ("ready", "desired"):
                v = num(dep.get(k))
                if v is not None:
                    d[k] = int(v) + (d[k] or 0)
        bands = q.get("bands") or []
        admission = bool(q.get("admission"))
        out = []
        for m in sorted(per):
            d = per[m]
            depths = [(str(b.get("band")), int((b.get("models") or {}).get(m, 0))) for b in bands]
            queued: int | None = sum(n for _, n in depths) if admission else None
            # (JSON has no +Inf: a pool with no usable replica is null in the mapping; a model with no
            # estimate at all is not in it)
            s = math.inf if m in sat and sat[m] is None else num(sat.get(m))
            deployed: CellType = ABSENT
            if d["desired"] is not None:
                deployed = Cell(f"{fmt_int(d['ready'])}/{d['desired']}",
                                _GOOD if d["ready"] is not None and d["ready"] >= d["desired"] else _WARN)
            cells = (
                m, ",".join(sorted(d["pools"])) or ABSENT, f"{d['usable']}/{d['total']}", deployed,
                bar(s if s is None or s != math.inf else 1.0, 8, "no usable replica" if s == math.inf else fmt_pct(s)),
                ABSENT if queued is None else str(queued),
                " ".join(f"{b}:{n}" for b, n in depths) if admission else ABSENT,
            )
            sort = (m, ",".join(sorted(d["pools"])), d["usable"], d["ready"], s, queued, queued)
            out.append(_row(m, cells, sort, {"model": m, **d, "pools": sorted(d["pools"])}))
        return out

    def summary(self, data: dict[str, Any]) -> str:
        q = data.get("/admin/v1/queues") or {}
        if not q.get("admission"):
            return "admission control is off: requests go straight to replicas"
        shed = []
        for b in q.get("bands") or []:
            d = b.get("decisions") or {}
            shed.append(f"{b.get('band')} {int(d.get('rejected', 0))}")
        return "shed so far (per band): " + (", ".join(shed) if shed else "none")

    def empty(self, data: dict[str, Any], read_only: bool = False) -> str:
        return "no models (no endpoints are configured, and nothing is deployed)"


class NodesView(View):
    name = "nodes"
    title = "Nodes"
    paths = ("/admin/v1/nodes", "/admin/v1/gpus")
    columns = (
        Column("name", "NODE"), Column("state", "STATE"), Column("cordon", "CORDON"),
        Column("heartbeat", "HEARTBEAT", True), Column("gpus", "GPUS", True), Column("util", "GPU UTIL"),
        Column("mem", "GPU MEMORY"), Column("errors", "ERRORS", True), Column("host", "HOST"),
        Column("agent", "AGENT"),
    )
    hint = "c cordon/uncordon  enter GPUs"

    def rows(self, data: dict[str, Any], show_ages: bool = True) -> list[Row]:
        nodes = (data.get("/admin/v1/nodes") or {}).get("nodes", [])
        gpus = (data.get("/admin/v1/gpus") or {}).get("gpus", [])
        agg: dict[str, list[dict[str, Any]]] = {}
        for g in gpus:
            agg.setdefault(str(g.get("node")), []).append(g)
        out = []
        for n in nodes:
            name = str(n.get("name"))
            up = n.get("state") == "up"
            gs = agg.get(name, [])
            # both over the GPUs that report it (a MIG GPU has no utilisation; one may lack memory
            # readings): – only when none does, and never for a node past its grace
            utils = [u for g in gs if (u := num(g.get("utilization_gpu_ratio"))) is not None] if up else []
            mems = [(u, t) for g in gs if (u := num(g.get("memory_used_bytes"))) is not None
                    and (t := num(g.get("memory_total_bytes")))] if up else []
            util = sum(utils) / len(utils) if utils else None
            mem = sum(u for u, _ in mems) / sum(t for _, t in mems) if mems else None
            # (past its grace, its errors are as old as its readings: not a current count either)
            errors = len(n.get("errors") or []) + sum(len(g.get("errors") or []) for g in gs) if up else None
            age = num(n.get("heartbeat_age_s"))
            cells = (
                name, word(n.get("state")), Cell("cordoned", _WARN) if n.get("cordoned") else
                Cell("leaving", _WARN) if n.get("leaving") else "no",
                fmt_age(age, show_ages), str(n.get("gpu_count", len(gs))), bar(util), bar(mem),
                ABSENT if errors is None else str(errors), str(n.get("hostname") or ABSENT),
                str(n.get("agent_version") or ABSENT),
            )
            sort = (name, n.get("state"), int(bool(n.get("cordoned"))), age, num(n.get("gpu_count")), util, mem,
                    errors, n.get("hostname"), n.get("agent_version"))
            out.append(_row(name, cells, sort, n))
        return out

    def empty(self, data: dict[str, Any], read_only: bool = False) -> str:
        return "no nodes registered (start llmgw agent on a node)"


# A GPU's identity (and its node's), kept for a node past its heartbeat grace: every other field is a
# reading that is no longer current then, absent, its health unknown (as the admin API sends it, and as
# /metrics stops exporting it; an older gateway's last readings are blanked here the same way)
GPU_IDENTITY = frozenset({"node", "node_state", "heartbeat_age_s", "uuid", "index", "name", "pci_bus_id",
                          "parent_uuid", "memory_total_bytes", "errors"})
_NODE_ERRORS_SHOWN = 2  # (the message line holds three lines: the rest are counted)


class GPUsView(View):
    name = "gpus"
    title = "GPUs"
    paths = ("/admin/v1/gpus",)
    columns = (
        Column("node", "NODE"), Column("idx", "IDX", True), Column("util", "UTIL"), Column("mem", "MEMORY"),
        Column("temp", "TEMP", True), Column("power", "POWER", True), Column("ecc", "ECC", True),
        Column("xid", "XID"), Column("health", "HEALTH"), Column("name", "MODEL"), Column("uuid", "UUID"),
    )
    hint = "enter details"

    def rows(self, data: dict[str, Any], show_ages: bool = True) -> list[Row]:
        out = []
        for g in (data.get("/admin/v1/gpus") or {}).get("gpus", []):
            current = g.get("node_state") == "up"
            if not current:  # (enter's details too: the last readings are not current, whoever sent them)
                g = {k: v if k in GPU_IDENTITY else "unknown" if k == "health" else None for k, v in g.items()}

            def cur(k: str, g: dict[str, Any] = g, current: bool = current) -> Any:
                return g.get(k) if current else None

            util = num(cur("utilization_gpu_ratio"))
            used, total = num(cur("memory_used_bytes")), num(g.get("memory_total_bytes"))
            mem = used / total if used is not None and total else None
            mem_label = f"{fmt_gib(used)}/{fmt_gib(total)}G" if mem is not None else ABSENT
            ecc_c, ecc_u = cur("ecc_corrected_volatile"), cur("ecc_uncorrected_volatile")
            ecc = ABSENT if ecc_c is None and ecc_u is None else f"{fmt_int(ecc_c)}/{fmt_int(ecc_u)}"
            xids = cur("xid_errors") or {}
            xid = ",".join(f"{k}×{v}" for k, v in sorted(xids.items())) if xids else ("none" if current else ABSENT)
            health = word(g.get("health")) if current else Cell(f"node {g.get('node_state')}", _BAD)
            key = f"{g.get('node')}/{g.get('uuid')}"
            cells = (
                str(g.get("node")), fmt_int(g.get("index")), bar(util, 6), bar(mem, 6, mem_label),
                fmt_float(cur("temperature_celsius"), 0, "°C"), fmt_float(cur("power_watts"), 0, " W"), ecc, xid,
                health, str(g.get("name") or ABSENT), str(g.get("uuid")),
            )
            sort = (str(g.get("node")), num(g.get("index")), util, mem, num(cur("temperature_celsius")),
                    num(cur("power_watts")), num(ecc_u), sum(xids.values()) if xids else None,
                    g.get("health") if current else "~" + str(g.get("node_state")), g.get("name"), g.get("uuid"))
            out.append(_row(key, cells, sort, g))
        return out

    def paths_for(self, scope: tuple[str, str] | None) -> tuple[str, ...]:
        # a node's GPUs (enter on a node): the node too, for its own errors above them
        return (*self.paths, "/admin/v1/nodes") if scope is not None and scope[0] == "node" else self.paths

    def note(self, data: dict[str, Any], scope: tuple[str, str] | None) -> str:
        """A node's GPUs: the node's own errors (what discovery failed on: nvidia-smi did not answer, NVML
        did not load), which no GPU row carries."""
        if scope is None or scope[0] != "node":
            return ""
        nodes = (data.get("/admin/v1/nodes") or {}).get("nodes") or []
        node = next((n for n in nodes if str(n.get("name")) == scope[1]), None)
        errors = [str(e) for e in (node or {}).get("errors") or []]
        if not errors:
            return ""
        name = printable(scope[1])
        lines = [f"{name}: {printable(e)}" for e in errors[:_NODE_ERRORS_SHOWN]]
        if len(errors) > _NODE_ERRORS_SHOWN:
            lines.append(f"… and {len(errors) - _NODE_ERRORS_SHOWN} more error(s): llmgw ctl nodes {name} lists them")
        return "\n".join(lines)

    def empty(self, data: dict[str, Any], read_only: bool = False) -> str:
        return "no GPUs reported (no nodes, or nodes without GPUs)"

    def empty_in(self, data: dict[str, Any], scope: tuple[str, str], read_only: bool = False) -> str:
        if scope[0] != "node":
            return self.empty(data, read_only)
        # (a node's GPUs: "no nodes, or nodes without GPUs" said nothing of the node entered)
        nodes = (data.get("/admin/v1/nodes") or {}).get("nodes") or []
        node = next((n for n in nodes if str(n.get("name")) == scope[1]), None)
        name = printable(scope[1])
        if node is None:
            return f"no node {name} now (forgotten or deregistered): esc goes back to the nodes"
        source = node.get("gpu_source")
        how = f"its agent's --gpu-source is {printable(source)}" if source == "none" else "a CPU node, or its GPUs unseen"
        return f"{name} reports no GPUs ({how})"


class DeploymentsView(View):
    name = "deployments"
    title = "Deployments"
    paths = ("/admin/v1/deployments",)
    columns = (
        Column("name", "DEPLOYMENT"), Column("model", "MODEL"), Column("engine", "ENGINE"),
        Column("ready", "READY", True), Column("desired", "DESIRED", True), Column("where", "WHERE"),
        Column("why", "NOT PLACED BECAUSE"),
    )
    hint = "s scale  enter replicas"

    def rows(self, data: dict[str, Any], show_ages: bool = True) -> list[Row]:
        # The shape of /admin/v1/deployments (control/deployments.py): name, model, engine, desired,
        # ready, nodes, message (why a replica is not placed or ready), replicas [{id, node, state, message}].
        # The reason is one line, as llmgw ctl deployments shows it (the whole message: Enter's log tails).
        doc = data.get("/admin/v1/deployments") or {}
        out = []
        for d in doc.get("deployments", []):
            name = str(d.get("name"))
            got = d.get("replicas")
            reps: list[dict[str, Any]] = [r for r in got if isinstance(r, dict)] if isinstance(got, list) else []
            desired = d.get("desired")
            ready = d.get("ready")
            nodes = d.get("nodes")
            where = sorted(map(str, nodes)) if isinstance(nodes, list) else sorted(
                {str(r.get("node")) for r in reps if r.get("node")})
            why = deployment_reason(d)
            cells = (name, str(d.get("model") or ABSENT), str(d.get("engine") or ABSENT),
                     Cell(fmt_int(ready), _GOOD if ready is not None and ready == desired else _WARN),
                     fmt_int(desired), ",".join(where) or ABSENT, str(why) if why else ABSENT)
            sort = (name, d.get("model"), d.get("engine"), num(ready), num(desired), ",".join(where), why)
            # (served_name: what the Models view's Enter scopes by; an older API has none: the name is the default)
            out.append(_row(name, cells, sort, {**d, "served_name": d.get("served_name") or name}))
        return out

    def empty(self, data: dict[str, Any], read_only: bool = False) -> str:
        return "no deployments (add them to the config's deployments: section, or run llmgw ctl deploy)"


class MirrorView(View):
    name = "mirror"
    title = "Mirror"
    paths = ("/admin/v1/mirror/models",)
    columns = (
        Column("ref", "MODEL"), Column("size", "SIZE", True), Column("arch", "ARCH"), Column("quant", "QUANT"),
        Column("params", "PARAMS", True), Column("digest", "DIGEST"), Column("projector", "PROJECTOR"),
        Column("source", "SOURCE"),
    )
    hint = "I import from Ollama"

    def rows(self, data: dict[str, Any], show_ages: bool = True) -> list[Row]:
        doc = data.get("/admin/v1/mirror/models") or {}
        out = []
        for m in doc.get("models", []):
            ref = str(m.get("ref"))
            params = num(m.get("parameter_count"))
            cells = (
                ref, fmt_bytes(m.get("size")), str(m.get("architecture") or ABSENT),
                str(m.get("quantization") or ABSENT), _params(params), short_digest(m.get("digest")),
                short_digest(m.get("projector")) if m.get("projector") else "none",
                str(m.get("source_kind") or ABSENT),
            )
            sort = (ref, num(m.get("size")), m.get("architecture"), m.get("quantization"), params, m.get("digest"),
                    m.get("projector") or "", m.get("source_kind"))
            out.append(_row(ref, cells, sort, m))
        return out

    def summary(self, data: dict[str, Any]) -> str:
        doc = data.get("/admin/v1/mirror/models") or {}
        return f"mirror at {doc['root']}" if doc.get("root") else ""

    def empty(self, data: dict[str, Any], read_only: bool = False) -> str:
        if read_only:
            return ("the mirror is empty (llmgw mirror import-ollama, on the gateway's machine, imports a model; "
                    "I does too, without --read-only)")
        return "the mirror is empty: press I to import a model from Ollama"


def _params(n: float | None) -> str:
    if n is None:
        return ABSENT
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(int(n))


VIEWS: dict[str, View] = {
    v.name: v for v in (EndpointsView(), ModelsView(), NodesView(), GPUsView(), DeploymentsView(), MirrorView())
}
"""By command name, in the order ``:`` completes them."""
