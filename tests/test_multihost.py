"""jaxllm.distributed: process-group settings, per-process data shards, and 2-process runs.

The 2-process run starts two local processes (`_worker`, in subprocesses) that join one
process group through a coordinator on a free localhost port, each with 2 fake CPU devices
(XLA_FLAGS in the child's environment only), and train the tiny associative-recall run of
tests/test_parallel.py together on a data=4 mesh. The test compares them with a single-process
run of the same global batches in this process, and checks that both end without an error
block. The failure tests run train.py's `main` in subprocesses with short time limits: a
coordinator nobody runs, and a peer killed mid-run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import types
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxllm import distributed
from jaxllm.config import ConfigError, ParallelConfig, TranslationConfig, config_changes
from jaxllm.data import associative_recall as ar
from jaxllm.data.sources import TokenSource, TranslationSource
from jaxllm.runs import load_run

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
from conftest import ROOT  # noqa: E402
from test_parallel import _cfg  # noqa: E402  (the tiny AR run: d 32, 2 layers, batch 16)

STEPS = ["--train.steps=3", "--train.eval_every=3"]  # logged every step
ERROR_BLOCK = ("Traceback", "WatchTasks", "Connection refused", "Check failure", "RPC:")


# ----------------------------------------------------------------------------- settings


def test_process_group_config_validation():
    ok = ParallelConfig(coordinator_address="10.0.0.1:1234", num_processes=2, process_id=1)
    assert (ok.num_processes, ok.process_id) == (2, 1)
    with pytest.raises(
        ConfigError, match=r"parallel.process_id must be in \[0, parallel.num_processes - 1 = 1"
    ):
        _cfg("--parallel.num_processes=2", "--parallel.process_id=2")
    with pytest.raises(ConfigError, match=r"parallel.num_processes must be >= 1, got 0"):
        _cfg("--parallel.num_processes=0")
    with pytest.raises(ConfigError, match=r"parallel.process_id must be >= 0, got -1"):
        _cfg("--parallel.process_id=-1")
    for bad in ("localhost", "localhost:0", "localhost:70000", ":1234"):
        with pytest.raises(ConfigError, match=r"coordinator_address must be HOST:PORT"):
            _cfg(f"--parallel.coordinator_address={bad}")
    with pytest.raises(ConfigError, match=r"'processes' is not in parallel"):
        _cfg("--parallel.processes=2")
    # Which process this is, and where the coordinator is, do not change what a run computes.
    moved = _cfg(
        "--parallel.coordinator_address=h:1", "--parallel.num_processes=4",
        "--parallel.process_id=3",
    )  # fmt: skip
    assert config_changes(_cfg(), moved) == []


def test_resolve_fills_from_the_environment_and_refuses_partial_groups():
    none = ParallelConfig()
    assert distributed.resolve(none, {}) == none
    staged = ParallelConfig(pipeline=2, microbatches=8)  # the mesh fields pass through whole
    assert distributed.resolve(staged, {}) == staged
    env = {"JAX_COORDINATOR_ADDRESS": "h:99", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "2"}
    got = distributed.resolve(none, env)
    assert (got.coordinator_address, got.num_processes, got.process_id) == ("h:99", 4, 2)
    # Config first, the environment for what the config leaves unset.
    got = distributed.resolve(ParallelConfig(process_id=3), env)
    assert (got.coordinator_address, got.num_processes, got.process_id) == ("h:99", 4, 3)
    with pytest.raises(
        ConfigError,
        match=r"go together .*got num_processes=2 \(config\), process_id=0 \(config\); "
        r"missing --parallel.coordinator_address or \$JAX_COORDINATOR_ADDRESS",
    ):
        distributed.resolve(ParallelConfig(num_processes=2, process_id=0), {})
    with pytest.raises(ConfigError, match=r"missing --parallel.process_id or \$JAX_PROCESS_ID"):
        distributed.resolve(none, {k: v for k, v in env.items() if k != "JAX_PROCESS_ID"})
    with pytest.raises(ConfigError, match=r"JAX_NUM_PROCESSES \(parallel.num_processes\) must be"):
        distributed.resolve(none, env | {"JAX_NUM_PROCESSES": "two"})
    with pytest.raises(
        ConfigError, match=r"process_id must be in \[0, .* = 3\], got 4 \(read from .*PROCESS_ID"
    ):
        distributed.resolve(none, env | {"JAX_PROCESS_ID": "4"})


def test_one_process_starts_nothing():
    # No settings, or a launcher of one task: nothing is started, nothing is printed.
    for env in ({}, {"SLURM_JOB_ID": "1", "SLURM_STEP_NODELIST": "n1", "SLURM_PROCID": "0",
                     "SLURM_LOCALID": "0", "SLURM_NTASKS": "1"}):  # fmt: skip
        group = distributed.initialize(ParallelConfig(), env)
        assert (group.num_processes, group.process_id, group.describe()) == (1, 0, "processes: 1")
    assert not jax.distributed.is_initialized()
    assert distributed._cluster_launch({"OMPI_MCA_orte_hnp_uri": "x", "OMPI_COMM_WORLD_SIZE": "2"})
    one = ParallelConfig(coordinator_address="localhost:1", num_processes=1, process_id=0)
    assert distributed.initialize(one, {}).num_processes == 1
    assert not jax.distributed.is_initialized()


# ----------------------------------------------------------------------------- data shards


def test_process_rows_partition_every_source():
    """Each process's rows of a batch, put side by side, are the one-process batch."""
    cuts = [slice(0, 4), slice(4, 12), slice(12, 16)]

    def check(batch_of):
        whole = batch_of(None)
        for k in whole:
            parts = [batch_of(rows)[k] for rows in cuts]
            np.testing.assert_array_equal(np.concatenate(parts), whole[k])

    split = ar.make_examples(40, 16, 4, np.random.default_rng(0))
    check(lambda rows: ar.train_batch(split, 16, 3, seed=1, rows=rows))
    tokens = np.arange(500, dtype=np.uint16)
    source = TokenSource(tokens, tokens, 16, 8, 2, seed=0)
    check(lambda rows: source.train_batch(5, rows))
    rng = np.random.default_rng(0)
    examples = [([1] * n, [2] * n) for n in rng.integers(3, 30, size=64)]
    mt_source = TranslationSource(
        types.SimpleNamespace(pad_id=0), examples, examples, [], TranslationConfig(), 16, 0, 48
    )
    check(lambda rows: mt_source.train_batch(2, rows))  # padded to the global batch's length
    # One process holds every row.
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "fsdp"))
    assert distributed.process_rows(mesh, 16) == slice(0, 16)


# ----------------------------------------------------------------------------- 2 processes


def _worker(run_dir: str) -> None:
    """One process of the pair: settings from the environment (JAX_*), as a launcher gives."""
    from jaxllm.train.loop import train

    result = train(_cfg(f"--train.run_dir={run_dir}", *STEPS))
    mesh_rows = distributed.process_rows(
        jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 1), ("data", "fsdp")), 16
    )
    print(
        json.dumps(
            {
                "process": jax.process_index(),
                "processes": jax.process_count(),
                "local_devices": jax.local_device_count(),
                "rows": [mesh_rows.start, mesh_rows.stop],
                "losses": result.losses,
                "eval_loss": result.eval_loss,
            }
        ),
        flush=True,
    )
    distributed.finish(0)  # train.py's exit: every process leaves the group together


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _spawn(code: str, args: list[str], port: int, process_id: int) -> subprocess.Popen:
    """`python -c code *args` as process `process_id` of 2 (coordinator localhost:port)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env |= {
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2 --xla_cpu_multi_thread_eigen=false",
        "JAX_PLATFORMS": "cpu",
        "JAX_COORDINATOR_ADDRESS": f"localhost:{port}",
        "JAX_NUM_PROCESSES": "2",
        "JAX_PROCESS_ID": str(process_id),
    }
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _run_pair(run_dir: Path, timeout: float = 150) -> list[dict]:
    port = _free_port()
    code = (
        f"import sys; sys.path.insert(0, {str(TESTS)!r}); import test_multihost as t; "
        "t._worker(sys.argv[1])"
    )
    procs = [_spawn(code, [str(run_dir)], port, i) for i in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        outs = [p.communicate() for p in procs]
        pytest.fail("2-process run timed out:\n" + "\n".join(e[-3000:] for _, e in outs))
    for i, (p, (_, err)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"process {i} failed (rc {p.returncode}):\n{err[-4000:]}"
        assert not any(x in err for x in ERROR_BLOCK), f"process {i} after success:\n{err}"
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


@pytest.mark.slow  # two processes, 2 devices each, train together
def test_two_processes_train_together_like_one(tmp_path):
    pair_dir, single_dir = tmp_path / "pair", tmp_path / "single"
    p0, p1 = _run_pair(pair_dir)
    assert (p0["process"], p1["process"]) == (0, 1)
    assert p0["processes"] == p1["processes"] == 2 and p0["local_devices"] == 2
    assert (p0["rows"], p1["rows"]) == ([0, 8], [8, 16])  # disjoint halves of each batch
    assert len(p0["losses"]) == 3 and p0["losses"] == p1["losses"]  # one computation
    assert p0["eval_loss"] == p1["eval_loss"]

    from jaxllm.train.loop import train

    single = train(_cfg(f"--train.run_dir={single_dir}", *STEPS))
    np.testing.assert_allclose(p0["losses"], single.losses, rtol=1e-5)
    np.testing.assert_allclose(p0["eval_loss"], single.eval_loss, rtol=1e-5)

    # One writer: process 0 alone wrote metrics, config and TensorBoard files.
    records = [json.loads(x) for x in (pair_dir / "metrics.jsonl").read_text().splitlines()]
    start = records[0]["processes"]
    assert start.startswith("processes: 2 (this is 0), coordinator localhost:"), start
    assert start.endswith("(from environment), cpu collectives gloo"), start
    assert records[0]["parallel"] == "parallel: mesh data=4 fsdp=1 over 4 cpu devices"
    train_losses = [r["loss"] for r in records if "loss" in r and "split" not in r]
    assert train_losses == p0["losses"]  # written once, not once per process
    assert len(list((pair_dir / "tensorboard").iterdir())) == 1
    assert not (pair_dir / ".lock.json").exists()  # released

    # The pair's checkpoint restores in one process (checksums verified), equal to the
    # single-process run's within float32 tolerance.
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to an older checkpoint
        _, pair, step = load_run(pair_dir)
    _, ref, _ = load_run(single_dir)
    assert step == 3
    for a, b in zip(jax.tree.leaves(pair), jax.tree.leaves(ref), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())


# ----------------------------------------------------------------------------- failures

TINY_CLI = [  # train.py flags for _cfg's tiny run, trained until a test stops it
    "--model.d_model=32", "--model.vocab_size=16", "--model.context_length=9",
    "--data.associative_recall.vocab_size=16", "--data.associative_recall.num_pairs=4",
    "--data.associative_recall.num_train=256", "--data.associative_recall.num_test=48",
    "--train.batch_size=16", "--train.steps=100000", "--train.eval_every=100000",
    "--train.log_every=1", "--optim.warmup_steps=1", "--train.progress=false",
]  # fmt: skip


def _cli(limit_s: int) -> str:
    """train.py's main with every wait of the process group cut to `limit_s`."""
    return (
        "import sys, train; d = train.distributed; "
        f"d.INIT_TIMEOUT_S = d.PEER_TIMEOUT_S = {limit_s}; sys.exit(train.main(sys.argv[1:]))"
    )


def _error_line(err: str) -> str:
    """The stderr of a failed process: exactly one line, an `error:` line."""
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-4000:]
    return lines[0]


def test_unreachable_coordinator_is_one_line(tmp_path):
    port = _free_port()  # nothing listens there: process 0 never starts
    start = time.monotonic()
    proc = _spawn(_cli(3), [f"--train.run_dir={tmp_path}", *TINY_CLI], port, 1)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and time.monotonic() - start < 45
    line = _error_line(err)
    assert line.startswith(
        "error: process 1: the process group did not form within 3 s: nothing accepts "
        f"connections at localhost:{port}; check that process 0 runs with the same "
        "--parallel.coordinator_address"
    ), line


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_peer_gone_mid_run_stops_the_others_with_one_line(tmp_path, sig):
    port = _free_port()
    procs = [_spawn(_cli(5), [f"--train.run_dir={tmp_path}", *TINY_CLI], port, i) for i in (0, 1)]
    try:
        metrics, deadline = tmp_path / "metrics.jsonl", time.monotonic() + 120
        while not (metrics.exists() and '"loss"' in metrics.read_text()):  # training runs
            assert time.monotonic() < deadline and procs[0].poll() is None, procs[0].stderr
            time.sleep(0.5)
        os.kill(procs[1].pid, sig)
        start = time.monotonic()
        _, err = procs[0].communicate(timeout=60)
        assert procs[0].returncode == 1 and time.monotonic() - start < 30
        # A collective that lost its peer says so at once; else the watch, after 5 s.
        assert re.match(
            r"error: process 0: (a peer process is gone \(.*Connection (closed|reset) by peer"
            r"|process 1 is gone: no sign of life for 5 s)",
            _error_line(err),
        ), err
    finally:
        for p in procs:
            p.kill()
            p.communicate()
