"""The one place that picks how our Pallas kernels are lowered on GPU: the Triton lowering.

Why Triton and not Mosaic GPU (jax's default Pallas GPU backend from 0.10): the three kernels are
row reductions and stencils over 2-D tiles whose shapes are not multiples of a warpgroup tile
(hidden sizes like 768, odd key lengths, ragged tails). The Triton lowering takes masked gathers
over power-of-two tiles, does the cross-thread reductions itself and runs on any sm_80+ card;
benchmarks/RESULTS.md (section "Pallas kernels") has the numbers showing how close to the measured
copy bandwidth this gets on the H100, which bounds what any other backend could gain.

jax 0.11 deprecates the Triton lowering and warns at every lowering (`DeprecationWarning: The
Pallas Triton backend is deprecated and will be removed in a future JAX version.`). We silence
exactly that message, because the choice above is deliberate and the warning fires inside the
caller's jit, where no narrower filter can reach it. When jax drops Triton, this file is the one to
change.
"""

from __future__ import annotations

import warnings

import jax
from jax.experimental.pallas import triton as pltriton

_TRITON_DEPRECATION = r"The Pallas Triton backend is deprecated"


def resolve_interpret(interpret: bool | None) -> bool:
    """`None` means: compile on GPU, interpret everywhere else (CPU tests)."""
    if interpret is None:
        return jax.default_backend() != "gpu"
    return bool(interpret)


# H100 SXM's SM count: the block-size sweeps in benchmarks/RESULTS.md ran there. Interpret mode
# (CPU) has no SMs; it uses this so a CPU test runs the same grid as the H100.
REFERENCE_CORE_COUNT = 132


def core_count() -> int:
    """Streaming multiprocessors of the default device (GPU), for sizing persistent grids."""
    device = jax.devices()[0]
    return int(getattr(device, "core_count", 0) or REFERENCE_CORE_COUNT)


def compiler_params(num_warps: int, num_stages: int = 1) -> pltriton.CompilerParams:
    """Triton compiler parameters; also installs the deprecation filter (see module docstring).

    Called while tracing, before jax lowers the kernel. `filterwarnings` drops an identical filter
    before re-inserting it, so repeated calls do not grow the filter list.
    """
    warnings.filterwarnings("ignore", message=_TRITON_DEPRECATION, category=DeprecationWarning)
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
