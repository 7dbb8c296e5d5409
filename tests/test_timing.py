"""jaxllm.profiling.timing: the interleaved sampler's order, counts and sample length."""

import time

import jax.numpy as jnp

from jaxllm.profiling.timing import interleaved_samples


def test_interleaved_samples_alternate_and_grow_short_samples():
    order = []

    def launcher(name, seconds):
        def launch():
            order.append(name)
            time.sleep(seconds)
            return jnp.zeros(())

        return launch

    samples = interleaved_samples(
        {"slow": launcher("slow", 2e-3), "fast": launcher("fast", 1e-4)},
        calls=2,
        launches=1,
        repeats=3,
        min_sample_s=2e-3,
    )
    assert {k: len(v) for k, v in samples.items()} == {"slow": 3, "fast": 3}
    # seconds per call: one launch makes `calls` calls
    assert all(0.9e-3 < s < 5e-3 for s in samples["slow"]), samples["slow"]
    assert all(s < 0.5e-3 for s in samples["fast"]), samples["fast"]
    # after warm-up (1) and calibration (1 launch each), rounds alternate: slow once (its
    # 2 ms launch is a whole sample), fast in as many launches as make 2 ms
    rounds = order[4:]
    fast_run = len(rounds) // 3 - 1
    assert rounds == (["slow"] + ["fast"] * fast_run) * 3
    assert fast_run > 1 and min(samples["fast"]) * 2 * fast_run > 0.8 * 2e-3
