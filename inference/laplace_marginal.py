"""Laplace-marginal of a client's global block: the local sites integrated out by a Laplace step.

A model with client-local sites has the flat vector ``z = (g, l)`` (global
block first, :mod:`fedprob.potential`). The client's target ``log pi(g, l)``
(:meth:`~fedprob.potential.Potential.log_density`: its share of the global
prior, the whole ``p(l | g)``, its likelihood and any Gaussian cavity term) is
turned into a target of ``g`` alone by integrating ``l`` with a Laplace step
at each ``g``:

    f(g) = log pi(g, l*(g)) - t/2 log det A(g) + d_l/2 log(2 pi),
    l*(g) = argmax_l log pi(g, l),   A(g) = -d^2/dl^2 log pi(g, l*(g)).

with ``t`` the target's likelihood weight (1 untempered: a tempered client
``t (log p(l | g) + log p(D | g, l))`` gets ``t`` times the untempered
log-integral, up to a constant). The client's Gaussian of ``g`` is the Laplace approximation of ``f``: mean
``g* = argmax f``, precision ``-hess f(g*)``; its local sites given ``g`` are
``l | g ~ N(l*(g*) + B (g - g*), A(g*)^-1)`` with ``B = dl*/dg = A^-1
d^2 log pi / dl dg`` (a :class:`~fedprob.posteriors.LocalConditional`).

Why not the joint mode. The Schur complement of the joint Hessian at the
joint mode is the curvature of the *profile* ``max_l log pi(g, l)``: it drops
``-1/2 log det A(g)``. Where the local block's curvature depends on ``g``
(a hierarchical scale ``sigma``: ``a_k ~ N(mu, sigma)`` or ``a_k = mu + sigma
z_k``) that term is the normalizer ``-log sigma`` of each client's
contribution, and without it the scale's posterior runs off to the prior's
tail (measured: ``sigma_a`` 3.2 against 0.62 under NUTS, 25 weekly clients of
bike-sharing data). On a linear-Gaussian model (``A`` free of ``g``) both
agree and are exact.

Computation. ``l*(g)`` by damped Newton steps in ``l`` (no derivative),
then one Newton step that is differentiated: at a fixed point of Newton's
map it gives ``l*`` with its exact first derivative in ``g``, so ``grad f``
(reverse mode, third derivatives of ``log pi`` through the log-determinant)
is exact at convergence. ``hess f`` is the central difference of ``grad f``
(``2 d_g`` gradients, vmapped; relative step ``fd_step``), so no fourth
derivative is compiled. ``g*`` by saddle-free Newton steps on ``f``
(eigenvalues of ``-hess f`` taken in absolute value, ``outer_steps``) with a
backtracking line search. Meant for the small global and local blocks of
hierarchical models (:data:`MAX_LOCAL_DIM`, :data:`MAX_GLOBAL_DIM`); larger
ones use the joint Laplace.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from fedprob.posteriors import Gaussian, LocalConditional

Array = jax.Array

#: largest local block integrated by the Laplace-marginal (its d_l x d_l Hessian at every Newton step)
MAX_LOCAL_DIM = 64
#: largest global block whose Hessian of f is formed (d_g evaluations of the nested solve)
MAX_GLOBAL_DIM = 128

_STEPS = jnp.asarray([1.0, 0.5, 0.25, 0.1, 0.03, 0.01])


def _sym(a):
    return 0.5 * (a + a.T)


def _positive(A, floor):
    """``A`` symmetrised with eigenvalues raised to ``floor`` (a Newton matrix that is a descent step)."""
    w, V = jnp.linalg.eigh(_sym(A))
    return (V * jnp.maximum(w, floor)) @ V.T


def applies(potential) -> bool:
    """Whether the Laplace-marginal is used for this model (client-local sites, small blocks)."""
    return bool(potential.local_sites) and potential.dim_local <= MAX_LOCAL_DIM and \
        potential.dim_global <= MAX_GLOBAL_DIM


def laplace_marginal(potential, target, start: Array, *, outer_steps: int = 15, inner_steps: int = 12,
                     refine_steps: int = 4, fd_step: float = None, min_precision: float = 1e-6):
    """``(Gaussian of g, joint mode (g*, l*), LocalConditional, diagnostics)`` of the client's target
    (module docstring), Newton's searches starting at ``start`` = (g0, l0); ``refine_steps``: Newton
    steps of the warm-started inner solve at each new ``g``; ``fd_step``: the difference step of
    ``hess f`` (None: 1e-4 in float64, 3e-3 in float32)."""
    dg = potential.dim_global
    dl = start.shape[0] - dg
    dtype = start.dtype
    steps = _STEPS.astype(dtype)
    h = fd_step if fd_step is not None else (1e-4 if dtype == jnp.float64 else 3e-3)

    def logp(g, l):
        return potential.log_density(jnp.concatenate([g, l]), target)

    weight = jnp.asarray(target.likelihood_weight, dtype)

    def newton_l(g, l):
        """One damped Newton step in ``l`` (the best of a few step lengths that raises log pi)."""
        grad = jax.grad(logp, 1)(g, l)
        A = -jax.hessian(logp, 1)(g, l)
        step = jnp.linalg.solve(_positive(A, min_precision), grad)
        vals = jax.vmap(lambda t: logp(g, l + t * step))(steps)
        vals = jnp.where(jnp.isfinite(vals), vals, -jnp.inf)
        best = jnp.argmax(vals)
        return jnp.where(vals[best] >= logp(g, l), l + steps[best] * step, l)

    def solve_l(g, l0, n):
        l, _ = jax.lax.scan(lambda l, _: (newton_l(g, l), None), l0, None, length=n)
        return l

    def marginal(g, ls):
        """f at ``g`` from the converged ``ls`` = l*(g): one differentiated Newton step, so the
        gradient in ``g`` is exact."""
        ls = jax.lax.stop_gradient(ls)
        grad = jax.grad(logp, 1)(g, ls)
        A = _sym(-jax.hessian(logp, 1)(g, ls))
        l = ls + jnp.linalg.solve(A, grad)
        _, logdet = jnp.linalg.slogdet(_sym(-jax.hessian(logp, 1)(g, l)))
        # a tempered target t (log p(l | g) + log p(D | g, l)) has A = t A_1: the marginal of the
        # tempered model is t times the untempered log-integral, whose log-determinant term is t/2 log det A_1
        return logp(g, l) - 0.5 * weight * logdet + 0.5 * dl * math.log(2 * math.pi)

    grad_f = jax.grad(marginal)

    def value_at(g, l0):
        ls = solve_l(g, l0, refine_steps)
        return marginal(g, ls), ls

    def hess_f(g, ls):
        """Central differences of grad f (each point's l* warm-started at ``ls``): (d_g, d_g)."""
        scale = h * jnp.maximum(1.0, jnp.abs(g))
        E = jnp.diag(scale)
        pts = jnp.concatenate([g + E, g - E])
        grads = jax.vmap(lambda p: grad_f(p, solve_l(p, ls, refine_steps)))(pts)
        H = (grads[:dg] - grads[dg:]) / (2 * scale[:, None])
        return _sym(H)

    def outer(carry, last):
        """f, its gradient and -hess f at the current g, then (unless ``last``) a saddle-free
        Newton step with a line search; evaluating before stepping lets the final point's values come
        from the same compiled body."""
        g, ls = carry
        val = marginal(g, ls)
        grad = grad_f(g, ls)
        P = -hess_f(g, ls)
        w, V = jnp.linalg.eigh(P)
        w = jnp.maximum(jnp.abs(w), jnp.maximum(min_precision, 1e-8 * jnp.max(jnp.abs(w))))
        step = V @ ((V.T @ grad) / w)
        cand, lc = jax.vmap(lambda t: value_at(g + t * step, ls))(steps)
        cand = jnp.where(jnp.isfinite(cand), cand, -jnp.inf)
        best = jnp.argmax(cand)
        ok = (cand[best] >= val) & ~last
        new = (jnp.where(ok, g + steps[best] * step, g), jnp.where(ok, lc[best], ls))
        return new, (val, grad, P, jnp.where(ok, cand[best] - val, 0.0))

    g0 = start[:dg]
    ls0 = solve_l(g0, start[dg:], inner_steps)
    last = jnp.arange(outer_steps + 1) == outer_steps
    (g, ls), (vals, grads, Ps, gains) = jax.lax.scan(outer, (g0, ls0), last)
    val, grad, P = vals[-1], grads[-1], Ps[-1]
    w, V = jnp.linalg.eigh(P)
    nclip = jnp.sum((~(w >= min_precision)).astype(jnp.int32))
    P = _sym((V * jnp.where(w >= min_precision, w, min_precision)) @ V.T)
    # the local block given g at the mode: l*(g) ~ l* + B (g - g*), B = A^-1 d2 log pi / dl dg
    A = _positive(-jax.hessian(logp, 1)(g, ls), min_precision)
    cross = jax.jacfwd(jax.grad(logp, 1), 0)(g, ls)                     # (d_l, d_g)
    slope = jnp.linalg.solve(A, cross)
    cov = _sym(jnp.linalg.inv(A))
    finite = jnp.isfinite(val) & jnp.all(jnp.isfinite(P)) & jnp.all(jnp.isfinite(g))
    nan = lambda x: jnp.where(finite, x, jnp.nan)
    g_gauss = Gaussian(nan(P @ g), nan(P))
    cond = LocalConditional(nan(g), nan(ls), nan(slope), nan(cov))
    diagnostics = {"grad_norm": jnp.linalg.norm(grad), "loss": -val, "num_clipped": nclip,
                   "last_gain": gains[-2]}
    return g_gauss, nan(jnp.concatenate([g, ls])), cond, diagnostics


__all__ = ["laplace_marginal", "applies", "MAX_LOCAL_DIM", "MAX_GLOBAL_DIM"]
