"""Write a user's file so it is never seen half-written: temp name in the same dir, then rename."""

from __future__ import annotations

import os
from pathlib import Path


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Replace `path` with `text` (UTF-8) in one rename; a crash leaves the old file or none."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Replace `path` with `data` in one rename; a crash leaves the old file or none."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
