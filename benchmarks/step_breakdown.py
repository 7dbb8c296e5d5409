"""Where a GPT-2 124M train step spends its time: python benchmarks/step_breakdown.py

Times (median of repeats, device-synced) the forward+loss, forward+backward, and the full
AdamW step, so the optimizer and backward costs can be read off by difference.
"""

from __future__ import annotations

from jaxllm.xla_flags import apply_default_xla_flags

apply_default_xla_flags()  # before jax is imported: XLA reads its flags then

import sys

import jax

from jaxllm.config import load_config
from jaxllm.profiling.harness import make_state, random_batch, time_calls
from jaxllm.train.state import loss_and_sums, train_step


def main() -> None:
    overrides = sys.argv[1:]
    cfg = load_config("configs/gpt2_124m.yaml", overrides)
    batch = random_batch(cfg)
    state = make_state(cfg, batch)
    apply = state.apply_fn
    fwd = jax.jit(lambda p: loss_and_sums(p, apply, batch, None)[0])
    grad = jax.jit(jax.grad(lambda p: loss_and_sums(p, apply, batch, None)[0]))
    logits = jax.jit(lambda p: apply({"params": p}, batch["inputs"]))
    r = {
        "logits only": time_calls(lambda: logits(state.params)),
        "forward+loss": time_calls(lambda: fwd(state.params)),
        "forward+backward": time_calls(lambda: grad(state.params)),
    }
    key = jax.random.PRNGKey(1)
    holder = {"state": state}

    def full():
        holder["state"], metrics = train_step(holder["state"], batch, key)
        return metrics

    r["full train_step"] = time_calls(full)
    print(
        f"{overrides} batch {cfg.train.batch_size}: "
        + ", ".join(f"{k} {1e3 * v.median_s:.1f} ms" for k, v in r.items()),
        flush=True,
    )


if __name__ == "__main__":
    main()
