"""The NumPyro model zoo: plain programs ``model(X, y=None)`` with a "data" plate."""
