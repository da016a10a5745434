"""Federated algorithms: server strategies over client backends."""
from .base import Algorithm, Context
