"""Orbax checkpoints of a run: the last K steps, plus the best by validation loss.

A checkpoint holds params, optimizer state and step (arrays) and a JSON record: the config, the
data-sampler state, every parameter's shape (so a restore into a different model fails with a
message naming the parameter instead of deep inside orbax), a sha256 of every array and whether
it was saved as the best.

What survives which fault:

- A crash or kill mid-save: orbax writes each step to `<step>.orbax-checkpoint-tmp*` and renames
  it when complete, so `restore` never picks a half-written checkpoint. The owner of the run dir
  deletes such temp dirs when it next opens it, and re-copies into `best/` a checkpoint that was
  meant to be the best but whose copy into `best/` was cut off.
- A full disk (or any write failure) during a save: `CheckpointSaveError` (an OSError) with one
  line naming the step, the directory and the checkpoint that is still intact; the temp dir is
  removed.
- A corrupt checkpoint (unreadable files, a missing item, or arrays whose bytes no longer match
  the checksum taken at save time): `restore` falls back to the next newest checkpoint that
  restores and says so in one `CheckpointFallbackWarning` line; if none restores,
  `CheckpointCorruptError` lists what was tried. orbax's own noise (asyncio tracebacks of the
  reads still in flight, absl error logs) is kept off stderr.
- A checkpoint of another model or optimizer: `CheckpointMismatchError` naming the parameter,
  or the optimizer settings.

Several processes (jaxllm/distributed.py): every process calls `Checkpointer(...)`, `save` and
`restore` at the same points (orbax writes each process's shards and lets process 0, its
primary host, write the metadata and finish the save); the run dir must be one filesystem that
all of them see. Repairs and moves of checkpoint dirs run on process 0 only, and the others
wait for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import time
import warnings
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax.training.train_state import TrainState
from jax.experimental import multihost_utils

from jaxllm import distributed
from jaxllm.train.run_lock import RunDirLock, RunDirLockedError

TMP_MARK = "orbax-checkpoint-tmp"  # in the names of orbax's unfinished checkpoint dirs
QUARANTINE = "corrupt_checkpoints"  # where a corrupt checkpoint goes before its step is redone


class CheckpointMismatchError(ValueError):
    """The checkpoint's parameters or optimizer state do not fit the model being restored."""


class CheckpointCorruptError(ValueError):
    """No checkpoint (of those tried) could be read back intact."""


class CheckpointSaveError(OSError):
    """A save failed (e.g. no space left on device); the earlier checkpoints are intact."""


class CheckpointFallbackWarning(UserWarning):
    """The newest checkpoint was unusable; an older one was restored instead."""


def param_shapes(params: Any) -> dict[str, list[int]]:
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return {jax.tree_util.keystr(path): list(np.shape(leaf)) for path, leaf in flat}


def _items(state: TrainState) -> dict[str, Any]:
    return {"params": state.params, "opt_state": state.opt_state, "step": state.step}


def _leaf_digests(tree: Any) -> Iterator[tuple[str, str]]:
    """(leaf path, 'dtype:sha256 of its bytes') of each array of `tree`, in tree order.

    One leaf at a time is copied to the host, so the extra memory is the largest leaf. Cost: one
    pass of sha256 over the state, ~1.2 GB/s on one core with SHA-NI, i.e. about 1.3 s per save
    (and per restore) of GPT-2 124M's 1.5 GB (params + AdamW moments), on top of orbax's work.
    """
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(leaf, jax.Array) and not (
            leaf.is_fully_addressable or leaf.is_fully_replicated
        ):  # sharded over several processes: every process gathers it (a collective)
            leaf = multihost_utils.process_allgather(leaf, tiled=True)
        arr = np.ascontiguousarray(jax.device_get(leaf))
        digest = hashlib.sha256(arr.reshape(-1).view(np.uint8)).hexdigest()
        yield jax.tree_util.keystr(path), f"{arr.dtype}:{digest}"


def _one_line(e: BaseException, limit: int = 400) -> str:
    """The gist of an orbax / tensorstore error on one line: its status code and innermost
    cause (from the last file it names), without tensorstore's spec dump; capped in the middle."""
    text = str(e.args[0]) if isinstance(e, KeyError) and len(e.args) == 1 else str(e)
    if text.startswith("Encountered error while reading array") and e.__cause__ is not None:
        return _one_line(e.__cause__, limit)  # orbax's wrapper; the cause names file and range
    text = re.split(r" \[(?:tensorstore_spec|source locations)|\s*See full TensorStore", text)[0]
    text = " ".join(text.split())
    status = re.match(r"([A-Z][A-Z_]{3,}): ", text)  # e.g. DATA_LOSS, RESOURCE_EXHAUSTED
    if status:
        text = text[status.end() :]
    parts = text.split(": ")
    named = [i for i, part in enumerate(parts) if '"/' in part]
    if named:  # from the innermost file on; a part that is only the path keeps its verb
        i = named[-1] - (named[-1] > 0 and parts[named[-1]].startswith('"'))
        text = ": ".join(parts[i:])
    text = f"{status.group(1) if status else type(e).__name__}: {text}"
    return text if len(text) <= limit else f"{text[: limit // 3]} ... {text[-(limit * 2 // 3) :]}"


def _remove_entry(entry: Path) -> None:
    """Delete a file, a link (not what it points to) or a directory tree; errors ignored."""
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry, ignore_errors=True)
    else:
        entry.unlink(missing_ok=True)


def _remove_unfinished(directory: Path, pattern: str, quiet: float = 1.0, most: float = 10) -> None:
    """Delete what matches `pattern` in `directory` until nothing has matched for `quiet`
    seconds (at most `most`). After a failed save orbax's I/O threads may still be running and
    one of them re-creates the unfinished `<step>.orbax-checkpoint-tmp` (e.g. the array-metadata
    mkdir with parents=True) after a first removal (seen in CI; a retried rmtree alone still
    failed 3 of 24 stress runs).
    Left over anyway, the next start's `_remove_temp_dirs` deletes it."""
    start = last_seen = time.monotonic()
    while True:
        now = time.monotonic()
        found = list(directory.glob(pattern))
        for entry in found:
            _remove_entry(entry)
        if found:
            last_seen = now
        elif now - last_seen >= quiet or now - start >= most:
            return
        time.sleep(0.05)


def _is_disk_full(e: BaseException) -> bool:
    text = str(e)
    return (
        getattr(e, "errno", None) == errno.ENOSPC
        or "No space left on device" in text
        or f"os_error_code='{errno.ENOSPC}'" in text
    )


class _TolerantLoop(asyncio.SelectorEventLoop):
    """An event loop that ignores the calls that come after it is closed.

    When an orbax read or write fails, orbax closes its loop under the operations still in
    flight; tensorstore's threads, completing them, then call the closed loop, and on orbax's
    own loop each such call prints an "Event loop is closed" traceback (hundreds for a real
    model, all after the one error that matters).
    """

    def call_soon_threadsafe(  # type: ignore[override]
        self, callback: Callable[..., Any], *args: Any, context: Any = None
    ) -> asyncio.Handle | None:
        with contextlib.suppress(RuntimeError):  # closed (now, or just before the check)
            if not self.is_closed():
                return super().call_soon_threadsafe(callback, *args, context=context)
        return None


def _run_sync_quietly(coro: Coroutine[Any, Any, Any]) -> Any:
    """orbax's `_run_sync_via_new_loop` on a `_TolerantLoop`: when the coroutine fails, its
    tasks still running are awaited and their errors and late callbacks are dropped."""
    loop = _TolerantLoop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(coro)
    except BaseException:
        loop.set_exception_handler(lambda *_: None)  # no "exception was never retrieved"
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        if pending:
            loop.run_until_complete(asyncio.wait(pending, timeout=120))
        raise
    finally:
        asyncio.set_event_loop(None)
        loop.close()


class _DropWarnings(logging.Filter):
    """Drops warnings and errors: orbax's absl logs (with tracebacks) of a failed read/write."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.WARNING


class _DropOrbaxWarnings(logging.Filter):
    """Drops warnings and errors logged from orbax's own files: after a failed save, orbax's
    worker threads may still log that failure (with a traceback) once we have raised ours."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.WARNING or f"{os.sep}orbax{os.sep}" not in record.pathname


_LATE_ORBAX_LOGS = _DropOrbaxWarnings()


@contextlib.contextmanager
def _quiet_orbax() -> Iterator[None]:
    """Keep orbax's noise of a failing read or write off stderr; we raise one clear error.

    Swaps orbax's private loop runner (process-wide, for the duration; skipped if a future
    orbax drops it) and drops absl warnings and errors meanwhile. After a failure, orbax's own
    warnings stay filtered for the rest of the process (its threads can log the failure late)."""
    from orbax.checkpoint._src import asyncio_utils

    absl_logger, drop = logging.getLogger("absl"), _DropWarnings()
    absl_logger.addFilter(drop)
    original = getattr(asyncio_utils, "_run_sync_via_new_loop", None)
    if original is not None:
        asyncio_utils._run_sync_via_new_loop = _run_sync_quietly
    try:
        yield
    except BaseException:
        absl_logger.addFilter(_LATE_ORBAX_LOGS)  # a no-op when already there
        raise
    finally:
        if original is not None:
            asyncio_utils._run_sync_via_new_loop = original
        absl_logger.removeFilter(drop)


def _manager(directory: Path, keep: int) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=False)
    return ocp.CheckpointManager(directory.resolve(), options=options)


def _owns_run_dir(run_dir: Path) -> bool:
    """Whether this process may repair `run_dir`: it holds the run dir lock, or nobody does."""
    lock = RunDirLock(run_dir)
    with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
        info = json.loads(lock.info_path.read_text())
        if info.get("pid") == os.getpid() and info.get("host") == socket.gethostname():
            return True  # the training loop of this process holds it
    if not run_dir.is_dir():
        return False
    try:
        lock.acquire()
    except (RunDirLockedError, OSError):
        return False  # another process is training in it, or it is read-only
    lock.release()
    return True


class Checkpointer:
    """The checkpoints of one run dir: `checkpoints/` (the last `keep` steps) and `best/`.

    `repair`: delete the temp dirs of saves that a crash cut off and complete `best/` (see the
    module docstring). None: only if this process holds the run dir's lock or no process does,
    so a reader (generate.py) never touches the files of a run in progress.
    """

    def __init__(self, run_dir: str | Path, keep: int = 3, repair: bool | None = None):
        self.run_dir = Path(run_dir)
        several = jax.process_count() > 1
        if several and jax.process_index() != 0:
            repair = False  # process 0 repairs; the others wait for it below
        if repair is None:
            repair = _owns_run_dir(self.run_dir)
        if repair:
            self._remove_temp_dirs()
        self.latest = _manager(self.run_dir / "checkpoints", keep)
        self.best = _manager(self.run_dir / "best", 1)
        self._unusable: dict[str, set[int]] = {"latest": set(), "best": set()}
        if repair:
            self._complete_best()
        if several:
            distributed.sync("jaxllm-checkpointer-repair")
            self.latest.reload()
            self.best.reload()

    # -- where things are ----------------------------------------------------------------------

    def _mngr(self, which: str) -> ocp.CheckpointManager:
        if which not in ("latest", "best"):
            raise ValueError(f"which must be 'latest' or 'best', got {which!r}")
        return self.latest if which == "latest" else self.best

    @staticmethod
    def _path(mngr: ocp.CheckpointManager, step: int) -> Path:
        return Path(mngr.directory) / str(step)

    def latest_step(self) -> int | None:
        return self.latest.latest_step()

    # -- repairs at start ----------------------------------------------------------------------

    def _remove_temp_dirs(self) -> None:
        """Delete the unfinished saves (`*orbax-checkpoint-tmp*`) directly under checkpoints/
        and best/ that a killed process left; nothing else."""
        for sub in ("checkpoints", "best"):
            directory = self.run_dir / sub
            if not directory.is_dir():
                continue
            for entry in directory.iterdir():
                if TMP_MARK in entry.name:
                    _remove_entry(entry)

    def _complete_best(self) -> None:
        """If the newest checkpoint saved as the best is newer than best/'s, a kill cut off its
        copy into best/: copy it there now (files, then an atomic rename)."""
        best_step = self.best.latest_step()
        for step in sorted(self.latest.all_steps(), reverse=True):
            if best_step is not None and step <= best_step:
                return
            if not self.recorded_meta(step).get("is_best"):
                continue
            target = self._path(self.best, step)
            tmp = target.with_name(f"{step}.{TMP_MARK}-repair")
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                shutil.copytree(self._path(self.latest, step), tmp)
                os.replace(tmp, target)
                self.best.reload()
                for old in self.best.all_steps():
                    if old != step:
                        self.best.delete(old)
            except Exception as e:
                shutil.rmtree(tmp, ignore_errors=True)
                warnings.warn(
                    f"could not copy checkpoint step {step} into {target.parent} "
                    f"(it was saved as the best): {_one_line(e)}",
                    CheckpointFallbackWarning,
                    stacklevel=2,
                )
            self.best.reload()
            return

    # -- save ----------------------------------------------------------------------------------

    def save(self, state: TrainState, meta: dict, best: bool = False) -> None:
        """Save at `state.step`; with best=True also replace the best-by-val-loss copy.

        Raises `CheckpointSaveError` (one line: what failed, where, and which checkpoint is
        intact) if a write fails, e.g. when the disk is full; the unfinished files are removed.
        """
        step = int(state.step)
        items = _items(state)
        meta = {
            **meta,
            "step": step,
            "param_shapes": param_shapes(state.params),
            "checksums": {"algorithm": "sha256", "arrays": dict(_leaf_digests(items))},
            "is_best": bool(best),
        }
        args = ocp.args.Composite(state=ocp.args.StandardSave(items), meta=ocp.args.JsonSave(meta))
        for which in ("latest", "best") if best else ("latest",):
            mngr = self._mngr(which)
            self._quarantine_from(which, step)
            if step in mngr.all_steps():
                continue
            try:
                with _quiet_orbax():
                    mngr.save(step, args=args)
                    mngr.wait_until_finished()
            except Exception as e:
                raise self._save_error(mngr, step, e) from None

    def _quarantine_from(self, which: str, step: int) -> None:
        """Move aside the checkpoints at or after `step` that `restore` found corrupt, so that
        this step can be saved again (orbax skips a step that is not newer than its latest)."""
        mngr = self._mngr(which)
        bad = [s for s in mngr.all_steps() if s >= step and s in self._unusable[which]]
        for s in bad if jax.process_index() == 0 else []:  # the same list on every process
            dest_dir = self.run_dir / QUARANTINE
            dest_dir.mkdir(parents=True, exist_ok=True)
            name = f"{Path(mngr.directory).name}_{s}"
            dest, n = dest_dir / name, 1
            while dest.exists():
                dest, n = dest_dir / f"{name}.{n}", n + 1
            os.replace(self._path(mngr, s), dest)
        if bad:
            distributed.sync("jaxllm-checkpoint-quarantine")
            self._unusable[which] -= set(bad)
            mngr.reload()

    def _save_error(
        self, mngr: ocp.CheckpointManager, step: int, e: Exception
    ) -> CheckpointSaveError:
        with contextlib.suppress(Exception), _quiet_orbax():
            mngr.wait_until_finished()
        directory = Path(mngr.directory)
        if jax.process_index() == 0:
            _remove_unfinished(directory, f"{step}.*{TMP_MARK}*")
        with contextlib.suppress(Exception):
            mngr.reload()
        kept = [s for s in mngr.all_steps() if s != step]
        intact = f"checkpoint {max(kept)} is intact" if kept else "no earlier checkpoint exists"
        if mngr is self.best and step in self.latest.all_steps():
            intact += f", and step {step} is saved in {self.latest.directory}"
        disk_full = _is_disk_full(e)
        cause = "no space left on device" if disk_full else _one_line(e)
        err = CheckpointSaveError(f"{cause} while saving step {step} to {directory}; {intact}")
        if disk_full:
            err.errno = errno.ENOSPC
        return err

    # -- restore -------------------------------------------------------------------------------

    def read_meta(self, step: int | None = None, which: str = "latest") -> dict:
        mngr = self._mngr(which)
        step = mngr.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {mngr.directory}")
        with _quiet_orbax():
            return mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def recorded_meta(self, step: int | None = None, which: str = "latest") -> dict:
        """`read_meta`, or {} where that checkpoint's record is missing or unreadable (`restore`
        falls back past such a checkpoint and says so: callers that only peek need not)."""
        try:
            return self.read_meta(step, which)
        except Exception:  # noqa: BLE001 - orbax and JSON raise many kinds; restore() reports
            return {}

    def restore(
        self, state: TrainState, step: int | None = None, which: str = "latest"
    ) -> tuple[TrainState, dict]:
        """Restore into the structure of `state` (same model and optimizer config).

        `step` None: the newest checkpoint of `which` ('latest' or 'best') that restores intact.
        One that fails to read, or whose arrays do not match the checksums taken at save time,
        is skipped, with one `CheckpointFallbackWarning` line naming it, the failure, and the
        step restored instead (for 'latest', best/'s copy of the same step is tried first).
        Checkpoints saved before checksums were recorded restore without that verification.

        `step` N: that checkpoint only. Raises `FileNotFoundError` listing the available steps
        if there is none at N, `CheckpointCorruptError` if it (or every one tried) is unusable,
        and `CheckpointMismatchError` if it does not fit the model or optimizer of `state`.
        """
        mngr = self._mngr(which)
        steps = sorted(mngr.all_steps(), reverse=True)
        if step is not None and step not in steps:
            have = ", ".join(map(str, sorted(steps))) if steps else "none"
            raise FileNotFoundError(
                f"no checkpoint at step {step} in {mngr.directory}; available steps: {have}"
            )
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {mngr.directory}")
        candidates = [(which, step)] if step is not None else []
        if step is None:
            # For 'latest', best/ may hold an intact copy of the same step: try it next.
            also_best = set(self.best.all_steps()) if which == "latest" else set()
            for s in steps:
                candidates += [(which, s)] + [("best", s)] * (s in also_best)
        failures = []
        for cand_which, s in candidates:
            cand = self._mngr(cand_which)
            try:
                restored, meta = self._restore_step(cand, s, state)
            except CheckpointCorruptError as e:
                failures.append(f"{self._path(cand, s)} ({e})")
                self._unusable[cand_which].add(s)
                continue
            if failures:
                warnings.warn(
                    f"checkpoint {'; '.join(failures)} could not be restored; restored step {s} "
                    f"({self._path(cand, s)}) instead",
                    CheckpointFallbackWarning,
                    stacklevel=2,
                )
            return restored, meta | {"restored_from": str(self._path(cand, s))}
        raise CheckpointCorruptError(
            f"no checkpoint in {mngr.directory} could be restored; tried {'; '.join(failures)}"
        )

    def _restore_step(
        self, mngr: ocp.CheckpointManager, step: int, state: TrainState
    ) -> tuple[TrainState, dict]:
        """Restore one checkpoint; any failure to read it intact is `CheckpointCorruptError`."""
        where = f"checkpoint step {step} in {mngr.directory}"
        try:
            meta = self.read_meta(step, "latest" if mngr is self.latest else "best")
        except Exception as e:
            raise CheckpointCorruptError(f"its record is unreadable: {_one_line(e)}") from None
        expected, saved = param_shapes(state.params), meta.get("param_shapes", {})
        for name in sorted(set(expected) | set(saved)):
            if expected.get(name) != saved.get(name):
                raise CheckpointMismatchError(
                    f"{where} does not fit this model: parameter {name} has shape "
                    f"{saved.get(name, 'missing')} in the checkpoint and "
                    f"{expected.get(name, 'missing')} in the model"
                )
        template = _items(state)
        sums = meta.get("checksums", {}).get("arrays")
        if sums is not None:
            here = [
                jax.tree_util.keystr(p)
                for p, _ in jax.tree_util.tree_flatten_with_path(template)[0]
            ]
            differ = sorted(set(here) ^ set(sums))
            if differ:
                side = "the checkpoint" if differ[0] in sums else "this optimizer"
                raise self._optimizer_mismatch(where, f"{differ[0]} is only in {side}")
        try:
            with _quiet_orbax():
                out = mngr.restore(
                    step, args=ocp.args.Composite(state=ocp.args.StandardRestore(template))
                )["state"]
        except Exception as e:
            if "tree structures do not match" in str(e):  # checkpoints without checksums
                lines = str(e).splitlines()[1:]
                diff = " ".join(x.strip(" -") for x in lines if not x.startswith("If this"))
                raise self._optimizer_mismatch(where, f"orbax: {diff[:200]}") from None
            raise CheckpointCorruptError(_one_line(e)) from None
        if sums is not None:
            for key, digest in _leaf_digests(out):  # stops at the first bad array
                # A leaf restored into another dtype (cast by orbax) cannot be checked.
                if digest.split(":")[0] == sums[key].split(":")[0] and digest != sums[key]:
                    raise CheckpointCorruptError(
                        f"array {key} does not match the checksum taken when it was saved"
                    )
        state = state.replace(params=out["params"], opt_state=out["opt_state"], step=out["step"])
        return state, meta

    @staticmethod
    def _optimizer_mismatch(where: str, detail: str) -> CheckpointMismatchError:
        return CheckpointMismatchError(
            f"{where}: the optimizer state does not fit: optim settings differ from the "
            f"checkpoint's (e.g. grad_clip on/off); {detail}"
        )

    def close(self) -> None:
        self.latest.close()
        self.best.close()
