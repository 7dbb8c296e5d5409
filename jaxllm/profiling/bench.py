"""End-to-end model timing (CS336 assignment 2, section 5.2): `python profile.py bench`.

A sweep over model sizes (harness.SIZES), context lengths, compute dtypes and modes: `logits`
(forward to the logits), `forward` (+ the loss), `forward_backward` (the loss's gradient) and
`train_step` (+ global-norm clipping and AdamW: jaxllm.train.state.train_step). Each config gets
random token ids and fresh float32 parameters, then `warmup` untimed calls and `samples` timed
samples of `group` back-to-back calls, each closed by a device sync; the table shows the mean
and standard deviation of the seconds per call. Every executable of a size is compiled ahead of
time, in parallel threads, before anything is timed, so the warm-up covers first calls only.

Resident while a mode is timed (P parameters): logits and forward hold the float32 parameters
(4 P bytes), forward_backward also the gradients (4 P), train_step the whole TrainState (12 P:
AdamW's moments are made just before it and dropped after it) and the gradients.

A config that runs out of memory gives an `OOM` cell and the sweep goes on. `isolate` (auto: on
a GPU) measures every size in child processes, since a failed execution can leave memory
behind: a child stops at its first OOM, that cell runs again alone in a new child (only an OOM
there is reported) and the cells after it go to another child. Children share a persistent
compilation cache. With `torch`, the same model in PyTorch (torch_reference), eager and
torch.compile, is timed after the config's own cells and the table marks where ours is slower.

Analytic costs in every row (and JSON line, for the roofline plot): `flops`, one call's matmul
FLOPs (forward_flops; with the backward 3x), and `bytes`, a floor on its HBM traffic from the
parameters (and gradients, AdamW state) alone (min_bytes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import os
import shutil
import statistics
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from jaxllm import ops
from jaxllm.config import Config, ModelConfig
from jaxllm.models import build_model
from jaxllm.profiling import torch_reference
from jaxllm.profiling.harness import (
    CS336_SIZES,
    DTYPE_TAG,
    BadInput,
    append_jsonl,
    is_oom,
    md_header,
    md_row,
    model_fns,
    random_batch,
    size_config,
    time_calls,
)
from jaxllm.profiling.isolate import Child, child_command, child_main, stop_children_on_exit
from jaxllm.train.state import Batch, loss_and_sums, train_step

MODES = ("logits", "forward", "forward_backward", "train_step")
DEFAULT_MODES = MODES[1:]
TORCH = "torch"  # the mode of a config's PyTorch cell (both implementations, every mode)
OOM = {"status": "OOM", "mean_s": None, "std_s": None}
OOM_HINT = (
    "OOM: a cell ran out of device memory. Activations: --execution.remat=block; the fused "
    "loss's logits: a smaller --execution.loss_chunk_mib (with --execution.loss_impl=pallas); or "
    "a smaller --train.batch_size"
)
Cell = tuple[int, str, str]  # (context, dtype, mode); a config is a (context, dtype) pair
Result = dict[str, Any]  # {"status", "mean_s", "std_s"}; a TORCH cell: {impl: {mode: Result}}


@dataclass(frozen=True)
class Sweep:
    """What one `profile.py bench` run measures."""

    sizes: tuple[str, ...] = CS336_SIZES
    contexts: tuple[int, ...] = (128, 256, 512, 1024)
    dtypes: tuple[str, ...] = ("float32",)
    modes: tuple[str, ...] = DEFAULT_MODES
    overrides: tuple[str, ...] = ()  # --section.key=value, as train.py takes them
    warmup: int = 5
    samples: int = 10
    group: int = 1  # calls per timed sample, back to back before one sync
    torch: bool = False
    torch_compile: str = "regional"  # torch_reference.compile_model
    compile_workers: int = 8
    isolate: str = "auto"  # child processes per size: "auto" (on a GPU), "always", "never"

    def config(self, size: str, dtype: str) -> Config:
        return size_config(size, [*self.overrides, f"--execution.compute_dtype={dtype}"])

    @property
    def timed_modes(self) -> list[str]:
        return [m for m in MODES if m in self.modes]  # train_step, which adds AdamW, last


# ----------------------------------------------------------------------------- analytic costs


def forward_flops(m: ModelConfig, batch: int, length: int) -> float:
    """Matmul FLOPs (2 per multiply-add) of one forward pass over (batch, length) tokens.

    Per token and layer: the q/k/v and output projections (4 d^2), the MLP (2 d d_ff for GPT-2,
    3 d d_ff for SwiGLU), and QK^T plus PV over all `length` keys (2 length d each: XLA computes
    the masked half too); then the LM head (d V). Times 3 this matches
    `flops.train_flops_per_token` (PaLM's 6 N + 12 L d T) up to biases and norm scales.
    """
    d, f, n_layers = m.d_model, m.ffn_dim, m.n_layers
    mlp_matrices = 3 if m.arch == "transformer_lm" else 2
    per_layer = 2 * (4 * d * d + mlp_matrices * d * f) + 4 * length * d
    return float(batch * length * (n_layers * per_layer + 2 * d * m.vocab_size))


def call_flops(mode: str, m: ModelConfig, batch: int, length: int) -> float:
    """Analytic FLOPs of one call of `mode`: forward F; with the backward (2 F) 3 F."""
    f = forward_flops(m, batch, length)
    return f if mode in ("logits", "forward") else 3 * f


# Bytes per parameter a call must move at least: the float32 parameters read once; the
# gradients written too; train_step reads and writes parameters and AdamW's two moments.
MIN_BYTES_PER_PARAM = {"logits": 4, "forward": 4, "forward_backward": 8, "train_step": 24}


def min_bytes(mode: str, n_params: int) -> float:
    """Lower bound on one call's HBM bytes: parameters (and grads / AdamW state) only."""
    return float(MIN_BYTES_PER_PARAM[mode] * n_params)


def param_count(m: ModelConfig) -> int:
    """Parameters of the model, from shapes only (nothing allocated)."""
    init = functools.partial(build_model(m).init, jax.random.PRNGKey(0))
    shapes = jax.eval_shape(init, jax.ShapeDtypeStruct((1, 8), np.int32))
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(shapes["params"])))


# ----------------------------------------------------------------------------- timing


def summarize(samples: Sequence[float]) -> Result:
    """Mean and sample standard deviation (0 for one sample) of per-call seconds."""
    std = statistics.stdev(samples) if len(samples) > 1 else 0.0
    return {"status": "ok", "mean_s": statistics.fmean(samples), "std_s": std}


def measure(make: Callable[[], Callable[[], Any]], warmup: int, samples: int, group: int = 1):
    """Time the call `make()` returns (harness.time_calls); out of memory -> OOM."""
    try:
        timing = time_calls(make(), warmup=warmup, group=group, samples=samples)
    except Exception as e:
        if not is_oom(e):
            raise
        return dict(OOM)
    return summarize(timing.samples)


def _has_oom(result: Result) -> bool:
    if "status" in result:
        return result["status"] == "OOM"
    return any(_has_oom(r) for side in result.values() for r in side.values())


# Tracing a Flax model is not thread-safe (nn.scan builds module classes while it traces):
# threads trace and lower one at a time and compile (the slow part, GIL released) in parallel.
_TRACING = threading.Lock()


def build_step(
    mode: str, holder: dict[str, Any], batch: Batch, apply: Callable[..., Any]
) -> Callable[[], Any]:
    """Compile `mode` ahead of time for the shapes in holder ("param_shapes", "state_shapes")
    and return a no-argument call of it. The call takes what is resident when it runs:
    holder["params"], or for train_step holder["state"], which it donates and replaces."""
    if mode == "train_step":
        key = jax.random.PRNGKey(1)
        with _TRACING:
            lowered = train_step.lower(holder["state_shapes"].replace(apply_fn=apply), batch, key)
        compiled = lowered.compile()

        def step() -> Any:
            s = holder["state"]
            if s.apply_fn is not apply:  # the state was made with another dtype's model
                s = s.replace(apply_fn=apply)
            holder["state"], metrics = compiled(s, batch, key)
            return metrics

        return step

    def loss(params: Any, b: Batch) -> jax.Array:
        return loss_and_sums(params, apply, b, None)[0]

    fn = {"logits": lambda p, b: apply({"params": p}, b["inputs"]), "forward": loss,
          "forward_backward": jax.grad(loss)}[mode]  # fmt: skip
    with _TRACING:
        lowered = jax.jit(fn).lower(holder["param_shapes"], batch)
    compiled = lowered.compile()
    return lambda: compiled(holder["params"], batch)


def plan(sweep: Sweep) -> list[Cell]:
    """A size's cells in the order they are timed: contexts, dtypes, modes, then PyTorch."""
    modes = sweep.timed_modes + ([TORCH] if sweep.torch else [])
    return [(t, d, m) for t in sweep.contexts for d in sweep.dtypes for m in modes]


class _Resident:
    """What a size keeps on the device between cells, in `holder` (build_step's calls read it):
    "params", or for train_step "state" (AdamW's moments made then, dropped after the cell)."""

    def __init__(self, cfg: Config, batch: Batch, holder: dict[str, Any]) -> None:
        init, new_state, _ = model_fns(cfg)
        key = jax.random.PRNGKey(0)
        self._init = functools.partial(jax.jit(init), key, batch["inputs"])  # same key: same values
        self._new_state = jax.jit(new_state, donate_argnums=0)  # the parameters move in
        holder["param_shapes"] = jax.eval_shape(init, key, batch["inputs"])
        holder["state_shapes"] = jax.eval_shape(new_state, holder["param_shapes"])
        self.holder = holder

    def hold(self, mode: str) -> None:
        """Make resident what `mode` needs (and nothing more)."""
        h = self.holder
        if h.get("params") is None and "state" not in h:
            h["params"] = self._init()
        if mode == "train_step" and "state" not in h:
            h["state"] = self._new_state(h.pop("params"))
        elif mode != "train_step" and "state" in h:
            self.release()

    def release(self) -> None:
        """Keep train_step's parameters, drop AdamW's moments (a state donated to a step that
        ran out of memory is gone: nothing is kept)."""
        state = self.holder.pop("state", None)
        if state is not None and not any(x.is_deleted() for x in jax.tree.leaves(state)):
            self.holder["params"] = state.params

    def drop(self) -> None:
        """After an out-of-memory error: drop everything."""
        self.holder.pop("state", None)
        self.holder.pop("params", None)
        gc.collect()


def measure_cells(
    sweep: Sweep, size: str, cells: Sequence[Cell], stop_after_oom: bool = False
) -> Iterator[tuple[Cell, Result]]:
    """Time `cells` of `size` in this process, in order. Every executable is compiled first, in
    parallel threads, and only then is anything timed, one cell after the other. The float32
    parameters are shared by the cells (see _Resident). `stop_after_oom`: return after the
    first cell that ran out of memory (a child process: the parent runs the rest)."""
    cfgs = {d: sweep.config(size, d) for d in dict.fromkeys(d for _, d, _ in cells)}
    cfg = next(iter(cfgs.values()))
    full = random_batch(cfg)  # a window's first T + 1 tokens are a window too
    batches = {t: {k: v[:, :t] for k, v in full.items()} for t, _, _ in cells}
    holder: dict[str, Any] = {}
    resident = _Resident(cfg, full, holder)
    applies = {d: build_model(c.model, c.execution).apply for d, c in cfgs.items()}
    with ThreadPoolExecutor(sweep.compile_workers) as pool:
        futures = {
            (t, d, m): pool.submit(build_step, m, holder, batches[t], applies[d])
            for t, d, m in cells
            if m != TORCH
        }
        wait(futures.values())

    def ready(cell: Cell) -> Callable[[], Any]:
        step = futures.pop(cell).result()  # its compile's error, if any, is this cell's
        resident.hold(cell[2])
        return step

    for cell in cells:
        t, d, mode = cell
        if mode == TORCH:
            result = _torch_side(sweep, cfgs[d], batches[t])
        else:
            result = measure(functools.partial(ready, cell), sweep.warmup, sweep.samples,
                             sweep.group)  # fmt: skip
            if mode == "train_step":
                resident.release()
        if _has_oom(result):
            resident.drop()
        yield cell, result
        if stop_after_oom and _has_oom(result):
            return


def _torch_side(sweep: Sweep, cfg: Config, batch: Batch) -> Result:
    """{"eager" | "compile": {mode: Result}} of the PyTorch reference of `cfg`."""
    out = {}
    for impl, compile_mode in (("eager", None), ("compile", sweep.torch_compile)):
        times = torch_reference.time_modes(
            cfg, np.asarray(batch["inputs"]), np.asarray(batch["targets"]), sweep.timed_modes,
            compile_mode=compile_mode, warmup=sweep.warmup, samples=sweep.samples,
            group=sweep.group,
        )  # fmt: skip
        out[impl] = {k: dict(OOM) if s is None else summarize(s) for k, s in times.items()}
    return out


# ----------------------------------------------------------------------------- child processes


class BenchChildError(RuntimeError):
    """A child process failed other than by running out of memory."""


def _child(spec: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """A child's measurement: the spec's cells, up to the first out-of-memory error."""
    sweep = Sweep(**{k: tuple(v) if isinstance(v, list) else v for k, v in spec["sweep"].items()})
    cells = [(int(t), str(d), str(m)) for t, d, m in spec["cells"]]
    for cell, result in measure_cells(sweep, spec["size"], cells, stop_after_oom=True):
        yield {"cell": list(cell), "result": result}


def _child_command(spec: dict[str, Any]) -> list[str]:
    return child_command("jaxllm.profiling.bench", spec)


def _child_cells(
    sweep: Sweep, size: str, cells: Sequence[Cell], env: dict[str, str]
) -> Iterator[tuple[Cell, Result]]:
    """`cells` measured in one child, as its records come. A child that dies with an
    out-of-memory error in its stderr gives OOM for the cell it was at; any other failure
    raises BenchChildError with its last words."""
    cells = list(cells)
    spec = {"sweep": dataclasses.asdict(sweep), "size": size, "cells": [list(c) for c in cells]}
    done, last_oom = 0, False
    with Child(_child_command(spec), env) as child:
        for rec in child.records():
            done, last_oom = done + 1, _has_oom(rec["result"])
            yield tuple(rec["cell"]), rec["result"]
    if done == len(cells) or (done and (last_oom or child.returncode == 0)):
        return  # all measured, or it stopped after an OOM: the caller runs the rest
    if child.returncode != 0 and is_oom(child.stderr):
        oom = {m: dict(OOM) for m in sweep.timed_modes}
        yield (
            cells[done],
            {"eager": oom, "compile": dict(oom)} if cells[done][2] == TORCH else dict(OOM),
        )
        return
    raise BenchChildError(f"size {size}: the child measuring {cells[done]} failed (exit "
                          f"{child.returncode}): {child.last_words()}")  # fmt: skip


def _isolated_cells(
    sweep: Sweep, size: str, cells: Sequence[Cell], env: dict[str, str]
) -> Iterator[tuple[Cell, Result]]:
    """As measure_cells, in child processes: an OOM from a child that ran other cells too is
    not reported: that cell runs again alone, and the cells after it go to another child."""
    pending, alone = list(cells), False
    while pending:
        run_now, alone = (pending[:1] if alone else list(pending)), False
        for cell, result in _child_cells(sweep, size, run_now, env):
            if cell != pending[0]:
                raise BenchChildError(f"size {size}: a child gave {cell}, not {pending[0]}")
            if _has_oom(result) and len(run_now) > 1:
                alone = True  # the child stops here
                continue
            pending.pop(0)
            yield cell, result


@contextlib.contextmanager
def _children(isolated: bool) -> Iterator[dict[str, str] | None]:
    """The children's environment (None: no children), with a compilation cache they share,
    deleted afterwards; no child outlives the sweep."""
    if not isolated:
        yield None
        return
    cache = tempfile.mkdtemp(prefix="jaxllm-bench-xla-cache-")
    try:
        with stop_children_on_exit():
            yield {"JAX_COMPILATION_CACHE_DIR": cache} | dict(os.environ)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


# ----------------------------------------------------------------------------- rows and output


def bench_size(
    sweep: Sweep, size: str, child_env: dict[str, str] | None = None
) -> Iterator[list[dict[str, Any]]]:
    """All contexts x dtypes of one size: a list of records (one per mode) per config, in
    order; measured here, or with `child_env` in child processes."""
    cells = plan(sweep)
    source = (measure_cells(sweep, size, cells) if child_env is None
              else _isolated_cells(sweep, size, cells, child_env))  # fmt: skip
    n_params = param_count(sweep.config(size, sweep.dtypes[0]).model)
    results: dict[Cell, Result] = {}
    configs = [(t, d) for t in sweep.contexts for d in sweep.dtypes]
    wanted = sweep.timed_modes + ([TORCH] if sweep.torch else [])  # a row waits for all
    for cell, result in source:
        results[cell] = result
        while configs and all((*configs[0], m) in results for m in wanted):
            t, d = configs.pop(0)
            ours = {m: results.pop((t, d, m)) for m in sweep.timed_modes}
            yield _records(sweep, size, t, d, n_params, ours, results.pop((t, d, TORCH), None))


def _records(sweep: Sweep, size: str, t: int, dtype: str, n_params: int,
             ours: dict[str, Result], torch: Result | None) -> list[dict[str, Any]]:  # fmt: skip
    """The JSON records of one config, one per mode: the roofline plot's keys (name, flops,
    bytes, seconds: None if OOM) and everything that identifies the measurement."""
    cfg = sweep.config(size, dtype)
    m, ex, b = cfg.model, cfg.execution, cfg.train.batch_size
    extra = "".join(f" {x}" for x, d in ((m.arch, "gpt2"), (ex.kernels, "xla")) if x != d)
    out = []
    for mode, o in ours.items():
        flops, ok = call_flops(mode, m, b, t), o["status"] == "ok"
        rec = {
            "name": f"bench {size} T{t} {DTYPE_TAG[dtype]} {mode}{extra}", "flops": flops,
            "bytes": min_bytes(mode, n_params), "seconds": o["mean_s"], "status": o["status"],
            "std_seconds": o["std_s"], "mean_ms": 1e3 * o["mean_s"] if ok else None,
            "std_ms": 1e3 * o["std_s"] if ok else None,
            "tokens_per_s": b * t / o["mean_s"] if ok else None,
            "tflops_per_s": flops / o["mean_s"] / 1e12 if ok else None, "size": size,
            "arch": m.arch, "context": t, "batch": b, "vocab": m.vocab_size, "dtype": dtype,
            "mode": mode, "kernels": ex.kernels, "ops": ops.plan_ops(m, ex).describe(),
            "n_params": n_params, "warmup": sweep.warmup, "samples": sweep.samples,
            "group": sweep.group, "overrides": list(sweep.overrides),
        }  # fmt: skip
        if torch is not None:
            rec["torch_compile_mode"] = sweep.torch_compile
            for impl, side in torch.items():
                r = side[mode]
                rec |= {f"torch_{impl}_status": r["status"], f"torch_{impl}_seconds": r["mean_s"],
                        f"torch_{impl}_std_seconds": r["std_s"]}  # fmt: skip
        out.append(rec)
    return out


def header(torch: bool = False) -> str:
    cols = ["size", "context", "dtype", "mode", "mean ms", "std ms", "tokens/s", "TFLOP/s"]
    return md_header(cols + (["torch eager ms", "torch.compile ms", "ours / compile"] * torch))


def _ms(rec: dict[str, Any], impl: str) -> str:
    if rec[f"torch_{impl}_status"] != "ok":
        return rec[f"torch_{impl}_status"]
    return (
        f"{1e3 * rec[f'torch_{impl}_seconds']:.2f} ± {1e3 * rec[f'torch_{impl}_std_seconds']:.2f}"
    )


def format_row(rec: dict[str, Any], torch: bool = False) -> str:
    """One Markdown row; with `torch`, PyTorch's times and ours / torch.compile (**slower**
    where ours is)."""
    cells = [rec["size"], rec["context"], DTYPE_TAG[rec["dtype"]], rec["mode"]]
    ok = rec["status"] == "ok"
    if ok:
        cells += [f"{rec['mean_ms']:.2f}", f"{rec['std_ms']:.2f}", f"{rec['tokens_per_s']:,.0f}",
                  f"{rec['tflops_per_s']:.3g}"]  # fmt: skip
    else:
        cells += [rec["status"], "-", "-", "-"]
    if torch:
        ratio = "-"
        if ok and rec["torch_compile_status"] == "ok":
            ratio = f"{rec['seconds'] / rec['torch_compile_seconds']:.2f}"
            ratio += " **slower**" if float(ratio) > 1.0 else ""  # as shown: 1.004 is a tie
        cells += [_ms(rec, "eager"), _ms(rec, "compile"), ratio]
    return md_row(cells)


def run(sweep: Sweep, jsonl_path: str | None = None, progress: bool = True) -> list[dict]:
    """Run the sweep: a preamble and the Markdown table on stdout (a row per config x mode as it
    finishes), a JSON line per row appended to `jsonl_path`, a tqdm bar on stderr (on a
    terminal). BadInput when a context exceeds a size's model.context_length."""
    for size in sweep.sizes:
        limit = sweep.config(size, sweep.dtypes[0]).model.context_length
        if max(sweep.contexts) > limit:
            raise BadInput(f"--contexts: {max(sweep.contexts)} exceeds size {size}'s context "
                           f"{limit}; raise it with --model.context_length=N")  # fmt: skip
    on_gpu = jax.default_backend() == "gpu"
    isolated = sweep.isolate == "always" or (sweep.isolate == "auto" and on_gpu)
    device = jax.devices()[0].device_kind
    cfg = sweep.config(sweep.sizes[0], sweep.dtypes[0])
    torch = f"; PyTorch eager and torch.compile ({sweep.torch_compile})" if sweep.torch else ""
    isolation = ("a process per size, a new one after an OOM (its cell re-run alone)" if isolated
                 else "none (an OOM can leave memory behind for the cells after it)")  # fmt: skip
    print(f"bench: batch {cfg.train.batch_size}, vocab {cfg.model.vocab_size}"
          f"{''.join(f', {o}' for o in sweep.overrides)}; {sweep.warmup} warm-up + "
          f"{sweep.samples} timed samples of {sweep.group} call(s) each (mean ± std per call, a "
          f"device sync per sample){torch}; device {device}, jax {jax.__version__}; isolation: "
          f"{isolation}", flush=True)  # fmt: skip
    for dtype in sweep.dtypes:  # the op paths of every size: they depend on the dtype
        c = sweep.config(sweep.sizes[0], dtype)
        print(f"{dtype}: {ops.plan_ops(c.model, c.execution).describe()}")
    print(header(sweep.torch), flush=True)
    rows: list[dict[str, Any]] = []
    extra = {"device": device, "jax": jax.__version__,
             "isolation": "process per size" if isolated else "none"}  # fmt: skip
    bar = tqdm(total=len(sweep.sizes) * len(sweep.contexts) * len(sweep.dtypes), desc="bench",
               unit="config", file=sys.stderr, disable=None if progress else True)  # fmt: skip
    with _children(isolated) as child_env:
        for size in sweep.sizes:
            bar.set_postfix_str(f"{size}: compiling")
            for new in bench_size(sweep, size, child_env):
                new = [r | extra for r in new]
                for row in new:
                    tqdm.write(format_row(row, sweep.torch), file=sys.stdout)
                append_jsonl(jsonl_path, new)
                rows += new
                bar.set_postfix_str(f"{size}: timing")
                bar.update()
            gc.collect()  # the size's parameters and executables, before the next size
            jax.clear_caches()
    bar.close()
    if any(r["status"] == "OOM" for r in rows):
        print(OOM_HINT, flush=True)
    return rows


if __name__ == "__main__":
    from jaxllm.xla_flags import apply_default_xla_flags

    apply_default_xla_flags()  # before the backend starts (at the first computation)
    sys.exit(child_main(_child))
