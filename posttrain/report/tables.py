"""The report's HTML pieces: escaping, numbers as the report writes them, cells, tables and links."""

import html
import json
import math
import os
import urllib.parse


def escape(value) -> str:
    return html.escape(str(value), quote=True)


def number(value: float) -> str:
    """4 significant digits (a large count with thousands separators), for reading, not for copying."""
    if isinstance(value, int) or (math.isfinite(value) and value == int(value) and abs(value) >= 1e4):
        return f"{int(value):,}"
    return f"{value:.4g}"


def change(first: float, last: float) -> str:
    """last - first with its sign."""
    difference = last - first
    return "0" if difference == 0 else ("+" if difference > 0 else "") + number(difference)


def clock(seconds: float) -> str:
    """h:mm:ss (m:ss under an hour; seconds with a decimal under a minute)."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, second = divmod(int(round(seconds)), 60)
    hours, minute = divmod(minutes, 60)
    return f"{hours}:{minute:02d}:{second:02d}" if hours else f"{minute}:{second:02d}"


def cell(value, css_class: str = "") -> str:
    """A table cell: a number right-aligned (class num), text as text (class text), None as '-'; `css_class` adds."""
    if isinstance(value, bool) or value is None:
        kind, text = "", "-" if value is None else str(value)
    elif isinstance(value, (int, float)):
        kind, text = "num", number(value) if math.isfinite(value) else str(value)
    else:
        kind, text = "text", value if isinstance(value, str) else json.dumps(value, default=str)
    classes = " ".join(c for c in (kind, css_class) if c)
    return f"<td class=\"{classes}\">{escape(text)}</td>" if classes else f"<td>{escape(text)}</td>"


def raw_cell(markup: str, css_class: str = "") -> str:
    """A cell of markup already escaped (a link, emphasis)."""
    return f"<td class=\"{css_class}\">{markup}</td>" if css_class else f"<td>{markup}</td>"


def table(header: list[str], body: list[list], css_class: str = "", numeric: tuple = ()) -> str:
    """A table of plain values (each escaped in `cell`); `numeric`: the columns whose heading is right-aligned."""
    head = "".join(f"<th class=\"num\">{escape(h)}</th>" if i in numeric else f"<th>{escape(h)}</th>"
                   for i, h in enumerate(header))
    lines = "".join("<tr>" + "".join(cell(v) for v in row) + "</tr>\n" for row in body)
    return markup_table(head, lines, css_class)


def markup_table(head: str, lines: str, css_class: str = "") -> str:
    """A table from its heading cells and body rows, already markup."""
    attribute = f" class=\"{css_class}\"" if css_class else ""
    return (f"<div class=\"scroll\"><table{attribute}><thead><tr>{head}</tr></thead>\n<tbody>\n{lines}</tbody>"
            "</table></div>")


def link(path: str, page_dir: str, text: str | None = None) -> str:
    """A link to a local file or folder, relative to the page's folder (nothing fetched until clicked), showing
    `text` (default: the path itself)."""
    target = urllib.parse.quote(os.path.relpath(path, page_dir).replace(os.sep, "/"))
    return f"<a href=\"{escape(target)}\">{escape(text if text is not None else path)}</a>"
