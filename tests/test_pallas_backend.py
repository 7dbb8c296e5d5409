"""The Pallas lowering choice (pallas_kernels/common.py) and the Mosaic GPU kernels on CPU.

A CPU cannot compile Mosaic GPU kernels, but it can (1) check the `backend` argument, (2) lower
the public functions with backend="mosaic_gpu" to the Mosaic GPU MLIR the GPU compiler would get
(jax cross-lowering for the cuda platform: every layout, shape and primitive rule of the kernels
is exercised, only the final PTX compilation is not), and (3) run the kernels in jax's Mosaic GPU
interpreter against the float64 references. The interpreter does not model the copy engine's
out-of-bounds handling (clamped row blocks, zero-filled halos), so (3) uses shapes without ragged
blocks, and for the conv only its interior tiles; benchmarks/mosaic_gpu_check.py checks all of it
on the GPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (
    add_layer_norm,
    add_layer_norm_ref,
    add_rms_norm,
    add_rms_norm_ref,
    attention_softmax,
    attention_softmax_ref,
    depthwise_conv1d,
    depthwise_conv1d_ref,
    layer_norm,
    linear_cross_entropy,
    rms_norm,
    rows_mgpu,
)
from pallas_kernels import attention_softmax_mgpu as softmax_mgpu
from pallas_kernels import cross_entropy_mgpu as ce_mgpu
from pallas_kernels import depthwise_conv1d_mgpu as conv_mgpu
from pallas_kernels import layer_norm_mgpu as ln_mgpu
from pallas_kernels.attention_softmax_common import Layout
from pallas_kernels.common import BACKENDS, check_backend
from pallas_kernels.cross_entropy import Config as CEConfig

try:  # jax's Mosaic GPU interpreter: private, so its absence skips rather than fails
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
except ImportError:
    InterpretGPUParams = None

needs_interpreter = pytest.mark.skipif(InterpretGPUParams is None, reason="no Mosaic interpreter")
try:  # where Mosaic GPU sums a kernel's shared memory (private: its absence skips)
    from jax.experimental.mosaic.gpu import core as mosaic_core

    needs_smem_spy = pytest.mark.skipif(
        not hasattr(mosaic_core, "_smem_tree_size"), reason="no Mosaic GPU smem hook"
    )
except ImportError:
    needs_smem_spy = pytest.mark.skip(reason="no Mosaic GPU smem hook")


def _ln_args(shape=(4, 256), dtype=jnp.float32):
    x = jnp.ones(shape, dtype)
    return x, jnp.ones(shape[-1:]), jnp.zeros(shape[-1:])


CALLS = {  # kernel -> (backend, interpret) -> call
    "layer_norm": lambda be, it: layer_norm(*_ln_args(), interpret=it, backend=be),
    "add_layer_norm": lambda be, it: add_layer_norm(
        _ln_args()[0], *_ln_args(), interpret=it, backend=be
    ),
    "rms_norm": lambda be, it: rms_norm(*_ln_args()[:2], interpret=it, backend=be),
    "add_rms_norm": lambda be, it: add_rms_norm(
        _ln_args()[0], *_ln_args()[:2], interpret=it, backend=be
    ),
    "attention_softmax": lambda be, it: attention_softmax(
        jnp.ones((1, 1, 2, 128)), causal=True, interpret=it, backend=be
    ),
    "depthwise_conv1d": lambda be, it: depthwise_conv1d(
        jnp.ones((1, 8, 128)), jnp.ones((128, 3)), jnp.ones((128,)), interpret=it, backend=be
    ),
}


@pytest.mark.parametrize("kernel", sorted(CALLS))
def test_unknown_backend_is_named(kernel):
    with pytest.raises(ValueError, match="backend must be one of .*triton.*mosaic_gpu.*'cuda'"):
        CALLS[kernel]("cuda", None)


@pytest.mark.parametrize("kernel", sorted(CALLS))
def test_mosaic_gpu_refuses_interpret_mode(kernel):
    with pytest.raises(ValueError, match="no interpret mode"):
        CALLS[kernel]("mosaic_gpu", True)


@pytest.mark.parametrize("kernel", sorted(CALLS))
def test_mosaic_gpu_runs_on_a_gpu_and_is_refused_elsewhere(kernel):
    if jax.default_backend() == "gpu":  # on a GPU the call compiles and runs
        jax.block_until_ready(CALLS[kernel]("mosaic_gpu", None))
    else:
        with pytest.raises(ValueError, match="CUDA GPU only"):
            CALLS[kernel]("mosaic_gpu", None)


def test_check_backend_accepts_the_two():
    assert BACKENDS == ("triton", "mosaic_gpu")
    assert check_backend("triton", True) == "triton"


def test_triton_refuses_a_mosaic_config():
    cfg = ln_mgpu.Config(block_rows=4, rows=4, chunk=256, programs_per_sm=1)
    with pytest.raises(ValueError, match="takes a layer_norm_triton.Config"):
        layer_norm(*_ln_args(), config=cfg)


@pytest.mark.parametrize(
    "make_config,match",
    [
        (lambda: ln_mgpu.configs(64, 100, jnp.float32, jnp.float32), "hidden size D"),
        (lambda: softmax_mgpu.configs(8, 200, jnp.float32, False), "key length Tk"),
        (lambda: conv_mgpu.default_config((1, 8, 96)), "channel count D"),
    ],
)
def test_mosaic_refuses_unaligned_widths(make_config, match):
    with pytest.raises(ValueError, match=f"multiple of 128.*{match}|{match}.*multiple of 128"):
        make_config()


def test_mosaic_layer_norm_refuses_rows_too_wide_for_shared_memory():
    with pytest.raises(ValueError, match="do not fit in shared memory"):
        ln_mgpu.configs(64, 16384, jnp.float32, jnp.float32, jnp.float32)


def test_only_the_wide_plain_layer_norm_forward_reads_its_params_from_global_memory():
    """8192-column bf16 rows fill an SM with gamma and beta in shared memory: the forward reads
    them from global memory instead, two programs an SM; the residual add and the backward keep
    them in shared memory."""
    fwd, bwd = ln_mgpu.configs(16384, 8192, jnp.bfloat16, jnp.bfloat16)
    assert fwd.global_params and (fwd.programs_per_sm, fwd.stages) == (2, 2)
    assert not bwd.global_params
    assert not ln_mgpu.configs(16384, 8192, jnp.bfloat16, jnp.bfloat16, jnp.bfloat16)[
        0
    ].global_params
    assert not ln_mgpu.configs(16384, 6144, jnp.bfloat16, jnp.bfloat16)[0].global_params


def test_layer_norm_configs_share_block_rows():
    for n_cols in (256, 768, 3072, 8192):
        fwd, bwd = ln_mgpu.configs(1000, n_cols, jnp.bfloat16, jnp.bfloat16, jnp.bfloat16)
        assert fwd.block_rows == bwd.block_rows
        assert fwd.direct == (n_cols <= ln_mgpu.DIRECT_COLS) and not bwd.direct
        for cfg in (fwd, bwd):
            ln_mgpu.check_config(cfg, 1000, n_cols)


def _lowered_smem(monkeypatch, fn, *args) -> int:
    """The dynamic shared memory of the Mosaic GPU kernel `fn` lowers to, for CUDA (on CPU)."""
    seen = []
    size = mosaic_core._smem_tree_size
    monkeypatch.setattr(mosaic_core, "_smem_tree_size", lambda t: seen.append(size(t)) or seen[-1])
    jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    return max(seen)


SMEM_CASES = {  # name -> (N, D, dtype, with the residual add)
    "ln_768_bf16": (16384, 768, jnp.bfloat16, False),
    "ln_1024_f32": (65536, 1024, jnp.float32, False),
    "ln_8192_bf16": (16384, 8192, jnp.bfloat16, False),
    "add_ln_384_bf16": (4096, 384, jnp.bfloat16, True),
}


@needs_smem_spy
@pytest.mark.parametrize("case", sorted(SMEM_CASES))
def test_norm_configs_count_the_shared_memory_the_kernels_take(monkeypatch, case):
    """The default configs' shared-memory count bounds what the lowered kernels request (within
    3 KB), so the programs per SM they ask for are resident together; a direct forward takes
    none but the reduction scratch."""
    n, d, dtype, residual = SMEM_CASES[case]
    x, g, b = _ln_args((n, d), dtype)
    h = x if residual else None
    fwd, bwd = ln_mgpu.configs(n, d, dtype, dtype, dtype if residual else None, 8)
    stats = jnp.ones((-(-n // bwd.block_rows), ln_mgpu.rows_round(bwd.block_rows)))
    extra = (jnp.dtype(dtype).itemsize,) * (2 if residual else 0)  # h and s / ds and dh
    io = (jnp.dtype(dtype).itemsize,) * 2 + extra
    for cfg, sizes, columns, backward, fn in [
        (fwd, io, (4, 4), False, lambda x: ln_mgpu.forward(x, h, g, b, 1e-5, dtype, fwd)),
        (bwd, io[:1] + io, (4, 4, 4), True,
         lambda x: ln_mgpu.backward(x, g, x, h, dtype, stats, stats, bwd)),
    ]:  # fmt: skip
        lowered = _lowered_smem(monkeypatch, fn, x)
        if cfg.direct:  # no blocks in shared memory: the cross-warp reduction scratch only
            assert lowered <= ln_mgpu._scratch_bytes(cfg, backward) + 1024, (cfg, lowered)
            continue
        counted = ln_mgpu._smem_bytes(cfg, d, sizes, columns, backward)
        assert lowered <= counted <= lowered + 3 * 1024, (cfg, lowered, counted)
        resident = rows_mgpu.SM_SMEM_BYTES // (lowered + rows_mgpu.BLOCK_RESERVED_BYTES)
        assert cfg.programs_per_sm <= resident


@needs_smem_spy
@pytest.mark.parametrize(
    "tq,tk,dtype,mask", [(2, 1024, jnp.bfloat16, True), (128, 4096, jnp.float32, False)]
)
def test_softmax_configs_ask_for_resident_programs(monkeypatch, tq, tk, dtype, mask):
    """The programs per SM the softmax's TMA configs ask for fit in an SM together."""
    x = jnp.ones((2 * tq, tk), dtype)
    m = jnp.zeros((tq, tk)) if mask else None
    lay = Layout(1, tq, mask_batch=False, mask_query=mask, mask_rows=tq if mask else 1)
    fwd, bwd = softmax_mgpu.configs(tq, tk, dtype, mask)
    for cfg, fn in [
        (fwd, lambda x: softmax_mgpu.forward(x, m, fwd, 0.5, True, lay)),
        (bwd, lambda x: softmax_mgpu.backward(x, x, bwd, 0.5, tq)),
    ]:
        assert not cfg.direct
        lowered = _lowered_smem(monkeypatch, fn, x)
        resident = rows_mgpu.SM_SMEM_BYTES // (lowered + rows_mgpu.BLOCK_RESERVED_BYTES)
        assert 1 <= cfg.programs_per_sm <= resident, (cfg, lowered)


@pytest.mark.parametrize("tq,tk,dtype", [(1024, 128, jnp.bfloat16), (4, 2048, jnp.float32)])
def test_softmax_configs_read_short_rows_directly_a_warp_each(tq, tk, dtype):
    for has_mask in (False, True):
        for cfg in softmax_mgpu.configs(tq, tk, dtype, has_mask):
            assert cfg.direct and cfg.warp_rows and cfg.rows % 4 == 0
            softmax_mgpu.check_config(cfg, 8 * tq, tq, tk)
    assert not any(c.direct for c in softmax_mgpu.configs(64, 4096, jnp.bfloat16, False))
    assert not any(c.direct for c in softmax_mgpu.configs(6, 128, jnp.bfloat16, False))
    with pytest.raises(ValueError, match="invalid Mosaic GPU softmax config"):
        softmax_mgpu.check_config(softmax_mgpu.Config(8, 2, 128, 1, 2, True), 64, 8, 128)


def _lower_for_cuda(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.fixture
def pretend_gpu(monkeypatch):
    """Make check_backend see a GPU, so the public functions take the Mosaic GPU path on CPU."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")


def _grad_of_sum(fn, argnums):
    return jax.grad(lambda *a: sum(jnp.sum(o.astype(jnp.float32)) for o in fn(*a)), argnums)


LOWERING_CASES = {  # name -> (function of arrays, arrays); forward and backward are lowered
    "layer_norm_rows": (
        lambda x, g, b: (layer_norm(x, g, b, backend="mosaic_gpu"),),
        _ln_args((37, 256)),
    ),
    "add_layer_norm_wide_bf16": (  # whole rows held in both directions (8192: the widest)
        lambda x, h, g, b: add_layer_norm(x, h, g, b, backend="mosaic_gpu"),
        (_ln_args((9, 8192), jnp.bfloat16)[0], *_ln_args((9, 8192), jnp.bfloat16)),
    ),
    "layer_norm_wide_bf16": (  # the forward reads gamma and beta from global memory
        lambda x, g, b: (layer_norm(x, g, b, backend="mosaic_gpu"),),
        _ln_args((9, 8192), jnp.bfloat16),
    ),
    "layer_norm_chunks_bf16": (  # rows wider than the forward holds: column chunks both ways
        lambda x, g, b: (layer_norm(x, g, b, backend="mosaic_gpu"),),
        _ln_args((9, 9216), jnp.bfloat16),
    ),
    "rms_norm_row_groups": (
        lambda x, g: (rms_norm(x, g, backend="mosaic_gpu"),),
        _ln_args((37, 256))[:2],
    ),
    "add_rms_norm_wide_bf16": (
        lambda x, h, g: add_rms_norm(x, h, g, backend="mosaic_gpu"),
        (_ln_args((9, 8192), jnp.bfloat16)[0], *_ln_args((9, 8192), jnp.bfloat16)[:2]),
    ),
    "softmax_causal": (
        lambda x: (attention_softmax(x, causal=True, scale=0.5, backend="mosaic_gpu"),),
        (jnp.ones((2, 2, 8, 256)),),
    ),
    "softmax_query_mask_chunks": (
        lambda x, m: (attention_softmax(x, m, backend="mosaic_gpu"),),
        (jnp.ones((1, 2, 4, 8192), jnp.bfloat16), jnp.zeros((1, 1, 4, 8192))),
    ),
    "softmax_warp_rows_bf16": (  # the default for short rows: a warp per row
        lambda x: (attention_softmax(x, causal=True, backend="mosaic_gpu"),),
        (jnp.ones((2, 2, 64, 128), jnp.bfloat16),),
    ),
    "conv_full": (
        lambda u, w, b: (depthwise_conv1d(u, w, b, "full", backend="mosaic_gpu"),),
        (jnp.ones((2, 50, 384)), jnp.ones((384, 3)), jnp.ones((384,))),
    ),
}


@pytest.mark.parametrize("name", sorted(LOWERING_CASES))
def test_public_mosaic_path_lowers_for_cuda(pretend_gpu, name):
    fn, args = LOWERING_CASES[name]
    n_diff = 1 if name.startswith("softmax") else len(args)
    fwd = _lower_for_cuda(fn, *args)
    bwd = _lower_for_cuda(_grad_of_sum(fn, tuple(range(n_diff))), *args)
    assert "mosaic_gpu" in fwd and bwd.count("mosaic_gpu") >= 2  # the forward and backward kernels


@pytest.mark.parametrize("name", ["layer_norm_rows", "softmax_warp_rows_bf16", "conv_full"])
def test_public_mosaic_path_lowers_under_x64(pretend_gpu, name):
    """With jax_enable_x64 on, the kernels' index arithmetic (the ring's slots) stays int32."""
    fn, args = LOWERING_CASES[name]
    with jax.enable_x64(True):
        args = [a.astype(jnp.float32) if a.dtype == jnp.float64 else a for a in args]
        assert "mosaic_gpu" in _lower_for_cuda(_grad_of_sum(fn, (0,)), *args)


@needs_interpreter
@pytest.mark.parametrize(
    "tiling",
    ["chunks", "whole_rows", "ring3", "ring4", "ring_global_params", "direct", "direct_chunks"],
)
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_layer_norm_kernels_in_interpreter(float64_ref, monkeypatch, rms, tiling):
    """One row at a time in two column chunks, two whole rows at a time (their tile held in
    registers across the sweeps), one program walking one-row blocks through a ring of three
    or four buffers (two or three loads ahead; or two, gamma and beta read from global memory
    by the forward), or a forward reading and writing global memory
    directly (4-row blocks of 2-row groups, or of one row in chunks: s written, then re-read);
    RMSNorm is the same kernels with beta None (no mean, no dbeta)."""
    n_rows, n_cols = 8, 256
    rng = np.random.default_rng(0)
    x, h, dy = (jnp.asarray(rng.normal(size=(n_rows, n_cols)), jnp.float32) for _ in range(3))
    gamma = jnp.asarray(1 + 0.1 * rng.normal(size=n_cols), jnp.float32)
    beta = None if rms else jnp.asarray(0.1 * rng.normal(size=n_cols), jnp.float32)
    params = (gamma,) if rms else (gamma, beta)
    cfg = ln_mgpu.Config(block_rows=2, rows=1, chunk=128, programs_per_sm=1)
    if tiling == "whole_rows":
        cfg = cfg._replace(rows=2, chunk=n_cols)
    if tiling.startswith("ring"):
        monkeypatch.setattr(rows_mgpu, "core_count", lambda: 1)
        params_global = tiling == "ring_global_params"
        cfg = cfg._replace(block_rows=1, stages=2 if params_global else int(tiling[-1]))
        cfg = cfg._replace(global_params=params_global)
    if tiling == "direct":
        cfg = cfg._replace(block_rows=4, rows=2, chunk=n_cols, direct=True)
    if tiling == "direct_chunks":
        cfg = cfg._replace(block_rows=4, direct=True)
    it = InterpretGPUParams()
    s, y, mean, rstd = ln_mgpu.forward(x, h, gamma, beta, 1e-5, jnp.float32, cfg, interpret=it)
    dx, dh, dg, db = ln_mgpu.backward(s, gamma, dy, dy, jnp.float32, mean, rstd, cfg, interpret=it)
    assert (mean is None) == (db is None) == rms
    ref_fn = add_rms_norm_ref if rms else add_layer_norm_ref
    ref_s, ref_y = float64_ref(ref_fn, x, h, *params)
    np.testing.assert_allclose(s, ref_s, atol=1e-6)
    np.testing.assert_allclose(y, ref_y, atol=1e-5)

    def loss(x, h, *params_and_dy):
        s, y = ref_fn(x, h, *params_and_dy[:-1])
        return jnp.sum(s * params_and_dy[-1]) + jnp.sum(y * params_and_dy[-1])

    refs = float64_ref(jax.grad(loss, tuple(range(2 + len(params)))), x, h, *params, dy)
    got = (dx, dh, dg) if rms else (dx, dh, dg, db)
    for g, ref in zip(got, refs, strict=True):
        np.testing.assert_allclose(g, ref, atol=1e-4 * np.abs(ref).max())


@needs_interpreter
@pytest.mark.parametrize("tiling", ["whole_rows", "warp_rows", "chunks", "direct"])
def test_softmax_kernels_in_interpreter(float64_ref, tiling):
    """Two whole rows at a time (held in registers across the sweeps), four rows a warp each, one
    row in two column chunks, or four rows a warp read from and written to global memory."""
    b, h, tq, tk = 2, 2, 4, 256
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(b, h, tq, tk)), jnp.float32)
    dy = jnp.asarray(rng.normal(size=(b, h, tq, tk)), jnp.float32)
    mask = jnp.asarray(np.where(rng.random((b, 1, 1, tk)) < 0.2, -np.inf, 0.0), jnp.float32)
    lay = Layout(h, tq, mask_batch=True, mask_query=False, mask_rows=1)
    cfg = softmax_mgpu.Config(block_rows=4, rows=2, chunk=tk, programs_per_sm=1)
    if tiling == "warp_rows":
        cfg = cfg._replace(rows=4, warp_rows=True)
    if tiling == "chunks":
        cfg = cfg._replace(rows=1, chunk=128)
    if tiling == "direct":
        cfg = cfg._replace(rows=4, warp_rows=True, direct=True)
    it = InterpretGPUParams()
    flat = x.reshape(-1, tk)
    y = softmax_mgpu.forward(flat, mask.reshape(b, tk), cfg, 0.5, True, lay, interpret=it)
    dx = softmax_mgpu.backward(y, dy.reshape(-1, tk), cfg, 0.5, tq, interpret=it)

    def ref(x):
        return attention_softmax_ref(x, mask, causal=True, scale=0.5)

    np.testing.assert_allclose(y.reshape(x.shape), float64_ref(ref, x), atol=1e-6)
    ref_dx = float64_ref(lambda x, dy: jax.vjp(ref, x)[1](dy)[0], x, dy)
    np.testing.assert_allclose(dx.reshape(x.shape), ref_dx, atol=1e-6)


@needs_interpreter
@pytest.mark.parametrize("steps", [1, 2, 3])  # 4 tiles a column: one each, a ring, a short run
def test_conv_kernels_interior_tiles_in_interpreter(float64_ref, steps):
    """Tiles whose halo lies inside [0, L): the interpreter clamps out-of-bounds copies where the
    GPU's copy engine zero-fills, so edge tiles (and dw, db) are checked on the GPU only."""
    rng = np.random.default_rng(2)
    u = jnp.asarray(rng.normal(size=(1, 48, 128)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(128, 3)), jnp.float32)
    b = jnp.asarray(rng.normal(size=(128,)), jnp.float32)
    cfg = conv_mgpu.Config(block_t=16, block_d=128, steps=steps)
    it = InterpretGPUParams(out_of_bounds_reads="uninitialized")
    out = conv_mgpu.forward(u, w, b, "full", cfg, interpret=it)
    g = jnp.asarray(rng.normal(size=out.shape), jnp.float32)
    du, _, _ = conv_mgpu.backward(u, w, g, "full", cfg, interpret=it)

    def ref(u):
        return depthwise_conv1d_ref(u, w, b, "full")

    interior = slice(16, 32)
    np.testing.assert_allclose(out[:, interior], float64_ref(ref, u)[:, interior], atol=1e-5)
    ref_du = float64_ref(lambda u, g: jax.vjp(ref, u)[1](g)[0], u, g)
    np.testing.assert_allclose(du[:, interior], ref_du[:, interior], atol=1e-5)


# ----------------------------------------------------------------------------- cross-entropy


def _ce_args(n_rows=64, vocab=2000, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(n_rows, 32)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(vocab, 32)) * 0.3, jnp.float32)
    t = jnp.asarray(rng.integers(0, vocab, n_rows), jnp.int32)
    wt = jnp.asarray(rng.uniform(size=n_rows), jnp.float32)
    return x, w, t, wt


def test_mosaic_cross_entropy_refusals(pretend_gpu):
    x, w, t, wt = _ce_args()
    with pytest.raises(ValueError, match="no interpret mode"):
        linear_cross_entropy(x, w, t, wt, interpret=True, backend="mosaic_gpu")
    with pytest.raises(ValueError, match="computes in bfloat16, got float32"):
        linear_cross_entropy(x, w, t, wt, jnp.float32, backend="mosaic_gpu")
    with pytest.raises(ValueError, match="takes a cross_entropy_mgpu.Config"):
        linear_cross_entropy(x, w, t, wt, backend="mosaic_gpu", config=CEConfig(1, 512, 4, 8))
    with pytest.raises(ValueError, match="takes a cross_entropy_triton.Config"):
        linear_cross_entropy(x, w, t, wt, config=ce_mgpu.Config(1024))
    z = jnp.zeros((8, 2004), jnp.bfloat16)  # rows of 4008 bytes: not whole 16-byte units
    with pytest.raises(ValueError, match="multiple of 8"):
        ce_mgpu.cross_entropy_from_logits(z, t[:8], wt[:8], 2000)
    with pytest.raises(ValueError, match="a multiple of 1024"):
        ce_mgpu.cross_entropy_from_logits(z[:, :2000], t[:8], wt[:8], 2000, ce_mgpu.Config(512))
    z = jnp.zeros((8, 115712), jnp.bfloat16)  # not even one row fits
    with pytest.raises(ValueError, match="rows of 115712 bfloat16 logits, 1 per SM, do not fit"):
        ce_mgpu.cross_entropy_from_logits(z, t[:8], wt[:8], 9)
    assert ce_mgpu.default_config(57344) == ce_mgpu.Config(2048, 1, 1)  # one row per SM fits
    assert ce_mgpu.default_config(50304) == ce_mgpu.Config(2048, 2, 1)  # GPT-2: two
    assert ce_mgpu.default_config(5120) == ce_mgpu.Config(1024, 2, 1)  # 2048s would pad more
    assert ce_mgpu.fits(50304) and not ce_mgpu.fits(57344)
    z = jnp.zeros((8, 51200), jnp.bfloat16)  # GPT-2's padded head: 2 per SM only single-buffered
    with pytest.raises(ValueError, match="rows of 51200 bfloat16 logits, 4 per SM, do not fit"):
        ce_mgpu.cross_entropy_from_logits(z, t[:8], wt[:8], 9, ce_mgpu.Config(2048, 2, 2))


def test_mosaic_cross_entropy_lowers_for_cuda(pretend_gpu):
    """GPT-2's head at 4 rows: the vocabulary padded to 50304 (128s) for the Mosaic kernel, which
    runs in the forward (it makes dz there); the backward only scales dx and dW."""
    x, w, t, wt = _ce_args(n_rows=4, vocab=50257)

    def loss(x, w):
        return linear_cross_entropy(x, w, t, wt, backend="mosaic_gpu")[0]

    text = _lower_for_cuda(jax.value_and_grad(loss, (0, 1)), x, w)
    assert "mosaic_gpu" in text and "50304" in text and "51200" not in text  # 50257 -> 50304


@needs_interpreter
@pytest.mark.parametrize("vocab", [1100, 700])
def test_cross_entropy_kernel_in_interpreter(float64_ref, vocab):
    """ce, hit and dz of padded bf16 logits against float64, the padding columns masked: rows of
    1152 columns, one chunk of 1024 and a tail of 128 (the buffer's other 896 columns never
    copied, masked as padding), vocab 1100 in the tail, 700 in the first chunk; 70 rows over 3
    programs, the last with a ragged run of 6 rows (the per-row arrays are padded to whole runs,
    so no copy leaves its array). Half the targets are their row's max (hit must say so); one
    row's target lies in the padding columns with weight 0, as a caller masks a row: finite ce,
    no gradient; targets -1 and past the row, with weights, give ce = logsumexp and dz = w
    softmax."""
    n_rows, width = 70, 1152
    rng = np.random.default_rng(1)
    z = jnp.asarray(rng.normal(size=(n_rows, width)) * 3, jnp.bfloat16)
    zv = np.asarray(z[:, :vocab], np.float32)
    t = np.where(rng.random(n_rows) < 0.5, zv.argmax(1), rng.integers(0, vocab, n_rows))
    wt = rng.uniform(size=n_rows)
    t[5], wt[5] = vocab + 7, 0.0  # a masked row whose target is a padding column
    t[6], t[7] = -1, width + 3  # off the row: no one-hot term
    t, wt = jnp.asarray(t, jnp.int32), jnp.asarray(wt, jnp.float32)
    ok = np.arange(n_rows) != 5

    def reference(z):
        zv = z[:, :vocab]
        lse = jax.nn.logsumexp(zv, axis=1)
        tv = jnp.clip(t, 0, vocab - 1)  # row 5 is compared for finiteness only
        z_t = jnp.take_along_axis(zv, tv[:, None], axis=1)[:, 0]
        z_t = jnp.where((t >= 0) & (t < vocab), z_t, 0.0)
        p = jnp.exp(zv - lse[:, None]) - jax.nn.one_hot(t, vocab, dtype=zv.dtype)
        dz = jnp.pad(p * wt[:, None].astype(zv.dtype), ((0, 0), (0, width - vocab)))
        return lse - z_t, z_t >= jnp.max(zv, axis=1), dz

    ref_ce, ref_hit, ref_dz = float64_ref(reference, z.astype(jnp.float32))
    assert 20 < ref_hit[ok].sum() < n_rows - 20  # hits and misses both checked
    # double-buffered rows, one program per SM; one buffer, two programs per SM
    cfgs = (ce_mgpu.Config(1024, 1, 2), ce_mgpu.Config(1024, 2, 1))
    for cfg in cfgs if vocab == 1100 else cfgs[1:]:
        ce, hit, dz = ce_mgpu.cross_entropy_from_logits(
            z, t, wt, vocab, cfg, interpret=InterpretGPUParams()
        )
        assert ce.shape == hit.shape == (n_rows,) and dz.shape == z.shape
        np.testing.assert_allclose(np.asarray(ce)[ok], ref_ce[ok], atol=1e-5, rtol=1e-5)
        np.testing.assert_array_equal(np.asarray(hit, bool)[ok], np.asarray(ref_hit)[ok])
        assert np.isfinite(ce[5]) and ce[5] > 1e29 and not hit[5]  # finite: 0 x ce stays 0
        assert not np.any(np.asarray(dz[:, vocab:], np.float32))  # padding: no gradient
        np.testing.assert_allclose(np.asarray(dz, np.float32), ref_dz, atol=4e-3)  # bf16 dz


@pytest.mark.parametrize("kernel", ["layer_norm", "add_layer_norm", "softmax", "conv", "loss"])
def test_second_derivatives_raise_a_clear_error(kernel):
    """grad of grad (and jax.hessian) through a kernel: one NotImplementedError naming it (it
    failed deep inside Pallas: "Too few leaves for PyTreeDef", a bare AssertionError, "JVP with
    aliasing"); first derivatives, under jit too, are unaffected."""
    from pallas_kernels import (
        add_layer_norm,
        attention_softmax,
        depthwise_conv1d,
        layer_norm,
        linear_cross_entropy,
    )

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(4, 128)), jnp.float32)
    g, b = jnp.ones(128), jnp.zeros(128)
    w_head = jnp.asarray(rng.normal(size=(50, 8)), jnp.float32)
    f = {
        "layer_norm": lambda a: jnp.sum(layer_norm(a, g, b) ** 3),
        "add_layer_norm": lambda a: jnp.sum(add_layer_norm(a, a, g, b)[1] ** 3),
        "softmax": lambda a: jnp.sum(attention_softmax(a.reshape(1, 1, 4, 128), None) ** 3),
        "conv": lambda a: jnp.sum(
            depthwise_conv1d(a.reshape(1, 4, 128), jnp.ones((128, 3)), jnp.zeros(128)) ** 3
        ),
        "loss": lambda a: linear_cross_entropy(
            a[:, :8], w_head, jnp.arange(4), jnp.ones(4) / 4, jnp.float32
        )[0],
    }[kernel]
    first = jax.grad(f)(x)
    assert np.isfinite(np.asarray(first)).all() and np.abs(np.asarray(first)).sum() > 0
    np.testing.assert_allclose(jax.jit(jax.grad(f))(x), first, rtol=1e-5, atol=1e-6)
    for second in (jax.grad(lambda a: jnp.sum(jax.grad(f)(a) ** 2)), jax.hessian(f)):
        with pytest.raises(NotImplementedError, match="has first derivatives only"):
            second(x)
