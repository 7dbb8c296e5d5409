"""Scaling on paper: step time and efficiency of DP, FSDP and PP over N GPUs, from one measured
GPU and the bytes each collective moves per step (`python profile.py scaling`).

A step on N GPUs is the one-GPU step (same rows per GPU) plus the time its collectives take at
the link's achieved bandwidth, nothing hidden behind compute unless `overlap` says so (bytes
counted as float32; the matmul weights' gradients and FSDP's gathered kernels cross in
bfloat16, so the fitted bandwidth is an effective one):
  DP    ring all-reduce of the gradients: 2 (N-1)/N x 4 P bytes per GPU.
  FSDP  all-gather of the parameters in the forward, again in the backward (the gathered
        weights are not saved: jaxllm.parallel.gathered_layers), reduce-scatter of the
        gradients: 3 (N-1)/N x 4 P bytes per GPU.
  PP    S = N stages, M microbatches of the same global batch, V virtual stages (GPipe: V = 1):
        V M + S - 1 ticks, each a stage's share of a microbatch's compute over V, a fixed cost
        per layer run (fitted) and the sends of its activations forward and their gradients
        backward (B/M x T x d x 4 bytes: the float32 residual stream).
One host holds GPUS_PER_HOST GPUs over NVLink (NVSwitch); more hosts talk over InfiniBand,
one NIC per GPU. NCCL runs one ring per NIC, so a ring's traffic leaves a host through all of its
NICs at once: across hosts a collective moves at min(NVLink, GPUS_PER_HOST x IB) per GPU, while a
pipeline send between two stages has one NIC. Large messages: latency is left out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from jaxllm.config import ModelConfig
from jaxllm.pipeline import bubble_fraction
from jaxllm.profiling.bench import param_count
from jaxllm.profiling.flops import train_flops_per_token

GPUS_PER_HOST = 8
NVLINK_GBPS = 450.0  # NVLink 4 (H100/H200 SXM): 18 links x 25 GB/s per direction per GPU
IB_GBPS = 50.0  # InfiniBand NDR, 400 Gb/s per GPU (one NIC per GPU, as in a DGX H100/H200)
# Fraction of the line rate the step's collectives reach with nothing hidden. Fitted: 2 and 4
# H200s, GPT-2 124M, the DP gradient all-reduce adds 3.2 ms for 498 MB (155 GB/s) and 3.8 ms
# for 746 MB (196 GB/s), well under nccl-tests' large-message bus bandwidth (near line rate);
# why is not measured here. Used for both links and for the pipeline's sends too: a ppermute
# alone reaches 0.53-0.70 of NVLink (25-200 MB, 2 H200s), but 0.4 fits the pipeline's steps
# better (the rest of a send's cost is in them).
ACHIEVED = 0.4
# One H200, GPT-2 124M, Pallas kernels + fused loss + cuDNN attention, batch 32 x 1024: 60.2 ms
# a step, 544,658 tokens/s x 855.2 MFLOPs per token. Other models: same FLOP rate.
ANCHOR_TFLOPS = 544_658 * 855_166_464 / 1e12
# PP's fixed cost per microbatch per layer of a stage (ms): launches and the small-batch
# inefficiency of a microbatch. Least-squares fit (tests/test_scaling.py) to S=2, M=4/8/16
# on 2 H200s.
LAYER_TICK_MS = 0.207


@dataclass(frozen=True)
class Setup:
    """A model on one GPU: what the predictions scale from."""

    n_params: int
    n_layers: int
    d_model: int
    context: int
    batch: int  # rows per GPU
    step_ms: float  # one GPU, `batch` rows, layers unrolled
    overlap: float = 0.0  # fraction of collective time hidden behind compute
    param_bytes: int = 4  # float32 parameters and gradients on the wire
    act_bytes: int = 4  # the float32 residual stream between stages


def setup_for(m: ModelConfig, batch: int, step_ms: float | None = None,
              overlap: float = 0.0) -> Setup:  # fmt: skip
    """A Setup from the config's counts; no measured step: ANCHOR_TFLOPS x the FLOPs per step."""
    n_params = param_count(m)
    if step_ms is None:
        flops = batch * m.context_length * train_flops_per_token(m, n_params)
        step_ms = flops / (ANCHOR_TFLOPS * 1e12) * 1e3
    return Setup(n_params, m.n_layers, m.d_model, m.context_length, batch, step_ms, overlap)


def ring_gbps(n: int) -> float:
    """Achieved GB/s per GPU of a collective over n GPUs (bus bandwidth)."""
    across = min(NVLINK_GBPS, GPUS_PER_HOST * IB_GBPS)  # a host's NICs carry its rings together
    return ACHIEVED * (NVLINK_GBPS if n <= GPUS_PER_HOST else across)


def send_gbps(n: int) -> float:
    """Achieved GB/s of one GPU's send to the next stage, some of which cross hosts if n > 8."""
    return ACHIEVED * (NVLINK_GBPS if n <= GPUS_PER_HOST else IB_GBPS)


def wire_ms(nbytes: float, gbps: float) -> float:
    return nbytes / (gbps * 1e9) * 1e3


def dp_ms(s: Setup, n: int) -> float:
    """DP step: the one-GPU step + the gradient all-reduce, 2 (N-1)/N x param bytes."""
    ring = 2 * (n - 1) / n * s.n_params * s.param_bytes
    return s.step_ms + (1 - s.overlap) * wire_ms(ring, ring_gbps(n))


def fsdp_ms(s: Setup, n: int) -> float:
    """FSDP step: the one-GPU step + gather, gather again, reduce-scatter."""
    moved = 3 * (n - 1) / n * s.n_params * s.param_bytes
    return s.step_ms + (1 - s.overlap) * wire_ms(moved, ring_gbps(n))


def pp_ms(s: Setup, n: int, microbatches: int, batch: int | None = None,
          layer_tick_ms: float = LAYER_TICK_MS, virtual: int = 1) -> float:  # fmt: skip
    """Pipeline step over n stages, global batch `batch` (default: s.batch) in M microbatches,
    `virtual` stages a device (1: GPipe)."""
    if n == 1:
        return s.step_ms * (batch or s.batch) / s.batch
    rows = (batch or s.batch) / microbatches
    compute = s.step_ms * rows / s.batch / (n * virtual)  # one chunk of one microbatch
    send = wire_ms(rows * s.context * s.d_model * s.act_bytes, send_gbps(n))
    ticks = virtual * microbatches + n - 1  # = V M / (1 - bubble_fraction(n, M, V))
    return ticks * (compute + layer_tick_ms * s.n_layers / (n * virtual) + 2 * send)


def predict(s: Setup, strategy: str, n: int, microbatches: int | None = None,
            batch: int | None = None, virtual: int = 1) -> dict[str, float]:  # fmt: skip
    """Step ms, tokens/s and efficiency (tokens/s over n x one GPU's, as parallel_throughput)."""
    if strategy == "pp":
        m = microbatches or min(4 * n, s.batch)
        rows, ms = batch or s.batch, pp_ms(s, n, m, batch, virtual=virtual)
    else:
        m, rows = None, n * s.batch
        ms = dp_ms(s, n) if strategy == "dp" else fsdp_ms(s, n)
    tps = rows * s.context / ms * 1e3
    eff = tps / (n * s.batch * s.context / s.step_ms * 1e3)
    return {"step_ms": ms, "tokens_per_s": tps, "efficiency": eff, "microbatches": m}


def table(s: Setup, gpus: tuple[int, ...] = (1, 2, 4, 8, 16, 64)) -> list[dict]:
    """One row per (N, strategy); PP only while a stage holds a layer and a microbatch a row."""
    out = []
    for n in gpus:
        for strategy in ("dp", "fsdp", "pp"):
            if strategy == "pp" and (n > s.n_layers or n > s.batch):
                continue
            out.append({"devices": n, "strategy": strategy, **predict(s, strategy, n)})
    return out


def format_table(rows: list[dict]) -> str:
    """N x (DP, FSDP, PP): step ms, tokens/s, efficiency; '-' where a strategy has no row."""
    cell = {(r["devices"], r["strategy"]): r for r in rows}
    head = f"{'GPUs':>5}" + "".join(f" | {k.upper() + ' ms':>9} {'tokens/s':>10} {'eff':>5}"
                                    for k in ("dp", "fsdp", "pp"))  # fmt: skip
    lines = [head, "-" * len(head)]
    for n in sorted({r["devices"] for r in rows}):
        line = f"{n:>5}"
        for k in ("dp", "fsdp", "pp"):
            r = cell.get((n, k))
            line += " | " + (f"{r['step_ms']:>9.1f} {r['tokens_per_s']:>10,.0f} "
                             f"{r['efficiency']:>5.0%}" if r else f"{'-':>27}")  # fmt: skip
        lines.append(line)
    pp = [r for r in rows if r["strategy"] == "pp" and r["devices"] > 1]
    if pp:
        b = ", ".join(
            f"S={r['devices']} M={r['microbatches']} "
            f"{bubble_fraction(r['devices'], r['microbatches']):.0%}"
            for r in pp
        )
        lines.append(f"PP: same global batch as one GPU; bubble {b}")
    return "\n".join(lines)


def read_rows(paths: list[str]) -> list[dict]:
    """The JSON lines of parallel_throughput.py --jsonl files; a line cut by a killed run is
    skipped."""
    rows = []
    for line in (ln for p in paths for ln in Path(p).read_text().splitlines()):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return [r for r in rows if isinstance(r, dict)]


def compare(s: Setup, measured: list[dict]) -> list[dict]:
    """Measured DP/FSDP/PP rows (parallel_throughput --jsonl) next to their predictions."""
    out = []
    for row in measured:
        if row.get("status") != "ok" or row.get("variant") not in ("dp", "fsdp", "pp"):
            continue
        n, m, v = row["devices"], row.get("microbatches"), row.get("virtual_stages") or 1
        p = predict(s, row["variant"], n, m, row["global_batch"] if m else None, v)
        out.append({"variant": row["variant"], "devices": n, "microbatches": m, "virtual": v,
                    "measured_ms": row["step_ms"], "predicted_ms": p["step_ms"],
                    "measured_eff": row.get("scaling_efficiency"),
                    "predicted_eff": p["efficiency"]})  # fmt: skip
    return out


def plot(rows: list[dict], measured: list[dict], path: str) -> None:
    """Tokens/s and efficiency per GPU count, a line per strategy; measured rows as dots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for k, color in (("dp", "C0"), ("fsdp", "C1"), ("pp", "C2")):
        r = [x for x in rows if x["strategy"] == k]
        ns = [x["devices"] for x in r]
        left.plot(ns, [x["tokens_per_s"] for x in r], "-", color=color, label=k.upper())
        right.plot(ns, [x["efficiency"] for x in r], "-", color=color, label=k.upper())
        got = [x for x in measured if x["variant"] == k and x["measured_eff"] is not None]
        right.plot([x["devices"] for x in got], [x["measured_eff"] for x in got], "o",
                   color=color)  # fmt: skip
    left.set(xscale="log", yscale="log", xlabel="GPUs", ylabel="tokens/s (predicted)")
    right.set(xscale="log", xlabel="GPUs", ylabel="scaling efficiency", ylim=(0, 1.05))
    right.axvline(GPUS_PER_HOST, color="gray", ls=":", label="one host")
    gpus = sorted({x["devices"] for x in rows})
    for ax in (left, right):
        ax.set_xticks(gpus, [str(n) for n in gpus], minor=False)
        ax.minorticks_off()
        ax.legend()
    fig.suptitle("predicted (lines), measured (dots)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
