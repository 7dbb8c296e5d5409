"""Pin a fast path's loss curve to the all-XLA float32 model: same init, same batches.

    PYTHONPATH=$PWD python3 benchmarks/loss_curve_pin.py --jsonl $OUT/pin.jsonl          # GPU
    ... --variant "bf16 residual=execution.residual_dtype=bfloat16"  # add a variant (repeatable)
    ... --steps 3 --model.n_layers=1 --model.d_model=32 --model.context_length=16 \
        --train.batch_size=2                                                             # CPU

Every variant trains the preset's model (default GPT-2 124M, `configs/gpt2_124m.yaml`, with its
fast paths; `--section.key=value` overrides, train.py's grammar, apply to every variant; this
script's default --train.batch_size=8 and --optim.warmup_steps=max(1, steps // 8) give way to an
override) for --steps steps from the same initial parameters on the same batches of a
learnable synthetic stream (next token = 7 x previous + 13 mod 1000, 20% of the tokens random
over the whole vocabulary), and prints the loss at a few steps and its largest distance from the
reference run (all-XLA ops in float32), as RESULTS.md's correctness pins report it. Variants:
"shipped" (the preset as is), "bf16 residual" (execution.residual_dtype=bfloat16), "all-XLA bf16"
(kernels, loss and attention on XLA), the reference; --variant adds
"NAME=section.key=value[,section.key=value]" (a variant's settings win over the overrides).
"""

from __future__ import annotations

from jaxllm.xla_flags import apply_default_xla_flags

apply_default_xla_flags()

import argparse  # noqa: E402
import json  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxllm.config import ConfigError, load_config, parse_overrides  # noqa: E402
from jaxllm.profiling.harness import append_jsonl, make_state  # noqa: E402
from jaxllm.train.state import train_step  # noqa: E402

ALL_XLA = [
    "execution.kernels=xla",
    "execution.loss_impl=xla",
    "execution.attention_impl=xla",
    "execution.mlp_impl=xla",
]
VARIANTS = {
    "shipped": [],
    "bf16 residual": ["execution.residual_dtype=bfloat16"],
    "all-XLA bf16": ALL_XLA,
}
REFERENCE = ("all-XLA f32", [*ALL_XLA, "execution.compute_dtype=float32"])


def synthetic_batches(steps: int, batch: int, context: int, vocab: int, seed: int = 0):
    """`steps` batches {inputs, targets} (batch, context) int32 of the learnable stream."""
    rng = np.random.default_rng(seed)
    start = min(1000, vocab)
    for _ in range(steps):
        ids = np.empty((batch, context + 1), np.int64)
        ids[:, 0] = rng.integers(0, start, batch)
        for t in range(context):
            ids[:, t + 1] = (7 * ids[:, t] + 13) % start
        noise = rng.random(ids.shape) < 0.2
        ids[noise] = rng.integers(0, vocab, noise.sum())
        yield {"inputs": ids[:, :-1].astype(np.int32), "targets": ids[:, 1:].astype(np.int32)}


def parse_variant(text: str) -> tuple[str, list[str]]:
    """'NAME=section.key=value,...' -> (NAME, ['section.key=value', ...]); '--' before a key is
    optional."""
    name, sep, overrides = text.partition("=")
    items = [o.strip().removeprefix("--") for o in overrides.split(",") if o.strip()]
    if not sep or not name.strip() or not items or any("=" not in o for o in items):
        raise argparse.ArgumentTypeError(
            f"--variant takes NAME=section.key=value[,section.key=value...], got {text!r}"
        )
    return name.strip(), items


def run(args: argparse.Namespace) -> dict[str, list[float]]:
    variants = {**VARIANTS, **dict(args.variant), REFERENCE[0]: REFERENCE[1]}
    # this script's defaults, the user's overrides (which win), then the run length
    base = ["--train.batch_size=8", f"--optim.warmup_steps={max(1, args.steps // 8)}",
            *args.overrides, f"--train.steps={args.steps}"]  # fmt: skip
    curves: dict[str, list[float]] = {}
    for name, overrides in variants.items():
        try:
            cfg = load_config(args.config, [*base, *(f"--{o}" for o in overrides)])
        except ConfigError as e:
            raise SystemExit(f"variant {name!r}: {e}") from None
        t, b = cfg.model.context_length, cfg.train.batch_size
        data = list(synthetic_batches(args.steps, b, t, cfg.model.vocab_size))
        state = make_state(cfg, data[0], seed=0)  # the same initial parameters for every variant
        key = jax.random.PRNGKey(1)
        losses = []
        for batch in data:
            state, metrics = train_step(state, batch, key)
            losses.append(float(metrics["loss"]))
        curves[name] = losses
        record = {"variant": name, "overrides": overrides, "losses": losses,
                  "device": jax.devices()[0].device_kind}  # fmt: skip
        print(json.dumps(record), flush=True)
        append_jsonl(args.jsonl, [record])
    ref = np.asarray(curves[REFERENCE[0]])
    at = sorted({0, len(ref) // 4, len(ref) // 2, len(ref) - 1})
    print("| variant | " + " | ".join(f"step {i + 1}" for i in at) + " | max abs diff vs "
          f"{REFERENCE[0]} |")  # fmt: skip
    print("|---|" + "--:|" * (len(at) + 1))
    for name, c in curves.items():
        diff = np.max(np.abs(np.asarray(c) - ref))
        print(f"| {name} | " + " | ".join(f"{c[i]:.4f}" for i in at) + f" | {diff:.4f} |")
    return curves


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        allow_abbrev=False,
        epilog="Config overrides as train.py takes them (--model.n_layers=1 --train.batch_size=2 "
        "...) apply to every variant. Unless an override names them, this script runs "
        "train.batch_size=8 and optim.warmup_steps=max(1, steps // 8); train.steps is --steps.",
    )
    p.add_argument("--config", default="configs/gpt2_124m.yaml", help="the preset (YAML)")
    p.add_argument("--steps", type=int, default=40, help="training steps per variant")
    p.add_argument("--variant", type=parse_variant, action="append", default=[],
                   metavar="NAME=SECTION.KEY=VALUE[,...]", help="one more variant")  # fmt: skip
    p.add_argument("--jsonl", help="append one JSON record per variant here")
    args, overrides = p.parse_known_args(argv)
    args.overrides = overrides  # --section.key=value, as train.py takes them
    bad = [a for a in overrides if a.startswith("--") and "." not in a.partition("=")[0]]
    if bad:
        p.error(f"unrecognized arguments: {' '.join(bad)} (config overrides: --section.key=value)")
    try:
        if "train.steps" in parse_overrides(overrides):
            p.error("--train.steps: give the run length as --steps")
    except ConfigError as e:
        p.error(str(e))
    if args.steps < 1:
        p.error("--steps must be >= 1")
    return run(args)


if __name__ == "__main__":
    main()
