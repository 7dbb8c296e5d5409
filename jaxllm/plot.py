"""Learning curves of a run: `python -m jaxllm.plot RUN_DIR [--out curve.png]`.

Reads RUN_DIR/metrics.jsonl and draws train and eval loss against step and wall time, and for
a translation run the BLEU of every epoch.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

from jaxllm.atomic_file import save_figure_atomic

matplotlib.use("Agg")  # files only; no display needed
import matplotlib.pyplot as plt  # noqa: E402


def read_metrics(run_dir: str | Path) -> tuple[list[dict], list[dict]]:
    """(train records, eval records) from run_dir/metrics.jsonl."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir} (is it a train.py run dir?)")
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    recs = []
    for i, line in enumerate(lines, 1):
        try:
            recs.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines):  # the last line of a killed run, cut mid-write: skipped
                break  # (resuming drops it too: metrics_log.truncate_metrics)
            raise ValueError(f"{path} line {i} is not JSON ({e})") from None
    train = [r for r in recs if "loss" in r and "split" not in r]
    evals = [r for r in recs if r.get("split") == "eval"]
    if not train:
        raise ValueError(f"{path} holds no training steps yet")
    return train, evals


def plot_run(run_dir: str | Path, out: str | Path | None = None, dpi: int = 80) -> Path:
    """Write the learning-curve PNG (default RUN_DIR/learning_curve.png); returns its path."""
    train, evals = read_metrics(run_dir)
    out = Path(out) if out else Path(run_dir) / "learning_curve.png"
    bleu = [r for r in evals if "bleu" in r]
    fig, axes = plt.subplots(1, 3 if bleu else 2, figsize=(13.5 if bleu else 9, 3.2))
    axes[1].sharey(axes[0])
    for ax, key, label in ((axes[0], "step", "step"), (axes[1], "wall_time", "wall time (s)")):
        ax.plot([r[key] for r in train], [r["loss"] for r in train], label="train", lw=1)
        if evals:
            ax.plot(
                [r[key] for r in evals], [r["loss"] for r in evals], "o-", ms=3, label="eval", lw=1
            )
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("loss (nats/token)")
    axes[0].legend()
    best = min((r["loss"] for r in evals), default=float("nan"))
    title = f"{Path(run_dir).name}: best eval loss {best:.3f}"
    if bleu:
        axes[2].plot([r["epoch"] for r in bleu], [r["bleu"] for r in bleu], "o-", ms=3, lw=1)
        axes[2].set_xlabel("epoch")
        axes[2].set_ylabel("BLEU")
        axes[2].grid(alpha=0.3)
        title += f", best BLEU {max(r['bleu'] for r in bleu):.2f}"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    save_figure_atomic(fig, out, dpi=dpi)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--out", default=None, help="PNG path (default RUN_DIR/learning_curve.png)")
    args = parser.parse_args(argv)
    try:
        print(plot_run(args.run_dir, args.out))
    except (ValueError, OSError) as e:  # bad metrics, no run dir, an --out it cannot write
        parser.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
