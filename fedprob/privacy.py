"""Client-level differential privacy: clipping, Gaussian noise and an RDP accountant.

:class:`GaussianDP` is a message transform the local engine applies to the
round's messages before aggregation (DP-FedAvg, McMahan et al. 2018). For
every participant the update part of its message (what the algorithm's
:meth:`~fedprob.algorithms.base.Algorithm.update_part` names: FedAvg/FedProx
their delta ``w - w_k``, FedPA its delta, the natural-parameter methods
(PVI, FedLap, FedLap-Cov, BayesADMM, ADMM) their delta ``lambda_k - lambda_g``,
of which every server term is a function) is clipped to L2 norm at most
``clip_norm`` C (jointly over its leaves) and Gaussian noise is added. The
noise is split over the M' aggregated clients, each adding
``N(0, sigma^2 C^2 / M')`` to its own clipped update, so the SUM the server
aggregates carries exactly ``N(0, sigma^2 C^2)`` (``sigma`` =
``noise_multiplier``), the Gaussian mechanism on a sum of sensitivity C.
Under DP the server averages with equal weights (sizes N_k would let one
client's size move every term), i.e. the aggregate is
``(sum_k clip(delta_k) + N(0, sigma^2 C^2)) / M'``.

What the guarantee covers. The accountant (:func:`epsilon`, from
``dp-accounting``'s RDP accountant) treats each round as the Poisson
subsampled Gaussian mechanism with sampling rate ``q = M / K``
(``clients_per_round / num_clients``), composed over the rounds run, under
add/remove-one-client adjacency: the usual accounting of DP-FedAvg (the
engine samples exactly M clients per round, for which Poisson accounting is
the standard approximation). It protects what the server releases (its
state and the posterior built from it) assuming the server sees only the
aggregate (secure aggregation): each single noisy message carries only
``sigma C / sqrt(M')`` of noise. Message leaves outside the update are not
sent: an algorithm's ``with_update`` replaces them by data-independent values
(FedPA's precision diagonal becomes 1). ``history`` reports
``dp_epsilon`` and ``dp_delta`` after every round.

Requires the optional extra ``pip install fedprob[privacy]`` (dp-accounting).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from .faults import tree_norm
from .validation import check_positive
from .names import CheckedKeywords

#: RDP orders of the accountant (integers: exact and fast for every sampling rate).
ORDERS = tuple(range(2, 129)) + (160, 192, 256, 512)

#: fold_in tag of the privacy noise (independent of selection, client and fault keys).
NOISE_TAG = 0x0D9


@dataclasses.dataclass(frozen=True)
class GaussianDP(CheckedKeywords):
    """Per-client clipping to ``clip_norm`` and Gaussian noise ``noise_multiplier * clip_norm`` on the sum.

    delta: the delta of the reported (epsilon, delta).
    """

    clip_norm: float
    noise_multiplier: float
    delta: float = 1e-5

    def __post_init__(self):
        from .extras import require

        require("privacy", "fp.GaussianDP(...)")
        check_positive("clip_norm", self.clip_norm)
        check_positive("noise_multiplier", self.noise_multiplier, allow_zero=True)
        if not 0 < float(self.delta) < 1:
            raise ValueError(f"delta must lie in (0, 1), got {self.delta!r}")


def check_supported(algorithm) -> None:
    """ValueError unless ``algorithm`` names the update part of its messages."""
    if type(algorithm).update_part is _base_update_part():
        raise ValueError(f"{type(algorithm).__name__} does not name an update to clip; differential "
                         "privacy supports FedAvg, FedProx, FedPA and the natural-parameter methods "
                         "(PVI, FedLap, FedLapCov, BayesADMM, ADMM)")


def _base_update_part():
    from .algorithms.base import Algorithm

    return Algorithm.update_part


def clip(update, clip_norm):
    """``update`` scaled to L2 norm at most ``clip_norm`` (jointly over its leaves)."""
    n = tree_norm(update)
    factor = jnp.minimum(1.0, clip_norm / jnp.maximum(n, 1e-30))
    return jax.tree_util.tree_map(lambda a: (a * factor).astype(a.dtype), update)


def privatize(algorithm, ctx, messages, mask, key, dp: GaussianDP):
    """The M messages with clipped, noised updates (noise std ``sigma C / sqrt(sum(mask))`` each)."""
    count = jnp.maximum(jnp.sum(mask), 1).astype(jnp.float32)
    std = dp.noise_multiplier * dp.clip_norm / jnp.sqrt(count)
    M = mask.shape[0]
    keys = jax.random.split(jax.random.fold_in(key, NOISE_TAG), M)

    def one(message, k):
        part = algorithm.update_part(ctx, message)
        if part is None:
            raise ValueError(f"{type(algorithm).__name__} names no update to clip in this configuration "
                             "(its server also averages the client posteriors); differential privacy "
                             "supports the PVI-type configurations (alpha = 1)")
        upd = clip(part, dp.clip_norm)
        leaves, treedef = jax.tree_util.tree_flatten(upd)
        ks = jax.random.split(k, max(len(leaves), 1))
        noisy = [a + (std * jax.random.normal(kk, a.shape)).astype(a.dtype) for a, kk in zip(leaves, ks)]
        return algorithm.with_update(ctx, message, jax.tree_util.tree_unflatten(treedef, noisy))

    return jax.vmap(one)(messages, keys)


@functools.lru_cache(maxsize=256)
def epsilon(noise_multiplier: float, sampling_rate: float, rounds: int, delta: float) -> float:
    """epsilon of ``rounds`` Poisson-subsampled Gaussian rounds at ``delta`` (dp-accounting RDP, :data:`ORDERS`)."""
    from .extras import require

    require("privacy", "differential privacy accounting")
    import dp_accounting
    if noise_multiplier == 0:
        return math.inf
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(float(sampling_rate),
                                            dp_accounting.GaussianDpEvent(float(noise_multiplier))),
        int(rounds))
    acc = dp_accounting.rdp.RdpAccountant(list(ORDERS))
    acc.compose(event)
    return float(acc.get_epsilon(float(delta)))


__all__ = ["GaussianDP", "clip", "privatize", "epsilon", "check_supported"]
