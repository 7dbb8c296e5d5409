"""pallas_kernels.depthwise_conv1d against the float64 reference: values, gradients, jit, vmap.

On CPU the kernels run in interpret mode; on a GPU the same tests check the compiled kernels.
Tolerances: float32 within 1e-5 (rel and abs) of float64; bfloat16 / float16 outputs within about
one rounding of the type (2e-2 / 5e-3, rel + abs, on outputs of order 1).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from pallas_kernels import depthwise_conv1d, depthwise_conv1d_ref
from pallas_kernels.depthwise_conv1d import Config

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.float16: 5e-3}
SMALL = Config(block_t=8, block_d=16, num_warps=4, bwd_programs=4)  # several tiles and chunks


def make(shape, k_size, dtype, seed=0):
    rng = np.random.default_rng(seed)
    u = jnp.asarray(rng.normal(size=shape), dtype)
    w = jnp.asarray(rng.normal(size=(shape[2], k_size)) / k_size, dtype)
    b = jnp.asarray(rng.normal(size=shape[2]), dtype)
    return u, w, b


CASES = [  # shape, K, mode, dtype, config
    ((2, 37, 20), 3, "same", jnp.float32, SMALL),
    ((1, 9, 8), 4, "full", jnp.float32, None),
    ((3, 5, 33), 7, "causal", jnp.float32, SMALL),
    ((1, 40, 24), 3, "full", jnp.float32, SMALL),
    ((2, 17, 40), 5, "same", jnp.bfloat16, None),
    ((1, 23, 16), 3, "causal", jnp.float16, SMALL),
]


@pytest.mark.parametrize("shape,k_size,mode,dtype,cfg", CASES)
def test_values_match_float64_reference(float64_ref, shape, k_size, mode, dtype, cfg):
    u, w, b = make(shape, k_size, dtype)
    out = depthwise_conv1d(u, w, b, mode, config=cfg)
    out_len = shape[1] + (k_size - 1 if mode == "full" else 0)
    assert out.dtype == dtype and out.shape == (shape[0], out_len, shape[2])
    ref = float64_ref(lambda u, w, b: depthwise_conv1d_ref(u, w, b, mode), u, w, b)
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, rtol=TOL[dtype], atol=TOL[dtype])


def test_full_mode_worked_example():
    """CS229S layout: out[0] = u[0] * w[K-1] + b, and the last output is u[L-1] * w[0] + b."""
    u, w, b = make((1, 6, 3), 3, jnp.float32, seed=7)
    out = depthwise_conv1d(u, w, b, "full")
    np.testing.assert_allclose(out[0, 0], u[0, 0] * w[:, 2] + b, rtol=1e-6)
    np.testing.assert_allclose(out[0, -1], u[0, -1] * w[:, 0] + b, rtol=1e-6)


@pytest.mark.parametrize("shape,k_size,mode,dtype,cfg", CASES[1:4])
def test_grads_match_float64_reference(float64_ref, shape, k_size, mode, dtype, cfg):
    u, w, b = make(shape, k_size, dtype, seed=1)
    out_len = shape[1] + (k_size - 1 if mode == "full" else 0)
    g = jnp.asarray(np.random.default_rng(2).normal(size=(shape[0], out_len, shape[2])), dtype)

    def loss(fn, **kw):
        return lambda u, w, b, g: jnp.sum(fn(u, w, b, mode, **kw) * g)

    grads = jax.grad(loss(depthwise_conv1d, config=cfg), argnums=(0, 1, 2))(u, w, b, g)
    refs = float64_ref(jax.grad(loss(depthwise_conv1d_ref), argnums=(0, 1, 2)), u, w, b, g)
    for gr, r in zip(grads, refs, strict=True):
        np.testing.assert_allclose(np.asarray(gr, np.float64), r, rtol=1e-5, atol=1e-4)


def test_bfloat16_grads_close_to_reference(float64_ref):
    u, w, b = make((1, 12, 8), 3, jnp.bfloat16, seed=3)
    g = jnp.asarray(np.random.default_rng(4).normal(size=u.shape), jnp.bfloat16)
    grads = jax.grad(lambda *a: jnp.sum(depthwise_conv1d(*a) * g), argnums=(0, 1, 2))(u, w, b)
    refs = float64_ref(
        jax.grad(lambda u, w, b, g: jnp.sum(depthwise_conv1d_ref(u, w, b) * g), (0, 1, 2)),
        u, w, b, g,
    )  # fmt: skip
    for gr, r in zip(grads, refs, strict=True):
        assert gr.dtype == jnp.bfloat16
        assert np.linalg.norm(np.asarray(gr, np.float64) - r) / np.linalg.norm(r) < 1e-2


def test_check_grads():
    u, w, b = make((1, 7, 5), 3, jnp.float32, seed=5)
    check_grads(
        lambda u, w, b: depthwise_conv1d(u, w, b, "causal"),
        (u, w, b),
        order=1,
        modes=["rev"],
        atol=1e-2,
        rtol=1e-2,
        eps=1e-3,
    )


def test_jit_and_vmap():
    u, w, b = make((3, 10, 8), 3, jnp.float32, seed=6)
    us = jnp.stack([u, 2 * u])  # (2, 3, 10, 8): vmapped leading axis
    f = jax.jit(jax.vmap(lambda u: depthwise_conv1d(u, w, b, "full")))
    ref = jnp.stack([depthwise_conv1d_ref(x, w, b, "full") for x in us])
    np.testing.assert_allclose(f(us), ref, rtol=1e-5, atol=1e-5)
    dw = jax.jit(
        jax.grad(lambda w: jnp.sum(jax.vmap(lambda u: depthwise_conv1d(u, w, b))(us) ** 2))
    )
    dw_ref = jax.grad(lambda w: sum(jnp.sum(depthwise_conv1d_ref(x, w, b) ** 2) for x in us))
    np.testing.assert_allclose(dw(w), dw_ref(w), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "u_shape,w_shape,b_shape,dtype,mode,match",
    [
        ((4, 8), (8, 3), (8,), jnp.float32, "same", "3-D"),
        ((1, 4, 8), (7, 3), (8,), jnp.float32, "same", "w must be 2-D"),
        ((1, 4, 8), (8, 3), (7,), jnp.float32, "same", "b must have shape"),
        ((1, 4, 8), (8, 9), (8,), jnp.float32, "same", "kernel size K"),
        ((1, 4, 8), (8, 3), (8,), jnp.int32, "same", "dtype"),
        ((1, 4, 8), (8, 3), (8,), jnp.float32, "valid", "mode must be one of"),
    ],
)
def test_bad_inputs_raise(u_shape, w_shape, b_shape, dtype, mode, match):
    with pytest.raises(ValueError, match=match):
        depthwise_conv1d(
            jnp.ones(u_shape, dtype), jnp.ones(w_shape, dtype), jnp.ones(b_shape, dtype), mode
        )
