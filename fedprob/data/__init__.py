"""Federated data: the padded container, partition schemes and loaders."""
from .federated import FederatedData
from .partition import SCHEMES, group_ids, partition, partition_indices
from .loaders import Dataset, load_digits, load_fashion_mnist, load_mnist, read_idx
from .uci import load_bike_weeks, load_credit_approval, load_heart_disease, load_uci
