"""What every kernel module shares: the lowering choice (Triton or Mosaic GPU), the first-order
rule of the custom VJPs, Triton compiler parameters, grid sizing and the measured tuning tables.

Every public kernel function takes `backend: str = "triton"`; `check_backend` validates it:

* "triton" (the default): Pallas' Triton lowering (`<op>_triton.py`). The kernels are row
  reductions and stencils over 2-D tiles whose shapes need not be multiples of a warpgroup tile
  (hidden sizes like 768, odd key lengths, ragged tails): Triton takes masked gathers over
  power-of-two tiles, does the cross-thread reductions itself and runs on any sm_80+ card.
* "mosaic_gpu": Pallas' Mosaic GPU lowering (`<op>_mgpu.py`, Hopper+): TMA copies of whole row
  blocks into shared memory, explicit register layouts. They assume aligned shapes (each says
  which, and refuses others with a ValueError) and compile only on a GPU: no interpret mode, and
  no silent fallback to Triton. benchmarks/mosaic_gpu_check.py measures both side by side. The
  fused cross-entropy's training pass is faster there (it keeps each row of logits in shared
  memory between its two sweeps); `cross_entropy.mosaic_loss_refusal` says where it cannot run.
  On an H200 every kernel's Mosaic version is at least about as fast as its Triton one, on an
  H100 the norms' and the loss's (benchmarks/RESULTS.md): jaxllm.ops runs them on Hopper-class
  GPUs under `kernel_backend: auto`.

jax 0.11 deprecates the Triton lowering and warns at every lowering (`DeprecationWarning: The
Pallas Triton backend is deprecated and will be removed in a future JAX version.`). We silence
exactly that message, because the choice above is deliberate and the warning fires inside the
caller's jit, where no narrower filter can reach it. A jax without the Triton lowering imports
this package all the same: `backend="triton"` is then an error (`triton_refusal`), and the
Mosaic GPU kernels run as before.
"""

from __future__ import annotations

import functools
import json
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

try:  # deprecated in jax 0.11, to be removed: the Mosaic GPU kernels do not need it
    from jax.experimental.pallas import triton as pltriton
except ImportError:
    pltriton = None

_TRITON_DEPRECATION = r"The Pallas Triton backend is deprecated"

BACKENDS = ("triton", "mosaic_gpu")
# finite: exp(MASK_VALUE - m) underflows to 0 without inf - inf = NaN. The same value as
# jaxllm.functional.MASK_VALUE (tests/test_layout.py checks; this package may not import jaxllm).
MASK_VALUE = -1e30
# The GPU the tuning tables and block-size sweeps come from (H100 SXM, 132 SMs). Interpret mode
# (CPU) and GPUs without tables of their own use its tables and SM count, so a CPU test runs the
# same grid as the H100.
REFERENCE_GPU = "h100"
REFERENCE_CORE_COUNT = 132
TUNING_DIR = Path(__file__).parent / "tuning"


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
            "model's xla paths (execution.kernels, loss_impl, mlp_impl: xla)"
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
    if backend == "triton" and (refusal := triton_refusal()) is not None:
        raise ValueError(
            f"backend='triton' needs {refusal}; use backend='mosaic_gpu' on a Hopper-class GPU"
        )
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


def triton_refusal() -> str | None:
    """What the Triton kernels (compiled or interpreted) need that this jax lacks, as "needs ..."
    would end (None: Pallas' Triton lowering is here)."""
    if pltriton is None:
        return f"Pallas' Triton lowering, which jax {jax.__version__} does not have"
    return None


def mosaic_gpu_capable() -> bool:
    """The default device is an NVIDIA GPU of compute capability 9.x or 10.x (Hopper, datacenter
    Blackwell): the Mosaic GPU kernels (TMA, warpgroups, ~228 KB of shared memory per SM)
    compile for it. Consumer Blackwell (12.x) has about half that shared memory."""
    if jax.default_backend() != "gpu":
        return False
    capability = getattr(jax.devices()[0], "compute_capability", "0")
    return int(float(capability)) in (9, 10)


def mosaic_gpu_refusal() -> str | None:
    """What a Mosaic GPU kernel needs that this machine lacks, as "needs ..." would end (None: a
    Hopper-class GPU is here)."""
    if mosaic_gpu_capable():  # a module-global lookup at call time: tests stand in another GPU
        return None
    found = jax.devices()[0].device_kind if jax.default_backend() == "gpu" else "none"
    return f"a GPU of compute capability 9.x or 10.x (Hopper-class; found: {found})"


def check_config(config: Any, backend: str, config_type: type, powers_of_two=()) -> None:
    """A public `config` argument: None or the chosen lowering's `config_type`. A Triton Config
    has every int field >= 1 and its `powers_of_two` fields (the fields that size a block: Triton
    tiles are powers of two) powers of two; a ValueError naming the field otherwise."""
    if config is None:
        return
    if not isinstance(config, config_type):
        name = f"{config_type.__module__.rpartition('.')[2]}.{config_type.__name__}"
        raise ValueError(f"backend={backend!r} takes a {name}, got {config}")
    if backend != "triton":
        return  # the Mosaic GPU modules check their configs against the shapes
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


def core_count() -> int:
    """Streaming multiprocessors of the default device (GPU), for sizing persistent grids."""
    device = jax.devices()[0]
    return int(getattr(device, "core_count", 0) or REFERENCE_CORE_COUNT)


@functools.cache
def tuning_table(kernel: str) -> dict[tuple, tuple]:
    """Measured tilings of `kernel`, key -> tiling, from tuning/<kernel>_<gpu>.json for the
    default device's GPU model (REFERENCE_GPU's file where it has none: said once, as a
    warning, on a GPU). Each file records the commands and dates that produced its entries."""
    device = jax.devices()[0]
    kind = device.device_kind.lower()
    path = None
    for candidate in sorted(TUNING_DIR.glob(f"{kernel}_*.json")):
        if re.search(rf"\b{re.escape(candidate.stem.removeprefix(kernel + '_'))}\b", kind):
            path = candidate
    if path is None:
        path = TUNING_DIR / f"{kernel}_{REFERENCE_GPU}.json"
        if device.platform == "gpu":
            warnings.warn(f"{kernel}: no tilings measured on {device.device_kind}; using "
                          f"{path.name}'s", stacklevel=2)  # fmt: skip
    entries = json.loads(path.read_text())["entries"]
    return {tuple(e["key"]): tuple(e["tiling"]) for e in entries}


def compiler_params(num_warps: int, num_stages: int = 1) -> pltriton.CompilerParams:
    """Triton compiler parameters; also installs the deprecation filter (see module docstring).

    Called while tracing, before jax lowers the kernel. `filterwarnings` drops an identical filter
    before re-inserting it, so repeated calls do not grow the filter list.
    """
    warnings.filterwarnings("ignore", message=_TRITON_DEPRECATION, category=DeprecationWarning)
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def i32(x) -> jax.Array:
    """x as an int32 index. Under jax_enable_x64 Python ints and loop counters are int64 while
    program ids are int32, and interpret mode rejects slice starts of mixed integer types; int32
    is also what the GPU's index arithmetic wants."""
    return jax.lax.convert_element_type(x, jnp.int32)


def safe_max(m: jax.Array) -> jax.Array:
    """A row max to shift exponentials by: 0 for a fully masked row, so exp(-inf - m) stays 0
    (no NaN)."""
    return jnp.where(m == -jnp.inf, 0.0, m)
