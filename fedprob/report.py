"""Reports: Markdown/HTML tables and the self-contained HTML page of a run.

:class:`Table` is a list of dict rows with a title and notes; a notebook shows
it directly (``_repr_html_``, ``_repr_markdown_``). :func:`html_report`
writes one HTML file (figures embedded as base64 PNG, no external files) with
the configuration, timings, per-round metrics, diagnostics and plots of one
or several runs.
"""
from __future__ import annotations

import base64
import html
import io
import json
import math
from pathlib import Path
from typing import Optional


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


# -- HTML page ----------------------------------------------------------------------------------

_CSS = """body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}
table{border-collapse:collapse;margin:0.5em 0;font-size:0.85em}td,th{border:1px solid #ccc;padding:2px 6px}
th{background:#f0f0f0}pre{background:#f7f7f7;padding:0.5em}.warn li{color:#a40}img{max-width:100%}"""


def figure_html(fig, alt: str = "figure") -> str:
    """A matplotlib figure as an <img> with the PNG embedded (base64); the figure is closed."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}"/>'


SCALAR_COLUMNS = ("round", "time", "accuracy", "nll", "brier", "ece", "rmse", "coverage_95", "coverage_50",
                  "client_loss", "client_accept_prob", "client_num_divergences")


def history_rows(history) -> list:
    """The scalar columns of a history that any round has."""
    cols = [c for c in SCALAR_COLUMNS if any(c in h for h in history)]
    return [{c: h.get(c, "") for c in cols} for h in history]


def html_report(runs, path, title: str = "fedprob report") -> str:
    """Write one HTML page for ``runs``: a list of dicts (see :func:`fedprob.rundir.load_run`).

    Each run dict has ``name``, ``config`` (dict), ``history`` (list of
    dicts), ``metrics`` (dict) and optionally ``idata`` (ArviZ) and
    ``diagnostics`` (rows). Returns the path written.
    """
    from . import plots
    from .extras import require

    require("plot", "a report")

    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>"]
    if len(runs) > 1:
        summary = [dict(method=r["name"], **{k: v for k, v in r.get("metrics", {}).items()
                                             if isinstance(v, (int, float))}) for r in runs]
        parts.append("<h2>Summary</h2>" + html_table(summary))
    hist = {r["name"]: r["history"] for r in runs if r.get("history")}
    for metric in ("accuracy", "nll", "rmse"):
        if any(metric in h for hs in hist.values() for h in hs):
            parts.append(f"<h3>Learning curves: {metric}</h3>")
            parts.append(figure_html(plots.learning_curves(hist, metric), f"learning curves {metric}"))
    for r in runs:
        name = html.escape(r["name"])
        parts.append(f"<h2>{name}</h2>")
        if r.get("config"):
            parts.append("<h3>Configuration</h3><pre>" + html.escape(json.dumps(r["config"], indent=1, default=str))
                         + "</pre>")
        if r.get("metrics"):
            parts.append("<h3>Final metrics and timings</h3>" + html_table([r["metrics"]]))
        if r.get("history"):
            parts.append("<h3>Per-round metrics</h3>" + html_table(history_rows(r["history"])))
            last = r["history"][-1]
            if "reliability" in last:
                parts.append("<h3>Reliability</h3>" + figure_html(plots.reliability_diagram(last, title=r["name"]),
                                                                   "reliability diagram"))
        if r.get("diagnostics"):
            t = Table(r["diagnostics"], notes=r.get("warnings", ()))
            parts.append("<h3>Diagnostics</h3>" + t._repr_html_())
        idata = r.get("idata")
        if idata is not None and getattr(idata, "attrs", {}).get("kind") not in ("point estimate", "predictive"):
            try:
                parts.append("<h3>Trace and rank</h3>" + figure_html(plots.trace(idata), "trace"))
                parts.append(figure_html(plots.rank(idata), "rank"))
            except (ValueError, KeyError) as e:
                parts.append(f"<p>no trace plot: {html.escape(str(e))}</p>")
    parts.append("</body></html>")
    path = Path(path)
    path.write_text("".join(parts))
    return str(path)


def result_report(result, path, name: Optional[str] = None) -> str:
    """:func:`html_report` of one in-memory :class:`~fedprob.result.Result`."""
    from .extras import require
    from .rundir import run_record

    require("plot", "result.report(...)")
    return html_report([run_record(result, name=name)], path, title=f"fedprob report: "
                       f"{name or type(result.algorithm).__name__}")
