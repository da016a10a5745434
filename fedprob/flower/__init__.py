"""fedprob on Flower's Deployment Engine: rows stay on the data holders' SuperNodes.

* :mod:`.appdir`: a Flower App directory for any fedprob configuration
  (``fedprob flower app``);
* :mod:`.serverapp` / :mod:`.clientapp`: the App's ServerApp and ClientApp;
* :mod:`.strategy`: fedprob algorithms as Flower message-API strategies;
* :mod:`.nodedata`: a node's ``.npz`` (format, checks, padding);
  :mod:`.node` / :mod:`.worker`: what a node computes, in a long-lived worker;
* :mod:`.certs`: TLS certificates and SuperNode keys (``fedprob flower certs``);
* :mod:`.local`: a SuperNode with its worker (``fedprob flower supernode``) and a
  whole federation on one machine (``fedprob flower local``).

Needs ``pip install "fedprob[flower]"`` (Flower and ``cryptography``).

Secure aggregation: Flower 1.41's SecAgg+ runs only with the legacy strategy
API: ``SecAggPlusWorkflow.__call__`` raises unless given a ``LegacyContext``
(``flwr/server/workflow/secure_aggregation/secaggplus_workflow.py``, lines
185-188) and drives ``context.strategy.configure_fit`` (line 286), and the
client's ``secaggplus_mod`` turns the reply into a legacy ``FitRes``
(``flwr/client/mod/secure_aggregation/secaggplus_mod.py``, line 169);
``flwr.serverapp`` (the message API these strategies use) has no secure
aggregation. Its quantizer, measured directly
(``benchmarks/deployment.py``), reproduces EP-MCMC's summed natural
parameters within 1.2e-6 relative once they are scaled by a public power of
two into its clipping range.
"""
