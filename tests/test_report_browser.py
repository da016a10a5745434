"""The HTML report: its parts, and the page rendered in headless Chromium (images load, no overflow at
1,280 px, no script error; screenshots saved beside the report)."""
from __future__ import annotations

import re

import pytest
from browser_check import check, find_browser

import fedprob as fp
from fedprob.report import html_report
from fedprob.rundir import federation_info, load_runs, save_run

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


def test_learning_curve_is_a_bar_chart_for_single_points():
    from fedprob import plots

    fig = plots.learning_curves({"a": [{"round": 1, "accuracy": 0.5}], "b": [{"round": 1, "accuracy": 0.7}]})
    assert len(fig.axes[0].patches) == 2 and not fig.axes[0].lines
    fig = plots.learning_curves({"a": [{"round": 1, "accuracy": 0.5}, {"round": 2}, {"round": 3, "accuracy": 0.6}]})
    assert len(fig.axes[0].lines) == 1 and list(fig.axes[0].lines[0].get_xdata()) == [1, 3]


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
@pytest.mark.slow
def test_demo_report_renders_in_headless_chromium(tmp_path, capsys):
    from fedprob import cli

    assert cli.main(["demo", "--quick", "--quiet", "--out", str(tmp_path / "demo")]) == 0
    assert cli.main(["report", str(tmp_path / "demo")]) == 0
    out = capsys.readouterr().out
    assert "report:" in out and len(out.splitlines()) < 60           # a short summary, not every table
    _browser_checks(tmp_path / "demo" / "report.html")
