"""The command line: demo, a TOML run, its run directory and HTML report; configuration errors."""
import json
import tomllib

import numpy as np
import pytest

from fedprob import cli

CONFIG = """
[data]
name = "digits"
[partition]
num_clients = 4
scheme = "iid"
seed = 1
[model]
name = "softmax_regression"
[algorithm]
name = "FedAvg"
local_epochs = 1
learning_rate = 1.0
[run]
rounds = 3
seed = 0
"""


def test_demo_methods_print_their_rows_and_learn(capsys):
    """The default run's version of test_demo_quick_prints_table (slow: every method, 54 s): the quick demo
    of two methods, one point estimate and one Bayesian, chosen by --methods; both learn digits well above
    chance. An unknown method name fails in one line, naming the demo's methods."""
    assert cli.main(["demo", "--quick", "--quiet", "--methods", "fedavg, PVI"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in out.splitlines()
            if line.startswith("| ") and not line.startswith("| method")}
    assert set(rows) == {"FedAvg", "PVI(Laplace, diag)"}
    header = next(line for line in out.splitlines() if line.startswith("| method"))
    header = [c.strip() for c in header.split("|")[2:-1]]
    for name in rows:
        assert float(rows[name][header.index("accuracy")]) > 0.5, name
    assert cli.main(["demo", "--quick", "--methods", "FedAvg,SGLD"]) == 2
    err = capsys.readouterr().err
    assert "unknown demo method(s) sgld" in err and "PredictiveBayes(cSGHMC)" in err


@pytest.mark.slow
def test_demo_quick_prints_table(capsys):
    """Slow (54 s: every demo method); its default-run version is test_demo_methods_print_their_rows_and_learn."""
    assert cli.main(["demo", "--quick", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "| method |" in out and "FedAvg" in out and "PredictiveBayes" in out
    # every method has its row; FedPA (IASG clients, two burn-in rounds) learns digits well above chance
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in out.splitlines()
            if line.startswith("| ") and not line.startswith("| method")}
    from fedprob.demo import demo_methods
    assert {name for name, _, _ in demo_methods(4, True)} <= set(rows)
    header = next(line for line in out.splitlines() if line.startswith("| method"))
    header = [c.strip() for c in header.split("|")[2:-1]]
    for name in ("FedPA(IASG)", "PVI(Laplace, diag)", "BayesADMM(IVON)"):
        assert float(rows[name][header.index("accuracy")]) > 0.5, name


@pytest.mark.slow
def test_demo_quick_writes_run_dirs_and_report(tmp_path, capsys):
    assert cli.main(["demo", "--quick", "--quiet", "--out", str(tmp_path / "demo")]) == 0
    rows = json.loads((tmp_path / "demo" / "demo.json").read_text())
    names = [r["method"] for r in rows]
    assert "FedAvg" in names
    for r in rows:
        assert 0.0 <= r["accuracy"] <= 1.0 and r["nll"] > 0
    # FedAvg learns digits well above chance even in the quick version
    assert rows[names.index("FedAvg")]["accuracy"] > 0.5
    assert "| method |" in capsys.readouterr().out
    # one run directory per method, which the report reads
    assert (tmp_path / "demo" / "fedavg" / "posterior.nc").exists()
    assert cli.main(["report", str(tmp_path / "demo")]) == 0
    page = (tmp_path / "demo" / "report.html").read_text()
    assert page.count("data:image/png;base64,") >= 8 and "PredictiveBayes(cSGHMC)" in page


def test_run_config_and_report(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG)
    out = tmp_path / "run"
    assert cli.main(["run", str(cfg), "--out", str(out), "--quiet", "--set", "algorithm.learning_rate=0.5",
                     "--seed", "3"]) == 0
    hist = json.loads((out / "history.json").read_text())
    assert len(hist) == 3 and hist[-1]["accuracy"] > 0.6
    assert hist[-1]["ece_bins"] == 15 and sum(hist[-1]["reliability"]["count"]) == 360
    saved = tomllib.loads((out / "config.toml").read_text())
    assert saved["algorithm"]["learning_rate"] == 0.5 and saved["run"]["seed"] == 3
    csv = (out / "history.csv").read_text().splitlines()
    assert csv[0].startswith("round,") and len(csv) == 4
    post = np.load(out / "posterior.npz")
    assert str(post["form"]) == "samples" and post["draws"].shape[0] == 1     # FedAvg: one point
    assert cli.main(["report", str(out)]) == 0
    page = (out / "report.html").read_text()
    assert page.startswith("<!doctype html>") and "data:image/png;base64," in page
    assert "learning_rate" in page and "accuracy" in capsys.readouterr().out
    # the saved configuration runs again; an existing run directory is refused, then overwritten with --force
    assert cli.main(["run", str(out / "config.toml"), "--out", str(out), "--quiet"]) == 2
    assert "exists" in capsys.readouterr().err
    assert cli.main(["run", str(out / "config.toml"), "--out", str(out), "--quiet", "--force",
                     "--set", "run.rounds=1"]) == 0
    assert len(json.loads((out / "history.json").read_text())) == 1


@pytest.mark.parametrize("text, message", [
    ('[runn]\nrounds = 2\n[model]\nname = "softmax_regression"\n[algorithm]\nname = "FedAvg"\n',
     "unknown table [runn]"),
    ('[run]\nrouds = 2\n[model]\nname = "softmax_regression"\n[algorithm]\nname = "FedAvg"\n',
     "unknown key 'rouds' in [run]"),
    ('[model]\nname = "softmax_regression"\n[algorithm]\nname = "FedAvg"\nlearning_rat = 1.0\n',
     "unknown key 'learning_rat' in [algorithm]"),
    ('[data]\nname = "digits"\n[model]\nname = "no_such_model"\n[algorithm]\nname = "FedAvg"\n',
     "unknown model 'no_such_model'"),
    ('[data]\nname = "mnist"\n[model]\nname = "softmax_regression"\n[algorithm]\nname = "FedAvg"\n', "root"),
    ("[data\n", "not valid TOML"),
])
def test_config_errors_are_one_line(tmp_path, capsys, text, message):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    assert cli.main(["run", str(cfg), "--quiet", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_version_help_and_set_syntax(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("fedprob ")
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    text = capsys.readouterr().out
    assert "[partition]" in text and "clients_per_round" in text and "--set" in text
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG)
    assert cli.main(["run", str(cfg), "--set", "learning_rate=1"]) == 2
    assert "table.key=value" in capsys.readouterr().err
    assert cli.main(["report", str(tmp_path)]) == 2
    assert "not a run directory" in capsys.readouterr().err
