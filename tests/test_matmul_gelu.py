"""pallas_kernels.matmul_gelu and matmul_dgelu (GELU in the epilogues of the MLP's fc GEMM and
of its backward's dX GEMM, Mosaic GPU) and the MLP path that calls them (jaxllm.ops.gelu_mlp,
execution.mlp_impl)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model

import pallas_kernels
from jaxllm import ops
from pallas_kernels import matmul_gelu_mgpu as mgpu
from pallas_kernels.common import mosaic_gpu_capable

try:  # jax 0.10's Mosaic GPU interpreter (private API); jax 0.11 moved it
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
except ImportError:
    InterpretGPUParams = None


def _inputs(m, k, n, dtype=jnp.bfloat16, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    dy = jax.random.normal(keys[0], (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(keys[1], (k, n), jnp.float32) * k**-0.5).astype(dtype)
    h = (2 * jax.random.normal(keys[2], (m, n), jnp.float32)).astype(dtype)
    return dy, w, h


def _check_close(float64_ref, out, dy, w, h):
    """Within two roundings of the output's 16-bit dtype of the float64 reference."""
    ref = float64_ref(pallas_kernels.matmul_dgelu_ref, dy, w, h)
    err = np.abs(np.asarray(out, np.float64) - ref).max()
    tol = 2 * float(jnp.finfo(h.dtype).eps) * np.abs(ref).max()
    assert out.dtype == h.dtype and err <= tol, (err, tol)


@pytest.mark.skipif(InterpretGPUParams is None, reason="needs jax 0.10's Mosaic GPU interpreter")
@pytest.mark.parametrize(
    "cfg, m, k, n",
    [
        # 8 tiles: 3, 3, 2 a block; one group of 4 rows of tiles, shorter than 8
        (mgpu.Config(stages=2, ctas=3, group_m=8), 512, 256, 256),
        # fewer k-blocks than slots; groups of 2 rows of tiles, then 1
        (mgpu.Config(block_n=64, stages=3, ctas=5, group_m=2), 384, 128, 320),
    ],
)
def test_interpreted_kernel_matches_float64_reference(float64_ref, cfg, m, k, n):
    dy, w, h = _inputs(m, k, n)
    _check_close(float64_ref, mgpu.matmul_dgelu(dy, w, h, cfg, InterpretGPUParams()), dy, w, h)
    x, b = dy, jax.random.normal(jax.random.PRNGKey(4), (n,))
    _check_fwd_close(float64_ref, mgpu.matmul_gelu(x, w, b, cfg, InterpretGPUParams()), x, w, b)


def _check_fwd_close(float64_ref, outs, x, w, b):
    """h and gelu(h) within two roundings of x's 16-bit dtype of the float64 reference."""
    for out, ref in zip(outs, float64_ref(pallas_kernels.matmul_gelu_ref, x, w, b), strict=True):
        err = np.abs(np.asarray(out, np.float64) - ref).max()
        tol = 2 * float(jnp.finfo(x.dtype).eps) * np.abs(ref).max()
        assert out.dtype == x.dtype and err <= tol, (err, tol)


def test_kernels_gelu_grad_is_autodiffs_in_float64():
    """The epilogue's gelu' (rearranged to save multiplies) against jax.grad of GPT-2's GELU."""
    with jax.enable_x64(True):
        x = jnp.linspace(-12.0, 12.0, 100_001, dtype=jnp.float64)
        want = jax.vmap(jax.grad(lambda v: jax.nn.gelu(v, approximate=True)))(x)
        np.testing.assert_allclose(mgpu.gelu_grad(x), want, rtol=0, atol=1e-13)


@pytest.mark.skipif(not mosaic_gpu_capable(), reason="needs a Hopper-class GPU")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("m, k, n", [(8192, 768, 3072), (1024, 1024, 4096), (256, 64, 128)])
def test_compiled_kernel_matches_float64_reference(float64_ref, m, k, n, dtype):
    dy, w, h = _inputs(m, k, n, dtype)
    _check_close(float64_ref, pallas_kernels.matmul_dgelu(dy, w, h), dy, w, h)
    b = jax.random.normal(jax.random.PRNGKey(4), (n,))
    _check_fwd_close(float64_ref, pallas_kernels.matmul_gelu(dy, w, b), dy, w, b)


@pytest.mark.skipif(not mosaic_gpu_capable(), reason="needs a Hopper-class GPU")
def test_compiled_kernels_in_groups_of_rows_of_tiles(float64_ref):
    """group_m 8 (default_config's for a w past L2) over 10 rows of tiles: 8, then 2."""
    cfg = mgpu.Config(group_m=8)
    dy, w, h = _inputs(1280, 256, 1024)
    _check_close(float64_ref, pallas_kernels.matmul_dgelu(dy, w, h, config=cfg), dy, w, h)
    b = jax.random.normal(jax.random.PRNGKey(4), (1024,))
    _check_fwd_close(float64_ref, pallas_kernels.matmul_gelu(dy, w, b, config=cfg), dy, w, b)


@pytest.mark.parametrize(
    "shapes, dtype, match",
    [
        (((256, 64), (64, 128), (256, 64)), jnp.bfloat16, "h \\(M, N\\)"),
        (((256, 64), (32, 128), (256, 128)), jnp.bfloat16, "w \\(K, N\\)"),
        (((256, 64), (64, 128), (256, 128)), jnp.float32, "bfloat16 or float16"),
        (((2, 256, 64), (64, 128), (2, 256, 128)), jnp.bfloat16, "dy \\(M, K\\)"),
        (((200, 64), (64, 128), (200, 128)), jnp.bfloat16, "M a multiple of 128, got 200"),
        (((256, 96), (96, 128), (256, 128)), jnp.bfloat16, "K a multiple of 64, got 96"),
    ],
)
def test_bad_inputs_raise(monkeypatch, shapes, dtype, match):
    import pallas_kernels.common as common

    monkeypatch.setattr(common, "mosaic_gpu_capable", lambda: True)
    args = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(pallas_kernels.matmul_dgelu, *args)


@pytest.mark.parametrize(
    "shapes, dtypes, match",
    [
        (((256, 64), (64, 128), (64,)), "bf16 bf16 f32", "b \\(N,\\)"),
        (((256, 64), (64, 128), (128,)), "bf16 bf16 bf16", "b float32"),
        (((200, 64), (64, 128), (128,)), "bf16 bf16 f32", "matmul_gelu needs M a multiple of 128"),
    ],
)
def test_bad_forward_inputs_raise(monkeypatch, shapes, dtypes, match):
    import pallas_kernels.common as common

    monkeypatch.setattr(common, "mosaic_gpu_capable", lambda: True)
    names = {"bf16": jnp.bfloat16, "f32": jnp.float32}
    args = [jax.ShapeDtypeStruct(s, names[t]) for s, t in zip(shapes, dtypes.split(), strict=True)]
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(pallas_kernels.matmul_gelu, *args)


def test_refused_without_a_hopper_gpu(monkeypatch):
    import pallas_kernels.common as common

    monkeypatch.setattr(common, "mosaic_gpu_capable", lambda: False)
    with pytest.raises(ValueError, match="Hopper-class"):
        pallas_kernels.matmul_dgelu(*_inputs(128, 64, 128))


def _kernels_as_references(monkeypatch):
    monkeypatch.setattr(pallas_kernels, "matmul_gelu", pallas_kernels.matmul_gelu_ref)
    monkeypatch.setattr(pallas_kernels, "matmul_dgelu", pallas_kernels.matmul_dgelu_ref)


@pytest.mark.parametrize("rows", [(2, 128), (3, 5)])  # a multiple of 128 rows, and not (XLA's)
@pytest.mark.parametrize("bias", [True, False])
def test_gelu_mlp_has_autodiffs_values_and_gradients(monkeypatch, rows, bias):
    """The custom VJP around the kernels (stood in by their references on the CPU): the same
    output and gradients (x, w1, b1, w2) as autodiff of gelu(x w1 + b1) w2."""
    _kernels_as_references(monkeypatch)
    keys = jax.random.split(jax.random.PRNGKey(1), 5)
    x = jax.random.normal(keys[0], (*rows, 64))
    w1, w2 = jax.random.normal(keys[1], (64, 256)) / 8, jax.random.normal(keys[2], (256, 64)) / 16
    b1 = jax.random.normal(keys[3], (256,)) if bias else None
    g = jax.random.normal(keys[4], (*rows, 64))

    def xla(x, w1, b1, w2):
        return jnp.dot(jax.nn.gelu(jnp.dot(x, w1) + (0 if b1 is None else b1)), w2)

    def run(fn):
        with jax.default_matmul_precision("highest"):  # a GPU's float32 GEMMs: no TF32
            y, vjp = jax.vjp(fn, x, w1, b1, w2)
            return jax.tree.leaves((y, *vjp(g)))

    for a, b in zip(run(ops.gelu_mlp), run(xla), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_gpt2_mlp_on_the_kernel_path_has_the_xla_paths_gradients(monkeypatch):
    """FeedForward in bf16 compute (fc and proj biases, float32 parameters): the same output
    and gradients (input, both weights, both biases) on either path, the kernel stood in by its
    reference, up to the bf16 rounding of dh (the reference rounds once, XLA after each op)."""
    from jaxllm.layers import FeedForward

    _kernels_as_references(monkeypatch)
    x = jax.random.normal(jax.random.PRNGKey(2), (2, 128, 64))
    g = jax.random.normal(jax.random.PRNGKey(3), (2, 128, 64))
    mlp = {p: FeedForward(256, compute_dtype=jnp.bfloat16, path=p) for p in ("xla", "pallas_mgpu")}
    params = mlp["xla"].init(jax.random.PRNGKey(0), x)
    kernel_params = mlp["pallas_mgpu"].init(jax.random.PRNGKey(0), x)  # the same, also in value
    jax.tree.map(np.testing.assert_array_equal, kernel_params, params)

    def run(path):
        y, vjp = jax.vjp(lambda p, x: mlp[path].apply(p, x), params, x)
        return jax.tree.leaves((y, *vjp(g.astype(y.dtype))))

    for got, want in zip(run("pallas_mgpu"), run("xla"), strict=True):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=0, atol=0.01 * np.abs(want).max())


def test_a_second_derivative_is_one_clear_error(monkeypatch):
    import pallas_kernels.common as common

    monkeypatch.setattr(common, "mosaic_gpu_capable", lambda: True)
    x = jax.ShapeDtypeStruct((128, 64), jnp.bfloat16)
    w1, w2 = jnp.zeros((64, 256), jnp.bfloat16), jnp.zeros((256, 64), jnp.bfloat16)

    def grad_norm(x):
        g = jax.grad(lambda x: jnp.sum(ops.gelu_mlp(x, w1, None, w2).astype(jnp.float32)))
        return jnp.sum(g(x).astype(jnp.float32))

    with pytest.raises(NotImplementedError, match="matmul_.?gelu: the Pallas kernel has first"):
        jax.eval_shape(jax.grad(grad_norm), x)


def test_plan_takes_the_kernel_only_where_it_runs(monkeypatch):
    import pallas_kernels.common as common

    def plan(backend, arch="gpt2", **kw):
        model = tiny_model(arch, mlp_impl="pallas", **{"d_model": 64, **kw})
        return ops.plan_ops(model.cfg, model.execution, backend=backend)

    assert plan("cpu", compute_dtype="bfloat16").notes == (
        "mlp_impl=pallas needs a GPU (backend here: cpu): the MLP runs on xla",
    )
    monkeypatch.setattr(common, "mosaic_gpu_capable", lambda: True)
    p = plan("gpu", compute_dtype="bfloat16")
    assert p.mlp == "pallas_mgpu" and "mlp=pallas_mgpu (rows % 128 > 0: xla)" in p.describe()
    assert "bfloat16 or float16 matmuls" in plan("gpu").notes[0]
    swiglu = plan("gpu", "transformer_lm", compute_dtype="bfloat16", d_ff=256)
    assert swiglu.mlp == "xla" and "SwiGLU" in swiglu.notes[0]
    assert "d_model a multiple of 64" in plan("gpu", compute_dtype="bfloat16", d_model=32).notes[0]
    monkeypatch.setattr(common, "mosaic_gpu_capable", lambda: False)
    assert "Hopper-class" in plan("gpu", compute_dtype="bfloat16").notes[0]
