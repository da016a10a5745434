"""Every notebook in notebooks/ executes top to bottom (nbclient, one kernel each), exactly as a user runs it.

The notebooks state their claims as assertions in their last cells, so a notebook whose numbers drift
fails here. Each runs in a temporary working directory, so files it writes (the quickstart's HTML
report) stay out of the checkout.
"""
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_the_notebooks_are_found():
    assert {"quickstart", "fedavg_vs_fedpa", "one_round_heterogeneity"} <= {p.stem for p in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(str(path), as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    if path.stem == "quickstart":
        page = (tmp_path / "quickstart_report.html").read_text()
        assert page.startswith("<!doctype html>") and "data:image/png;base64," in page
