"""Write a user's file so it is never seen half-written: temp name in the same dir, then rename."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Replace `path` with `text` (UTF-8) in one rename; a crash leaves the old file or none."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Replace `path` with `data` in one rename; a crash leaves the old file or none."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write_synced(tmp, data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_synced(path: Path, data: bytes) -> None:
    """Write `data` to `path` and fsync it: on disk before a rename puts it in place, so that a
    power cut leaves the old file or the new one."""
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def save_figure_atomic(fig: Any, path: str | os.PathLike, **savefig_kwargs: Any) -> Path:
    """Save a matplotlib figure to `path` in one rename, in the format of its suffix (the temp
    name keeps the suffix: matplotlib picks the format from it); the parent directory must
    exist (a FileNotFoundError names it)."""
    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"cannot write {path}: directory {path.parent} does not exist")
    if path.is_dir():
        raise IsADirectoryError(f"cannot write {path}: it is a directory (give a file name)")
    if not path.suffix:  # matplotlib would take the temp name's ".tmp" as the format
        raise ValueError(f"cannot write {path}: give a file extension for the format, e.g. .png")
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    try:
        fig.savefig(tmp, **savefig_kwargs)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
