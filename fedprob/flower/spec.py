"""A fedprob TOML configuration as the Flower App's run configuration: what every side builds from it.

The ServerApp and every node build the same algorithm and model from the
configuration's ``[model]``, ``[algorithm]``, ``[client]``, ``[run]``,
``[faults]`` and ``[stragglers]`` tables (:func:`build_parts`), without
loading ``[data]``: in a deployment the rows are on the nodes. A classifier's
``num_classes`` must therefore be in ``[model]``; :func:`resolve` (run by
``fedprob flower app``) writes it there from the data set when the data set
loads where the app is written.

``[flower]`` holds the deployment's own keys (:data:`FLOWER_KEYS`):
``num_nodes`` (wait for this many nodes before the first round; default:
every node connected after ``node_wait_s``), ``node_wait_s`` (default 60),
``round_timeout_s`` (how long a round waits for its replies; default 600),
``on_missing`` (``"error"`` or ``"drop"``: what a participant without a reply
does to the round; default ``"drop"`` when ``[faults]`` or ``[stragglers]``
are given, else ``"error"``) and ``evaluate`` (evaluate the posterior on the
data set's test split where the server can load it; default true).
"""
from __future__ import annotations

import tomllib

from .. import config as C

FLOWER_KEYS = C.FLOWER_KEYS
CLASSIFIERS = ("softmax_regression", "bnn_mlp", "cnn")


def parse(text: str) -> dict:
    """The configuration dict of TOML ``text`` (``[flower]`` checked here, the rest by
    :func:`fedprob.config.validate`)."""
    try:
        cfg = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"configuration is not valid TOML: {e}") from None
    fl = cfg.get("flower", {})
    if not isinstance(fl, dict):
        raise ValueError("[flower] must be a table")
    C._check_keys("flower", fl, FLOWER_KEYS)
    if fl.get("on_missing", "error") not in ("error", "drop"):
        raise ValueError(f"[flower] on_missing is 'error' or 'drop', got {fl['on_missing']!r}")
    C.validate(cfg)
    return cfg


def flower_options(cfg: dict) -> dict:
    """``[flower]`` with its defaults filled in."""
    fl = dict(cfg.get("flower", {}))
    faulty = "faults" in cfg or "stragglers" in cfg
    fl.setdefault("num_nodes", None)
    fl.setdefault("node_wait_s", 60.0)
    fl.setdefault("round_timeout_s", 600.0)
    fl.setdefault("on_missing", "drop" if faulty else "error")
    fl.setdefault("evaluate", True)
    return fl


def build_parts(cfg: dict):
    """``(algorithm, model, model_kwargs, run_kw)`` from ``cfg`` without loading its data.

    run_kw: ``rounds`` (None: the algorithm's default), ``seed``,
    ``clients_per_round``, ``faults``, ``privacy`` (None)."""
    from .. import algorithms, inference, models

    model_fn, model_kw = C._named(models, cfg.get("model", {}), "model")
    if model_fn.__name__ in CLASSIFIERS and "num_classes" not in model_kw:
        raise ValueError(f"[model] num_classes is needed on the Deployment Engine ({model_fn.__name__}): "
                         "the nodes hold the data; `fedprob flower app` fills it in where the data set loads")
    model = model_fn(**model_kw)
    algo_cls, algo_kw = C._named(algorithms, cfg.get("algorithm", {}), "algorithm")
    if "client" in cfg:
        backend_cls, backend_kw = C._named(inference, cfg["client"], "client")
        algo_kw["client"] = backend_cls(**backend_kw)
    algo = algo_cls(**algo_kw)
    opts = C.run_options({t: cfg[t] for t in ("run", "faults", "stragglers") if t in cfg})
    run = {"rounds": opts.get("rounds"), "seed": int(opts.get("seed", 0)),
           "clients_per_round": opts.get("clients_per_round"), "faults": opts.get("faults"), "privacy": None}
    return algo, model, None, run


def resolve(cfg: dict) -> dict:
    """``cfg`` with ``[model] num_classes`` filled in from the data set when a classifier lacks it
    (loads ``[data]``); engine, checkpoint and device tables are dropped (the deployment decides)."""
    from .. import models

    out = {t: dict(v) for t, v in cfg.items() if t not in ("engine", "checkpoint")}
    model_fn, model_kw = C._named(models, out.get("model", {}), "model")
    if model_fn.__name__ in CLASSIFIERS and "num_classes" not in model_kw:
        ds = load_dataset(out)
        if ds.num_classes is None:
            raise ValueError(f"[model] {model_fn.__name__} needs num_classes")
        out["model"]["num_classes"] = int(ds.num_classes)
    return out


def load_dataset(cfg: dict):
    """The ``[data]`` data set (train and test splits), as ``fedprob run`` loads it."""
    d = dict(cfg.get("data", {}))
    name = d.pop("name", "digits")
    root = d.pop("root", None)
    fn = C._loader(name)
    if name == "digits":
        return fn(**d)
    if root is None:
        raise ValueError(f"data set '{name}' is read from disk: give [data] root = \"...\"")
    return fn(name, root, **d) if name in C.UCI_SETS else fn(root, **d)


def federation(cfg: dict):
    """The ``(FederatedData, test)`` that ``fedprob run`` builds from ``cfg`` (for ``split``)."""
    ds = load_dataset(cfg)
    part = dict(cfg.get("partition", {}))
    scheme = part.pop("scheme", "iid")
    num_clients = part.pop("num_clients", None if scheme == "groups" else 10)
    return ds.partition(num_clients, scheme, **part), ds.test


__all__ = ["parse", "build_parts", "flower_options", "resolve", "load_dataset", "federation", "FLOWER_KEYS"]
