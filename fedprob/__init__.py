"""fedprob: Bayesian federated learning as a NumPyro backend.

    import fedprob as fp
    fed = fp.data.partition(X, y, num_clients=10, scheme="dirichlet", alpha=0.5, seed=0)
    algo = fp.algorithms.PredictiveBayes(client=fp.inference.CyclicalSGHMC())
    result = fp.run(algo, fp.models.logistic_regression(), fed, rounds=1, seed=0)
"""
from . import data, gaussian, potential, posteriors, protocols
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
