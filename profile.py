"""Profiling CLI: `python profile.py SUBCOMMAND [flags] [--section.key=value ...]`.

  kernels    the Pallas kernels against XLA and PyTorch: time, GB/s, % of copy (needs a GPU)
  roofline   FLOPs, bytes, intensity and roofline verdicts per op of a layer; the conv1d question
  bench      end-to-end time of forward / backward / train step over sizes x contexts (CS336 5.2)
  breakdown  one layer's time per component next to its FLOP share
  trace      jax.profiler trace of train steps (TensorBoard), top kernels per step, HLO
  nsys       `trace --nvtx` under Nsight Systems, then `nsys stats` per phase
  memory     peak memory of forward / train step per context, with and without remat
  scaling    DP / FSDP / PP step time and efficiency over 1..64 GPUs on paper, vs measured rows

Config overrides are train.py's: --execution.kernels=pallas --train.batch_size=16 ... Without a
GPU every subcommand picks a CPU-sized model on the XLA path and says so in its first line.
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
    # imports. Load the real one and put it in sys.modules: importers get whatever sys.modules
    # holds once this file has run.
    _spec = importlib.util.spec_from_file_location(
        "profile", os.path.join(sysconfig.get_paths()["stdlib"], "profile.py")
    )
    _stdlib_profile = importlib.util.module_from_spec(_spec)
    sys.modules["profile"] = _stdlib_profile
    _spec.loader.exec_module(_stdlib_profile)

# jaxllm (and so jax) is imported inside the subcommands: the parser and --help stay fast, and
# XLA's flags are set before jax's backend starts (_backend).
ROOT = Path(__file__).resolve().parent
KERNELS = ("softmax", "layer_norm", "conv1d")
CONTEXTS = (128, 256, 512, 1024)
# harness.SIZES and bench.MODES, named here so that building the parser imports no jax
SIZES = ("tiny", "small", "medium", "large", "xl", "2.7B")
MODES = ("logits", "forward", "forward_backward", "train_step")
OVERRIDES = (
    "Config overrides as train.py takes them: --execution.kernels=pallas --train.batch_size=16"
)


def _ints(text: str) -> tuple[int, ...]:
    """'128,1024' -> (128, 1024), each >= 1 (an argparse type)."""
    try:
        items = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        items = ()
    if not items or min(items) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return items


def _names(*allowed: str):
    """An argparse type: 'a,b' -> ('a', 'b'), each one of `allowed`."""

    def parse(text: str) -> tuple[str, ...]:
        items = tuple(x.strip() for x in text.split(",") if x.strip())
        bad = [x for x in items if x not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{bad or text!r}; allowed: {', '.join(allowed)}")
        return items

    return parse


def _count(text: str) -> int:
    """An argparse type: an integer >= 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


def _positive(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _backend(prealloc: bool = True) -> bool:
    """Set XLA's flags, start jax's backend, say whether it is a GPU. prealloc False: this
    process allocates on demand (it only reads the device, or shares it with PyTorch); the
    environment its children inherit stays as it was."""
    from jaxllm.xla_flags import apply_default_xla_flags

    apply_default_xla_flags()  # before the backend starts: XLA reads its flags then
    key, old = "XLA_PYTHON_CLIENT_PREALLOCATE", os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE")
    if not prealloc:
        os.environ[key] = "false"
    import jax

    try:
        return jax.default_backend() == "gpu"
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


def _no_gpu(what: str, how: str, kernels: str) -> None:
    path = "the XLA path" if kernels == "xla" else "Pallas kernels, interpreted"
    print(f"no GPU: {what} on {path}; pass {how} for another", flush=True)


def _fitting(contexts: tuple[int, ...], limit: int) -> tuple[int, ...]:
    return tuple(t for t in contexts if t <= limit) or (limit,)


# ----------------------------------------------------------------------------- subcommands
def _kernels(args: argparse.Namespace, overrides: list[str]) -> None:
    from jaxllm.profiling.harness import BadInput

    if not _backend(prealloc=False):  # on demand: PyTorch's baselines share the GPU
        raise BadInput("needs a GPU (jax's backend here is not 'gpu'); the kernels' analytic "
                         "roofline runs anywhere: python profile.py roofline")  # fmt: skip
    import pallas_kernels
    from jaxllm.profiling import kernel_bench

    if (missing := pallas_kernels.triton_refusal()) is not None:
        raise BadInput(f"times the Triton kernels: they need {missing}")
    kernel_bench.run(list(args.only), tune=args.tune, jsonl_path=args.jsonl)


def _roofline(args: argparse.Namespace, overrides: list[str]) -> None:
    from jaxllm.config import load_config
    from jaxllm.profiling import roofline
    from jaxllm.profiling.harness import BadInput

    if args.conv and len(args.conv) != 4:
        raise BadInput(f"--conv takes B,L,D,K, got {','.join(map(str, args.conv))}")
    base = [] if args.config else ["--train.batch_size=4"]
    cfg = load_config(args.config, base + overrides)
    print(roofline.report(
        cfg.model, cfg.train.batch_size, dtype=args.dtype, device=args.device, conv=args.conv,
        conv_padding=args.conv_padding, peak_tflops=args.peak_tflops, peak_gbps=args.peak_gbps,
        png=args.png, measured=args.measured,
    ))  # fmt: skip


def _bench(args: argparse.Namespace, overrides: list[str]) -> None:
    if args.torch:
        from jaxllm.profiling.torch_reference import require_torch

        require_torch(cuda=True)
    gpu = _backend(prealloc=False)  # the sweep's children allocate as a plain run does
    from jaxllm.profiling import bench
    from jaxllm.profiling.harness import CS336_SIZES, size_config

    sizes = args.sizes or (CS336_SIZES if gpu else ("tiny",))
    base = size_config(sizes[0], overrides)  # bad overrides: one line before anything runs
    if not (args.sizes or gpu):
        _no_gpu("benching size tiny", "--sizes small,...", base.execution.kernels)
    limit = min(size_config(s, overrides).model.context_length for s in sizes)
    sweep = bench.Sweep(
        sizes=sizes, contexts=args.contexts or _fitting(CONTEXTS, limit),
        dtypes=args.dtypes or (base.execution.compute_dtype,),
        modes=args.modes or bench.DEFAULT_MODES,
        overrides=tuple(overrides), warmup=args.warmup, samples=args.samples, group=args.group,
        torch=args.torch, torch_compile=args.torch_compile,
        compile_workers=args.compile_workers, isolate=args.isolate,
    )  # fmt: skip
    bench.run(sweep, jsonl_path=args.jsonl, progress=not args.no_progress)


def _breakdown(args: argparse.Namespace, overrides: list[str]) -> None:
    gpu = _backend()
    from jaxllm.profiling import breakdown
    from jaxllm.profiling.harness import size_config

    size = args.size or ("small" if gpu else "tiny")
    cfg = size_config(size, overrides)
    if not (args.size or gpu):
        _no_gpu("timing a layer of size tiny", "--size small", cfg.execution.kernels)
    context = args.context or min(1024, cfg.model.context_length)
    breakdown.run(cfg.model, cfg.execution, size, cfg.train.batch_size, context, warmup=args.warmup,
                  group=args.group, samples=args.samples, jsonl_path=args.jsonl)  # fmt: skip


def _trace(args: argparse.Namespace, overrides: list[str]) -> None:
    gpu = _backend()
    import jax

    from jaxllm.config import load_config
    from jaxllm.ops import plan_ops
    from jaxllm.profiling import trace

    config = args.config or ROOT / ("configs/gpt2_124m.yaml" if gpu else "configs/ar.yaml")
    cfg = load_config(config, overrides)
    if not (args.config or gpu):
        _no_gpu("tracing configs/ar.yaml", "--config configs/...", cfg.execution.kernels)
    m, ex = cfg.model, cfg.execution
    print(f"trace: {m.arch} d_model {m.d_model}, {m.n_layers} layers, context "
          f"{m.context_length}, batch {cfg.train.batch_size}, {ex.compute_dtype}, "
          f"remat {ex.remat}; "
          f"{args.warmup} warm-up + {args.samples} {'NVTX-ranged' if args.nvtx else 'traced'} "
          f"train steps; device {jax.devices()[0].device_kind}, jax {jax.__version__}")  # fmt: skip
    print(plan_ops(m, ex).describe(), flush=True)  # which paths run
    res = trace.trace_train_steps(cfg, args.out, args.warmup, args.samples, args.nvtx, args.top)
    if args.nvtx:
        print("phases (host ms per step, each synced):",
              ", ".join(f"{p} {ms:.2f}" for p, ms in res.phase_ms.items()))  # fmt: skip
        print(
            f"NVTX ranges warmup, steps, {', '.join(trace.PHASES)} via {trace.nvtx_source()}"
            f" (none: XLA's own ranges still name each program); wrote {res.hlo_path}"
        )
        return
    print(trace.format_summary(res.summary, jax.default_backend()))
    print(f"\nwrote {trace.latest_profile_dir(res.trace_dir)} (*.xplane.pb, *.trace.json.gz, "
          f"perfetto_trace.json.gz) and {res.hlo_path} (optimized HLO)\nopen: pip install -e "
          f'".[profile]" && tensorboard --logdir {res.trace_dir}  (Profile tab), or '
          "perfetto_trace.json.gz in https://ui.perfetto.dev")  # fmt: skip


def _nsys(args: argparse.Namespace, overrides: list[str]) -> None:
    from jaxllm.profiling import trace

    trace_args = [f"--warmup={args.warmup}", f"--samples={args.samples}", *overrides]
    trace_args += [f"--config={args.config}"] if args.config else []
    trace.run_nsys(args.out, trace_args, args.nsys_bin)


def _memory(args: argparse.Namespace, overrides: list[str]) -> None:
    gpu = _backend(prealloc=False)  # this process only reads device stats
    from jaxllm.profiling import memory
    from jaxllm.profiling.harness import size_config

    size = args.size or ("large" if gpu else "tiny")
    cfg = size_config(size, overrides)
    if not (args.size or gpu):
        _no_gpu("measuring size tiny", "--size large", cfg.execution.kernels)
    contexts = args.contexts or _fitting(CONTEXTS[:3], cfg.model.context_length)
    memory.run(size, contexts, args.remats, overrides, args.out, args.jsonl, args.isolate,
               args.samples)  # fmt: skip


def _scaling(args: argparse.Namespace, overrides: list[str]) -> None:
    from jaxllm.config import load_config
    from jaxllm.profiling import scaling
    from jaxllm.profiling.harness import BadInput

    missing = [f for f in args.measured if not Path(f).is_file()]
    if missing or not 0 <= args.overlap <= 1:
        raise BadInput(f"--measured {missing[0]}: no such file" if missing else
                       f"--overlap {args.overlap}: must be in [0, 1]")  # fmt: skip
    rows = scaling.read_rows(args.measured)
    ok = {r["variant"]: r for r in rows if r.get("status") == "ok"}  # the last row per variant
    one = ok.get("single", {})
    batch = args.per_device_batch or one.get("setup", {}).get("per_device_batch") or 32
    step = args.step_ms or one.get("step_ms")
    config = args.config or one.get("setup", {}).get("config") or ROOT / "configs/gpt2_124m.yaml"
    cfg = load_config(config, [*one.get("setup", {}).get("overrides", ()), *overrides])
    s = scaling.setup_for(cfg.model, batch, step, args.overlap)
    anchor = "measured" if step else f"{scaling.ANCHOR_TFLOPS:.0f} TFLOP/s, H200 GPT-2 124M"
    print(f"scaling on paper: {cfg.model.arch} {s.n_params / 1e6:.1f}M params, {batch} x "
          f"{s.context} tokens per GPU; one GPU {s.step_ms:.1f} ms a step ({anchor}); "
          f"collectives at {scaling.ring_gbps(1):.0f} GB/s per GPU in a "
          f"host of {scaling.GPUS_PER_HOST}, {scaling.ring_gbps(10**6):.0f} across hosts (sends "
          f"{scaling.send_gbps(10**6):.0f}): {scaling.ACHIEVED:.0%} of NVLink's and InfiniBand's "
          f"line rates; {s.overlap:.0%} hidden behind compute")  # fmt: skip
    table = scaling.table(s, args.gpus)
    print(scaling.format_table(table))
    checked = scaling.compare(s, rows)
    if checked:
        print("\nmeasured vs predicted:")
        for c in checked:
            m_ = f" M={c['microbatches']}" if c["microbatches"] else ""
            m_ += f" V={c['virtual']}" if c["virtual"] > 1 else ""
            eff = "-" if c["measured_eff"] is None else f"{c['measured_eff']:.0%}"
            print(f"  {c['variant']:>4} N={c['devices']}{m_}: {c['measured_ms']:.1f} ms vs "
                  f"{c['predicted_ms']:.1f} predicted; efficiency {eff} vs "
                  f"{c['predicted_eff']:.0%}")  # fmt: skip
    if args.png:
        scaling.plot(table, checked, args.png)
        print(f"wrote {args.png}")


# ----------------------------------------------------------------------------- the parser
def _timing(p: argparse.ArgumentParser, warmup: int, samples: int, group: int | None) -> None:
    p.add_argument("--warmup", type=int, default=warmup, help="untimed calls (or steps) first")
    p.add_argument("--samples", type=_count, default=samples, help="timed samples")
    if group:
        p.add_argument("--group", type=_count, default=group, help="calls per sample")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, func, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, allow_abbrev=False, epilog=OVERRIDES)
        p.set_defaults(func=func)
        return p

    jsonl = dict(default=None, help="append a JSON line per row here")
    isolate = dict(default="auto", choices=("auto", "always", "never"),
                   help="child processes (auto: on a GPU)")  # fmt: skip
    # help strings go through %-formatting (argparse): "%%" prints one "%"
    k = add("kernels", _kernels, "Pallas kernels vs XLA and PyTorch: time, GB/s, %% of copy")
    k.add_argument("--only", type=_names(*KERNELS), default=KERNELS, help=", ".join(KERNELS))
    k.add_argument("--tune", action="store_true", help="also time a few block configs")
    k.add_argument("--jsonl", **jsonl)

    r = add("roofline", _roofline, "per-op FLOPs, bytes, intensity, roofline verdicts, PNG")
    r.add_argument("--config", default=None, help="YAML preset (default: GPT-2 small, batch 4)")
    r.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"),
                   help="element dtype analysed")  # fmt: skip
    r.add_argument("--device", default="H100", type=str.upper, choices=("A100", "T4", "H100"))
    r.add_argument("--conv", type=_ints, default=None, metavar="B,L,D,K",
                   help="the conv1d question at this shape instead of a layer")  # fmt: skip
    r.add_argument("--conv-padding", default="full", choices=("full", "causal", "same"))
    r.add_argument("--peak-tflops", type=_positive, default=None, help="measured peak TFLOP/s")
    r.add_argument("--peak-gbps", type=_positive, default=None, help="measured memory GB/s")
    r.add_argument("--png", default=None, help="write the roofline plot here")
    r.add_argument("--measured", nargs="+", default=(), metavar="FILE", help="JSONL rows")

    b = add("bench", _bench, "end-to-end time of forward / backward / train step (CS336 5.2)")
    b.add_argument(
        "--sizes", type=_names(*SIZES), default=None, help="default: small..2.7B; no GPU: tiny"
    )
    b.add_argument("--contexts", type=_ints, default=None, help="default: 128..1024 that fit")
    b.add_argument("--dtypes", type=_names("float32", "bfloat16"), default=None,
                   help="compute dtypes (default: the model's)")  # fmt: skip
    b.add_argument("--modes", type=_names(*MODES), default=None,
                   help=f"{', '.join(MODES)} (default: the last three)")  # fmt: skip
    _timing(b, warmup=5, samples=10, group=1)
    b.add_argument("--torch", action="store_true", help="also PyTorch, eager and compiled")
    b.add_argument("--torch-compile", default="regional", choices=("regional", "model"))
    b.add_argument("--compile-workers", type=_count, default=8, help="compile threads")
    b.add_argument("--isolate", **isolate)
    b.add_argument("--jsonl", **jsonl)
    b.add_argument("--no-progress", action="store_true", help="no tqdm bar")

    d = add("breakdown", _breakdown, "one layer: time per component vs its FLOP share")
    d.add_argument("--size", choices=SIZES, default=None, help="default: small; no GPU: tiny")
    d.add_argument("--context", type=_count, default=None, help="default: 1024 or the model's")
    _timing(d, warmup=3, samples=5, group=10)
    d.add_argument("--jsonl", **jsonl)

    for name, func, help in (
        ("trace", _trace, "jax.profiler trace of train steps (TensorBoard), top kernels, HLO"),
        ("nsys", _nsys, "Nsight Systems: `trace --nvtx` under nsys profile, then nsys stats"),
    ):
        t = add(name, func, help)
        t.add_argument("--out", required=True, help="output directory")
        t.add_argument(
            "--config", default=None, help="default: GPT-2 124M; no GPU: configs/ar.yaml"
        )
        _timing(t, warmup=3, samples=3, group=None)
    sub.choices["nsys"].add_argument("--nsys-bin", default="nsys", help="the nsys executable")
    t = sub.choices["trace"]
    t.add_argument("--top", type=_count, default=30, help="kernels in the table")
    t.add_argument("--nvtx", action="store_true", help="phases in NVTX ranges, for nsys")

    s = add("scaling", _scaling, "DP / FSDP / PP over 1..64 GPUs on paper, vs measured rows")
    s.add_argument("--config", default=None,
                   help="YAML preset (default: the measured rows', else GPT-2 124M)")  # fmt: skip
    s.add_argument("--per-device-batch", type=_count, default=None,
                   help="rows per GPU (default: the measured single row's, else 32)")  # fmt: skip
    s.add_argument("--step-ms", type=_positive, default=None,
                   help="measured one-GPU step (default: the measured single row's, else "
                   "from the H200 FLOP rate)")  # fmt: skip
    s.add_argument("--overlap", type=float, default=0.0, help="fraction of collectives hidden")
    s.add_argument("--gpus", type=_ints, default=(1, 2, 4, 8, 16, 64), help="GPU counts")
    s.add_argument("--measured", nargs="+", default=(), metavar="FILE",
                   help="parallel_throughput.py --jsonl rows")  # fmt: skip
    s.add_argument("--png", default=None, help="write tokens/s and efficiency per GPU count")

    m = add("memory", _memory, "peak memory of forward / train step per context, remat or not")
    m.add_argument("--size", choices=SIZES, default=None, help="default: large; no GPU: tiny")
    m.add_argument("--contexts", type=_ints, default=None, help="default: 128,256,512 that fit")
    m.add_argument("--remats", type=_names("none", "block"), default=("none", "block"))
    m.add_argument("--samples", type=_count, default=3, help="timed train steps")
    m.add_argument("--isolate", **isolate)
    m.add_argument("--out", default="runs/memory", help="PNG and pprof files go here")
    m.add_argument("--jsonl", **jsonl)
    return parser


class UsageError(SystemExit):
    """A one-line error: exit status 2 (as train.py), the message as its str."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def check_outputs(args: argparse.Namespace) -> None:
    """Refuse output paths the run could not write, before it measures anything."""
    from jaxllm.profiling.harness import BadInput

    for flag in ("jsonl", "png"):
        path = getattr(args, flag, None)
        if path and (Path(path).is_dir() or not Path(path).parent.is_dir()):
            why = "is a directory" if Path(path).is_dir() else f"no directory {Path(path).parent}"
            raise BadInput(f"--{flag} {path}: {why}")
    out = getattr(args, "out", None)
    if out is not None:
        first = next(p for p in (Path(out), *Path(out).parents) if p.exists() or p == Path("."))
        if first.exists() and not first.is_dir():
            raise BadInput(f"--out {out}: {first} is not a directory")


def main(argv: list[str] | None = None) -> int:
    from jaxllm.console import use_one_line_warnings

    use_one_line_warnings()
    parser = _parser()
    args, overrides = parser.parse_known_args(argv)
    if args.command == "kernels" and overrides:
        parser.error(f"unrecognized arguments: {' '.join(overrides)}")
    try:
        check_outputs(args)
        args.func(args, overrides)
        return 0
    except Exception as e:
        message = _one_line(e, args.command)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        raise UsageError(message) from None


def _one_line(e: Exception, command: str) -> str | None:
    """The one-line error for bad input, a missing tool and out of memory; None: a traceback."""
    from jaxllm.config import ConfigError
    from jaxllm.profiling.harness import BadInput, is_oom
    from jaxllm.profiling.torch_reference import TorchUnavailableError
    from jaxllm.profiling.trace import NsysError

    if isinstance(e, ConfigError | BadInput | TorchUnavailableError | NsysError):
        return f"profile.py {command}: {e}"
    if not is_oom(e):
        return None
    first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
    hint = " (e.g. --config configs/ar.yaml)" if command in ("trace", "nsys") else ""
    return (
        f"profile.py {command}: out of memory ({first[:200]}); use a smaller model or batch{hint}"
    )


if __name__ == "__main__":
    sys.exit(main())
