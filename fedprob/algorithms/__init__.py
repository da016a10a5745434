"""Federated algorithms: server strategies over client backends."""
from .base import Algorithm, Context
from .fedavg import FedAvg
from .fedprox import FedProx
