"""`train.trace_steps`: a jax.profiler trace of a range of the training loop's updates, for
TensorBoard's profile plugin (`profile.py trace` analyses such traces)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax


def latest_profile_dir(log_dir: str | Path) -> Path:
    """The newest LOG_DIR/plugins/profile/<timestamp>/ that jax.profiler wrote."""
    runs = [p for p in (Path(log_dir) / "plugins" / "profile").glob("*") if p.is_dir()]
    if not runs:
        raise FileNotFoundError(f"no jax.profiler trace under {log_dir}/plugins/profile")
    return max(runs, key=lambda p: p.stat().st_mtime)


class StepRangeTrace:
    """`train.trace_steps: [start, end]`: a jax.profiler trace of updates start .. end - 1
    (numbered as the log numbers them: the n-th update is step n) into `log_dir`. The trace
    starts before update `start` (or the first one in range, when a resumed run begins past
    it) and stops after update end - 1, once the device has finished it. Each traced update
    is a StepTraceAnnotation, so TensorBoard's profile plugin shows per-step times."""

    def __init__(
        self, steps: tuple[int, ...] | None, log_dir: Path, say: Callable[[str, int], None]
    ) -> None:
        self.start, self.end = steps if steps else (0, 0)
        self.log_dir, self.say = log_dir, say  # say(message, the update it is about)
        self.active = False
        self._step: jax.profiler.StepTraceAnnotation | None = None
        self._first = self._last = 0

    def before_step(self, n: int) -> None:
        """Call before update n (1-based)."""
        if not self.active and self.start <= n < self.end:
            jax.profiler.start_trace(str(self.log_dir), create_perfetto_trace=True)
            self.active, self._first = True, n
            self.say(
                f"trace: recording steps {n}..{self.end - 1} with jax.profiler into "
                f"{self.log_dir} (tensorboard --logdir {self.log_dir})",
                n,
            )
        if self.active:
            self._last = n
            self._step = jax.profiler.StepTraceAnnotation("train", step_num=n)
            self._step.__enter__()

    def after_step(self, n: int, result: Any) -> None:
        """Call after update n with its outputs: stops (synced) after the last traced one."""
        if self._step is not None:
            self._step.__exit__(None, None, None)
            self._step = None
        if self.active and n >= self.end - 1:
            jax.block_until_ready(result)
            self.stop(n)

    def stop(self, last: int | None = None) -> None:
        """Stop and write the trace (also when the run ends or fails inside the range)."""
        if not self.active:
            return
        if self._step is not None:
            self._step.__exit__(None, None, None)
            self._step = None
        self.active = False
        jax.profiler.stop_trace()
        upto = f"..{last}" if last is not None else " until the run stopped"
        self.say(
            f"trace: wrote steps {self._first}{upto} to {latest_profile_dir(self.log_dir)}",
            self._last if last is None else last,
        )
