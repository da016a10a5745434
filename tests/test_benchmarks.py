"""CI-sized runs of the benchmark scripts in benchmarks/ (their ``--quick`` mode).

Each test imports one script by path and calls its ``main(["--quick"])``
(which prints its tables and writes no files), then checks the numbers it
returns are usable: every timing ratio positive and finite, and the vmapped
clients not slower than 1.5 times the Python loop over the same clients.
One test function per script.
"""
from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_script(name: str):
    """benchmarks/<name>.py as a module (benchmarks/ is not a package).

    The module is registered in ``sys.modules`` before it runs, as a normal
    import would (dataclasses defined in the script look their module up there).
    """
    path = BENCHMARKS / f"{name}.py"
    mod_name = f"benchmark_{name}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(mod_name, None)
        raise
    return module


def positive_finite(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


def test_engine_benchmark_quick(tmp_path):
    engine = load_script("engine")
    rows, step = engine.main(["--quick", "--out", str(tmp_path)])
    assert [r["clients"] for r in rows] == [10, 100]
    for r in rows:
        for k in ("vmapped_round_ms", "python_loop_round_ms", "loop_over_vmapped"):
            assert positive_finite(r[k]), (k, r)
    # at 100 clients the vmapped round is not slower than 1.5x the loop (best of the interleaved repeats:
    # medians under a busy shared machine swung to 0.66); the 10-client round lasts ~2 ms, where
    # scheduling noise decides the ratio (0.58 seen under two parallel suites)
    # (best of 3, a clean-clone run read 0.61 with the median near 1; best of 9 locally 0.70-1.05, medians
    # 1.0-1.13): either statistic at or above 1/1.5 shows the vmapped round is not 1.5x slower
    big = rows[-1]
    assert max(big["loop_over_vmapped_best"], big["loop_over_vmapped"]) > 1 / 1.5, big
    assert [r["model"].split()[0] for r in step] == ["softmax", "mlp"]
    for r in step:
        for k in ("client_step_us", "bare_gradient_us", "step_over_gradient"):
            assert positive_finite(r[k]), (k, r)
    assert not any(tmp_path.iterdir())     # --quick writes no result files


def test_inference_benchmark_steps_and_clients_quick(tmp_path):
    """The default run's version of test_inference_benchmark_quick (slow: its ESS sections, 45 s in all): the
    step-over-gradient and clients-over-loop sections at CI size, every ratio the tables print recomputed
    from its parts. The ESS claims it leaves to the slow test are also oracles elsewhere: a preconditioned
    chain mixes where the plain one does not in tests/test_precondition.py, NUTS against exact posteriors in
    tests/test_nuts.py."""
    bench = load_script("inference")
    out = bench.main(["--quick", "--sections", "steps,clients", "--out", str(tmp_path)])
    assert {r["sampler"] for r in out["steps"]} >= {"SGLD", "IASG"}
    for r in out["steps"]:
        for k in ("step_us", "bare_gradient_us", "step_over_gradient", "steps_per_s", "bandwidth_fraction"):
            assert positive_finite(r[k]), (k, r)
        assert math.isclose(r["steps_per_s"], 1e6 / r["step_us"])
        assert math.isclose(r["step_over_gradient"], r["step_us"] / r["bare_gradient_us"], rel_tol=1e-2)
    (row,) = out["clients"]
    assert row["clients"] == 10
    assert math.isclose(row["client_steps_per_s"], 1e3 * row["clients"] * row["steps"] / row["vmapped_ms"])
    assert row["loop_over_vmapped_best"] > 1 / 1.5, row
    assert out["ess"] == [] and out["ess_per_gradient"] == []
    assert not any(tmp_path.iterdir())


@pytest.mark.slow       # 45 s; its default-run version is test_inference_benchmark_steps_and_clients_quick
def test_inference_benchmark_quick(tmp_path):
    bench = load_script("inference")
    out = bench.main(["--quick", "--out", str(tmp_path)])
    steps = out["steps"]
    assert {r["sampler"] for r in steps} >= {"SGLD", "IASG"}
    for r in steps:
        for k in ("step_us", "bare_gradient_us", "step_over_gradient", "gradient_plus_noise_us",
                  "step_over_gradient_plus_noise", "steps_per_s", "bandwidth_fraction"):
            assert positive_finite(r[k]), (k, r)
        assert math.isclose(r["steps_per_s"], 1e6 / r["step_us"])
        assert math.isclose(r["bandwidth_fraction"],
                            r["floor_bytes_per_step"] * r["steps_per_s"] / (out["meta"]["copy_GB_per_s"] * 1e9))
    assert [r["clients"] for r in out["clients"]] == [10]
    for r in out["clients"]:
        for k in ("vmapped_ms", "python_loop_ms", "loop_over_vmapped", "loop_over_vmapped_best",
                  "client_steps_per_s", "loop_client_steps_per_s", "bandwidth_fraction"):
            assert positive_finite(r[k]), (k, r)
        assert math.isclose(r["client_steps_per_s"], 1e3 * r["clients"] * r["steps"] / r["vmapped_ms"])
        # The best-of-repeats ratio: medians on a shared 2-core machine swing by 2x.
        assert r["loop_over_vmapped_best"] > 1 / 1.5, r
    ess = {r["sampler"].split(" ")[0]: r for r in out["ess"]}
    assert set(ess) == {"NUTS", "SGHMC", "CyclicalSGHMC"}
    for r in out["ess"]:
        for k in ("wall_s", "min_ess", "median_ess", "min_ess_per_s", "median_ess_per_s"):
            assert positive_finite(r[k]), (k, r)
        # bulk ESS may exceed the draw count (antithetic NUTS draws), not by several times
        assert r["min_ess"] <= r["median_ess"] <= 4 * r["chains"] * r["draws_per_chain"]
    # NUTS on a logistic regression mixes: bulk ESS well above a tenth of its draws
    nuts = ess["NUTS"]
    assert nuts["min_ess"] > 0.1 * nuts["chains"] * nuts["draws_per_chain"]
    # minibatches on an ill-conditioned client: the default (Laplace-preconditioned, control variate) chain
    # mixes, the plain one (its step held down by the gradient-noise cap) has not left its start
    per = {r["sampler"]: r for r in out["ess_per_gradient"]}
    default = per.pop("SGHMC preconditioned + CV (default)")
    assert set(per) == {"SGHMC"}
    assert default["ess_per_1000_gradients"] > 10 * per["SGHMC"]["ess_per_1000_gradients"], (default, per)
    assert default["max_abs_mean_err_sd"] < 0.3 < per["SGHMC"]["max_abs_mean_err_sd"], (default, per)
    assert out["meta"]["cpu_count"] >= 1 and out["meta"]["backend"]
    assert not any(tmp_path.iterdir())


def test_one_round_defaults_benchmark_one_row():
    """The default run's version of test_one_round_defaults_benchmark_quick (slow, 26 s): EPMCMC over
    SVI(guide="full") on the 3 shifted clients of 4,000 rows, within the bound of the exact posterior (the
    SGHMC row's product at its defaults is also tests/test_stein_products.py's default-run oracle)."""
    rows = load_script("one_round_defaults").main(["--quick", "--clients", "SVI(full)"])
    assert [(r["aggregator"], r["client"]) for r in rows] == [("EPMCMC", "SVI(full)")]
    assert rows[0]["meets_bound"] and not rows[0]["warnings"], rows[0]


@pytest.mark.slow
def test_one_round_defaults_benchmark_quick():
    """The CI size of benchmarks/one_round_defaults.py: EPMCMC over SGHMC() and SVI(guide="full") on 3
    shifted clients of 4,000 rows, within the issue's bound of the exact posterior."""
    rows = load_script("one_round_defaults").main(["--quick"])
    assert [(r["aggregator"], r["client"]) for r in rows] == [("EPMCMC", "SGHMC"), ("EPMCMC", "SVI(full)")]
    for r in rows:
        assert r["meets_bound"], r
        assert not r["warnings"], r


@pytest.mark.slow     # about 6 minutes: every sampler and both products on the three federations
def test_one_round_defaults_benchmark_full(tmp_path):
    rows = load_script("one_round_defaults").main(["--seeds", "1", "--problems", "shifted3,iid12,corr12",
                                                   "--out", str(tmp_path)])
    assert len(rows) == 24
    failed = [r for r in rows if not r.get("meets_bound")]
    assert not failed, failed


@pytest.mark.slow     # 83 s cold; the aggregates themselves are tested in test_one_round.py
def test_one_round_benchmark_quick(data_root):
    """benchmarks/one_round.py --quick: every one-round aggregate from one set of cSGHMC client runs
    plus FedAvg, on 2,000 MNIST rows (label sort h=0.9) and real estate (feature-sorted clients)."""
    bench = load_script("one_round")
    results = BENCHMARKS / "results" / "one_round.json"
    before = results.stat().st_mtime_ns if results.exists() else None
    out = bench.main(["--quick", "--data", str(data_root)])
    after = results.stat().st_mtime_ns if results.exists() else None
    assert before == after                  # --quick without --out writes nothing
    methods = {"PredictiveBayes", "PredictiveBayes (β-pooled)", "EPMCMC (diag)", "OneShotAverage",
               "Ensemble", "FedAvg (5 rounds)"}
    one_round = {"PredictiveBayes", "PredictiveBayes (β-pooled)", "EPMCMC (diag)", "OneShotAverage",
                 "Ensemble"}
    cls = {r["method"]: r for r in out["classification"]}
    reg = {r["method"]: r for r in out["regression"]}
    assert set(cls) == methods and set(reg) == methods | {"Least squares (pooled, reference)"}
    for rows in (cls, reg):
        # the one-round aggregates share ONE client run: same training time, same client steps
        assert len({rows[m]["train_s"] for m in one_round}) == 1
        assert len({rows[m]["client_steps"] for m in one_round}) == 1
        for r in rows.values():
            assert r["excluded_clients"] == 0, r          # no client diverged
            assert math.isfinite(r["nll"]), r
        assert 0.0 <= rows["PredictiveBayes (β-pooled)"]["beta"] <= 1.0
    for r in cls.values():
        assert r["dataset"] == "mnist" and r["heterogeneity"] == 0.9 and 0.0 <= r["accuracy"] <= 1.0
    # chance is 0.1: the mixture of client predictives and FedAvg learn something in 5 epochs
    assert cls["Ensemble"]["accuracy"] > 0.3 and cls["FedAvg (5 rounds)"]["accuracy"] > 0.3
    for r in reg.values():
        assert r["dataset"] == "real_estate" and r["split"] == "feature_sort"
        # standardized target (test variance 1.0, so the constant predictor scores ~1.0): no method
        # diverges
        assert 0.0 < r["mse"] < 1.5 and 0.0 <= r["coverage_95"] <= 1.0, r
    # the paper's numbers as typed from its Tables 1-2
    assert bench.PAPER["table1_accuracy_percent"]["PredictiveBayes"]["mnist"] == (97.28, 0.19)
    assert bench.PAPER["table1_accuracy_percent"]["EP MCMC"]["fashion_mnist"] == (83.30, 1.53)
    assert bench.PAPER["table2_mse"]["PredictiveBayes"]["bike_sharing"] == (0.0587, 0.0120)
    assert bench.PAPER["table2_mse"]["FedAvg (5 rounds)"]["air_quality"] == (1.070, 0.022)


def test_overhead_benchmark_quick(tmp_path):
    """benchmarks/overhead.py --quick: fp.run beside its client phase and the gradient + noise floor."""
    bench = load_script("overhead")
    out = bench.main(["--quick", "--out", str(tmp_path)])
    row = out["row"]
    for k in ("run_over_floor", "run_over_client_phase"):
        assert positive_finite(row[k]), (k, row)
    # the run contains its client phase, which is at least the steps' floor up to timing noise
    assert row["run_s"]["best"] >= row["client_phase_s"]["best"]
    assert row["accuracy"] > 0.5
    assert (tmp_path / "overhead.json").exists()


@pytest.mark.processes   # fresh processes that time their own first compile: on every CPU, as a user's would
def test_first_result_quick():
    """A small model's first fp.run, in a fresh process, costs at most twice NUTS on the pooled rows."""
    rows = load_script("first_result").main(["--quick"])
    assert [r["run"].split(",")[0] for r in rows] == ["NUTS (pooled rows)", "fp.run FedAvg"]
    for r in rows:
        assert positive_finite(float(r["cold_s"])) and positive_finite(float(r["warm_s"]))
    assert rows[1]["cold / NUTS pooled"] <= 2.0 and rows[1]["warm_s"] < 1.0


@pytest.mark.slow     # 40 s cold; EP's oracles are in test_ep.py
def test_ep_benchmark_quick():
    """benchmarks/ep.py --quick: 8 normal-normal clients, 6 EP rounds; an EP round costs at most twice an
    EPMCMC round with the same NUTS settings (measured 0.75), EP's Stein moments are exact there from
    the first round, and the sample moments are within Monte Carlo error."""
    out = load_script("ep").main(["--quick"])
    rows = {r["method"]: r for r in out["rows"]}
    assert set(rows) == {"EP", "EP(moments='sample')"}
    for r in rows.values():
        for k in ("nuts_pooled_s", "epmcmc_round_s", "round_s", "round_over_epmcmc_round"):
            assert positive_finite(r[k]), (k, r)
        assert r["round_over_epmcmc_round"] <= 2.0, r
        assert r["default_rounds"] == 35 and r["rounds"] == 6
    ep = rows["EP"]
    assert ep["rounds_to_converge"] == 1
    assert abs(ep["global_mean_err_sd"]) < 1e-3 and abs(ep["global_sd_ratio"] - 1) < 1e-3
    sample = rows["EP(moments='sample')"]
    assert abs(sample["global_mean_err_sd"]) < 0.3 and abs(sample["global_sd_ratio"] - 1) < 0.15


@pytest.mark.slow     # 18 s cold; the search's stop is an oracle in the default run: tests/test_laplace.py::
#                       test_full_batch_search_stops_when_the_loss_stalls_at_the_fixed_length_answer
def test_map_search_benchmark_quick():
    """benchmarks/map_search.py --quick: BayesADMM with Laplace clients, the search stopped when its loss
    stalls against all 200 L-BFGS steps (8 rounds): the same posterior, several times faster."""
    bench = load_script("map_search")
    (row,) = bench.main(["--quick"])
    assert row["rounds"] == 8 and row["mean_diff_in_sd"] < 1e-6, row
    assert positive_finite(row["fixed_over_stall"]) and row["fixed_over_stall"] > 2, row


@pytest.mark.slow     # 12 s cold; the curvatures are oracles in the default run: tests/test_laplace.py::
#                       test_diag_ggn_on_a_network_exact_by_cotangents_and_unbiased_by_sampled_labels
def test_network_curvature_benchmark_quick():
    """benchmarks/network_curvature.py --quick: the diagonal GGN of an MLP by per-row Jacobians, by one
    reverse pass per row and class (the same numbers), and as a Monte Carlo Fisher; FedLap-Cov with
    sampled labels beside FedAvg."""
    bench = load_script("network_curvature")
    out = bench.main(["--quick"])
    one = out["one_client"]
    assert one["exact_vs_jacobians_max_rel"] < 1e-4, one
    assert 0 < one["fisher_rel_err_median"] < 0.5, one
    rows = {(r["method"], r["engine"]): r for r in out["federation"]["rows"]}
    assert set(m for m, _ in rows) == {"FedAvg", "FedLapCov(fisher_samples=1)"}
    assert all(positive_finite(r["round_s"]) and 0 <= r["accuracy_at_mean"] <= 1 for r in rows.values())


def test_one_round_clients_benchmark_quick():
    """benchmarks/one_round_clients.py --quick: PredictiveBayes(CyclicalSGHMC) over 10 digits clients, the
    client phase beside the vmapped gradient + noise floor of the same steps, the evaluation beside the
    predictive's flops."""
    bench = load_script("one_round_clients")
    (row,) = bench.main(["--quick"])["rows"]
    assert row["setting"] == "no stretch" and row["stretch"] == 1 and row["steps"] == 300, row
    for k in ("run_s", "client_phase_s", "floor_s", "phase_over_floor", "evaluate_s", "predictive_floor_s"):
        assert positive_finite(row[k]), (k, row)
    assert row["phase_over_floor"] < 10, row        # the chains cost about their gradient + noise steps
    assert row["accuracy"] > 0.6, row


def test_fedpa_writers_federation_and_rounds_to_target(data_root):
    """benchmarks/fedpa_writers.py's federation (MNIST rows over 40 writers with label, size and style skew)
    and its rounds-to-target column; the runs themselves are test_fedpa_writers_benchmark_quick (slow)."""
    bench = load_script("fedpa_writers")
    fed, (Xt, yt) = bench.writers(data_root, 40, seed=0, test_rows=100)
    assert fed.num_clients == 40 and Xt.shape == (100, 784) and 0.0 <= Xt.min() and Xt.max() <= 1.0
    assert bench.first_round([0.5] * 9 + [1.0] * 11, 0.72) == 14     # the window of rounds 5-14
    assert bench.first_round([math.nan, 0.5, math.nan, 1.0] * 5, 0.74, window=4) == 4   # unevaluated rounds left out
    assert bench.first_round([0.5] * 20, 0.75) is None


@pytest.mark.slow     # 22 s: FedPA-ME's client phases on 784-dimensional MNIST rows
def test_fedpa_writers_benchmark_quick(data_root):
    """benchmarks/fedpa_writers.py --quick: FedAvg-ME and FedPA-ME with the same client steps and server
    optimiser, 4 rounds of 4 writers: one accuracy per round. Its federation and rounds-to-target column
    are test_fedpa_writers_federation_and_rounds_to_target in the default run; FedPA's deltas against
    their exact values are in tests/test_fedpa.py."""
    bench = load_script("fedpa_writers")
    rows = bench.main(["--quick"])
    assert [r["method"] for r in rows] == ["FedAvg-ME", "FedPA-ME"]
    for r in rows:
        assert len(r["accuracy"]) == 4 and all(0.0 <= a <= 1.0 for a in r["accuracy"]), r


def test_network_defaults_paper_window():
    """benchmarks/network_defaults.py --fmnist reads each stop R also as the BayesADMM paper does: the
    readings after rounds R-2..R averaged, then averaged over the splits that have all three (pure
    bookkeeping on recorded rows; the runs themselves take half an hour)."""
    nd = load_script("network_defaults")
    rows = [{"algorithm": "BayesADMM", "split": s, "rounds": r, "accuracy": acc, "nll": nll,
             "prediction": "mean", "round_seconds": 1.0}
            for s, readings in ((0, {8: (0.80, 0.6), 9: (0.81, 0.5), 10: (0.82, 0.4)}),
                                (1, {8: (0.70, 0.9), 9: (0.72, 0.8), 10: (0.74, 0.7)}),
                                (2, {9: (0.10, 9.0), 10: (0.90, 0.1)}))          # rounds 9-10 only: left out
            for r, (acc, nll) in readings.items()]
    acc, nll, splits = nd.window_means(rows, "BayesADMM", 10, 3)
    assert splits == 2
    assert acc == pytest.approx((81 + 72) / 2) and nll == pytest.approx((0.5 + 0.8) / 2)
    assert nd.window_means(rows, "BayesADMM", 10, 1) is None           # a window of one: the stop alone
    assert nd.window_means(rows, "FedAvg", 10, 3) is None
    md = nd.fmnist_markdown(rows, {"machine": "m", "jax": "j", "date": "d"}, [10], splits=[0, 1, 2])
    line = next(l for l in md.splitlines() if l.startswith("| BayesADMM | 76.50"))
    assert line == "| BayesADMM | 76.50 (0.650) [77.0] | 2 |"
    # the single-reading table keeps round 10 alone: (82 + 74 + 90) / 3
    assert "| BayesADMM | 3 | 82.0 (0.400)" in md
