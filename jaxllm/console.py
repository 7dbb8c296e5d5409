"""How the command-line tools print: a Python warning as one `warning: ...` line.

Python's default format adds the file, line number and source line of the `warnings.warn`
call, which tells a user nothing (e.g. "checkpoint N could not be restored; restored M").
"""

from __future__ import annotations

import sys
import warnings

from tqdm import tqdm


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    # tqdm.write: a warning raised under a progress bar gets a line of its own
    tqdm.write(f"warning: {message}", file=file or sys.stderr)


def use_one_line_warnings() -> None:
    """Print every warning of this process as one `warning: <message>` line (CLIs only: a
    library leaves the format to its caller)."""
    warnings.showwarning = _show_warning
