"""pallas_kernels.layer_norm (and rms_norm, the same kernels without mean and beta) against the
float64 references: values, gradients, jit, vmap.

On CPU the kernels run in interpret mode; with JAX_PLATFORMS=cuda,cpu (tests/conftest.py pins the
CPU otherwise) the same tests check the compiled kernels on a GPU.
Tolerances: float32 within 1e-5 (rel and abs, on unit-scale outputs) of float64; bfloat16 outputs
within about one bfloat16 rounding (2e-2 rel + abs).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from pallas_kernels import (
    add_layer_norm,
    add_layer_norm_ref,
    add_rms_norm,
    add_rms_norm_ref,
    layer_norm,
    layer_norm_ref,
    rms_norm,
    rms_norm_ref,
)
from pallas_kernels.layer_norm import Config

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def make(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=shape) * 2 + 0.5, dtype)
    gamma = jnp.asarray(rng.normal(size=shape[-1:]), jnp.float32)
    beta = jnp.asarray(rng.normal(size=shape[-1:]), jnp.float32)
    return x, gamma, beta


CASES = [  # shape, dtype, config
    ((3, 5, 100), jnp.float32, None),
    ((37, 64), jnp.float32, Config(block_rows=4, num_warps=4, programs=3)),
    ((2, 1000), jnp.bfloat16, None),
    ((9, 768), jnp.float32, Config(block_rows=2, num_warps=4, programs=2)),
    ((3, 8192), jnp.float32, None),
]


@pytest.mark.parametrize("shape,dtype,cfg", CASES)
def test_values_match_float64_reference(float64_ref, shape, dtype, cfg):
    x, gamma, beta = make(shape, dtype)
    y = layer_norm(x, gamma, beta, config=cfg)
    assert y.dtype == dtype and y.shape == shape
    ref = float64_ref(layer_norm_ref, x, gamma, beta)
    np.testing.assert_allclose(np.asarray(y, np.float64), ref, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("shape,dtype,cfg", [c for c in CASES if c[1] == jnp.float32][:3])
def test_grads_match_float64_reference(float64_ref, shape, dtype, cfg):
    x, gamma, beta = make(shape, dtype, seed=1)
    dy = jnp.asarray(np.random.default_rng(2).normal(size=shape), dtype)

    def loss(fn, **kw):
        return lambda x, g, b, dy: jnp.sum(fn(x, g, b, **kw) * dy)

    grads = jax.grad(loss(layer_norm, config=cfg), argnums=(0, 1, 2))(x, gamma, beta, dy)
    refs = float64_ref(jax.grad(loss(layer_norm_ref), argnums=(0, 1, 2)), x, gamma, beta, dy)
    for g, r in zip(grads, refs, strict=True):
        scale = np.abs(r).max()
        np.testing.assert_allclose(np.asarray(g, np.float64), r, rtol=1e-4, atol=1e-5 * scale)


def test_bfloat16_grads_close_to_reference(float64_ref):
    x, gamma, beta = make((6, 200), jnp.bfloat16, seed=3)
    dy = jnp.asarray(np.random.default_rng(4).normal(size=x.shape), jnp.bfloat16)
    dx = jax.grad(lambda x: jnp.sum(layer_norm(x, gamma, beta) * dy))(x)
    assert dx.dtype == jnp.bfloat16
    ref = float64_ref(jax.grad(lambda x, dy: jnp.sum(layer_norm_ref(x, gamma, beta) * dy)), x, dy)
    err = np.linalg.norm(np.asarray(dx, np.float64) - ref) / np.linalg.norm(ref)
    assert err < 1e-2


def test_check_grads():
    x, gamma, beta = make((4, 33), jnp.float32, seed=5)
    check_grads(
        layer_norm, (x, gamma, beta), order=1, modes=["rev"], atol=1e-2, rtol=1e-2, eps=1e-3
    )


def test_jit_and_vmap():
    x, gamma, beta = make((3, 4, 50), jnp.float32, seed=6)
    y = jax.jit(jax.vmap(lambda x: layer_norm(x, gamma, beta, eps=1e-6)))(x)
    np.testing.assert_allclose(y, layer_norm_ref(x, gamma, beta, eps=1e-6), rtol=1e-5, atol=1e-5)
    g = jax.jit(jax.grad(lambda g: jnp.sum(jax.vmap(lambda x: layer_norm(x, g, beta))(x) ** 2)))
    gr = jax.grad(lambda g: jnp.sum(layer_norm_ref(x, g, beta) ** 2))
    np.testing.assert_allclose(g(gamma), gr(gamma), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "x_shape,dtype,g_shape,match",
    [
        ((), jnp.float32, (1,), "at least 1 dim"),
        ((2, 8), jnp.int32, (8,), "dtype"),
        ((2, 8), jnp.float32, (7,), "gamma must have shape"),
        ((1, 20000), jnp.float32, (20000,), "hidden size"),
    ],
)
def test_bad_inputs_raise(x_shape, dtype, g_shape, match):
    with pytest.raises(ValueError, match=match):
        layer_norm(jnp.zeros(x_shape, dtype), jnp.ones(g_shape), jnp.zeros(g_shape))


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(x=jnp.zeros((0, 8))), r"no rows to normalise: shape \(0, 8\)"),
        (dict(eps=-1.0), r"eps must be a finite real number >= 0 \(not an array\), got -1.0"),
        (dict(eps=jnp.float32(1e-5)), "eps must be a finite real number"),  # an array
        (dict(config=Config(4, 4, 0)), "config.programs must be >= 1"),
        (dict(config=Config(3, 4, 8)), "config.block_rows must be a power of two, got 3"),
    ],
)
def test_bad_settings_raise_before_the_kernel(kw, match):
    """They divided by zero or produced NaN rows inside the kernel (or failed only at GPU
    compile time: Triton tiles are powers of two)."""
    args = dict(x=jnp.zeros((4, 8)), gamma=jnp.ones(8), beta=jnp.zeros(8)) | kw
    with pytest.raises(ValueError, match=match):
        layer_norm(**args)


def test_numpy_scalar_eps_is_taken():
    """np.float32(1e-5) (a config read through NumPy) is a number like 1e-5."""
    x, gamma, beta = make((4, 8), jnp.float32, seed=9)
    got = layer_norm(x, gamma, beta, eps=np.float32(1e-5))
    np.testing.assert_array_equal(got, layer_norm(x, gamma, beta, eps=float(np.float32(1e-5))))


def test_float32_in_bfloat16_out(float64_ref):
    """The pre-norm mixed-precision case: f32 residual in, bf16 matmul input out, bf16 dy in."""
    x, gamma, beta = make((6, 96), jnp.float32, seed=5)
    y = layer_norm(x, gamma, beta, out_dtype=jnp.bfloat16)
    assert y.dtype == jnp.bfloat16
    ref = float64_ref(layer_norm_ref, x, gamma, beta)
    np.testing.assert_allclose(np.asarray(y, np.float64), ref, rtol=1e-2, atol=1e-2)
    dy = jnp.asarray(np.random.default_rng(6).normal(size=x.shape), jnp.bfloat16)

    def loss(fn, **kw):
        return lambda x, g, b: jnp.sum(fn(x, g, b, **kw).astype(jnp.float32) * dy)

    grads = jax.grad(loss(layer_norm, out_dtype=jnp.bfloat16), argnums=(0, 1, 2))(x, gamma, beta)
    assert grads[0].dtype == jnp.float32
    refs = float64_ref(jax.grad(loss(layer_norm_ref), argnums=(0, 1, 2)), x, gamma, beta)
    for g, r in zip(grads, refs, strict=True):
        np.testing.assert_allclose(np.asarray(g, np.float64), r, atol=1e-4 * np.abs(r).max())
    with pytest.raises(ValueError, match="out_dtype must be one of"):
        layer_norm(x, gamma, beta, out_dtype=jnp.int32)


SMALL_CFG = Config(block_rows=4, num_warps=4, programs=3)


@pytest.mark.parametrize(
    "shape,x_dtype,h_dtype,out_dtype,cfg",
    [
        ((4, 5, 100), jnp.float32, jnp.float32, jnp.float32, None),
        ((37, 64), jnp.float32, jnp.bfloat16, jnp.bfloat16, SMALL_CFG),
        ((37, 64), jnp.bfloat16, jnp.bfloat16, jnp.bfloat16, SMALL_CFG),  # a bf16 residual stream
    ],
)
def test_add_layer_norm_matches_reference(float64_ref, shape, x_dtype, h_dtype, out_dtype, cfg):
    """s = x + h (in x's dtype) and LayerNorm(s) in one kernel; gradients include the residual
    stream's ds."""
    x, gamma, beta = make(shape, x_dtype, seed=7)
    rng = np.random.default_rng(8)
    h = jnp.asarray(rng.normal(size=shape), h_dtype)
    ds = jnp.asarray(rng.normal(size=shape), x_dtype)
    dy = jnp.asarray(rng.normal(size=shape), out_dtype)
    s, y = add_layer_norm(x, h, gamma, beta, out_dtype=out_dtype, config=cfg)
    assert s.dtype == x_dtype and y.dtype == out_dtype
    s_ref, y_ref = float64_ref(add_layer_norm_ref, x, h, gamma, beta)
    tol = 1e-5 if out_dtype == jnp.float32 else 1e-2
    s_tol = 1e-6 if x_dtype == jnp.float32 else 4e-3  # s rounded to bf16 (8-bit mantissa)
    np.testing.assert_allclose(np.asarray(s, np.float64), s_ref, rtol=s_tol, atol=s_tol)
    # y is the norm of the stored s exactly (as the backward rebuilds it from s)
    y_of_s = layer_norm(s, gamma, beta, out_dtype=out_dtype, config=cfg)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_of_s))
    np.testing.assert_allclose(np.asarray(y, np.float64), y_ref, rtol=tol, atol=tol)

    def loss(fn, **kw):
        def f(x, h, g, b):
            s, y = fn(x, h, g, b, **kw)
            return jnp.sum((s * ds).astype(jnp.float32)) + jnp.sum(y.astype(jnp.float32) * dy)

        return f

    grads = jax.grad(loss(add_layer_norm, out_dtype=out_dtype, config=cfg), argnums=(0, 1, 2, 3))(
        x, h, gamma, beta
    )
    assert grads[0].dtype == x_dtype and grads[1].dtype == h_dtype
    refs = float64_ref(jax.grad(loss(add_layer_norm_ref), argnums=(0, 1, 2, 3)), x, h, gamma, beta)
    gtol = 1e-4 if h_dtype == jnp.float32 else 1e-2
    for g, r in zip(grads, refs, strict=True):
        np.testing.assert_allclose(np.asarray(g, np.float64), r, atol=gtol * np.abs(r).max())


def test_add_layer_norm_rejects_mismatched_branch():
    x, gamma, beta = make((4, 8), jnp.float32)
    with pytest.raises(ValueError, match="h must match x's shape"):
        add_layer_norm(x, jnp.zeros((4, 9)), gamma, beta)


# ----------------------------------------------------------------------------- RMSNorm


def rms_norm_np(x, gamma, eps=1e-5):
    """The float64 NumPy oracle: x / sqrt(mean(x^2) + eps) * gamma."""
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * np.asarray(gamma, np.float64)


RMS_CASES = [  # shape (ragged row counts: none is a multiple of the block), dtype, config
    ((37, 64), jnp.float32, Config(block_rows=4, num_warps=4, programs=3)),
    ((3, 5, 96), jnp.bfloat16, None),  # 15 rows, default blocks of 16
    ((9, 768), jnp.float32, Config(block_rows=2, num_warps=4, programs=2)),
    ((9, 768), jnp.bfloat16, None),
]


@pytest.mark.parametrize("shape,dtype,cfg", RMS_CASES)
def test_add_rms_norm_values_match_numpy_float64(shape, dtype, cfg):
    """s = x + h and y = RMSNorm(s) against NumPy in float64 (the plain rms_norm's values are
    checked with its gradients below)."""
    x, gamma, _ = make(shape, dtype, seed=10)
    h = jnp.asarray(np.random.default_rng(11).normal(size=shape), dtype)
    s, y = add_rms_norm(x, h, gamma, config=cfg)
    assert s.dtype == y.dtype == dtype and y.shape == shape
    s64 = np.asarray(s, np.float64)  # the kernel's s, rounded to x's dtype, is y's input
    want_s = np.asarray(x, np.float64) + np.asarray(h, np.float64)
    np.testing.assert_allclose(s64, want_s, rtol=TOL[dtype] / 2)
    np.testing.assert_allclose(
        np.asarray(y, np.float64), rms_norm_np(s64, gamma), rtol=TOL[dtype], atol=TOL[dtype]
    )
    # y is the norm of the stored s exactly (the statistics of the rounded stream, as the
    # backward rebuilds them): the plain kernel on s gives the same bits
    np.testing.assert_array_equal(np.asarray(y), np.asarray(rms_norm(s, gamma, config=cfg)))


@pytest.mark.parametrize("case", [0, 1], ids=["f32", "bf16"])
def test_rms_norm_grads_match_float64_reference(float64_ref, case):
    """d/dx, d/dh (the residual), d/dgamma of add_rms_norm's s and y, and the plain rms_norm's
    values and d/dx, d/dgamma, against NumPy / jax.grad of the float64 reference. bf16: the
    model's mixed-precision case (float32 stream x, bf16 branch h, bf16 output and dy)."""
    shape, dtype, cfg = RMS_CASES[case]
    x, gamma, _ = make(shape, jnp.float32, seed=12)
    rng = np.random.default_rng(13)
    h = jnp.asarray(rng.normal(size=shape), dtype)
    ds = jnp.asarray(rng.normal(size=shape), jnp.float32)
    dy = jnp.asarray(rng.normal(size=shape), dtype)
    kw = dict(out_dtype=dtype, config=cfg)

    y, vjp = jax.vjp(lambda x, g: rms_norm(x, g, **kw), x, gamma)
    assert y.dtype == dtype
    tol = TOL[dtype]
    np.testing.assert_allclose(np.asarray(y, np.float64), rms_norm_np(x, gamma), rtol=tol, atol=tol)
    grads = vjp(dy)
    _, add_vjp = jax.vjp(lambda *a: add_rms_norm(*a, **kw), x, h, gamma)
    grads += add_vjp((ds, dy))
    assert grads[0].dtype == grads[2].dtype == jnp.float32 and grads[3].dtype == dtype

    def plain(x, g):
        return jnp.sum(rms_norm_ref(x, g).astype(jnp.float32) * dy)

    def add(x, h, g):
        s, y = add_rms_norm_ref(x, h, g)
        return jnp.sum(s * ds) + jnp.sum(y.astype(jnp.float32) * dy)

    refs = float64_ref(jax.grad(plain, argnums=(0, 1)), x, gamma)
    refs += float64_ref(jax.grad(add, argnums=(0, 1, 2)), x, h, gamma)
    gtol = 1e-5 if dtype == jnp.float32 else 1e-2
    for g, r in zip(grads, refs, strict=True):
        np.testing.assert_allclose(np.asarray(g, np.float64), r, atol=gtol * np.abs(r).max())
