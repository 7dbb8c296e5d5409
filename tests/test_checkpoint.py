"""Orbax checkpoints: resume after SIGKILL gives the same loss curve; mismatch errors; logs;
faults: corrupt checkpoints fall back, a full disk and a kill mid-save are one line."""

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, tiny_run
from flax.training.train_state import TrainState
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from jaxllm.config import OptimConfig
from jaxllm.models import build_model
from jaxllm.runs import CheckpointConfigWarning, load_run
from jaxllm.train.checkpoint import (
    CheckpointCorruptError,
    Checkpointer,
    CheckpointFallbackWarning,
    CheckpointMismatchError,
    CheckpointSaveError,
)
from jaxllm.train.loop import train
from jaxllm.train.metrics_log import MetricsLog, truncate_logs
from jaxllm.train.optim import make_optimizer
from jaxllm.train.run_lock import RunDirLock
from jaxllm.train.state import create_state

# A run killed and resumed: 60 steps, checkpoints every 20, dropout on (its rng must resume too).
KILLED = ["--execution.dropout=0.1", "--train.steps=60", "--train.eval_every=30",
          "--train.checkpoint_every=20"]  # fmt: skip


def train_curve(run_dir: Path) -> list[tuple[int, float]]:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in recs if "loss" in r and "split" not in r]


@pytest.mark.slow  # three trainings, two of them in train.py processes
def test_sigkill_and_resume_matches_uninterrupted_run(tmp_path):
    from conftest import TINY_RUN

    ref_dir, run_dir = tmp_path / "ref", tmp_path / "killed"
    train(tiny_run(ref_dir, *KILLED))

    cmd = [sys.executable, str(ROOT / "train.py"), *TINY_RUN, *KILLED, f"--train.run_dir={run_dir}"]
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
    events = [json.loads(x)["event"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()
              if "event" in json.loads(x)]  # fmt: skip
    assert events == ["start", "resume"]
    # TensorBoard: the killed attempt's scalars past the checkpoint are gone, not doubled
    curves = []
    for d in (run_dir, ref_dir):
        acc = EventAccumulator(str(d / "tensorboard"))
        acc.Reload()
        curves.append([(e.step, e.value) for e in acc.Scalars("train/loss")])
    assert curves[0] == curves[1]


def test_truncate_logs_keeps_what_precedes_the_restart(tmp_path):
    """A fresh start (step 0) keeps nothing of an attempt that saved no checkpoint; a resume
    from step 10 keeps the records and scalars up to 10, in both logs."""
    log = MetricsLog(tmp_path)
    log.write({"event": "start", "step": 0})
    for step in (5, 10, 15):
        log.write({"step": step, "loss": 1.0 / step}, prefix="train")
    log.close()

    def scalars():
        acc = EventAccumulator(str(tmp_path / "tensorboard"))
        acc.Reload()
        return [e.step for e in acc.Scalars("train/loss")] if acc.Tags()["scalars"] else []

    def steps():
        lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
        return [json.loads(x)["step"] for x in lines]

    truncate_logs(tmp_path, 10)
    assert steps() == [0, 5, 10] and scalars() == [5, 10]
    truncate_logs(tmp_path, 0)
    assert steps() == [] and scalars() == []


def test_restore_into_other_model_names_parameter(finished_run):
    other = tiny_run(  # past the resume check: the checkpoint itself must refuse
        finished_run, "--train.steps=30", "--model.d_model=16", "--train.allow_config_change=true"
    )
    with pytest.raises(
        CheckpointMismatchError,
        match=r"parameter .* has shape \[.*32.*\] in the "
        r"checkpoint and \[.*16.*\] in the model",
    ):
        train(other)


def test_existing_checkpoints_without_resume_is_an_error(finished_run):
    with pytest.raises(FileExistsError, match="already holds checkpoints"):
        train(tiny_run(finished_run, "--train.resume=false"))


def test_rerunning_a_finished_run_reports_its_evaluation(trained_tiny_run, finished_run, capsys):
    first = trained_tiny_run[1]
    again = train(tiny_run(finished_run))
    assert again.eval_accuracy == first.eval_accuracy and again.eval_loss == first.eval_loss
    assert "already holds the finished run (step 20 of 20)" in capsys.readouterr().out


def test_load_run_builds_the_model_the_checkpoint_was_trained_as(finished_run):
    """generate.py's loader: a config.yaml edited after training (n_heads: the same parameter
    shapes, another model) loses to the checkpoint's recorded model, with a warning naming the
    edit, while config.yaml's execution fields (kernels, dropout) apply."""
    import warnings

    run = finished_run
    cfg, variables, step = load_run(run)
    moved = run.parent / "run_moved"  # config.yaml names the old dir
    shutil.copytree(run, moved, ignore=shutil.ignore_patterns(".lock"))
    assert load_run(moved)[0].train.run_dir == str(moved)  # (translate read its tokenizer there)
    tokens = jnp.arange(12, dtype=jnp.int32)[None] % cfg.model.vocab_size
    want = build_model(cfg.model, cfg.execution).apply(variables, tokens)
    yaml = run / "config.yaml"
    text = yaml.read_text()
    assert "n_heads: 4" in text and "kernels: xla" in text
    edit = text.replace("n_heads: 4", "n_heads: 2").replace("kernels: xla", "kernels: pallas")
    yaml.write_text(edit)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        edited, variables2, step2 = load_run(run)
    assert [type(w.message) for w in seen] == [CheckpointConfigWarning]
    assert "(n_heads: 4 -> 2): the checkpoint's is used" in str(seen[0].message)
    assert (edited.model.n_heads, edited.execution.kernels, step2) == (4, "pallas", step)
    got = build_model(edited.model, edited.execution).apply(
        variables2, tokens
    )  # Pallas, interpreted
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    # training-only fields (dropout) follow config.yaml: no warning, no refusal
    yaml.write_text(text.replace("dropout: 0.0", "dropout: 0.1"))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert load_run(run)[0].execution.dropout == 0.1
    assert not [w for w in seen if w.category is CheckpointConfigWarning]
    # an unreadable newest record: the older checkpoint is restored, as restore() does
    yaml.write_text(text)
    garble_meta(run / "checkpoints" / str(step))
    with pytest.warns(CheckpointFallbackWarning):  # (it was a raw JSON error)
        load_run(run)


def test_tensorboard_events_written(trained_tiny_run):
    acc = EventAccumulator(str(trained_tiny_run[0] / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "eval/loss"} <= tags
    assert [e.step for e in acc.Scalars("train/loss")] == [5, 10, 15, 20]


# --- Faults: corrupt checkpoints, a full disk, a kill during the save into best/ ---------------
# Tiny TrainStates saved and restored directly, without training: each test takes a second or two.


def tiny_state(grad_clip: float = 1.0, step: int = 0) -> TrainState:
    """A few parameters (one of 128 KiB of random floats, stored out of line by orbax) under
    the project's optimizer; the values depend on `step`, so checkpoints differ."""
    key = jax.random.PRNGKey(step)
    params = {
        "big": {"kernel": jax.random.normal(key, (256, 128))},
        "layers": {f"l{i}": {"kernel": jnp.full((8, 8), step + i / 10)} for i in range(6)},
        "bias": jnp.arange(16, dtype=jnp.float32) + step,
    }
    tx = make_optimizer(OptimConfig(warmup_steps=0, grad_clip=grad_clip), 10)
    return TrainState.create(apply_fn=None, params=params, tx=tx).replace(step=step)


def save_steps(run_dir: Path, steps=(1, 2, 3), best=()) -> dict[int, TrainState]:
    ckpt = Checkpointer(run_dir)
    states = {s: tiny_state(step=s) for s in steps}
    for s, state in states.items():
        ckpt.save(state, {"note": s}, best=s in best)
    ckpt.close()
    return states


def same_params(a: TrainState, b: TrainState) -> bool:
    leaves = jax.tree_util.tree_leaves(a.params), jax.tree_util.tree_leaves(b.params)
    pairs = zip(*leaves, strict=True)
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in pairs)


def flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    offset = len(data) // 2 if offset is None else offset
    data[offset] ^= 0x5A
    path.write_bytes(bytes(data))


def largest_file(directory: Path) -> Path:
    return max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def assert_quiet(capfd) -> None:
    """Nothing of orbax's on stderr: its stray tensorstore callbacks print late, so wait."""
    time.sleep(0.5)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Event loop is closed" not in err, err[-3000:]
    assert "ERROR:absl" not in err, err[-3000:]


def corrupt_btree_node(step_dir: Path) -> None:
    flip_byte(next((step_dir / "state/d").iterdir()), 100)  # the b-tree node of all arrays


def corrupt_manifest(step_dir: Path) -> None:
    flip_byte(step_dir / "state/manifest.ocdbt", 60)


def delete_state_item(step_dir: Path) -> None:
    shutil.rmtree(step_dir / "state")


def garble_meta(step_dir: Path) -> None:
    (step_dir / "meta/metadata").write_text('{"step": 3, "param_sh')


def flip_array_byte(step_dir: Path) -> None:
    # The bytes of the largest array (random floats, stored raw): no orbax or tensorstore check
    # covers them, so without the checksum this restores a different state without an error.
    flip_byte(largest_file(step_dir / "state/ocdbt.process_0/d"))


def truncate_array_files(step_dir: Path) -> None:
    for f in (step_dir / "state/ocdbt.process_0/d").iterdir():
        f.write_bytes(f.read_bytes()[:100])


CORRUPTIONS = {
    "btree": (corrupt_btree_node, "Error decoding b-tree node"),
    "manifest": (corrupt_manifest, "manifest"),
    "no state item": (delete_state_item, 'Item "state" was not found'),
    "meta": (garble_meta, "its record is unreadable"),
    "array bytes": (flip_array_byte, r"array \['params'\]\['big'\]\['kernel'\] does not match"),
    "truncated arrays": (truncate_array_files, r"OUT_OF_RANGE: .*not valid for value of size"),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_corrupt_newest_checkpoint_falls_back_in_one_line(tmp_path, capfd, corruption):
    corrupt, reason = CORRUPTIONS[corruption]
    states = save_steps(tmp_path)
    corrupt(tmp_path / "checkpoints/3")
    ckpt = Checkpointer(tmp_path)
    with pytest.warns(CheckpointFallbackWarning) as record:
        state, meta = ckpt.restore(tiny_state())
    ckpt.close()
    assert (int(state.step), meta["note"]) == (2, 2) and same_params(state, states[2])
    assert len(record) == 1, [str(r.message) for r in record]
    line = str(record[0].message)
    assert "\n" not in line and re.search(reason, line), line
    assert "TensorStore details" not in line and "bound method" not in line, line  # no spec dump
    assert line.startswith(f"checkpoint {tmp_path / 'checkpoints/3'} (")
    assert line.endswith(f"restored step 2 ({tmp_path / 'checkpoints/2'}) instead")
    assert_quiet(capfd)


def test_no_intact_checkpoint_is_one_error_listing_what_was_tried(tmp_path, capfd):
    save_steps(tmp_path, steps=(1, 2))
    corrupt_manifest(tmp_path / "checkpoints/2")
    delete_state_item(tmp_path / "checkpoints/1")
    ckpt = Checkpointer(tmp_path)
    with pytest.raises(CheckpointCorruptError) as info:
        ckpt.restore(tiny_state())
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"no checkpoint in {tmp_path / 'checkpoints'} could")
    assert f"tried {tmp_path / 'checkpoints/2'} (" in msg and "checkpoints/1 (" in msg
    assert isinstance(info.value, ValueError)  # train.py: one line, exit code 2
    assert_quiet(capfd)


def test_best_copy_of_the_same_step_is_tried_before_older_steps(tmp_path):
    states = save_steps(tmp_path, best=(3,))
    corrupt_btree_node(tmp_path / "checkpoints/3")
    with pytest.warns(CheckpointFallbackWarning, match=r"restored step 3 \(.*best/3\) instead"):
        state, _ = Checkpointer(tmp_path).restore(tiny_state())
    assert int(state.step) == 3 and same_params(state, states[3])


def test_restore_a_chosen_step(tmp_path):
    states = save_steps(tmp_path)
    ckpt = Checkpointer(tmp_path)
    state, meta = ckpt.restore(tiny_state(), step=1)
    assert (int(state.step), meta["note"]) == (1, 1) and same_params(state, states[1])
    with pytest.raises(
        FileNotFoundError, match=r"no checkpoint at step 7 in .*available steps: 1, 2, 3"
    ):
        ckpt.restore(tiny_state(), step=7)
    corrupt_manifest(tmp_path / "checkpoints/2")  # a chosen step is never swapped for another
    with pytest.raises(CheckpointCorruptError, match="checkpoints/2"):
        ckpt.restore(tiny_state(), step=2)


def test_checkpoint_without_checksums_restores_unverified(tmp_path):
    """Checkpoints saved before checksums were recorded still restore (and are not checked)."""
    states = save_steps(tmp_path, steps=(1,))
    meta_file = tmp_path / "checkpoints/1/meta/metadata"
    meta = json.loads(meta_file.read_text())
    assert set(meta["checksums"]["arrays"]) >= {"['params']['big']['kernel']", "['step']"}
    del meta["checksums"]
    meta_file.write_text(json.dumps(meta))
    state, _ = Checkpointer(tmp_path).restore(tiny_state())
    assert same_params(state, states[1])


def test_a_corrupt_step_is_moved_aside_when_that_step_is_saved_again(tmp_path):
    save_steps(tmp_path, steps=(1, 2))
    corrupt_manifest(tmp_path / "checkpoints/2")
    ckpt = Checkpointer(tmp_path)
    with pytest.warns(CheckpointFallbackWarning):
        ckpt.restore(tiny_state())  # step 1; the run goes on from there
    again = tiny_state(step=2)
    ckpt.save(again, {"note": "again"})  # orbax alone skips a step not newer than its latest
    state, meta = ckpt.restore(tiny_state())
    ckpt.close()
    assert meta["note"] == "again" and same_params(state, again)
    assert (tmp_path / "corrupt_checkpoints/checkpoints_2/state/manifest.ocdbt").is_file()


def test_changed_optimizer_structure_is_a_mismatch_error(tmp_path):
    ckpt = Checkpointer(tmp_path)
    ckpt.save(tiny_state(grad_clip=1.0, step=1), {})
    no_clip = tiny_state(grad_clip=0.0)
    msg = (
        r"the optimizer state does not fit: optim settings differ from the checkpoint's "
        r"\(e.g. grad_clip on/off\)"
    )
    with pytest.raises(CheckpointMismatchError, match=msg):
        ckpt.restore(no_clip)
    # The same from orbax's own check, for checkpoints saved without checksums.
    meta_file = tmp_path / "checkpoints/1/meta/metadata"
    meta = json.loads(meta_file.read_text())
    del meta["checksums"]
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(CheckpointMismatchError, match=msg) as info:
        ckpt.restore(no_clip)
    assert "\n" not in str(info.value)


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_FSIZE fault injection: Linux")
def test_a_failed_write_during_save_is_one_line_and_leaves_no_temp_dir(tmp_path, capfd):
    """The kernel refuses the write of the array file (RLIMIT_FSIZE: EFBIG, 'File too large'),
    as it would with ENOSPC: the save fails inside tensorstore's C++ writer."""
    import resource

    states = save_steps(tmp_path, steps=(1,))
    ckpt = Checkpointer(tmp_path)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (32 * 1024, hard))
    try:
        with pytest.raises(CheckpointSaveError) as info:
            ckpt.save(tiny_state(step=2), {})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    msg = str(info.value)
    assert "\n" not in msg and "File too large" in msg, msg
    assert msg.endswith(
        f"while saving step 2 to {tmp_path / 'checkpoints'}; checkpoint 1 is intact"
    )
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["1"]
    assert_quiet(capfd)
    state, _ = ckpt.restore(tiny_state())
    assert int(state.step) == 1 and same_params(state, states[1])
    ckpt.save(tiny_state(step=2), {})  # the same Checkpointer saves again once it can
    assert ckpt.latest_step() == 2
    ckpt.close()


DISK_FULL_SCRIPT = """
import json, shutil, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_checkpoint import save_steps, tiny_state
from jaxllm.train.checkpoint import Checkpointer, CheckpointSaveError
mnt = Path(sys.argv[1])
save_steps(mnt / "run", steps=(1,))
ckpt = Checkpointer(mnt / "run")
(mnt / "filler").write_bytes(bytes(shutil.disk_usage(mnt).free - 16384))
try:
    ckpt.save(tiny_state(step=2), {{}})
    out = {{"error": None}}
except CheckpointSaveError as e:
    out = {{"error": str(e), "errno": e.errno}}
out["left"] = sorted(p.name for p in (mnt / "run/checkpoints").iterdir())
out["restored"] = int(ckpt.restore(tiny_state())[0].step)
print(json.dumps(out))
"""


def test_disk_full_during_save_on_a_small_tmpfs(tmp_path):
    """A real ENOSPC: a 2 MiB tmpfs, mounted in a private mount (and user) namespace."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    unshare = [
        "unshare",
        "-Urm",
        "sh",
        "-c",
        'mount -t tmpfs -o size=2m tmpfs "$0" && exec "$@"',
    ]
    probe = subprocess.run([*unshare, str(mnt), "true"], capture_output=True)
    if shutil.which("unshare") is None or probe.returncode != 0:
        pytest.skip("cannot mount a tmpfs in a user namespace here")
    script = DISK_FULL_SCRIPT.format(tests=str(ROOT / "tests"))
    res = subprocess.run(
        [*unshare, str(mnt), sys.executable, "-c", script, str(mnt)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["error"] == (
        f"no space left on device while saving step 2 to {mnt / 'run/checkpoints'}; "
        "checkpoint 1 is intact"
    )
    assert out["errno"] == errno.ENOSPC and out["left"] == ["1"] and out["restored"] == 1
    assert "Traceback" not in res.stderr and "absl" not in res.stderr, res.stderr[-3000:]


def test_start_removes_stale_temp_dirs_and_completes_best(tmp_path):
    """As if killed while copying step 2 into best/: checkpoints/2 is marked best, best/ holds
    step 1 and orbax's temp dir; another save was cut off in checkpoints/ too."""
    states = save_steps(tmp_path, steps=(1, 2), best=(1, 2))
    shutil.copytree(tmp_path / "best/2", tmp_path / "best/2.orbax-checkpoint-tmp")
    shutil.rmtree(tmp_path / "best/2")
    shutil.copytree(tmp_path / "checkpoints/1", tmp_path / "best/1")
    (tmp_path / "checkpoints/3.orbax-checkpoint-tmp-1234").mkdir()
    (tmp_path / "checkpoints/notes.orbax-checkpoint-tmp.txt").write_text("x")
    (tmp_path / "checkpoints/keep.txt").write_text("not orbax's")
    (tmp_path / "checkpoints/1/x.orbax-checkpoint-tmp").mkdir()  # not directly under: kept
    assert Checkpointer(tmp_path, repair=False).best.all_steps() == [1]  # the stale state

    ckpt = Checkpointer(tmp_path)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["1", "2", "keep.txt"]
    assert sorted(p.name for p in (tmp_path / "best").iterdir()) == ["2"]
    assert (tmp_path / "checkpoints/1/x.orbax-checkpoint-tmp").is_dir()
    state, meta = ckpt.restore(tiny_state(), which="best")
    assert meta["is_best"] and int(state.step) == 2 and same_params(state, states[2])
    ckpt.close()


def test_a_run_dir_in_use_by_another_process_is_not_repaired(tmp_path):
    save_steps(tmp_path, steps=(1,))
    stale = tmp_path / "checkpoints/2.orbax-checkpoint-tmp"
    stale.mkdir()  # might be that process's save in progress
    lock = RunDirLock(tmp_path)
    lock.acquire()
    try:
        lock.info_path.write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": "-"}))
        Checkpointer(tmp_path).close()
        assert stale.is_dir()
    finally:
        lock.release()
    Checkpointer(tmp_path).close()  # free again: the owner cleans up
    assert not stale.exists()


def test_training_resumes_past_a_corrupt_newest_checkpoint(finished_run, capfd):
    """The loop end to end: the newest checkpoint and its copy in best/ are corrupt; the re-run
    says so in one warning, resumes from the one before and gives the uninterrupted curve."""
    run = finished_run
    curve = train_curve(run)
    assert Checkpointer(run).latest.all_steps() == [10, 20]
    corrupt_manifest(run / "checkpoints/20")
    corrupt_btree_node(run / "best/20")
    capfd.readouterr()
    with pytest.warns(CheckpointFallbackWarning) as record:
        result = train(tiny_run(run))
    assert len(record) == 1, [str(r.message) for r in record]
    line = str(record[0].message)
    assert "checkpoints/20 (DATA_LOSS" in line and "best/20 (" in line
    assert line.endswith(f"restored step 10 ({run / 'checkpoints/10'}) instead")
    assert result.start_step == 10 and train_curve(run) == curve  # bit-exact on CPU
    assert f"resuming from step 10 ({run / 'checkpoints/10'})" in capfd.readouterr().err
    assert_quiet(capfd)
    assert (run / "corrupt_checkpoints/checkpoints_20").is_dir()  # step 20 saved anew
    cfg = tiny_run(run)
    template = create_state(
        build_model(cfg.model, cfg.execution), make_optimizer(cfg.optim, cfg.train.steps),
        jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32),
    )  # fmt: skip
    assert int(Checkpointer(run).restore(template)[0].step) == 20
