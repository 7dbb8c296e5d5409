"""Top GPU kernels of a GPT-2 124M train step: python benchmarks/trace_step.py OUT_DIR [overrides]

Records 3 steps with jax.profiler (a Perfetto trace, also viewable in TensorBoard's profile
plugin), prints the kernels that take the most device time per step, and writes the optimized
HLO of the step to OUT_DIR/step.hlo.txt (kernel names are the HLO fusion names there).
"""

from __future__ import annotations

from jaxllm.xla_flags import apply_default_xla_flags

apply_default_xla_flags()  # before jax is imported: XLA reads its flags then

import collections
import gzip
import json
import sys
from pathlib import Path

import jax

from jaxllm.config import load_config
from jaxllm.profiling.harness import make_state, random_batch
from jaxllm.train.state import train_step

STEPS = 3


def main() -> None:
    out = Path(sys.argv[1])
    cfg = load_config("configs/gpt2_124m.yaml", sys.argv[2:])
    batch = random_batch(cfg)
    state = make_state(cfg, batch)
    key = jax.random.PRNGKey(1)
    out.mkdir(parents=True, exist_ok=True)
    hlo = train_step.lower(state, batch, key).compile().as_text()
    (out / "step.hlo.txt").write_text(hlo)
    for _ in range(3):
        state, m = train_step(state, batch, key)
    jax.block_until_ready(m)
    with jax.profiler.trace(str(out / "trace"), create_perfetto_trace=True):
        for _ in range(STEPS):
            state, m = train_step(state, batch, key)
        jax.block_until_ready(m)
    trace = next((out / "trace").rglob("*.trace.json.gz"))
    with gzip.open(trace) as f:
        events = json.load(f)["traceEvents"]
    gpu_pids = {
        e["pid"]
        for e in events
        if e.get("ph") == "M"
        and e.get("name") == "process_name"
        and "GPU" in str(e.get("args", {}).get("name", ""))
    }
    total = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpu_pids:
            total[e["name"][:90]] += e.get("dur", 0) / 1e3 / STEPS  # ms per step
    print(f"device time per step: {sum(total.values()):.1f} ms (kernels, summed)")
    for name, ms in total.most_common(45):
        print(f"{ms:8.2f} ms  {name}")


if __name__ == "__main__":
    main()
