"""Profiler work in child processes: `profile.py bench` measures a model size per child (an
out-of-memory error there leaves nothing behind for the cells after it), `profile.py memory` a
config per child (its allocator peak is then its own).

A child is `python -m <module> --child SPEC_JSON`; `child_main` runs its measurement and prints
each record on a TAG line, `Child` starts one and hands the parent those records as they come,
passes stderr lines that start with a progress tag on to our stderr, and keeps the rest of its
stderr (XLA's logging) for the error message of a failed child. No child outlives the parent
(`stop_children_on_exit`, SIGTERM from `timeout` included).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

TAG = "PROFILE_RECORD "  # the start of a child's result lines on stdout
_CHILDREN: set[subprocess.Popen] = set()  # running children, killed on exit
_LOCK = threading.Lock()


def child_command(module: str, spec: dict[str, Any]) -> list[str]:
    """The command of a child that runs `module`'s measurement of `spec`."""
    return [sys.executable, "-m", module, "--child", json.dumps(spec)]


def child_main(measure: Callable[[dict[str, Any]], Iterator[dict[str, Any]]], argv=None) -> int:
    """A child's entry point: `measure(spec)`'s records, each on a TAG line as it comes."""
    p = argparse.ArgumentParser()
    p.add_argument("--child", required=True, help="JSON spec of what to measure")
    for record in measure(json.loads(p.parse_args(argv).child)):
        print(TAG + json.dumps(record), flush=True)
    return 0


class Child:
    """One child process: `with Child(cmd, env) as c: for record in c.records(): ...`; then
    `returncode`, `stderr` (its last 200 lines) and `wall_s`. Leaving the block early (an
    exception, a closed generator) kills the child."""

    def __init__(self, cmd: list[str], env: dict[str, str], progress_tag: str | None = None):
        self.cmd, self.env, self.progress_tag = cmd, env, progress_tag
        self.returncode: int | None = None
        self.wall_s = 0.0
        self._tail: collections.deque[str] = collections.deque(maxlen=200)

    @property
    def stderr(self) -> str:
        return "".join(self._tail)

    def last_words(self) -> str:
        return (self.stderr.strip().splitlines() or ["no output"])[-1][:300]

    def __enter__(self) -> Child:
        self._t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            self.cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=self.env,
        )  # fmt: skip
        with _LOCK:
            _CHILDREN.add(self.proc)
        self._pump = threading.Thread(target=self._read_stderr, daemon=True)
        self._pump.start()
        return self

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:
            self._tail.append(line)
            if self.progress_tag and line.startswith(self.progress_tag):
                sys.stderr.write(line)
                sys.stderr.flush()

    def records(self) -> Iterator[dict[str, Any]]:
        """The records the child prints (child_main), as they come."""
        for line in self.proc.stdout:
            if line.startswith(TAG):
                yield json.loads(line[len(TAG) :])

    def __exit__(self, *exc: Any) -> None:
        try:
            if exc[0] is not None:  # left early: its output is not wanted
                with contextlib.suppress(OSError):
                    self.proc.kill()
            else:
                self.proc.stdout.read()  # the rest, so that it cannot block on a full pipe
            self.returncode = self.proc.wait()
            self._pump.join()
        finally:
            with _LOCK:
                _CHILDREN.discard(self.proc)
            self.wall_s = round(time.perf_counter() - self._t0, 3)


@contextlib.contextmanager
def stop_children_on_exit() -> Iterator[None]:
    """For a sweep of children: SIGTERM raises SystemExit in the main thread, and however the
    sweep ends, every child still running is killed."""

    def on_sigterm(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    in_main = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, on_sigterm) if in_main else None
    try:
        yield
    finally:
        with _LOCK:
            children = list(_CHILDREN)
        for proc in children:
            with contextlib.suppress(OSError):
                proc.kill()
        if in_main:
            signal.signal(signal.SIGTERM, old)
