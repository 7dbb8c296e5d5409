"""End-to-end timing of whole models (CS336 assignment 2, section 5.2): `python profile.py bench`.

A sweep over model sizes (CS336's table, plus `tiny` for tests), context lengths, compute dtypes
and modes: `logits` (forward to the logits), `forward` (forward + loss), `forward_backward`
(the loss's gradient w.r.t. the parameters) and `train_step` (forward, backward, global-norm
clipping and AdamW: jaxllm.train.state.train_step). Every config gets random token ids and
fresh float32 parameters (jaxllm.profiling.harness), then the course's recipe: `warmup` calls
untimed, then `steps` calls, each closed by a device sync and timed on its own; the table
reports the mean and standard deviation over those `steps` calls. Compilation is not in any of
them: every executable of a size is compiled ahead of time, in parallel threads, before the
first call is timed (see `bench_size`; `--compile-workers 1` compiles one at a time), so the
warm-up covers first-call effects only.

A config that does not fit in memory gives an `OOM` cell and the sweep goes on. With `--torch`,
the same model in PyTorch (jaxllm.profiling.torch_reference), eager and torch.compile, is timed
with the same recipe in the same process, and the table marks where ours is slower than
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
50257 --dtypes bfloat16 --kernels pallas --set model.attention_impl=dot_product_attention
--set model.loss_impl=pallas --modes logits,forward,forward_backward,train_step`.
"""

from __future__ import annotations

import functools
import gc
import json
import statistics
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from jaxllm.config import Config, ConfigError, ModelConfig, load_config
from jaxllm.models import build_model
from jaxllm.profiling.harness import make_state, random_batch, time_calls
from jaxllm.train.state import Batch, loss_and_sums, train_step


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
    overrides: tuple[str, ...] = ()  # extra config overrides, e.g. "model.attention_impl=..."
    torch: bool = False  # also time the PyTorch reference (eager and torch.compile)
    compile_workers: int = 8  # threads compiling a size's executables before timing
    torch_compile: str = "regional"  # torch_reference.compile_model: "regional" or "model"


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
    ):
        parse_choices(",".join(items), allowed, flag)
    from jaxllm.profiling.torch_reference import COMPILE_MODES  # no torch import

    if sweep.torch_compile not in COMPILE_MODES:
        allowed = ", ".join(COMPILE_MODES)
        raise BenchArgError(f"--torch-compile: unknown value {sweep.torch_compile!r}; allowed: "
                            f"{allowed} (one of them)")  # fmt: skip
    if min(sweep.batch, sweep.steps, sweep.compile_workers) < 1 or sweep.warmup < 0:
        raise BenchArgError(
            f"--batch, --steps and --compile-workers must be >= 1 and --warmup >= 0, got batch "
            f"{sweep.batch}, steps {sweep.steps}, compile workers {sweep.compile_workers}, "
            f"warmup {sweep.warmup}"
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


def is_oom(error: BaseException) -> bool:
    """XLA's out-of-memory errors (jax.errors.JaxRuntimeError, formerly XlaRuntimeError) say
    RESOURCE_EXHAUSTED; PyTorch's say 'out of memory'. Matched on the message, as the error
    class has moved between JAX versions."""
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
    """Compile `mode` ahead of time for holder["state"]'s shapes, the batch and the model's
    `apply` (its compute dtype), and return a no-argument call of it that returns something
    to wait on. train_step donates the state: each call puts the new one in the holder."""
    state = holder["state"]

    def loss(params: Any, b: Batch) -> jax.Array:
        return loss_and_sums(params, apply, b, None)[0]

    if mode == "train_step":
        key = jax.random.PRNGKey(1)
        with _TRACING:
            lowered = train_step.lower(state.replace(apply_fn=apply), batch, key)
        compiled = lowered.compile()

        def step() -> Any:
            s = holder["state"]
            if s.apply_fn is not apply:  # the state shared by the configs of another dtype
                s = s.replace(apply_fn=apply)
            holder["state"], metrics = compiled(s, batch, key)
            return metrics

        return step
    fns = {
        "logits": (lambda p, b: apply({"params": p}, b["inputs"])),
        "forward": loss,
        "forward_backward": jax.grad(loss),
    }
    if mode not in fns:
        raise BenchArgError(f"unknown mode {mode!r}; allowed: {', '.join(MODES)}")
    with _TRACING:
        lowered = jax.jit(fns[mode]).lower(state.params, batch)
    compiled = lowered.compile()
    return lambda: compiled(holder["state"].params, batch)


def measure(make: Callable[[], Callable[[], Any]], warmup: int, steps: int) -> Measured:
    """Get the call from `make()`, then `warmup` untimed calls and `steps` timed ones, each
    closed by a device sync (time_calls with one call per sample). Out of memory -> OOM."""
    try:
        timing = time_calls(make(), warmup=warmup, steps=1, repeats=steps)
    except Exception as e:
        if not is_oom(e):
            raise
        return Measured("OOM")
    return summarize(timing.samples)


def bench_size(sweep: Sweep, size: str) -> Iterator[list[Row]]:
    """All contexts x dtypes of one size, a list of rows (one per mode) per config.

    One state (float32 parameters and AdamW moments: the same for every context and compute
    dtype) serves all of them. Every executable of the size is compiled first, in parallel
    threads (XLA compiles with the GIL released; compilation dominates a sweep's wall time),
    and only then is anything timed, one config after the other, so that nothing else runs
    on the machine while a call is timed.
    """
    configs = [(t, d) for t in sweep.contexts for d in sweep.dtypes]
    cfgs = {d: build_config(size, **_config_kwargs(sweep, d)) for d in sweep.dtypes}
    # random_batch draws (max context + 1)-token windows; their first T + 1 tokens are a
    # window too: inputs[:, :T] and targets[:, :T] stay one token apart.
    full = random_batch(cfgs[sweep.dtypes[0]], sweep.batch)
    batches = {t: {k: v[:, :t] for k, v in full.items()} for t in sweep.contexts}
    # train_step last: it donates the state, which an OOM inside it leaves deleted.
    modes = [m for m in MODES if m in sweep.modes]
    model = cfgs[sweep.dtypes[0]].model
    # Jitted: one compile instead of one per op (eager init), and no temporaries.
    init = functools.partial(jax.jit(make_state, static_argnums=0), cfgs[sweep.dtypes[0]], full)
    try:
        state = init()
    except Exception as e:
        if not is_oom(e):
            raise
        n_params = _param_count(model, full)
        for t, d in configs:
            yield _rows(sweep, size, t, d, modes, n_params, {m: Measured("OOM") for m in modes})
        return
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
    holder = {"state": state}
    del state
    applies = {d: build_model(cfgs[d].model).apply for d in sweep.dtypes}
    with ThreadPoolExecutor(max(1, sweep.compile_workers)) as pool:
        futures = {
            (t, d, m): pool.submit(build_step, m, holder, batches[t], applies[d])
            for t, d in configs
            for m in modes
        }
        wait(futures.values())  # compile everything before timing anything
    for t, d in configs:
        if any(x.is_deleted() for x in jax.tree_util.tree_leaves(holder["state"])):
            holder["state"] = init()  # a train_step that ran out of memory consumed it
        results = {m: measure(futures[t, d, m].result, sweep.warmup, sweep.steps) for m in modes}
        torch = _torch_side(sweep, cfgs[d].model, batches[t], modes) if sweep.torch else {}
        yield _rows(sweep, size, t, d, modes, n_params, results, torch)
        for m in modes:  # the executables of this config are done with
            del futures[t, d, m]


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
    """Parameters of the model, from shapes only (nothing allocated: for a config that OOMs)."""
    shapes = jax.eval_shape(build_model(m).init, jax.random.PRNGKey(0), batch["inputs"][:1])
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
            steps=sweep.steps,
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


def row_json(row: Row, sweep: Sweep, device: str) -> dict[str, Any]:
    """The JSON line of a row: the roofline plot's keys (name, flops, bytes, seconds: None if
    OOM) plus everything that identifies and describes the measurement."""
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
        "n_params": row.n_params,
        "warmup": sweep.warmup,
        "steps": sweep.steps,
        "overrides": list(sweep.overrides),
        "device": device,
        "jax": jax.__version__,
    }
    if row.torch_compile is not None:
        out["torch_compile_mode"] = sweep.torch_compile
    for key, m in (("torch_eager", row.torch_eager), ("torch_compile", row.torch_compile)):
        if m is not None:
            out |= {f"{key}_status": m.status, f"{key}_seconds": m.mean_s,
                    f"{key}_std_seconds": m.std_s}  # fmt: skip
    return out


def run(sweep: Sweep, jsonl_path: str | None = None, progress: bool = True) -> list[Row]:
    """Run the sweep: a preamble and the Markdown table on stdout (a row per config x mode as
    it finishes), a JSON line per row appended to `jsonl_path`, a tqdm bar on stderr (when it
    is a terminal)."""
    check_sweep(sweep)
    device = jax.devices()[0].device_kind
    print(
        f"bench: arch {sweep.arch}, batch {sweep.batch}, vocab {sweep.vocab}, kernels "
        f"{sweep.kernels}{''.join(f', {o}' for o in sweep.overrides)}; {sweep.warmup} warm-up "
        f"+ {sweep.steps} timed calls each (mean ± std, every call closed by a device sync)"
        + (f"; PyTorch eager and torch.compile ({sweep.torch_compile})" if sweep.torch else "")
        + f"; device {device}, jax {jax.__version__}",
        flush=True,
    )
    print(header(sweep.torch), flush=True)
    rows: list[Row] = []
    total = len(sweep.sizes) * len(sweep.contexts) * len(sweep.dtypes)
    # disable=None: a bar on a terminal only, none in a log file (a redraw per row there)
    bar = tqdm(total=total, desc="bench", unit="config", file=sys.stderr,
               disable=None if progress else True)  # fmt: skip
    for size in sweep.sizes:
        bar.set_postfix_str(f"{size}: compiling")
        for new in bench_size(sweep, size):
            for row in new:
                tqdm.write(format_row(row, sweep.torch), file=sys.stdout)
                if jsonl_path:
                    with open(jsonl_path, "a") as f:
                        f.write(json.dumps(row_json(row, sweep, device)) + "\n")
            rows += new
            bar.set_postfix_str(f"{size}: timing")
            bar.update()
        # Free the size's state and executables before the next size.
        gc.collect()
        jax.clear_caches()
    bar.close()
    sys.stdout.flush()
    return rows
