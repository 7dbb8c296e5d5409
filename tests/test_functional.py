"""jaxllm.functional against float64 NumPy references: values and gradients."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jaxllm import functional as F

RNG = np.random.default_rng(0)


def np_logsumexp(x, axis=-1):
    m = np.max(x, axis=axis, keepdims=True)
    return (m + np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True))).squeeze(axis)


def np_softmax(x, axis=-1):
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


@pytest.mark.parametrize("approximate", [True, False])
def test_gelu_matches_reference(approximate):
    x = RNG.normal(size=(64, 33)) * 4
    if approximate:
        ref = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    else:
        ref = 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))
    assert rel_err(F.gelu(jnp.asarray(x, jnp.float32), approximate), ref) < 1e-6
    # the erf form is jax.nn.gelu(approximate=False)
    np.testing.assert_allclose(
        F.gelu(jnp.float32(1.3), approximate),
        jax.nn.gelu(jnp.float32(1.3), approximate=approximate),
        rtol=1e-6,
    )


def test_gelu_grad():
    check_grads(
        lambda x: F.gelu(x),
        (jnp.linspace(-5, 5, 41, dtype=jnp.float32),),
        order=1,
        modes=["rev"],
        atol=1e-2,
        rtol=1e-2,
    )


def test_gelu_custom_vjp_matches_analytic_derivative():
    # d/dx of the tanh GELU, in float64 NumPy
    x = np.linspace(-6, 6, 97)
    c = math.sqrt(2 / math.pi)
    t = np.tanh(c * (x + 0.044715 * x**3))
    ref = 0.5 * (1 + t) + 0.5 * x * (1 - t**2) * c * (1 + 3 * 0.044715 * x**2)
    g = jax.vmap(jax.grad(F.gelu))(jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(g, ref, atol=1e-5)
    # bfloat16 in, bfloat16 gradient out (the MLP runs it in compute dtype)
    gb = jax.grad(lambda v: F.gelu(v).astype(jnp.float32).sum())(jnp.asarray(x, jnp.bfloat16))
    assert gb.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(gb, np.float64), ref, atol=3e-2)


def test_gelu_backward_shares_nothing_with_the_forward():
    # On the GPU the forward runs inside the MLP GEMM's cuBLASLt epilogue only while no other
    # op uses its subexpressions; the barrier in the backward keeps XLA's CSE from sharing
    # x * x or tanh with it (-0.7 ms a GPT-2 step: benchmarks/RESULTS.md).
    fwd = str(jax.make_jaxpr(F.gelu)(jnp.ones(4)))
    bwd = str(jax.make_jaxpr(jax.grad(lambda v: F.gelu(v).sum()))(jnp.ones(4)))
    assert "optimization_barrier" not in fwd
    assert "optimization_barrier" in bwd


@pytest.mark.parametrize("scale", [1.0, 1e4])
def test_logsumexp_stable_for_extreme_inputs(scale):
    x = RNG.normal(size=(16, 50)) * scale
    x[0] = -scale  # constant row
    got = F.logsumexp(jnp.asarray(x, jnp.float32), axis=-1)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, np_logsumexp(x), rtol=1e-6, atol=1e-3)


@pytest.mark.parametrize("scale", [1.0, 3.0, 1e4])
def test_logsumexp_grad_is_softmax(scale):
    x = RNG.normal(size=(8, 20)) * scale
    if scale < 10:  # a spread-out softmax: a gradient through the max alone would fail
        assert np_softmax(x).max() < 0.99
    g = jax.grad(lambda z: F.logsumexp(z, axis=-1).sum())(jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(g, np_softmax(x), atol=1e-6)


def test_one_hot():
    ids = jnp.array([[0, 3], [4, 5]])  # 5 is out of range -> zero row
    oh = F.one_hot(ids, 5)
    assert oh.shape == (2, 2, 5)
    np.testing.assert_array_equal(oh.sum(-1), [[1, 1], [1, 0]])
    assert oh[0, 1, 3] == 1


@pytest.mark.parametrize("temperature", [0.5, 1.0, 3.0])
def test_softmax_temperature(temperature):
    x = RNG.normal(size=(10, 17)) * 30
    got = F.softmax(jnp.asarray(x, jnp.float32), temperature=temperature)
    assert rel_err(got, np_softmax(x / temperature)) < 1e-5
    with pytest.raises(ValueError, match="temperature"):
        F.softmax(jnp.ones(3), temperature=0.0)


def test_softmax_float32_within_1e6_of_float64_at_large_offsets():
    """CS336's check: softmax(x + 100) of float32 x within 1e-6 of float64.
    exp(z - logsumexp(z)) misses it by up to ~3e-6 here: logsumexp ~ 102 rounds to float32
    (ulp 7.6e-6), and that error multiplies every probability. Few keys, so probabilities are
    large and the error shows."""
    x = (np.random.default_rng(3).normal(size=(16, 8)) + 100).astype(np.float32)
    got = F.softmax(jnp.asarray(x))
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(
        np.asarray(got, np.float64), np_softmax(x.astype(np.float64)), atol=1e-6
    )
    # a fully masked row (MASK_VALUE everywhere) is uniform, as MASK_VALUE's comment promises
    np.testing.assert_allclose(F.softmax(jnp.full((2, 4), F.MASK_VALUE)), 0.25, rtol=1e-6)
    # -inf entries get probability 0; the rest normalise among themselves
    got = F.softmax(jnp.asarray([[0.0, -np.inf, 1.0]]))
    np.testing.assert_allclose(got, np_softmax(np.array([[0.0, -700.0, 1.0]])), atol=1e-7)


def test_softmax_grad_matches_finite_differences():
    x = RNG.normal(size=(3, 7)) * 3
    w = RNG.normal(size=(3, 7))
    with jax.enable_x64():  # finite differences need float64
        check_grads(
            lambda z: F.softmax(z, temperature=0.7) * jnp.asarray(w),
            (jnp.asarray(x),),
            order=2,
            modes=["fwd", "rev"],
        )
    # float32: the Jacobian-vector product is diag(p) - p p^T
    p = np_softmax(x)
    g = jax.grad(lambda z: jnp.sum(F.softmax(z) * jnp.asarray(w, jnp.float32)))(
        jnp.asarray(x, jnp.float32)
    )
    np.testing.assert_allclose(g, p * (w - np.sum(p * w, -1, keepdims=True)), atol=1e-6)


@pytest.mark.parametrize("scale", [1.0, 1e4])
def test_softmax_loss_matches_reference(scale):
    logits = RNG.normal(size=(32, 100)) * scale
    target = RNG.integers(0, 100, size=32)
    ref = np_logsumexp(logits) - logits[np.arange(32), target]
    got = F.softmax_loss(jnp.asarray(logits, jnp.float32), jnp.asarray(target))
    assert got.shape == (32,)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-3 * scale / 1e2)


def test_softmax_loss_gradient_vs_float64():
    logits = RNG.normal(size=(6, 11)) * 5
    target = RNG.integers(0, 11, size=6)
    g = jax.grad(lambda z: F.softmax_loss(z, jnp.asarray(target)).sum())(
        jnp.asarray(logits, jnp.float32)
    )
    ref = np_softmax(logits) - np.eye(11)[target]
    np.testing.assert_allclose(g, ref, atol=1e-6)
    with jax.enable_x64():
        check_grads(
            lambda z: F.softmax_loss(z, jnp.asarray(target)),
            (jnp.asarray(logits),),
            order=2,
            modes=["rev"],  # custom_vjp: reverse mode only
        )
    # bf16 logits: the gradient comes back in bf16 and matches the float64 reference
    gb = jax.grad(lambda z: F.softmax_loss(z, jnp.asarray(target)).sum())(
        jnp.asarray(logits, jnp.bfloat16)
    )
    assert gb.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(gb, np.float64), ref, atol=2e-2)


def test_label_smoothed_softmax_loss_vs_float64():
    eps, v = 0.1, 11
    logits = RNG.normal(size=(6, v)) * 3
    target = RNG.integers(0, v, size=6)
    q = (1 - eps) * np.eye(v)[target] + eps / v  # the smoothed target distribution
    log_p = logits - np_logsumexp(logits)[:, None]
    ref = -np.sum(q * log_p, axis=-1)
    z = jnp.asarray(logits, jnp.float32)
    got = F.softmax_loss(z, jnp.asarray(target), eps)
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    g = jax.grad(lambda z: F.softmax_loss(z, jnp.asarray(target), eps).sum())(z)
    np.testing.assert_allclose(g, np_softmax(logits) - q, atol=1e-6)
    with jax.enable_x64():
        check_grads(
            lambda z: F.softmax_loss(z, jnp.asarray(target), eps),
            (jnp.asarray(logits),),
            order=1,
            modes=["rev"],
        )


def test_linear_cross_entropy_smoothing_changes_objective_not_metric():
    rng = np.random.default_rng(7)  # own generator: the module RNG's state depends on test order
    x = jnp.asarray(rng.normal(size=(8, 5)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(13, 5)), jnp.float32)
    t = jnp.asarray(rng.integers(0, 13, size=8))
    wts = jnp.full((8,), 1 / 8)
    with jax.default_matmul_precision("highest"):  # a GPU runs float32 matmuls as TF32 otherwise
        plain, ce, _ = F.linear_cross_entropy(x, w, t, wts, jnp.float32)
        smooth, ce_s, _ = F.linear_cross_entropy(x, w, t, wts, jnp.float32, 0.2)
    np.testing.assert_allclose(ce_s, ce)  # the reported cross-entropy is the plain one
    np.testing.assert_allclose(plain, jnp.mean(ce), rtol=1e-6)
    # float64: smoothed objective = mean((1 - eps) nll + eps mean_j(-log p_j)), eps = 0.2
    logits = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T  # (8, 13)
    logp = logits - np_logsumexp(logits)[:, None]
    nll = -logp[np.arange(8), np.asarray(t)]
    ref = np.mean(0.8 * nll - 0.2 * logp.mean(-1))
    np.testing.assert_allclose(float(smooth), ref, rtol=1e-5)
    assert abs(ref - nll.mean()) > 1e-2  # this data makes smoothing visible


def test_cross_entropy_ignores_padding():
    logits = RNG.normal(size=(3, 7, 13))
    targets = RNG.integers(0, 13, size=(3, 7))
    targets[0, 4:] = -100
    targets[2, :] = -100
    valid = targets != -100
    per = (
        np_logsumexp(logits)
        - np.take_along_axis(logits, np.where(valid, targets, 0)[..., None], -1)[..., 0]
    )
    ref = per[valid].mean()
    got = F.cross_entropy(jnp.asarray(logits, jnp.float32), jnp.asarray(targets), ignore_index=-100)
    np.testing.assert_allclose(got, ref, rtol=1e-6)
    # all ignored: 0, not NaN; and the gradient is finite
    all_ign = jnp.full((2, 3), -100)
    assert F.cross_entropy(jnp.zeros((2, 3, 5)), all_ign, ignore_index=-100) == 0.0
    g = jax.grad(lambda z: F.cross_entropy(z, all_ign, ignore_index=-100))(jnp.zeros((2, 3, 5)))
    assert np.all(np.isfinite(g)) and np.all(g == 0)
    # by default IGNORE (-1) targets count nothing, as everywhere else
    ign = np.where(valid, targets, -1)
    got = F.cross_entropy(jnp.asarray(logits, jnp.float32), jnp.asarray(ign))
    np.testing.assert_allclose(got, ref, rtol=1e-6)
    # without ignore_index: plain mean
    np.testing.assert_allclose(
        F.cross_entropy(
            jnp.asarray(logits, jnp.float32), jnp.asarray(np.abs(targets) % 13), ignore_index=None
        ),
        (
            np_logsumexp(logits)
            - np.take_along_axis(logits, (np.abs(targets) % 13)[..., None], -1)[..., 0]
        ).mean(),
        rtol=1e-6,
    )


def test_causal_mask_forms():
    b = F.causal_mask(4)
    assert b.dtype == jnp.bool_
    np.testing.assert_array_equal(b, np.tril(np.ones((4, 4), bool)))
    a = F.causal_mask(4, additive=True)
    assert a.dtype == jnp.float32
    assert np.all(a[np.tril_indices(4)] == 0) and np.all(a[np.triu_indices(4, 1)] < -1e29)
    # a fully masked row stays finite in softmax (uniform), never NaN
    assert np.all(np.isfinite(F.softmax(jnp.full((1, 4), F.MASK_VALUE))))


def test_dropout():
    x = jnp.ones((1000,))
    assert F.dropout(x, 0.5, None) is x
    y = F.dropout(x, 0.5, jax.random.PRNGKey(0))
    kept = np.asarray(y) != 0
    assert 0.4 < kept.mean() < 0.6
    np.testing.assert_allclose(np.asarray(y)[kept], 2.0)
    with pytest.raises(ValueError, match="dropout rate"):
        F.dropout(x, 1.0, jax.random.PRNGKey(0))


def test_layer_norm_and_rms_norm_vs_float64():
    x = RNG.normal(size=(5, 48)) * 3 + 1
    s, b = RNG.normal(size=48), RNG.normal(size=48)
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    ref = (x - mu) / np.sqrt(var + 1e-5) * s + b

    def f32(a):
        return jnp.asarray(a, jnp.float32)

    assert rel_err(F.layer_norm(f32(x), f32(s), f32(b)), ref) < 1e-5
    ref_rms = x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-5) * s
    assert rel_err(F.rms_norm(f32(x), f32(s)), ref_rms) < 1e-5
    assert F.layer_norm(f32(x).astype(jnp.bfloat16), f32(s), f32(b)).dtype == jnp.bfloat16


def test_rope_rotates_adjacent_pairs():
    # position p, pair i rotates (x[2i], x[2i+1]) by p * theta^(-2i/d)
    d, theta = 8, 10000.0
    x = RNG.normal(size=(1, 3, 2, d))
    pos = np.array([[0, 1, 5]])
    cos, sin = F.rope_angles(jnp.asarray(pos), d, theta)
    got = np.asarray(F.apply_rope(jnp.asarray(x, jnp.float32), cos, sin))
    ref = np.empty_like(x)
    for t in range(3):
        for i in range(d // 2):
            ang = pos[0, t] * theta ** (-2 * i / d)
            c, s = math.cos(ang), math.sin(ang)
            a, b = x[0, t, :, 2 * i], x[0, t, :, 2 * i + 1]
            ref[0, t, :, 2 * i], ref[0, t, :, 2 * i + 1] = a * c - b * s, a * s + b * c
    np.testing.assert_allclose(got, ref, atol=1e-5)
    np.testing.assert_allclose(got[0, 0], x[0, 0], atol=1e-6)  # position 0 is the identity


def test_attention_vs_float64_reference():
    b, t, h, dh = 2, 5, 3, 4
    q, k, v = (RNG.normal(size=(b, t, h, dh)) for _ in range(3))
    key_mask = np.ones((b, t), bool)
    key_mask[1, 3:] = False
    mask = F.attention_mask(t, t, 0, jnp.asarray(key_mask))
    got = F.attention(*(jnp.asarray(a, jnp.float32) for a in (q, k, v)), mask)
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(dh)
    allowed = np.tril(np.ones((t, t), bool))[None, None] & key_mask[:, None, None, :]
    probs = np_softmax(np.where(allowed, scores, -np.inf))
    ref = np.einsum("bhqk,bkhd->bqhd", probs, v)
    assert rel_err(got, ref) < 1e-5
    # mask None: every query sees every key
    full = F.attention(*(jnp.asarray(a, jnp.float32) for a in (q, k, v)), None)
    ref = np.einsum("bhqk,bkhd->bqhd", np_softmax(scores), v)
    assert rel_err(full, ref) < 1e-5


@pytest.mark.parametrize(
    "policy", [None, jax.checkpoint_policies.everything_saveable], ids=["plain", "checkpoint"]
)
def test_gelu_reads_the_bias_add_directly_under_checkpoint(policy):
    # The GEMM epilogue (matmul + bias + GELU) needs GELU to read the bias add. jax.checkpoint
    # inserts a reduce_precision after any saved value the forward also reads (FSDP's per-layer
    # gather runs each layer so); GELU's saved value is its own no-op rounding of x instead.
    def mlp(x, w, b):
        return F.gelu(jnp.dot(x, w) + b)

    f = mlp if policy is None else jax.checkpoint(mlp, policy=policy)
    args = [jnp.ones(s, jnp.bfloat16) for s in ((4, 8), (8, 16), (16,))]
    step = jax.value_and_grad(lambda *a: f(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    hlo = jax.jit(step).lower(*args).as_text()
    ops = dict(re.findall(r"(%\w+) = stablehlo\.(\w+)", hlo))
    dot = next(name for name, op in ops.items() if op == "dot_general")
    pre = re.search(rf"(%\w+) = stablehlo\.add {dot}, ", hlo).group(1)  # matmul + bias
    assert re.search(rf"stablehlo\.multiply {pre}, {pre}\b", hlo)  # GELU's x * x reads it
