"""Roofline of a decoder layer's ops and the CS229S conv1d question: `python profile.py roofline`.

The FLOP/IO model (OpCost, layer_ops, component_of; conventions in its docstring) lives in
`jaxllm/profiling/flops.py`. This module adds the hardware peaks, the compute- or memory-bound
verdict (intensity against the ridge point, peak FLOP/s / bytes/s), measured points, the text
report and the roofline PNG.

Measured points: `--measured FILE ...` reads JSONL files, one object per line:
  - a row of `python profile.py kernels --jsonl F` (kernel, direction, shape, dtype, ms, ...):
    its FLOPs and bytes come from `flops.kernel_cost` at that shape;
  - any row with the keys name, flops, bytes (of one call) and seconds (its time), optionally
    dtype (picks the roof it is drawn under), as `profile.py bench` and `breakdown` write them.
Rows that are neither (or carry non-positive numbers) are skipped and counted.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from jaxllm.atomic_file import save_figure_atomic
from jaxllm.config import ModelConfig
from jaxllm.profiling.flops import (
    ATTENTION_LINEAR,
    ATTENTION_QUADRATIC,
    DTYPE_BYTES,
    OpCost,
    component_of,
    conv1d,
    conv1d_bytes,
    conv1d_output_length,
    conv1d_padding,
    kernel_cost,
    layer_ops,
    mha_crossover_length,
    mha_flops,
)
from jaxllm.profiling.harness import BadInput, md_header, md_row


@dataclass(frozen=True)
class Hardware:
    """Peak dense FLOP/s per dtype name and memory bandwidth in bytes/s."""

    name: str
    peak_flops: dict[str, float]
    mem_bytes_per_s: float

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for `dtype`; BadInput if the device has none."""
        if dtype not in self.peak_flops:
            allowed = ", ".join(self.peak_flops)
            raise BadInput(f"{self.name} has no {dtype} peak; allowed: {allowed}")
        return self.peak_flops[dtype]

    def ridge(self, dtype: str) -> float:
        """Ridge point, FLOP/byte: ops of higher intensity are compute-bound."""
        return self.peak(dtype) / self.mem_bytes_per_s

    def attainable(self, intensity: float, dtype: str) -> float:
        """Roofline FLOP/s at `intensity` FLOP/byte: min(peak, intensity * bandwidth)."""
        return min(self.peak(dtype), intensity * self.mem_bytes_per_s)


# Datasheet peaks, dense (no 2:4 sparsity). The fp32 peaks are the CUDA-core (non-tensor) ones;
# XLA's default matmul precision may run float32 matmuls as TF32 on A100/H100 (156 / 494.7
# TFLOP/s dense), above that roof.
HARDWARE: dict[str, Hardware] = {
    # "NVIDIA A100 Tensor Core GPU" datasheet, A100 80GB SXM column: BF16 / FP16 Tensor Core
    # 312 TFLOPS (624 with sparsity), FP32 19.5 TFLOPS, GPU memory bandwidth 2,039 GB/s.
    "A100": Hardware(
        "NVIDIA A100 80GB SXM",
        {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12},
        2.039e12,
    ),
    # "NVIDIA T4 Tensor Core GPU" datasheet: mixed precision (FP16/FP32) 65 TFLOPS, single
    # precision 8.1 TFLOPS, GDDR6 320+ GB/s. Turing has no bfloat16.
    "T4": Hardware("NVIDIA T4", {"float16": 65e12, "float32": 8.1e12}, 320e9),
    # "NVIDIA H100 Tensor Core GPU" datasheet, H100 SXM column: BF16 / FP16 Tensor Core 1,979
    # TFLOPS with sparsity, i.e. 989.4 dense ("NVIDIA H100 Tensor Core GPU Architecture"
    # whitepaper, H100 SXM5), FP32 67 TFLOPS (66.9 in the whitepaper), 3.35 TB/s.
    "H100": Hardware(
        "NVIDIA H100 SXM", {"bfloat16": 989.4e12, "float16": 989.4e12, "float32": 66.9e12}, 3.35e12
    ),
}


def verdict(op: OpCost, hw: Hardware, dtype: str) -> str:
    """'compute-bound' if the op's intensity reaches the ridge point of `hw` at `dtype`, else
    'memory-bound'."""
    return "compute-bound" if op.intensity >= hw.ridge(dtype) else "memory-bound"


def min_seconds(op: OpCost, hw: Hardware, dtype: str) -> float:
    """Roofline lower bound on the op's time: max(FLOPs / peak, bytes / bandwidth)."""
    return max(op.flops / hw.peak(dtype), op.bytes / hw.mem_bytes_per_s)


# ----------------------------------------------------------------------------- measured points
@dataclass(frozen=True)
class Measured:
    """A timed op: FLOPs and bytes of one call, its time in seconds, its dtype if known."""

    name: str
    flops: float
    bytes: float
    seconds: float
    dtype: str | None = None

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes

    @property
    def flops_per_s(self) -> float:
        return self.flops / self.seconds


BENCH_KEYS = ("name", "flops", "bytes", "seconds")
KERNEL_KEYS = ("kernel", "direction", "shape", "dtype", "ms")


def _positive_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def measured_from_row(row: object) -> Measured | None:
    """A Measured from one JSONL row (either schema in the module docstring); None if neither."""
    if not isinstance(row, dict):
        return None
    if all(k in row for k in BENCH_KEYS):
        if not all(_positive_number(row[k]) for k in BENCH_KEYS[1:]):
            return None
        dtype = row.get("dtype") if row.get("dtype") in DTYPE_BYTES else None
        return Measured(str(row["name"]), row["flops"], row["bytes"], row["seconds"], dtype)
    if all(k in row for k in KERNEL_KEYS):
        dtype, ms = row["dtype"], row["ms"]
        if (
            dtype not in DTYPE_BYTES
            or not _positive_number(ms)
            or row["direction"] not in ("fwd", "bwd")
        ):
            return None
        try:
            shape = tuple(int(x) for x in str(row["shape"]).split("x"))
            cost = kernel_cost(row["kernel"], row["direction"], shape, DTYPE_BYTES[dtype])
        except ValueError:
            return None
        return Measured(f"{cost.name} {dtype}", cost.flops, cost.bytes, ms / 1e3, dtype)
    return None


def load_measured(paths: Iterable[str | Path]) -> tuple[list[Measured], int, int]:
    """(points, skipped rows, total rows) of JSONL files; blank lines are not rows."""
    points, skipped, total = [], 0, 0
    for path in paths:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as e:
            raise BadInput(f"cannot read measurements file {path}: {e.strerror}") from e
        for line in filter(str.strip, lines):
            total += 1
            try:
                point = measured_from_row(json.loads(line))
            except json.JSONDecodeError:
                point = None
            if point is None:
                skipped += 1
            else:
                points.append(point)
    return points, skipped, total


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    return "\n".join([md_header(header), *map(md_row, rows)])


def _short_verdict(op: OpCost, hw: Hardware, dtype: str) -> str:
    return verdict(op, hw, dtype).removesuffix("-bound") if dtype in hw.peak_flops else "n/a"


def layer_report(
    ops: list[OpCost], title: str, dtype: str, devices: dict[str, Hardware], device: str
) -> str:
    """Per-op FLOPs, bytes, intensity, verdict on every device, lower-bound time on `device`."""
    hw = devices[device]
    ridges = ", ".join(
        f"{key} {d.ridge(dtype):.1f}" if dtype in d.peak_flops else f"{key} n/a (no {dtype} peak)"
        for key, d in devices.items()
    )
    flops, nbytes = sum(op.flops for op in ops), sum(op.bytes for op in ops)
    t_min = sum(min_seconds(op, hw, dtype) for op in ops)
    rows = [[op.name, component_of(op.name), f"{op.flops / 1e9:.3f}", f"{op.bytes / 1e6:.2f}",
             f"{op.intensity:.1f}", *(_short_verdict(op, d, dtype) for d in devices.values()),
             f"{min_seconds(op, hw, dtype) * 1e6:.1f}"] for op in ops]  # fmt: skip
    rows.append(["total", "", f"{flops / 1e9:.3f}", f"{nbytes / 1e6:.2f}", f"{flops / nbytes:.1f}",
                 *([""] * len(devices)), f"{t_min * 1e6:.1f}"])  # fmt: skip
    shares = []
    for comp in ("attention", "mlp", "norm/other"):
        mine = [op for op in ops if component_of(op.name) == comp]
        f_share = sum(op.flops for op in mine) / flops
        t_share = sum(min_seconds(op, hw, dtype) for op in mine) / t_min
        shares.append(f"{comp} {100 * f_share:.1f}% of FLOPs, {100 * t_share:.1f}% of t_min")
    header = ["op", "component", "GFLOP", "MB", "FLOP/B", *devices, f"t_min us ({device})"]
    return "\n".join([
        title,
        "FLOPs: 2 per multiply-add; bytes: each input read once, each output written once, per "
        "op run alone (unfused), all tensors in the one dtype",
        f"ridge point (FLOP/byte) = peak FLOP/s / memory bytes/s at {dtype}: {ridges}",
        _table(header, rows),
        "by component: " + "; ".join(shares),
    ])  # fmt: skip


def scaling_report(*, batch: int, d_model: int, n_heads: int, arch: str,
                   lengths: Sequence[int]) -> str:  # fmt: skip
    """MHA forward FLOPs over lengths: projections linear in L, score-sized ops quadratic."""
    rows = []
    for t in lengths:
        lin, quad = mha_flops(batch=batch, length=t, d_model=d_model, n_heads=n_heads, arch=arch)
        rows.append([str(t), f"{lin / 1e9:.2f}", f"{quad / 1e9:.2f}", f"{quad / lin:.2f}"])
    cross = mha_crossover_length(d_model=d_model, n_heads=n_heads, arch=arch)
    linear = " + ".join(n for n in ATTENTION_LINEAR if n != "rope" or arch != "gpt2")  # no RoPE
    header = ["L", f"{linear} GFLOP (~L)", f"{' + '.join(ATTENTION_QUADRATIC)} GFLOP (~L^2)",
              "quadratic / linear"]  # fmt: skip
    return "\n".join([
        f"MHA forward FLOPs vs length L ({arch}, batch {batch}, d_model {d_model}, {n_heads} "
        "heads; one layer)",
        _table(header, rows),
        f"quadratic = linear at L = {cross:.0f} (matmuls alone, 8 L D^2 = 4 L^2 D: L = 2 D = "
        f"{2 * d_model})",
    ])  # fmt: skip


def conv_report(shape: Sequence[int], dtype: str, padding: str,
                devices: dict[str, Hardware]) -> str:  # fmt: skip
    """The CS229S conv question: bandwidth, throughput, ridge, FLOPs, bytes, intensity, verdict."""
    batch, length, width, kernel = shape
    s = DTYPE_BYTES[dtype]
    conv = dict(batch=batch, length=length, width=width, kernel=kernel, dtype_bytes=s,
                padding=padding)  # fmt: skip
    op, parts = conv1d(**conv), conv1d_bytes(**conv)
    left, right = conv1d_padding(kernel, padding)
    lines = [
        f"depthwise conv1d, {dtype} ({s} B/element): batch {batch}, length {length}, width "
        f"{width}, kernel {kernel}, padding {padding} ({left} zeros left, {right} right) -> "
        f"output length {conv1d_output_length(length, kernel, padding)}",
        f"  FLOPs                 {op.flops:,.0f} ({op.flops / 1e9:.3f} GFLOP) = B * Lo * D * "
        "(2K + 1): 2 per multiply-add (K per output), 1 per bias add",
        f"  bytes                 {op.bytes:,.0f} ({op.bytes / 1e6:.1f} MB) = "
        + " + ".join(f"{k} {v:,.0f}" for k, v in parts.items()) + ", each moved once",
        f"  arithmetic intensity  {op.intensity:.3f} FLOP/byte",
    ]  # fmt: skip
    for key, hw in devices.items():
        ridge = hw.ridge(dtype)
        sign = ">=" if op.intensity >= ridge else "<"
        lines += [
            f"{key} ({hw.name}):",
            f"  memory bandwidth      {hw.mem_bytes_per_s / 1e9:.1f} GB/s",
            f"  compute throughput    {hw.peak(dtype) / 1e12:.1f} TFLOP/s ({dtype})",
            f"  ridge point           {ridge:.1f} FLOP/byte (throughput / bandwidth)",
            f"  verdict               {verdict(op, hw, dtype)} ({op.intensity:.3f} {sign} "
            f"{ridge:.1f}): time >= {min_seconds(op, hw, dtype) * 1e3:.4f} ms (memory alone "
            f"{op.bytes / hw.mem_bytes_per_s * 1e3:.4f} ms, compute alone "
            f"{op.flops / hw.peak(dtype) * 1e3:.4f} ms)",
        ]
    return "\n".join(lines)


def measured_report(points: list[Measured], roofs: dict[str, Hardware], dtype: str) -> str:
    """Achieved FLOP/s and GB/s of measured points, and their share of each roof at the point's
    intensity and dtype (`dtype` for points without one)."""
    rows = []
    for p in points:
        dt = p.dtype or dtype
        shares = [f"{100 * p.flops_per_s / hw.attainable(p.intensity, dt):.0f}"
                  if dt in hw.peak_flops else "n/a" for hw in roofs.values()]  # fmt: skip
        rows.append([p.name, dt, f"{p.intensity:.2f}", f"{p.flops_per_s / 1e12:.3f}",
                     f"{p.bytes / p.seconds / 1e9:.0f}", *shares])  # fmt: skip
    header = ["measured", "dtype", "FLOP/B", "TFLOP/s", "GB/s", *(f"% of {k} roof" for k in roofs)]
    return _table(header, rows)


# ----------------------------------------------------------------------------- plot
def _close_groups(ops: list[OpCost], ratio: float = 1.15) -> list[list[OpCost]]:
    """Ops sorted by intensity, split where consecutive intensities differ by more than ratio."""
    groups: list[list[OpCost]] = []
    for op in sorted(ops, key=lambda op: op.intensity):
        if groups and op.intensity <= groups[-1][-1].intensity * ratio:
            groups[-1].append(op)
        else:
            groups.append([op])
    return groups


def plot_roofline(
    path: str | Path, hw: Hardware, dtype: str, ops: list[OpCost],
    measured: Sequence[Measured] = (), extra: Hardware | None = None, dpi: int = 80,
) -> Path:  # fmt: skip
    """Write the roofline PNG: `hw`'s roofs (one per dtype drawn), the analytic ops on the roof
    at their intensity, measured points at their achieved FLOP/s, `extra` (measured peaks)
    dashed."""
    import matplotlib  # optional: only for the plot

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    dtypes = [dtype] + sorted({p.dtype for p in measured if p.dtype and p.dtype != dtype})
    dtypes = [d for d in dtypes if d in hw.peak_flops]
    xs = [op.intensity for op in ops] + [p.intensity for p in measured]
    xs += [hw.ridge(d) for d in dtypes] + ([extra.ridge(dtype)] if extra else [])
    lo, hi = min(xs) / 4, max(xs) * 4
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, d in enumerate(dtypes):
        ax.plot(grid, [hw.attainable(x, d) for x in grid], lw=1.5, color=f"C{i}",
                label=f"{hw.name} {d} roof (ridge {hw.ridge(d):.0f} FLOP/B)")  # fmt: skip
    if extra is not None:
        label = f"measured peaks {dtype} (ridge {extra.ridge(dtype):.0f} FLOP/B)"
        ax.plot(
            grid, [extra.attainable(x, dtype) for x in grid], "--", lw=1, color="k", label=label
        )
    if dtype in hw.peak_flops:
        xs = [op.intensity for op in ops]
        ax.scatter(xs, [hw.attainable(x, dtype) for x in xs], s=18, color="C0", zorder=3,
                   label=f"analytic ops ({dtype}), on the roof")  # fmt: skip
        # ops of (nearly) the same intensity share one label: norm1/norm2, scores/av, ...
        for i, group in enumerate(_close_groups(ops)):
            x, names = group[0].intensity, ", ".join(op.name for op in group)
            ax.annotate(names, (x, hw.attainable(x, dtype)), fontsize=6,
                        xytext=(4, -10 if i % 2 else 4), textcoords="offset points")  # fmt: skip
    if measured:
        ax.scatter([p.intensity for p in measured], [p.flops_per_s for p in measured], s=22,
                   marker="x", color="C3", zorder=4, label="measured")  # fmt: skip
        for p in measured:
            ax.annotate(p.name, (p.intensity, p.flops_per_s), fontsize=5, color="C3",
                        xytext=(3, -8), textcoords="offset points")  # fmt: skip
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP/byte)", ylabel="FLOP/s")
    ax.set_title(f"roofline: {hw.name}, {dtype}", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    save_figure_atomic(fig, path, dpi=dpi)
    plt.close(fig)
    return Path(path)


# ----------------------------------------------------------------------------- the command
SCALING_LENGTHS = (128, 256, 512, 1024, 2048, 4096, 8192)


def report(
    model: ModelConfig, batch: int, *, dtype: str = "bfloat16", device: str = "H100",
    conv: Sequence[int] | None = None, conv_padding: str = "full",
    peak_tflops: float | None = None, peak_gbps: float | None = None,
    png: str | Path | None = None, measured: Sequence[str | Path] = (),
) -> str:  # fmt: skip
    """The text of `python profile.py roofline` (writes `png` too); BadInput on bad input.

    Without `conv`: the per-op table of one decoder layer of `model` at (batch,
    model.context_length) on every device (model.short_conv adds its causal conv) and the MHA
    length scaling. `conv` (B, L, D, K): the CS229S conv question at that shape and padding.
    """
    hw = HARDWARE[device]
    hw.peak(dtype)  # a dtype the chosen device has no peak for is an error, not a "n/a"
    extra = None
    if peak_tflops is not None or peak_gbps is not None:
        extra = Hardware("peaks measured on the machine",
                         {dtype: peak_tflops * 1e12 if peak_tflops else hw.peak(dtype)},
                         peak_gbps * 1e9 if peak_gbps else hw.mem_bytes_per_s)  # fmt: skip
    mine = {device: hw} | ({"measured": extra} if extra else {})
    if conv is not None:
        out = [conv_report(conv, dtype, conv_padding, mine)]
        b, t, w, k = conv
        ops = [conv1d(batch=b, length=t, width=w, kernel=k, dtype_bytes=DTYPE_BYTES[dtype],
                      padding=conv_padding)]  # fmt: skip
    else:
        m, t = model, model.context_length
        ops = layer_ops(batch=batch, length=t, d_model=m.d_model, n_heads=m.n_heads,
                        d_ff=m.ffn_dim, dtype_bytes=DTYPE_BYTES[dtype], arch=m.arch,
                        conv_kernel=m.short_conv_size if m.short_conv else 0)  # fmt: skip
        title = (f"roofline: {m.arch} decoder layer, forward; batch {batch}, length {t}, d_model "
                 f"{m.d_model}, {m.n_heads} heads (head dim {m.d_model // m.n_heads}), d_ff "
                 f"{m.ffn_dim}, {dtype} ({DTYPE_BYTES[dtype]} B/element)")  # fmt: skip
        out = [layer_report(ops, title, dtype, HARDWARE | mine, device), "",
               scaling_report(batch=batch, d_model=m.d_model, n_heads=m.n_heads, arch=m.arch,
                              lengths=sorted({*SCALING_LENGTHS, t}))]  # fmt: skip
    points: list[Measured] = []
    if measured:
        points, skipped, total = load_measured(measured)
        out += ["", f"measured: {len(points)} points from {len(measured)} file(s); skipped "
                f"{skipped} of {total} rows (neither a `profile.py kernels` row nor "
                f"{{{', '.join(BENCH_KEYS)}}} with positive numbers)"]  # fmt: skip
        if points:
            out.append(measured_report(points, mine, dtype))
    if png is not None:
        out.append(f"wrote {plot_roofline(png, hw, dtype, ops, points, extra)}")
    return "\n".join(out)
