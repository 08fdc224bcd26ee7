"""What the command prints: readable tables on a terminal (no dependency beyond pandas), and the
one line that stands for an operating-system error."""

from __future__ import annotations

import errno
import re
import shutil

__all__ = ["print_table", "format_table", "os_error_line"]

# errno -> what the user can do about it
_OS_FIXES = {
    errno.ENOSPC: "free some space or write to another --out",
    errno.EDQUOT: "free some of your quota or write to another --out",
    errno.EFBIG: "the file size limit (ulimit -f) was reached; raise it or write to another --out",
    errno.EACCES: "check the permissions, or write to another --out",
    errno.EROFS: "the file system is read-only; write to another --out",
}


def format_table(frame, *, floats: dict[str, str] | None = None, max_width: int | None = None) -> str:
    """A DataFrame as aligned text; integers as they are typed back (no thousands separators: a neuron id
    ``1184`` must paste into the next command), long cells cut with '…'."""
    floats = floats or {}
    width = max_width or max(60, shutil.get_terminal_size((120, 20)).columns)
    columns = list(frame.columns)
    cells = [[str(c) for c in columns]]
    for row in frame.itertuples(index=False):
        line = []
        for name, value in zip(columns, row):
            if name in floats and value == value:
                text = floats[name].format(value)
            elif isinstance(value, bool):
                text = str(value)
            elif isinstance(value, int) or (hasattr(value, "dtype") and "int" in str(getattr(value, "dtype", ""))):
                text = str(int(value))
            elif isinstance(value, float):
                text = f"{value:.4g}"
            elif name == "id":  # a neuron id, LAYER:NEURON, printed to be typed back
                text = str(value)
            else:
                text = repr(value) if isinstance(value, str) else str(value)
            line.append(text if len(text) <= 48 else text[:47] + "…")
        cells.append(line)
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(line[:width] for line in lines)


def print_table(frame, **kwargs) -> None:
    print(format_table(frame, **kwargs))


def os_error_line(error: OSError, *, out: str | None = None) -> str:
    """One line for an ``OSError`` (a full disk, a file size limit, a permission): what failed, where,
    and the fix. ``out``: the command's output path, named when the error carries no file name
    (pyarrow's write errors do not)."""
    reason = error.strerror or str(error).splitlines()[0] or type(error).__name__
    where = f" ({error.filename})" if error.filename else f" while writing {out}" if out else ""
    number = error.errno
    if number is None:  # pyarrow puts the errno in its message only: "... [errno 28] No space left ..."
        found = re.search(r"\[errno (\d+)\]", str(error), flags=re.IGNORECASE)
        number = int(found.group(1)) if found else None
    fix = _OS_FIXES.get(number, "check the path and try again")
    return f"{reason}{where}; {fix}"
