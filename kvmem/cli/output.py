"""Readable tables on a terminal (no dependency beyond pandas)."""

from __future__ import annotations

import shutil

__all__ = ["print_table", "format_table"]


def format_table(frame, *, floats: dict[str, str] | None = None, max_width: int | None = None) -> str:
    """A DataFrame as aligned text; integers get thousands separators, long cells are cut with '…'."""
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
                text = f"{int(value):,}"
            elif isinstance(value, float):
                text = f"{value:.4g}"
            else:
                text = repr(value) if isinstance(value, str) else str(value)
            line.append(text if len(text) <= 48 else text[:47] + "…")
        cells.append(line)
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(line[:width] for line in lines)


def print_table(frame, **kwargs) -> None:
    print(format_table(frame, **kwargs))
