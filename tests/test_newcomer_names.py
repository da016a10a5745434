"""Every name a user types is checked where it is given, naming the closest valid one.

One test per kind of misspelling: algorithm, client backend and model names (Python
attribute and TOML ``name``), partition scheme and option, keyword arguments of
algorithms, backends, option objects, model builders and ``fp.run``, TOML tables
and keys, CLI subcommands and flags; the message always holds the valid spelling.
"""
from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest

import fedprob as fp
from fedprob import cli, config
from fedprob.names import CheckedKeywords, closest, hint


def _raises(exc, fn, *needles):
    with pytest.raises(exc) as info:
        fn()
    msg = str(info.value)
    for n in needles:
        assert n in msg, msg
    return msg


def test_closest_prefers_case_then_difflib_and_gives_up():
    assert closest("fedavg", ["FedAvg", "FedPA"]) == "FedAvg"
    assert closest("FedAvgg", ["FedAvg", "FedPA", "FedProx"]) == "FedAvg"
    assert closest("label-sort", ["label_sort", "iid"]) == "label_sort"
    assert closest("zzzz", ["FedAvg", "FedPA"]) is None
    assert hint("zzzz", ["b", "a"]) == "; (valid: a, b)"


@pytest.mark.parametrize("module, wrong, right", [
    (fp.algorithms, "Fedavg", "FedAvg"),
    (fp.algorithms, "EPMC", "EPMCMC"),
    (fp.inference, "Nuts", "NUTS"),
    (fp.inference, "CyclicSGHMC", "CyclicalSGHMC"),
    (fp.models, "softmax_regresion", "softmax_regression"),
])
def test_misspelled_attribute_names_closest(module, wrong, right):
    _raises(AttributeError, lambda: getattr(module, wrong), f"did you mean {right!r}")
    assert not hasattr(module, wrong)


@pytest.mark.parametrize("build, wrong, right", [
    (fp.algorithms.FedAvg, "learning_rat", "learning_rate"),
    (fp.algorithms.FedPA, "burnin_rounds", "burn_in_rounds"),
    (fp.algorithms.EPMCMC, "familly", "family"),
    (fp.algorithms.PVI, "dampin", "damping"),
    (fp.inference.NUTS, "num_chain", "num_chains"),
    (fp.inference.Laplace, "hesian", "hessian"),
    (fp.inference.CyclicalSGHMC, "batchsize", "batch_size"),
    (fp.Faults, "dropout", "dropout_rate"),
    (fp.Stragglers, "rat", "rate"),
    (fp.Checkpoint, "kep", "keep"),
    (fp.engine.Local, "client_chunks", "client_chunk"),
    (fp.engine.Flower, "num_node", "num_nodes"),
    (fp.models.softmax_regression, "num_clases", "num_classes"),
])
def test_misspelled_keyword_names_closest(build, wrong, right):
    if dataclasses.is_dataclass(build) and right not in {f.name for f in dataclasses.fields(build)}:
        pytest.skip(f"{build.__name__} has no field {right}")
    msg = _raises(TypeError, lambda: build(**{wrong: 1}), f"unexpected keyword argument {wrong!r}",
                  f"did you mean {right!r}", "(valid: ")
    assert msg.startswith(getattr(build, "__name__", "")), msg


def test_keyword_check_keeps_dataclass_behaviour():
    """Valid keywords, positional arguments, aliases, replace and pickling are unchanged."""
    assert issubclass(fp.algorithms.FedAvg, CheckedKeywords)
    assert issubclass(fp.inference.NUTS, CheckedKeywords)
    a = fp.algorithms.FedAvg(learning_rate=0.5)
    assert dataclasses.replace(a, batch_size=8).batch_size == 8
    assert pickle.loads(pickle.dumps(a)) == a
    nuts = fp.inference.NUTS(num_chains=2)
    assert pickle.loads(pickle.dumps(nuts)) == nuts
    with pytest.warns(FutureWarning):        # an alias field is a known keyword
        assert fp.algorithms.FedLap(rho=0.5) == fp.algorithms.FedLap(damping=0.5)


def test_misspelled_run_keyword():
    fed = fp.data.partition(np.zeros((8, 2)), np.arange(8) % 2, num_clients=2, seed=0)
    _raises(TypeError, lambda: fp.run(fp.algorithms.FedAvg(), fp.models.logistic_regression(), fed, round=2),
            "'round'", "did you mean 'rounds'")


def test_misspelled_partition_scheme_and_option():
    X, y = np.random.default_rng(0).normal(size=(40, 2)), np.arange(40) % 2
    _raises(ValueError, lambda: fp.data.partition(X, y, 2, "dirichlett"), "unknown scheme 'dirichlett'",
            "did you mean 'dirichlet'")
    _raises(ValueError, lambda: fp.data.partition(X, y, 2, "Label_Sort"), "did you mean 'label_sort'")
    _raises(TypeError, lambda: fp.data.partition(X, y, 2, "dirichlet", alpah=0.5), "did you mean 'alpha'")
    _raises(ValueError, lambda: fp.data.partition_indices(X, y, 2, "dirichlet", alpah=0.5),
            "unknown partition option 'alpah'", "did you mean 'alpha'")


def test_misspelled_choice_value():
    _raises(ValueError, lambda: fp.Stragglers(0.1, policy="truncat"), "did you mean 'truncate'")


BASE = {"model": {"name": "softmax_regression"}, "algorithm": {"name": "FedAvg"}}


@pytest.mark.parametrize("patch, needles", [
    ({"algorithm": {"name": "FedAvgg"}}, ("unknown algorithm 'FedAvgg' in [algorithm] name", "'FedAvg'")),
    ({"algorithm": {"name": "Algorithm"}}, ("unknown algorithm 'Algorithm'",)),
    ({"model": {"name": "softmax_regresion"}}, ("unknown model", "did you mean 'softmax_regression'")),
    ({"client": {"name": "Nuts"}}, ("unknown client backend 'Nuts' in [client] name", "did you mean 'NUTS'")),
    ({"partition": {"scheme": "dirichlett"}}, ("[partition] scheme", "did you mean 'dirichlet'")),
    ({"data": {"name": "digit"}}, ("unknown data set 'digit'", "did you mean 'digits'")),
    ({"engine": {"name": "flwr"}}, ("unknown engine 'flwr'", "did you mean 'flower'")),
    ({"modle": {"name": "x"}}, ("unknown table [modle]", "did you mean 'model'")),
    ({"run": {"rouds": 3}}, ("unknown key 'rouds' in [run]", "did you mean 'rounds'")),
    ({"algorithm": {"name": "FedAvg", "learning_rat": 1.0}}, ("did you mean 'learning_rate'",)),
    ({"client": {"name": "NUTS", "num_chain": 2}}, ("unknown key 'num_chain' in [client]", "'num_chains'")),
    ({"faults": {"dropout": 0.1}}, ("did you mean 'dropout_rate'",)),
])
def test_misspelled_toml_names(patch, needles):
    cfg = {**BASE, **patch}
    _raises(ValueError, lambda: config.validate(cfg), *needles)


@pytest.mark.parametrize("argv, needles", [
    (["demo", "--quik"], ("fedprob demo", "unrecognized argument '--quik'", "did you mean '--quick'")),
    (["dmeo"], ("unknown command 'dmeo'", "did you mean 'demo'")),
    (["run", "x.toml", "--sett", "a.b=1"], ("fedprob run", "did you mean '--set'")),
    (["flower", "spilt"], ("unknown command 'spilt'", "did you mean 'split'")),
    (["demo", "--rounds", "-3"], ("--rounds", "positive integer")),
])
def test_misspelled_cli_names(argv, needles, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    for n in needles:
        assert n in err, err


def test_cli_without_command_prints_help(capsys):
    assert cli.main([]) == 2
    out = capsys.readouterr()
    assert "demo" in out.out and "report" in out.out and "choose a command" in out.err
