import subprocess
import sys

from jaxllm.xla_flags import apply_default_xla_flags


def test_defaults_appended_and_user_flags_win(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=true --foo=1")
    apply_default_xla_flags()
    assert sys.modules["os"].environ["XLA_FLAGS"] == "--xla_gpu_enable_triton_gemm=true --foo=1"
    monkeypatch.setenv("XLA_FLAGS", "--foo=1")
    apply_default_xla_flags()
    assert sys.modules["os"].environ["XLA_FLAGS"] == "--foo=1 --xla_gpu_enable_triton_gemm=false"


def test_flag_is_accepted_by_the_cpu_backend():
    code = (
        "from jaxllm.xla_flags import apply_default_xla_flags; apply_default_xla_flags(); "
        "import jax.numpy as jnp; print(float(jnp.ones(3).sum()))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "3.0"
