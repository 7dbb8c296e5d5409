"""Traces of train steps: jax.profiler (TensorBoard / Perfetto) and NVTX ranges for Nsight Systems.

`python profile.py trace --out DIR` (trace_train_steps): a few train steps after warm-up,
recorded with jax.profiler into DIR/trace (`tensorboard --logdir DIR/trace`, or
DIR/trace/plugins/profile/*/perfetto_trace.json.gz in ui.perfetto.dev), the optimized HLO in
DIR/step.hlo.txt, and a table of the kernels that take the most device time per step, each with
its named scope (jaxllm.models.decoder names them: block_3/attn/qkv, loss, optimizer ...). A
launch's scope comes from the HLO instruction behind it: the `hlo_op` argument XLA annotates
launches with, else the kernel name read against the HLO (HloKernels: fusions and Triton/Pallas
kernels are named after their instructions, cuBLAS and cuDNN kernels only after their library)
and the launch order (align_launches).

`--nvtx` (phase_steps) is the mode to run under Nsight Systems: no jax.profiler trace (both
would attach CUPTI); the step runs as three jitted programs, forward, backward and optimizer,
each in an NVTX range of its name, synced before the range closes. `python profile.py nsys`
runs it under `nsys profile --trace=cuda,nvtx` and prints `nsys stats` per phase.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import ctypes.util
import functools
import glob
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from jaxllm.atomic_file import write_text_atomic
from jaxllm.config import Config
from jaxllm.profiling.harness import make_state, md_header, md_row, random_batch
from jaxllm.train.state import loss_and_sums, train_step
from jaxllm.train.step_trace import latest_profile_dir

PHASES = ("forward", "backward", "optimizer")
PROFILE_CLI = Path(__file__).resolve().parents[2] / "profile.py"  # nsys runs it from any cwd

# ----------------------------------------------------------------------------- reading traces


def load_trace_events(log_dir: str | Path) -> list[dict[str, Any]]:
    """The Chrome-trace events of the newest trace under log_dir (its *.trace.json.gz)."""
    run = latest_profile_dir(log_dir)
    files = sorted(run.glob("*.trace.json.gz"))
    if not files:
        raise FileNotFoundError(f"no *.trace.json.gz in {run}")
    with gzip.open(files[0]) as f:
        return json.load(f)["traceEvents"]


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+) = ")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r"(?:calls|to_apply)=%?([\w.\-]+)")


def hlo_scopes(hlo_text: str) -> dict[str, str]:
    """{HLO instruction name: its named-scope path} from optimized HLO text, e.g.
    'fusion.12' -> 'bwd/block_3/attn/qkv' (see `scope_of`). An instruction without metadata
    (XLA often leaves it off a fusion) takes that of the computation it calls: its root's, else
    its first instruction's that has one."""
    own: dict[str, str] = {}  # instruction -> op_name
    calls: dict[str, str] = {}  # instruction -> the computation it calls
    first: dict[str, str] = {}  # computation -> op_name of its root, else its first op_name
    comp = None
    for line in hlo_text.splitlines():
        if (m := _COMPUTATION.match(line)) and " = " not in line:
            comp = m.group(1)
            continue
        if not (m := _INSTRUCTION.match(line)):
            continue
        name, op = m.group(2), _OP_NAME.search(line)
        if op:
            own[name] = op.group(1)
            if comp is not None and (m.group(1) or comp not in first):
                first[comp] = op.group(1)
        if c := _CALLS.search(line):
            calls[name] = c.group(1)
    names = own.keys() | calls.keys()
    out = {}
    for name in names:
        op = own.get(name) or first.get(calls.get(name, ""))
        if op:
            out[name] = scope_of(op)
    return out


def scope_of(op_name: str) -> str:
    """An HLO op_name -> the scope path a reader wants: the jit(...) prefix and the primitive
    dropped, autodiff's transforms shortened to fwd/ (jvp) and bwd/ (transpose), remat's
    recomputation marked recompute/.
    'jit(train_step)/transpose(jvp(GPT2.loss))/block_3/attn/qkv/dot_general' ->
    'bwd/block_3/attn/qkv'."""
    parts = op_name.split("/")
    if parts and parts[0].startswith(("jit(", "pjit(")):
        parts = parts[1:]
    # the primitive (dot_general, add, ...); a Pallas call's is its kernel's name + pallas_call
    parts = parts[:-2] if parts[-1:] == ["pallas_call"] else parts[:-1]
    out: list[str] = []
    for p in parts:
        if p.startswith("transpose("):
            out = ["bwd"]
        elif p.startswith("jvp("):
            out = out or ["fwd"]
        elif p == "rematted_computation":
            out = ["recompute", *[q for q in out if q != "bwd"]]
        elif p == "checkpoint" or p.startswith(("jit(", "pjit(")) or "->" in p:
            continue  # remat's wrapper, nested jits (jnp helpers), einsum specs
        elif p not in out:  # remat repeats the block's path inside the backward
            out.append(p)
    return "/".join(out) or "(top level)"


def _distinct_scopes(scopes: Iterable[str]) -> list[str]:
    uniq = sorted(set(scopes))
    return uniq if len(uniq) <= 1 else sorted({re.sub(r"block_\d+", "block_*", s) for s in uniq})


def merge_scopes(scopes: Iterable[str]) -> str:
    """One label for the scopes of several launches or instructions: the scope itself when
    they agree, block_N -> block_* when they differ only in the block, else the distinct
    scopes joined with ', ' (five at most, then a count)."""
    merged = _distinct_scopes(scopes)
    if len(merged) <= 5:
        return ", ".join(merged) or "(no scope)"
    return ", ".join(merged[:4]) + f", ... ({len(merged)} scopes)"


# XLA:GPU emits each fusion (and copy, ...) as a kernel named after the instruction,
# sanitized: input_multiply_reduce_fusion.8 -> input_multiply_reduce_fusion_8.
def kernel_name_of(instruction: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", instruction)


_OPCODE = re.compile(r" ([a-z][a-z0-9\-]*)\(")
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_DEDUP = re.compile(r'deduplicated_name="([^"]*)"')
_TRITON_IR = re.compile(r'(?:\bir = "|"ir":")([^"]*)"')
_TRITON_NAME = re.compile(r'(?:[,{] ?name = "|"name":")([^"]*)"')
_NO_LAUNCH = {"parameter", "get-tuple-element", "bitcast", "tuple", "constant", "after-all"}
_FAMILY_NAMES = {"cublas": "cuBLAS GEMM", "cudnn_fwd": "cuDNN fprop", "cudnn_bwd": "cuDNN bprop"}


def kernel_family(kernel: str) -> str | None:
    """The library a kernel name comes from, where the name alone says: 'cudnn_fwd' /
    'cudnn_bwd' (cuDNN's fused attention: ..._flash_fprop_... / ..._flash_bprop_...),
    'cublas' (nvjet_*, *gemm*, cutlass, xmma: cuBLAS / cuBLASLt GEMMs), else None."""
    low = kernel.lower()
    if low.startswith("cudnn") or "fmha" in low or "sdpa" in low:
        return "cudnn_bwd" if re.search(r"bprop|bwd|backward|dgrad|wgrad", low) else "cudnn_fwd"
    if re.search(r"nvjet|gemm|gemv|cutlass|xmma|splitk|cublas", low):
        return "cublas"
    return None


class HloKernels:
    """Which HLO instructions a GPU kernel name can come from, from the optimized HLO text
    (`compiled.as_text()`), and their scopes (hlo_scopes).

    - Fusions (and other XLA-emitted ops): the kernel is named after the instruction
      (kernel_name_of). XLA compiles identical fusions once: the instructions that share a
      `deduplicated_name` launch one kernel, named after the first of them in the schedule,
      so a kernel name stands for that whole group (e.g. the same MLP multiply in every
      block: fwd/block_*/mlp).
    - Triton custom calls (Pallas kernels): the kernel is the `name` in the call's
      backend_config; calls with the same name but different Triton IR get distinct kernels,
      suffixed __1, __2 ... in schedule order (add_layer_norm_bwd, add_layer_norm_bwd__1).
    - cuBLAS / cuDNN custom calls (`__cublas$...`, `__cudnn$...`): the library names its
      kernels (nvjet_*, cudnn_generated_...): the name says only which library, so it maps to
      all calls of that family; the trace's `hlo_op` argument or the launch order
      (`align_launches`) picks the one call.
    """

    def __init__(self, hlo_text: str) -> None:
        self.scopes = hlo_scopes(hlo_text)
        self.launches: list[str] = []  # the entry computation's kernel-launching ops, in order
        self.family: dict[str, str] = {}  # instruction -> fusion / triton / cublas / cudnn_*
        self.groups: dict[str, list[str]] = {}  # kernel name -> the instructions it runs for
        self.bias: dict[str, bool] = {}  # cuBLAS call -> its epilogue adds a bias
        self._candidates: dict[str, tuple[list[str], str]] = {}
        dedup: dict[str, list[str]] = collections.defaultdict(list)
        triton: dict[tuple[str, str], list[str]] = {}  # (name, IR) -> calls, first-seen order
        comp, entry = None, False
        for line in hlo_text.splitlines():
            if (m := _COMPUTATION.match(line)) and " = " not in line:
                comp, entry = m.group(1), line.startswith("ENTRY")
                continue
            if not (m := _INSTRUCTION.match(line)) or comp is None:
                continue
            name = m.group(2)
            op = _OPCODE.search(line, m.end() - 1)
            opcode = op.group(1) if op else ""
            target = t.group(1) if (t := _TARGET.search(line)) else ""
            if target.startswith("__cublas"):
                family = "cublas"
                self.bias[name] = bool(re.search(r'"epilogue":"\w*BIAS', line))
            elif target.startswith("__cudnn"):
                family = "cudnn_bwd" if "backward" in target.lower() else "cudnn_fwd"
            elif opcode == "custom-call" and "triton" in target:
                family = "triton"
                ir = _TRITON_IR.search(line)
                tname = _TRITON_NAME.search(line, ir.end() if ir else 0)
                if tname:
                    triton.setdefault((tname.group(1), ir.group(1) if ir else ""), []).append(name)
            else:
                family = "xla"
            if entry and opcode not in _NO_LAUNCH:
                self.launches.append(name)
                self.family[name] = family
            if family == "xla" and (opcode == "fusion" or entry):
                if d := _DEDUP.search(line):
                    dedup[d.group(1)].append(name)
                else:
                    self.groups[kernel_name_of(name)] = [name]
        for members in dedup.values():  # every member's name: the kernel is the first's
            for name in members:
                self.groups[kernel_name_of(name)] = members
        seen: collections.Counter[str] = collections.Counter()
        for (tname, _), calls in triton.items():  # dicts keep first-seen (schedule) order
            n = seen[tname]
            seen[tname] += 1
            self.groups[tname if n == 0 else f"{tname}__{n}"] = calls

    def fits(self, kernel: str, instruction: str) -> bool:
        """Can this library kernel run for this call: same family and, for cuBLASLt's nvjet
        kernels (named ..._bias_... when the epilogue adds a bias), the same epilogue."""
        if self.family.get(instruction) != kernel_family(kernel):
            return False
        if kernel.startswith("nvjet") and instruction in self.bias:
            return self.bias[instruction] == ("_bias" in kernel)
        return True

    def candidates(self, kernel: str) -> tuple[list[str], str]:
        """(the instructions `kernel` can be, how that was decided): 'kernel name' (a fusion
        or Triton kernel: these instructions), 'kernel family' (cuBLAS / cuDNN: every call of
        that family that `fits`), or ([], 'unknown')."""
        if kernel in self.groups:
            return self.groups[kernel], "kernel name"
        if kernel not in self._candidates:
            calls = [i for i in self.launches if self.fits(kernel, i)]
            self._candidates[kernel] = (calls, "kernel family") if calls else ([], "unknown")
        return self._candidates[kernel]

    def scope(self, instructions: Sequence[str], one_of: bool = False) -> str:
        """The merged scope of instructions that a kernel runs for (merge_scopes); with
        `one_of`, of candidates of which a launch is one: 'one of N: a, b' when they
        disagree, and for a whole library family, which names no scope, '(one of N cuBLAS GEMM
        calls)'."""
        scopes = [self.scopes.get(i, "(no scope)") for i in instructions]
        label = merge_scopes(scopes)
        if not one_of or len(_distinct_scopes(scopes)) <= 1:
            return label
        fams = {self.family.get(i) for i in instructions}
        fam = fams.pop() if len(fams) == 1 else None
        if fam in _FAMILY_NAMES and len(instructions) == len(
            [i for i in self.launches if self.family[i] == fam]
        ):  # every call of the family: it says no scope
            return f"(one of {len(instructions)} {_FAMILY_NAMES[fam]} calls)"
        return f"one of {len(instructions)}: {label}"


def align_launches(
    kernels: Sequence[str], hk: HloKernels, known: Sequence[str | None] | None = None
) -> list[list[str]]:
    """For one stream's kernel launches in time order (names, several steps back to back):
    the instructions each can be, using the schedule. Launches whose instruction is `known`
    (the trace's hlo_op) and kernels named by the HLO (fusions, Triton) are anchors, the latter
    placed at the first member of their group after the previous anchor (wrapping to the
    start at a new step). The cuBLAS / cuDNN launches between two anchors belong to the calls
    of their family scheduled between them: one call takes all its launches (split-K,
    attention backward), as many launches as calls pair up in order, any other count keeps
    all those calls as candidates. Unknown kernels get []."""
    pos = {name: i for i, name in enumerate(hk.launches)}
    out: list[list[str]] = [[] for _ in kernels]
    anchors: list[tuple[int, int]] = []  # (event index, schedule position)
    p = -1
    for j, k in enumerate(kernels):
        members = [known[j]] if known is not None and known[j] in pos else hk.groups.get(k)
        spots = sorted(pos[i] for i in members or () if i in pos)
        if not spots:
            continue
        q = next((s for s in spots if s > p), spots[0])  # none after p: the next step
        anchors.append((j, q))
        out[j] = [hk.launches[q]]
        p = q
    bounds = [(-1, -1), *anchors, (len(kernels), len(hk.launches))]
    for (j0, a), (j1, b) in zip(bounds, bounds[1:], strict=False):
        between = range(a + 1, b) if a < b else [*range(a + 1, len(hk.launches)), *range(b)]
        by_family: dict[str, list[int]] = collections.defaultdict(list)
        for j in range(j0 + 1, j1):
            if (fam := kernel_family(kernels[j])) is not None:
                by_family[fam].append(j)
        for fam, events in by_family.items():
            calls = [hk.launches[s] for s in between if hk.family[hk.launches[s]] == fam]
            if len(calls) == 1 or not calls:
                for j in events:
                    out[j] = calls
            elif len(calls) == len(events):
                for j, c in zip(events, calls, strict=True):
                    out[j] = [c]
            else:
                for j in events:
                    out[j] = [c for c in calls if hk.fits(kernels[j], c)] or calls
    return out


@dataclass(frozen=True)
class KernelRow:
    name: str
    ms_per_step: float
    calls_per_step: float
    scope: str


@dataclass(frozen=True)
class KernelSummary:
    source: str  # "device" (GPU kernels) or "host" (XLA ops on the CPU backend)
    steps: int
    total_ms_per_step: float
    rows: tuple[KernelRow, ...]  # by time, longest first
    by_scope: tuple[tuple[str, float], ...]  # (scope with block_i -> block_*, ms per step)
    resolved: tuple[tuple[str, int], ...] = ()  # (how scopes were found, launches), most first
    arg_keys: tuple[str, ...] = ()  # the argument names the events carried
    span_ms_per_step: float | None = None  # device: first kernel's start to last one's end
    idle_ms_per_step: float | None = None  # ... of it with no kernel running


def _device_events(
    events: list[dict[str, Any]], streams_only: bool = False
) -> list[dict[str, Any]]:
    """Complete events on the GPU timelines: kernel (and memcpy) events of the 'Stream #N'
    lines when the trace has them (or `streams_only`), else every event of the GPU processes."""
    gpu_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") ==
                "process_name" and "GPU" in str(e.get("args", {}).get("name", ""))}  # fmt: skip
    on_gpu = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu_pids]
    threads = {(e.get("pid"), e.get("tid")): str(e.get("args", {}).get("name", ""))
               for e in events if e.get("name") == "thread_name"}  # fmt: skip
    streams = [e for e in on_gpu if threads.get((e["pid"], e.get("tid")), "").startswith("Stream")]
    return streams if streams or streams_only else on_gpu


def kernel_seconds(events: list[dict[str, Any]]) -> float:
    """Summed duration (s) of the GPU kernels of a trace's events (its 'Stream #N' lines; the
    GPU's other lines summarise the same time), copies left out (a timed chain's pass-through
    state: MemcpyD2D, memcpy32_post ...)."""
    streams = _device_events(events, streams_only=True)
    picked = [e for e in streams if "memcpy" not in e["name"].lower()]
    if not picked:
        raise ValueError("the trace has no GPU kernel events: clock='trace' times GPU kernels")
    return sum(float(e["dur"]) for e in picked) * 1e-6  # trace durations are in us


def traced_kernel_seconds(run: Callable[[], Any]) -> float:
    """`kernel_seconds` of what `run()` launches, recorded with jax.profiler into a temporary
    directory (run's result is waited for inside the trace)."""
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir, create_perfetto_trace=True):
            jax.block_until_ready(run())
        return kernel_seconds(load_trace_events(log_dir))


def _host_op_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """XLA:CPU's per-op events (they carry an `hlo_op` argument)."""
    return [e for e in events if e.get("ph") == "X" and "hlo_op" in e.get("args", {})]


def event_scopes(
    picked: list[dict[str, Any]],
    scopes: dict[str, str],
    hlo: HloKernels | None = None,
    names_are_ops: bool = False,
) -> list[tuple[str, str]]:
    """(scope, how) per event. In order of trust: the event's `hlo_op` argument (the HLO
    instruction XLA annotated the launch with: exact), the event name as an instruction
    (`names_are_ops`: host ops on the CPU; a GPU kernel is named after the first of the
    instructions it runs for, not each), then, with `hlo` (HloKernels), the kernel name and
    the launch order (align_launches, per stream): 'kernel name' (a fusion / Triton kernel),
    'launch order' (a cuBLAS / cuDNN launch placed between its neighbours), 'kernel family'
    (all calls of that library), else '(no scope)'."""
    out: list[tuple[str, str] | None] = [None] * len(picked)
    known: list[str | None] = [None] * len(picked)
    for j, e in enumerate(picked):
        op = e.get("args", {}).get("hlo_op")
        if op is not None and str(op) in scopes:
            out[j], known[j] = (scopes[str(op)], "hlo_op"), str(op)
        elif names_are_ops and e["name"] in scopes:
            out[j] = (scopes[e["name"]], "event name")
    if hlo is not None and None in out:
        streams: dict[tuple[Any, Any], list[int]] = collections.defaultdict(list)
        for j, e in enumerate(picked):
            streams[(e.get("pid"), e.get("tid"))].append(j)
        for idx in streams.values():
            idx.sort(key=lambda j: picked[j].get("ts", 0))
            names = [picked[j]["name"] for j in idx]
            placed = align_launches(names, hlo, [known[j] for j in idx])
            for j, calls in zip(idx, placed, strict=True):
                if out[j] is not None:
                    continue
                named, how = hlo.candidates(picked[j]["name"])
                if how == "kernel name":
                    out[j] = (hlo.scope(calls or named), how)
                elif calls and len(calls) < len(named):
                    out[j] = (hlo.scope(calls, one_of=True), "launch order")
                elif named:
                    out[j] = (hlo.scope(named, one_of=True), how)
    return [o or ("(no scope)", "(no scope)") for o in out]


def top_kernels(
    events: list[dict[str, Any]],
    steps: int,
    scopes: dict[str, str] | None = None,
    top: int = 30,
    hlo: HloKernels | None = None,
) -> KernelSummary | None:
    """The `top` kernels by summed duration per step (ms); None when the trace has neither
    device kernels nor host XLA ops. Scopes per launch from event_scopes (the `hlo_op`
    argument looked up in `scopes` (hlo_scopes), else the kernel name in `hlo`); a kernel's
    row merges the scopes of its launches (merge_scopes)."""
    if scopes is None:
        scopes = hlo.scopes if hlo is not None else {}
    source, picked = "device", _device_events(events)
    if not picked:
        source, picked = "host", _host_op_events(events)
    if not picked:
        return None
    ms: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()
    scopes_of_name: dict[str, set[str]] = collections.defaultdict(set)
    by_scope: collections.Counter[str] = collections.Counter()
    resolved: collections.Counter[str] = collections.Counter()
    arg_keys: set[str] = set()
    resolved_events = event_scopes(picked, scopes, hlo, names_are_ops=source == "host")
    for e, (scope, how) in zip(picked, resolved_events, strict=True):
        name = e["name"][:90]
        arg_keys.update(e.get("args", {}))
        dur = e.get("dur", 0) / 1e3 / steps  # trace durations are in us
        ms[name] += dur
        calls[name] += 1 / steps
        scopes_of_name[name].add(scope)
        by_scope[re.sub(r"block_\d+", "block_*", scope)] += dur
        resolved[how] += 1
    rows = tuple(
        KernelRow(name, t, calls[name], merge_scopes(scopes_of_name[name]))
        for name, t in ms.most_common(top)
    )
    span = idle = None
    if source == "device" and all("ts" in e for e in picked):
        span, busy = _span_and_busy(picked)
        span, idle = span / 1e3 / steps, (span - busy) / 1e3 / steps
    return KernelSummary(
        source, steps, sum(ms.values()), rows, tuple(by_scope.most_common()),
        tuple(resolved.most_common()), tuple(sorted(arg_keys)), span, idle,
    )  # fmt: skip


def _span_and_busy(events: list[dict[str, Any]]) -> tuple[float, float]:
    """(first start to last end, the union of the intervals), in the trace's us."""
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in events)
    busy, end = 0.0, spans[0][0]
    for start, stop in spans:
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return end - spans[0][0], busy


def format_summary(s: KernelSummary | None, backend: str) -> str:
    """Two Markdown tables: the top kernels, then time per scope (blocks merged)."""
    if s is None:
        return f"no device kernel events and no XLA op events in the trace (backend {backend})"
    lines = []
    if s.source == "host":
        lines.append(f"no device kernel events in the trace (backend {backend}): the table lists "
                     "the host XLA ops (XLA:CPU thunks) instead")  # fmt: skip
    what = "device kernels" if s.source == "device" else "host XLA ops"
    line = f"{what}: {s.total_ms_per_step:.2f} ms per step summed over {s.steps} steps"
    if s.span_ms_per_step is not None:  # steps launched back to back: idle = the GPU waited
        line += (f"; the steps span {s.span_ms_per_step:.2f} ms each, {s.idle_ms_per_step:.2f} "
                 "ms of it with no kernel running")  # fmt: skip
    lines.append(line)
    if s.resolved:
        args = f"event args: {', '.join(s.arg_keys)}" if s.arg_keys else "no event args"
        lines.append(f"scopes of the launches: {', '.join(f'{h} {n}' for h, n in s.resolved)} "
                     f"({args})")  # fmt: skip
    total = s.total_ms_per_step or 1.0
    lines += ["", md_header(["ms/step", "%", "calls/step", "kernel", "scope"])]
    for r in s.rows:
        share = f"{100 * r.ms_per_step / total:.1f}"
        lines.append(md_row([f"{r.ms_per_step:.3f}", share, f"{r.calls_per_step:g}", f"`{r.name}`",
                             r.scope]))  # fmt: skip
    lines += ["", md_header(["ms/step", "%", "scope (all blocks)"])]
    lines += [md_row([f"{t:.3f}", f"{100 * t / total:.1f}", scope]) for scope, t in s.by_scope[:25]]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- NVTX


@functools.cache
def _nvtx() -> tuple[Callable[[str], Any] | None, Callable[[], Any] | None, str]:
    """(push, pop, where from) of NVTX ranges: the `nvtx` package (optional), else
    nvtxRangePushA / nvtxRangePop of CUDA's libnvToolsExt through ctypes, else none. They do
    nothing unless a tool (nsys) is attached."""
    try:
        import nvtx  # type: ignore[import-not-found]  # optional

        return nvtx.push_range, nvtx.pop_range, "nvtx package"
    except ImportError:
        pass
    found = ctypes.util.find_library("nvToolsExt")
    paths = [found] if found else []
    for root in sys.path:  # pip's nvidia-nvtx-cu12 wheel
        paths += sorted(glob.glob(os.path.join(root, "nvidia", "nvtx", "lib", "libnvToolsExt.so*")))
    for path in paths + sorted(glob.glob("/usr/local/cuda*/lib64/libnvToolsExt.so*")):
        try:
            lib = ctypes.CDLL(path)
            push, pop = lib.nvtxRangePushA, lib.nvtxRangePop
        except (OSError, AttributeError):
            continue
        push.argtypes, push.restype, pop.restype = [ctypes.c_char_p], ctypes.c_int, ctypes.c_int
        return (lambda name, push=push: push(name.encode())), pop, path
    return None, None, "none"


def nvtx_source() -> str:
    """Where NVTX ranges come from: a library path, 'nvtx package', or 'none'."""
    return _nvtx()[2]


@contextlib.contextmanager
def annotate(name: str) -> Iterator[None]:
    """A named range in both profilers: jax.profiler.TraceAnnotation (TensorBoard / Perfetto)
    and an NVTX range (Nsight Systems), when an NVTX library is found."""
    push, pop, _ = _nvtx()
    with jax.profiler.TraceAnnotation(name):
        if push is not None:
            push(name)
        try:
            yield
        finally:
            if pop is not None:
                pop()


# ----------------------------------------------------------------------------- profile.py trace


@dataclass(frozen=True)
class TraceResult:
    out: Path
    trace_dir: Path | None  # the jax.profiler log dir (None in --nvtx mode)
    hlo_path: Path
    summary: KernelSummary | None
    phase_ms: dict[str, float]  # --nvtx mode: host wall ms per step of each phase (synced)


def trace_train_steps(
    cfg: Config, out: str | Path, warmup: int = 3, steps: int = 3, nvtx: bool = False,
    top: int = 30,
) -> TraceResult:  # fmt: skip
    """Warm up `warmup` train steps, then trace `steps` more; write OUT/step.hlo.txt and (not
    --nvtx) the jax.profiler trace in OUT/trace; return the top kernels per step."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    batch = random_batch(cfg)
    # Jitted: one compile instead of hundreds of eager ops (seconds on a CPU); same values.
    state = jax.jit(functools.partial(make_state, cfg))(batch)
    if nvtx:
        times, hlo_path = phase_steps(state, batch, warmup, steps, out)
        return TraceResult(out, None, hlo_path, None, times)
    key = jax.random.PRNGKey(1)
    step = train_step.lower(state, batch, key).compile()  # compile once, call the executable
    hlo_path = out / "step.hlo.txt"
    write_text_atomic(hlo_path, step.as_text())
    with annotate("warmup"):
        for _ in range(warmup):
            state, _ = step(state, batch, key)
        jax.block_until_ready(state)  # (with no warm-up: the state's creation)
    trace_dir = out / "trace"
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        for i in range(steps):
            with jax.profiler.StepTraceAnnotation("train", step_num=i):
                state, metrics = step(state, batch, key)
        jax.block_until_ready((state, metrics))
    events = load_trace_events(trace_dir)
    summary = top_kernels(events, steps, top=top, hlo=HloKernels(hlo_path.read_text()))
    return TraceResult(out, trace_dir, hlo_path, summary, {})


def phase_steps(
    state: Any, batch: Any, warmup: int, steps: int, out: Path
) -> tuple[dict[str, float], Path]:
    """Train steps split into three jitted programs (forward = the loss, backward = its
    gradient, optimizer = apply_gradients), each in an NVTX range of its name and synced
    before the range closes; `warmup` steps first in a `warmup` range. Writes the programs'
    optimized HLO to OUT/phases.hlo.txt; returns (host ms per step of each phase, the median
    over the steps; that path)."""
    apply_fn = state.apply_fn
    rng = jax.random.PRNGKey(1)

    def loss(params: Any, b: Any) -> jax.Array:
        return loss_and_sums(params, apply_fn, b, rng)[0]

    def forward(params: Any, b: Any) -> jax.Array:
        return loss(params, b)

    def backward(params: Any, b: Any) -> Any:  # the gradient (its forward pass included)
        return jax.grad(loss)(params, b)

    def optimizer(s: Any, grads: Any) -> Any:
        return s.apply_gradients(grads=grads)

    grads = jax.eval_shape(backward, state.params, batch)
    fns = {  # compiled once; XLA names the programs jit_forward, jit_backward, jit_optimizer
        "forward": jax.jit(forward).lower(state.params, batch).compile(),
        "backward": jax.jit(backward).lower(state.params, batch).compile(),
        "optimizer": jax.jit(optimizer, donate_argnums=0).lower(state, grads).compile(),
    }
    hlo_path = out / "phases.hlo.txt"
    write_text_atomic(hlo_path, "\n\n".join(fn.as_text() for fn in fns.values()))

    def one_step(times: dict[str, list[float]] | None) -> None:
        nonlocal state
        grads = None
        for phase in PHASES:
            t0 = time.perf_counter()
            with annotate(phase):
                if phase == "forward":
                    out = fns[phase](state.params, batch)
                elif phase == "backward":
                    out = grads = fns[phase](state.params, batch)
                else:
                    out = state = fns[phase](state, grads)
                jax.block_until_ready(out)
            if times is not None:
                times[phase].append(1e3 * (time.perf_counter() - t0))

    with annotate("warmup"):
        for _ in range(warmup):
            one_step(None)
    times: dict[str, list[float]] = {p: [] for p in PHASES}
    with annotate("steps"):
        for i in range(steps):
            with jax.profiler.StepTraceAnnotation("train", step_num=i):
                one_step(times)
    return {p: sorted(t)[len(t) // 2] for p, t in times.items()}, hlo_path


# ----------------------------------------------------------------------------- profile.py nsys


class NsysError(RuntimeError):
    """nsys is missing, or it did not produce a report."""


def nsys_commands(
    nsys: str, out: str | Path, trace_args: Sequence[str]
) -> tuple[list[str], list[list[str]]]:
    """(the `nsys profile` command, the `nsys stats` commands) for `profile.py trace --nvtx`
    with trace_args; the report is OUT/report.nsys-rep."""
    report = str(Path(out) / "report")
    profile = [
        nsys, "profile", "--trace=cuda,nvtx", "--force-overwrite=true", "-o", report,
        sys.executable, str(PROFILE_CLI), "trace", "--nvtx", "--out", str(out), *trace_args,
    ]  # fmt: skip
    rep = report + ".nsys-rep"
    stats = [[nsys, "stats", "--report", "nvtx_sum", rep]]
    stats += [
        [nsys, "stats", "--report", "cuda_gpu_kern_sum", f"--filter-nvtx={phase}", rep]
        for phase in PHASES
    ]
    return profile, stats


def run_nsys(out: str | Path, trace_args: Sequence[str], nsys: str = "nsys") -> None:
    """Profile `profile.py trace --nvtx` under Nsight Systems, then print its NVTX summary and
    the GPU kernels of each phase. NsysError (one line) when nsys is missing or fails."""
    exe = shutil.which(nsys)
    if exe is None:
        raise NsysError(
            f"Nsight Systems ({nsys}) is not on the PATH. Install it (or pass --nsys-bin PATH), "
            "or use the jax.profiler path instead: python profile.py trace --out DIR, then "
            "tensorboard --logdir DIR/trace"
        )
    Path(out).mkdir(parents=True, exist_ok=True)
    profile, stats = nsys_commands(exe, out, trace_args)
    print("$ " + " ".join(profile), flush=True)
    done = subprocess.run(profile)
    report = Path(out) / "report.nsys-rep"
    if done.returncode != 0 or not report.is_file():
        leftovers = sorted(str(p) for p in Path(out).glob("report*"))
        raise NsysError(
            f"nsys profile exited with {done.returncode} and wrote no {report}"
            + (f" (found: {', '.join(leftovers)})" if leftovers else "")
            + ": a .qdstrm without a report means nsys could not convert its raw data "
            "(QdstrmImporter missing from this nsys install). Use python profile.py trace "
            "--out DIR (jax.profiler) instead"
        )
    for cmd in stats:
        print("$ " + " ".join(cmd), flush=True)
        subprocess.run(cmd)
