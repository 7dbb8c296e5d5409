"""Peak memory of the forward pass and of a train step per context length, with and without
rematerialisation: `python profile.py memory`.

Three kinds of number per config, each column named by where it came from:
  saved for bwd  the forward values autodiff keeps for the backward pass (jax's residuals,
             from tracing alone): exactly what remat trades for recomputation.
  xla        XLA's buffer assignment of the compiled executable (`compiled.memory_analysis()`:
             arguments + outputs - donated + the temporaries' arena). Per program, per config,
             on every backend, known before anything runs. XLA:CPU's arena does not shrink
             with remat (it keeps the same temp size), so on the CPU look at `saved for bwd`.
  allocator  the device allocator's `peak_bytes_in_use` (`jax.local_devices()[0].memory_stats()`)
             after the program ran: what the process really held, buffers XLA does not see
             included. The counter is process-wide and never goes down, so every config runs
             in a fresh subprocess: forward first with only the parameters and the batch
             resident, then the train step (parameters, AdamW state, gradients). On the CPU
             memory_stats() is None: there is no allocator column and configs run in-process.
A config that does not fit gives OOM in its cells (XLA's columns still say what it would need)
and the sweep goes on. After each train step a pprof profile of the live device buffers is
written (`jax.profiler.save_device_memory_profile`; read it with `pprof -top FILE` or `go tool
pprof`). The train step is also timed (harness.time_calls), so the table shows what remat saves
in memory and what it costs in time.

Cost per config, and what you see while it runs. Each config traces its programs once, on the
host, then compiles each once: the parameter init, the forward pass, the AdamW state built
from those parameters (a few element-wise ops) and the train step; the train step's compile
is the longest (about three quarters of the compile time on a CPU; a 36-layer model is
unrolled, its HLO is 36 blocks long). A row is printed, and its
JSON line appended, as soon as its config finishes, so a sweep cut off by a time limit keeps
the rows it finished; progress (each phase's seconds) and every config's wall time go to
stderr. Subprocesses allocate on demand (XLA_PYTHON_CLIENT_PREALLOCATE=false, set for them
and for this process, which only reads device stats): a preallocating child would take 75% of
the GPU. `--jobs N` starts N config subprocesses at a time, but only their host-side start-up
and tracing overlap: each then waits for its turn, given in config order once the previous
config's process has exited (its device memory freed), to compile (XLA:GPU autotunes its
kernels on the device) and run, so one config at a time uses the device and each one's peak,
time and autotuning are its own. Before 2026-11-23 a file lock covered running only: N
children compiled a 36-layer model side by side on the same cores and GPU (each also
compiling the parameter init twice), so they all finished late and together, and rows were
printed only in config order once a whole child had exited, with no progress shown:
`--size large --jobs 3/4` printed no row in 200 s on an H100 (on a 2-core CPU, `--size tiny
--contexts 32,64 --isolate always --jobs 4`: first row after 21.7 s before, 8.7 s after, all
four in 23 s either way).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from jaxllm.atomic_file import save_figure_atomic
from jaxllm.models import build_model
from jaxllm.ops import plan_ops
from jaxllm.profiling.bench import SIZES, BenchArgError, build_config, is_oom
from jaxllm.profiling.harness import random_batch, time_calls
from jaxllm.profiling.isolate import Child, stdin_turn
from jaxllm.profiling.isolate import Turns as _Turns
from jaxllm.profiling.isolate import kill_children as _kill_children
from jaxllm.train.optim import make_optimizer
from jaxllm.train.state import LMTrainState, loss_and_sums, train_step

REMATS = ("none", "block")
RESULT_TAG = "MEMORY_RESULT "  # the line a subprocess prints its result on
READY_TAG = "MEMORY_READY"  # a subprocess waiting for its turn on the device (--wait-turn)
PROGRESS_TAG = "memory "  # the start of every progress line (stderr)


@dataclass(frozen=True)
class Case:
    """One measured config."""

    size: str
    context: int
    remat: str
    dtype: str = "float32"
    batch: int = 4
    vocab: int = 10_000
    arch: str = "gpt2"
    overrides: tuple[str, ...] = ()

    @property
    def tag(self) -> str:
        return f"{self.size}_T{self.context}_{self.dtype}_remat-{self.remat}"


def say(message: str) -> None:
    """A progress line on stderr (stdout holds the table)."""
    print(message, file=sys.stderr, flush=True)


class _Clock:
    """Seconds per phase of one config, each said (stderr) as it ends."""

    def __init__(self, tag: str, report: Callable[[str], None]) -> None:
        self.tag, self.report = tag, report
        self.start = self.last = time.perf_counter()
        self.phases: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = round(now - self.last, 3)
        self.last = now
        self.report(f"{PROGRESS_TAG}{self.tag}: {phase} in {self.phases[phase]:.1f} s")

    @property
    def total(self) -> float:
        return time.perf_counter() - self.start


def _compiled_peak(compiled: Any) -> int | None:
    """Bytes XLA's buffer assignment needs for one call of `compiled`: arguments + outputs -
    donated (aliased) + the temporaries' arena (None if unknown). Not `peak_memory_in_bytes`:
    XLA:CPU reports only the arguments there."""
    m = compiled.memory_analysis()
    if m is None:
        return None
    return int(
        m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
        + m.temp_size_in_bytes
    )  # fmt: skip


def _allocator_peak() -> int | None:
    stats = jax.local_devices()[0].memory_stats()
    return None if stats is None else int(stats.get("peak_bytes_in_use", 0)) or None


def saved_for_backward_bytes(loss: Callable[[Any], jax.Array], params: Any) -> int:
    """Bytes of the forward values autodiff keeps for the backward pass of `loss(params)`
    (jax's residuals; parameters that are saved as they are not counted): what remat trades
    for recomputation. Traced only, nothing runs. Uses jax's residual listing (the one behind
    jax.ad_checkpoint.print_saved_residuals); where that is missing, all of jax.vjp's
    residuals, parameters included."""
    try:
        from jax._src.ad_checkpoint import saved_residuals

        res = saved_residuals(loss, params)
        return int(sum(
            math.prod(a.shape) * a.dtype.itemsize
            for a, where in res
            if not where.startswith("from the argument")
        ))  # fmt: skip
    except (ImportError, AttributeError, TypeError, ValueError):
        vjp = jax.eval_shape(lambda p: jax.vjp(loss, p)[1], params)
        return int(sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(vjp)))


def measure_case(
    case: Case,
    out_dir: str | Path,
    time_steps: int = 3,
    turn: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    report: Callable[[str], None] = say,
) -> dict[str, Any]:
    """Measure one config in this process; returns the JSON-able record (see `run`), with
    `phase_s` (seconds per phase) and `wall_s`.

    Host side first, no device work: each program is traced once, from shapes alone. Then,
    inside `turn()` (when given: parallel jobs never share the device, and XLA:GPU autotunes
    on the device while compiling), each program is compiled once (XLA's numbers are known even
    for a config that will not fit) and they run: the parameter init and the forward pass with
    only the parameters and the batch resident, then the AdamW state built from those
    parameters and the timed train step."""
    clock = _Clock(case.tag, report)
    out_dir = Path(out_dir)
    cfg = build_config(
        case.size, arch=case.arch, vocab=case.vocab, dtype=case.dtype, batch=case.batch,
        overrides=(f"execution.remat={case.remat}", *case.overrides),
    )  # fmt: skip
    # random_batch draws windows of model.context_length tokens: ask for `context` (the model
    # keeps its full position table, as in `profile.py bench`).
    at_t = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, context_length=case.context)
    )
    batch = random_batch(at_t, case.batch)
    rec: dict[str, Any] = {**dataclasses.asdict(case), "overrides": list(case.overrides)}
    rec |= {"status": "ok", "device": jax.devices()[0].device_kind, "jax": jax.__version__}
    out_dir.mkdir(parents=True, exist_ok=True)
    model = build_model(cfg.model, cfg.execution)
    # As harness.make_state, but from given parameters: the init is compiled once, not twice.
    tx = make_optimizer(cfg.optim, cfg.train.steps or cfg.optim.warmup_steps + 1)

    def forward(p: Any, b: Any) -> jax.Array:
        return loss_and_sums(p, model.apply, b, None)[0]

    def new_state(params: Any) -> LMTrainState:
        return LMTrainState.create(
            apply_fn=model.apply, params=params, tx=tx, vocab_size=cfg.model.vocab_size
        )

    key0, key1 = jax.random.PRNGKey(0), jax.random.PRNGKey(1)
    init_traced = jax.jit(model.init).trace(key0, batch["inputs"])
    param_shapes = init_traced.out_info["params"]
    rec["n_params"] = int(sum(math.prod(x.shape) for x in jax.tree.leaves(param_shapes)))
    rec["saved_bytes"] = saved_for_backward_bytes(lambda p: forward(p, batch), param_shapes)
    state_traced = jax.jit(new_state).trace(param_shapes)
    lowered = {
        "init": init_traced.lower(),
        "forward": jax.jit(forward).lower(param_shapes, batch),
        "AdamW state": state_traced.lower(),
        "train step": train_step.lower(state_traced.out_info, batch, key1),  # donates the state
    }
    clock.lap("traced")
    with turn() if turn else contextlib.nullcontext():
        if turn:
            clock.lap("waited for its turn on the device")
        compiled = {}
        for name, low in lowered.items():
            compiled[name] = low.compile()
            clock.lap(f"compiled {name}")
        rec["forward_xla_bytes"] = _compiled_peak(compiled["forward"])
        rec["train_xla_bytes"] = _compiled_peak(compiled["train step"])
        try:
            params = compiled["init"](key0, batch["inputs"])["params"]
            jax.block_until_ready(compiled["forward"](params, batch))
            rec["forward_allocator_bytes"] = _allocator_peak()
            holder = {"state": compiled["AdamW state"](params)}  # parameters and AdamW state
            del params
            step = compiled["train step"]

            def call() -> Any:
                holder["state"], metrics = step(holder["state"], batch, key1)
                return metrics

            timing = time_calls(call, warmup=1, steps=1, repeats=time_steps)
            rec["train_allocator_bytes"] = _allocator_peak()
            rec["step_ms"] = 1e3 * timing.median_s
            prof = out_dir / f"memory_{case.tag}.prof"
            jax.profiler.save_device_memory_profile(str(prof))
            rec["pprof"] = str(prof)
            clock.lap("ran")
        except Exception as e:
            if not is_oom(e):
                raise
            rec["status"] = "OOM"
            clock.lap("ran out of memory")
    rec["phase_s"] = clock.phases
    rec["wall_s"] = round(clock.total, 3)
    return rec


@contextlib.contextmanager
def _stdin_turn() -> Any:
    """A subprocess's turn on the device: say READY_TAG, wait for the parent's "go"."""
    with stdin_turn(READY_TAG, "memory: no turn on the device (the sweep stopped)"):
        yield


def _measure_in_subprocess(
    case: Case, out_dir: Path, time_steps: int, turns: _Turns | None = None, index: int = 0
) -> dict[str, Any]:
    """measure_case in a fresh interpreter, so the allocator's peak is this config's alone.
    With `turns`, the child traces right away, then waits for turn `index` to compile and run.
    Its progress lines are passed on to our stderr as they come; the rest of its stderr (XLA's
    logging) is kept for the error message of a failed config."""
    cmd = [sys.executable, "-m", "jaxllm.profiling.memory", "--case",
           json.dumps(dataclasses.asdict(case)), "--out", str(out_dir),
           "--time-steps", str(time_steps)] + (["--wait-turn"] if turns else [])  # fmt: skip
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}  # peak = what was used
    with Child(cmd, env, progress_tag=PROGRESS_TAG, turns=turns, index=index,
               ready_tag=READY_TAG, stopped="memory: the sweep stopped") as child:  # fmt: skip
        stdout = list(child.lines())
    wall = child.wall_s  # with the interpreter's start and the wait
    for line in stdout:
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG) :]) | {"process_s": wall}
    stderr = child.stderr
    err = (stderr.strip().splitlines() or ["no output"])[-1]
    status = "OOM" if "RESOURCE_EXHAUSTED" in stderr else f"failed (exit {child.returncode})"
    return {**dataclasses.asdict(case), "status": status, "error": err[:300], "process_s": wall}


# ----------------------------------------------------------------------------- output


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.3g}"


def header(allocator: bool) -> str:
    cols = ["size", "context", "dtype", "remat", "saved for bwd GiB", "forward GiB (xla)",
            "train step GiB (xla)"]  # fmt: skip
    if allocator:
        cols += ["forward GiB (allocator)", "train step GiB (allocator)"]
    cols += ["step ms", "vs remat none"]
    return "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols)


def _ratio(rec: dict[str, Any], base: dict[str, Any], key: str) -> str:
    a, b = rec.get(key), base.get(key)
    return f"x{a / b:.2f}" if a and b else "-"


def format_row(rec: dict[str, Any], allocator: bool, baseline: dict[str, Any] | None) -> str:
    """A Markdown row. The last cell compares with the same context without remat: saved-for-
    backward bytes, the train step's peak (allocator when there is one, else XLA's) and time."""
    cells = [rec["size"], str(rec["context"]), rec["dtype"], rec["remat"]]
    cells.append(_gib(rec.get("saved_bytes")))
    cells += [_gib(rec.get("forward_xla_bytes")), _gib(rec.get("train_xla_bytes"))]
    if rec["status"] != "ok":  # XLA's numbers are known before running: what it would need
        n = 3 if allocator else 1
        return "| " + " | ".join(cells + [rec["status"]] * n + ["-"]) + " |"
    if allocator:
        cells += [_gib(rec.get("forward_allocator_bytes")), _gib(rec.get("train_allocator_bytes"))]
    cells.append(f"{rec['step_ms']:.2f}")
    vs = "-"
    if baseline is not None and baseline is not rec and baseline.get("status") == "ok":
        peak = "train_allocator_bytes" if allocator else "train_xla_bytes"
        vs = (
            f"saved {_ratio(rec, baseline, 'saved_bytes')}, peak {_ratio(rec, baseline, peak)}, "
            f"time {_ratio(rec, baseline, 'step_ms')}"
        )
    cells.append(vs)
    return "| " + " | ".join(cells) + " |"


def plot(records: Sequence[dict[str, Any]], path: str | Path, allocator: bool) -> None:
    """Left: peak memory per context length (the forward pass, then the train step per remat
    setting). Right: what autodiff keeps for the backward pass, per remat setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    src = "allocator" if allocator else "xla"
    contexts = sorted({r["context"] for r in records})
    remats = [m for m in REMATS if any(r["remat"] == m for r in records)]

    def value(t: int, remat: str, key: str) -> float:
        r = next((r for r in records if r["context"] == t and r["remat"] == remat), None)
        v = None if r is None else r.get(key)
        return np.nan if v is None or (key != "saved_bytes" and r["status"] != "ok") else v / 2**30

    x = np.arange(len(contexts))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    series = [("forward", remats[0], f"forward_{src}_bytes")]
    series += [(f"train step, remat {m}", m, f"train_{src}_bytes") for m in remats]
    width = 0.8 / len(series)
    for i, (label, remat, key) in enumerate(series):
        heights = [value(t, remat, key) for t in contexts]
        left.bar(x + (i - (len(series) - 1) / 2) * width, heights, width, label=label)
    left.set_ylabel(f"peak memory, GiB ({src})")
    width = 0.8 / len(remats)
    for i, m in enumerate(remats):
        heights = [value(t, m, "saved_bytes") for t in contexts]
        right.bar(x + (i - (len(remats) - 1) / 2) * width, heights, width, label=f"remat {m}")
    right.set_ylabel("saved for the backward pass, GiB")
    r0 = records[0]
    for ax in (left, right):
        ax.set_xticks(x, [str(t) for t in contexts])
        ax.set_xlabel("context length")
        ax.legend()
    fig.suptitle(f"{r0['size']}, batch {r0['batch']}, {r0['dtype']} (OOM: no bar)")
    fig.tight_layout()
    save_figure_atomic(fig, path, dpi=120)
    plt.close(fig)


def run(
    size: str = "large",
    contexts: Sequence[int] = (128, 256, 512),
    remats: Sequence[str] = REMATS,
    dtype: str = "float32",
    batch: int = 4,
    vocab: int = 10_000,
    arch: str = "gpt2",
    overrides: Sequence[str] = (),
    out_dir: str | Path = "runs/memory",
    jsonl_path: str | None = None,
    isolate: str = "auto",
    time_steps: int = 3,
    jobs: int = 1,
) -> list[dict[str, Any]]:
    """The sweep: a Markdown table on stdout, a row per config printed as soon as that config
    finishes (and its JSON line appended to `jsonl_path` then), pprof files and
    OUT_DIR/memory_<size>.png at the end; progress and each config's wall time on stderr.
    Returns the records in config order. `isolate`: "auto" (a subprocess per config when the
    device has allocator stats), "always" or "never". `jobs`: subprocesses at a time; they
    overlap their start-up and tracing only, and compile and run one at a time, in config
    order, so peaks and times stay those of one config alone. Should rows finish out of order
    (a config that failed early), the table is printed again in config order at the end."""
    if size not in SIZES:
        raise BenchArgError(f"--size: unknown size {size!r}; allowed: {', '.join(SIZES)}")
    bad = [m for m in remats if m not in REMATS]
    if bad or not remats:
        raise BenchArgError(f"--remat: unknown value(s) {bad}; allowed: {', '.join(REMATS)}")
    # the model's context: the size's, or an override's (--set model.context_length=N)
    model_cfg = build_config(size, arch=arch, vocab=vocab, dtype=dtype, batch=batch,
                             overrides=overrides).model  # fmt: skip
    limit = model_cfg.context_length
    if not contexts or min(contexts) < 1 or max(contexts) > limit:
        raise BenchArgError(
            f"--contexts must be in 1..{limit} for size {size}, got {contexts} (raise the limit "
            "with --set model.context_length=N)"
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # This process only reads device stats; it must not take 75% of the GPU that the config
    # subprocesses need (effective only before its backend starts, as under profile.py).
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    allocator = jax.local_devices()[0].memory_stats() is not None
    subprocesses = isolate == "always" or (isolate == "auto" and allocator)
    print(
        f"memory: {size}, arch {arch}, batch {batch}, vocab {vocab}, {dtype}"
        f"{''.join(f', {o}' for o in overrides)}; device {jax.devices()[0].device_kind}, jax "
        f"{jax.__version__}. GiB: saved for bwd = forward values autodiff keeps for the "
        "backward (jax's residuals); xla = the compiled program's buffer assignment"
        + (
            "; allocator = peak_bytes_in_use, a fresh process per config"
            if allocator
            else " (no allocator stats on this backend; XLA:CPU's buffer assignment does not "
            "show what remat saves, the saved-for-bwd column does)"
        )
        + "; step ms: median train step",
        flush=True,
    )
    print(plan_ops(model_cfg).describe(), flush=True)  # which paths run, as bench says
    print(header(allocator), flush=True)
    cases = [Case(size, t, m, dtype, batch, vocab, arch, tuple(overrides))
             for t in contexts for m in remats]  # fmt: skip
    done: dict[Case, dict[str, Any]] = {}
    source = "allocator+xla" if allocator else "xla"
    t_start = time.perf_counter()

    def baseline(case: Case) -> dict[str, Any] | None:
        return done.get(dataclasses.replace(case, remat="none"))

    def finished(case: Case, rec: dict[str, Any]) -> None:
        rec["memory_source"] = source
        done[case] = rec
        print(format_row(rec, allocator, baseline(case)), flush=True)
        if jsonl_path:
            with open(jsonl_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        times = [f"{rec['wall_s']:.1f} s"] if "wall_s" in rec else []
        times += [f"{rec['process_s']:.1f} s with its process"] if "process_s" in rec else []
        say(f"{PROGRESS_TAG}[{len(done)}/{len(cases)}] {case.tag}: {rec['status']}, "
            f"{', '.join(times)}; sweep {time.perf_counter() - t_start:.0f} s")  # fmt: skip

    def on_sigterm(signum: int, frame: Any) -> None:  # `timeout`: stop the children too
        raise SystemExit(128 + signum)

    in_main = threading.current_thread() is threading.main_thread()
    old_handler = signal.signal(signal.SIGTERM, on_sigterm) if in_main else None
    pool = ThreadPoolExecutor(max(jobs, 1)) if subprocesses else None
    turns = _Turns() if jobs > 1 else None
    try:
        if pool is None:  # the CPU: memory is not the limit, one process
            for case in cases:
                finished(case, measure_case(case, out_dir, time_steps))
                gc.collect()
        else:
            futures = {
                pool.submit(_measure_in_subprocess, c, out_dir, time_steps, turns, i): c
                for i, c in enumerate(cases)
            }
            for fut in as_completed(futures):
                finished(futures[fut], fut.result())
    finally:
        if turns is not None:
            turns.abort()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        _kill_children()
        if in_main:
            signal.signal(signal.SIGTERM, old_handler)
    records = [done[c] for c in cases]
    if list(done) != cases:  # finished out of order (jobs > 1): the table in config order
        print("\nin config order:\n" + header(allocator))
        for case, rec in zip(cases, records, strict=True):
            print(format_row(rec, allocator, baseline(case)))
    png = out_dir / f"memory_{size}.png"
    plot(records, png, allocator)
    print(f"\nplot: {png}; pprof profiles (live buffers after the train step): {out_dir}/*.prof")
    return records


def _main(argv: list[str] | None = None) -> int:
    """The subprocess entry point: measure one --case, print it on a RESULT_TAG line."""
    p = argparse.ArgumentParser()
    p.add_argument("--case", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--time-steps", type=int, default=3)
    p.add_argument("--wait-turn", action="store_true", help="compile and run after a 'go'")
    args = p.parse_args(argv)
    raw = json.loads(args.case)
    case = Case(**{**raw, "overrides": tuple(raw.get("overrides", ()))})
    rec = measure_case(case, args.out, args.time_steps, _stdin_turn if args.wait_turn else None)
    print(RESULT_TAG + json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    # `profile.py memory` set these before starting us; for a direct run, set them before the
    # backend starts (at the first computation, not at `import jax`).
    from jaxllm.xla_flags import apply_default_xla_flags

    apply_default_xla_flags()
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # peak = what was used
    sys.exit(_main())
