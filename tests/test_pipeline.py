"""jaxllm.pipeline: the GPipe schedule helper, and the shard_map engine against running the
layers one after another (forward, and gradients w.r.t. the stacked params and the input).

The multi-device checks need 8 fake CPU devices, which XLA creates only if its flag is set
before jax is imported: one subprocess imports this file and runs `_check_pipelines`, which
prints its results as one JSON line for `test_pipelines_on_8_devices` to judge.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT
from jax.sharding import Mesh

from jaxllm.pipeline import bubble_fraction, gpipe_schedule, pipeline_apply

TESTS = Path(__file__).resolve().parent
D = 16  # toy model width


# ----------------------------------------------------------------------------- toy stack


def mlp_layer(p: dict, x: jax.Array) -> jax.Array:
    """One toy layer: a residual MLP, (b, D) -> (b, D)."""
    return x + jnp.tanh(x @ p["w"] + p["b"])


def pair_layer(p: dict, xh: tuple) -> tuple:
    """A layer with a pytree carry, like the decoder's (x, h): the pending residual add first."""
    x, h = xh
    x = x + h
    return x, jnp.tanh(x @ p["w"] + p["b"])


def noisy_layer(p: dict, x: jax.Array, key: jax.Array) -> jax.Array:
    """A keyed layer (like dropout): mlp_layer plus noise drawn from its key."""
    return mlp_layer(p, x) + 0.1 * jax.random.normal(key, x.shape)


def sequential_keyed(layer_fn, params, x, rng, m: int):
    """The keyed reference: the batch cut into its global microbatches (m per shard, shards
    of consecutive rows), layer l of microbatch g given fold_in(fold_in(rng, l), g)."""
    n_layers = jax.tree.leaves(params)[0].shape[0]
    outs = []
    for g, mb in enumerate(jnp.split(x, m)):
        for layer in range(n_layers):
            p = jax.tree.map(lambda a, i=layer: a[i], params)
            mb = layer_fn(p, mb, jax.random.fold_in(jax.random.fold_in(rng, layer), g))
        outs.append(mb)
    return jnp.concatenate(outs)


def sequential(layer_fn, params, x):
    """The reference: all L layers one after another on the whole batch."""
    return jax.lax.scan(lambda h, p: (layer_fn(p, h), None), x, params)[0]


def toy(n_layers: int, batch: int, seed: int = 0) -> tuple[dict, jax.Array]:
    kw, kb, kx = jax.random.split(jax.random.PRNGKey(seed), 3)
    params = {
        "w": jax.random.normal(kw, (n_layers, D, D)) / np.sqrt(D),  # (L, D, D)
        "b": 0.1 * jax.random.normal(kb, (n_layers, D)),  # (L, D)
    }
    return params, jax.random.normal(kx, (batch, D))  # (B, D)


def sum_squares(out) -> jax.Array:
    return sum(jnp.sum(o**2) for o in jax.tree.leaves(out))


def max_rel_err(got, want) -> float:
    """Largest |got - want| over all leaves, relative to each leaf's largest |want|."""
    errs = jax.tree.map(
        lambda g, w: float(np.abs(np.asarray(g) - w).max() / np.abs(np.asarray(w)).max()),
        got,
        want,
    )
    return max(jax.tree.leaves(errs))


def compare(layer_fn, params, x, mesh, m, post=lambda out: out, **kw) -> dict[str, float]:
    """Pipeline vs sequential: forward outputs, and grads of sum(out^2) w.r.t. (params, x),
    out = post(what the side returns)."""

    def out_and_grads(f):  # one compiled program per side
        def loss(p, x):
            out = post(f(p, x))
            return sum_squares(out), out

        (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(params, x)
        return out, grads

    def piped(p, x):
        return pipeline_apply(layer_fn, p, x, mesh=mesh, n_microbatches=m, **kw)

    got = out_and_grads(piped)
    want = out_and_grads(lambda p, x: sequential(layer_fn, p, x))
    return {"out": max_rel_err(got[0], want[0]), "grads": max_rel_err(got[1], want[1])}


# ----------------------------------------------------------------------------- schedule


def test_gpipe_schedule_matches_hand_tables():
    # The course's example (S = 3 partitions, M = 3 microbatches); pairs are (microbatch, stage).
    assert gpipe_schedule(3, 3) == [
        [(0, 0)],
        [(1, 0), (0, 1)],
        [(2, 0), (1, 1), (0, 2)],
        [(2, 1), (1, 2)],
        [(2, 2)],
    ]
    assert gpipe_schedule(3, 4) == [
        [(0, 0)],
        [(1, 0), (0, 1)],
        [(2, 0), (1, 1), (0, 2)],
        [(3, 0), (2, 1), (1, 2)],
        [(3, 1), (2, 2)],
        [(3, 2)],
    ]
    assert gpipe_schedule(4, 2) == [  # fewer microbatches than stages
        [(0, 0)],
        [(1, 0), (0, 1)],
        [(1, 1), (0, 2)],
        [(1, 2), (0, 3)],
        [(1, 3)],
    ]
    assert gpipe_schedule(1, 3) == [[(0, 0)], [(1, 0)], [(2, 0)]]  # no pipeline: no bubble
    assert gpipe_schedule(3, 1) == [[(0, 0)], [(0, 1)], [(0, 2)]]  # one microbatch: sequential


@pytest.mark.parametrize("s, m", [(1, 1), (2, 5), (4, 4), (5, 2), (8, 16)])
def test_gpipe_schedule_invariants_and_bubble(s, m):
    ticks = gpipe_schedule(s, m)
    assert len(ticks) == m + s - 1
    pairs = [(i, j, k) for k, tick in enumerate(ticks) for i, j in tick]
    # Every (microbatch, stage) runs exactly once, at tick microbatch + stage.
    assert sorted((i, j) for i, j, _ in pairs) == [(i, j) for i in range(m) for j in range(s)]
    assert all(k == i + j for i, j, k in pairs)
    # Idle (stage, tick) slots over all slots is the bubble fraction.
    assert bubble_fraction(s, m) == pytest.approx(1 - len(pairs) / (s * len(ticks)))


def test_bubble_fraction_values():
    assert bubble_fraction(1, 7) == 0.0
    assert bubble_fraction(4, 1) == pytest.approx(3 / 4)
    assert bubble_fraction(4, 4) == pytest.approx(3 / 7)
    assert bubble_fraction(4, 29) == pytest.approx(0.09375)
    # Circular: V chunks per stage, V M + S - 1 ticks of 1/V the work each.
    assert bubble_fraction(4, 4, 1) == bubble_fraction(4, 4)
    assert bubble_fraction(4, 4, 2) == pytest.approx(3 / 11)
    assert bubble_fraction(4, 8, 3) == pytest.approx(3 / 27)
    with pytest.raises(ValueError, match=r"virtual_stages must be an integer >= 1, got 0"):
        bubble_fraction(4, 4, 0)


@pytest.mark.parametrize("s, m", [(0, 4), (3, 0), (-1, 2), (2.0, 2), (True, 2)])
def test_schedule_refuses_bad_sizes(s, m):
    with pytest.raises(ValueError, match=r"must be an integer >= 1"):
        gpipe_schedule(s, m)
    with pytest.raises(ValueError, match=r"must be an integer >= 1"):
        bubble_fraction(s, m)


# ----------------------------------------------------------------------------- one device


def one_stage_mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:1]), ("pipeline",))


def test_one_stage_pipeline_is_sequential():
    params, x = toy(n_layers=3, batch=8)
    errs = compare(mlp_layer, params, x, one_stage_mesh(), m=4)
    assert errs["out"] < 1e-6 and errs["grads"] < 1e-5, errs
    # Circular on one stage: 3 chunks of a layer, each microbatch round the (self-)ring 3 times.
    errs = compare(mlp_layer, params, x, one_stage_mesh(), m=2, virtual_stages=3)
    assert errs["out"] < 1e-6 and errs["grads"] < 1e-5, errs
    # The ticks are visible to the profiler: HLO op names carry the scope.
    hlo = (
        jax.jit(
            lambda p, x: pipeline_apply(mlp_layer, p, x, mesh=one_stage_mesh(), n_microbatches=2)
        )
        .lower(params, x)
        .as_text(debug_info=True)
    )
    assert "pipeline_tick" in hlo


def test_weight_gradients_are_summed_over_the_batch_axes_once():
    """The stage's weights are reduced over the batch axes once a step, not once per tick: with
    a psum per tick every tick's weight-gradient partial would stay alive until one combined
    all-reduce (memory and traffic growing with the microbatches)."""
    params, x = toy(n_layers=2, batch=8)
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "pipeline"))

    def all_reduces(m: int) -> int:
        def loss(p, x):
            return sum_squares(pipeline_apply(mlp_layer, p, x, mesh=mesh, n_microbatches=m))

        return jax.jit(jax.grad(loss)).lower(params, x).as_text().count("all_reduce")

    assert all_reduces(2) == all_reduces(8) > 0


def test_pipeline_apply_refusals():
    mesh = one_stage_mesh()
    params, x = toy(n_layers=2, batch=6)
    with pytest.raises(ValueError, match=r"n_microbatches must be an integer >= 1, got 0"):
        pipeline_apply(mlp_layer, params, x, mesh=mesh, n_microbatches=0)
    with pytest.raises(ValueError, match=r"batch size 6 .* divisible by 1 x 4 = 4"):
        pipeline_apply(mlp_layer, params, x, mesh=mesh, n_microbatches=4)
    with pytest.raises(ValueError, match=r"mesh has no axis 'pp'"):
        pipeline_apply(mlp_layer, params, x, mesh=mesh, axis="pp", n_microbatches=2)
    with pytest.raises(ValueError, match=r"share one leading layer axis; got .* \[2, 3\]"):
        pipeline_apply(
            mlp_layer, {**params, "b": params["b"][:1].repeat(3, 0)}, x, mesh=mesh, n_microbatches=2
        )
    with pytest.raises(ValueError, match=r"one leading batch axis; got .* \[5, 6\]"):
        pipeline_apply(pair_layer, params, (x, x[:5]), mesh=mesh, n_microbatches=2)
    with pytest.raises(ValueError, match=r"virtual_stages must be an integer >= 1, got 0"):
        pipeline_apply(mlp_layer, params, x, mesh=mesh, n_microbatches=2, virtual_stages=0)
    with pytest.raises(ValueError, match=r"2 stacked layers .* 1 pipeline stages x 3 virtual"):
        pipeline_apply(mlp_layer, params, x, mesh=mesh, n_microbatches=2, virtual_stages=3)


# ----------------------------------------------------------------------------- 8 devices


def _check_pipelines() -> None:
    """Runs in the 8-device subprocess; prints {case: {out, grads} errors, ...} as JSON."""
    devices = np.array(jax.devices())
    out = {}

    # S = 4 stages of 2 layers, M = 6 microbatches; with and without re-materialisation.
    mesh = Mesh(devices[:4], ("pipeline",))
    params, x = toy(n_layers=8, batch=24)
    out["pp4_m6"] = compare(mlp_layer, params, x, mesh, m=6)
    out["pp4_m6_remat"] = compare(mlp_layer, params, x, mesh, m=6, remat=True)

    # DP x PP: data=2 x pipeline=4, 1 layer per stage, 12 rows = 2 shards x 3 microbatches x 2.
    dp_pp = Mesh(devices.reshape(2, 4), ("data", "pipeline"))
    dp_params, dp_x = toy(n_layers=4, batch=12, seed=1)
    out["dp2_pp4_m3"] = compare(mlp_layer, dp_params, dp_x, dp_pp, m=3)

    # The same with 24 rows, which also split over the 4 stages: rows in and out split over
    # (data, pipeline), gathered to stage 0 and scattered from stage 3 by ppermute.
    split_params, split_x = toy(n_layers=4, batch=24, seed=3)
    out["dp2_pp4_m3_split"] = compare(mlp_layer, split_params, split_x, dp_pp, m=3)

    # Keyed layers (dropout): layer l of global microbatch g (data shard d has g = 3 d .. 3 d + 2)
    # gets fold_in(fold_in(rng, l), g); rows replicated over the stages (12) and split (24).
    rng = jax.random.PRNGKey(7)
    run = jax.jit(
        lambda p, x, k: pipeline_apply(noisy_layer, p, x, mesh=dp_pp, n_microbatches=3, rng=k)
    )
    for name, (p, x) in {
        "keyed": (dp_params, dp_x),
        "keyed_split": (split_params, split_x),
    }.items():
        got = run(p, x, rng)
        out[name] = {
            "err": max_rel_err(got, sequential_keyed(noisy_layer, p, x, rng, m=6)),
            "again": bool(jnp.array_equal(got, run(p, x, rng))),
            "noise": float(jnp.abs(got - sequential(mlp_layer, p, x)).min()),  # all rows
            "other_rng": float(jnp.abs(got - run(p, x, jax.random.PRNGKey(8))).max()),
        }

    # Split rows: no collective sums over the stages in the backward (each stage's input
    # cotangent goes back by ppermute); replicated rows: the input's cotangent is summed.
    def sums_over_stages(x) -> bool:
        def loss(p, x):
            return sum_squares(pipeline_apply(mlp_layer, p, x, mesh=dp_pp, n_microbatches=3))

        text = str(jax.make_jaxpr(jax.grad(loss, (0, 1)))(split_params, x))
        return any("pipeline" in axes for axes in re.findall(r"psum\w*\[axes=\(([^)]*)\)", text))

    out["psum_over_stages"] = {
        "split": sums_over_stages(split_x),
        "replicated": sums_over_stages(split_x[:12]),
    }

    # S = 8 > M = 2, and a pytree carry (x, h) like the decoder blocks'; 4 rows (replicated
    # over the stages) and 16 (split over them).
    params, x = toy(n_layers=8, batch=4, seed=2)
    xh = (x, jnp.zeros_like(x))
    out["pp8_m2_pair"] = compare(pair_layer, params, xh, Mesh(devices, ("pipeline",)), m=2)
    params, x = toy(n_layers=8, batch=16, seed=4)
    xh = (x, 0.5 * x)
    out["pp8_m2_pair_split"] = compare(pair_layer, params, xh, Mesh(devices, ("pipeline",)), m=2)
    # ... and sending x + h only (pair_layer adds h first thing), as the decoder's carry does:
    # the pipeline then returns (x + h, 0) for the sequential (x, h).
    wire = (lambda c: c[0] + c[1], lambda y: (y, jnp.zeros_like(y)))
    out["pp8_m2_pair_wire"] = compare(
        pair_layer, params, xh, Mesh(devices, ("pipeline",)), m=2, post=wire[0], wire=wire
    )
    sends = str(jax.make_jaxpr(lambda p, x: pipeline_apply(
        pair_layer, p, x, mesh=Mesh(devices, ("pipeline",)), n_microbatches=2, wire=wire
    ))(params, xh)).count("ppermute")  # fmt: skip
    out["wire_sends"] = sends  # one array each (the pair would be two)

    # The backward: jax.grad's transposed tick loop sends cotangents stage s + 1 -> s.
    jaxpr = jax.make_jaxpr(
        jax.grad(
            lambda p, x: sum_squares(pipeline_apply(mlp_layer, p, x, mesh=dp_pp, n_microbatches=3))
        )
    )(dp_params, dp_x)
    text = str(jaxpr)
    out["forward_shift"] = "perm=((0, 1), (1, 2), (2, 3))" in text
    out["backward_shift"] = "perm=((1, 0), (2, 1), (3, 2))" in text

    def error(n_layers: int, batch: int) -> str:
        p, x = toy(n_layers, batch)
        try:
            pipeline_apply(mlp_layer, p, x, mesh=dp_pp, n_microbatches=3)
        except ValueError as e:
            return str(e)
        return "no error"

    out["errors"] = {"layers": error(n_layers=6, batch=12), "batch": error(n_layers=4, batch=10)}
    print(json.dumps(out))


def _on_8_devices(check: str) -> dict:
    """Run `check` (a function of this file) in a subprocess with 8 fake CPU devices; its
    printed JSON line."""
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_cpu_multi_thread_eigen=false",
        "JAX_PLATFORMS": "cpu",
    }
    code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import test_pipeline as t; t.{check}()"
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # an 8-device subprocess
def test_pipelines_on_8_devices():
    got = _on_8_devices("_check_pipelines")
    cases = ("pp4_m6", "pp4_m6_remat", "dp2_pp4_m3", "dp2_pp4_m3_split", "pp8_m2_pair")
    for case in (*cases, "pp8_m2_pair_split", "pp8_m2_pair_wire"):
        assert got[case]["out"] < 1e-6, (case, got[case])
        assert got[case]["grads"] < 1e-5, (case, got[case])
    for r in (got["keyed"], got["keyed_split"]):
        assert r["err"] < 1e-6 and r["again"], r  # the documented keys, deterministic
        assert r["noise"] > 0 and r["other_rng"] > 1e-3, r
    assert got["psum_over_stages"] == {"split": False, "replicated": True}
    assert got["wire_sends"] == 7 + 8 + 7  # gathers, ticks but the last (M + S - 2), scatters
    assert got["forward_shift"] and got["backward_shift"]
    assert "6 stacked layers must split evenly into 4 pipeline stages" in got["errors"]["layers"]
    assert (
        "batch size 10 must split over the batch axes ('data',) (2 ways)" in got["errors"]["batch"]
    )
    assert "divisible by 2 x 3 = 6" in got["errors"]["batch"]


def _check_circular() -> None:
    """Runs in the 8-device subprocess: the circular schedule (V chunks per stage) against the
    layers one after another; prints {case: errors, ...} as JSON."""
    devices = np.array(jax.devices())
    out = {}
    # (S, V, M, L, B): M = S; M > S, where stage 0 takes a microbatch back from the last stage
    # ticks after it arrived (S = 2, M = 4: 3 ticks later); chunks of 2 layers.
    for s, v, m, n_layers, batch in [(2, 2, 2, 4, 8), (4, 2, 4, 8, 16), (2, 3, 4, 6, 8),
                                     (4, 2, 5, 16, 20)]:  # fmt: skip
        params, x = toy(n_layers, batch, seed=s + v + m)
        mesh = Mesh(devices[:s], ("pipeline",))
        out[f"pp{s}_v{v}_m{m}"] = compare(mlp_layer, params, x, mesh, m, virtual_stages=v)

    # data 2 x pipeline 4, V = 2, M = 6, rows split over the stages (24 = 2 x 4 x 3) or
    # replicated (12 = 2 x 6 x 1), with a pytree carry sent as one array (`wire`) and remat.
    dp_pp = Mesh(devices.reshape(2, 4), ("data", "pipeline"))
    wire = (lambda c: c[0] + c[1], lambda y: (y, jnp.zeros_like(y)))
    for batch in (24, 12):
        params, x = toy(n_layers=8, batch=batch, seed=batch)
        xh = (x, 0.5 * x)
        kw = {"post": wire[0], "wire": wire, "remat": True, "virtual_stages": 2}
        out[f"dp2_pp4_v2_m6_{batch}"] = compare(pair_layer, params, xh, dp_pp, m=6, **kw)

    # Keyed layers: layer l (global, 0 .. L - 1) of global microbatch g gets
    # fold_in(fold_in(rng, l), g), whichever stage and repeat runs it.
    rng = jax.random.PRNGKey(7)
    params, x = toy(n_layers=8, batch=32, seed=5)
    run = jax.jit(
        lambda p, x, k: pipeline_apply(
            noisy_layer, p, x, mesh=dp_pp, n_microbatches=4, virtual_stages=2, rng=k
        )
    )
    got = run(params, x, rng)
    out["keyed"] = {
        "err": max_rel_err(got, sequential_keyed(noisy_layer, params, x, rng, m=8)),
        "noise": float(jnp.abs(got - sequential(mlp_layer, params, x)).min()),
    }

    # The ring: the last stage sends to stage 0 forward, stage 0 to the last backward.
    text = str(jax.make_jaxpr(jax.grad(lambda p, x: sum_squares(pipeline_apply(
        mlp_layer, p, x, mesh=dp_pp, n_microbatches=4, virtual_stages=2
    ))))(params, x))  # fmt: skip
    out["forward_ring"] = "perm=((0, 1), (1, 2), (2, 3), (3, 0))" in text
    out["backward_ring"] = "perm=((1, 0), (2, 1), (3, 2), (0, 3))" in text
    try:
        pipeline_apply(mlp_layer, params, x, mesh=dp_pp, n_microbatches=2, virtual_stages=2)
        out["few_microbatches"] = "no error"
    except ValueError as e:
        out["few_microbatches"] = str(e)
    print(json.dumps(out))


@pytest.mark.slow  # an 8-device subprocess
def test_circular_pipelines_on_8_devices():
    got = _on_8_devices("_check_circular")
    cases = [k for k in got if k.startswith(("pp", "dp"))]
    assert len(cases) == 6, cases
    for case in cases:
        assert got[case]["out"] < 1e-6, (case, got[case])
        assert got[case]["grads"] < 1e-5, (case, got[case])
    assert got["keyed"]["err"] < 1e-6 and got["keyed"]["noise"] > 0, got["keyed"]
    assert got["forward_ring"] and got["backward_ring"]
    assert (
        "virtual_stages=2 needs n_microbatches >= the 4 stages, got 2" in (got["few_microbatches"])
    )
