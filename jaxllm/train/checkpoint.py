"""Orbax checkpoints of a run: the last K steps, plus the best by validation loss.

A checkpoint holds params, optimizer state and step (arrays) and a JSON record: the config, the
data-sampler state and every parameter's shape (so a restore into a different model fails
with a message naming the parameter instead of deep inside orbax). Orbax writes each step to a
temporary directory and renames it when complete, so a crash mid-save never leaves a
checkpoint that `restore` would pick.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax.training.train_state import TrainState


class CheckpointMismatchError(ValueError):
    """The checkpoint's parameters do not fit the model being restored."""


def param_shapes(params: Any) -> dict[str, list[int]]:
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return {jax.tree_util.keystr(path): list(np.shape(leaf)) for path, leaf in flat}


def _manager(directory: Path, keep: int) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=False)
    return ocp.CheckpointManager(directory.resolve(), options=options)


class Checkpointer:
    def __init__(self, run_dir: str | Path, keep: int = 3):
        run_dir = Path(run_dir)
        self.latest = _manager(run_dir / "checkpoints", keep)
        self.best = _manager(run_dir / "best", 1)

    def latest_step(self) -> int | None:
        return self.latest.latest_step()

    def save(self, state: TrainState, meta: dict, best: bool = False) -> None:
        """Save at `state.step`; with best=True also replace the best-by-val-loss copy."""
        step = int(state.step)
        items = {"params": state.params, "opt_state": state.opt_state, "step": state.step}
        meta = {**meta, "step": step, "param_shapes": param_shapes(state.params)}
        args = ocp.args.Composite(state=ocp.args.StandardSave(items), meta=ocp.args.JsonSave(meta))
        for mngr in (self.latest, self.best) if best else (self.latest,):
            if step not in mngr.all_steps():
                mngr.save(step, args=args)
            mngr.wait_until_finished()

    def read_meta(self, step: int | None = None, which: str = "latest") -> dict:
        mngr = self.latest if which == "latest" else self.best
        step = mngr.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {mngr.directory}")
        return mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def restore(
        self, state: TrainState, step: int | None = None, which: str = "latest"
    ) -> tuple[TrainState, dict]:
        """Restore into the structure of `state` (same model and optimizer config)."""
        mngr = self.latest if which == "latest" else self.best
        meta = self.read_meta(step, which)
        expected, saved = param_shapes(state.params), meta["param_shapes"]
        for name in sorted(set(expected) | set(saved)):
            if expected.get(name) != saved.get(name):
                raise CheckpointMismatchError(
                    f"checkpoint step {meta['step']} in {mngr.directory} does not fit this "
                    f"model: parameter {name} has shape {saved.get(name, 'missing')} in the "
                    f"checkpoint and {expected.get(name, 'missing')} in the model"
                )
        template = {"params": state.params, "opt_state": state.opt_state, "step": state.step}
        out = mngr.restore(
            meta["step"], args=ocp.args.Composite(state=ocp.args.StandardRestore(template))
        )["state"]
        state = state.replace(params=out["params"], opt_state=out["opt_state"], step=out["step"])
        return state, meta

    def close(self) -> None:
        self.latest.close()
        self.best.close()


def load_run(run_dir: str | Path, which: str = "latest") -> tuple[Any, Any, int]:
    """(config, model variables {'params': ...}, step) of a train.py run dir's checkpoint.

    `which` is 'latest' or 'best' (lowest eval loss). The optimizer state is restored into an
    abstract template and dropped, so nothing is allocated twice.
    """
    from jaxllm.config import load_config
    from jaxllm.models import build_model
    from jaxllm.train.optim import make_optimizer
    from jaxllm.train.state import create_state

    run_dir = Path(run_dir)
    if which not in ("latest", "best"):
        raise ValueError(f"which must be 'latest' or 'best', got {which!r}")
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir} is not a train.py run dir (no config.yaml)")
    cfg = load_config(run_dir / "config.yaml")
    model = build_model(cfg.model)
    example = jnp.zeros((1, 1), jnp.int32)
    # The optimizer state's structure does not depend on the schedule's length.
    tx = make_optimizer(cfg.optim, cfg.optim.warmup_steps + 1)
    abstract = jax.eval_shape(lambda: create_state(model, tx, jax.random.PRNGKey(0), example))
    ckpt = Checkpointer(run_dir, cfg.train.keep_checkpoints)
    try:
        if (ckpt.latest if which == "latest" else ckpt.best).latest_step() is None:
            raise FileNotFoundError(f"no {which} checkpoint in {run_dir}")
        state, meta = ckpt.restore(abstract, which=which)
    finally:
        ckpt.close()
    return cfg, {"params": state.params}, meta["step"]
