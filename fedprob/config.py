"""Run configurations: TOML tables checked against what they configure, dotted overrides, TOML output.

Tables: ``[data]`` (``name`` and ``root``, plus the loader's keyword
arguments), ``[partition]`` (``num_clients``, ``scheme`` and the partition
options), ``[model]`` (``name`` of a ``fedprob.models`` builder plus its
keyword arguments), ``[algorithm]`` (``name`` in ``fedprob.algorithms`` plus
its fields), optional ``[client]`` (``name`` of a ``fedprob.inference``
backend plus its fields, passed as ``client=``), ``[run]`` (``rounds``,
``seed``, ``clients_per_round``, ``eval_every``) and the options of ``fp.run``,
each optional: ``[engine]`` (``name = "local"`` with ``client_chunk`` and
``devices``, the number of ``jax.devices()`` to use; or ``name = "flower"``
with ``num_nodes``), ``[faults]`` (``dropout_rate``, ``max_update_norm``),
``[stragglers]`` (``rate``, ``policy``, ``min_fraction``) and ``[checkpoint]``
(``dir``, ``keep``), and ``[flower]``, read by ``fedprob flower app`` only
(:mod:`fedprob.flower.spec`). ``[run] client_chunk`` of earlier releases still works
with a FutureWarning (write ``[engine] client_chunk``). An unknown table or key
is a ValueError naming it and what is accepted there.
"""
from __future__ import annotations

import dataclasses
import inspect
import tomllib

from .names import hint, public_names, unknown
from .toml_text import dumps

TABLES = ("data", "partition", "model", "algorithm", "client", "run", "engine", "faults", "stragglers",
          "checkpoint", "flower")   # [flower]: the Deployment Engine's keys (fedprob.flower.spec); fedprob run ignores it
RUN_KEYS = ("rounds", "seed", "clients_per_round", "eval_every")
OLD_RUN_KEYS = ("client_chunk",)       # deprecated: [engine] client_chunk
ENGINE_KEYS = {"local": ("name", "client_chunk", "devices"), "flower": ("name", "num_nodes")}
OPTION_KEYS = {"faults": ("dropout_rate", "max_update_norm"), "stragglers": ("rate", "policy", "min_fraction"),
               "checkpoint": ("dir", "keep")}
FLOWER_KEYS = ("num_nodes", "node_wait_s", "round_timeout_s", "on_missing", "evaluate")
PARTITION_KEYS = ("num_clients", "scheme", "seed", "num_classes", "alpha", "alpha_size", "min_size",
                  "heterogeneity", "classes_per_client", "groups", "feature")
UCI_SETS = ("air_quality", "bike_sharing", "wine_quality", "real_estate", "forest_fires")
DATA_SETS = ("digits", "mnist", "fashion_mnist", "credit_approval", "heart_disease") + UCI_SETS

HELP = """configuration (TOML):
  [data]       name = one of {sets}; root = "DIR" for data on disk; loader options
               (digits: test_fraction, seed, flatten; UCI sets: protocol, test_fraction, seed)
  [partition]  num_clients, scheme = iid | dirichlet | label_sort | shards | groups, seed,
               alpha, alpha_size, min_size, heterogeneity, classes_per_client, groups, feature
  [model]      name = a fedprob.models builder (softmax_regression, linear_regression, ...) + its options
  [algorithm]  name = a fedprob.algorithms class (FedAvg, FedPA, EPMCMC, PredictiveBayes, ...) + its fields
  [client]     name = a fedprob.inference backend (NUTS, SGHMC, Laplace, ...) + its fields (optional)
  [run]        {run}
  [engine]     name = local (client_chunk, devices = how many of jax.devices()) | flower (num_nodes)
  [faults]     dropout_rate, max_update_norm
  [stragglers] rate, policy = truncate | discard, min_fraction
  [checkpoint] dir = "DIR" (resume: run again with more rounds), keep
  [flower]     num_nodes, node_wait_s, round_timeout_s, on_missing = error | drop, evaluate
               (Flower's Deployment Engine: fedprob flower app; fedprob run ignores it)
override any key with --set table.key=value (value in TOML syntax, e.g. --set algorithm.learning_rate=0.05)
""".format(sets=", ".join(DATA_SETS), run=", ".join(RUN_KEYS))


def _loader(name: str):
    from . import data

    if name in UCI_SETS:
        return data.load_uci
    fn = getattr(data, f"load_{name}", None)
    if name not in DATA_SETS or fn is None:
        raise ValueError(unknown("data set", name, DATA_SETS, "[data] name"))
    return fn


def _params(fn) -> set:
    if dataclasses.is_dataclass(fn):
        return {f.name for f in dataclasses.fields(fn) if f.init}
    sig = inspect.signature(fn)
    if any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()):
        return None
    return {p for p in sig.parameters}


def _named(module, table: dict, what: str):
    if "name" not in table:
        raise ValueError(f"[{what}] needs a name")
    name = table["name"]
    valid = _choices(module, what)
    if name not in valid:
        raise ValueError(unknown(_WHAT[what], name, valid, f"[{what}] name"))
    obj = getattr(module, name)
    return obj, {k: v for k, v in table.items() if k != "name"}


_WHAT = {"model": "model", "algorithm": "algorithm", "client": "client backend"}


def _choices(module, what: str) -> list:
    """The names a ``[model]``, ``[algorithm]`` or ``[client]`` table may give: the model builders,
    the :class:`~fedprob.algorithms.Algorithm` subclasses, the client backends."""
    from .algorithms import Algorithm
    from .protocols import ClientBackend

    kind = {"algorithm": Algorithm, "client": ClientBackend}.get(what)
    names = public_names(vars(module), kind)
    if kind is None:
        names = [n for n in names if inspect.isfunction(getattr(module, n))]
    return [n for n in names if not getattr(getattr(module, n), "__abstractmethods__", None)]


def _check_keys(table: str, keys, allowed) -> None:
    if allowed is None:
        return
    bad = sorted(set(keys) - set(allowed))
    if bad:
        raise ValueError(f"unknown key {bad[0]!r} in [{table}]{hint(bad[0], allowed)}")


def validate(cfg: dict) -> dict:
    """``cfg`` if every table and key is known (see the module docstring), else a ValueError naming the first."""
    from . import algorithms, inference, models

    if not isinstance(cfg, dict):
        raise ValueError("a configuration is a TOML document of tables")
    for t, v in cfg.items():
        if t not in TABLES:
            raise ValueError(f"unknown table [{t}] in the configuration{hint(t, TABLES)}")
        if not isinstance(v, dict):
            raise ValueError(f"[{t}] must be a table, got {type(v).__name__}")
    d = cfg.get("data", {})
    name = d.get("name", "digits")
    fn = _loader(name)
    allowed = _params(fn)
    _check_keys("data", d, None if allowed is None else (allowed | {"name", "root"}) - {"name_"})
    _check_keys("partition", cfg.get("partition", {}), PARTITION_KEYS)
    _check_keys("run", cfg.get("run", {}), RUN_KEYS + OLD_RUN_KEYS)
    engine = cfg.get("engine", {}).get("name", "local")
    if engine not in ENGINE_KEYS:
        raise ValueError(unknown("engine", engine, ENGINE_KEYS, "[engine] name"))
    part = cfg.get("partition", {})
    if "scheme" in part:
        from .data.partition import SCHEMES

        if part["scheme"] not in SCHEMES:
            raise ValueError(unknown("scheme", part["scheme"], SCHEMES, "[partition] scheme"))
    _check_keys("engine", cfg.get("engine", {}), ENGINE_KEYS[engine])
    for table, keys in OPTION_KEYS.items():
        _check_keys(table, cfg.get(table, {}), keys)
    _check_keys("flower", cfg.get("flower", {}), FLOWER_KEYS)
    for table, module in (("model", models), ("algorithm", algorithms), ("client", inference)):
        if table in cfg or table in ("model", "algorithm"):
            obj, kw = _named(module, cfg.get(table, {}), table)
            allowed = _params(obj)
            if allowed is not None:
                _check_keys(table, kw, allowed)
    return cfg


def loads(text: str) -> dict:
    """Parse and validate TOML text."""
    try:
        cfg = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"configuration is not valid TOML: {e}") from None
    return validate(cfg)


def override(cfg: dict, assignments) -> dict:
    """A copy of ``cfg`` with ``table.key=value`` assignments applied (value in TOML syntax, else a string)."""
    out = {t: dict(v) for t, v in cfg.items()}
    for a in assignments or ():
        if "=" not in a or "." not in a.split("=", 1)[0]:
            raise ValueError(f"--set takes table.key=value, got '{a}'")
        lhs, rhs = a.split("=", 1)
        table, key = lhs.strip().split(".", 1)
        try:
            value = tomllib.loads(f"v = {rhs.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            value = rhs.strip()
        out.setdefault(table, {})[key] = value
    return out


def build(cfg: dict):
    """(algorithm, model, fed, eval_data, run kwargs) from a validated configuration."""
    from . import algorithms, inference, models

    validate(cfg)
    d = dict(cfg.get("data", {}))
    name = d.pop("name", "digits")
    root = d.pop("root", None)
    fn = _loader(name)
    if name == "digits":
        ds = fn(**d)
    elif root is None:
        raise ValueError(f"data set '{name}' is read from disk: give [data] root = \"...\"")
    elif name in UCI_SETS:
        ds = fn(name, root, **d)
    else:
        ds = fn(root, **d)
    part = dict(cfg.get("partition", {}))
    scheme = part.pop("scheme", "iid")
    num_clients = part.pop("num_clients", None if scheme == "groups" else 10)
    fed = ds.partition(num_clients, scheme, **part)
    model_fn, model_kw = _named(models, cfg.get("model", {}), "model")
    if model_fn.__name__ in ("softmax_regression", "bnn_mlp", "cnn") and ds.num_classes is not None:
        model_kw.setdefault("num_classes", ds.num_classes)
    model = model_fn(**model_kw)
    algo_cls, algo_kw = _named(algorithms, cfg.get("algorithm", {}), "algorithm")
    if "client" in cfg:
        backend_cls, backend_kw = _named(inference, cfg["client"], "client")
        algo_kw["client"] = backend_cls(**backend_kw)
    algo = algo_cls(**algo_kw)
    return algo, model, fed, ds.test, run_options(cfg)


def run_options(cfg: dict) -> dict:
    """``fp.run``'s keyword arguments from ``[run]``, ``[engine]``, ``[faults]``, ``[stragglers]`` and
    ``[checkpoint]`` (option objects; ``[run] client_chunk`` moves into the engine with a FutureWarning)."""
    from . import deprecated
    from .checkpoint import Checkpoint
    from .engine import Flower, Local
    from .faults import Faults
    from .stragglers import Stragglers

    kw = dict(cfg.get("run", {}))
    engine = dict(cfg.get("engine", {}))
    name = engine.pop("name", "local")
    if "client_chunk" in kw:
        if "client_chunk" in engine:
            raise ValueError("client_chunk is given in [run] and in [engine]: keep only [engine] client_chunk")
        engine["client_chunk"] = kw.pop("client_chunk")
        deprecated.warn("[run] client_chunk", "[engine] client_chunk", stacklevel=2)
    if name == "flower":
        kw["engine"] = Flower(**engine)
    else:
        if "devices" in engine:
            engine["devices"] = _devices(engine["devices"])
        kw["engine"] = Local(**engine)
    if "faults" in cfg or "stragglers" in cfg:
        s = cfg.get("stragglers")
        if s is not None and "rate" not in s:
            raise ValueError("[stragglers] needs rate (the probability that a participant straggles)")
        kw["faults"] = Faults(**cfg.get("faults", {}), stragglers=None if s is None else Stragglers(**s))
    if "checkpoint" in cfg:
        kw["checkpoint"] = Checkpoint(**cfg["checkpoint"])
    return kw


def _devices(n):
    """The first ``n`` of ``jax.devices()``."""
    import jax

    devs = jax.devices()
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= len(devs):
        raise ValueError(f"[engine] devices is how many of the {len(devs)} devices to use (1 to {len(devs)}), "
                         f"got {n!r}")
    return devs[:n]


__all__ = ["validate", "loads", "override", "dumps", "build", "run_options", "HELP", "TABLES"]
