"""Data layer: partition schemes, FederatedData, and the loaders (digits embedded; the rest need data_root)."""
import gzip

import numpy as np
import pytest

import fedprob as fp
from fedprob.data import FederatedData, partition, partition_indices

SCHEME_CASES = [
    ("iid", {}),
    ("dirichlet", {"alpha": 0.3}),
    ("dirichlet", {"alpha": 0.3, "alpha_size": 0.5, "min_size": 2}),
    ("label_sort", {"heterogeneity": 0.0}),
    ("label_sort", {"heterogeneity": 0.4}),
    ("label_sort", {"heterogeneity": 1.0}),
    ("shards", {"classes_per_client": 2}),
    ("groups", {}),  # groups filled in by the test
    ("feature_sort", {"feature": 3}),
]


def make_classification(n=503, d=5, C=7, seed=0):
    """Rows tagged by their index in column 0, so a row's identity survives partitioning."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d)).astype(np.float32)
    X[:, 0] = np.arange(n)
    y = rng.integers(0, C, size=n)
    return X, y


def case_kwargs(scheme, kw, n):
    kw = dict(kw)
    if scheme == "groups":
        kw["groups"] = np.random.default_rng(5).integers(0, 6, size=n) * 10 + 3  # 6 ids, not 0..5
    return kw


def class_tv(fed, C):
    """Mean total-variation distance between each client's class mix and the pooled mix."""
    pooled = np.bincount(fed.pooled()[1], minlength=C) / fed.num_rows
    tv = [0.5 * np.abs(np.bincount(fed.client(k)[1], minlength=C) / fed.sizes[k] - pooled).sum()
          for k in range(fed.num_clients)]
    return float(np.mean(tv))


# ----------------------------------------------------------------------------- partition property


@pytest.mark.parametrize("scheme,kw", SCHEME_CASES)
def test_every_row_in_exactly_one_client(scheme, kw):
    X, y = make_classification()
    n = len(y)
    kw = case_kwargs(scheme, kw, n)
    K = None if scheme == "groups" else 6
    parts = partition_indices(X, y, K, scheme, seed=3, **kw)
    allidx = np.concatenate(parts)
    np.testing.assert_array_equal(np.sort(allidx), np.arange(n))  # each row once
    assert all(len(p) >= 1 for p in parts)

    fed = partition(X, y, K, scheme, seed=3, **kw)
    assert isinstance(fed, FederatedData)
    assert fed.num_clients == 6 and fed.num_rows == n
    assert fed.X.dtype == np.float32 and fed.y.dtype == np.int32 and fed.num_classes == 7
    np.testing.assert_array_equal(fed.sizes, [len(p) for p in parts])
    Xp, yp = fed.pooled()
    ids = Xp[:, 0].astype(np.int64)
    np.testing.assert_array_equal(np.sort(ids), np.arange(n))  # multiset of rows preserved
    np.testing.assert_array_equal(Xp, X[ids])
    np.testing.assert_array_equal(yp, y[ids])
    for k, p in enumerate(parts):  # partition and partition_indices agree client by client
        np.testing.assert_array_equal(fed.client(k)[0][:, 0].astype(np.int64), p)


@pytest.mark.parametrize("scheme,kw", SCHEME_CASES)
def test_deterministic_given_seed(scheme, kw):
    X, y = make_classification()
    kw = case_kwargs(scheme, kw, len(y))
    K = None if scheme == "groups" else 6
    a = partition(X, y, K, scheme, seed=11, **kw)
    b = partition(X, y, K, scheme, seed=11, **kw)
    np.testing.assert_array_equal(a.X, b.X)
    np.testing.assert_array_equal(a.y, b.y)
    np.testing.assert_array_equal(a.sizes, b.sizes)
    c = partition(X, y, K, scheme, seed=12, **kw)
    assert not np.array_equal(a.X, c.X)  # a different seed moves rows (groups: only the order inside clients)


def test_iid_sizes_and_regression_target():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(101, 3))
    y = rng.normal(size=101)  # float target -> regression
    fed = partition(X, y, 4, "iid", seed=0)
    assert fed.num_classes is None and fed.y.dtype == np.float32
    np.testing.assert_array_equal(fed.sizes, [26, 25, 25, 25])
    # float labels that are integral stay a regression target for iid unless num_classes is given
    fed2 = partition(X, np.arange(101.0) % 3, 4, "iid", num_classes=3)
    assert fed2.num_classes == 3 and fed2.y.dtype == np.int32
    # integer labels infer num_classes = max + 1
    assert partition(X, np.arange(101) % 4, 4).num_classes == 4
    # 2-D regression targets are kept
    fed3 = partition(X, rng.normal(size=(101, 2)), 3)
    assert fed3.y.shape == (3, 34, 2)


# ----------------------------------------------------------------------------- dirichlet


def test_dirichlet_small_alpha_is_more_skewed():
    X, y = make_classification(n=2000, C=10, seed=1)
    skew = {a: np.mean([class_tv(partition(X, y, 10, "dirichlet", alpha=a, seed=s), 10) for s in range(4)])
            for a in (0.05, 1.0, 100.0, 1e5)}
    iid = np.mean([class_tv(partition(X, y, 10, "iid", seed=s), 10) for s in range(4)])
    # 20-seed means: 0.74 / 0.34 / 0.087 / 0.081, iid 0.081 (pure sampling noise of 200-row clients)
    assert skew[0.05] > 0.6
    assert 0.2 < skew[1.0] < 0.5
    assert skew[100.0] < 0.11
    assert skew[0.05] > skew[1.0] > skew[100.0]
    assert abs(skew[1e5] - iid) < 0.015  # alpha -> infinity is the iid split
    ncls = np.mean([np.sum(np.bincount(partition(X, y, 10, "dirichlet", alpha=0.05).client(k)[1]) > 0)
                    for k in range(10)])
    assert ncls < 7  # most clients miss several classes


def test_dirichlet_sizes():
    X, y = make_classification(n=400, C=5)
    equal = partition(X, y, 8, "dirichlet", alpha=0.5)
    np.testing.assert_array_equal(equal.sizes, np.full(8, 50))  # alpha_size=None: equal sizes
    # tiny alpha_size would leave clients empty; min_size repairs them
    for m in (1, 7):
        fed = partition(X, y, 20, "dirichlet", alpha=0.5, alpha_size=0.01, min_size=m, seed=2)
        assert fed.sizes.min() >= m and fed.num_rows == 400
        assert fed.sizes.max() > 100  # quantity skew: one client holds much of the data
    flat = partition(X, y, 8, "dirichlet", alpha=0.5, alpha_size=1e4, seed=2)
    assert flat.sizes.max() - flat.sizes.min() <= 10  # large alpha_size: near-equal


# ----------------------------------------------------------------------------- label_sort, shards


def test_label_sort_heterogeneity():
    X, y = make_classification(n=1000, C=10, seed=4)
    h0 = partition(X, y, 10, "label_sort", heterogeneity=0.0)
    h1 = partition(X, y, 10, "label_sort", heterogeneity=1.0)
    hm = partition(X, y, 10, "label_sort", heterogeneity=0.5)
    for fed in (h0, h1, hm):
        np.testing.assert_array_equal(fed.sizes, np.full(10, 100))
    ncls0 = [len(np.unique(h0.client(k)[1])) for k in range(10)]
    ncls1 = [len(np.unique(h1.client(k)[1])) for k in range(10)]
    assert min(ncls0) == 10  # h=0: uniform split, every client sees every class
    assert max(ncls1) <= 3  # h=1: sorted then contiguous: a client spans at most its class boundaries
    for k in range(9):  # h=1: labels are monotone across clients
        assert h1.client(k)[1].max() <= h1.client(k + 1)[1].min()
    assert class_tv(h0, 10) < class_tv(hm, 10) < class_tv(h1, 10)
    # h=0.5: about half of each client's rows come from its sorted block, the rest is iid
    assert 0.3 < class_tv(hm, 10) / class_tv(h1, 10) < 0.7


@pytest.mark.parametrize("cpc", [1, 2, 3])
def test_shards_classes_per_client(cpc):
    X, y = make_classification(n=600, C=10, seed=6)
    fed = partition(X, y, 10, "shards", classes_per_client=cpc, seed=1)
    ncls = [len(np.unique(fed.client(k)[1])) for k in range(10)]
    assert max(ncls) <= cpc
    assert fed.sizes.max() <= 1.5 * fed.sizes.min()  # shards of near-equal size


def test_groups_and_feature_sort():
    X, y = make_classification(n=300, C=4)
    g = np.array(["b", "a", "c"])[np.arange(300) % 3]
    fed = partition(X, y, None, "groups", groups=g)
    np.testing.assert_array_equal(fp.data.group_ids(g), ["a", "b", "c"])
    for k, gid in enumerate(["a", "b", "c"]):  # client k = k-th sorted unique id
        ids = fed.client(k)[0][:, 0].astype(int)
        np.testing.assert_array_equal(np.sort(ids), np.flatnonzero(g == gid))
    assert partition(X, y, 3, "groups", groups=g).num_clients == 3

    yr = np.random.default_rng(0).normal(size=300)
    fs = partition(X, yr, 7, "feature_sort", feature=2, seed=0)
    assert fs.num_classes is None
    assert fs.sizes.max() - fs.sizes.min() <= 1
    for k in range(6):
        assert fs.client(k)[0][:, 2].max() <= fs.client(k + 1)[0][:, 2].min()
    neg = partition(X, yr, 7, "feature_sort", feature=-1)  # python-style negative index
    for k in range(6):
        assert neg.client(k)[0][:, -1].max() <= neg.client(k + 1)[0][:, -1].min()


# ----------------------------------------------------------------------------- validation


def _bad(**over):
    X, y = make_classification(n=50, C=3)
    args = dict(X=X, y=y, num_clients=5, scheme="iid")
    args.update(over)
    return args


@pytest.mark.parametrize("args,match", [
    (_bad(X=np.where(np.arange(250).reshape(50, 5) == 7, np.nan, 1.0)), "X contains 1 NaN/inf"),
    (_bad(y=np.r_[np.inf, np.zeros(49)]), "y contains 1 NaN/inf"),
    (_bad(y=np.zeros(49, int)), "different numbers of rows: 50 vs 49"),
    (_bad(X=np.zeros(50)), "X must have a row axis"),
    (_bad(num_clients=0), "num_clients must be >= 1"),
    (_bad(num_clients=2.5), "num_clients must be an integer"),
    (_bad(num_clients=51), "num_clients=51 exceeds the number of rows"),
    (_bad(scheme="round_robin"), "unknown scheme 'round_robin'"),
    (_bad(scheme="dirichlet", y=np.linspace(0, 1, 50)), "non-integer labels"),
    (_bad(scheme="shards", y=np.full(50, -1)), "labels out of range: found negative"),
    (_bad(scheme="label_sort", num_classes=2), r"labels out of range: found \[0, 2\], expected \[0, 1\]"),
    (_bad(scheme="label_sort", heterogeneity=1.5), r"heterogeneity must lie in \[0, 1\]"),
    (_bad(scheme="label_sort", heterogeneity=-0.1), r"heterogeneity must lie in \[0, 1\]"),
    (_bad(scheme="dirichlet", alpha=0.0), "alpha must be a positive finite number"),
    (_bad(scheme="dirichlet", alpha_size=-1.0), "alpha_size must be a positive finite number"),
    (_bad(scheme="dirichlet", min_size=11), "min_size=11 with 5 clients needs 55 rows"),
    (_bad(scheme="dirichlet", min_size=0), "min_size must be >= 1"),
    (_bad(scheme="shards", num_clients=1, classes_per_client=2), "smaller than the 3 classes present"),
    (_bad(scheme="groups", num_clients=None), "needs groups="),
    (_bad(scheme="groups", num_clients=None, groups=np.zeros(49)), "one id per row: got shape"),
    (_bad(scheme="groups", num_clients=3, groups=np.arange(50) % 2), "groups holds 2 distinct ids"),
    (_bad(scheme="feature_sort", feature=5), "feature=5 out of range for 5"),
    (_bad(scheme="iid", alpha=0.5), "alpha= applies to scheme 'dirichlet', not to scheme 'iid'"),
    (_bad(num_clients=None), "needs num_clients"),
])
def test_partition_validation(args, match):
    with pytest.raises(ValueError, match=match):
        partition(args.pop("X"), args.pop("y"), args.pop("num_clients"), args.pop("scheme"), **args)


def test_partition_indices_rejects_unknown_option():
    X, y = make_classification(n=20)
    with pytest.raises(ValueError, match="unknown partition option"):
        partition_indices(X, y, 2, "iid", alpah=0.1)


# ----------------------------------------------------------------------------- FederatedData


def test_federated_data_padding_client_pooled():
    X0, y0 = np.arange(6.0).reshape(3, 2), np.array([0, 1, 2])
    X1, y1 = np.arange(10.0, 12.0).reshape(1, 2), np.array([1])
    fed = FederatedData.from_clients([(X0, y0), (X1, y1)], num_classes=3)
    assert fed.X.shape == (2, 3, 2) and fed.y.shape == (2, 3) and fed.max_size == 3
    np.testing.assert_array_equal(fed.sizes, [3, 1])
    np.testing.assert_array_equal(fed.X[1], [[10, 11]] * 3)  # padding repeats the first row
    np.testing.assert_array_equal(fed.y[1], [1, 1, 1])
    Xc, yc = fed.client(1)
    np.testing.assert_array_equal(Xc, X1)
    np.testing.assert_array_equal(yc, y1)
    Xp, yp = fed.pooled()
    np.testing.assert_array_equal(Xp, np.concatenate([X0, X1]))
    np.testing.assert_array_equal(yp, [0, 1, 2, 1])
    with pytest.raises(IndexError, match="client 2 out of range"):
        fed.client(2)
    with pytest.raises(ValueError, match="client 1 has no data"):
        FederatedData.from_clients([(X0, y0), (X0[:0], y0[:0])])
    with pytest.raises(ValueError, match="labels out of range"):
        FederatedData.from_clients([(X0, y0)], num_classes=2)
    cd = fed.client_data()
    assert cd.X.shape == (2, 3, 2)


# ----------------------------------------------------------------------------- digits


def test_load_digits():
    d = fp.data.load_digits()
    assert d.X_train.shape == (1437, 64) and d.X_test.shape == (360, 64)
    assert d.X_train.dtype == np.float32 and d.y_train.dtype == np.int32 and d.num_classes == 10
    allX = np.concatenate([d.X_train, d.X_test])
    assert allX.min() == 0.0 and allX.max() == 1.0
    np.testing.assert_array_equal(allX * 16, np.round(allX * 16))  # counts 0..16 / 16
    allY = np.concatenate([d.y_train, d.y_test])
    np.testing.assert_array_equal(np.bincount(allY), [178, 182, 177, 183, 181, 182, 181, 179, 174, 180])
    # stratified: each class's test share within one row of 20%
    cnt = np.bincount(allY)
    assert np.all(np.abs(np.bincount(d.y_test, minlength=10) - 0.2 * cnt) <= 1.0)
    # train + test is the embedded set, row for row
    with np.load(fp.data.loaders.resources.files("fedprob").joinpath("_data/digits.npz")) as z:
        ref = z["images"].reshape(1797, 64).astype(np.float32) / 16
    key = lambda a: a[np.lexsort(a.T[::-1])]
    np.testing.assert_array_equal(key(allX), key(ref))
    # determinism and seed dependence; unflattened images; train/test tuples
    d2 = fp.data.load_digits(seed=0)
    np.testing.assert_array_equal(d.X_train, d2.X_train)
    assert not np.array_equal(d.y_train, fp.data.load_digits(seed=1).y_train)
    img = fp.data.load_digits(flatten=False, test_fraction=0.5)
    assert img.X_train.shape == (898, 8, 8) and img.X_test.shape == (899, 8, 8)
    assert d.train[0] is d.X_train and d.test[1] is d.y_test
    fed = d.partition(5, "dirichlet", alpha=1.0)
    assert fed.num_rows == 1437 and fed.num_classes == 10
    with pytest.raises(ValueError, match="test_fraction must lie strictly between 0 and 1"):
        fp.data.load_digits(test_fraction=1.0)


# ----------------------------------------------------------------------------- MNIST family


def test_idx_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing file train-images-idx3-ubyte.gz"):
        fp.data.load_mnist(tmp_path)
    bad = tmp_path / "bad.gz"
    with gzip.open(bad, "wb") as fh:
        fh.write(bytes([0, 0, 8, 1, 0, 0, 0, 5, 1, 2, 3]))  # header says 5 values, 3 present
    with pytest.raises(ValueError, match="truncated or corrupt"):
        fp.data.read_idx(bad)
    good = tmp_path / "good"
    good.write_bytes(bytes([0, 0, 8, 2, 0, 0, 0, 2, 0, 0, 0, 3]) + bytes(range(6)))
    np.testing.assert_array_equal(fp.data.read_idx(good), np.arange(6).reshape(2, 3))


@pytest.fixture(scope="module")
def mnist(data_root):
    return fp.data.load_mnist(data_root)  # finds data_root/mnist/


def test_mnist(mnist):
    assert mnist.X_train.shape == (60000, 784) and mnist.X_test.shape == (10000, 784)
    assert mnist.X_train.dtype == np.float32 and mnist.y_train.dtype == np.int32
    assert mnist.X_train.min() == 0.0 and mnist.X_train.max() == 1.0
    np.testing.assert_array_equal(np.bincount(mnist.y_train),
                                  [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949])
    np.testing.assert_array_equal(np.bincount(mnist.y_test),
                                  [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009])
    assert abs(float(mnist.X_train.mean()) - 0.1307) < 1e-3


def test_fashion_mnist(data_root):
    fm = fp.data.load_fashion_mnist(data_root / "fashion_mnist", flatten=False, normalize=False)
    assert fm.X_train.shape == (60000, 28, 28) and fm.X_train.dtype == np.uint8
    assert fm.X_test.shape == (10000, 28, 28)
    np.testing.assert_array_equal(np.bincount(fm.y_train), np.full(10, 6000))
    np.testing.assert_array_equal(np.bincount(fm.y_test), np.full(10, 1000))
    assert abs(float(fm.X_train.mean()) / 255 - 0.2860) < 1e-3


# ----------------------------------------------------------------------------- UCI

# name: (rows after cleaning in "fixed", fixed inputs, paper inputs, paper train, paper test)
UCI = {
    "air_quality": (7674, 13, 13, 7485, 1872),
    "bike_sharing": (731, 11, 13, 584, 147),
    "wine_quality": (1599, 11, 11, 1279, 320),
    "real_estate": (414, 6, 7, 331, 83),
    "forest_fires": (517, 12, 12, 413, 104),
}


@pytest.mark.parametrize("name", list(UCI))
def test_uci_fixed_protocol(data_root, name):
    n, d_fixed, _, _, _ = UCI[name]
    ds = fp.data.load_uci(name, data_root, seed=0)
    assert ds.X_train.shape[1] == d_fixed and len(ds.feature_names) == d_fixed
    assert ds.X_train.shape[0] + ds.X_test.shape[0] == n
    assert ds.X_test.shape[0] == int(np.ceil(0.2 * n))
    assert ds.num_classes is None and ds.X_train.dtype == np.float32 and ds.y_train.dtype == np.float32
    for a in (ds.X_train, ds.X_test, ds.y_train, ds.y_test):
        assert np.all(np.isfinite(a))
    np.testing.assert_allclose(ds.X_train.mean(0), 0, atol=1e-5)  # train statistics only
    np.testing.assert_allclose(ds.X_train.std(0), 1, atol=1e-4)
    np.testing.assert_allclose(ds.y_train.mean(), 0, atol=1e-5)
    np.testing.assert_allclose(ds.y_train.std(), 1, atol=1e-4)
    assert abs(float(ds.y_test.mean())) > 1e-4  # the test set was not standardized on itself
    # the seed reshuffles; the same seed reproduces
    np.testing.assert_array_equal(ds.y_train, fp.data.load_uci(name, data_root, seed=0).y_train)
    assert not np.array_equal(ds.y_train, fp.data.load_uci(name, data_root, seed=1).y_train)


def test_uci_fixed_drops_leaks_and_unstandardizes(data_root):
    bike = fp.data.load_uci("bike_sharing", data_root)
    for leak in ("casual", "registered", "instant", "dteday", "cnt"):
        assert leak not in bike.feature_names
    raw = np.genfromtxt(data_root / "uci_bike_sharing" / "day.csv", delimiter=",", names=True,
                        dtype=None, encoding="utf-8")
    cnt = np.concatenate([bike.y_train, bike.y_test]) * bike.y_std + bike.y_mean
    np.testing.assert_allclose(np.sort(cnt), np.sort(raw["cnt"].astype(float)), atol=0.02)
    re = fp.data.load_uci("real_estate", data_root)
    assert "No" not in re.feature_names
    air = fp.data.load_uci("air_quality", data_root)
    assert "NMHC(GT)" not in air.feature_names and {"MONTH", "HOUR"} <= set(air.feature_names)
    co = air.y_train * air.y_std + air.y_mean
    assert co.min() > 0  # the -200 "missing" codes of the target are gone


@pytest.mark.parametrize("name", list(UCI))
def test_uci_paper_protocol(data_root, name):
    _, _, d_paper, n_tr, n_te = UCI[name]
    ds = fp.data.load_uci(name, data_root, protocol="paper")
    assert ds.X_train.shape == (n_tr, d_paper) and ds.X_test.shape == (n_te, d_paper)
    X = np.concatenate([ds.X_train, ds.X_test]).astype(np.float64)
    y = np.concatenate([ds.y_train, ds.y_test]).astype(np.float64)
    np.testing.assert_allclose(X.mean(0), 0, atol=1e-5)  # z-scored on the whole set, ddof=1
    np.testing.assert_allclose(X.std(0, ddof=1), 1, atol=1e-5)
    np.testing.assert_allclose(y.mean(), 0, atol=1e-5)
    np.testing.assert_allclose(y.std(ddof=1), 1, atol=1e-5)


def test_uci_paper_matches_independent_read(data_root):
    """Real estate (paper): the SOURCE.md loader plus a pandas-style z-score, row for row, No kept."""
    a = np.genfromtxt(data_root / "uci_real_estate" / "real_estate_valuation_from_xlsx.csv",
                      delimiter=",", skip_header=1)
    z = (a - a.mean(0)) / a.std(0, ddof=1)
    ds = fp.data.load_uci("real_estate", data_root, protocol="paper")
    assert ds.feature_names[0] == "No"
    np.testing.assert_allclose(ds.X_train, z[:331, :7], atol=1e-5)
    np.testing.assert_allclose(ds.y_test, z[331:, 7], atol=1e-5)
    np.testing.assert_allclose(ds.y_mean, a[:, 7].mean(), rtol=1e-12)
    bike = fp.data.load_uci("bike_sharing", data_root, protocol="paper")
    assert {"casual", "registered"} <= set(bike.feature_names)  # the paper's leak is kept
    air = fp.data.load_uci("air_quality", data_root, protocol="paper")
    assert air.y_mean < 0  # -200 codes kept as values, as in the paper


def test_uci_errors(data_root, tmp_path):
    with pytest.raises(ValueError, match="unknown UCI data set 'iris'"):
        fp.data.load_uci("iris", data_root)
    with pytest.raises(ValueError, match="unknown protocol 'random'"):
        fp.data.load_uci("wine_quality", data_root, protocol="random")
    with pytest.raises(FileNotFoundError, match="missing file winequality-red.csv"):
        fp.data.load_uci("wine_quality", tmp_path)
    with pytest.raises(FileNotFoundError, match="missing file processed.cleveland.data"):
        fp.data.load_heart_disease(tmp_path)


def test_credit_approval(data_root):
    ds = fp.data.load_credit_approval(data_root)
    assert ds.X_train.shape[0] + ds.X_test.shape[0] == 653  # rows with '?' dropped
    assert ds.X_train.shape[1] == 46 and ds.num_classes == 2
    y = np.concatenate([ds.y_train, ds.y_test])
    np.testing.assert_array_equal(np.bincount(y), [296, 357])  # '+' -> 0, '-' -> 1
    np.testing.assert_allclose(ds.X_train[:, :6].mean(0), 0, atol=1e-5)
    np.testing.assert_allclose(ds.X_train[:, :6].std(0), 1, atol=1e-4)
    onehot = np.concatenate([ds.X_train, ds.X_test])[:, 6:]
    assert set(np.unique(onehot)) == {0.0, 1.0}
    np.testing.assert_array_equal(onehot.sum(1), np.full(653, 9))  # one category per attribute
    paper = fp.data.load_credit_approval(data_root, protocol="paper")
    np.testing.assert_allclose(np.concatenate([paper.X_train, paper.X_test])[:, :6].mean(0), 0, atol=1e-5)
    assert paper.X_train.shape == (522, 46)


def test_heart_disease(data_root):
    ds = fp.data.load_heart_disease(data_root)
    assert ds.group_names == ("cleveland", "hungarian", "switzerland", "va")
    np.testing.assert_array_equal(np.bincount(ds.group_train), [199, 172, 30, 85])  # FLamby's sizes
    np.testing.assert_array_equal(np.bincount(ds.group_test), [104, 89, 16, 45])
    assert ds.X_train.shape[1] == 13 and ds.num_classes == 2
    for a in (ds.X_train, ds.X_test):
        assert np.all(np.isfinite(a))
    for k in range(4):  # per-centre train standardization (Switzerland's chol is constant 0 -> 0)
        Xk = ds.X_train[ds.group_train == k]
        np.testing.assert_allclose(Xk.mean(0), 0, atol=1e-5)
        sd = Xk.std(0)
        assert np.all((np.abs(sd - 1) < 1e-4) | (sd < 1e-6))
    # labels: num > 0; Cleveland has 303 rows, 164 without disease
    cle = np.concatenate([ds.y_train[ds.group_train == 0], ds.y_test[ds.group_test == 0]])
    np.testing.assert_array_equal(np.bincount(cle), [164, 139])
    fed = ds.partition(scheme="groups")
    np.testing.assert_array_equal(fed.sizes, [199, 172, 30, 85])
    imp = fp.data.load_heart_disease(data_root, missing="impute", standardize="pooled")
    assert imp.X_train.shape[0] + imp.X_test.shape[0] == 920
    np.testing.assert_allclose(imp.X_train.std(0), 1, atol=1e-4)
    with pytest.raises(ValueError, match="missing must be 'drop' or 'impute'"):
        fp.data.load_heart_disease(data_root, missing="zero")
