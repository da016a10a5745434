"""A :class:`~fedprob.result.Result` as ArviZ data, and its diagnostics table.

Groups of ``to_arviz`` (each says what it is in its ``description`` attribute):

* ``posterior``: the global posterior, every NumPyro site constrained (and
  every deterministic site outside the data plate), dims
  ``(chain, draw, *site dims)``. A Gaussian global posterior gives
  ``num_chains`` chains of independent draws (for FedPA, of its diagonal
  Gaussian approximation at the server point); an ensemble gives each client
  chain's draws (chain c of the global = chain c of every client,
  interleaved); other draw-based posteriors give their stored draws as one
  chain. A point estimate (FedAvg, OneShotAverage) is one draw labelled
  ``kind = "point estimate"``, never repeated into fake draws. The
  predictive-space methods (PredictiveBayes) have no global parameter
  posterior: the group is left out and ``attrs["no_posterior"]`` says why.
* ``client_posterior``: each client's local posterior, dims
  ``(chain, draw, client, *site dims)`` with the backend's ``num_chains``,
  where the server keeps the clients' draws (Ensemble, PredictiveBayes);
  summing methods keep only sufficient statistics, so it is absent.
* ``client_sample_stats``: the backends' per-draw sampler statistics beside
  ``client_posterior``, dims ``(chain, draw, client)``, named as ArviZ names
  them (NUTS/HMC: ``diverging``, ``acceptance_rate``, ``step_size``,
  ``n_steps``, ``tree_depth``, ``energy``, ``lp``; SGLD/SGHMC: ``step_size``
  and ``gradient_noise_ratio``, 0 for the full batch; IASG: ``step_size``),
  from each client's latest included round (the draws the server kept, where it
  keeps them; also for methods that keep only summaries, e.g. EPMCMC with
  NUTS clients). :func:`client_view` turns one client into an
  ordinary ArviZ object (``posterior`` + ``sample_stats`` with dims
  ``(chain, draw)``) for ``az.bfmi``, ``az.plot_energy``, trace plots with
  divergences, ...
* ``sample_stats``: the backends' scalar diagnostics per ``(round, client)``
  (mean acceptance, number of divergences, step sizes, gradient-noise
  ratio, ...: the names of ``Result.history``'s ``client_*`` columns), with
  ``participated`` and ``excluded`` flags; NaN where a client sat out. Its
  dims are ``(round, client)``, never ``(chain, draw)``: per-draw values live
  in ``client_sample_stats``.
* ``observed_data``, ``posterior_predictive`` (draws of y, one per
  posterior draw) and ``log_likelihood`` (pointwise, per draw) on the
  evaluation set, so ``az.loo``/``az.compare`` work across algorithms; for
  predictive-space methods ``posterior_predictive`` draws from the pooled
  predictive and ``log_likelihood`` is absent (no per-draw likelihood).

Client-local sites (``infer={"local": True}``). In ``posterior`` a local site
has dims ``(chain, draw, client, *site dims)``: with each global draw, every
client's local sites drawn from that client's local posterior given it (its
conditional; a point estimate's values, repeated over the one draw), so
``az.summary`` gives one row per client (``a[3]``); a deterministic site that
reads local sites gets the ``client`` dim too. An ensemble's global draws
mix the clients, so its ``posterior`` holds the global sites only and each
client's local sites are in ``client_posterior`` (its own joint draws). The
evaluation rows belong to no client of the federation: ``log_likelihood`` and
``posterior_predictive`` are a new client's, each draw's local sites drawn
from their conditional prior given its global sites (``predict(X)``'s
default).
"""
from __future__ import annotations

import numpy as np

import jax
import jax.numpy as jnp

from . import diagnostics as D
from .posteriors import Gaussian, Samples


def _kind(post) -> str:
    from .algorithms.ensemble import EnsemblePosterior
    from .algorithms.predictive_bayes import PredictiveBayesPosterior

    if isinstance(post, PredictiveBayesPosterior):
        return "predictive"
    if isinstance(post, EnsemblePosterior):
        return "ensemble"
    if isinstance(post.form, Gaussian):
        return "gaussian"
    if post.form.draws.reshape(-1, post.form.draws.shape[-1]).shape[0] == 1:
        return "point estimate"
    return "samples"


def _chains_of(result) -> int:
    from .protocols import num_chains

    backend = getattr(result.algorithm, "backend", None) or getattr(result.algorithm, "client", None)
    return num_chains(backend) if backend is not None else 1


def _client_ids(result, k: int) -> np.ndarray:
    valid = getattr(result.server_state, "valid", None)
    ids = np.flatnonzero(np.asarray(valid)) if valid is not None else np.arange(k)
    return ids if ids.size == k else np.arange(k)


def client_chains(result):
    """(client ids, flat draws (C, S, K', d)) of the clients' local posteriors, or None when not kept."""
    post = result.posterior
    cd = getattr(post, "client_draws", None)
    if cd is None:
        return None
    cd = np.asarray(cd)
    K, N, d = cd.shape
    C = _chains_of(result)
    if N % C:
        C = 1
    x = cd.reshape(K, C, N // C, d).transpose(1, 2, 0, 3)
    return _client_ids(result, K), x


def global_chains(result, num_draws: int, num_chains: int, seed: int):
    """(kind, flat draws (C, S, d), description) of the global posterior; draws None when there are none."""
    post = result.posterior
    kind = _kind(post)
    if kind == "predictive":
        return kind, None, ("no global parameter posterior: this method pools the clients' predictive "
                            "distributions (a product in predictive space), which is not the union of client "
                            "draws; the client draws are in client_posterior")
    if kind == "gaussian":
        C = max(1, int(num_chains))
        S = max(1, int(num_draws) // C)
        z = np.asarray(post.form.sample(jax.random.PRNGKey(seed), C * S)).reshape(C, S, -1)
        desc = (f"{C} chains of independent draws from the Gaussian global posterior "
                "(natural parameters in the run directory)")
        from .algorithms.fedpa import FedPA

        if isinstance(result.algorithm, FedPA):
            shape = "diagonal" if post.form.is_diag else "full"
            desc += (f"; FedPA's Gaussian approximation: a {shape} Gaussian centred at the server point, its "
                     "precision from the client draws (not draws of a global sampler)")
        return kind, z, desc
    if kind == "ensemble":
        ids, x = client_chains(result)            # (C, S, K, d) -> chain c interleaves every client's chain c
        C, S, K, d = x.shape
        w = np.asarray(post.mixture_weights)
        return kind, x.reshape(C, S * K, d), (
            f"union of the {K} clients' draws, chain c holding every client's chain c (interleaved); equal to the "
            f"ensemble's mixture when its weights are equal (weights {np.round(w, 4).tolist()})")
    z = np.asarray(post.form.draws).reshape(-1, post.form.draws.shape[-1])
    if kind == "point estimate":
        return kind, z[None], ("a point estimate: one value, not posterior draws (ESS and R-hat are undefined "
                               "and left NaN)")
    C = int(post.info.get("num_chains", 1))
    if C > 1 and z.shape[0] % C == 0:
        return kind, z.reshape(C, z.shape[0] // C, -1), (
            f"the algorithm's stored draws of the global posterior in {C} chains: chain c combines every "
            "client's chain c, so R-hat compares independent chains")
    return kind, z[None], "the algorithm's stored draws of the global posterior, as one chain"


def _constrain_impl(potential, z):
    return jax.vmap(potential.constrain_all)(z)


_constrain_jit = jax.jit(_constrain_impl, static_argnums=0)


def _constrain(potential, z):
    """flat (..., d) -> dict of constrained sites with the same leading axes."""
    lead = z.shape[:-1]
    vals = _constrain_jit(potential, jnp.asarray(z.reshape(-1, z.shape[-1])))
    return {k: np.asarray(v).reshape(lead + v.shape[1:]) for k, v in vals.items()}


def _stats(result):
    """sample_stats arrays (round, client) from the result's per-round client diagnostics."""
    rounds = result.client_diagnostics
    K = result.context.num_clients
    if not rounds:
        return {}
    names = [n for n in rounds[0] if n not in ("participants", "included")]
    out = {n: np.full((len(rounds), K), np.nan) for n in names}
    part = np.zeros((len(rounds), K), bool)
    excl = np.zeros((len(rounds), K), bool)
    for r, entry in enumerate(rounds):
        ids = np.asarray(entry["participants"])
        part[r, ids] = True
        excl[r, ids] = ~np.asarray(entry["included"])
        for n in names:
            v = np.asarray(entry[n], float)
            if v.shape == ids.shape:
                out[n][r, ids] = v
    out = {n: v for n, v in out.items()}
    out["participated"] = part
    out["excluded"] = excl
    return out


def _draw_stats(result):
    """(client ids, name -> (C, S, K') array) of the per-draw statistics kept, or None when there are none."""
    store = getattr(result, "client_draw_stats", None) or {}
    if not store or not np.any(store["has"]):
        return None
    ids = np.flatnonzero(store["has"])
    return ids, {name: np.moveaxis(v[ids], 0, -1) for name, v in store.items() if name != "has"}


def client_view(idata, client: int):
    """One client as an ordinary ArviZ object: its ``client_posterior`` as ``posterior`` and its
    ``client_sample_stats`` as ``sample_stats`` (those present), dims ``(chain, draw, ...)``.

    ``az.summary``, ``az.bfmi`` (needs ``energy``), ``az.plot_energy`` and trace
    plots with divergences then read it as they read any single-model run.
    """
    groups = {}
    for src, dst in (("client_posterior", "posterior"), ("client_sample_stats", "sample_stats")):
        g = D.group(idata, src)
        if g is not None and client in np.asarray(g["client"]):
            groups[dst] = g.sel(client=client, drop=True)
    if not groups:
        raise ValueError(f"client {client} has no draws or per-draw statistics here (groups client_posterior "
                         "and client_sample_stats)")
    return D.make_inference_data(groups)


def to_arviz(result, num_draws: int = 1000, num_chains: int = 4, seed: int = 0, eval_data=None):
    """The groups listed in the module docstring, for ``result`` (see :meth:`Result.to_arviz`)."""
    if not isinstance(num_draws, (int, np.integer)) or num_draws < 1:
        raise ValueError(f"num_draws must be a positive integer, got {num_draws!r}")
    pot = result.context.potential
    local = bool(getattr(pot, "local_sites", ()))
    kind, z, desc = global_chains(result, num_draws, num_chains, seed)
    groups = {}
    attrs = {"algorithm": type(result.algorithm).__name__, "kind": kind, "description": desc}
    attrs.update(product_checks(result))
    if z is not None:
        if not local:
            groups["posterior"] = D._dataset(_constrain(pot, z), attrs=attrs)
        elif kind == "ensemble":
            vals = _constrain(pot, z)
            attrs["description"] = desc + ("; the global sites only (each client's local sites are in "
                                           "client_posterior)")
            groups["posterior"] = D._dataset({n: vals[n] for n in pot.global_sites}, attrs=attrs)
        else:
            vals, client_sites = result.posterior.joint_site_draws(z, jax.random.PRNGKey(seed + 2))
            K = result.posterior.num_local_clients
            dims = {n: ["client"] for n in client_sites}
            attrs["description"] = desc + ("; local sites (dims chain, draw, client, ...) drawn with each global "
                                           "draw from every client's local posterior given it")
            groups["posterior"] = D._dataset(vals, dims=dims, coords={"client": np.arange(K)}, attrs=attrs)
    cl = client_chains(result)
    if cl is not None:
        ids, x = cl
        cpost = _constrain(pot, x)
        dims = {k: ["client"] for k in cpost}
        groups["client_posterior"] = D._dataset(
            cpost, dims=dims, coords={"client": ids},
            attrs={"description": "each client's local posterior: the backend's chains per client "
                                  "(dims chain, draw, client, ...)", "num_chains": x.shape[0]})
    per_draw = _draw_stats(result)
    if per_draw is not None:
        sids, per_draw = per_draw
        groups["client_sample_stats"] = D._dataset(
            per_draw, dims={k: ["client"] for k in per_draw}, coords={"client": sids},
            attrs={"description": "each client's per-draw sampler statistics (dims chain, draw, client) from "
                                  "its latest included round: beside client_posterior where the server keeps "
                                  "the draws"})
    stats = _stats(result)
    if stats:
        groups["sample_stats"] = D._dataset(
            stats, lead=("round", "client"),
            coords={"round": np.arange(1, len(result.client_diagnostics) + 1),
                    "client": np.arange(result.context.num_clients)},
            attrs={"description": "client backend diagnostics per (round, client): NaN where the client did "
                                  "not take part; excluded: its update was not finite and left out"})
    ev = eval_data if eval_data is not None else result.eval_data
    if ev is not None:
        from . import inputs

        X, y = inputs.normalize(ev[0]), np.asarray(ev[1])                 # indices stay integer
        groups["observed_data"] = D._dataset({"y": y}, lead=("obs",) + tuple(f"y_dim_{i}" for i in range(y.ndim - 1)),
                                             attrs={"description": "the evaluation targets"})
        key = jax.random.PRNGKey(seed + 1)
        if z is not None and kind != "point estimate":
            zz = _new_client(pot, z, jax.random.fold_in(key, 5)) if local else z
            ll, yrep = _per_draw(pot, jnp.asarray(zz), inputs.tree_map(jnp.asarray, X), jnp.asarray(y), key)
            groups["log_likelihood"] = D._dataset({"y": ll}, dims={"y": ["obs"]}, attrs={
                "description": "pointwise log p(y_i | x_i, theta) of each global posterior draw on the evaluation set"})
            groups["posterior_predictive"] = D._dataset({"y": yrep}, dims={"y": ["obs"]}, attrs={
                "description": "one draw of y per global posterior draw on the evaluation inputs"})
        elif kind == "predictive":
            yrep = _pooled_predictive_draws(result.posterior, X, num_draws, key)
            groups["posterior_predictive"] = D._dataset({"y": yrep[None]}, dims={"y": ["obs"]}, attrs={
                "description": "draws of y from the pooled (product) predictive, one chain; no per-draw "
                               "likelihood exists, so log_likelihood is absent and az.loo does not apply"})
    idata = D.make_inference_data(groups)
    attrs = {"algorithm": type(result.algorithm).__name__, "kind": kind, "no_posterior": desc if z is None else "",
             **product_checks(result)}
    if getattr(result, "global_khat", None) is not None:
        attrs["pareto_khat_global"] = float(result.global_khat)
    khat = getattr(result, "client_khat", None)
    if khat is not None:
        from . import psis

        attrs["pareto_khat"] = np.asarray(khat, float)
        attrs["pareto_khat_clients"] = np.arange(len(khat))
        attrs["pareto_khat_note"] = (f"Pareto k-hat of each client's Gaussian against its own target (NaN: none); "
                                     f"above {psis.KHAT_MAX} that Gaussian is unreliable")
    _set_attrs(idata, attrs)
    return idata


def _new_client(pot, z, key):
    """Joint draws (..., d) for global draws ``z`` (..., d_g or d): the local block of each drawn from
    the local sites' conditional prior given its global block (a client outside the federation)."""
    z = np.asarray(z)
    lead = z.shape[:-1]
    zg = jnp.asarray(z.reshape(-1, z.shape[-1])[:, :pot.dim_global])
    zl = jax.vmap(pot.sample_local_prior)(jax.random.split(key, zg.shape[0]), zg)
    return np.asarray(jnp.concatenate([zg, zl.astype(zg.dtype)], -1)).reshape(lead + (pot.dim,))


def _set_attrs(idata, attrs):
    try:
        idata.attrs.update(D._clean_attrs(attrs))
    except AttributeError:  # pragma: no cover - InferenceData without attrs
        pass


def _per_draw_impl(pot, z, X, y, key):
    """Pointwise log likelihood (C, S, n) and one y draw per posterior draw (vmapped; no scan, fast to compile)."""
    C, S, d = z.shape
    flat = z.reshape(C * S, d)
    if pot.task == "classification":
        yy = y.astype(jnp.int32)
        classes = jnp.arange(pot.num_classes, dtype=jnp.int32)
        lp = jax.vmap(lambda t: jax.vmap(lambda c: pot.pointwise_log_likelihood(t, X, jnp.full(yy.shape, c)))(
            classes))(flat)                                                    # (CS, classes, n)
        ll = jnp.take_along_axis(lp, yy[None, None, :], axis=1)[:, 0]
        yrep = jax.random.categorical(key, jnp.swapaxes(lp, 1, 2), axis=-1)
    else:
        ll = jax.vmap(lambda t: pot.pointwise_log_likelihood(t, X, y))(flat)
        keys = jax.random.split(key, C * S)
        yrep = jax.vmap(lambda t, k: pot.predictive_distribution(t, X).sample(k))(flat, keys)
    return ll.reshape(C, S, -1), yrep.reshape((C, S) + yrep.shape[1:])


_per_draw_jit = jax.jit(_per_draw_impl, static_argnums=0)


def _per_draw(pot, z, X, y, key):
    ll, yrep = _per_draw_jit(pot, z, X, y, key)
    return np.asarray(ll), np.asarray(yrep)


def _pooled_predictive_draws(post, X, n, key):
    pred = post.predict(X)
    if post.potential.task == "classification":
        logits = jnp.log(jnp.clip(jnp.asarray(pred), 1e-30, None))
        return np.asarray(jax.random.categorical(key, logits, axis=-1, shape=(n, logits.shape[0])))
    mean, var = pred
    return np.asarray(mean + jnp.sqrt(var) * jax.random.normal(key, (n,) + jnp.shape(mean)))


def product_checks(result) -> dict:
    """The checks of a product of client posteriors in its ``info``, as flat numbers: ``mc_error_sd_ratio``
    (the Monte Carlo sd of the product's mean over its posterior sd, largest coordinate) and
    ``mc_error_sd_ratio_<site>`` per model site, ``mc_error_target`` and ``diag_bias_sd`` (a diagonal
    product's estimated bias in posterior sds); empty for other posteriors."""
    info = getattr(result.posterior, "info", None) or {}
    out = {}
    if "mc_error_sd_ratio" in info:
        out["mc_error_sd_ratio"] = float(info["mc_error_sd_ratio"])
        per = info.get("mc_error_sd_ratios")
        if per is not None:
            per = np.asarray(per, np.float64)
            for site in result.context.potential.sites:
                if site.offset + site.size > per.shape[-1]:      # a client-local site: not in the product
                    continue
                out[f"mc_error_sd_ratio_{site.name}"] = float(np.max(per[site.offset:site.offset + site.size]))
    for k in ("mc_error_target", "diag_bias_sd"):
        if k in info and info[k] is not None:
            out[k] = float(info[k])
    return out


# -- diagnostics table --------------------------------------------------------------------------

def diagnostics_rows(result, num_draws: int = 1000, seed: int = 0) -> list:
    """One row per scope (global, each client): draws, ESS, R-hat, Gaussian gap, sampler health."""
    rows = []
    kind, z, _ = global_chains(result, num_draws, 4, seed)
    if z is not None:
        r = {"scope": "global", "kind": kind}
        r.update(D.summarize(z) if kind != "point estimate" else {"chains": 1, "draws": 1})
        gk = getattr(result, "global_khat", None)
        if gk is not None:
            r["khat"] = float(gk)
        checks = product_checks(result)
        if "mc_error_sd_ratio" in checks:
            r["mc_error_sd_ratio"] = checks["mc_error_sd_ratio"]
            r["mc_error_by_site"] = ", ".join(f"{k[len('mc_error_sd_ratio_'):]}: {v:.3g}" for k, v in checks.items()
                                              if k.startswith("mc_error_sd_ratio_"))
        if "diag_bias_sd" in checks:
            r["diag_bias_sd"] = checks["diag_bias_sd"]
        rows.append(r)
    cl = client_chains(result)
    stats = _stats(result)
    last = {n: v[-1] for n, v in stats.items()} if stats else {}
    K = result.context.num_clients
    khat = getattr(result, "client_khat", None)
    per_client = {}
    if cl is not None:
        ids, x = cl
        for j, k in enumerate(ids):
            per_client[int(k)] = D.summarize(x[:, :, j])
    for k in range(K):
        if cl is None and not last and khat is None:
            break
        r = {"scope": f"client {k}", "kind": "client"}
        r.update(per_client.get(k, {}))
        if khat is not None and not np.isnan(khat[k]):
            r["khat"] = float(khat[k])
        for n in ("accept_prob", "num_divergences", "step_size", "noise_ratio", "grad_noise_ratio"):
            if n in last and np.isfinite(last[n][k]):
                r[n] = float(last[n][k])
        if "excluded" in last:
            r["excluded"] = bool(last["excluded"][k])
        rows.append(r)
    return rows


def diagnostics_table(result, warn: bool = True):
    """:class:`fedprob.report.Table` of :func:`diagnostics_rows`, with the warnings of :func:`diagnostics.check`
    (one per cause, the clients aggregated) and divergent transitions; a run warns each cause once, however
    often it is asked."""
    from .table import Table

    from . import psis

    rows = diagnostics_rows(result)
    seen = result.__dict__.setdefault("_warned", set())
    msgs = D.check(rows, warn=warn, seen=seen)
    m = psis.message(getattr(result, "client_khat", None), getattr(result, "global_khat", None))
    if m is not None:
        msgs.append(m)
        if warn:
            D.issue([m], ["khat"], seen, stacklevel=2)
    div = [(int(r["num_divergences"]), r["scope"]) for r in rows if r.get("num_divergences", 0) > 0]
    if div:
        clients = [r for r in rows if str(r.get("scope", "")).startswith("client")]
        n, scope = max(div)
        m = (f"divergent transitions on {len(div)} of {len(clients)} clients, {sum(d for d, _ in div)} in all, "
             f"most {n} ({scope}): raise target_accept_prob or reparameterise the model")
        msgs.append(m)
        if warn:
            D.issue([m], ["clients:divergences"], seen, stacklevel=2)
    return Table(rows, title=f"Diagnostics: {type(result.algorithm).__name__}", notes=msgs)


__all__ = ["to_arviz", "client_view", "diagnostics_rows", "diagnostics_table", "client_chains", "global_chains"]
