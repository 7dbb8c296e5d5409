"""GPT-2 training throughput on 1 vs N devices: data parallel, FSDP and pipeline parallel.

    python benchmarks/parallel_throughput.py --config configs/gpt2_124m.yaml \
        --per-device-batch 32 --variants single,single_scan,dp,fsdp,pp --jsonl out.jsonl \
        [--section.key=value ...]

Every variant is a Config (the YAML preset; this script's defaults execution.kernels=pallas and
execution.loss_impl=pallas, which an override of the key replaces; the `--section.key=value`
overrides, train.py's grammar; then the variant's own parallel.* / execution.scan_layers /
train.batch_size, which no override may set) run through the library's multi-device path,
as train.py wires it: `parallel.make_mesh` over `jax.devices()[:n]`, the state initialised in
place (`parallel.create_sharded`), the step `parallel.jit_train_step(train_step, ...)`, the
batch placed by `parallel.shard_batch`. It is timed with the one recipe of
benchmarks/throughput.py (jaxllm.profiling.harness): random token ids, a fresh AdamW state,
--warmup calls (compilation included) untimed, then the median over --samples samples of --group
back-to-back steps closed by a device sync (profile.py's --warmup / --samples / --group).

Variants (N = --devices, default all visible):
  single       1 device, batch = per-device batch.
  single_scan  1 device, execution.scan_layers=true: the baseline of fsdp_scan.
  dp           parallel.data=N, global batch N x per-device batch; compared with `single`.
  fsdp         parallel.fsdp=N (weights gathered per layer, unrolled blocks), global batch
               N x per-device batch; compared with `single`.
  fsdp_scan    the same with scan_layers (gathered per layer inside the scanned loop), global batch
               N x per-device batch; compared with `single_scan`.
  pp           parallel.pipeline=N (S = N stages), scan_layers, once per microbatch count M of
               --microbatches and virtual stage count V of --virtual-stages (V > 1: the
               circular schedule, parallel.virtual_stages); global batch = per-device batch
               (the whole batch goes through every stage); compared with `single` at that
               same batch (the stages unroll their layers, as the plain model does).
  dp_fsdp      2-D: parallel.data=N/2 x fsdp=2, global batch N x per-device batch; compared
               with `single`.
  dp_pp        2-D: parallel.data=N/2 x pipeline=2, once per (M, V); global batch N/2 x
               per-device batch (each data shard goes through both stages); vs `single`.

Per row: speedup = tokens/s over the 1-device baseline's, scaling efficiency = speedup / N.
MFU per device counts throughput.py's FLOPs per token (jaxllm.profiling.flops, PaLM's 6 N +
12 L d T) against its peak (989 TFLOP/s dense bf16: H100 SXM, the same for the H200) x N.
Pipeline bubble, measured: 1 - t_single / (S x t_pp), the share of the S devices' time
not spent on the 1-device work (t = step time at the same global batch); next to the schedule's
bound (S - 1) / (V M + S - 1) (jaxllm.pipeline.bubble_fraction), which ignores the stages'
transfers.
A baseline this run does not measure is taken from an earlier row of --jsonl with the same
setup (config, overrides, per-device batch, kernels, loss, device kind), else it is measured too.

Peak memory is the allocator's `peak_bytes_in_use` (max over the variant's devices; None where
the backend keeps no stats, e.g. CPU). It is a high-water mark since the process started: for
one variant's own peak run it alone (`--variants fsdp`), one process per variant.

`--big`: train a few steps of a (large) model with fsdp over N devices, scan_layers and
remat=block (unless an override gives execution.remat), printing each step's loss; `--devices 1`
runs the same on one device, where an out-of-memory error becomes a row "OOM: <first line>".
"""

from __future__ import annotations

import os
import sys

from jaxllm.xla_flags import apply_default_xla_flags

apply_default_xla_flags()  # before jax is imported: XLA reads its flags then
if "--big" in sys.argv[1:]:  # a model that barely fits: let the allocator use most of the GPU
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import argparse
import dataclasses
import gc
import itertools
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import jax
from throughput import PEAK_BF16  # benchmarks/throughput.py, this script's neighbour

from jaxllm import parallel
from jaxllm.config import Config, ConfigError, load_config, parse_overrides
from jaxllm.models import build_model
from jaxllm.pipeline import bubble_fraction
from jaxllm.profiling.flops import train_flops_per_token
from jaxllm.profiling.harness import is_oom, random_batch, time_calls
from jaxllm.train.optim import make_optimizer
from jaxllm.train.state import create_state, train_step

VARIANTS = ("single", "single_scan", "dp", "fsdp", "fsdp_scan", "pp", "dp_fsdp", "dp_pp")
# pp against the plain (unrolled) model: the stages unroll their layers too (jaxllm.pipeline),
# and the scanned model's loop overheads would flatter the pipeline.
BASELINE = {
    "dp": "single", "fsdp": "single", "fsdp_scan": "single_scan", "pp": "single",
    "dp_fsdp": "single",
    "dp_pp": "single",
}  # fmt: skip
MIB = 2**20


@dataclasses.dataclass(frozen=True)
class Variant:
    """One row to measure: its name, device count, global batch and config overrides."""

    name: str
    n_devices: int
    global_batch: int
    overrides: tuple[str, ...]
    microbatches: int | None = None  # pp only
    virtual_stages: int = 1  # pp only

    @property
    def label(self) -> str:
        if self.microbatches is None:
            return self.name
        circular = f" V={self.virtual_stages}" if self.virtual_stages > 1 else ""
        return f"{self.name} M={self.microbatches}{circular}"


class BenchError(Exception):
    """Bad input: the message says what was asked and what is available."""


# ----------------------------------------------------------------------------- building


# This script's defaults where they differ from a preset: the fast paths (an override wins)
DEFAULTS = ("--execution.kernels=pallas", "--execution.loss_impl=pallas")
# What each variant sets itself (--variants, --per-device-batch, --microbatches,
# --virtual-stages): no override
VARIANT_KEYS = (
    "parallel.data",
    "parallel.fsdp",
    "parallel.pipeline",
    "parallel.microbatches",
    "parallel.virtual_stages",
    "execution.scan_layers",
    "train.batch_size",
)


def base_overrides(args: argparse.Namespace) -> list[str]:
    """This script's DEFAULTS, then the user's overrides (which win)."""
    return [*DEFAULTS, *args.overrides]


def make_variants(args: argparse.Namespace, names: list[str], n: int) -> list[Variant]:
    """The rows of `names` (in VARIANTS order, pp once per microbatch and virtual stage count)."""
    b = args.per_device_batch
    one = ["--parallel.data=1", "--parallel.fsdp=1", "--parallel.pipeline=1"]
    plain, scan = "--execution.scan_layers=false", "--execution.scan_layers=true"
    out = []
    for name in (v for v in VARIANTS if v in names):
        if name == "single":
            out.append(Variant(name, 1, b, (*one, plain)))
        elif name == "single_scan":
            out.append(Variant(name, 1, b, (*one, scan)))
        elif name == "dp":
            mesh = (f"--parallel.data={n}", "--parallel.fsdp=1", "--parallel.pipeline=1")
            out.append(Variant(name, n, n * b, (*mesh, plain)))
        elif name in ("fsdp", "fsdp_scan"):
            mesh = ("--parallel.data=1", f"--parallel.fsdp={n}", "--parallel.pipeline=1")
            out.append(Variant(name, n, n * b, (*mesh, scan if name == "fsdp_scan" else plain)))
        elif name == "dp_fsdp":  # 2-D: data N/2 x fsdp 2
            mesh = (f"--parallel.data={n // 2}", "--parallel.fsdp=2", "--parallel.pipeline=1")
            out.append(Variant(name, n, n * b, (*mesh, plain)))
        else:  # pp: S = N stages; dp_pp: data N/2 x 2 stages, each data shard a pp batch
            ways, stages = (1, n) if name == "pp" else (n // 2, 2)
            mesh = (f"--parallel.data={ways}", "--parallel.fsdp=1", f"--parallel.pipeline={stages}")
            for m, v in itertools.product(args.microbatches, args.virtual_stages):
                micro = (f"--parallel.microbatches={m}", f"--parallel.virtual_stages={v}")
                out.append(Variant(name, n, ways * b, (*mesh, scan, *micro), m, v))
    return out


def variant_config(args: argparse.Namespace, v: Variant) -> Config:
    """The typed Config of a variant: preset, DEFAULTS, overrides, the variant's settings."""
    overrides = [*base_overrides(args), *v.overrides, f"--train.batch_size={v.global_batch}"]
    return load_config(args.config, overrides)


def check_devices(name: str, n: int, visible: list[jax.Device]) -> None:
    """BenchError unless `n` of the visible devices can run variant `name`."""
    kind = f"{len(visible)} {visible[0].platform} device{'s' * (len(visible) > 1)} visible"
    if n > len(visible):
        raise BenchError(
            f"{name} needs {n} devices, but there are {kind} (jax.devices()); lower --devices, "
            "or on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N"
        )
    if name in BASELINE and n < 2:
        hint = (
            f"--devices={n} was asked; leave it out to use all"
            if n < len(visible)
            else "on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=2"
        )
        raise BenchError(
            f"variant {name} needs at least 2 devices (it spreads one step over them and "
            f"compares with 1 device), but {n} {'was' if n < len(visible) else 'is'} "
            f"available: {kind}; {hint}"
        )


def build(cfg: Config, devices: list[jax.Device]) -> tuple[Any, jax.sharding.Mesh]:
    """The model and its mesh, checked as train does (ConfigError naming the fix)."""
    return build_model(cfg.model, cfg.execution), parallel.make_mesh(cfg, devices)


# ----------------------------------------------------------------------------- measuring


def peak_bytes(devices: list[jax.Device]) -> int | None:
    """Max allocator high-water mark over `devices`; None without memory stats (CPU)."""
    peaks = []
    for d in devices:
        stats = d.memory_stats()
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


def first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return (lines[0] if lines else type(error).__name__)[:300]


class Run:
    """A variant's model, mesh, sharded state, jitted step and sharded batch (as train.py)."""

    def __init__(self, cfg: Config, devices: list[jax.Device], label: str, seed: int) -> None:
        self.cfg = cfg
        model, self.mesh = build(cfg, devices)
        micro, virtual = cfg.parallel.microbatches, cfg.parallel.virtual_stages
        self.plan_line = parallel.kernel_model(model, self.mesh).plan.describe()
        batch = cfg.train.batch_size
        self.parallel_line = parallel.describe(self.mesh, micro, batch, virtual)
        print(f"{label}: {self.plan_line}")
        print(f"{label}: {self.parallel_line}", flush=True)
        host = random_batch(cfg, cfg.train.batch_size, seed)
        tx = make_optimizer(cfg.optim, cfg.train.steps or cfg.optim.warmup_steps + 1)
        init_rng, example = jax.random.PRNGKey(seed), host["inputs"][:1]
        self.state = parallel.create_sharded(
            lambda: create_state(model, tx, init_rng, example), self.mesh
        )
        self.n_params = sum(x.size for x in jax.tree_util.tree_leaves(self.state.params))
        self.step_fn = parallel.jit_train_step(train_step, self.state, self.mesh, micro, virtual)
        self.batch = parallel.shard_batch(host, self.mesh)
        self.key = jax.random.PRNGKey(seed + 1)

    def step(self) -> dict[str, jax.Array]:
        """One train step; the state is donated and replaced."""
        self.state, metrics = self.step_fn(self.state, self.batch, self.key)
        return metrics

    def state_bytes(self) -> int:
        return parallel.state_bytes_per_device(self.state)

    def mfu(self, tokens_per_s: float) -> float:
        """Model FLOPs utilisation per device (throughput.py's FLOPs and peak)."""
        flops = tokens_per_s * train_flops_per_token(self.cfg.model, self.n_params)
        return flops / (PEAK_BF16 * self.mesh.size)


def measure(args: argparse.Namespace, v: Variant, devices: list[jax.Device]) -> dict[str, Any]:
    """Time variant `v`: step ms (median, spread), tokens/s, MFU, loss, bytes per device."""
    cfg = variant_config(args, v)
    run = Run(cfg, devices, v.label, args.seed)
    timing = time_calls(run.step, warmup=args.warmup, group=args.group, samples=args.samples)
    loss = float(run.step()["loss"])
    tps = v.global_batch * cfg.model.context_length / timing.median_s
    return {
        "step_ms": 1e3 * timing.median_s,
        "spread_ms": 1e3 * timing.spread_s,
        "tokens_per_s": tps,
        "mfu_per_device": run.mfu(tps),
        "loss": loss,
        "n_params": run.n_params,
        "state_bytes_per_device": run.state_bytes(),
        "peak_bytes": peak_bytes(devices),
        "parallel": run.parallel_line,
        "plan": run.plan_line,
    }


def free() -> None:
    """Drop what the last variant left: unreferenced arrays and the compiled executables."""
    gc.collect()
    jax.clear_caches()
    gc.collect()


# ----------------------------------------------------------------------------- rows


def setup_key(args: argparse.Namespace, devices: list[jax.Device]) -> dict[str, Any]:
    """What makes two rows comparable (a baseline from an earlier run must match it)."""
    ex = load_config(args.config, base_overrides(args)).execution
    return {
        "config": args.config,
        "overrides": list(args.overrides),
        "per_device_batch": args.per_device_batch,
        "kernels": ex.kernels,
        "loss": ex.loss_impl,
        "device_kind": devices[0].device_kind,
    }


def earlier_rows(path: str | None, setup: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The last ok row per variant in the --jsonl file with the same setup."""
    rows: dict[str, dict[str, Any]] = {}
    if not path or not Path(path).is_file():
        return rows
    for line in Path(path).read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a killed run
        if isinstance(row, dict) and row.get("setup") == setup and row.get("status") == "ok":
            rows[row["variant"]] = row
    return rows


def compare(row: dict[str, Any], base: dict[str, Any] | None) -> None:
    """Fill speedup, scaling efficiency (and for pp the measured bubble) from `base`."""
    row["baseline"] = None if base is None else base["variant"]
    if base is None or row["status"] != "ok":
        return
    speedup = row["tokens_per_s"] / base["tokens_per_s"]
    row["speedup"] = speedup
    row["scaling_efficiency"] = speedup / row["devices"]
    if row["variant"] == "pp":  # same global batch: 1 - t_1 / (S t_pp)
        row["bubble"] = 1 - base["step_ms"] / (row["devices"] * row["step_ms"])


def append_row(path: str | None, row: dict[str, Any]) -> None:
    """Append one JSON line and flush it: a run killed later keeps the finished rows."""
    if not path:
        return
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _fmt(x: float | None, spec: str, scale: float = 1.0, suffix: str = "") -> str:
    return "-" if x is None else f"{x * scale:{spec}}{suffix}"


def print_table(rows: list[dict[str, Any]]) -> None:
    """The markdown table of the parallel variants."""
    print(
        "\n| variant | devices | batch | step ms | spread ms | tokens/s | speedup | efficiency "
        "| bubble (bound) | MFU/device | loss | state MiB/device | peak MiB | status |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        bubble = "-"
        if r.get("bubble_bound") is not None:
            bubble = f"{_fmt(r.get('bubble'), '.0%')} ({r['bubble_bound']:.0%})"
        print(
            f"| {r['label']} | {r['devices']} | {r['global_batch']} | "
            f"{_fmt(r.get('step_ms'), '.1f')} | {_fmt(r.get('spread_ms'), '.2f')} | "
            f"{_fmt(r.get('tokens_per_s'), ',.0f')} | "
            f"{_fmt(r.get('speedup'), '.2f', suffix='x')} | "
            f"{_fmt(r.get('scaling_efficiency'), '.0%')} | {bubble} | "
            f"{_fmt(r.get('mfu_per_device'), '.1%')} | {_fmt(r.get('loss'), '.4f')} | "
            f"{_fmt(r.get('state_bytes_per_device'), ',.1f', 1 / MIB)} | "
            f"{_fmt(r.get('peak_bytes'), ',.0f', 1 / MIB)} | {r['status']} |"
        )


# ----------------------------------------------------------------------------- modes


def run_variants(args: argparse.Namespace, visible: list[jax.Device]) -> int:
    """Measure the --variants, print the table, append --jsonl rows; 1 if a row failed."""
    names = [s for s in args.variants.split(",") if s]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown or not names:
        raise BenchError(f"--variants: unknown {unknown}; allowed: {', '.join(VARIANTS)}")
    n = args.devices or len(visible)
    for name in names:
        check_devices(name, 1 if name.startswith("single") else n, visible)
    setup = setup_key(args, visible)
    earlier = earlier_rows(args.jsonl, setup)
    wanted = {BASELINE[x] for x in names if x in BASELINE}
    missing = sorted(wanted - set(names) - set(earlier))
    if missing and not args.no_baseline:
        print(f"adding baseline variant(s) {', '.join(missing)} (not in --variants or --jsonl)")
        names += missing
    variants = make_variants(args, names, n)
    for v in variants:  # every config and mesh checked before anything runs
        build(variant_config(args, v), visible[: v.n_devices])

    print(f"devices: {n} x {visible[0].device_kind}, jax {jax.__version__}", flush=True)
    rows: list[dict[str, Any]] = []
    measured: dict[str, dict[str, Any]] = {}
    for v in variants:
        row: dict[str, Any] = {
            "variant": v.name,
            "label": v.label,
            "devices": v.n_devices,
            "global_batch": v.global_batch,
            "microbatches": v.microbatches,
            "virtual_stages": v.virtual_stages,
        }
        if v.name == "pp":
            row["bubble_bound"] = bubble_fraction(v.n_devices, v.microbatches, v.virtual_stages)
            row["bubble"] = None
        try:
            row |= measure(args, v, visible[: v.n_devices])
            row["status"] = "ok" if math.isfinite(row["loss"]) else "non-finite loss"
        except Exception as e:  # an OOM (or another failure) is a row; the sweep goes on
            row["status"] = f"{'OOM' if is_oom(e) else 'error'}: {first_line(e)}"
            print(f"{v.label}: {type(e).__name__}: {str(e)[:2000]}", file=sys.stderr)
        free()
        if row["status"] == "ok" and v.name not in BASELINE:
            measured[v.name] = row
        if v.name in BASELINE:
            base = measured.get(BASELINE[v.name])
            before = earlier.get(BASELINE[v.name])
            row["baseline_from"] = "this run" if base else "jsonl" if before else None
            compare(row, base or before)
        row.update(setup=setup, jax=jax.__version__, group=args.group, samples=args.samples)
        append_row(args.jsonl, row)
        rows.append(row)
        print(f"{v.label}: {json.dumps({k: row.get(k) for k in _SHOWN})}", flush=True)
    print_table(rows)
    ok = all(r["status"] == "ok" or r["status"].startswith("OOM") for r in rows)
    return 0 if ok else 1


_SHOWN = ("step_ms", "tokens_per_s", "speedup", "bubble", "loss", "state_bytes_per_device")


def run_big(args: argparse.Namespace, visible: list[jax.Device]) -> int:
    """Train --big-steps steps of the configured model with fsdp over N devices; OOM -> row."""
    n = args.devices or len(visible)
    check_devices("big", n, visible)
    b = n * args.per_device_batch
    own_remat = "execution.remat" in parse_overrides(args.overrides)
    remat = [] if own_remat else ["--execution.remat=block"]
    mesh = ("--parallel.data=1", f"--parallel.fsdp={n}", "--parallel.pipeline=1")
    v = Variant("big", n, b, (*mesh, "--execution.scan_layers=true", *remat))
    cfg = variant_config(args, v)
    devices = visible[:n]
    build(cfg, devices)  # config errors before anything runs
    print(f"devices: {n} x {visible[0].device_kind}, jax {jax.__version__}", flush=True)
    row: dict[str, Any] = {"variant": "big", "devices": n, "global_batch": b, "losses": []}
    times: list[float] = []
    try:
        run = Run(cfg, devices, f"big on {n}", args.seed)
        row["n_params"] = run.n_params
        row["state_bytes_per_device"] = run.state_bytes()
        gib = row["state_bytes_per_device"] / 2**30
        print(f"params {run.n_params:,}; params + optimizer state {gib:.2f} GiB per device")
        for i in range(args.big_steps):
            t0 = time.perf_counter()
            loss = float(run.step()["loss"])  # waits for the step
            times.append(time.perf_counter() - t0)
            row["losses"].append(loss)
            print(f"step {i + 1}: loss {loss:.4f}, {1e3 * times[-1]:.0f} ms", flush=True)
        later = times[1:] or times  # the first step compiles
        row["first_step_s"] = times[0]
        row["step_ms"] = 1e3 * statistics.median(later)
        row["tokens_per_s"] = b * cfg.model.context_length / (row["step_ms"] / 1e3)
        row["mfu_per_device"] = run.mfu(row["tokens_per_s"])
        row["peak_bytes"] = peak_bytes(devices)
        row["parallel"], row["plan"] = run.parallel_line, run.plan_line
        finite = all(math.isfinite(x) for x in row["losses"])
        row["status"] = "ok" if finite else "non-finite loss"
        del run
    except Exception as e:
        if not is_oom(e):
            raise
        row["status"] = f"OOM: {first_line(e)}"
        row["peak_bytes"] = peak_bytes(devices)
    free()
    row.update(setup=setup_key(args, visible), jax=jax.__version__, remat=cfg.execution.remat)
    append_row(args.jsonl, row)
    gib = 2**30
    print(
        "\n| variant | devices | batch | params | state GiB/device | peak GiB | first step s "
        "| step ms | tokens/s | MFU/device | losses | status |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    losses = " ".join(f"{x:.3f}" for x in row["losses"]) or "-"
    print(
        f"| big | {n} | {b} | {_fmt(row.get('n_params'), ',.0f')} | "
        f"{_fmt(row.get('state_bytes_per_device'), '.2f', 1 / gib)} | "
        f"{_fmt(row.get('peak_bytes'), '.2f', 1 / gib)} | {_fmt(row.get('first_step_s'), '.1f')} | "
        f"{_fmt(row.get('step_ms'), '.0f')} | {_fmt(row.get('tokens_per_s'), ',.0f')} | "
        f"{_fmt(row.get('mfu_per_device'), '.1%')} | {losses} | {row['status']} |"
    )
    return 0 if row["status"] == "ok" or row["status"].startswith("OOM") else 1


# ----------------------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        allow_abbrev=False,
        epilog="Config overrides as train.py takes them (--model.n_layers=2 --execution.remat=block"
        " ...) apply to every variant. Unless an override names them, this script runs "
        "execution.kernels=pallas and execution.loss_impl=pallas (the preset may say "
        "otherwise); the all-XLA path: --execution.kernels=xla --execution.loss_impl=xla "
        "--execution.mlp_impl=xla.",
    )
    p.add_argument("--config", default="configs/gpt2_124m.yaml", help="YAML preset")
    p.add_argument("--per-device-batch", type=int, default=32, help="rows per device")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    p.add_argument(
        "--microbatches",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=[4, 8],
        help="pp: comma-separated microbatch counts, one row each",
    )
    p.add_argument(
        "--virtual-stages",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=[1],
        help="pp: comma-separated virtual stage counts (1: GPipe), one row per (M, V)",
    )
    p.add_argument("--devices", type=int, default=None, help="N for dp/fsdp/pp/big (all)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile included)")
    p.add_argument("--samples", type=int, default=5, help="timed samples (median)")
    p.add_argument("--group", type=int, default=10, help="back-to-back steps per sample")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jsonl", default=None, help="append one JSON object per row")
    p.add_argument(
        "--no-baseline",
        action="store_true",
        help="do not add a variant's missing baseline (single / single_scan)",
    )
    p.add_argument("--big", action="store_true", help="train a large model with fsdp (see top)")
    p.add_argument("--big-steps", type=int, default=5, help="--big: steps to train")
    args, overrides = p.parse_known_args(argv)
    args.overrides = overrides  # --section.key=value, as train.py takes them
    bad = [a for a in args.overrides if a.startswith("--") and "." not in a.partition("=")[0]]
    if bad:
        p.error(f"unrecognized arguments: {' '.join(bad)} (config overrides: --section.key=value)")
    try:
        mine = sorted(set(parse_overrides(args.overrides)) & set(VARIANT_KEYS))
    except ConfigError as e:
        p.error(str(e))
    if mine:
        p.error(
            f"--{mine[0]}: the variants set it (--variants, --per-device-batch, --microbatches, "
            "--virtual-stages)"
        )
    for name in ("per_device_batch", "group", "samples", "big_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.devices is not None and args.devices < 1:
        p.error("--devices must be >= 1")
    if not args.microbatches or min(args.microbatches) < 1:
        p.error("--microbatches: comma-separated integers >= 1, e.g. 4,8")
    if not args.virtual_stages or min(args.virtual_stages) < 1:
        p.error("--virtual-stages: comma-separated integers >= 1, e.g. 1,3")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    visible = jax.devices()
    try:
        return run_big(args, visible) if args.big else run_variants(args, visible)
    except (BenchError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
