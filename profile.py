"""Profiling CLI. Subcommands:

  kernels   benchmark the Pallas kernels against XLA and PyTorch (jaxllm/profiling/kernel_bench.py)
  roofline  FLOPs, bytes, intensity and roofline verdicts per op (jaxllm/profiling/roofline.py)

Run on a GPU: `python profile.py kernels [--tune] [--only softmax,layer_norm,conv1d]`.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import sysconfig

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    # help strings go through %-formatting (argparse): "%%" prints one "%"
    k = sub.add_parser("kernels", help="Pallas kernels vs XLA and PyTorch: time, GB/s, %% copy")
    k.add_argument("--only", default="", help=f"comma-separated subset of {', '.join(KERNELS)}")
    k.add_argument("--tune", action="store_true", help="also time a few block configs per case")
    k.add_argument("--jsonl", default=None, help="append one JSON line per table row here")
    k.set_defaults(func=_kernels)
    _add_roofline(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
