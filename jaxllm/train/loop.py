"""The training loop: steps, periodic evaluation, progress bar and a JSON-lines metrics log."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxllm.config import Config, save_config
from jaxllm.data.sources import BatchSource, make_source
from jaxllm.models import build_model
from jaxllm.train.optim import lr_schedule, make_optimizer
from jaxllm.train.state import create_state, eval_step, train_step


@dataclass
class TrainResult:
    final_step: int
    train_loss: float
    eval_loss: float
    eval_accuracy: float
    wall_time_s: float
    losses: list[float]  # training loss at every logged step


def evaluate(state, source: BatchSource) -> dict[str, float]:
    """Exact mean loss and accuracy over all evaluation batches."""
    totals = {"loss_sum": 0.0, "correct": 0, "count": 0}
    for batch in source.eval_batches():
        out = jax.device_get(eval_step(state, batch))
        for k in totals:
            totals[k] += out[k].item()
    n = max(totals["count"], 1)
    return {"loss": totals["loss_sum"] / n, "accuracy": totals["correct"] / n}


class MetricsLog:
    """Appends one JSON object per line to run_dir/metrics.jsonl (flushed each write)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = path.open("a")

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def train(cfg: Config, source: BatchSource | None = None) -> TrainResult:
    """Train `cfg.model` on `cfg.data` for `cfg.train.steps` steps; returns the final metrics."""
    cfg.validate()
    tc = cfg.train
    run_dir = Path(tc.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    source = source or make_source(cfg)
    model = build_model(cfg.model)
    schedule = lr_schedule(cfg.optim, tc.steps)
    tx = make_optimizer(cfg.optim, tc.steps)
    init_rng, dropout_rng = jax.random.split(jax.random.PRNGKey(tc.seed))
    example = jnp.asarray(source.train_batch(0)["inputs"])
    state = create_state(model, tx, init_rng, example)
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(state.params))

    log = MetricsLog(run_dir / "metrics.jsonl")
    log.write({"event": "start", "params": n_params, "config": cfg.to_dict()})
    bar = tqdm(total=tc.steps, desc="train", disable=not tc.progress, dynamic_ncols=True)
    start = last_time = time.perf_counter()
    last_step, tokens_per_batch = 0, example.size
    losses: list[float] = []
    metrics, ev = None, {"loss": float("nan"), "accuracy": float("nan")}
    for step in range(tc.steps):
        batch = source.train_batch(step)
        state, metrics = train_step(state, batch, dropout_rng)
        done = step + 1
        if done % tc.log_every == 0 or done == tc.steps:
            m = {k: float(v) for k, v in jax.device_get(metrics).items()}
            now = time.perf_counter()
            rec = {
                "step": done,
                "loss": m["loss"],
                "accuracy": m["accuracy"],
                "grad_norm": m["grad_norm"],
                "lr": float(schedule(step)),
                "tokens_per_s": tokens_per_batch * (done - last_step) / (now - last_time),
                "wall_time": now - start,
            }
            log.write(rec)
            losses.append(m["loss"])
            last_step, last_time = done, now
            bar.set_postfix(loss=f"{m['loss']:.4f}", lr=f"{rec['lr']:.2e}")
        if done % tc.eval_every == 0 or done == tc.steps:
            ev = evaluate(state, source)
            log.write(
                {"step": done, "split": "eval", **ev, "wall_time": time.perf_counter() - start}
            )
            bar.write(f"step {done}: eval loss {ev['loss']:.4f}  accuracy {ev['accuracy']:.4f}")
            last_time = time.perf_counter()  # keep eval time out of tokens/s
        bar.update(1)
    bar.close()
    wall = time.perf_counter() - start
    log.write({"event": "end", "step": tc.steps, "wall_time": wall})
    log.close()
    return TrainResult(
        final_step=tc.steps,
        train_loss=float(np.mean(losses[-1:])),
        eval_loss=ev["loss"],
        eval_accuracy=ev["accuracy"],
        wall_time_s=wall,
        losses=losses,
    )
