"""Optional dependencies: checked when the option that needs one is built, with the line that installs it.

=============  ================================  ==========================================================
extra          installs                          enables
=============  ================================  ==========================================================
``plot``       matplotlib                        ``result.report(...)``, ``fedprob report``, ``fp.plots``
``privacy``    dp-accounting                     ``fp.GaussianDP`` (the (epsilon, delta) accountant)
``flower``     flwr[simulation], cryptography    ``fp.engine.Flower()``, ``fedprob flower ...``
``notebooks``  jupyter, nbconvert, matplotlib    running the notebooks in ``notebooks/``
``test``       pytest and the oracles' packages  the test suite
=============  ================================  ==========================================================

:func:`require` raises an ImportError naming the extra and both install
lines: ``pip install ".[flower]"`` from a checkout of fedprob, ``pip install
"fedprob[flower]"`` from a package index. It looks the modules up without
importing them (``importlib.util.find_spec``), so a check costs microseconds.
"""
from __future__ import annotations

import importlib.util

#: extra -> (the modules it provides, the distributions it installs, what it enables)
EXTRAS = {
    "plot": (("matplotlib",), "matplotlib", "reports and plots"),
    "privacy": (("dp_accounting",), "dp-accounting", "differential privacy accounting (fp.GaussianDP)"),
    "flower": (("flwr", "ray"), "flwr[simulation]", "the Flower engine (fp.engine.Flower)"),
    "notebooks": (("nbconvert", "matplotlib"), "jupyter and nbconvert", "running the notebooks"),
}


def install_lines(extra: str) -> str:
    """The two ways to install ``extra``: from a checkout and from a package index."""
    return f'pip install ".[{extra}]" in a checkout of fedprob, or pip install "fedprob[{extra}]"'


def missing(extra: str, modules=None) -> list:
    """The modules of ``extra`` (or the given ``modules``) that cannot be imported."""
    mods = EXTRAS[extra][0] if modules is None else modules
    out = []
    for m in mods:
        try:
            found = importlib.util.find_spec(m) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            out.append(m)
    return out


def require(extra: str, what: str, modules=None) -> None:
    """ImportError naming ``extra`` and its install lines when a module of it is missing.

    what: the feature that needs it, e.g. ``"fp.engine.Flower()"``.
    """
    gone = missing(extra, modules)
    if gone:
        _, dists, _ = EXTRAS[extra]
        raise ImportError(f"{what} needs the optional dependency {dists} (missing module "
                          f"{', '.join(gone)}): install the {extra!r} extra: {install_lines(extra)}")


__all__ = ["EXTRAS", "install_lines", "missing", "require"]
