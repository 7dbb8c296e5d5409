"""jaxllm.train.run_lock: one process per run dir.

The holders are real processes: a live one makes acquire fail at once, naming its pid, host and
start time; one killed with SIGKILL (no cleanup runs) leaves a lock the next run takes over.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from datetime import datetime

import pytest
from conftest import ROOT

from jaxllm.train.run_lock import INFO_NAME, RunDirLock, RunDirLockedError

# Takes the lock, says so, then holds it until its stdin closes (or it is killed).
HOLDER = textwrap.dedent(
    """
    import sys
    from jaxllm.train.run_lock import RunDirLock
    with RunDirLock(sys.argv[1]):
        print("locked", flush=True)
        sys.stdin.read()
    """
)


@pytest.fixture
def holder(tmp_path):
    """Start a process holding tmp_path/run's lock; yields (process, run_dir)."""
    run_dir = tmp_path / "run"
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout.readline().strip() == "locked"
        yield proc, run_dir
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def test_live_holder_blocks_at_once_and_is_named(holder):
    proc, run_dir = holder
    t0 = time.monotonic()
    with pytest.raises(RunDirLockedError) as err:
        RunDirLock(run_dir).acquire()
    assert time.monotonic() - t0 < 2  # no waiting
    msg = str(err.value)
    assert str(run_dir) in msg and f"pid {proc.pid}" in msg and socket.gethostname() in msg
    started = json.loads((run_dir / INFO_NAME).read_text())["started"]
    assert f"started {started}" in msg and datetime.fromisoformat(started).tzinfo is not None
    assert isinstance(err.value, RuntimeError)

    (run_dir / INFO_NAME).write_text("{not json")  # unreadable info: still refused
    with pytest.raises(RunDirLockedError, match="unknown holder"):
        RunDirLock(run_dir).acquire()

    proc.stdin.close()  # the holder releases and exits normally
    assert proc.wait(timeout=30) == 0
    with RunDirLock(run_dir) as lock:
        assert lock.is_held


def test_lock_of_a_killed_process_is_taken_over(holder):
    proc, run_dir = holder
    with pytest.raises(RunDirLockedError):
        RunDirLock(run_dir).acquire()
    proc.send_signal(signal.SIGKILL)  # no release, no cleanup: the info file stays behind
    proc.wait(timeout=30)
    assert json.loads((run_dir / INFO_NAME).read_text())["pid"] == proc.pid
    with RunDirLock(run_dir) as lock:  # the kernel dropped the dead process's lock
        assert lock.is_held
        assert json.loads((run_dir / INFO_NAME).read_text())["pid"] == os.getpid()


def test_acquire_release_in_process(tmp_path):
    run_dir = tmp_path / "new" / "run"  # created on acquire
    lock = RunDirLock(run_dir)
    lock.acquire()
    lock.acquire()  # already held: no-op
    info = json.loads((run_dir / INFO_NAME).read_text())
    assert info["pid"] == os.getpid() and info["host"] == socket.gethostname()
    other = RunDirLock(run_dir)  # a second owner in this process is refused as well
    with pytest.raises(RunDirLockedError, match=f"pid {os.getpid()}"):
        other.acquire()
    assert not other.is_held
    lock.release()
    assert not lock.is_held and not (run_dir / INFO_NAME).exists()
    lock.release()  # not held: no-op
    with other:
        assert other.is_held
    assert not other.is_held
