"""Peak memory of the forward pass and of a train step per context length, with and without
rematerialisation: `python profile.py memory`.

Three kinds of number per config, each column named by where it came from:
  saved for bwd  the forward values autodiff keeps for the backward pass (jax's residuals,
                 from tracing alone): exactly what remat trades for recomputation.
  xla        XLA's buffer assignment of the compiled executable (arguments + outputs - donated
             + temporaries), known before anything runs. XLA:CPU's arena does not shrink with
             remat: on the CPU look at `saved for bwd`.
  allocator  the device allocator's `peak_bytes_in_use` after the program ran: what the process
             really held. The counter is process-wide and never goes down, so with `isolate`
             every config runs in a fresh child process (jaxllm.profiling.isolate). The CPU
             keeps no allocator stats: no column, and configs run in this process.
A config that does not fit gives OOM in its cells (XLA's columns still say what it would need).
After each train step a pprof profile of the live device buffers is written
(`jax.profiler.save_device_memory_profile`; read it with `pprof -top FILE`). The train step is
also timed, so the table shows what remat saves in memory and what it costs in time. Each
config's programs are traced once and compiled once; a row is printed (and its JSON line
appended) as soon as its config finishes, its phases' seconds go to stderr.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxllm.atomic_file import save_figure_atomic
from jaxllm.ops import plan_ops
from jaxllm.profiling.harness import (
    BadInput,
    append_jsonl,
    is_oom,
    md_header,
    md_row,
    model_fns,
    random_batch,
    size_config,
    time_calls,
)
from jaxllm.profiling.isolate import Child, child_command, child_main, stop_children_on_exit
from jaxllm.train.state import train_step

REMATS = ("none", "block")
PROGRESS_TAG = "memory "  # the start of every progress line (stderr)


def say(message: str) -> None:
    """A progress line on stderr (stdout holds the table)."""
    print(message, file=sys.stderr, flush=True)


class _Clock:
    """Seconds per phase of one config, each said as it ends."""

    def __init__(self, tag: str, report: Callable[[str], None]) -> None:
        self.tag, self.report = tag, report
        self.start = self.last = time.perf_counter()
        self.phases: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = round(now - self.last, 3)
        self.last = now
        self.report(f"{PROGRESS_TAG}{self.tag}: {phase} in {self.phases[phase]:.1f} s")


def _compiled_peak(compiled: Any) -> int | None:
    """Bytes XLA's buffer assignment needs for one call: arguments + outputs - donated + the
    temporaries' arena (not `peak_memory_in_bytes`: XLA:CPU reports only the arguments there)."""
    m = compiled.memory_analysis()
    if m is None:
        return None
    return int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
               + m.temp_size_in_bytes)  # fmt: skip


def _allocator_peak() -> int | None:
    stats = jax.local_devices()[0].memory_stats()
    return None if stats is None else int(stats.get("peak_bytes_in_use", 0)) or None


def saved_for_backward_bytes(loss: Callable[[Any], jax.Array], params: Any) -> int:
    """Bytes of the forward values autodiff keeps for the backward pass of `loss(params)`, the
    parameters left out (traced only). Uses jax's residual listing (behind
    jax.ad_checkpoint.print_saved_residuals); where that is missing, all of jax.vjp's."""
    try:
        from jax._src.ad_checkpoint import saved_residuals  # private: may move

        res = saved_residuals(loss, params)
        return int(sum(math.prod(a.shape) * a.dtype.itemsize for a, where in res
                       if not where.startswith("from the argument")))  # fmt: skip
    except (ImportError, AttributeError, TypeError, ValueError):
        vjp = jax.eval_shape(lambda p: jax.vjp(loss, p)[1], params)
        return int(sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(vjp)))


def case_config(case: dict[str, Any]) -> Any:
    return size_config(case["size"], [*case["overrides"], f"--execution.remat={case['remat']}"])


def tag(case: dict[str, Any]) -> str:
    dtype = case_config(case).execution.compute_dtype
    return f"{case['size']}_T{case['context']}_{dtype}_remat-{case['remat']}"


def _trace(case: dict[str, Any], rec: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """Host side, no device work: each program traced once from shapes and lowered (init,
    forward, AdamW state, train step); the parameter count and saved-for-backward bytes go
    into `rec`. Returns (lowered programs, the batch)."""
    cfg = case_config(case)
    at_t = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, context_length=case["context"])
    )
    batch = random_batch(at_t)  # `context` tokens; the model keeps its whole position table
    init_fn, new_state, forward = model_fns(cfg)
    init = jax.jit(init_fn).trace(jax.random.PRNGKey(0), batch["inputs"])
    params = init.out_info
    rec["n_params"] = int(sum(math.prod(x.shape) for x in jax.tree.leaves(params)))
    rec["saved_bytes"] = saved_for_backward_bytes(lambda p: forward(p, batch), params)
    state = jax.jit(new_state).trace(params)
    lowered = {
        "init": init.lower(),
        "forward": jax.jit(forward).lower(params, batch),
        "AdamW state": state.lower(),
        "train step": train_step.lower(state.out_info, batch, jax.random.PRNGKey(1)),
    }
    return lowered, batch


def measure_case(
    case: dict[str, Any], out_dir: str | Path, samples: int = 3, report=say
) -> dict[str, Any]:
    """Measure one config in this process: compile each program once (XLA's numbers are known
    even for a config that will not fit), run the init and the forward pass with only the
    parameters and the batch resident, then the AdamW state and the timed train step."""
    name = tag(case)
    clock = _Clock(name, report)
    full = case_config(case)
    cfg = full.model
    rec = {**case, "dtype": full.execution.compute_dtype, "arch": cfg.arch,
           "vocab": cfg.vocab_size, "batch": full.train.batch_size, "status": "ok",
           "device": jax.devices()[0].device_kind, "jax": jax.__version__}  # fmt: skip
    lowered, batch = _trace(case, rec)
    clock.lap("traced")
    compiled = {}
    for phase, low in lowered.items():
        compiled[phase] = low.compile()
        clock.lap(f"compiled {phase}")
    rec["forward_xla_bytes"] = _compiled_peak(compiled["forward"])
    rec["train_xla_bytes"] = _compiled_peak(compiled["train step"])
    key0, key1 = jax.random.PRNGKey(0), jax.random.PRNGKey(1)
    try:
        params = compiled["init"](key0, batch["inputs"])
        jax.block_until_ready(compiled["forward"](params, batch))
        rec["forward_allocator_bytes"] = _allocator_peak()
        holder = {"state": compiled["AdamW state"](params)}
        del params

        def call() -> Any:
            holder["state"], metrics = compiled["train step"](holder["state"], batch, key1)
            return metrics

        timing = time_calls(call, warmup=1, group=1, samples=samples)
        rec["train_allocator_bytes"] = _allocator_peak()
        rec["step_ms"] = 1e3 * timing.median_s
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        rec["pprof"] = str(Path(out_dir) / f"memory_{name}.prof")
        jax.profiler.save_device_memory_profile(rec["pprof"])
        clock.lap("ran")
    except Exception as e:
        if not is_oom(e):
            raise
        rec["status"] = "OOM"
        clock.lap("ran out of memory")
    rec["phase_s"] = clock.phases
    rec["wall_s"] = round(time.perf_counter() - clock.start, 3)
    return rec


def _child(spec: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield measure_case(spec["case"], spec["out"], spec["samples"])


def measure_in_child(case: dict[str, Any], out_dir: str | Path, samples: int) -> dict[str, Any]:
    """measure_case in a fresh interpreter, so the allocator's peak is this config's alone; a
    failed child gives a record saying why."""
    spec = {"case": case, "out": str(out_dir), "samples": samples}
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}  # peak = what was used
    with Child(child_command("jaxllm.profiling.memory", spec), env, PROGRESS_TAG) as child:
        recs = list(child.records())
    if recs:
        return recs[0] | {"process_s": child.wall_s}
    status = "OOM" if is_oom(child.stderr) else f"failed (exit {child.returncode})"
    return {**case, "status": status, "error": child.last_words(), "process_s": child.wall_s}


# ----------------------------------------------------------------------------- output


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.3g}"


def header(allocator: bool) -> str:
    cols = ["size", "context", "dtype", "remat", "saved for bwd GiB", "forward GiB (xla)",
            "train step GiB (xla)"]  # fmt: skip
    cols += ["forward GiB (allocator)", "train step GiB (allocator)"] * allocator
    return md_header(cols + ["step ms", "vs remat none"])


def _ratio(rec: dict[str, Any], base: dict[str, Any], key: str) -> str:
    a, b = rec.get(key), base.get(key)
    return f"x{a / b:.2f}" if a and b else "-"


def format_row(rec: dict[str, Any], allocator: bool, baseline: dict[str, Any] | None) -> str:
    """A Markdown row; the last cell compares with the same context without remat."""
    cells = [rec["size"], rec["context"], rec.get("dtype", "-"), rec["remat"]]
    cells += [_gib(rec.get(k)) for k in ("saved_bytes", "forward_xla_bytes", "train_xla_bytes")]
    if rec["status"] != "ok":  # XLA's numbers are known before running: what it would need
        return md_row(cells + [rec["status"]] * (3 if allocator else 1) + ["-"])
    if allocator:
        cells += [_gib(rec.get("forward_allocator_bytes")), _gib(rec.get("train_allocator_bytes"))]
    vs = "-"
    if baseline is not None and baseline is not rec and baseline.get("status") == "ok":
        peak = "train_allocator_bytes" if allocator else "train_xla_bytes"
        vs = (
            f"saved {_ratio(rec, baseline, 'saved_bytes')}, peak {_ratio(rec, baseline, peak)}, "
            f"time {_ratio(rec, baseline, 'step_ms')}"
        )
    return md_row(cells + [f"{rec['step_ms']:.2f}", vs])


def plot(records: Sequence[dict[str, Any]], path: str | Path, allocator: bool) -> None:
    """Left: peak memory per context length (the forward pass, then the train step per remat
    setting). Right: what autodiff keeps for the backward pass, per remat setting."""
    import matplotlib  # optional: only for the plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    src = "allocator" if allocator else "xla"
    contexts = sorted({r["context"] for r in records})
    remats = [m for m in REMATS if any(r["remat"] == m for r in records)]

    def value(t: int, remat: str, key: str) -> float:
        r = next((r for r in records if r["context"] == t and r["remat"] == remat), {})
        ok = key == "saved_bytes" or r.get("status") == "ok"
        return r[key] / 2**30 if ok and r.get(key) is not None else np.nan

    def bars(ax: Any, series: list[tuple[str, str, str]], ylabel: str) -> None:
        width = 0.8 / len(series)
        for i, (label, remat, key) in enumerate(series):
            at = x + (i - (len(series) - 1) / 2) * width
            ax.bar(at, [value(t, remat, key) for t in contexts], width, label=label)
        ax.set_ylabel(ylabel)
        ax.set_xticks(x, [str(t) for t in contexts])
        ax.set_xlabel("context length")
        ax.legend()

    x = np.arange(len(contexts))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    series = [("forward", remats[0], f"forward_{src}_bytes")]
    bars(left, series + [(f"train step, remat {m}", m, f"train_{src}_bytes") for m in remats],
         f"peak memory, GiB ({src})")  # fmt: skip
    bars(right, [(f"remat {m}", m, "saved_bytes") for m in remats],
         "saved for the backward pass, GiB")  # fmt: skip
    r0 = records[0]
    fig.suptitle(f"{r0['size']}, batch {r0.get('batch')}, {r0.get('dtype')} (OOM: no bar)")
    fig.tight_layout()
    save_figure_atomic(fig, path, dpi=120)
    plt.close(fig)


def run(
    size: str,
    contexts: Sequence[int],
    remats: Sequence[str] = REMATS,
    overrides: Sequence[str] = (),
    out_dir: str | Path = "runs/memory",
    jsonl_path: str | None = None,
    isolate: str = "auto",
    samples: int = 3,
) -> list[dict[str, Any]]:
    """The sweep: a Markdown row per config as it finishes (and its JSON line), pprof files and
    OUT_DIR/memory_<size>.png at the end. `isolate`: a child process per config "auto" (when
    the device keeps allocator stats), "always" or "never"."""
    cfg = size_config(size, overrides)
    model = cfg.model
    if max(contexts) > model.context_length:
        raise BadInput(f"--contexts must be in 1..{model.context_length} for size {size}, got "
                         f"{list(contexts)} (raise it with --model.context_length=N)")  # fmt: skip
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    allocator = jax.local_devices()[0].memory_stats() is not None
    children = isolate == "always" or (isolate == "auto" and allocator)
    print(f"memory: {size}{''.join(f', {o}' for o in overrides)}; device "
          f"{jax.devices()[0].device_kind}, jax {jax.__version__}. GiB: saved for bwd = forward "
          "values autodiff keeps for the backward; xla = the compiled program's buffer "
          "assignment" + ("; allocator = peak_bytes_in_use, a fresh process per config"
          if allocator else " (no allocator stats here; on XLA:CPU the saved-for-bwd column "
          "shows what remat saves)") + "; step ms: median train step", flush=True)  # fmt: skip
    print(plan_ops(model, cfg.execution).describe(), flush=True)
    print(header(allocator), flush=True)
    cases = [{"size": size, "context": t, "remat": m, "overrides": list(overrides)}
             for t in contexts for m in remats]  # fmt: skip
    records: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    with stop_children_on_exit():
        for i, case in enumerate(cases):
            if children:
                rec = measure_in_child(case, out_dir, samples)
            else:
                rec = measure_case(case, out_dir, samples)
                gc.collect()
            rec["memory_source"] = "allocator+xla" if allocator else "xla"
            base = next((r for r in records if r["context"] == case["context"]
                         and r["remat"] == "none"), None)  # fmt: skip
            records.append(rec)
            print(format_row(rec, allocator, base), flush=True)
            append_jsonl(jsonl_path, [rec])
            say(f"{PROGRESS_TAG}[{i + 1}/{len(cases)}] {tag(case)}: {rec['status']}, "
                f"{rec.get('wall_s', rec.get('process_s', 0)):.1f} s; sweep "
                f"{time.perf_counter() - t_start:.0f} s")  # fmt: skip
    png = out_dir / f"memory_{size}.png"
    plot(records, png, allocator)
    print(f"\nplot: {png}; pprof profiles (live buffers after the train step): {out_dir}/*.prof")
    return records


if __name__ == "__main__":
    from jaxllm.xla_flags import apply_default_xla_flags

    apply_default_xla_flags()  # before the backend starts (at the first computation)
    sys.exit(child_main(_child))
