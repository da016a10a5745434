"""Federated algorithms: server strategies over client backends."""
from .base import Algorithm, Context
from .fedavg import FedAvg
from .fedprox import FedProx
from .consensus import ConsensusMC
from .ep_mcmc import EPMCMC
from .predictive_bayes import PredictiveBayes, fit_beta
from .ensemble import Ensemble
from .one_shot_average import OneShotAverage
from .one_round import ClientRuns, aggregate, run_clients
from .fedpa import FedPA
from .natural import NaturalLoop
from .pvi import PVI, run_sequential
from .ep import EP
from .fedlap import FedLap, FedLapCov
from .bayes_admm import BayesADMM
from .admm import ADMM
from .feddyn import FedDyn
from .fedlap_func import FedLapFunc

from ..names import module_getattr as _module_getattr

__getattr__ = _module_getattr(__name__, globals(), "algorithm or attribute")
