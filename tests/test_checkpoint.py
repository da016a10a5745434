"""Checkpoints: exact resume after an interruption, fallback past a damaged file, refusal of foreign ones."""
import json
import os

import jax
import numpy as np
import pytest

import fedprob as fp
from fedprob import checkpoint as ckpt
from conftest import linreg_model

MODEL = linreg_model(prior_scale=1.0, sigma=0.5)
# server Adam: the optimiser state must be saved and restored too
ALGO = fp.algorithms.FedAvg(local_steps=3, batch_size=4, learning_rate=0.1, server_optimizer="adam",
                            server_learning_rate=0.05)
OPTS = dict(seed=7, clients_per_round=3, faults=fp.Faults(dropout_rate=0.2), progress=False)


def make_fed(K=5, seed=0, d=2):
    rng = np.random.default_rng(seed)
    clients = []
    for k in range(K):
        X = rng.normal(size=(6 + 2 * k, d))
        clients.append((X, X @ np.linspace(1.0, -1.0, d) + 0.5 * rng.normal(size=len(X))))
    return fp.data.FederatedData.from_clients(clients)


def leaves(r):
    return [np.asarray(a) for a in jax.tree_util.tree_leaves((r.server_state, r.client_states))]


def strip_time(history):
    return [{k: v for k, v in h.items() if k != "time"} for h in history]


@pytest.fixture(scope="module")
def uninterrupted():
    return fp.run(ALGO, MODEL, make_fed(), rounds=6, **OPTS)


def assert_same_run(a, b):
    for x, y in zip(leaves(a), leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)
    assert strip_time(a.history) == strip_time(b.history)


def test_interrupted_run_resumes_bit_for_bit(tmp_path, monkeypatch, uninterrupted):
    fed, real_save = make_fed(), ckpt.save

    def crash_after_three(directory, round_, *args):
        if round_ == 4:
            raise KeyboardInterrupt("simulated crash during round 4")
        return real_save(directory, round_, *args)

    monkeypatch.setattr(ckpt, "save", crash_after_three)
    with pytest.raises(KeyboardInterrupt):
        fp.run(ALGO, MODEL, fed, rounds=6, checkpoint=fp.Checkpoint(str(tmp_path)), **OPTS)
    monkeypatch.setattr(ckpt, "save", real_save)
    assert sorted(os.listdir(tmp_path)) == ["round-000002.json", "round-000002.npz",
                                            "round-000003.json", "round-000003.npz"]
    # arrays and JSON only: loading needs no pickle
    with np.load(tmp_path / "round-000003.npz", allow_pickle=False) as z:
        assert all(z[k].dtype != object for k in z.files)
    meta = json.loads((tmp_path / "round-000003.json").read_text())
    assert meta["round"] == 3 and len(meta["history"]) == 3
    resumed = fp.run(ALGO, MODEL, fed, rounds=6, checkpoint=fp.Checkpoint(str(tmp_path)), **OPTS)
    assert_same_run(resumed, uninterrupted)
    assert uninterrupted.history[-1]["dropped"] or any(h["dropped"] for h in uninterrupted.history)
    # everything done already: a third call runs nothing and returns the same result
    again = fp.run(ALGO, MODEL, fed, rounds=6, checkpoint=fp.Checkpoint(str(tmp_path)), **OPTS)
    assert_same_run(again, uninterrupted)


def test_truncated_checkpoint_falls_back_to_previous_round(tmp_path, uninterrupted):
    fed = make_fed()
    fp.run(ALGO, MODEL, fed, rounds=3, checkpoint=fp.Checkpoint(str(tmp_path)), **OPTS)
    npz = tmp_path / "round-000003.npz"
    npz.write_bytes(npz.read_bytes()[: npz.stat().st_size // 2])
    with pytest.warns(RuntimeWarning, match="round-000003 is unreadable"):
        resumed = fp.run(ALGO, MODEL, fed, rounds=6, checkpoint=fp.Checkpoint(str(tmp_path)), **OPTS)
    assert_same_run(resumed, uninterrupted)


def test_foreign_checkpoint_is_refused_naming_what_differs(tmp_path):
    fed = make_fed()
    fp.run(ALGO, MODEL, fed, rounds=1, checkpoint=fp.Checkpoint(str(tmp_path)), **OPTS)
    d = str(tmp_path)
    other_algo = fp.algorithms.FedAvg(local_steps=3, batch_size=4, learning_rate=0.2,
                                      server_optimizer="adam", server_learning_rate=0.05)
    with pytest.raises(ValueError, match="different algorithm.*learning_rate=0.1"):
        fp.run(other_algo, MODEL, fed, rounds=2, checkpoint=fp.Checkpoint(d), **OPTS)
    with pytest.raises(ValueError, match="different data"):
        fp.run(ALGO, MODEL, make_fed(seed=1), rounds=2, checkpoint=fp.Checkpoint(d), **OPTS)
    with pytest.raises(ValueError, match="different model"):
        fp.run(ALGO, linreg_model(prior_scale=2.0), fed, rounds=2, checkpoint=fp.Checkpoint(d), **OPTS)
    with pytest.raises(ValueError, match="different settings.*seed"):
        fp.run(ALGO, MODEL, fed, rounds=2, checkpoint=fp.Checkpoint(d), **{**OPTS, "seed": 8})
