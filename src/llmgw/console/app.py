"""``llmgw console``: the Textual app, views over the admin API.

One layer polls (:meth:`ConsoleApp._poll`: the current view's API paths, every
``refresh`` seconds, each call bounded by the client's timeout) and holds the
answers; the table only renders them (:mod:`.views` makes the rows), and actions
go back through the same client. Keys are declared once (:data:`KEYS`): the
bindings, the footer and the ``?`` help screen are all made from that list.

Nothing the API sends is read as markup: every line on screen is a ``Text`` (or a
table cell, plain text too), what agents and engines reported passed through
:func:`~llmgw.cli._common.printable` (their control characters escaped).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from rich.text import Text
from textual import on
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.css.query import NoMatches
from textual.screen import ModalScreen
from textual.suggester import SuggestFromList
from textual.widgets import Footer, Input, ProgressBar, Static

from ..admin.summary import reload_summary
from ..cli._common import MAX_REPLICAS, printable, replica_count
from .client import AdminClient, APIError, AuthError, ClientError, NotAdminAPI, Unreachable, quote_id
from .table import FleetTable
from .views import (
    ABSENT,
    VIEWS,
    Row,
    View,
    apply_filter,
    column_widths,
    cut_point,
    details,
    fmt_age,
    fmt_bytes,
    sort_rows,
)

__all__ = ["KEYS", "ConsoleApp", "Key"]


@dataclass(frozen=True)
class Key:
    """One key: what it does, in which views (empty: every view), whether it changes anything."""

    key: str
    action: str
    label: str
    help: str
    views: tuple[str, ...] = ()
    changes: bool = False  # hidden by --read-only
    show: bool = True


KEYS: tuple[Key, ...] = (
    Key("colon", "command", "view", "command mode: :endpoints :models :nodes :gpus :deployments :mirror (tab completes)"),
    Key("slash", "filter", "filter", "filter the rows (a regular expression; !text keeps the rows that do not match)"),
    Key("question_mark", "help", "help", "this help"),
    Key("escape", "go_back", "back", "clear the filter, or go back to the previous view", show=False),
    Key("enter", "select", "enter", "drill down: an endpoint's or GPU's details, a node's GPUs (its own errors "
        "above them), a model's endpoints, a deployment's replicas", show=False),
    Key("less_than_sign", "sort(-1)", "<", "sort by the previous column", show=False),
    Key("greater_than_sign", "sort(1)", "sort", "sort by the next column", show=False),
    Key("equals_sign", "reverse", "=", "reverse the sort order", show=False),
    Key("d", "drain", "drain", "drain the endpoint (no new requests; asks first)", ("endpoints",), True),
    Key("u", "undrain", "undrain", "undrain the endpoint (take requests again)", ("endpoints",), True),
    Key("c", "cordon", "cordon", "cordon the node (no new replicas; asks first), or uncordon it", ("nodes",), True),
    Key("s", "scale", "scale", f"scale the deployment (asks for the replica count, 0-{MAX_REPLICAS})", ("deployments",),
        True),
    Key("I", "import_ollama", "import", "import a model from the gateway machine's Ollama store", ("mirror",), True),
    Key("r", "reload", "reload", "reload the gateway's config file (asks first)", (), True),
    Key("q", "quit", "quit", "quit"),
)

COMMANDS = {
    "endpoints": "endpoints", "ep": "endpoints", "models": "models", "mo": "models", "nodes": "nodes",
    "no": "nodes", "gpus": "gpus", "gpu": "gpus", "deployments": "deployments", "deploy": "deployments",
    "dp": "deployments", "mirror": "mirror", "mi": "mirror", "help": "help", "quit": "quit", "q": "quit",
}
_COMPLETIONS = [*VIEWS, "help", "quit"]


def _key_label(k: str) -> str:
    return {"colon": ":", "slash": "/", "question_mark": "?", "escape": "esc", "less_than_sign": "<",
            "greater_than_sign": ">", "equals_sign": "="}.get(k, k)


@dataclass
class _Place:
    """Where the operator is: the view, what it is scoped to (a drill-down), the filter, the sort."""

    view: str
    scope: tuple[str, str] | None = None  # (record field, value): a node's GPUs, a model's endpoints
    filter: str = ""
    sort: int | None = None
    reverse: bool = False
    cursor_key: str | None = None


class ConfirmScreen(ModalScreen[bool]):
    """y / n before anything destructive."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "answer(True)", "yes"), Binding("n,escape", "answer(False)", "no"),
    ]
    DEFAULT_CSS = """
    ConfirmScreen { align: center middle; }
    ConfirmScreen > Static { width: 70; max-width: 95%; border: thick $warning; padding: 1 2; background: $surface; }
    """

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        # (the question names what the API sent, a node's name: text, never markup)
        yield Static(Text.assemble(printable(self.question), "\n\n", ("y", "bold"), " yes    ", ("n", "bold"),
                                   " / esc no"), id="question")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


class AskScreen(ModalScreen[str | None]):
    """One line of input (the replica count of a scale)."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "cancel")]
    DEFAULT_CSS = """
    AskScreen { align: center middle; }
    AskScreen > Vertical { width: 60; height: auto; border: thick $accent; padding: 1 2; background: $surface; }
    """

    def __init__(self, question: str, value: str = "") -> None:
        super().__init__()
        self.question, self.value = question, value

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(Text(printable(self.question)))
            yield Input(value=self.value, id="answer")

    @on(Input.Submitted)
    def _submit(self, event: Input.Submitted) -> None:
        self.dismiss(event.value)

    def action_cancel(self) -> None:
        self.dismiss(None)


class _TitledScroll(VerticalScroll):
    """A scroll whose border title too long for it is cut at a word, ``…`` marking the cut: Textual would
    cut it anywhere ("replicas and their lo…")."""

    def __init__(self, title: str) -> None:
        super().__init__()
        self.full_title = title
        self.border_title = Text(title)

    def on_resize(self) -> None:
        title = self.full_title
        room = self.outer_size.width - 6  # (the corners, and a space each side of the title)
        if 0 < room < len(title):
            title = title[:cut_point(title, room)] + "…"
        self.border_title = Text(title)


class TextScreen(ModalScreen[None]):
    """Help, an item's details, a log tail: text that scrolls; esc or q closes it."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,q", "close", "close")]
    DEFAULT_CSS = """
    TextScreen { align: center middle; }
    TextScreen > VerticalScroll { width: 100; max-width: 98%; height: 90%; border: thick $accent;
                                  background: $surface; padding: 0 1; }
    """

    def __init__(self, title: str, body: str | Text) -> None:
        super().__init__()
        # (a str is text as written, never markup: a GPU named "NVIDIA H100 [/link]" is shown as such)
        self.title_text = title
        self.body = body if isinstance(body, Text) else Text(printable(body, lines=True))

    def compose(self) -> ComposeResult:
        with _TitledScroll(printable(self.title_text)) as v:
            v.border_subtitle = "esc closes"
            yield Static(self.body, id="text")

    def action_close(self) -> None:
        self.dismiss(None)


class ImportScreen(ModalScreen[None]):
    """``I``: the Ollama store of the gateway's machine; enter imports the chosen model, with a bar."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "close", "close")]
    DEFAULT_CSS = """
    ImportScreen { align: center middle; }
    ImportScreen > Vertical { width: 100; max-width: 98%; height: 80%; border: thick $accent;
                              background: $surface; padding: 0 1; }
    ImportScreen FleetTable { height: 1fr; }
    ImportScreen #import-status { height: auto; min-height: 2; }
    ImportScreen ProgressBar { height: 1; }
    """

    def __init__(self, client: AdminClient, poll: float = 0.25) -> None:
        super().__init__()
        self.client = client
        self.poll = poll
        self.job: dict[str, Any] | None = None
        self.done = asyncio.Event()
        self.loaded = asyncio.Event()
        self.status_text = ""

    def compose(self) -> ComposeResult:
        with Vertical() as v:
            v.border_title = "Import from Ollama (the gateway machine's store)"
            v.border_subtitle = "enter imports · esc closes"
            yield FleetTable(id="ollama")
            yield ProgressBar(total=100, show_eta=False, id="bar")
            yield Static("reading the Ollama store…", id="import-status")

    async def on_mount(self) -> None:
        self.query_one("#bar", ProgressBar).display = False
        self.query_one(FleetTable).focus()
        self.run_worker(self._load(), exclusive=True, group="ollama-list")

    def _status(self, text: str | Text) -> None:
        shown = text if isinstance(text, Text) else Text(printable(text))  # (model names, paths: never markup)
        self.status_text = shown.plain
        self.query_one("#import-status", Static).update(shown)

    async def _load(self) -> None:
        from .views import Column, _row

        try:
            doc = await self.client.get("/admin/v1/mirror/ollama")
        except ClientError as exc:
            self._status(Text(printable(f"cannot list the Ollama store: {exc}"), style="red"))
            self.loaded.set()
            return
        cols = (Column("name", "OLLAMA MODEL"), Column("size", "SIZE", True), Column("format", "FORMAT"),
                Column("projector", "PROJECTOR"), Column("mirror", "IN THE MIRROR AS"),
                Column("problem", "CANNOT IMPORT BECAUSE"))

        def mirrored(m: dict[str, Any]) -> str:
            refs = m.get("in_mirror")
            return ABSENT if refs is None else ", ".join(refs) if refs else "not yet"

        rows = [
            _row(m["name"], (m["name"], fmt_bytes(m.get("size")), str(m.get("format") or ABSENT),
                             "yes" if m.get("projector") else "no", mirrored(m), str(m.get("problem") or "")),
                 (m["name"],), m)
            for m in doc.get("models", [])
        ]
        self.query_one(FleetTable).set_rows(cols, rows)
        self.loaded.set()
        if rows:
            self._status(f"{len(rows)} model(s) in {', '.join(doc.get('stores') or [])}; enter imports the one"
                         " under the cursor")
        else:
            where = ", ".join(doc.get("stores") or doc.get("searched") or [])
            self._status(f"no Ollama models found (looked in {where}); ollama pull one first")

    @on(FleetTable.Selected)
    def _chosen(self, event: FleetTable.Selected) -> None:
        event.stop()
        if self.job is not None and self.job.get("state") in ("queued", "running"):
            self.app.notify("an import is already running", severity="warning")
            return
        self.run_worker(self._import(event.row.key), exclusive=True, group="ollama-import")

    async def _import(self, name: str) -> None:
        bar = self.query_one("#bar", ProgressBar)
        self.done.clear()
        try:
            job = await self.client.post("/admin/v1/mirror/imports", {"ollama": name})
        except ClientError as exc:
            self._status(Text(printable(f"refused: {exc}"), style="bold red"))
            self.done.set()
            return
        self.job = job
        bar.display = True
        bar.update(total=100, progress=0)
        self._status(f"importing {name}…")
        while True:
            state = job.get("state")
            if state in ("done", "failed"):
                break
            await asyncio.sleep(self.poll)
            try:
                job = await self.client.get(f"/admin/v1/mirror/imports/{quote_id(job['id'])}")
            except APIError as exc:
                if exc.status == 404:  # (the gateway restarted: its jobs are gone)
                    self._status(Text(printable(f"the gateway no longer knows this import ({exc}); look in the "
                                                "mirror view"), style="bold red"))
                    self.done.set()
                    return
                self._status(Text(printable(f"lost the import's progress: {exc}; retrying"), style="yellow"))
                continue
            except ClientError as exc:
                self._status(Text(printable(f"lost the import's progress: {exc}; retrying"), style="yellow"))
                continue
            self.job = job
            p = job.get("progress")
            if p is not None:
                bar.update(progress=round(p * 100))
            if job.get("step"):
                done, total = job.get("done_bytes"), job.get("total_bytes")
                self._status(f"{job['step']}: {fmt_bytes(done)} of {fmt_bytes(total)} (step {job.get('steps')})")
        if job.get("state") == "done":
            bar.update(progress=100)
            m = job.get("model") or {}
            what = "imported" if m.get("created", True) else "already in the mirror:"
            self._status(Text(printable(f"{what} {m.get('ref')} ({fmt_bytes(m.get('size'))})"), style="bold green"))
            self.app.notify(f"{what} {m.get('ref')}")
            if isinstance(self.app, ConsoleApp):
                self.app.wake()
        else:
            bar.display = False
            err = job.get("error") or {}
            self._status(Text(printable(f"refused ({err.get('code')}): {err.get('message')}"), style="bold red"))
        self.done.set()

    def action_close(self) -> None:
        self.dismiss(None)


class ConsoleApp(App[None]):
    """The console.

    Args:
        client: the admin API.
        refresh: seconds between polls.
        read_only: hide (and refuse) every action that changes something.
        name: what the header calls this gateway (default: the admin URL).
        show_ages: ``False`` shows ages as ``·`` (deterministic snapshots).
        start: the first view.
    """

    TITLE = "llmgw console"
    CSS = """
    Screen { layout: vertical; }
    #status { height: 1; background: $primary-background; color: $text; padding: 0 1; }
    #crumbs { height: 1; padding: 0 1; color: $text-muted; }
    #message { height: auto; max-height: 3; padding: 0 1; }
    #message.error { color: $error; text-style: bold; }
    #message.warn { color: $warning; }
    #summary { height: 1; padding: 0 1; color: $text-muted; }
    #promptbar { height: 1; display: none; background: $boost; }
    #prompt-label { width: 2; padding: 0 0 0 1; }
    #prompt { height: 1; border: none; padding: 0; width: 1fr; background: $boost; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        # ":" and "/" are priority bindings: handled by the app as they arrive, so the keys typed right
        # after them (one batch from a fast typist or tmux) already reach the prompt, not the table.
        Binding(k.key, k.action, k.label, show=k.show, priority=k.key in ("colon", "slash"))
        for k in KEYS if k.key != "enter"
    ]
    ENABLE_COMMAND_PALETTE = False

    def __init__(self, client: AdminClient, *, refresh: float = 2.0, read_only: bool = False,
                 name: str | None = None, show_ages: bool = True, start: str = "endpoints") -> None:
        super().__init__()
        self.client = client
        self.refresh_s = max(0.05, refresh)
        self.read_only = read_only
        self.label = name or client.url
        self.show_ages = show_ages
        self.place = _Place(start)
        self.stack: list[_Place] = []
        self.data: dict[str, Any] = {}
        self.errors: dict[str, APIError] = {}
        self.disconnected: str | None = None  # why, while the API cannot be reached
        self.auth_error: str | None = None
        self._auth_told = False
        self.last_ok: float | None = None
        self.polls = 0
        self._wake = asyncio.Event()
        self.updated = asyncio.Event()  # set after each poll's render (tests wait on it)
        self.rendered_rows: list[Row] = []
        self.data_version = 0
        self._built: tuple[tuple[str, int], list[Row], list[int]] | None = None
        self._shown: dict[str, Any] = {}  # what each Static shows (updated only when it changes)
        self.message_text = ""
        self.told: list[str] = []  # every notification, in order (what the operator was told)
        self._prompt_mode: str | None = None  # "command" | "filter"

    # -- layout --

    def compose(self) -> ComposeResult:
        yield Static(id="status")
        yield Static(id="crumbs")
        yield Static(id="message")
        yield FleetTable(id="table")
        yield Static(id="summary")
        with Horizontal(id="promptbar"):
            yield Static(":", id="prompt-label")
            yield Input(id="prompt", suggester=SuggestFromList(_COMPLETIONS, case_sensitive=False))
        yield Footer()

    def on_mount(self) -> None:
        self.main.query_one(FleetTable).focus()
        self._render()
        self.run_worker(self._poll(), exclusive=True, group="poll", name="poll")

    @property
    def main(self) -> Any:
        """The console's own screen (under any dialog on top of it)."""
        return self.screen_stack[0]

    @property
    def view(self) -> View:
        return VIEWS[self.place.view]

    def wake(self) -> None:
        """Poll now (after an action, a view switch)."""
        self._wake.set()

    def notify(self, message: str, *args: Any, **kw: Any) -> None:
        # (a notification names what the API sent, a node, an error: text, never markup)
        message = printable(message, lines=True)
        kw.setdefault("markup", False)
        self.told.append(message)
        del self.told[:-200]
        super().notify(message, *args, **kw)

    # -- polling --

    async def _poll(self) -> None:
        while True:
            await self.poll_once()
            try:
                await asyncio.wait_for(self._wake.wait(), self.refresh_s)
            except TimeoutError:
                pass
            self._wake.clear()

    async def poll_once(self) -> None:
        view = self.view
        paths = view.paths_for(self.place.scope)
        results = await asyncio.gather(*(self.client.get(p) for p in paths), return_exceptions=True)
        unreachable: str | None = None
        auth: str | None = None
        for path, res in zip(paths, results, strict=True):
            if isinstance(res, Unreachable):
                unreachable = str(res)
            elif isinstance(res, AuthError):
                auth = str(res)
            elif isinstance(res, APIError):
                self.errors[path] = res
                self.data.pop(path, None)
            elif isinstance(res, BaseException):
                raise res
            else:
                self.errors.pop(path, None)
                self.data[path] = res
            self.data_version += 1
        self.polls += 1
        was = self.disconnected
        self.disconnected = unreachable
        if unreachable is None and auth is None:
            self.last_ok = time.monotonic()
            if was is not None:
                self.notify("connected again")
        if auth is not None:
            if not self._auth_told or auth != self.auth_error:
                self.notify(auth, severity="error", timeout=10)  # once, not every refresh
                self._auth_told = True
            self.auth_error = auth
        elif unreachable is None:
            self.auth_error = None
            self._auth_told = False
        if self.place.view == view.name:
            # PERF: 8,000 rows take ~0.1 s to build; in a thread the loop keeps handling keys meanwhile
            # (the GIL is handed over every few ms), and the table is redrawn once they are ready.
            built = await asyncio.to_thread(self._build, view, dict(self.data), self.data_version)
            if self.place.view == view.name and built[0][1] == self.data_version:
                self._built = built
            self._render()
        self.updated.set()

    def _build(self, view: View, data: dict[str, Any], version: int) -> tuple[tuple[str, int], list[Row], list[int]]:
        rows = view.rows(data, self.show_ages)
        return (view.name, version), rows, column_widths(view.columns, rows)

    async def wait_for_update(self, timeout: float = 10.0) -> None:
        """Wait for the next poll to be rendered (tests, the bench)."""
        self.updated.clear()
        self.wake()
        await asyncio.wait_for(self.updated.wait(), timeout)

    # -- rendering --

    def _api_problem(self) -> str | None:
        for p in self.view.paths_for(self.place.scope):
            err = self.errors.get(p)
            if err is None or p in self.view.optional:
                continue
            if self.view.name == "deployments" and err.status == 404 and err.code != "no_control_plane":
                return ("the control plane has no deployments API (this gateway's llmgw has no "
                        "/admin/v1/deployments; deployments come with a newer llmgw)")
            return printable(str(err))
        return None

    def _not_admin(self) -> str | None:
        """Why what answers is no admin API (the client port), while it says so."""
        for p in self.view.paths_for(self.place.scope):
            err = self.errors.get(p)
            if isinstance(err, NotAdminAPI):
                return str(err)
        return None

    def _render(self) -> None:
        try:
            main = self.screen_stack[0]
            table = main.query_one(FleetTable)
            # (every widget drawn, looked up before anything is: closing down, the screen's widgets go
            # one by one, and a poll that ended meanwhile found the table but not the line under it)
            lines = {s: main.query_one(s, Static) for s in ("#status", "#crumbs", "#message", "#summary")}
        except (NoMatches, IndexError):
            return  # (starting, or closing down: nothing to draw on)
        view = self.view
        place = self.place
        # PERF: the rows are built once per poll; a key (sort, filter, cursor) reuses them
        built = self._built
        if built is None or built[0] != (view.name, self.data_version):
            built = self._built = self._build(view, self.data, self.data_version)
        rows = built[1]
        widths = built[2]
        if place.scope is not None:
            field, value = place.scope
            rows = [r for r in rows if _in_scope(r.record.get(field), value)]
        total = len(rows)
        rows = apply_filter(rows, place.filter)
        sort = place.sort if place.sort is not None else view.default_sort
        rows = sort_rows(rows, sort, place.reverse)
        keep = table.current.key if table.current is not None and table.columns == view.columns else place.cursor_key
        table.set_rows(view.columns, rows, sort_column=sort, sort_reverse=place.reverse, keep=keep, widths=widths)
        self.rendered_rows = rows
        # the header: where, what, how fresh
        if self.disconnected is not None:
            # (the reason is said in full under the table, where it wraps: on this line an 80-column
            # terminal cut it before the fix it names)
            conn = Text("✖ disconnected, retrying", style="bold red")
            if self.last_ok is not None and self.show_ages:
                conn.append(f"; data {time.monotonic() - self.last_ok:.0f}s old")
        elif self.auth_error is not None:
            conn = Text("✖ unauthorized", style="bold red")
        elif self.polls == 0:
            conn = Text("… connecting")
        elif self._not_admin() is not None:  # (it answers, but as the client port: the message says which)
            conn = Text("✖ not an admin API", style="bold red")
        else:
            conn = Text("● connected", style="green")
        if self.disconnected is not None or self.auth_error is not None or self._not_admin() is not None:
            # (first: on a narrow terminal the end of the line is cut, and an empty table must not
            # read as an empty fleet)
            status = Text.assemble(conn, "  ", ("llmgw console", "bold"), "  ", self.label)
        else:
            status = Text.assemble(("llmgw console", "bold"), "  ", self.label, "  ", conn)
        if self.read_only:
            status.append("  [read-only]", style="bold yellow")
        self._show(lines, "#status", status)
        crumbs = " › ".join([*(_crumb(p) for p in self.stack), _crumb(place)])
        # (nothing read yet, a token refused from the start: no count, rather than a 0 that reads as none)
        count = "–" if self.last_ok is None else f"{len(rows)}/{total}" if len(rows) != total else f"{total}"
        extra = f"  filter /{place.filter}" if place.filter else ""
        self._show(lines, "#crumbs", f"{crumbs} ({count}){extra}  sort {view.columns[sort].label}"
                                     f"{'↓' if place.reverse else '↑'}")
        msg = lines["#message"]
        problem = self.auth_error or self._api_problem()
        if problem is None and self.disconnected is not None:
            problem = printable(f"cannot reach the admin API: {self.disconnected}")
        note = view.note(self.data, place.scope) if problem is None else ""  # (a node's own errors, over its GPUs)
        said = [note] if note else []
        if problem is not None:
            said = [problem]
        elif self.polls and total == 0 and self.disconnected is None:
            said.append(view.empty(self.data, self.read_only) if place.scope is None
                        else view.empty_in(self.data, place.scope, self.read_only))
        elif self.polls and not rows and total:
            said.append("no rows match the filter (esc clears it)")
        text = "\n".join(said)
        msg.set_class(problem is not None, "error")
        msg.set_class(problem is None and bool(note), "warn")
        self._show(lines, "#message", text)
        msg.display = bool(text)
        self.message_text = text
        summary = view.summary(self.data) if problem is None else ""
        self._show(lines, "#summary", summary)

    def _show(self, lines: dict[str, Static], selector: str, content: str | Text) -> None:
        # PERF: a Static's update lays the screen out again; skip it when nothing changed
        key = content.markup if isinstance(content, Text) else content
        if self._shown.get(selector) != key:
            self._shown[selector] = key
            # (a str is text: an API's message, a typed filter, a node's name in the crumbs; never markup)
            lines[selector].update(content if isinstance(content, Text) else Text(printable(content, lines=True)))

    # -- keys --

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        for k in KEYS:
            if k.action.split("(")[0] == action:
                if k.changes and self.read_only:
                    return False
                if k.views and self.place.view not in k.views:
                    return False
        return True

    def _switch(self, name: str, *, push: bool = True, scope: tuple[str, str] | None = None,
                filter: str = "") -> None:
        table = self.main.query_one(FleetTable)
        if table.current is not None:
            self.place.cursor_key = table.current.key
        if push:
            self.stack.append(self.place)
            del self.stack[:-10]
        self.place = _Place(name, scope=scope, filter=filter)
        table.cursor = 0
        self.refresh_bindings()
        self._render()
        self.wake()

    def action_go_back(self) -> None:
        if self._prompt_mode is not None:
            self._close_prompt()
            return
        if self.place.filter:
            self.place.filter = ""
            self._render()
            return
        if self.stack:
            self.place = self.stack.pop()
            self.refresh_bindings()
            self._render()
            self.wake()

    def _typed(self, char: str) -> bool:
        """A priority key while typing (into the prompt or a dialog): type it there instead."""
        if self._prompt_mode is None and self.screen is self.screen_stack[0]:
            return False
        focused = self.focused
        if isinstance(focused, Input):
            focused.insert_text_at_cursor(char)
        return True

    def action_command(self) -> None:
        if not self._typed(":"):
            self._open_prompt("command", ":")

    def action_filter(self) -> None:
        if not self._typed("/"):
            self._open_prompt("filter", "/", self.place.filter)

    def _open_prompt(self, mode: str, prefix: str, value: str = "") -> None:
        prompt = self.main.query_one("#prompt", Input)
        self._prompt_mode = mode
        prompt.placeholder = "endpoints models nodes gpus deployments mirror help quit" if mode == "command" \
            else "a regular expression; !text inverts"
        self.main.query_one("#prompt-label", Static).update(prefix)
        prompt.value = value
        self.main.query_one("#promptbar").display = True  # (inline: focusable at once, before the next layout)
        self.screen.set_focus(prompt)  # (at once: the keys typed next must reach it, not the table)

    def _close_prompt(self) -> None:
        prompt = self.main.query_one("#prompt", Input)
        self._prompt_mode = None
        self.main.query_one("#promptbar").display = False
        prompt.value = ""
        self.screen.set_focus(self.main.query_one(FleetTable))

    @on(Input.Changed, "#prompt")
    def _prompt_changed(self, event: Input.Changed) -> None:
        if self._prompt_mode == "filter":
            self.place.filter = event.value
            self._render()

    @on(Input.Submitted, "#prompt")
    def _prompt_submitted(self, event: Input.Submitted) -> None:
        mode = self._prompt_mode
        value = event.value.strip()
        if mode == "command":
            prompt = self.main.query_one("#prompt", Input)
            suggestion = getattr(prompt, "_suggestion", "")
            self._close_prompt()
            self.run_command(value or suggestion)
        else:
            self._close_prompt()
            self.place.filter = value
            self._render()

    def on_key(self, event: Any) -> None:
        # tab completes a command (the suggestion shown greyed after the cursor)
        if self._prompt_mode == "command" and event.key == "tab":
            prompt = self.main.query_one("#prompt", Input)
            suggestion = getattr(prompt, "_suggestion", "")
            if suggestion:
                prompt.value = suggestion
                prompt.cursor_position = len(suggestion)
            event.prevent_default()
            event.stop()

    def run_command(self, text: str) -> None:
        """``:name [filter]``: switch view (``endpoints``, ``gpus node-a``, ...), ``help`` or ``quit``."""
        word, _, rest = text.lstrip(":").strip().partition(" ")
        target = COMMANDS.get(word.lower())
        if target is None:
            matches = [c for c in _COMPLETIONS if c.startswith(word.lower())] if word else []
            target = matches[0] if len(matches) == 1 else None
        if target is None:
            self.notify(f"no command {word!r}; try {', '.join(_COMPLETIONS)}", severity="warning")
            return
        if target == "help":
            self.action_help()
        elif target == "quit":
            self.exit()
        else:
            # a view named with : starts a new trail (as k9s's), drill-downs extend it: switching
            # back and forth must not pile crumbs up until the current one falls off the line
            self.stack.clear()
            self._switch(target, push=False, filter=rest.strip())

    def action_help(self) -> None:
        self.push_screen(TextScreen("llmgw console: keys", help_text(self.read_only)))

    def action_sort(self, delta: int) -> None:
        n = len(self.view.columns)
        cur = self.place.sort if self.place.sort is not None else self.view.default_sort
        self.place.sort = (cur + delta) % n
        self._render()

    def action_reverse(self) -> None:
        self.place.reverse = not self.place.reverse
        self._render()

    @on(FleetTable.Selected, "#table")
    def _selected(self, event: FleetTable.Selected) -> None:
        row = event.row
        name = self.place.view
        if name == "nodes":
            self._switch("gpus", scope=("node", row.key))
        elif name == "models":
            if row.record.get("total") == 0 and row.record.get("desired") is not None:
                # (deployed, no replica ready yet: its deployments say why)
                self._switch("deployments", scope=("served_name", row.key))
            else:
                self._switch("endpoints", scope=("models", row.key))
        elif name == "deployments":
            self.run_worker(self._replica_logs(row), group="action")
        else:
            self.push_screen(TextScreen(f"{self.view.title[:-1] if name != 'gpus' else 'GPU'} {row.key}",
                                        self._details(row.record)))

    def _details(self, record: dict[str, Any]) -> str:
        head = ""
        state = record.get("node_state")
        if state is not None and state != "up":  # (a GPU of a node past its heartbeat grace)
            age = record.get("heartbeat_age_s")
            heard = (f"its last heartbeat {fmt_age(age, self.show_ages)} ago" if age is not None
                     else "not heard from since this control plane took over")
            head = f"node {state}: no current readings ({heard})\n\n"
        return head + details(record, show_ages=self.show_ages)

    # -- actions (each through the admin API; destructive ones ask first) --

    def _selected_row(self) -> Row | None:
        row = self.main.query_one(FleetTable).current
        if row is None:
            self.notify("nothing selected", severity="warning")
        return row

    def _confirm(self, question: str, then: Callable[[], Any]) -> None:
        def answered(yes: bool | None) -> None:
            if yes:
                self.run_worker(then(), group="action")

        self.push_screen(ConfirmScreen(question), answered)

    async def _act(self, method: str, path: str, body: Any, done: Callable[[Any], str]) -> None:
        try:
            res = await self.client.call(method, path, body)
        except ClientError as exc:
            self.notify(str(exc), severity="error", timeout=8)
            return
        self.notify(done(res))
        self.wake()

    def action_drain(self) -> None:
        row = self._selected_row()
        if row is None or self.read_only:
            return
        ep = row.key
        self._confirm(f"Drain {ep}? No new requests go to it; those in flight finish.",
                      lambda: self._act("POST", f"/admin/v1/endpoints/{quote_id(ep)}/drain", None,
                                        lambda r: f"{ep}: draining" if r.get("changed") else f"{ep}: already draining"))

    def action_undrain(self) -> None:
        row = self._selected_row()
        if row is None or self.read_only:
            return
        ep = row.key
        self.run_worker(self._act("POST", f"/admin/v1/endpoints/{quote_id(ep)}/undrain", None,
                                  lambda r: f"{ep}: taking requests" if r.get("changed")
                                  else f"{ep}: was not draining"), group="action")

    def action_cordon(self) -> None:
        row = self._selected_row()
        if row is None or self.read_only:
            return
        node = row.key
        if row.record.get("cordoned"):
            self.run_worker(self._act("POST", f"/admin/v1/nodes/{quote_id(node)}/uncordon", None,
                                      lambda r: f"{node}: uncordoned"), group="action")
            return
        self._confirm(f"Cordon {node}? No new replicas are placed there; running ones stay.",
                      lambda: self._act("POST", f"/admin/v1/nodes/{quote_id(node)}/cordon", None,
                                        lambda r: f"{node}: cordoned"))

    def action_reload(self) -> None:
        if self.read_only:
            return

        self._confirm("Reload the gateway's config file? Endpoints may be added, removed or replaced.",
                      lambda: self._act("POST", "/admin/v1/reload", None, reload_summary))

    def action_scale(self) -> None:
        row = self._selected_row()
        if row is None or self.read_only:
            return
        name = row.key
        current = row.record.get("desired", row.record.get("replicas"))

        def answered(value: str | None) -> None:
            if value is None:
                return
            try:
                n = replica_count(value)  # (0-1024, ASCII digits: as llmgw ctl scale takes it)
            except ValueError as exc:
                self.notify(str(exc), severity="error")
                return
            self._confirm(f"Scale {name} to {n} replica(s)?",
                          lambda: self._act("POST", f"/admin/v1/deployments/{quote_id(name)}/scale",
                                            {"replicas": n}, lambda r: f"{name}: scaling to {n}"))

        self.push_screen(AskScreen(f"Replicas for {name} (0-{MAX_REPLICAS}):",
                                   "" if not isinstance(current, int) else str(current)), answered)

    def action_import_ollama(self) -> None:
        if self.read_only:
            return
        self.push_screen(ImportScreen(self.client))

    async def _replica_logs(self, row: Row) -> None:
        got = row.record.get("replicas")
        reps: list[Any] = got if isinstance(got, list) else []
        lines: list[str] = []
        for r in reps:
            rid = r.get("id") or r.get("name")
            if not rid:
                continue
            head = f"== {rid} on {r.get('node') or ABSENT}: {r.get('state') or ABSENT}"
            try:
                # (GET /admin/v1/replicas/{id}/logs: the end of the replica's log, fetched from its node)
                res = await self.client.get(f"/admin/v1/replicas/{quote_id(str(rid))}/logs?lines=100")
            except ClientError as exc:
                lines.append(f"{head}\n(no log: {exc})")
                continue
            text = res.get("text") if isinstance(res, dict) else None
            lines.append(f"{head}\n{text or '(empty)'}")
        body = "\n\n".join(lines) if lines else self._details(row.record)
        # (the engines' own output: line breaks kept, any other control character escaped)
        self.push_screen(TextScreen(f"Deployment {row.key}: replicas and their log tails", body))


def _in_scope(value: Any, wanted: str) -> bool:
    if isinstance(value, list):
        return wanted in value
    return value == wanted


def _crumb(p: _Place) -> str:
    title = VIEWS[p.view].title
    return f"{title} of {p.scope[1]}" if p.scope else title


def help_text(read_only: bool) -> Text:
    """Every key, global and per view (what ``?`` shows), made from :data:`KEYS`."""
    t = Text()
    t.append("Global\n", style="bold underline")
    for k in KEYS:
        if not k.views and not (k.changes and read_only):
            t.append(f"  {_key_label(k.key):>6}  ", style="bold")
            t.append(k.help + "\n")
    t.append("  ↑ ↓ PgUp PgDn Home End  move     ← →  scroll sideways\n")
    for name, view in VIEWS.items():
        keys = [k for k in KEYS if name in k.views and not (k.changes and read_only)]
        t.append(f"\n{view.title}", style="bold underline")
        t.append(f"   :{name}\n")
        t.append("  columns: " + ", ".join(c.label for c in view.columns) + "\n", style="dim")
        for k in keys:
            t.append(f"  {_key_label(k.key):>6}  ", style="bold")
            t.append(k.help + "\n")
        if not keys:
            t.append("  (no actions here" + (" in read-only mode" if read_only else "") + ")\n", style="dim")
    if read_only:
        t.append("\nread-only: every action that changes something is hidden\n", style="bold yellow")
    t.append("\nAbsent numbers show as –, never 0. Every state is a word; colour only repeats it.\n", style="dim")
    return t

