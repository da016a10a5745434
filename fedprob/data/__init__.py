"""Federated data: the padded container, partition schemes and loaders."""
from .federated import FederatedData
