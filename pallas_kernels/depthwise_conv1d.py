"""Depthwise conv1d over time with in-kernel zero padding: Pallas kernels with a custom VJP.

u (B, L, D), w (D, K), b (D,): out[:, t, d] = b[d] + sum_k w[d, k] * u[:, t + k - P, d], reads
outside [0, L) being zeros, with left padding P = K - 1 ('full', 'causal') or (K - 1) // 2
('same'). 'full' is the CS229S layout (K = 3, two zeros on each side): Lo = L + K - 1 output rows;
the other modes give Lo = L. This module checks the arguments, picks the lowering
(depthwise_conv1d_triton.py by default, depthwise_conv1d_mgpu.py with backend="mosaic_gpu") and
owns the custom VJP; reference.depthwise_conv1d_ref is the jnp reference. Math is float32 for
every input dtype. Backward: du[s] = sum_k w[k] g[s + P - k], dw[k] = sum_s u[s] g[s + P - k],
db = sum g, with g = dout.

Memory traffic, s bytes per element (the minimum: each input read once, each output written once):
  forward : read u, write out    = (L + Lo) B D s   (+ w, b; halo rows of K - 1 per tile)
  backward: read u, g; write du  = (2 L + Lo) B D s (+ w; float32 dw/db partials per tile)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import depthwise_conv1d_mgpu as mgpu
from . import depthwise_conv1d_triton as triton
from .common import check_backend, check_config, first_order_rules, resolve_interpret
from .depthwise_conv1d_triton import Config, default_config
from .reference import CONV_MODES

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
MAX_KERNEL = 7  # the K taps are unrolled


# Jitted (here and _backward) so that call sites of one shape and config lower the kernels once.
@functools.partial(jax.jit, static_argnames=("mode", "interpret", "cfg", "backend"))
def _forward(u, w, b, mode: str, interpret: bool, cfg, backend: str) -> jax.Array:
    if backend == "mosaic_gpu":
        return mgpu.forward(u, w, b, mode, cfg)
    return triton.forward(u, w, b, mode, cfg, interpret)


@functools.partial(jax.jit, static_argnames=("mode", "interpret", "cfg", "backend"))
def _backward(u, w, g, mode: str, interpret: bool, cfg, backend: str):
    if backend == "mosaic_gpu":
        return mgpu.backward(u, w, g, mode, cfg)
    return triton.backward(u, w, g, mode, cfg, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _conv(u, w, b, mode, interpret, cfgs, backend):
    return _forward(u, w, b, mode, interpret, cfgs[0], backend)


def _conv_fwd(u, w, b, mode, interpret, cfgs, backend):
    return _forward(u, w, b, mode, interpret, cfgs[0], backend), (u, w, b)


def _conv_bwd(mode, interpret, cfgs, backend, res, g):
    u, w, b = res
    du, dw, db = _backward(u, w, g, mode, interpret, cfgs[1], backend)
    return du, dw.astype(w.dtype), db.astype(b.dtype)


_conv.defvjp(*first_order_rules("depthwise_conv1d", 3, _conv_fwd, _conv_bwd))


def _check(u, w, b, mode: str) -> None:
    if getattr(u, "ndim", None) != 3:
        raise ValueError(f"u must be 3-D (B, L, D), got shape {jnp.shape(u)}")
    if any(n < 1 for n in u.shape):
        raise ValueError(f"u must have B, L, D >= 1, got shape {u.shape}")
    if getattr(w, "ndim", None) != 2 or w.shape[0] != u.shape[2]:
        raise ValueError(f"w must be 2-D (D, K) with D = {u.shape[2]}, got shape {jnp.shape(w)}")
    if jnp.shape(b) != (u.shape[2],):
        raise ValueError(f"b must have shape ({u.shape[2]},), got {jnp.shape(b)}")
    if not 1 <= w.shape[1] <= MAX_KERNEL:
        raise ValueError(f"kernel size K must be in [1, {MAX_KERNEL}], got {w.shape[1]}")
    for name, a in (("u", u), ("w", w), ("b", b)):
        if a.dtype not in DTYPES:
            raise ValueError(f"{name} dtype must be float32, bfloat16 or float16, got {a.dtype}")
    if mode not in CONV_MODES:
        raise ValueError(f"mode must be one of {CONV_MODES}, got {mode!r}")


def depthwise_conv1d(
    u: jax.Array,
    w: jax.Array,
    b: jax.Array,
    mode: str = "same",
    interpret: bool | None = None,
    *,
    config=None,
    backend: str = "triton",
) -> jax.Array:
    """Depthwise conv1d: u (B, L, D), w (D, K), b (D,) -> (B, Lo, D) in u's dtype.

    A cross-correlation (as torch's conv1d). Lo = L for 'same' and 'causal', L + K - 1 for 'full'
    (the course's padding of K - 1 zeros on both ends). K may exceed L: the padding defines it.
    Math is float32; dw and db come back in w's and b's dtypes. `config` overrides the tiling of
    both kernels (benchmarks use it); by default each direction takes `default_config`.
    `backend`: "triton" or "mosaic_gpu" (common.py); the latter takes a
    depthwise_conv1d_mgpu.Config.
    """
    check_backend(backend, interpret)
    _check(u, w, b, mode)
    if backend == "mosaic_gpu":
        check_config(config, backend, mgpu.Config)
        fwd_cfg = config or mgpu.default_config(u.shape)
        bwd_cfg = config or mgpu.default_config(u.shape, backward=True)
        return _conv(u, w, b, mode, False, (fwd_cfg, bwd_cfg), backend)
    check_config(config, backend, Config, ("block_d",))  # fwd_programs None: bwd_programs
    fwd_cfg = config or default_config(u.shape, u.dtype)
    bwd_cfg = config or default_config(u.shape, u.dtype, backward=True)
    return _conv(u, w, b, mode, resolve_interpret(interpret), (fwd_cfg, bwd_cfg), backend)
