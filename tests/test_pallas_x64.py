"""The Pallas kernels with `jax_enable_x64` on.

With x64 on, Python ints and loop counters become int64 while program ids stay int32, and Pallas'
interpret mode rejected the mix (`index arguments to dynamic_slice must be integers of the same
type, got: int32, int64`). Each kernel's core cases run here under x64, forward and gradient, with
float32 inputs, against the jnp references evaluated in float64. Outputs must stay float32.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (
    add_layer_norm,
    add_layer_norm_ref,
    attention_softmax,
    attention_softmax_ref,
    depthwise_conv1d,
    depthwise_conv1d_ref,
    layer_norm,
    layer_norm_ref,
    linear_cross_entropy,
    linear_cross_entropy_ref,
)
from pallas_kernels.attention_softmax import Config as SoftmaxConfig
from pallas_kernels.cross_entropy import Config as CEConfig
from pallas_kernels.depthwise_conv1d import Config as ConvConfig
from pallas_kernels.layer_norm import Config as LNConfig

F32, F64 = jnp.float32, np.float64


@pytest.fixture(autouse=True)
def _x64():
    """x64 on for the whole test, as a user's `jax.config.update("jax_enable_x64", True)`;
    float32 GEMMs at full precision so the float64 comparison holds on a GPU (TF32) too."""
    with jax.enable_x64(True), jax.default_matmul_precision("highest"):
        yield


def normal(shape, seed, scale=1.0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape) * scale, F32)


def f64(*arrays):
    return [None if a is None else jnp.asarray(a, F64) for a in arrays]


def assert_close(got, ref, tol):
    assert got.dtype == F32, got.dtype
    np.testing.assert_allclose(np.asarray(got, F64), np.asarray(ref, F64), rtol=tol, atol=tol)


def test_layer_norm():
    cfg = LNConfig(block_rows=4, num_warps=4, programs=3)  # several row blocks per program
    x, g, b, dy = normal((37, 64), 0, 2.0), normal(64, 1), normal(64, 2), normal((37, 64), 3)
    assert_close(layer_norm(x, g, b, config=cfg), layer_norm_ref(*f64(x, g, b)), 1e-5)

    def loss(fn, **kw):
        return lambda x, g, b, dy: jnp.sum(fn(x, g, b, **kw) * dy)

    grads = jax.grad(loss(layer_norm, config=cfg), argnums=(0, 1, 2))(x, g, b, dy)
    refs = jax.grad(loss(layer_norm_ref), argnums=(0, 1, 2))(*f64(x, g, b, dy))
    for got, ref in zip(grads, refs, strict=True):
        assert_close(got, ref, 1e-4)


def test_add_layer_norm():
    cfg = None  # the default (tuned) config
    x, h, g, b = normal((9, 40), 0), normal((9, 40), 1), normal(40, 2), normal(40, 3)
    s, y = add_layer_norm(x, h, g, b, config=cfg)
    s_ref, y_ref = add_layer_norm_ref(*f64(x, h, g, b))
    assert_close(s, s_ref, 1e-6)
    assert_close(y, y_ref, 1e-5)

    def loss(fn, **kw):
        def f(x, h, g, b):
            s, y = fn(x, h, g, b, **kw)
            return jnp.sum(y * jnp.cos(y)) + jnp.sum(s * s)

        return f

    grads = jax.grad(loss(add_layer_norm, config=cfg), argnums=(0, 1, 2, 3))(x, h, g, b)
    refs = jax.grad(loss(add_layer_norm_ref), argnums=(0, 1, 2, 3))(*f64(x, h, g, b))
    for got, ref in zip(grads, refs, strict=True):
        assert_close(got, ref, 1e-4)


@pytest.mark.parametrize(
    "shape,mask_shape,causal,scale,cfg",
    [  # one row held whole; rows swept in chunks (the online max/sum loop)
        ((2, 3, 5, 7), (2, 1, 1, 7), True, 0.5, None),
        ((1, 2, 9, 37), (1, 1, 9, 37), True, None, SoftmaxConfig(2, 4, max_block=16)),
    ],
)
def test_attention_softmax(shape, mask_shape, causal, scale, cfg):
    x, dy = normal(shape, 0, 3.0), normal(shape, 1)
    rng = np.random.default_rng(2)
    mask = np.where(rng.random(mask_shape) < 0.3, -np.inf, rng.normal(size=mask_shape))
    mask = jnp.asarray(mask, F32)
    kw = dict(causal=causal, scale=scale)
    y = attention_softmax(x, mask, config=cfg, **kw)
    assert_close(y, attention_softmax_ref(*f64(x, mask), **kw), 1e-5)

    def loss(fn, **kw2):
        return lambda x, m, dy: jnp.sum(fn(x, m, **kw, **kw2) * dy)

    got = jax.grad(loss(attention_softmax, config=cfg))(x, mask, dy)
    assert_close(got, jax.grad(loss(attention_softmax_ref))(*f64(x, mask, dy)), 1e-5)


@pytest.mark.parametrize(
    "shape,k_size,mode,cfg",
    [
        ((2, 37, 20), 3, "same", ConvConfig(block_t=8, block_d=16, num_warps=4, bwd_programs=4)),
        ((1, 9, 8), 4, "full", None),
    ],
)
def test_depthwise_conv1d(shape, k_size, mode, cfg):
    u, w, b = normal(shape, 0), normal((shape[2], k_size), 1, 1 / k_size), normal(shape[2], 2)
    out = depthwise_conv1d(u, w, b, mode, config=cfg)
    assert_close(out, depthwise_conv1d_ref(*f64(u, w, b), mode), 1e-5)
    g = normal(out.shape, 3)

    def loss(fn, **kw):
        return lambda u, w, b, g: jnp.sum(fn(u, w, b, mode, **kw) * g)

    grads = jax.grad(loss(depthwise_conv1d, config=cfg), argnums=(0, 1, 2))(u, w, b, g)
    refs = jax.grad(loss(depthwise_conv1d_ref), argnums=(0, 1, 2))(*f64(u, w, b, g))
    for got, ref in zip(grads, refs, strict=True):
        assert_close(got, ref, 1e-4)


@pytest.mark.parametrize(
    "n,d,v,cfg",
    [  # several rows per program and chunks per row; the default one-row, one-chunk config
        (37, 16, 300, CEConfig(block_rows=4, block_cols=64, num_warps=4, programs=3)),
        (5, 8, 200, None),
    ],
)
def test_linear_cross_entropy(n, d, v, cfg):
    rng = np.random.default_rng(0)
    x, w = normal((n, d), 1), normal((v, d), 2, 0.5)
    targets = jnp.asarray(rng.integers(0, v, n))  # int64: what jnp makes of ints under x64
    assert targets.dtype == jnp.int64
    weights = jnp.asarray(rng.random(n) / n, F32)
    loss, ce, hit = linear_cross_entropy(x, w, targets, weights, F32, config=cfg)
    ref_loss, ref_ce, ref_hit = linear_cross_entropy_ref(
        *f64(x, w), targets, *f64(weights), compute_dtype=F64
    )
    assert_close(loss, ref_loss, 1e-5)
    assert_close(ce, ref_ce, 1e-5)
    np.testing.assert_array_equal(np.asarray(hit), np.asarray(ref_hit))

    def grad(fn, dtype, **kw):
        return jax.grad(lambda x, w, wt: fn(x, w, targets, wt, dtype, **kw)[0], argnums=(0, 1))

    grads = grad(linear_cross_entropy, F32, config=cfg)(x, w, weights)
    refs = grad(linear_cross_entropy_ref, F64)(*f64(x, w, weights))
    for got, ref in zip(grads, refs, strict=True):
        assert_close(got, ref, 1e-5)
