"""PP step time with the pipeline's scans unrolled (monkeypatched experiment)."""
import functools, sys, time, types
from jaxllm.xla_flags import apply_default_xla_flags
apply_default_xla_flags()
import jax
import jaxllm.pipeline as PL
from jaxllm import parallel
from jaxllm.config import load_config
from jaxllm.models import build_model
from jaxllm.profiling.harness import random_batch, time_calls
from jaxllm.train.optim import make_optimizer
from jaxllm.train.state import create_state, train_step

def patch(mode):
    real_scan = jax.lax.scan
    def scan(*a, **k):
        ticks = "length" in k
        if mode == "all" or (mode == "ticks" and ticks) or (mode == "layers" and not ticks):
            k["unroll"] = True
        return real_scan(*a, **k)
    lax = types.SimpleNamespace(**{n: getattr(jax.lax, n) for n in dir(jax.lax) if not n.startswith("__")})
    lax.scan = scan
    j = types.SimpleNamespace(**{n: getattr(jax, n) for n in dir(jax) if not n.startswith("__")})
    j.lax = lax
    PL.jax = j if mode else jax

for mode, m in [(None, 4), ("layers", 4), ("ticks", 4), ("all", 4), ("all", 8)]:
    patch(mode)
    cfg = load_config("configs/gpt2_124m.yaml", ["--model.kernels=pallas", "--model.loss_impl=pallas", "--model.attention_impl=xla", "--model.scan_layers=true", "--train.batch_size=32", "--parallel.pipeline=2", f"--parallel.microbatches={m}"])
    mesh = parallel.make_mesh(cfg)
    model = build_model(cfg.model)
    batch = random_batch(cfg, 32)
    tx = make_optimizer(cfg.optim, 1000)
    state = parallel.create_sharded(lambda: create_state(model, tx, jax.random.PRNGKey(0), batch["inputs"]), mesh)
    step = parallel.jit_train_step(train_step, state, mesh, m)
    b = parallel.shard_batch(batch, mesh); key = jax.random.PRNGKey(1)
    t0 = time.time()
    h = {"s": state}
    def go():
        h["s"], met = step(h["s"], b, key)
        return met
    t = time_calls(go, steps=5, repeats=3)
    print(f"pp M={m} unroll={mode}: {1e3*t.median_s:.1f} ms (spread {1e3*t.spread_s:.1f}), loss {float(go()['loss']):.4f}, total {time.time()-t0:.0f}s", flush=True)
    del state, h; jax.clear_caches()
