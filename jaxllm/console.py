"""How the command-line tools print: a Python warning as one `warning: ...` line.

Python's default format adds the file, line number and source line of the `warnings.warn`
call, which tells a user nothing (e.g. "checkpoint N could not be restored; restored M").
"""

from __future__ import annotations

import contextlib
import sys
import warnings

from tqdm import tqdm


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    f = sys.stderr if file is None else file
    if f is None:  # as Python's own: no stderr (pythonw), nowhere to write
        return
    tag = "" if issubclass(category, UserWarning) else f" ({category.__name__})"
    # OSError: as Python's own, e.g. stderr piped into a `head` that has exited;
    # tqdm.write: a warning raised under a progress bar gets a line of its own
    with contextlib.suppress(OSError):
        tqdm.write(f"warning{tag}: {' '.join(str(message).split())}", file=f)


def use_one_line_warnings() -> None:
    """Print every warning of this process as one `warning: <message>` line (CLIs only: a
    library leaves the format to its caller)."""
    warnings.showwarning = _show_warning
