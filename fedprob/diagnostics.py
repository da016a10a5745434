"""ArviZ shim and sampler diagnostics (ArviZ 0.23 on Python 3.11, 1.x on >= 3.12).

One place talks to ArviZ. Conventions: draws are arrays ``(chains, draws, ...)``;
:func:`ess` (bulk or tail) and :func:`rhat` (rank-normalised split R-hat) are
ArviZ's own, computed on every trailing element at once; only bulk ESS and
R-hat are compared across ArviZ versions; tail ESS uses the 5%/95% quantiles
(:data:`TAIL_PROB`) on both. :func:`make_inference_data` builds
InferenceData (0.23) or an xarray DataTree (1.x, what its ``from_dict`` gives)
from plain arrays with named dims; :func:`to_netcdf` / :func:`from_netcdf`
store either in one NetCDF file.
:func:`importance_ess` is the importance-sampling ESS of approximate draws
against a reference log density (FedPA paper, App. A.2);
:func:`gaussian_gap` measures how far draws are from their Gaussian summary.
"""
from __future__ import annotations

import math
import warnings
from typing import Callable, Optional

import numpy as np

#: thresholds of :func:`check`: bulk/tail ESS below, R-hat above, Gaussian gap above. RHAT_MAX is the
#: target for one parameter; the warning fires above RHAT_WARN on a scope's largest R-hat (see check)
ESS_MIN = 100.0
RHAT_MAX = 1.01
RHAT_WARN = 1.05
GAP_MAX = 0.5


#: the quantiles of tail ESS (Vehtari et al. 2021: the smaller ESS of the 5% and 95% quantiles),
#: passed to ArviZ explicitly: 0.23 uses them by default, 1.x defaults to its ``ci_prob`` (0.89)
TAIL_PROB = (0.05, 0.95)


def _az():
    """The arviz module, imported on first use without its import-time FutureWarning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        import arviz as az

    return az


def arviz_major() -> int:
    """The installed ArviZ's major version: 0 (InferenceData) or 1 (xarray DataTree)."""
    return int(str(_az().__version__).split(".")[0])


def _dataset(arrays: dict, dims: Optional[dict] = None, coords: Optional[dict] = None,
             attrs: Optional[dict] = None, lead=("chain", "draw")):
    """An xarray Dataset of ``name -> array`` whose leading axes are ``lead`` and the rest named by ``dims``."""
    import xarray as xr

    dims = dims or {}
    data = {}
    for name, a in arrays.items():
        a = np.asarray(a)
        extra = list(dims.get(name, []))
        n_extra = a.ndim - len(lead) - len(extra)
        if n_extra < 0:
            raise ValueError(f"{name}: array of shape {a.shape} has fewer axes than dims {list(lead) + extra}")
        extra += [f"{name}_dim_{i}" for i in range(n_extra)]
        data[name] = (tuple(lead) + tuple(extra), a)
    used = {d for v in data.values() for d in v[0]}
    co = {k: v for k, v in (coords or {}).items() if k in used}
    return xr.Dataset(data, coords=co, attrs=_clean_attrs(attrs or {}))


def _clean_attrs(attrs: dict) -> dict:
    """Attributes NetCDF can store: strings and numbers (others as their str)."""
    out = {}
    for k, v in attrs.items():
        if isinstance(v, (bool, np.bool_)):
            out[k] = int(v)
        elif isinstance(v, np.ndarray) and v.ndim == 1 and v.dtype.kind in "fiu":
            out[k] = v                                    # a numeric vector: NetCDF stores it as is
        elif isinstance(v, (str, int, float, np.integer, np.floating)):
            out[k] = v
        else:
            out[k] = str(v)
    return out


def make_inference_data(groups: dict):
    """InferenceData (ArviZ 0.23) or DataTree (1.x) from ``group name -> xarray Dataset``.

    ArviZ 1.x has no InferenceData class of its own (``arviz.InferenceData`` is
    ``xarray.DataTree``): its ``from_dict`` gives a DataTree with one child
    node per group, and so does this.
    """
    az = _az()
    if arviz_major() < 1:
        return az.InferenceData(**groups)
    import xarray as xr

    return xr.DataTree.from_dict({f"/{k}": v for k, v in groups.items()})


def to_inference_data(draws: dict, dims: Optional[dict] = None, coords: Optional[dict] = None):
    """dict site -> (chains, draws, ...) array -> ArviZ object with a posterior group."""
    return make_inference_data({"posterior": _dataset(draws, dims, coords)})


def group(idata, name: str):
    """A group of InferenceData or DataTree as an xarray Dataset (None when absent)."""
    if hasattr(idata, "_groups_all"):                      # arviz 0.23 InferenceData
        return getattr(idata, name) if name in idata.groups() else None
    if name in getattr(idata, "children", {}):
        return idata[name].to_dataset()
    return None


def group_names(idata) -> list:
    """The group names of InferenceData or DataTree."""
    if hasattr(idata, "_groups_all"):
        return list(idata.groups())
    return list(idata.children)


def to_netcdf(idata, path) -> None:
    """Write InferenceData or DataTree to one NetCDF file (one NetCDF group per ArviZ group)."""
    idata.to_netcdf(str(path))


def from_netcdf(path):
    """Read :func:`to_netcdf`'s file back: InferenceData (0.23) or DataTree (1.x), loaded into memory."""
    az = _az()
    if arviz_major() < 1:
        return az.from_netcdf(str(path))
    import xarray as xr

    with xr.open_datatree(str(path)) as dt:
        return dt.load().copy()


def elpd(loo) -> float:
    """The estimated elpd of an ``az.loo`` result (``elpd_loo`` on 0.23, ``elpd`` on 1.x)."""
    return float(loo.elpd_loo if hasattr(loo, "elpd_loo") else loo.elpd)


# -- ESS and R-hat ------------------------------------------------------------------------------

def _stat(fn_name: str, draws, **kw) -> np.ndarray:
    x = np.asarray(draws, np.float64)
    if x.ndim < 2:
        raise ValueError(f"draws must have shape (chains, draws, ...), got {x.shape}")
    az = _az()
    ds = _dataset({"x": x.reshape(x.shape[0], x.shape[1], -1)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out = getattr(az, fn_name)(ds, **kw)
    return np.asarray(out["x"]).reshape(x.shape[2:])


def ess(draws, method: str = "bulk") -> np.ndarray:
    """Effective sample size (``method`` "bulk" or "tail") of (chains, draws, ...) samples, elementwise."""
    if method not in ("bulk", "tail"):
        raise ValueError(f"method must be 'bulk' or 'tail', got {method!r}")
    return _stat("ess", draws, method=method, **({"prob": TAIL_PROB} if method == "tail" else {}))


def rhat(draws) -> np.ndarray:
    """Rank-normalised split R-hat of (chains, draws, ...) samples, elementwise."""
    return _stat("rhat", draws)


def importance_ess(draws, log_density: Callable, proposal_log_density: Optional[Callable] = None) -> float:
    """Importance-sampling ESS ``(sum_j w_j)^2 / sum_j w_j^2`` of (n, d) draws (FedPA paper, App. A.2).

    ``log w_j = log_density(theta_j) - proposal_log_density(theta_j)``: the
    reference (exact or NUTS) log posterior, unnormalised, against the
    approximate sampler's density when known. Without a proposal density the
    weights are proportional to the reference posterior density, as in the
    paper. Lies in [1, n]; n when the draws come from the reference itself.
    """
    x = np.asarray(draws)
    if x.ndim != 2 or x.shape[0] < 1:
        raise ValueError(f"draws must have shape (n, d) with n >= 1, got {x.shape}")
    logw = np.asarray([float(log_density(z)) for z in x]) if not _vectorised(log_density, x) \
        else np.asarray(log_density(x), np.float64)
    if proposal_log_density is not None:
        logw = logw - (np.asarray(proposal_log_density(x), np.float64) if _vectorised(proposal_log_density, x)
                       else np.asarray([float(proposal_log_density(z)) for z in x]))
    if not np.all(np.isfinite(logw)):
        raise ValueError("the log weights are not all finite")
    logw = logw - logw.max()
    w = np.exp(logw)
    return float(w.sum() ** 2 / (w ** 2).sum())


def _vectorised(fn, x) -> bool:
    """True when ``fn`` maps (n, d) draws to (n,) values."""
    try:
        out = np.asarray(fn(x))
    except Exception:  # noqa: BLE001 - a per-draw function
        return False
    return out.shape == (x.shape[0],)


def gaussian_gap(draws) -> float:
    """Largest distance, in sds, between empirical and Gaussian 5/25/50/75/95% quantiles of (n, d) draws.

    0 for draws that are Gaussian in every coordinate (up to Monte Carlo
    error, about 0.1 at n = 1000); large for skewed, heavy-tailed or
    multimodal marginals that a moment-matched Gaussian summarises badly.
    """
    x = np.asarray(draws, np.float64)
    x = x.reshape(-1, x.shape[-1])
    if x.shape[0] < 10:
        return float("nan")
    p = np.array([0.05, 0.25, 0.5, 0.75, 0.95])
    z = np.array([-1.6448536, -0.6744898, 0.0, 0.6744898, 1.6448536])
    m, s = x.mean(0), x.std(0, ddof=1)
    s = np.where(s > 0, s, np.inf)
    q = np.quantile(x, p, axis=0)
    return float(np.max(np.abs((q - m) / s - z[:, None])))


def summarize(draws) -> dict:
    """min bulk ESS, min tail ESS, max R-hat and the Gaussian gap of (chains, draws, d...) samples."""
    x = np.asarray(draws, np.float64)
    row = {"chains": int(x.shape[0]), "draws": int(x.shape[1])}
    if x.shape[1] < 4:
        row.update(ess_bulk=float("nan"), ess_tail=float("nan"), rhat=float("nan"), gaussian_gap=float("nan"))
        return row
    row["ess_bulk"] = float(np.nanmin(ess(x, "bulk")))
    row["ess_tail"] = float(np.nanmin(ess(x, "tail")))
    row["rhat"] = float(np.nanmax(rhat(x))) if x.shape[0] > 1 else float("nan")
    row["gaussian_gap"] = gaussian_gap(x.reshape(x.shape[0] * x.shape[1], -1))
    return row


def _is_client(scope: str) -> bool:
    return str(scope).startswith("client")


def _causes(ess_min: float, rhat_max: float, gap_max: float):
    """(cause, value of a row or None, flagged(value), worst of values, label, format, advice)."""
    def ess_of(r):
        e = min(r.get("ess_bulk", math.inf), r.get("ess_tail", math.inf))
        return None if math.isnan(e) else e

    def finite(key):
        return lambda r: (r.get(key) if r.get(key) is not None and not math.isnan(r.get(key)) else None)

    return (
        ("ess", ess_of, lambda v: v < ess_min, min, f"effective sample size below {ess_min:g}", "{:.0f}",
         "draw more samples (num_samples) or use a better-mixing sampler"),
        ("rhat", finite("rhat"), lambda v: v > rhat_max, max, f"R-hat above {rhat_max:g}", "{:.3f}",
         "the chains disagree: run longer chains (more warm-up and samples)"),
        ("gap", finite("gaussian_gap"), lambda v: v > gap_max, max,
         f"draws far from their Gaussian summary (quantile gap above {gap_max:g} sd)", "{:.2f}",
         "a Gaussian fitted to them (EPMCMC, ConsensusMC, FedPA) summarises them badly"),
    )


def check(rows, ess_min: float = ESS_MIN, rhat_max: float = RHAT_WARN, gap_max: float = GAP_MAX,
          warn: bool = True, seen: Optional[set] = None) -> list:
    """Warning messages for rows of :func:`summarize` (with a ``scope``: "global", "client 3"): one per cause.

    Low bulk or tail ESS, high R-hat and a large Gaussian gap are the causes.
    The global scope gets its own message per cause; the clients are
    aggregated into one message per cause (``"R-hat above 1.05 on 10 of 10
    clients, worst 1.062 (client 3): ..."``). With ``warn`` each message is
    issued as a RuntimeWarning, except those whose cause is already in
    ``seen`` (a set the caller keeps per run; the causes warned are added),
    so repeated calls on one run warn once.

    R-hat's warning threshold is :data:`RHAT_WARN` (1.05) on the largest
    R-hat over a scope's coordinates: 1.01 (:data:`RHAT_MAX`) is the target
    for one parameter, and the largest of hundreds of healthy coordinates
    exceeds it by chance (4 chains of 500 draws over 650 coordinates: about
    1.01 to 1.02).
    """
    msgs, causes = [], []
    clients = [r for r in rows if _is_client(r.get("scope", ""))]
    for cause, value, flagged, worst_of, label, fmt, advice in _causes(ess_min, rhat_max, gap_max):
        for r in rows:
            if not _is_client(r.get("scope", "")):
                v = value(r)
                if v is not None and flagged(v):
                    msgs.append(f"{r.get('scope', 'draws')}: {label}: {fmt.format(v)}; {advice}")
                    causes.append(f"{r.get('scope', 'draws')}:{cause}")
        bad = [(value(r), r["scope"]) for r in clients if value(r) is not None and flagged(value(r))]
        if bad:
            v, scope = worst_of(bad)
            msgs.append(f"{label} on {len(bad)} of {len(clients)} clients, worst {fmt.format(v)} ({scope}): "
                        f"{advice}")
            causes.append(f"clients:{cause}")
    if warn:
        issue(msgs, causes, seen, stacklevel=3)
    return msgs


def issue(msgs, causes, seen: Optional[set], stacklevel: int = 2) -> None:
    """Warn each message whose cause is not in ``seen`` (then add it)."""
    for m, c in zip(msgs, causes):
        if seen is not None:
            if c in seen:
                continue
            seen.add(c)
        warnings.warn(m, RuntimeWarning, stacklevel=stacklevel + 1)


__all__ = ["ess", "rhat", "importance_ess", "gaussian_gap", "summarize", "check", "issue", "to_inference_data",
           "make_inference_data", "group", "group_names", "to_netcdf", "from_netcdf", "arviz_major", "TAIL_PROB", "elpd"]
