"""Partition a pooled data set over clients: iid, Dirichlet, label sort, shards, groups, feature sort.

Every scheme is a function of ``(X, y, seed, hyperparameters)`` only, puts every
row in exactly one client, and leaves no client empty. Rows inside a client are
shuffled (deterministically), so the order of a client's rows carries no
information about the scheme.

Schemes (keyword arguments in brackets, defaults after ``=``):

``"iid"``
    Shuffle, then split into ``num_clients`` near-equal parts (sizes differ by
    at most one). Works for classification and regression.
``"dirichlet"`` [``alpha=0.5``, ``alpha_size=None``, ``min_size=1``]
    Two-level Dirichlet. Client sizes: ``p ~ Dir(alpha_size * 1_K)`` and
    ``n_k = min_size + round((N - K * min_size) * p_k)`` (largest remainder, so
    sizes sum to N and each is at least ``min_size``); ``alpha_size=None``
    gives near-equal sizes. Class mix: ``q_k ~ Dir(alpha * C * p)`` per client,
    with p the pooled class frequencies (so ``Dir(alpha * 1_C)`` for balanced
    classes, and ``E[q_k] = p`` always); client k draws ``n_k`` labels from
    ``q_k`` by weighted sampling without replacement from the rows not yet
    assigned (row weight ``q_kc / p_c``; clients are visited in random order,
    and classes that run out are replaced by what is left, so the last
    clients' mixes drift towards the leftovers). Small ``alpha`` -> few classes per
    client; large ``alpha`` -> near-uniform mixes.
``"label_sort"`` [``heterogeneity=1.0``]
    The one-round predictive paper's mixing with h in [0, 1]: a random
    fraction h of the rows is sorted by label and split contiguously over
    the clients, the other rows are split iid; client k gets its part of both.
    h = 0 is ``"iid"``; h = 1 sorts all rows by class (each client sees one or
    two classes when K = C). Total sizes differ by at most one.
``"shards"`` [``classes_per_client=2``]
    McMahan et al. (2017): sort by label, cut into ``K * classes_per_client``
    shards, hand each client ``classes_per_client`` random shards. Shards are
    cut inside each class (a class with a larger share of rows gets more
    shards, every class at least one), so a shard holds one class and a client
    holds at most ``classes_per_client`` classes. Needs
    ``K * classes_per_client >= number of classes present``.
``"groups"`` [``groups``]
    Natural federations: ``groups`` is an array of client ids, one per row;
    client k holds the rows of the k-th smallest unique id (see
    :func:`group_ids`). ``num_clients`` may be None; if given it must equal
    the number of unique ids.
``"feature_sort"`` [``feature=0``]
    For regression heterogeneity: sort rows by column ``feature`` of X (an
    index into the flattened features; negative counts from the end) and cut
    into contiguous near-equal shards, so client k's values of that feature
    all lie at or below client k+1's.

Labels: for ``"dirichlet"``, ``"label_sort"`` and ``"shards"`` y must hold
integer class labels; ``num_classes`` defaults to ``max(y) + 1``. For the
other schemes y is treated as class labels when it has an integer (or bool)
dtype or ``num_classes`` is given, and as a regression target (``num_classes``
None) when it is floating point.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ..names import check_name, checked_keywords, unknown
from .. import inputs
from .federated import FederatedData, check_xy

SCHEMES = ("iid", "dirichlet", "label_sort", "shards", "groups", "feature_sort")
CLASS_SCHEMES = ("dirichlet", "label_sort", "shards")

# hyperparameter -> (schemes it applies to, default)
_OPTIONS = {
    "alpha": (("dirichlet",), 0.5),
    "alpha_size": (("dirichlet",), None),
    "min_size": (("dirichlet",), 1),
    "heterogeneity": (("label_sort",), 1.0),
    "classes_per_client": (("shards",), 2),
    "groups": (("groups",), None),
    "feature": (("feature_sort",), 0),
}

_UNSET = object()


@checked_keywords
def partition(X, y, num_clients: Optional[int] = None, scheme: str = "iid", *, seed: int = 0,
              num_classes: Optional[int] = None, alpha=_UNSET, alpha_size=_UNSET, min_size=_UNSET,
              heterogeneity=_UNSET, classes_per_client=_UNSET, groups=_UNSET,
              feature=_UNSET) -> FederatedData:
    """Split ``(X, y)`` over ``num_clients`` clients with ``scheme``; see the module docstring.

    ``X`` is one array, or several model inputs as a tuple or dict of arrays with one row each per
    ``y`` entry (:mod:`fedprob.inputs`: each keeps its dtype, the model gets them as positional or
    keyword arguments); schemes that read features see them flattened and concatenated.

    Returns ``FederatedData.from_clients(...)``: X as float32 (int32 if integer), y as int32 for
    classification (``num_classes`` set) and float32 for regression.
    Deterministic given ``seed``. Raises ValueError on bad input before any
    work: NaN/inf, mismatched lengths, ``num_clients`` outside [1, rows],
    non-integer or out-of-range labels for class schemes, unknown scheme,
    hyperparameters outside their range or passed to a scheme that does not
    use them.
    """
    y = np.asarray(y)
    opts = dict(alpha=alpha, alpha_size=alpha_size, min_size=min_size, heterogeneity=heterogeneity,
                classes_per_client=classes_per_client, groups=groups, feature=feature)
    if inputs.is_structured(X):                 # several inputs: a tuple or dict of arrays, each its dtype
        X = inputs.normalize(X)
        parts, y_out, k_classes = _plan(inputs.matrix(X), y, num_clients, scheme, seed, num_classes, opts)
        return FederatedData.from_clients([(inputs.take(X, idx), y_out[idx]) for idx in parts],
                                          num_classes=k_classes)
    X = np.asarray(X)
    parts, y_out, k_classes = _plan(X, y, num_clients, scheme, seed, num_classes, opts)
    return FederatedData.from_clients([(X[idx], y_out[idx]) for idx in parts], num_classes=k_classes)


def partition_indices(X, y, num_clients: Optional[int] = None, scheme: str = "iid", *, seed: int = 0,
                      num_classes: Optional[int] = None, **options) -> list:
    """The row indices of each client, as :func:`partition` would assign them.

    Returns a list of ``num_clients`` int64 arrays that together hold every
    index in ``range(len(y))`` exactly once. Same arguments as :func:`partition`.
    """
    for key in options:
        if key not in _OPTIONS:
            raise ValueError(unknown("partition option", key, _OPTIONS))
    opts = {k: options.get(k, _UNSET) for k in _OPTIONS}
    X = inputs.matrix(inputs.normalize(X)) if inputs.is_structured(X) else np.asarray(X)
    parts, _, _ = _plan(X, np.asarray(y), num_clients, scheme, seed, num_classes, opts)
    return parts


def group_ids(groups) -> np.ndarray:
    """The client ids of the ``"groups"`` scheme, in client order (sorted unique ids)."""
    return np.unique(np.asarray(groups))


# ----------------------------------------------------------------------------- validation


def _resolve_options(scheme: str, opts: dict) -> dict:
    out = {}
    for name, (schemes, default) in _OPTIONS.items():
        val = opts.get(name, _UNSET)
        if scheme in schemes:
            out[name] = default if val is _UNSET else val
        elif val is not _UNSET:
            users = ", ".join(repr(s) for s in schemes)
            raise ValueError(f"option {name}= applies to scheme {users}, not to scheme {scheme!r}")
    return out


def _as_labels(y: np.ndarray, num_classes: Optional[int], scheme: str) -> tuple[np.ndarray, int]:
    """Validate integer class labels; return them as int64 and the number of classes."""
    if y.ndim != 1:
        raise ValueError(f"scheme {scheme!r} needs a 1-D label vector y, got shape {y.shape}")
    if y.dtype == bool:
        y = y.astype(np.int64)
    if not np.issubdtype(y.dtype, np.number):
        raise ValueError(f"labels must be numeric class indices, got dtype {y.dtype}")
    if not np.issubdtype(y.dtype, np.integer):
        if not np.all(np.mod(y, 1) == 0):
            raise ValueError(f"non-integer labels found; scheme {scheme!r} needs integer class labels "
                             "(for a regression target use 'iid', 'groups' or 'feature_sort')")
    lab = y.astype(np.int64)
    lo, hi = int(lab.min()), int(lab.max())
    if lo < 0:
        raise ValueError(f"labels out of range: found negative label {lo}; labels must lie in [0, num_classes)")
    if num_classes is None:
        num_classes = hi + 1
    else:
        if int(num_classes) != num_classes or num_classes < 1:
            raise ValueError(f"num_classes must be a positive integer, got {num_classes!r}")
        num_classes = int(num_classes)
        if hi >= num_classes:
            raise ValueError(f"labels out of range: found [{lo}, {hi}], expected [0, {num_classes - 1}]")
    return lab, num_classes


def _check_pos_int(name: str, v, lo: int = 1) -> int:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {v!r}")
    if v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    return int(v)


def _check_positive(name: str, v) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a positive number, got {v!r}") from None
    if not np.isfinite(f) or f <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {v!r}")
    return f


def _plan(X, y, num_clients, scheme, seed, num_classes, opts):
    """Validate everything, then return (list of index arrays, labels to store, num_classes)."""
    if scheme not in SCHEMES:
        check_name("scheme", scheme, SCHEMES)
    o = _resolve_options(scheme, opts)
    if y.ndim == 0:
        raise ValueError("y must have one entry per row, got a scalar")
    check_xy(X, y)
    n = X.shape[0]
    if n == 0:
        raise ValueError("no rows to partition")

    gid = None
    if scheme == "groups":
        if o["groups"] is None:
            raise ValueError("scheme 'groups' needs groups=<array of client ids, one per row>")
        g = np.asarray(o["groups"])
        if g.ndim != 1 or g.shape[0] != n:
            raise ValueError(f"groups must be a 1-D array with one id per row: got shape {g.shape} "
                             f"for {n} rows")
        uniq, gid = np.unique(g, return_inverse=True)
        if num_clients is None:
            num_clients = len(uniq)
        elif _check_pos_int("num_clients", num_clients) != len(uniq):
            raise ValueError(f"num_clients={num_clients} but groups holds {len(uniq)} distinct ids "
                             "(pass num_clients=None to take the number of groups)")
    if num_clients is None:
        raise ValueError(f"scheme {scheme!r} needs num_clients")
    K = _check_pos_int("num_clients", num_clients)
    if K > n:
        raise ValueError(f"num_clients={K} exceeds the number of rows ({n}); every client needs a row")

    # labels
    if scheme in CLASS_SCHEMES:
        lab, C = _as_labels(y, num_classes, scheme)
        y_out = lab
    elif num_classes is not None or (y.ndim == 1 and (np.issubdtype(y.dtype, np.integer) or y.dtype == bool)):
        lab, C = _as_labels(y, num_classes, scheme)
        y_out = lab
    else:
        lab, C, y_out = None, None, y

    rng = np.random.default_rng(seed)
    if scheme == "iid":
        parts = np.array_split(rng.permutation(n), K)
    elif scheme == "dirichlet":
        alpha = _check_positive("alpha", o["alpha"])
        alpha_size = None if o["alpha_size"] is None else _check_positive("alpha_size", o["alpha_size"])
        min_size = _check_pos_int("min_size", o["min_size"])
        if K * min_size > n:
            raise ValueError(f"min_size={min_size} with {K} clients needs {K * min_size} rows, "
                             f"only {n} given")
        parts = _dirichlet(lab, C, K, alpha, alpha_size, min_size, rng)
    elif scheme == "label_sort":
        h = o["heterogeneity"]
        try:
            h = float(h)
        except (TypeError, ValueError):
            raise ValueError(f"heterogeneity must be a number in [0, 1], got {h!r}") from None
        if not 0.0 <= h <= 1.0:
            raise ValueError(f"heterogeneity must lie in [0, 1], got {h}")
        parts = _label_sort(lab, K, h, rng)
    elif scheme == "shards":
        cpc = _check_pos_int("classes_per_client", o["classes_per_client"])
        present = int(np.unique(lab).size)
        if K * cpc < present:
            raise ValueError(f"shards: num_clients * classes_per_client = {K * cpc} is smaller than the "
                             f"{present} classes present, so some rows could not be placed")
        if K * cpc > n:
            raise ValueError(f"shards: {K * cpc} shards requested but only {n} rows")
        parts = _shards(lab, K, cpc, rng)
    elif scheme == "groups":
        order = np.argsort(gid, kind="stable")
        parts = np.split(order, np.cumsum(np.bincount(gid, minlength=K))[:-1])
    else:  # feature_sort
        f = o["feature"]
        flat = X.reshape(n, -1)
        d = flat.shape[1]
        if isinstance(f, (bool, np.bool_)) or not isinstance(f, (int, np.integer)):
            raise ValueError(f"feature must be an integer column index, got {f!r}")
        if not -d <= f < d:
            raise ValueError(f"feature={f} out of range for {d} feature column(s)")
        perm = rng.permutation(n)  # random tie-breaking, then a stable sort
        order = perm[np.argsort(flat[perm, int(f)], kind="stable")]
        parts = np.array_split(order, K)

    parts = [rng.permutation(np.asarray(p, dtype=np.int64)) for p in parts]
    for k, p in enumerate(parts):  # guaranteed by construction; kept as a cheap invariant
        if p.size == 0:
            raise ValueError(f"client {k} received no rows")
    return parts, y_out, C


# ----------------------------------------------------------------------------- schemes


def _largest_remainder(total: int, weights: np.ndarray) -> np.ndarray:
    """Nonnegative integers proportional to ``weights`` that sum to ``total``."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    raw = total * w
    base = np.floor(raw).astype(np.int64)
    short = total - int(base.sum())
    if short > 0:
        base[np.argsort(-(raw - base), kind="stable")[:short]] += 1
    return base


def _equal_sizes(n: int, K: int) -> np.ndarray:
    return np.array([len(a) for a in np.array_split(np.arange(n), K)], dtype=np.int64)


def _dirichlet(lab, C, K, alpha, alpha_size, min_size, rng):
    n = lab.shape[0]
    if alpha_size is None:
        sizes = _equal_sizes(n, K)
    else:
        p = _safe_dirichlet(rng, np.full(K, alpha_size))
        sizes = min_size + _largest_remainder(n - K * min_size, p)
    counts = np.bincount(lab, minlength=C)
    present = np.flatnonzero(counts > 0)
    freq = counts / n
    conc = alpha * len(present) * freq[present]  # alpha per class when classes are balanced
    pool = rng.permutation(n)  # unassigned rows, in random order
    parts = [None] * K
    for k in rng.permutation(K):
        q = np.zeros(C)
        q[present] = _safe_dirichlet(rng, conc)
        # Weighted sampling without replacement (Efraimidis-Spirakis keys log(u) / w): each row of
        # class c has weight q_c / freq_c, so a fresh pool yields mix q and q = freq is plain iid;
        # classes that run out are replaced by the remaining ones in proportion to their weight.
        w = q[lab[pool]] / freq[lab[pool]]
        with np.errstate(divide="ignore", over="ignore"):
            keys = np.where(w > 0, np.log(rng.random(pool.size)) / w, -np.inf)
        m = int(sizes[k])
        finite = np.flatnonzero(np.isfinite(keys))
        if finite.size > m:
            take = finite[np.argpartition(-keys[finite], m - 1)[:m]]
        else:  # every row of positive weight, then weight-0 rows in (random) pool order
            take = np.concatenate([finite, np.flatnonzero(~np.isfinite(keys))[: m - finite.size]])
        parts[k] = pool[take]
        pool = np.delete(pool, take)
    return parts


def _safe_dirichlet(rng, conc) -> np.ndarray:
    conc = np.asarray(conc, dtype=np.float64)
    p = rng.dirichlet(conc)
    if not np.all(np.isfinite(p)) or p.sum() <= 0:  # tiny concentrations can underflow
        p = np.zeros(conc.shape[0])
        p[rng.choice(conc.shape[0], p=conc / conc.sum())] = 1.0
    return p


def _label_sort(lab, K, h, rng):
    n = lab.shape[0]
    perm = rng.permutation(n)
    m = int(round(h * n))
    sorted_part = perm[:m][np.argsort(lab[perm[:m]], kind="stable")]
    iid_part = perm[m:]
    s_sizes = _equal_sizes(m, K)
    t_sizes = _equal_sizes(n, K)
    i_sizes = t_sizes - s_sizes  # >= 0: both are larger-first near-equal splits and m <= n
    s_chunks = np.split(sorted_part, np.cumsum(s_sizes)[:-1])
    i_chunks = np.split(iid_part, np.cumsum(i_sizes)[:-1])
    return [np.concatenate([a, b]) for a, b in zip(s_chunks, i_chunks)]


def _shards(lab, K, cpc, rng):
    S = K * cpc
    classes = np.unique(lab)
    counts = np.array([np.sum(lab == c) for c in classes], dtype=np.int64)
    # shards per class: one each, the rest by the D'Hondt rule (never more shards than rows)
    per = np.ones(len(classes), dtype=np.int64)
    for _ in range(S - len(classes)):
        score = np.where(per < counts, counts / per, -np.inf)
        per[int(np.argmax(score))] += 1
    shards = []
    for c, m in zip(classes, per):
        rows = rng.permutation(np.flatnonzero(lab == c))
        shards.extend(np.array_split(rows, int(m)))
    order = rng.permutation(S)
    return [np.concatenate([shards[j] for j in order[k * cpc:(k + 1) * cpc]]) for k in range(K)]


__all__ = ["partition", "partition_indices", "group_ids", "SCHEMES"]
