"""A NumPyro model as a flat log density over unconstrained parameters.

A model is a plain NumPyro program ``model(X, y=None, **model_kwargs)`` whose
likelihood (observed) sites live inside ``numpyro.plate("data", X.shape[0])``.
:class:`Potential` traces it once and fixes one parameter *layout*: the latent
sites in the order the model samples them, each mapped to unconstrained space
by ``biject_to(site.support)`` and flattened, concatenated into one vector
``z`` of length ``dim``. Clients and server share this layout.

Conventions (used by every backend and algorithm):

* ``log_prior(z)`` is the model prior in unconstrained space, Jacobian
  included.
* The log likelihood of a client is a **sum** over its points. A minibatch of
  ``b`` rows drawn uniformly (with replacement) from a client's ``n`` valid
  rows carries weight ``n / b`` per row, so it is an unbiased estimate of that
  sum; the full batch carries weight 1 on valid rows and 0 on padding.
* A client's target (:class:`LocalTarget`) is
  ``prior_weight * log p0(z) + likelihood_weight * log p(D_k | z)
  + linear . z - z' P z / 2``. Samplers use ``prior_weight = 1`` (own
  posterior) or ``1/K`` (a sub-posterior, arranged by the algorithm);
  ``likelihood_weight = 1`` is temperature 1 (temperature acts on the
  injected noise in the samplers, see ``fedprob.inference``). The Gaussian
  term carries cavities, proximal terms and dual variables of the iterative
  algorithms; it is zero by default.
* Point-estimate client optimizers minimise ``-log_density / n_k`` with
  ``prior_weight = 1/K`` (see :func:`mean_loss`), so learning rates carry
  across client sizes.

Client-local sites. A site declared ``numpyro.sample(name, d, infer={"local": True})``
belongs to one client (a varying intercept, a client's own scale): every
client infers the joint of the global sites and its own copy of the local
ones, and only the global block leaves it. The layout puts the global sites
first, ``z = (z_global, z_local)`` (``dim_global`` then ``dim_local``
coordinates; without local sites the layout is the model order). A client's
target then reads ``prior_weight * log p0(z_global) + likelihood_weight *
(log p(z_local | z_global) + log p(D_k | z))`` plus the Gaussian term: the
prior share (1/K, a cavity) applies to the global sites only, and the local
sites' conditional prior stays whole on every client, as a part of the
client's evidence about the global sites. A local site must be continuous
and keep one shape on every client (not inside the ``data`` plate, not
sized by the row count); other sites may depend on it, no global site (nor a
``numpyro.factor`` outside the data plate) may: the server holds those and has
no client's local value (refused at construction, naming both sites).

Clients of different sizes are padded into one array of ``N_max`` rows with a
count ``n`` each (:class:`ClientData`), so one jitted function serves every
client under ``vmap``.
"""
from __future__ import annotations

import functools
import types
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import logsumexp
import numpyro.distributions as dist
from numpyro import handlers
from numpyro.distributions import constraints
from numpyro.distributions.transforms import biject_to

from . import inputs

Array = jax.Array

DATA_PLATE = "data"
#: the starting points :meth:`Potential.init` knows
INIT_STRATEGIES = ("center", "prior", "prior_full", "zeros")


class ClientData(NamedTuple):
    """One client's rows, padded to a common length.

    X: (N_max, ...) inputs; y: (N_max, ...) targets; n: () number of valid rows
    (rows ``n:`` are padding and never enter a log density). Stacked over a
    leading client axis it is the data of a whole federation.
    """

    X: Array
    y: Array
    n: Array


class LocalTarget(NamedTuple):
    """The log density a client works on (see the module docstring).

    ``log pi(z) = prior_weight * log p0(z) + likelihood_weight * log p(D|z)
    + linear . z - z' precision z / 2``, with ``precision`` either a vector
    (diagonal) or a (d, d) matrix.
    """

    data: ClientData
    prior_weight: Array
    likelihood_weight: Array
    linear: Array
    precision: Array


def make_target(data: ClientData, dim: int, prior_weight=1.0, likelihood_weight=1.0,
                linear=None, precision=None, dtype=jnp.float32) -> LocalTarget:
    """A :class:`LocalTarget` with an (optional) Gaussian term, zero by default."""
    linear = jnp.zeros((dim,), dtype) if linear is None else jnp.asarray(linear, dtype)
    precision = jnp.zeros((dim,), dtype) if precision is None else jnp.asarray(precision, dtype)
    return LocalTarget(data, jnp.asarray(prior_weight, dtype), jnp.asarray(likelihood_weight, dtype),
                       linear, precision)


def pooled_log_posterior(potential, z: Array, data: ClientData) -> Array:
    """``log p0(z) + sum_k log p(D_k | z)`` over stacked client data (K, ...): each client's full-batch
    log density with prior share 1/K, summed (the global posterior, unnormalised)."""
    K = data.n.shape[0]
    per = jax.vmap(lambda d: potential.log_density(z, make_target(d, potential.dim, prior_weight=1.0 / K,
                                                                     dtype=z.dtype)))(data)
    return jnp.sum(per)


class SiteInfo(NamedTuple):
    name: str
    shape: tuple          # constrained shape
    unconstrained_shape: tuple
    offset: int
    size: int


def _in_data_plate(site) -> Optional[Any]:
    for frame in site.get("cond_indep_stack", ()):
        if frame.name == DATA_PLATE:
            return frame
    return None


def _is_real(support) -> bool:
    """True for an unconstrained real support (possibly with event dimensions)."""
    while isinstance(support, constraints.independent):
        support = support.base_constraint
    return support is constraints.real


def _likelihood_kind(fn) -> str:
    """"classification" (Categorical / Bernoulli), "count" (other discrete) or "regression"."""
    base = fn
    while isinstance(base, (dist.Independent, dist.ExpandedDistribution, dist.MaskedDistribution)):
        base = base.base_dist
    if isinstance(base, _CATEGORICAL) and fn.support.is_discrete:
        return "classification"
    return "count" if fn.support.is_discrete else "regression"


_CATEGORICAL = (dist.CategoricalLogits, dist.CategoricalProbs, dist.BernoulliLogits, dist.BernoulliProbs)


def _abstract_trace(model, X, y, model_kwargs) -> dict:
    """Static facts about every site of one model trace, traced abstractly (no FLOPs)."""
    out = {}

    def f(X, y):
        with handlers.block():
            tr = handlers.trace(handlers.seed(inputs.call, 0)).get_trace(model, X, y, model_kwargs)
        for name, site in tr.items():
            entry = {"type": site["type"]}
            if site["type"] == "deterministic":
                entry["in_data_plate"] = _in_data_plate(site) is not None
            if site["type"] == "plate":
                size, subsample_size = site["args"]    # numpyro records (size, subsample_size)
                entry.update(size=int(size),
                             subsample_size=int(size if subsample_size is None else subsample_size))
            if site["type"] == "sample":
                fn = site["fn"]
                entry.update(is_observed=bool(site["is_observed"]),
                             local=bool((site.get("infer") or {}).get("local", False)),
                             in_data_plate=_in_data_plate(site) is not None,
                             is_discrete=bool(fn.support.is_discrete),
                             is_factor=isinstance(fn, dist.Unit),
                             kind=_likelihood_kind(fn),
                             shape=tuple(jnp.shape(site["value"])), num_classes=None)
                if not site["is_observed"] and not fn.support.is_discrete:
                    u = biject_to(fn.support).inv(site["value"])
                    entry["unconstrained_shape"] = tuple(jnp.shape(u))
                    entry["is_real"] = _is_real(fn.support)
                entry["event_shape"] = tuple(fn.event_shape)
                entry["dist_shape"] = tuple(fn.batch_shape) + tuple(fn.event_shape)
                if entry["kind"] == "classification" and fn.has_enumerate_support and not fn.event_shape:
                    entry["num_classes"] = int(fn.enumerate_support(expand=False).shape[0])
            out[name] = entry
        return jnp.zeros(())

    try:
        jax.eval_shape(f, X, y)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"tracing the model on {inputs.num_rows(X)} rows failed ({type(e).__name__}: {e}). fedprob calls "
            f"the model with client data of any number of rows (a client's, a minibatch, one row): size "
            f"the '{DATA_PLATE}' plate and every per-row array by the rows of the inputs "
            f"(`numpyro.plate('{DATA_PLATE}', X.shape[0])`). Any other size the model takes from the data "
            "(the number of groups, schools, classes, a plate that is not the rows) must not be computed from "
            "the inputs, which hold one client's rows: make it a model argument, "
            "`def model(X, y=None, num_groups=8)` with `fp.run(..., model_kwargs={'num_groups': 8})`") from e
    return out


def _check_local_site(name: str, site: dict, in_plate: bool) -> None:
    """A client-local site must be continuous and sized independently of the client's rows."""
    if site["is_discrete"]:
        raise ValueError(
            f"local site '{name}' is discrete; client-local sites are inferred jointly with the global "
            "ones by gradient-based client backends (Laplace, VI, NUTS, SG-MCMC), which need continuous "
            "sites: marginalise it in the likelihood or give it a continuous distribution")
    if in_plate:
        raise ValueError(
            f"local site '{name}' lies inside the '{DATA_PLATE}' plate, so its shape depends on the "
            "client's row count; a local site needs one shape on every client (declare it outside the "
            f"'{DATA_PLATE}' plate with a fixed shape, or marginalise per-row latents in the likelihood)")


def _check_local_shapes(model, X, y, model_kwargs, info: dict, names) -> None:
    """Refuse a local site whose shape changes with the number of rows (traced at 1 row and at 2)."""
    one = _abstract_trace(model, X[:1], y[:1], model_kwargs)
    for name in names:
        a, b = info[name]["shape"], one.get(name, {}).get("shape")
        if a != b:
            raise ValueError(
                f"local site '{name}' has shape {b} on a client of 1 row and {a} on one of 2 rows: its "
                "shape depends on the client's row count; a local site needs one shape on every client "
                "(size it by a fixed number, e.g. a number of groups passed in model_kwargs)")


def _depends(jaxpr, marked_inputs) -> list:
    """For each output of ``jaxpr``: whether it depends on an input flagged in ``marked_inputs``
    (a forward pass over the equations; calls of sub-jaxprs are followed, other control flow counts
    every output as dependent on every input)."""
    from jax.extend.core import Literal

    marked = {v for v, m in zip(jaxpr.invars, marked_inputs) if m}
    hit = lambda v: not isinstance(v, Literal) and v in marked
    for eqn in jaxpr.eqns:
        ins = [hit(v) for v in eqn.invars]
        if not any(ins):
            continue
        sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        sub = getattr(sub, "jaxpr", sub)
        if sub is not None and hasattr(sub, "eqns") and len(sub.invars) == len(ins) \
                and len(sub.outvars) == len(eqn.outvars):
            outs = _depends(sub, ins)
        else:
            outs = [True] * len(eqn.outvars)
        marked.update(v for v, m in zip(eqn.outvars, outs) if m)
    return [hit(v) for v in jaxpr.outvars]


# the nested program of Potential._split_terms: the potential is static (hashed on its identity), so
# equal potentials share one trace per argument shape
_split_terms_jit = jax.jit(lambda potential, z, X, y, weights: potential._split_terms_traced(z, X, y, weights),
                           static_argnums=0)


def minibatch(key: Array, data: ClientData, batch_size: Optional[int]):
    """Rows and per-row weights for one stochastic estimate of the log likelihood.

    ``batch_size=None`` is the full batch (weights 1 on valid rows, 0 on
    padding). Otherwise ``batch_size`` rows are drawn uniformly with
    replacement from the ``n`` valid rows, each weighted ``n / batch_size``:
    an unbiased estimate of the sum over the client's points.
    """
    n_max = inputs.num_rows(data.X)
    if batch_size is None:
        valid = jnp.arange(n_max) < data.n
        w = valid.astype(jnp.result_type(float))
        # padded rows are replaced by row 0 so that no padded value (even NaN) reaches a gradient
        keep = lambda a: jnp.where(valid.reshape((-1,) + (1,) * (a.ndim - 1)), a, a[:1])
        return inputs.tree_map(keep, data.X), keep(data.y), w
    n = jnp.maximum(data.n, 1)
    idx = jax.random.randint(key, (batch_size,), 0, n)
    w = jnp.full((batch_size,), 1.0) * (data.n / batch_size)
    return inputs.take(data.X, idx), data.y[idx], w.astype(jnp.result_type(float))


def _first_rows(a, n: int):
    """The first ``n`` rows of ``a``: a NumPy array, or a slice of ``a`` when it is a tracer."""
    return a[:n] if isinstance(a, jax.core.Tracer) else np.asarray(a)[:n]


class Potential:
    """Flat log density of a NumPyro model (see the module docstring).

    Parameters
    ----------
    model: ``model(X, y=None, **model_kwargs)`` with its observed sites inside
        ``numpyro.plate("data", X.shape[0])``.
    X, y: example data (a few rows suffice) fixing shapes and dtypes.
    model_kwargs: extra keyword arguments passed to every call of the model.
    """

    def __init__(self, model: Callable, X, y, model_kwargs: Optional[dict] = None):
        self.model = model
        self.model_kwargs = dict(model_kwargs or {})
        # one real row of inputs: the model is traced at it wherever no data is given (the prior,
        # constrain, init), never at invented zeros, so a model that reads a scale or an index
        # from its inputs sees a valid value (a concrete row unless the data are themselves traced)
        self._row_X = inputs.tree_map(lambda a: _first_rows(a, 1), X)
        self._row_y = _first_rows(y, 1)
        X = inputs.tree_map(lambda a: jnp.asarray(a)[:2], X)
        y = jnp.asarray(y)[:2]
        info = _abstract_trace(model, X, y, self.model_kwargs)
        sites, observed, deterministic, real_sites, prior_factors, factors = [], [], [], [], [], []
        latent = []
        offset = 0
        has_plate = False
        for name, site in info.items():
            if site["type"] == "plate" and name == DATA_PLATE:
                has_plate = True
                if site["size"] != inputs.num_rows(X):
                    raise ValueError(
                        f"the '{DATA_PLATE}' plate has size {site['size']} on a batch of {inputs.num_rows(X)} "
                        f"rows: its size must be the number of rows, "
                        f"`numpyro.plate('{DATA_PLATE}', X.shape[0])`, not a fixed number")
                if site["subsample_size"] != site["size"]:
                    raise ValueError(
                        f"the '{DATA_PLATE}' plate sets subsample_size={site['subsample_size']}; fedprob "
                        "draws minibatches itself (batch_size of the client backend) and scales them by "
                        f"N_k/b: drop subsample_size from `numpyro.plate('{DATA_PLATE}', X.shape[0])`")
            if site["type"] == "param":
                raise ValueError(
                    f"site '{name}' is a numpyro.param; fedprob needs every parameter as a "
                    "numpyro.sample site with a prior")
            if site["type"] == "deterministic" and not site["in_data_plate"]:
                deterministic.append(name)
            if site["type"] != "sample":
                continue
            in_plate = site["in_data_plate"]
            has_plate = has_plate or in_plate
            if site["is_observed"]:
                if site["is_factor"] and not in_plate:
                    # numpyro.factor outside the data plate: a term of the prior
                    prior_factors.append(name)
                    continue
                if not in_plate:
                    hint = (" and drop `.to_event(...)`: the plate makes the rows independent"
                            if site.get("event_shape") else "")
                    raise ValueError(
                        f"observed site '{name}' is outside the plate named '{DATA_PLATE}'; the model needs "
                        f"a '{DATA_PLATE}' plate: put the likelihood inside "
                        f"`with numpyro.plate('{DATA_PLATE}', X.shape[0]):`{hint}")
                if not site["is_factor"] and site["shape"] != site["dist_shape"]:
                    raise ValueError(
                        f"observed site '{name}' receives values of shape {site['shape']} for {inputs.num_rows(X)} "
                        f"rows (y rows have shape {tuple(y.shape[1:])}) but its distribution has shape "
                        f"{site['dist_shape']}: y does not match the model's likelihood")
                if site["is_discrete"] and site.get("event_shape"):
                    raise ValueError(
                        f"observed site '{name}' is discrete with event shape {site['event_shape']} inside "
                        f"the '{DATA_PLATE}' plate; give one label per row (drop `.to_event(...)`)")
                observed.append(name)
                if site["is_factor"]:
                    factors.append(name)
                continue
            if site["local"]:
                _check_local_site(name, site, in_plate)
            if in_plate:
                raise ValueError(
                    f"latent site '{name}' lies inside the '{DATA_PLATE}' plate; per-datapoint "
                    "latent variables are not supported (marginalise them in the likelihood)")
            if site["is_discrete"]:
                raise ValueError(f"latent site '{name}' is discrete; only continuous parameters "
                                 "are supported")
            size = int(np.prod(site["unconstrained_shape"]))
            latent.append((name, site, size))
        # the layout: global sites first (model order), then the client-local ones (model order)
        latent = [t for t in latent if not t[1]["local"]] + [t for t in latent if t[1]["local"]]
        local_names = tuple(name for name, site, _ in latent if site["local"])
        if local_names and X.shape[0] > 1:
            _check_local_shapes(model, X, y, self.model_kwargs, info, local_names)
        for name, site, size in latent:
            sites.append(SiteInfo(name, site["shape"], site["unconstrained_shape"], offset, size))
            real_sites.append(site["is_real"])
            offset += size
        if not has_plate:
            raise ValueError(
                f"the model has no numpyro.plate named '{DATA_PLATE}': wrap the likelihood in "
                f"`with numpyro.plate('{DATA_PLATE}', X.shape[0]):` so fedprob can scale minibatches")
        if not observed:
            raise ValueError("the model observes nothing: call it as model(X, y) with "
                             "`obs=y` on the likelihood site inside the 'data' plate")
        if not sites:
            raise ValueError("the model has no latent sample sites to infer")
        self.sites = tuple(sites)
        self._real_mask = np.concatenate([np.full(s.size, r) for s, r in zip(sites, real_sites)])
        self.observed = tuple(observed)
        self.prior_factors = tuple(prior_factors)
        #: ``numpyro.factor`` sites inside the data plate: a likelihood with no predictive distribution
        self.likelihood_factors = tuple(factors)
        self._masked = None
        #: ``numpyro.deterministic`` sites outside the data plate: functions of the parameters alone,
        #: reported beside the latent sites by :meth:`constrain_all` (per-row ones depend on inputs)
        self.deterministic = tuple(deterministic)
        self.dim = offset
        self.site_names = tuple(s.name for s in sites)
        #: client-local sites (``infer={"local": True}``), after the global ones in the layout: the
        #: flat vector is ``z = (z_global, z_local)`` with ``z_global = z[:dim_global]``
        self.local_sites = local_names
        self.global_sites = tuple(n for n in self.site_names if n not in local_names)
        self.dim_global = int(sum(s.size for s in sites if s.name not in local_names))
        self.dim_local = self.dim - self.dim_global
        obs = info[observed[0]]
        # "classification": Categorical/Bernoulli likelihood (predict gives class log-probabilities);
        # "count": any other discrete likelihood (Poisson, Binomial, ...); "regression": continuous.
        # Counts and regression predict (mean, variance).
        self.task = obs["kind"]
        self.num_classes = obs["num_classes"] if self.task == "classification" else None
        #: the shape of one input row (a tuple or dict of them for several inputs, :mod:`fedprob.inputs`)
        self.x_shape = inputs.row_shapes(X)
        self.y_shape = tuple(y.shape[1:])
        self._x_dtype = inputs.row_dtypes(X)
        self._y_dtype_str = str(y.dtype)
        self._identity = _identity_key(model, self.model_kwargs, self.x_shape, self.y_shape,
                                       self._x_dtype, self._y_dtype_str)
        if local_names:
            self._check_global_terms_read_no_local_site()

    # -- identity ---------------------------------------------------------------------------
    # Two potentials are equal when they trace the same program: the same model function (a plain
    # function or closure by its code and captured values, :func:`_freeze_model`), equal
    # model_kwargs (arrays compared by value) and the same row shapes and dtypes. Compiled
    # functions that take a potential as a static argument are cached on this identity.
    def __hash__(self):
        return hash(self._identity)

    def __eq__(self, other):
        return isinstance(other, Potential) and self._identity == other._identity

    def _check_global_terms_read_no_local_site(self) -> None:
        """Refuse a global site (or a ``numpyro.factor`` outside the data plate) whose density reads a
        client-local site: it is held by the server and shared by every client, and no client's local
        value is the server's. Found on the model's jaxpr (abstract, no FLOPs): which global terms
        depend on which local site's input."""
        glob = [s for s in self.sites if s.name not in self.local_sites]
        loc = [s for s in self.sites if s.name in self.local_sites]
        X, y = self.example_X(), self.example_y()

        def terms(*parts):          # one input per site (a concatenation would join them all)
            u = {s.name: p.reshape(s.unconstrained_shape) for s, p in zip(glob + loc, parts)}
            tr = self._trace_with(u, X, y, {})
            out = [jnp.sum(tr[s.name]["fn"].log_prob(tr[s.name]["value"])) for s in glob]
            return out + [jnp.sum(tr[n]["fn"].log_prob(tr[n]["value"])) for n in self.prior_factors]

        dtype = jnp.result_type(float)
        closed = jax.make_jaxpr(terms)(*[jnp.zeros((s.size,), dtype) for s in glob + loc])
        names = [s.name for s in glob] + list(self.prior_factors)
        for i, site in enumerate(loc):
            reads = _depends(closed.jaxpr, [False] * len(glob) + [j == i for j in range(len(loc))])
            hit = [n for n, r in zip(names, reads) if r]
            if hit and hit[0] in self.global_sites:
                raise ValueError(
                    f"global site '{hit[0]}' depends on the client-local site '{site.name}': a global site is "
                    "held by the server and shared by every client, and the server has no value of one "
                    f"client's local site; mark '{hit[0]}' client-local too (infer={{'local': True}}), or "
                    f"share '{site.name}' (drop its infer={{'local': True}})")
            if hit:
                raise ValueError(
                    f"numpyro.factor '{hit[0]}' outside the '{DATA_PLATE}' plate depends on the client-local site "
                    f"'{site.name}': such a factor is a term of the global prior, held by the server, which has "
                    f"no value of one client's local site; give '{site.name}' that density in its own "
                    f"distribution, or share '{site.name}' (drop its infer={{'local': True}})")

    # -- layout ---------------------------------------------------------------------------
    def unravel(self, z: Array) -> dict:
        """Flat vector -> dict of unconstrained arrays (site order of the model)."""
        return {s.name: z[s.offset:s.offset + s.size].reshape(s.unconstrained_shape)
                for s in self.sites}

    def ravel(self, u: dict) -> Array:
        """Dict of unconstrained arrays -> flat vector in the fixed layout."""
        return jnp.concatenate([jnp.reshape(u[s.name], (-1,)) for s in self.sites])

    def _transforms(self, tr_sites) -> dict:
        return {s.name: biject_to(tr_sites[s.name]["fn"].support) for s in self.sites}

    def constrain(self, z: Array, X=None) -> dict:
        """Flat unconstrained vector -> dict of constrained site values."""
        # Supports can depend on other sites; trace once with the unconstrained
        # values pushed through each site's transform in model order.
        u = self.unravel(z)
        values = {}
        y = self.example_y() if X is None else None
        X = self.example_X() if X is None else X
        tr = self._trace_with(u, X, y, values)
        return {s.name: tr[s.name]["value"] for s in self.sites}

    def constrain_all(self, z: Array) -> dict:
        """:meth:`constrain` plus every deterministic site outside the data plate (one trace)."""
        u = self.unravel(z)
        tr = self._trace_with(u, self.example_X(), self.example_y(), {})
        names = self.site_names + self.deterministic
        return {name: tr[name]["value"] for name in names}

    def unconstrain(self, params: dict) -> Array:
        """Dict of constrained site values -> flat unconstrained vector."""
        X = self.example_X()
        with handlers.block():
            tr = handlers.trace(handlers.substitute(handlers.seed(self._call, 0), data=params)).get_trace(
                X, self.example_y())
        return self.ravel({s.name: biject_to(tr[s.name]["fn"].support).inv(params[s.name])
                           for s in self.sites})

    def _trace_with(self, u: dict, X, y, out: dict):
        """Trace the model with latent sites set from unconstrained values ``u``."""

        def substitute_fn(site):
            if site["type"] == "sample" and site["name"] in u and not site["is_observed"]:
                x = biject_to(site["fn"].support)(u[site["name"]])
                out[site["name"]] = x
                return x
            return None

        with handlers.block():
            return handlers.trace(handlers.substitute(handlers.seed(self._call, 0),
                                                      substitute_fn=substitute_fn)).get_trace(X, y)

    # -- densities ------------------------------------------------------------------------
    def _terms(self, z: Array, X, y, weights):
        """(log prior with Jacobian, weighted log likelihood) from one trace."""
        lp_global, lp_local, ll = self._split_terms(z, X, y, weights)
        return lp_global + lp_local, ll

    def _split_terms(self, z: Array, X, y, weights):
        """(log prior of the global sites, log p(local sites | global sites), weighted log
        likelihood), Jacobians included, from one trace; the middle term is 0.0 without local sites.

        Every density of the potential goes through here, and a client update, a round or a check
        asks for it many times (gradients, Hessians, per-row terms, prior parts): a nested ``jit``
        keyed on the potential's identity traces the model once per argument shape and reuses that
        program under ``grad``/``vmap``, where a plain call re-ran the model's Python each time."""
        return _split_terms_jit(self, z, X, y, weights)

    def _split_terms_traced(self, z: Array, X, y, weights):
        """:meth:`_split_terms`, traced from the model (what the nested ``jit`` compiles)."""
        u = self.unravel(z)
        values = {}
        tr = self._trace_with(u, X, y, values)
        log_prior, log_local = 0.0, 0.0
        for s in self.sites:
            site = tr[s.name]
            x = values[s.name]
            lp = jnp.sum(site["fn"].log_prob(x))
            if site.get("scale") is not None:
                lp = lp * site["scale"]
            t = biject_to(site["fn"].support)
            term = lp + jnp.sum(t.log_abs_det_jacobian(u[s.name], x))
            if s.name in self.local_sites:
                log_local = log_local + term
            else:
                log_prior = log_prior + term
        for name in self.prior_factors:
            site = tr[name]
            lp = jnp.sum(site["fn"].log_prob(site["value"]))
            log_prior = log_prior + (lp if site.get("scale") is None else lp * site["scale"])
        log_lik = 0.0
        for name in self.observed:
            site = tr[name]
            lp = site["fn"].log_prob(site["value"])
            if site.get("scale") is not None:          # handlers.scale: a tempered likelihood
                lp = lp * site["scale"]
            frame = _in_data_plate(site)
            w = jnp.reshape(weights, (weights.shape[0],) + (1,) * (-frame.dim - 1))
            log_lik = log_lik + jnp.sum(lp * w)
        return log_prior, log_local, log_lik

    def log_prior(self, z: Array) -> Array:
        """log p0(z) in unconstrained space (Jacobian included)."""
        # a real row at weight 0: the likelihood term vanishes and stays finite
        return self._terms(z, self.example_X(), self.example_y(), jnp.zeros((1,)))[0]

    def _call(self, X, y):
        return inputs.call(self.model, X, y, self.model_kwargs)

    def log_prior_parts(self, z: Array):
        """(log p0 of the global sites, log p(local sites | global sites)) at the flat ``z``; the second
        is 0.0 without client-local sites. Their sum is :meth:`log_prior`."""
        return self._split_terms(z, self.example_X(), self.example_y(), jnp.zeros((1,)))[:2]

    def target_log_prior(self, z: Array, target: LocalTarget) -> Array:
        """The prior part of a client's target: ``prior_weight * log p0(z_global) +
        likelihood_weight * log p(z_local | z_global)`` (module docstring)."""
        lp, lp_local = self.log_prior_parts(z)
        return target.prior_weight * lp + target.likelihood_weight * lp_local

    def log_prior_global(self, z_global: Array) -> Array:
        """log p0 of the global sites alone, a function of ``z_global`` (dim_global,); the local
        sites are set to 0 in unconstrained space (no global site may depend on a local one)."""
        z = jnp.concatenate([z_global, jnp.zeros((self.dim_local,), z_global.dtype)])
        return self._split_terms(z, self.example_X(), self.example_y(), jnp.zeros((1,)))[0]

    def example_X(self):
        """One real input row, (1, ...): where the model is traced when no data is at hand."""
        return inputs.tree_map(jnp.asarray, self._row_X)

    def example_y(self):
        """The target row of :meth:`example_X`, (1, ...): observed there, so a model whose
        likelihood needs ``y`` (a ``numpyro.factor``) traces without data too."""
        return jnp.asarray(self._row_y)

    def _y_dtype(self):
        return jnp.int32 if self.task in ("classification", "count") else jnp.result_type(float)

    def log_likelihood(self, z: Array, X, y, weights=None) -> Array:
        """sum_i weights_i log p(y_i | x_i, z) (weights default to 1)."""
        weights = jnp.ones((inputs.num_rows(X),)) if weights is None else weights
        return self._terms(z, X, y, weights)[1]

    def pointwise_log_likelihood(self, z: Array, X, y) -> Array:
        """(n,) log p(y_i | x_i, z) per row."""
        return jax.vmap(lambda xi, yi: self.log_likelihood(z, inputs.tree_map(lambda a: a[None], xi), yi[None]))(X, y)

    def log_joint(self, z: Array, X, y, weights=None, prior_weight=1.0) -> Array:
        """prior_weight * log p0(z) + sum_i weights_i log p(y_i | x_i, z)."""
        weights = jnp.ones((inputs.num_rows(X),)) if weights is None else weights
        lp, ll = self._terms(z, X, y, weights)
        return prior_weight * lp + ll

    def log_density(self, z: Array, target: LocalTarget, key=None, batch_size=None) -> Array:
        """A client's (stochastic, if batch_size is set) log target density."""
        X, y, w = minibatch(key, target.data, batch_size)
        lp, lp_local, ll = self._split_terms(z, X, y, w)
        # the prior share acts on the global sites only; p(local | global) goes with the client's
        # likelihood (it is part of the client's evidence about the global sites)
        out = target.prior_weight * lp + target.likelihood_weight * (lp_local + ll) + jnp.dot(target.linear, z)
        if target.precision.ndim == 1:
            out = out - 0.5 * jnp.sum(target.precision * z * z)
        else:
            out = out - 0.5 * z @ target.precision @ z
        return out

    def grad_log_density(self, z, target, key=None, batch_size=None):
        """(log density, gradient) of :meth:`log_density`."""
        return jax.value_and_grad(self.log_density)(z, target, key, batch_size)

    # -- initialisation ---------------------------------------------------------------------
    def sample_prior(self, key: Array) -> Array:
        """One draw of every latent site from the prior, as a flat unconstrained vector."""
        X = self.example_X()
        with handlers.block():
            tr = handlers.trace(handlers.seed(self._call, key)).get_trace(X, self.example_y())
        return self.ravel({s.name: biject_to(tr[s.name]["fn"].support).inv(tr[s.name]["value"])
                           for s in self.sites})

    def sample_local_prior(self, key: Array, z_global: Array) -> Array:
        """One draw of the local block from its conditional prior ``p(z_local | z_global)`` (a new
        client's local sites), unconstrained, (dim_local,)."""
        u = self.unravel(jnp.concatenate([z_global, jnp.zeros((self.dim_local,), z_global.dtype)]))
        glob = set(self.global_sites)

        def substitute_fn(site):
            if site["type"] == "sample" and site["name"] in glob and not site["is_observed"]:
                return biject_to(site["fn"].support)(u[site["name"]])
            return None

        with handlers.block():
            tr = handlers.trace(handlers.substitute(handlers.seed(self.model, key), substitute_fn=substitute_fn)
                                ).get_trace(self.example_X(), self.example_y(), **self.model_kwargs)
        parts = [jnp.reshape(biject_to(tr[n]["fn"].support).inv(tr[n]["value"]), (-1,))
                 for n in self.local_sites]
        return jnp.concatenate(parts).astype(z_global.dtype)

    def init(self, key: Array, strategy: str = "prior") -> Array:
        """A starting point for optimisers and samplers (flat unconstrained vector).

        ``"center"``: every site at the centre of its prior: the unconstrained
        image of the prior median (``icdf(0.5)`` entrywise; the mean for
        multivariate sites or where no icdf exists; unconstrained 0 where
        neither is finite), so a Normal site starts at its loc and a
        HalfNormal(s) scale at 0.674 s. Sites are visited in model order with
        the centres of earlier sites substituted (hierarchical priors).
        Deterministic: the default of the point-estimate methods.
        ``"prior"``: real-valued sites (weights, biases) drawn from the prior;
        sites with a constrained support (scales, simplexes, ...) at the centre
        of their unconstrained space (a scale of 1), because a prior draw of a
        scale can be tiny and make every gradient step diverge.
        ``"prior_full"``: every site drawn from the prior (:meth:`sample_prior`).
        ``"zeros"``: z = 0.

        Initialisation scale: a site declaring ``infer={"init_scale": s}``
        (e.g. the weights of :func:`fedprob.models.bnn_mlp`, whose all-zero
        centre leaves every hidden unit identical) starts at its centre plus
        ``s * N(0, 1)`` noise in unconstrained space under ``"center"`` and
        ``"prior"``, whatever its prior scale.
        """
        if strategy not in INIT_STRATEGIES:
            raise ValueError(f"unknown init strategy '{strategy}' (use one of {INIT_STRATEGIES})")
        if strategy == "zeros":
            return jnp.zeros((self.dim,))
        if strategy == "prior_full":
            return self.sample_prior(key)

        def center(fn):
            # unwrap to_event / expand / mask wrappers down to the distribution defining the values
            base = fn
            while isinstance(base, (dist.Independent, dist.ExpandedDistribution, dist.MaskedDistribution)):
                base = base.base_dist
            c = None
            if base.event_shape == ():
                try:
                    c = base.icdf(jnp.full(base.batch_shape, 0.5))
                except (NotImplementedError, ImportError, AttributeError, TypeError):
                    c = None
            if c is None:
                try:
                    c = base.mean
                except (NotImplementedError, AttributeError):
                    c = None
            if c is not None and hasattr(base, "loc") and _is_real(base.support):
                c = jnp.where(jnp.isfinite(c), c, base.loc)        # e.g. StudentT(df <= 1): its loc
            t = biject_to(fn.support)
            if c is None:
                return t(jnp.zeros(t.inverse_shape(fn.shape())))
            u = t.inv(jnp.broadcast_to(c, fn.shape()))
            return t(jnp.where(jnp.isfinite(u), u, 0.0))

        latent = set(self.site_names)
        k_noise = jax.random.fold_in(key, 1)
        noise_keys = dict(zip(self.site_names, jax.random.split(k_noise, len(self.site_names))))
        if strategy == "prior":
            prior_u = self.unravel(jnp.where(self._real_mask, self.sample_prior(key), 0.0))
        out = {}

        def substitute_fn(site):
            if site["type"] != "sample" or site["name"] not in latent or site["is_observed"]:
                return None
            fn, name = site["fn"], site["name"]
            t = biject_to(fn.support)
            scale = (site.get("infer") or {}).get("init_scale")
            if strategy == "center" or scale is not None:
                u = t.inv(center(fn))
                if scale is not None:
                    u = u + jnp.asarray(scale) * jax.random.normal(noise_keys[name], jnp.shape(u))
            else:
                u = prior_u[name]                               # a prior draw (real sites) or 0
            out[name] = u
            return t(u)

        X = self.example_X()
        with handlers.block():
            handlers.trace(handlers.substitute(handlers.seed(self._call, 0),
                                               substitute_fn=substitute_fn)).get_trace(X, self.example_y())
        return self.ravel(out)

    # -- prediction -----------------------------------------------------------------------
    def predictive_distribution(self, z: Array, X):
        """The NumPyro distribution of the (first) observed site at inputs X, with any ``.mask(...)``
        removed: a mask leaves rows out of the fit; the predictive of y at a row is the unmasked
        distribution."""
        tr = self._trace_with(self.unravel(z), X, None, {})
        return _unmasked(tr[self.observed[0]]["fn"])

    @property
    def masked_likelihood(self) -> bool:
        """Whether the observed site's distribution carries a ``.mask(...)`` (found on one trace)."""
        if self._masked is None:
            if self.likelihood_factors:
                self._masked = False
            else:
                tr = self._trace_with(self.unravel(jnp.zeros((self.dim,))), self.example_X(), None, {})
                fn = tr[self.observed[0]]["fn"]
                self._masked = _unmasked(fn) is not fn
        return self._masked

    def predictive_log_likelihood(self, z: Array, X, y) -> Array:
        """(n,) log p(y_i | x_i, z) under the predictive: :meth:`pointwise_log_likelihood`, except that a
        masked likelihood is scored unmasked (:meth:`predictive_distribution`)."""
        if self.masked_likelihood:
            return self.predictive_distribution(z, X).log_prob(y)
        return self.pointwise_log_likelihood(z, X, y)

    def predict(self, z: Array, X):
        """Per-parameter predictive at inputs X.

        Classification: (n, C) class log-probabilities. Regression and counts:
        a tuple (mean, variance) of the observation distribution (noise included).
        """
        fn = self.predictive_distribution(z, X)
        if self.task == "classification":
            # a categorical's log-probabilities at every class are its normalised logits (what its
            # log_prob gathers from, bit for bit); scoring the enumerated classes would broadcast them
            # C times and gather (twice the cost of the rest of a softmax model's prediction)
            if type(fn) is dist.CategoricalLogits:
                return fn.logits - logsumexp(fn.logits, axis=-1, keepdims=True)
            if type(fn) is dist.CategoricalProbs:
                return fn.logits
            vals = fn.enumerate_support(expand=False)
            lp = fn.log_prob(vals)            # (C, n)
            return jnp.moveaxis(lp, 0, -1)
        return fn.mean, fn.variance


def _unmasked(fn):
    """``fn`` without its ``MaskedDistribution`` wrappers."""
    while isinstance(fn, dist.MaskedDistribution):
        fn = fn.base_dist
    return fn


def _freeze(value):
    """A hashable, value-based stand-in for a model keyword argument."""
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _freeze(v)) for k, v in value.items())))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_freeze(v) for v in value))
    if isinstance(value, (np.ndarray, jax.Array)) or hasattr(value, "__array__"):
        a = np.asarray(value)
        return ("array", a.shape, str(a.dtype), a.tobytes())
    try:
        hash(value)
    except TypeError:
        return ("object", id(value))          # unhashable and not an array: identity only
    return value


def _freeze_model(fn, seen=()):
    """A value-based stand-in for a model function: a plain function by its code, the values its
    closure holds, its defaults and its module (each by :func:`_freeze`, functions among them by
    this rule), so the same factory called twice with equal arguments (``fp.models.bnn_mlp((100,),
    10)``) gives equal potentials and shares compiled programs; ``functools.partial`` by its
    function and arguments; anything else (a callable object, a builtin) by identity."""
    if id(fn) in seen:
        return ("recursive", id(fn))
    seen = seen + (id(fn),)
    if isinstance(fn, functools.partial):
        return ("partial", _freeze_model(fn.func, seen), _freeze_value(fn.args, seen),
                _freeze_value(fn.keywords, seen))
    if not isinstance(fn, types.FunctionType):
        return fn
    cells = []
    for cell in fn.__closure__ or ():
        try:
            cells.append(_freeze_value(cell.cell_contents, seen))
        except ValueError:                    # an empty cell (a name not yet bound)
            cells.append(("empty",))
    return ("function", fn.__module__, fn.__qualname__, fn.__code__, tuple(cells),
            _freeze_value(fn.__defaults__, seen), _freeze_value(fn.__kwdefaults__, seen))


def _freeze_value(value, seen):
    """:func:`_freeze` with functions by :func:`_freeze_model` and scalars with their type
    (``1``, ``1.0`` and ``True`` are equal in Python but may trace differently)."""
    if isinstance(value, (types.FunctionType, functools.partial)):
        return _freeze_model(value, seen)
    if isinstance(value, dict):
        return ("dict", tuple(sorted(((k, _freeze_value(v, seen)) for k, v in value.items()), key=repr)))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_freeze_value(v, seen) for v in value))
    if isinstance(value, (bool, int, float, complex, str, bytes, type(None))):
        return (type(value).__name__, value)
    return _freeze(value)


def _identity_key(model, model_kwargs, x_shape, y_shape, x_dtype, y_dtype) -> tuple:
    return (_freeze_model(model), _freeze(dict(model_kwargs)), _freeze(x_shape), y_shape, _freeze(x_dtype),
            y_dtype)


def mean_loss(potential: Potential, z, target: LocalTarget, key=None, batch_size=None):
    """``-log_density / n``: the client objective of point-estimate optimizers."""
    return -potential.log_density(z, target, key, batch_size) / jnp.maximum(target.data.n, 1)


def get_potential(model, fed, model_kwargs: Optional[dict] = None) -> Potential:
    """The :class:`Potential` of ``model`` (with ``model_kwargs``) on data shaped like the
    :class:`~fedprob.data.FederatedData` ``fed``.

    Building one traces the model abstractly (no FLOPs). Potentials compare
    equal when they trace the same program, so compiled functions are shared
    between equal ones and never between different ``model_kwargs``.
    """
    return Potential(model, inputs.tree_map(lambda a: a[0], fed.X), fed.y[0], model_kwargs)
