"""Causal flash attention: our Mosaic GPU kernels vs cuDNN vs XLA, device time (Hopper GPU only).

    PYTHONPATH=$PWD python3 benchmarks/flash_attention_bench.py --jsonl $OUT/fa.jsonl
    ... --quick                                   # GPT-2's shape only, fewer repetitions
    ... --shapes 64,1024,12,64 --configs 64,128,2 64,64,2   # our forward at several tilings
    ... --grad --bwd-configs 64,64,2 128,64,2      # + fwd+bwd, our backward at several tilings

For every shape (B, T, H, D) bfloat16, direction (fwd; fwd+bwd with --grad) and implementation:
ours (pallas_kernels.flash_attention at each --configs, default its CONFIGS entry; fwd+bwd rows
also at each --bwd-configs, default BwdConfig()),
jax.nn.dot_product_attention(implementation="cudnn", is_causal=True) and the same with "xla":
  * max |error| of the output against the float32 jnp reference (reference.flash_attention_ref)
    on the same random inputs (forward rows); fwd+bwd rows: grad_err, the largest over dq, dk,
    dv of max |error| / max |reference| against the reference's VJP;
  * median device ms per call (jaxllm/profiling/timing.chained_median_seconds: one executable,
    each call's output feeding the next call's q, states rotated to miss L2; a loop of --unroll
    calls per iteration, the same for every implementation), measured in
    --trials separate runs: the median of those and their spread ((max - min) / median);
  * TFLOP/s over the causal flops: forward 2 * B*H*T^2*D (two matmuls, half the score matrix),
    fwd+bwd 3.5 times that; and the ratio of cuDNN's time to this row's (> 1: faster than cuDNN);
  * compile seconds of one call.
A failure of one cell is recorded (its exception) and the script goes on.
One JSON line per row to --jsonl as it finishes; a Markdown table on stdout at the end.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from jaxllm.xla_flags import apply_default_xla_flags  # noqa: E402

apply_default_xla_flags()

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxllm.profiling.timing import chained_median_seconds, rotation_count  # noqa: E402
from pallas_kernels import flash_attention_mgpu as fa_mgpu  # noqa: E402
from pallas_kernels.common import mosaic_gpu_capable  # noqa: E402
from pallas_kernels.flash_attention import flash_attention  # noqa: E402
from pallas_kernels.reference import flash_attention_ref  # noqa: E402

GPT2 = (64, 1024, 12, 64)
# CS336-style sizes: T from 128 to 1024 at head dims 64 and 128 (d_model 1024)
CS336 = [(8, t, 1024 // d, d) for d in (64, 128) for t in (128, 256, 512, 1024)]


def causal_flops(b: int, t: int, h: int, d: int) -> float:
    return 2.0 * b * h * t * t * d


def implementations(configs: list, bwd_configs: list = (None,)) -> dict[str, Callable]:
    """name -> attention fn: ours at each (forward, backward) config pair, cuDNN, XLA."""
    impls = {}
    for cfg in configs:
        for bwd in bwd_configs:
            tags = [f"{tag}{'-'.join(map(str, c))}" for tag, c in (("-", cfg), ("-bwd", bwd)) if c]
            name = "ours" + "".join(tags)
            impls[name] = lambda q, k, v, cfg=cfg, bwd=bwd: flash_attention(
                q, k, v, config=cfg, bwd_config=bwd
            )
    for impl in ("cudnn", "xla"):
        impls[impl] = lambda q, k, v, impl=impl: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation=impl
        )
    return impls


def step_of(fn: Callable, direction: str) -> Callable:
    """(q, k, v) -> (q', k, v): the forward's output, or dq of the VJP with the output as its
    cotangent, becomes the next call's q."""
    if direction == "fwd":
        return lambda s: (fn(*s), *s[1:])

    def fwd_bwd(s):
        o, vjp = jax.vjp(fn, *s)
        dq, dk, dv = vjp(o)
        return dq, dk, dv

    return fwd_bwd


def measure(fn, direction, shape, args, ref, trials) -> dict:
    key = jax.random.PRNGKey(0)
    q, k, v = (jax.random.normal(kk, shape, jnp.bfloat16) for kk in jax.random.split(key, 3))
    row: dict = {}
    t0 = time.perf_counter()
    call = jax.jit(fn if direction == "fwd" else step_of(fn, direction))
    args_ = (q, k, v) if direction == "fwd" else ((q, k, v),)
    call = call.lower(*args_).compile()  # compiled once: timed here, then checked
    row["compile_s"] = round(time.perf_counter() - t0, 2)
    if direction == "fwd":
        out = call(*args_).astype(jnp.float32)
        row["max_err"] = float(jnp.max(jnp.abs(out - ref(q, k, v))))
    else:
        got = call(*args_)
        want = jax.jit(step_of(ref, direction))(tuple(x.astype(jnp.float32) for x in (q, k, v)))
        errs = [
            jnp.max(jnp.abs(g - w)) / jnp.max(jnp.abs(w)) for g, w in zip(got, want, strict=True)
        ]
        row["grad_err"] = float(max(errs))
    n = rotation_count(3 * q.size * q.dtype.itemsize)
    states = [tuple(x + i for x in (q, k, v)) for i in range(n)]
    kw = dict(calls=args.calls, launches=args.launches, repeats=args.repeats, unroll=args.unroll)
    step = step_of(fn, direction)  # one function: the trials reuse one compiled program
    times = [chained_median_seconds(step, states, **kw) for _ in range(trials)]
    ms = statistics.median(times) * 1e3
    flops = causal_flops(*shape) * (1.0 if direction == "fwd" else 3.5)
    row.update(ms=round(ms, 4), spread=round((max(times) - min(times)) * 1e3 / ms, 3),
               tflops=round(flops / (ms * 1e-3) / 1e12, 1))  # fmt: skip
    return row


def parse_config(text: str) -> fa_mgpu.Config:
    return fa_mgpu.Config(*(int(x) for x in text.split(",")))


def parse_bwd_config(text: str) -> fa_mgpu.BwdConfig:
    return fa_mgpu.BwdConfig(*(int(x) for x in text.split(",")))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", help="B,T,H,D each (default GPT-2 + CS336 sizes)")
    parser.add_argument("--configs", nargs="*", type=parse_config, default=[None],
                        help="ours at block_q,block_kv,stages (default: CONFIGS)")  # fmt: skip
    parser.add_argument(
        "--bwd-configs",
        nargs="*",
        type=parse_bwd_config,
        default=[None],
        help="our backward's block_q,block_kv,stages[,ctas] (default: BwdConfig())",
    )
    parser.add_argument("--grad", action="store_true", help="also time fwd+bwd")
    parser.add_argument("--quick", action="store_true", help="GPT-2's shape, fewer repetitions")
    parser.add_argument("--trials", type=int, default=3, help="separate timing runs per cell")
    parser.add_argument("--calls", type=int, default=16)
    parser.add_argument("--launches", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--unroll", type=int, default=4, help="calls per timing-loop iteration")
    parser.add_argument("--jsonl", help="append one JSON line per table row here")
    args = parser.parse_args(argv)
    if args.shapes:
        shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes]
    else:
        shapes = [GPT2] if args.quick else [GPT2, *CS336]
    if args.quick:
        args.trials, args.repeats = 1, 3
    if not mosaic_gpu_capable():
        sys.exit(f"flash_attention_bench: needs a Hopper-class NVIDIA GPU (Mosaic GPU); the "
                 f"default JAX backend is {jax.default_backend()!r}")  # fmt: skip
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)

    def ref(q, k, v):
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        return jax.jit(lambda *a: flash_attention_ref(*a, causal=True))(*f32)

    rows = []
    for shape in shapes:
        for direction in ("fwd", "fwd+bwd") if args.grad else ("fwd",):
            cudnn_ms = None
            bwd = args.bwd_configs if direction == "fwd+bwd" else [None]
            impls = implementations(args.configs, bwd)
            for name in ["cudnn", *[n for n in impls if n != "cudnn"]]:  # cuDNN first: the ratio
                row = dict(shape=list(shape), direction=direction, impl=name)
                try:
                    row.update(measure(impls[name], direction, shape, args, ref, args.trials))
                except Exception as e:  # one failing cell must not stop the table
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                if name == "cudnn":
                    cudnn_ms = row.get("ms")
                if cudnn_ms and "ms" in row:
                    row["vs_cudnn"] = round(cudnn_ms / row["ms"], 3)
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.jsonl:
                    with open(args.jsonl, "a") as f:
                        f.write(json.dumps(row) + "\n")

    cols = ["shape", "direction", "impl", "ms", "spread", "tflops", "vs_cudnn", "max_err",
            "grad_err", "compile_s"]  # fmt: skip
    print("\n| " + " | ".join(cols) + " | error |\n|" + "---|" * (len(cols) + 1))
    for row in rows:
        cells = [str(row.get(c, "")) for c in cols] + [row.get("error", "")]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
