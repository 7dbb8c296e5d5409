"""`kernels: pallas` (LayerNorm or RMSNorm with the residual add, attention softmax) and
`loss_impl: pallas` (fused LM head + cross-entropy) run pallas_kernels (interpret mode on CPU):
loss and gradients must match the XLA path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import pallas_kernels_in, tiny_model

from jaxllm.layers import DepthwiseConv1d
from jaxllm.models import init_kv_cache
from jaxllm.train.state import loss_and_sums

# One layer, two heads: each Pallas kernel on CPU runs in (slow) interpret mode.
# attention on the `kernels` path (auto would take cuDNN on a GPU in bf16)
TINY = dict(vocab_size=37, n_layers=1, n_heads=2, attention_impl="xla")
# What the gradient of one layer's loss runs with kernels: pallas (the plan alone could say
# "pallas" while a layer still called XLA): ln_1, then ln_2 and ln_f each with the residual add.
NORM_KERNELS = {
    "gpt2": {"layer_norm_fwd": 1, "add_layer_norm_fwd": 2, "add_layer_norm_bwd": 2,
             "layer_norm_bwd": 1},
    "transformer_lm": {"rms_norm_fwd": 1, "add_rms_norm_fwd": 2, "add_rms_norm_bwd": 2,
                       "rms_norm_bwd": 1},
}  # fmt: skip
SOFTMAX_KERNELS = {"attention_softmax_fwd": 1, "attention_softmax_bwd": 1}


@pytest.mark.parametrize(
    "arch, dtype, tol",
    [
        ("gpt2", "float32", 1e-4),
        pytest.param("gpt2", "bfloat16", 3e-2, marks=pytest.mark.slow),  # (both paths above)
        # RMSNorm (+ residual add) on its kernel, writing the bf16 matmul input from the f32
        # stream and a bf16 branch (the loss agrees exactly, gradients to ~2e-3; float32 to
        # 2e-7: the kernel's math itself is checked in test_pallas_layer_norm.py)
        ("transformer_lm", "bfloat16", 1e-2),
    ],
)
def test_pallas_matches_xla(arch, dtype, tol):
    xla = tiny_model(arch, **TINY, compute_dtype=dtype)
    pallas = tiny_model(arch, **TINY, compute_dtype=dtype, kernels="pallas")
    assert pallas.plan.norm == "pallas"
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 8), 0, 37)
    batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, axis=1)}
    params = xla.init(jax.random.PRNGKey(1), tokens)["params"]

    def loss(model):
        return jax.value_and_grad(lambda p: loss_and_sums(p, model.apply, batch, None)[0])(params)

    assert pallas_kernels_in(lambda: loss(xla)) == {}
    assert pallas_kernels_in(lambda: loss(pallas)) == NORM_KERNELS[arch] | SOFTMAX_KERNELS
    (l_x, g_x), (l_p, g_p) = loss(xla), loss(pallas)
    np.testing.assert_allclose(l_p, l_x, rtol=tol)
    gx, gp = jax.tree_util.tree_leaves(g_x), jax.tree_util.tree_leaves(g_p)
    num = sum(float(jnp.sum((a - b) ** 2)) for a, b in zip(gx, gp, strict=True))
    den = sum(float(jnp.sum(a**2)) for a in gx)
    assert (num / den) ** 0.5 < tol


def test_decoding_with_pallas_norms_matches_xla():
    """Decoding over a KV cache with a padded prompt: attention is XLA on every plan, the
    LayerNorms run the Pallas kernels; logits equal the all-XLA model's."""
    model, ref = tiny_model(**TINY, kernels="pallas"), tiny_model(**TINY)
    tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 8), 0, 37)
    params = model.init(jax.random.PRNGKey(3), tokens)
    key_mask = jnp.array([[True] * 8, [False] * 3 + [True] * 5])
    cache = init_kv_cache(model, 2, 8)

    def decode(m):
        return m.apply(params, tokens, cache, 0, None, key_mask, method="decode")

    assert pallas_kernels_in(lambda: decode(ref)) == {}
    norms = {"layer_norm_fwd": 1, "add_layer_norm_fwd": 2}  # ln_1; ln_2 and ln_f with the add
    assert pallas_kernels_in(lambda: decode(model)) == norms
    (got, _), (want, _) = decode(model), decode(ref)
    np.testing.assert_allclose(got, want, atol=1e-4)


@pytest.mark.parametrize("mode", ["causal", "same", "full"])
def test_depthwise_conv_layer_switch(mode):
    u = jax.random.normal(jax.random.PRNGKey(4), (2, 10, 8))
    xla, pallas = DepthwiseConv1d(3, mode), DepthwiseConv1d(3, mode, path="pallas")
    params = xla.init(jax.random.PRNGKey(5), u)
    np.testing.assert_allclose(pallas.apply(params, u), xla.apply(params, u), atol=1e-5)
    if mode != "full":
        assert xla.apply(params, u).shape == u.shape


@pytest.mark.parametrize(
    "arch, dtype, tol",
    [
        ("gpt2", "float32", 1e-5),
        ("transformer_lm", "float32", 1e-5),
        pytest.param("gpt2", "bfloat16", 2e-2, marks=pytest.mark.slow),
    ],
)
def test_fused_loss_matches_xla_loss(monkeypatch, arch, dtype, tol):
    """loss_impl: pallas (fused head + cross-entropy) = the logits path, with ignored targets,
    for a tied (gpt2) and an untied (transformer_lm) head. The Triton kernel on any machine (a
    Hopper GPU would plan the Mosaic one for bf16: test_pallas_cross_entropy compares the two);
    float32 GEMMs at full precision (a GPU's default TF32 differs by ~3e-5 here)."""
    import pallas_kernels.common as tb

    monkeypatch.setattr(tb, "mosaic_gpu_capable", lambda: False)
    with jax.default_matmul_precision("highest"):
        _fused_loss_matches_xla_loss(arch, dtype, tol)


def _fused_loss_matches_xla_loss(arch, dtype, tol):
    xla, fused = (
        tiny_model(arch, **TINY, compute_dtype=dtype, loss_impl=impl) for impl in ("xla", "pallas")
    )
    tokens = jax.random.randint(jax.random.PRNGKey(6), (3, 8), 0, 37)
    targets = jnp.roll(tokens, -1, axis=1).at[:, :3].set(-1)  # IGNORE the first three
    batch = {"inputs": tokens, "targets": targets}
    params = xla.init(jax.random.PRNGKey(7), tokens)["params"]

    def grads(m):
        return jax.value_and_grad(lambda p: loss_and_sums(p, m.apply, batch, None), has_aux=True)(
            params
        )

    assert pallas_kernels_in(lambda: grads(xla)) == {}
    assert pallas_kernels_in(lambda: grads(fused)) == {"cross_entropy_fwd_bwd": 1}
    outs = [grads(m) for m in (xla, fused)]
    ((l_x, aux_x), g_x), ((l_p, aux_p), g_p) = outs
    np.testing.assert_allclose(l_p, l_x, rtol=tol)
    np.testing.assert_allclose(aux_p["loss_sum"], aux_x["loss_sum"], rtol=tol)
    assert int(aux_p["count"]) == int(aux_x["count"]) == 3 * 5
    assert int(aux_p["correct"]) == int(aux_x["correct"])
    # the mean loss is loss_sum / count
    np.testing.assert_allclose(l_x, aux_x["loss_sum"] / 15, rtol=1e-6)
    gx, gp = jax.tree_util.tree_leaves(g_x), jax.tree_util.tree_leaves(g_p)
    num = sum(float(jnp.sum((a - b) ** 2)) for a, b in zip(gx, gp, strict=True))
    den = sum(float(jnp.sum(a**2)) for a in gx)
    assert (num / den) ** 0.5 < tol
