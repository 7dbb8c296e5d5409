"""Profiler work in child processes: `profile.py memory` runs a config per child (its allocator
peak is then its own), `profile.py bench` a model size per child (an out-of-memory error there
cannot leave anything behind for the configs after it). Moved here from memory.py.

`Child` starts one, hands the caller its stdout lines as they come (a protocol of tagged
lines, each profiler its own), passes lines of its stderr that start with a progress tag on to
our stderr and keeps the rest of it (XLA's logging) for the error message of a failed child.
`Turns` lets children started ahead of time use the device one at a time, in order: a child
says a ready tag on stdout and waits for "go" on stdin (`stdin_turn`). Every running child is
killed when the parent stops (`kill_children`; `stop_children_on_exit` for a whole sweep,
SIGTERM from `timeout` included).
"""

from __future__ import annotations

import collections
import contextlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

_CHILDREN: set[subprocess.Popen] = set()  # running children (killed on exit)
_CHILDREN_LOCK = threading.Lock()


class Turns:
    """The device, one child at a time, in order: turn i starts once turn i - 1 is over (its
    process exited). `abort` releases every waiter."""

    def __init__(self) -> None:
        self.next = 0
        self.aborted = False
        self.cond = threading.Condition()

    def wait(self, i: int) -> bool:
        """Block until turn i; False when the sweep was aborted."""
        with self.cond:
            self.cond.wait_for(lambda: self.next == i or self.aborted)
            return not self.aborted

    def done(self, i: int) -> None:
        """Turn i is over (after it started, or without using it: a failed child)."""
        if self.wait(i):
            with self.cond:
                self.next = i + 1
                self.cond.notify_all()

    def abort(self) -> None:
        with self.cond:
            self.aborted = True
            self.cond.notify_all()


@contextlib.contextmanager
def stdin_turn(ready_tag: str, stopped: str) -> Iterator[None]:
    """In a child: its turn on the device. Say `ready_tag`, wait for the parent's "go"; exit
    with the message `stopped` on anything else."""
    print(ready_tag, flush=True)
    if sys.stdin.readline().strip() != "go":
        raise SystemExit(stopped)
    yield


class Child:
    """One child process, as a context manager: `with Child(cmd, env) as c: for line in
    c.lines(): ...`; afterwards `returncode`, `stderr` (its last 200 lines, progress lines
    included) and `wall_s` (with the interpreter's start and any wait for a turn). Leaving the
    block early (an exception, a generator closed) kills the child.

    progress_tag: stderr lines starting with it go on to our stderr as they come. turns, index,
    ready_tag: the child waits for turn `index` (it prints `ready_tag`, see `stdin_turn`);
    with `turns` aborted before the start, SystemExit(`stopped`)."""

    def __init__(
        self,
        cmd: Sequence[str],
        env: dict[str, str],
        *,
        progress_tag: str | None = None,
        turns: Turns | None = None,
        index: int = 0,
        ready_tag: str | None = None,
        stopped: str = "the sweep stopped",
    ) -> None:
        self.cmd, self.env = list(cmd), env
        self.progress_tag, self.turns, self.index = progress_tag, turns, index
        self.ready_tag, self.stopped = ready_tag, stopped
        self.proc: subprocess.Popen | None = None
        self.returncode: int | None = None
        self.wall_s = 0.0
        self._tail: collections.deque[str] = collections.deque(maxlen=200)
        self._pump: threading.Thread | None = None
        self._t0 = time.perf_counter()

    @property
    def stderr(self) -> str:
        return "".join(self._tail)

    def __enter__(self) -> Child:
        self._t0 = time.perf_counter()
        try:
            if self.turns is not None and self.turns.aborted:
                raise SystemExit(self.stopped)
            self.proc = subprocess.Popen(
                self.cmd, stdin=subprocess.PIPE if self.turns else subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env,
            )  # fmt: skip
        except BaseException:
            self._finish()
            raise
        with _CHILDREN_LOCK:
            _CHILDREN.add(self.proc)
        self._pump = threading.Thread(target=self._read_stderr, daemon=True)
        self._pump.start()
        return self

    def _read_stderr(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for line in self.proc.stderr:
            self._tail.append(line)
            if self.progress_tag and line.startswith(self.progress_tag):
                sys.stderr.write(line)
                sys.stderr.flush()

    def lines(self) -> Iterator[str]:
        """The child's stdout lines as they come, but for the turn handshake."""
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            if self.turns is not None and self.ready_tag and line.startswith(self.ready_tag):
                go = "go\n" if self.turns.wait(self.index) else "stop\n"
                with contextlib.suppress(OSError):  # the child may have died meanwhile
                    assert self.proc.stdin is not None
                    self.proc.stdin.write(go)
                    self.proc.stdin.flush()
            else:
                yield line

    def __exit__(self, *exc: Any) -> None:
        proc = self.proc
        try:
            if proc is not None:
                if exc[0] is not None:  # left early: the child's output is not wanted
                    with contextlib.suppress(OSError):
                        proc.kill()
                else:
                    for _ in self.lines():  # the rest of its stdout, so that it cannot block
                        pass
                self.returncode = proc.wait()
                if self._pump is not None:
                    self._pump.join()
        finally:
            self._finish()

    def _finish(self) -> None:
        if self.proc is not None:
            with _CHILDREN_LOCK:
                _CHILDREN.discard(self.proc)
        if self.turns is not None:
            self.turns.done(self.index)
        self.wall_s = round(time.perf_counter() - self._t0, 3)


def kill_children() -> None:
    """Kill every child still running."""
    with _CHILDREN_LOCK:
        children = list(_CHILDREN)
    for proc in children:
        with contextlib.suppress(OSError):
            proc.kill()


@contextlib.contextmanager
def stop_children_on_exit() -> Iterator[None]:
    """For a sweep of children: SIGTERM (`timeout`) raises SystemExit in the main thread, and
    however the sweep ends, no child outlives it."""

    def on_sigterm(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    in_main = threading.current_thread() is threading.main_thread()
    old_handler = signal.signal(signal.SIGTERM, on_sigterm) if in_main else None
    try:
        yield
    finally:
        kill_children()
        if in_main:
            signal.signal(signal.SIGTERM, old_handler)
