"""Plots (matplotlib: the ``plot`` extra, ``pip install ".[plot]"``). Each function returns a matplotlib Figure.

* :func:`learning_curves`: one history metric over the evaluated rounds, several runs overlaid
  (a bar chart of the final values when each run was evaluated once).
* :func:`heterogeneity`: client sizes and label histograms of a federation.
* :func:`reliability_diagram`: accuracy against confidence per bin (classification)
  or empirical against nominal interval coverage (regression), from a history entry.
* :func:`marginals`: a posterior's 1-D marginals against a reference's (exact or NUTS draws).
* :func:`method_marginals`: several methods' 1-D marginals of one site (kernel density
  lines, a point estimate as a vertical line) beside a reference's (shaded).
* :func:`client_contours`: per-client and global 2-sigma Gaussian contours on a 2-D slice
  of the flat parameter.
* :func:`trace` and :func:`rank`: ArviZ's trace and rank plots of a posterior group.
"""
from __future__ import annotations

import numpy as np


def _plt():
    from .extras import require

    require("plot", "plots")
    import matplotlib.pyplot as plt

    return plt


def _history(run):
    return run.history if hasattr(run, "history") else run


def learning_curves(runs: dict, metric: str = "accuracy", ax=None):
    """``runs``: name -> Result or history list; the metric over the evaluated rounds, one line per run.

    Rounds without the metric (not evaluated) are skipped, so a run evaluated every few rounds is
    still a line. When no run has more than one evaluated round, a bar chart of the final values.
    """
    plt = _plt()
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(6, 3.4), layout="constrained")
    points = {name: [e for e in _history(run) if isinstance(e.get(metric), (int, float))]
              for name, run in runs.items()}
    points = {k: v for k, v in points.items() if v}
    if points and max(len(v) for v in points.values()) == 1:
        names = list(points)
        ax.barh(range(len(names)), [v[-1][metric] for v in points.values()], color="C0")
        ax.set_yticks(range(len(names)), names, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel(f"{metric} (final round)")
        return fig
    for name, h in points.items():
        ax.plot([e["round"] for e in h], [e[metric] for e in h], marker="o", ms=3, label=name)
    ax.set_xlabel("round")
    ax.set_ylabel(metric)
    if points:
        ax.legend(fontsize=7)
    return fig


def heterogeneity(sizes, label_counts=None):
    """The federation at a glance: rows per client, and each client's label histogram (stacked shares)."""
    plt = _plt()
    sizes = np.asarray(sizes)
    K = len(sizes)
    ncols = 1 if label_counts is None else 2
    fig, axes = plt.subplots(1, ncols, figsize=(5.5 * ncols, 3.2), layout="constrained", squeeze=False)
    axes[0, 0].bar(range(K), sizes, color="C0")
    axes[0, 0].set_xlabel("client")
    axes[0, 0].set_ylabel("rows")
    axes[0, 0].set_title("client sizes", fontsize=9)
    if label_counts is not None:
        counts = np.asarray(label_counts, float)
        share = counts / np.maximum(counts.sum(1, keepdims=True), 1)
        bottom = np.zeros(K)
        cmap = plt.get_cmap("tab10" if counts.shape[1] <= 10 else "tab20")
        for c in range(counts.shape[1]):
            axes[0, 1].bar(range(K), share[:, c], bottom=bottom, color=cmap(c % cmap.N), label=str(c))
            bottom += share[:, c]
        axes[0, 1].set_xlabel("client")
        axes[0, 1].set_ylabel("share of rows")
        axes[0, 1].set_title("labels per client", fontsize=9)
        axes[0, 1].legend(fontsize=6, ncols=2, title="label", title_fontsize=6, loc="center left",
                          bbox_to_anchor=(1.0, 0.5))
    return fig


def reliability_diagram(entry, ax=None, title: str = ""):
    """From a history entry (or a Result: its last round) with a ``reliability`` curve."""
    plt = _plt()
    if hasattr(entry, "history"):
        entry = entry.history[-1]
    if isinstance(entry, list):
        entry = entry[-1]
    rel = entry.get("reliability")
    if rel is None:
        raise ValueError("this history entry has no reliability curve (evaluate on eval_data)")
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(3.6, 3.4))
    ax.plot([0, 1], [0, 1], "k--", lw=0.8)
    if "confidence" in rel:
        conf = np.asarray(rel["confidence"], float)
        acc = np.asarray(rel["accuracy"], float)
        cnt = np.asarray(rel["count"], float)
        edges = np.asarray(rel["edges"], float)
        m = cnt > 0
        ax.bar(edges[:-1][m], acc[m], width=np.diff(edges)[m], align="edge", alpha=0.5, edgecolor="k",
               label="accuracy")
        ax.plot(conf[m], acc[m], "o-", ms=3, color="C1", label="per bin")
        ax.set_xlabel("confidence")
        ax.set_ylabel("accuracy")
        ax.set_title(f"{title} ECE {entry.get('ece', float('nan')):.3f}".strip(), fontsize=9)
    else:
        ax.plot(rel["nominal"], rel["coverage"], "o-", ms=3)
        ax.set_xlabel("nominal coverage")
        ax.set_ylabel("empirical coverage")
        ax.set_title(title, fontsize=9)
    return fig


def _flat_draws(x):
    x = np.asarray(x)
    return x.reshape(-1, x.shape[-1]) if x.ndim > 1 else x[:, None]


def marginals(draws: dict, reference: dict, names=None, max_panels: int = 6):
    """Histograms of ``draws`` against ``reference`` (both dicts site -> (n, ...) draws), one panel per element."""
    plt = _plt()
    panels = []
    for k in names or draws:
        a, b = _flat_draws(draws[k]), _flat_draws(reference[k])
        for j in range(a.shape[1]):
            panels.append((f"{k}[{j}]" if a.shape[1] > 1 else k, a[:, j], b[:, j]))
    panels = panels[:max_panels]
    if not panels:
        raise ValueError("no sites to plot")
    fig, axes = plt.subplots(1, len(panels), figsize=(2.6 * len(panels), 2.4), squeeze=False)
    for ax, (label, a, b) in zip(axes[0], panels):
        lo, hi = np.percentile(np.concatenate([a, b]), [0.5, 99.5])
        bins = np.linspace(lo, hi, 40)
        ax.hist(b, bins, density=True, alpha=0.4, color="k", label="reference")
        ax.hist(a, bins, density=True, histtype="step", color="C0", lw=1.5, label="posterior")
        ax.set_title(label, fontsize=9)
        ax.set_yticks([])
    axes[0][0].legend(fontsize=7)
    return fig


def _kde(x, grid):
    """Gaussian kernel density of the draws ``x`` on ``grid`` (Scott's bandwidth)."""
    x = np.asarray(x, float)
    h = 1.06 * x.std() * len(x) ** -0.2
    if not h > 0:
        return None
    z = (grid[:, None] - x[None, :]) / h
    return np.exp(-0.5 * z * z).sum(1) / (len(x) * h * np.sqrt(2 * np.pi))


def method_marginals(methods: dict, site: str, reference=None, reference_name: str = "reference",
                     max_coords: int = 4):
    """The first ``max_coords`` coordinates of ``site``, one panel each: each method's marginal density.

    methods: name -> (n, ...) draws of the site (n = 1: a point estimate, drawn as a vertical
    dashed line); reference: optional (n, ...) draws, shaded grey. A density more than 1.6 times
    the reference's peak is clipped at the top of its panel (an overconfident method is a spike).
    """
    plt = _plt()

    def flat(a):                       # (n, *shape) -> (n, prod(shape)), coordinates in C order
        a = np.asarray(a, float)
        return a.reshape(a.shape[0], -1)

    shape = np.shape(reference if reference is not None else next(iter(methods.values())))[1:]
    ref = None if reference is None else flat(reference)
    flat = {k: flat(v) for k, v in methods.items()}
    d = int(np.prod(shape))
    ncols = min(d, max_coords)
    fig, axes = plt.subplots(1, ncols, figsize=(2.7 * ncols, 2.5), squeeze=False, layout="constrained")
    handles = {}
    for j, ax in enumerate(axes[0]):
        cols = [a[:, j] for a in flat.values() if a.shape[1] > j] + ([ref[:, j]] if ref is not None else [])
        lo, hi = np.percentile(np.concatenate(cols), [0.5, 99.5])
        pts = [a[0, j] for a in flat.values() if a.shape[0] == 1 and a.shape[1] > j]
        lo, hi = min([lo, *pts]), max([hi, *pts])
        pad = 0.08 * (hi - lo) if hi > lo else 1.0
        grid = np.linspace(lo - pad, hi + pad, 200)
        top = None
        if ref is not None:
            dens = _kde(ref[:, j], grid)
            if dens is not None:
                handles[reference_name] = ax.fill_between(grid, dens, color="0.75", lw=0)
                top = 1.6 * dens.max()
        for i, (name, a) in enumerate(flat.items()):
            if a.shape[1] <= j:
                continue
            color = f"C{i % 10}"
            dens = _kde(a[:, j], grid) if a.shape[0] > 1 else None
            if dens is None:
                handles[name] = ax.axvline(a[0, j], color=color, ls="--", lw=1.2)
            else:
                handles[name], = ax.plot(grid, dens, color=color, lw=1.3)
        if top is not None:
            ax.set_ylim(0, top)
        idx = ",".join(str(int(i)) for i in np.unravel_index(j, shape)) if shape else ""
        ax.set_title(f"{site}[{idx}]" if idx else site, fontsize=9)
        ax.set_yticks([])
        ax.tick_params(labelsize=7)
    fig.legend(list(handles.values()), list(handles), loc="outside lower center", ncols=min(len(handles), 4),
               fontsize=7, frameon=False)
    return fig


def _ellipse(mean, cov, n=100, r=2.0):
    t = np.linspace(0, 2 * np.pi, n)
    L = np.linalg.cholesky(cov + 1e-12 * np.eye(2))
    return mean[:, None] + r * L @ np.stack([np.cos(t), np.sin(t)])


def client_contours(client_draws, global_mean, global_cov, dims=(0, 1), reference=None, labels=None):
    """2-sigma contours of each client's draws (K, S, d) and of the global N(mean, cov) on coordinates ``dims``.

    ``reference``: optional (n, d) draws of the exact posterior, drawn as points.
    """
    plt = _plt()
    i, j = dims
    cd = np.asarray(client_draws)
    fig, ax = plt.subplots(figsize=(4, 4))
    if reference is not None:
        r = np.asarray(reference)
        ax.plot(r[:, i], r[:, j], ".", ms=1, color="0.7", label="reference draws")
    for k in range(cd.shape[0]):
        x = cd[k][:, [i, j]]
        e = _ellipse(x.mean(0), np.cov(x.T))
        ax.plot(e[0], e[1], lw=1, label=(labels[k] if labels else f"client {k}"))
    m = np.asarray(global_mean)[[i, j]]
    c = np.asarray(global_cov)
    c = c[np.ix_([i, j], [i, j])] if c.ndim == 2 else np.diag(c[[i, j]])
    e = _ellipse(m, c)
    ax.plot(e[0], e[1], "k", lw=2, label="global")
    ax.set_xlabel(f"z[{i}]")
    ax.set_ylabel(f"z[{j}]")
    ax.legend(fontsize=7)
    return fig


def _small(idata, var_names, max_elements: int = 3):
    """A posterior-only ArviZ object with the first ``max_elements`` elements of each chosen site."""
    from .diagnostics import group, to_inference_data

    post = group(idata, "posterior")
    if post is None:
        raise ValueError("no posterior group (the method has no global parameter draws)")
    names = var_names or list(post.data_vars)[:3]
    draws = {}
    for k in names:
        a = np.asarray(post[k])
        a = a.reshape(a.shape[0], a.shape[1], -1)
        for j in range(min(max_elements, a.shape[2])):
            draws[f"{k}[{j}]" if a.shape[2] > 1 else k] = a[:, :, j]
    return to_inference_data(draws), list(draws)


def trace(idata, var_names=None):
    """ArviZ's trace plot of the posterior group (first sites when ``var_names`` is None)."""
    from .diagnostics import _az, arviz_major

    idata, var_names = _small(idata, var_names)
    az = _az()
    if arviz_major() < 1:
        axes = az.plot_trace(idata, var_names=var_names, compact=False, figsize=(9, 1.5 * len(var_names)))
    else:  # arviz 1.x (arviz_plots)
        pc = az.plot_trace_dist(idata, var_names=var_names, backend="matplotlib")
        return pc.viz["chart"].item() if hasattr(pc, "viz") else _plt().gcf()
    return np.atleast_1d(axes).ravel()[0].figure


def rank(idata, var_names=None):
    """ArviZ's rank plot of the posterior group (needs more than one chain)."""
    from .diagnostics import _az, arviz_major

    idata, var_names = _small(idata, var_names)
    az = _az()
    if arviz_major() < 1:
        axes = az.plot_rank(idata, var_names=var_names, figsize=(3 * len(var_names), 2.5))
    else:  # arviz 1.x
        pc = az.plot_rank(idata, var_names=var_names, backend="matplotlib")
        return pc.viz["chart"].item() if hasattr(pc, "viz") else _plt().gcf()
    return np.atleast_1d(axes).ravel()[0].figure


__all__ = ["learning_curves", "heterogeneity", "reliability_diagram", "marginals", "method_marginals", "client_contours", "trace", "rank"]
