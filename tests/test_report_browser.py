"""The HTML report: its parts, and the page rendered in headless Chromium (images load, no overflow at
1,280 px, no script error; screenshots saved beside the report). The posterior marginals beside a reference
are checked on a conjugate linear regression against its exact Gaussian posterior."""
from __future__ import annotations

import re

import numpy as np
import pytest
from browser_check import check, find_browser
from conftest import linreg_exact_posterior, linreg_model

import fedprob as fp
from fedprob.report import html_report, reference_rows
from fedprob.rundir import federation_info, load_reference, load_runs, save_reference, save_run

BROWSER = find_browser()
needs_browser = pytest.mark.skipif(BROWSER is None, reason="no headless Chromium on PATH (the CI script installs "
                                   "chromium-headless-shell with apt where it can: apt-get install -y "
                                   "chromium-headless-shell)")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """A report of three quick runs on the digits, saved in the order PVI, FedAvg, OneShotAverage."""
    root = tmp_path_factory.mktemp("runs")
    ds = fp.data.load_digits()
    fed = fp.data.partition(*ds.train, num_clients=5, scheme="dirichlet", alpha=0.5, seed=0)
    model = fp.models.softmax_regression(num_classes=10)
    info = federation_info(fed, "digits, 5 clients, Dirichlet(0.5) label split")
    for name, algo, rounds in (("PVI", fp.algorithms.PVI(), 3), ("FedAvg", fp.algorithms.FedAvg(), 3),
                               ("OneShotAverage", fp.algorithms.OneShotAverage(
                                   client=fp.inference.Laplace(hessian="diag_ggn")), 1)):
        result = fp.run(algo, model, fed, rounds=rounds, eval_data=ds.test, progress=False)
        save_run(root / name.lower(), result, name=name, federation=info, total_time=1.0)
    page = root / "report.html"
    html_report(load_runs(root), page, title="fedprob report: test")
    return page, fed


def test_report_has_header_contents_summary_legend_and_run_order(report):
    page, fed = report
    text = page.read_text()
    assert "digits, 5 clients, Dirichlet(0.5) label split" in text and "versions: python" in text
    assert "<nav><h2>Contents</h2>" in text and "href='#summary'" in text and "href='#federation'" in text
    summary = text[text.index("<section id='summary'>"):text.index("</section>")]
    header = re.findall(r"<th>(.*?)</th>", summary[:summary.index("</thead>")])
    assert header == ["method", "rounds", "accuracy", "nll", "ece", "total_time", "compile_time"]
    assert "<dl class='legend'>" in summary and "expected calibration error" in summary
    assert "client_kinetic_temperature" not in summary[:summary.index("<details>")]
    order = [text.index(f"<h2>{n}</h2>") for n in ("PVI", "FedAvg", "OneShotAverage")]
    assert order == sorted(order)                                   # the order the runs were made
    assert "FedAvg(" in text and "learning_rate=" in text            # the algorithm's configuration
    assert 'alt="client sizes and label histograms"' in text


def test_marginals_without_a_reference_say_how_to_give_one(report):
    text = report[0].read_text()
    section = text[text.index("<section id='marginals'>"):]
    section = section[:section.index("</section>")]
    assert "href='#marginals'" in text and "No reference posterior was given" in section
    assert 'alt="marginals of W"' in section and 'alt="marginals of b"' in section
    assert "Against the reference" not in section


SIGMA, PRIOR = 0.5, 1.0


@pytest.fixture(scope="module")
def reference_report(tmp_path_factory):
    """Three runs on a conjugate linear regression with correlated features (4 clients), the exact Gaussian
    posterior saved as the run directory's reference.npz, and the page ``fedprob report`` writes."""
    from fedprob import cli

    root = tmp_path_factory.mktemp("refruns")
    rng = np.random.default_rng(0)
    corr = np.array([[1.0, 0.8, 0.3], [0.8, 1.0, 0.5], [0.3, 0.5, 1.0]])
    X = (rng.normal(size=(240, 3)) @ np.linalg.cholesky(corr).T).astype(np.float32)
    y = (X @ np.array([1.0, -2.0, 0.5]) + SIGMA * rng.normal(size=240)).astype(np.float32)
    fed = fp.data.partition(X[:200], y[:200], num_clients=4, scheme="iid", seed=0)
    model = linreg_model(PRIOR, SIGMA)
    laplace = fp.inference.Laplace(hessian="full")
    for slug, name, algo, rounds in (
            ("ep-full", "EPMCMC(Laplace, full)", fp.algorithms.EPMCMC(client=laplace), 1),
            ("ep-diag", "EPMCMC(Laplace, diag)", fp.algorithms.EPMCMC(client=fp.inference.Laplace(hessian="diag_ggn"),
                                                                      family="diag"), 1),
            ("fedavg", "FedAvg", fp.algorithms.FedAvg(), 3)):
        result = fp.run(algo, model, fed, rounds=rounds, eval_data=(X[200:], y[200:]), progress=False)
        save_run(root / slug, result, name=name, num_draws=4000,          # sds within about 1.6% of the truth
                 federation=federation_info(fed, "linear regression, 4 clients"), total_time=1.0)
    Xs = [fed.client(k)[0] for k in range(4)]
    mean, cov = linreg_exact_posterior(Xs, [fed.client(k)[1] for k in range(4)], SIGMA, PRIOR)
    save_reference(root, {"w": rng.multivariate_normal(mean, cov, size=4000)}, name="exact Gaussian")
    assert cli.main(["report", str(root)]) == 0
    return root / "report.html", root, mean, cov


def test_marginals_beside_the_reference_match_the_exact_spread(reference_report, capsys):
    page, root, mean, cov = reference_report
    name, ref = load_reference(root)
    assert name == "exact Gaussian" and ref["w"].shape == (4000, 3)
    rows = {r["method"]: r for r in reference_rows(load_runs(root), ref)}
    full, diag, fedavg = rows["EPMCMC(Laplace, full)"], rows["EPMCMC(Laplace, diag)"], rows["FedAvg"]
    # full-covariance EP on a conjugate model is exact: means within MC error, sds those of the reference
    assert full["coords"] == 3 and full["mean_err_max"] < 0.1
    assert 0.94 < full["sd_ratio_min"] and full["sd_ratio_max"] < 1.06
    # the diagonal product keeps the diagonal of the precision: sd 1/sqrt(P_jj), below the exact sqrt(cov_jj)
    expected = np.sqrt(1.0 / np.diag(np.linalg.inv(cov))) / np.sqrt(np.diag(cov))
    assert expected.max() < 0.9
    assert abs(diag["sd_ratio_median"] - np.median(expected)) < 0.06 * np.median(expected)
    assert abs(diag["sd_ratio_min"] - expected.min()) < 0.06 * expected.min()
    assert abs(diag["sd_ratio_max"] - expected.max()) < 0.06 * expected.max()
    # a point estimate has no spread to compare
    assert fedavg["kind"] == "point estimate" and fedavg["sd_ratio_median"] == ""
    text = page.read_text()
    section = text[text.index("<section id='marginals'>"):]
    section = section[:section.index("</section>")]
    assert "Beside the reference: exact Gaussian (4000 draws" in section
    assert 'alt="marginals of w"' in section and "Against the reference" in section
    assert "standardised" in section or "reference sd" in section           # the table's legend


def test_report_cli_prints_the_comparison(tmp_path, reference_report, capsys):
    from fedprob import cli

    page, root, _, _ = reference_report
    assert cli.main(["report", str(root), "--out", str(tmp_path / "r.html"),
                     "--reference", str(root / "reference.npz")]) == 0
    out = capsys.readouterr().out
    assert "against the reference (exact Gaussian):" in out and "sd_ratio_median" in out
    with pytest.raises(FileNotFoundError, match="no reference file"):
        load_reference(tmp_path / "missing.npz")


def test_reference_forms_are_checked():
    from fedprob.rundir import reference_draws

    with pytest.raises(ValueError, match="at least 2 draws"):
        reference_draws({"w": np.zeros((1, 3))})
    with pytest.raises(ValueError, match="non-finite"):
        reference_draws({"w": np.array([[0.0], [np.nan]])})
    with pytest.raises(TypeError, match="a reference is a dict"):
        reference_draws(3.0)


def test_learning_curve_is_a_bar_chart_for_single_points():
    from fedprob import plots

    fig = plots.learning_curves({"a": [{"round": 1, "accuracy": 0.5}], "b": [{"round": 1, "accuracy": 0.7}]})
    assert len(fig.axes[0].patches) == 2 and not fig.axes[0].lines
    fig = plots.learning_curves({"a": [{"round": 1, "accuracy": 0.5}, {"round": 2}, {"round": 3, "accuracy": 0.6}]})
    assert len(fig.axes[0].lines) == 1 and list(fig.axes[0].lines[0].get_xdata()) == [1, 3]


def test_method_marginals_panels_follow_the_site_shape():
    from fedprob import plots

    rng = np.random.default_rng(0)
    fig = plots.method_marginals({"draws": rng.normal(size=(300, 3, 2)), "point": np.zeros((1, 3, 2))}, "W",
                                 reference=rng.normal(size=(500, 3, 2)), max_coords=4)
    axes = fig.axes
    assert [ax.get_title() for ax in axes] == ["W[0,0]", "W[0,1]", "W[1,0]", "W[1,1]"]
    assert all(len(ax.lines) == 2 and len(ax.collections) == 1 for ax in axes)   # density, point line, shade
    assert list(axes[0].lines[1].get_xdata()) == [0.0, 0.0]                       # the point estimate


def _browser_checks(page):
    result = check(page, width=1280, screenshot=page.with_name("report-1280.png"))
    assert result["images"] >= 5 and result["broken"] == [], result
    assert result["scroll_width"] <= 1280 and result["overflow"] == [], result
    assert result["errors"] == [], result
    assert page.with_name("report-1280.png").stat().st_size > 10_000
    return result


@needs_browser
def test_report_renders_in_headless_chromium(report):
    _browser_checks(report[0])


@needs_browser
def test_report_with_reference_marginals_renders_in_headless_chromium(reference_report):
    _browser_checks(reference_report[0])


@needs_browser
@pytest.mark.slow
def test_demo_report_renders_in_headless_chromium(tmp_path, capsys):
    from fedprob import cli

    assert cli.main(["demo", "--quick", "--quiet", "--out", str(tmp_path / "demo")]) == 0
    assert cli.main(["report", str(tmp_path / "demo")]) == 0
    out = capsys.readouterr().out
    assert "report:" in out and len(out.splitlines()) < 60           # a short summary, not every table
    _browser_checks(tmp_path / "demo" / "report.html")
