"""UCI tabular data sets: five regression sets, Credit Approval and the 4-hospital Heart Disease.

The readers use only numpy and the ``csv`` module. ``root`` is the folder that
holds the data set folders (``uci_air_quality/``, ``uci_bike_sharing/``, ...,
``fed_heart_disease/``); a folder that holds the files themselves works too.

Regression sets (:func:`load_uci`) and their two protocols:

``protocol="fixed"`` (default): rows are shuffled with ``seed``; the last
``ceil(test_fraction * n)`` shuffled rows are the test set; missing feature
values are imputed with the train medians; X and y are standardized with the
train mean and (population, ddof=0) std only (a column that is constant on the
train rows is centred, not scaled). Columns that leak the target or only index
the rows are dropped:

- air_quality: target ``CO(GT)``. -200 marks a missing value; rows whose
  target is missing are dropped (9,357 -> 7,674 rows), missing inputs are
  imputed. ``NMHC(GT)`` (90% missing), Date and Time are dropped; ``MONTH``
  and ``HOUR`` are derived from them (13 inputs).
- bike_sharing: target ``cnt``; ``instant``, ``dteday`` and ``casual`` /
  ``registered`` (which sum to the target) are dropped (11 inputs).
- wine_quality: red wine, target ``quality`` (11 inputs).
- real_estate: target ``Y house price of unit area``; the row number ``No`` is
  dropped (6 inputs).
- forest_fires: target ``log(1 + area)``; month -> 1..12, day -> mon=1..sun=7
  (12 inputs).

``protocol="paper"``: the preprocessing of the one-round predictive paper's
code (FedPredSpace): no shuffle, every column (target included) z-scored with
the mean and sample std (ddof=1) of the *whole* set, first
``int(n * (1 - test_fraction))`` rows train, the rest test, leaks kept
(air quality keeps the -200 codes as values and the 13 inputs above; bike keeps
``casual``/``registered``: 13 inputs; real estate keeps ``No``: 7 inputs).
Row counts at the default 0.2: air 7,485/1,872, bike 584/147, wine
1,279/320, real estate 331/83, forest fires 413/104.

In both protocols ``y_mean``/``y_std`` on the returned :class:`Dataset` undo
the target's standardization.
"""
from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from .loaders import Dataset, check_fraction, num_test_rows, stratified_split

REGRESSION_SETS = ("air_quality", "bike_sharing", "wine_quality", "real_estate", "forest_fires")
PROTOCOLS = ("fixed", "paper")

_MONTHS = {m: i + 1 for i, m in enumerate(
    ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"])}
_DAYS = {d: i + 1 for i, d in enumerate(["mon", "tue", "wed", "thu", "fri", "sat", "sun"])}


# ----------------------------------------------------------------------------- file access


def _locate(root, folder: str, filename: str) -> Path:
    if root is None:
        raise ValueError("root is required: the folder holding the data set folders (e.g. uci_bike_sharing/)")
    root = Path(root)
    tried = [root / folder / filename, root / filename]
    for p in tried:
        if p.is_file():
            return p
    raise FileNotFoundError(f"missing file {filename} (looked for: {', '.join(str(p) for p in tried)})")


def _read_csv(path: Path, delimiter: str = ",", header: bool = True):
    with open(path, newline="", encoding="utf-8") as fh:
        rows = [r for r in csv.reader(fh, delimiter=delimiter) if r and any(c.strip() for c in r)]
    if header:
        return [c.strip() for c in rows[0]], rows[1:]
    return None, rows


def _to_float(rows, cols, missing=("?", "")) -> np.ndarray:
    out = np.empty((len(rows), len(cols)), dtype=np.float64)
    for i, r in enumerate(rows):
        for j, c in enumerate(cols):
            v = r[c].strip()
            out[i, j] = np.nan if v in missing else float(v)
    return out


# ----------------------------------------------------------------------------- raw tables


def _raw_table(name: str, root):
    """(column names, float table with NaN for missing, target column name, {protocol: dropped columns})."""
    if name == "air_quality":
        header, rows = _read_csv(_locate(root, "uci_air_quality", "AirQualityUCI_from_xlsx.csv"))
        num = header[2:]
        t = _to_float(rows, list(range(2, len(header))))
        month = np.array([float(r[0].strip()[5:7]) for r in rows])
        hour = np.array([float(r[1].strip().split(":")[0]) for r in rows])
        cols = num + ["MONTH", "HOUR"]
        t = np.column_stack([t, month, hour])
        return cols, t, "CO(GT)", {"paper": ["NMHC(GT)"], "fixed": ["NMHC(GT)"]}, -200.0
    if name == "bike_sharing":
        header, rows = _read_csv(_locate(root, "uci_bike_sharing", "day.csv"))
        keep = [c for c in header if c != "dteday"]
        t = _to_float(rows, [header.index(c) for c in keep])
        return keep, t, "cnt", {"paper": ["instant"], "fixed": ["instant", "casual", "registered"]}, None
    if name == "wine_quality":
        header, rows = _read_csv(_locate(root, "uci_wine_quality", "winequality-red.csv"), delimiter=";")
        t = _to_float(rows, list(range(len(header))))
        return header, t, "quality", {"paper": [], "fixed": []}, None
    if name == "real_estate":
        header, rows = _read_csv(_locate(root, "uci_real_estate", "real_estate_valuation_from_xlsx.csv"))
        t = _to_float(rows, list(range(len(header))))
        return header, t, "Y house price of unit area", {"paper": [], "fixed": ["No"]}, None
    if name == "forest_fires":
        header, rows = _read_csv(_locate(root, "uci_forest_fires", "forestfires.csv"))
        t = np.empty((len(rows), len(header)))
        for i, r in enumerate(rows):
            for j, c in enumerate(header):
                v = r[j].strip()
                t[i, j] = _MONTHS[v] if c == "month" else _DAYS[v] if c == "day" else float(v)
        t[:, header.index("area")] = np.log1p(t[:, header.index("area")])
        return header, t, "area", {"paper": [], "fixed": []}, None
    raise ValueError(f"unknown UCI data set {name!r}; choose one of {', '.join(REGRESSION_SETS)} "
                     "(or use load_credit_approval / load_heart_disease)")


def _safe_std(s: np.ndarray) -> np.ndarray:
    return np.where(s > 0, s, 1.0)


def load_uci(name: str, root, *, protocol: str = "fixed", test_fraction: float = 0.2,
             seed: int = 0) -> Dataset:
    """A UCI regression set (air_quality, bike_sharing, wine_quality, real_estate, forest_fires).

    See the module docstring for the columns and both protocols. X and y are
    float32; ``num_classes`` is None; ``y_mean``/``y_std`` undo the target's
    standardization; ``feature_names`` names X's columns.
    """
    if name not in REGRESSION_SETS:
        raise ValueError(f"unknown UCI data set {name!r}; choose one of {', '.join(REGRESSION_SETS)} "
                         "(or use load_credit_approval / load_heart_disease)")
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; choose 'fixed' or 'paper'")
    f = check_fraction(test_fraction)
    cols, t, target, drops, missing_code = _raw_table(name, root)
    inputs = [c for c in cols if c != target and c not in drops[protocol]]
    xi = [cols.index(c) for c in inputs]
    yi = cols.index(target)
    n = t.shape[0]

    if protocol == "paper":
        sub = t[:, xi + [yi]]
        mu, sd = sub.mean(axis=0), _safe_std(sub.std(axis=0, ddof=1))
        z = (sub - mu) / sd
        n_train = int(n * (1.0 - f))
        X, y = z[:, :-1], z[:, -1]
        return Dataset(X[:n_train].astype(np.float32), y[:n_train].astype(np.float32),
                       X[n_train:].astype(np.float32), y[n_train:].astype(np.float32),
                       num_classes=None, feature_names=tuple(inputs), name=name,
                       y_mean=float(mu[-1]), y_std=float(sd[-1]))

    if missing_code is not None:
        t = np.where(t == missing_code, np.nan, t)
    t = t[np.isfinite(t[:, yi])]
    n = t.shape[0]
    perm = np.random.default_rng(seed).permutation(n)
    n_test = num_test_rows(n, f)
    tr, te = perm[: n - n_test], perm[n - n_test:]
    X_tr, X_te, y_tr, y_te = t[tr][:, xi], t[te][:, xi], t[tr, yi], t[te, yi]
    if np.isnan(X_tr).any() or np.isnan(X_te).any():
        med = np.nanmedian(X_tr, axis=0)
        if np.isnan(med).any():
            bad = [inputs[j] for j in np.flatnonzero(np.isnan(med))]
            raise ValueError(f"{name}: column(s) {bad} have no observed train value to impute from")
        X_tr = np.where(np.isnan(X_tr), med, X_tr)
        X_te = np.where(np.isnan(X_te), med, X_te)
    mu, sd = X_tr.mean(axis=0), _safe_std(X_tr.std(axis=0))
    y_mu, y_sd = float(y_tr.mean()), float(_safe_std(np.array(y_tr.std())))
    return Dataset(((X_tr - mu) / sd).astype(np.float32), ((y_tr - y_mu) / y_sd).astype(np.float32),
                   ((X_te - mu) / sd).astype(np.float32), ((y_te - y_mu) / y_sd).astype(np.float32),
                   num_classes=None, feature_names=tuple(inputs), name=name, y_mean=y_mu, y_std=y_sd)


# ----------------------------------------------------------------------------- credit approval

_CREDIT_NUMERIC = [1, 2, 7, 10, 13, 14]
_CREDIT_CATEGORICAL = [0, 3, 4, 5, 6, 8, 9, 11, 12]


def load_credit_approval(root, *, protocol: str = "fixed", test_fraction: float = 0.2,
                         seed: int = 0) -> Dataset:
    """UCI Credit Approval (``crx.data``), binary classification as in PVI.

    Rows with a missing value (``?``) are dropped (690 -> 653). Inputs: the 6
    continuous attributes (A2, A3, A8, A11, A14, A15), standardized, then a
    one-hot block for each of the 9 categorical attributes (categories = the
    values seen in the 653 rows, sorted; no category dropped): 46 columns.
    Label: ``-`` (rejected) -> 1, ``+`` (approved) -> 0, ``num_classes=2``.

    ``protocol="fixed"``: stratified shuffled split with ``seed``
    (``ceil(test_fraction * n)`` test rows), continuous columns standardized
    with the train mean/std. ``protocol="paper"``: PVI's preprocessing, rows
    permuted with ``np.random.RandomState(0)`` (whatever ``seed``), continuous
    columns standardized on all rows, then the first ``int(n * (1 -
    test_fraction))`` rows train.
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; choose 'fixed' or 'paper'")
    f = check_fraction(test_fraction)
    _, rows = _read_csv(_locate(root, "uci_credit_approval", "crx.data"), header=False)
    rows = [[v.strip() for v in r] for r in rows]
    if any(len(r) != 16 for r in rows):
        raise ValueError("crx.data: expected 16 comma-separated fields per row")
    rows = [r for r in rows if "?" not in r]
    num = _to_float(rows, _CREDIT_NUMERIC)
    names = [f"A{c + 1}" for c in _CREDIT_NUMERIC]
    blocks = []
    for c in _CREDIT_CATEGORICAL:
        vals = np.array([r[c] for r in rows])
        cats = sorted(set(vals.tolist()))
        blocks.append((vals[:, None] == np.array(cats)[None, :]).astype(np.float64))
        names += [f"A{c + 1}={v}" for v in cats]
    onehot = np.concatenate(blocks, axis=1)
    labels = np.array([r[15] for r in rows])
    if not set(labels.tolist()) <= {"+", "-"}:
        raise ValueError("crx.data: the class column must hold '+' or '-'")
    y = (labels == "-").astype(np.int32)
    n = len(rows)
    if protocol == "paper":
        perm = np.random.RandomState(0).permutation(n)
        num, onehot, y = num[perm], onehot[perm], y[perm]
        mu, sd = num.mean(axis=0), _safe_std(num.std(axis=0))
        X = np.concatenate([(num - mu) / sd, onehot], axis=1).astype(np.float32)
        n_train = int(n * (1.0 - f))
        return Dataset(X[:n_train], y[:n_train], X[n_train:], y[n_train:], num_classes=2,
                       feature_names=tuple(names), name="credit_approval")
    tr, te = stratified_split(y, f, np.random.default_rng(seed))
    mu, sd = num[tr].mean(axis=0), _safe_std(num[tr].std(axis=0))
    X = np.concatenate([(num - mu) / sd, onehot], axis=1).astype(np.float32)
    return Dataset(X[tr], y[tr], X[te], y[te], num_classes=2, feature_names=tuple(names),
                   name="credit_approval")


# ----------------------------------------------------------------------------- heart disease

HEART_CENTERS = ("cleveland", "hungarian", "switzerland", "va")
_HEART_COLS = ["age", "sex", "cp", "trestbps", "chol", "fbs", "restecg", "thalach", "exang",
               "oldpeak", "slope", "ca", "thal", "num"]
_HEART_KEEP = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]  # slope, ca, thal (mostly missing) dropped
_HEART_DISCRETE = {1, 2, 5, 6, 8}  # sex, cp, fbs, restecg, exang: imputed with the mode


def load_heart_disease(root, *, test_fraction: float = 0.34, seed: int = 0, missing: str = "drop",
                       standardize: str = "per_center") -> Dataset:
    """Heart Disease from 4 hospitals (FLamby's Fed-Heart-Disease), a natural 4-client federation.

    Centres (``group_names``, ids 0..3): cleveland, hungarian, switzerland, va.
    Columns slope, ca and thal are dropped (missing for most rows outside
    Cleveland). Remaining ``?`` values:

    - ``missing="drop"`` (FLamby): drop the row -> 303/261/46/130 = 740 rows.
    - ``missing="impute"``: keep all 920 rows; fill continuous columns with the
      pooled train median, discrete ones (sex, cp, fbs, restecg, exang) with
      the pooled train mode.

    Note that Switzerland records cholesterol 0 for every patient (an
    unrecorded value, kept as is, as FLamby does).

    Split: per centre, stratified by label, ``ceil(test_fraction * n_k)``
    test rows (the default 0.34 gives FLamby's 199/104, 172/89, 30/16, 85/45;
    the rows themselves differ from FLamby's sklearn draw).
    Inputs (13): age, sex, trestbps, chol, fbs, thalach, exang, oldpeak, then
    one-hot cp=2, cp=3, cp=4, restecg=1, restecg=2 (first category dropped).
    ``standardize``: ``"per_center"`` (FLamby's federated setting: each
    centre's rows with that centre's train mean/std), ``"pooled"`` (pooled
    train statistics) or ``"none"``; a column constant on the reference rows is
    centred, not scaled. Label: ``num > 0`` (disease) -> 1, ``num_classes=2``.
    Rows are ordered by centre; ``group_train``/``group_test`` give each row's
    centre id.
    """
    if missing not in ("drop", "impute"):
        raise ValueError(f"missing must be 'drop' or 'impute', got {missing!r}")
    if standardize not in ("per_center", "pooled", "none"):
        raise ValueError(f"standardize must be 'per_center', 'pooled' or 'none', got {standardize!r}")
    f = check_fraction(test_fraction)
    rng = np.random.default_rng(seed)
    tables, tr_idx, te_idx = [], [], []
    for c in HEART_CENTERS:
        _, rows = _read_csv(_locate(root, "fed_heart_disease", f"processed.{c}.data"), header=False)
        t = _to_float(rows, list(range(14)))
        t = t[:, _HEART_KEEP + [13]]
        if np.isnan(t[:, -1]).any():
            raise ValueError(f"processed.{c}.data: missing labels")
        if missing == "drop":
            t = t[~np.isnan(t).any(axis=1)]
        tr, te = stratified_split((t[:, -1] > 0).astype(np.int32), f, rng)
        tables.append(t)
        tr_idx.append(tr)
        te_idx.append(te)

    parts = {"train": [], "test": []}
    for k, (t, tr, te) in enumerate(zip(tables, tr_idx, te_idx)):
        parts["train"].append((t[tr], np.full(len(tr), k, np.int32)))
        parts["test"].append((t[te], np.full(len(te), k, np.int32)))
    raw = {p: np.concatenate([a for a, _ in v]) for p, v in parts.items()}
    grp = {p: np.concatenate([g for _, g in v]) for p, v in parts.items()}

    if missing == "impute":
        ref = raw["train"][:, :-1]
        fill = np.empty(ref.shape[1])
        for j in range(ref.shape[1]):
            col = ref[:, j][~np.isnan(ref[:, j])]
            if _KEEP_IS_DISCRETE[j]:
                vals, cnt = np.unique(col, return_counts=True)
                fill[j] = vals[np.argmax(cnt)]
            else:
                fill[j] = np.median(col)
        for p in raw:
            x = raw[p][:, :-1]
            raw[p][:, :-1] = np.where(np.isnan(x), fill, x)

    def features(t):
        age, sex, cp, trestbps, chol, fbs, restecg, thalach, exang, oldpeak = t[:, :10].T
        cols = [age, sex, trestbps, chol, fbs, thalach, exang, oldpeak,
                cp == 2, cp == 3, cp == 4, restecg == 1, restecg == 2]
        return np.column_stack(cols).astype(np.float64)

    X = {p: features(raw[p]) for p in raw}
    y = {p: (raw[p][:, -1] > 0).astype(np.int32) for p in raw}
    if standardize == "pooled":
        mu, sd = X["train"].mean(axis=0), _safe_std(X["train"].std(axis=0))
        X = {p: (v - mu) / sd for p, v in X.items()}
    elif standardize == "per_center":
        for k in range(len(HEART_CENTERS)):
            ref = X["train"][grp["train"] == k]
            mu, sd = ref.mean(axis=0), _safe_std(ref.std(axis=0))
            for p in X:
                m = grp[p] == k
                X[p][m] = (X[p][m] - mu) / sd
    names = ("age", "sex", "trestbps", "chol", "fbs", "thalach", "exang", "oldpeak",
             "cp=2", "cp=3", "cp=4", "restecg=1", "restecg=2")
    return Dataset(X["train"].astype(np.float32), y["train"], X["test"].astype(np.float32), y["test"],
                   num_classes=2, feature_names=names, name="heart_disease",
                   group_train=grp["train"], group_test=grp["test"], group_names=HEART_CENTERS)


_KEEP_IS_DISCRETE = [j in _HEART_DISCRETE for j in _HEART_KEEP]

__all__ = ["load_uci", "load_credit_approval", "load_heart_disease", "REGRESSION_SETS", "HEART_CENTERS"]


# ----------------------------------------------------------------------------- bike sharing by week

BIKE_WEEK_FEATURES = ("temp", "workingday")


def load_bike_weeks(root, *, test_per_week: int = 2, seed: int = 0,
                    features: tuple = BIKE_WEEK_FEATURES) -> Dataset:
    """UCI Bike Sharing (``day.csv``) as a grouped federation: one client per calendar week.

    731 days -> 105 weeks of 7 days (the last one 3 days): a hierarchical
    regression problem with many small clients. Per week, ``test_per_week``
    days drawn with ``seed`` are held out (weeks of fewer than 5 days keep
    all their days for training): 523 train rows (5 per full week) and 208
    test rows at the default. Target: ``log(cnt)`` standardized with the train
    rows' mean and std (``y_mean``/``y_std`` undo it, to log counts).
    Inputs: ``features`` (columns of day.csv; default temperature and the
    working-day flag) standardized with the train rows' statistics.
    ``group_train``/``group_test`` hold each row's week (0..104),
    ``group_names`` the week's first date.
    """
    header, rows = _read_csv(_locate(root, "uci_bike_sharing", "day.csv"))
    missing = [c for c in features if c not in header]
    if missing:
        raise ValueError(f"unknown bike_sharing column(s) {missing}; choose from {header}")
    if int(test_per_week) < 0 or int(test_per_week) > 4:
        raise ValueError(f"test_per_week must lie in [0, 4] (a week keeps at least 3 train days), got "
                         f"{test_per_week!r}")
    X = _to_float(rows, [header.index(c) for c in features])
    y = np.log(_to_float(rows, [header.index("cnt")])[:, 0])
    week = np.arange(len(rows)) // 7
    rng = np.random.default_rng(seed)
    is_test = np.zeros(len(rows), bool)
    for k in range(int(week.max()) + 1):
        idx = np.flatnonzero(week == k)
        if len(idx) >= 5:
            is_test[rng.choice(idx, int(test_per_week), replace=False)] = True
    tr, te = ~is_test, is_test
    mu, sd = X[tr].mean(0), _safe_std(X[tr].std(0))
    y_mu, y_sd = float(y[tr].mean()), float(y[tr].std())
    names = tuple(rows[int(np.flatnonzero(week == k)[0])][header.index("dteday")].strip()
                  for k in range(int(week.max()) + 1))
    return Dataset(((X[tr] - mu) / sd).astype(np.float32), ((y[tr] - y_mu) / y_sd).astype(np.float32),
                   ((X[te] - mu) / sd).astype(np.float32), ((y[te] - y_mu) / y_sd).astype(np.float32),
                   num_classes=None, feature_names=tuple(features), name="bike_weeks",
                   group_train=week[tr].astype(np.int32), group_test=week[te].astype(np.int32),
                   group_names=names, y_mean=y_mu, y_std=y_sd)
