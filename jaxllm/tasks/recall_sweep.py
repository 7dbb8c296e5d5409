"""Associative recall vs depth (CS229S project 0, part 1): train GPT-2s of 1..L layers at a few
widths and seeds on the AR preset, plot test accuracy against the number of layers.

    python -m jaxllm.tasks.recall_sweep --out runs/ar_sweep [--layers 1 2 3 4] [--widths 32 64]
        [--seeds 0 1 2] [--workers 2] [--train.steps=2500] [--model.short_conv=true]

Writes OUT/results.jsonl (one line per run), OUT/accuracy_vs_layers.png (seed mean per width,
every run as a dot, the 90% line) and prints a Markdown table and, per width, the smallest
depth whose every run reaches 90%. Each run is `configs/ar.yaml` with n_layers, d_model, init_std =
1/sqrt(d_model) (what ar.yaml uses at d 64) and train.seed swept, one evaluation at the end
(train.eval_every = train.steps) and any `--section.key=value` overrides, in its own process;
every run's settings are checked before the first trains. Rerunning the command resumes the
sweep: finished runs report their results, an interrupted one continues from its checkpoint.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from jaxllm.atomic_file import save_figure_atomic, write_text_atomic
from jaxllm.config import Config, ConfigError, config_changes, load_config, parse_overrides
from jaxllm.console import use_one_line_warnings
from jaxllm.train.loop import ResumeConfigError, check_resume, train

PRESET = Path(__file__).resolve().parents[2] / "configs" / "ar.yaml"
TARGET = 0.9
SWEPT = ("model.n_layers", "model.d_model", "model.init_std", "train.seed", "train.run_dir")


def run_config(overrides: list[str], layers: int, width: int, seed: int, out: str) -> Config:
    """The Config of one run (ConfigError for settings the preset cannot take)."""
    base = load_config(PRESET, overrides)
    name = f"L{layers}_d{width}_s{seed}" + ("_conv" if base.model.short_conv else "")
    sweep = [
        f"--train.eval_every={base.train.steps}",
        "--train.progress=false",
        # a rerun of the sweep resumes: a finished run reports its result, a cut one goes on
        "--train.resume=true",
    ]
    cell = [
        f"--model.n_layers={layers}",
        f"--model.d_model={width}",
        f"--model.init_std={1 / math.sqrt(width):.6g}",
        f"--train.seed={seed}",
        f"--train.run_dir={Path(out) / 'runs' / name}",
    ]
    return load_config(PRESET, [*sweep, *overrides, *cell])


def run_one(overrides: list[str], layers: int, width: int, seed: int, out: str) -> dict:
    """Train one AR model (or report a finished one); returns its settings and test accuracy."""
    cfg = run_config(overrides, layers, width, seed, out)
    result = train(cfg)
    return {
        "layers": layers, "width": width, "seed": seed, "short_conv": cfg.model.short_conv,
        "steps": cfg.train.steps, "accuracy": result.eval_accuracy, "seconds": result.wall_time_s,
    }  # fmt: skip


def plot(results: list[dict], path: Path) -> None:
    import matplotlib  # only here: the worker processes, which never plot, skip its import

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for (width, conv), group in itertools.groupby(
        sorted(results, key=lambda r: (r["width"], r["short_conv"], r["layers"])),
        key=lambda r: (r["width"], r["short_conv"]),
    ):
        group = list(group)
        layers = sorted({r["layers"] for r in group})
        mean = [sum(r["accuracy"] for r in group if r["layers"] == n)
                / sum(r["layers"] == n for r in group) for n in layers]  # fmt: skip
        label = f"d {width}" + (" + short conv" if conv else "")
        (line,) = ax.plot(layers, mean, "o-", label=label)
        ax.scatter([r["layers"] for r in group], [r["accuracy"] for r in group], s=10,
                   alpha=0.4, color=line.get_color())  # fmt: skip
    ax.axhline(TARGET, color="gray", ls="--", lw=1, label="90%")
    ax.set_xlabel("layers")
    ax.set_ylabel("test accuracy")
    ax.set_xticks(sorted({r["layers"] for r in results}))
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("associative recall (8 pairs, vocab 32): accuracy vs depth", fontsize=9)
    fig.tight_layout()
    save_figure_atomic(fig, path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    use_one_line_warnings()
    p = argparse.ArgumentParser(
        prog="python -m jaxllm.tasks.recall_sweep",
        description=__doc__.split("\n\n")[0],
        epilog="Config overrides for every run: --train.steps=1000 --model.short_conv=true",
    )
    p.add_argument("--out", required=True, help="output dir (results.jsonl, PNG, runs/)")
    p.add_argument("--layers", type=int, nargs="+", default=[1, 2, 3, 4])
    p.add_argument("--widths", type=int, nargs="+", default=[32, 64])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--workers", type=int, default=1, help="runs in parallel (processes)")
    args, overrides = p.parse_known_args(argv)
    if min(args.layers + args.widths + [args.workers]) < 1:
        p.error("--layers, --widths and --workers must be >= 1")
    out = Path(args.out)
    # each value once (a repeated one would train into the same run dir twice)
    cells = itertools.product(*(dict.fromkeys(v) for v in (args.layers, args.widths, args.seeds)))
    jobs = [(overrides, n, w, s, str(out)) for n, w, s in cells]
    try:  # every run's settings checked before the first one trains, resumability included
        if swept := [f"--{k}" for k in parse_overrides(overrides) if k in SWEPT]:
            raise ConfigError(f"{', '.join(swept)}: set by the sweep (--layers, --widths, --seeds)")
        for job in jobs:
            cfg = run_config(*job)
            saved = Path(cfg.train.run_dir) / "config.yaml"
            if saved.is_file():
                old = load_config(saved)
                try:
                    check_resume(old, cfg, old.train.steps, cfg.train.steps)
                except ResumeConfigError:
                    changes = "; ".join(config_changes(old, cfg))
                    p.error(f"--out {out} holds a sweep with other settings (run "
                            f"{saved.parent.name}: {changes}): use another --out")  # fmt: skip
        out.mkdir(parents=True, exist_ok=True)
    except (ConfigError, OSError) as e:
        p.error(str(e))
    context = multiprocessing.get_context("spawn")  # fork + JAX threads can deadlock
    results = []
    try:
        with ProcessPoolExecutor(args.workers, mp_context=context) as pool:
            for r in pool.map(run_one, *zip(*jobs, strict=True)):
                results.append(r)
                print(json.dumps(r), flush=True)
                # rewritten after every run: a later failure keeps what finished
                text = "".join(json.dumps(x) + "\n" for x in results)
                write_text_atomic(out / "results.jsonl", text)
        plot(results, out / "accuracy_vs_layers.png")
    except (ConfigError, OSError) as e:  # bad data or settings, a disk problem: one line
        p.error(f"{e} ({len(results)} of {len(jobs)} runs done, in {out / 'results.jsonl'})")
    print("\n| layers | width | short conv | accuracy per seed | mean |\n|---|---|---|---|---|")
    by_cell: dict[tuple[int, int, bool], list[float]] = {}
    for r in results:
        by_cell.setdefault((r["layers"], r["width"], r["short_conv"]), []).append(r["accuracy"])
    for (n, w, conv), accs in sorted(by_cell.items()):
        cells = ", ".join(f"{a:.3f}" for a in accs)
        print(f"| {n} | {w} | {conv} | {cells} | {sum(accs) / len(accs):.3f} |")
    for w in sorted(set(args.widths)):
        ok = [n for (n, w2, _), accs in sorted(by_cell.items()) if w2 == w and min(accs) >= TARGET]
        print(f"width {w}: smallest depth with every run >= 90%: {ok[0] if ok else 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
