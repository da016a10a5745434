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
"""
