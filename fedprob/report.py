"""Plain-text reports: Markdown tables of metrics."""
from __future__ import annotations


def format_table(rows) -> str:
    """A Markdown table of dict rows (floats to 4 significant digits)."""
    if not rows:
        return ""
    cols = list(dict.fromkeys(c for r in rows for c in r))

    def fmt(v):
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)
