"""Run logs: JSON lines (metrics.jsonl) and TensorBoard event files, side by side."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter

from jaxllm.atomic_file import write_text_atomic


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


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop records past `last_step` (written after the checkpoint a run resumes from), so a
    resumed run's log reads like an uninterrupted one. Temp file + rename: never half-written."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line cut by the kill
            continue
        if rec.get("step", 0) <= last_step:
            keep.append(line)
    write_text_atomic(path, "".join(f"{line}\n" for line in keep))
