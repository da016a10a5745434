"""Client-local sites: the Gaussian algebra between a client's joint and the global block.

A model's flat vector is ``z = (g, l)``: the global block ``g`` (``dim_global``
coordinates, shared by every client) and the local block ``l`` (one copy per
client, ``infer={"local": True}``; :mod:`fedprob.potential`). A client infers
the joint of ``(g, l_k)``; what it sends concerns ``g`` only, and what it keeps
is its local block *given* ``g``.

Given a joint Gaussian ``N(m, P^-1)`` with ``P = [[P_gg, P_gl], [P_lg, P_ll]]``
(a Laplace approximation at the joint mode ``m``, or a Gaussian guide):

* the **global marginal** has mean ``m_g`` and precision the Schur complement
  ``S = P_gg - P_gl P_ll^-1 P_lg``;
* the **local conditional** is ``l | g ~ N(m_l + B (g - m_g), P_ll^-1)`` with
  ``B = -P_ll^-1 P_lg`` (:class:`LocalConditional`).

A diagonal joint (mean-field) has ``S = P_gg``, ``B = 0``. Under a global
posterior ``q(g) = N(mu, Sigma)`` the conditional gives the client's local
posterior ``l_k ~ N(m_l + B (mu - m_g), P_ll^-1 + B Sigma B')``
(:func:`local_marginal`), and joint draws ``g ~ q``, ``l = m_l + B (g - m_g) +
P_ll^-1/2 eps`` (:func:`sample_joint`). On a linear-Gaussian model the
conditional is exact, so an exact ``q(g)`` gives the exact local posteriors.

From joint draws (a sampling client) the conditional is the least-squares
regression of ``l`` on ``g`` (:func:`conditional_from_draws`): ``B = C_lg
C_gg^-1``, residual covariance ``C_ll - B C_gl``, the Gaussian conditional of
the draws' moment-matched joint.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .posteriors import Gaussian, LocalConditional, local_marginal, sample_local

Array = jax.Array


def initial_conditional(z0: Array, dim_global: int) -> LocalConditional:
    """The conditional before any client pass: centred at the start ``z0``, unit covariance, no slope."""
    d_l = z0.shape[-1] - dim_global
    return LocalConditional(z0[:dim_global], z0[dim_global:], jnp.zeros((d_l, dim_global), z0.dtype),
                            jnp.eye(d_l, dtype=z0.dtype))


def _sym(a):
    return 0.5 * (a + jnp.swapaxes(a, -1, -2))


def split_joint(joint: Gaussian, mean: Array, dim_global: int):
    """``(global marginal, LocalConditional)`` of the joint ``N(mean, joint.precision^-1)``.

    The global marginal is full (Schur complement) for a full joint and
    diagonal for a diagonal one; ``mean`` is the joint mean (the mode of a
    Laplace approximation).
    """
    dg = dim_global
    m_g, m_l = mean[:dg], mean[dg:]
    P = joint.precision
    if joint.is_diag:
        p_g, p_l = P[:dg], P[dg:]
        cond = LocalConditional(m_g, m_l, jnp.zeros((m_l.shape[0], dg), P.dtype), jnp.diag(1.0 / p_l))
        return Gaussian(p_g * m_g, p_g), cond
    P_gg, P_gl, P_ll = P[:dg, :dg], P[:dg, dg:], P[dg:, dg:]
    L = jnp.linalg.cholesky(_sym(P_ll))
    cov = jax.scipy.linalg.cho_solve((L, True), jnp.eye(P_ll.shape[0], dtype=P.dtype))
    slope = -jax.scipy.linalg.cho_solve((L, True), P_gl.T)             # -P_ll^-1 P_lg
    S = _sym(P_gg + P_gl @ slope)
    return Gaussian(S @ m_g, S), LocalConditional(m_g, m_l, slope, _sym(cov))


def sample_joint(cond: LocalConditional, g: Array, key) -> Array:
    """Joint draws ``(g, l)`` (S, d) for global draws ``g`` (S, d_g) under one client's conditional."""
    return jnp.concatenate([g, sample_local(cond, g, key)], -1)


def conditional_from_draws(draws: Array, dim_global: int, ridge: float = 1e-6) -> LocalConditional:
    """The Gaussian conditional ``l | g`` of joint draws (S, d): a least-squares regression of the
    local block on the global one (a ``ridge`` times the mean variance keeps it solvable)."""
    g, l = draws[:, :dim_global], draws[:, dim_global:]
    S = draws.shape[0]
    mg, ml = jnp.mean(g, 0), jnp.mean(l, 0)
    cg, cl = g - mg, l - ml
    C_gg = cg.T @ cg / max(S - 1, 1)
    C_lg = cl.T @ cg / max(S - 1, 1)
    C_ll = cl.T @ cl / max(S - 1, 1)
    C_gg = C_gg + ridge * jnp.mean(jnp.diagonal(C_gg)) * jnp.eye(dim_global, dtype=draws.dtype)
    slope = jnp.linalg.solve(C_gg, C_lg.T).T
    return LocalConditional(mg, ml, slope, _sym(C_ll - slope @ C_lg.T))


def embed_global(g: Gaussian, dim: int) -> Gaussian:
    """A Gaussian term on the global block as one on the joint ``dim`` coordinates (zero on the local
    block): a cavity or proximal term that leaves the local sites to their conditional prior."""
    pad = dim - g.linear.shape[-1]
    if pad == 0:
        return g
    linear = jnp.concatenate([g.linear, jnp.zeros((pad,), g.linear.dtype)])
    if g.is_diag:
        return Gaussian(linear, jnp.concatenate([g.precision, jnp.zeros((pad,), g.precision.dtype)]))
    return Gaussian(linear, jnp.pad(g.precision, ((0, pad), (0, pad))))


__all__ = ["LocalConditional", "initial_conditional", "split_joint", "local_marginal", "sample_local",
           "sample_joint", "conditional_from_draws", "embed_global"]
