"""The process group of a run on several hosts: starting it, and who this process is in it.

One process per host (or per GPU) runs the same program; `jax.distributed.initialize` connects
them through a coordinator (process 0), after which `jax.devices()` lists the devices of every
process and one mesh (jaxllm/parallel.py) spans them all. Where the settings come from, first
match per field:

1. config / flags: `--parallel.coordinator_address=HOST:PORT --parallel.num_processes=N
   --parallel.process_id=I`;
2. the environment: $JAX_COORDINATOR_ADDRESS (jax reads it too), $JAX_NUM_PROCESSES and
   $JAX_PROCESS_ID (jax does not read these two: this module does, here and nowhere else).

All three, or none. With none: a Slurm step (`srun`) or Open MPI launch (`mpirun`) of more
than one task is left to jax's own cluster detection (`jax.distributed.initialize()` with no
arguments, which also gives each task one local GPU); anything else is one process, exactly as
before (nothing is started and no device is touched here).

On the CPU, processes exchange data through gloo over TCP (`jax_cpu_collectives_implementation`,
jax 0.10's default); it is set when the CPU backend may run and no other implementation (mpi)
was chosen, and the start-up line says so.

Who does what (`is_primary`): every process computes and takes part in every checkpoint save
(orbax coordinates them; the run dir must be one shared filesystem); process 0 alone writes the
logs, metrics, config, plots and progress bar, holds the run dir lock and repairs the run dir.
Each process feeds only its own rows of each global batch (`process_rows`, `global_batch`).

Failures and exit. A process waits INIT_TIMEOUT_S for the group to form, then stops with one
line naming the coordinator address and what to check. While the group runs, each process
writes a counter to the coordinator's key-value store every BEAT_S (`_watch`): a process whose
counter stands still for PEER_TIMEOUT_S is gone, and a store that stops answering means the
coordinator is; the process that sees it prints one line and ends at once (os._exit: jax's
own shutdown would wait for the missing process, then abort with a page of gRPC logs).
jax's heartbeat timeout is set longer, so this check speaks first. `finish` ends a process:
after success every process leaves the group together and the coordinator, whose service
the others poll to the end, goes last; after an error a process leaves at once.
"""

from __future__ import annotations

import atexit
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import NoReturn

import jax
import numpy as np
from jax._src.distributed import global_state  # the group's client and service (no public handle)
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from jaxllm import parallel
from jaxllm.config import ConfigError, ParallelConfig

ENV = {  # ParallelConfig field -> environment variable read when the field is None
    "coordinator_address": "JAX_COORDINATOR_ADDRESS",
    "num_processes": "JAX_NUM_PROCESSES",
    "process_id": "JAX_PROCESS_ID",
}


@dataclass(frozen=True)
class ProcessGroup:
    """What `initialize` did: `num_processes` 1 and `source` "single process" when nothing."""

    num_processes: int
    process_id: int
    coordinator_address: str | None
    source: str  # "single process", "config", "environment", "config + environment", "slurm", ...
    cpu_collectives: str | None = None  # set by initialize on the CPU ("gloo")

    def describe(self) -> str:
        """One line for the start of a run, e.g. 'processes: 2 (this is 0), coordinator
        localhost:1234 (from config), cpu collectives gloo'."""
        if self.num_processes == 1 and self.source == "single process":
            return "processes: 1"
        line = (
            f"processes: {self.num_processes} (this is {self.process_id}), coordinator "
            f"{self.coordinator_address} (from {self.source})"
        )
        return line + (f", cpu collectives {self.cpu_collectives}" if self.cpu_collectives else "")


_group: ProcessGroup | None = None  # what this process started (initialize runs once)
_stop_watch = threading.Event()  # set when this process leaves the group on purpose
_watcher: threading.Thread | None = None  # runs _watch while in a group

INIT_TIMEOUT_S = 300  # how long a process waits for all processes to join at the start
PEER_TIMEOUT_S = 120  # a process that shows no sign of life this long is gone
BEAT_S = 2.0  # how often each process shows it is alive and checks the others
EXIT_GRACE_S = 1.0  # after a clean exit the coordinator outlives the others by this
# Errors of a collective whose peer process went away (gloo over TCP, NCCL).
PEER_LOST = re.compile(r"connection (reset|closed|refused)|broken pipe|closed by peer", re.I)


def _cluster_launch(environ: Mapping[str, str]) -> str | None:
    """'slurm' / 'ompi' when a launcher started this process as one of several tasks."""

    def count(name: str) -> int:
        try:
            return int(environ.get(name, "1"))
        except ValueError:
            return 1

    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_PROCID", "SLURM_LOCALID")
    if all(k in environ for k in slurm) and count("SLURM_NTASKS") > 1:
        return "slurm"
    if "OMPI_MCA_orte_hnp_uri" in environ and count("OMPI_COMM_WORLD_SIZE") > 1:
        return "ompi"
    return None


def resolve(cfg: ParallelConfig, environ: Mapping[str, str] | None = None) -> ParallelConfig:
    """`cfg` with its process-group fields filled from the environment where None, validated:
    all three set (checked like a config: ConfigError naming the field and its range), or none.
    """
    environ = os.environ if environ is None else environ
    values, origin = {}, {}
    for name, var in ENV.items():
        value, where = getattr(cfg, name), "config"
        if value is None and environ.get(var, "").strip():
            raw, where = environ[var].strip(), "environment"
            if name == "coordinator_address":
                value = raw
            else:
                try:
                    value = int(raw)
                except ValueError:
                    raise ConfigError(
                        f"environment variable {var} (parallel.{name}) must be an integer, got "
                        f"{raw!r}"
                    ) from None
        values[name], origin[name] = value, where
    given = [n for n, v in values.items() if v is not None]
    if given and len(given) < len(ENV):
        missing = [n for n in ENV if values[n] is None]
        have = ", ".join(f"{n}={values[n]!r} ({origin[n]})" for n in given)
        need = ", ".join(f"--parallel.{n} or ${ENV[n]}" for n in missing)
        raise ConfigError(
            "parallel.coordinator_address, parallel.num_processes and parallel.process_id go "
            f"together (all three, or none for one process): got {have}; missing {need}"
        )
    try:
        out = replace(cfg, **values)  # the mesh fields (microbatches too) kept
    except ConfigError as e:
        env = [ENV[n] for n in given if origin[n] == "environment"]
        raise ConfigError(f"{e}" + (f" (read from {', '.join(env)})" if env else "")) from None
    return out


def _cpu_may_run() -> bool:
    platforms = jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS", "")
    return not platforms or "cpu" in platforms.lower().split(",")


def initialize(cfg: ParallelConfig, environ: Mapping[str, str] | None = None) -> ProcessGroup:
    """Start this process's part of the process group described by `cfg` (see the module
    docstring), once: later calls return the first group, or raise ConfigError if they ask for
    another. Must run before anything touches a device (jax refuses otherwise)."""
    global _group
    environ = os.environ if environ is None else environ
    asked, cfg = cfg, resolve(cfg, environ)
    n, i, address = cfg.num_processes, cfg.process_id, cfg.coordinator_address
    launcher = _cluster_launch(environ) if n is None else None
    if _group is not None:
        if n is not None and (n, i) != (_group.num_processes, _group.process_id):
            raise ConfigError(
                f"this process already joined a group as process {_group.process_id} of "
                f"{_group.num_processes}; it cannot become process {i} of {n}"
            )
        return _group
    if jax.distributed.is_initialized():  # started by the caller: describe it, change nothing
        _group = ProcessGroup(jax.process_count(), jax.process_index(), None, "caller")
        return _group
    if (n is None and launcher is None) or n == 1:  # one process: start nothing
        return ProcessGroup(1, 0, None, "single process")
    collectives = None
    if _cpu_may_run():
        if jax.config.jax_cpu_collectives_implementation is None:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        collectives = jax.config.jax_cpu_collectives_implementation
    origins = {"environment" if getattr(asked, k) is None else "config" for k in ENV}
    # jax's own limits sit above ours, so that ours report first (jax's end in a fatal abort).
    limits = dict(
        initialization_timeout=INIT_TIMEOUT_S + 60, heartbeat_timeout_seconds=PEER_TIMEOUT_S + 60
    )
    watchdog = threading.Timer(INIT_TIMEOUT_S, _not_formed, (address, n, i))
    watchdog.daemon = True
    watchdog.start()
    try:
        if launcher is not None:
            jax.distributed.initialize(**limits)
        else:
            jax.distributed.initialize(address, n, i, **limits)
    except RuntimeError as e:
        if "must be called before" in str(e):
            raise ConfigError(
                "jax.distributed.initialize must run before any JAX computation; start the run "
                "with train() / train.py before touching devices"
            ) from None
        raise
    finally:
        watchdog.cancel()
    if launcher is not None:
        source = launcher
    else:
        source = "config + environment" if len(origins) == 2 else origins.pop()
    if jax.default_backend() != "cpu":
        collectives = None  # the CPU setting plays no part in a GPU/TPU run: not mentioned
    _group = ProcessGroup(
        jax.process_count(),
        jax.process_index(),
        address or global_state.coordinator_address,
        source,
        collectives,
    )
    global _watcher
    _watcher = threading.Thread(target=_watch, args=(_group,), daemon=True, name="jaxllm-watch")
    _watcher.start()
    atexit.register(_leave_watch)  # runs before jax's exit handler (registered earlier)
    return _group


def _abort(process_id: int | None, message: str, code: int) -> NoReturn:
    """One error line, then end this process at once (the group is broken; see the module
    docstring)."""
    sys.stdout.flush()
    who = "" if process_id is None else f"process {process_id}: "
    tqdm.write(f"error: {who}{message}", file=sys.stderr)  # a line of its own under a bar
    sys.stderr.flush()
    os._exit(code)


def _not_formed(address: str | None, n: int | None, i: int | None) -> None:
    """The group did not form within INIT_TIMEOUT_S: say where it waited and what to check."""
    if address is None:
        why = "the coordinator the launcher named was never reached"
    else:
        try:
            host, port = address.rsplit(":", 1)
            socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
            why = f"the coordinator at {address} answers but not all {n} processes joined"
        except (OSError, ValueError):
            why = f"nothing accepts connections at {address}"
    _abort(
        i,
        f"the process group did not form within {INIT_TIMEOUT_S} s: {why}; check that process "
        "0 runs with the same --parallel.coordinator_address, that this host can reach that "
        "host and port (address, firewall), and that every process has the same "
        "num_processes and its own process_id",
        2,
    )


def _watch(group: ProcessGroup) -> None:
    """Each process's sign of life: a counter in the coordinator's key-value store, written
    every BEAT_S; every process checks every counter (see the module docstring)."""
    client, me, beat = global_state.client, group.process_id, 0
    seen: dict[int, tuple[str, float]] = {}  # process -> (its counter, when it last changed)
    while not _stop_watch.wait(BEAT_S):
        beat += 1
        try:
            client.key_value_set(f"jaxllm/alive/{me}", str(beat), allow_overwrite=True)
            alive = dict(client.key_value_dir_get("jaxllm/alive/"))
        except Exception as e:  # the store is gone with the coordinator's process
            if _stop_watch.is_set():
                return
            reason = (str(e).strip() or type(e).__name__).splitlines()[0]
            _abort(
                me,
                f"lost the coordinator (process 0) at {group.coordinator_address}: it crashed, "
                f"was killed or its host is unreachable; see its log ({reason})",
                1,
            )
        now = time.monotonic()
        for p in range(group.num_processes):
            value, (last, since) = alive.get(f"jaxllm/alive/{p}", ""), seen.get(p, (None, now))
            if value != last:
                seen[p] = (value, now)
            elif now - since > PEER_TIMEOUT_S and not _stop_watch.is_set():
                _abort(
                    me,
                    f"process {p} is gone: no sign of life for {PEER_TIMEOUT_S} s (it crashed, "
                    "was killed or its host is unreachable; see its log)",
                    1,
                )


def _leave_watch() -> None:
    _stop_watch.set()
    if _watcher is not None:
        _watcher.join()


def peer_lost(error: BaseException) -> str | None:
    """One line for an error of a collective whose peer process went away, else None."""
    text = str(error).strip()
    if not PEER_LOST.search(text):
        return None
    return f"a peer process is gone ({text.splitlines()[0]}); see the other processes' logs"


def finish(code: int) -> int:
    """End this process: alone, return `code`. In a group this process ends here: after
    success (`code` 0) every process leaves the group together, the coordinator last (the
    others' jax runtimes poll its service until they end); after an error at once, since the
    others cannot finish without it (they report it gone)."""
    if not jax.distributed.is_initialized():
        return code
    sys.stdout.flush()
    sys.stderr.flush()
    if code == 0:
        sync("jaxllm-exit")  # everyone is done (checkpoints written)
        _leave_watch()
        service, global_state.service = global_state.service, None  # the coordinator's: kept up
        jax.distributed.shutdown()  # a barrier: every process leaves together
        if service is not None:
            time.sleep(EXIT_GRACE_S)  # the others end at once: let them go first
    os._exit(code)


def is_primary() -> bool:
    """Process 0: the one that writes logs, metrics, config, plots and prints."""
    return jax.process_index() == 0


def sync(name: str) -> None:
    """Wait until every process reaches this point (no-op on one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


# ----------------------------------------------------------------------------- batches


def process_rows(mesh: Mesh, n_rows: int) -> slice:
    """The rows [start, stop) of a global batch of `n_rows` that this process's devices hold
    when the batch is split over data x fsdp (all of them on one process). The slices cover the
    batch and overlap only where processes hold other pipeline stages of the same rows (the
    batch is replicated over `pipeline`), so no example is used twice per step."""
    index = NamedSharding(mesh, parallel.BATCH).addressable_devices_indices_map((n_rows,))
    # a process's devices of several stages hold the same rows once per stage: count them once
    spans = sorted({s[0].indices(n_rows)[:2] for s in index.values()})
    start, stop = spans[0][0], spans[-1][1]
    if sum(b - a for a, b in spans) != stop - start or len({a for a, _ in spans}) != len(spans):
        raise ValueError(
            f"the devices of process {jax.process_index()} hold rows {spans} of the batch: not "
            "one contiguous block (order the mesh's devices by process)"
        )
    return slice(start, stop)


def global_batch(local: dict[str, np.ndarray], mesh: Mesh, n_rows: int) -> dict[str, jax.Array]:
    """One global batch of `n_rows` rows from each process's rows (`process_rows`), split over
    data x fsdp. Every process calls it with its own rows, in the same step."""
    sharding = NamedSharding(mesh, parallel.BATCH)
    return {
        k: jax.make_array_from_process_local_data(sharding, v, (n_rows, *np.shape(v)[1:]))
        for k, v in local.items()
    }


def put_batch(batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """A whole host batch (the same on every process, e.g. an evaluation batch) on the mesh:
    each process puts only its rows; a batch whose rows do not split evenly is replicated."""
    n = len(next(iter(batch.values())))
    ways = mesh.shape["data"] * mesh.shape["fsdp"]
    if n % ways == 0:
        rows = process_rows(mesh, n)
        return global_batch({k: np.asarray(v)[rows] for k, v in batch.items()}, mesh, n)
    whole = NamedSharding(mesh, P())
    return {
        k: jax.make_array_from_process_local_data(whole, np.asarray(v), np.shape(v))
        for k, v in batch.items()
    }
