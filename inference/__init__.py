"""Client inference backends: every way a client infers its local posterior."""
from .base import ClientBackend, ClientResult
