"""GPT-2 small training throughput (tokens/s, MFU) on one GPU: python benchmarks/throughput.py

    python benchmarks/throughput.py [--config P] [--vary section.key=A,B ...] \
        [--section.key=value ...]

Times the jitted train_step (forward, backward, AdamW) on random tokens for each variant,
after --warmup untimed calls, as the median over --samples samples of --group back-to-back
steps closed by a device sync (profile.py's --warmup / --samples / --group).

Variants: one row per combination of the --vary values (`--vary train.batch_size=16,64`,
repeatable). Config overrides (`--section.key=value`, train.py's grammar) apply to every
variant. Defaults that differ from the preset, each dropped where an override or --vary names
the key: train.batch_size varied over 16,64,96; execution.kernels=pallas,
execution.loss_impl=pallas, execution.attention_impl=auto (the fast paths).
The all-XLA baseline: --execution.kernels=xla --execution.loss_impl=xla
--execution.mlp_impl=xla.

MFU counts 6 * N_matmul_params + 12 * L * d * T FLOPs per token (forward + backward; PaLM's
appendix B formula; N excludes the position table, includes the tied LM head) against the
H100 SXM dense bf16 peak of 989 TFLOP/s.
"""

from __future__ import annotations

from jaxllm.xla_flags import apply_default_xla_flags

apply_default_xla_flags()  # before jax is imported: XLA reads its flags then

import argparse
import itertools

import jax

from jaxllm.config import Config, ConfigError, load_config, parse_overrides
from jaxllm.models import build_model
from jaxllm.profiling.flops import train_flops_per_token
from jaxllm.profiling.harness import make_state, md_header, md_row, random_batch, time_calls
from jaxllm.train.state import train_step

PEAK_BF16 = 989e12
# What this script runs unless an override or --vary names the key: key -> values (a row each)
DEFAULTS = {
    "train.batch_size": ["16", "64", "96"],
    "execution.attention_impl": ["auto"],
    "execution.kernels": ["pallas"],
    "execution.loss_impl": ["pallas"],
}
COLUMNS = {  # always in the table, read from each variant's config
    "batch": lambda c: c.train.batch_size,
    "attention": lambda c: c.execution.attention_impl,
    "kernels": lambda c: c.execution.kernels,
    "loss": lambda c: c.execution.loss_impl,
}


def bench(cfg: Config, warmup: int, group: int, samples: int) -> dict:
    batch = cfg.train.batch_size
    data = random_batch(cfg, batch)
    state = make_state(cfg, data)
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
    key = jax.random.PRNGKey(1)
    holder = {"state": state}

    def step():
        holder["state"], metrics = train_step(holder["state"], data, key)
        return metrics

    timing = time_calls(step, warmup=warmup, group=group, samples=samples)
    tps = batch * cfg.model.context_length / timing.median_s
    return {
        "step_ms": 1e3 * timing.median_s,
        "tokens_per_s": tps,
        "mfu": tps * train_flops_per_token(cfg.model, n_params) / PEAK_BF16,
        "loss": float(step()["loss"]),
        "spread_ms": 1e3 * timing.spread_s,
    }


def parse_vary(text: str) -> tuple[str, list[str]]:
    """'section.key=A,B' -> ('section.key', ['A', 'B']) (an argparse type)."""
    key, eq, values = text.removeprefix("--").partition("=")
    items = [v.strip() for v in values.split(",") if v.strip()]
    if not eq or "." not in key or not items:
        raise argparse.ArgumentTypeError(f"expected section.key=A,B[,...], got {text!r}")
    return key, items


def check_overrides(p: argparse.ArgumentParser, overrides: list[str]) -> None:
    """argparse's error for a flag that is neither this script's nor a --section.key override."""
    bad = [a for a in overrides if a.startswith("--") and "." not in a.partition("=")[0]]
    if bad:
        p.error(f"unrecognized arguments: {' '.join(bad)} (config overrides: --section.key=value)")


def axes(overrides: list[str], vary: list[tuple[str, list[str]]]) -> dict[str, list[str]]:
    """The varied keys and their values: DEFAULTS less the keys the user names, then --vary."""
    given = set(parse_overrides(overrides))
    out = {k: v for k, v in DEFAULTS.items() if k not in given}
    for key, values in vary:
        if key in given:
            raise ConfigError(f"--vary {key}=... and the override --{key}: give one")
        out[key] = values  # a key varied twice: the last --vary wins
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        allow_abbrev=False,
        epilog="Config overrides as train.py takes them (--model.vocab_size=50304 ...) apply to "
        "every row. Unless an override or --vary names them, this script runs "
        "execution.kernels=pallas, execution.loss_impl=pallas and "
        "execution.attention_impl=auto (the preset may say otherwise) and varies "
        "train.batch_size over 16,64,96.",
    )
    p.add_argument("--config", default="configs/gpt2_124m.yaml", help="YAML preset")
    p.add_argument("--vary", type=parse_vary, action="append", default=[],
                   metavar="SECTION.KEY=A,B", help="one row per value (repeatable: every "
                   "combination); default: train.batch_size=16,64,96")  # fmt: skip
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile included)")
    p.add_argument("--samples", type=int, default=5, help="timed samples (median)")
    p.add_argument("--group", type=int, default=10, help="back-to-back steps per sample")
    args, overrides = p.parse_known_args(argv)
    check_overrides(p, overrides)
    if min(args.group, args.samples) < 1 or args.warmup < 0:
        p.error("--group and --samples must be >= 1, --warmup >= 0")
    configs = []
    try:
        varied = axes(overrides, args.vary)
        for combo in itertools.product(*varied.values()):  # all checked before anything runs
            mine = [f"--{k}={v}" for k, v in zip(varied, combo, strict=True)]
            configs.append((combo, load_config(args.config, [*mine, *overrides])))
    except ConfigError as e:
        p.error(str(e))
    extra = [k for k in varied if k not in DEFAULTS]  # columns beyond COLUMNS
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    rows = []
    for combo, cfg in configs:
        name = " ".join(combo)
        print(f"{name}: {build_model(cfg.model, cfg.execution).plan.describe()}")
        try:
            r = bench(cfg, args.warmup, args.group, args.samples)
        except Exception as e:  # report OOM etc. in the table, keep going
            print(f"{name}: failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        cells = [str(f(cfg)) for f in COLUMNS.values()]
        cells += [str(v) for k, v in zip(varied, combo, strict=True) if k in extra]
        rows.append((cells, r))
        print(f"{name}: {r}", flush=True)
    head = [*COLUMNS, *extra, "step ms", "tokens/s", "MFU", "spread ms"]
    print("\n" + md_header(head))
    for cells, r in rows:
        print(md_row([*cells, f"{r['step_ms']:.1f}", f"{r['tokens_per_s']:,.0f}",
                      f"{100 * r['mfu']:.1f}%", f"{r['spread_ms']:.2f}"]))  # fmt: skip


if __name__ == "__main__":
    main()
