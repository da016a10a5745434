"""Every notebook in notebooks/ runs top to bottom at its reduced size, and its claims hold."""
import json
from pathlib import Path

import numpy as np
import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def check_quickstart(ns):
    # the exact-check cell: EP-MCMC over NUTS clients matches the closed-form posterior
    ep = ns["ep"]
    sd = np.sqrt(np.asarray(ep.posterior.form.variance()))
    err = np.abs(np.asarray(ep.posterior.mean["w"]) - ns["exact_mean"]) / ns["exact_sd"]
    assert err.max() < 0.25
    assert np.all(np.abs(sd / ns["exact_sd"] - 1) < 0.15)
    # every method of the comparison learned the digits
    assert all(r["accuracy"] > 0.6 for r in ns["rows"])


CHECKS = {"quickstart": check_quickstart}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch):
    monkeypatch.setenv("FEDPROB_NOTEBOOK_SMALL", "1")
    nb = json.loads(path.read_text())
    ns = {"__name__": "__notebook__"}
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), f"{path.name}[cell {i}]", "exec"), ns)
    CHECKS.get(path.stem, lambda ns: None)(ns)
