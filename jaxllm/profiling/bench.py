"""End-to-end timing of whole models (CS336 assignment 2, section 5.2): `python profile.py bench`.

A sweep over model sizes (CS336's table, plus `tiny` for tests), context lengths, compute dtypes
and modes: `logits` (forward to the logits), `forward` (forward + loss), `forward_backward`
(the loss's gradient w.r.t. the parameters) and `train_step` (forward, backward, global-norm
clipping and AdamW: jaxllm.train.state.train_step). Every config gets random token ids and
fresh float32 parameters (as jaxllm.profiling.harness.make_state), then the course's recipe:
`warmup` calls untimed, then `steps` calls, each closed by a device sync and timed on its own;
the table reports the mean and standard deviation over those `steps` calls. `group` > 1 (CLI
`--group`) makes each of the `steps` samples `group` calls back to back before one sync, as a
training loop runs (dispatch overlaps device work), for ours and the PyTorch reference alike.
Compilation is not in any of them: every executable of a size is compiled ahead of time, in
parallel threads, before the first call is timed (see `measure_cells`; `--compile-workers 1`
compiles one at a time), so the warm-up covers first-call effects only.

What is resident on the device while a mode is timed (P = parameter count; this is where the
OOM boundary between the modes comes from):
  logits, forward   the float32 parameters (4 P bytes), the batch, the activations of one
                    forward pass and its output (the logits, or the loss).
  forward_backward  the parameters (4 P) and the gradients it returns (4 P), plus the
                    activations the backward pass needs.
  train_step        the whole TrainState: parameters and AdamW's two moments (12 P), donated
                    and updated in place, plus the gradients (4 P) and the activations inside
                    the step.
AdamW's moments exist only for the train_step config: they are made from the parameters just
before it is timed and dropped after it (the parameters stay for the next config), so the
other modes never carry the 8 P bytes they do not use. (Until 2026-11-23 one full TrainState
served every mode: 2.7B float32 forward_backward at context 512 ran out of memory on an H100
while train_step at 512 fit.)

A config that does not fit in memory gives an `OOM` cell and the sweep goes on; nothing after
it may be affected by it. `--isolate` (auto: on a GPU) runs every size in a fresh child process
(`python -m jaxllm.profiling.bench --child ...`, through jaxllm.profiling.isolate) that streams
its results back a cell at a time (the table, JSON lines and progress bar are the parent's, as
without it). A child stops at its first out-of-memory error: a failed execution can leave
memory behind (an H100 sweep once reported every cell of `xl` after the first real OOM as OOM,
cells that fit in a fresh process included). Its remaining cells go to a new child, and the
OOM cell itself is first run again alone in a child of its own (its compile next to the
others', or what an earlier cell left, could have caused it): only an OOM that happens there is
reported. Children share a persistent compilation cache (a temporary directory, unless
JAX_COMPILATION_CACHE_DIR is set), so a re-run loads the executables that took jax's threshold
(a second) to compile instead of compiling them again. The parent starts its backend without
XLA's preallocation (it only reads the device's name) and never touches the device otherwise;
the children allocate as a plain run does.
Without isolation (`--isolate never`, and on the CPU) everything runs in this process, which
after an OOM frees what it holds and rebuilds the parameters, but cannot free what XLA keeps.

With `--torch`, the same model in PyTorch (jaxllm.profiling.torch_reference), eager and
torch.compile, is timed with the same recipe in the same process as the config's JAX cells
(after them, with the parameters resident), and the table marks where ours is slower than
torch.compile.

Analytic costs carried by every row (and its JSON line, for the roofline plot):
  flops  one call's matmul FLOPs (`forward_flops`): forward = F, forward_backward and
         train_step = 3 F (backward = 2 x forward; AdamW's O(params) elementwise work is left
         out). Softmax, norms and the loss are not counted.
  bytes  a lower bound on the HBM traffic of one call, parameters only (`min_bytes`): the
         float32 parameters read once (4 B each); forward_backward also writes the gradients
         (8 B); train_step reads and writes the parameters and AdamW's two moments (24 B; the
         gradients may stay on chip). Activations are left out, so this is a floor.

The train step's cost by difference (what benchmarks/step_breakdown.py printed), on the GPT-2
124M preset's model: `python profile.py bench --sizes small --contexts 1024 --batch 16 --vocab
50257 --dtypes bfloat16 --kernels pallas --set execution.attention_impl=dot_product_attention
--set execution.loss_impl=pallas --modes logits,forward,forward_backward,train_step`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
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
from jaxllm.config import Config, ConfigError, ModelConfig, load_config
from jaxllm.models import build_model
from jaxllm.profiling.harness import random_batch, time_calls
from jaxllm.profiling.isolate import Child, stop_children_on_exit
from jaxllm.train.optim import make_optimizer
from jaxllm.train.state import Batch, LMTrainState, loss_and_sums, train_step


class BenchArgError(ValueError):
    """A bad sweep setting (unknown size, mode, dtype; a context over the model's maximum)."""


@dataclass(frozen=True)
class Size:
    d_model: int
    d_ff: int
    n_layers: int
    n_heads: int
    max_context: int = 1024  # the model's context_length: GPT-2's position table has 1024 rows


# CS336 assignment 2, table 1; `tiny` is for tests and CPU smoke runs.
SIZES: dict[str, Size] = {
    "tiny": Size(64, 256, 2, 4, max_context=128),
    "small": Size(768, 3072, 12, 12),
    "medium": Size(1024, 4096, 24, 16),
    "large": Size(1280, 5120, 36, 20),
    "xl": Size(1600, 6400, 48, 25),
    "2.7B": Size(2560, 10240, 32, 32),
}
CS336_SIZES = ("small", "medium", "large", "xl", "2.7B")
MODES = ("logits", "forward", "forward_backward", "train_step")
DEFAULT_MODES = ("forward", "forward_backward", "train_step")
DTYPES = ("float32", "bfloat16")
ARCHS = ("gpt2", "transformer_lm")
KERNELS = ("xla", "pallas")
DTYPE_TAG = {"float32": "f32", "bfloat16": "bf16"}
ISOLATE = ("auto", "always", "never")
TORCH = "torch"  # the mode of a cell that times the config's PyTorch reference (--torch)
CELL_TAG = "BENCH_CELL "  # the line a child process prints a cell's result on

# One measurement: (context, dtype, mode); a config is a (context, dtype) pair.
Cell = tuple[int, str, str]


@dataclass(frozen=True)
class Sweep:
    """What one `profile.py bench` run measures."""

    sizes: tuple[str, ...] = CS336_SIZES
    contexts: tuple[int, ...] = (128, 256, 512, 1024)
    dtypes: tuple[str, ...] = ("float32",)
    modes: tuple[str, ...] = DEFAULT_MODES
    arch: str = "gpt2"
    batch: int = 4
    vocab: int = 10_000  # CS336's
    kernels: str = "xla"
    warmup: int = 5
    steps: int = 10
    group: int = 1  # calls per timed sample, back to back before one sync (1: every call synced)
    overrides: tuple[str, ...] = ()  # extra config overrides, e.g. "execution.attention_impl=..."
    torch: bool = False  # also time the PyTorch reference (eager and torch.compile)
    compile_workers: int = 8  # threads compiling a size's executables before timing
    torch_compile: str = "regional"  # torch_reference.compile_model: "regional" or "model"
    isolate: str = "auto"  # a child process per size: "auto" (on a GPU), "always", "never"


@dataclass(frozen=True)
class Measured:
    """One timed call: status "ok" or "OOM"; seconds per call, mean and std over the steps."""

    status: str
    mean_s: float | None = None
    std_s: float | None = None


@dataclass(frozen=True)
class Row:
    size: str
    arch: str
    context: int
    batch: int
    vocab: int
    dtype: str
    mode: str
    kernels: str
    n_params: int
    flops: float  # analytic, one call
    bytes: float  # lower bound, one call
    ours: Measured
    torch_eager: Measured | None = None
    torch_compile: Measured | None = None

    @property
    def name(self) -> str:
        """e.g. 'bench small T1024 bf16 forward_backward' (+ arch / kernels when not default)."""
        extra = "".join(f" {x}" for x, d in ((self.arch, "gpt2"), (self.kernels, "xla")) if x != d)
        return f"bench {self.size} T{self.context} {DTYPE_TAG[self.dtype]} {self.mode}{extra}"


# ----------------------------------------------------------------------------- arguments


def parse_choices(text: str, allowed: Sequence[str], flag: str) -> tuple[str, ...]:
    """'small,large' -> ('small', 'large'), each checked against `allowed`."""
    items = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        what = f"unknown value(s) {bad}" if bad else "no value given"
        raise BenchArgError(f"{flag}: {what}; allowed: {', '.join(allowed)}")
    return items


def parse_ints(text: str, flag: str) -> tuple[int, ...]:
    """'128,1024' -> (128, 1024); every value a positive integer."""
    try:
        items = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        items = ()
    if not items or min(items) <= 0:
        raise BenchArgError(f"{flag}: expected comma-separated positive integers, got {text!r}")
    return items


def build_config(
    size: str,
    *,
    arch: str = "gpt2",
    vocab: int = 10_000,
    dtype: str = "float32",
    kernels: str = "xla",
    batch: int = 4,
    overrides: Sequence[str] = (),
) -> Config:
    """The Config of one benchmarked model, built as train.py builds one: defaults plus
    `--section.key=value` overrides (the size preset's, then the user's `overrides`)."""
    if size not in SIZES:
        raise BenchArgError(f"unknown size {size!r}; allowed: {', '.join(SIZES)}")
    s = SIZES[size]
    model = dict(
        arch=arch, vocab_size=vocab, context_length=s.max_context, d_model=s.d_model,
        d_ff=s.d_ff, n_layers=s.n_layers, n_heads=s.n_heads, compute_dtype=dtype,
        kernels=kernels, dropout=0.0,
    )  # fmt: skip
    if arch == "transformer_lm":  # CS336's model: no biases, untied head
        model |= dict(bias=False, qkv_bias=False, tie_embeddings=False)
    args = [f"--model.{k}={v}" for k, v in model.items()]
    # A benchmark reads no data, but the default data section (associative recall) checks the
    # model's vocabulary and context against its task: make that task as small as allowed.
    args += ["--data.associative_recall.vocab_size=4", "--data.associative_recall.num_pairs=1"]
    args += [f"--train.batch_size={batch}"]
    args += [o if o.startswith("--") else f"--{o}" for o in overrides]
    try:
        return load_config(None, args)
    except ConfigError as e:
        raise BenchArgError(f"size {size}: {e}") from None


def check_sweep(sweep: Sweep) -> None:
    """Raise BenchArgError for anything the sweep cannot run, before anything is timed."""
    for flag, items, allowed in (
        ("--sizes", sweep.sizes, tuple(SIZES)),
        ("--modes", sweep.modes, MODES),
        ("--dtypes", sweep.dtypes, DTYPES),
        ("--arch", (sweep.arch,), ARCHS),
        ("--kernels", (sweep.kernels,), KERNELS),
        ("--isolate", (sweep.isolate,), ISOLATE),
    ):
        parse_choices(",".join(items), allowed, flag)
    from jaxllm.profiling.torch_reference import COMPILE_MODES  # no torch import

    if sweep.torch_compile not in COMPILE_MODES:
        allowed = ", ".join(COMPILE_MODES)
        raise BenchArgError(f"--torch-compile: unknown value {sweep.torch_compile!r}; allowed: "
                            f"{allowed} (one of them)")  # fmt: skip
    if min(sweep.batch, sweep.steps, sweep.group, sweep.compile_workers) < 1 or sweep.warmup < 0:
        raise BenchArgError(
            f"--batch, --steps, --group and --compile-workers must be >= 1 and --warmup >= 0, "
            f"got batch {sweep.batch}, steps {sweep.steps}, group {sweep.group}, compile workers "
            f"{sweep.compile_workers}, warmup {sweep.warmup}"
        )
    for size in sweep.sizes:
        cfg = build_config(size, **_config_kwargs(sweep, sweep.dtypes[0]))
        limit = cfg.model.context_length
        too_long = [t for t in sweep.contexts if t > limit]
        if too_long:
            raise BenchArgError(
                f"--contexts: {too_long} exceed size {size}'s maximum context {limit}; allowed: "
                f"1..{limit} (raise it with --set model.context_length=N)"
            )


def _config_kwargs(sweep: Sweep, dtype: str) -> dict[str, Any]:
    return dict(
        arch=sweep.arch, vocab=sweep.vocab, dtype=dtype, kernels=sweep.kernels,
        batch=sweep.batch, overrides=sweep.overrides,
    )  # fmt: skip


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


# Bytes per parameter that a call must move at least: see the module docstring.
MIN_BYTES_PER_PARAM = {"logits": 4, "forward": 4, "forward_backward": 8, "train_step": 24}


def min_bytes(mode: str, n_params: int) -> float:
    """Lower bound on one call's HBM bytes: parameters (and grads / AdamW state) only."""
    return float(MIN_BYTES_PER_PARAM[mode] * n_params)


# ----------------------------------------------------------------------------- timing


def is_oom(error: BaseException | str) -> bool:
    """XLA's out-of-memory errors (jax.errors.JaxRuntimeError, formerly XlaRuntimeError) say
    RESOURCE_EXHAUSTED; PyTorch's say 'out of memory'. Matched on the message, as the error
    class has moved between JAX versions (a child's stderr can be given as it is)."""
    msg = str(error)
    return "RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower()


def summarize(samples: Sequence[float]) -> Measured:
    """Mean and sample standard deviation (0 for one sample) of per-call seconds."""
    std = statistics.stdev(samples) if len(samples) > 1 else 0.0
    return Measured("ok", statistics.fmean(samples), std)


# Tracing a Flax model is not thread-safe (nn.scan builds module classes while it traces:
# "dictionary changed size during iteration"): threads trace and lower one at a time and
# compile (the slow part, GIL released) in parallel.
_TRACING = threading.Lock()


def build_step(
    mode: str, holder: dict[str, Any], batch: Batch, apply: Callable[..., Any]
) -> Callable[[], Any]:
    """Compile `mode` ahead of time for the shapes in holder ("param_shapes", "state_shapes"),
    the batch and the model's `apply` (its compute dtype), and return a no-argument call of it
    that returns something to wait on. The call takes what is resident when it runs:
    holder["params"], or for train_step holder["state"] (the full TrainState), which it donates:
    each call puts the new one in the holder."""
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

    fns = {
        "logits": (lambda p, b: apply({"params": p}, b["inputs"])),
        "forward": loss,
        "forward_backward": jax.grad(loss),
    }
    if mode not in fns:
        raise BenchArgError(f"unknown mode {mode!r}; allowed: {', '.join(MODES)}")
    with _TRACING:
        lowered = jax.jit(fns[mode]).lower(holder["param_shapes"], batch)
    compiled = lowered.compile()
    return lambda: compiled(holder["params"], batch)


def measure(
    make: Callable[[], Callable[[], Any]], warmup: int, steps: int, group: int = 1
) -> Measured:
    """Get the call from `make()`, then `warmup` untimed calls and `steps` timed samples of
    `group` back-to-back calls, each sample closed by a device sync (time_calls); seconds per
    call. Out of memory -> OOM."""
    try:
        timing = time_calls(make(), warmup=warmup, steps=group, repeats=steps)
    except Exception as e:
        if not is_oom(e):
            raise
        return Measured("OOM")
    return summarize(timing.samples)


def plan(sweep: Sweep) -> list[Cell]:
    """A size's cells in the order they are timed: contexts, then dtypes, then modes (in MODES
    order: train_step, which needs AdamW's moments, last), then the config's PyTorch cell."""
    modes = [m for m in MODES if m in sweep.modes]
    extra = [TORCH] if sweep.torch else []
    return [(t, d, m) for t in sweep.contexts for d in sweep.dtypes for m in modes + extra]


class _Resident:
    """What a size keeps on the device between cells, in `holder` (build_step's calls read it):
    "params" for logits / forward / forward_backward; for train_step "state", the TrainState
    made from those parameters (AdamW's moments are created then) and dropped after the cell,
    its parameters kept. What an out-of-memory error leaves is dropped; the parameters are
    initialised again (the same values: same key) when next needed."""

    def __init__(self, cfg: Config, batch: Batch, holder: dict[str, Any]) -> None:
        model = build_model(cfg.model, cfg.execution)
        tx = make_optimizer(cfg.optim, cfg.train.steps or cfg.optim.warmup_steps + 1)

        def init(key: jax.Array, inputs: jax.Array) -> Any:  # harness.make_state's parameters
            return model.init(key, inputs)["params"]

        def new_state(params: Any) -> LMTrainState:
            return LMTrainState.create(
                apply_fn=model.apply, params=params, tx=tx, vocab_size=cfg.model.vocab_size
            )

        key = jax.random.PRNGKey(0)
        # jitted: one compile instead of one per op (eager init), and no temporaries
        self._init = functools.partial(jax.jit(init), key, batch["inputs"])
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
        """After train_step: keep its parameters, drop AdamW's moments. A train step that ran
        out of memory consumed (donated) its state: nothing is kept then."""
        state = self.holder.pop("state", None)
        if state is not None and not any(x.is_deleted() for x in jax.tree.leaves(state)):
            self.holder["params"] = state.params

    def drop(self) -> None:
        """After an out-of-memory error: drop everything."""
        self.holder.pop("state", None)
        self.holder.pop("params", None)
        gc.collect()


def _has_oom(result: Measured | dict[str, dict[str, Measured]]) -> bool:
    if isinstance(result, Measured):
        return result.status == "OOM"
    return any(m.status == "OOM" for side in result.values() for m in side.values())


def measure_cells(
    sweep: Sweep, size: str, cells: Sequence[Cell], stop_after_oom: bool = False
) -> Iterator[tuple[Cell, Any]]:
    """Time `cells` of `size` in this process, in order: (cell, Measured), or for a TORCH cell
    (cell, {"eager" | "compile": {mode: Measured}}).

    Every executable is compiled first, in parallel threads (XLA compiles with the GIL
    released; compilation dominates a sweep's wall time), and only then is anything timed, one
    cell after the other, so that nothing else runs on the machine while a call is timed. The
    parameters (float32, the same for every context and compute dtype) are shared by the
    cells; see _Resident for what each mode holds. `stop_after_oom`: return after the first
    cell with an out-of-memory error (a child process: the parent re-runs the rest).
    """
    dtypes = list(dict.fromkeys(d for _, d, _ in cells))
    cfgs = {d: build_config(size, **_config_kwargs(sweep, d)) for d in dtypes}
    cfg = cfgs[dtypes[0]]
    # random_batch draws (max context + 1)-token windows; their first T + 1 tokens are a
    # window too: inputs[:, :T] and targets[:, :T] stay one token apart.
    full = random_batch(cfg, sweep.batch)
    batches = {t: {k: v[:, :t] for k, v in full.items()} for t, _, _ in cells}
    modes = [m for m in MODES if m in sweep.modes]
    holder: dict[str, Any] = {}
    resident = _Resident(cfg, full, holder)
    applies = {d: build_model(cfgs[d].model).apply for d in dtypes}
    with ThreadPoolExecutor(max(1, sweep.compile_workers)) as pool:
        futures = {
            (t, d, m): pool.submit(build_step, m, holder, batches[t], applies[d])
            for t, d, m in cells
            if m != TORCH
        }
        wait(futures.values())  # compile everything before timing anything

    def ready(cell: Cell) -> Callable[[], Any]:
        step = futures.pop(cell).result()  # its compile's error, if any, is this cell's
        resident.hold(cell[2])
        return step

    for cell in cells:
        t, d, mode = cell
        result: Any
        if mode == TORCH:
            result = _torch_side(sweep, cfgs[d].model, batches[t], modes)
        else:
            result = measure(functools.partial(ready, cell), sweep.warmup, sweep.steps, sweep.group)
            if mode == "train_step":
                resident.release()
        if _has_oom(result):
            resident.drop()
        yield cell, result
        if stop_after_oom and _has_oom(result):
            return


def _isolated_cells(
    sweep: Sweep, size: str, cells: Sequence[Cell], env: dict[str, str]
) -> Iterator[tuple[Cell, Any]]:
    """As measure_cells, each cell measured in a child process: the first child gets all
    cells; a child stops at its first out-of-memory error. An OOM from a child that ran (or
    compiled) other cells too is not reported: that cell runs again alone in a new child, and
    what happens there is its result; the cells after it go to another child."""
    pending = list(cells)
    alone = False  # pending[0] ran out of memory beside other cells: run it on its own
    while pending:
        run_now = pending[:1] if alone else list(pending)
        alone = False
        for cell, result in _child_cells(sweep, size, run_now, env):
            if cell != pending[0]:
                raise BenchChildError(f"size {size}: a child gave {cell}, not {pending[0]}")
            if _has_oom(result) and len(run_now) > 1:
                alone = True  # the child stops here
                continue
            pending.pop(0)
            yield cell, result


class BenchChildError(RuntimeError):
    """A child process failed other than by running out of memory."""


def _child_command(spec: dict[str, Any]) -> list[str]:
    """The command of a child that measures spec["cells"] of spec["size"] (see _child_main)."""
    return [sys.executable, "-m", "jaxllm.profiling.bench", "--child", json.dumps(spec)]


def _child_cells(
    sweep: Sweep, size: str, cells: Sequence[Cell], env: dict[str, str]
) -> Iterator[tuple[Cell, Any]]:
    """Run `cells` in one child process, (cell, result) as its lines come. A child that dies
    with an out-of-memory error in its stderr (XLA can abort the process) gives an OOM result
    for the cell it was at; any other failure raises BenchChildError with its last words."""
    cells = list(cells)  # the caller's list may change while we yield
    spec = {"sweep": dataclasses.asdict(sweep), "size": size, "cells": [list(c) for c in cells]}
    done, last_oom = 0, False
    with Child(_child_command(spec), env) as child:
        for line in child.lines():
            if line.startswith(CELL_TAG):
                rec = json.loads(line[len(CELL_TAG) :])
                result = _decode(rec["result"])
                done, last_oom = done + 1, _has_oom(result)
                yield tuple(rec["cell"]), result  # type: ignore[misc]
    if done == len(cells) or (done and (last_oom or child.returncode == 0)):
        return  # all measured, or it stopped after an OOM: the caller runs the rest
    last = (child.stderr.strip().splitlines() or ["no output"])[-1][:300]
    if child.returncode != 0 and is_oom(child.stderr):
        t, d, mode = cells[done]
        if mode != TORCH:
            yield cells[done], Measured("OOM")
        else:
            oom = {m: Measured("OOM") for m in sweep.modes}
            yield cells[done], {"eager": oom, "compile": dict(oom)}
        return
    raise BenchChildError(
        f"size {size}: the child process measuring {cells[done]} failed (exit "
        f"{child.returncode}): {last}"
    )


def _encode(result: Measured | dict[str, dict[str, Measured]]) -> Any:
    if isinstance(result, Measured):
        return dataclasses.asdict(result)
    return {impl: {m: dataclasses.asdict(x) for m, x in side.items()}
            for impl, side in result.items()}  # fmt: skip


def _decode(data: dict[str, Any]) -> Measured | dict[str, dict[str, Measured]]:
    if "status" in data:
        return Measured(**data)
    return {impl: {m: Measured(**x) for m, x in side.items()} for impl, side in data.items()}


def _child_env(cache_dir: str | None) -> dict[str, str]:
    """A child's environment: ours (XLA_FLAGS, the preallocation setting of a plain run), with
    the shared compilation cache unless the user set one."""
    env = dict(os.environ)
    if cache_dir and "JAX_COMPILATION_CACHE_DIR" not in env:
        env["JAX_COMPILATION_CACHE_DIR"] = cache_dir
    return env


def bench_size(
    sweep: Sweep, size: str, child_env: dict[str, str] | None = None
) -> Iterator[list[Row]]:
    """All contexts x dtypes of one size, a list of rows (one per mode) per config, in order:
    measured in this process (measure_cells), or with `child_env` in child processes
    (_isolated_cells)."""
    cells = plan(sweep)
    if child_env is None:
        source = measure_cells(sweep, size, cells)
    else:
        source = _isolated_cells(sweep, size, cells, child_env)
    modes = [m for m in MODES if m in sweep.modes]
    model = build_config(size, **_config_kwargs(sweep, sweep.dtypes[0])).model
    n_params = _param_count(model, {"inputs": np.zeros((1, min(sweep.contexts)), np.int32)})
    results: dict[Cell, Any] = {}
    configs = [(t, d) for t in sweep.contexts for d in sweep.dtypes]
    wanted = [*modes, *([TORCH] if sweep.torch else [])]  # a config's row waits for all of them
    for cell, result in source:
        results[cell] = result
        while configs and all((*configs[0], m) in results for m in wanted):
            t, d = configs.pop(0)
            ours = {m: results.pop((t, d, m)) for m in modes}
            torch = results.pop((t, d, TORCH), None)
            yield _rows(sweep, size, t, d, modes, n_params, ours, torch)
    if configs:  # cannot happen: both sources give every cell
        raise BenchChildError(f"size {size}: configs {configs} were not measured")


def _rows(
    sweep: Sweep,
    size: str,
    context: int,
    dtype: str,
    modes: Sequence[str],
    n_params: int,
    results: dict[str, Measured],
    torch: dict[str, dict[str, Measured]] | None = None,
) -> list[Row]:
    """The rows of one config, one per mode, with their analytic FLOPs and bytes."""
    torch = torch or {}
    m = build_config(size, **_config_kwargs(sweep, dtype)).model
    return [
        Row(
            size=size,
            arch=sweep.arch,
            context=context,
            batch=sweep.batch,
            vocab=sweep.vocab,
            dtype=dtype,
            mode=mode,
            kernels=sweep.kernels,
            n_params=n_params,
            flops=call_flops(mode, m, sweep.batch, context),
            bytes=min_bytes(mode, n_params),
            ours=results[mode],
            torch_eager=torch.get("eager", {}).get(mode),
            torch_compile=torch.get("compile", {}).get(mode),
        )
        for mode in modes
    ]


def _param_count(m: ModelConfig, batch: Batch) -> int:
    """Parameters of the model, from shapes only (nothing allocated, on no device)."""

    def init(inputs: jax.Array) -> Any:
        return build_model(m).init(jax.random.PRNGKey(0), inputs)

    shapes = jax.eval_shape(init, batch["inputs"][:1])
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(shapes["params"])))


def _torch_side(
    sweep: Sweep, m: ModelConfig, batch: Batch, modes: Sequence[str]
) -> dict[str, dict[str, Measured]]:
    """{"eager" | "compile": {mode: Measured}} for the PyTorch reference of `m`."""
    from jaxllm.profiling import torch_reference

    inputs, targets = np.asarray(batch["inputs"]), np.asarray(batch["targets"])
    out = {}
    for impl, compile_mode in (("eager", None), ("compile", sweep.torch_compile)):
        samples = torch_reference.time_modes(
            m, inputs, targets, modes, compile_mode=compile_mode, warmup=sweep.warmup,
            steps=sweep.steps, group=sweep.group,
        )  # fmt: skip
        out[impl] = {k: Measured("OOM") if s is None else summarize(s) for k, s in samples.items()}
    return out


# ----------------------------------------------------------------------------- output


def header(torch: bool = False) -> str:
    cols = ["size", "context", "dtype", "mode", "mean ms", "std ms", "tokens/s", "TFLOP/s"]
    if torch:
        cols += ["torch eager ms", "torch.compile ms", "ours / compile"]
    return "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols)


def _ms(m: Measured | None) -> str:
    if m is None:
        return "-"
    return "OOM" if m.status != "ok" else f"{1e3 * m.mean_s:.2f} ± {1e3 * m.std_s:.2f}"


def format_row(row: Row, torch: bool = False) -> str:
    """One Markdown table row; torch columns when `torch`. Ours slower than torch.compile is
    marked **slower**."""
    o = row.ours
    if o.status == "ok":
        tokens_per_s = row.batch * row.context / o.mean_s
        tflops = row.flops / o.mean_s / 1e12
        ours = [
            f"{1e3 * o.mean_s:.2f}",
            f"{1e3 * o.std_s:.2f}",
            f"{tokens_per_s:,.0f}",
            f"{tflops:.3g}",
        ]
    else:
        ours = [o.status, "-", "-", "-"]
    cells = [row.size, str(row.context), DTYPE_TAG[row.dtype], row.mode, *ours]
    if torch:
        ratio = "-"
        c = row.torch_compile
        if o.status == "ok" and c is not None and c.status == "ok":
            ratio = f"{o.mean_s / c.mean_s:.2f}"
            ratio += " **slower**" if float(ratio) > 1.0 else ""  # as shown: 1.004 is a tie
        cells += [_ms(row.torch_eager), _ms(row.torch_compile), ratio]
    return "| " + " | ".join(cells) + " |"


@functools.cache  # per sweep, size and dtype: the preamble and every JSON row ask for it
def ops_line(sweep: Sweep, size: str, dtype: str) -> str:
    """The op paths the model of `size` at `dtype` takes on this machine, as a training run's
    `ops:` line says them (e.g. which lowering the fused loss took)."""
    return ops.plan_ops(build_config(size, **_config_kwargs(sweep, dtype)).model).describe()


def row_json(row: Row, sweep: Sweep, device: str, isolation: str | None = None) -> dict[str, Any]:
    """The JSON line of a row: the roofline plot's keys (name, flops, bytes, seconds: None if
    OOM) plus everything that identifies and describes the measurement (`isolation`: "process
    per size" or "none", when given)."""
    o = row.ours
    ok = o.status == "ok"
    out = {
        "name": row.name,
        "flops": row.flops,
        "bytes": row.bytes,
        "seconds": o.mean_s,
        "status": o.status,
        "std_seconds": o.std_s,
        "mean_ms": 1e3 * o.mean_s if ok else None,
        "std_ms": 1e3 * o.std_s if ok else None,
        "tokens_per_s": row.batch * row.context / o.mean_s if ok else None,
        "tflops_per_s": row.flops / o.mean_s / 1e12 if ok else None,
        "size": row.size,
        "arch": row.arch,
        "context": row.context,
        "batch": row.batch,
        "vocab": row.vocab,
        "dtype": row.dtype,
        "mode": row.mode,
        "kernels": row.kernels,
        "ops": ops_line(sweep, row.size, row.dtype),
        "n_params": row.n_params,
        "warmup": sweep.warmup,
        "steps": sweep.steps,
        "group": sweep.group,
        "overrides": list(sweep.overrides),
        "device": device,
        "jax": jax.__version__,
    }
    if isolation is not None:
        out["isolation"] = isolation
    if row.torch_compile is not None:
        out["torch_compile_mode"] = sweep.torch_compile
    for key, m in (("torch_eager", row.torch_eager), ("torch_compile", row.torch_compile)):
        if m is not None:
            out |= {f"{key}_status": m.status, f"{key}_seconds": m.mean_s,
                    f"{key}_std_seconds": m.std_s}  # fmt: skip
    return out


def use_children(isolate: str) -> bool:
    """Whether the sweep runs a child process per size: "always", "never", or "auto" = on a GPU.
    Starts this process's backend (to read the device) without XLA's preallocation, which
    would take 75% of the GPU from the children; the children get the environment as it was
    (a variable read when the backend starts: effective unless something ran before)."""
    if isolate == "never":
        return False
    key = "XLA_PYTHON_CLIENT_PREALLOCATE"
    old = os.environ.get(key)
    os.environ[key] = "false"
    try:
        on_gpu = jax.default_backend() == "gpu"
    finally:
        if old is None:
            del os.environ[key]
        else:
            os.environ[key] = old
    return isolate == "always" or on_gpu


@contextlib.contextmanager
def _children(isolated: bool) -> Iterator[dict[str, str] | None]:
    """The children's environment for the sweep (None: no children), with a compilation cache
    shared by them and deleted afterwards; no child outlives the sweep."""
    if not isolated:
        yield None
        return
    cache = tempfile.mkdtemp(prefix="jaxllm-bench-xla-cache-")
    try:
        with stop_children_on_exit():
            yield _child_env(cache)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def run(sweep: Sweep, jsonl_path: str | None = None, progress: bool = True) -> list[Row]:
    """Run the sweep: a preamble and the Markdown table on stdout (a row per config x mode as
    it finishes), a JSON line per row appended to `jsonl_path`, a tqdm bar on stderr (when it
    is a terminal). With `sweep.isolate` (see use_children), every size runs in child
    processes (see the module docstring); the output is the same."""
    check_sweep(sweep)
    isolated = use_children(sweep.isolate)
    device = jax.devices()[0].device_kind
    isolation = "process per size" if isolated else "none"
    print(
        f"bench: arch {sweep.arch}, batch {sweep.batch}, vocab {sweep.vocab}, kernels "
        f"{sweep.kernels}{''.join(f', {o}' for o in sweep.overrides)}; {sweep.warmup} warm-up "
        + (
            f"+ {sweep.steps} timed calls each (mean ± std, every call closed by a device sync)"
            if sweep.group == 1
            else f"+ {sweep.steps} timed samples of {sweep.group} back-to-back calls each (mean "
            "± std of the seconds per call, a device sync per sample)"
        )
        + (f"; PyTorch eager and torch.compile ({sweep.torch_compile})" if sweep.torch else "")
        + f"; device {device}, jax {jax.__version__}; isolation (--isolate {sweep.isolate}): "
        + (
            "a fresh process per size, a new one after an OOM (whose cell is re-run alone: an "
            "OOM cell is one that ran out of memory in a process of its own)"
            if isolated
            else "none, one process (an OOM can leave memory behind for the cells after it)"
        ),
        flush=True,
    )
    for dtype in sweep.dtypes:  # the op paths are those of every size: they depend on the dtype
        try:  # made for this machine (after use_children started the backend without prealloc)
            line = ops_line(sweep, sweep.sizes[0], dtype)
        except ConfigError as e:  # e.g. --set execution.loss_backend=mosaic_gpu off Hopper
            raise BenchArgError(f"--dtypes {dtype}: {e}") from None
        print(f"{dtype}: {line}", flush=True)
    print(header(sweep.torch), flush=True)
    rows: list[Row] = []
    total = len(sweep.sizes) * len(sweep.contexts) * len(sweep.dtypes)
    # disable=None: a bar on a terminal only, none in a log file (a redraw per row there)
    bar = tqdm(total=total, desc="bench", unit="config", file=sys.stderr,
               disable=None if progress else True)  # fmt: skip
    with _children(isolated) as child_env:
        for size in sweep.sizes:
            bar.set_postfix_str(f"{size}: compiling")
            for new in bench_size(sweep, size, child_env):
                for row in new:
                    tqdm.write(format_row(row, sweep.torch), file=sys.stdout)
                    if jsonl_path:
                        with open(jsonl_path, "a") as f:
                            f.write(json.dumps(row_json(row, sweep, device, isolation)) + "\n")
                rows += new
                bar.set_postfix_str(f"{size}: timing")
                bar.update()
            # Free the size's parameters and executables before the next size.
            gc.collect()
            jax.clear_caches()
    bar.close()
    if any(r.ours.status == "OOM" for r in rows):
        print(OOM_HINT, flush=True)
    sys.stdout.flush()
    return rows


OOM_HINT = (
    "OOM: a cell ran out of device memory. Activations: --set execution.remat=block "
    "(recompute each block in the backward); the fused loss's logits: a smaller "
    "--set execution.loss_chunk_mib (with execution.loss_impl=pallas); or a smaller --batch"
)


def _child_main(argv: list[str] | None = None) -> int:
    """A child process (see _child_cells): measure the --child spec's cells, stop after the
    first out-of-memory error, print each result on a CELL_TAG line as it is known."""
    p = argparse.ArgumentParser()
    p.add_argument("--child", required=True, help="JSON: sweep, size, cells")
    spec = json.loads(p.parse_args(argv).child)
    raw = spec["sweep"]
    sweep = Sweep(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})
    cells = [(int(t), str(d), str(m)) for t, d, m in spec["cells"]]
    for cell, result in measure_cells(sweep, spec["size"], cells, stop_after_oom=True):
        print(CELL_TAG + json.dumps({"cell": list(cell), "result": _encode(result)}), flush=True)
    return 0


if __name__ == "__main__":
    # `profile.py bench` set the XLA flags before starting us; for a direct run, set them
    # before the backend starts (at the first computation, not at `import jax`).
    from jaxllm.xla_flags import apply_default_xla_flags

    apply_default_xla_flags()
    sys.exit(_child_main())
