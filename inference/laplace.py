"""Laplace approximation of one client's target at its MAP.

``q(z) = N(m, P^-1)`` with ``m`` the mode of the client's **full** target
``log pi(z) = prior_weight log p0(z) + likelihood_weight log p(D_k|z)
+ linear . z - z' Lambda z / 2`` (found by :func:`fedprob.inference.optim.minimize`
on the mean loss ``-log pi / n``; full-batch L-BFGS by default) and ``P`` a
curvature of ``-log pi`` at ``m`` over the whole client data (not one
minibatch):

* ``"full"``: ``P = -hess log pi(m)``, symmetrised; (d, d), cost d HVPs and
  d^2 memory.
* ``"diag"``: the exact diagonal of ``-hess log pi(m)`` from d Hessian-vector
  products (one linearisation of the gradient, ``chunk_size`` basis vectors
  at a time): cost about d gradient evaluations, memory ``chunk_size * d``;
  no d x d matrix is formed.
* ``"ggn"`` / ``"diag_ggn"``: generalized Gauss-Newton. The likelihood part is
  ``likelihood_weight * sum_i J_i' H_i J_i`` with ``eta_i`` the natural
  parameters of observation i's distribution (logits for Bernoulli and
  Categorical, ``(loc / s^2, -1 / (2 s^2))`` for Normal, log rate for
  Poisson), ``J_i = d eta_i / dz`` and ``H_i`` the Hessian of
  ``-log p(y_i | eta_i)`` in ``eta_i`` (the log-partition Hessian: PSD and
  free of ``y``). With a Normal of fixed scale this is ``J_loc' J_loc / s^2``.
  The prior and Gaussian-term curvature is added exactly (for "diag_ggn"
  and a prior whose Hessian is diagonal, with one Hessian-vector product:
  :func:`prior_curvature_diag`). For a canonical
  link (linear ``eta``) the GGN equals the Hessian. Rows are processed
  ``chunk_size`` at a time (Jacobian memory ``chunk_size * K * d``), each
  row's Jacobian by K reverse passes (or d forward passes over the chunk when
  ``d <= K``). The diagonal forms no Jacobian: K reverse passes per row with
  the columns of a square root of ``H_i`` as cotangents, or, by default for
  networks whose rows' Jacobians are large, one pass per row with a sampled
  label (a Monte Carlo Fisher, unbiased; ``fisher_samples``, :func:`ggn_likelihood`). Where no closed form exists (another likelihood, a mask, a
  ``numpyro.factor``, several observed sites: :func:`ggn_supported`) the
  exact curvature is used instead ("full" / "diag"), so any likelihood
  NumPyro can score has a Laplace client.

Guard: precisions below ``min_precision`` (diagonal entries, or eigenvalues
of a full matrix) are raised to it; their count is ``num_clipped``.

Output: :class:`~fedprob.posteriors.Gaussian` with ``linear = P m`` and
``precision = P`` (vector for the diagonal variants, matrix otherwise);
``params = m``; diagnostics ``final_loss`` (mean loss at ``m``), ``grad_norm``
(its gradient norm), ``num_clipped``, ``num_rejected`` (optimizer steps
rejected as non-finite), ``num_steps`` (optimizer steps taken: the full-batch
search stops once its loss stalls), ``finite``.

The MAP search left unset (no ``optimizer``, ``learning_rate`` or
``batch_size``) follows the client's size (:func:`map_search_settings`):
full-batch L-BFGS while one gradient over the client's padded rows costs at
most :data:`FULL_BATCH_MAX_WORK` row-parameters (regressions, small
networks: the exact mode), Adam from :data:`AUTO_LEARNING_RATE` decayed to 0
on minibatches of :data:`AUTO_BATCH_SIZE` rows beyond (a network on thousands of rows:
full-batch L-BFGS took 178 s a round on the Fashion-MNIST MLP of
benchmarks/dual.py, 10 clients of up to 2,555 rows, 178,110 weights).
"""
from __future__ import annotations

import dataclasses
from functools import partial
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
import optax
from numpyro.distributions.distribution import ExpandedDistribution, Independent

from fedprob import inputs
from fedprob.potential import minibatch

from fedprob.posteriors import Gaussian
from fedprob.protocols import ClientBackend, ClientResult, finite_flag
from .dense_check import check_fits
from .optim import OPTIMIZERS, minimize

HESSIANS = ("full", "diag", "ggn", "diag_ggn")


# -- generic curvature ------------------------------------------------------------------------
def hessian_full(fn, z):
    """``hess fn(z)`` (d, d), symmetrised."""
    h = jax.hessian(fn)(z)
    return 0.5 * (h + h.T)


def hessian_diag(fn, z, chunk_size: int = 32):
    """Exact diagonal of ``hess fn(z)`` from d Hessian-vector products, ``chunk_size`` at a time."""
    d = z.shape[0]
    _, hvp = jax.linearize(jax.grad(fn), z)

    def one(i):
        e = jnp.zeros((d,), z.dtype).at[i].set(1.0)
        return hvp(e)[i]

    return jax.lax.map(one, jnp.arange(d), batch_size=min(chunk_size, d))


_DIAGONAL_PRIORS: dict = {}


def prior_hessian_is_diagonal(potential) -> bool:
    """Whether ``hess log p0`` of the model prior is diagonal (independent, elementwise sites).

    Checked once per potential, at trace time, at two fixed points ``z``
    (entries ``N(0, 1)``, drawn once by numpy): with ``D = H 1`` (the row
    sums) the Hessian is diagonal exactly when ``H v = D * v`` for a
    Gaussian probe ``v``; an off-diagonal entry makes the two differ with
    probability one. Hierarchical priors (a weight's scale drawn from
    another site) and multivariate sites fail the check.
    """
    key = (potential, bool(jax.config.jax_enable_x64))
    hit = _DIAGONAL_PRIORS.get(key)
    if hit is None:
        rng = np.random.default_rng(0)
        d = potential.dim
        z = rng.normal(size=(2, d))
        v = rng.normal(size=(2, d))
        dt = jnp.result_type(float)
        with jax.ensure_compile_time_eval():        # concrete even when called while tracing
            row_sums, hv = map(np.asarray, _prior_hvps(potential, jnp.asarray(z, dt), jnp.asarray(v, dt)))
        dv = row_sums * v
        tol = 1e-4 * (1.0 + np.abs(hv) + np.abs(dv) + np.abs(row_sums))
        hit = _DIAGONAL_PRIORS[key] = bool(np.all(np.abs(hv - dv) <= tol) and np.all(np.isfinite(hv)))
    return hit


@partial(jax.jit, static_argnums=0)
def _prior_hvps(potential, z, v):
    """``(H 1, H v)`` of ``log p0`` at each row of ``z`` (one compiled program, not op-by-op)."""
    def one(zz, vv):
        _, hvp = jax.linearize(jax.grad(potential.log_prior), zz)
        return hvp(jnp.ones_like(zz)), hvp(vv)

    return jax.vmap(one)(z, v)


def prior_curvature_diag(potential, z, chunk_size: int = 32):
    """Diagonal of ``-hess log p0(z)``: one Hessian-vector product when
    :func:`prior_hessian_is_diagonal` (then ``H 1`` is the diagonal), else
    :func:`hessian_diag` (d products: quadratic in d)."""
    def neg_log_prior(x):
        return -potential.log_prior(x)

    if prior_hessian_is_diagonal(potential):
        _, hvp = jax.linearize(jax.grad(neg_log_prior), z)
        return hvp(jnp.ones_like(z))
    return hessian_diag(neg_log_prior, z, chunk_size)


#: Above this many parameters :func:`hessian_diag_estimate` switches from the exact diagonal
#: (d Hessian-vector products) to a Hutchinson estimate with ``NUM_PROBES`` products.
EXACT_DIAG_MAX_DIM = 512
NUM_PROBES = 64


def hessian_diag_estimate(fn, z, key, max_exact_dim: int = EXACT_DIAG_MAX_DIM,
                          num_probes: int = NUM_PROBES, chunk_size: int = 32):
    """Diagonal of ``hess fn(z)`` at a cost that does not grow with d.

    Exact (:func:`hessian_diag`) for ``d <= max_exact_dim``; above, the
    Hutchinson estimate ``mean_j v_j * (H v_j)`` over ``num_probes``
    Rademacher vectors ``v_j`` (unbiased; entry i has variance
    ``sum_{k != i} H_ik^2 / num_probes``), floored at ``1e-3`` times its
    mean absolute value so that a noisy entry never comes out non-positive.
    Used to set scales (starting curvatures, preconditioners) that later
    iterations refine, not as a posterior precision.
    """
    d = z.shape[0]
    if d <= max_exact_dim:
        return hessian_diag(fn, z, chunk_size)
    _, hvp = jax.linearize(jax.grad(fn), z)
    probes = jax.random.rademacher(key, (num_probes, d), z.dtype)
    est = jnp.mean(jax.lax.map(lambda v: v * hvp(v), probes, batch_size=min(chunk_size, num_probes)), 0)
    return jnp.maximum(est, 1e-3 * jnp.mean(jnp.abs(est)))


# -- natural parameters of the observation distribution ------------------------------------------
def _unwrap(fn):
    """(innermost distribution, full per-site shape batch + event) through Independent/Expanded."""
    shape = tuple(fn.batch_shape) + tuple(fn.event_shape)
    while isinstance(fn, (Independent, ExpandedDistribution)):
        fn = fn.base_dist
    return fn, shape


def natural_parameters(fn):
    """``(eta, build)`` for an observation distribution.

    ``eta``: (n, M) natural parameters per row (rows = leading axis);
    ``build(e)`` maps any (r, M) block of rows back to a distribution over
    those rows (its ``log_prob`` summed over the trailing axes is the rows'
    log likelihood under ``fn``). Supported families: Bernoulli,
    Categorical, Normal, Poisson (optionally wrapped in Independent /
    expand).
    """
    base, shape = _unwrap(fn)
    n = shape[0]

    def flat(a):
        return a.reshape((n, -1))

    def rows(e, tail=()):
        # build() accepts any number of rows r: (r, M) -> (r,) + per-row shape.
        return e.reshape((e.shape[0],) + shape[1:] + tail)

    if isinstance(base, (dist.BernoulliLogits, dist.BernoulliProbs)):
        if isinstance(base, dist.BernoulliLogits):
            logits = base.logits
        else:
            logits = jax.scipy.special.logit(base.probs)
        eta = flat(jnp.broadcast_to(logits, shape))
        return eta, lambda e: dist.BernoulliLogits(rows(e))
    if isinstance(base, (dist.CategoricalLogits, dist.CategoricalProbs)):
        logits = base.logits if isinstance(base, dist.CategoricalLogits) else jnp.log(base.probs)
        tail = (logits.shape[-1],)
        eta = flat(jnp.broadcast_to(logits, shape + tail))
        return eta, lambda e: dist.CategoricalLogits(rows(e, tail))
    if isinstance(base, dist.Normal):
        var = jnp.broadcast_to(base.scale, shape) ** 2
        loc = jnp.broadcast_to(base.loc, shape)
        eta = jnp.concatenate([flat(loc / var), flat(-0.5 / var)], axis=1)

        def build(e):
            e1, e2 = jnp.split(e, 2, axis=1)
            v = -0.5 / e2
            return dist.Normal(rows(e1 * v), rows(jnp.sqrt(v)))

        return eta, build
    if isinstance(base, dist.Poisson):
        eta = flat(jnp.log(jnp.broadcast_to(base.rate, shape)))
        return eta, lambda e: dist.Poisson(jnp.exp(rows(e)))
    raise ValueError(
        f"hessian='ggn' does not support the observation distribution {type(base).__name__}; "
        "supported: Bernoulli, Categorical, Normal, Poisson. Use hessian='full' or 'diag'.")


def _check_ggn(potential) -> None:
    if len(potential.observed) != 1:
        raise ValueError(f"hessian='ggn' needs exactly one observed site, the model has "
                         f"{list(potential.observed)}; use hessian='full' or 'diag'")


def ggn_supported(potential) -> bool:
    """True when the closed-form GGN applies: one observed site whose distribution
    :func:`natural_parameters` knows (checked abstractly at one real row, no FLOPs). Otherwise
    (a Student-t, a zero-inflated or masked likelihood, a ``numpyro.factor``, several observed
    sites) :func:`curvature` uses the exact Hessian of the same target instead."""
    cached = getattr(potential, "_ggn_supported", None)
    if cached is not None:
        return cached
    ok = len(potential.observed) == 1
    if ok:
        try:
            jax.eval_shape(lambda z: natural_parameters(
                potential.predictive_distribution(z, potential.example_X()))[0],
                jax.ShapeDtypeStruct((potential.dim,), jnp.float32))
        except (ValueError, TypeError, NotImplementedError, AttributeError):
            ok = False
    try:
        potential._ggn_supported = ok
    except AttributeError:
        pass
    return ok


#: The diagonal GGN is computed exactly while a row's Jacobian ``d eta_i / dz`` has at most this many
#: entries (outputs per row M times parameters d); above, by default, as a Monte Carlo Fisher
#: (:func:`ggn_likelihood`): one reverse pass per row instead of M.
EXACT_GGN_MAX_JACOBIAN = 2 ** 20


def fisher_sample_count(num_outputs: int, dim: int, fisher_samples=None) -> int:
    """Sampled labels per row for the diagonal GGN: ``fisher_samples`` when given (0: exact), else 0
    when ``num_outputs * dim <= EXACT_GGN_MAX_JACOBIAN`` or a row has a single output, else 1."""
    if fisher_samples is not None:
        return int(fisher_samples)
    return 0 if num_outputs <= 1 or num_outputs * dim <= EXACT_GGN_MAX_JACOBIAN else 1


def ggn_likelihood(potential, z, X, y, weights, diagonal: bool = False, chunk_size: int = 32,
                   fisher_samples=None, key=None):
    """``sum_i w_i J_i' H_i J_i`` over rows (see the module docstring), (d, d) or (d,).

    Chunks of ``chunk_size`` rows after the last row of nonzero weight (a
    client's padding) are skipped: a loop of ``ceil(rows / chunk_size)``
    steps, so a client alone (``fp.run(..., client_chunk=1)``) costs its own
    rows; under ``vmap`` the loop runs to the largest client's count.

    Diagonal with ``S = fisher_sample_count(M, d, fisher_samples) > 0`` (and a ``key``): the Monte
    Carlo Fisher ``sum_i w_i mean_s (J_i' u_is)^2`` with ``u_is = grad_eta log p(y~_is | eta_i)`` at
    labels ``y~_is`` drawn from the model's own predictive at ``z``. In natural parameters the
    score's covariance is the log-partition Hessian, ``E[u u'] = H_i``, so the estimate is unbiased
    for the exact diagonal at a cost of S reverse passes per row instead of M (one per output). Its
    relative error on parameter j is about ``sqrt(2 / (S n_j))`` for n_j rows that move it alike;
    it is the default only where the exact Jacobians are large (:data:`EXACT_GGN_MAX_JACOBIAN`).
    """
    _check_ggn(potential)
    n = y.shape[0]
    c = max(1, min(chunk_size, n))
    n_pad = -(-n // c) * c
    if n_pad > n:
        pad = n_pad - n
        X = jax.tree_util.tree_map(lambda a: jnp.concatenate([a, jnp.repeat(a[:1], pad, 0)]), X)
        y = jnp.concatenate([y, jnp.repeat(y[:1], pad, 0)])
        weights = jnp.concatenate([weights, jnp.zeros((pad,), weights.dtype)])
    Xc = jax.tree_util.tree_map(lambda a: a.reshape((n_pad // c, c) + a.shape[1:]), X)
    yc = y.reshape((n_pad // c, c) + y.shape[1:])
    wc = weights.reshape((n_pad // c, c))
    d = z.shape[0]

    def chunk(acc, batch):
        Xb, yb, wb, index = batch

        def eta_fn(zz):
            return natural_parameters(potential.predictive_distribution(zz, Xb))[0]

        def eta_row(zz, x):
            row = jax.tree_util.tree_map(lambda a: a[None], x)
            return natural_parameters(potential.predictive_distribution(zz, row))[0][0]

        eta, build = natural_parameters(potential.predictive_distribution(z, Xb))
        m = eta.shape[1]

        def row_nll(e_row, y_row):
            return -jnp.sum(build(e_row[None]).log_prob(y_row[None]))

        samples = fisher_sample_count(m, d, fisher_samples) if diagonal and d > m and key is not None else 0
        if samples == 0:
            H = jax.vmap(jax.hessian(row_nll))(eta, yb)                    # (c, M, M)
        if diagonal and d > m:
            # diag(J' H J) = sum_a (J' l_a)^2 over cotangents l_a: the columns of a square root of H
            # (exact, M of them) or sampled scores (Monte Carlo Fisher, S of them); each is one
            # reverse pass per row, and no (c, M, d) Jacobian is formed
            if samples > 0:
                ys = build(eta).sample(jax.random.fold_in(key, index), (samples,))           # (S, c, ...)
                cot = jax.vmap(jax.vmap(jax.grad(row_nll)), in_axes=(None, 0))(eta, ys)   # (S, c, M)
                scale = 1.0 / samples
            else:
                lam, V = jnp.linalg.eigh(0.5 * (H + jnp.swapaxes(H, 1, 2)))
                cot = jnp.moveaxis(V * jnp.sqrt(jnp.maximum(lam, 0.0))[:, None, :], 2, 0)  # (M, c, M)
                scale = 1.0

            def score(x, u_row):                  # J_i' u: the gradient of eta_i . u at z
                return jax.grad(lambda zz: jnp.vdot(eta_row(zz, x), u_row))(z)

            def add(total, u):
                g = jax.vmap(score)(Xb, u)                                      # (c, d)
                return total + jnp.einsum("c,cd->d", wb, g * g), None

            return acc + scale * jax.lax.scan(add, jnp.zeros((d,), z.dtype), cot)[0], None
        # forward mode costs d passes over the chunk; reverse mode row by row, M passes per
        # row (a reverse pass over the whole chunk would cost c * M, the chunk's rows being
        # independent)
        if d <= m:
            J = jax.jacfwd(eta_fn)(z)                                       # (c, M, d)
        else:
            J = jax.vmap(lambda x: jax.jacrev(eta_row)(z, x))(Xb)          # (c, M, d)
        HJ = wb[:, None, None] * jnp.einsum("cab,cbd->cad", H, J)          # (c, M, d)
        if diagonal:
            return acc + jnp.sum(J * HJ, axis=(0, 1)), None
        return acc + J.reshape(-1, d).T @ HJ.reshape(-1, d), None

    acc0 = jnp.zeros((d,) if diagonal else (d, d), z.dtype)
    used = jnp.max(jnp.where(weights != 0, jnp.arange(n_pad) + 1, 0))     # rows up to the last weighted one
    out = jax.lax.fori_loop(0, (used + c - 1) // c,
                            lambda i, acc: chunk(acc, (jax.tree_util.tree_map(lambda a: a[i], Xc), yc[i],
                                                       wc[i], i))[0], acc0)
    return out if diagonal else 0.5 * (out + out.T)


def curvature(potential, target, z, hessian: str = "full", chunk_size: int = 32, key=None,
              fisher_samples=None):
    """Precision ``P`` of the Laplace approximation at ``z`` (unclipped).

    ``-hess log_density`` for "full"/"diag"; GGN of the likelihood plus the
    exact prior and Gaussian-term curvature for "ggn"/"diag_ggn". With a
    ``key``, "diag" is :func:`hessian_diag_estimate` (exact up to
    ``EXACT_DIAG_MAX_DIM`` parameters, a Hutchinson estimate above) and
    "diag_ggn" takes its likelihood part as a Monte Carlo Fisher with
    :func:`fisher_sample_count` labels per row (by default only where a row's
    Jacobian exceeds :data:`EXACT_GGN_MAX_JACOBIAN` entries; see :func:`ggn_likelihood`).
    Where no closed-form GGN exists (:func:`ggn_supported` is False) "ggn"
    is "full" and "diag_ggn" is "diag": the exact curvature of the same
    target, so every likelihood NumPyro can score has a Laplace client.
    """
    if hessian not in HESSIANS:
        raise ValueError(f"unknown hessian '{hessian}' (use one of {HESSIANS})")
    if hessian in ("ggn", "diag_ggn") and not ggn_supported(potential):
        hessian = "full" if hessian == "ggn" else "diag"

    def neg_log_density(x):
        return -potential.log_density(x, target)

    if hessian == "full":
        return hessian_full(neg_log_density, z)
    if hessian == "diag":
        if key is not None:
            return hessian_diag_estimate(neg_log_density, z, key, chunk_size=chunk_size)
        return hessian_diag(neg_log_density, z, chunk_size)

    diagonal = hessian == "diag_ggn"
    X, y, w = minibatch(None, target.data, None)
    lik = target.likelihood_weight * ggn_likelihood(potential, z, X, y, w.astype(z.dtype),
                                                    diagonal, chunk_size, fisher_samples, key)

    def neg_log_prior(x):
        # with client-local sites their conditional prior carries the likelihood weight
        return -potential.target_log_prior(x, target)

    lam = target.precision
    if diagonal and potential.local_sites:
        prior = hessian_diag(neg_log_prior, z, chunk_size)
        gauss = lam if lam.ndim == 1 else jnp.diagonal(lam)
    elif diagonal:
        prior = target.prior_weight * prior_curvature_diag(potential, z, chunk_size)
        gauss = lam if lam.ndim == 1 else jnp.diagonal(lam)
    else:
        prior = hessian_full(neg_log_prior, z)
        gauss = jnp.diag(lam) if lam.ndim == 1 else 0.5 * (lam + lam.T)
    return lik + prior + gauss


def runs_off(potential, target, start, z):
    """Whether the search from ``start`` to ``z`` ran off along a direction where the objective
    ``-log density`` is unbounded below: its curvature along ``u = z - start`` is negative,
    ``u' H(z) u < 0`` (one Hessian-vector product on the full batch), **and** so is the Gaussian
    term's, ``u' precision u < 0``.

    A likelihood and prior that are log-concave along ``u`` cannot make the curvature negative, so
    the second condition says the Gaussian term (a dual loop's ``rho S_g - U_k``, not positive
    definite when one client holds more than rho of the curvature in a diagonal family of correlated
    parameters) drives the search off to infinity: e.g. BayesADMM with a diagonal family at
    ``rho = gamma = 1/K`` sent a finite client mean of 1e10 after 200 L-BFGS steps. A network whose
    search stops short of a minimum with a positive definite Gaussian term is never flagged."""
    u = z - start
    lam = target.precision
    gauss = jnp.sum(lam * u * u) if lam.ndim == 1 else u @ (lam @ u)

    def neg_log_density(x):
        return -potential.log_density(x, target)

    _, hu = jax.jvp(jax.grad(neg_log_density), (z,), (u,))
    return (gauss < 0) & (jnp.vdot(u, hu) < 0)


def clip_precision(P, min_precision: float):
    """Raise diagonal entries (vector P) or eigenvalues (matrix P) below ``min_precision``.

    Returns ``(P, number clipped)``; a matrix is rebuilt only when something is clipped.
    """
    if P.ndim == 1:
        low = ~(P >= min_precision)                     # NaN counts as clipped
        return jnp.where(low, min_precision, P), jnp.sum(low.astype(jnp.int32))
    evals, evecs = jnp.linalg.eigh(P)
    low = ~(evals >= min_precision)
    fixed = (evecs * jnp.where(low, min_precision, evals)) @ evecs.T
    fixed = 0.5 * (fixed + fixed.T)
    nlow = jnp.sum(low.astype(jnp.int32))
    return jnp.where(nlow > 0, fixed, P), nlow


#: rows x parameters of one full-batch gradient above which an unset MAP search takes minibatches
#: (2^27: MNIST softmax regression on 6,000-row clients, 4.7e7, keeps full-batch L-BFGS; the
#: Fashion-MNIST MLP on a 2,555-row client, 4.6e8, does not)
FULL_BATCH_MAX_WORK = 2 ** 27
#: minibatch rows and Adam step of the automatic minibatch search
AUTO_BATCH_SIZE = 128
AUTO_LEARNING_RATE = 1e-2


def map_search_settings(optimizer, learning_rate, batch_size, rows: int, dim: int, num_steps: int = 200):
    """``(optimizer, learning_rate, batch_size)`` of a MAP search of ``num_steps`` steps over ``rows``
    (padded) rows and ``dim`` parameters: the given ones when any is set; unset, full-batch L-BFGS
    (all None) while ``rows * dim <= FULL_BATCH_MAX_WORK``, else Adam on ``AUTO_BATCH_SIZE`` rows with
    its step decayed from ``AUTO_LEARNING_RATE`` to 0 over the steps (cosine): a constant step keeps
    the answer jittering about the mode (on a 600-row regression its largest coordinate ends 0.99
    posterior sd from the mode on average over 16 keys, against 0.36 with the decay), and the
    Laplace's linear term ``P m`` carries that jitter."""
    if optimizer is not None or learning_rate is not None or batch_size is not None:
        return optimizer, learning_rate, batch_size
    if rows * dim <= FULL_BATCH_MAX_WORK or rows <= AUTO_BATCH_SIZE:
        return None, None, None
    return optax.adam(optax.cosine_decay_schedule(AUTO_LEARNING_RATE, max(int(num_steps), 1))), None, AUTO_BATCH_SIZE


@dataclasses.dataclass(frozen=True)
class Laplace(ClientBackend):
    """Gaussian at the MAP of the client's full target with curvature ``hessian``.

    hessian: "full", "diag", "ggn" or "diag_ggn" (module docstring).
    num_steps / optimizer / learning_rate / batch_size: the MAP search
    (:func:`fedprob.inference.optim.minimize`; optimizer None = L-BFGS for the
    full batch, Adam for minibatches; all three unset: chosen by the client's
    size, :func:`map_search_settings`). The curvature always uses the full
    client data. min_precision: floor on precisions. chunk_size: basis
    vectors per HVP batch ("diag") and rows per Jacobian batch (GGN).
    local: on a model with client-local sites, how the global block's
    Gaussian is taken: "marginal" (default) integrates the local sites out
    by a Laplace step at every global value
    (:mod:`fedprob.inference.laplace_marginal`; exact Hessians, used where
    the blocks are small, else "joint"), "joint" is the Schur complement of
    the joint Laplace at the joint mode (the profile over the local sites,
    which misses the normalizer of a hierarchical scale).
    fisher_samples ("diag_ggn" only): labels drawn per row for the Monte Carlo
    Fisher (:func:`ggn_likelihood`); None (the default) is exact while a row's
    Jacobian has at most :data:`EXACT_GGN_MAX_JACOBIAN` entries (outputs x
    parameters: logistic and softmax regressions, small networks) and one
    label per row above (networks with many classes: the cost of a row no
    longer grows with the classes); 0 is always exact.
    """

    hessian: str = "full"
    num_steps: int = 200
    optimizer: Any = None
    learning_rate: Optional[float] = None
    batch_size: Optional[int] = None
    min_precision: float = 1e-6
    chunk_size: int = 32
    local: str = "marginal"
    fisher_samples: Optional[int] = None

    init_strategy: str = "center"

    output = "gaussian"

    def __post_init__(self):
        if self.hessian not in HESSIANS:
            raise ValueError(f"unknown hessian '{self.hessian}' (use one of {HESSIANS})")
        if self.num_steps < 0:
            raise ValueError(f"num_steps must be >= 0, got {self.num_steps}")
        if self.batch_size is not None and self.batch_size <= 0:
            raise ValueError(f"batch_size must be positive or None, got {self.batch_size}")
        if isinstance(self.optimizer, str) and self.optimizer.lower() not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer '{self.optimizer}' (use one of {OPTIMIZERS} "
                             "or an optax GradientTransformation)")
        if self.optimizer == "lbfgs" and self.batch_size is not None:
            raise ValueError("optimizer='lbfgs' needs the full batch (batch_size=None)")
        if not (self.min_precision > 0 and math.isfinite(self.min_precision)):
            raise ValueError(f"min_precision must be a positive number, got {self.min_precision}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.local not in ("marginal", "joint"):
            raise ValueError(f"local must be 'marginal' or 'joint', got {self.local!r}")
        if self.fisher_samples is not None and (isinstance(self.fisher_samples, bool)
                                                or not isinstance(self.fisher_samples, (int, np.integer))
                                                or self.fisher_samples < 0):
            raise ValueError(f"fisher_samples must be None (automatic) or an integer >= 0 (0: the exact "
                             f"diagonal GGN), got {self.fisher_samples!r}")

    def search_settings(self, target, dim: int):
        """``(optimizer, learning_rate, batch_size)`` of this backend's MAP search on ``target``."""
        return self.search_settings_for(inputs.num_rows(target.data.X), dim)

    def search_settings_for(self, rows: int, dim: int):
        """``(optimizer, learning_rate, batch_size)`` of this backend's MAP search over ``rows`` (padded)
        rows and ``dim`` parameters (:func:`map_search_settings`)."""
        return map_search_settings(self.optimizer, self.learning_rate, self.batch_size, rows, dim,
                                   self.num_steps)

    def run(self, key, potential, target, init) -> ClientResult:
        if self.hessian in ("full", "ggn"):
            check_fits(f"Laplace(hessian={self.hessian!r})", init.shape[-1], init.dtype,
                       "Use a diagonal curvature: Laplace(hessian='diag_ggn') (or 'diag'), with a diagonal "
                       "family where the algorithm takes one (family='diag'; the natural-parameter methods' "
                       "default client above 100 parameters).")
        optimizer, learning_rate, batch_size = self.search_settings(target, init.shape[-1])
        opt = minimize(potential, target, init, key=key, num_steps=self.num_steps,
                       optimizer=optimizer, learning_rate=learning_rate, batch_size=batch_size)
        # a client whose objective is not finite at its answer has failed: say so with NaN
        # (the engine then leaves it out and reports it) rather than a finite start point;
        # so has one whose objective is unbounded below along the way it went (runs_off)
        off = runs_off(potential, target, init, opt.params)
        m = jnp.where(jnp.isfinite(opt.loss) & ~off, opt.params, jnp.nan)
        P, nclip = clip_precision(curvature(potential, target, m, self.hessian, self.chunk_size,
                                            jax.random.fold_in(key, 1) if self.hessian == "diag_ggn" else None,
                                            self.fisher_samples),
                                  self.min_precision)
        linear = P * m if P.ndim == 1 else P @ m
        post = Gaussian(linear, P)
        diagnostics = {
            "final_loss": opt.loss,
            "grad_norm": opt.grad_norm,
            "num_clipped": nclip,
            "num_rejected": opt.num_rejected,
            "num_steps": opt.num_steps.astype(jnp.result_type(float)),
            "unbounded": off.astype(jnp.result_type(float)),
            "finite": finite_flag(post, m),
        }
        return ClientResult(post, m, diagnostics)


__all__ = ["Laplace", "curvature", "hessian_full", "hessian_diag", "hessian_diag_estimate", "ggn_likelihood",
           "prior_hessian_is_diagonal", "prior_curvature_diag", "fisher_sample_count", "EXACT_GGN_MAX_JACOBIAN",
           "natural_parameters", "clip_precision", "runs_off", "HESSIANS"]
