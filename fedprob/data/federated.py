"""FederatedData: a federation's rows, stacked and padded over clients."""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

from .. import inputs


def check_finite(name: str, a: np.ndarray) -> None:
    if np.issubdtype(a.dtype, np.floating) and not np.all(np.isfinite(a)):
        bad = int(np.sum(~np.isfinite(a)))
        raise ValueError(f"{name} contains {bad} NaN/inf value(s); clean or impute them first")


def check_labels(y: np.ndarray, num_classes: Optional[int]) -> None:
    if num_classes is None:
        return
    if not np.issubdtype(y.dtype, np.integer):
        if not np.all(np.mod(y, 1) == 0):
            raise ValueError("class labels must be integers")
    lo, hi = (int(y.min()), int(y.max())) if y.size else (0, 0)
    if lo < 0 or hi >= num_classes:
        raise ValueError(f"labels out of range: found [{lo}, {hi}], expected [0, {num_classes - 1}]")


def check_xy(X: np.ndarray, y: np.ndarray) -> None:
    if X.ndim < 2:
        raise ValueError(f"X must have a row axis and at least one feature axis, got shape {X.shape}")
    if X.shape[0] != y.shape[0]:
        raise ValueError(f"X and y have different numbers of rows: {X.shape[0]} vs {y.shape[0]}")
    check_finite("X", X)
    check_finite("y", y)


def check_model_labels(y, num_classes, what: str) -> None:
    """ValueError unless the class labels ``y`` are integers in [0, num_classes) of the model's
    classes (no check when None); ``what`` names the data in the message."""
    if num_classes is None:
        return
    y = np.asarray(y)
    if not np.all(np.mod(y, 1) == 0):
        raise ValueError(f"{what}: class labels must be integers")
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise ValueError(f"{what}: labels out of range [{int(y.min())}, {int(y.max())}] for a model "
                         f"with {num_classes} classes")


def check_eval_data(eval_data, potential):
    """``(X, y)`` of ``eval_data`` checked against ``potential``'s row shapes and labels (X as int32 if
    integer, else float32);
    None when ``eval_data`` is None."""
    if eval_data is None:
        return None
    if not isinstance(eval_data, (tuple, list)) or len(eval_data) != 2:
        raise ValueError("eval_data must be a pair (X_test, y_test)")
    if inputs.is_structured(eval_data[0]):
        X, y = inputs.check_like(eval_data[0], potential.x_shape, "eval_data X"), np.asarray(eval_data[1])
        check_finite("y", y)
        if inputs.num_rows(X) != y.shape[0]:
            raise ValueError(f"eval_data X and y have different numbers of rows: {inputs.num_rows(X)} vs {y.shape[0]}")
        if tuple(y.shape[1:]) != potential.y_shape:
            raise ValueError(f"eval_data y rows have shape {y.shape[1:]}, the federation's have {potential.y_shape}")
        if potential.task == "classification":
            check_model_labels(y, potential.num_classes, "eval_data")
        return X, y
    X, y = np.asarray(eval_data[0]), np.asarray(eval_data[1])
    check_xy(X, y)
    if tuple(X.shape[1:]) != potential.x_shape:
        raise ValueError(f"eval_data X rows have shape {X.shape[1:]}, the federation's have {potential.x_shape}")
    if tuple(y.shape[1:]) != potential.y_shape:
        raise ValueError(f"eval_data y rows have shape {y.shape[1:]}, the federation's have {potential.y_shape}")
    if potential.task == "classification":
        check_model_labels(y, potential.num_classes, "eval_data")
    return (X.astype(np.int32) if np.issubdtype(X.dtype, np.integer) else X.astype(np.float32)), y


def _pad_rows(a, n_max: int, dt):
    """``a`` padded to ``n_max`` rows with copies of its first row (weight 0 downstream), as ``dt``."""
    out = np.empty((n_max,) + a.shape[1:], dtype=dt)
    out[: a.shape[0]] = a
    out[a.shape[0]:] = a[:1]
    return out


def _label_dtype(ys, num_classes, dtype):
    """Labels stay integer (class indices, counts) whether or not ``num_classes`` is given."""
    return np.int32 if num_classes is not None or all(np.issubdtype(v.dtype, np.integer) for v in ys) else dtype


@dataclasses.dataclass(frozen=True)
class FederatedData:
    """Client data stacked into padded arrays.

    X: (K, N_max, ...) and y: (K, N_max, ...) with the rows of client k in
    ``[:sizes[k]]``; padding repeats the client's first row (so every padded
    value is a valid input) and never enters a log density.
    sizes: (K,) rows per client. num_classes: the label range for
    classification (None for regression). ``from_clients`` keeps integer
    labels integer (int32) and stores other targets as ``dtype``.
    """

    X: np.ndarray
    y: np.ndarray
    sizes: np.ndarray
    num_classes: Optional[int] = None

    def __post_init__(self):
        for a in inputs.leaves(self.X):
            if a.shape[:2] != self.y.shape[:2]:
                raise ValueError(f"X {a.shape} and y {self.y.shape} disagree on (clients, rows)")
        if self.sizes.shape != (self.num_clients,):
            raise ValueError("sizes must have one entry per client")
        if np.any(self.sizes <= 0):
            empty = np.flatnonzero(self.sizes <= 0).tolist()
            raise ValueError(f"client(s) {empty} have no data; every client needs at least one row")

    @classmethod
    def from_clients(cls, clients: Sequence[tuple], num_classes: Optional[int] = None,
                     dtype=np.float32) -> "FederatedData":
        """From a list of (X_k, y_k) pairs of possibly different lengths.

        ``X_k`` is one array, or a tuple or dict of arrays (several model inputs, :mod:`fedprob.inputs`),
        the same structure for every client; each input keeps its dtype (integers int32, bools bool).
        """
        if len(clients) == 0:
            raise ValueError("no clients given")
        if inputs.is_structured(clients[0][0]):
            return cls._from_structured(clients, num_classes, dtype)
        Xs, ys = [], []
        for k, (Xk, yk) in enumerate(clients):
            Xk, yk = np.asarray(Xk), np.asarray(yk)
            if Xk.shape[0] == 0:
                raise ValueError(f"client {k} has no data; every client needs at least one row")
            check_xy(Xk, yk)
            check_labels(yk, num_classes)
            Xs.append(Xk)
            ys.append(yk)
        for name, arrs in (("X", Xs), ("y", ys)):
            shapes = {a.shape[1:] for a in arrs}
            if len(shapes) > 1:
                first = arrs[0].shape[1:]
                k = next(i for i, a in enumerate(arrs) if a.shape[1:] != first)
                raise ValueError(f"client {k}'s {name} rows have shape {arrs[k].shape[1:]}, client 0's "
                                 f"have {first}: every client needs rows of the same shape")
        sizes = np.array([x.shape[0] for x in Xs], dtype=np.int32)
        n_max = int(sizes.max())
        ydt = _label_dtype(ys, num_classes, dtype)

        # integer inputs (group indices, counts, totals) stay integer: a model indexes with them
        xdt = np.int32 if all(np.issubdtype(x.dtype, np.integer) or x.dtype == bool for x in Xs) else dtype
        X = np.stack([_pad_rows(x, n_max, xdt) for x in Xs])
        y = np.stack([_pad_rows(v, n_max, ydt) for v in ys])
        return cls(X, y, sizes, num_classes)

    @classmethod
    def _from_structured(cls, clients, num_classes, dtype):
        Xs, ys = [], []
        for k, (Xk, yk) in enumerate(clients):
            if not inputs.is_structured(Xk) or not inputs.same_structure(inputs.normalize(Xk), Xs[0] if Xs else
                                                                         inputs.normalize(Xk)):
                raise ValueError(f"client {k}'s inputs are not structured like client 0's "
                                 "(every client needs the same tuple or dict of arrays)")
            Xk, yk = inputs.normalize(Xk, f"client {k}'s X"), np.asarray(yk)
            if inputs.num_rows(Xk) != yk.shape[0]:
                raise ValueError(f"client {k}: X and y have different numbers of rows: "
                                 f"{inputs.num_rows(Xk)} vs {yk.shape[0]}")
            if yk.shape[0] == 0:
                raise ValueError(f"client {k} has no data; every client needs at least one row")
            inputs.check_finite(Xk)
            check_finite("y", yk)
            check_labels(yk, num_classes)
            Xs.append(Xk)
            ys.append(yk)
        for i, a in enumerate(inputs.leaves(Xs[0])):
            for k, Xk in enumerate(Xs):
                b = inputs.leaves(Xk)[i]
                if b.shape[1:] != a.shape[1:] or b.dtype != a.dtype:
                    raise ValueError(f"client {k}'s input {i} has rows {b.shape[1:]} {b.dtype}, client 0's "
                                     f"{a.shape[1:]} {a.dtype}: every client needs inputs of the same shape and type")
        sizes = np.array([yk.shape[0] for yk in ys], dtype=np.int32)
        n_max = int(sizes.max())
        ydt = _label_dtype(ys, num_classes, dtype)

        X = inputs.tree_map(lambda *a: np.stack([_pad_rows(x, n_max, x.dtype) for x in a]), *Xs)
        y = np.stack([_pad_rows(v, n_max, ydt) for v in ys])
        return cls(X, y, sizes, num_classes)

    @property
    def num_clients(self) -> int:
        return int(self.y.shape[0])

    @property
    def client_sizes(self) -> np.ndarray:
        return self.sizes

    @property
    def num_rows(self) -> int:
        return int(self.sizes.sum())

    @property
    def max_size(self) -> int:
        return int(self.y.shape[1])

    def client(self, k: int):
        """(X_k, y_k) of client k, without padding."""
        if not 0 <= k < self.num_clients:
            raise IndexError(f"client {k} out of range [0, {self.num_clients})")
        n = int(self.sizes[k])
        return inputs.tree_map(lambda a: a[k, :n], self.X), self.y[k, :n]

    def pooled(self):
        """All rows of all clients, concatenated in client order."""
        Xs, ys = zip(*(self.client(k) for k in range(self.num_clients)))
        return inputs.tree_map(lambda *a: np.concatenate(a), *Xs), np.concatenate(ys)

    def client_data(self):
        """The stacked :class:`fedprob.potential.ClientData` (JAX arrays)."""
        import jax.numpy as jnp

        from ..potential import ClientData

        return ClientData(inputs.tree_map(jnp.asarray, self.X), jnp.asarray(self.y), jnp.asarray(self.sizes))

    def __repr__(self) -> str:
        s = self.sizes
        return (f"FederatedData(num_clients={self.num_clients}, rows={self.num_rows}, "
                f"sizes min/median/max={s.min()}/{int(np.median(s))}/{s.max()}, "
                f"x_shape={inputs.tree_map(lambda a: a.shape[2:], self.X)}, num_classes={self.num_classes})")
