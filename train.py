"""Train a model from a YAML preset: `python train.py [--config configs/X.yaml] [--a.b=value ...]`.

With no arguments it runs the associative-recall preset (configs/ar.yaml) on the CPU.
Several hosts: the same command on each, with --parallel.coordinator_address=HOST:PORT
--parallel.num_processes=N --parallel.process_id=I (or $JAX_COORDINATOR_ADDRESS,
$JAX_NUM_PROCESSES, $JAX_PROCESS_ID); see jaxllm/distributed.py.
"""

from __future__ import annotations

from jaxllm.xla_flags import apply_default_xla_flags

apply_default_xla_flags()  # before jax is imported: XLA reads its flags then

import argparse
import errno
import sys
import traceback
from pathlib import Path

import jax

from jaxllm import distributed
from jaxllm.config import ConfigError, load_config
from jaxllm.console import use_one_line_warnings
from jaxllm.train.checkpoint import CheckpointSaveError
from jaxllm.train.loop import NonFiniteLossError, train
from jaxllm.train.run_lock import RunDirLockedError

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "ar.yaml"
# OSErrors about a path the user gave (read-only, not a directory, no permission, no space):
# one error line; any other OSError keeps its traceback.
USER_ERRNOS = frozenset(
    {errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EISDIR, errno.ENOSPC,
     errno.ENAMETOOLONG, errno.ENOENT, errno.EEXIST}
)  # fmt: skip


def _who() -> str:
    """'process I: ' in a multi-process run (each process reports its own errors), else ''."""
    if not jax.distributed.is_initialized():
        return ""
    return f"process {jax.process_index()}: "


def main(argv: list[str] | None = None) -> int:
    """The exit status; in a multi-process run each process ends in distributed.finish: all
    together after success, at once after an error (one line, or the traceback)."""
    try:
        code = _main(argv)
    except SystemExit as e:  # parser.exit: the error line is out
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    except BaseException as e:
        if not jax.distributed.is_initialized():
            raise
        lost = distributed.peer_lost(e)
        if lost:
            print(f"error: {_who()}{lost}", file=sys.stderr)
        else:
            traceback.print_exc()
        code = 1
    return distributed.finish(code)


def _main(argv: list[str] | None) -> int:
    use_one_line_warnings()
    parser = argparse.ArgumentParser(
        description=__doc__,
        epilog="Any config field can be overridden: --model.n_layers=4 --train.steps 500",
    )
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML preset")
    args, overrides = parser.parse_known_args(argv)
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        parser.exit(2, f"error: {e}\n")
    try:
        result = train(cfg)  # starts the process group of a multi-host run first
    except (
        ConfigError,
        FileNotFoundError,
        FileExistsError,  # checkpoints in the run dir and --train.resume=false
        ImportError,  # an optional extra a preset needs (e.g. `datasets` for IWSLT14's hub data)
        ValueError,
        RunDirLockedError,
        CheckpointSaveError,
    ) as e:
        parser.exit(2, f"error: {_who()}{e}\n")  # bad data or settings, a busy run dir: one line
    except OSError as e:  # the run dir or a data path the machine refuses: one line too
        if e.errno not in USER_ERRNOS:
            raise  # anything else keeps its traceback
        parser.exit(2, f"error: {_who()}{e}\n")
    except NonFiniteLossError as e:
        parser.exit(1, f"error: {_who()}{e}\n")
    if not distributed.is_primary():
        return 0  # process 0 reports
    bleu = "" if result.bleu != result.bleu else f" | BLEU {result.bleu:.2f}"  # NaN: no BLEU
    ran = result.final_step > result.start_step  # a finished run re-run trains no step
    train_loss = f"{result.train_loss:.4f}" if ran else "-"
    print(
        f"done: ran {result.final_step - result.start_step} steps "
        f"({result.start_step} -> {result.final_step}) in {result.wall_time_s:.1f} s | train loss "
        f"{train_loss} | eval loss {result.eval_loss:.4f} | "
        f"eval accuracy {result.eval_accuracy:.4f}{bleu} | run dir {cfg.train.run_dir}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
