"""The one place that picks how our Pallas kernels are lowered on GPU: Triton or Mosaic GPU.

Every public kernel function takes `backend: str = "triton"`; `check_backend` validates it here, so
the choice and its rules live in one module:

* "triton" (the default): Pallas' Triton lowering. The kernels are row reductions and stencils over
  2-D tiles whose shapes need not be multiples of a warpgroup tile (hidden sizes like 768, odd key
  lengths, ragged tails): Triton takes masked gathers over power-of-two tiles, does the
  cross-thread reductions itself and runs on any sm_80+ card; benchmarks/RESULTS.md (section
  "Pallas kernels") has its H100 numbers against the measured copy bandwidth.
* "mosaic_gpu": Pallas' Mosaic GPU lowering (`jax.experimental.pallas.mosaic_gpu`, Hopper+), in
  the `*_mgpu.py` modules: TMA copies of whole row blocks into shared memory, explicit register
  layouts. They assume aligned shapes (each says which, and refuses others with a ValueError) and
  compile only on a GPU: no interpret mode, and no silent fallback to Triton.
  benchmarks/mosaic_gpu_check.py measures both side by side; the default changes only where
  Mosaic GPU measures at least as fast. So far that is the fused cross-entropy's training pass:
  its Mosaic kernel keeps each row of logits in shared memory between its two sweeps, 1.58x the
  Triton kernel at GPT-2's batch 64 on the H100 (benchmarks/RESULTS.md); `mosaic_loss_refusal`
  says where it cannot run, and jaxllm.ops asks it. A forward without gradient stays on the
  Triton kernel, which reads each row once and writes nothing (`linear_cross_entropy` says so).
  The norm, softmax and conv kernels stay on Triton, which measured faster.

jax 0.11 deprecates the Triton lowering and warns at every lowering (`DeprecationWarning: The
Pallas Triton backend is deprecated and will be removed in a future JAX version.`). We silence
exactly that message, because the choice above is deliberate and the warning fires inside the
caller's jit, where no narrower filter can reach it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax
from jax.experimental.pallas import triton as pltriton

_TRITON_DEPRECATION = r"The Pallas Triton backend is deprecated"

BACKENDS = ("triton", "mosaic_gpu")


def first_order_only(kernel: str, fn: Callable, *arrays: Any) -> Any:
    """fn(*arrays), a kernel's gradient pass, as a function JAX may not differentiate again: a
    second derivative through `kernel` (jax.hessian, grad of grad) raises this clear error
    instead of failing deep inside Pallas, whose calls have no JVP rule. First derivatives
    never differentiate the gradient pass, so they are unaffected."""
    f = jax.custom_jvp(fn)

    @f.defjvp
    def _jvp(primals, tangents):
        raise NotImplementedError(
            f"{kernel}: the Pallas kernel has first derivatives only. For a second derivative "
            "(jax.hessian, grad of grad) use its jnp reference (pallas_kernels.*_ref) or the "
            "model's xla paths (execution.kernels: xla, execution.loss_impl: xla)"
        )

    return f(*arrays)


def first_order_rules(kernel: str, n_diff: int, fwd: Callable, bwd: Callable):
    """A custom VJP's (fwd, bwd) rules, each run through first_order_only: a second derivative
    differentiates both (the forward's kernel makes the residuals the backward reads). The
    function's first n_diff arguments are its arrays, the rest its nondiff_argnums."""

    def fwd_rule(*args):
        static = args[n_diff:]
        return first_order_only(kernel, lambda *a: fwd(*a, *static), *args[:n_diff])

    def bwd_rule(*args):  # (*nondiff arguments, residuals, cotangents)
        static = args[:-2]
        return first_order_only(kernel, lambda res, ct: bwd(*static, res, ct), *args[-2:])

    return fwd_rule, bwd_rule


def check_backend(backend: str, interpret: bool | None) -> str:
    """Validate a public `backend` argument against the interpret setting and the platform.

    Mosaic GPU kernels compile for an NVIDIA Hopper-class GPU only: asking for them in interpret
    mode or off GPU is an error, not a silent switch to another lowering."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "mosaic_gpu":
        if interpret:
            raise ValueError(
                "backend='mosaic_gpu' has no interpret mode; use backend='triton' to interpret"
            )
        if jax.default_backend() != "gpu":
            raise ValueError(
                "backend='mosaic_gpu' compiles for a CUDA GPU only, but the default JAX backend "
                f"is {jax.default_backend()!r}; use backend='triton' (interpreted off GPU)"
            )
    return backend


def mosaic_gpu_capable() -> bool:
    """The default device is an NVIDIA GPU of compute capability 9.x or 10.x (Hopper, datacenter
    Blackwell): the Mosaic GPU kernels (TMA, warpgroups, ~228 KB of shared memory per SM)
    compile for it. Consumer Blackwell (12.x) has about half that shared memory."""
    if jax.default_backend() != "gpu":
        return False
    capability = getattr(jax.devices()[0], "compute_capability", "0")
    return int(float(capability)) in (9, 10)


def mosaic_loss_refusal(n_vocab: int, compute_dtype) -> str | None:
    """Why the fused loss's Mosaic GPU kernel cannot run here, as "needs ..." would end (None:
    it can): a Hopper-class GPU, bfloat16 logits, padded rows that fit two per SM."""
    from . import cross_entropy_mgpu

    if not mosaic_gpu_capable():
        found = jax.devices()[0].device_kind if jax.default_backend() == "gpu" else "none"
        return f"a GPU of compute capability 9.x or 10.x (Hopper-class; found: {found})"
    if (dtype := jax.numpy.dtype(compute_dtype)) != jax.numpy.bfloat16:
        return f"bfloat16 logits (got {dtype})"
    if not cross_entropy_mgpu.fits(n_vocab):
        limit = cross_entropy_mgpu.MAX_COLS_TWO_PER_SM
        return f"a vocabulary of at most {limit} (two padded rows per SM; got {n_vocab})"
    return None


def check_triton_config(config: Any, powers_of_two: tuple[str, ...]) -> None:
    """A Triton kernel's Config: every int field >= 1, and the fields that size a block (Triton
    tiles are powers of two) powers of two; a ValueError naming the field otherwise."""
    for name, value in config._asdict().items():
        if isinstance(value, int) and value < 1:
            raise ValueError(f"config.{name} must be >= 1 (positive), got {value} ({config})")
        if name in powers_of_two and value & (value - 1):
            raise ValueError(f"config.{name} must be a power of two, got {value} ({config})")


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


def mosaic_compiler_params(reduction_scratch_bytes: int = 2048, approx_math: bool = False):
    """Mosaic GPU compiler parameters shared by the `*_mgpu.py` kernels.

    Lane lowering semantics: the kernels state every register layout themselves (jax 0.11 turned
    on the Warpgroup semantics with automatic layout inference by default; pinning Lane keeps the
    layouts the kernels were written and checked for). `reduction_scratch_bytes`: shared memory
    for cross-warp row reductions (more lets one reduction exchange more rows at once).
    `approx_math`: the approximate exp/log/divide instructions (the cross-entropy kernel).
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu  # GPU-only import, kept lazy

    return plgpu.CompilerParams(
        lowering_semantics=plgpu.LoweringSemantics.Lane,
        reduction_scratch_bytes=reduction_scratch_bytes,
        approx_math=approx_math,
    )
