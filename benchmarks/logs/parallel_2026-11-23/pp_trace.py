"""Trace the PP step (and single_scan) on the GPUs; per-device busy time and top kernels."""
import collections, sys
from jaxllm.xla_flags import apply_default_xla_flags
apply_default_xla_flags()
import jax
from jaxllm import parallel
from jaxllm.config import load_config
from jaxllm.models import build_model
from jaxllm.profiling import trace as T
from jaxllm.profiling.harness import random_batch
from jaxllm.train.optim import make_optimizer
from jaxllm.train.state import create_state, train_step
out = sys.argv[1]
for name, extra, n in [("pp4", ["--parallel.pipeline=2", "--parallel.microbatches=4"], 2), ("single", [], 1)]:
    cfg = load_config("configs/gpt2_124m.yaml", ["--model.kernels=xla", "--model.loss_impl=xla", "--model.attention_impl=xla", "--model.scan_layers=true", "--train.batch_size=32", *extra])
    mesh = parallel.make_mesh(cfg, jax.devices()[:n])
    model = build_model(cfg.model)
    batch = random_batch(cfg, 32)
    tx = make_optimizer(cfg.optim, 1000)
    state = parallel.create_sharded(lambda: create_state(model, tx, jax.random.PRNGKey(0), batch["inputs"]), mesh)
    step = parallel.jit_train_step(train_step, state, mesh, cfg.parallel.microbatches)
    b = parallel.shard_batch(batch, mesh); key = jax.random.PRNGKey(1)
    comp = step.lower(state, b, key).compile()
    hlo = comp.as_text(); open(f"{out}/{name}.hlo.txt", "w").write(hlo)
    for _ in range(3): state, m = comp(state, b, key)
    jax.block_until_ready(m)
    d = f"{out}/trace_{name}"
    with jax.profiler.trace(d):
        for i in range(2): state, m = comp(state, b, key)
        jax.block_until_ready(m)
    ev = T.load_trace_events(d)
    dev = T._device_events(ev)
    busy = collections.Counter(); span = {}
    for e in dev:
        busy[e["pid"]] += e["dur"] / 2e3
        s = span.setdefault(e["pid"], [1e30, 0]); s[0] = min(s[0], e["ts"]); s[1] = max(s[1], e["ts"] + e["dur"])
    for p in busy: print(name, "device pid", p, f"busy {busy[p]:.1f} ms/step, span {(span[p][1]-span[p][0])/2e3:.1f} ms/step")
    by = collections.Counter(); cnt = collections.Counter()
    for e in dev:
        k = e["name"][:60]; by[k] += e["dur"] / 2e3 / len(busy); cnt[k] += 1
    print(name, "top kernels (ms per step per device):")
    for k, t in by.most_common(25): print(f"  {t:8.2f}  {cnt[k]//2:5d}  {k}")
