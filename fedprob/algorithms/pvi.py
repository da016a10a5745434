"""Partitioned variational inference (Ashman et al. 2022): the natural loop with ``rho = alpha = 1``.

Sites ``t_k = exp(<lambda_hat_k, T(theta)>)``, global ``q_g ∝ p0 prod_k t_k``.
Client k fits ``q_k = argmin E_q[l_k] + E_q[log t_k] + KL(q || q_g)`` (the
tilted cavity ``q_g / t_k * p(D_k | theta)``, FedLap paper Eq. 5) with its
backend, the site moves by the damped natural-parameter step
``lambda_hat_k += damping (lambda_k - lambda_g)``, and the server sums:
``lambda_g = lambda_0 + sum_k lambda_hat_k`` (Eq. 6). With ``damping = 1``
and exact client solves (a Laplace backend on a conjugate Gaussian model)
one round gives the exact posterior.

Rounds. Damped sites converge geometrically: on a conjugate model with
exact client solves, every client present each round, the site sum after R
rounds is ``1 - (1 - damping)^R`` of the exact one (the mean is right much
earlier). At damping 1/K (the default "auto" up to 22 clients) that is about 3K rounds for 95%: the
default 10 rounds leave the precision 5.6% short at K = 4 and 35% short at
K = 10 (measured at 4 clients of 4,000 rows, tests/test_dual.py). Pass
``rounds`` accordingly, or ``damping=1.0`` where the clients are exact.

Participation: synchronous by default (every client each round);
``fp.run(..., clients_per_round=M)`` samples M clients per round (absent
clients keep their sites). :func:`run_sequential` is sequential PVI: the
clients visit the server one after another in a fixed order, each seeing
the sites of those before it (a ``lax.scan`` over clients).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from ..protocols import finite_flag
from .base import Context, check_local_sites
from .aliases import resolve_family
from .natural import FAMILIES, FULL_MAX_DIM, Configured, NaturalLoop, unset_family_for


@dataclasses.dataclass(frozen=True)
class PVI(Configured):
    """PVI with Gaussian sites.

    client: Gaussian backend (None: Laplace with a diagonal GGN for
    ``family="diag"``, the full GGN for "full"); damping: site step in
    (0, 1] (a number, "size" for N_k/N, "clients" for 1/K, "auto", the
    default: 1/K up to 22 clients and 0.045 above, the step that converges
    within the default 100 rounds (:data:`~fedprob.algorithms.natural.AUTO_DAMPING_FLOOR`;
    on 105 weekly clients of bike-sharing data, a hierarchical model, 1/K
    left sds 1.2x NUTS's after 100 rounds). Synchronous undamped PVI overshoots when every client moves at once on a
    non-conjugate model, e.g. 0.47 accuracy and NLL 14 after 20 rounds on the
    digits demo against 0.93 / 0.38 at 1/K; ``damping=1.0`` is exact in one
    round on conjugate models with exact client solves); family:
    "diag", "full" or "isotropic" (precision fixed at the prior's; None, the
    default: the client backend's own family, so ``Laplace(hessian="full")``
    clients give "full", and without a client "full" on a model with
    client-local sites or of at most :data:`FULL_MAX_DIM` parameters, "diag"
    beyond (:meth:`for_model`); "diag" over a backend
    that returns a full precision is refused);
    delta: prior precision override (None: the model's prior);
    prediction: "auto" (the default: "mean" or "average", whichever predicts the clients' rows
    better under their cavities, :mod:`~fedprob.algorithms.prediction_choice`), "average" (over
    draws of q_g) or "mean".
    """

    client: Any = None
    damping: Union[float, str] = "auto"
    family: Optional[str] = None
    delta: Optional[float] = None
    prediction: str = "auto"
    num_predictive_draws: int = 32

    def __post_init__(self):
        object.__setattr__(self, "_family_unset", self.family is None and self.client is None
                           and getattr(self, "covariance", None) is None)
        if not isinstance(self.damping, str) and not 0.0 < float(self.damping) <= 1.0:
            raise ValueError(f"damping must lie in (0, 1], got {self.damping!r}")
        resolve_family(self, "diag", FAMILIES)
        self.loop()

    def for_model(self, potential):
        """An unset family (no client given) becomes "full" on a model with client-local sites and
        on a model of at most :data:`FULL_MAX_DIM` parameters (:func:`~fedprob.algorithms.natural.
        unset_family_for`: on 8 logistic-regression clients with correlated, shifted inputs the
        diagonal family's sds were 0.77-0.91x NUTS's and its mean 0.10 sd off, "full" 0.96-1.01x and
        0.06 sd)."""
        family = unset_family_for(potential) if self._family_unset else None
        return dataclasses.replace(self, family=family) if family else self

    def loop(self) -> NaturalLoop:
        return NaturalLoop(client=self.client, family=self.family, rho=1.0, damping=self.damping, alpha=1.0,
                           delta=self.delta, prediction=self.prediction,
                           num_predictive_draws=self.num_predictive_draws)




def run_sequential(algorithm, model, fed, sweeps: int = 1, seed: int = 0, eval_data=None,
                   model_kwargs: Optional[dict] = None):
    """Sequential PVI: ``sweeps`` passes over the clients in order 0..K-1, one server update per client.

    Works for any algorithm of the natural loop. Each sweep is one compiled
    ``lax.scan`` over the clients; a client whose update is not finite, or
    whose server update is rejected, changes nothing. Returns an
    :class:`fedprob.result.Result` with one history entry per sweep.
    """
    from ..engine.local import _where_tree
    from ..metrics import evaluate
    from ..potential import get_potential
    from ..result import Result

    if int(sweeps) < 1:
        raise ValueError(f"sweeps must be >= 1, got {sweeps}")
    potential = get_potential(model, fed, model_kwargs)
    check_local_sites(algorithm, potential)
    ctx = Context(potential, fed.num_clients, np.asarray(fed.sizes), fed.num_rows)
    data = fed.client_data()
    key = jax.random.PRNGKey(seed)
    k_init, k_rounds = jax.random.split(key)
    t0 = time.perf_counter()
    server, clients = jax.jit(lambda k, d: algorithm.init(ctx, k, d))(k_init, data)
    init_time = time.perf_counter() - t0

    def visit(carry, xs):
        server, clients = carry
        k, kk = xs
        c = jax.tree_util.tree_map(lambda a: a[k], clients)
        d = jax.tree_util.tree_map(lambda a: a[k], data)
        new_c, msg, _ = algorithm.client_update(ctx, server, c, d, kk)
        ok = finite_flag(new_c, msg)
        one = jax.tree_util.tree_map(lambda a: a[None], msg)
        new_s = algorithm.server_update(ctx, server, one, d.n[None], ok[None])
        accept = ok & finite_flag(new_s)
        server = _where_tree(accept, new_s, server)
        merged = _where_tree(accept, new_c, c)
        clients = jax.tree_util.tree_map(lambda a, b: a.at[k].set(b), clients, merged)
        return (server, clients), accept

    @jax.jit
    def sweep(server, clients, key):
        K = ctx.num_clients
        keys = jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.arange(K))
        (server, clients), accepted = jax.lax.scan(visit, (server, clients), (jnp.arange(K), keys))
        return server, clients, accepted

    t0 = time.perf_counter()
    sweep = sweep.lower(server, clients, k_rounds).compile()
    compile_time = time.perf_counter() - t0
    history = []
    for r in range(int(sweeps)):
        t = time.perf_counter()
        server, clients, accepted = sweep(server, clients, jax.random.fold_in(k_rounds, r))
        server = jax.block_until_ready(server)
        acc = np.asarray(accepted)
        entry = {"round": r + 1, "time": time.perf_counter() - t, "participants": list(range(ctx.num_clients)),
                 "excluded": np.flatnonzero(~acc).tolist(), "server_update_ok": bool(acc.all())}
        if eval_data is not None:
            entry.update(evaluate(algorithm.posterior(ctx, server, clients), *eval_data))
        history.append(entry)
    from ..engine.local import refresh_local

    clients, refresh = refresh_local(algorithm, ctx, server, clients, data, jax.random.fold_in(k_rounds, int(sweeps)))
    info = {} if refresh is None else {"local_refresh": refresh}
    return Result(algorithm.posterior(ctx, server, clients), history, server, clients, algorithm, ctx,
                  compile_time, init_time, info=info)


__all__ = ["PVI", "run_sequential"]
