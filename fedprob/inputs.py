"""Model inputs as the user has them: one array, or a tuple or dict of arrays.

A NumPyro model takes its inputs as one matrix, ``model(X, y=None)``, or as
several arrays, ``model(dept, male, applications, admit=None)``. fedprob keeps
``X`` as a pytree of arrays that share their leading (row) axis:

* an array ``X``: the model is called ``model(X, y, **kwargs)``;
* a tuple (or list) ``(a, b, c)``: ``model(a, b, c, y, **kwargs)``;
* a dict ``{"a": a, "b": b}``: ``model(a=a, b=b, **{obs: y}, **kwargs)``, where
  ``obs`` is the first parameter of the model that is neither an input nor a
  keyword argument (``admit`` above).

Each array keeps its dtype: integers (indices, counts, totals) become int32,
booleans stay bool, floats become float32. Rows are selected, padded and
minibatched leaf by leaf.
"""
from __future__ import annotations

import inspect
import jax
import numpy as np


def is_structured(X) -> bool:
    """True for a tuple, list or dict of arrays (several model inputs)."""
    return isinstance(X, (tuple, list, dict))


def leaves(X) -> list:
    return jax.tree_util.tree_leaves(X)


def tree_map(fn, X, *rest):
    return jax.tree_util.tree_map(fn, X, *rest)


def num_rows(X) -> int:
    """The number of rows (the leading axis every input shares)."""
    return int(np.shape(leaves(X)[0])[0])


def take(X, idx):
    """The rows ``idx`` of every input."""
    return tree_map(lambda a: a[idx], X)


def normalize(X, what: str = "X"):
    """X with each array as numpy (int32 for integers, bool kept, float32 otherwise), checked: every
    input has a row axis and they agree on the number of rows. A list becomes a tuple."""
    if isinstance(X, list):
        X = tuple(X)
    if is_structured(X):
        if len(X) == 0:
            raise ValueError(f"{what} is an empty {type(X).__name__}: give at least one input array")
        if isinstance(X, dict) and not all(isinstance(k, str) for k in X):
            raise ValueError(f"{what}: the keys of a dict of inputs must be the model's argument names (str)")

    def conv(a):
        a = np.asarray(a)
        if a.dtype == bool:
            return a
        if np.issubdtype(a.dtype, np.integer):
            return a.astype(np.int32)
        return a.astype(np.float32)

    X = tree_map(conv, X)
    shapes = [a.shape for a in leaves(X)]
    if any(len(s) == 0 for s in shapes):
        raise ValueError(f"every array of {what} needs a row axis, got shapes {shapes}")
    if len({s[0] for s in shapes}) > 1:
        raise ValueError(f"the arrays of {what} have different numbers of rows: {[s[0] for s in shapes]}")
    return X


def row_shapes(X):
    """The shape of one row of each input (same structure as X)."""
    return tree_map(lambda a: tuple(np.shape(a)[1:]), X) if is_structured(X) else tuple(np.shape(X)[1:])


def row_dtypes(X):
    return tree_map(lambda a: str(np.asarray(a).dtype if not hasattr(a, "dtype") else a.dtype), X)


def _obs_name(model, X: dict, kwargs: dict) -> str:
    try:
        params = inspect.signature(model).parameters
    except (TypeError, ValueError):
        params = {}
    for name, p in params.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or name in X or name in kwargs:
            continue
        return name
    raise ValueError(f"X is a dict of inputs {sorted(X)}: the model needs one more parameter for the "
                     "observations (e.g. `def model(dept, male, admit=None)`), and none was found")


def call(model, X, y, kwargs: dict):
    """``model`` called with inputs X (see the module docstring), observations y and ``kwargs``."""
    if isinstance(X, dict):
        return model(**X, **{_obs_name(model, X, kwargs): y}, **kwargs)
    if isinstance(X, (tuple, list)):
        return model(*X, y, **kwargs)
    return model(X, y, **kwargs)


def check_finite(X, what: str = "X") -> None:
    for a in leaves(X):
        a = np.asarray(a)
        if np.issubdtype(a.dtype, np.floating) and not np.all(np.isfinite(a)):
            raise ValueError(f"{what} contains {int(np.sum(~np.isfinite(a)))} NaN/inf value(s); clean or impute "
                             "them first")


def matrix(X) -> np.ndarray:
    """Every input flattened per row and concatenated: (n, features) float (for partition schemes)."""
    n = num_rows(X)
    return np.concatenate([np.asarray(a, np.float64).reshape(n, -1) for a in leaves(X)], 1)


def check_like(X, x_shape, what: str = "X"):
    """X normalised (:func:`normalize`) and checked against the training rows' shapes ``x_shape``
    (a shape, or a tuple/dict of them): same structure, same row shapes, finite. Returns X."""
    structured = isinstance(x_shape, dict) or (isinstance(x_shape, tuple) and x_shape
                                               and all(isinstance(s, tuple) for s in x_shape))
    if structured != is_structured(X):
        raise ValueError(f"{what} must be {'a ' + type(x_shape).__name__ + ' of arrays' if structured else 'one array'}"
                         f" like the federation's inputs (rows of shape {x_shape})")
    X = normalize(X, what)
    got = row_shapes(X)
    if structured and jax.tree_util.tree_structure(got, is_leaf=lambda t: isinstance(t, tuple) and all(
            isinstance(i, int) for i in t)) != jax.tree_util.tree_structure(x_shape, is_leaf=lambda t: isinstance(
            t, tuple) and all(isinstance(i, int) for i in t)):
        raise ValueError(f"{what} has inputs {got}, the model was fitted on {x_shape}")
    if got != x_shape:
        raise ValueError(f"{what} has rows of shape {got}; the model was fitted on rows of shape {x_shape}")
    check_finite(X, what)
    return X


def as_jax(X):
    """One array as ``jnp.asarray``; several inputs normalised (:func:`normalize`), each a JAX array."""
    import jax.numpy as jnp

    return tree_map(jnp.asarray, normalize(X)) if is_structured(X) else jnp.asarray(X)


def same_structure(X, ref) -> bool:
    return jax.tree_util.tree_structure(X) == jax.tree_util.tree_structure(ref)


__all__ = ["is_structured", "num_rows", "take", "normalize", "row_shapes", "call", "matrix", "check_finite"]
