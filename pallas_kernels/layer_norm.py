"""Fused LayerNorm and RMSNorm over the last axis: forward and backward Pallas kernels tied by a
custom VJP.

x (..., D) is viewed as N rows of D. A program walks `steps` blocks of `block_rows` whole rows
(padded to a power of two of columns and masked), so each row's statistics stay in registers (one
read of x) and gamma/beta are read once per program, not once per row (at D = 8192 a per-row
re-read of float32 gamma/beta is 4x the bf16 row itself in L2 traffic). Backward recomputes xhat
from the saved float32 mean/rstd; dgamma/dbeta are summed per program in registers, written as
per-program partials (G, D) float32 and reduced by one small jnp.sum (no atomics).

RMSNorm (`rms_norm`, `add_rms_norm`: y = x * rsqrt(mean(x^2) + eps) * gamma, the Llama norm) runs
the same kernel bodies with the static flag `rms=True`: no mean (neither subtracted nor saved), no
beta, no dbeta partials, and the backward drops the mean-gradient term:
  LayerNorm: dx = rstd * (g dy - xhat mean(xhat g dy) - mean(g dy)),  xhat = (x - mean) rstd
  RMSNorm:   dx = rstd * (g dy - xhat mean(xhat g dy)),               xhat = x rstd

`add_layer_norm` / `add_rms_norm` fuse the pre-norm block's residual add: s = x + h is written
next to y, and the backward adds the residual stream's gradient ds in the same pass
(dx = ds + norm'(dy)).

Minimal memory traffic, N rows of D, s bytes per element of x:
  LayerNorm forward : read x, write y       = 2 * N * D * s  (+ 8 N for mean/rstd, + gamma/beta)
  LayerNorm backward: read x, dy; write dx  = 3 * N * D * s  (+ 8 N for mean/rstd, + 8 G D for
                                                              the dgamma/dbeta partials)
  RMSNorm forward   : read x, write y       = 2 * N * D * s  (+ 4 N for rstd, + gamma)
  RMSNorm backward  : read x, dy; write dx  = 3 * N * D * s  (+ 4 N for rstd, + 4 G D partials)
  with the residual add: + read h, write s forward; + read ds, write dh backward (4 and 5 N D s)
Backend: Triton lowering by default; `backend="mosaic_gpu"` runs layer_norm_mgpu.py's kernels in
the same custom VJP (pallas_kernels/triton_backend.py picks and validates the lowering).
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .triton_backend import (
    check_backend,
    check_triton_config,
    compiler_params,
    core_count,
    first_order_rules,
    resolve_interpret,
)

DTYPES = (jnp.float32, jnp.bfloat16)
MAX_HIDDEN = 16384  # one row lives in registers; 16k float32 over 16 warps is 32 per thread


class Config(NamedTuple):
    block_rows: int  # rows per loop step
    num_warps: int
    programs: int  # target number of programs; each loops over ceil(blocks / programs) steps
    num_stages: int = 1  # Triton software pipelining of the row loop


def default_configs(n_cols: int) -> tuple[Config, Config]:
    """(forward, backward) block sizes by padded row length, from the H100 sweep in
    benchmarks/RESULTS.md: 2048-element row blocks; the forward wants more programs (it keeps
    no partials), the backward fewer programs (smaller dgamma/dbeta partials) and pipelining."""
    width = pl.next_power_of_2(n_cols)
    block_rows = max(1, 2048 // width)
    fwd = Config(block_rows, 4 if width <= 2048 else 8, programs=8 * core_count())
    bwd = Config(block_rows, 4 if width <= 2048 else 16, programs=4 * core_count(), num_stages=3)
    return fwd, bwd


def _grid(n_rows: int, cfg: Config) -> tuple[int, int]:
    """(programs, steps per program) covering n_rows in blocks of cfg.block_rows."""
    n_blocks = pl.cdiv(n_rows, cfg.block_rows)
    steps = pl.cdiv(n_blocks, cfg.programs)
    return pl.cdiv(n_blocks, steps), steps


def _i32(x) -> jax.Array:
    """x as an int32 index. Under jax_enable_x64 Python ints and loop counters are int64 while
    program ids are int32, and interpret mode rejects slice starts of mixed integer types; int32
    is also what the GPU's index arithmetic wants."""
    return jax.lax.convert_element_type(x, jnp.int32)


def _row_block(pid, block_rows: int, block_cols: int, n_rows: int, n_cols: int):
    # pid mixes program id and loop counter: int32 whatever x64 makes of the counter
    row0 = _i32(pid) * block_rows
    rows = pl.ds(row0, block_rows)
    row_ok = row0 + jnp.arange(block_rows, dtype=jnp.int32) < n_rows  # (R,)
    col_ok = jnp.arange(block_cols, dtype=jnp.int32) < n_cols  # (C,)
    return rows, row_ok, col_ok


def operands(direction: str, residual: bool, rms: bool) -> tuple[str, ...]:
    """The kernels' operand names, inputs then outputs, in call order (both lowerings): h and s
    (ds and dh) only with the residual add; beta, mean (and dbeta) only for LayerNorm."""
    if direction == "fwd":
        names = ("x", residual and "h", "g", not rms and "b",
                 residual and "s", "y", not rms and "mean", "rstd")  # fmt: skip
    else:
        names = ("x", "g", "dy", residual and "ds", not rms and "mean", "rstd",
                 "dx", residual and "dh", "dg", not rms and "db")  # fmt: skip
    return tuple(n for n in names if n)


def kernel_name(direction: str, residual: bool, rms: bool) -> str:
    """e.g. add_rms_norm_fwd: the kernel's name in profiles (layer_norm_mgpu adds _mgpu)."""
    return f"{'add_' if residual else ''}{'rms' if rms else 'layer'}_norm_{direction}"


def _fwd_kernel(*refs, eps: float, block_rows: int, steps: int, residual: bool, rms: bool):
    # with the residual, s = x + h is written out too: the pre-norm block's residual add, fused
    r = dict(zip(operands("fwd", residual, rms), refs, strict=True))
    n_rows, n_cols = r["x"].shape
    block_cols = pl.next_power_of_2(n_cols)
    cols = pl.ds(_i32(0), block_cols)
    col_ok = jnp.arange(block_cols, dtype=jnp.int32) < n_cols
    g = pltriton.load(r["g"].at[cols], mask=col_ok, other=0.0).astype(jnp.float32)
    if not rms:
        b = pltriton.load(r["b"].at[cols], mask=col_ok, other=0.0).astype(jnp.float32)
    part = pl.program_id(0)  # read outside the loop: interpret mode cannot lower it inside

    @pl.loop(0, steps)
    def step(i):
        rows, row_ok, _ = _row_block(part * steps + i, block_rows, block_cols, n_rows, n_cols)
        valid = row_ok[:, None] & col_ok[None, :]
        x = pltriton.load(r["x"].at[rows, cols], mask=valid, other=0.0).astype(jnp.float32)
        if residual:
            h = pltriton.load(r["h"].at[rows, cols], mask=valid, other=0.0).astype(jnp.float32)
            s = (x + h).astype(r["s"].dtype)  # the stream as stored: its norm, as backward's
            pltriton.store(r["s"].at[rows, cols], s, mask=valid)
            x = s.astype(jnp.float32)
        if rms:  # no centring: masked loads already zeroed the padding columns
            xc = x
        else:
            mean = jnp.sum(x, axis=1) / n_cols  # (R,)
            xc = jnp.where(col_ok[None, :], x - mean[:, None], 0.0)
        rstd = jax.lax.rsqrt(jnp.sum(xc * xc, axis=1) / n_cols + eps)
        y = xc * rstd[:, None] * g[None, :]
        if not rms:
            y = y + b[None, :]
        pltriton.store(r["y"].at[rows, cols], y.astype(r["y"].dtype), mask=valid)
        if not rms:
            pltriton.store(r["mean"].at[rows], mean, mask=row_ok)
        pltriton.store(r["rstd"].at[rows], rstd, mask=row_ok)


def _bwd_kernel(*refs, block_rows: int, steps: int, residual: bool, rms: bool):
    # with the residual, dx = ds + norm'(dy): the residual stream's gradient joins in; dh = dx
    r = dict(zip(operands("bwd", residual, rms), refs, strict=True))
    n_rows, n_cols = r["x"].shape
    block_cols = pl.next_power_of_2(n_cols)
    cols = pl.ds(_i32(0), block_cols)
    col_ok = jnp.arange(block_cols, dtype=jnp.int32) < n_cols
    g = pltriton.load(r["g"].at[cols], mask=col_ok, other=0.0).astype(jnp.float32)
    part = pl.program_id(0)  # read outside the loop: interpret mode cannot lower it inside

    def step(i, acc):
        rows, row_ok, _ = _row_block(part * steps + i, block_rows, block_cols, n_rows, n_cols)
        valid = row_ok[:, None] & col_ok[None, :]
        x = pltriton.load(r["x"].at[rows, cols], mask=valid, other=0.0).astype(jnp.float32)
        dy = pltriton.load(r["dy"].at[rows, cols], mask=valid, other=0.0).astype(jnp.float32)
        mean = None if rms else pltriton.load(r["mean"].at[rows], mask=row_ok, other=0.0)
        rstd = pltriton.load(r["rstd"].at[rows], mask=row_ok, other=0.0)
        xc = x if rms else x - mean[:, None]
        xhat = jnp.where(valid, xc * rstd[:, None], 0.0)  # (R, C)
        gdy = g[None, :] * dy
        c1 = jnp.sum(xhat * gdy, axis=1) / n_cols
        c2 = None if rms else jnp.sum(gdy, axis=1) / n_cols
        dx = gdy - xhat * c1[:, None]
        if not rms:
            dx = dx - c2[:, None]
        dx = dx * rstd[:, None]
        if residual:
            ds = pltriton.load(r["ds"].at[rows, cols], mask=valid, other=0.0)
            dx = dx + ds.astype(jnp.float32)
            pltriton.store(r["dh"].at[rows, cols], dx.astype(r["dh"].dtype), mask=valid)
        pltriton.store(r["dx"].at[rows, cols], dx.astype(r["dx"].dtype), mask=valid)
        return (acc[0] + dy * xhat, *(() if rms else (acc[1] + dy,)))  # dgamma (, dbeta)

    zeros = jnp.zeros((block_rows, block_cols), jnp.float32)
    accs = jax.lax.fori_loop(0, steps, step, (zeros,) * (1 if rms else 2))
    for name, acc in zip(("dg", "db"), accs, strict=False):
        pltriton.store(r[name].at[part, cols], jnp.sum(acc, axis=0), mask=col_ok)


def _forward(x, h, gamma, beta, eps: float, out_dtype, interpret: bool, cfg, backend: str):
    """(y, mean, rstd), or (s = x + h, y, mean, rstd) when h is given; beta None is RMSNorm
    (mean is then None)."""
    if backend == "mosaic_gpu":
        from . import layer_norm_mgpu

        return layer_norm_mgpu.forward(x, h, gamma, beta, eps, out_dtype, cfg)
    n_rows, n_cols = x.shape  # (N, D)
    n_programs, steps = _grid(n_rows, cfg)
    residual, rms = h is not None, beta is None
    stats = jax.ShapeDtypeStruct((n_rows,), jnp.float32)
    out_shape = (jax.ShapeDtypeStruct(x.shape, out_dtype), *(() if rms else (stats,)), stats)
    if residual:
        out_shape = (jax.ShapeDtypeStruct(x.shape, x.dtype), *out_shape)
    kernel = functools.partial(
        _fwd_kernel, eps=eps, block_rows=cfg.block_rows, steps=steps, residual=residual, rms=rms
    )
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(n_programs,),
        compiler_params=compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name=kernel_name("fwd", residual, rms),
    )(*((x, h) if residual else (x,)), gamma, *(() if rms else (beta,)))
    return (*outs[:-1], None, outs[-1]) if rms else outs


def _backward(x, gamma, dy, ds, h_dtype, mean, rstd, interpret: bool, cfg, backend: str):
    """(dx, dgamma, dbeta), or (dx, dh, dgamma, dbeta) when ds (the gradient of s) is given;
    mean None is RMSNorm (dbeta is then None)."""
    if backend == "mosaic_gpu":
        from . import layer_norm_mgpu

        return layer_norm_mgpu.backward(x, gamma, dy, ds, h_dtype, mean, rstd, cfg)
    n_rows, n_cols = x.shape
    n_programs, steps = _grid(n_rows, cfg)
    part = jax.ShapeDtypeStruct((n_programs, n_cols), jnp.float32)
    residual, rms = ds is not None, mean is None
    out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype), part, *(() if rms else (part,))]
    if residual:
        out_shape.insert(1, jax.ShapeDtypeStruct(x.shape, h_dtype))
    kernel = functools.partial(
        _bwd_kernel, block_rows=cfg.block_rows, steps=steps, residual=residual, rms=rms
    )
    outs = pl.pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid=(n_programs,),
        compiler_params=compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name=kernel_name("bwd", residual, rms),
    )(x, gamma, dy, *((ds,) if residual else ()), *(() if rms else (mean,)), rstd)
    n_grads = 2 if residual else 1
    sums = [jnp.sum(p, axis=0) for p in outs[n_grads:]]
    return (*outs[:n_grads], *sums, *((None,) if rms else ()))


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
        from . import layer_norm_mgpu

        if config is not None and not isinstance(config, layer_norm_mgpu.Config):
            raise ValueError(f"backend='mosaic_gpu' takes a layer_norm_mgpu.Config, got {config}")
        n_rows = math.prod(x.shape[:-1])
        param_bytes = sum(p.dtype.itemsize for p in (gamma, beta) if p is not None)
        cfgs = layer_norm_mgpu.configs(
            n_rows, x.shape[-1], x.dtype, out_dtype, h_dtype, param_bytes
        )
        return out_dtype, ((config, config) if config else cfgs), False
    if config is not None and not isinstance(config, Config):
        raise ValueError(f"backend='triton' takes a layer_norm.Config, got {config}")
    if config is not None:
        check_triton_config(config, ("block_rows", "num_warps"))
    cfgs = (config, config) if config else default_configs(x.shape[-1])
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
    (benchmarks use it). `backend`: "triton" or "mosaic_gpu" (triton_backend.py).
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
