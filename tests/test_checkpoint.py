"""Orbax checkpoints: resume after SIGKILL gives the same loss curve; mismatch errors; logs."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from jaxllm.config import load_config
from jaxllm.train.checkpoint import CheckpointMismatchError
from jaxllm.train.loop import train

ROOT = Path(__file__).resolve().parents[1]
ARGS = [
    "--data.associative_recall.num_train=640",
    "--data.associative_recall.num_test=64",
    "--model.dropout=0.1",  # dropout rng must resume too
    "--train.steps=60",
    "--train.log_every=5",
    "--train.eval_every=30",
    "--train.checkpoint_every=20",
    "--optim.warmup_steps=5",
    "--train.progress=false",
]


def train_curve(run_dir: Path) -> list[tuple[int, float]]:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in recs if "loss" in r and "split" not in r]


def test_sigkill_and_resume_matches_uninterrupted_run(tmp_path):
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "killed"
    train(load_config(ROOT / "configs/ar.yaml", [*ARGS, f"--train.run_dir={ref_dir}"]))

    cmd = [sys.executable, str(ROOT / "train.py"), *ARGS, f"--train.run_dir={run_dir}"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    ckpts = run_dir / "checkpoints"
    while time.time() < deadline:  # kill once a checkpoint exists, mid-run
        if ckpts.is_dir() and any(p.name.isdigit() for p in ckpts.iterdir()):
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = max(int(p.name) for p in ckpts.iterdir() if p.name.isdigit())
    assert killed_at < 60, "the run finished before it could be killed"

    res = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert train_curve(run_dir) == train_curve(ref_dir)  # bit-exact on CPU
    assert (run_dir / "best").is_dir()


def test_restore_into_other_model_names_parameter(tmp_path):
    cfg = load_config(
        ROOT / "configs/ar.yaml", [*ARGS, "--train.steps=10", f"--train.run_dir={tmp_path}"]
    )
    train(cfg)
    other = load_config(
        ROOT / "configs/ar.yaml",
        [*ARGS, "--train.steps=20", "--model.d_model=32", f"--train.run_dir={tmp_path}"],
    )
    with pytest.raises(
        CheckpointMismatchError,
        match=r"parameter .* has shape \[.*64.*\] in the "
        r"checkpoint and \[.*32.*\] in the model",
    ):
        train(other)


def test_existing_checkpoints_without_resume_is_an_error(tmp_path):
    args = [*ARGS, "--train.steps=10", f"--train.run_dir={tmp_path}"]
    train(load_config(ROOT / "configs/ar.yaml", args))
    with pytest.raises(FileExistsError, match="already holds checkpoints"):
        train(load_config(ROOT / "configs/ar.yaml", [*args, "--train.resume=false"]))


def test_rerunning_a_finished_run_reports_its_evaluation(tmp_path, capsys):
    args = [*ARGS, "--train.steps=10", "--train.eval_every=10", f"--train.run_dir={tmp_path}"]
    first = train(load_config(ROOT / "configs/ar.yaml", args))
    again = train(load_config(ROOT / "configs/ar.yaml", args))
    assert again.eval_accuracy == first.eval_accuracy and again.eval_loss == first.eval_loss
    assert "already holds the finished run (step 10 of 10)" in capsys.readouterr().out


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    args = [
        *ARGS,
        "--train.steps=40",
        "--optim.lr=1e9",
        "--optim.grad_clip=0",
        "--optim.warmup_steps=0",
        "--train.checkpoint_every=1",
        "--train.log_every=1",
        f"--train.run_dir={tmp_path}",
    ]
    with pytest.raises(RuntimeError, match=r"loss became .* at step \d+"):
        train(load_config(ROOT / "configs/ar.yaml", args))
    steps = [int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()]
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    finite = [
        r["step"]
        for r in recs
        if "loss" in r and r["loss"] == r["loss"] and abs(r["loss"]) < float("inf")
    ]
    assert steps and max(steps) <= max(finite)


def test_tensorboard_events_written(tmp_path):
    train(
        load_config(
            ROOT / "configs/ar.yaml", [*ARGS, "--train.steps=20", f"--train.run_dir={tmp_path}"]
        )
    )
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "eval/loss"} <= tags
    assert [e.step for e in acc.Scalars("train/loss")] == [5, 10, 15, 20]
