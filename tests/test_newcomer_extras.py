"""Optional dependencies fail when the option that needs them is built, naming the extra and how to install it."""
from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest

import fedprob as fp
from fedprob import extras

HAS_FLWR = importlib.util.find_spec("flwr") is not None


def _install_lines_in(msg: str, extra: str) -> None:
    assert f'pip install ".[{extra}]"' in msg, msg          # from a checkout
    assert f'pip install "fedprob[{extra}]"' in msg, msg    # from a package index


def test_gaussian_dp_without_dp_accounting_fails_when_built(monkeypatch):
    monkeypatch.setitem(sys.modules, "dp_accounting", None)
    with pytest.raises(ImportError) as info:
        fp.GaussianDP(clip_norm=1.0, noise_multiplier=1.0)
    assert "fp.GaussianDP" in str(info.value) and "dp-accounting" in str(info.value)
    _install_lines_in(str(info.value), "privacy")


def test_flower_engine_without_flwr_fails_when_built(monkeypatch):
    monkeypatch.setitem(sys.modules, "flwr", None)
    with pytest.raises(ImportError) as info:
        fp.engine.Flower()
    _install_lines_in(str(info.value), "flower")


@pytest.mark.skipif(not HAS_FLWR, reason="flwr is not installed (the 'flower' extra)")
def test_flower_run_without_ray_fails_before_any_work(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    fed = fp.data.partition(np.zeros((8, 2)), np.arange(8) % 2, num_clients=2, seed=0)
    with pytest.raises(ImportError) as info:
        fp.run(fp.algorithms.FedAvg(), fp.models.logistic_regression(), fed, rounds=1,
               engine=fp.engine.Flower())
    assert "ray" in str(info.value)
    _install_lines_in(str(info.value), "flower")


def test_report_without_matplotlib_fails_first(monkeypatch, tmp_path):
    from fedprob.report import html_report

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError) as info:
        html_report([], tmp_path / "r.html")
    _install_lines_in(str(info.value), "plot")
    assert not (tmp_path / "r.html").exists()


def test_every_extra_is_in_pyproject_and_readme():
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    declared = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    readme = (root / "README.md").read_text()
    for extra in extras.EXTRAS:
        assert extra in declared, extra
        assert f'.[{extra}]' in readme, f"README set-up does not list the {extra!r} extra"
    assert any(d.startswith("flwr[simulation]") for d in declared["flower"])


def test_present_extras_pass():
    extras.require("privacy", "x", ("numpy",))
    assert extras.missing("plot", ("numpy", "surely_not_a_module_xyz")) == ["surely_not_a_module_xyz"]


def test_a_source_checkout_imports_without_being_installed():
    """Python started in the checkout's root with no installed fedprob on its path (the editable
    install's finder removed): ``import fedprob`` takes the checkout's fedprob/, whose subpackages
    fedprob.models and fedprob.inference are the folders beside it, and a model builds."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = ("import sys\n"
            "sys.meta_path = [f for f in sys.meta_path\n"
            "                 if not str(getattr(f, '__module__', '')).startswith('__editable__')]\n"
            "import fedprob as fp, fedprob.inference\n"
            "fp.models.logistic_regression()\n"
            "print(fp.__file__); print(fp.inference.__file__); print(fp.models.__file__)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    files = [Path(line) for line in out.stdout.split()]
    assert files == [root / "fedprob" / "__init__.py", root / "inference" / "__init__.py",
                     root / "models" / "__init__.py"], out.stdout
