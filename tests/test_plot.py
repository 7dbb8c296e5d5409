import json

import pytest

from jaxllm.plot import main, plot_run


def test_plot_writes_png(tmp_path):
    recs = [{"step": s, "loss": 3.0 / s, "wall_time": 0.1 * s} for s in range(1, 20)]
    recs.append({"step": 19, "split": "eval", "loss": 0.5, "wall_time": 2.0})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = plot_run(tmp_path)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob("*.tmp.png"))


def test_plot_errors(tmp_path):
    with pytest.raises(SystemExit):
        main([str(tmp_path)])


def test_plot_a_killed_run_and_bad_outputs(tmp_path, capsys):
    """The last line of a killed run's log, cut mid-write, is skipped (a bad line elsewhere is
    an error naming the file and line); an --out without an extension or a directory is one
    error line."""
    recs = [{"step": s, "loss": 3.0 / s, "wall_time": 0.1 * s} for s in range(1, 5)]
    text = "".join(json.dumps(r) + "\n" for r in recs)
    (tmp_path / "metrics.jsonl").write_text(text + '{"step": 5, "lo')
    assert plot_run(tmp_path).is_file()
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "lo\n' + text)
    with pytest.raises(ValueError, match=r"metrics.jsonl line 1 is not JSON"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text(text)
    for out, says in ((tmp_path / "curve", "give a file extension"), (tmp_path, "directory")):
        with pytest.raises(SystemExit) as e:
            main([str(tmp_path), "--out", str(out)])
        assert e.value.code == 2 and says in capsys.readouterr().err
