"""Flash attention, forward and backward (pallas_kernels/flash_attention*.py).

A CPU cannot compile the Mosaic GPU kernels. The tests (1) run them in jax's Mosaic GPU
interpreter (with tests/mgpu_interpret.py's patches for the wgmma forms the interpreter lacks)
against the float64 reference: output and logsumexp, and dq, dk, dv against the reference's VJP,
on tile configurations that exercise the unmasked, diagonal and skipped blocks of the causal
loops; (2) cross-lower the public function and its gradient for CUDA at GPT-2's shape, which runs
Mosaic GPU's layout and wgmma shape checks; (3) on a Hopper GPU (JAX_PLATFORMS=cuda,cpu) compile
them and compare with the reference. The interpreter ignores the
shared-memory tiling and swizzle and runs wgmma synchronously: those, timing and register
pressure are the GPU's to check (also benchmarks/flash_attention_bench.py).
"""

import argparse
import functools
import importlib.util

import jax
import jax.numpy as jnp
import mgpu_interpret
import numpy as np
import pytest
from conftest import ROOT

from jaxllm import ops
from pallas_kernels import flash_attention_mgpu as fa_mgpu
from pallas_kernels.common import mosaic_gpu_capable
from pallas_kernels.flash_attention import causal_tile, flash_attention
from pallas_kernels.reference import flash_attention_ref

# the module (the package's name flash_attention is its function)
flash_module = importlib.import_module("pallas_kernels.flash_attention")

try:  # jax's Mosaic GPU interpreter: private, so its absence skips rather than fails
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
except ImportError:
    InterpretGPUParams = None


@pytest.fixture
def interpreter(monkeypatch):
    if InterpretGPUParams is None or not mgpu_interpret.patched(monkeypatch):
        pytest.skip("no Mosaic GPU interpreter to patch in this jax")
    return InterpretGPUParams()


@pytest.fixture
def pretend_gpu(monkeypatch):
    """Make the public function see a Hopper GPU, so it takes the Mosaic GPU path on CPU."""
    import pallas_kernels.common as common

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(common, "mosaic_gpu_capable", lambda: True)


def _qkv(shape, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    return tuple(jax.random.normal(key, shape, jnp.bfloat16) for key in keys)


def _lse_ref(q, k, causal):
    """logsumexp over the keys of the scaled scores, (B, H, T)."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    if causal:
        s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
    return jax.nn.logsumexp(s, axis=-1)


CASES = {  # name -> (D, causal, config[, (B, T, H)]); (1, 256, 2) unless given: 4 query tiles
    # of 2 x 64, 2 units, 2 CUDA blocks
    "causal_d64": (64, True, fa_mgpu.Config(64, 128, 2)),
    "causal_d64_3stages": (64, True, fa_mgpu.Config(64, 128, 3)),  # head dim 64's default
    "causal_d128": (128, True, fa_mgpu.Config(64, 128, 2)),
    # 64-key blocks: warpgroup 0 skips the block only warpgroup 1 needs; 3 slots > the first
    # tile's 2 blocks
    "causal_d64_kv64_3stages": (64, True, fa_mgpu.Config(64, 64, 3)),
    "full_d64": (64, False, fa_mgpu.Config(64, 128, 2)),
    # 9 tiles (5 units, the last one tile) on 2 CUDA blocks: block 0 runs units 0, 2, 4
    "causal_d64_odd_2ctas": (64, True, fa_mgpu.Config(64, 64, 3, ctas=2), (1, 384, 3)),
}


@pytest.mark.parametrize(  # the fast tier runs one case (and the end-to-end test), slow all
    "name",
    [n if n == "causal_d64_odd_2ctas" else pytest.param(n, marks=pytest.mark.slow) for n in CASES],
)
def test_forward_in_interpreter(interpreter, float64_ref, name):
    d, causal, cfg, (b, t, h) = (*CASES[name], (1, 256, 2))[:4]
    q, k, v = _qkv((b, t, h, d))
    o, lse = fa_mgpu.forward(q, k, v, cfg, d**-0.5, causal, interpret=interpreter)
    assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == (b, h, t)
    ref = float64_ref(lambda q, k, v: flash_attention_ref(q, k, v, causal=causal), q, k, v)
    np.testing.assert_allclose(np.asarray(o, np.float64), ref, atol=2e-2)  # bf16 output and P
    np.testing.assert_allclose(lse, float64_ref(_lse_ref, q, k, causal=causal), atol=1e-4)


BWD_CASES = {  # name -> (D, causal, config[, (B, T, H)]); (1, 256, 2) unless given
    "causal_d64": (64, True, fa_mgpu.BwdConfig(64, 64, 2)),
    # 128-key blocks: the dq kernel masks one key block, the dk/dv kernel two query blocks and
    # its second warpgroup skips two
    "causal_d64_kv128_3stages": (64, True, fa_mgpu.BwdConfig(64, 128, 3)),
    "causal_d128_kv128": (128, True, fa_mgpu.BwdConfig(64, 128, 1)),
    "causal_d128": (128, True, fa_mgpu.BwdConfig(64, 64, 2)),
    # one CUDA block: 4 dq tiles (2 units) and 2 dk/dv tiles (1 unit) in turn
    "full_d64_1stage_1cta": (64, False, fa_mgpu.BwdConfig(64, 128, 1, ctas=1)),
    # one ring slot: skipped and computed blocks share it
    "causal_d64_1stage": (64, True, fa_mgpu.BwdConfig(64, 64, 1)),
    # T = 512: two dk/dv tiles of 2 x 128 keys a head, the second starting past query block 0;
    # 2 CUDA blocks, a unit (pair) of them each
    "causal_d64_kv128_t512_2ctas": (64, True, fa_mgpu.BwdConfig(64, 128, 2, ctas=2), (1, 512, 2)),
    "full_d128": (128, False, fa_mgpu.BwdConfig(64, 64, 2)),
    # 8 dq and 8 dk/dv tiles (4 units each) on 3 CUDA blocks: the rings run on across tiles
    "causal_d64_t512_3ctas": (64, True, fa_mgpu.BwdConfig(64, 64, 2, ctas=3), (1, 512, 2)),
    # 9 tiles a kernel (5 units, the last one tile) on 2 CUDA blocks
    "causal_d64_odd_2ctas": (64, True, fa_mgpu.BwdConfig(64, 64, 2, ctas=2), (1, 384, 3)),
}


def _grad_close(got, ref):
    """bf16 gradients against float64 ones: within 1% of the largest (measured about 0.4%)."""
    for g, r in zip(got, ref, strict=True):
        assert g.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(g, np.float64), r, atol=1e-2 * np.abs(r).max())


@pytest.mark.slow  # the fast tier checks the backward end to end (the test below)
@pytest.mark.parametrize("name", sorted(BWD_CASES))
def test_backward_in_interpreter(interpreter, float64_ref, name):
    """dq, dk, dv of the backward kernels, given the exact o and lse (rounded as the forward
    stores them), against the float64 reference's VJP."""
    d, causal, cfg, (b, t, h) = (*BWD_CASES[name], (1, 256, 2))[:4]
    q, k, v = _qkv((b, t, h, d))
    do = jax.random.normal(jax.random.PRNGKey(7), q.shape, jnp.bfloat16)
    o = float64_ref(flash_attention_ref, q, k, v, causal=causal).astype(jnp.bfloat16)
    lse = float64_ref(_lse_ref, q, k, causal=causal).astype(np.float32)
    got = fa_mgpu.backward(q, k, v, o, lse, do, cfg, d**-0.5, causal, interpret=interpreter)

    def ref_grads(q, k, v, do):
        return jax.vjp(lambda *x: flash_attention_ref(*x, causal=causal), q, k, v)[1](do)

    _grad_close(got, float64_ref(ref_grads, q, k, v, do))


@pytest.mark.slow  # the fast tier checks the packed path end to end (qkv_attention below)
def test_packed_qkv_runs_as_apart_in_interpreter(interpreter):
    """q, k, v packed (B, T, 3, H, D), as a fused projection writes them, read in place: the
    same o, lse, dq as apart, bit for bit, and dk, dv written into one (B, T, 2, H, D) array.
    2 heads (offsets 2 and 4 in the packed view), 4 tiles a kernel on 2 CUDA blocks."""
    b, t, h, d = 1, 256, 2, 64
    cfg, bwd_cfg = fa_mgpu.Config(64, 64, 3, ctas=2), fa_mgpu.BwdConfig(64, 64, 2, ctas=2)
    q, k, v = _qkv((b, t, h, d), seed=3)
    qkv = jnp.stack([q, k, v], axis=2)
    fwd = functools.partial(fa_mgpu.forward, cfg=cfg, scale=d**-0.5, causal=True,
                            interpret=interpreter)  # fmt: skip
    o, lse = fwd(q, k, v)
    for got, want in zip(fwd(qkv, None, None), (o, lse), strict=True):
        np.testing.assert_array_equal(got, want)
    do = jax.random.normal(jax.random.PRNGKey(7), q.shape, jnp.bfloat16)
    bwd = functools.partial(fa_mgpu.backward, o=o, lse=lse, do=do, cfg=bwd_cfg, scale=d**-0.5,
                            causal=True, interpret=interpreter)  # fmt: skip
    dq, dk, dv = bwd(q, k, v)
    dq_p, dkv = bwd(qkv, None, None)
    assert dkv.shape == (b, t, 2, h, d)
    for got, want in ((dq_p, dq), (dkv[:, :, 0], dk), (dkv[:, :, 1], dv)):
        np.testing.assert_array_equal(got, want)


def test_public_function_and_gradients_in_interpreter(
    interpreter, pretend_gpu, monkeypatch, float64_ref
):
    """flash_attention's custom VJP end to end (both kernels interpreted), called as the model
    calls it (jaxllm.ops, path "flash"), T not a multiple of the tile (causal: padded): the
    output and the gradients of q, k, v against the float64 reference's."""
    for name in ("forward", "backward"):  # the module's jitted entries, interpreted
        fn = functools.partial(getattr(fa_mgpu, name), interpret=interpreter)
        jitted = jax.jit(fn, static_argnames=("cfg", "scale", "causal"))
        monkeypatch.setattr(flash_module, f"_{name}", jitted)
    q, k, v = _qkv((1, 100, 1, 64), seed=1)  # T padded to 128 inside
    w = jax.random.normal(jax.random.PRNGKey(2), q.shape, jnp.float32)

    def loss(attention):
        return lambda q, k, v: jnp.sum(attention(q, k, v).astype(jnp.float32) * w)

    flash = functools.partial(ops.causal_attention, path="flash")
    got = jax.value_and_grad(loss(flash), (0, 1, 2))(q, k, v)
    ref = float64_ref(jax.value_and_grad(loss(flash_attention_ref), (0, 1, 2)), q, k, v)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-2)
    _grad_close(got[1], ref[1])


def test_qkv_attention_matches_projection_and_reference_in_interpreter(
    interpreter, pretend_gpu, monkeypatch, float64_ref
):
    """jaxllm.ops.qkv_attention (the model's flash path: the q/k/v projection and the attention
    in one VJP, the kernels interpreted), T padded inside: output and the gradients of x, W, b
    against the projection and the float64 reference's attention differentiated."""
    for name in ("forward", "backward"):
        fn = functools.partial(getattr(fa_mgpu, name), interpret=interpreter)
        jitted = jax.jit(fn, static_argnames=("cfg", "scale", "causal"))
        monkeypatch.setattr(flash_module, f"_{name}", jitted)
    b, t, h, dh = 1, 100, 2, 64
    keys = jax.random.split(jax.random.PRNGKey(4), 4)
    x = jax.random.normal(keys[0], (b, t, h * dh), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (h * dh, 3 * h * dh)) * 0.1).astype(jnp.bfloat16)
    bias = jax.random.normal(keys[2], (3 * h * dh,), jnp.float32)
    ct = jax.random.normal(keys[3], (b, t, h * dh), jnp.float32)

    def loss(attend):
        return lambda x, w, bias: jnp.sum(attend(x, w, bias).astype(jnp.float32) * ct)

    def apart(x, w, bias):
        q, k, v = jnp.split((x @ w + bias.astype(x.dtype)).reshape(b, t, 3 * h, dh), 3, 2)
        return flash_attention_ref(q, k, v, causal=True).reshape(b, t, h * dh)

    got = jax.value_and_grad(loss(functools.partial(ops.qkv_attention, n_heads=h)), (0, 1, 2))
    got = got(x, w, bias)
    ref = float64_ref(jax.value_and_grad(loss(apart), (0, 1, 2)), x, w, bias)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-2)
    assert [g.dtype for g in got[1]] == [jnp.bfloat16, jnp.bfloat16, jnp.float32]
    for g, r in zip(got[1], ref[1], strict=True):
        np.testing.assert_allclose(np.asarray(g, np.float64), r, atol=1e-2 * np.abs(r).max())
    keys = slice(h * dh, 2 * h * dh)  # the op returns 0: the softmax ignores a key bias
    assert np.abs(ref[1][2][keys]).max() < 1e-9 * np.abs(ref[1][2]).max()
    assert not np.any(np.asarray(got[1][2][keys]))


def test_flash_path_refuses_attention_dropout_in_a_direct_call():
    """The config refuses flash attention with dropout; a layer built by hand says so too (the
    fused projection's path would otherwise have skipped the dropout)."""
    from jaxllm.layers import AttentionInputs, MultiHeadAttention

    mha = MultiHeadAttention(2, dropout=0.1, path="flash", compute_dtype=jnp.bfloat16)
    x, key = jnp.zeros((1, 128, 128), jnp.bfloat16), jax.random.PRNGKey(0)
    inputs = AttentionInputs(jnp.zeros((1, 128), jnp.int32), deterministic=False)
    with pytest.raises(ValueError, match="flash attention has no dropout"):
        mha.init({"params": key, "dropout": key}, x, inputs)


@pytest.mark.parametrize(
    "d, cfg, bwd_cfg, causal, x64",
    [
        (64, None, None, True, False),
        (128, None, None, True, False),
        (64, fa_mgpu.Config(64, 64, 3), fa_mgpu.BwdConfig(64, 128, 3), True, False),
        (128, None, fa_mgpu.BwdConfig(64, 128, 1), False, False),
        (64, None, None, True, True),
    ],
    ids=["d64", "d128", "kv64_bwd_kv128", "d128_full_kv128", "d64_x64"],
)
def test_lowers_for_cuda(pretend_gpu, d, cfg, bwd_cfg, causal, x64):
    """GPT-2's shape (B 64, T 1024, 12 heads), the forward and value_and_grad (forward, dq and
    dk/dv kernels). x64: with jax_enable_x64 on, the index arithmetic stays int32 (jax's
    interpreter cannot run the kernels under x64)."""
    q = jax.ShapeDtypeStruct((64, 1024, 12, d), jnp.bfloat16)

    def attention(q, k, v):
        return flash_attention(q, k, v, causal=causal, config=cfg, bwd_config=bwd_cfg)

    def loss(q, k, v):
        return jnp.sum(attention(q, k, v).astype(jnp.float32))

    with jax.enable_x64(x64):
        for fn in (attention, jax.value_and_grad(loss, (0, 1, 2))):
            text = jax.jit(fn).trace(q, q, q).lower(lowering_platforms=("cuda",)).as_text()
            assert "flash_attention_fwd_mgpu" in text
        assert "flash_attention_dq_mgpu" in text and "flash_attention_dkv_mgpu" in text


@pytest.mark.parametrize(
    "shape, dtype, match",
    [
        ((1, 256, 2, 96), jnp.bfloat16, "head dim"),
        ((1, 256, 2, 64), jnp.float32, "bfloat16 or float16"),
        ((1, 256, 2, 128), fa_mgpu.Config(64, 128, 4), "shared memory"),
        ((1, 256, 2, 64), fa_mgpu.Config(64, 128, 1), "stages >= 2"),
        ((1, 256, 2, 64), fa_mgpu.Config(64, 128, 2, ctas=-1), "ctas >= 0"),
        ((1, 256, 2, 64), fa_mgpu.BwdConfig(64, 64, 2, ctas=-1), "backward config .* ctas >= 0"),
        ((1, 256, 2, 128), fa_mgpu.BwdConfig(64, 64, 5), "backward config .* shared memory"),
        ((1, 256, 2, 64), fa_mgpu.BwdConfig(128, 64, 2), "block_q 64, block_kv 64 or 128"),
    ],
)
def test_refusals(pretend_gpu, shape, dtype, match):
    """Bad shapes, dtypes and configs (a config in the dtype column: bfloat16 with that config)."""
    cfg = dtype if isinstance(dtype, fa_mgpu.Config | fa_mgpu.BwdConfig) else None
    x = jnp.zeros(shape, jnp.bfloat16 if cfg else dtype)
    key = "bwd_config" if isinstance(cfg, fa_mgpu.BwdConfig) else "config"
    with pytest.raises(ValueError, match=match):
        flash_attention(x, x, x, **{key: cfg})


def test_causal_tile():
    """Causal T pads to the least multiple both kernels take: 128 by default (not more)."""
    assert causal_tile(fa_mgpu.Config(), fa_mgpu.BwdConfig()) == 128
    assert causal_tile(fa_mgpu.Config(64, 64, 2), fa_mgpu.BwdConfig(64, 128, 2)) == 256


def test_full_attention_needs_whole_tiles(pretend_gpu):
    """Causal attention pads T to the tile; without the mask a padded key would be seen."""
    x = jnp.zeros((1, 192, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="multiple of 128, got T = 192"):
        flash_attention(x, x, x, causal=False)


@pytest.mark.parametrize("d, ctas", [(64, 0), (128, 0), (64, 2)], ids=["d64", "d128", "2ctas"])
def test_compiled_on_a_gpu_and_refused_elsewhere(float64_ref, d, ctas):
    """On a GPU (JAX_PLATFORMS=cuda,cpu) the kernels compile and the output and gradients match
    the reference over several query tiles, causal (T = 448: padded) and not (T = 512), also on
    2 CUDA blocks (each kernel's tiles in turn: its rings and stores run on across them);
    elsewhere the call is refused."""
    q, k, v = _qkv((2, 512, 3, d), seed=3)
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="needs a GPU of compute capability 9.x or 10.x"):
            flash_attention(q, k, v)
        return
    do = jax.random.normal(jax.random.PRNGKey(4), q.shape, jnp.bfloat16)
    flash = functools.partial(flash_attention, config=fa_mgpu.CONFIGS[d]._replace(ctas=ctas),
                              bwd_config=fa_mgpu.BwdConfig(ctas=ctas))  # fmt: skip
    for causal in (True, False):
        t = 448 if causal else 512

        def grads(attention, q, k, v, do, causal=causal, t=t):
            o, vjp = jax.vjp(
                functools.partial(attention, causal=causal), *(x[:, :t] for x in (q, k, v))
            )
            return o, vjp(do[:, :t])

        o, got = jax.jit(functools.partial(grads, flash))(q, k, v, do)
        ref, ref_grads = float64_ref(functools.partial(grads, flash_attention_ref), q, k, v, do)
        np.testing.assert_allclose(np.asarray(o, np.float64), ref, atol=2e-2)
        _grad_close(got, ref_grads)


@pytest.mark.parametrize("d", [64, 128])
def test_packed_qkv_compiled_on_a_gpu_is_apart_bit_for_bit(d):
    """On a GPU: flash_attention_qkv and its backward on q, k, v packed give the o, dq, dk, dv
    of q, k, v apart exactly (T = 448: padded inside); elsewhere the call is refused."""
    q, k, v = _qkv((2, 448, 3, d), seed=5)
    qkv = jnp.stack([q, k, v], axis=2)
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="needs a GPU of compute capability 9.x or 10.x"):
            flash_module.flash_attention_qkv(qkv)
        return
    do = jax.random.normal(jax.random.PRNGKey(6), q.shape, jnp.bfloat16)
    o, vjp = jax.vjp(flash_attention, q, k, v)
    o_p, lse = jax.jit(flash_module.flash_attention_qkv)(qkv)
    dq_p, dkv = jax.jit(flash_module.flash_attention_qkv_grad)(qkv, o_p, lse, do)
    for got, want in zip((o_p, dq_p, dkv[:, :, 0], dkv[:, :, 1]), (o, *vjp(do)), strict=True):
        np.testing.assert_array_equal(got, want)


def _bench():
    spec = importlib.util.spec_from_file_location(
        "fa_bench", ROOT / "benchmarks/flash_attention_bench.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_refuses_off_gpu_and_times_xla_on_cpu():
    """The benchmark parses its arguments and refuses without a Hopper GPU; its timing of one
    cell runs (jax.nn.dot_product_attention's XLA path, the one implementation a CPU has)."""
    bench = _bench()
    if not mosaic_gpu_capable():
        with pytest.raises(SystemExit, match="Hopper-class"):
            bench.main(["--quick", "--configs", "64,64,2", "--shapes", "1,128,2,64"])
    args = argparse.Namespace(calls=4, launches=1, repeats=1, unroll=2)
    impls = bench.implementations([None, fa_mgpu.Config()], [None, fa_mgpu.BwdConfig(64, 128, 2)])
    assert "ours-64-128-2-0-bwd64-128-2-0" in impls and "ours" in impls
    xla = impls["xla"]
    fwd, fwd_bwd = (
        bench.measure(xla, direction, (1, 128, 2, 64), args, bench_ref, trials=2)
        for direction in ("fwd", "fwd+bwd")
    )
    assert fwd["ms"] > 0 and fwd_bwd["ms"] > 0 and fwd["spread"] >= 0
    assert fwd["max_err"] < 2e-2 and fwd_bwd["grad_err"] < 2e-2  # bf16 output and gradients


def bench_ref(q, k, v):
    return flash_attention_ref(*(x.astype(jnp.float32) for x in (q, k, v)))
