"""`profile.py bench` and `profile.py breakdown` on the CPU with the tiny size.

The CLI runs in-process (`profile.main([...])`), as a user would call it; the OOM path is
simulated by making the step builder raise XLA's RESOURCE_EXHAUSTED error. Isolation (a child
process per size, a new one after an OOM) is tested with fake children (a few lines of Python
that speak the protocol) and with real ones whose step is made to run out of memory.
"""

import functools
import gc
import importlib.util
import itertools
import json
import math
import os
import re
import sys
import weakref
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.profiling import bench, breakdown
from jaxllm.profiling.flops import train_flops_per_token
from jaxllm.profiling.harness import size_config
from jaxllm.profiling.isolate import TAG

TINY_RUN = ["--warmup", "1", "--samples", "2", "--no-progress"]
SMALL = ("--model.vocab_size=64", "--train.batch_size=2")
TINY_SWEEP = ["--sizes", "tiny", *SMALL, "--dtypes", "float32"]
JSON_KEYS = {"name", "flops", "bytes", "seconds", "status", "mean_ms", "std_ms", "tokens_per_s",
             "tflops_per_s", "size", "context", "dtype", "mode", "n_params"}  # fmt: skip


@functools.cache
def _profile_cli():
    """Our profile.py, loaded from its file: `import profile` gives the standard library's."""
    path = Path(__file__).resolve().parents[1] / "profile.py"
    spec = importlib.util.spec_from_file_location("jaxllm_profile_cli", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cli(argv: list[str]) -> int:
    return _profile_cli().main(argv)


def table_rows(text: str) -> list[list[str]]:
    """The body rows of the Markdown tables in `text`, as lists of cells."""
    rows = []
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith(("| size", "| component")):
            rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def test_bench_tiny_table_json_lines_and_an_oom_cell(tmp_path, capsys, monkeypatch):
    """The table and JSON lines of a tiny sweep. Calls made to fail with XLA's
    RESOURCE_EXHAUSTED (one at compile time, a train step at run time, which deletes the state
    it was given) give OOM cells, and the sweep goes on."""
    real = bench.build_step

    def oom():
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1 GiB")

    def build_step(mode, holder, batch, apply):
        if batch["inputs"].shape[1] != 16:
            return real(mode, holder, batch, apply)
        if mode == "forward_backward":  # fails to compile
            oom()

        def train_step_that_runs_out():  # fails at run time, its donated state deleted
            for x in jax.tree_util.tree_leaves(holder["state"]):
                x.delete()
            oom()

        if mode == "train_step":
            return train_step_that_runs_out
        return real(mode, holder, batch, apply)

    monkeypatch.setattr(bench, "build_step", build_step)
    out = tmp_path / "bench.jsonl"
    argv = ["bench", *TINY_SWEEP, "--contexts", "16,32", *TINY_RUN, "--jsonl", str(out)]
    assert cli(argv) == 0
    text = capsys.readouterr().out
    assert "| size | context | dtype | mode | mean ms | std ms | tokens/s | TFLOP/s |" in text
    assert "float32: ops: norm=xla attention=xla decode=xla loss=xla" in text  # the paths taken
    rows = table_rows(text)
    modes = ["forward", "forward_backward", "train_step"]
    assert [(r[1], r[3]) for r in rows] == [(t, m) for t in ("16", "32") for m in modes]
    for r in rows:
        assert r[0] == "tiny" and r[2] == "f32"
        if (r[1], r[3]) in (("16", "forward_backward"), ("16", "train_step")):
            assert r[4:] == ["OOM", "-", "-", "-"]
        else:  # the same config's other modes ran, and so did the next config
            assert float(r[4]) > 0 and float(r[5]) >= 0 and float(r[6].replace(",", "")) > 0
    assert text.count(bench.OOM_HINT) == 1  # what to try, once, after the table

    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 6
    assert all(r["ops"].startswith("ops: norm=xla attention=xla") for r in lines)
    ooms = [r for r in lines if r["status"] == "OOM"]
    assert [r["name"] for r in ooms] == [f"bench tiny T16 f32 {m}" for m in modes[1:]]
    assert all(r["seconds"] is None and r["flops"] > 0 and r["bytes"] > 0 for r in ooms)
    ok = [r for r in lines if r["status"] != "OOM"]
    for row in ok:
        assert row.keys() >= JSON_KEYS
        assert row["status"] == "ok"
        for key in ("flops", "bytes", "seconds", "mean_ms", "tokens_per_s", "tflops_per_s"):
            assert isinstance(row[key], float) and math.isfinite(row[key]) and row[key] > 0, key
        assert row["std_ms"] >= 0
        assert math.isclose(row["seconds"] * 1e3, row["mean_ms"])
    t32 = lines[3:]
    assert [r["name"] for r in t32] == [f"bench tiny T32 f32 {m}" for m in modes]
    # backward = 2 x forward: forward_backward and train_step count 3x the forward's FLOPs
    assert t32[1]["flops"] == t32[2]["flops"] == 3 * t32[0]["flops"]
    assert t32[0]["bytes"] < t32[1]["bytes"] < t32[2]["bytes"]


# A child process as bench's behaves, without jax: each cell "ok", but DIES (the
# process aborts with XLA's out-of-memory message), CROWDED (out of memory unless alone in its
# process: compiled beside the others) and BOOM (an unrelated crash). argv: log, cells, spec.
FAKE_CHILD = """
import json, sys
log, special = sys.argv[1], json.loads(sys.argv[2])
cells = json.loads(sys.argv[sys.argv.index("--child") + 1])["cells"]
with open(log, "a") as f:
    f.write(json.dumps(cells) + "\\n")
for cell in cells:
    kind = next((k for k, c in special.items() if c == cell), None)
    if kind == "DIES":
        sys.exit("E external/xla: RESOURCE_EXHAUSTED: Out of memory allocating 9 GiB")
    if kind == "BOOM":
        sys.exit("Segmentation fault in the fake child")
    oom = kind == "CROWDED" and len(cells) > 1
    result = {"status": "OOM" if oom else "ok", "mean_s": None if oom else 1e-3, "std_s": 0.0}
    print(TAG + json.dumps({"cell": cell, "result": result}), flush=True)
    if oom:
        break  # as bench._child: stop at the first OOM
""".replace("TAG", repr(TAG))


def _fake_children(monkeypatch, tmp_path, **special):
    log = tmp_path / "children.log"
    cmd = [sys.executable, "-c", FAKE_CHILD, str(log), json.dumps(special)]
    monkeypatch.setattr(bench, "_child_command", lambda spec: [*cmd, "--child", json.dumps(spec)])
    return log


def test_isolated_sweep_confirms_an_oom_alone_and_measures_the_cells_after_it(
    monkeypatch, tmp_path
):
    """A child stops at its first OOM; that cell runs again alone, and only an OOM there is
    reported (a child that died with XLA's message counts); the rest go to a new child."""
    sweep = bench.Sweep(sizes=("tiny",), contexts=(16, 32), overrides=SMALL)
    cells = [[t, "float32", m] for t in (16, 32) for m in bench.DEFAULT_MODES]
    f16, fb16, ts16, f32, fb32, ts32 = cells
    log = _fake_children(monkeypatch, tmp_path, CROWDED=fb16, DIES=f32)
    rows = [r for config in bench.bench_size(sweep, "tiny", dict(os.environ)) for r in config]
    assert [(r["context"], r["mode"], r["status"]) for r in rows] == [
        (t, m, "OOM" if [t, "float32", m] == f32 else "ok") for t, _, m in cells
    ]
    assert all(r["seconds"] == 1e-3 for r in rows if r["status"] == "ok")
    runs = [json.loads(line) for line in log.read_text().splitlines()]
    assert runs == [cells, [fb16], [ts16, f32, fb32, ts32], [f32], [fb32, ts32]]

    _fake_children(monkeypatch, tmp_path, BOOM=fb32)  # not an OOM: the sweep stops, saying why
    with pytest.raises(bench.BenchChildError, match=r"\(32, 'float32', 'forward_backward'\).*"
                       r"exit 1.*Segmentation fault"):  # fmt: skip
        list(bench.bench_size(sweep, "tiny", dict(os.environ)))


# A real child (python -m jaxllm.profiling.bench --child), but its T16 step runs out of memory
# when called, and from then on every step of its process does: memory that leaked.
LEAKY_CHILD = """
import sys
import jax
from jaxllm.profiling import bench
from jaxllm.profiling.isolate import child_main

log, real, leaked = sys.argv[1], bench.build_step, []

def build_step(mode, holder, batch, apply):
    step = real(mode, holder, batch, apply)
    t = batch["inputs"].shape[1]

    def call():
        if t == 16 or leaked:
            leaked.append(t)
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 1 GiB")
        return step()

    return call

bench.build_step = build_step
with open(log, "a") as f:
    f.write(sys.argv[sys.argv.index("--child") + 1] + "\\n")
sys.exit(child_main(bench._child, sys.argv[sys.argv.index("--child") :]))
"""


def test_bench_isolate_always_measures_what_follows_an_oom(tmp_path, capsys, monkeypatch):
    log = tmp_path / "children.log"
    cmd = [sys.executable, "-c", LEAKY_CHILD, str(log)]
    monkeypatch.setattr(bench, "_child_command", lambda spec: [*cmd, "--child", json.dumps(spec)])
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # re-runs load
    out = tmp_path / "bench.jsonl"
    argv = ["bench", *TINY_SWEEP, "--contexts", "16,32", "--modes", "forward", *TINY_RUN,
            "--isolate", "always", "--jsonl", str(out)]  # fmt: skip
    assert cli(argv) == 0
    text = capsys.readouterr().out
    assert "isolation: a process per size" in text
    rows = table_rows(text)
    assert [r[1] for r in rows] == ["16", "32"]
    assert rows[0][4:] == ["OOM", "-", "-", "-"]
    assert float(rows[1][4]) > 0  # measured in a new process: the leak did not follow it
    children = [json.loads(line)["cells"] for line in log.read_text().splitlines()]
    f16, f32 = [16, "float32", "forward"], [32, "float32", "forward"]
    assert children == [[f16, f32], [f16], [f32]]  # the OOM confirmed alone
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["status"] for r in lines] == ["OOM", "ok"]
    assert {r["isolation"] for r in lines} == {"process per size"}


def test_forward_holds_only_the_parameters_and_train_step_the_full_state(monkeypatch):
    """While forward is timed no AdamW moment exists; train_step gets them, and they are gone
    again (its parameters kept) by the next config's forward. The steps are stand-ins (no
    model compiled): what is resident is bench's own."""
    seen, moments = [], []

    def build_step(mode, holder, batch, apply):
        def call():
            live = {k for k in ("params", "state") if k in holder}
            params = holder["state"].params if "state" in holder else holder["params"]
            seen.append((batch["inputs"].shape[1], mode, live, len(jax.tree.leaves(params))))
            if mode == "train_step":
                opt_state = jax.tree.leaves(holder["state"].opt_state)
                assert len(opt_state) > 2 * len(jax.tree.leaves(params))  # mu, nu, count
                moments.extend(weakref.ref(x) for x in opt_state)
            else:
                gc.collect()
                assert not [r for r in moments if r() is not None], "AdamW state still alive"
            return jnp.zeros(())

        return call

    monkeypatch.setattr(bench, "build_step", build_step)
    sweep = bench.Sweep(sizes=("tiny",), contexts=(16, 32), overrides=SMALL, warmup=0,
                        samples=1, modes=("forward", "train_step"), isolate="never")  # fmt: skip
    cells = bench.plan(sweep)[:3]  # T16 forward, T16 train_step, T32 forward
    results = dict(bench.measure_cells(sweep, "tiny", cells))
    assert list(results) == cells and all(m["status"] == "ok" for m in results.values())
    assert [(t, m, live) for t, m, live, _ in seen] == [
        (t, m, {"state" if m == "train_step" else "params"}) for t, _, m in cells
    ]
    assert len({n for *_, n in seen}) == 1 and moments  # the same parameters throughout


def test_measure_reports_oom_and_raises_anything_else():
    def oom():
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")

    assert bench.measure(lambda: oom, warmup=1, samples=2) == bench.OOM
    with pytest.raises(ValueError, match="boom"):
        bench.measure(lambda: (_ for _ in ()).throw(ValueError("boom")), warmup=1, samples=2)


def test_table_marks_where_ours_is_slower_than_torch_compile():
    ours = {"status": "ok", "mean_s": 2e-3, "std_s": 1e-4}
    torch = {"eager": {"forward": {"status": "ok", "mean_s": 3e-3, "std_s": 1e-4}},
             "compile": {"forward": {"status": "ok", "mean_s": 1e-3, "std_s": 1e-4}}}  # fmt: skip
    (row,) = bench._records(bench.Sweep(torch=True), "small", 1024, "bfloat16", 1,
                            {"forward": ours}, torch)  # fmt: skip
    assert "| 3.00 ± 0.10 | 1.00 ± 0.10 | 2.00 **slower** |" in bench.format_row(row, torch=True)
    for compile_s, ratio in ((4e-3, "0.50"), (1.995e-3, "1.00")):  # 1.0025: a tie, as shown
        other = row | {"torch_compile_seconds": compile_s}
        assert bench.format_row(other, torch=True).endswith(f"| {ratio} |")
    assert row["torch_compile_seconds"] == 1e-3 and row["torch_eager_status"] == "ok"


def test_forward_flops_match_the_training_flops_per_token():
    """3 x forward_flops per token = PaLM's 6 N + 12 L d T, up to biases and norm scales; with
    the tied head (gpt2) and the untied one (transformer_lm: its token table is a lookup)."""
    for size, arch in itertools.product(("tiny", "small"), ("gpt2", "transformer_lm")):
        cfg = size_config(size, [f"--model.arch={arch}"]).model
        t = cfg.context_length
        n = bench.param_count(cfg)
        ours = 3 * bench.forward_flops(cfg, 1, t) / t
        assert ours == pytest.approx(train_flops_per_token(cfg, n), rel=0.01)


@pytest.mark.parametrize(
    "argv, allowed",
    [
        (["bench", "--sizes", "small,huge"], "allowed: tiny, small, medium, large, xl, 2.7B"),
        (["bench", "--modes", "backward"], "allowed: logits, forward, forward_backward, train"),
        (["bench", "--dtypes", "float16"], "allowed: float32, bfloat16"),
        (["bench", "--model.arch=llama"], "model.arch"),
        (["bench", "--isolate", "sometimes"], "invalid choice: 'sometimes'"),
        (["bench", "--sizes", "tiny", "--contexts", "64,256"], "exceeds size tiny's context 128"),
        (["bench", "--contexts", "0"], "integers >= 1"),
        (["bench", "--group", "0"], "an integer >= 1"),
        (
            [
                "bench",
                "--sizes",
                "tiny",
                "--contexts",
                "16",
                "--execution.compute_dtype=bfloat16",
                "--execution.loss_impl=pallas",
                "--execution.kernel_backend=mosaic_gpu",
            ],
            "kernel_backend=mosaic_gpu needs, for the loss kernels, a GPU",
        ),  # fmt: skip
        (["breakdown", "--size", "huge"], "invalid choice: 'huge'"),
        (["breakdown", "--execution.compute_dtype=float16"], "execution.compute_dtype"),
        (["breakdown", "--size", "tiny", "--context", "512"], "exceeds size tiny's context 128"),
    ],
)
def test_bad_flags_exit_with_one_line_naming_what_is_allowed(argv, allowed, capsys):
    with pytest.raises(SystemExit) as e:
        cli(argv)
    err = capsys.readouterr().err.strip().splitlines()[-1]  # argparse's, or ours: "error: ..."
    assert e.value.code == 2 and allowed in err, err


def test_rows_wait_for_the_torch_cell(monkeypatch):
    """With --torch a config's rows carry PyTorch's times: the row is made only after the
    config's torch cell (timed last), not as soon as our own modes are measured."""
    sweep = bench.Sweep(sizes=("tiny",), contexts=(16,), overrides=SMALL, torch=True,
                        modes=("forward", "train_step"))  # fmt: skip

    def ok(seconds):
        return {"status": "ok", "mean_s": seconds, "std_s": 0.0}

    torch_ms = {"eager": {m: ok(3e-3) for m in sweep.modes},
                "compile": {m: ok(2e-3) for m in sweep.modes}}  # fmt: skip

    def fake_cells(sweep, size, cells, stop_after_oom=False):
        for cell in cells:
            yield cell, torch_ms if cell[2] == bench.TORCH else ok(1e-3)

    monkeypatch.setattr(bench, "measure_cells", fake_cells)
    rows = [r for config in bench.bench_size(sweep, "tiny") for r in config]
    assert [r["mode"] for r in rows] == ["forward", "train_step"]
    assert all(r["torch_compile_seconds"] == 2e-3 and r["torch_eager_seconds"] == 3e-3
               for r in rows)  # fmt: skip


def test_torch_side_needs_torch_with_cuda():
    try:
        import torch

        if torch.cuda.is_available():
            pytest.skip("torch with CUDA is here: --torch would run")
    except ImportError:
        pass
    with pytest.raises(SystemExit, match="needs (torch|a CUDA GPU)"):
        cli(["bench", *TINY_SWEEP, "--contexts", "16", "--torch", *TINY_RUN])


def test_breakdown_tiny_flop_shares_add_up_to_100(tmp_path, capsys):
    out = tmp_path / "breakdown.jsonl"
    argv = ["breakdown", "--size", "tiny", "--context", "32", "--train.batch_size=2"]
    assert cli([*argv, "--warmup", "1", "--group", "2", "--samples", "2", "--jsonl", str(out)]) == 0
    text = capsys.readouterr().out
    columns = "| time ms | time share % | FLOP share % | TFLOP/s |"
    for direction in ("forward", "forward+backward"):
        assert f"| component ({direction}) {columns}" in text
    rows = table_rows(text)
    pieces = [r for r in rows if re.match(r"(attention|mlp|norm/other): ", r[0])]
    assert len(pieces) == 2 * 6  # qkv, scores+mask+softmax, av, out, mlp, norms; 2 directions
    assert sum(float(r[3]) for r in pieces) == pytest.approx(200, abs=0.5)  # 100% per table
    assert sum(float(r[2]) for r in pieces) == pytest.approx(200, abs=0.5)
    assert all(float(r[1]) > 0 for r in rows)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    fwd = [r for r in lines if r["direction"] == "forward"]
    layer = next(r for r in fwd if r["piece"] == "layer")
    # against the matmuls counted by hand (q/k/v + out: 4 d^2, MLP: 2 d f per token; QK^T and
    # PV: 2 T d each): the elementwise ops add a few percent on top, a missing piece far more
    m = size_config("tiny").model
    b, t, d, f = 2, 32, m.d_model, m.ffn_dim
    matmuls = 2 * b * t * (4 * d * d + 2 * d * f) + 4 * b * t * t * d
    assert matmuls < layer["flops"] < 1.1 * matmuls
    assert all(r["flops"] > 0 and r["bytes"] > 0 and r["seconds"] > 0 for r in lines)


def test_breakdown_pieces_chained_give_the_block(arch):
    """The pieces are the layer's own computation: chained, they reproduce the Block."""
    c = size_config("tiny", [f"--model.arch={arch}"])
    pieces, layer = breakdown.build_pieces(c.model, c.execution, batch=2, length=16)
    by = {p.name: p for p in pieces}
    assert list(by)[-2:] == ["out_proj", "mlp"] and ("rope" in by) == (arch == "transformer_lm")
    norms = by["norms+residuals"]

    @jax.jit
    def chained(p1, p2, x, h, p_qkv, p_out, p_mlp):
        _, y1, _ = norms.fn(p1, p2, x, h, h)
        q, k, v = by["qkv_proj"].fn(p_qkv, y1)
        if "rope" in by:
            q, k = by["rope"].fn(q, k)
        o = by["av"].fn(by["scores+mask+softmax"].fn(q, k), v)
        x2, _, y2 = norms.fn(p1, p2, x, h, by["out_proj"].fn(p_out, o))
        return x2, by["mlp"].fn(p_mlp, y2)

    p1, p2, x, h, _ = norms.args
    got = chained(p1, p2, x, h, by["qkv_proj"].args[0], by["out_proj"].args[0], by["mlp"].args[0])
    want = jax.jit(layer.fn)(*layer.args)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_torch_reference_computes_the_same_function(arch):
    """Same architecture in PyTorch: our parameters copied in give our logits and loss."""
    torch = pytest.importorskip("torch")
    from jaxllm.profiling import torch_reference
    from jaxllm.profiling.harness import make_state, random_batch
    from jaxllm.train.state import loss_and_sums

    cfg = size_config("tiny", [f"--model.arch={arch}", *SMALL])
    batch = random_batch(cfg, 2)
    state = make_state(cfg, batch)
    with jax.default_matmul_precision("float32"):  # a GPU would otherwise use TF32 (CPU torch)
        logits = state.apply_fn({"params": state.params}, batch["inputs"])
        loss = loss_and_sums(state.params, state.apply_fn, batch, None)[0]
    model = torch_reference.build(cfg.model, cfg.execution)
    torch_reference.load_flax_params(model, state.params)
    x, y = (torch.tensor(np.asarray(batch[k]), dtype=torch.long) for k in ("inputs", "targets"))
    with torch.no_grad():
        np.testing.assert_allclose(model(x).numpy(), np.asarray(logits), atol=2e-5, rtol=1e-4)
        assert model(x, y).item() == pytest.approx(float(loss), rel=1e-5)
    times = torch_reference.time_modes(
        cfg, np.asarray(batch["inputs"]), np.asarray(batch["targets"]),
        bench.MODES, compile_mode=None, warmup=1, samples=2, device="cpu",
    )  # fmt: skip
    assert all(len(s) == 2 and min(s) > 0 for s in times.values())
    grouped = torch_reference.time_modes(  # 2 samples of 3 back-to-back calls each
        cfg, np.asarray(batch["inputs"]), np.asarray(batch["targets"]),
        ["train_step"], compile_mode=None, warmup=1, samples=2, device="cpu", group=3,
    )  # fmt: skip
    assert len(grouped["train_step"]) == 2 and min(grouped["train_step"]) > 0
    jax.clear_caches()


def test_torch_reference_keeps_a_bf16_residual_stream_when_asked():
    """execution.residual_dtype=bfloat16 in the PyTorch reference: every block returns a bf16
    stream under autocast, and the loss stays that of our model with the same setting."""
    torch = pytest.importorskip("torch")
    from jaxllm.profiling import torch_reference
    from jaxllm.profiling.harness import make_state, random_batch
    from jaxllm.train.state import loss_and_sums

    cfg = size_config("tiny", [*SMALL, "--execution.compute_dtype=bfloat16",
                               "--execution.residual_dtype=bfloat16"])  # fmt: skip
    batch = random_batch(cfg, 2)
    state = make_state(cfg, batch)
    loss = loss_and_sums(state.params, state.apply_fn, batch, None)[0]
    model = torch_reference.build(cfg.model, cfg.execution)
    torch_reference.load_flax_params(model, state.params)
    dtypes = []
    for block in model.blocks:
        block.register_forward_hook(lambda mod, args, out: dtypes.append(out.dtype))
    x, y = (torch.tensor(np.asarray(batch[k]), dtype=torch.long) for k in ("inputs", "targets"))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = model(x, y).item()
    assert dtypes == [torch.bfloat16] * cfg.model.n_layers
    assert got == pytest.approx(float(loss), rel=2e-2)


def test_group_times_back_to_back_calls(tmp_path, capsys):
    """--group N: each timed sample is N calls before one sync (seconds per call), recorded."""
    calls = []

    def make():
        return lambda: calls.append(1) or jnp.zeros(())

    m = bench.measure(make, warmup=1, samples=2, group=3)
    assert m["status"] == "ok" and len(calls) == 1 + 2 * 3
    out = tmp_path / "bench.jsonl"
    argv = ["bench", *TINY_SWEEP, "--contexts", "16", "--modes", "forward", *TINY_RUN,
            "--group", "3", "--isolate", "never", "--jsonl", str(out)]  # fmt: skip
    assert cli(argv) == 0
    text = capsys.readouterr().out
    assert "2 timed samples of 3 call(s) each" in text
    assert bench.OOM_HINT not in text  # no OOM, no advice
    assert [json.loads(line)["group"] for line in out.read_text().splitlines()] == [3]
