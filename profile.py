"""Profiling CLI. Subcommands:

  kernels   benchmark the Pallas kernels against XLA and PyTorch (jaxllm/profiling/kernel_bench.py)

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    # help strings go through %-formatting (argparse): "%%" prints one "%"
    k = sub.add_parser("kernels", help="Pallas kernels vs XLA and PyTorch: time, GB/s, %% copy")
    k.add_argument("--only", default="", help=f"comma-separated subset of {', '.join(KERNELS)}")
    k.add_argument("--tune", action="store_true", help="also time a few block configs per case")
    k.add_argument("--jsonl", default=None, help="append one JSON line per table row here")
    k.set_defaults(func=_kernels)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
