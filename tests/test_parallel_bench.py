"""benchmarks/parallel_throughput.py on 2 CPU devices: every variant gives a finite row.

The script runs in a subprocess: the device count (XLA_FLAGS) is read when jax starts, so it
is set in the child's environment only (as tests/test_multihost.py does).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "parallel_throughput.py"
OVERRIDES = [  # config overrides, as train.py takes them
    "--execution.kernels=xla",
    "--execution.loss_impl=xla",
    "--model.n_layers=2",
    "--model.d_model=32",
    "--model.n_heads=2",
    "--model.context_length=32",
    "--model.vocab_size=64",
    "--data.kind=associative_recall",  # the preset's token files insist on GPT-2's vocabulary
]
TINY = [
    "--config=configs/gpt2_124m.yaml",
    "--per-device-batch=4",
    "--group=1",
    "--samples=1",
    "--warmup=1",
    *OVERRIDES,
]


def _run(args: list[str], devices: int | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env["JAX_PLATFORMS"] = "cpu"
    if devices is not None:
        # Optimisation level 0: the tiny steps compile about twice as fast, which is most of
        # the test's time.
        env["XLA_FLAGS"] = (
            f"--xla_force_host_platform_device_count={devices} "
            "--xla_cpu_multi_thread_eigen=false --xla_backend_optimization_level=0"
        )
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_every_variant_on_two_devices(tmp_path: Path) -> None:
    """One bench run (about 30 s on 2 CPU cores) checked three ways. One test, not three
    sharing a fixture: pytest-xdist would run that fixture once per worker."""
    out = tmp_path / "rows.jsonl"
    variants = "--variants=single,single_scan,dp,fsdp,fsdp_scan,pp"
    done = _run([*TINY, variants, "--microbatches=2", f"--jsonl={out}"], devices=2)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-4000:]
    assert "| variant | devices |" in done.stdout  # the markdown table
    assert "parallel: mesh data=1 fsdp=2" in done.stdout  # describe() lines, once per variant
    assert "ops: norm=xla" in done.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    setup = rows[0]["setup"]  # the overrides as given; the paths they chose
    assert setup["overrides"] == OVERRIDES and setup["kernels"] == "xla"
    assert (rows[0]["group"], rows[0]["samples"]) == (1, 1)
    check_every_variant_gives_a_finite_row(rows)
    check_fsdp_halves_the_state_per_device(rows)
    check_pipeline_rows_carry_bubble_and_bound(rows)


def check_every_variant_gives_a_finite_row(rows: list[dict]) -> None:
    by = {r["variant"]: r for r in rows}
    assert set(by) == {"single", "single_scan", "dp", "fsdp", "fsdp_scan", "pp"}
    for r in rows:
        assert r["status"] == "ok", r
        assert math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0
        assert math.isfinite(r["loss"]) and r["loss"] > 0
        assert r["step_ms"] > 0 and r["state_bytes_per_device"] > 0
        assert r["devices"] == (1 if r["variant"].startswith("single") else 2)
    assert (
        by["dp"]["global_batch"]
        == by["fsdp"]["global_batch"]
        == by["fsdp_scan"]["global_batch"]
        == 8
    )
    assert by["pp"]["global_batch"] == by["single"]["global_batch"] == 4
    assert by["dp"]["baseline"] == "single"
    assert by["fsdp_scan"]["baseline"] == "single_scan"
    assert by["pp"]["baseline"] == by["dp"]["baseline"] == by["fsdp"]["baseline"] == "single"
    for name in ("dp", "fsdp", "fsdp_scan", "pp"):
        r = by[name]
        assert r["speedup"] > 0
        assert r["scaling_efficiency"] == pytest.approx(r["speedup"] / 2)


def check_fsdp_halves_the_state_per_device(rows: list[dict]) -> None:
    by = {r["variant"]: r for r in rows}
    for fsdp, one in (("fsdp", "single"), ("fsdp_scan", "single_scan")):
        half, whole = by[fsdp]["state_bytes_per_device"], by[one]["state_bytes_per_device"]
        assert 0.45 * whole <= half <= 0.6 * whole, (fsdp, half, whole)
    assert by["dp"]["state_bytes_per_device"] == by["single"]["state_bytes_per_device"]


def check_pipeline_rows_carry_bubble_and_bound(rows: list[dict]) -> None:
    (pp,) = [r for r in rows if r["variant"] == "pp"]
    base = next(r for r in rows if r["variant"] == "single")
    assert pp["microbatches"] == 2
    assert pp["bubble_bound"] == pytest.approx(1 / 3)  # (S - 1) / (M + S - 1), S = M = 2
    assert pp["bubble"] == pytest.approx(1 - base["step_ms"] / (2 * pp["step_ms"]))
    assert "pipeline=2 (2 microbatches" in pp["parallel"]


def test_dp_on_one_device_is_refused() -> None:
    done = _run([*TINY, "--variants=dp"], devices=None)  # jax's CPU default: 1 device
    assert done.returncode != 0
    assert "1 cpu device visible" in done.stderr, done.stderr[-2000:]
    assert "needs at least 2 devices" in done.stderr
    assert "Traceback" not in done.stderr


def test_flags_of_the_old_grammar_and_the_variants_keys_are_refused() -> None:
    """Config fields are --section.key=value overrides; those a variant sets are not."""
    for args, message in (
        (["--kernels=xla", "--set", "model.n_layers=2"], "unrecognized arguments: --kernels"),
        (["--train.batch_size=8"], "--train.batch_size: the variants set it"),
    ):
        done = _run([*TINY, *args], devices=None)
        assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]
