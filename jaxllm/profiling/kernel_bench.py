"""Benchmark of the Pallas kernels against XLA's jit of the jnp reference and PyTorch's op.

Families (`profile.py kernels --only ...`): softmax, layer_norm (LayerNorm rows, then RMSNorm
rows: the same kernels with `rms=True`, on the same shapes and tilings), conv1d.

For each kernel, direction, shape and dtype: the median device time of the best of a few block
configurations (and of the default one), achieved GB/s over the minimal bytes (each input read
once, each output written once; pallas_kernels/*.py docstrings), its share of the measured copy
bandwidth, and speed-ups over XLA (same run) and PyTorch (if importable). Backward rows time the
VJP function alone (residuals computed beforehand), for Pallas and XLA alike.

"% streams" is the kernel's time against XLA's fastest possible kernel with the same full-size
traffic at the same shape and dtype: an elementwise loop fusion reading as many (shape, dtype)
arrays and writing as many (1 and 1 forward, 2 and 1 backward), no reductions. Where a row stays
under 85% of the 1 GiB copy, this says whether its traffic at that size could do better at all
(small arrays: launch and ramp-up latency; 2 reads per write: a mix the copy does not measure).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import attention_softmax, depthwise_conv1d, layer_norm, rms_norm
from pallas_kernels.attention_softmax import Config as SoftmaxConfig
from pallas_kernels.depthwise_conv1d import Config as ConvConfig
from pallas_kernels.depthwise_conv1d import default_config as conv_default_config
from pallas_kernels.layer_norm import Config as LayerNormConfig
from pallas_kernels.reference import (
    attention_softmax_ref,
    conv1d_padding,
    depthwise_conv1d_ref,
    layer_norm_ref,
    rms_norm_ref,
)

from .flops import conv1d_output_length
from .harness import append_jsonl
from .timing import chained_median_seconds, rotation_count, torch_median_seconds

SOFTMAX_SHAPES = [((64, 16, 128, 128), "causal"), ((8, 12, 1024, 1024), "keypad"),
                  ((8, 16, 2048, 2048), "causal")]  # fmt: skip
LN_SHAPES = [(16384, 768), (65536, 1024), (16384, 8192)]
# CS229S project 0 (part 3): B = 1, L x D grid, K = 3
CONV_SHAPES = [((1, n_l, n_d), 3) for n_l in (1024, 2048, 4096, 8192)
               for n_d in (768, 1024, 2048, 8192)]  # fmt: skip
CONV_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)
DTYPES = (jnp.float32, jnp.bfloat16)


@dataclasses.dataclass
class Row:
    kernel: str
    direction: str
    shape: str
    dtype: str
    config: str
    ms: float
    gbps: float
    pct_copy: float
    streams_ms: float  # XLA elementwise kernel with the same reads and writes (module doc)
    default_ms: float
    xla_ms: float
    torch_ms: float | None
    rel_err: float


@dataclasses.dataclass
class Case:
    """One kernel x direction x shape x dtype: how to build its timed steps."""

    kernel: str
    direction: str
    shape: tuple
    dtype: Any
    bytes: int
    states: Callable[[Callable], list]  # impl -> rotated states
    step: Callable[[Callable], Callable]  # impl -> (state -> state)
    output: Callable[[Any], jax.Array]  # state -> the array compared between impls
    pallas: Callable[[Any], Callable]  # config (None: default) -> impl
    xla: Callable
    configs: list
    torch: Callable[[], Callable[[], Any]] | None
    array_shape: tuple[int, ...] = ()  # the full-size arrays' shape, for the streams time
    streams: tuple[int, int] = (1, 1)  # full-size arrays read, written


def _rel_err(a, b) -> float:
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def copy_bandwidth() -> dict[str, float]:
    """Device copy bandwidth in GB/s (bytes read + written) of a 1 GiB float32 buffer."""
    n = 2**28
    x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
    out = {"jax_negate": 2 * 4 * n / chained_median_seconds(lambda x: -x, [x]) / 1e9}
    torch = _torch()
    if torch is not None:
        a = torch.randn(n, device="cuda")
        b = torch.empty_like(a)
        out["torch_copy"] = 2 * 4 * n / torch_median_seconds(lambda: b.copy_(a)) / 1e9
        del a, b
        torch.cuda.empty_cache()
    return out


def streams_step(arrays: tuple[jax.Array, ...], writes: int) -> tuple[jax.Array, ...]:
    """One step of the streams reference: reads every array, replaces the first `writes` with
    (sum of the others) - itself. Chained, values stay bounded (period 2: a -> b - a -> a)."""
    rest = sum(arrays[writes:], 0.0)
    return tuple(rest - a for a in arrays[:writes]) + tuple(arrays[writes:])


@functools.cache  # LayerNorm and RMSNorm rows share shapes: time each reference once a run
def streams_seconds(shape: tuple[int, ...], dtype, reads: int, writes: int) -> float:
    """Median seconds of XLA's elementwise kernel reading `reads` arrays of (shape, dtype) and
    writing `writes`, no reductions: what any kernel with that traffic could reach here."""
    if reads < writes or writes < 1:
        raise ValueError(f"need reads >= writes >= 1, got {reads}, {writes}")

    def state(seed):
        keys = jax.random.split(jax.random.key(seed), reads)
        return tuple(jax.random.normal(k, shape, jnp.float32).astype(dtype) for k in keys)

    n_bytes = (reads + writes) * math.prod(shape) * jnp.dtype(dtype).itemsize
    states = [state(i) for i in range(rotation_count(n_bytes))]
    return chained_median_seconds(lambda a: streams_step(a, writes), states)


def _fwd_bwd_cases(
    kernel, shape, dtype, nbytes, make_args, pallas, xla, configs, torch_ops, n_diff=3,
    array_shape=None,
):  # fmt: skip
    """Forward (chain: out -> first arg) and backward (chain: dx -> cotangent) cases.

    The backward differentiates the first `n_diff` arguments (the rest, e.g. a mask, are held).
    `array_shape`: the shape of the full-size arrays (default `shape`).
    """
    array_shape = tuple(array_shape or shape)
    n_fwd, n_bwd = nbytes

    def fwd_states(impl):
        args = make_args()
        return [args] + [make_args(seed) for seed in range(1, rotation_count(n_fwd))]

    def fwd_step(impl):
        return lambda args: (impl(*args), *args[1:])

    def bwd_states(impl):
        out = []
        for seed in range(rotation_count(n_bwd)):
            args = make_args(seed)
            held = args[n_diff:]
            y, vjp = jax.vjp(lambda *diff, held=held: impl(*diff, *held), *args[:n_diff])
            dy = jax.random.normal(jax.random.key(100 + seed), y.shape, y.dtype)
            out.append((vjp, dy, jnp.zeros((), jnp.float32)))
        return out

    def bwd_step(impl):
        def step(state):
            vjp, dy, acc = state
            grads = vjp(dy)
            extra = sum(jnp.sum(g.astype(jnp.float32)) for g in grads[1:] if g is not None)
            return vjp, grads[0], acc + extra  # parameter grads kept live, not DCE'd

        return step

    fwd_torch, bwd_torch = torch_ops if torch_ops else (None, None)
    yield Case(kernel, "fwd", shape, dtype, n_fwd, fwd_states, fwd_step, lambda s: s[0],
               pallas, xla, configs, fwd_torch, array_shape, (1, 1))  # fmt: skip
    yield Case(kernel, "bwd", shape, dtype, n_bwd, bwd_states, bwd_step, lambda s: s[1],
               pallas, xla, configs, bwd_torch, array_shape, (2, 1))  # fmt: skip


def softmax_cases(shapes=SOFTMAX_SHAPES, dtypes=DTYPES) -> Iterator[Case]:
    for shape, kind in shapes:
        for dtype in dtypes:
            b, h, tq, tk = shape
            s = jnp.dtype(dtype).itemsize
            n = b * h * tq * tk
            causal = kind == "causal"
            # scores of std 0.1/Tk scaled by Tk: probabilities stay near 1/Tk and the chained
            # backward (dx = Tk * y * (dy - dot)) keeps its magnitude: no drift to zeros or inf.
            scale = float(tk)

            def make_args(seed=0, shape=shape, dtype=dtype, causal=causal, tk=tk):
                key = jax.random.key(seed)
                x = (0.1 / tk * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
                if causal:
                    return (x,)
                lens = jax.random.randint(jax.random.key(seed + 50), (shape[0],), tk // 2, tk + 1)
                mask = jnp.where(jnp.arange(tk) < lens[:, None], 0.0, -jnp.inf)
                return x, mask[:, None, None, :].astype(jnp.float32)  # (B, 1, 1, Tk) key padding

            def pallas(cfg, causal=causal, scale=scale):
                return lambda x, mask=None: attention_softmax(
                    x, mask, causal=causal, scale=scale, config=cfg
                )

            def xla(x, mask=None, causal=causal, scale=scale):
                return attention_softmax_ref(x, mask, causal=causal, scale=scale)

            width = min(1 << (tk - 1).bit_length(), 4096)
            configs = sorted({SoftmaxConfig(max(1, rows // width), nw, 4096)
                              for rows in (1024, 4096) for nw in (4, 8)})  # fmt: skip
            mask_bytes = 0 if causal else b * tk * 4
            yield from _fwd_bwd_cases(
                "softmax", shape, dtype, (2 * n * s + mask_bytes, 3 * n * s), make_args,
                pallas, xla, configs, _softmax_torch(shape, dtype), n_diff=1,
            )  # fmt: skip


def _softmax_torch(shape, dtype):
    torch = _torch()
    if torch is None:
        return None
    tdtype = torch.float32 if dtype == jnp.float32 else torch.bfloat16

    def fwd():
        x = torch.randn(shape, device="cuda", dtype=tdtype)
        return lambda: torch.softmax(x, -1)  # torch's fused op; no mask (it has none in-op)

    def bwd():
        y = torch.softmax(torch.randn(shape, device="cuda", dtype=tdtype), -1)
        dy = torch.randn_like(y)
        return lambda: torch._softmax_backward_data(dy, y, -1, tdtype)

    return fwd, bwd


def norm_cases(shapes=LN_SHAPES, dtypes=DTYPES) -> Iterator[Case]:
    """The layer_norm family: LayerNorm rows, then RMSNorm rows (the Llama norm: gamma only) on
    the same shapes and tilings, with the same minimal bytes (read x, write y; read x and dy,
    write dx), gamma (and dgamma partials) aside."""
    for rms in (False, True):
        yield from _norm_cases(rms, shapes, dtypes)


def _norm_cases(rms: bool, shapes, dtypes) -> Iterator[Case]:
    kernel = "rms_norm" if rms else "layer_norm"
    for shape in shapes:
        for dtype in dtypes:
            n_rows, d = shape
            s = jnp.dtype(dtype).itemsize

            def make_args(seed=0, shape=shape, dtype=dtype, d=d):
                k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
                x = jax.random.normal(k1, shape, jnp.float32).astype(dtype)
                gamma = 1 + 0.1 * jax.random.normal(k2, (d,), jnp.float32)
                beta = 0.1 * jax.random.normal(k3, (d,), jnp.float32)
                return (x, gamma) if rms else (x, gamma, beta)

            def pallas(cfg):
                if rms:
                    return lambda x, g: rms_norm(x, g, config=cfg)
                return lambda x, g, b: layer_norm(x, g, b, config=cfg)

            width = 1 << (d - 1).bit_length()
            tiles = (
                (2048, 4, 528, 1),
                (2048, 4, 1056, 1),
                (2048, 4, 528, 3),
                (8192, 8, 528, 1),
                (8192, 8, 528, 3),
                (8192, 16, 528, 3),
            )  # (elements, warps, programs, stages)
            configs = sorted({LayerNormConfig(max(1, e // width), nw, p, st)
                              for e, nw, p, st in tiles})  # fmt: skip
            yield from _fwd_bwd_cases(
                kernel, shape, dtype, (2 * n_rows * d * s, 3 * n_rows * d * s), make_args,
                pallas, rms_norm_ref if rms else layer_norm_ref, configs,
                _norm_torch(shape, dtype, rms), n_diff=2 if rms else 3,
            )  # fmt: skip


def _norm_torch(shape, dtype, rms: bool):
    torch = _torch()
    if torch is None or (rms and not hasattr(torch.nn.functional, "rms_norm")):
        return None
    tdtype = torch.float32 if dtype == jnp.float32 else torch.bfloat16
    d = shape[1]

    def inputs():
        x = torch.randn(shape, device="cuda", dtype=tdtype)
        return x, torch.ones(d, device="cuda"), torch.zeros(d, device="cuda")

    def fwd():
        x, g, b = inputs()
        if rms:
            return lambda: torch.nn.functional.rms_norm(x, (d,), g.to(tdtype), 1e-5)
        return lambda: torch.nn.functional.layer_norm(x, (d,), g.to(tdtype), b.to(tdtype))

    def bwd():
        x, g, b = inputs()
        g, b = g.to(tdtype), b.to(tdtype)
        dy = torch.randn_like(x)
        if rms:  # what autograd runs for F.rms_norm (fused or composite, by torch version)
            x.requires_grad_(True)
            g.requires_grad_(True)
            y = torch.nn.functional.rms_norm(x, (d,), g, 1e-5)
            return lambda: torch.autograd.grad(y, (x, g), dy, retain_graph=True)
        _, mean, rstd = torch.ops.aten.native_layer_norm(x, [d], g, b, 1e-5)
        mask = [True, True, True]
        return lambda: torch.ops.aten.native_layer_norm_backward(dy, x, [d], mean, rstd, g, b, mask)

    return fwd, bwd


# ----------------------------------------------------------------------------- conv1d
# The CS229S course shapes (project 0, part 3): B = 1, K = 3. The course pads two zeros on each
# side, which is mode 'full' (L + 2 outputs); that output cannot feed the next call, so 'full' is
# timed as a `timing.live_chain` (benchmarks/conv1d_course.py). The chained cases below, which
# `profile.py kernels` runs, use mode 'same' (L outputs; flops.kernel_cost assumes it) on the
# same shapes: the same kernels, two output rows fewer.


def conv_bytes(shape: tuple, k_size: int, dtype, mode: str) -> tuple[int, int]:
    """Minimal (forward, backward) bytes: read u, write out; read u and g, write du."""
    n_b, n_l, n_d = shape
    n_o = conv1d_output_length(n_l, k_size, mode)
    s = jnp.dtype(dtype).itemsize
    return (n_l + n_o) * n_b * n_d * s, (2 * n_l + n_o) * n_b * n_d * s


def conv_inputs(shape: tuple, k_size: int, dtype, seed: int = 0) -> tuple[jax.Array, ...]:
    """u ~ N(0, 1); positive taps summing to 1 (chained calls average: never blow up or vanish);
    a small bias."""
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    u = jax.random.normal(k1, shape, jnp.float32).astype(dtype)
    w = jax.nn.softmax(jax.random.normal(k2, (shape[2], k_size)), -1).astype(dtype)
    b = (0.01 * jax.random.normal(k3, (shape[2],))).astype(dtype)
    return u, w, b


def conv_sweep(shape: tuple, dtype, backward: bool) -> list[ConvConfig]:
    """Tilings around the default, most promising first: more threads on the same channel block
    (fewer elements and registers per thread: 16-bit tilings hold 8 per thread), more rows per
    step (loads in flight), more or fewer programs (strip length), Triton pipelining, half or
    double the channel block."""
    base = conv_default_config(shape, dtype, backward=backward)
    programs = base.bwd_programs
    out = [
        base._replace(num_warps=2 * base.num_warps),
        base._replace(num_warps=4 * base.num_warps),
        base._replace(block_t=8),
        base._replace(bwd_programs=2 * programs, fwd_programs=2 * programs),
        base._replace(num_stages=3),
        base._replace(block_d=base.block_d // 2, num_warps=max(1, base.num_warps // 2)),
        base._replace(bwd_programs=programs // 2, fwd_programs=programs // 2, block_t=8),
        base._replace(block_d=2 * base.block_d, num_warps=min(8, 2 * base.num_warps)),
        base._replace(block_t=2, bwd_programs=2 * programs, fwd_programs=2 * programs),
    ]
    widest = max(32, pl.next_power_of_2(shape[2]))  # wider blocks would only mask lanes
    fits = [c for c in out if 32 <= c.block_d <= widest and c.num_warps * 32 <= c.block_d]
    return list(dict.fromkeys(c for c in fits if c != base))


def conv_torch(shape: tuple, k_size: int, dtype, mode: str = "full"):
    """(forward, backward) builders for PyTorch's `nn.Conv1d(D, D, K, padding, groups=D)`, or None
    (no CUDA torch, or a mode torch's symmetric padding cannot express).

    torch's Conv1d wants channels first, (B, D, L): its inputs are made in that layout, so no
    transpose is timed. 'causal' runs padding K - 1 and keeps the first L outputs (a view). The
    backward is the op autograd calls for it, `aten.convolution_backward` (du, dw, db).
    """
    torch = _torch()
    left, right = conv1d_padding(k_size, mode)
    if torch is None or (left != right and mode != "causal"):
        return None
    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        jnp.dtype(dtype).name
    ]
    n_b, n_l, n_d = shape
    keep = conv1d_output_length(n_l, k_size, mode)

    def module_and_input():
        conv = torch.nn.Conv1d(
            n_d, n_d, k_size, padding=left, groups=n_d, device="cuda", dtype=tdtype
        )
        return conv, torch.randn(n_b, n_d, n_l, device="cuda", dtype=tdtype)

    def fwd():
        conv, u = module_and_input()

        def call():
            with torch.no_grad():
                return conv(u)[..., :keep]

        return call

    def bwd():
        conv, u = module_and_input()
        g = torch.randn(n_b, n_d, n_l + 2 * left - k_size + 1, device="cuda", dtype=tdtype)
        mask = [True, True, True]
        return lambda: torch.ops.aten.convolution_backward(
            g, u, conv.weight, [n_d], [1], [left], [1], False, [0], n_d, mask
        )

    return fwd, bwd


CONV_MODE = "same"  # the bench chains out -> u, so the conv must keep L outputs


def conv_cases(shapes=CONV_SHAPES, dtypes=CONV_DTYPES) -> Iterator[Case]:
    """Chained cases (output -> next input) in CONV_MODE ('full' is timed with
    timing.live_chain: benchmarks/conv1d_course.py)."""
    mode = CONV_MODE
    for shape, k_size in shapes:
        for dtype in dtypes:

            def make_args(seed=0, shape=shape, dtype=dtype, k_size=k_size):
                return conv_inputs(shape, k_size, dtype, seed)

            def pallas(cfg, mode=mode):
                return lambda u, w, b: depthwise_conv1d(u, w, b, mode, config=cfg)

            def xla(u, w, b, mode=mode):
                return depthwise_conv1d_ref(u, w, b, mode)

            fwd, bwd = _fwd_bwd_cases(
                "conv1d", shape + (k_size,), dtype, conv_bytes(shape, k_size, dtype, mode),
                make_args, pallas, xla, conv_sweep(shape, dtype, backward=False),
                conv_torch(shape, k_size, dtype, mode), array_shape=shape,
            )  # fmt: skip
            yield fwd
            yield dataclasses.replace(bwd, configs=conv_sweep(shape, dtype, backward=True))


def _time_impl(case: Case, impl) -> tuple[float, jax.Array]:
    states = case.states(impl)
    seconds = chained_median_seconds(case.step(impl), states)
    first = case.step(impl)(case.states(impl)[0])  # one call on fresh inputs, for the error
    return seconds, case.output(first)


def run_case(case: Case, copy_gbps: float, tune: bool) -> Row:
    xla_s, ref = _time_impl(case, case.xla)
    default_s, out = _time_impl(case, case.pallas(None))
    best_s, best_cfg = default_s, "default"
    for cfg in case.configs if tune else []:
        try:
            sec, _ = _time_impl(case, case.pallas(cfg))
        except Exception as e:  # a config the compiler rejects (e.g. too many registers)
            print(f"# {case.kernel} {case.direction} {cfg}: {type(e).__name__}: {e}"[:300])
            continue
        if sec < best_s:
            best_s, best_cfg = sec, str(tuple(cfg))
    torch_ms = None
    if case.torch is not None:
        torch_ms = torch_median_seconds(case.torch()) * 1e3
        _torch().cuda.empty_cache()
    gbps = case.bytes / best_s / 1e9
    streams_s = streams_seconds(case.array_shape, case.dtype, *case.streams)
    return Row(case.kernel, case.direction, "x".join(map(str, case.shape)),
               jnp.dtype(case.dtype).name, best_cfg, best_s * 1e3, gbps, 100 * gbps / copy_gbps,
               streams_s * 1e3, default_s * 1e3, xla_s * 1e3, torch_ms,
               _rel_err(out, ref))  # fmt: skip


HEADER = (
    "| kernel | dir | shape | dtype | best config | ms | GB/s | % copy | % streams | default ms "
    "| XLA ms | x XLA | torch ms | x torch | rel err vs XLA |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def format_row(r: Row) -> str:
    torch = "- | -" if r.torch_ms is None else f"{r.torch_ms:.3f} | {r.torch_ms / r.ms:.2f}"
    return (
        f"| {r.kernel} | {r.direction} | {r.shape} | {r.dtype} | {r.config} | {r.ms:.3f} "
        f"| {r.gbps:.0f} | {r.pct_copy:.0f} | {100 * r.streams_ms / r.ms:.0f} "
        f"| {r.default_ms:.3f} | {r.xla_ms:.3f} "
        f"| {r.xla_ms / r.ms:.2f} | {torch} | {r.rel_err:.1e} |"
    )


def run(kernels: list[str], tune: bool, jsonl_path: str | None = None) -> list[Row]:
    """Print the copy bandwidth, then one table row per case as it finishes."""
    bw = copy_bandwidth()
    copy_gbps = bw.get("torch_copy", bw["jax_negate"])
    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}")
    print("copy bandwidth GB/s: " + ", ".join(f"{k} {v:.0f}" for k, v in bw.items()))
    print(HEADER, flush=True)
    makers = {"softmax": softmax_cases, "layer_norm": norm_cases, "conv1d": conv_cases}
    rows = []
    for name in kernels:
        for case in makers[name]():
            row = run_case(case, copy_gbps, tune)
            rows.append(row)
            print(format_row(row), flush=True)
            append_jsonl(jsonl_path, [dataclasses.asdict(row)])
    return rows
