"""The command line: demo, a TOML run and its report."""
import json

import pytest

from fedprob import cli


def test_demo_quick_writes_table(tmp_path, capsys):
    assert cli.main(["demo", "--quick", "--quiet", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "demo.json").read_text())
    names = [r["method"] for r in rows]
    assert "FedAvg" in names
    for r in rows:
        assert 0.0 <= r["accuracy"] <= 1.0 and r["nll"] > 0
    # FedAvg learns digits well above chance even in the quick version
    assert rows[names.index("FedAvg")]["accuracy"] > 0.5
    assert "| method |" in capsys.readouterr().out


def test_run_config_and_report(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text("""
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
""")
    out = tmp_path / "run"
    assert cli.main(["run", str(cfg), "--out", str(out), "--quiet"]) == 0
    hist = json.loads((out / "history.json").read_text())
    assert len(hist) == 3 and hist[-1]["accuracy"] > 0.6
    assert (out / "posterior.npz").exists()
    assert cli.main(["report", str(out)]) == 0
    assert "accuracy" in capsys.readouterr().out


def test_config_errors(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[data]\nname = "digits"\n[model]\nname = "no_such_model"\n[algorithm]\nname = "FedAvg"\n')
    with pytest.raises(ValueError, match="unknown model"):
        cli.main(["run", str(cfg), "--quiet"])
    cfg.write_text('[data]\nname = "mnist"\n')
    with pytest.raises(ValueError, match="root"):
        cli.main(["run", str(cfg), "--quiet"])
