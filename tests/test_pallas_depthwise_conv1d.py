"""pallas_kernels.depthwise_conv1d against the float64 reference: values, gradients, jit, vmap.

On CPU the kernels run in interpret mode; with JAX_PLATFORMS=cuda,cpu (tests/conftest.py pins the
CPU otherwise) the same tests check the compiled kernels on a GPU.
Tolerances against float64 on the same (rounded) inputs, outputs of order 1:
  float32  out, du: 1e-5 (rel + abs);           dw, db: 1e-5 of max |ref|
  float16  out, du: atol 1e-2 (CS229S's check);  dw, db: 2e-3 of max |ref| (~2 half-ulps)
  bfloat16 out, du: atol 1e-2 + rtol 8e-3 (~1 ulp); dw, db: 1e-2 of max |ref|
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from pallas_kernels import depthwise_conv1d, depthwise_conv1d_ref
from pallas_kernels.common import TUNING_DIR, core_count, tuning_table
from pallas_kernels.depthwise_conv1d import Config, default_config

F16, BF16, F32 = jnp.float16, jnp.bfloat16, jnp.float32
TOL = {F32: (1e-5, 1e-5, 1e-5), F16: (1e-2, 0.0, 2e-3), BF16: (1e-2, 8e-3, 1e-2)}  # atol, rtol, rel
# Ragged on purpose: 40 channels = 2.5 blocks of 16; 19 rows walked 4 per step in 2 strips.
SMALL = Config(block_t=4, block_d=16, num_warps=1, bwd_programs=12, fwd_programs=12)
TUNED = tuning_table("depthwise_conv1d")  # (direction, dtype, L, D) -> measured tiling


def make(shape, k_size, dtype, seed=0):
    rng = np.random.default_rng(seed)
    u = jnp.asarray(rng.normal(size=shape), dtype)
    w = jnp.asarray(rng.normal(size=(shape[2], k_size)) / k_size, dtype)
    b = jnp.asarray(rng.normal(size=shape[2]), dtype)
    return u, w, b


def out_len(n_len, k_size, mode):
    return n_len + k_size - 1 if mode == "full" else n_len


def check_against_float64(float64_ref, shape, k_size, mode, dtype, cfg, seed=0):
    """Forward and all three gradients (one VJP) against the reference evaluated in float64."""
    u, w, b = make(shape, k_size, dtype, seed)
    out, vjp = jax.vjp(lambda u, w, b: depthwise_conv1d(u, w, b, mode, config=cfg), u, w, b)
    assert out.dtype == dtype and out.shape == (shape[0], out_len(shape[1], k_size, mode), shape[2])
    g = jnp.asarray(np.random.default_rng(seed + 1).normal(size=out.shape), dtype)
    grads = vjp(g)

    def ref(u, w, b, g):
        out, ref_vjp = jax.vjp(lambda u, w, b: depthwise_conv1d_ref(u, w, b, mode), u, w, b)
        return out, *ref_vjp(g)

    atol, rtol, rel = TOL[dtype]
    refs = float64_ref(ref, u, w, b, g)
    for name, got, want in zip(("out", "du", "dw", "db"), (out, *grads), refs, strict=True):
        assert got.dtype == dtype, name
        got = np.asarray(got, np.float64)
        if name in ("out", "du"):
            np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=name)
        else:  # sums over B and L: relative to their scale
            assert np.max(np.abs(got - want)) <= rel * np.max(np.abs(want)), name


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("mode", ["full", "causal", "same"])
def test_matches_float64_reference(float64_ref, mode, dtype):
    check_against_float64(float64_ref, (2, 19, 40), 3, mode, dtype, SMALL)


@pytest.mark.parametrize(
    "shape,k_size,mode,cfg",
    [
        ((1, 9, 8), 4, "full", None),  # default config; even K
        ((3, 5, 33), 7, "causal", Config(3, 16, 4, 5)),  # K > rows per step
        ((1, 2, 8), 5, "full", Config(2, 8, 1, 3)),  # K > L
        ((1, 3, 8), 5, "same", Config(1, 8, 1, 2)),  # K > L, one row per step
        ((2, 33, 5), 1, "same", Config(8, 4, 1, 4, 2, 7)),  # K = 1; 2 pipeline stages
    ],
)
def test_edge_shapes_match_float64_reference(float64_ref, shape, k_size, mode, cfg):
    check_against_float64(float64_ref, shape, k_size, mode, F32, cfg, seed=3)


def test_course_worked_example():
    """CS229S project 0, part 3: u = [2, -3, 1, -1, 1], taps [1, -1, 1], bias 6, two zeros on each
    side: out[0] = 0*1 + 0*-1 + 2*1 + 6 = 8, out[1] = 0 - 2 - 3 + 6 = 1, output length L + 2."""
    u = jnp.zeros((1, 5, 16), F16).at[0, :, 0].set(jnp.array([2, -3, 1, -1, 1], F16))
    w = jnp.zeros((16, 3), F16).at[0].set(jnp.array([1, -1, 1], F16))
    b = jnp.zeros((16,), F16).at[0].set(6)
    out = depthwise_conv1d(u, w, b, "full")
    assert out.shape == (1, 7, 16)
    np.testing.assert_array_equal(np.asarray(out[0, :, 0]), [8, 1, 12, 1, 9, 4, 7])
    np.testing.assert_array_equal(np.asarray(out[0, :, 1:]), 0)


def test_full_mode_ends():
    """'full': out[0] = u[0] * w[K-1] + b and the last output is u[L-1] * w[0] + b."""
    u, w, b = make((1, 6, 3), 3, F32, seed=7)
    out = depthwise_conv1d(u, w, b, "full")
    np.testing.assert_allclose(out[0, 0], u[0, 0] * w[:, 2] + b, rtol=1e-6)
    np.testing.assert_allclose(out[0, -1], u[0, -1] * w[:, 0] + b, rtol=1e-6)


def test_check_grads():
    u, w, b = make((1, 7, 5), 3, F32, seed=5)
    check_grads(
        lambda u, w, b: depthwise_conv1d(u, w, b, "full", config=Config(2, 4, 1, 3)),
        (u, w, b),
        order=1,
        modes=["rev"],
        atol=1e-2,
        rtol=1e-2,
        eps=1e-3,
    )


def test_jit_and_vmap():
    u, w, b = make((3, 10, 8), 3, F32, seed=6)
    us = jnp.stack([u, 2 * u])  # (2, 3, 10, 8): vmapped leading axis
    f = jax.jit(jax.vmap(lambda u: depthwise_conv1d(u, w, b, "full")))
    ref = jnp.stack([depthwise_conv1d_ref(x, w, b, "full") for x in us])
    np.testing.assert_allclose(f(us), ref, rtol=1e-5, atol=1e-5)
    dw = jax.jit(
        jax.grad(lambda w: jnp.sum(jax.vmap(lambda u: depthwise_conv1d(u, w, b))(us) ** 2))
    )
    dw_ref = jax.grad(lambda w: sum(jnp.sum(depthwise_conv1d_ref(x, w, b) ** 2) for x in us))
    np.testing.assert_allclose(dw(w), dw_ref(w), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("shape", [(1, 1024, 768), (1, 8192, 8192), (4, 100, 40)])
def test_default_config(shape, dtype):
    for backward in (False, True):
        cfg = default_config(shape, dtype, backward=backward)
        assert cfg.block_d & (cfg.block_d - 1) == 0
        per_thread = cfg.block_d * jnp.dtype(dtype).itemsize / (cfg.num_warps * 32)
        assert per_thread <= 16  # bytes of a row per thread: one 16-byte load at most
        if shape[2] % 64 == 0:
            assert shape[2] % cfg.block_d == 0  # no masked lanes when D allows it
    assert default_config((1, 1024, 768), F32).block_d == 256


COURSE_SHAPES = [
    (1, n_l, n_d) for n_l in (1024, 2048, 4096, 8192) for n_d in (768, 1024, 2048, 8192)
]


def assert_valid_config(cfg, n_channels, dtype):
    """A tiling the kernels accept, with every thread busy on at most 16 bytes per row."""
    assert isinstance(cfg, Config)
    assert min(cfg.block_t, cfg.num_warps, cfg.num_stages, cfg.bwd_programs, cfg.fwd_programs) >= 1
    assert cfg.block_d & (cfg.block_d - 1) == 0 and n_channels % cfg.block_d == 0
    assert 32 * cfg.num_warps <= cfg.block_d
    assert cfg.block_d * jnp.dtype(dtype).itemsize <= 16 * 32 * cfg.num_warps


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("shape", COURSE_SHAPES, ids=lambda s: f"{s[1]}x{s[2]}")
def test_default_config_course_shapes(shape, dtype):
    for backward in (False, True):
        assert_valid_config(default_config(shape, dtype, backward=backward), shape[2], dtype)


def test_tuned_table():
    """Each measured entry is a valid tiling of a course shape, returned for B * L ~ L, and names
    the run (date and command) that picked it."""
    data = json.loads((TUNING_DIR / "depthwise_conv1d_h100.json").read_text())
    assert all(src["date"] and src["commands"] for src in data["sources"])
    assert {e["source"] for e in data["entries"]} <= set(range(len(data["sources"])))
    assert TUNED
    for (direction, dtype, n_l, n_d), tiling in TUNED.items():
        assert direction in ("fwd", "bwd") and (1, n_l, n_d) in COURSE_SHAPES
        backward = direction == "bwd"
        programs = tiling[3] * core_count()
        want = Config(*tiling[:3], programs, tiling[4], programs)
        assert_valid_config(want, n_d, dtype)
        for shape in ((1, n_l, n_d), (4, n_l // 4, n_d), (1, n_l * 5 // 4, n_d)):
            assert default_config(shape, jnp.dtype(dtype), backward=backward) == want, shape


def test_default_config_off_the_table_is_the_heuristic():
    fwd, bwd = 8 * core_count(), 4 * core_count()
    # B * L or D off the course grid: 16-byte loads, block_d a divisor of D where one exists
    assert default_config((1, 16384, 1024), F32) == Config(4, 512, 4, fwd, 1, fwd)
    assert default_config((1, 1024, 640), BF16) == Config(4, 128, 1, fwd, 1, fwd)
    assert default_config((2, 100, 40), F32, backward=True) == Config(4, 64, 1, bwd, 1, bwd)


# One tuned tiling per (block_t, num_stages): the fields that change the kernel's loop structure.
TUNED_SAMPLE = list({(t[0], t[4]): t for t in sorted(set(TUNED.values()))}.values())


@pytest.mark.parametrize("tiling", TUNED_SAMPLE, ids=str)
def test_tuned_tilings_match_float64_reference(float64_ref, tiling):
    programs = tiling[3] * core_count()
    cfg = Config(*tiling[:3], programs, tiling[4], programs)
    check_against_float64(float64_ref, (2, 37, 40), 3, "full", F32, cfg, seed=2)


@pytest.mark.parametrize(
    "u_shape,w_shape,b_shape,dtype,mode,match",
    [
        ((4, 8), (8, 3), (8,), F32, "same", "u must be 3-D"),
        ((1, 1, 4, 8), (8, 3), (8,), F32, "same", "u must be 3-D"),
        ((1, 0, 8), (8, 3), (8,), F32, "same", "B, L, D >= 1"),
        ((1, 4, 8), (7, 3), (8,), F32, "same", "w must be 2-D"),
        ((1, 4, 8), (8,), (8,), F32, "same", "w must be 2-D"),
        ((1, 4, 8), (8, 3, 1), (8,), F32, "same", "w must be 2-D"),
        ((1, 4, 8), (8, 3), (7,), F32, "same", "b must have shape"),
        ((1, 4, 8), (8, 9), (8,), F32, "same", "kernel size K"),
        ((1, 4, 8), (8, 0), (8,), F32, "same", "kernel size K"),
        ((1, 4, 8), (8, 3), (8,), jnp.int32, "same", "dtype"),
        ((1, 4, 8), (8, 3), (8,), F32, "valid", "mode must be one of"),
    ],
)
def test_bad_inputs_raise(u_shape, w_shape, b_shape, dtype, mode, match):
    with pytest.raises(ValueError, match=match):
        depthwise_conv1d(
            jnp.ones(u_shape, dtype), jnp.ones(w_shape, dtype), jnp.ones(b_shape, dtype), mode
        )


def test_float64_input_raises():
    with jax.enable_x64(True):
        u, w, b = jnp.ones((1, 4, 8), jnp.float64), jnp.ones((8, 3)), jnp.ones(8)
        with pytest.raises(ValueError, match="u dtype must be"):
            depthwise_conv1d(u, w, b)


@pytest.mark.parametrize(
    "cfg,match",
    [
        (Config(4, 24, 4, 8), "power of two"),
        (Config(0, 16, 4, 8), "positive"),
        (Config(4, 16, 4, 8, 1, 0), "positive"),
    ],
)
def test_bad_config_raises(cfg, match):
    u, w, b = make((1, 4, 8), 3, F32)
    with pytest.raises(ValueError, match=match):
        depthwise_conv1d(u, w, b, config=cfg)
