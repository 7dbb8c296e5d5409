"""Our `profile.py` CLI must not shadow the standard library's `profile`.

From the repo root, sys.path[0] is the repo, so `import profile` (which cProfile does) would
find our CLI and `python -m cProfile train.py` would fail with `module 'profile' has no
attribute 'run'`. Each check runs a fresh interpreter in the repo root, as a user would.
"""

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # only cwd puts us on path
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def test_cprofile_runs_a_script_from_the_repo_root():
    out = run("-m", "cProfile", "-s", "cumtime", "profile.py", "--help")
    assert out.returncode == 0, out.stderr
    assert "function calls" in out.stdout  # cProfile's stats header
    assert "kernels" in out.stdout  # the profiled script (our CLI's help) ran too


def test_import_profile_from_the_repo_root_is_the_standard_library():
    code = "import profile, cProfile; print(profile.__file__); print(callable(profile.run))"
    out = run("-c", code)
    assert out.returncode == 0, out.stderr
    path, has_run = out.stdout.split()
    assert Path(path).resolve() == Path(sysconfig.get_paths()["stdlib"], "profile.py").resolve()
    assert has_run == "True"


def test_cli_still_runs_as_a_script():
    out = run("profile.py", "--help")
    assert out.returncode == 0, out.stderr
    assert "kernels" in out.stdout
    out = run("profile.py", "kernels", "--only", "nope")
    assert out.returncode == 2 and "--only: ['nope']; allowed: softmax" in out.stderr
