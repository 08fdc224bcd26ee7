"""Write a directory so that readers see the old one or the complete new one, never half of it; read a
parquet file that a writer may be replacing by rename."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["read_replaced_parquet", "staged_directory"]


@contextmanager
def staged_directory(target: str | os.PathLike, *, mode: int | None = None) -> Iterator[Path]:
    """Yield a hidden sibling directory to fill; when the block succeeds it takes ``target``'s place
    by rename (an existing ``target`` is moved aside first, then deleted). On error nothing changes.

    ``mode``: permissions for the new directory (mkdtemp makes it private to the user).
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.writing-", dir=target.parent))
    if mode is not None:
        tmp.chmod(mode)
    try:
        yield tmp
        if target.exists():
            trash = target.with_name(f".{target.name}.old-{os.getpid()}")
            os.replace(target, trash)
            os.replace(tmp, target)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def read_replaced_parquet(path: str | os.PathLike):
    """The pyarrow table in ``path``, read in one pass over one open file.

    ``pq.read_table(path)`` opens the path more than once (footer, then pages); a writer's rename
    between those opens pairs one file's footer with another's pages and the read fails. Raises
    FileNotFoundError when there is no file.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    return pq.read_table(pa.BufferReader(Path(path).read_bytes()))
