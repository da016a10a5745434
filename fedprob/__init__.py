"""fedprob: Bayesian federated learning as a NumPyro backend.

    import fedprob as fp
    fed = fp.data.partition(X, y, num_clients=10, scheme="dirichlet", alpha=0.5, seed=0)
    algo = fp.algorithms.PredictiveBayes(client=fp.inference.CyclicalSGHMC())
    result = fp.run(algo, fp.models.logistic_regression(), fed, rounds=1, seed=0)
"""
import os as _os

from . import data, gaussian, potential, posteriors, protocols

try:
    from . import models, inference
except ImportError:
    # a source checkout on sys.path but not installed (a notebook or script started in the checkout's
    # root): the subpackages fedprob.models and fedprob.inference are the folders models/ and
    # inference/ beside fedprob/ (pyproject.toml's package-dir), so they are looked up there too
    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    if not all(_os.path.isfile(_os.path.join(_root, sub, "__init__.py")) for sub in ("models", "inference")):
        raise
    __path__.append(_root)
    from . import models, inference
from . import algorithms
from .potential import Potential
from .posteriors import Gaussian, GlobalPosterior, Samples

__version__ = "0.1.0"
from . import engine
from .checkpoint import Checkpoint
from .faults import Faults
from .privacy import GaussianDP
from .stragglers import Stragglers
from .result import Result
from .run import run
from . import metrics, diagnostics, report
