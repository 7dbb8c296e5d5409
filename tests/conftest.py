"""Shared test setup: float64 is enabled per-test where a reference needs it."""

import os

# Tests run on the CPU; keep XLA from grabbing both cores' worth of threads per process.
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")


import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def float64_ref():
    """Call a jnp reference on float64 copies of its array arguments; returns NumPy float64."""

    def call(fn, *args, **kwargs):
        with jax.enable_x64(True):
            args64 = [None if a is None else np.asarray(a, np.float64) for a in args]
            return jax.tree.map(lambda r: np.asarray(r, np.float64), fn(*args64, **kwargs))

    return call
