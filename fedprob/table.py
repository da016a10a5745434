"""Tables of dict rows: Markdown and HTML text, and :class:`Table` (rows with a title and notes).

Floats are shown to 4 significant digits; NaN as ``nan``. A :class:`Table` is
what ``result.diagnostics()`` and ``result.summary()`` return: Markdown and
HTML reprs for notebooks, ``column(name)``, ``to_pandas()``.
"""
from __future__ import annotations

import html
import math


def _fmt(v) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.4g}"
    return str(v)


def format_table(rows) -> str:
    """A Markdown table of dict rows (floats to 4 significant digits)."""
    if not rows:
        return ""
    cols = list(dict.fromkeys(c for r in rows for c in r))
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def html_table(rows) -> str:
    """An HTML table of dict rows (floats to 4 significant digits, cells escaped)."""
    if not rows:
        return "<p>(empty)</p>"
    cols = list(dict.fromkeys(c for r in rows for c in r))
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(r.get(c, '')))}</td>" for c in cols) + "</tr>"
                   for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


class Table:
    """Rows (dicts) with a title and notes (warnings); Markdown and HTML reprs for notebooks."""

    def __init__(self, rows, title: str = "", notes=()):
        self.rows = [dict(r) for r in rows]
        self.title = title
        self.notes = list(notes)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]

    def column(self, name):
        return [r.get(name) for r in self.rows]

    def to_pandas(self):
        """The rows as a pandas DataFrame (indexed by ``parameter`` or ``scope`` when there is one)."""
        import pandas as pd

        df = pd.DataFrame(self.rows)
        for key in ("parameter", "scope"):
            if key in df.columns:
                return df.set_index(key)
        return df

    def _repr_markdown_(self) -> str:
        parts = [f"**{self.title}**\n"] if self.title else []
        parts.append(format_table(self.rows))
        parts += ["", *[f"- {n}" for n in self.notes]] if self.notes else []
        return "\n".join(parts)

    def _repr_html_(self) -> str:
        t = f"<h4>{html.escape(self.title)}</h4>" if self.title else ""
        notes = "".join(f"<li>{html.escape(n)}</li>" for n in self.notes)
        return t + html_table(self.rows) + (f"<ul class='warn'>{notes}</ul>" if notes else "")

    def __repr__(self) -> str:
        return self._repr_markdown_()


__all__ = ["Table", "format_table", "html_table"]
