"""The training loop: steps, evaluation, logs, checkpoints, resume, and a NaN guard.

With several processes (jaxllm/distributed.py) every process runs this loop on its rows of each
batch; process 0 alone writes config, logs and metrics, prints and holds the run dir lock, and
all of them save each checkpoint together (orbax).
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
from tqdm.auto import tqdm

from jaxllm import distributed, parallel
from jaxllm.atomic_file import write_text_atomic
from jaxllm.bleu import hypotheses_text
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
from jaxllm.profiling.trace import StepRangeTrace
from jaxllm.train.checkpoint import Checkpointer
from jaxllm.train.metrics_log import MetricsLog, truncate_logs
from jaxllm.train.optim import lr_schedule, make_optimizer
from jaxllm.train.run_lock import RunDirLock
from jaxllm.train.state import create_state, eval_step, raise_for_bad_ids, train_step


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
    bleu: float = math.nan  # translation: BLEU after the last epoch


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
    with rows that carry no loss to a multiple of `rows_multiple` (parallel.eval_rows_multiple:
    the run's layout for every batch, a partial last one included); None: the mesh's layout
    with one microbatch per pipeline stage (parallel.eval_rows_multiple(mesh); pass the value
    for the run's microbatches with a pipelined step_fn), 1 without a mesh."""
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
    primary = distributed.is_primary()
    with RunDirLock(cfg.train.run_dir) if primary else contextlib.nullcontext():
        return _train(cfg, source, group)


def _train(cfg: Config, source: BatchSource | None, group: distributed.ProcessGroup) -> TrainResult:
    tc = cfg.train
    primary, multi = distributed.is_primary(), jax.process_count() > 1
    run_dir = Path(tc.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    source = source or make_source(cfg)
    model = build_model(cfg.model, cfg.execution)
    mesh = parallel.make_mesh(cfg)  # ConfigError if the sizes do not fit the devices or batch
    plan = parallel.kernel_model(model, mesh).plan  # the paths the steps take on this mesh
    total = total_steps(cfg, source)
    per_epoch = source.steps_per_epoch if tc.epochs is not None else None
    if cfg.optim.warmup_steps >= total:
        raise ConfigError(
            f"optim.warmup_steps ({cfg.optim.warmup_steps}) must be < the run's {total} steps"
            + (f" ({tc.epochs} epochs x {per_epoch})" if per_epoch else "")
        )
    schedule = lr_schedule(cfg.optim, total)
    init_rng, dropout_rng = jax.random.split(jax.random.PRNGKey(tc.seed))
    example = jnp.asarray(source.train_batch(0)["inputs"])
    tx = make_optimizer(cfg.optim, total)
    # Initialised in place on the mesh: with FSDP no device ever holds the whole state.
    state = parallel.create_sharded(lambda: create_state(model, tx, init_rng, example), mesh)
    microbatches = cfg.parallel.microbatches  # pipeline stages only; None: one per stage
    step_fn = parallel.jit_train_step(train_step, state, mesh, microbatches)
    eval_fn = parallel.jit_eval_step(eval_step, state, mesh, microbatches)
    eval_rows = parallel.eval_rows_multiple(mesh, microbatches)
    # This process's rows of every train batch (several processes: a disjoint share each).
    rows = distributed.process_rows(mesh, tc.batch_size) if multi else None
    if multi:  # put once on every process's devices, not at every step
        dropout_rng = jax.device_put(dropout_rng, parallel.replicated(mesh))

    ckpt = Checkpointer(run_dir, tc.keep_checkpoints)
    start_step, best_eval = 0, math.inf
    if ckpt.latest_step() is None and (stale := ckpt.best.latest_step()) is not None:
        # A new run's best saves would never replace it (orbax keeps only newer steps).
        raise FileExistsError(
            f"{run_dir / 'best'} holds checkpoint {stale} of an earlier run, but "
            f"{run_dir / 'checkpoints'} is empty: remove {run_dir / 'best'} or choose another "
            "--train.run_dir"
        )
    if ckpt.latest_step() is not None:
        if not tc.resume:
            raise FileExistsError(
                f"{run_dir} already holds checkpoints (latest step {ckpt.latest_step()}); "
                "pass --train.resume=true to continue it or choose another --train.run_dir"
            )
        saved, old = run_dir / "config.yaml", None
        try:  # the run's config: config.yaml, else the one its newest checkpoint recorded
            if saved.is_file():
                old = load_config(saved)
            elif (recorded := ckpt.recorded_meta().get("config")) is not None:
                saved = f"checkpoint {ckpt.latest_step()}'s recorded config (no {saved})"
                old = from_dict(Config, recorded)
        except ConfigError as e:  # e.g. written by another version: name the file
            raise ConfigError(f"{saved} (the run's saved config): {e}") from None
        if old is not None:
            check_resume(old, cfg, total_steps(old, source), total)
        state, meta = ckpt.restore(state)
        start_step, best_eval = int(state.step), meta.get("best_score", math.inf)
        if not tc.allow_config_change:
            check_same_data(meta.get("data"), getattr(source, "fingerprint", None), run_dir)
        if primary:
            print(f"resuming from step {start_step} ({meta['restored_from']})", file=sys.stderr)
    if primary:
        truncate_logs(run_dir, start_step)  # what an earlier attempt logged past this point
        save_config(cfg, run_dir / "config.yaml")

    log = MetricsLog(run_dir, enabled=primary)
    # the fused loss's chunks of rows for a full batch, if it splits them (the loss runs outside
    # any pipeline, on the rows of the whole batch split over the mesh: plan.shard)
    rows = tc.batch_size * cfg.model.context_length
    chunks = plan.loss_chunks(cfg.model, cfg.execution, rows)
    layout = parallel.describe(mesh, microbatches, cfg.execution.scan_layers, cfg.train.batch_size)
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
    log.write(
        {
            "event": "resume" if start_step else "start",
            "step": start_step,
            "params": n_params,
            "ops": plan.describe(),
            **({"loss_chunks": chunks} if chunks else {}),
            "parallel": layout,
            "state_bytes_per_device": parallel.state_bytes_per_device(state),
            **({"processes": group.describe()} if multi else {}),
            "config": cfg.to_dict(),
        }
    )
    bar = tqdm(
        total=total,
        initial=start_step,
        desc="train",
        disable=not tc.progress or not primary,
        dynamic_ncols=True,
    )

    def echo(message: str) -> None:  # the console, from process 0 only
        if primary:
            bar.write(message)

    if multi:
        echo(group.describe())
    echo(plan.describe())
    if chunks:
        echo(chunks)
    state_mib = parallel.state_bytes_per_device(state) / 2**20
    echo(f"{layout}; params + optimizer state {state_mib:.1f} MiB per device")
    if per_epoch:
        echo(f"{tc.epochs} epochs of {per_epoch} steps = {total} steps")
    tokens = 0  # (padded) input tokens since the last log
    bad = jnp.full((3,), -1, jnp.int32)
    if multi:
        bad = jax.device_put(bad, parallel.replicated(mesh))
    losses, rates = [], []
    ev = {"loss": math.nan, "accuracy": math.nan}
    bleu = math.nan
    start = last_time = time.perf_counter()
    last_step = start_step

    def say(message: str, step: int) -> None:  # on the console and in metrics.jsonl
        echo(message)
        # the step: a resume from an earlier checkpoint drops it with the rest of that attempt
        log.write({"event": "trace", "step": step, "message": message})

    # train.trace_steps: a jax.profiler trace of those updates in RUN_DIR/trace (else a no-op);
    # of process 0 only.
    trace = StepRangeTrace(tc.trace_steps if primary else None, run_dir / "trace", say)

    def stop_if_diverged(flags: jax.Array | int) -> None:
        if not isinstance(flags, int):
            flags = jax.device_get(flags)  # replicated: every process reads its own copy
        ids_step, n_ids, bad_step = (-1, 0, flags) if isinstance(flags, int) else map(int, flags)
        if ids_step >= 0:  # bad data first: it is what makes the loss blow up
            raise_for_bad_ids(n_ids, ids_step, "train", cfg.model.vocab_size)
        if bad_step < 0:
            return
        kept = ckpt.latest_step()
        where = (
            f"The last good checkpoint (step {kept}) is kept in {run_dir}."
            if kept is not None
            else "No checkpoint was saved before it."
        )
        raise NonFiniteLossError(
            f"the loss or the gradient norm became non-finite at step {bad_step}; stopped. "
            f"{where} Try a lower optim.lr or a stricter optim.grad_clip."
        )

    def save(step: int, best: bool = False) -> None:
        # Never checkpoint a diverged state: the flag, then every parameter and moment, on device.
        stop_if_diverged(bad)
        if not bool(_all_finite((state.params, state.opt_state))):
            stop_if_diverged(step)
        meta = {
            "config": cfg.to_dict(),
            "data": getattr(source, "fingerprint", None),  # the token files' sha256
            "sampler": {"seed": tc.seed, "next_step": step},
            "best_score": best_eval,  # lower is better: eval loss, or -BLEU (translation)
        }
        ckpt.save(state, meta, best=best)

    try:
        for step in range(start_step, total):
            if multi:  # this process's rows only, assembled into the global batch
                batch = distributed.global_batch(
                    source.train_batch(step, rows), mesh, tc.batch_size
                )
            else:
                batch = parallel.shard_batch(source.train_batch(step), mesh)
            tokens += batch["inputs"].size  # global
            prev_bad = bad
            trace.before_step(step + 1)
            state, metrics = step_fn(state, batch, dropout_rng)
            trace.after_step(step + 1, (state, metrics))
            bad = _first_bad(bad, metrics, step + 1)
            # The previous step's flag: reading it waits for that step only, while this one
            # runs, so the loop stops one step after the first bad one at the latest.
            stop_if_diverged(prev_bad)
            done = step + 1
            if done % tc.log_every == 0 or done == total:
                m = {k: float(v) for k, v in jax.device_get(metrics).items()}
                stop_if_diverged(bad)
                now = time.perf_counter()
                rate = tokens / (now - last_time)
                tokens = 0
                if last_step > start_step:  # the first interval includes compilation
                    rates.append(rate)
                rec = {
                    "step": done,
                    "loss": m["loss"],
                    "accuracy": m["accuracy"],
                    "grad_norm": m["grad_norm"],
                    "lr": float(schedule(step)),
                    "tokens_per_s": rate,
                    "wall_time": now - start,
                }
                log.write(rec, prefix="train")
                losses.append(m["loss"])
                last_step, last_time = done, now
                bar.set_postfix(loss=f"{m['loss']:.4f}", lr=f"{rec['lr']:.2e}")
            end_of_epoch = per_epoch is not None and done % per_epoch == 0
            paused = time.perf_counter()  # eval and saving stay out of tokens/s
            if (tc.eval_every and done % tc.eval_every == 0) or done == total or end_of_epoch:
                ev = evaluate(state, source, mesh, eval_fn, eval_rows)
                rec = {"step": done, "split": "eval", **ev}
                line = f"step {done}: eval loss {ev['loss']:.4f}  accuracy {ev['accuracy']:.4f}"
                if per_epoch is not None:
                    epoch = done // per_epoch
                    scores, hyps = source.score(model, {"params": state.params})
                    bleu = scores["bleu"]
                    rec |= {"epoch": epoch, "bleu": bleu}
                    line += f"  BLEU {bleu:.2f} (epoch {epoch})"
                    hyp_file = run_dir / f"hypotheses_epoch{epoch}.txt"
                    result = {"epoch": epoch, "step": done, "validation_loss": ev["loss"]}
                    result |= scores | {"hypotheses": hyp_file.name}
                    if primary:
                        write_text_atomic(hyp_file, hypotheses_text(hyps))
                        write_text_atomic(
                            run_dir / f"eval_results_epoch{epoch}.json",
                            json.dumps(result, indent=2),
                        )
                log.write(rec | {"wall_time": time.perf_counter() - start}, prefix="eval")
                echo(line)
                # The best checkpoint: lowest eval loss, or highest BLEU where BLEU is scored
                # (a translation model's BLEU keeps rising after its eval loss turns up).
                score = -bleu if per_epoch is not None else ev["loss"]
                improved = score < best_eval
                best_eval = min(best_eval, score)
                if (
                    improved
                    or done == total
                    or (tc.checkpoint_every and done % tc.checkpoint_every == 0)
                ):
                    save(done, best=improved)
            elif tc.checkpoint_every and done % tc.checkpoint_every == 0:
                save(done)
            # the interval's tokens stay counted: move its start past the pause instead
            last_time += time.perf_counter() - paused
            bar.update(1)
        if start_step >= total:  # a finished run: report its final evaluation again
            echo(
                f"{run_dir} already holds the finished run (step {start_step} of {total}); "
                "evaluating its last checkpoint. Choose another --train.run_dir to train anew."
            )
            ev = evaluate(state, source, mesh, eval_fn, eval_rows)
    finally:
        trace.stop()  # a run that ends (or fails) inside the traced range still writes it
        bar.close()
        log.close()
        ckpt.close()
    wall = time.perf_counter() - start
    return TrainResult(
        final_step=total,
        train_loss=losses[-1] if losses else math.nan,
        eval_loss=ev["loss"],
        eval_accuracy=ev["accuracy"],
        wall_time_s=wall,
        losses=losses,
        tokens_per_s=sum(rates) / len(rates) if rates else math.nan,
        start_step=start_step,
        bleu=bleu,
    )
