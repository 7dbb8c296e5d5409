"""Mosaic GPU vs Triton vs XLA for the Pallas kernels: correctness and device time, side by side.

    PYTHONPATH=$PWD python3 benchmarks/mosaic_gpu_check.py --jsonl $OUT/mgpu.jsonl          # GPU
    PYTHONPATH=$PWD python3 benchmarks/mosaic_gpu_check.py --quick --jsonl $OUT/mgpu.jsonl  # 90 s
    ... --only layer_norm,conv1d                                       # a subset of the kernels

For every kernel x shape x dtype (float32, bfloat16) x direction and every implementation:
pallas_kernels with backend="triton" and backend="mosaic_gpu" (their default configs), and XLA (jit
of the jnp reference in pallas_kernels/reference.py; its jax.vjp for the backward):
  * max error against a float64 NumPy reference on the same random inputs, relative to the largest
    reference value of each output (max over the outputs: y; dx and the parameter gradients);
    "!" marks an error above TOL. Softmax shapes of more than CHECK_ROWS rows are checked on their
    first CHECK_ROWS rows (rows are independent).
  * median device ms (jaxllm/profiling/timing.py; `--clock trace`: summed kernel durations from a
    profiler trace, for rows whose calls last a few microseconds): layer norm and softmax chain
    each call's output into the next call's input (chained_median_seconds; backward rows time
    the VJP function alone, residuals computed beforehand, as profile.py kernels); the conv runs
    the course's padding, mode 'full' (L + K - 1 outputs cannot feed the next call), with
    live_chain_seconds, the backward being (u, w, b, g) -> (du, dw, db) through jax.vjp (its
    forward output is dead).
  * GB/s over the minimal bytes (each input read once, each output written once; the module
    docstrings) and its % of the device copy bandwidth measured in the same run.
A compile or runtime failure of one cell prints its exception type and the first 15 lines of its
message (the whole traceback with MOSAIC_CHECK_TRACEBACK=1), is recorded in the JSON line, and the
script goes on. One Markdown table on stdout (a row
per kernel x shape x dtype x direction, printed as it finishes), one JSON line per row to --jsonl.
Shapes: `profile.py kernels`'s tables (jaxllm/profiling/kernel_bench.py), ragged row counts (the
copy engine's clamping of a last partial block), the CS229S conv course shapes (B = 1, L in {1024,
8192}, D in {768, 8192}, K = 3).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch

from jaxllm.xla_flags import apply_default_xla_flags  # noqa: E402

apply_default_xla_flags()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxllm.profiling import kernel_bench as kb  # noqa: E402
from jaxllm.profiling.harness import append_jsonl  # noqa: E402
from jaxllm.profiling.timing import (  # noqa: E402
    CLOCKS,
    chained_median_seconds,
    live_chain_seconds,
    rotation_count,
)
from pallas_kernels import (  # noqa: E402
    add_layer_norm,
    add_layer_norm_ref,
    attention_softmax,
    attention_softmax_ref,
    depthwise_conv1d,
    depthwise_conv1d_ref,
    layer_norm,
    layer_norm_ref,
)
from pallas_kernels.reference import conv1d_padding  # noqa: E402

IMPLS = ("triton", "mosaic_gpu", "xla")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
TOL = {"float32": 1e-4, "bfloat16": 3e-2}  # max error relative to the largest reference value
CHECK_ROWS = 4096
EPS = 1e-5
K = 3  # conv taps (the course's)

LN_SHAPES = [*kb.LN_SHAPES, (1000, 768), (37, 8192)]  # + ragged last blocks
LN_QUICK = [(1000, 1024)]  # --quick: small shapes with ragged blocks, bfloat16 by default
ADD_LN_SHAPES = [(16384, 768), (1000, 1024), (4096, 8192)]
ADD_LN_QUICK = [(1000, 1024)]
SOFTMAX_SHAPES = [*kb.SOFTMAX_SHAPES, ((2, 4, 100, 256), "causal"), ((1, 2, 8, 8192), "qmask")]
SOFTMAX_QUICK = [((2, 4, 100, 256), "causal")]
CONV_SHAPES = [(1, n_l, n_d) for n_l in (1024, 8192) for n_d in (768, 8192)] + [(2, 1000, 384)]
CONV_QUICK = [(2, 1000, 384)]


@dataclasses.dataclass
class Row:
    kernel: str
    shape: str
    dtype: str
    direction: str
    bytes: int
    err: dict = dataclasses.field(default_factory=dict)  # impl -> max relative error
    ms: dict = dataclasses.field(default_factory=dict)  # impl -> median device ms
    failures: dict = dataclasses.field(default_factory=dict)  # impl -> exception text


@dataclasses.dataclass
class Case:
    """One kernel x shape x dtype: how to call each implementation and what to compare."""

    kernel: str
    shape: tuple
    dtype: str
    nbytes: tuple[int, int]  # minimal (forward, backward) bytes
    make_args: Callable[[int], tuple]  # seed -> arguments (differentiated ones first)
    n_diff: int  # leading arguments the backward differentiates
    impl: Callable[[str], Callable]  # "triton" / "mosaic_gpu" / "xla" -> function of the args
    ref_fwd: Callable[..., list]  # float64 NumPy arrays -> outputs
    ref_bwd: Callable[..., list]  # float64 NumPy arrays, cotangents -> gradients
    chained: bool = True  # output[0] can be the next call's first argument
    check_rows: int | None = None  # compare only the first rows (row-independent kernels)


def failure_text(exc: BaseException, lines: int = 15) -> str:
    """Exception type and the first lines of its message."""
    text = f"{type(exc).__name__}: {exc}"
    return "\n".join(text.splitlines()[:lines])


# ----------------------------------------------------------------------------- float64 references
def ln_f64(x, g, b):
    mean = x.mean(-1, keepdims=True)
    rstd = 1 / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + EPS)
    return (x - mean) * rstd * g + b, (x - mean) * rstd, rstd


def ln_bwd_f64(x, g, b, dy):
    _, xhat, rstd = ln_f64(x, g, b)
    gdy = g * dy
    dx = (gdy - gdy.mean(-1, keepdims=True) - xhat * (gdy * xhat).mean(-1, keepdims=True)) * rstd
    return dx, (dy * xhat).sum(0), dy.sum(0)


def softmax_f64(x, mask, causal, scale):
    z = x * scale + (0 if mask is None else mask)
    if causal:
        tq, tk = z.shape[-2:]
        allowed = np.arange(tk)[None, :] <= np.arange(tq)[:, None] + (tk - tq)
        z = np.where(allowed, z, -np.inf)
    m = z.max(-1, keepdims=True)
    e = np.exp(z - np.where(np.isneginf(m), 0, m))
    s = e.sum(-1, keepdims=True)
    return e / np.where(s > 0, s, 1)


def conv_f64(u, w, b, mode):
    left, right = conv1d_padding(w.shape[1], mode)
    up = np.pad(u, ((0, 0), (left, right), (0, 0)))
    n_out = up.shape[1] - w.shape[1] + 1
    return b + sum(up[:, k : k + n_out] * w[:, k] for k in range(w.shape[1]))


def conv_bwd_f64(u, w, b, g, mode):
    left, right = conv1d_padding(w.shape[1], mode)
    up = np.pad(u, ((0, 0), (left, right), (0, 0)))
    dup = np.zeros_like(up)
    n_out = g.shape[1]
    dw = np.empty(w.shape)
    for k in range(w.shape[1]):
        dup[:, k : k + n_out] += g * w[:, k]
        dw[:, k] = np.einsum("btd,btd->d", g, up[:, k : k + n_out])
    return dup[:, left : left + u.shape[1]], dw, g.sum((0, 1))


# ----------------------------------------------------------------------------- cases
def _normal(key, shape, dtype, scale=1.0):
    return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def layer_norm_case(shape, dtype: str) -> Case:
    n, d = shape
    s = jnp.dtype(dtype).itemsize

    def make_args(seed):
        k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
        return (_normal(k1, shape, dtype), 1 + _normal(k2, (d,), jnp.float32, 0.1),
                _normal(k3, (d,), jnp.float32, 0.1))  # fmt: skip

    def impl(name):
        if name == "xla":
            return lambda x, g, b: layer_norm_ref(x, g, b, EPS)
        return lambda x, g, b: layer_norm(x, g, b, EPS, backend=name)

    return Case("layer_norm", shape, dtype, (2 * n * d * s, 3 * n * d * s), make_args, 3, impl,
                lambda x, g, b: [ln_f64(x, g, b)[0]],
                lambda x, g, b, dy: list(ln_bwd_f64(x, g, b, dy)))  # fmt: skip


def add_layer_norm_case(shape, dtype: str) -> Case:
    n, d = shape
    s = jnp.dtype(dtype).itemsize

    def make_args(seed):
        k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
        x, h = _normal(k1, shape, dtype), _normal(k4, shape, dtype)
        return x, h, 1 + _normal(k2, (d,), jnp.float32, 0.1), _normal(k3, (d,), jnp.float32, 0.1)

    def impl(name):
        if name == "xla":
            return lambda x, h, g, b: add_layer_norm_ref(x, h, g, b, EPS)
        return lambda x, h, g, b: add_layer_norm(x, h, g, b, EPS, backend=name)

    def ref_fwd(x, h, g, b):
        return [x + h, ln_f64(x + h, g, b)[0]]

    def ref_bwd(x, h, g, b, ds, dy):
        dx, dg, db = ln_bwd_f64(x + h, g, b, dy)
        return [dx + ds, dx + ds, dg, db]

    return Case("add_layer_norm", shape, dtype, (4 * n * d * s, 5 * n * d * s), make_args, 4,
                impl, ref_fwd, ref_bwd)  # fmt: skip


def softmax_case(spec, dtype: str) -> Case:
    shape, kind = spec
    b, _, tq, tk = shape
    n = int(np.prod(shape))
    s = jnp.dtype(dtype).itemsize
    causal = kind == "causal"
    scale = 1.0 / np.sqrt(64)

    def make_args(seed):
        k1, k2 = jax.random.split(jax.random.key(seed))
        x = _normal(k1, shape, dtype, 2.0)
        if kind == "keypad":  # (B, 1, 1, Tk) key padding: -inf past a random length per batch
            lens = jax.random.randint(k2, (b,), tk // 2, tk + 1)
            return x, jnp.where(jnp.arange(tk) < lens[:, None], 0.0, -jnp.inf)[:, None, None, :]
        if kind == "qmask":  # (B, 1, Tq, Tk) additive float mask
            return x, _normal(k2, (b, 1, tq, tk), jnp.float32)
        return (x,)

    def impl(name):
        if name == "xla":
            return lambda x, m=None: attention_softmax_ref(x, m, causal=causal, scale=scale)
        return lambda x, m=None: attention_softmax(x, m, causal=causal, scale=scale, backend=name)

    heads = max(1, min(shape[1], CHECK_ROWS // tq))  # checked: batch 0, the first heads

    def first(a):
        return None if a is None else a[:1, :heads] if a.shape[1] > 1 else a[:1]

    def ref_fwd(x, m=None):
        return [softmax_f64(first(x), first(m), causal, scale).reshape(-1, tk)]

    def ref_bwd(x, *rest):
        m, dy = (None, rest[0]) if len(rest) == 1 else rest
        y = softmax_f64(first(x), first(m), causal, scale)
        dy = first(dy)
        return [(scale * y * (dy - (y * dy).sum(-1, keepdims=True))).reshape(-1, tk)]

    mask_bytes = 0 if kind == "causal" else (b * tk * 4 if kind == "keypad" else b * tq * tk * 4)
    return Case("softmax", shape + (kind,), dtype, (2 * n * s + mask_bytes, 3 * n * s),
                make_args, 1, impl, ref_fwd, ref_bwd, check_rows=heads * tq)  # fmt: skip


def conv_case(shape, dtype: str) -> Case:
    bsz, n_l, n_d = shape
    s = jnp.dtype(dtype).itemsize
    n_o = n_l + K - 1

    def make_args(seed):
        return kb.conv_inputs(shape, K, DTYPES[dtype], seed)

    def impl(name):
        if name == "xla":
            return lambda u, w, b: depthwise_conv1d_ref(u, w, b, "full")
        return lambda u, w, b: depthwise_conv1d(u, w, b, "full", backend=name)

    return Case("conv1d", shape + (K,), dtype,
                ((n_l + n_o) * bsz * n_d * s, (2 * n_l + n_o) * bsz * n_d * s), make_args, 3,
                impl, lambda u, w, b: [conv_f64(u, w, b, "full")],
                lambda u, w, b, g: list(conv_bwd_f64(u, w, b, g, "full")),
                chained=False)  # fmt: skip


# ----------------------------------------------------------------------------- checking, timing
def _as_list(out) -> list:
    return list(out) if isinstance(out, tuple | list) else [out]


def _f64(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def _max_err(got: list, ref: list, rows: int | None) -> float:
    """Max over outputs of max |got - ref| / max |ref| (first `rows` rows of row outputs)."""
    worst = 0.0
    for g, r in zip(got, ref, strict=True):
        g = _f64(g)
        if rows is not None:
            g = g.reshape(-1, g.shape[-1])[:rows]
        worst = max(worst, float(np.abs(g - r).max() / max(np.abs(r).max(), 1e-30)))
    return worst


def _cotangents(case: Case, outs: list, seed: int = 100) -> tuple:
    keys = jax.random.split(jax.random.key(seed), len(outs))
    return tuple(_normal(k, o.shape, o.dtype) for k, o in zip(keys, outs, strict=True))


def check(case: Case, name: str, direction: str) -> float:
    """Max error of one implementation against float64 NumPy on the seed-0 inputs."""
    args = case.make_args(0)
    fn = case.impl(name)
    outs = _as_list(jax.jit(fn)(*args))
    args64 = [_f64(a) for a in args]
    if direction == "fwd":
        return _max_err(outs, case.ref_fwd(*args64), case.check_rows)
    cts = _cotangents(case, outs)
    diff, held = args[: case.n_diff], args[case.n_diff :]

    def grads(*a):
        out, vjp = jax.vjp(lambda *d: fn(*d, *held), *a[: case.n_diff])
        return vjp(a[case.n_diff :] if isinstance(out, tuple) else a[case.n_diff])

    got = jax.jit(grads)(*diff, *cts)
    ref = case.ref_bwd(*args64, *[_f64(c) for c in cts])
    rows = case.check_rows
    if case.kernel == "softmax":  # only dx (the mask gets no gradient)
        got = got[:1]
    return _max_err(got, ref, rows)


def time_ms(case: Case, name: str, direction: str, reps: dict) -> float:
    """Median device ms per call (module docstring)."""
    fn = case.impl(name)
    nbytes = case.nbytes[direction == "bwd"]
    seeds = range(rotation_count(nbytes))
    if not case.chained:  # conv 'full': live_chain_seconds over rotated argument sets
        if direction == "fwd":
            return 1e3 * live_chain_seconds(fn, [case.make_args(s) for s in seeds], **reps)

        def fwd_bwd(*a):
            out, vjp = jax.vjp(fn, *a[:-1])
            return vjp(a[-1])

        sets = []
        for seed in seeds:
            args = case.make_args(seed)
            sets.append((*args, *_cotangents(case, _as_list(jax.eval_shape(fn, *args)), seed)))
        return 1e3 * live_chain_seconds(fwd_bwd, sets, **reps)
    if direction == "fwd":

        def step(args):
            return (_as_list(fn(*args))[0], *args[1:])  # output 0 has the first input's type

        return 1e3 * chained_median_seconds(step, [case.make_args(s) for s in seeds], **reps)
    states = []
    for seed in seeds:  # residuals computed here, outside the timed step
        args = case.make_args(seed)
        held = args[case.n_diff :]
        out, vjp = jax.vjp(lambda *d, held=held: fn(*d, *held), *args[: case.n_diff])
        states.append((vjp, _cotangents(case, _as_list(out), seed), jnp.zeros((), jnp.float32)))

    def bwd_step(state):
        vjp, cts, acc = state
        grads = vjp(cts if len(cts) > 1 else cts[0])
        extra = sum(jnp.sum(g.astype(jnp.float32)) for g in grads[1:] if g is not None)
        return vjp, (grads[0].astype(cts[0].dtype), *cts[1:]), acc + extra  # dx -> next cotangent

    return 1e3 * chained_median_seconds(bwd_step, states, **reps)


HEADER = (
    "| kernel | shape | dtype | dir | err triton | err mosaic | err xla | triton ms | mosaic ms "
    "| xla ms | triton GB/s (% copy) | mosaic GB/s (% copy) | mosaic / triton |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def format_row(row: Row, copy_gbps: float) -> str:
    def err(name):
        if name in row.failures and name not in row.err:
            return "FAIL"
        e = row.err.get(name)
        return "-" if e is None else f"{e:.1e}{'!' if e > TOL[row.dtype] else ''}"

    def ms(name):
        v = row.ms.get(name)
        return ("FAIL" if name in row.failures else "-") if v is None else f"{v:.3f}"

    def bw(name):
        v = row.ms.get(name)
        if v is None:
            return "-"
        gbps = row.bytes / (v * 1e-3) / 1e9
        return f"{gbps:.0f} ({100 * gbps / copy_gbps:.0f})"

    t, m = row.ms.get("triton"), row.ms.get("mosaic_gpu")
    ratio = f"{m / t:.2f}" if t and m else "-"
    return (
        f"| {row.kernel} | {row.shape} | {row.dtype} | {row.direction} | {err('triton')} "
        f"| {err('mosaic_gpu')} | {err('xla')} | {ms('triton')} | {ms('mosaic_gpu')} | {ms('xla')} "
        f"| {bw('triton')} | {bw('mosaic_gpu')} | {ratio} |"
    )


def run_case(case: Case, direction: str, reps: dict) -> Row:
    shape = "x".join(map(str, case.shape))
    row = Row(case.kernel, shape, case.dtype, direction, case.nbytes[direction == "bwd"])
    for name in IMPLS:
        for what, fn in (("err", check), ("ms", time_ms)):
            if name in row.failures:
                break
            try:
                value = (
                    fn(case, name, direction, reps) if what == "ms" else fn(case, name, direction)
                )
                getattr(row, what)[name] = value
            except Exception as exc:  # one cell's failure must not stop the run
                row.failures[name] = failure_text(exc)
                print(f"# {case.kernel} {shape} {case.dtype} {direction} {name} ({what}): "
                      f"{row.failures[name]}", flush=True)  # fmt: skip
                if os.environ.get("MOSAIC_CHECK_TRACEBACK"):
                    traceback.print_exc()
    return row


MAKERS = {
    "layer_norm": (layer_norm_case, LN_SHAPES, LN_QUICK),
    "add_layer_norm": (add_layer_norm_case, ADD_LN_SHAPES, ADD_LN_QUICK),
    "softmax": (softmax_case, SOFTMAX_SHAPES, SOFTMAX_QUICK),
    "conv1d": (conv_case, CONV_SHAPES, CONV_QUICK),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(MAKERS), help="comma-separated kernels")
    parser.add_argument("--quick", action="store_true", help="few shapes and repetitions")
    parser.add_argument(
        "--dtypes", help="comma-separated; default float32,bfloat16 (--quick: bfloat16)"
    )
    parser.add_argument("--jsonl", help="append one JSON line per table row here")
    parser.add_argument(
        "--clock", choices=CLOCKS, default="wall",
        help="trace: the GPU's kernel durations from a profiler trace (calls of a few us)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.clock == "trace" and jax.default_backend() != "gpu":
        parser.error(f"--clock trace times GPU kernels; this backend is {jax.default_backend()}")
    kernels = [k for k in args.only.split(",") if k]
    unknown = set(kernels) - set(MAKERS)
    if unknown:
        parser.error(f"unknown kernels {sorted(unknown)}; choose from {list(MAKERS)}")
    dtypes = (args.dtypes or ("bfloat16" if args.quick else "float32,bfloat16")).split(",")
    if bad := sorted(set(dtypes) - set(DTYPES)):
        parser.error(f"--dtypes: unknown {bad}; allowed {list(DTYPES)}")
    reps = (dict(calls=4, launches=2, repeats=3) if args.quick
            else dict(calls=16, launches=4, repeats=5))  # fmt: skip
    reps["clock"] = args.clock
    start = time.perf_counter()
    bw = kb.copy_bandwidth()
    copy_gbps = bw.get("torch_copy", bw["jax_negate"])
    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}; clock {args.clock}; "
          f"copy GB/s: " + ", ".join(f"{k} {v:.0f}" for k, v in bw.items()))  # fmt: skip
    print(HEADER, flush=True)
    for kernel in kernels:
        make, shapes, quick = MAKERS[kernel]
        for shape in quick if args.quick else shapes:
            for dtype in dtypes:
                case = make(shape, dtype)
                for direction in ("fwd", "bwd"):
                    row = run_case(case, direction, reps)
                    print(format_row(row, copy_gbps), flush=True)
                    record: dict[str, Any] = dataclasses.asdict(row)
                    record.update(copy_gbps=copy_gbps, jax=jax.__version__)
                    append_jsonl(args.jsonl, [record])
    print(f"# done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
