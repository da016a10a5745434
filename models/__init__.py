"""The NumPyro model zoo: plain programs ``model(X, y=None)`` with a "data" plate."""
from .linear import linear_regression
from .logistic import logistic_regression, softmax_regression
from .mlp import bnn_mlp
from .cnn import cnn
from .poisson import poisson_regression
from .hierarchical import hierarchical_linear
from . import examples

from fedprob.names import checked_keywords as _checked, module_getattr as _module_getattr

# a misspelled option of a builder names the closest one (the builders themselves are unchanged)
(linear_regression, logistic_regression, softmax_regression, bnn_mlp, cnn, poisson_regression,
 hierarchical_linear) = map(_checked, (linear_regression, logistic_regression, softmax_regression, bnn_mlp, cnn,
                                       poisson_regression, hierarchical_linear))

__getattr__ = _module_getattr(__name__, globals(), "model or attribute")
