"""Data set loaders: the embedded 8x8 digits, MNIST and Fashion-MNIST from IDX files.

Every loader returns a :class:`Dataset` with numpy arrays: X as float32, y as
int32 for classification and float32 for regression. Nothing is downloaded:
digits ships inside the package, the others read files from a folder you name.
"""
from __future__ import annotations

import dataclasses
import gzip
from importlib import resources
from pathlib import Path
from typing import Optional

import numpy as np


@dataclasses.dataclass(frozen=True, eq=False)
class Dataset:
    """A train/test split of one data set.

    X_*: (N, ...) float32 inputs. y_*: (N,) int32 class labels (``num_classes``
    set) or float32 targets (``num_classes`` None). ``feature_names`` names the
    columns of 2-D X (None for images). For natural federations
    ``group_train``/``group_test`` hold each row's client id (int32 in
    ``[0, len(group_names))``). For a regression target standardized by the
    loader, ``y_mean``/``y_std`` undo it: ``y_original = y * y_std + y_mean``.
    """

    X_train: np.ndarray
    y_train: np.ndarray
    X_test: np.ndarray
    y_test: np.ndarray
    num_classes: Optional[int] = None
    feature_names: Optional[tuple] = None
    name: str = ""
    group_train: Optional[np.ndarray] = None
    group_test: Optional[np.ndarray] = None
    group_names: Optional[tuple] = None
    y_mean: Optional[float] = None
    y_std: Optional[float] = None

    def __post_init__(self):
        for part in ("train", "test"):
            X, y = getattr(self, f"X_{part}"), getattr(self, f"y_{part}")
            if X.shape[0] != y.shape[0]:
                raise ValueError(f"X_{part} and y_{part} have different numbers of rows: "
                                 f"{X.shape[0]} vs {y.shape[0]}")
            g = getattr(self, f"group_{part}")
            if g is not None and g.shape != (X.shape[0],):
                raise ValueError(f"group_{part} must have one id per row: shape {g.shape} for {X.shape[0]} rows")
        if self.feature_names is not None and self.X_train.ndim == 2 \
                and len(self.feature_names) != self.X_train.shape[1]:
            raise ValueError(f"{len(self.feature_names)} feature names for {self.X_train.shape[1]} columns")

    @property
    def train(self):
        """``(X_train, y_train)``."""
        return self.X_train, self.y_train

    @property
    def test(self):
        """``(X_test, y_test)``."""
        return self.X_test, self.y_test

    @property
    def num_features(self) -> int:
        return int(np.prod(self.X_train.shape[1:]))

    def partition(self, num_clients: Optional[int] = None, scheme: str = "iid", **kwargs):
        """Partition the training rows (see :func:`fedprob.data.partition`).

        With ``scheme="groups"`` and no ``groups=`` given, the natural groups
        ``group_train`` are used.
        """
        from .partition import partition

        if scheme == "groups" and "groups" not in kwargs:
            if self.group_train is None:
                raise ValueError(f"data set {self.name!r} has no natural groups; pass groups=")
            kwargs["groups"] = self.group_train
        if self.num_classes is not None and "num_classes" not in kwargs:
            kwargs["num_classes"] = self.num_classes
        return partition(self.X_train, self.y_train, num_clients, scheme, **kwargs)

    def __repr__(self) -> str:
        extra = f", groups={len(self.group_names)}" if self.group_names is not None else ""
        return (f"Dataset({self.name!r}, train={self.X_train.shape}, test={self.X_test.shape}, "
                f"num_classes={self.num_classes}{extra})")


# ----------------------------------------------------------------------------- helpers


def check_fraction(test_fraction) -> float:
    try:
        f = float(test_fraction)
    except (TypeError, ValueError):
        raise ValueError(f"test_fraction must be a number in (0, 1), got {test_fraction!r}") from None
    if not 0.0 < f < 1.0:
        raise ValueError(f"test_fraction must lie strictly between 0 and 1, got {test_fraction}")
    return f


def num_test_rows(n: int, test_fraction: float) -> int:
    """ceil(test_fraction * n), at least 1 and at most n - 1 (train keeps floor((1 - f) n) rows)."""
    t = int(np.ceil(test_fraction * n - 1e-9))
    return min(max(t, 1), n - 1)


def stratified_split(y, test_fraction: float, rng: np.random.Generator):
    """Shuffled split with ``ceil(test_fraction * n)`` test rows, allocated to classes in proportion.

    Returns (train_idx, test_idx), each in random order.
    """
    y = np.asarray(y)
    n = y.shape[0]
    n_test = num_test_rows(n, test_fraction)
    classes, inv, counts = np.unique(y, return_inverse=True, return_counts=True)
    raw = n_test * counts / n
    per = np.floor(raw).astype(np.int64)
    short = n_test - int(per.sum())
    if short > 0:
        per[np.argsort(-(raw - per), kind="stable")[:short]] += 1
    tr, te = [], []
    for c in range(len(classes)):
        rows = rng.permutation(np.flatnonzero(inv == c))
        te.append(rows[:per[c]])
        tr.append(rows[per[c]:])
    return rng.permutation(np.concatenate(tr)), rng.permutation(np.concatenate(te))


# ----------------------------------------------------------------------------- digits


def load_digits(test_fraction: float = 0.2, seed: int = 0, flatten: bool = True) -> Dataset:
    """The 8x8 handwritten digits (1,797 images, 10 classes), embedded in the package.

    The UCI "Optical Recognition of Handwritten Digits" test set (Alpaydin &
    Kaynak, CC BY 4.0); pixels are counts 0..16, returned divided by 16 so X
    lies in [0, 1]. Split: shuffled with ``seed``, ``ceil(test_fraction * n)``
    test rows spread over the classes in proportion to their counts.
    ``flatten=True`` gives X of shape (n, 64), else (n, 8, 8).
    """
    f = check_fraction(test_fraction)
    with resources.files("fedprob").joinpath("_data/digits.npz").open("rb") as fh:
        with np.load(fh) as z:
            images, labels = z["images"], z["labels"]
    X = images.astype(np.float32) / np.float32(16.0)
    if flatten:
        X = X.reshape(X.shape[0], -1)
    y = labels.astype(np.int32)
    tr, te = stratified_split(y, f, np.random.default_rng(seed))
    return Dataset(X[tr], y[tr], X[te], y[te], num_classes=10, feature_names=None, name="digits")


# ----------------------------------------------------------------------------- IDX (MNIST family)


def read_idx(path) -> np.ndarray:
    """Read an IDX file (optionally gzip-compressed) of unsigned bytes into a uint8 array."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as fh:
        b = fh.read()
    if len(b) < 4 or b[0] != 0 or b[1] != 0:
        raise ValueError(f"{path} is not an IDX file (bad magic number)")
    if b[2] != 0x08:
        raise ValueError(f"{path}: only unsigned-byte IDX files are supported (type code {b[2]:#04x})")
    nd = b[3]
    dims = [int.from_bytes(b[4 + 4 * i: 8 + 4 * i], "big") for i in range(nd)]
    offset = 4 + 4 * nd
    if len(b) - offset != int(np.prod(dims)):
        raise ValueError(f"{path}: header says shape {dims} but the file holds {len(b) - offset} values "
                         "(truncated or corrupt)")
    return np.frombuffer(b, np.uint8, offset=offset).reshape(dims)


_IDX_FILES = {
    "X_train": "train-images-idx3-ubyte",
    "y_train": "train-labels-idx1-ubyte",
    "X_test": "t10k-images-idx3-ubyte",
    "y_test": "t10k-labels-idx1-ubyte",
}


def _find_idx(root: Path, stem: str, subdir: str) -> Path:
    """``stem.gz`` or ``stem`` in ``root`` or ``root/subdir``."""
    tried = []
    for folder in (root, root / subdir):
        for name in (stem + ".gz", stem):
            p = folder / name
            tried.append(str(p))
            if p.is_file():
                return p
    raise FileNotFoundError(f"missing file {stem}.gz (looked for: {', '.join(tried)})")


def _load_idx_set(root, subdir: str, name: str, flatten: bool, normalize: bool) -> Dataset:
    if root is None:
        raise ValueError(f"load_{name} needs root, the folder holding the IDX files")
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"data folder {root} does not exist")
    arrays = {key: read_idx(_find_idx(root, stem, subdir)) for key, stem in _IDX_FILES.items()}
    for part in ("train", "test"):
        X, y = arrays[f"X_{part}"], arrays[f"y_{part}"]
        if X.shape[0] != y.shape[0]:
            raise ValueError(f"{name} {part}: {X.shape[0]} images but {y.shape[0]} labels")
    out = {}
    for key in ("X_train", "X_test"):
        X = arrays[key]
        if flatten:
            X = X.reshape(X.shape[0], -1)
        out[key] = X.astype(np.float32) / np.float32(255.0) if normalize else X
    for key in ("y_train", "y_test"):
        out[key] = arrays[key].astype(np.int32)
    return Dataset(out["X_train"], out["y_train"], out["X_test"], out["y_test"], num_classes=10, name=name)


def load_mnist(root, flatten: bool = True, normalize: bool = True) -> Dataset:
    """MNIST (60,000 train / 10,000 test, 10 classes) from the standard IDX files.

    ``root`` holds ``train-images-idx3-ubyte.gz``, ``train-labels-idx1-ubyte.gz``,
    ``t10k-images-idx3-ubyte.gz``, ``t10k-labels-idx1-ubyte.gz`` (or the same
    names without ``.gz``), directly or in a subfolder ``mnist/``.
    ``normalize=True``: float32 pixels in [0, 1]; False: the raw uint8 0..255.
    ``flatten=True``: X of shape (n, 784), else (n, 28, 28).
    """
    return _load_idx_set(root, "mnist", "mnist", flatten, normalize)


def load_fashion_mnist(root, flatten: bool = True, normalize: bool = True) -> Dataset:
    """Fashion-MNIST (60,000 / 10,000, 10 classes); same file names and options as :func:`load_mnist`.

    Looked for in ``root`` or its subfolder ``fashion_mnist/``.
    """
    return _load_idx_set(root, "fashion_mnist", "fashion_mnist", flatten, normalize)


__all__ = ["Dataset", "load_digits", "load_mnist", "load_fashion_mnist", "read_idx", "stratified_split"]
