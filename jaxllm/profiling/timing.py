"""Device-side timing of JAX (and optionally PyTorch) code on a GPU.

JAX: `chained_median_seconds` compiles ONE executable that runs the step `calls` times back to back
on device, each call consuming the previous call's output (so XLA can neither hoist nor dedupe
it) with an optimization barrier between calls (so XLA cannot fuse across them). Several states
are rotated so that, when one call's data fits in L2, a call reads data last touched several calls
earlier. The executable is launched `launches` times back to back before one host sync, so only one
dispatch is exposed per `launches * calls` device calls; the result is the median over `repeats`.
That holds while a launch's device work outlasts its dispatch; for calls of a few microseconds,
`clock="trace"` sums the GPU's own kernel durations from a jax.profiler trace of the launches
instead of the wall clock (copies left out; GPU only).
PyTorch: CUDA events via triton.testing.do_bench (median, with an L2 flush between calls).
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax

from jaxllm.profiling.trace import traced_kernel_seconds

CLOCKS = ("wall", "trace")
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
    unroll: int | None = None,
    clock: Literal["wall", "trace"] = "wall",
) -> float:
    """Median device seconds per `step` call; `step(state) -> state` of the same structure.

    `unroll`: None runs the calls as straight-line code (the program holds `calls` copies of
    step); k: a loop whose iterations run k calls (rounded up to a multiple of the states; calls
    then rounded up to a multiple of that), for steps that compile slowly as straight-line
    copies; the loop adds its per-iteration device-to-host
    sync, a few microseconds per k calls. The compiled program is kept per step function (the
    last 8): pass a plain function, the same object to time it again without recompiling."""
    _check_clock(clock)
    n = len(states)
    per_iter = n * max(1, -(-(unroll or calls) // n))
    calls = per_iter * max(1, -(-calls // per_iter))
    run = _chained_program(step, n, per_iter, calls)
    held = [jax.block_until_ready(run(list(states)))]  # compile and warm up

    def launch():
        held[0] = run(held[0])  # each launch continues from the last one's states
        return held[0]

    return _median_per_call(launch, launches, calls, repeats, clock)


@functools.lru_cache(maxsize=8)  # the same step timed again (trials) is not compiled again
def _chained_program(step: Callable[[Any], Any], n: int, per_iter: int, calls: int) -> Callable:
    """The jitted program of chained_median_seconds: `calls` calls of step over n states,
    `per_iter` of them per loop iteration (straight-line code when per_iter == calls)."""

    def body(states):
        states = list(states)
        for i in range(per_iter):
            states[i % n] = jax.lax.optimization_barrier(step(states[i % n]))
        return states

    @jax.jit
    def run(states):
        if per_iter == calls:
            return body(states)
        return jax.lax.fori_loop(0, calls // per_iter, lambda _, s: body(s), list(states))

    return run


def _check_clock(clock: str) -> None:
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {CLOCKS}, got {clock!r}")


def _launch_n(launch: Callable[[], Any], n: int) -> Any:
    for _ in range(n):
        out = launch()
    return out


def _median_per_call(
    launch: Callable[[], Any], launches: int, calls: int, repeats: int, clock: str = "wall"
) -> float:
    """Median over `repeats` of the seconds per device call when `launches` launches of
    `calls` calls each run back to back before one host sync (`clock`: module docstring)."""
    samples = []
    for _ in range(repeats):
        if clock == "trace":
            seconds = traced_kernel_seconds(lambda: _launch_n(launch, launches))
        else:
            t0 = time.perf_counter()
            jax.block_until_ready(_launch_n(launch, launches))
            seconds = time.perf_counter() - t0
        samples.append(seconds / (launches * calls))
    return statistics.median(samples)


def interleaved_samples(
    launchers: dict[str, Callable[[], Any]],
    calls: int,
    *,
    launches: int = 4,
    repeats: int = 11,
    min_sample_s: float = 5e-3,
    clock: Literal["wall", "trace"] = "wall",
) -> dict[str, list[float]]:
    """Seconds per device call of each launcher (one launch = `calls` device calls), sampled in
    turn: `repeats` rounds, each taking one sample of every launcher (A B C A B C ...), so a
    drift of the GPU's clocks or load hits all of them alike and their ratio stays fair. A sample
    is `n` launches before one host sync, n >= `launches` grown until a sample lasts
    `min_sample_s` (launch latency and the clocks' ramp-up out of idle otherwise dominate
    10-microsecond kernels). Each launcher is warmed up (compiled, loaded) first. `clock`: module
    docstring (the sample length is still sized by the wall clock)."""
    _check_clock(clock)
    n_launch = {}
    for name, launch in launchers.items():
        jax.block_until_ready(launch())
        per_call = _median_per_call(launch, launches, calls, 1)
        n_launch[name] = max(launches, math.ceil(min_sample_s / max(per_call * calls, 1e-9)))
    samples: dict[str, list[float]] = {name: [] for name in launchers}
    for _ in range(repeats):
        for name, launch in launchers.items():
            samples[name].append(_median_per_call(launch, n_launch[name], calls, 1, clock))
    return samples


def live_chain(fn: Callable, n_sets: int, calls: int = 16) -> Callable:
    """The executable `live_chain_seconds` times: `calls` calls of fn on rotated argument sets."""
    call = jax.jit(fn)  # lowered once, however many times it is called

    @jax.jit
    def run(arg_sets):
        arg_sets, outs = list(arg_sets), []
        for i in range(calls):
            out = call(*arg_sets[i % n_sets])
            arg_sets[i % n_sets], out = jax.lax.optimization_barrier((arg_sets[i % n_sets], out))
            outs.append(out)
        return outs

    return run


def live_chain_seconds(
    fn: Callable,
    arg_sets: list,
    *,
    calls: int = 16,
    launches: int = 4,
    repeats: int = 5,
    run: Callable | None = None,
    clock: Literal["wall", "trace"] = "wall",
) -> float:
    """Median device seconds per fn(*args) call, for ops whose output cannot be the next call's
    input (conv1d 'full': L + K - 1 rows out of L).

    As `chained_median_seconds`: one executable makes `calls` calls back to back, rotating
    argument sets so that reads miss L2 (size the list with `rotation_count`), with an
    optimization barrier between calls; it is launched `launches` times per host sync, median of
    `repeats`. Here every call's output is an output of the executable, so XLA can drop none as
    dead code, and no input is returned (which would cost a copy). `run`: `live_chain(...)`,
    possibly compiled ahead (`run.lower(arg_sets).compile()`).
    """
    _check_clock(clock)
    run = run or live_chain(fn, len(arg_sets), calls)
    jax.block_until_ready(run(arg_sets))  # compile and warm up
    return _median_per_call(lambda: run(arg_sets), launches, calls, repeats, clock)


def torch_median_seconds(fn: Callable[[], Any]) -> float:
    """Median seconds of a PyTorch CUDA callable, timed with CUDA events (triton.testing)."""
    from triton.testing import do_bench  # optional: the GPU image has it (with torch)

    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3
