"""The scaling model on paper against the 2 x H200 and 4 x H200 measurements (GPT-2 124M, Pallas
kernels + fused loss + cuDNN attention, 32 x 1024 tokens per GPU), and `profile.py scaling`."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from jaxllm.config import load_config
from jaxllm.profiling import scaling

ROOT = Path(__file__).resolve().parents[1]
GPT2 = str(ROOT / "configs/gpt2_124m.yaml")


@pytest.fixture(scope="module")
def model():
    return load_config(GPT2, []).model


def test_dp_and_fsdp_rows_within_5_percent(model):
    two = scaling.setup_for(model, 32, step_ms=60.2)
    assert scaling.dp_ms(two, 2) == pytest.approx(63.4, rel=0.05)
    four = scaling.setup_for(model, 32, step_ms=59.4)
    assert scaling.dp_ms(four, 4) == pytest.approx(64.0, rel=0.05)
    assert scaling.fsdp_ms(four, 4) == pytest.approx(66.7, rel=0.05)
    assert scaling.predict(two, "dp", 2)["efficiency"] == pytest.approx(0.95, abs=0.05)


def test_pipeline_rows_within_10_percent(model):
    two = scaling.setup_for(model, 32, step_ms=59.9)
    rows = [(2, 4, 32, 41.7), (2, 8, 32, 47.0), (2, 16, 32, 54.7)]
    # LAYER_TICK_MS is the least-squares fit of the per-layer tick time to these rows
    xs = np.array([(m + n - 1) * two.n_layers / n for n, m, _, _ in rows])
    rs = np.array([ms - scaling.pp_ms(two, n, m, b, layer_tick_ms=0.0) for n, m, b, ms in rows])
    assert xs @ rs / (xs @ xs) == pytest.approx(scaling.LAYER_TICK_MS, abs=0.005)
    for n, m, b, ms in rows:
        assert scaling.pp_ms(two, n, m, b) == pytest.approx(ms, rel=0.10), m
    # not fitted: S=4, global batch 128 (one GPU: 228.1 ms for the 128 rows), GPipe and circular
    four = scaling.setup_for(model, 32, step_ms=228.1 / 4)
    for m, v, ms in ((8, 1, 89.1), (16, 1, 85.2), (8, 3, 90.0), (16, 3, 92.0)):
        assert scaling.pp_ms(four, 4, m, 128, virtual=v) == pytest.approx(ms, rel=0.10), (m, v)
    # not fitted: S=2 at 256 and 512 rows (2026-11-28; one GPU: 453.0 ms for 256 rows)
    big = scaling.setup_for(model, 256, step_ms=453.0)
    for m, b, ms in ((8, 256, 275.6), (16, 256, 281.6), (8, 512, 542.4), (16, 512, 536.8)):
        assert scaling.pp_ms(big, 2, m, b) == pytest.approx(ms, rel=0.05), (m, b)


def test_efficiency_falls_with_gpus_and_more_across_hosts(model):
    s = scaling.setup_for(model, 32, step_ms=60.2)
    rows = scaling.table(s, (1, 2, 4, 8, 16, 32, 64))
    for strategy in ("dp", "fsdp", "pp"):
        eff = [r["efficiency"] for r in rows if r["strategy"] == strategy]
        assert eff[0] == pytest.approx(1.0)
        assert all(a >= b for a, b in zip(eff, eff[1:], strict=False)), (strategy, eff)
    assert scaling.ring_gbps(16) < scaling.ring_gbps(8)
    assert scaling.send_gbps(16) < scaling.send_gbps(8)
    # a ring that crosses hosts at N = 16 loses more per doubling than one inside a host
    dp = {r["devices"]: r["step_ms"] for r in rows if r["strategy"] == "dp"}
    assert dp[16] - dp[8] > dp[8] - dp[4]
    assert not [r for r in rows if r["strategy"] == "pp" and r["devices"] > model.n_layers]


def _row(variant: str, devices: int, step_ms: float, **extra) -> dict:
    """A row as benchmarks/parallel_throughput.py --jsonl writes it (the keys read here)."""
    setup = {"config": GPT2, "overrides": [], "per_device_batch": 32, "kernels": "pallas"}
    batch = extra.pop("global_batch", 32 * devices)
    return {"variant": variant, "devices": devices, "global_batch": batch, "microbatches": None,
            "step_ms": step_ms, "tokens_per_s": batch * 1024 / step_ms * 1e3, "status": "ok",
            "setup": setup, **extra}  # fmt: skip


def test_cli_table_measured_rows_and_png(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("profile_cli", ROOT / "profile.py")
    cli = importlib.util.module_from_spec(spec)  # imported as `profile` it would shadow stdlib's
    spec.loader.exec_module(cli)
    rows = [
        _row("single", 1, 60.2),
        _row("dp", 2, 63.4, scaling_efficiency=0.95),
        _row("pp", 2, 41.7, global_batch=32, microbatches=4, scaling_efficiency=0.72),
        {"variant": "fsdp", "status": "OOM: out of memory"},
    ]
    measured = tmp_path / "rows.jsonl"
    measured.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"cut')
    png = tmp_path / "scaling.png"
    argv = ["scaling", "--measured", str(measured), "--png", str(png), "--gpus", "1,2,16"]
    assert cli.main([*argv, "--model.context_length=1024"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("scaling on paper: gpt2 124.4M params, 32 x 1024 tokens per GPU")
    assert "60.2 ms a step (measured)" in out
    assert "dp N=2: 63.4 ms vs 63.0 predicted; efficiency 95% vs 96%" in out
    assert "pp N=2 M=4: 41.7 ms vs" in out
    assert "fsdp N=2" not in out  # not ok: no comparison
    assert [ln.split()[0] for ln in out.splitlines()[3:6]] == ["1", "2", "16"]
    assert png.stat().st_size > 10_000
