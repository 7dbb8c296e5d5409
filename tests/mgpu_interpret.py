"""Test-only patches of jax's Mosaic GPU interpreter (private API, jax 0.10.x) for wgmma forms it
does not model, so the flash attention kernels run on the CPU:

* a transposed shared-memory B operand (`k.T`, Q K^T): the
  interpreter looks for `.indices` on every transform and fails on TransposeTransform;
* an A operand in registers (P V): the interpreter takes every operand for a shared-memory ref.

`patched(monkeypatch)` installs both for one test and returns True, or False when the private
modules moved or changed shape (jax 0.11; the caller skips). Never imported by the library.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np


def _split_transpose(transforms):
    """(transforms without a trailing TransposeTransform, its permutation or None)."""
    from jax._src.state import types as state_types

    transforms = tuple(transforms)
    if transforms and isinstance(transforms[-1], state_types.TransposeTransform):
        return transforms[:-1], transforms[-1].permutation
    return transforms, None


def _read(gc, key, transforms, thread, info):
    """Contents of a shared-memory allocation under (non-transpose) transforms, and its range."""
    memory = gc._get_shared_memory()
    span = gc.interpret_utils.to_range(jax.tree.map(int, gc._remove_noop_transforms(transforms)))
    value, _, _ = memory.get_buffer_content(key, span, thread, logging_info=info)
    return value, span


def _mma(gc, *, token, device_id, thread_id, grid_point_coords, acc_key, acc_transforms,
         acc_dtype, a, b_key, b_transforms, source_info=None):  # fmt: skip
    """acc += a @ b in the interpreter's shared memory, b possibly transposed; a is an array (A in
    registers) or (allocation key, transforms) of a shared-memory A."""
    memory = gc._get_shared_memory()
    thread = memory.get_global_thread_id(int(device_id), int(thread_id))
    coords = tuple(int(x) for x in grid_point_coords)
    info = gc.interpret_utils.GPULoggingInfo(
        device_id=int(device_id), grid_point_coords=coords, thread_id=int(thread_id),
        source_info=source_info,
    )  # fmt: skip
    if isinstance(a, tuple):
        a, _ = _read(gc, gc.HostAllocationKey.from_array(a[0]), a[1], thread, info)
    b_tr, b_perm = _split_transpose(b_transforms)
    b, _ = _read(gc, gc.HostAllocationKey.from_array(b_key), b_tr, thread, info)
    if b_perm is not None:
        b = np.transpose(b, b_perm)
    acc_key = gc.HostAllocationKey.from_array(acc_key)
    acc, span = _read(gc, acc_key, acc_transforms, thread, info)
    out = acc + np.matmul(np.asarray(a), b, dtype=acc_dtype)
    memory.store_buffer_content(acc_key, span, out, thread, logging_info=info)
    return token


def patched(monkeypatch) -> bool:
    try:
        from jax._src import callback
        from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as gc
        from jax._src.pallas.mosaic_gpu.interpret import jaxpr_interpret as ji
        from jax._src.state import types as state_types
    except ImportError:
        return False
    fields = {f.name for f in dataclasses.fields(ji.JaxprInterpreter)}
    if not (
        hasattr(gc, "wgmma")
        and hasattr(ji.JaxprInterpreter, "_interpret_wgmma_ref_p")
        and "grid_point_coords" in fields
    ):  # jax 0.11's interpreter changed its state
        return False
    smem_wgmma = gc.wgmma
    ref_wgmma = ji.JaxprInterpreter._interpret_wgmma_ref_p

    def wgmma(*, a_transforms, b_transforms, **kw):  # both operands in shared memory
        if _split_transpose(b_transforms)[1] is None:
            return smem_wgmma(a_transforms=a_transforms, b_transforms=b_transforms, **kw)
        return _mma(
            gc, token=kw["token"], device_id=kw["device_id"], thread_id=kw["thread_id"],
            grid_point_coords=kw["grid_point_coords"],
            acc_key=kw["acc_allocation_key_as_array"], acc_transforms=kw["acc_transforms"],
            acc_dtype=kw["acc_dtype"], a=(kw["a_allocation_key_as_array"], a_transforms),
            b_key=kw["b_allocation_key_as_array"], b_transforms=b_transforms,
            source_info=kw.get("source_info"),
        )  # fmt: skip

    def interpret_wgmma(self, eqn, token, get_invals):
        if isinstance(eqn.invars[1].aval, state_types.AbstractRef):
            return ref_wgmma(self, eqn, token, get_invals)
        acc, a, b, *leaves = get_invals()  # A in registers
        empty = jax.tree.structure([])
        trees = [eqn.params[f"{x}_transforms_tree"] or empty for x in ("acc", "a", "b")]
        acc_t, _, b_t = jax.tree.unflatten(jax.tree_util.treedef_tuple(trees), leaves)

        def run(*, a_value, acc_allocation_key_as_array, b_allocation_key_as_array, **kw):
            return _mma(gc, acc_key=acc_allocation_key_as_array, a=a_value,
                        b_key=b_allocation_key_as_array, **kw)  # fmt: skip

        out = callback.io_callback(
            functools.partial(run, acc_dtype=eqn.invars[0].aval.dtype, source_info=eqn.source_info),
            gc.TOKEN_SHAPE_DTYPE, token=token, device_id=self.device_info.device_id,
            grid_point_coords=self.grid_point_coords, thread_id=self.thread_id,
            acc_allocation_key_as_array=acc, acc_transforms=acc_t, a_value=a,
            b_allocation_key_as_array=b, b_transforms=b_t, ordered=True,
        )  # fmt: skip
        return out, []

    monkeypatch.setattr(gc, "wgmma", wgmma)
    monkeypatch.setattr(ji.JaxprInterpreter, "_interpret_wgmma_ref_p", interpret_wgmma)
    return True
