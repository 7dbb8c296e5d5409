"""jaxllm.profiling.timing: the interleaved sampler's order, counts and sample length; the
chained timer's program size; the trace clock's sum of kernel durations."""

import time

import jax.numpy as jnp
import pytest

from jaxllm.profiling.timing import chained_median_seconds, interleaved_samples
from jaxllm.profiling.trace import kernel_seconds


def test_interleaved_samples_alternate_and_grow_short_samples():
    order = []

    def launcher(name, seconds):
        def launch():
            order.append(name)
            if seconds:
                time.sleep(seconds)
            return jnp.zeros(())

        return launch

    samples = interleaved_samples(
        {"slow": launcher("slow", 5e-3), "fast": launcher("fast", 0.0)},
        calls=2,
        launches=1,
        repeats=3,
        min_sample_s=5e-3,
    )
    assert {k: len(v) for k, v in samples.items()} == {"slow": 3, "fast": 3}
    # seconds per call (one launch makes `calls` = 2 calls): a sleep never ends early
    assert min(samples["slow"]) >= 2.5e-3, samples["slow"]
    assert max(samples["fast"]) < min(samples["slow"]), samples
    # after warm-up and calibration (2 launches each), rounds alternate: slow once (its 5 ms
    # launch is a whole sample), fast in as many launches as make 5 ms (however loaded the CPU)
    rounds = order[4:]
    fast_run = len(rounds) // 3 - 1
    assert rounds == (["slow"] + ["fast"] * fast_run) * 3
    assert fast_run > 1


def test_chained_timing_unroll_bounds_the_copies_of_the_step():
    """unroll=k puts k copies of the step in the program (a loop of them), not `calls`."""
    traced = []

    def step(x):
        traced.append(1)
        return x + 1

    x = jnp.zeros(4)
    for unroll, copies in ((None, 8), (2, 2), (3, 4)):  # 3 -> 4: a multiple of the two states
        traced.clear()
        states = [x] * (2 if unroll == 3 else 1)
        assert (
            chained_median_seconds(step, states, calls=8, launches=1, repeats=1, unroll=unroll) > 0
        )
        assert len(traced) == copies
    chained_median_seconds(step, [x, x], calls=8, launches=1, repeats=1, unroll=3)
    assert len(traced) == 4  # the same step again: the kept program, not traced anew


def test_trace_clock_sums_gpu_kernels_without_copies():
    meta = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #13"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 8, "args": {"name": "XLA Ops"}},
    ]
    events = meta + [
        {"ph": "X", "pid": 1, "tid": 7, "name": "conv_fwd_mosaic_gpu_kernel", "dur": 2.5},
        {"ph": "X", "pid": 1, "tid": 7, "name": "loop_slice_fusion", "dur": 1.0},
        {"ph": "X", "pid": 1, "tid": 7, "name": "MemcpyD2D", "dur": 9.0},  # the chain's copies
        {"ph": "X", "pid": 1, "tid": 7, "name": "memcpy32_post", "dur": 9.0},
        {"ph": "X", "pid": 2, "tid": 3, "name": "host op", "dur": 50.0},
        {"ph": "X", "pid": 1, "tid": 8, "name": "fusion.3", "dur": 3.5},  # the same time again
    ]
    assert kernel_seconds(events) == pytest.approx(3.5e-6)
    with pytest.raises(ValueError, match="no GPU kernel events"):
        kernel_seconds(meta)


def test_trace_clock_is_refused_without_gpu_kernels_and_unknown_clocks_are_named():
    x = jnp.zeros(4)
    with pytest.raises(ValueError, match="no GPU kernel events"):  # CPU: XLA:CPU ops only
        chained_median_seconds(lambda x: x + 1, [x], calls=2, launches=1, repeats=1, clock="trace")
    with pytest.raises(ValueError, match="clock must be one of"):
        chained_median_seconds(lambda x: x + 2, [x], calls=2, launches=1, repeats=1, clock="host")
