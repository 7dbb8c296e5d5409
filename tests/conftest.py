"""Shared test setup: the repo root, tiny model and run configs, the GPT-2 BPE files, float64
references.

Test files import the names from here (`from conftest import ROOT, tiny_run`); pytest puts this
directory on sys.path. Tests marked `slow` (multi-device subprocesses, convergence, kill and
resume) run only with `pytest -m slow`: the default `pytest` leaves them out.
"""

import dataclasses
import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path

from jaxllm.xla_flags import add_xla_flags  # imports no jax: the flags must come first

# The suite runs on the CPU, as CI does, also on a machine with a GPU: many tests compare float32
# results at 1e-5 (a GPU's default TF32 matmuls miss that), count on the CPU's behaviour (Pallas
# in interpret mode, cost analysis, no allocator statistics) or start CPU subprocesses: a whole
# run on an H100 fails some 18 such tests, no library bug among them. JAX_PLATFORMS=cuda,cpu
# runs them on the GPU instead: that is how the kernel tests are run compiled
# (`JAX_PLATFORMS=cuda,cpu pytest -n 0 tests/test_pallas_*.py tests/test_ops.py
# tests/test_kernel_switch.py`; the Mosaic GPU ones need a Hopper GPU and skip elsewhere; `cpu`
# too, because jax's Mosaic GPU interpreter runs its kernels on the CPU through io_callback).
# Children started by tests inherit the setting.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Keep XLA from grabbing both cores' worth of threads per process. On a GPU reductions must not
# use atomics: the tests check that a rerun with the same seed is bit-identical. Added to any
# XLA_FLAGS already set (a flag given there wins), so an environment's own flags keep these.
add_xla_flags({"--xla_cpu_multi_thread_eigen": "false", "--xla_gpu_deterministic_ops": "true"})


import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from jaxllm.config import Config, ExecutionConfig, ModelConfig, load_config  # noqa: E402
from jaxllm.models import Decoder, build_model  # noqa: E402
from jaxllm.train.loop import train  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]  # the repository
# CI clones the repo beside shared/ (data for real runs; the tests need only the BPE files and
# make everything else themselves). JAXLLM_TEST_BPE_DIR overrides.
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared/data"
BPE_DIR = Path(os.environ.get("JAXLLM_TEST_BPE_DIR", SHARED_DATA / "gpt2_bpe"))
needs_bpe = pytest.mark.skipif(not BPE_DIR.is_dir(), reason=f"no GPT-2 BPE files at {BPE_DIR}")

# The tiny model every model-level test uses: fast on CPU, still multi-layer and multi-head.
TINY = dict(vocab_size=61, context_length=16, d_model=32, n_layers=2, n_heads=4)
ARCH_EXTRAS = {  # what each architecture needs beyond TINY
    "gpt2": {},
    "transformer_lm": dict(d_ff=48, bias=False, qkv_bias=False, tie_embeddings=False),
}


def tiny_config(arch: str = "gpt2", **overrides) -> ModelConfig:
    """A tiny ModelConfig of `arch`; keyword arguments override any field."""
    return ModelConfig(**{**TINY, "arch": arch, **ARCH_EXTRAS[arch], **overrides})


def tiny_model(arch: str = "gpt2", **overrides) -> Decoder:
    """The model of `tiny_config(arch)`; keyword arguments override any model or execution
    field (e.g. kernels="pallas", n_layers=1)."""
    names = {f.name for f in dataclasses.fields(ExecutionConfig)}
    execution = ExecutionConfig(**{k: v for k, v in overrides.items() if k in names})
    model = {k: v for k, v in overrides.items() if k not in names}
    return build_model(tiny_config(arch, **model), execution)


# The tiny training run every loop-level test starts from: the ar preset (associative recall)
# at d 32, one layer, batch 16, 20 steps, with its log, evaluation and checkpoints every few steps.
TINY_RUN = [
    "--model.d_model=32",
    "--model.n_layers=1",
    "--data.associative_recall.num_train=256",
    "--data.associative_recall.num_test=64",
    "--train.batch_size=16",
    "--train.steps=20",
    "--train.log_every=5",
    "--train.eval_every=10",
    "--train.checkpoint_every=10",
    "--optim.warmup_steps=2",
    "--train.progress=false",
]


def tiny_run(run_dir: Path | str | None, *overrides: str, preset: str = "ar.yaml") -> Config:
    """A tiny training Config of configs/`preset` writing to `run_dir`; `overrides`
    ("--section.key=value", as train.py takes them) go after TINY_RUN's and win."""
    run = [] if run_dir is None else [f"--train.run_dir={run_dir}"]
    return load_config(ROOT / "configs" / preset, [*TINY_RUN, *run, *overrides])


@pytest.fixture(scope="session")
def trained_tiny_run(tmp_path_factory):
    """(run dir, TrainResult) of tiny_run's 20 steps, trained once per worker: checkpoints
    at 10 and 20, best/, metrics.jsonl and TensorBoard logs. Read it; copy it to change it
    (`finished_run`)."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    return run_dir, train(tiny_run(run_dir))


@pytest.fixture
def finished_run(trained_tiny_run, tmp_path) -> Path:
    """A copy of trained_tiny_run's run dir, tmp_path/run, for this test to change."""
    run = tmp_path / "run"
    shutil.copytree(trained_tiny_run[0], run, ignore=shutil.ignore_patterns(".lock"))
    return run


_own_cache: str | None = None  # the compilation cache this process made (and removes)


def pytest_configure(config) -> None:
    """Set up before any test compiles; xdist workers (started later) inherit the environment."""
    global _own_cache
    # One persistent compilation cache for the whole session: the workers and the processes tests
    # start share it, so a program compiled once (a tiny run's train step, a resume's, an
    # 8-device check's) loads in milliseconds the next time. Compiling is most of a test's time
    # on a CPU. A new directory each session; a JAX_COMPILATION_CACHE_DIR already set is used.
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        _own_cache = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jax-jit-")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    min_secs = float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_secs)
    # The fast run (the default `-m "not slow"`) compiles at LLVM -O0: its programs are tiny and
    # compiling them is most of its time (a quarter of its CPU time less). The slow run keeps
    # XLA's default: its long trainings would run twice as long.
    if config.option.markexpr == "not slow":
        add_xla_flags({"--xla_backend_optimization_level": "0"})


def pytest_unconfigure(config) -> None:
    if _own_cache:
        shutil.rmtree(_own_cache, ignore_errors=True)


@pytest.fixture(params=sorted(ARCH_EXTRAS))
def arch(request) -> str:
    """Run a test once per architecture."""
    return request.param


def pallas_kernels_in(fn, *args) -> Counter:
    """{kernel name: count} of the pallas_calls in fn's jaxpr (nested jaxprs too): what a
    model really runs, not what its plan says."""
    return pallas_kernel_names(jax.make_jaxpr(fn)(*args))


def eqn_counts(closed, key) -> Counter:
    """{key(eqn): count} over a ClosedJaxpr's equations and its nested jaxprs' (not a kernel's
    body), one per call site: a nested jaxpr that several call sites share (a jitted kernel
    entry; the printed jaxpr shows it once) counts once per site. key -> None: not counted."""
    counts = Counter()

    def walk(jaxpr) -> None:
        for eqn in jaxpr.eqns:
            if (k := key(eqn)) is not None:
                counts[k] += 1
            if eqn.primitive.name == "pallas_call":
                continue
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    if hasattr(sub, "eqns"):
                        walk(sub)
                    elif hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
                        walk(sub.jaxpr)

    walk(closed.jaxpr)
    return counts


def _kernel_name(eqn) -> str | None:
    if eqn.primitive.name != "pallas_call":
        return None
    info = eqn.params.get("name_and_src_info", eqn.params.get("name"))  # differs across jax
    return getattr(info, "name", info)


def pallas_kernel_names(closed) -> Counter:
    """{kernel name: count} of the pallas_calls in a ClosedJaxpr, one per call site."""
    return eqn_counts(closed, _kernel_name)


@pytest.fixture
def float64_ref():
    """Call a jnp reference on float64 copies of its array arguments; returns NumPy float64."""

    def call(fn, *args, **kwargs):
        with jax.enable_x64(True):
            args64 = [None if a is None else np.asarray(a, np.float64) for a in args]
            return jax.tree.map(lambda r: np.asarray(r, np.float64), fn(*args64, **kwargs))

    return call
