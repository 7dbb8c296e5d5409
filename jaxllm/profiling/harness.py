"""The one benchmark harness: model sizes, a random batch, a train state, a synced step timer,
and the small output helpers every profiler shares (Markdown rows, JSON lines).

Every `profile.py` subcommand and every script in benchmarks/ that times a model builds its
inputs here, so all numbers come from one recipe: random token ids (never zeros), fresh float32
parameters and AdamW state, `warmup` untimed calls (compilation included), then `samples`
samples of `group` back-to-back calls, each sample closed by a device sync.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.config import Config, load_config, parse_overrides
from jaxllm.models import build_model
from jaxllm.train.optim import make_optimizer
from jaxllm.train.state import Batch, LMTrainState, loss_and_sums


class BadInput(ValueError):
    """Input a profiler cannot run: the message says what, and what is allowed."""


@dataclass(frozen=True)
class Size:
    d_model: int
    d_ff: int
    n_layers: int
    n_heads: int
    context: int = 1024  # model.context_length: GPT-2's position table has 1024 rows


# CS336 assignment 2, table 1; `tiny` is for tests and CPU runs.
SIZES: dict[str, Size] = {
    "tiny": Size(64, 256, 2, 4, context=128),
    "small": Size(768, 3072, 12, 12),
    "medium": Size(1024, 4096, 24, 16),
    "large": Size(1280, 5120, 36, 20),
    "xl": Size(1600, 6400, 48, 25),
    "2.7B": Size(2560, 10240, 32, 32),
}
CS336_SIZES = ("small", "medium", "large", "xl", "2.7B")
DTYPE_TAG = {"float32": "f32", "bfloat16": "bf16"}


def size_config(size: str, overrides: Sequence[str] = ()) -> Config:
    """The Config of a benchmarked model: CS336's setup (vocabulary 10000, batch 4, no dropout)
    at `size`, then `--section.key=value` overrides, as train.py reads them. model.arch=
    transformer_lm gets CS336's model: no biases, an untied head."""
    s = SIZES[size]
    model = dict(vocab_size=10_000, context_length=s.context, d_model=s.d_model, d_ff=s.d_ff,
                 n_layers=s.n_layers, n_heads=s.n_heads)  # fmt: skip
    # No data is read, but the default data section (associative recall) checks the model's
    # vocabulary and context against its task: make that task as small as allowed.
    args = [f"--model.{k}={v}" for k, v in model.items()] + ["--train.batch_size=4"]
    args += ["--execution.dropout=0.0"]
    args += ["--data.associative_recall.vocab_size=4", "--data.associative_recall.num_pairs=1"]
    if parse_overrides(list(overrides)).get("model.arch") == "transformer_lm":
        args += ["--model.bias=false", "--model.qkv_bias=false", "--model.tie_embeddings=false"]
    return load_config(None, [*args, *overrides])


def random_batch(cfg: Config, batch_size: int | None = None, seed: int = 0) -> Batch:
    """inputs, targets (B, T) int32: random ids of a (T + 1)-token window, T = context_length."""
    b = batch_size or cfg.train.batch_size
    t, v = cfg.model.context_length, cfg.model.vocab_size
    ids = np.random.default_rng(seed).integers(0, v, (b, t + 1))
    return {
        "inputs": jnp.asarray(ids[:, :-1], jnp.int32),
        "targets": jnp.asarray(ids[:, 1:], jnp.int32),
    }


def model_fns(cfg: Config) -> tuple[Callable, Callable, Callable]:
    """(init, new_state, loss) of cfg's model, to jit or trace: init(key, inputs) -> float32
    parameters; new_state(params) -> the TrainState with AdamW's moments (the schedule's length
    does not change what a step costs); loss(params, batch) -> the mean loss, no dropout."""
    model = build_model(cfg.model, cfg.execution)
    tx = make_optimizer(cfg.optim, cfg.train.steps or cfg.optim.warmup_steps + 1)

    def init(key: jax.Array, inputs: jax.Array) -> Any:
        return model.init(key, inputs)["params"]

    def new_state(params: Any) -> LMTrainState:
        return LMTrainState.create(
            apply_fn=model.apply, params=params, tx=tx, vocab_size=cfg.model.vocab_size
        )

    def loss(params: Any, batch: Batch) -> jax.Array:
        return loss_and_sums(params, model.apply, batch, None)[0]

    return init, new_state, loss


def make_state(cfg: Config, batch: Batch, seed: int = 0) -> LMTrainState:
    """Fresh float32 parameters and AdamW state for cfg."""
    init, new_state, _ = model_fns(cfg)
    return new_state(init(jax.random.PRNGKey(seed), batch["inputs"]))


@dataclass(frozen=True)
class Timing:
    median_s: float  # seconds per call
    spread_s: float  # max - min over the samples, seconds per call
    samples: tuple[float, ...]


def time_calls(
    fn: Callable[[], Any],
    *,
    warmup: int = 3,
    group: int = 10,
    samples: int = 5,
    sync: Callable[[Any], Any] = jax.block_until_ready,
) -> Timing:
    """Seconds per `fn()` call: `warmup` untimed calls, then `samples` samples of `group` calls
    back to back (dispatch overlaps device work, as in a training loop), each closed by
    `sync(last result)`."""
    out = None
    for _ in range(warmup):
        out = fn()
    sync(out)
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(group):
            out = fn()
        sync(out)
        times.append((time.perf_counter() - t0) / group)
    return Timing(statistics.median(times), max(times) - min(times), tuple(times))


def is_oom(error: BaseException | str) -> bool:
    """XLA's out-of-memory errors say RESOURCE_EXHAUSTED, PyTorch's 'out of memory' (matched on
    the message: the error class has moved between JAX versions; a child's stderr works too)."""
    msg = str(error)
    return "RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower()


def md_row(cells: Iterable[Any]) -> str:
    """One Markdown table row."""
    return "| " + " | ".join(map(str, cells)) + " |"


def md_header(cols: Sequence[str]) -> str:
    """A Markdown table's header and rule."""
    return md_row(cols) + "\n|" + "---|" * len(cols)


def append_jsonl(path: str | None, records: Iterable[dict[str, Any]]) -> None:
    """Append one JSON line per record to `path` (nothing when `path` is None or '')."""
    if path:
        with open(path, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
