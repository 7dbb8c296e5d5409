"""The training loop: steps, evaluation, logs, checkpoints, resume, and a NaN guard.

`train` reads top to bottom: setup (`_Run.__init__`: model, state, resume, logs), the loop
(`_Run.step` once per update: train step, log, evaluation, `checkpoint_policy`), finish.

With several processes (jaxllm/distributed.py) every process runs this loop on its rows of each
batch; process 0 alone writes config, logs and metrics, prints and holds the run dir lock, and
all of them save each checkpoint together (orbax).
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
from tqdm.auto import tqdm

from jaxllm import distributed, parallel
from jaxllm.config import (
    Config,
    ConfigError,
    config_changes,
    from_dict,
    load_config,
    save_config,
)
from jaxllm.data.sources import BatchSource, make_source
from jaxllm.models import build_model
from jaxllm.train.checkpoint import Checkpointer
from jaxllm.train.metrics_log import MetricsLog, truncate_logs
from jaxllm.train.optim import lr_schedule, make_optimizer
from jaxllm.train.run_lock import RunDirLock
from jaxllm.train.state import create_state, eval_step, raise_for_bad_ids, train_step
from jaxllm.train.step_trace import StepRangeTrace


class NonFiniteLossError(RuntimeError):
    """The loss or the gradient became NaN or inf; the run stopped at the last good checkpoint."""


class ResumeConfigError(ConfigError):
    """Resuming a run dir with settings that would change its result."""


@dataclass
class TrainResult:
    final_step: int
    train_loss: float
    eval_loss: float
    eval_accuracy: float
    wall_time_s: float
    losses: list[float]  # training loss at every logged step of this process
    tokens_per_s: float  # mean over this process's logged intervals (compile excluded)
    start_step: int = 0  # where this process began (> 0: resumed)
    extras: dict = field(default_factory=dict)  # the source's at the last evaluation (Extras)

    @property
    def bleu(self) -> float:
        """Translation: BLEU after the last epoch (NaN: none scored)."""
        return self.extras.get("bleu", math.nan)


def evaluate(
    state,
    source: BatchSource,
    mesh: jax.sharding.Mesh | None = None,
    step_fn=eval_step,
    rows_multiple: int | None = None,
) -> dict[str, float]:
    """Exact mean loss and accuracy over all evaluation batches (split over `mesh` if given;
    with several processes each puts only its rows of every batch on its devices). `step_fn`:
    eval_step, or its `parallel.jit_eval_step` version for the run's mesh. Each batch is padded
    with rows that carry no loss to a multiple of `rows_multiple` (parallel.eval_rows_multiple;
    None: that of `mesh` with one microbatch per pipeline stage, 1 without a mesh)."""
    if rows_multiple is None:
        rows_multiple = 1 if mesh is None else parallel.eval_rows_multiple(mesh)
    totals = {"loss_sum": 0.0, "correct": 0, "count": 0}
    step = int(state.step)
    put = distributed.put_batch if jax.process_count() > 1 else parallel.shard_batch
    for batch in source.eval_batches():
        if rows_multiple > 1:
            batch = parallel.pad_rows(batch, rows_multiple)
        if mesh is not None:
            batch = put(batch, mesh)
        out = jax.device_get(step_fn(state, batch))
        raise_for_bad_ids(out["bad_ids"], step, "evaluation", state.vocab_size)
        for k in totals:
            totals[k] += out[k].item()
    n = max(totals["count"], 1)
    return {"loss": totals["loss_sum"] / n, "accuracy": totals["correct"] / n}


@jax.jit
def _first_bad(bad: jax.Array, metrics: dict, step: jax.Array) -> jax.Array:
    # Device-side record (no host sync) of the first step with out-of-vocabulary ids in its
    # batch and how many (bad[0], bad[1]), and of the first step whose loss or gradient norm is
    # not finite (bad[2]); -1: none yet.
    n_ids = metrics["bad_ids"].astype(jnp.int32)
    ok = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])
    ids = jnp.where(bad[0] < 0, jnp.where(n_ids > 0, jnp.stack([step, n_ids]), -1), bad[:2])
    nonfinite = jnp.where((bad[2] < 0) & ~ok, step, bad[2])
    return jnp.concatenate([ids, nonfinite[None]])


@jax.jit
def _all_finite(tree) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(tree)]))


def check_resume(old: Config, new: Config, old_total: int, new_total: int) -> None:
    """Refuse (ResumeConfigError) a resume whose settings change the result, listing each
    difference; a longer run is allowed only where the lr schedule of the steps already planned
    is unchanged (a cosine spans the whole run, so usually it is not)."""
    if old.execution.scan_layers != new.execution.scan_layers:
        s = str(old.execution.scan_layers).lower()
        raise ResumeConfigError(
            f"{new.train.run_dir}'s checkpoints hold the blocks "
            f"{'stacked' if old.execution.scan_layers else 'unrolled'}: resume with "
            f"--execution.scan_layers={s}"
        )
    if new.train.allow_config_change:
        return
    changes = [
        c for c in config_changes(old, new) if not c.startswith(("train.steps", "train.epochs"))
    ]
    if old_total != new_total:
        steps = jnp.arange(min(old_total, new_total))
        same = jnp.allclose(
            lr_schedule(old.optim, old_total)(steps), lr_schedule(new.optim, new_total)(steps)
        )
        if not same or new_total < old_total:
            changes.append(
                f"run length: {old_total} -> {new_total} steps, which changes the learning-rate "
                "schedule (the cosine decays to min_lr at the last step)"
            )
    if changes:
        raise ResumeConfigError(
            f"{new.train.run_dir} holds a run with other settings: "
            + "; ".join(changes)
            + ". Choose another --train.run_dir, or pass --train.allow_config_change=true "
            "to continue with the new settings"
        )


def check_same_data(was: dict | None, now: dict | None, run_dir: Path) -> None:
    """Refuse (ResumeConfigError) a resume whose token files hold other tokens than the ones
    the checkpoint trained on (the same paths, re-made: `prepare` over them), by the sha256
    their sidecars recorded. Runs without a record (other data kinds, older checkpoints) pass."""
    if not was or not now:
        return
    changed = [
        f"{k}: sha256 {str(was.get(k))[:12]}... -> {str(v)[:12]}..."
        for k, v in now.items()
        if was.get(k) is not None and v is not None and was.get(k) != v
    ]
    if changed:
        raise ResumeConfigError(
            f"{run_dir} was trained on other token files: {'; '.join(changed)}. Choose another "
            "--train.run_dir, or pass --train.allow_config_change=true to continue on the new data"
        )


def total_steps(cfg: Config, source: BatchSource) -> int:
    """train.steps, or train.epochs x the source's batches per epoch."""
    if cfg.train.steps is not None:
        return cfg.train.steps
    if source.steps_per_epoch is None:
        raise ValueError(f"data kind {cfg.data.kind} has no epochs; set train.steps")
    return cfg.train.epochs * source.steps_per_epoch


def checkpoint_policy(done: int, total: int, every: int, improved: bool) -> bool:
    """Whether to save a checkpoint after update `done`: every `every` updates (0: never), after
    the last one, and after an evaluation that improved the best score (lowest eval loss, or the
    source's own score: Extras.score), which is then saved as the best checkpoint too."""
    return improved or done == total or bool(every and done % every == 0)


def train(cfg: Config, source: BatchSource | None = None) -> TrainResult:
    """Train `cfg.model` on `cfg.data` for train.steps steps (or train.epochs epochs); returns
    the final metrics.

    The run dir is locked for the whole run (RunDirLock: a second process is refused). With
    `train.resume` (the default) a run dir that holds checkpoints continues from the latest
    one: batches and dropout depend only on (seed, step), so the loss curve is the one an
    uninterrupted run would give; settings that would change it are refused (check_resume).

    Several processes: `cfg.parallel`'s process group (or the environment's) is started first,
    before any device is touched (jaxllm/distributed.py); only process 0 takes the lock.
    """
    group = distributed.initialize(cfg.parallel)
    with RunDirLock(cfg.train.run_dir) if distributed.is_primary() else contextlib.nullcontext():
        run = _Run(cfg, source, group)  # model, state (resumed), logs
        try:
            for step in range(run.start_step, run.total):
                run.step(step)
            if run.start_step >= run.total:
                run.report_finished()
        finally:
            run.close()
    return run.result()


class _Run:
    """One run of `train`: what setup builds, the running totals, and each part of the loop.
    With several processes, process 0 alone writes logs and files and prints."""

    def __init__(self, cfg: Config, source: BatchSource | None, group: distributed.ProcessGroup):
        self.cfg, self.group = cfg, group
        self.primary, self.multi = distributed.is_primary(), jax.process_count() > 1
        self.run_dir = Path(cfg.train.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.source = source or make_source(cfg)
        self._build()
        self._resume()
        self._open_logs()
        self.tokens = 0  # (padded) input tokens since the last log
        self.bad = jnp.full((3,), -1, jnp.int32)  # _first_bad's record, on device
        if self.multi:
            self.bad = jax.device_put(self.bad, parallel.replicated(self.mesh))
        self.losses, self.rates = [], []  # train losses, tokens/s of the logged intervals
        self.ev, self.extras = {"loss": math.nan, "accuracy": math.nan}, {}  # the last eval's
        self.start = self.last_time = time.perf_counter()
        self.last_step = self.start_step
        # train.trace_steps: a jax.profiler trace of those updates in RUN_DIR/trace (else a
        # no-op); of process 0 only.
        trace_steps = cfg.train.trace_steps if self.primary else None
        self.trace = StepRangeTrace(trace_steps, self.run_dir / "trace", self.say)

    def _build(self) -> None:
        """The model, the mesh, the run's length, the optimizer, the state and the jitted steps."""
        cfg, tc = self.cfg, self.cfg.train
        self.model = build_model(cfg.model, cfg.execution)
        self.mesh = parallel.make_mesh(cfg)  # ConfigError if the sizes do not fit
        self.plan = parallel.kernel_model(self.model, self.mesh).plan  # the steps' paths here
        self.total = total_steps(cfg, self.source)
        self.per_epoch = self.source.steps_per_epoch if tc.epochs is not None else None
        if cfg.optim.warmup_steps >= self.total:
            raise ConfigError(
                f"optim.warmup_steps ({cfg.optim.warmup_steps}) must be < the run's {self.total} "
                "steps" + (f" ({tc.epochs} epochs x {self.per_epoch})" if self.per_epoch else "")
            )
        self.schedule = lr_schedule(cfg.optim, self.total)
        init_rng, self.dropout_rng = jax.random.split(jax.random.PRNGKey(tc.seed))
        example = jnp.asarray(self.source.train_batch(0)["inputs"])
        tx = make_optimizer(cfg.optim, self.total)
        # Initialised in place on the mesh: with FSDP no device ever holds the whole state.
        self.state = parallel.create_sharded(
            lambda: create_state(self.model, tx, init_rng, example), self.mesh
        )
        microbatches = cfg.parallel.microbatches  # pipeline stages only; None: one per stage
        pipe = (microbatches, cfg.parallel.virtual_stages)
        self.step_fn = parallel.jit_train_step(train_step, self.state, self.mesh, *pipe)
        self.eval_fn = parallel.jit_eval_step(eval_step, self.state, self.mesh, *pipe)
        self.eval_rows = parallel.eval_rows_multiple(self.mesh, microbatches)
        # This process's rows of every train batch (several processes: a disjoint share each).
        self.rows = distributed.process_rows(self.mesh, tc.batch_size) if self.multi else None
        if self.multi:  # put once on every process's devices, not at every step
            self.dropout_rng = jax.device_put(self.dropout_rng, parallel.replicated(self.mesh))

    def _resume(self) -> None:
        """A run dir with checkpoints: refused (train.resume false, or other settings or data),
        else its latest checkpoint restored. Then process 0 drops what an earlier attempt
        logged past this point and writes config.yaml."""
        tc, run_dir = self.cfg.train, self.run_dir
        self.ckpt = Checkpointer(run_dir, tc.keep_checkpoints)
        self.start_step, self.best_score = 0, math.inf
        latest = self.ckpt.latest_step()
        if latest is None and (stale := self.ckpt.best.latest_step()) is not None:
            # A new run's best saves would never replace it (orbax keeps only newer steps).
            raise FileExistsError(
                f"{run_dir / 'best'} holds checkpoint {stale} of an earlier run, but "
                f"{run_dir / 'checkpoints'} is empty: remove {run_dir / 'best'} or choose "
                "another --train.run_dir"
            )
        if latest is not None:
            if not tc.resume:
                raise FileExistsError(
                    f"{run_dir} already holds checkpoints (latest step {latest}); pass "
                    "--train.resume=true to continue it or choose another --train.run_dir"
                )
            if (old := _saved_config(run_dir, self.ckpt)) is not None:
                check_resume(old, self.cfg, total_steps(old, self.source), self.total)
            self.state, meta = self.ckpt.restore(self.state)
            self.start_step = int(self.state.step)
            self.best_score = meta.get("best_score", math.inf)
            if not tc.allow_config_change:
                fingerprint = getattr(self.source, "fingerprint", None)
                check_same_data(meta.get("data"), fingerprint, run_dir)
            if self.primary:
                where = meta["restored_from"]
                print(f"resuming from step {self.start_step} ({where})", file=sys.stderr)
        if self.primary:
            truncate_logs(run_dir, self.start_step)
            save_config(self.cfg, run_dir / "config.yaml")

    def _open_logs(self) -> None:
        """metrics.jsonl's start (or resume) record, the progress bar, the console's summary."""
        cfg, tc = self.cfg, self.cfg.train
        self.log = MetricsLog(self.run_dir, enabled=self.primary)
        # the fused loss's chunks of rows for a full batch, if it splits them (the loss runs
        # outside any pipeline, on the rows of the whole batch split over the mesh: plan.shard)
        rows = tc.batch_size * cfg.model.context_length
        chunks = self.plan.loss_chunks(cfg.model, cfg.execution, rows)
        layout = parallel.describe(
            self.mesh, cfg.parallel.microbatches, tc.batch_size, cfg.parallel.virtual_stages
        )
        state_bytes = parallel.state_bytes_per_device(self.state)
        n_params = sum(x.size for x in jax.tree_util.tree_leaves(self.state.params))
        record = {"event": "resume" if self.start_step else "start", "step": self.start_step}
        record |= {"params": n_params, "ops": self.plan.describe()}
        record |= {"loss_chunks": chunks} if chunks else {}
        record |= {"parallel": layout, "state_bytes_per_device": state_bytes}
        record |= {"processes": self.group.describe()} if self.multi else {}
        self.log.write(record | {"config": cfg.to_dict()})
        quiet = not tc.progress or not self.primary
        self.bar = tqdm(
            total=self.total,
            initial=self.start_step,
            desc="train",
            disable=quiet,
            dynamic_ncols=True,
        )
        if self.multi:
            self.echo(self.group.describe())
        self.echo(self.plan.describe())
        if chunks:
            self.echo(chunks)
        self.echo(f"{layout}; params + optimizer state {state_bytes / 2**20:.1f} MiB per device")
        if self.per_epoch:
            self.echo(f"{tc.epochs} epochs of {self.per_epoch} steps = {self.total} steps")

    def echo(self, message: str) -> None:
        """On the console, from process 0 only."""
        if self.primary:
            self.bar.write(message)

    def say(self, message: str, step: int) -> None:
        """On the console and in metrics.jsonl, with its step: a resume from an earlier
        checkpoint drops it with the rest of that attempt."""
        self.echo(message)
        self.log.write({"event": "trace", "step": step, "message": message})

    def step(self, step: int) -> None:
        """Update step + 1 (`done`), then its log line, evaluation and checkpoint when due."""
        tc = self.cfg.train
        if self.multi:  # this process's rows only, assembled into the global batch
            rows = self.source.train_batch(step, self.rows)
            batch = distributed.global_batch(rows, self.mesh, tc.batch_size)
        else:
            batch = parallel.shard_batch(self.source.train_batch(step), self.mesh)
        self.tokens += batch["inputs"].size  # global
        prev_bad, done = self.bad, step + 1
        self.trace.before_step(done)
        self.state, metrics = self.step_fn(self.state, batch, self.dropout_rng)
        self.trace.after_step(done, (self.state, metrics))
        self.bad = _first_bad(self.bad, metrics, done)
        # The previous step's flag: reading it waits for that step only, while this one
        # runs, so the loop stops one step after the first bad one at the latest.
        self.stop_if_diverged(prev_bad)
        if done % tc.log_every == 0 or done == self.total:
            self._log_train(done, metrics)
        paused = time.perf_counter()  # evaluation and saving stay out of tokens/s
        end_of_epoch = self.per_epoch is not None and done % self.per_epoch == 0
        due = (tc.eval_every and done % tc.eval_every == 0) or done == self.total or end_of_epoch
        improved = bool(due) and self._evaluate(done)
        if checkpoint_policy(done, self.total, tc.checkpoint_every, improved):
            self.save(done, best=improved)
        # the interval's tokens stay counted: move its start past the pause instead
        self.last_time += time.perf_counter() - paused
        self.bar.update(1)

    def _log_train(self, done: int, metrics: dict) -> None:
        """metrics.jsonl's train record of update `done`, with tokens/s since the last one."""
        m = {k: float(v) for k, v in jax.device_get(metrics).items()}
        self.stop_if_diverged(self.bad)
        now = time.perf_counter()
        rate = self.tokens / (now - self.last_time)
        self.tokens = 0
        if self.last_step > self.start_step:  # the first interval includes compilation
            self.rates.append(rate)
        lr = float(self.schedule(done - 1))
        rec = {"step": done} | {k: m[k] for k in ("loss", "accuracy", "grad_norm")}
        rec |= {"lr": lr, "tokens_per_s": rate, "wall_time": now - self.start}
        self.log.write(rec, prefix="train")
        self.losses.append(m["loss"])
        self.last_step, self.last_time = done, now
        self.bar.set_postfix(loss=f"{m['loss']:.4f}", lr=f"{lr:.2e}")

    def _evaluate(self, done: int) -> bool:
        """Evaluate after update `done`, log it, and say whether the best score improved."""
        self.ev = ev = evaluate(self.state, self.source, self.mesh, self.eval_fn, self.eval_rows)
        rec = {"step": done, "split": "eval", **ev}
        line = f"step {done}: eval loss {ev['loss']:.4f}  accuracy {ev['accuracy']:.4f}"
        score = ev["loss"]
        # the source's own measures of this evaluation (BatchSource.evaluate_extras), if any
        hook = getattr(self.source, "evaluate_extras", None)
        epoch = done // self.per_epoch if self.per_epoch is not None else None
        out = self.run_dir if self.primary else None  # where it may write files
        if hook and (extras := hook(self.model, {"params": self.state.params}, rec, epoch, out)):
            self.extras = extras.record
            rec |= extras.record
            line += extras.line
            score = extras.score
        self.log.write(rec | {"wall_time": time.perf_counter() - self.start}, prefix="eval")
        self.echo(line)
        improved = score < self.best_score
        self.best_score = min(self.best_score, score)
        return improved

    def stop_if_diverged(self, flags: jax.Array | int) -> None:
        """Raise for _first_bad's record `flags` (or a bad step number): out-of-vocabulary ids
        (BadTokenIdsError) or a non-finite loss or gradient (NonFiniteLossError)."""
        if not isinstance(flags, int):
            flags = jax.device_get(flags)  # replicated: every process reads its own copy
        ids_step, n_ids, bad_step = (-1, 0, flags) if isinstance(flags, int) else map(int, flags)
        if ids_step >= 0:  # bad data first: it is what makes the loss blow up
            raise_for_bad_ids(n_ids, ids_step, "train", self.cfg.model.vocab_size)
        if bad_step < 0:
            return
        where = "No checkpoint was saved before it."
        if (kept := self.ckpt.latest_step()) is not None:
            where = f"The last good checkpoint (step {kept}) is kept in {self.run_dir}."
        raise NonFiniteLossError(
            f"the loss or the gradient norm became non-finite at step {bad_step}; stopped. "
            f"{where} Try a lower optim.lr or a stricter optim.grad_clip."
        )

    def save(self, step: int, best: bool = False) -> None:
        """Checkpoint the state after update `step` (never a diverged one: the flag, then every
        parameter and moment, on device)."""
        self.stop_if_diverged(self.bad)
        if not bool(_all_finite((self.state.params, self.state.opt_state))):
            self.stop_if_diverged(step)
        meta = {
            "config": self.cfg.to_dict(),
            "data": getattr(self.source, "fingerprint", None),  # the token files' sha256
            "sampler": {"seed": self.cfg.train.seed, "next_step": step},
            "best_score": self.best_score,  # lower is better: eval loss, or Extras.score
        }
        self.ckpt.save(self.state, meta, best=best)

    def report_finished(self) -> None:
        """A run dir that holds the finished run: its final evaluation again."""
        self.echo(
            f"{self.run_dir} already holds the finished run (step {self.start_step} of "
            f"{self.total}); evaluating its last checkpoint. Choose another --train.run_dir to "
            "train anew."
        )
        self.ev = evaluate(self.state, self.source, self.mesh, self.eval_fn, self.eval_rows)

    def close(self) -> None:
        self.trace.stop()  # a run that ends (or fails) inside the traced range still writes it
        self.bar.close()
        self.log.close()
        self.ckpt.close()

    def result(self) -> TrainResult:
        return TrainResult(
            final_step=self.total,
            train_loss=self.losses[-1] if self.losses else math.nan,
            eval_loss=self.ev["loss"],
            eval_accuracy=self.ev["accuracy"],
            wall_time_s=time.perf_counter() - self.start,
            losses=self.losses,
            tokens_per_s=sum(self.rates) / len(self.rates) if self.rates else math.nan,
            start_step=self.start_step,
            extras=self.extras,
        )


def _saved_config(run_dir: Path, ckpt: Checkpointer) -> Config | None:
    """The run's config: config.yaml, else the one its newest checkpoint recorded."""
    saved = run_dir / "config.yaml"
    try:
        if saved.is_file():
            return load_config(saved)
        if (recorded := ckpt.recorded_meta().get("config")) is not None:
            saved = f"checkpoint {ckpt.latest_step()}'s recorded config (no {saved})"
            return from_dict(Config, recorded)
    except ConfigError as e:  # e.g. written by another version: name the file
        raise ConfigError(f"{saved} (the run's saved config): {e}") from None
    return None
