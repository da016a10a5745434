"""A small Bayesian convolutional network for image classification."""
from __future__ import annotations

import math
import operator
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpyro
import numpyro.distributions as dist

from .linear import check_num_classes, check_scale
from .mlp import check_sizes, dense_layer, init_std, output_likelihood, weight_prior


def to_images(X, image_shape: Optional[tuple]):
    """Inputs -> (n, H, W, C) images.

    X may be (n, H, W) (one channel), (n, H, W, C), or flat (n, H*W*C) with
    ``image_shape`` = (H, W) or (H, W, C); flat square one-channel inputs
    (n, s*s) need no ``image_shape``.
    """
    X = jnp.asarray(X)
    if image_shape is not None:
        shape = tuple(image_shape)
        if len(shape) == 2:
            shape = shape + (1,)
        if X.ndim < 2 or math.prod(X.shape[1:]) != math.prod(shape):
            raise ValueError(f"cnn: X of shape {X.shape} does not hold images of shape {tuple(image_shape)}")
        return X.reshape((X.shape[0],) + shape)
    if X.ndim == 4:
        return X
    if X.ndim == 3:
        return X[..., None]
    if X.ndim == 2:
        s = math.isqrt(X.shape[1])
        if s * s == X.shape[1]:
            return X.reshape(X.shape[0], s, s, 1)
        raise ValueError(f"cnn: flat inputs of shape {X.shape} are not square images; "
                         "pass image_shape=(H, W) or (H, W, C)")
    raise ValueError(f"cnn: X must be (n, H, W), (n, H, W, C) or flat (n, H*W), got shape {X.shape}")


def _int_at_least(name: str, value, minimum: int) -> int:
    try:
        v = operator.index(value)
    except TypeError:
        v = None
    if v is None or isinstance(value, bool) or v < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return v


def pool2x2(h, pool: str):
    """2x2 pooling with stride 2 over the spatial axes of (n, H, W, C) (odd edges dropped)."""
    if h.shape[1] < 2 or h.shape[2] < 2:
        raise ValueError(f"cnn: feature map of spatial size {h.shape[1:3]} is too small to pool; "
                         "use fewer conv layers or larger images")
    window, strides = (1, 2, 2, 1), (1, 2, 2, 1)
    if pool == "max":
        return jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, window, strides, "VALID")
    return jax.lax.reduce_window(h, 0.0, jax.lax.add, window, strides, "VALID") / 4.0


def cnn(num_classes: int, channels: Sequence[int] = (8, 16), kernel_size: int = 3, hidden: int = 64,
        prior_scale: Optional[float] = 1.0, image_shape: Optional[tuple] = None, pool: str = "max",
        init_scale: Optional[float] = None):
    """Bayesian CNN classifier ``model(X, y=None)``.

    Architecture: for each entry c_l of ``channels`` a ``kernel_size`` x
    ``kernel_size`` convolution (stride 1, "SAME" padding, NHWC/HWIO), relu
    and 2x2 ``pool`` ("max" or "avg", stride 2); then flatten, a dense layer of
    ``hidden`` units with relu (skipped when ``hidden=0``), and a dense output
    layer of ``num_classes`` logits.

    Sites in order: ``"conv0_W"`` (k, k, C_in, c_0), ``"conv0_b"`` (c_0,),
    ``"conv1_W"``, ``"conv1_b"``, ..., then ``"W0", "b0"`` (hidden layer) and
    ``"W1", "b1"`` (output layer) as in :func:`bnn_mlp`.

    Prior: ``N(0, prior_scale^2)`` on every weight and bias (default 1, a
    weak prior); ``prior_scale=None`` gives the fan-in prior, weights
    ``N(0, 1/fan_in)`` (fan_in = k*k*C_in for a convolution) and biases
    ``N(0, 1)``. Initialisation is separate from the prior (as in
    :func:`bnn_mlp`): every weight starts at 0 plus ``init_scale`` (default
    ``1/sqrt(fan_in)``) Gaussian noise, every bias at 0.

    Likelihood, inside ``numpyro.plate("data", n)``:
    ``y_i ~ Categorical(logits = net(x_i))``.

    Inputs: (n, H, W), (n, H, W, C), or flat (n, H*W*C) with ``image_shape``
    (flat square one-channel images need none). 8x8 digits and 28x28 MNIST
    work with the defaults.
    """
    C = check_num_classes(num_classes)
    chans = check_sizes("channels", channels)
    k = _int_at_least("kernel_size", kernel_size, 1)
    hidden = _int_at_least("hidden", hidden, 0)
    if pool not in ("max", "avg"):
        raise ValueError(f"pool must be 'max' or 'avg', got {pool!r}")
    check_scale("prior_scale", prior_scale, allow_none=True)
    check_scale("init_scale", init_scale, allow_none=True)

    def model(X, y=None):
        h = to_images(X, image_shape)
        for l, c_out in enumerate(chans):
            c_in = h.shape[-1]
            sw, sb = weight_prior(k * k * c_in, prior_scale)
            W = numpyro.sample(f"conv{l}_W", dist.Normal(0.0, sw).expand([k, k, c_in, c_out]).to_event(4),
                               infer={"init_scale": init_std(k * k * c_in, init_scale)})
            b = numpyro.sample(f"conv{l}_b", dist.Normal(0.0, sb).expand([c_out]).to_event(1))
            h = jax.lax.conv_general_dilated(h.astype(W.dtype), W, window_strides=(1, 1), padding="SAME",
                                             dimension_numbers=("NHWC", "HWIO", "NHWC"))
            h = pool2x2(jax.nn.relu(h + b), pool)
        h = h.reshape(h.shape[0], -1)
        layer = 0
        if hidden:
            h = jax.nn.relu(dense_layer("W0", "b0", h, hidden, prior_scale, init_scale))
            layer = 1
        out = dense_layer(f"W{layer}", f"b{layer}", h, C, prior_scale, init_scale)
        output_likelihood(out, y, C, None, 1.0, "cnn")

    model.__name__ = "cnn"
    model.__doc__ = cnn.__doc__
    return model
