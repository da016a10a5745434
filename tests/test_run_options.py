"""fp.run's options as objects: each validates; the new form equals the deprecated keywords bit for bit;
the keywords warn; the TOML tables; the package's imports form no circle."""
import ast
import dataclasses
import inspect
import os
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest

import fedprob as fp
from fedprob import config as C
from fedprob import deprecated
from conftest import linreg_model

MODEL = linreg_model(prior_scale=1.0, sigma=0.5)
ALGO = fp.algorithms.FedAvg(local_steps=4, batch_size=4, learning_rate=0.1, server_optimizer="adam",
                            server_learning_rate=0.05)


def make_fed(K=5, seed=0):
    rng = np.random.default_rng(seed)
    clients = []
    for k in range(K):
        X = rng.normal(size=(6 + 2 * k, 2))
        y = X @ np.array([1.0, -1.0]) + 0.5 * rng.normal(size=len(X))
        if k == 1:
            y = 30.0 * y                          # an oversized update for the norm bound
        clients.append((X, y))
    return fp.data.FederatedData.from_clients(clients)


FED = make_fed()


def leaves(r):
    return [np.asarray(a) for a in jax.tree_util.tree_leaves((r.server_state, r.client_states))]


def strip(r):
    return [{k: v for k, v in h.items() if k != "time"} for h in r.history]


# ---------------------------------------------------------------------------------------------------
# each option validates its fields


def test_option_objects_validate_their_fields_and_are_frozen():
    dev = jax.devices()[0]
    assert fp.engine.Local(devices=[dev], client_chunk=2).devices == (dev,)       # stored as a tuple
    for bad, match in (({"devices": []}, "empty"), ({"devices": ["cpu"]}, "JAX devices"),
                       ({"devices": dev}, "sequence"), ({"devices": [dev, dev]}, "twice"),
                       ({"client_chunk": 0}, "client_chunk must be a positive integer"),
                       ({"client_chunk": 1.5}, "client_chunk"), ({"client_chunk": True}, "client_chunk")):
        with pytest.raises(ValueError, match=match):
            fp.engine.Local(**bad)
    for n in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="num_nodes must be a positive integer"):
            fp.engine.Flower(num_nodes=n)
    for bad, match in (({"rate": 1.0}, r"Stragglers.rate must lie in \[0, 1\)"),
                       ({"rate": -0.1}, "Stragglers.rate"),
                       ({"rate": 0.2, "policy": "late"}, "Stragglers.policy must be one of 'truncate', 'discard'"),
                       ({"rate": 0.2, "min_fraction": 1.0}, "Stragglers.min_fraction")):
        with pytest.raises(ValueError, match=match):
            fp.Stragglers(**bad)
    with pytest.raises(TypeError):
        fp.Stragglers()                                             # the rate is required
    for bad, match in (({"dropout_rate": 1.0}, r"dropout_rate must lie in \[0, 1\)"),
                       ({"max_update_norm": 0.0}, "max_update_norm must be a positive"),
                       ({"stragglers": 1.0}, "Stragglers.rate")):
        with pytest.raises(ValueError, match=match):
            fp.Faults(**bad)
    with pytest.raises(TypeError, match="Faults.stragglers must be a fp.Stragglers"):
        fp.Faults(stragglers="truncate")
    # a number is short for Stragglers(rate=number); 0 means none
    assert fp.Faults(stragglers=0.3) == fp.Faults(stragglers=fp.Stragglers(0.3))
    assert fp.Faults(stragglers=0).stragglers is None and not fp.Faults().active
    f = fp.Faults(0.1, fp.Stragglers(0.2, "discard", 0.5), 3.0)
    assert (f.straggler_rate, f.straggler_policy, f.straggler_min_fraction, f.truncates) == (0.2, "discard", 0.5,
                                                                                            False)
    for bad, match in (({"dir": ""}, "Checkpoint.dir"), ({"dir": 3}, "Checkpoint.dir"),
                       ({"dir": "d", "keep": 0}, "Checkpoint.keep must be an integer >= 1")):
        with pytest.raises(ValueError, match=match):
            fp.Checkpoint(**bad)
    assert fp.Checkpoint(Path("a") / "b").dir == os.path.join("a", "b")
    for obj, field in ((fp.engine.Local(), "client_chunk"), (fp.engine.Flower(), "num_nodes"), (f, "dropout_rate"),
                       (fp.Stragglers(0.1), "rate"), (fp.Checkpoint("d"), "keep")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, field, 1)
        hash(obj)


def test_run_refuses_options_of_the_wrong_kind():
    for kw, err, match in (({"engine": "gpu"}, ValueError, "engine must be fp.engine.Local"),
                           ({"engine": 3}, TypeError, "engine must be fp.engine.Local"),
                           ({"faults": {"dropout_rate": 0.1}}, TypeError, "faults must be a fp.Faults"),
                           ({"checkpoint": "ckpt"}, TypeError, r"checkpoint must be a fp.Checkpoint"),
                           ({"privacy": 1.0}, TypeError, "privacy must be"),
                           ({"engine": fp.engine.Flower(), "checkpoint": fp.Checkpoint("d")}, ValueError,
                            "Flower.. does not support checkpoints"),
                           ({"num_clients": 3}, TypeError, "unexpected keyword argument 'num_clients'")):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            with pytest.raises(err, match=match):
                fp.run(ALGO, MODEL, FED, rounds=1, progress=False, **kw)


# ---------------------------------------------------------------------------------------------------
# the deprecated keywords: the same run, bit for bit, with one FutureWarning naming the new form


def test_new_options_equal_the_deprecated_keywords_bit_for_bit(tmp_path):
    common = dict(rounds=4, seed=5, clients_per_round=4, progress=False)
    new = dict(engine=fp.engine.Local(client_chunk=2),
               faults=fp.Faults(dropout_rate=0.2, stragglers=fp.Stragglers(0.4, min_fraction=0.25),
                                max_update_norm=5.0),
               checkpoint=fp.Checkpoint(str(tmp_path / "new")))
    old = dict(engine="local", client_chunk=2, dropout_rate=0.2, straggler_rate=0.4, straggler_min_fraction=0.25,
               max_update_norm=5.0, checkpoint_dir=str(tmp_path / "old"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)               # the new form warns about nothing
        warnings.simplefilter("ignore", RuntimeWarning)
        a = fp.run(ALGO, MODEL, FED, **common, **new)
    with pytest.warns(FutureWarning) as rec:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            b = fp.run(ALGO, MODEL, FED, **common, **old)
    assert len(rec) == 1
    msg = str(rec[0].message)
    for name in ("engine='local'", "client_chunk", "dropout_rate", "straggler_rate", "straggler_min_fraction",
                 "max_update_norm", "checkpoint_dir", "next release"):
        assert name in msg, name
    assert ("engine=fp.engine.Local(client_chunk=2), faults=fp.Faults(dropout_rate=0.2, max_update_norm=5.0, "
            "stragglers=fp.Stragglers(rate=0.4, min_fraction=0.25))") in msg
    assert rec[0].filename == __file__                              # points at the caller
    for x, y in zip(leaves(a), leaves(b)):
        np.testing.assert_array_equal(x, y)
    assert strip(a) == strip(b) and a.info["client_chunk"] == b.info["client_chunk"] == 2
    assert any(h["stragglers"] for h in a.history) and any(h["dropped"] for h in a.history)
    assert any(h["excluded"] for h in a.history)                    # the norm bound acted
    # the two forms write the same checkpoint fingerprints: a run in one form resumes the other's
    assert sorted(os.listdir(tmp_path / "new")) == sorted(os.listdir(tmp_path / "old"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        c = fp.run(ALGO, MODEL, FED, **{**common, "rounds": 5}, **{**new, "checkpoint": fp.Checkpoint(
            str(tmp_path / "old"), keep=1)})
    assert strip(c)[:4] == strip(b) and len(c.history) == 5
    assert len([p for p in os.listdir(tmp_path / "old") if p.endswith(".json")]) == 1     # keep=1


def test_flower_engine_gets_the_same_call_in_both_forms(monkeypatch):
    from fedprob.engine import flower

    calls = []
    monkeypatch.setattr(flower, "run", lambda *a, **kw: calls.append((a, kw)))
    faults = fp.Faults(dropout_rate=0.3, stragglers=fp.Stragglers(0.2, policy="discard"), max_update_norm=2.0)
    fp.run(ALGO, MODEL, FED, rounds=2, seed=4, clients_per_round=3, engine=fp.engine.Flower(num_nodes=2),
           faults=faults)
    with pytest.warns(FutureWarning, match=r"engine=fp.engine.Flower\(num_nodes=2\)"):
        fp.run(ALGO, MODEL, FED, rounds=2, seed=4, clients_per_round=3, engine="flower", num_nodes=2,
               dropout_rate=0.3, straggler_rate=0.2, straggler_policy="discard", max_update_norm=2.0)
    assert calls[0] == calls[1]
    assert calls[0][1]["num_nodes"] == 2 and calls[0][1]["faults"] == faults and calls[0][1]["rounds"] == 2


def test_deprecated_keywords_translate_to_the_objects_and_refuse_mixtures():
    def translate(engine=None, faults=None, checkpoint=None, **old):
        with pytest.warns(FutureWarning, match="deprecated"):
            return deprecated.run_options(engine, faults, checkpoint, old)

    assert translate(engine="flower", num_nodes=3) == (fp.engine.Flower(num_nodes=3), None, None)
    assert translate(engine="local") == (fp.engine.Local(), None, None)
    assert translate(devices=None, num_nodes=2) == (fp.engine.Local(), None, None)     # as before: unused there
    assert translate(straggler_policy="discard")[1] == fp.Faults(stragglers=fp.Stragglers(0.0, "discard"))
    assert translate(dropout_rate=0.0)[1] == fp.Faults()
    assert translate(checkpoint_dir=None) == (None, None, None)
    # the old names in the old messages
    for kw, match in (({"straggler_rate": 0.1, "straggler_policy": "late"}, "straggler_policy must be one of"),
                      ({"straggler_rate": 0.1, "straggler_min_fraction": 1.0}, "straggler_min_fraction must lie in"),
                      ({"dropout_rate": 1.0}, "dropout_rate must lie in"),
                      ({"engine": "flower", "client_chunk": 2}, "engine='flower' does not support client_chunk"),
                      ({"engine": "sharded"}, "engine must be"),
                      ({"engine": fp.engine.Local(), "client_chunk": 2}, "inside engine=Local"),
                      ({"faults": fp.Faults(), "dropout_rate": 0.1}, "inside faults=fp.Faults"),
                      ({"checkpoint": fp.Checkpoint("d"), "checkpoint_dir": "d"}, "not both")):
        engine, faults, checkpoint = (kw.pop(k, None) for k in ("engine", "faults", "checkpoint"))
        with pytest.raises(ValueError, match=match):
            deprecated.run_options(engine, faults, checkpoint, kw)
    with pytest.raises(TypeError, match="unexpected keyword argument 'straggler'"):
        deprecated.run_options(None, None, None, {"straggler": 0.1})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert deprecated.run_options(None, None, None, {}) == (None, None, None)   # nothing old: no warning


# ---------------------------------------------------------------------------------------------------
# the TOML configuration's tables

CONFIG = """
[data]
name = "digits"
[partition]
num_clients = 4
[model]
name = "softmax_regression"
[algorithm]
name = "FedAvg"
[run]
rounds = 2
"""


def test_config_tables_build_the_option_objects_and_the_old_key_warns():
    cfg = C.loads(CONFIG + """
[engine]
client_chunk = 2
devices = 1
[faults]
dropout_rate = 0.1
[stragglers]
rate = 0.2
policy = "discard"
[checkpoint]
dir = "ckpt"
keep = 3
""")
    kw = C.run_options(cfg)
    assert kw == {"rounds": 2, "engine": fp.engine.Local(devices=jax.devices()[:1], client_chunk=2),
                  "faults": fp.Faults(dropout_rate=0.1, stragglers=fp.Stragglers(0.2, "discard")),
                  "checkpoint": fp.Checkpoint("ckpt", keep=3)}
    assert C.run_options(C.loads(CONFIG + '[engine]\nname = "flower"\nnum_nodes = 2\n'))["engine"] == \
        fp.engine.Flower(num_nodes=2)
    assert C.run_options(C.loads(CONFIG)) == {"rounds": 2, "engine": fp.engine.Local()}
    with pytest.warns(FutureWarning, match=r"\[run\] client_chunk is deprecated.*\[engine\] client_chunk"):
        old = C.run_options(C.loads(CONFIG.replace("rounds = 2", "rounds = 2\nclient_chunk = 3")))
    assert old["engine"] == fp.engine.Local(client_chunk=3) and "client_chunk" not in old
    for extra, match in (('[engine]\nname = "flower"\nclient_chunk = 2\n', "unknown key 'client_chunk' in .engine."),
                         ('[engine]\nname = "gpu"\n', "unknown engine 'gpu'"),
                         ("[stragglers]\nrate_ = 0.1\n", "unknown key 'rate_' in .stragglers."),
                         ("[faults]\nstraggler_rate = 0.1\n", "unknown key 'straggler_rate' in .faults.")):
        with pytest.raises(ValueError, match=match):
            C.loads(CONFIG + extra)
    for extra, match in (("[stragglers]\npolicy = 'discard'\n", "needs rate"),
                         ("[engine]\ndevices = 0\n", "devices is how many"),
                         ("[faults]\ndropout_rate = 1.5\n", "dropout_rate must lie in")):
        with pytest.raises(ValueError, match=match):
            C.run_options(C.loads(CONFIG + extra))


# ---------------------------------------------------------------------------------------------------
# layers that only point down

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"fedprob": ROOT / "fedprob", "fedprob.models": ROOT / "models", "fedprob.inference": ROOT / "inference"}


def package_modules() -> dict:
    """module name -> (path, is a package __init__), for fedprob and its models / inference packages."""
    out = {}
    for pkg, root in PACKAGES.items():
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root).with_suffix("").parts
            if any(p.startswith(".") for p in rel):
                continue
            is_init = rel[-1] == "__init__"
            name = ".".join((pkg,) + (rel[:-1] if is_init else rel))
            out[name] = (path, is_init)
    return out


def import_graph(modules: dict) -> dict:
    """module -> the package modules it imports (anywhere in the file, function bodies included).

    ``from a import b`` counts as importing the module ``a.b`` when there is one, else ``a``."""
    graph = {}
    for name, (path, is_init) in modules.items():
        base = name if is_init else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = base.split(".")
                    target = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    target = node.module
                for a in node.names:
                    if f"{target}.{a.name}" in modules:
                        deps.add(f"{target}.{a.name}")
                    elif target in modules:
                        deps.add(target)
        deps.discard(name)
        graph[name] = deps
    return graph


def find_cycle(graph: dict):
    """One import circle as a list of modules (first repeated at the end), or None."""
    state, stack = {}, []

    def visit(v):
        state[v] = 1
        stack.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state:
                found = visit(w)
                if found:
                    return found
        state[v] = 2
        stack.pop()
        return None

    for v in sorted(graph):
        if v not in state:
            found = visit(v)
            if found:
                return found
    return None


def test_the_package_imports_form_no_circle():
    modules = package_modules()
    assert {"fedprob.run", "fedprob.algorithms.one_round", "fedprob.inference", "fedprob.models",
            "fedprob.engine.flower", "fedprob.cli", "fedprob.demo"} <= set(modules)
    graph = import_graph(modules)
    assert "fedprob.potential" in graph["fedprob.algorithms.client_runs"]    # the walker sees lazy imports
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)
    # the walker finds a circle where there is one
    assert find_cycle({**graph, "fedprob.potential": graph["fedprob.potential"] | {"fedprob.run"}}) is not None
    assert "fedprob.cli" not in graph["fedprob.demo"] and "fedprob.run" not in graph["fedprob.algorithms.pvi"]


def test_run_body_is_short():
    """fp.run reads as validate, build, loop, collect."""
    src = inspect.getsource(fp.run)
    fn = ast.parse(src).body[0]
    body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) else fn.body        # without the docstring
    lines = body[-1].end_lineno - body[0].lineno + 1
    assert lines <= 80, f"fp.run's body has {lines} lines"


def test_the_final_posterior_is_computed_once():
    """With eval_data, the last round's evaluated posterior is the result's: its Monte Carlo check
    runs (and warns) once per run, and the result's metrics are those of ``result.posterior``."""
    from fedprob.metrics import evaluate

    # sample moments over a short unpreconditioned chain: a Monte Carlo error large enough to warn
    algo = fp.algorithms.ConsensusMC(client=fp.inference.SGLD(num_burnin=50, num_samples=20, thinning=1,
                                                               target_ess=0, precondition=None), moments="sample")
    X, y = FED.pooled()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = fp.run(algo, MODEL, FED, seed=0, eval_data=(X, y), progress=False)
    mc = [w for w in caught if "Monte Carlo error of the combined mean" in str(w.message)]
    assert len(mc) == 1, [str(w.message)[:80] for w in mc]
    again = evaluate(r.posterior, X, y)
    assert r.history[-1]["rmse"] == pytest.approx(again["rmse"], rel=1e-6)
