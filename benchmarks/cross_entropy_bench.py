"""Fused LM-head cross-entropy vs XLA on one GPU: python benchmarks/cross_entropy_bench.py

Two levels, GPT-2 small's head at batch 16 x 1024 (N = 16384 rows, D = 768, V = 50257), bf16:
  kernel: z (N, Vp) -> (loss, dz); Pallas `cross_entropy_from_logits` per config vs XLA's
          value_and_grad of sum(w * softmax_loss(z, t)) (logsumexp forward + softmax
          backward, padded z, masked).
  head:   (x, W) -> (loss, dx, dW); `linear_cross_entropy` vs `linear_cross_entropy_ref`
          (GEMMs included).
Device-side chained timing (jaxllm.profiling.timing), median of 5; correctness vs the XLA path
checked first. Bandwidth counts one read of z and one write of dz.
`--rows N` sets the row count (65536 = GPT-2 at batch 64); `--sweep` times a grid of configs
(columns per chunk x warps x programs x pipeline stages): the kernel reads each row twice, and
the second read comes from L2 only while the rows in flight (programs resident x row bytes)
fit in it. `--jsonl` appends one record per row.
"""

from __future__ import annotations

from jaxllm.xla_flags import apply_default_xla_flags

apply_default_xla_flags()

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import functional as F
from jaxllm.profiling.harness import append_jsonl, md_header, md_row
from jaxllm.profiling.timing import chained_median_seconds
from pallas_kernels import linear_cross_entropy, linear_cross_entropy_ref
from pallas_kernels.common import core_count
from pallas_kernels.cross_entropy import (
    VOCAB_ALIGN,
    Config,
    cross_entropy_from_logits,
    default_config,
)

FULL = (16384, 768, 50257)  # GPT-2 small's head at batch 16 x 1024: N rows, D, V
SMALL = (64, 16, 1000)  # --small: a CPU smoke run (interpret mode)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="toy size (CPU smoke run)")
    p.add_argument("--rows", type=int, default=None, help=f"rows N (default {FULL[0]})")
    p.add_argument("--sweep", action="store_true", help="time a grid of persistent configs")
    p.add_argument("--no-head", action="store_true", help="skip the head (GEMMs) level")
    p.add_argument("--jsonl", help="append one JSON record per row here")
    p.add_argument(
        "--mosaic", action="store_true", help="also the Mosaic GPU kernel (one read per row; GPU)"
    )
    args = p.parse_args()
    N, D, V = SMALL if args.small else FULL  # noqa: N806 (the docstring's names)
    if args.rows is not None:
        if args.rows < 1:
            p.error(f"--rows must be >= 1, got {args.rows}")
        N = args.rows  # noqa: N806
    interpret = jax.default_backend() != "gpu"
    VP = V + (-V % VOCAB_ALIGN)
    rng = np.random.default_rng(0)
    z = jnp.asarray(rng.normal(size=(N, VP)) * 2, jnp.bfloat16)
    t = jnp.asarray(rng.integers(0, V, N), jnp.int32)
    w = jnp.full((N,), 1.0 / N, jnp.float32)
    col_ok = jnp.arange(VP) < V

    def xla_step(z):
        def loss(z):
            zm = jnp.where(col_ok, z, jnp.asarray(F.MASK_VALUE, z.dtype))
            return jnp.sum(w * F.softmax_loss(zm, t))

        return jax.grad(loss)(z)

    ref = jax.jit(xla_step)(z)
    # fused under jit: at 65536 rows the eager float32 copies of z alone would take 26 GB
    max_err = jax.jit(lambda a, b: jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
    rows = []
    t_xla = chained_median_seconds(xla_step, [z], calls=8)
    gb = 2 * N * VP * 2 / 1e9
    rows.append(("kernel", "xla", t_xla, 0.0))
    configs = [default_config()] + [
        Config(1, bc, nw, p)
        for bc, nw, p in ((65536, 16, N), (65536, 32, N), (2048, 4, N), (4096, 8, 1056))
    ]
    if args.sweep:
        # wider programs and persistent grids: fewer rows in flight, so that a row's second
        # sweep could find it in L2 (50 MB); with L2 eviction hints on the first sweep
        # (evict_last) and the second (evict_first) none of them gained (benchmarks/RESULTS.md)
        sms = core_count()
        configs += [
            Config(1, bc, nw, programs, stages)
            for bc, nw, programs, stages in (
                (4096, 8, N, 1),
                (8192, 16, N, 1),
                (8192, 32, N, 1),
                (4096, 8, 4 * sms, 2),
                (8192, 16, 2 * sms, 2),
                (8192, 32, sms, 2),
            )
        ]
    for cfg in configs:
        step = lambda z, cfg=cfg: cross_entropy_from_logits(z, t, w, V, True, interpret, cfg)[2]  # noqa: E731
        try:
            err = float(max_err(jax.jit(step)(z), ref))
            rows.append(
                ("kernel", str(tuple(cfg)), chained_median_seconds(step, [z], calls=8), err)
            )
            print(rows[-1], flush=True)
        except Exception as e:  # report and go on
            print(f"{cfg}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    if args.mosaic:  # the same padded logits
        from pallas_kernels import cross_entropy_mgpu

        # ce and hit against the Triton kernel's (its dz is checked against XLA below); a row
        # count that is not a multiple of a program's run (e.g. --rows 1000) checks the ragged
        # last run, which relies on the copy engine's clamping
        ce_t, hit_t, _ = cross_entropy_from_logits(z, t, w, V, True, interpret, default_config())
        ce_m, hit_m, _ = cross_entropy_mgpu.cross_entropy_from_logits(z, t, w, V)
        ce_diff, hit_diff = float(jnp.max(jnp.abs(ce_m - ce_t))), int(jnp.sum(hit_m != hit_t))
        print(f"mosaic_gpu vs triton: max |ce diff| {ce_diff:.2e}, hit differs in {hit_diff} of "
              f"{N} rows", flush=True)  # fmt: skip
        if not ce_diff <= 1e-2 or hit_diff > 2 + N // 1000:  # the same bf16 logits: ties only
            raise SystemExit(f"mosaic_gpu disagrees with triton: ce {ce_diff}, hit {hit_diff}")
        Mc = cross_entropy_mgpu.Config  # noqa: N806
        # the default (chunks of 2048, two programs per SM, one row buffer each), then one
        # double-buffered program per SM (what default_config's docstring compares), chunks of 1024
        for cfg in (Mc(2048, 2, 1), Mc(2048, 1, 2), Mc(1024, 2, 1), Mc(1024, 1, 2)):
            mosaic = lambda z, cfg=cfg: cross_entropy_mgpu.cross_entropy_from_logits(  # noqa: E731
                z, t, w, V, cfg
            )[2]
            err = float(max_err(jax.jit(mosaic)(z), ref))
            sec = chained_median_seconds(mosaic, [z], calls=8)
            rows.append(("kernel", f"mosaic_gpu {tuple(cfg)}", sec, err))
            print(rows[-1], flush=True)

    x = jnp.asarray(rng.normal(size=(N, D)), jnp.float32)
    wt = jnp.asarray(rng.normal(size=(V, D)) * 0.02, jnp.float32)
    heads = (
        ()
        if args.no_head
        else (("xla", linear_cross_entropy_ref, {}), ("pallas", linear_cross_entropy, {}))
    )
    if args.mosaic and not args.no_head:
        heads += (("pallas mosaic_gpu", linear_cross_entropy, {"backend": "mosaic_gpu"}),)
    for name, fn, kw in heads:

        def head_step(s, fn=fn, kw=kw):
            x, wt = s
            gx, gw = jax.grad(lambda x, wt: fn(x, wt, t, w, jnp.bfloat16, **kw)[0], (0, 1))(x, wt)
            return x - gx, wt - gw

        rows.append(("head", name, chained_median_seconds(head_step, [(x, wt)], calls=4), 0.0))
        print(rows[-1], flush=True)
    print(f"\nN={N} V={V} (Vp={VP}) bf16; kernel GB/s counts read z + write dz = {gb:.2f} GB")
    print(md_header(["level", "impl / config (rows, cols, warps, programs)", "ms", "GB/s", "x XLA",
                     "max err"]))  # fmt: skip
    base = {lvl: ms for lvl, impl, ms, _ in rows if impl == "xla"}
    for lvl, impl, s, err in rows:
        bw = f"{gb / s:,.0f}" if lvl == "kernel" else "-"
        print(md_row([lvl, impl, f"{1e3 * s:.3f}", bw, f"{base[lvl] / s:.2f}", f"{err:.2e}"]))
        rec = dict(level=lvl, impl=impl, ms=1e3 * s, max_err=err, rows=N, vocab=V,
                   gbps=gb / s if lvl == "kernel" else None, xla_ms=1e3 * base[lvl],
                   device=jax.devices()[0].device_kind)  # fmt: skip
        append_jsonl(args.jsonl, [rec])


if __name__ == "__main__":
    main()
