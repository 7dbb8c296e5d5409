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
and the sweep goes on. `--jobs N` runs N config subprocesses at a time: they compile side by
side (compiling a 36-layer model takes longer than running it) and take turns on the device
under a file lock, so each one's peak and time are its own. After each train step
a pprof profile of the live device buffers is written (`jax.profiler.save_device_memory_profile`;
read it with `pprof -top FILE` or `go tool pprof`). The train step is also timed
(harness.time_calls), so the table shows what remat saves in memory and what it costs in time.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
from filelock import FileLock

from jaxllm.models import build_model
from jaxllm.profiling.bench import SIZES, BenchArgError, build_config, is_oom
from jaxllm.profiling.harness import make_state, random_batch, time_calls
from jaxllm.train.state import loss_and_sums, train_step

REMATS = ("none", "block")
RESULT_TAG = "MEMORY_RESULT "  # the line a subprocess prints its result on


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
    case: Case, out_dir: str | Path, time_steps: int = 3, lock: str | Path | None = None
) -> dict[str, Any]:
    """Measure one config in this process; returns the JSON-able record (see `run`).

    Everything is compiled first, from shapes alone (no device memory; XLA's numbers are known
    even for a config that will not fit), then, holding `lock` (a file lock, when given, so
    that parallel jobs compile side by side but never share the device), the programs run:
    the forward pass with only the parameters and the batch resident, then the train step.
    Compile-time autotuning scratch is transient and far below either peak."""
    out_dir = Path(out_dir)
    cfg = build_config(
        case.size, arch=case.arch, vocab=case.vocab, dtype=case.dtype, batch=case.batch,
        overrides=(f"model.remat={case.remat}", *case.overrides),
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
    model = build_model(cfg.model)

    def forward(p: Any, b: Any) -> jax.Array:
        return loss_and_sums(p, model.apply, b, None)[0]

    key0, key1 = jax.random.PRNGKey(0), jax.random.PRNGKey(1)
    param_shapes = jax.eval_shape(model.init, key0, batch["inputs"])["params"]
    rec["n_params"] = int(sum(math.prod(x.shape) for x in jax.tree.leaves(param_shapes)))
    rec["saved_bytes"] = saved_for_backward_bytes(lambda p: forward(p, batch), param_shapes)
    # Jitted state: one compile instead of hundreds of eager ops (seconds on a CPU); same values.
    new_state = jax.jit(functools.partial(make_state, cfg))
    state_shapes = jax.eval_shape(new_state, batch)
    init = jax.jit(model.init).lower(key0, batch["inputs"]).compile()
    fwd = jax.jit(forward).lower(param_shapes, batch).compile()
    make = new_state.lower(batch).compile()
    step = train_step.lower(state_shapes, batch, key1).compile()  # donates the state
    rec["forward_xla_bytes"] = _compiled_peak(fwd)
    rec["train_xla_bytes"] = _compiled_peak(step)
    with FileLock(str(lock)) if lock else contextlib.nullcontext():
        try:
            params = init(key0, batch["inputs"])["params"]
            jax.block_until_ready(fwd(params, batch))
            rec["forward_allocator_bytes"] = _allocator_peak()
            del params

            holder = {"state": make(batch)}  # parameters and AdamW state

            def call() -> Any:
                holder["state"], metrics = step(holder["state"], batch, key1)
                return metrics

            timing = time_calls(call, warmup=1, steps=1, repeats=time_steps)
            rec["train_allocator_bytes"] = _allocator_peak()
            rec["step_ms"] = 1e3 * timing.median_s
            prof = out_dir / f"memory_{case.tag}.prof"
            jax.profiler.save_device_memory_profile(str(prof))
            rec["pprof"] = str(prof)
        except Exception as e:
            if not is_oom(e):
                raise
            rec["status"] = "OOM"
    return rec


def _measure_in_subprocess(
    case: Case, out_dir: Path, time_steps: int, lock: Path | None
) -> dict[str, Any]:
    """measure_case in a fresh interpreter, so the allocator's peak is this config's alone."""
    cmd = [sys.executable, "-m", "jaxllm.profiling.memory", "--case",
           json.dumps(dataclasses.asdict(case)), "--out", str(out_dir),
           "--time-steps", str(time_steps)] + (["--lock", str(lock)] if lock else [])  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG) :])
    err = (done.stderr.strip().splitlines() or ["no output"])[-1]
    status = "OOM" if "RESOURCE_EXHAUSTED" in done.stderr else f"failed (exit {done.returncode})"
    return {**dataclasses.asdict(case), "status": status, "error": err[:300]}


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
    fig.savefig(path, dpi=120)
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
    """The sweep: a Markdown table on stdout (a row per config, in order), a JSON line per
    config in `jsonl_path`, pprof files and OUT_DIR/memory_<size>.png. `isolate`: "auto" (a
    subprocess per config when the device has allocator stats), "always" or "never". `jobs`:
    subprocesses at a time; they compile in parallel and take turns on the device (a file
    lock around running and timing), so peaks and times stay those of one config alone."""
    if size not in SIZES:
        raise BenchArgError(f"--size: unknown size {size!r}; allowed: {', '.join(SIZES)}")
    bad = [m for m in remats if m not in REMATS]
    if bad or not remats:
        raise BenchArgError(f"--remat: unknown value(s) {bad}; allowed: {', '.join(REMATS)}")
    limit = SIZES[size].max_context
    if not contexts or min(contexts) < 1 or max(contexts) > limit:
        raise BenchArgError(f"--contexts must be in 1..{limit} for size {size}, got {contexts}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
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
    print(header(allocator), flush=True)
    cases = [Case(size, t, m, dtype, batch, vocab, arch, tuple(overrides))
             for t in contexts for m in remats]  # fmt: skip
    lock = out_dir / ".memory.lock" if jobs > 1 else None
    pool = ThreadPoolExecutor(max(jobs, 1)) if subprocesses else None
    pending = [
        pool.submit(_measure_in_subprocess, c, out_dir, time_steps, lock) if pool else None
        for c in cases
    ]
    records: list[dict[str, Any]] = []
    base = None
    for case, job in zip(cases, pending, strict=True):
        if job is not None:
            rec = job.result()
        else:  # the CPU: memory is not the limit, so keep the caches (eager init is slow)
            rec = measure_case(case, out_dir, time_steps)
            gc.collect()
        rec["memory_source"] = "allocator+xla" if allocator else "xla"
        if case.remat == "none":
            base = rec
        print(format_row(rec, allocator, base if base and base["context"] == case.context
                         else None), flush=True)  # fmt: skip
        if jsonl_path:
            with open(jsonl_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        records.append(rec)
    if pool:
        pool.shutdown()
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
    p.add_argument("--lock", default=None)
    args = p.parse_args(argv)
    raw = json.loads(args.case)
    case = Case(**{**raw, "overrides": tuple(raw.get("overrides", ()))})
    rec = measure_case(case, args.out, args.time_steps, args.lock)
    print(RESULT_TAG + json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    # `profile.py memory` set these before starting us; for a direct run, set them before the
    # backend starts (at the first computation, not at `import jax`).
    from jaxllm.xla_flags import apply_default_xla_flags

    apply_default_xla_flags()
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # peak = what was used
    sys.exit(_main())
