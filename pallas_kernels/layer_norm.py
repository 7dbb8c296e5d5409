"""Fused LayerNorm and RMSNorm over the last axis (optionally with the pre-norm residual add):
forward and backward Pallas kernels tied by a custom VJP. This module checks the arguments, picks
the lowering (layer_norm_triton.py by default, layer_norm_mgpu.py with backend="mosaic_gpu") and
owns the custom VJPs; reference.py holds the jnp references.

x (..., D) is viewed as N rows of D; statistics are float32 and saved for the backward (mean and
rstd per row), which recomputes xhat from them. RMSNorm (`rms_norm`, `add_rms_norm`:
y = x * rsqrt(mean(x^2) + eps) * gamma, the Llama norm) runs the same kernel bodies with the
static flag `rms=True`: no mean (neither subtracted nor saved), no beta, no dbeta, and the
backward drops the mean-gradient term:
  LayerNorm: dx = rstd * (g dy - xhat mean(xhat g dy) - mean(g dy)),  xhat = (x - mean) rstd
  RMSNorm:   dx = rstd * (g dy - xhat mean(xhat g dy)),               xhat = x rstd

`add_layer_norm` / `add_rms_norm` fuse the pre-norm block's residual add: s = x + h is written
next to y, and the backward adds the residual stream's gradient ds in the same pass
(dx = ds + norm'(dy)).

Memory traffic, N rows of D, s bytes per element of x, G programs (both lowerings):
  LayerNorm forward : read x, write y       = 2 * N * D * s  (+ 8 N for mean/rstd, + gamma/beta)
  LayerNorm backward: read x, dy; write dx  = 3 * N * D * s  (+ 8 N for mean/rstd, + 8 G D for
                                                              the dgamma/dbeta partials)
  RMSNorm forward   : read x, write y       = 2 * N * D * s  (+ 4 N for rstd, + gamma)
  RMSNorm backward  : read x, dy; write dx  = 3 * N * D * s  (+ 4 N for rstd, + 4 G D partials)
  with the residual add: + read h, write s forward; + read ds, write dh backward (4 and 5 N D s)
"""

from __future__ import annotations

import functools
import math
import numbers

import jax
import jax.numpy as jnp

from . import layer_norm_mgpu as mgpu
from . import layer_norm_triton as triton
from .common import check_backend, check_config, first_order_rules, resolve_interpret
from .layer_norm_triton import Config

DTYPES = (jnp.float32, jnp.bfloat16)
MAX_HIDDEN = 16384  # one row lives in registers; 16k float32 over 16 warps is 32 per thread


# Jitted (here and _backward) so that call sites of one shape and config lower the kernels once.
@functools.partial(jax.jit, static_argnames=("eps", "out_dtype", "interpret", "cfg", "backend"))
def _forward(x, h, gamma, beta, eps: float, out_dtype, interpret: bool, cfg, backend: str):
    """(y, mean, rstd), or (s = x + h, y, mean, rstd) when h is given; beta None is RMSNorm
    (mean is then None)."""
    if backend == "mosaic_gpu":
        return mgpu.forward(x, h, gamma, beta, eps, out_dtype, cfg)
    return triton.forward(x, h, gamma, beta, eps, out_dtype, cfg, interpret)


@functools.partial(jax.jit, static_argnames=("h_dtype", "interpret", "cfg", "backend"))
def _backward(x, gamma, dy, ds, h_dtype, mean, rstd, interpret: bool, cfg, backend: str):
    """(dx, dgamma, dbeta), or (dx, dh, dgamma, dbeta) when ds (the gradient of s) is given;
    mean None is RMSNorm (dbeta is then None)."""
    if backend == "mosaic_gpu":
        return mgpu.backward(x, gamma, dy, ds, h_dtype, mean, rstd, cfg)
    return triton.backward(x, gamma, dy, ds, h_dtype, mean, rstd, cfg, interpret)


def _cast(grad, param):
    """A parameter's float32 gradient in the parameter's dtype; None for an absent beta."""
    return None if param is None else grad.astype(param.dtype)


# One custom VJP per arity, for LayerNorm and RMSNorm alike: beta None selects RMSNorm (an empty
# pytree, whose cotangent is None).
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _norm(x, gamma, beta, eps, out_dtype, interpret, cfgs, backend):
    return _forward(x, None, gamma, beta, eps, out_dtype, interpret, cfgs[0], backend)[0]


def _norm_fwd(x, gamma, beta, eps, out_dtype, interpret, cfgs, backend):
    y, mean, rstd = _forward(x, None, gamma, beta, eps, out_dtype, interpret, cfgs[0], backend)
    return y, (x, gamma, beta, mean, rstd)


def _norm_bwd(eps, out_dtype, interpret, cfgs, backend, res, dy):
    x, gamma, beta, mean, rstd = res
    dx, dg, db = _backward(x, gamma, dy, None, None, mean, rstd, interpret, cfgs[1], backend)
    return dx, _cast(dg, gamma), _cast(db, beta)


_norm.defvjp(*first_order_rules("layer_norm / rms_norm", 3, _norm_fwd, _norm_bwd))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _add_norm(x, h, gamma, beta, eps, out_dtype, interpret, cfgs, backend):
    return _forward(x, h, gamma, beta, eps, out_dtype, interpret, cfgs[0], backend)[:2]


def _add_norm_fwd(x, h, gamma, beta, eps, out_dtype, interpret, cfgs, backend):
    s, y, mean, rstd = _forward(x, h, gamma, beta, eps, out_dtype, interpret, cfgs[0], backend)
    return (s, y), (s, jnp.zeros((0,), h.dtype), gamma, beta, mean, rstd)


def _add_norm_bwd(eps, out_dtype, interpret, cfgs, backend, res, cts):
    s, h_like, gamma, beta, mean, rstd = res
    ds, dy = cts
    h_dtype = h_like.dtype
    dx, dh, dg, db = _backward(s, gamma, dy, ds, h_dtype, mean, rstd, interpret, cfgs[1], backend)
    return dx, dh, _cast(dg, gamma), _cast(db, beta)


_add_norm.defvjp(
    *first_order_rules("add_layer_norm / add_rms_norm", 4, _add_norm_fwd, _add_norm_bwd)
)


def _check(x, gamma, beta) -> None:
    if x.ndim < 1:
        raise ValueError(f"x must have at least 1 dim (..., D), got shape {x.shape}")
    if x.dtype not in DTYPES:
        raise ValueError(f"x dtype must be one of float32, bfloat16, got {x.dtype}")
    n_cols = x.shape[-1]
    if not 1 <= n_cols <= MAX_HIDDEN:
        raise ValueError(f"hidden size D must be in [1, {MAX_HIDDEN}], got {n_cols}")
    if x.size == 0:
        raise ValueError(f"x has no rows to normalise: shape {x.shape}")
    for name, p in (("gamma", gamma), ("beta", beta)):
        if p is None:  # RMSNorm: no beta
            continue
        if p.shape != (n_cols,):
            raise ValueError(f"{name} must have shape ({n_cols},) to match x, got {p.shape}")
        if not jnp.issubdtype(p.dtype, jnp.floating):
            raise ValueError(f"{name} must be floating point, got {p.dtype}")


def _prepare(x, gamma, beta, out_dtype, config, backend: str, interpret, h_dtype=None):
    """Check the public arguments; returns (out_dtype, (forward, backward) configs, interpret).

    `config` is a Config (Triton) or a layer_norm_mgpu.Config (Mosaic GPU; used for both
    directions, which share the forward's row blocks)."""
    _check(x, gamma, beta)
    check_backend(backend, interpret)
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if out_dtype not in DTYPES:
        raise ValueError(f"out_dtype must be one of float32, bfloat16, got {out_dtype}")
    if backend == "mosaic_gpu":
        check_config(config, backend, mgpu.Config)
        n_rows = math.prod(x.shape[:-1])
        param_bytes = sum(p.dtype.itemsize for p in (gamma, beta) if p is not None)
        cfgs = mgpu.configs(n_rows, x.shape[-1], x.dtype, out_dtype, h_dtype, param_bytes)
        return out_dtype, ((config, config) if config else cfgs), False
    check_config(config, backend, Config, ("block_rows", "num_warps"))
    cfgs = (config, config) if config else triton.default_configs(x.shape[-1])
    return out_dtype, cfgs, resolve_interpret(interpret)


def _apply(x, h, gamma, beta, eps, interpret, out_dtype, config, backend):
    """The public functions' common body: h None is the plain norm, beta None is RMSNorm."""
    # a Python or NumPy real (np.float32(1e-5) too), not an array: it is compiled in
    if not (isinstance(eps, numbers.Real) and math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite real number >= 0 (not an array), got {eps!r}")
    out_dtype, cfgs, interpret = _prepare(
        x, gamma, beta, out_dtype, config, backend, interpret, None if h is None else h.dtype
    )
    flat = (-1, x.shape[-1])
    static = (float(eps), out_dtype, interpret, cfgs, backend)
    if h is None:
        return _norm(x.reshape(flat), gamma, beta, *static).reshape(x.shape)
    if h.shape != x.shape or h.dtype not in DTYPES:
        raise ValueError(
            f"h must match x's shape {x.shape} with a float32/bfloat16 dtype, got "
            f"{h.dtype}{h.shape}"
        )
    s, y = _add_norm(x.reshape(flat), h.reshape(flat), gamma, beta, *static)
    return s.reshape(x.shape), y.reshape(x.shape)


def mosaic_norm_refusal(n_cols: int, dtype, out_dtype, param_bytes: int = 8) -> str | None:
    """Why the Mosaic GPU norm kernels cannot take rows of `n_cols` of `dtype` (the residual
    stream) with a branch h and y in `out_dtype`, and gamma (+ beta) of `param_bytes` bytes per
    column, as "needs ..." would end (None: they can, with and without the residual add): D a
    multiple of 128 whose rows fit in shared memory."""
    try:  # the residual variant: the larger
        mgpu.configs(1024, n_cols, dtype, out_dtype, out_dtype, param_bytes)
    except ValueError:
        return f"a hidden size D that is a multiple of 128 and fits in shared memory (got {n_cols})"
    return None


def layer_norm(
    x: jax.Array,
    gamma: jax.Array,
    beta: jax.Array,
    eps: float = 1e-5,
    interpret: bool | None = None,
    *,
    out_dtype=None,
    config=None,
    backend: str = "triton",
) -> jax.Array:
    """LayerNorm over the last axis: x (..., D), gamma/beta (D,) -> (..., D) in `out_dtype`
    (default x's dtype; float32 x to bfloat16 y is the mixed-precision pre-norm case: the kernel
    writes the matmul's input directly, and takes its bfloat16 gradient).

    Statistics are float32. `config` overrides the tuned block sizes of both directions
    (benchmarks use it). `backend`: "triton" or "mosaic_gpu" (common.py).
    """
    return _apply(x, None, gamma, beta, eps, interpret, out_dtype, config, backend)


def add_layer_norm(
    x: jax.Array,
    h: jax.Array,
    gamma: jax.Array,
    beta: jax.Array,
    eps: float = 1e-5,
    interpret: bool | None = None,
    *,
    out_dtype=None,
    config=None,
    backend: str = "triton",
) -> tuple[jax.Array, jax.Array]:
    """The pre-norm residual step in one kernel: s = x + h, y = LayerNorm(s).

    x (..., D) the residual stream, h (..., D) a branch output (float32 or bfloat16);
    returns (s in x's dtype, y in `out_dtype`, default x's dtype). One pass reads x and h and
    writes s and y; the backward reads s, dy, ds and writes dx and dh (= dx in h's dtype) in one
    pass too, instead of a LayerNorm plus separate add and convert passes. `backend` as in
    `layer_norm`.
    """
    return _apply(x, h, gamma, beta, eps, interpret, out_dtype, config, backend)


def rms_norm(
    x: jax.Array,
    gamma: jax.Array,
    eps: float = 1e-5,
    interpret: bool | None = None,
    *,
    out_dtype=None,
    config=None,
    backend: str = "triton",
) -> jax.Array:
    """RMSNorm over the last axis: y = x * rsqrt(mean(x^2) + eps) * gamma; x (..., D), gamma
    (D,) -> (..., D) in `out_dtype` (default x's dtype). The LayerNorm kernels without the mean
    and beta; arguments as in `layer_norm`."""
    return _apply(x, None, gamma, None, eps, interpret, out_dtype, config, backend)


def add_rms_norm(
    x: jax.Array,
    h: jax.Array,
    gamma: jax.Array,
    eps: float = 1e-5,
    interpret: bool | None = None,
    *,
    out_dtype=None,
    config=None,
    backend: str = "triton",
) -> tuple[jax.Array, jax.Array]:
    """The Llama pre-norm residual step in one kernel: s = x + h, y = RMSNorm(s); returns
    (s in x's dtype, y in `out_dtype`). Both directions one pass each, as `add_layer_norm`."""
    return _apply(x, h, gamma, None, eps, interpret, out_dtype, config, backend)
