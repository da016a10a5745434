"""Reports: Markdown/HTML tables and the self-contained HTML page of a run.

:class:`Table` is a list of dict rows with a title and notes; a notebook shows
it directly (``_repr_html_``, ``_repr_markdown_``). :func:`html_report`
writes one HTML file (figures embedded as base64 PNG, no external files) with
the configuration, timings, per-round metrics, diagnostics and plots of one
or several runs, and each method's posterior marginals beside a reference
posterior (pooled NUTS, an exact Gaussian) when one is given.
"""
from __future__ import annotations

import base64
import html
import io
import json
import math
from pathlib import Path
from typing import Optional


from .table import Table, _fmt, format_table, html_table  # noqa: F401  (re-exported)


# -- HTML page ----------------------------------------------------------------------------------

_CSS = """body{font-family:sans-serif;max-width:1180px;margin:1.5em auto;padding:0 1em;color:#222;line-height:1.35}
table{border-collapse:collapse;margin:0.5em 0;font-size:0.85em}td,th{border:1px solid #ccc;padding:2px 6px}
th{background:#f0f0f0}pre{background:#f7f7f7;padding:0.5em;white-space:pre-wrap;word-break:break-word}
.warn li{color:#a40}img{max-width:100%;height:auto}.scroll{max-width:100%;overflow-x:auto}
nav ol{columns:2;font-size:0.9em}dl.legend{font-size:0.85em;display:grid;grid-template-columns:max-content 1fr;
gap:0.1em 1em}dl.legend dt{font-weight:bold}details{margin:0.4em 0}summary{cursor:pointer;color:#225}
.meta{font-size:0.9em;color:#444}"""

def figure_html(fig, alt: str = "figure") -> str:
    """A matplotlib figure as an <img> with the PNG embedded (base64); the figure is closed."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    if not fig.get_constrained_layout():
        try:
            fig.tight_layout()                      # subplot titles and labels do not overlap
        except (ValueError, RuntimeError):          # pragma: no cover - a layout matplotlib cannot solve
            pass
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


#: the summary's columns and what they mean (the rest of the final metrics are folded away)
SUMMARY_LEGEND = {
    "method": "the algorithm (and client backend), in the order the runs were made",
    "rounds": "communication rounds run",
    "accuracy": "share of test rows classified right (classification)",
    "nll": "mean negative log predictive density of the test rows; lower is better",
    "ece": "expected calibration error over 15 confidence bins; 0 is calibrated",
    "rmse": "root mean squared error of the predictive mean (regression)",
    "coverage_95": "share of test targets inside the 95% predictive interval (regression)",
    "total_time": "wall time of the run in seconds",
    "compile_time": "seconds of it spent compiling (0 when a cache or an earlier run had compiled it)",
}


def _wrap(table_html: str) -> str:
    return f"<div class='scroll'>{table_html}</div>"


def _slug(name: str, i: int) -> str:
    import re

    return f"m{i}-" + re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower()


def summary_rows(runs) -> list:
    """One row per run with the columns of :data:`SUMMARY_LEGEND` that any run has."""
    rows = []
    for r in runs:
        m = r.get("metrics", {})
        row = {"method": r["name"], "rounds": len(r.get("history", [])) or m.get("round", "")}
        row.update({k: m[k] for k in SUMMARY_LEGEND if k in m and k not in ("method", "rounds")})
        rows.append(row)
    cols = [c for c in SUMMARY_LEGEND if any(c in row for row in rows)]
    return [{c: row.get(c, "") for c in cols} for row in rows]


def _nonempty(rows) -> list:
    """Rows without the columns that are empty everywhere, and without rows holding only labels."""
    rows = [r for r in rows if any(v not in ("", None) for k, v in r.items() if k not in ("scope", "kind"))]
    cols = [c for c in dict.fromkeys(c for r in rows for c in r)
            if any(r.get(c) not in ("", None) and not (isinstance(r.get(c), float) and math.isnan(r[c]))
                   for r in rows)]
    return [{c: r.get(c, "") for c in cols} for r in rows]


#: the columns of the comparison with the reference and what they mean
REFERENCE_LEGEND = {
    "method": "the algorithm, in run order",
    "kind": "what its posterior is: draws, a Gaussian, an ensemble, or a point estimate (no spread)",
    "coords": "coordinates compared: every coordinate of the sites the method and the reference share",
    "mean_err_median": "median over coordinates of |method mean - reference mean| / reference sd",
    "mean_err_max": "the largest of those standardised mean errors",
    "sd_ratio_median": "median over coordinates of method sd / reference sd: 1 is the reference's spread, "
                       "below 1 overconfident (empty for a point estimate)",
    "sd_ratio_min": "the smallest of those ratios",
    "sd_ratio_max": "the largest of those ratios",
}


def method_draws(run) -> Optional[dict]:
    """dict site -> (n, *site shape) draws of a run record's global posterior (n = 1 for a point estimate);
    None when the run has no parameter posterior (a predictive-space method) or no ArviZ data."""
    import numpy as np

    from .diagnostics import group

    idata = run.get("idata")
    post = group(idata, "posterior") if idata is not None else None
    if post is None:
        return None
    out = {}
    for k in post.data_vars:
        a = np.asarray(post[k], dtype=np.float64)
        out[str(k)] = a.reshape((-1,) + a.shape[2:])
    return out


def reference_rows(runs, reference: dict) -> list:
    """One row per run that has a parameter posterior: its standardised mean errors and sd ratios against
    ``reference`` (dict site -> draws) over every coordinate of the sites both have (:data:`REFERENCE_LEGEND`)."""
    import numpy as np

    rows = []
    for r in runs:
        draws = method_draws(r)
        if draws is None:
            continue
        err, ratio = [], []
        for site, ref in reference.items():
            a = draws.get(site)
            if a is None or a.shape[1:] != ref.shape[1:]:
                continue
            a, b = a.reshape(a.shape[0], -1), ref.reshape(ref.shape[0], -1)
            sd_ref = b.std(0, ddof=1)
            err.append(np.abs(a.mean(0) - b.mean(0)) / sd_ref)
            if a.shape[0] > 1:
                ratio.append(a.std(0, ddof=1) / sd_ref)
        if not err:
            continue
        err = np.concatenate(err)
        kind = (getattr(r.get("idata"), "attrs", {}) or {}).get("kind", "")
        row = {"method": r["name"], "kind": kind, "coords": int(err.size),
               "mean_err_median": float(np.median(err)), "mean_err_max": float(err.max())}
        if ratio:
            ratio = np.concatenate(ratio)
            row.update(sd_ratio_median=float(np.median(ratio)), sd_ratio_min=float(ratio.min()),
                       sd_ratio_max=float(ratio.max()))
        rows.append(row)
    cols = [c for c in REFERENCE_LEGEND if any(c in row for row in rows)]
    return [{c: row.get(c, "") for c in cols} for row in rows]


def _as_reference(reference, reference_name):
    """(name, dict site -> draws) or None, from what :func:`html_report` accepts as ``reference``."""
    from .rundir import load_reference, reference_draws

    if reference is None:
        return None
    if isinstance(reference, (str, Path)):
        loaded = load_reference(reference)
        if loaded is None:
            return None
        return (reference_name or loaded[0]), loaded[1]
    if isinstance(reference, tuple) and len(reference) == 2 and isinstance(reference[0], str):
        return (reference_name or reference[0]), reference_draws(reference[1])
    return (reference_name or "reference"), reference_draws(reference)


def _marginals_section(runs, ref, plots, max_sites: int = 6, max_coords: int = 4) -> str:
    """Each method's marginals of the first ``max_coords`` coordinates of the first ``max_sites`` sites,
    beside the reference when one is given, and the comparison table."""
    methods = {r["name"]: d for r in runs if (d := method_draws(r)) is not None}
    if not methods:
        return ""
    parts = ["<section id='marginals'><h2>Posterior marginals</h2>"]
    if ref is None:
        sites = list(dict.fromkeys(k for d in methods.values() for k in d))
        parts.append("<p class='meta'>No reference posterior was given: pass <code>reference=</code> to the "
                     "report (pooled NUTS draws, an exact posterior), or save one as RUN_DIR/reference.npz "
                     "with <code>fedprob.rundir.save_reference</code> (<code>fedprob report RUN_DIR --reference "
                     "FILE.npz</code>).</p>")
    else:
        name, draws = ref
        sites = [k for k in draws if any(k in d for d in methods.values())]
        n = next(iter(draws.values())).shape[0]
        parts.append(f"<p class='meta'>Beside the reference: {html.escape(name)} ({n} draws, shaded). "
                     "Lines are kernel densities of each method's draws; a dashed vertical line is a point "
                     "estimate.</p>")
        if not sites:
            parts.append("<p>The reference shares no site with the methods' posteriors: sites "
                         f"{html.escape(', '.join(draws))}.</p></section>")
            return "".join(parts)
    shown = sites[:max_sites]
    for site in shown:
        per = {m: d[site] for m, d in methods.items() if site in d}
        refd = ref[1][site] if ref is not None else None
        parts.append(f"<h3>{html.escape(site)}</h3>" + figure_html(
            plots.method_marginals(per, site, reference=refd, reference_name=ref[0] if ref else "reference",
                                   max_coords=max_coords), f"marginals of {site}"))
    if len(sites) > len(shown):
        parts.append(f"<p class='meta'>{len(sites) - len(shown)} more site(s) not drawn: "
                     f"{html.escape(', '.join(sites[len(shown):]))}.</p>")
    if ref is not None:
        rows = reference_rows(runs, ref[1])
        if rows:
            parts.append(f"<h3>Against the reference</h3>{_wrap(html_table(rows))}<dl class='legend'>"
                         + "".join(f"<dt>{html.escape(c)}</dt><dd>{html.escape(REFERENCE_LEGEND[c])}</dd>"
                                   for c in rows[0]) + "</dl>")
    parts.append("</section>")
    return "".join(parts)


def _header(runs) -> str:
    info = next((r["info"] for r in runs if r.get("info")), {})
    fed = info.get("federation", {})
    parts = []
    if fed.get("description"):
        parts.append(f"<p>{html.escape(fed['description'])}</p>")
    if fed.get("sizes"):
        sizes = fed["sizes"]
        parts.append(f"<p class='meta'>{fed.get('num_clients', len(sizes))} clients, {sum(sizes)} training rows "
                     f"(client sizes {min(sizes)} to {max(sizes)}); {len(runs)} run(s)</p>")
    if info.get("versions"):
        parts.append("<p class='meta'>versions: " + html.escape(", ".join(f"{k} {v}" for k, v in
                                                                           info["versions"].items())) + "</p>")
    return "".join(parts)


def html_report(runs, path, title: str = "fedprob report", reference=None,
                reference_name: Optional[str] = None) -> str:
    """Write one HTML page for ``runs``: a list of dicts (see :func:`fedprob.rundir.load_run`), in run order.

    Each run dict has ``name``, ``config`` (dict), ``history`` (list of
    dicts), ``metrics`` (dict) and optionally ``idata`` (ArviZ),
    ``diagnostics`` (rows), ``warnings`` and ``info`` (the algorithm's repr,
    the federation, library versions: :func:`fedprob.rundir.run_info`).
    The page: a header (data, clients, versions), contents, a summary of
    the columns that matter with a legend (every final metric folded below
    it), learning curves, the federation's heterogeneity, the posterior
    marginals of each method (beside ``reference`` when given, with a table
    of standardised mean errors and sd ratios against it), then one section
    per run (configuration, metrics, diagnostics, plots). Returns the path.

    reference: a reference posterior in any form
    :func:`fedprob.rundir.reference_draws` takes (dict site -> draws, such as
    pooled NUTS's ``get_samples()``; a posterior; a Result; ArviZ data; the
    path of a ``reference.npz`` or of a directory holding one), or a tuple
    ``(name, draws)`` as :func:`fedprob.rundir.load_reference` returns;
    ``reference_name`` says what it is ("pooled NUTS", "exact").
    """
    from . import plots
    from .extras import require

    require("plot", "a report")
    contents = [("summary", "Summary")]
    body = [f"<section id='summary'><h2>Summary</h2>{_wrap(html_table(summary_rows(runs)))}<dl class='legend'>"]
    cols = summary_rows(runs)[0] if runs else {}
    body.append("".join(f"<dt>{html.escape(c)}</dt><dd>{html.escape(SUMMARY_LEGEND[c])}</dd>" for c in cols))
    body.append("</dl>")
    full = [dict(method=r["name"], **{k: v for k, v in r.get("metrics", {}).items() if isinstance(v, (int, float))})
            for r in runs]
    body.append(f"<details><summary>every final metric</summary>{_wrap(html_table(full))}</details></section>")
    hist = {r["name"]: r["history"] for r in runs if r.get("history")}
    curves = [m for m in ("accuracy", "nll", "rmse") if any(m in h for hs in hist.values() for h in hs)]
    if curves:
        contents.append(("curves", "Learning curves"))
        body.append("<section id='curves'><h2>Learning curves</h2>")
        for metric in curves:
            body.append(f"<h3>{metric}</h3>" + figure_html(plots.learning_curves(hist, metric),
                                                             f"learning curves {metric}"))
        body.append("</section>")
    fed = next((r["info"]["federation"] for r in runs if r.get("info", {}).get("federation", {}).get("sizes")), None)
    if fed is not None:
        contents.append(("federation", "Federation"))
        body.append("<section id='federation'><h2>Federation</h2>" + figure_html(
            plots.heterogeneity(fed["sizes"], fed.get("label_counts")), "client sizes and label histograms")
            + "</section>")
    marg = _marginals_section(runs, _as_reference(reference, reference_name), plots)
    if marg:
        contents.append(("marginals", "Posterior marginals"))
        body.append(marg)
    for i, r in enumerate(runs):
        anchor = _slug(r["name"], i)
        contents.append((anchor, r["name"]))
        body.append(f"<section id='{anchor}'>{_run_section(r, plots)}</section>")
    nav = "<nav><h2>Contents</h2><ol>" + "".join(f"<li><a href='#{a}'>{html.escape(t)}</a></li>"
                                                   for a, t in contents) + "</ol></nav>"
    page = (f"<!doctype html><html><head><meta charset='utf-8'><meta name='viewport' "
            f"content='width=device-width'><title>{html.escape(title)}</title><style>{_CSS}</style></head><body>"
            f"<h1>{html.escape(title)}</h1>{_header(runs)}{nav}{''.join(body)}</body></html>")
    path = Path(path)
    path.write_text(page)
    return str(path)


def _run_section(r, plots) -> str:
    parts = [f"<h2>{html.escape(r['name'])}</h2>"]
    algo = r.get("info", {}).get("algorithm")
    if algo or r.get("config"):
        parts.append("<h3>Configuration</h3>")
        if algo:
            parts.append(f"<pre>{html.escape(algo)}</pre>")
        if r.get("config"):
            parts.append("<pre>" + html.escape(json.dumps(r["config"], indent=1, default=str)) + "</pre>")
    if r.get("metrics"):
        parts.append("<details><summary>final metrics and timings</summary>" + _wrap(html_table([r["metrics"]]))
                     + "</details>")
    if r.get("history"):
        parts.append("<details><summary>per-round metrics</summary>" + _wrap(html_table(history_rows(r["history"])))
                     + "</details>")
        last = r["history"][-1]
        if "reliability" in last:
            parts.append("<h3>Reliability</h3>" + figure_html(plots.reliability_diagram(last, title=r["name"]),
                                                               "reliability diagram"))
    if r.get("diagnostics"):
        rows = _nonempty(r["diagnostics"])
        notes = "".join(f"<li>{html.escape(n)}</li>" for n in r.get("warnings", ()))
        parts.append("<h3>Diagnostics</h3>" + (f"<ul class='warn'>{notes}</ul>" if notes else "")
                     + (f"<details><summary>per scope (global, clients)</summary>{_wrap(html_table(rows))}</details>"
                        if rows else ""))
    idata = r.get("idata")
    if idata is not None and getattr(idata, "attrs", {}).get("kind") not in ("point estimate", "predictive"):
        try:
            parts.append("<h3>Trace and rank</h3>" + figure_html(plots.trace(idata), "trace"))
            parts.append(figure_html(plots.rank(idata), "rank"))
        except (ValueError, KeyError) as e:
            parts.append(f"<p>no trace plot: {html.escape(str(e))}</p>")
    return "".join(parts)


def result_report(result, path, name: Optional[str] = None, reference=None,
                  reference_name: Optional[str] = None) -> str:
    """:func:`html_report` of one in-memory :class:`~fedprob.result.Result` (``reference`` as there)."""
    from .extras import require
    from .rundir import run_record

    require("plot", "result.report(...)")
    return html_report([run_record(result, name=name)], path, title=f"fedprob report: "
                       f"{name or type(result.algorithm).__name__}", reference=reference,
                       reference_name=reference_name)
