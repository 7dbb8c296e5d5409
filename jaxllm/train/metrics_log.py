"""Run logs: JSON lines (metrics.jsonl) and TensorBoard event files, side by side."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter
from tensorboard.summary.writer.record_writer import RecordWriter

from jaxllm.atomic_file import write_bytes_atomic, write_text_atomic


class MetricsLog:
    """Appends one JSON object per line to run_dir/metrics.jsonl (flushed each write) and
    writes the numeric fields of step records as TensorBoard scalars under `prefix/name`.

    `enabled=False` (every process but 0 of a multi-process run): opens nothing, writes
    nothing, so a run dir has one writer."""

    def __init__(self, run_dir: Path, enabled: bool = True):
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("a")
        self._tb = EventFileWriter(str(run_dir / "tensorboard"))

    def write(self, record: dict, prefix: str | None = None) -> None:
        if not self.enabled:
            return
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()
        if prefix is not None and "step" in record:
            values = [
                summary_pb2.Summary.Value(tag=f"{prefix}/{k}", simple_value=float(v))
                for k, v in record.items()
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
            ]
            summary = summary_pb2.Summary(value=values)
            self._tb.add_event(
                event_pb2.Event(wall_time=time.time(), step=record["step"], summary=summary)
            )

    def close(self) -> None:
        if not self.enabled:
            return
        self._f.close()
        self._tb.close()


def truncate_logs(run_dir: Path, last_step: int) -> None:
    """Drop what an earlier attempt logged past `last_step`, the step this run starts from (its
    checkpoint's, or 0 for a fresh start: then nothing of an attempt that never saved a
    checkpoint is kept), from metrics.jsonl and the TensorBoard events, so that a restarted
    run's logs read like an uninterrupted one's. Each file is rewritten by temp name + rename."""
    truncate_metrics(run_dir / "metrics.jsonl", last_step)
    truncate_events(run_dir / "tensorboard", last_step)


def _kept(step: int, last_step: int) -> bool:
    return last_step > 0 and step <= last_step


def truncate_metrics(path: Path, last_step: int) -> None:
    """metrics.jsonl without the records past `last_step` (see truncate_logs)."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line cut by the kill
            continue
        if _kept(rec.get("step", 0), last_step):
            keep.append(line)
    write_text_atomic(path, "".join(f"{line}\n" for line in keep))


def truncate_events(tb_dir: Path, last_step: int) -> None:
    """The TensorBoard event files in `tb_dir` without the scalars past `last_step`: each file
    is read (a record cut by a kill ends it) and rewritten when it loses any."""
    if not tb_dir.is_dir():
        return
    for path in sorted(tb_dir.glob("*tfevents*")):
        events = list(LegacyEventFileLoader(str(path)).Load())  # as written: no migration
        keep = [e for e in events if not e.HasField("summary") or _kept(e.step, last_step)]
        if len(keep) == len(events):
            continue
        out = io.BytesIO()
        writer = RecordWriter(out)
        for event in keep:
            writer.write(event.SerializeToString())
        write_bytes_atomic(path, out.getvalue())
