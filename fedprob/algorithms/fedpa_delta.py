"""FedPA's client delta ``Sigma_hat^-1 (theta - mean)`` by the dynamic program of App. C.

Given draws ``x_1..x_l`` (rows of ``samples``), their mean ``xbar_l``, the
sample covariance ``S_l`` (divisor ``l - 1``) and the shrinkage estimate

    Sigma_hat_l = rho_l I + (1 - rho_l) S_l,      rho_l = 1 / (1 + (l - 1) rho),

the delta is ``Sigma_hat_l^-1 (theta - xbar_l)`` (Al-Shedivat et al. 2021,
Thm. 3). With ``Sigma~_t = I + (t - 1) rho S_t = Sigma_hat_t / rho_t`` each
new draw is a rank-one update ``Sigma~_t = Sigma~_{t-1} + gamma_t u_t u_t'``,
``u_t = x_t - xbar_{t-1}``, ``gamma_t = (t - 1) rho / t``, so Sherman-Morrison
gives, with ``v_t = Sigma~_{t-1}^-1 u_t`` and ``D_t = Sigma~_t^-1 (theta - xbar_t)``:

    v_t = u_t - sum_{k<t} c_k (v_k . u_t) v_k,        c_k = gamma_k / (1 + gamma_k u_k . v_k)
    D_t = D_{t-1} - (gamma_t (u_t . D_{t-1}) + 1/t) / (1 + gamma_t u_t . v_t) v_t
    delta_t = D_t / rho_t

(``D_1 = theta - x_1``). No d x d matrix is formed: the state is the stored
``v_k`` and ``c_k`` (O(l d) memory) and each draw costs O(t d), O(l^2 d) in
all. The recursion is streaming: :func:`delta_update` folds in one draw and
:func:`delta_value` reads the delta after any number of draws (one draw gives
``theta - x_1``, FedAvg's delta).

Eq. 23 of the paper prints the factor as ``(1 + gamma_t (t u_t . D_{t-1} - u_t . v_t))
/ (1 + gamma_t u_t . v_t)``, with the 1 inside the fraction; the dense solve
disagrees with that. The authors' code uses ``1 + gamma_t (t u_t . D_{t-1} -
u_t . v_t) / (1 + gamma_t u_t . v_t)``, which is the form above.

Covariance scale. ``scale`` multiplies the sample covariance,
``Sigma_hat = rho_l I + (1 - rho_l) scale * S_l``: computed as the DP on the
draws and ``theta`` stretched by ``sqrt(scale)`` (about ``theta``), divided
by ``sqrt(scale)``.

Data-driven shrinkage (App. C, Chen et al. 2010): :func:`oas_rho` /
:func:`rblw_rho` estimate the weight ``rho_l`` on the target from the draws
(with traces computed from the l x l Gram matrix, O(l^2 d)) and
:func:`rho_from_weight` turns it into the DP's ``rho``. Chen et al.'s target
is ``tr(S)/d I``; here the weight is applied to the target ``I`` of the DP.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array


class DeltaState(NamedTuple):
    """Streaming state of the dynamic program (room for ``L`` draws)."""

    count: Array      # () draws folded in so far
    mean: Array       # (d,) running mean xbar_t
    dtil: Array       # (d,) D_t = Sigma~_t^-1 (theta - xbar_t)
    vs: Array         # (L, d) v_k (zero rows for unused slots)
    coefs: Array      # (L,) c_k (zero for unused slots)
    theta: Array      # (d,) the point the delta is taken at
    rho: Array        # () shrinkage parameter


def delta_init(theta, max_draws: int, rho) -> DeltaState:
    """An empty state for up to ``max_draws`` draws at the point ``theta``."""
    theta = jnp.asarray(theta)
    d = theta.shape[-1]
    z = jnp.zeros_like(theta)
    return DeltaState(jnp.zeros((), jnp.int32), z, z, jnp.zeros((max_draws, d), theta.dtype),
                      jnp.zeros((max_draws,), theta.dtype), theta, jnp.asarray(rho, theta.dtype))


def delta_update(state: DeltaState, x) -> DeltaState:
    """Fold one draw ``x`` (d,) into the state (O(t d))."""
    t = state.count + 1
    tf = t.astype(state.mean.dtype)
    first = t == 1
    u = x - state.mean
    v = u - (state.coefs * (state.vs @ u)) @ state.vs
    gamma = (tf - 1.0) * state.rho / tf
    uv = jnp.dot(u, v)
    den = 1.0 + gamma * uv
    dtil = state.dtil - (gamma * jnp.dot(u, state.dtil) + 1.0 / tf) / den * v
    dtil = jnp.where(first, state.theta - x, dtil)
    slot = jnp.clip(t - 1, 0, state.vs.shape[0] - 1)
    keep = ~first
    vs = state.vs.at[slot].set(jnp.where(keep, v, state.vs[slot]))
    coefs = state.coefs.at[slot].set(jnp.where(keep, gamma / den, state.coefs[slot]))
    mean = state.mean + u / tf
    return state._replace(count=t, mean=mean, dtil=dtil, vs=vs, coefs=coefs)


def delta_value(state: DeltaState) -> Array:
    """``Sigma_hat_t^-1 (theta - xbar_t)`` after the draws folded in so far (0 before any)."""
    t = state.count.astype(state.dtil.dtype)
    return state.dtil * (1.0 + jnp.maximum(t - 1.0, 0.0) * state.rho)


def delta(samples, theta, shrinkage, scale=1.0) -> Array:
    """``Sigma_hat^-1 (theta - mean)`` of (l, d) draws by the DP (module docstring).

    ``shrinkage`` is rho >= 0 (rho_l = 1 / (1 + (l - 1) rho)); ``scale``
    multiplies the sample covariance. Jittable, vmappable, O(l^2 d) time,
    O(l d) memory.
    """
    samples = jnp.asarray(samples)
    theta = jnp.asarray(theta, samples.dtype)
    c = jnp.sqrt(jnp.asarray(scale, samples.dtype))
    xs = (samples - theta) * c                       # centred on theta: better conditioned in float32
    state = delta_init(jnp.zeros_like(theta), samples.shape[0], shrinkage)
    state, _ = jax.lax.scan(lambda s, x: (delta_update(s, x), None), state, xs)
    return delta_value(state) / c


def dense_delta(samples, theta, shrinkage, scale=1.0) -> Array:
    """The same delta by forming ``Sigma_hat`` and solving (O(d^3)): the oracle and a timing baseline."""
    samples = jnp.asarray(samples)
    l, d = samples.shape
    rho_l = 1.0 / (1.0 + (l - 1) * shrinkage)
    m = jnp.mean(samples, 0)
    c = samples - m
    S = c.T @ c / max(l - 1, 1)
    Sigma = rho_l * jnp.eye(d, dtype=samples.dtype) + (1.0 - rho_l) * scale * S
    return jnp.linalg.solve(Sigma, theta - m)


def _column_mean(samples):
    """Mean over the draws as a matrix product (XLA's CPU reduction over a short leading axis is ~10x slower)."""
    l = samples.shape[0]
    return jnp.full((l,), 1.0 / l, samples.dtype) @ samples


def _traces(samples, scale=1.0):
    """(tr S, tr S^2) of the ML sample covariance (divisor l) from the l x l Gram matrix."""
    l = samples.shape[0]
    c = (samples - _column_mean(samples)) * jnp.sqrt(jnp.asarray(scale, samples.dtype))
    G = c @ c.T / l
    return jnp.trace(G), jnp.sum(G * G)


def oas_rho(samples, scale=1.0) -> Array:
    """Oracle approximating shrinkage weight on the target (Chen et al. 2010, Eq. 23), in [0, 1]."""
    l, d = samples.shape
    tr, tr2 = _traces(samples, scale)
    num = (1.0 - 2.0 / d) * tr2 + tr ** 2
    den = (l + 1.0 - 2.0 / d) * (tr2 - tr ** 2 / d)
    return jnp.where(den > 0, jnp.clip(num / jnp.where(den > 0, den, 1.0), 0.0, 1.0), 1.0)


def rblw_rho(samples, scale=1.0) -> Array:
    """Rao-Blackwellised Ledoit-Wolf weight on the target (Chen et al. 2010, Eq. 17), in [0, 1]."""
    l, d = samples.shape
    tr, tr2 = _traces(samples, scale)
    num = (l - 2.0) / l * tr2 + tr ** 2
    den = (l + 2.0) * (tr2 - tr ** 2 / d)
    return jnp.where(den > 0, jnp.clip(num / jnp.where(den > 0, den, 1.0), 0.0, 1.0), 1.0)


def rho_from_weight(rho_l, num_draws: int) -> Array:
    """The DP's rho giving target weight ``rho_l`` after ``num_draws`` draws: ``(1/rho_l - 1)/(l - 1)``."""
    if num_draws < 2:
        return jnp.zeros_like(jnp.asarray(rho_l))
    return (1.0 / jnp.maximum(rho_l, 1e-6) - 1.0) / (num_draws - 1)


def precision_diagonal(samples, shrinkage, scale=1.0) -> Array:
    """diag(Sigma_hat^-1) by Woodbury on the l x l Gram matrix (O(l^2 d + l^3), no d x d matrix).

    Floored at 1e-6 / rho_l (float rounding when a coordinate is dominated by the spread of the draws).
    """
    samples = jnp.asarray(samples)
    l, d = samples.shape
    rho_l = 1.0 / (1.0 + (l - 1) * shrinkage)
    B = (samples - _column_mean(samples)) * jnp.sqrt((1.0 - rho_l) * scale / max(l - 1, 1))
    # B B' = U diag(lam) U': diag(B' (rho_l I + B B')^-1 B) = sum_j (U'B)_j^2 / (rho_l + lam_j), each term
    # below 1, so far-spread draws give a small precision, never an overflow
    lam, U = jnp.linalg.eigh(B @ B.T)
    C = U.T @ B
    frac = (C * C) / (rho_l + jnp.maximum(lam, 0.0))[:, None]
    return jnp.maximum(1.0 - jnp.ones((l,), samples.dtype) @ frac, 1e-6) / rho_l


def drift_ratio(samples):
    """``(ratio, trend)``: ``ratio = ||m_2 - m_1||^2 / ((2 / h) tr S_w)``, how far the means of the first
    and last ``h = l // 2`` draws lie apart against what the draws' own spread allows (``S_w`` the
    covariance pooled within the two halves, divisor ``2h - 2``), and ``trend = 6 h^2 / (h + 1)``, the
    ratio of draws on a straight line at constant speed (no spread about it). Independent draws of
    one distribution score about 1 (F-distributed), a settled but autocorrelated chain a few times
    that, a chain still travelling toward its mode close to ``trend``. ``(0, inf)`` below 4 draws (no
    test); collapsed draws whose halves differ score far above any limit."""
    l = samples.shape[0]
    h = l // 2
    if h < 2:
        return jnp.zeros((), samples.dtype), jnp.full((), jnp.inf, samples.dtype)
    a, b = samples[:h], samples[l - h:]
    m1, m2 = jnp.mean(a, 0), jnp.mean(b, 0)
    within = (jnp.sum(jnp.square(a - m1)) + jnp.sum(jnp.square(b - m2))) / (2 * h - 2)
    gap = jnp.sum(jnp.square(m2 - m1))
    ratio = jnp.where(gap > 0, gap / jnp.maximum(within * 2.0 / h, jnp.finfo(samples.dtype).tiny), 0.0)
    return ratio.astype(samples.dtype), jnp.asarray(6.0 * h * h / (h + 1), samples.dtype)


def drift_spread_ratio(samples, grad_fn, scale):
    """``scale * s_u * c_u``: how far a chain's draws spread along their drift direction against the
    local posterior's spread there. ``u`` is the unit vector from the mean of the first ``h = l // 2``
    draws, ``m_1``, to that of the last ``h``, ``m_2``; ``s_u`` the draws' variance along ``u`` (divisor
    ``l - 1``); ``c_u = (g(m_2) - g(m_1)) . (m_2 - m_1) / ||m_2 - m_1||^2`` the secant curvature of the
    client's mean loss (``grad_fn`` its gradient) over the segment the chain travelled. At the mean-loss
    scale (``scale = N_k``, FedPA's convention) a Gaussian sub-posterior's variance along ``u`` is
    ``1 / c_u`` when ``u`` is one of its axes, so about 1 or below for draws of the posterior moving
    along a direction the data pin down; draws travelling toward their mode along such a direction
    spread far wider (on the Fashion-MNIST MLP of benchmarks/dual.py, 8 to 34 on its clients of 1,189
    and 2,555 rows); a chain creeping along a direction the client's data hardly constrain (prior share
    only) stays about 1 or below (digits softmax regression: 0.04 to 1.1). A non-positive curvature (a concave
    stretch) gives 0. Below 4 draws: 0."""
    l = samples.shape[0]
    h = l // 2
    if h < 2:
        return jnp.zeros((), samples.dtype)
    m1, m2 = jnp.mean(samples[:h], 0), jnp.mean(samples[l - h:], 0)
    du = m2 - m1
    sq = jnp.sum(du * du)
    safe = jnp.where(sq > 0, sq, 1.0)
    curvature = jnp.dot(grad_fn(m2) - grad_fn(m1), du) / safe
    proj = (samples - _column_mean(samples)) @ du / jnp.sqrt(safe)
    s_u = jnp.sum(proj * proj) / (l - 1)
    ratio = jnp.where((sq > 0) & (curvature > 0), scale * s_u * curvature, 0.0)
    return ratio.astype(samples.dtype)


__all__ = ["DeltaState", "delta_init", "delta_update", "delta_value", "delta", "dense_delta",
           "oas_rho", "rblw_rho", "rho_from_weight", "precision_diagonal", "drift_ratio", "drift_spread_ratio"]
