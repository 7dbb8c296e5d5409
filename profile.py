"""Profiling CLI. Subcommands:

  kernels   benchmark the Pallas kernels against XLA and PyTorch (jaxllm/profiling/kernel_bench.py)
  roofline  FLOPs, bytes, intensity and roofline verdicts per op (jaxllm/profiling/roofline.py)
  bench     end-to-end model timing over sizes x contexts x dtypes (jaxllm/profiling/bench.py)
  breakdown one layer's time per component next to its FLOP share (jaxllm/profiling/breakdown.py)
  trace     jax.profiler trace of train steps for TensorBoard, top kernels per step, HLO
            (jaxllm/profiling/trace.py); `--nvtx`: phases as NVTX ranges for Nsight Systems
  nsys      `trace --nvtx` under `nsys profile --trace=cuda,nvtx`, then `nsys stats` per phase
  memory    peak memory of forward / train step per context, with and without remat, + PNG and
            pprof files (jaxllm/profiling/memory.py)

Run on a GPU: `python profile.py kernels [--tune] [--only softmax,layer_norm,conv1d]`.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import sysconfig
from pathlib import Path

if __name__ == "profile":
    # Imported as `profile`, not run: the repo root is on sys.path (cwd, for `python -m cProfile`
    # or `python -c` here), so this file shadows the standard library's `profile`, which cProfile
    # imports (`module 'profile' has no attribute 'run'`). Load the real one from the stdlib
    # directory and put it in sys.modules: the import system hands importers whatever
    # sys.modules holds once this file has run, so they get the standard library's module.
    _spec = importlib.util.spec_from_file_location(
        "profile", os.path.join(sysconfig.get_paths()["stdlib"], "profile.py")
    )
    _stdlib_profile = importlib.util.module_from_spec(_spec)
    sys.modules["profile"] = _stdlib_profile
    _spec.loader.exec_module(_stdlib_profile)

KERNELS = ("softmax", "layer_norm", "conv1d")


def _kernels(args: argparse.Namespace) -> int:
    only = [k for k in args.only.split(",") if k]
    bad = [k for k in only if k not in KERNELS]
    if bad:
        raise SystemExit(f"--only: unknown kernel(s) {bad}; allowed: {', '.join(KERNELS)}")
    # Share the GPU with PyTorch's baselines: allocate on demand instead of grabbing 75%.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    from jaxllm.profiling import kernel_bench

    if jax.default_backend() != "gpu":
        raise SystemExit("profile.py kernels needs a GPU (jax.default_backend() is not 'gpu')")
    kernel_bench.run(only or list(KERNELS), tune=args.tune, jsonl_path=args.jsonl)
    return 0


# ----------------------------------------------------------------------------- roofline
def _roofline(args: argparse.Namespace) -> int:
    from jaxllm.profiling import roofline

    names = ("op", "arch", "batch", "length", "width", "heads", "d_ff", "dtype", "device",
             "kernel", "conv_padding", "peak_tflops", "peak_gbps", "png", "measured")  # fmt: skip
    try:
        print(roofline.report(**{name: getattr(args, name) for name in names}))
    except ValueError as e:  # bad input: one line naming it and what is allowed
        raise SystemExit(f"profile.py roofline: {e}") from None
    return 0


def _add_roofline(sub) -> None:
    r = sub.add_parser("roofline", help="per-op FLOPs, bytes, intensity, roofline verdicts, PNG")
    r.add_argument("--op", default="layer", help="layer (one decoder layer's ops) or conv1d")
    r.add_argument("--arch", default="gpt2", help="gpt2 or transformer_lm (RMSNorm, SwiGLU, RoPE)")
    r.add_argument("--batch", type=int, default=4)
    r.add_argument("--length", type=int, default=1024, help="sequence length")
    r.add_argument("--width", "--d-model", dest="width", type=int, default=768, help="d_model")
    r.add_argument("--heads", type=int, default=12)
    r.add_argument("--d-ff", type=int, default=None, help="MLP width (default 4 * width)")
    r.add_argument("--dtype", default="bfloat16", help="bfloat16, float16 or float32")
    device_help = "A100, T4 or H100: the PNG's roof, the conv verdict, the measured machine"
    r.add_argument("--device", default="H100", help=device_help)
    conv_help = "conv1d kernel size (--op conv1d: default 3; layer: adds a short conv)"
    r.add_argument("--kernel", type=int, default=None, help=conv_help)
    pad_help = "full, causal or same (default: full for --op conv1d, causal in a layer)"
    r.add_argument("--conv-padding", default=None, help=pad_help)
    r.add_argument("--peak-tflops", type=float, default=None, help="measured peak TFLOP/s")
    r.add_argument("--peak-gbps", type=float, default=None, help="measured memory GB/s")
    r.add_argument("--png", default=None, help="write the roofline plot here")
    rows_help = "JSONL files of `kernels --jsonl` or {name, flops, bytes, seconds} rows"
    r.add_argument("--measured", nargs="+", default=(), metavar="FILE", help=rows_help)
    r.set_defaults(func=_roofline)


# ----------------------------------------------------------------------------- bench
def _bench(args: argparse.Namespace) -> int:
    from jaxllm.xla_flags import apply_default_xla_flags

    apply_default_xla_flags()  # before jax starts its backend: XLA reads its flags then
    if args.torch:  # share the GPU with PyTorch: allocate on demand instead of grabbing 75%
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    from jaxllm.profiling import bench
    from jaxllm.profiling.torch_reference import TorchUnavailableError, require_torch

    try:
        sweep = bench.Sweep(
            sizes=bench.parse_choices(
                args.sizes or ",".join(bench.CS336_SIZES), tuple(bench.SIZES), "--sizes"
            ),
            contexts=bench.parse_ints(args.contexts, "--contexts"),
            dtypes=bench.parse_choices(args.dtypes, bench.DTYPES, "--dtypes"),
            modes=bench.parse_choices(
                args.modes or ",".join(bench.DEFAULT_MODES), bench.MODES, "--modes"
            ),
            arch=args.arch, batch=args.batch, vocab=args.vocab, kernels=args.kernels,
            warmup=args.warmup, steps=args.steps, group=args.group, overrides=tuple(args.set),
            torch=args.torch,
            compile_workers=args.compile_workers, torch_compile=args.torch_compile,
            isolate=args.isolate,
        )  # fmt: skip
        bench.check_sweep(sweep)
        if args.torch:
            require_torch(cuda=True)
        bench.run(sweep, jsonl_path=args.jsonl, progress=not args.no_progress)
    except (bench.BenchArgError, TorchUnavailableError) as e:  # one line: what and what is allowed
        raise SystemExit(f"profile.py bench: {e}") from None
    return 0


def _add_bench(sub) -> None:
    # No jaxllm import here: building the parser must not import jax (flags first, in _bench).
    # Defaults of None are filled in from jaxllm.profiling.bench; bad names list what is allowed.
    b = sub.add_parser(
        "bench", help="end-to-end time of forward / backward / train step (CS336 5.2)"
    )
    sizes_help = "model sizes: small, medium, large, xl, 2.7B (default: all), tiny (tests)"
    b.add_argument("--sizes", default=None, help=sizes_help)
    b.add_argument("--contexts", default="128,256,512,1024", help="context lengths")
    b.add_argument("--dtypes", default="float32", help="compute dtypes: float32, bfloat16")
    modes_help = (
        "logits, forward (+ loss), forward_backward, train_step (+ clipping and AdamW); "
        "default: the last three"
    )
    b.add_argument("--modes", default=None, help=modes_help)
    b.add_argument("--arch", default="gpt2", help="gpt2 or transformer_lm")
    b.add_argument("--batch", type=int, default=4)
    b.add_argument("--vocab", type=int, default=10_000, help="vocabulary size (CS336: 10000)")
    b.add_argument("--kernels", default="xla", help="xla or pallas (execution.kernels)")
    b.add_argument("--warmup", type=int, default=5, help="untimed calls before the timed ones")
    b.add_argument("--steps", type=int, default=10, help="timed samples, each closed by a sync")
    group_help = "calls per timed sample, back to back (1: every call synced, CS336's recipe)"
    b.add_argument("--group", type=int, default=1, help=group_help)
    workers_help = "threads compiling a size's executables ahead of time (1: one at a time)"
    b.add_argument("--compile-workers", type=int, default=8, help=workers_help)
    set_help = "a config override, e.g. execution.attention_impl=dot_product_attention (repeatable)"
    b.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=set_help)
    torch_help = "also time the same model in PyTorch, eager and torch.compile (needs CUDA)"
    b.add_argument("--torch", action="store_true", help=torch_help)
    compile_help = (
        "regional (default: each block compiled once, shared by all; the output too) or model "
        "(the whole model, one graph: minutes per config)"
    )
    b.add_argument("--torch-compile", default="regional", help=compile_help)
    isolate_help = (
        "a fresh process per size, and a new one after an out-of-memory error (the cell "
        "re-run alone): auto (on a GPU), always, never"
    )
    b.add_argument("--isolate", default="auto", help=isolate_help)
    b.add_argument("--jsonl", default=None, help="append one JSON line per table row here")
    bar_help = "no tqdm bar (there is one only when stderr is a terminal)"
    b.add_argument("--no-progress", action="store_true", help=bar_help)
    b.set_defaults(func=_bench)


# ----------------------------------------------------------------------------- breakdown
def _breakdown(args: argparse.Namespace) -> int:
    from jaxllm.xla_flags import apply_default_xla_flags

    apply_default_xla_flags()  # before jax starts its backend: XLA reads its flags then
    from jaxllm.profiling import bench, breakdown

    try:
        for flag, value, allowed in (
            ("--size", args.size, tuple(bench.SIZES)),
            ("--dtype", args.dtype, bench.DTYPES),
            ("--arch", args.arch, bench.ARCHS),
            ("--kernels", args.kernels, bench.KERNELS),
        ):
            if value not in allowed:  # one value each, not a list
                raise bench.BenchArgError(f"{flag}: unknown value {value!r}; allowed: "
                                          f"{', '.join(allowed)} (one of them)")  # fmt: skip
        size, dtype = args.size, args.dtype
        if min(args.batch, args.context, args.steps, args.repeats) < 1 or args.warmup < 0:
            raise bench.BenchArgError(
                "--batch, --context, --steps and --repeats must be >= 1, --warmup >= 0"
            )
        cfg = bench.build_config(
            size, arch=args.arch, dtype=dtype, kernels=args.kernels, batch=args.batch,
            overrides=args.set,
        )  # fmt: skip
        breakdown.run(
            cfg.model, size, args.batch, args.context, warmup=args.warmup, steps=args.steps,
            repeats=args.repeats, jsonl_path=args.jsonl,
        )  # fmt: skip
    except bench.BenchArgError as e:  # one line: what and what is allowed
        raise SystemExit(f"profile.py breakdown: {e}") from None
    return 0


def _add_breakdown(sub) -> None:
    d = sub.add_parser("breakdown", help="one layer: time per component vs its FLOP share")
    d.add_argument("--size", default="small", help="one of bench's sizes (small .. 2.7B, tiny)")
    d.add_argument("--context", type=int, default=1024, help="sequence length")
    d.add_argument("--dtype", default="float32", help="compute dtype: float32 or bfloat16")
    d.add_argument("--batch", type=int, default=4)
    d.add_argument("--arch", default="gpt2", help="gpt2 or transformer_lm")
    d.add_argument("--kernels", default="xla", help="xla or pallas (execution.kernels)")
    d.add_argument("--warmup", type=int, default=3, help="untimed calls per piece")
    d.add_argument("--steps", type=int, default=10, help="back-to-back calls per sample")
    d.add_argument("--repeats", type=int, default=5, help="samples; the median is reported")
    set_help = "a config override, e.g. execution.attention_impl=dot_product_attention (repeatable)"
    d.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=set_help)
    d.add_argument("--jsonl", default=None, help="append one JSON line per piece here")
    d.set_defaults(func=_breakdown)


# ----------------------------------------------------------------------------- trace
TRACE_DEFAULT_CONFIG = "configs/gpt2_124m.yaml"


def _config_overrides(args: argparse.Namespace) -> list[str]:
    """--set KEY=VALUE items, then trailing --section.key=value arguments (as train.py)."""
    return [s if s.startswith("--") else f"--{s}" for s in args.set] + list(args.overrides)


def _trace(args: argparse.Namespace) -> int:
    from jaxllm.xla_flags import apply_default_xla_flags

    apply_default_xla_flags()  # before jax starts its backend: XLA reads its flags then
    import jax

    from jaxllm.config import ConfigError, load_config
    from jaxllm.profiling import trace

    try:
        cfg = load_config(args.config, _config_overrides(args))
    except ConfigError as e:
        raise SystemExit(f"profile.py trace: {e}") from None
    if args.warmup < 0 or args.steps < 1 or args.top < 1:
        raise SystemExit("profile.py trace: --warmup must be >= 0, --steps and --top >= 1")
    m = cfg.model
    print(
        f"trace: {m.arch} d_model {m.d_model}, {m.n_layers} layers, context {m.context_length}, "
        f"batch {cfg.train.batch_size}, {m.compute_dtype}, remat {m.remat}; {args.warmup} "
        f"warm-up + {args.steps} {'NVTX-ranged' if args.nvtx else 'traced'} train steps; "
        f"device {jax.devices()[0].device_kind}, "
        f"jax {jax.__version__}",
        flush=True,
    )
    from jaxllm.ops import plan_ops

    print(
        plan_ops(cfg.model, cfg.execution).describe(), flush=True
    )  # which paths run (e.g. Pallas interpreted)
    res = trace.trace_train_steps(cfg, args.out, args.warmup, args.steps, args.nvtx, args.top)
    if args.nvtx:
        src = trace.nvtx_source()
        print("phases (host ms per step, each synced):", ", ".join(
            f"{p} {ms:.2f}" for p, ms in res.phase_ms.items()))  # fmt: skip
        if src == "none":
            print("NVTX: no NVTX library found (libnvToolsExt or the nvtx package): the "
                  "warmup/steps/phase ranges exist only as jax.profiler annotations; under nsys, "
                  "XLA's own NVTX ranges (domain TSL) still name each program: jit_forward, "
                  "jit_backward, jit_optimizer")  # fmt: skip
        else:
            print(f"NVTX ranges warmup, steps, {', '.join(trace.PHASES)} via {src}")
        print(f"wrote {res.hlo_path} (optimized HLO of the three phase programs)")
        return 0
    print(trace.format_summary(res.summary, jax.default_backend()))
    print(
        f"\nwrote {trace.latest_profile_dir(res.trace_dir)} (*.xplane.pb, *.trace.json.gz, "
        f"perfetto_trace.json.gz) and {res.hlo_path} (optimized HLO: kernel names are its "
        "fusion names, scopes its op_name metadata)\n"
        f'open: pip install -e ".[profile]" && tensorboard --logdir {res.trace_dir}  '
        "(Profile tab, trace_viewer), or load perfetto_trace.json.gz in https://ui.perfetto.dev"
    )
    return 0


def _add_trace_args(t) -> None:
    """The flags `trace` and `nsys` share: what to run and for how long."""
    t.add_argument("--config", default=TRACE_DEFAULT_CONFIG, help="YAML preset")
    set_help = "a config override, e.g. model.n_layers=2 (repeatable); trailing "
    set_help += "--section.key=value arguments work too, as in train.py"
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=set_help)
    t.add_argument("--warmup", type=int, default=3, help="untraced steps first (compile)")
    t.add_argument("--steps", type=int, default=3, help="traced train steps")
    t.set_defaults(overrides_ok=True)


def _add_trace(sub) -> None:
    t = sub.add_parser(
        "trace", help="jax.profiler trace of train steps (TensorBoard), top kernels, HLO"
    )
    t.add_argument("--out", required=True, help="output dir: trace/, step.hlo.txt")
    _add_trace_args(t)
    t.add_argument("--top", type=int, default=30, help="kernels in the table")
    nvtx_help = "for Nsight Systems: forward / backward / optimizer as separate programs in "
    nvtx_help += "NVTX ranges (no jax.profiler trace); see `profile.py nsys`"
    t.add_argument("--nvtx", action="store_true", help=nvtx_help)
    t.set_defaults(func=_trace)


# ----------------------------------------------------------------------------- nsys
def _nsys(args: argparse.Namespace) -> int:
    from jaxllm.profiling import trace

    trace_args = [f"--config={args.config}", f"--warmup={args.warmup}", f"--steps={args.steps}"]
    trace_args += _config_overrides(args)
    try:
        trace.run_nsys(args.out, trace_args, args.nsys_bin)
    except trace.NsysError as e:
        raise SystemExit(f"profile.py nsys: {e}") from None
    return 0


def _add_nsys(sub) -> None:
    n = sub.add_parser(
        "nsys", help="Nsight Systems: `trace --nvtx` under nsys profile, then nsys stats"
    )
    n.add_argument("--out", required=True, help="output dir: report.nsys-rep, phases.hlo.txt")
    n.add_argument("--nsys-bin", default="nsys", help="the nsys executable (name or path)")
    _add_trace_args(n)
    n.set_defaults(func=_nsys)


# ----------------------------------------------------------------------------- memory
def _memory(args: argparse.Namespace) -> int:
    from jaxllm.xla_flags import apply_default_xla_flags

    apply_default_xla_flags()  # before jax starts its backend: XLA reads its flags then
    # This process only reads device stats; each config's subprocess allocates on demand too,
    # so a peak is what the program used, not a preallocated pool.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    from jaxllm.profiling import bench, memory

    try:
        contexts = bench.parse_ints(args.contexts, "--contexts")
        remats = bench.parse_choices(args.remat, memory.REMATS, "--remat")
        dtypes = bench.parse_choices(args.dtype, bench.DTYPES, "--dtype")
        if len(dtypes) != 1:
            raise bench.BenchArgError(f"--dtype takes one value, got {args.dtype!r}")
        (dtype,) = dtypes
        if args.isolate not in ("auto", "always", "never"):
            raise bench.BenchArgError(f"--isolate: {args.isolate!r}; allowed: auto, always, never")
        if min(args.batch, args.time_steps, args.jobs) < 1:
            raise bench.BenchArgError("--batch, --time-steps and --jobs must be >= 1")
        memory.run(
            args.size, contexts, remats, dtype, args.batch, args.vocab, args.arch,
            tuple(args.set), args.out, args.jsonl, args.isolate, args.time_steps, args.jobs,
        )  # fmt: skip
    except (bench.BenchArgError, ValueError) as e:  # one line: what and what is allowed
        raise SystemExit(f"profile.py memory: {e}") from None
    return 0


def _add_memory(sub) -> None:
    m = sub.add_parser(
        "memory", help="peak memory of forward / train step per context, with and without remat"
    )
    m.add_argument("--size", default="large", help="tiny, small, medium, large, xl or 2.7B")
    m.add_argument("--contexts", default="128,256,512", help="context lengths")
    m.add_argument("--dtype", default="float32", help="compute dtype: float32 or bfloat16")
    m.add_argument("--remat", default="none,block", help="execution.remat values to compare")
    m.add_argument("--batch", type=int, default=4)
    m.add_argument("--vocab", type=int, default=10_000, help="vocabulary size (CS336: 10000)")
    m.add_argument("--arch", default="gpt2", help="gpt2 or transformer_lm")
    set_help = "a config override, e.g. execution.attention_impl=dot_product_attention (repeatable)"
    m.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=set_help)
    m.add_argument("--out", default="runs/memory", help="PNG and pprof files go here")
    m.add_argument("--jsonl", default=None, help="append one JSON line per config here")
    iso_help = "subprocess per config: auto (when the device has allocator stats), always, never"
    m.add_argument("--isolate", default="auto", help=iso_help)
    m.add_argument("--time-steps", type=int, default=3, help="timed train steps (median)")
    jobs_help = "config processes started ahead (start-up, tracing); compile + run one at a time"
    m.add_argument("--jobs", type=int, default=1, help=jobs_help)
    m.set_defaults(func=_memory)


class UsageError(SystemExit):
    """A one-line error: exit status 2 (as train.py and prepare), the message as its str."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def check_outputs(args: argparse.Namespace) -> None:
    """Refuse output paths the run could not write, before it measures anything (a --jsonl in a
    missing directory failed after the first row): --jsonl a file in an existing directory,
    --out a directory or a path that can become one."""
    jsonl = getattr(args, "jsonl", None)
    if jsonl:  # "" means none, as the runners read it
        path = Path(jsonl)
        if path.is_dir() or not path.parent.is_dir():
            why = "is a directory" if path.is_dir() else f"directory {path.parent} does not exist"
            raise SystemExit(f"profile.py {args.command}: --jsonl {path}: {why}")
    out = getattr(args, "out", None)
    if out is not None:
        first = next(p for p in (Path(out), *Path(out).parents) if p.exists() or p == Path("."))
        if first.exists() and not first.is_dir():
            raise SystemExit(f"profile.py {args.command}: --out {out}: {first} is not a directory")


def main(argv: list[str] | None = None) -> int:
    from jaxllm.console import use_one_line_warnings

    use_one_line_warnings()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    # help strings go through %-formatting (argparse): "%%" prints one "%"
    k = sub.add_parser("kernels", help="Pallas kernels vs XLA and PyTorch: time, GB/s, %% copy")
    k.add_argument("--only", default="", help=f"comma-separated subset of {', '.join(KERNELS)}")
    k.add_argument("--tune", action="store_true", help="also time a few block configs per case")
    k.add_argument("--jsonl", default=None, help="append one JSON line per table row here")
    k.set_defaults(func=_kernels)
    _add_roofline(sub)
    _add_bench(sub)
    _add_breakdown(sub)
    _add_trace(sub)
    _add_nsys(sub)
    _add_memory(sub)
    args, extra = parser.parse_known_args(argv)
    # Only trace and nsys take train.py's trailing --section.key=value overrides.
    if extra and not getattr(args, "overrides_ok", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides = extra
    try:
        check_outputs(args)
        return args.func(args)
    except SystemExit as e:  # the subcommands' one-line errors: "error: ..." and status 2
        if not isinstance(e.code, str):
            raise
        print(f"error: {e.code}", file=sys.stderr)
        raise UsageError(e.code) from None
    except Exception as e:  # out of memory: one line, not XLA's traceback
        from jaxllm.profiling.bench import is_oom

        if not is_oom(e):
            raise
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        hint = " (e.g. --config configs/ar.yaml)" if args.command in ("trace", "nsys") else ""
        message = (
            f"profile.py {args.command}: out of memory ({first[:200]}); use a smaller model or "
            f"batch{hint}"
        )
        print(f"error: {message}", file=sys.stderr)
        raise UsageError(message) from None


if __name__ == "__main__":
    sys.exit(main())
