"""Depthwise conv1d at the CS229S course shapes: Pallas vs XLA vs PyTorch, forward and backward.

    PYTHONPATH=$PWD python3 benchmarks/conv1d_course.py --jsonl conv.jsonl     # GPU, < 4 min
    python benchmarks/conv1d_course.py --interpret --smoke                     # CPU, tiny shapes

Shapes: B = 1, L in {1024, 2048, 4096, 8192}, D in {768, 1024, 2048, 8192}, K = 3, the course's
padding of two zeros on each side (mode 'full': L + 2 outputs); float16, bfloat16, float32.
For every shape x dtype x direction:
  * max error of the Pallas kernel (default config; the outputs of its own timed executable on
    the first input set) against float64 NumPy on the same inputs: out / du absolute, dw and db
    relative to max |ref|; "ok" applies the tolerances in TOL (float16: the course's atol 1e-2);
  * median device ms of: Pallas with its default config and a sweep of tilings around it
    (kernel_bench.conv_sweep, up to --sweep per row, best ms and config reported; the corners
    of the L x D grid run first and get the sweep first, later rows sweep what --budget leaves
    after reserving the default/XLA/torch timing of all rows); XLA = jit of the jnp reference
    (its jax.vjp for the backward);
    PyTorch nn.Conv1d(D, D, 3, padding=2, groups=D) forward under no_grad, backward =
    aten.convolution_backward (du, dw, db; what autograd calls). torch takes channels first,
    (B, D, L): its inputs are made in that layout, no transpose is timed. Ours and XLA's are
    (B, L, D).
  * --mosaic: also the Mosaic GPU lowering (backend="mosaic_gpu", its default tiling), timed and
    checked against float64 the same way;
  * x XLA = XLA ms / Pallas ms; % copy = minimal bytes / ms / copy bandwidth (measured in the
    same run: torch copy_ of 1 GiB, else jax negate), bytes = read u + write out (forward),
    read u, g + write du (backward); % same-size copy = the time of a negation moving the row's
    bytes (half read, half written; timed like the kernels) / the kernel's time: the copy bound
    at this size, launch and tail latency included.
Timing: one profiling.timing.live_chain executable per implementation (16 calls on rotated
inputs, every output kept live; 'full' output cannot feed the next call), sampled with
profiling.timing.interleaved_samples: 11 rounds, each one sample of XLA, Pallas (and the
others) in turn, each sample >= 5 ms of device work; ms = median, `spread_pct` = (max - min) /
min of a version's own samples (its run-to-run noise), `xla_ratio_rounds` = XLA / Pallas per
round. A row under 1.0x XLA by less than both versions' spread is reported as within noise.
`--clock trace`: each sample is the GPU's kernel time from a profiler trace, not the wall clock
(which dispatch bounds for calls of a few us; jaxllm/profiling/timing.py).
Backward rows time (u, w, b, g) -> (du, dw, db) with jax.vjp inside the timed function, for
Pallas and XLA alike; its forward output is unused and XLA drops it. All executables of one
shape x dtype are built (lowered in turn, XLA-compiled in parallel threads) before any of them
is timed: nothing compiles meanwhile.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch

from jaxllm.xla_flags import apply_default_xla_flags  # noqa: E402

apply_default_xla_flags()

import argparse  # noqa: E402
import concurrent.futures as cf  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxllm.profiling import kernel_bench as kb  # noqa: E402
from jaxllm.profiling.harness import append_jsonl  # noqa: E402
from jaxllm.profiling.timing import (  # noqa: E402
    CLOCKS,
    chained_median_seconds,
    interleaved_samples,
    live_chain,
    rotation_count,
    torch_median_seconds,
)
from pallas_kernels import depthwise_conv1d, depthwise_conv1d_ref  # noqa: E402
from pallas_kernels.depthwise_conv1d import Config, default_config  # noqa: E402

MODE, K = "full", 3
LENGTHS, CHANNELS = (1024, 2048, 4096, 8192), (768, 1024, 2048, 8192)
SMOKE_LENGTHS, SMOKE_CHANNELS = (37,), (24,)
DTYPES = {"float16": jnp.float16, "bfloat16": jnp.bfloat16, "float32": jnp.float32}
# (out / du: atol, rtol; dw / db: max error relative to max |ref|) against float64
TOL = {"float16": (1e-2, 0.0, 2e-3), "bfloat16": (1e-2, 8e-3, 1e-2), "float32": (1e-5, 1e-5, 1e-5)}
LARGE_BYTES = 32 * 2**20  # "large shape": u alone is at least this (the % copy target)


@dataclasses.dataclass
class Result:
    shape: tuple
    dtype: str
    direction: str
    bytes: int
    default_config: str
    default_ms: float | None = None
    xla_ms: float | None = None
    torch_ms: float | None = None
    mosaic_ms: float | None = None  # --mosaic: backend="mosaic_gpu", its default tiling
    copy_ms: float | None = None  # a copy of the row's bytes (read half, write half)
    err: dict = dataclasses.field(default_factory=dict)
    ok: bool | None = None
    mosaic_err: dict = dataclasses.field(default_factory=dict)
    mosaic_ok: bool | None = None
    sweep: dict = dataclasses.field(default_factory=dict)  # config -> ms, or the error text
    notes: list = dataclasses.field(default_factory=list)
    # timing spread per timed executable: (max - min) / min of its samples, in %
    spread_pct: dict = dataclasses.field(default_factory=dict)
    xla_ratio_rounds: list = dataclasses.field(default_factory=list)  # XLA / default, per round

    def best(self) -> tuple[float | None, str]:
        timed = {c: ms for c, ms in self.sweep.items() if isinstance(ms, float)}
        if self.default_ms is not None:
            timed["default"] = self.default_ms
        if not timed:
            return None, "-"
        cfg = min(timed, key=timed.get)
        return timed[cfg], cfg


def cfg_str(cfg: Config, backward: bool) -> str:
    programs = cfg.bwd_programs if backward or cfg.fwd_programs is None else cfg.fwd_programs
    return (
        f"t{cfg.block_t} d{cfg.block_d} w{cfg.num_warps} p{programs} s{cfg.num_stages}"
        f" = {tuple(cfg)}"
    )


# ----------------------------------------------------------------------------- float64 check
def f64_reference(u, w, b, g, lo: int, hi: int) -> tuple[np.ndarray, ...]:
    """out, du, dw, db in float64 for channels [lo, hi): the definition, written out in NumPy.

    out[t] = b + sum_k w[k] up[t + k] on u zero-padded by K - 1 on both sides; du is the adjoint
    (each g[t] w[k] lands on up[t + k]); dw[k] = sum over B, t of g[t] up[t + k]; db = sum of g.
    """
    u, g = u[..., lo:hi].astype(np.float64), g[..., lo:hi].astype(np.float64)
    w, b = w[lo:hi].astype(np.float64), b[lo:hi].astype(np.float64)
    n_b, n_l, n_d = u.shape
    n_o = n_l + K - 1
    up = np.zeros((n_b, n_o + K - 1, n_d))
    up[:, K - 1 : K - 1 + n_l] = u
    out = np.broadcast_to(b, (n_b, n_o, n_d)).copy()
    dup = np.zeros_like(up)
    dw = np.empty((n_d, K))
    for k in range(K):
        out += up[:, k : k + n_o] * w[:, k]
        dup[:, k : k + n_o] += g * w[:, k]
        dw[:, k] = np.einsum("btd,btd->d", g, up[:, k : k + n_o])
    return out, dup[:, K - 1 : K - 1 + n_l], dw, g.sum(axis=(0, 1))


def max_errors(inputs, outputs, dtype: str, pool) -> tuple[dict, dict]:
    """Max errors of (out, du, dw, db) against float64 (dw, db relative to max |ref|), and
    whether each is within TOL; over chunks of 256 channels in threads."""
    u, w, b, g = (np.asarray(x) for x in inputs)
    got = [np.asarray(x) for x in outputs]
    atol, rtol, _ = TOL[dtype]

    def chunk(lo):
        hi = min(u.shape[2], lo + 256)
        ref = f64_reference(u, w, b, g, lo, hi)
        mine = (got[0][..., lo:hi], got[1][..., lo:hi], got[2][lo:hi], got[3][lo:hi])
        stats = []
        for m, r in zip(mine, ref, strict=True):
            diff = np.abs(m.astype(np.float64) - r)
            stats.append((diff.max(), np.abs(r).max(), bool(np.all(diff <= atol + rtol * abs(r)))))
        return stats

    parts = list(pool.map(chunk, range(0, u.shape[2], 256)))
    err, ok = {}, {}
    for i, name in enumerate(("out", "du", "dw", "db")):
        diff, scale = (max(float(p[i][j]) for p in parts) for j in (0, 1))
        if name in ("out", "du"):
            err[name], ok[name] = diff, all(p[i][2] for p in parts)
        else:  # sums over B and L: relative to their scale
            err[name] = diff / max(scale, 1e-30)
            ok[name] = err[name] <= TOL[dtype][2]
    return err, ok


# ----------------------------------------------------------------------------- the timed functions
def fwd_fn(impl: Callable) -> Callable:
    return impl


def bwd_fn(impl: Callable) -> Callable:
    def fn(u, w, b, g):
        return jax.vjp(impl, u, w, b)[1](g)

    return fn


def pallas_impl(cfg: Config | None, interpret: bool | None) -> Callable:
    return lambda u, w, b: depthwise_conv1d(u, w, b, MODE, interpret, config=cfg)


def mosaic_impl(u, w, b):
    return depthwise_conv1d(u, w, b, MODE, backend="mosaic_gpu")


def xla_impl(u, w, b):
    return depthwise_conv1d_ref(u, w, b, MODE)


def arg_sets(shape, dtype, backward: bool, n_sets: int) -> list[tuple]:
    sets = []
    for seed in range(n_sets):
        u, w, b = kb.conv_inputs(shape, K, dtype, seed)
        if backward:
            n_o = kb.conv1d_output_length(shape[1], K, MODE)
            g = jax.random.normal(jax.random.key(100 + seed), (shape[0], n_o, shape[2]))
            sets.append((u, w, b, g.astype(dtype)))
        else:
            sets.append((u, w, b))
    return sets


def abstract(sets: list[tuple]) -> list[tuple]:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), sets)


def compile_all(jobs: dict, calls: int, pool) -> dict:
    """name -> the compiled live chain of (fn, arg sets), or the exception. Built from shapes
    alone (no input needs to exist yet): lowered one by one here (that is where Pallas runs the
    Triton compiler), then XLA-compiled in parallel threads."""
    lowered = {}
    for name, (fn, sets) in jobs.items():
        try:
            lowered[name] = live_chain(fn, len(sets), calls).lower(abstract(sets))
        except Exception as e:  # a tiling the compiler rejects: report it, go on
            lowered[name] = e
    futures = {
        name: pool.submit(low.compile)
        for name, low in lowered.items()
        if not isinstance(low, Exception)
    }
    out = {}
    for name, low in lowered.items():
        try:
            out[name] = low if isinstance(low, Exception) else futures[name].result()
        except Exception as e:
            out[name] = e
    return out


def short(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]


# ----------------------------------------------------------------------------- one shape x dtype
def run_group(shape, dtype_name, n_sweep: int, args, pool, timing) -> list[Result]:
    """Per direction: Pallas (default config and `n_sweep` tilings of kernel_bench.conv_sweep),
    XLA and torch, every executable compiled before any is timed; then the default config's
    errors, from the outputs of its own timed executable on the first input set."""
    dtype = DTYPES[dtype_name]
    interpret = True if args.interpret else None
    results, jobs, n_sets = [], {}, {}
    for direction in args.dirs:
        backward = direction == "bwd"
        nbytes = kb.conv_bytes(shape, K, dtype, MODE)[backward]
        cfg = default_config(shape, dtype, backward=backward)
        results.append(Result(shape, dtype_name, direction, nbytes, cfg_str(cfg, backward)))
        n_sets[direction] = rotation_count(nbytes, args.max_sets)
        sets = jax.eval_shape(
            functools.partial(arg_sets, shape, dtype, backward, n_sets[direction])
        )
        wrap = bwd_fn if backward else fwd_fn
        jobs[direction, "xla"] = (wrap(xla_impl), sets)
        jobs[direction, "default"] = (wrap(pallas_impl(None, interpret)), sets)
        if args.mosaic:
            jobs[direction, "mosaic"] = (wrap(mosaic_impl), sets)
        for c in kb.conv_sweep(shape, dtype, backward)[:n_sweep]:
            jobs[direction, cfg_str(c, backward)] = (wrap(pallas_impl(c, interpret)), sets)
    runs = compile_all(jobs, args.calls, pool)
    got = {}  # the default config's outputs on input set 0: out (fwd); du, dw, db (bwd)
    got_mosaic = {}  # the same for --mosaic
    for res in results:
        backward = res.direction == "bwd"
        sets = arg_sets(shape, dtype, backward, n_sets[res.direction])
        launchers = {}
        for direction, name in jobs:
            if direction != res.direction:
                continue
            if isinstance(runs[direction, name], Exception):  # reported; a failed sweep tiling
                text = f"{res.direction} {name}: {short(runs[direction, name])}"  # keeps its error
                if name in ("xla", "default", "mosaic"):
                    res.notes.append(text)
                else:
                    res.sweep[name] = short(runs[direction, name])
                    print(f"# {res.shape} {res.dtype} {text}", flush=True)
                continue
            launchers[name] = functools.partial(runs[direction, name], sets)
        samples = interleaved_samples(launchers, **timing)
        for name, secs in samples.items():
            ms = 1e3 * statistics.median(secs)
            res.spread_pct[name] = 100 * (max(secs) - min(secs)) / min(secs)
            if name == "xla":
                res.xla_ms = ms
            elif name == "default":
                res.default_ms = ms
                first = runs[res.direction, name](sets)[0]
                got[res.direction] = jax.device_get(first if backward else (first,))
            elif name == "mosaic":
                res.mosaic_ms = ms
                first = runs[res.direction, name](sets)[0]
                got_mosaic[res.direction] = jax.device_get(first if backward else (first,))
            else:
                res.sweep[name] = ms
        if "xla" in samples and "default" in samples:  # per round: the same clocks for both
            pairs = zip(samples["xla"], samples["default"], strict=True)
            res.xla_ratio_rounds = [x / d for x, d in pairs]
        if backward and "bwd" in got:
            got["inputs"] = jax.device_get(sets[0])
        del sets
        res.torch_ms = torch_ms(shape, dtype, backward, args, res)
        res.copy_ms = 1e3 * same_size_copy_seconds(res.bytes, dtype, timing)
    check_errors(results, got, dtype_name, pool)
    if args.mosaic:
        got_mosaic["inputs"] = got.get("inputs")
        check_errors(results, got_mosaic, dtype_name, pool, prefix="mosaic_")
    return results


def same_size_copy_seconds(nbytes: int, dtype, timing: dict) -> float:
    """Device seconds of the copy bound at this size: a negation reading nbytes / 2 and writing
    nbytes / 2 (the bytes of the row), chained and rotated like the kernels (launch and tail
    latency included, as in the kernels' own times)."""
    n = max(1, nbytes // 2 // jnp.dtype(dtype).itemsize)
    n_sets = rotation_count(nbytes)
    xs = [jax.random.normal(jax.random.key(i), (n,), dtype) for i in range(n_sets)]
    return chained_median_seconds(lambda x: -x, xs, **timing)


def check_errors(results: list[Result], got: dict, dtype_name: str, pool, prefix="") -> None:
    """Fill err / ok (or mosaic_err / mosaic_ok with prefix="mosaic_") of each row from the
    outputs in `got` against float64."""
    if got.get("inputs") is None:  # the backward's inputs (u, w, b, g) define both directions
        for res in results:
            res.notes.append(f"{prefix}error check: needs the backward row (--dirs ...,bwd)")
        return
    if "bwd" not in got:
        for res in results:
            res.notes.append(f"{prefix}error check: the backward failed")
        return
    u, w, b, g = got["inputs"]
    out = got["fwd"][0] if "fwd" in got else np.zeros(g.shape, g.dtype)  # (no forward row)
    err, ok = max_errors((u, w, b, g), (out, *got["bwd"]), dtype_name, pool)
    for res in results:
        names = ("du", "dw", "db") if res.direction == "bwd" else ("out",)
        setattr(res, prefix + "err", {n: err[n] for n in names})
        setattr(res, prefix + "ok", all(ok[n] for n in names))


def torch_ms(shape, dtype, backward: bool, args, res: Result) -> float | None:
    builders = None if args.no_torch else kb.conv_torch(shape, K, dtype, MODE)
    if builders is None:
        return None
    import torch

    try:
        return 1e3 * torch_median_seconds(builders[1 if backward else 0]())
    except Exception as e:  # e.g. out of memory: the row still has Pallas and XLA
        res.notes.append(f"torch: {short(e)}")
        return None
    finally:
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- report
HEADER = (
    "| shape (B x L x D) | dtype | dir | pallas ms (default) | best ms | best config "
    "| mosaic ms | XLA ms | torch ms | copy ms (same bytes) | x XLA (default / best / mosaic) "
    "| % copy (default / best / mosaic) | % same-size copy (default / mosaic) | max err "
    "| mosaic err | ok (triton / mosaic) |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def fmt(x, spec=".3f") -> str:
    return "-" if x is None else format(x, spec)


def ratio(a, b) -> float | None:
    return None if a is None or b is None else a / b


def pct(res: Result, ms, copy_gbps: float) -> float | None:
    return None if ms is None else 100 * res.bytes / (ms * 1e-3) / 1e9 / copy_gbps


def pct_same(res: Result, ms) -> float | None:
    """% of the copy of the same bytes (copy_ms): the copy bound at this size."""
    return None if ms is None or res.copy_ms is None else 100 * res.copy_ms / ms


def err_str(res: Result, err: dict) -> str:
    if res.direction == "fwd":
        return fmt(err.get("out"), ".1e")
    return " / ".join(f"{n} {fmt(err.get(n), '.1e')}" for n in ("du", "dw", "db"))


def ok_str(ok: bool | None) -> str:
    return "-" if ok is None else ("yes" if ok else "NO")


def row(res: Result, copy_gbps: float) -> str:
    best_ms, best_cfg = res.best()
    times = (res.default_ms, best_ms, res.mosaic_ms)
    x_xla = " / ".join(fmt(ratio(res.xla_ms, ms), ".2f") for ms in times)
    copy = " / ".join(fmt(pct(res, ms, copy_gbps), ".0f") for ms in times)
    same = " / ".join(fmt(pct_same(res, ms), ".0f") for ms in (res.default_ms, res.mosaic_ms))
    return (
        f"| {'x'.join(map(str, res.shape))} | {res.dtype} | {res.direction} "
        f"| {fmt(res.default_ms)} | {fmt(best_ms)} | {best_cfg.split(' = ')[0]} "
        f"| {fmt(res.mosaic_ms)} | {fmt(res.xla_ms)} | {fmt(res.torch_ms)} | {fmt(res.copy_ms)} "
        f"| {x_xla} | {copy} | {same} | {err_str(res, res.err)} "
        f"| {err_str(res, res.mosaic_err) if res.mosaic_ok is not None else '-'} "
        f"| {ok_str(res.ok)} / {ok_str(res.mosaic_ok)} |"
    )


def u_bytes(shape, dtype_name: str) -> int:
    return int(np.prod(shape)) * jnp.dtype(DTYPES[dtype_name]).itemsize


def faster_ms(res: Result) -> float | None:
    """The faster of the two lowerings' default tilings (what a per-shape backend pick gets)."""
    timed = [ms for ms in (res.default_ms, res.mosaic_ms) if ms is not None]
    return min(timed) if timed else None


PICKS = {  # summary label -> the time of a row it counts
    "default": lambda r: r.default_ms,
    "best": lambda r: r.best()[0],
    "mosaic": lambda r: r.mosaic_ms,
    "faster of triton default / mosaic": faster_ms,
}


def row_name(r: Result) -> str:
    return f"{r.shape[1]}x{r.shape[2]} {r.dtype} {r.direction}"


def noise_pct(r: Result) -> float:
    """The smaller of XLA's and the default tiling's run-to-run spread (%): a gap between them
    under this is not told apart from a repeat of either."""
    return min(r.spread_pct.get("xla", 0.0), r.spread_pct.get("default", 0.0))


def within_noise(r: Result) -> bool:
    return 100 * (r.default_ms / r.xla_ms - 1) < noise_pct(r)


def summary(results: list[Result], copy_gbps: float) -> list[str]:
    """How many rows meet the targets: >= 1.0x XLA everywhere, >= 85% of copy on large shapes
    (of the run's copy bandwidth, and of a copy of the same bytes)."""
    out = []
    for label, pick in PICKS.items():
        for d in ("fwd", "bwd"):
            n_xla = n_fast = n_big = n_copy = n_same = 0
            for r in results:
                ms = pick(r)
                if r.direction != d or ms is None:
                    continue
                if r.xla_ms is not None:
                    n_xla, n_fast = n_xla + 1, n_fast + (r.xla_ms >= ms)
                if u_bytes(r.shape, r.dtype) >= LARGE_BYTES:
                    n_big, n_copy = n_big + 1, n_copy + (pct(r, ms, copy_gbps) >= 85)
                    n_same += (pct_same(r, ms) or 0) >= 85
            if n_xla or n_big:
                out.append(
                    f"{label} {d}: >= 1.0x XLA in {n_fast}/{n_xla} rows; >= 85% of copy in "
                    f"{n_copy}/{n_big} large rows ({n_same}/{n_big} of the same-size copy)"
                )
    for d in ("fwd", "bwd"):
        slow = [r for r in results if r.direction == d and r.xla_ms and r.default_ms
                and r.default_ms > r.xla_ms]  # fmt: skip
        beyond = [r for r in slow if not within_noise(r)]
        if slow:
            out.append(
                f"default {d} under 1.0x XLA: {len(slow) - len(beyond)} within the timing noise "
                f"(gap < both versions' spread), {len(beyond)} beyond it"
                + "".join(
                    f"\n  {row_name(r)} {r.xla_ms / r.default_ms:.3f}x, spread {noise_pct(r):.1f}%"
                    for r in beyond
                )  # fmt: skip
            )
    n_ok = sum(bool(r.ok) for r in results)
    out.append(f"errors within tolerance: {n_ok}/{len(results)} rows")
    if any(r.mosaic_ok is not None for r in results):
        n_ok = sum(bool(r.mosaic_ok) for r in results)
        out.append(f"mosaic errors within tolerance: {n_ok}/{len(results)} rows")
    large = sorted({f"{r.shape[1]}x{r.shape[2]} {r.dtype}" for r in results
                    if u_bytes(r.shape, r.dtype) >= LARGE_BYTES})  # fmt: skip
    out.append(f"large rows (u >= {LARGE_BYTES >> 20} MiB): {', '.join(large)}")
    return out


def record(res: Result, kind: str, copy_gbps: float) -> dict:
    best_ms, best_cfg = res.best()
    rec = dataclasses.asdict(res)
    rec.update(kind=kind, mode=MODE, k=K, best_ms=best_ms, best_config=best_cfg,
               copy_gbps=copy_gbps, shape=list(res.shape))  # fmt: skip
    return rec


def copy_gbps(args) -> tuple[float, str]:
    if args.smoke:
        x = jnp.ones((2**20,), jnp.float32)
        return 2 * 4 * 2**20 / chained_median_seconds(lambda x: -x, [x], calls=4) / 1e9, "negate"
    bw = kb.copy_bandwidth()
    key = "torch_copy" if "torch_copy" in bw else "jax_negate"
    return bw[key], ", ".join(f"{k} {v:.0f} GB/s" for k, v in bw.items())


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jsonl", help="append one JSON record per table row here")
    p.add_argument("--dtypes", default=",".join(DTYPES), help="comma list (%(default)s)")
    p.add_argument("--lengths", default=None, help="comma list of L (course grid)")
    p.add_argument("--channels", default=None, help="comma list of D (course grid)")
    p.add_argument("--dirs", default="fwd,bwd", help="comma list (%(default)s)")
    p.add_argument("--sweep", type=int, default=4, help="max sweep configs per row (%(default)s)")
    p.add_argument("--budget", type=float, default=200.0, help="seconds for all (%(default)s)")
    p.add_argument("--calls", type=int, default=16, help="calls per timed executable")
    p.add_argument("--repeats", type=int, default=11, help="timing rounds per median")
    p.add_argument("--clock", choices=CLOCKS, default="wall", help="trace: GPU kernel time")
    p.add_argument("--max-sets", type=int, default=8, help="max rotated input sets")
    p.add_argument("--threads", type=int, default=8, help="parallel compiles / error chunks")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch baseline")
    p.add_argument("--mosaic", action="store_true", help="also time backend='mosaic_gpu' (GPU)")
    p.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, short timing (CPU check)")
    args = p.parse_args()
    if args.clock == "trace" and jax.default_backend() != "gpu":
        p.error(f"--clock trace times GPU kernels; this backend is {jax.default_backend()}")
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    args.dirs = [d for d in args.dirs.split(",") if d]
    bad = [d for d in args.dtypes if d not in DTYPES] + [
        d for d in args.dirs if d not in ("fwd", "bwd")
    ]
    if bad:
        p.error(f"unknown dtype or dir: {bad}")
    lengths = SMOKE_LENGTHS if args.smoke else LENGTHS
    channels = SMOKE_CHANNELS if args.smoke else CHANNELS
    args.lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else list(lengths)
    args.channels = [int(x) for x in args.channels.split(",")] if args.channels else list(channels)
    if args.smoke:
        args.calls, args.repeats, args.max_sets = 2, 1, 2
    if args.mosaic and (args.interpret or jax.default_backend() != "gpu"):
        p.error("--mosaic needs a GPU (the Mosaic GPU lowering has no interpret mode here)")
    if kb._torch() is None:
        args.no_torch = True
    return args


def priority(lengths, channels, group) -> tuple:
    """Run order: the corners of the L x D grid first (they bound the default-config heuristic,
    so they get the sweep budget first), larger first."""
    (_, n_l, n_d), dtype_name = group
    corner = n_l in (min(lengths), max(lengths)) and n_d in (min(channels), max(channels))
    return not corner, -u_bytes(group[0], dtype_name)


def main() -> None:
    t_start = time.perf_counter()
    args = parse_args()
    timing = dict(calls=args.calls, launches=1 if args.smoke else 4, repeats=args.repeats,
                  clock=args.clock)  # fmt: skip
    device = jax.devices()[0]
    print(f"device: {device.device_kind}; jax {jax.__version__}; backend {jax.default_backend()}"
          f"{' (Pallas interpret mode)' if args.interpret else ''}")  # fmt: skip
    bw, bw_text = copy_gbps(args)
    print(f"copy bandwidth: {bw_text} -> {bw:.0f} GB/s is the % copy denominator")
    torch_note = (
        "skipped (no CUDA torch or --no-torch)"
        if args.no_torch
        else (
            f"nn.Conv1d(D, D, {K}, padding={K - 1}, groups=D) on its own channels-first (B, D, L) "
            "layout, inputs made in it: no transpose is timed"
        )
    )
    print(f"mode {MODE!r} (L + {K - 1} outputs), K = {K}; Pallas and XLA on (B, L, D); "
          f"torch: {torch_note}")  # fmt: skip
    shapes = [(1, n_l, n_d) for n_l in args.lengths for n_d in args.channels]
    groups = [(s, d) for s in shapes for d in args.dtypes]
    results: dict[tuple, list[Result]] = {}
    per_exe = None  # measured seconds per timed executable (its compile share, timing, extras)
    n_dirs = len(args.dirs)
    n_base = 3 if args.mosaic else 2  # executables per direction besides the sweep
    with cf.ThreadPoolExecutor(args.threads) as pool:
        print("\n" + HEADER, flush=True)
        order = sorted(groups, key=functools.partial(priority, args.lengths, args.channels))
        for i, (shape, dtype_name) in enumerate(order):
            n_sweep = args.sweep
            if per_exe is not None:  # what is left after the base rows of the remaining groups
                left = args.budget - (time.perf_counter() - t_start)
                reserve = 1.2 * per_exe * n_dirs * n_base * (len(groups) - i)
                n_sweep = max(0, min(args.sweep, int((left - reserve) / (per_exe * n_dirs))))
            t0 = time.perf_counter()
            results[shape, dtype_name] = run_group(shape, dtype_name, n_sweep, args, pool, timing)
            spent = (time.perf_counter() - t0) / (n_dirs * (n_base + n_sweep))
            per_exe = spent if per_exe is None else 0.5 * (per_exe + spent)
            for res in results[shape, dtype_name]:
                print(row(res, bw), flush=True)
                append_jsonl(args.jsonl, [record(res, "row", bw)])
    flat = [r for g in groups for r in results[g]]
    print(f"\n## conv1d 'full' K = {K}, {device.device_kind}, copy {bw:.0f} GB/s\n")
    print(HEADER)
    for res in flat:
        print(row(res, bw))
    print()
    for line in summary(flat, bw):
        print(line)
    n_swept = [len(r.sweep) for r in flat]
    print(f"sweep: {min(n_swept, default=0)}-{max(n_swept, default=0)} tilings per row "
          f"(up to --sweep {args.sweep}, within --budget {args.budget:.0f} s)")  # fmt: skip
    for res in flat:
        for note in res.notes:
            print(f"note {res.shape} {res.dtype} {res.direction}: {note}")
    print(f"tolerances vs float64 (out, du: atol, rtol; dw, db: rel. to max |ref|): {TOL}")
    print(f"wall time {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
