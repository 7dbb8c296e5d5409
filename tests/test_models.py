"""Model shapes, parameter counts, causality, dtype handling and input errors."""

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY, tiny_config

from jaxllm import functional as F
from jaxllm.config import ExecutionConfig, ModelConfig
from jaxllm.layers import AttentionInputs, Linear, MultiHeadAttention
from jaxllm.models import build_model, init_kv_cache, stack_blocks, unstack_blocks

ARCHS = {arch: tiny_config(arch) for arch in ("gpt2", "transformer_lm")}


def init(cfg, t=8, seed=0, **execution):
    model = build_model(cfg, ExecutionConfig(**execution))
    params = model.init(jax.random.PRNGKey(seed), jnp.zeros((2, t), jnp.int32))
    return model, params


def n_params(tree):
    return sum(x.size for x in jax.tree_util.tree_leaves(tree))


def test_gpt2_small_has_124_439_808_parameters():
    cfg = ModelConfig()  # the GPT-2 small defaults
    shapes = jax.eval_shape(
        build_model(cfg).init, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32)
    )
    assert n_params(shapes) == 124_439_808


def test_untied_head_adds_vocab_by_dmodel():
    tied, untied = ModelConfig(**TINY), ModelConfig(tie_embeddings=False, **TINY)

    def count(c):
        return n_params(
            jax.eval_shape(build_model(c).init, jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))
        )

    assert count(untied) - count(tied) == 61 * 32


def test_transformer_lm_layout():
    _, params = init(ARCHS["transformer_lm"])
    p = params["params"]
    assert set(p) == {"embed", "h0", "h1", "ln_f", "lm_head"}
    mlp = p["h0"]["mlp"]
    assert mlp["w1"]["kernel"].shape == (32, 48) and mlp["w2"]["kernel"].shape == (48, 32)
    assert not any(
        "bias" in "/".join(map(str, k)) for k in jax.tree_util.tree_flatten_with_path(p)[0]
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_shapes_and_float32_logits(arch):
    model, params = init(ARCHS[arch])
    tokens = jax.random.randint(jax.random.PRNGKey(1), (3, 11), 0, 61)
    logits = model.apply(params, tokens)
    assert logits.shape == (3, 11, 61) and logits.dtype == jnp.float32
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(lambda x: x.dtype == jnp.float32, params))


@pytest.mark.parametrize("arch", ARCHS)
def test_causality(arch):
    """Changing tokens after position t never changes logits at positions <= t."""
    model, params = init(ARCHS[arch])
    apply = jax.jit(model.apply)
    rng = np.random.default_rng(0)
    base = rng.integers(0, 61, size=(2, 16))
    ref = np.asarray(apply(params, jnp.asarray(base)))
    for t in (0, 5, 14):
        changed = base.copy()
        changed[:, t + 1 :] = rng.integers(0, 61, size=(2, 15 - t))
        out = np.asarray(apply(params, jnp.asarray(changed)))
        np.testing.assert_allclose(out[:, : t + 1], ref[:, : t + 1], atol=1e-5)
        assert not np.allclose(out[:, t + 1 :], ref[:, t + 1 :])  # the future did change


@pytest.mark.parametrize("arch", ARCHS)
def test_bfloat16_compute_close_to_float32(arch):
    cfg = ARCHS[arch]
    model, params = init(cfg)
    bf16 = build_model(cfg, ExecutionConfig(compute_dtype="bfloat16"))
    tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 16), 0, 61)
    a, b = model.apply(params, tokens), bf16.apply(params, tokens)
    assert b.dtype == jnp.bfloat16  # logits in compute dtype; the loss upcasts
    b = b.astype(jnp.float32)
    assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(a)) < 3e-2


def test_padding_mask_hides_keys():
    model, params = init(ARCHS["gpt2"])
    tokens = jax.random.randint(jax.random.PRNGKey(3), (1, 8), 0, 61)
    key_mask = jnp.array([[False] * 3 + [True] * 5])  # left padding, as generate makes it
    other = tokens.at[:, :3].set((tokens[:, :3] + 7) % 61)
    cache = init_kv_cache(model, 1, 8)

    def decode(toks):
        return model.apply(params, toks, cache, 0, None, key_mask, method="decode")[0]

    # every real position attends past the padding: changing the pad tokens changes nothing
    np.testing.assert_allclose(decode(tokens)[:, 3:], decode(other)[:, 3:], atol=1e-5)


def test_fused_qkv_is_concatenation_of_separate_projections():
    """The llmsys model's bias-free q/k/v: fused kernel = [Wq | Wk | Wv]."""
    d, h, t = 16, 2, 5
    rng = np.random.default_rng(0)
    wq, wk, wv, wo = (rng.normal(size=(d, d)).astype(np.float32) * 0.3 for _ in range(4))
    x = rng.normal(size=(1, t, d)).astype(np.float32)
    mha = MultiHeadAttention(n_heads=h, qkv_bias=False, out_bias=False)
    params = {
        "params": {"qkv": {"kernel": np.concatenate([wq, wk, wv], axis=1)}, "out": {"kernel": wo}}
    }
    pos = jnp.arange(t)[None]
    with jax.default_matmul_precision("highest"):  # GPUs run float32 matmuls as TF32 otherwise
        y, _ = mha.apply(params, jnp.asarray(x), AttentionInputs(pos))
    q, k, v = ((x @ w).reshape(1, t, h, d // h) for w in (wq, wk, wv))
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // h)
    s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ref = np.einsum("bhqk,bkhd->bqhd", p, v).reshape(1, t, d) @ wo
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5)


def test_split_linear_equals_the_whole_one_with_its_gradients(float64_ref):
    """Linear(splits=3): the blocks of the unsplit output, and the same gradients; the bias
    gradient of 4096 bfloat16 rows summed in float32 (float64 reference: a bfloat16 sum fails)."""
    lin = Linear(24, compute_dtype=jnp.bfloat16)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(4096, 8)), jnp.bfloat16)
    p = {"kernel": jnp.asarray(rng.normal(size=(8, 24)), jnp.float32), "bias": jnp.ones(24)}
    dy = jnp.asarray(rng.normal(size=(4096, 24)) * (rng.random(24) < 0.5), jnp.bfloat16)

    def loss(p, splits):
        y = lin.apply({"params": p}, x, splits=splits)
        y = jnp.concatenate(y, -1) if splits > 1 else y
        return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)), y

    (_, y1), g1 = jax.value_and_grad(loss, has_aux=True)(p, 1)
    (_, y3), g3 = jax.value_and_grad(loss, has_aux=True)(p, 3)
    np.testing.assert_array_equal(y3, y1)
    np.testing.assert_allclose(g3["kernel"], g1["kernel"], rtol=1e-5, atol=1e-3)
    ref = float64_ref(lambda d: jnp.sum(d, 0), dy.astype(jnp.float32))
    for g in (g1, g3):
        np.testing.assert_allclose(g["bias"], ref, rtol=1e-6)
    # forward over reverse (Hessian-vector products) still goes through the bias add
    jax.jacfwd(jax.grad(lambda b: loss({**p, "bias": b}, 3)[0]))(p["bias"])


def test_llmsys_config_is_expressible():
    cfg = ModelConfig(
        vocab_size=10003,
        context_length=40,
        d_model=256,
        n_heads=8,
        n_layers=4,
        d_ff=256,
        qkv_bias=False,
        tie_embeddings=False,
    )
    shapes = jax.eval_shape(
        build_model(cfg).init, jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32)
    )["params"]
    assert "bias" not in shapes["h0"]["attn"]["qkv"]
    assert shapes["h0"]["mlp"]["fc"]["kernel"].shape == (256, 256)


def test_linear_init_and_dtype():
    lin = Linear(512, compute_dtype=jnp.bfloat16)
    p = lin.init(jax.random.PRNGKey(0), jnp.ones((1, 256)))
    assert p["params"]["kernel"].dtype == jnp.float32
    assert abs(float(p["params"]["kernel"].std()) - 0.02) < 2e-3
    assert lin.apply(p, jnp.ones((1, 256))).dtype == jnp.bfloat16


def test_input_errors():
    model, params = init(ARCHS["gpt2"])
    with pytest.raises(ValueError, match="exceeds the model's context_length 16"):
        model.apply(params, jnp.zeros((1, 17), jnp.int32))
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 60\]"):
        model.apply(params, jnp.full((1, 4), 61, jnp.int32))
    with pytest.raises(ValueError, match="token ids"):
        model.apply(params, jnp.full((1, 4), -1, jnp.int32))
    with pytest.raises(ValueError, match="integers"):
        model.apply(params, jnp.zeros((1, 4), jnp.float32))
    # the length check also fires under jit (shapes are static)
    with pytest.raises(ValueError, match="context_length"):
        jax.jit(model.apply)(params, jnp.zeros((1, 17), jnp.int32))
    with pytest.raises(ValueError, match="divisible"):
        build_model(ModelConfig(d_model=30, n_heads=4))
    tokens = jnp.zeros((2, 4), jnp.int32)
    with pytest.raises(ValueError, match=r"targets shape \(2, 3\) must equal tokens shape"):
        model.apply(params, tokens, jnp.zeros((2, 3), jnp.int32), method="loss")
    for bad in (61, -5):  # >= vocab gave a NaN loss, < -1 a finite wrong one
        with pytest.raises(ValueError, match=r"targets must be in \[0, 60\] .* or -1"):
            model.apply(params, tokens, jnp.full((2, 4), bad, jnp.int32), method="loss")


@pytest.mark.parametrize("arch", ARCHS)
def test_targets_give_the_mean_loss_of_the_logits(arch):
    """model(tokens, targets=...) = mean softmax loss of model(tokens) over non-IGNORE targets."""
    model, params = init(ARCHS[arch])
    tokens = jax.random.randint(jax.random.PRNGKey(3), (2, 8), 0, 61)
    targets = jnp.roll(tokens, -1, axis=1).at[:, -1].set(-1)
    loss, aux = model.apply(params, tokens, targets, method="loss")
    logits = model.apply(params, tokens)
    ref = F.cross_entropy(logits, targets, ignore_index=-1)
    np.testing.assert_allclose(loss, ref, rtol=1e-5)
    assert int(aux["count"]) == 14
    np.testing.assert_allclose(aux["loss_sum"], ref * 14, rtol=1e-5)
    hits = (jnp.argmax(logits, -1) == targets) & (targets != -1)
    assert int(aux["correct"]) == int(hits.sum())


def test_dropout_only_in_training_mode():
    model, params = init(ModelConfig(**TINY), dropout=0.5)
    tokens = jnp.ones((1, 8), jnp.int32)
    a = model.apply(params, tokens)
    np.testing.assert_array_equal(a, model.apply(params, tokens))
    b = model.apply(params, tokens, deterministic=False, rngs={"dropout": jax.random.PRNGKey(0)})
    assert not np.allclose(a, b)


def test_attention_impls_agree():
    cfg = ARCHS["transformer_lm"]
    model, params = init(cfg)
    dpa = build_model(cfg, ExecutionConfig(attention_impl="dot_product_attention"))
    tokens = jax.random.randint(jax.random.PRNGKey(4), (2, 12), 0, 61)
    np.testing.assert_allclose(model.apply(params, tokens), dpa.apply(params, tokens), atol=1e-4)
    assert F.MASK_VALUE < -1e29


def test_rotary_theta_and_relative_positions():
    """RoPE makes q.k depend only on the position difference; theta changes the rotation."""
    rng = np.random.default_rng(1)
    q, k = (jnp.asarray(rng.normal(size=(1, 1, 1, 8)), jnp.float32) for _ in range(2))

    def rope(x, pos, theta=100.0):
        return F.apply_rope(x, *F.rope_angles(jnp.array([[pos]]), 8, theta))

    def score(pq, pk):
        return float(jnp.sum(rope(q, pq) * rope(k, pk)))

    np.testing.assert_allclose(score(3, 1), score(12, 10), rtol=1e-5)
    assert abs(score(3, 1) - score(3, 2)) > 1e-4
    assert not np.allclose(rope(q, 3, theta=10000.0), rope(q, 3))


@pytest.mark.parametrize("arch", ARCHS)
def test_short_conv_is_causal_and_refuses_cached_decoding(arch):
    cfg = tiny_config(arch, short_conv=True, short_conv_size=4)
    model, params = init(cfg)
    assert params["params"]["h1"]["conv"]["kernel"].shape == (32, 4)
    rng = np.random.default_rng(2)
    base = rng.integers(0, 61, size=(2, 16))
    changed = base.copy()
    changed[:, 9:] = rng.integers(0, 61, size=(2, 7))
    a, b = model.apply(params, jnp.asarray(base)), model.apply(params, jnp.asarray(changed))
    np.testing.assert_allclose(a[:, :9], b[:, :9], atol=1e-5)
    assert not np.allclose(a[:, 9:], b[:, 9:])
    cache = init_kv_cache(model, 2, 16)
    with pytest.raises(ValueError, match="generate_uncached"):
        model.apply(params, jnp.asarray(base), cache, 0, method="decode")


def test_label_smoothing_only_in_training_loss(arch):
    cfg = tiny_config(arch)
    plain = build_model(cfg)
    model = build_model(cfg, ExecutionConfig(label_smoothing=0.1))
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 8), 0, cfg.vocab_size)
    params = plain.init(jax.random.PRNGKey(1), tokens)["params"]

    def loss(m, deterministic):
        rngs = None if deterministic else {"dropout": jax.random.PRNGKey(2)}
        args = ({"params": params}, tokens, tokens)
        return m.apply(*args, deterministic=deterministic, rngs=rngs, method="loss")

    ref, ref_sums = loss(plain, True)
    evaluated, sums = loss(model, True)  # evaluation: plain cross-entropy
    np.testing.assert_allclose(evaluated, ref, rtol=1e-6)
    trained, train_sums = loss(model, False)  # training: the smoothed objective (dropout 0)
    assert abs(float(trained) - float(ref)) > 1e-3
    np.testing.assert_allclose(train_sums["loss_sum"], ref_sums["loss_sum"], rtol=1e-6)


@pytest.mark.parametrize(
    ("arch", "remat"),
    [("gpt2", "none"), pytest.param("transformer_lm", "block", marks=pytest.mark.slow)],
)
def test_scan_layers_is_the_same_function_of_the_same_parameters(arch, remat):
    """execution.scan_layers: logits, loss gradients and the cached decode equal the unrolled
    model's on the same weights (stack_blocks / unstack_blocks convert the layouts)."""
    cfg = dataclasses.replace(ARCHS[arch], n_layers=3)
    sex = ExecutionConfig(remat=remat, scan_layers=True)
    model, params = init(cfg, remat=remat)
    smodel = build_model(cfg, sex)
    p = params["params"]
    sp = stack_blocks(p, 3)
    shapes = jax.eval_shape(smodel.init, jax.random.PRNGKey(0), jnp.zeros((2, 8), jnp.int32))
    assert jax.tree.structure(shapes["params"]) == jax.tree.structure(sp)
    assert shapes["params"]["blocks"]["block"]["attn"]["qkv"]["kernel"].shape == (3, 32, 96)
    assert set(sp) == {k for k in p if not k.startswith("h")} | {"blocks"}
    tok = jax.random.randint(jax.random.PRNGKey(1), (2, 8), 0, cfg.vocab_size)

    def run(m, q):
        logits = m.apply({"params": q}, tok)
        g = jax.grad(lambda q: m.apply({"params": q}, tok, tok, method="loss")[0])(q)
        return logits, g

    run = jax.jit(run, static_argnums=0)  # one compile per model, not op-by-op dispatch
    highest = jax.default_matmul_precision("highest")  # a GPU runs float32 as TF32 otherwise
    with highest:
        (logits, g), (slogits, sg) = run(model, p), run(smodel, sp)
    np.testing.assert_allclose(slogits, logits, atol=1e-5, rtol=1e-5)
    sg = unstack_blocks(sg)
    assert jax.tree.structure(g) == jax.tree.structure(sg)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(sg), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-4)
    cache = init_kv_cache(smodel, 2, 8)
    assert cache["k"].shape == (3, 2, 8, cfg.n_heads, cfg.head_dim)
    decode = jax.jit(functools.partial(smodel.apply, method="decode"))
    with highest:
        prefill, cache = decode({"params": sp}, tok[:, :5], cache, 0)
        step, _ = decode({"params": sp}, tok[:, 5:6], cache, 5)
    np.testing.assert_allclose(prefill, logits[:, :5], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(step[:, 0], logits[:, 5], atol=1e-5, rtol=1e-5)


def test_scan_layers_inits_every_layer_differently_and_drops_out_per_layer():
    model, params = init(ARCHS["gpt2"], scan_layers=True, dropout=0.5)
    qkv = params["params"]["blocks"]["block"]["attn"]["qkv"]["kernel"]  # (L, D, 3D)
    assert not np.allclose(qkv[0], qkv[1])
    tok = jnp.ones((2, 8), jnp.int32)
    run = jax.jit(lambda key, train: model.apply(params, tok, not train, rngs={"dropout": key}),
                  static_argnums=1)  # fmt: skip
    a, b, c = (run(jax.random.PRNGKey(s), True) for s in (0, 0, 1))
    assert np.allclose(a, b) and not np.allclose(a, c)
    assert not np.allclose(a, run(jax.random.PRNGKey(0), False))


def test_bfloat16_residual_stream():
    """execution.residual_dtype=bfloat16: every block hands on a bf16 stream (x and its pending
    branch h), and the loss and gradients stay close to the float32 stream's (same params).
    GPT-2 only: the cast is the Decoder's (`stream`), shared by every architecture."""
    cfg = ARCHS["gpt2"]
    f32_stream, params = init(cfg, compute_dtype="bfloat16")
    ex = ExecutionConfig(compute_dtype="bfloat16", residual_dtype="bfloat16")
    bf16_stream = build_model(cfg, ex)
    tokens = jax.random.randint(jax.random.PRNGKey(3), (2, 16), 0, 61)
    targets = jnp.roll(tokens, -1, axis=1)

    streams = []

    def record(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if context.method_name == "__call__" and context.module.name.startswith("h"):
            streams.append((out[0].dtype, out[1].dtype))  # a block's (x, h, cache)
        return out

    def loss(model):
        f = lambda p: model.apply(p, tokens, targets, method="loss")[0]  # noqa: E731
        with nn.intercept_methods(record):
            return jax.jit(jax.value_and_grad(f))(params)  # traced here: records once

    (l_ref, g_ref), n_ref = loss(f32_stream), len(streams)
    assert streams and set(streams) == {(jnp.dtype("float32"), jnp.dtype("bfloat16"))}
    streams.clear()
    l_bf, g_bf = loss(bf16_stream)
    assert len(streams) == n_ref and set(streams) == {(jnp.dtype("bfloat16"),) * 2}
    np.testing.assert_allclose(float(l_bf), float(l_ref), rtol=2e-2)
    ga, gb = jax.tree_util.tree_leaves(g_ref), jax.tree_util.tree_leaves(g_bf)
    num = sum(float(jnp.sum((a - b) ** 2)) for a, b in zip(ga, gb, strict=True))
    assert (num / sum(float(jnp.sum(a**2)) for a in ga)) ** 0.5 < 5e-2


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_refuses_writes_past_the_cache_and_positions_past_the_context(arch):
    """A write past the cache's last slot was clamped onto it, and GPT-2 gave NaN logits for
    positions past its table: both are errors naming the allowed range (concrete values)."""
    cfg = ARCHS[arch]
    model, params = init(cfg)
    cache = init_kv_cache(model, 1, 8)
    tok = jnp.zeros((1, 2), jnp.int32)

    def decode(index, positions=None):
        return model.apply(params, tok, cache, index, positions, method="decode")

    decode(6)  # slots 6, 7: the last that fit
    with pytest.raises(ValueError, match=r"cache_index 7 \+ 2 tokens must fit the cache's 8 "
                       r"slots: cache_index in \[0, 6\]"):  # fmt: skip
        decode(7)
    with pytest.raises(ValueError, match=r"positions must be in \[0, 15\] \(context_length 16\)"):
        decode(0, jnp.asarray([[15, 16]]))


@pytest.mark.parametrize("bad", [-1, 61])
def test_out_of_range_ids_give_nan_under_jit(bad):
    """Under jit nothing can raise on token ids: an id outside [0, vocab_size) (negative too)
    gives NaN logits for its sequence (attention spreads the NaN row: 0 x NaN) instead of another
    id's embedding, and the other sequences stay finite; eager apply refuses it."""
    model, params = init(ARCHS["gpt2"])
    tokens = jnp.array([[1, 2, bad, 3], [1, 2, 4, 3]])
    logits = jax.jit(model.apply)(params, tokens)
    assert np.isnan(logits[0, 2]).all() and np.isfinite(logits[1]).all()
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 60\]"):
        model.apply(params, tokens)


@pytest.mark.parametrize("arch", ["gpt2", "transformer_lm"])
def test_read_dtypes_names_only_what_a_block_reads_cast(arch):
    """FSDP gathers the leaves read_dtypes names already cast to the compute dtype: storing
    them cast must leave the loss bit-identical (the conv kernel, read in float32, is not named:
    casting it too would change the loss)."""
    from conftest import tiny_model

    from jaxllm.models.decoder import read_dtypes

    model = tiny_model(arch, short_conv=True, compute_dtype="bfloat16")
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 61, (2, 8)), jnp.int32)
    params = model.init(jax.random.PRNGKey(0), tokens)["params"]
    read = read_dtypes(model.execution)
    blocks = [k for k in params if k.startswith("h")]
    cast = dict(params)
    for k in blocks:
        cast[k] = jax.tree.map(
            lambda x, d: x if d is None else x.astype(d), params[k], read(params[k])
        )
    named = {
        jax.tree_util.keystr(path)
        for path, d in jax.tree_util.tree_flatten_with_path(read(params["h0"]))[0]
        if d is not None
    }
    linears = ["['attn']['qkv']", "['attn']['out']"] + {
        "gpt2": ["['mlp']['fc']", "['mlp']['proj']"],
        "transformer_lm": ["['mlp']['w1']", "['mlp']['w2']", "['mlp']['w3']"],
    }[arch]
    assert named == {f"{m}['kernel']" for m in linears}, named
    loss = lambda p: model.apply({"params": p}, tokens, tokens, method="loss")[0]  # noqa: E731
    assert loss(cast) == loss(params)
    conv = dict(cast)
    for k in blocks:
        conv[k] = {
            **cast[k],
            "conv": jax.tree.map(lambda x: x.astype(jnp.bfloat16), cast[k]["conv"]),
        }
    assert loss(conv) != loss(params)
