"""One process per run dir: an OS advisory lock on `run_dir/.lock`.

Two trainings writing one run dir would interleave checkpoints and metrics. `RunDirLock` takes an
exclusive lock through `filelock` (flock(2) on Unix, msvcrt.locking on Windows), without waiting: a
second process gets `RunDirLockedError` at once. The kernel drops such a lock when its holder
dies, however it dies (SIGKILL, OOM kill), so a crashed run's lock is taken over by the next run
with nothing to clean up by hand; no pid-liveness guessing is needed.

The holder records who it is (pid, host, start time) in `run_dir/.lock.json`, only for the
second process's error message; the lock itself is the flock, never that file. On a filesystem
without flock (some network mounts) `filelock` fails or falls back to a plain lock file, which a
killed process leaves behind: keep run dirs on local disks.

    with RunDirLock(run_dir):
        train(...)
"""

from __future__ import annotations

import json
import os
import socket
from datetime import datetime
from pathlib import Path
from types import TracebackType

from filelock import FileLock, Timeout

from jaxllm.atomic_file import write_text_atomic

LOCK_NAME = ".lock"
INFO_NAME = ".lock.json"


class RunDirLockedError(RuntimeError):
    """The run dir is locked by another live process (or another `RunDirLock` in this one)."""


class RunDirLock:
    """Exclusive, non-blocking ownership of a run dir; a context manager, or acquire()/release().

    acquire() creates the run dir if needed. Acquiring again while held is a no-op; release()
    when not held is a no-op.
    """

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.run_dir = Path(run_dir)
        self.lock_path = self.run_dir / LOCK_NAME
        self.info_path = self.run_dir / INFO_NAME
        # thread_local=False: the thread that releases (a finally, an atexit hook) need not be
        # the one that acquired.
        self._lock = FileLock(self.lock_path, thread_local=False)

    @property
    def is_held(self) -> bool:
        """Whether this object holds the lock."""
        return self._lock.is_locked

    def acquire(self) -> None:
        """Take the lock now or raise `RunDirLockedError` naming the holder; never waits."""
        if self.is_held:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._lock.acquire(timeout=0)
        except Timeout:
            raise RunDirLockedError(
                f"run dir {self.run_dir} is in use by {self.holder()}; use another run dir, or "
                "wait for that process to end (its lock goes with it, even if it is killed)"
            ) from None
        try:
            self._write_info()
        except BaseException:  # e.g. disk full: do not keep a lock nobody will release
            self._lock.release(force=True)
            raise

    def release(self) -> None:
        """Drop the lock and remove the info file."""
        if not self.is_held:
            return
        # Remove the info while still holding the lock: after the unlock it may be a new
        # holder's file.
        self.info_path.unlink(missing_ok=True)
        self._lock.release(force=True)

    def holder(self) -> str:
        """The holder as the info file describes it: 'pid P on host H, started T', or
        'unknown holder' when the file is missing or unreadable (e.g. just being written)."""
        try:
            info = json.loads(self.info_path.read_text())
            return f"pid {info['pid']} on host {info['host']}, started {info['started']}"
        except (OSError, ValueError, TypeError, KeyError):
            return "unknown holder"

    def _write_info(self) -> None:
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": datetime.now()
            .astimezone()
            .isoformat(timespec="seconds"),  # local, with offset
        }
        write_text_atomic(self.info_path, json.dumps(info) + "\n")  # never half a file

    def __enter__(self) -> RunDirLock:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()
