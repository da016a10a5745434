"""The NumPyro model zoo: plain programs ``model(X, y=None)`` with a "data" plate."""
from .linear import linear_regression
from .logistic import logistic_regression, softmax_regression
from .mlp import bnn_mlp
from .cnn import cnn
from .poisson import poisson_regression
