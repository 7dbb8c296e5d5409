"""Where a GPT-2 124M train step spends its time: python benchmarks/step_breakdown.py

Times (median of repeats, device-synced) the forward+loss, forward+backward, and the full
AdamW step, so the optimizer and backward costs can be read off by difference.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jaxllm.xla_flags import apply_default_xla_flags

apply_default_xla_flags()  # before jax is imported: XLA reads its flags then

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.config import load_config
from jaxllm.models import build_model
from jaxllm.train.optim import make_optimizer
from jaxllm.train.state import _loss_and_metrics, create_state, train_step


def timeit(fn, *args, n=10, repeats=5):
    out = fn(*args)
    jax.block_until_ready(out)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            out = fn(*args)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) / n)
    return 1e3 * statistics.median(ts)


def main() -> None:
    overrides = sys.argv[1:]
    cfg = load_config("configs/gpt2_124m.yaml", overrides)
    b, t = cfg.train.batch_size, cfg.model.context_length
    model = build_model(cfg.model)
    tok = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (b, t + 1))
    batch = {
        "inputs": jnp.asarray(tok[:, :-1], jnp.int32),
        "targets": jnp.asarray(tok[:, 1:], jnp.int32),
    }
    state = create_state(
        model, make_optimizer(cfg.optim, 1000), jax.random.PRNGKey(0), batch["inputs"]
    )
    fwd = jax.jit(lambda p: _loss_and_metrics(p, state.apply_fn, batch, None)[0])
    grad = jax.jit(jax.grad(lambda p: _loss_and_metrics(p, state.apply_fn, batch, None)[0]))
    logits = jax.jit(lambda p: state.apply_fn({"params": p}, batch["inputs"]))
    r = {
        "logits only": timeit(logits, state.params),
        "forward+loss": timeit(fwd, state.params),
        "forward+backward": timeit(grad, state.params),
    }
    key = jax.random.PRNGKey(1)
    holder = [state]

    def full():
        holder[0], m = train_step(holder[0], batch, key)
        return m

    r["full train_step"] = timeit(full)
    print(
        f"{overrides} batch {b}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in r.items()), flush=True
    )


if __name__ == "__main__":
    main()
