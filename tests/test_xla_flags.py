import subprocess
import sys

from jaxllm.xla_flags import DEFAULT_FLAGS, apply_default_xla_flags


def test_defaults_appended_and_user_flags_win(monkeypatch):
    ours = [f"{k}={v}" for k, v in DEFAULT_FLAGS.items()]
    user = ["--xla_gpu_enable_triton_gemm=true", "--foo=1"]
    monkeypatch.setenv("XLA_FLAGS", " ".join(user))
    apply_default_xla_flags()
    assert sys.modules["os"].environ["XLA_FLAGS"].split() == user + ours[1:]  # the user's wins
    monkeypatch.setenv("XLA_FLAGS", "--foo=1")
    apply_default_xla_flags()
    assert sys.modules["os"].environ["XLA_FLAGS"].split() == ["--foo=1", *ours]


def test_flag_is_accepted_by_the_cpu_backend():
    code = (
        "from jaxllm.xla_flags import apply_default_xla_flags; apply_default_xla_flags(); "
        "import jax.numpy as jnp; print(float(jnp.ones(3).sum()))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "3.0"
