"""The AR layer sweep CLI: one tiny run end to end (results file, plot, table)."""

import json

import pytest

from jaxllm.tasks import recall_sweep


@pytest.mark.slow  # trains, plots, resumes
def test_sweep_writes_results_and_plot(tmp_path, capsys):
    out = tmp_path / "sweep"
    args = ["--out", str(out), "--layers", "1", "--widths", "16", "--seeds", "0"]
    args += ["--model.short_conv=true", "--train.steps=110"]
    assert recall_sweep.main(args) == 0
    (rec,) = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert rec["layers"] == 1 and rec["width"] == 16 and rec["short_conv"] is True
    assert 0.0 <= rec["accuracy"] <= 1.0
    assert (out / "accuracy_vs_layers.png").stat().st_size > 1000
    assert "width 16: smallest depth with every run >= 90%" in capsys.readouterr().out
    # the same command again resumes the sweep: the finished run reports its result
    assert recall_sweep.main(args) == 0
    again = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert again == [rec | {"seconds": again[0]["seconds"]}]
    # other settings into the same --out: refused up front, naming the flag that helps
    with pytest.raises(SystemExit) as e:
        recall_sweep.main([*args[:-1], "--train.steps=300"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "holds a sweep with other settings" in err
    assert "train.steps: 110 -> 300" in err and "use another --out" in err


def test_sweep_rejects_bad_arguments(tmp_path, capsys):
    with pytest.raises(SystemExit):
        recall_sweep.main(["--out", str(tmp_path), "--train.steps=50"])
    assert "optim.warmup_steps (100) must be < train.steps (50)" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a swept field is the sweep's
        recall_sweep.main(["--out", str(tmp_path), "--train.seed=3"])
    assert "--train.seed: set by the sweep" in capsys.readouterr().err


def test_sweep_checks_every_run_before_training_any(tmp_path, capsys):
    """Width 30 with the preset's 4 heads: it trained the other runs first, then a traceback."""
    with pytest.raises(SystemExit) as e:
        recall_sweep.main(["--out", str(tmp_path / "s"), "--layers", "1", "--widths", "32", "30",
                           "--seeds", "0", "--train.steps=101"])  # fmt: skip
    assert e.value.code == 2 and "n_heads" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()  # nothing trained, nothing written
