"""pallas_kernels.attention_softmax against the float64 reference: values, gradients, jit, vmap.

On CPU the kernels run in interpret mode; with JAX_PLATFORMS=cuda,cpu (tests/conftest.py pins the
CPU otherwise) the same tests check the compiled kernels on a GPU.
Tolerances: float32 outputs within 1e-5 (rel) + 1e-6 (abs) of float64; bfloat16/float16 outputs
within one rounding of the 16-bit type (1e-2 rel + abs, probabilities are at most 1).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from pallas_kernels import attention_softmax, attention_softmax_ref
from pallas_kernels.attention_softmax import Config

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2, jnp.float16: 1e-2}
LOOPED = Config(block_rows=2, num_warps=4, max_block=16)  # forces the chunked (long-row) path


def make(shape, mask_shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=shape) * 3, dtype)
    if mask_shape is None:
        return x, None
    mask = np.where(rng.random(mask_shape) < 0.3, -np.inf, rng.normal(size=mask_shape))
    mask[0, 0, 0] = -np.inf  # a fully masked row must give zeros
    return x, jnp.asarray(mask, jnp.float32)


CASES = [  # shape, mask shape, causal, scale, dtype, config
    ((2, 3, 5, 7), (2, 1, 1, 7), True, 0.5, jnp.float32, None),
    ((1, 2, 9, 37), (1, 1, 9, 37), False, None, jnp.float32, LOOPED),
    ((2, 2, 6, 4), None, True, None, jnp.float32, None),  # Tq > Tk: first rows fully masked
    ((1, 2, 8, 33), (1, 1, 1, 33), True, 0.125, jnp.float32, LOOPED),
    ((2, 1, 3, 130), (2, 1, 3, 130), False, 1.0, jnp.bfloat16, None),
    ((1, 2, 4, 20), None, True, 0.3, jnp.float16, LOOPED),
]


@pytest.mark.parametrize("shape,mask_shape,causal,scale,dtype,cfg", CASES)
def test_values_match_float64_reference(float64_ref, shape, mask_shape, causal, scale, dtype, cfg):
    x, mask = make(shape, mask_shape, dtype)
    y = attention_softmax(x, mask, causal=causal, scale=scale, config=cfg)
    assert y.dtype == dtype and y.shape == shape
    ref = float64_ref(lambda x, m: attention_softmax_ref(x, m, causal=causal, scale=scale), x, mask)
    y = np.asarray(y, np.float64)
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y, ref, rtol=TOL[dtype], atol=TOL[dtype])
    dead = ref.sum(-1) == 0  # fully masked rows
    assert dead.any() == (mask is not None or shape[2] > shape[3])
    assert (y[dead] == 0).all()


@pytest.mark.parametrize("cfg", [None, LOOPED])
def test_shift_invariant_far_below_zero(float64_ref, cfg):
    """softmax(x - 100) = softmax(x): the chunked path's running sum once rescaled by
    exp(0 - max) = inf for rows below -88.7 (0 * inf = NaN) and wrote unnormalised rows."""
    x, _ = make((1, 2, 4, 37), None, jnp.float32, seed=3)
    y = attention_softmax(x - 100.0, config=cfg)
    ref = float64_ref(lambda x: attention_softmax_ref(x), x)
    np.testing.assert_allclose(np.asarray(y, np.float64), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape,mask_shape,causal,scale,dtype,cfg", [CASES[i] for i in (0, 1, 3)])
def test_grad_matches_float64_reference(float64_ref, shape, mask_shape, causal, scale, dtype, cfg):
    x, mask = make(shape, mask_shape, dtype, seed=1)
    dy = jnp.asarray(np.random.default_rng(2).normal(size=shape), dtype)

    def loss(fn, **kw):
        return lambda x, m, dy: jnp.sum(fn(x, m, causal=causal, scale=scale, **kw) * dy)

    g = jax.grad(loss(attention_softmax, config=cfg))(x, mask, dy)
    ref = float64_ref(jax.grad(loss(attention_softmax_ref)), x, mask, dy)
    np.testing.assert_allclose(np.asarray(g, np.float64), ref, rtol=1e-5, atol=1e-5)


def test_check_grads_and_zero_mask_cotangent():
    x, mask = make((1, 2, 3, 6), (1, 1, 3, 6), jnp.float32, seed=3)
    check_grads(
        lambda x: attention_softmax(x, mask, causal=True, scale=0.7),
        (x,),
        order=1,
        modes=["rev"],
        atol=1e-2,
        rtol=1e-2,
        eps=1e-3,
    )
    gm = jax.grad(lambda m: jnp.sum(attention_softmax(x, m) ** 2))(jnp.zeros_like(mask))
    assert (gm == 0).all()


def test_jit_and_vmap():
    x, mask = make((3, 2, 2, 5, 9), None, jnp.float32, seed=4)  # leading axis vmapped
    mask = jnp.asarray(np.random.default_rng(5).normal(size=(2, 1, 1, 9)), jnp.float32)
    f = jax.jit(jax.vmap(lambda s: attention_softmax(s, mask, causal=True)))
    y = f(x)
    ref = jnp.stack([attention_softmax_ref(s, mask, causal=True) for s in x])
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)
    g = jax.jit(jax.grad(lambda x: jnp.sum(jax.vmap(attention_softmax)(x) ** 3)))(x)
    gr = jax.grad(lambda x: jnp.sum(jax.vmap(attention_softmax_ref)(x) ** 3))(x)
    np.testing.assert_allclose(g, gr, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "shape,dtype,mask_shape,scale,match",
    [
        ((2, 3, 4), jnp.float32, None, None, "4-D"),
        ((1, 2, 3, 4), jnp.int32, None, None, "dtype"),
        ((1, 2, 3, 4), jnp.float32, (1, 2, 3, 4), None, "may not vary over H"),
        ((1, 2, 3, 4), jnp.float32, (1, 1, 3, 5), None, "Tk"),
        ((1, 2, 3, 4), jnp.float32, None, jnp.ones(()), "scale"),
    ],
)
def test_bad_inputs_raise(shape, dtype, mask_shape, scale, match):
    mask = None if mask_shape is None else jnp.zeros(mask_shape)
    with pytest.raises(ValueError, match=match):
        attention_softmax(jnp.zeros(shape, dtype), mask, scale=scale)


def test_empty_scores_and_bad_configs_raise():
    with pytest.raises(ValueError, match=r"B, H, Tq, Tk >= 1, got shape \(1, 1, 2, 0\)"):
        attention_softmax(jnp.zeros((1, 1, 2, 0)))
    for cfg, match in ((Config(0, 4, 16), "block_rows must be >= 1"),
                       (Config(1, 4, 12), "max_block must be a power of two, got 12")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            attention_softmax(jnp.zeros((1, 1, 2, 8)), config=cfg)
