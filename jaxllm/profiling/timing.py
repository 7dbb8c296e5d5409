"""Device-side timing of JAX (and optionally PyTorch) code on a GPU.

JAX: `chained_median_seconds` compiles ONE executable that runs the step `calls` times back to back
on device, each call consuming the previous call's output (so XLA can neither hoist nor dedupe
it) with an optimization barrier between calls (so XLA cannot fuse across them). Several states
are rotated so that, when one call's data fits in L2, a call reads data last touched several calls
earlier. The executable is launched `launches` times back to back before one host sync, so only one
dispatch is exposed per `launches * calls` device calls; the result is the median over `repeats`.
PyTorch: CUDA events via triton.testing.do_bench (median, with an L2 flush between calls).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

L2_BYTES = 50 * 2**20  # H100: rotate states until one pass over them is well above this


def rotation_count(bytes_per_call: int, limit: int = 8) -> int:
    """How many independent states to rotate so consecutive reads miss a 50 MB L2."""
    return max(1, min(limit, -(-4 * L2_BYTES // max(bytes_per_call, 1))))


def chained_median_seconds(
    step: Callable[[Any], Any],
    states: Sequence[Any],
    *,
    calls: int = 16,
    launches: int = 4,
    repeats: int = 5,
) -> float:
    """Median device seconds per `step` call; `step(state) -> state` of the same structure."""
    n = len(states)
    calls = n * max(1, -(-calls // n))

    @jax.jit
    def run(states):
        states = list(states)
        for i in range(calls):
            states[i % n] = jax.lax.optimization_barrier(step(states[i % n]))
        return states

    states = jax.block_until_ready(run(list(states)))  # compile and warm up
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(launches):
            states = run(states)
        jax.block_until_ready(states)
        samples.append((time.perf_counter() - t0) / (launches * calls))
    return statistics.median(samples)


def torch_median_seconds(fn: Callable[[], Any]) -> float:
    """Median seconds of a PyTorch CUDA callable, timed with CUDA events (triton.testing)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3
