"""Run directories: what ``fedprob run``/``fedprob demo --out`` write and ``fedprob report`` reads.

Layout (arrays and text only, no pickle)::

    config.toml        the configuration, accepted again by ``fedprob run``
    history.json       one dict per round (metrics, timings, reliability curves)
    history.csv        the scalar columns of the history
    metrics.json       the final round's scalars plus total/compile/init time
    posterior.npz      the whole global posterior: ``form`` ("gaussian" or "samples"),
                       ``linear``/``precision`` (natural parameters) or ``draws`` (flat,
                       unconstrained), ``client_draws`` when the server keeps them,
                       ``mean/<site>`` (constrained)
    posterior.nc       ``Result.to_arviz()`` as NetCDF (all groups)
    diagnostics.json   the rows and warnings of ``Result.diagnostics()``
    info.json          what the report's header shows: the algorithm's configuration (its repr),
                       the federation (client sizes, label counts per client), a description of
                       the data and split, library versions, and when the run was saved (the
                       report lists runs in that order)

Beside the runs (in the directory that holds them, or in a single run's
directory) an optional ``reference.npz`` holds draws of a reference
posterior (pooled NUTS, an exact Gaussian, ...): one array ``(n, *site
shape)`` of constrained draws per site, and ``__name__`` (what it is);
:func:`save_reference` writes it and ``fedprob report`` draws the methods'
marginals beside it.

An existing non-empty directory is not overwritten unless ``overwrite=True``.
"""
from __future__ import annotations

import csv
import json
import math
import shutil
from pathlib import Path
from typing import Optional

import numpy as np

from . import diagnostics as D
from .posteriors import Gaussian


def _jsonable(v):
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, np.ndarray):
        return _jsonable(v.tolist())
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (np.floating, float)):
        return None if not math.isfinite(float(v)) else float(v)
    if isinstance(v, (np.bool_,)):
        return bool(v)
    return v


def final_metrics(result, total_time: Optional[float] = None) -> dict:
    """The last round's scalar entries plus timings."""
    out = {k: v for k, v in result.history[-1].items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    out.update(compile_time=float(result.compile_time), init_time=float(result.init_time))
    if total_time is not None:
        out["total_time"] = float(total_time)
    return out


def posterior_arrays(posterior) -> dict:
    """The global posterior as named numpy arrays (see the module docstring)."""
    form = posterior.form
    out = {f"mean/{k}": np.asarray(v) for k, v in posterior.mean.items()}
    if isinstance(form, Gaussian):
        out.update(form=np.array("gaussian"), linear=np.asarray(form.linear), precision=np.asarray(form.precision))
    else:
        out.update(form=np.array("samples"), draws=np.asarray(form.draws))
    cd = getattr(posterior, "client_draws", None)
    if cd is not None:
        out["client_draws"] = np.asarray(cd)
        out["mixture_weights"] = np.asarray(posterior.mixture_weights)
    return out


def prepare(out, overwrite: bool = False) -> Path:
    """``out`` as an empty directory; a FileExistsError if it holds files and ``overwrite`` is False."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not overwrite:
            raise FileExistsError(f"run directory {out} exists and is not empty (use --force to overwrite)")
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    out.mkdir(parents=True, exist_ok=True)
    return out


def versions() -> dict:
    """The versions of Python and of the libraries a run depends on."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("fedprob", "jax", "numpyro", "optax", "arviz", "numpy"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def federation_info(fed, description: str = "") -> dict:
    """Client sizes and per-client label counts (classification) of a FederatedData, with a description."""
    sizes = [int(n) for n in np.asarray(fed.sizes)]
    out = {"num_clients": int(fed.num_clients), "sizes": sizes, "description": description}
    C = getattr(fed, "num_classes", None)
    if C:
        counts = []
        for k in range(fed.num_clients):
            y = np.asarray(fed.y[k])[:sizes[k]].astype(int)
            counts.append(np.bincount(y, minlength=C)[:C].tolist())
        out["label_counts"] = counts
    return out


def run_info(result, federation: Optional[dict] = None) -> dict:
    import time

    return {"algorithm": repr(result.algorithm), "federation": federation or {
                "num_clients": int(result.context.num_clients),
                "sizes": [int(n) for n in np.asarray(result.context.client_sizes)]},
            "versions": versions(), "saved": time.time()}


def run_record(result, name: Optional[str] = None, config: Optional[dict] = None,
               total_time: Optional[float] = None, num_draws: int = 400, federation: Optional[dict] = None) -> dict:
    """A run as the dict :func:`fedprob.report.html_report` reads, from an in-memory Result.

    federation: :func:`federation_info` of the data the run used (default: the client sizes only).
    """
    table = result.diagnostics(warn=False)
    return {"name": name or type(result.algorithm).__name__, "config": config or {},
            "history": _jsonable(result.history), "metrics": final_metrics(result, total_time),
            "idata": result.to_arviz(num_draws=num_draws), "diagnostics": _jsonable(table.rows),
            "warnings": table.notes, "info": _jsonable(run_info(result, federation))}


def save_run(out, result, config: Optional[dict] = None, total_time: Optional[float] = None,
             name: Optional[str] = None, overwrite: bool = False, num_draws: int = 400,
             federation: Optional[dict] = None) -> Path:
    """Write ``result`` as a run directory (layout in the module docstring); returns its path."""
    from .toml_text import dumps

    out = prepare(out, overwrite)
    rec = run_record(result, name, config, total_time, num_draws, federation)
    if config:
        (out / "config.toml").write_text(dumps(config))
    (out / "name.txt").write_text(rec["name"] + "\n")
    (out / "history.json").write_text(json.dumps(rec["history"], indent=1))
    cols = list(dict.fromkeys(k for h in result.history for k, v in h.items()
                              if isinstance(v, (int, float)) and not isinstance(v, bool)))
    with open(out / "history.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for h in result.history:
            w.writerow({c: h.get(c, "") for c in cols})
    (out / "metrics.json").write_text(json.dumps(_jsonable(rec["metrics"]), indent=1))
    np.savez(out / "posterior.npz", **posterior_arrays(result.posterior))
    D.to_netcdf(rec["idata"], out / "posterior.nc")
    (out / "diagnostics.json").write_text(json.dumps({"rows": rec["diagnostics"], "warnings": rec["warnings"]},
                                                     indent=1))
    (out / "info.json").write_text(json.dumps(rec["info"], indent=1))
    return out


REFERENCE_FILE = "reference.npz"


def reference_draws(reference, num_draws: int = 4000, seed: int = 0) -> dict:
    """A reference posterior as ``dict site -> (n, *site shape)`` numpy draws (constrained).

    ``reference`` is such a dict already (e.g. pooled NUTS's ``mcmc.get_samples()``,
    or draws of an exact Gaussian), a global posterior or anything with
    ``sample(key, n)`` returning that dict (``num_draws`` draws), a
    :class:`~fedprob.result.Result` (its posterior), ArviZ data (its
    ``posterior`` group, chains stacked), or the path of a ``reference.npz``.
    """
    from . import diagnostics as D

    if isinstance(reference, (str, Path)):
        return load_reference(reference)[1]
    if hasattr(reference, "posterior") and hasattr(reference, "algorithm"):      # a Result
        reference = reference.posterior
    if hasattr(reference, "sample") and not isinstance(reference, dict):
        import jax

        reference = reference.sample(jax.random.PRNGKey(seed), num_draws)
    elif not isinstance(reference, dict):
        post = D.group(reference, "posterior")
        if post is None:
            raise TypeError("a reference is a dict site -> draws, a posterior, a Result, ArviZ data with a "
                            f"posterior group, or the path of a reference.npz; got {type(reference).__name__}")
        reference = {k: np.asarray(post[k]).reshape((-1,) + np.asarray(post[k]).shape[2:]) for k in post.data_vars}
    out = {}
    for k, v in reference.items():
        a = np.asarray(v, dtype=np.float64)
        if a.ndim == 0 or a.shape[0] < 2:
            raise ValueError(f"reference site {k!r}: expected (num_draws, ...) draws with at least 2 draws, "
                             f"got shape {a.shape}")
        if not np.all(np.isfinite(a)):
            raise ValueError(f"reference site {k!r} has non-finite draws")
        out[str(k)] = a
    if not out:
        raise ValueError("the reference has no sites")
    return out


def save_reference(path, reference, name: str = "reference", num_draws: int = 4000, seed: int = 0) -> Path:
    """Write a reference posterior (any form :func:`reference_draws` takes) as ``path/reference.npz``
    (``path`` a directory) or to ``path`` (a ``.npz`` file); ``name`` says what it is (``"pooled NUTS"``)."""
    draws = reference_draws(reference, num_draws, seed)
    path = Path(path)
    if path.suffix != ".npz":
        path.mkdir(parents=True, exist_ok=True)
        path = path / REFERENCE_FILE
    np.savez(path, __name__=np.array(str(name)), **draws)
    return path


def load_reference(path):
    """(name, dict site -> draws) from ``path`` (a ``.npz`` file, or a directory holding ``reference.npz``);
    None when a directory holds none."""
    path = Path(path)
    if path.is_dir():
        path = path / REFERENCE_FILE
        if not path.exists():
            return None
    if not path.exists():
        raise FileNotFoundError(f"no reference file {path}")
    with np.load(path, allow_pickle=False) as f:
        name = str(f["__name__"]) if "__name__" in f.files else path.stem
        draws = {k: np.asarray(f[k]) for k in f.files if k != "__name__"}
    return name, reference_draws(draws)


def is_run_dir(path) -> bool:
    return (Path(path) / "history.json").exists()


def load_run(path) -> dict:
    """A run directory as a report record: name, config, history, metrics, idata, diagnostics, warnings."""
    import tomllib

    d = Path(path)
    if not is_run_dir(d):
        raise ValueError(f"{d} is not a run directory (no history.json)")
    rec = {"name": (d / "name.txt").read_text().strip() if (d / "name.txt").exists() else d.name,
           "history": json.loads((d / "history.json").read_text()),
           "config": tomllib.loads((d / "config.toml").read_text()) if (d / "config.toml").exists() else {},
           "metrics": json.loads((d / "metrics.json").read_text()) if (d / "metrics.json").exists() else {}}
    if (d / "posterior.nc").exists():
        rec["idata"] = D.from_netcdf(d / "posterior.nc")
    if (d / "diagnostics.json").exists():
        diag = json.loads((d / "diagnostics.json").read_text())
        rec["diagnostics"], rec["warnings"] = diag["rows"], diag["warnings"]
    if (d / "info.json").exists():
        rec["info"] = json.loads((d / "info.json").read_text())
    return rec


def load_runs(path) -> list:
    """The run directory ``path``, or every run directory directly inside it, in the order they were saved
    (by name where a directory does not say when)."""
    d = Path(path)
    if is_run_dir(d):
        return [load_run(d)]
    runs = sorted(p for p in d.iterdir() if p.is_dir() and is_run_dir(p)) if d.is_dir() else []
    if not runs:
        raise ValueError(f"{d} is not a run directory (no history.json) and holds none")
    recs = [load_run(p) for p in runs]
    return sorted(recs, key=lambda r: (r.get("info", {}).get("saved", math.inf), r["name"]))


__all__ = ["save_reference", "load_reference", "reference_draws", "REFERENCE_FILE", "save_run", "federation_info", "versions", "run_info", "load_run", "load_runs", "run_record", "posterior_arrays", "prepare", "is_run_dir"]
