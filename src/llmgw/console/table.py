"""A fast, read-only table for the console: only the lines on screen are ever rendered.

Textual's ``DataTable`` measures every cell of every row it is given, which for
8,000 GPUs costs over a second per refresh. This widget keeps the rows as plain
data (:class:`~llmgw.console.views.Row`), computes column widths from the cells'
lengths, and renders a line only when Textual asks for it (the Line API), so a
key press redraws ~20 lines whatever the fleet's size. Sorting and filtering
happen on the plain rows, before they reach it.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.style import Style
from rich.text import Text
from textual.binding import Binding
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip

from .views import Cell, Column, Row, column_widths, cut_point

__all__ = ["FleetTable"]

MAX_WIDTH = 48
GAP = 1


class FleetTable(ScrollView, can_focus=True):
    """Rows under a fixed header line, a row cursor, horizontal scrolling for narrow terminals."""

    DEFAULT_CSS = """
    FleetTable { height: 1fr; scrollbar-size: 1 1; }
    """

    BINDINGS = [
        Binding("up,k", "cursor(-1)", "up", show=False),
        Binding("down,j", "cursor(1)", "down", show=False),
        Binding("pageup", "page(-1)", "page up", show=False),
        Binding("pagedown", "page(1)", "page down", show=False),
        Binding("home,g", "jump(0)", "first", show=False),
        Binding("end,G", "jump(-1)", "last", show=False),
        Binding("left", "pan(-8)", "scroll left", show=False),
        Binding("right", "pan(8)", "scroll right", show=False),
        Binding("enter", "select", "drill down", show=False),
    ]

    class Selected(Message):
        """Enter on a row."""

        def __init__(self, table: FleetTable, row: Row) -> None:
            super().__init__()
            self.table = table
            self.row = row

        @property
        def control(self) -> FleetTable:
            return self.table

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.columns: tuple[Column, ...] = ()
        self.rows: list[Row] = []
        self.widths: list[int] = []
        self.sort_column: int | None = None
        self.sort_reverse = False
        self.cursor = 0
        self._header_style = Style(bold=True)
        self._cursor_style = Style(reverse=True)
        self._sort_mark = Style(bold=True, underline=True)

    # -- data --

    def set_rows(self, columns: Sequence[Column], rows: list[Row], *, sort_column: int | None = None,
                 sort_reverse: bool = False, keep: str | None = None, widths: list[int] | None = None) -> None:
        """Show ``rows`` (already sorted and filtered); the cursor stays on the row keyed ``keep`` if present.

        ``widths``: the columns' widths (:func:`~llmgw.console.views.column_widths` of every row, so
        columns keep still while a filter narrows the rows); measured from ``rows`` when not given.
        """
        columns = tuple(columns)
        if columns != self.columns:
            self.scroll_to(0, 0, animate=False)
        self.columns = columns
        self.sort_column = sort_column
        self.sort_reverse = sort_reverse
        self.widths = widths if widths is not None else column_widths(columns, rows, MAX_WIDTH)
        self.rows = rows
        if keep is not None:
            for i, r in enumerate(rows):
                if r.key == keep:
                    self.cursor = i
                    break
        self.cursor = max(0, min(self.cursor, len(rows) - 1))
        self.virtual_size = Size(sum(self.widths) + GAP * len(self.widths), len(rows) + 1)
        self._keep_cursor_visible()
        self.refresh()

    @property
    def current(self) -> Row | None:
        return self.rows[self.cursor] if 0 <= self.cursor < len(self.rows) else None

    # -- rendering --

    def _line(self, cells: Sequence[str | Text | Cell], style: Style | None = None) -> Text:
        t = Text(no_wrap=True, overflow="crop", end="")
        for i, (col, cell, w) in enumerate(zip(self.columns, cells, self.widths, strict=False)):
            if isinstance(cell, Cell):
                piece = cell.text()
            else:
                piece = cell.copy() if isinstance(cell, Text) else Text(cell)
            n = piece.cell_len
            if n > w:  # (at a word boundary where there is one: "the large…" reads as a word)
                piece.truncate(cut_point(piece.plain, w))
                piece.append("…")
                n = piece.cell_len
            pad = " " * (w - n)
            if col.right:
                t.append(pad)
                t.append_text(piece)
            else:
                t.append_text(piece)
                t.append(pad)
            if i < len(self.columns) - 1:
                t.append(" " * GAP)
        if style is not None:
            t.stylize(style)
        return t

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        width = self.size.width
        console = self.app.console
        if y == 0:
            labels: list[str | Text] = []
            for i, c in enumerate(self.columns):
                if i == self.sort_column:
                    labels.append(Text(c.label + ("↓" if self.sort_reverse else "↑"), style=self._sort_mark))
                else:
                    labels.append(c.label)
            text = self._line(labels, self._header_style)
        else:
            index = scroll_y + y - 1
            if index >= len(self.rows):
                return Strip.blank(width, self.rich_style)
            row = self.rows[index]
            text = self._line(row.cells, self._cursor_style if index == self.cursor and self.has_focus else None)
            if index == self.cursor and not self.has_focus:
                text.stylize(Style(underline=True))
        segments = list(text.render(console))
        strip = Strip(segments).crop(scroll_x, scroll_x + width)
        return strip.extend_cell_length(width, self.rich_style)

    # -- cursor --

    def _keep_cursor_visible(self) -> None:
        page = max(1, self.size.height - 1)
        top = self.scroll_offset.y
        if self.cursor < top:
            self.scroll_to(y=self.cursor, animate=False)
        elif self.cursor >= top + page:
            self.scroll_to(y=self.cursor - page + 1, animate=False)

    def _move(self, to: int) -> None:
        if not self.rows:
            return
        self.cursor = max(0, min(to, len(self.rows) - 1))
        self._keep_cursor_visible()
        self.refresh()

    def action_cursor(self, delta: int) -> None:
        self._move(self.cursor + delta)

    def action_page(self, direction: int) -> None:
        self._move(self.cursor + direction * max(1, self.size.height - 2))

    def action_jump(self, where: int) -> None:
        self._move(0 if where == 0 else len(self.rows) - 1)

    def action_pan(self, delta: int) -> None:
        self.scroll_to(x=max(0, self.scroll_offset.x + delta), animate=False)

    def action_select(self) -> None:
        row = self.current
        if row is not None:
            self.post_message(self.Selected(self, row))

    def on_focus(self) -> None:
        self.refresh()

    def on_blur(self) -> None:
        self.refresh()

    def on_resize(self) -> None:
        self._keep_cursor_visible()

    def on_click(self, event: object) -> None:
        y = getattr(event, "y", None)
        if isinstance(y, int) and y >= 1:
            self._move(self.scroll_offset.y + y - 1)

