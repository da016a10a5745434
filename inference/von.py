"""VON: variational online Newton with a full-covariance Gaussian (Khan & Rue, "The Bayesian
learning rule", Eq. 12; the client solver of full-covariance BayesADMM, App. C.4).

For a client target ``log pi(z)`` (a :class:`~fedprob.potential.LocalTarget`:
prior, likelihood and Gaussian term) VON fits ``q = N(m, S^-1)`` to
``argmin_q E_q[-log pi] - H(q)`` (``-ELBO``) by natural-gradient steps of
size ``beta_t``::

    theta_j = m + S^-1/2 eps_j,  j = 1..mc_samples            (eps_j ~ N(0, I))
    S <- (1 - beta_t) S + beta_t mean_j C(theta_j)
    m <- m - beta_t S^-1 mean_j grad(-log pi)(theta_j)        (with the new S)

``C`` is the curvature of ``-log pi`` at the draw: ``"hessian"`` (the exact
Hessian, d Hessian-vector products) or ``"ggn"`` (generalized Gauss-Newton
of the likelihood plus the exact prior and Gaussian-term curvature, PSD:
:func:`fedprob.inference.laplace.curvature`). At a fixed point
``S = E_q[hess(-log pi)]`` and ``E_q[grad(-log pi)] = 0``: the variational
optimum's conditions (Price's and Bonnet's theorems). For a Gaussian target
this is the exact posterior; the iterates then carry only the Monte Carlo
noise of the gradient average, which the tail averages (``average_fraction``
of the steps, of ``m`` and of ``S``) reduce.

Start: the mode after ``map_steps`` L-BFGS steps from ``init`` and ``S``
the curvature there (the Laplace approximation), so the steps refine it; a
curvature that is not positive definite at a draw (a ``"hessian"`` of a
non-convex loss) is symmetrised and its eigenvalues raised to
``min_precision``. Output: ``Gaussian(linear = S m, precision = S)`` with a
(d, d) precision; ``params = m``; diagnostics ``mean_drift`` (change of
``m`` between the last two tenths of the steps, in posterior sds),
``converged`` (``mean_drift < 0.25``: the window means of a converged run
differ by their Monte Carlo noise, about 0.1 sd at the defaults) and
``nonfinite``.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from fedprob.posteriors import Gaussian
from fedprob.protocols import ClientBackend, ClientResult, finite_flag
from .budget import within_budget
from .laplace import clip_precision, curvature
from .optim import minimize

CURVATURES = ("hessian", "ggn")


def von_run(key, potential, target, mean0, prec0, *, num_steps: int, learning_rate: float,
            mc_samples: int, hessian: str, min_precision: float, average_fraction: float, max_steps=None):
    """``num_steps`` VON steps from ``N(mean0, prec0^-1)``: ``(mean, precision, (2, d) window means)``,
    mean and precision averaged over the last ``average_fraction`` of the steps.

    ``max_steps`` (optional, traced int): steps ``t >= max_steps`` leave ``(m, S)`` unchanged (a
    run stopped early); the averages and windows then hold the stopped state for the steps not taken.
    """
    kind = "full" if hessian == "hessian" else "ggn"
    d = mean0.shape[0]
    start_avg = min(int(num_steps * (1.0 - average_fraction)), num_steps - 1)
    w = max(1, num_steps // 10)
    win_a, win_b = max(0, num_steps - 2 * w), num_steps - w
    dt = mean0.dtype

    def neg_log(z):
        return -potential.log_density(z, target)

    def step(carry, xs):
        m, S, sum_m, sum_S, win = carry
        t, k = xs
        L = jnp.linalg.cholesky(S)
        eps = jax.random.normal(k, (mc_samples, d), dt)
        # theta = m + S^-1/2 eps with S = L L': solve L' x = eps
        thetas = m + jax.vmap(lambda e: jax.scipy.linalg.solve_triangular(L.T, e, lower=False))(eps)
        grads = jax.vmap(jax.grad(neg_log))(thetas)
        curv = jax.vmap(lambda th: curvature(potential, target, th, kind))(thetas)
        C = jnp.mean(curv, 0)
        C, _ = clip_precision(0.5 * (C + C.T), min_precision)
        S_new = (1.0 - learning_rate) * S + learning_rate * C
        S_new = 0.5 * (S_new + S_new.T)
        m_new = m - learning_rate * jnp.linalg.solve(S_new, jnp.mean(grads, 0))
        ok = jnp.all(jnp.isfinite(S_new)) & jnp.all(jnp.isfinite(m_new)) & within_budget(t, max_steps)
        m, S = jnp.where(ok, m_new, m), jnp.where(ok, S_new, S)
        a = (t >= start_avg).astype(dt)
        inw = jnp.stack([(t >= win_a) & (t < win_b), t >= win_b]).astype(dt)
        return (m, S, sum_m + a * m, sum_S + a * S, win + inw[:, None] * m), None

    carry = (mean0, prec0, jnp.zeros_like(mean0), jnp.zeros_like(prec0), jnp.zeros((2, d), dt))
    keys = jax.random.split(key, num_steps)
    (m, S, sum_m, sum_S, win), _ = jax.lax.scan(step, carry, (jnp.arange(num_steps), keys))
    n_avg = num_steps - start_avg
    counts = jnp.asarray([max(1, win_b - win_a), num_steps - win_b], dt)
    return sum_m / n_avg, sum_S / n_avg, win / counts[:, None]


@dataclasses.dataclass(frozen=True)
class VON(ClientBackend):
    """Full-covariance VON client backend (module docstring).

    learning_rate: step beta of the natural-gradient updates (0 < beta <= 1);
    num_steps: VON steps; mc_samples: draws per step; hessian: "ggn" (PSD,
    default) or "hessian" (exact); map_steps: L-BFGS steps of the mode
    search that starts it (0: start at ``init`` with the curvature there);
    average_fraction: tail over which m and S are averaged; min_precision:
    floor of the curvature's eigenvalues.
    """

    learning_rate: float = 0.1
    num_steps: int = 200
    mc_samples: int = 4
    hessian: str = "ggn"
    map_steps: int = 200
    average_fraction: float = 0.5
    min_precision: float = 1e-6

    init_strategy: str = "center"
    output = "gaussian"

    def __post_init__(self):
        if not 0.0 < float(self.learning_rate) <= 1.0:
            raise ValueError(f"learning_rate must lie in (0, 1], got {self.learning_rate}")
        if int(self.num_steps) < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")
        if int(self.mc_samples) < 1:
            raise ValueError(f"mc_samples must be >= 1, got {self.mc_samples}")
        if self.hessian not in CURVATURES:
            raise ValueError(f"hessian must be one of {CURVATURES}, got {self.hessian!r}")
        if int(self.map_steps) < 0:
            raise ValueError(f"map_steps must be >= 0, got {self.map_steps}")
        if not 0 <= float(self.average_fraction) < 1:
            raise ValueError(f"average_fraction must lie in [0, 1), got {self.average_fraction}")
        if not float(self.min_precision) > 0:
            raise ValueError(f"min_precision must be > 0, got {self.min_precision}")

    @property
    def local_step_count(self) -> int:
        """Steps of one :meth:`run`: the mode search's ``map_steps`` then ``num_steps`` VON steps."""
        return int(self.map_steps) + int(self.num_steps)

    def run(self, key, potential, target, init, max_steps=None) -> ClientResult:
        """``N(m, S^-1)`` fitted to ``target`` from ``init``; ``max_steps`` (optional, traced int <=
        :attr:`local_step_count`) stops the run after that many steps, counted over the mode search
        then the VON steps."""
        dim = potential.dim
        init = jnp.asarray(init)
        if init.shape != (dim,):
            raise ValueError(f"init must have shape ({dim},), got {init.shape}")
        k_map, k_run = jax.random.split(key)
        m0 = init
        if int(self.map_steps) > 0:
            m0 = minimize(potential, target, init, key=k_map, num_steps=int(self.map_steps),
                          max_steps=max_steps).params
        von_steps = None if max_steps is None else jnp.clip(max_steps - int(self.map_steps), 0,
                                                              int(self.num_steps))
        kind = "full" if self.hessian == "hessian" else "ggn"
        S0, _ = clip_precision(curvature(potential, target, m0, kind), float(self.min_precision))
        m, S, win = von_run(k_run, potential, target, m0, S0, num_steps=int(self.num_steps),
                            learning_rate=float(self.learning_rate), mc_samples=int(self.mc_samples),
                            hessian=self.hessian, min_precision=float(self.min_precision),
                            average_fraction=float(self.average_fraction), max_steps=von_steps)
        S = 0.5 * (S + S.T)
        post = Gaussian(S @ m, S)
        ok = finite_flag(post, m)
        sd = jnp.sqrt(jnp.diagonal(jnp.linalg.inv(S)))
        drift = jnp.max(jnp.abs(win[1] - win[0]) / sd)
        return ClientResult(post, m, {"mean_drift": drift, "converged": (drift < 0.25) & ok,
                                      "nonfinite": ~ok})


__all__ = ["VON", "von_run", "CURVATURES"]
