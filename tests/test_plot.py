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
